"""The LM head of an fp32 model for rows decoded greedily: an int8 screen, then exact fp32 logits
for the few tokens it cannot rule out.

A greedy step wants one thing from the head: the argmax of its fp32 logits. At batch 1 the head
is a fifth of what a decode step streams on SmolLM2 (113 of 538 MB in fp32: 49,152 x 576), so
it multiplies the rows by an int8 copy of the head first (each row rounded with a scale of its
own: a quarter of the bytes, the native GEMV over int8 blocks), bounds each approximate logit's
error, keeps every token whose upper bound reaches the best lower bound, and computes those
tokens' logits from the fp32 rows (a handful of dot products). The argmax over them is the argmax
of the fp32 logits: a token left out lies below another token by more than both errors together.

The error bound, for a row x and a head row w (length D) with int8 rounding w' (its error's norm
known per row at load): x.w - x.w' = x.(w - w'), and the screen's fp32 sums and any fp32 sum of
the logit each err by at most about (D + 2) 2^-24 of sum |x_i w_i|:

    |fp32 logit - screened logit| <= ||x||_2 (||w - w'||_2 + (D + 2) 2^-24 (||w||_2 + ||w'||_2))

(Cauchy-Schwarz), 1% added. On SmolLM2 over 1,024 real decode rows it kept 2 tokens at the median,
9 at the 90th percentile and 93 at most (``tests/test_greedy_head.py`` pins the bound, and the
argmax against float64).

The logits this returns are -inf for every token the screen ruled out: only a greedy argmax of the
raw logits may read them, so the model runner asks for them only when every logits row of a step
belongs to a greedy request that wants no logprobs, no grammar and no logit bias or penalty
(``SamplingParams.argmax_only``, ``ForwardBatch.greedy_only``): a bias cannot lift a token the
screen dropped, and a penalty can sink the one it kept (``tests/test_penalties.py``). ``KVBATCH_GREEDY_HEAD=0``
turns the screen off (the full fp32 head for every row; read by the model, beside its other switches).

**Batched rows** (more than :data:`SCREEN_MAX_ROWS`, a batched decode step). There the head's GEMM
is bound by arithmetic, not bytes (64 rows of SmolLM2: 3.6 GFLOP, 11-14 ms of a ~100 ms step on
the Xeon 167), so the screen multiplies in integers: the rows' activations are rounded to int8 as
well (one scale for the step's rows: they are RMS-normed alike, and oneDNN takes one per tensor)
and oneDNN's int8 linear multiplies them by the int8 head, prepacked at load (VNNI/AMX code: 2.8
ms at 64 rows against 4.2 for ``torch._int_mm``, which packs the head on every call). Rounding the
activations costs the bound most where a few channels are far larger than the rest (LLM hidden
states have such channels: with them rounded, the screen kept 80 tokens at the median and 48,226
at most on SmolLM2), so the :data:`OUTLIER_COLUMNS` columns with the step's largest magnitudes stay
fp32 and are multiplied by the int8 head's values in an fp32 GEMM of that width (kept then: 16 at
the median, 112 at the 90th percentile, 2,864 at most, 43 on average, over 1,536 rows). For row x,
its outlier part x_o, the int8 rounding x' of the rest x_r and head row w with int8 rounding w':

    |fp32 logit - screened logit| <= ||x|| ||w - w'|| + (||x_r - x'|| + (k + 2) 2^-24 ||x_o||) ||w'||
                                     + (D + 2) 2^-24 ||x|| (||w|| + ||w'||)

(the identity x.w - (x_o + x').w' = x.(w - w') + (x_r - x').w', Cauchy-Schwarz on each term, the
outlier GEMM's and the fp32 logit's own sums), 1% added, and 2^-21 of the screened logit for
oneDNN's fp32 scaling. Whether this beats the fp32 head is measured at load
(:func:`batched_screen_wins`, 64 rows): where it does not (held to AVX2 on the Xeon 167 it lost),
or torch lacks the ops, batched rows get the full head.

Memory: the head's int8 copy in the GEMV's blocks (a quarter of its fp32 bytes), for batched rows
two more (oneDNN's packed int8, and a column-major int8 copy for the outlier columns), and for an
untied head a plain fp32 copy of its rows besides the layout the projections' kernel keeps (packed
layouts cannot be read by row; a tied head's rows are the embedding table, already held)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.huge_pages import HugePageArena

# Rows the native GEMV screen takes: decode steps and small batches, where the head is bound by
# streaming its weights; past them the head's GEMM is compute-bound, fewer bytes gain nothing, and
# the batched screen (integer products) serves them where it won its measurement.
SCREEN_MAX_ROWS = native_kernels.GEMV_MAX_ROWS
# fp32 columns of a batched step's activations (those with its largest magnitudes): with one int8
# scale for the step, 16 and 24 kept 16 and 9 tokens at the median, 111 and 54 at the 90th
# percentile (SmolLM2, 1,536 rows in steps of 64); each costs an fp32
# multiply-add per row and token.
OUTLIER_COLUMNS = 16
# The batch the load-time measurement times the batched screen against the fp32 head at.
MEASURE_ROWS = 64


@dataclass(frozen=True)
class BatchedScreen:
    """The head as the batched rows' integer screen reads it."""

    packed: torch.Tensor  # the int8 head in oneDNN's packed layout (qlinear_prepack): opaque, kept by oneDNN
    q_cols: torch.Tensor  # [D, V] int8: the outlier columns' rows
    scale: torch.Tensor  # [V] fp32: each head row's int8 scale
    zero_points: torch.Tensor  # [V] int64 zeros: the head's int8 is symmetric
    norm: torch.Tensor  # [V] fp32: ||w'||, each int8 row's norm (rounded up)
    timings_ms: tuple[float, float]  # at load, MEASURE_ROWS rows: (this screen, the fp32 head)


