"""Which CPU kernel multiplies the dense projections, chosen by measuring on this machine.

The fastest layout differs between CPUs (oneDNN's packed weights won on AMD Zen 4/5, BLAS won at
one row on an Intel Xeon with AMX), so at load time the candidates (oneDNN packed, BLAS; for int8
weights the int8 routes of :mod:`kvbatch.engine.models.quant`) each multiply weights of the
model's own shapes at one row count per bucket (1, 2-8, 9-64, 65+), and each bucket takes the
fastest. The weights measured are at most the model's own size and up to ``_STREAM_BYTES``, more
than a last-level cache holds, so decode's memory-bound passes are measured as memory-bound.

The result is cached as JSON in ``$KVBATCH_CACHE_DIR`` (default ``~/.cache/kvbatch``), one file
per key: CPU model and flags, torch version, thread count, dtype, weight format and shapes; a
changed key is a new file, so a new torch, CPU or model is measured afresh. A bucket keeps the
bucket-1 winner's layout unless another kernel is more than ``_SWITCH_GAIN`` faster there: a
second layout costs a second copy of the weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbatch.engine.models.linear import (
    BLAS,
    BUCKET_BOUNDS,
    CUBLAS,
    INT8,
    MIXED,
    ONEDNN,
    LinearFormat,
    choose_linear_format,
    linear_override,
    onednn_available,
)
from kvbatch.engine.models.quant import DEQUANT, INT8PACK, int8_linear, quantize_int8

LINEAR_CHOICES = ("auto", ONEDNN, BLAS)
WEIGHT_CHOICES = ("full", "int8")  # full: the compute dtype; int8: weight-only int8
BUCKET_ROWS = (1, 8, 64, 256)  # the row count each bucket of BUCKET_BOUNDS is measured at
CACHE_VERSION = 1
_STREAM_BYTES = 48 << 20  # measured weights: past a 32 MB L3, as the model's are
_SWITCH_GAIN = 0.10
_SLOW_CALL_S = 0.02
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


def best_of_three(kind: str, rows: int, run: Callable[[], object]) -> float:
    """The default timer: one warm-up call, then the fastest of three (the machine may be shared);
    just the warm-up when it took over ``_SLOW_CALL_S`` (repeating a call that slow would blow the
    load-time budget, and at that length one call is a fair measure)."""
    t0 = time.perf_counter()
    run()
    best = time.perf_counter() - t0
    if best > _SLOW_CALL_S:
        return best
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_identity() -> tuple[str, list[str]]:
    """This CPU's model name and feature flags (from /proc/cpuinfo where there is one)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, fields.get("flags", "").split()


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


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVBATCH_CACHE_DIR") or Path.home() / ".cache" / "kvbatch")


def cache_key(dtype: torch.dtype, weights: str, shapes: Sequence[tuple[int, int]], num_layers: int,
              candidates: Sequence[str]) -> dict[str, Any]:
    """Everything a measurement depends on; a change in any of it measures again."""
    model, flags = cpu_identity()
    return {"version": CACHE_VERSION, "cpu": model, "flags": sorted(flags), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."), "weights": weights,
            "shapes": [list(s) for s in shapes], "num_layers": num_layers, "candidates": list(candidates),
            "buckets": list(BUCKET_BOUNDS)}


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
    """The kernels (float) or routes (int8) worth measuring for ``dtype`` weights on this CPU."""
    if weights == "int8":
        return ([INT8PACK] if int8pack_available() else []) + [DEQUANT]
    packable = dtype in (torch.float32, torch.bfloat16) and onednn_available(dtype)
    return [ONEDNN, BLAS] if packable else [BLAS]


def candidate_format(kind: str, dtype: torch.dtype) -> LinearFormat:
    if kind in (INT8PACK, DEQUANT):
        return LinearFormat(INT8, dtype, bucket_kinds=(kind,) * len(BUCKET_ROWS))
    return LinearFormat(kind, dtype)


