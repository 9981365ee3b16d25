"""Which CPU kernel multiplies the dense projections, chosen by measuring on this machine.

The fastest layout differs between CPUs (oneDNN's packed weights won on AMD Zen 4/5, BLAS won at
one row on an Intel Xeon with AMX), so at load time the candidates (oneDNN packed, BLAS; for int8
weights the int8 routes of :mod:`kvbatch.kernels.cpu.quant`; for GGUF weights the native kernel
of :mod:`kvbatch.kernels.cpu.gguf_kernels` against oneDNN and BLAS over the dequantized fp32)
each multiply weights of the
model's own shapes at one row count per bucket (1, 2-8, 9-64, 65+), and each bucket takes the
fastest. The weights measured are at most the model's own size and up to ``_STREAM_BYTES``, more
than a last-level cache holds, so decode's memory-bound passes are measured as memory-bound.

The measurement is sized to take a few hundred milliseconds of CPU time: the weights are one layer's random
values copied (not drawn again) as often as streaming needs; every kernel is warmed up at each row
count before it is timed (the first call at a row count creates oneDNN primitives and touches
fresh buffers, which once made a slow first call pass for the kernel's speed); then the candidates
are timed in rounds, one call each, and from the second round on a candidate more than
``_CLEAR_LEAD`` times slower than the leader is not timed again in that bucket (a single sample
can be a spike on a shared machine), and no new round starts once the bucket's timed calls add up
to ``_BUCKET_BUDGET_S``. At most ``_ROUNDS`` rounds per bucket, so the number of timed calls is
bounded by candidates x buckets x ``_ROUNDS`` whatever the machine.

The result is cached as JSON in ``$KVBATCH_CACHE_DIR`` (default ``~/.cache/kvbatch``), one file
per key: CPU model and flags, torch version, thread count, dtype, weight format and shapes; a
changed key is a new file, so a new torch, CPU or model is measured afresh. A bucket keeps the
bucket-1 winner's layout unless another kernel is more than ``_SWITCH_GAIN`` faster there: a
second layout costs a second copy of the weights. Once a second layout is held, the decode
buckets take it wherever it measured faster (``_HELD_BUCKETS``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvbatch.kernels.cpu import gguf_kernels, mkl_packed
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.gguf_blocks import NATIVE_QTYPES
from kvbatch.kernels.cpu.gguf_kernels import GGUFWeight, QuantizedBlocks
from kvbatch.kernels.cpu.huge_pages import HugePageArena
from kvbatch.kernels.cpu.linear import (
    BLAS,
    BUCKET_BOUNDS,
    CUBLAS,
    GGUF,
    GGUF_NATIVE,
    INT8,
    MIXED,
    MKL,
    NATIVE,
    NATIVE_MAX_ROWS,
    ONEDNN,
    LinearFormat,
    choose_linear_format,
    linear_override,
    onednn_available,
    place_in_huge_pages,
)
from kvbatch.kernels.cpu.machine import cpu_identity, default_cache_dir, isa_limits  # also this module's API
from kvbatch.kernels.cpu.quant import (
    DEQUANT,
    GEMV,
    INT8_ROUTES,
    INT8PACK,
    Int8Weight,
    int8_linear,
    quantize_int8,
)

LINEAR_CHOICES = ("auto", ONEDNN, BLAS, MKL)
# full: the compute dtype; int8: weight-only int8; gguf: the GGUF file's own blocks where they win
WEIGHT_CHOICES = ("full", "int8", "gguf")
# The row count each bucket of BUCKET_BOUNDS is measured at. The open bucket (prefill chunks) at
# 128 rows: compute-bound already there, and 256 would double the costliest calls of the measurement.
BUCKET_ROWS = (1, 8, 64, 128)
# 2: timings without the first call's warm-up (version 1 could report a warm-up as the speed).
# 3: the int8 gemv route measured at every bucket (version 2 timed it for 1-8 rows only, so its
#    files hold dequant or int8pack for batched rows, where gemv now wins).
# 4: the one-row bucket credits the kernels the fused decode layers run (_FUSED_CREDIT).
# 5: a layout already held takes the decode buckets where it measured faster (_HELD_BUCKETS).
CACHE_VERSION = 5
_STREAM_BYTES = 48 << 20  # measured weights: past a 32 MB L3, as the model's are
_SWITCH_GAIN = 0.10
# The buckets (1, 2-8, 9-64 rows: decode) where a layout the choice already holds (it won another
# bucket by _SWITCH_GAIN) takes over wherever it measured faster at all. Why: the measurement
# multiplies one layer's weights from 9 rows up, which stay in the cache, where a decode step
# streams every layer's from memory, and a kernel's lead there grows: on the Xeon 167 held to AVX2
# (2026-12-05) MKL's packed weights measured 9% faster than BLAS at 64 rows (under the 10% switch
# gain: BLAS kept), while the engine's 64-row step spent 95.6 ms in its projections with MKL and
# 121.8 with BLAS, and streamed over 30 layers MKL took 1.17 ms a layer at 16 rows to BLAS's 1.95.
# Not the prefill bucket (65+ rows, measured at 128): the two cross within it (MKL 7% faster at
# 128 rows, BLAS 9% faster at 2,048 on the same Xeon), so a small lead at 128 rows says little.
_HELD_BUCKETS = 3
# At one row the kernels whose layout the fused decode layers take (fused_kinds) run inside one native
# call per step, without the small ops between the projections that the per-projection timings
# cannot see; they count as this much faster than they measured. On the Xeon 167 (2026-12-05) MKL's
# packed weights, in huge pages, measured within 10% of BLAS at one row and won the bucket by a
# hair; the engine then decoded at 39.3 tok/s against 56.2 with BLAS in the fused step.
_FUSED_CREDIT = 0.25
# Timed calls per candidate and bucket: at least _MIN_ROUNDS (one sample can be a spike on a shared
# machine), at most _ROUNDS, and no new round once the bucket's timed calls add up to
# _BUCKET_BUDGET_S (cheap one-row calls get more samples than costly many-row ones).
_MIN_ROUNDS = 2
_ROUNDS = 5
_BUCKET_BUDGET_S = 0.08
_CLEAR_LEAD = 1.5  # slower than the leader by this factor after _MIN_ROUNDS: not timed again in the bucket
_HOPELESS = 3.0  # a candidate this many times slower than the best in a bucket is not timed further
_STREAMED_BUCKETS = 2  # buckets 1 and 2-8 are memory-bound: measured over _STREAM_BYTES
_LAYER_PREFIX = "model.layers.0."

# (kind, rows, run) -> seconds one call of ``run`` takes; tests inject a fake.
Timer = Callable[[str, int, Callable[[], object]], float]


@dataclass(frozen=True)
class KernelChoice:
    """The format a model's projections use, and how it was arrived at."""

    fmt: LinearFormat
    source: str  # measured | cache | forced | env | static
    timings_ms: dict[str, list[float]] = field(default_factory=dict)  # kind -> ms per bucket
    cache_path: str | None = None
    timed_calls: int = 0  # timer calls the measurement made (0 unless source is measured)
    measure_s: float = 0.0  # wall seconds the measurement took, weights made included
    note: str = ""  # why the weights asked for are not what runs (e.g. no native GGUF kernel)