@dataclass(frozen=True)
class GreedyHead:
    """An fp32 head ``[vocab, dim]`` as the screen reads it."""

    rows: torch.Tensor  # [V, D] fp32: the head itself (a tied model's embedding table, not a copy)
    screen: native_kernels.Int8Blocks  # each head row rounded to int8 with its own scale, in the native GEMV's blocks
    error: torch.Tensor  # [V] fp32: the bound's factor on ||x||_2 (module docstring), per token
    batched: BatchedScreen | None = None  # rows past SCREEN_MAX_ROWS; None: they get the full head

    @property
    def screen_bytes(self) -> int:
        """What one pass of the screen streams (the int8 blocks and their scales)."""
        return self.screen.q.numel() + self.screen.scale.numel() * self.screen.scale.element_size()


def make_greedy_head(head: torch.Tensor, arena: HugePageArena | None = None) -> GreedyHead | None:
    """The screen for ``head`` [vocab, dim] fp32 on the CPU, or None where it cannot run (the native
    kernels unavailable, another dtype or device, or a weight that is not finite: no bound holds).
    ``arena``: the huge pages the screen's blocks go to (streamed every greedy step, as the
    projections are: kernels/cpu/huge_pages.py)."""
    if head.dtype != torch.float32 or head.device.type != "cpu" or head.dim() != 2 or not native_kernels.available():
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
    q8 = q.to(torch.int8)
    screen = native_kernels.int8_blocks(q8, scale.float())
    if arena is not None:
        screen = screen._replace(q=arena.place(screen.q))
    greedy = GreedyHead(head, screen, (error * 1.01).float())
    if not int8_linear_available():
        return greedy
    norm = (rounded.norm(dim=1) * (1 + 2.0 ** -20)).float()
    q_cols = q8.t().contiguous()
    batched = BatchedScreen(_prepack(q8, MEASURE_ROWS),
                            arena.place(q_cols) if arena is not None else q_cols, scale.float(),
                            torch.zeros(len(q8), dtype=torch.int64), norm, (0.0, 0.0))
    wins, timings = batched_screen_wins(GreedyHead(head, screen, greedy.error, batched))
    return GreedyHead(head, screen, greedy.error, replace(batched, timings_ms=timings) if wins else None)


def int8_linear_available() -> bool:
    """Whether oneDNN's int8 linear over a prepacked weight (``torch.ops.onednn.qlinear_prepack`` and
    ``qlinear_pointwise``, private ops of torch's x86 build) runs here and gives the scaled integer
    product to within fp32 rounding, at the extremes of the int8 range too.

    Where oneDNN runs AVX2 code without VNNI (an AVX2-only CPU such as AMD Zen 1-3, or any CPU under
    ``ONEDNN_MAX_CPU_ISA=AVX2``: ``bench_engine.py --isa avx2``), it multiplies the activations'
    uint8 bytes by the int8 weights in pairs summed into int16 (``vpmaddubsw``), which saturates:
    a row of 127s times a head row of 127s came out as 2,040 for 258,064 on an AVX2 EPYC. No bound
    holds over that, so such a CPU gets no batched screen (the fp32 head, as without the ops)."""
    try:
        small_w = torch.tensor([[127, -128, 3, 1], [5, -7, 0, 9]], dtype=torch.int8)
        small_x = torch.tensor([[127, -127, 3, 1]] * 3, dtype=torch.int8)
        # full-range rows and head rows: every pair of uint8 x int8 products past int16's range
        g = torch.Generator().manual_seed(0)
        big_w = torch.stack([torch.full((64,), 127), torch.full((64,), -127), torch.randint(-127, 128, (64,), generator=g)])
        big_x = torch.stack([torch.full((64,), 127), torch.full((64,), -127), torch.randint(-127, 128, (64,), generator=g)])
        for w, x in ((small_w, small_x), (big_w.to(torch.int8), big_x.to(torch.int8))):
            ws = torch.linspace(0.25, 0.5, len(w))
            packed = _prepack(w, len(x))
            got = _int8_linear(x, 0.125, packed, ws, torch.zeros(len(w), dtype=torch.int64))
            want = 0.125 * (x.double() @ w.double().t()) * ws.double()
            if not bool(((got.double() - want).abs() <= want.abs() * 2.0 ** -21).all()):
                return False
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def _prepack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """The int8 weight ``w`` [out, in] in oneDNN's packed layout for about ``rows`` rows of
    activations (what :func:`_int8_linear` multiplies by)."""
    return torch.ops.onednn.qlinear_prepack(w, [rows, w.shape[1]])


