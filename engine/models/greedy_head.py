"""The LM head of an fp32 model for rows decoded greedily: a bf16 screen, then exact fp32 logits
for the few tokens it cannot rule out.

A greedy step wants one thing from the head: the argmax of its fp32 logits. At batch 1 the head
is a fifth of what a decode step streams on SmolLM2 (113 of 538 MB in fp32: 49,152 x 576), so
it multiplies the rows by a bf16 copy of the head first (half the bytes, the native GEMV over bf16
blocks), bounds each approximate logit's error, keeps every token whose upper bound reaches the
best lower bound, and computes those tokens' logits from the fp32 rows (a handful of dot
products). The argmax over them is the argmax of the fp32 logits: a token left out lies below
another token by more than both errors together.

The error bound, for a row x and a head row w (length D): the screen's product of x_i and w_i
carries up to two bf16 roundings (the weight always; x where ``vdpbf16ps`` runs), each at most
2^-8 of the value, and its sum and any fp32 sum of the same products each err by at most about D
2^-24 of sum |x_i w_i|:

    |fp32 logit - screened logit| <= (2^-7 + 2^-16 + 2 (D + 2) 2^-24) sum |x_i w_i|
                                  <= that x ||x||_2 ||w||_2

(Cauchy-Schwarz), with every head row's norm computed once at load. On SmolLM2 over 1,024 real
decode rows the bound was 7.4x the largest error seen, and kept 2 tokens at the median, 6 at the
90th percentile and 35 at most (``tests/test_greedy_head.py`` pins the bound, and the argmax against
float64).

The logits this returns are -inf for every token the screen ruled out: only a greedy argmax may
read them, so the model runner asks for them only when every logits row of a step belongs to a
greedy request that wants no logprobs (``ForwardBatch.greedy_only``). ``KVBATCH_GREEDY_HEAD=0``
turns the screen off (the full fp32 head for every row; read by the model, beside its other switches).

Memory: the head's bf16 copy (half its fp32 bytes), and for an untied head a plain fp32 copy of its
rows besides the layout the projections' kernel keeps (packed layouts cannot be read by row; a tied
head's rows are the embedding table, already held)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.kernels import cpu_native
from kvbatch.kernels.huge_pages import HugePageArena

# Rows the screen takes: decode steps and small batches, where the head is bound by streaming its
# weights; past them the head's GEMM is compute-bound, and it gains nothing from fewer bytes.
SCREEN_MAX_ROWS = cpu_native.GEMV_MAX_ROWS


@dataclass(frozen=True)
class GreedyHead:
    """An fp32 head ``[vocab, dim]`` as the screen reads it."""

    rows: torch.Tensor  # [V, D] fp32: the head itself (a tied model's embedding table, not a copy)
    screen: cpu_native.Int8Blocks  # each head row rounded to int8 with its own scale, in the native GEMV's blocks
    error: torch.Tensor  # [V] fp32: the bound's factor on ||x||_2 (module docstring), per token

    @property
    def screen_bytes(self) -> int:
        """What one pass of the screen streams (the int8 blocks and their scales)."""
        return self.screen.q.numel() + self.screen.scale.numel() * self.screen.scale.element_size()


def make_greedy_head(head: torch.Tensor, arena: HugePageArena | None = None) -> GreedyHead | None:
    """The screen for ``head`` [vocab, dim] fp32 on the CPU, or None where it cannot run (the native
    kernels unavailable, another dtype or device, or a weight that is not finite: no bound holds).
    ``arena``: the huge pages the screen's blocks go to (streamed every greedy step, as the
    projections are: kernels/huge_pages.py)."""
    if head.dtype != torch.float32 or head.device.type != "cpu" or head.dim() != 2 or not cpu_native.available():
        return None
    if not bool(torch.isfinite(head).all()):
        return None
    head = head.contiguous()
    w = head.double()
    scale = (w.abs().amax(dim=1) / 127).float().double()  # the fp32 scale the kernel applies, exactly
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float64).tiny)[:, None], 0.0)
    q = q.round().clamp_(-127, 127)
    rounded = q * scale[:, None]  # w' exactly (an int8 times an fp32 scale fits float64)
    dim = head.shape[1]
    error = (w - rounded).norm(dim=1) + (dim + 2) * 2.0 ** -24 * (w.norm(dim=1) + rounded.norm(dim=1))
    screen = cpu_native.int8_blocks(q.to(torch.int8), scale.float())
    if arena is not None:
        screen = screen._replace(q=arena.place(screen.q))
    return GreedyHead(head, screen, (error * 1.01).float())


def _rows(head: GreedyHead, x: torch.Tensor) -> torch.Tensor:
    """``x`` as the screen takes it (contiguous fp32 [rows, dim]), or a ValueError naming what it got."""
    if x.dim() != 2 or x.shape[1] != head.rows.shape[1] or x.dtype != torch.float32:
        raise ValueError(f"the greedy head takes fp32 rows of {head.rows.shape[1]}, got {x.dtype} {tuple(x.shape)}")
    return x.contiguous()


def screen(head: GreedyHead, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(approx, bound)``, both [rows, vocab]: the int8 screen's logits for fp32 ``x`` [rows, dim]
    and, per token, how far any fp32 computation of its logit can lie from them: what
    :func:`screened_logits`' native call computes inside (its norm in double), in torch for the
    tests that hold the bound against float64."""
    x = _rows(head, x)
    approx = cpu_native.gemv(x, head.screen)
    return approx, torch.mul(head.error, x.norm(dim=1, keepdim=True))


def screened_logits(head: GreedyHead, x: torch.Tensor) -> torch.Tensor:
    """Logits ``[rows, vocab]`` for fp32 ``x`` [rows, dim] whose argmax is that of ``x @ head.T``:
    exact fp32 logits for every token the int8 screen could not rule out, -inf for the rest."""
    x = _rows(head, x)
    # one native call: as torch ops after the GEMV, the bound and the selection took 0.43 ms a step
    return cpu_native.greedy_head(x, head.screen, head.error, head.rows)