def one_call(kind: str, rows: int, run: Callable[[], object]) -> float:
    """The default timer: the wall time of one call (warm-up and repeats are the caller's)."""
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def dense_shapes(tensors: Mapping[str, torch.Tensor]) -> list[tuple[int, int]]:
    """The ``[out, in]`` shapes one layer's dense projections are multiplied as: layer 0's 2-D
    ``*_proj.weight`` tensors, with q/k/v and gate/up fused as the models fuse them."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, t in tensors.items():
        if not name.startswith(_LAYER_PREFIX) or not name.endswith("proj.weight") or t.dim() != 2:
            continue
        short = name[len(_LAYER_PREFIX):].removesuffix(".weight").split(".")[-1]
        group = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
        key = group.get(short, short)
        out_f, in_f = t.shape
        if key in shapes and shapes[key][1] == in_f:
            shapes[key] = (shapes[key][0] + out_f, in_f)
        else:
            shapes[key if key not in shapes else name] = (int(out_f), int(in_f))
    return sorted(set(shapes.values()))


def cache_key(dtype: torch.dtype, weights: str, shapes: Sequence[tuple[int, int]], num_layers: int,
              candidates: Sequence[str], gguf_qtype: str | None = None, huge_pages: bool = False) -> dict[str, Any]:
    """Everything a measurement depends on; a change in any of it measures again (for GGUF
    weights also the block type and the native kernel's build; with the native GEMV a candidate,
    its build; whether the weights lie in huge pages; the instruction-set caps set in the
    environment: MKL held to AVX2 is another candidate than MKL on AVX-512)."""
    model, flags = cpu_identity()
    key = {"version": CACHE_VERSION, "cpu": model, "flags": sorted(flags), "isa_limits": isa_limits(),
           "torch": torch.__version__,
           "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."), "weights": weights,
           "shapes": [list(s) for s in shapes], "num_layers": num_layers, "candidates": list(candidates),
           "buckets": list(BUCKET_BOUNDS), "huge_pages": huge_pages}
    if weights == "gguf":
        key.update(gguf_qtype=gguf_qtype, gguf_kernel=gguf_kernels.identity())
    if NATIVE in candidates or GEMV in candidates:
        key.update(native_kernel=native_kernels.identity())
    return key


def cache_file(key: Mapping[str, Any], cache_dir: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"kernels-{digest}.json"


def int8pack_available() -> bool:
    """Whether ``torch._weight_int8pack_mm`` runs on this build's CPU (a private op: probe it)."""
    try:
        w = quantize_int8(torch.eye(8))
        y = int8_linear(torch.ones(2, 8), w, None, INT8PACK)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, torch.ones(2, 8), atol=1e-2))