def _int8_linear(q: torch.Tensor, x_scale: float, packed: torch.Tensor, w_scale: torch.Tensor,
                 zero_points: torch.Tensor) -> torch.Tensor:
    """``x_scale * (q @ w.T) * w_scale`` in fp32 for int8 ``q`` [rows, in] and the int8 ``w`` that
    ``packed`` holds (oneDNN takes the activations as uint8 with zero point 128)."""
    u8 = (q.to(torch.int16) + 128).to(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(u8, x_scale, 128, packed, w_scale, zero_points, None, 1.0, 0,
                                              torch.float32, "none", [], "")


def batched_screen_wins(head: GreedyHead, rounds: int = 3) -> tuple[bool, tuple[float, float]]:
    """Whether ``head``'s batched screen beats its fp32 head (``x @ head.T``) at
    :data:`MEASURE_ROWS` rows on this machine, and the two times in ms (the best of ``rounds``,
    each after a first call)."""
    x = torch.randn(MEASURE_ROWS, head.rows.shape[1], generator=torch.Generator().manual_seed(0))

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    screened = best(lambda: _batched_logits(head, x))
    full = best(lambda: torch.mm(x, head.rows.t()))
    return screened < full, (screened, full)


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
    approx = native_kernels.gemv(x, head.screen)
    return approx, torch.mul(head.error, x.norm(dim=1, keepdim=True))


def takes(head: GreedyHead | None, rows: int) -> bool:
    """Whether :func:`screened_logits` serves ``rows`` rows: up to SCREEN_MAX_ROWS always, more
    where the batched screen won its measurement."""
    return head is not None and 0 < rows and (rows <= SCREEN_MAX_ROWS or head.batched is not None)


def screened_logits(head: GreedyHead, x: torch.Tensor) -> torch.Tensor:
    """Logits ``[rows, vocab]`` for fp32 ``x`` [rows, dim] whose argmax is that of ``x @ head.T``:
    exact fp32 logits for every token the int8 screen could not rule out, -inf for the rest."""
    x = _rows(head, x)
    if x.shape[0] > SCREEN_MAX_ROWS and head.batched is not None:
        return _batched_logits(head, x)
    # one native call: as torch ops after the GEMV, the bound and the selection took 0.43 ms a step
    return native_kernels.greedy_head(x, head.screen, head.error, head.rows)


def batched_terms(head: GreedyHead, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The batched screen's pieces for fp32 ``x`` [rows, dim]: ``(s, y, xn, cr)``: the int8 rows'
    products with the int8 head, scaled (fp32), the outlier columns' fp32 products with its unscaled
    values, and per row ||x|| and the bound's factor on ||w'|| (float64); the approximate logit of
    token v is ``s + scale[v] y`` (module docstring). One int8 scale serves every row: the rows are
    RMS-normed alike, and oneDNN's int8 linear takes one scale per tensor."""
    b = head.batched
    assert b is not None
    k = min(OUTLIER_COLUMNS, x.shape[1])
    cols = x.abs().amax(dim=0).topk(k).indices  # this step's largest columns
    x_o = x.index_select(1, cols)
    x_r = x.index_fill(1, cols, 0.0)
    top = float(x_r.abs().max())
    sx = top / 127 if top > 0 and math.isfinite(top) else 1.0
    sx = float(torch.tensor(sx, dtype=torch.float32))  # the fp32 scale oneDNN applies, exactly
    q = (x_r / sx).round_().clamp_(-127, 127)  # the bound uses q as it is
    s = _int8_linear(q.to(torch.int8), sx, b.packed, b.scale, b.zero_points)
    y = torch.mm(x_o, b.q_cols.index_select(0, cols).float())
    rounding = (x_r.double() - q.double() * sx).norm(dim=1)
    cr = (rounding + (k + 2) * 2.0 ** -24 * x_o.double().norm(dim=1)) * 1.01
    return s, y, x.double().norm(dim=1), cr


def batched_screen(head: GreedyHead, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`screen` for batched rows: ``(approx, bound)`` [rows, vocab] float64, what the native
    selection computes inside, for the tests that hold the bound against float64."""
    b = head.batched
    assert b is not None
    s, y, xn, cr = batched_terms(head, _rows(head, x))
    approx = s.double() + b.scale.double() * y.double()
    bound = xn[:, None] * head.error.double() + cr[:, None] * b.norm.double() + approx.abs() * 2.0 ** -21
    return approx, bound


def _batched_logits(head: GreedyHead, x: torch.Tensor) -> torch.Tensor:
    b = head.batched
    assert b is not None
    s, y, xn, cr = batched_terms(head, x)
    return native_kernels.screen_select(s, y, b.scale, xn, head.error, cr, b.norm, x, head.rows)