def measure(candidates: Sequence[str], dtype: torch.dtype, shapes: Sequence[tuple[int, int]], num_layers: int,
            timer: Timer = best_of_three) -> dict[str, list[float]]:
    """ms per bucket for each candidate, multiplying random weights of ``shapes``: up to
    ``_STREAM_BYTES`` of them (at most ``num_layers`` copies) for the memory-bound small buckets,
    one layer's worth from 9 rows up (compute-bound there, and the most expensive to time)."""
    g = torch.Generator().manual_seed(0)
    layer_bytes = sum(o * i for o, i in shapes) * torch.finfo(dtype).bits // 8
    copies = max(1, min(num_layers, _STREAM_BYTES // max(layer_bytes, 1)))
    plain = [torch.randn(o, i, generator=g).to(dtype) for _ in range(copies) for o, i in shapes]
    inputs = {rows: {i: torch.randn(rows, i, generator=g).to(dtype) for _, i in shapes} for rows in BUCKET_ROWS}
    prepared = {kind: [(candidate_format(kind, dtype).prepare(w), w.shape[1]) for w in plain] for kind in candidates}
    timings: dict[str, list[float]] = {kind: [] for kind in candidates}
    for b, rows in enumerate(BUCKET_ROWS):
        for kind in candidates:
            # Lost the previous bucket by far: more rows will not save it. (Not from bucket 1 on:
            # one row takes other kernels, matrix-vector ones, than two or more.)
            if b > 1 and _hopeless(timings, kind, b - 1):
                timings[kind].append(math.inf)
                continue
            fmt = candidate_format(kind, dtype)
            ws = prepared[kind] if b < _STREAMED_BUCKETS else prepared[kind][:len(shapes)]

            def run(ws: list = ws, xs: dict = inputs[rows], fmt: LinearFormat = fmt) -> None:
                for w, in_f in ws:
                    fmt(xs[in_f], w)

            timings[kind].append(timer(kind, rows, run) * 1e3)
    return timings


def _hopeless(timings: Mapping[str, Sequence[float]], kind: str, b: int) -> bool:
    best = min(t[b] for t in timings.values())
    return timings[kind][b] > _HOPELESS * best


def pick(timings: Mapping[str, Sequence[float]]) -> tuple[str, ...]:
    """The kernel per bucket: the bucket-1 winner, unless another is more than ``_SWITCH_GAIN``
    faster in that bucket."""
    primary = min(timings, key=lambda k: timings[k][0])
    kinds = []
    for b in range(len(BUCKET_ROWS)):
        best = min(timings, key=lambda k: timings[k][b])
        kinds.append(best if timings[best][b] < timings[primary][b] * (1 - _SWITCH_GAIN) else primary)
    return tuple(kinds)


def format_from_kinds(kinds: Sequence[str], dtype: torch.dtype, weights: str) -> LinearFormat:
    if weights == "int8":
        return LinearFormat(INT8, dtype, bucket_kinds=tuple(kinds))
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
                   timer: Timer = best_of_three) -> KernelChoice:
    """The projection format for a model whose layers multiply ``shapes``.

    ``linear``: ``auto`` (measure, or the ``KVBATCH_LINEAR`` override when set), or ``onednn`` /
    ``blas`` (forced). ``weights``: ``full`` or ``int8``. Batch-invariant mode and CUDA take the
    static choice (one kernel whose padding rule is known; cuBLAS)."""
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
    if device.type == "cuda":
        return KernelChoice(LinearFormat(CUBLAS, dtype, device), "static")
    if weights == "full":
        if linear != "auto":
            if linear == ONEDNN and ONEDNN not in candidates_for(dtype, weights):
                raise ValueError(f"--linear onednn, but this torch build cannot pack {dtype} weights with oneDNN")
            return KernelChoice(LinearFormat(linear, dtype), "forced")
        if linear_override():
            return KernelChoice(choose_linear_format(dtype, device), "env")
        if batch_invariant:
            return KernelChoice(choose_linear_format(dtype, device), "static")
    candidates = candidates_for(dtype, weights)
    if len(candidates) == 1:
        return KernelChoice(format_from_kinds([candidates[0]] * len(BUCKET_ROWS), dtype, weights), "static")
    key = cache_key(dtype, weights, shapes, num_layers, candidates)
    path = cache_file(key, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    cached = _read_cache(path, key, candidates)
    if cached is not None:
        return KernelChoice(format_from_kinds(cached["kinds"], dtype, weights), "cache",
                            cached.get("timings_ms", {}), str(path))
    timings = measure(candidates, dtype, shapes, num_layers, timer)
    kinds = pick(timings)
    _write_cache(path, {"key": key, "kinds": list(kinds),
                        "timings_ms": {k: [None if math.isinf(t) else t for t in v] for k, v in timings.items()}})
    return KernelChoice(format_from_kinds(kinds, dtype, weights), "measured", timings, str(path))