def candidates_for(dtype: torch.dtype, weights: str) -> list[str]:
    """The kernels (float) or routes (int8) worth measuring for ``dtype`` weights on this CPU; for
    GGUF weights the native kernel (when it builds here) and the float kernels; for fp32 and bf16
    also the native decode GEMV (when the native CPU kernels build), measured for 1-8 rows only;
    for fp32 MKL's packed sgemm (where torch's library exports it); for int8 weights under fp32
    activations the native int8 kernel, measured at every row count."""
    if weights == "int8":
        native = [GEMV] if dtype == torch.float32 and native_kernels.available() else []
        return ([INT8PACK] if int8pack_available() else []) + [DEQUANT] + native
    packable = dtype in (torch.float32, torch.bfloat16) and onednn_available(dtype)
    floats = [ONEDNN, BLAS] if packable else [BLAS]
    if weights == "gguf" and gguf_kernels.available():
        return [GGUF_NATIVE, *floats]
    native = [NATIVE] if dtype in (torch.float32, torch.bfloat16) and native_kernels.available() else []
    if dtype != torch.float32:
        return [*floats, *native]
    return [*floats, *([MKL] if mkl_packed.available() else []), *native]


def candidate_format(kind: str, dtype: torch.dtype) -> LinearFormat:
    if kind in INT8_ROUTES:
        return LinearFormat(INT8, dtype, bucket_kinds=(kind,) * len(BUCKET_ROWS))
    if kind == GGUF_NATIVE:
        return LinearFormat(GGUF, dtype, bucket_kinds=(kind,) * len(BUCKET_ROWS))
    return LinearFormat(kind, dtype)


