"""The constrained rows' token masks: filled on the host by llguidance, applied with tensor ops.

A step's bitmask is ``[N, W]`` int32 (bit ``j`` of word ``w`` allows token ``32 w + j``), one row
per logits row, ``W = ceil(tokenizer vocabulary / 32)``. Only the constrained rows are filled
(llguidance computes them, in parallel over the batch with ``fill_next_token_bitmask_par``);
every other row is all ones. :func:`apply_token_bitmask` unpacks the bits with a shift and an
``and`` and keeps only the allowed logits with one ``where`` over ``[N, V]`` (the rest ``-inf``): no
per-row Python, the same ops on the CPU and on CUDA (the bitmask crosses in one non-blocking
copy). The mask is exactly as wide as the logits: when the model's vocabulary is wider than the
tokenizer's (padded embeddings), the extra ids are never allowed; when it is narrower, the bits
past it are dropped.

A constrained row whose mask (cut to the logits' width) allows nothing is reported, not
sampled: :func:`fill_token_bitmask` says which, the engine ends those rows with an error and
opens their masks so the batch's arithmetic never sees a row of all ``-inf`` (no NaN).

Under speculative decoding a constrained row verifies drafts: :func:`fill_draft_bitmask` fills one
mask per verify position (the grammar's state after the drafts before it) in the same call, so
the verifier reads the same masked distribution plain sampling would at each position.
"""

from __future__ import annotations

import os

import llguidance
import torch

_executor: llguidance.LLExecutor | None = None
PAR_MIN_ROWS = 4  # fewer constrained rows than this are filled in the calling thread


def _par_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
    return _executor


def fill_token_bitmask(matchers: list[llguidance.LLMatcher | None], tokenizer_vocab: int,
                       logits_width: int) -> tuple[torch.Tensor, list[int]]:
    """The host bitmask ``[N, ceil(tokenizer_vocab / 32)]`` of one step (row ``i`` for
    ``matchers[i]``; None: unconstrained, all ones) and the rows whose mask allows no token below
    ``logits_width`` (those rows are reopened to all ones: the caller must not emit their token)."""
    return fill_draft_bitmask([(m, i, []) for i, m in enumerate(matchers) if m is not None], len(matchers),
                              tokenizer_vocab, logits_width)


def fill_draft_bitmask(rows: list[tuple[llguidance.LLMatcher, int, list[int]]], num_rows: int, tokenizer_vocab: int,
                       logits_width: int) -> tuple[torch.Tensor, list[int]]:
    """:func:`fill_token_bitmask` for a step that verifies drafts: ``rows`` holds (matcher, its first
    logits row ``r``, the drafts verified after it); row ``r + j`` gets the mask of the grammar's
    state after ``drafts[:j]``, every other row of ``num_rows`` is all ones. Returns the bitmask and
    the rows that allow nothing below ``logits_width`` (reopened, as there).

    The draft masks come from llguidance's executor in one parallel call: for each matcher it
    consumes the drafts one by one, writing the mask before each and after the last, and rolls
    them all back, so every matcher ends where it started. It stops at a draft the grammar refuses
    or that ends it (EOS): the rows after that one stay all ones, and the engine never emits a
    token from them (such a draft is rejected for sure, or the request ends at it). Drafts are cut
    before any id outside the tokenizer's vocabulary, on which llguidance errors for good."""
    words = (tokenizer_vocab + 31) // 32
    bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
    plain: list[tuple[llguidance.LLMatcher, int]] = []
    drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
    filled: list[int] = []
    for m, r, drafts in rows:
        inside = next((j for j, t in enumerate(drafts) if not 0 <= t < tokenizer_vocab), len(drafts))
        if inside:
            drafted.append((m, r, list(drafts[:inside])))
        else:
            plain.append((m, r))
        filled.extend(range(r, r + len(drafts) + 1))
    # llguidance writes each row's words in place (what llguidance.torch's fill functions do;
    # that module is not imported: it compiles a kernel with torch.compile at import).
    if len(plain) >= PAR_MIN_ROWS:
        _par_executor().unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, num_rows)
    else:
        for m, r in plain:
            m.unsafe_compute_mask_ptr(bitmask[r].data_ptr(), words * 4)
    if drafted:
        _par_executor().unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, num_rows)
    idx = torch.tensor(filled, dtype=torch.long)
    dead = _allows_nothing(bitmask.index_select(0, idx), logits_width)
    empty = [int(i) for i in idx[dead]]
    if empty:
        bitmask[empty] = -1
    return bitmask, empty


def _allows_nothing(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Per row: no bit set below ``width`` (whole words, then the partial last word)."""
    full, rest = divmod(min(width, bitmask.shape[1] * 32), 32)
    any_bit = (bitmask[:, :full] != 0).any(1)
    if rest:
        any_bit |= (bitmask[:, full] & ((1 << rest) - 1)) != 0
    return ~any_bit


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with every token the host ``bitmask`` [N, W] does not allow set to
    ``-inf`` (a new tensor; ids ``>= 32 W`` are never allowed). Tensor ops only: the words are
    read as bytes (little-endian: byte ``k`` of word ``w`` holds tokens ``32 w + 8 k ..``), each
    byte shifted into its 8 bits, and one ``where`` over ``[N, V]`` keeps the allowed logits."""
    n, v = logits.shape
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    bm = bitmask if device.type != "cuda" else bitmask.pin_memory().to(device, non_blocking=True)
    words = min(bm.shape[1], (v + 31) // 32)
    bits = ((bm[:, :words].contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(n, words * 32)
    if words * 32 >= v:
        bits = bits[:, :v]
    else:  # the model's vocabulary is wider than the tokenizer's: the extra ids stay masked
        bits = torch.nn.functional.pad(bits, (0, v - words * 32), value=0)
    return torch.where(bits.bool(), logits, float("-inf"))