def _weight_bytes(kind: str, shapes: Sequence[tuple[int, int]], dtype: torch.dtype, gguf_qtype: str | None) -> int:
    """One layer's weight bytes as ``kind`` streams them."""
    if kind == GGUF_NATIVE:
        return sum(o * i // 32 * NATIVE_QTYPES[gguf_qtype or "Q4_1"][1] for o, i in shapes)
    if kind in INT8_ROUTES:
        return sum(o * i for o, i in shapes)
    return sum(o * i for o, i in shapes) * torch.finfo(dtype).bits // 8


def measure(candidates: Sequence[str], dtype: torch.dtype, shapes: Sequence[tuple[int, int]], num_layers: int,
            timer: Timer = one_call, calls: list[tuple[str, int]] | None = None,
            gguf_qtype: str | None = None, huge_pages: bool = False) -> dict[str, list[float]]:
    """ms per bucket for each candidate, multiplying random weights of ``shapes``: up to
    ``_STREAM_BYTES`` of them (at most ``num_layers`` copies of one layer) for the memory-bound
    small buckets, one layer's worth from 9 rows up (compute-bound there, and the most expensive
    to time). ``calls`` (when given) receives ``(kind, rows)`` of every timed call.

    The native GGUF candidate (random ``gguf_qtype`` blocks) streams more copies, as its layer is
    smaller, so its small-bucket times are scaled to the float candidates' copy count: every
    timing is for the same number of layers.

    ``huge_pages``: each candidate's weights placed as the model will place them
    (:func:`~kvbatch.kernels.cpu.linear.place_in_huge_pages`), so that a kernel is timed on the
    pages it will stream (a plain read of 4 KiB pages ran at 21 GB/s, of 2 MiB ones at 29, on a
    Xeon 167)."""
    g = torch.Generator().manual_seed(0)
    arena = HugePageArena() if huge_pages else None

    copies_of = {kind: max(1, min(num_layers, _STREAM_BYTES // max(_weight_bytes(kind, shapes, dtype, gguf_qtype), 1)))
                 for kind in candidates}
    copies = max(1, min(num_layers, _STREAM_BYTES // max(_weight_bytes(BLAS, shapes, dtype, None), 1)))
    # One layer drawn at random; the other copies are clones: memory to stream, not new numbers
    # (a copy costs less than drawing random values).
    layer = [torch.empty(o, i).uniform_(-1, 1, generator=g).to(dtype) for o, i in shapes]
    inputs = {rows: {i: torch.empty(rows, i).uniform_(-1, 1, generator=g).to(dtype) for _, i in shapes}
              for rows in BUCKET_ROWS}
    prepared: dict[str, list] = {}
    for kind in candidates:
        fmt = candidate_format(kind, dtype)
        if kind == GGUF_NATIVE:
            first = [(GGUFWeight(gguf_kernels.random_blocks(gguf_qtype or "Q4_1", o, i, g)), i) for o, i in shapes]
            first = [(w if arena is None else place_in_huge_pages(arena, w), i) for w, i in first]
        else:
            first = [(fmt.prepare(w, arena), w.shape[1]) for w in layer]
        if kind == MKL:  # MKL's packed buffers must not move: each copy is packed afresh, not cloned
            more = [(fmt.prepare(w, arena), w.shape[1]) for _ in range(copies_of[kind] - 1) for w in layer]
        else:
            more = [(_copy_prepared(w, arena), in_f) for _ in range(copies_of[kind] - 1) for w, in_f in first]
        prepared[kind] = first + more
    timings: dict[str, list[float]] = {kind: [] for kind in candidates}
    for b, rows in enumerate(BUCKET_ROWS):
        # Lost the previous bucket by far: more rows will not save it. (Not from bucket 1 on:
        # one row takes other kernels, matrix-vector ones, than two or more.)
        # the float native GEMV: decode rows only (the int8 one runs any row count)
        eligible = [k for k in candidates if not (k == NATIVE and rows > NATIVE_MAX_ROWS)]
        live = [k for k in eligible if not (b > 1 and _hopeless(timings, k, b - 1, eligible))]
        runs = {}
        for kind in live:
            fmt = candidate_format(kind, dtype)
            ws = prepared[kind] if b < _STREAMED_BUCKETS else prepared[kind][:len(shapes)]

            def run(ws: list = ws, xs: dict = inputs[rows], fmt: LinearFormat = fmt) -> None:
                for w, in_f in ws:
                    fmt(xs[in_f], w)

            runs[kind] = run
            for w, in_f in ws[:len(shapes)]:  # warm-up: one layer, untimed
                fmt(inputs[rows][in_f], w)
        best = dict.fromkeys(candidates, math.inf)
        spent = 0.0  # seconds of timed calls in this bucket, as the timer reports them
        for r in range(_ROUNDS):
            for kind in live:
                took = timer(kind, rows, runs[kind])
                if b < _STREAMED_BUCKETS:  # per `copies` layers, whatever this candidate streamed
                    took *= copies / copies_of[kind]
                best[kind] = min(best[kind], took)
                spent += took
                if calls is not None:
                    calls.append((kind, rows))
            if r + 1 >= _MIN_ROUNDS:
                leader = min(best[k] for k in live)
                live = [k for k in live if best[k] <= _CLEAR_LEAD * leader]
                if spent >= _BUCKET_BUDGET_S:
                    break
            if len(live) == 1:  # nothing left to compare it with
                break
        for kind in candidates:
            timings[kind].append(best[kind] * 1e3)
    return timings


def _copy_prepared(w: object, arena: HugePageArena | None = None) -> object:
    """Another copy of a prepared weight, in the same layout (clone where it is a plain or an
    opaque oneDNN tensor; an int8 weight clones its parts, bf16 blocks their tensor), placed in
    ``arena`` as the original was."""
    if arena is not None:
        return place_in_huge_pages(arena, _copy_prepared(w))
    if isinstance(w, torch.Tensor):
        return w.clone()
    if isinstance(w, native_kernels.Bf16Blocks):
        return w._replace(q=w.q.clone())
    if isinstance(w, Int8Weight):
        blocks = None if w.blocks is None else w.blocks._replace(q=w.blocks.q.clone())
        return Int8Weight(None if w.q is None else w.q.clone(), w.scale.clone(), w.scale_bf16.clone(), blocks)
    if isinstance(w, GGUFWeight) and w.blocks is not None and not w.layouts:
        blk = w.blocks
        return GGUFWeight(QuantizedBlocks(blk.qtype, blk.out_features, blk.in_features, blk.data.clone()))
    raise TypeError(f"cannot copy a prepared weight of type {type(w).__name__}")


def _hopeless(timings: Mapping[str, Sequence[float]], kind: str, b: int, among: Sequence[str]) -> bool:
    """Whether ``kind`` lost bucket ``b`` by more than ``_HOPELESS`` against the best of ``among``
    (the kernels that run the next bucket: the native GEMV's win at 8 rows says nothing at 64)."""
    best = min(timings[k][b] for k in among)
    return timings[kind][b] > _HOPELESS * best


def fused_kinds(dtype: torch.dtype, weights: str) -> tuple[str, ...]:
    """The candidates whose layout the fused decode layers take (``LinearFormat.fused_rows``)."""
    if weights == "int8":
        return (GEMV,)
    if weights == "gguf":
        return (GGUF_NATIVE,)
    return (BLAS, NATIVE) if dtype == torch.float32 else (NATIVE,) if dtype == torch.bfloat16 else ()


def pick(timings: Mapping[str, Sequence[float]], fused: Sequence[str] = ()) -> tuple[str, ...]:
    """The kernel per bucket: the bucket-1 winner, unless another is more than ``_SWITCH_GAIN``
    faster in that bucket; in bucket 1 the ``fused`` kinds count as ``_FUSED_CREDIT`` faster than
    they measured (they run in the fused decode step). Then a decode bucket (up to 64 rows) takes
    any kernel whose layout that first pass already holds where it measured faster at all: its
    weights are paid for, so the switch gain (a guard on memory) has nothing left to guard, and the
    measurement understates such a lead (see ``_HELD_BUCKETS``)."""
    def cost(k: str, b: int) -> float:
        return timings[k][b] * (1 - _FUSED_CREDIT) if b == 0 and k in fused else timings[k][b]

    primary = min(timings, key=lambda k: cost(k, 0))
    kinds = []
    for b in range(len(BUCKET_ROWS)):
        best = min(timings, key=lambda k: cost(k, b))
        kinds.append(best if cost(best, b) < cost(primary, b) * (1 - _SWITCH_GAIN) else primary)
    held = set(kinds)
    for b in range(_HELD_BUCKETS):
        kinds[b] = min(held, key=lambda k: (cost(k, b), k != kinds[b]))
    return tuple(kinds)


def format_from_kinds(kinds: Sequence[str], dtype: torch.dtype, weights: str) -> LinearFormat:
    """The format for the kernels picked per bucket; GGUF weights whose native kernel won no
    bucket take the plain float format (no reason to keep the blocks)."""
    if weights == "int8":
        return LinearFormat(INT8, dtype, bucket_kinds=tuple(kinds))
    if weights == "gguf" and GGUF_NATIVE in kinds:
        return LinearFormat(GGUF, dtype, bucket_kinds=tuple(kinds))
    if len(set(kinds)) == 1:
        return LinearFormat(kinds[0], dtype)
    return LinearFormat(MIXED, dtype, bucket_kinds=tuple(kinds))


def _read_cache(path: Path, key: Mapping[str, Any], candidates: Sequence[str]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    kinds = data.get("kinds")
    if not isinstance(kinds, list) or len(kinds) != len(BUCKET_ROWS) or not set(kinds) <= set(candidates):
        return None
    return data


def _write_cache(path: Path, data: Mapping[str, Any]) -> None:
    """Atomically (a concurrent loader reads the old file or the new one, never half of one);
    a read-only home only costs the next load a measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def choose_kernels(dtype: torch.dtype, shapes: Sequence[tuple[int, int]], *, num_layers: int = 1,
                   linear: str = "auto", weights: str = "full", batch_invariant: bool = False,
                   device: torch.device | str = "cpu", cache_dir: Path | str | None = None,
                   timer: Timer = one_call, gguf_qtype: str | None = None, huge_pages: bool = False) -> KernelChoice:
    """The projection format for a model whose layers multiply ``shapes``.

    ``linear``: ``auto`` (measure, or the ``KVBATCH_LINEAR`` override when set), or ``onednn`` /
    ``blas`` (forced). ``weights``: ``full``, ``int8`` or ``gguf`` (``gguf_qtype``: the GGUF type
    of the layers' blocks, None when the checkpoint has none). Batch-invariant mode and CUDA take
    the static choice (one kernel whose padding rule is known; cuBLAS). ``huge_pages``: the model
    will hold its weights in huge pages (:func:`~kvbatch.engine.models.llama.huge_pages_wanted`), so
    the candidates are timed there too.

    ``gguf`` falls back to the dequantized fp32 weights, saying why in ``KernelChoice.note``, when
    the checkpoint holds no blocks of a native type or the native kernel cannot be built here.
    bf16 on the CPU gets a note too where it measures slower than fp32 (:func:`bf16_slowdown`);
    ``build_model`` warns with every note."""
    choice = _choose_kernels(dtype, shapes, num_layers, linear, weights, batch_invariant, device, cache_dir, timer,
                             gguf_qtype, huge_pages)
    if dtype == torch.bfloat16 and choice.fmt.device.type == "cpu" and shapes:
        slower = bf16_slowdown(choice.fmt, shapes, timer)
        if slower > 1.0:
            model, flags = cpu_identity()
            bf16_flags = (", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags)
                          or "neither avx512_bf16 nor amx_bf16")
            note = (f"bf16 projections measured {slower:.1f}x slower than fp32 at {_SLOWDOWN_ROWS} rows (a batched "
                    f"decode step) on this CPU ({model}; {bf16_flags}); --dtype fp32 is the faster setting here")
            choice = replace(choice, note="; ".join(n for n in (choice.note, note) if n))
    return choice


# bf16_slowdown's rows: a batched decode step (bucket 9-64), compute-bound. An emulated bf16
# multiply loses there, while at 1-8 rows it still gains by halving the bytes: on a 2-vCPU AVX2
# EPYC (family 25), one SmolLM2 layer in bf16 BLAS took 0.69x and 0.88x of fp32's time at 1 and 8
# rows, 3.5x at 64 and 4.3x at 128.
_SLOWDOWN_ROWS = 64


def bf16_slowdown(fmt: LinearFormat, shapes: Sequence[tuple[int, int]], timer: Timer = one_call) -> float:
    """How many times longer one layer's projections (``shapes``) take at ``_SLOWDOWN_ROWS`` rows
    in the bf16 format ``fmt`` than in fp32 BLAS on this machine: best of 3 calls each after one
    warm-up (tens of milliseconds where bf16 is emulated, a few where it is not). Below 1 where
    bf16 is the faster setting, as on CPUs with AVX512-BF16 or AMX; several times 1 where bf16 is
    emulated (seen on an AVX2-only EPYC: bf16 batched decode at 0.7x transformers fp32 against
    kvbatch fp32's 3.0x, ``bench_engine.py --quick``)."""
    g = torch.Generator().manual_seed(1)
    layer = [torch.empty(o, i).uniform_(-1, 1, generator=g) for o, i in shapes]
    fp32 = LinearFormat(BLAS, torch.float32)
    best = {}
    bf16_kind = f"bf16-{fmt.kind_for(_SLOWDOWN_ROWS)}"
    for name, f, dtype in (("fp32-blas", fp32, torch.float32), (bf16_kind, fmt, torch.bfloat16)):
        ws = [(f.prepare(w.to(dtype)), torch.ones(_SLOWDOWN_ROWS, w.shape[1], dtype=dtype)) for w in layer]

        def run(ws: list = ws, f: LinearFormat = f) -> None:
            for w, x in ws:
                f(x, w)

        run()
        best[name] = min(timer(name, _SLOWDOWN_ROWS, run) for _ in range(3))
    fp32_s, bf16_s = best.values()
    return bf16_s / fp32_s if fp32_s > 0 else 0.0


def _choose_kernels(dtype: torch.dtype, shapes: Sequence[tuple[int, int]], num_layers: int, linear: str,
                    weights: str, batch_invariant: bool, device: torch.device | str, cache_dir: Path | str | None,
                    timer: Timer, gguf_qtype: str | None, huge_pages: bool = False) -> KernelChoice:
    """:func:`choose_kernels` before its bf16 check."""
    if linear not in LINEAR_CHOICES:
        raise ValueError(f"linear must be one of {', '.join(LINEAR_CHOICES)}, not {linear!r}")
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, not {weights!r}")
    device = torch.device(device)
    if weights == "int8":
        if device.type != "cpu":
            raise ValueError(f"int8 weights run on the CPU only, not on {device}")
        if linear != "auto":
            raise ValueError(f"--linear {linear} picks a float kernel; int8 weights choose their int8 route by measurement")
        if batch_invariant:
            raise ValueError("batch-invariant mode needs full-precision weights (int8 routes round differently per bucket)")
    note = ""
    if weights == "gguf":
        if device.type != "cpu":
            raise ValueError(f"GGUF-native weights run on the CPU only, not on {device}")
        if dtype != torch.float32:
            raise ValueError(f"GGUF-native weights multiply fp32 activations; use dtype fp32, not {dtype}")
        if linear != "auto":
            raise ValueError(f"--linear {linear} picks a float kernel; GGUF weights choose per bucket by measurement")
        if batch_invariant:
            raise ValueError("batch-invariant mode needs one kernel for every row count, not GGUF-native buckets")
        if gguf_qtype is None:
            note = (f"weights=gguf: the checkpoint holds no {'/'.join(NATIVE_QTYPES)} projection blocks; "
                    "using the dequantized fp32 weights")
            weights = "full"
        elif not gguf_kernels.available():
            note = (f"weights=gguf: the native GGUF kernel is unavailable ({gguf_kernels.unavailable_reason()}); "
                    "using the dequantized fp32 weights")
            weights = "full"
    if device.type == "cuda":
        return KernelChoice(LinearFormat(CUBLAS, dtype, device), "static")
    if weights == "full":
        if linear != "auto":
            if linear == ONEDNN and ONEDNN not in candidates_for(dtype, weights):
                raise ValueError(f"--linear onednn, but this torch build cannot pack {dtype} weights with oneDNN")
            if linear == MKL and dtype != torch.float32:
                raise ValueError(f"--linear mkl multiplies fp32 weights, not {dtype}")
            if linear == MKL and not mkl_packed.available():
                raise ValueError("--linear mkl, but this torch build exports no MKL packed sgemm")
            return KernelChoice(LinearFormat(linear, dtype), "forced")
        if linear_override():
            return KernelChoice(choose_linear_format(dtype, device), "env")
        if batch_invariant:
            return KernelChoice(choose_linear_format(dtype, device), "static")
    candidates = candidates_for(dtype, weights)
    if len(candidates) == 1:
        return KernelChoice(format_from_kinds([candidates[0]] * len(BUCKET_ROWS), dtype, weights), "static", note=note)
    key = cache_key(dtype, weights, shapes, num_layers, candidates, gguf_qtype, huge_pages)
    path = cache_file(key, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    cached = _read_cache(path, key, candidates)
    if cached is not None:
        return KernelChoice(format_from_kinds(cached["kinds"], dtype, weights), "cache",
                            cached.get("timings_ms", {}), str(path), note=note)
    t0 = time.perf_counter()
    calls: list[tuple[str, int]] = []
    timings = measure(candidates, dtype, shapes, num_layers, timer, calls, gguf_qtype, huge_pages)
    kinds = pick(timings, fused_kinds(dtype, weights))
    measure_s = time.perf_counter() - t0
    _write_cache(path, {"key": key, "kinds": list(kinds), "timed_calls": len(calls), "measure_s": measure_s,
                        "timings_ms": {k: [None if math.isinf(t) else t for t in v] for k, v in timings.items()}})
    return KernelChoice(format_from_kinds(kinds, dtype, weights), "measured", timings, str(path),
                        len(calls), measure_s, note)
