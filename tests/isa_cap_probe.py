"""Run by ``tests/test_isa_caps.py`` as the process that ``bench_engine.py --isa NAME`` restarts
itself as (its ``os.execve`` pointed at this file): reports what the project set up and chose under
the instruction-set caps it finds in its environment, and how far each kernel it would run lies
from a float64 reference. What MKL, oneDNN or torch say of themselves is not asked: only what the
project controls, and the numbers.

Usage: ``python isa_cap_probe.py REPORT.json [the restarted argv...]``; writes the report there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvbatch.kernels.cpu import gguf_kernels, greedy_head, native_build
from kvbatch.kernels.cpu import kernel_choice as kc
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.gguf_blocks import dequantize, quantize
from kvbatch.kernels.cpu.linear import INT8, LinearFormat, onednn_available
from kvbatch.kernels.cpu.machine import default_cache_dir, isa_limits

OUT_F, IN_F = 96, 128
SHAPES = [(OUT_F, IN_F), (IN_F, OUT_F)]  # a layer of two projections: what the choice measures
CASES = [("fp32", torch.float32, "full"), ("bf16", torch.bfloat16, "full"), ("fp32", torch.float32, "int8")]


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error, relative to the reference's largest magnitude."""
    return float((got.double() - want).abs().max() / want.abs().max())


def linear_errors(fmt: LinearFormat, dtype: torch.dtype, seed: int) -> dict[str, float]:
    """``fmt``'s multiply at every bucket's row count against float64 over the weights as ``fmt``
    holds them (bf16-rounded, or int8 and a scale)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(OUT_F, IN_F, generator=g).to(dtype)
    b = torch.randn(OUT_F, generator=g).to(dtype)
    prepared = fmt.prepare(w)
    held = prepared.dequantize() if fmt.kind == INT8 else w
    out = {}
    for rows in kc.BUCKET_ROWS:
        x = torch.randn(rows, IN_F, generator=g).to(dtype)
        want = x.double() @ held.double().T + b.double()
        out[f"{rows}:{fmt.kind_for(rows)}"] = worst(fmt(x, prepared, b), want)
    return out


def main(report_path: str, restarted_argv: list[str]) -> None:
    cc = native_build.compiler()
    report: dict = {
        "argv": restarted_argv,
        "limits": isa_limits(),
        "cflags": list(native_build.cflags()),
        "native_available": native_kernels.available(),
        "native_key": native_build.build_key(native_kernels.SOURCE, cc) if cc else None,
        "gguf_available": gguf_kernels.available(),
        "gguf_key": gguf_kernels.build_key(cc) if cc else None,
        "gguf_simd": gguf_kernels.simd(),
        "onednn_bf16": onednn_available(torch.bfloat16),
        "candidates": {}, "choices": {}, "errors": {},
    }
    for name, dtype, weights in CASES:
        case = f"{name}/{weights}"
        candidates = kc.candidates_for(dtype, weights)
        report["candidates"][case] = candidates
        for i, kind in enumerate(candidates):  # every kernel the measurement may pick
            for where, err in linear_errors(kc.candidate_format(kind, dtype), dtype, i).items():
                report["errors"][f"{case}/{kind}/{where}"] = err
        choice = kc.choose_kernels(dtype, SHAPES, weights=weights)  # measured under the caps, then cached
        cached = json.loads(Path(choice.cache_path).read_text())["key"] if choice.cache_path else None
        report["choices"][case] = {"source": choice.source, "kinds": [choice.fmt.kind_for(r) for r in kc.BUCKET_ROWS],
                                   "cache_key": cached}
        for where, err in linear_errors(choice.fmt, dtype, 99).items():  # the chosen format, bucket by bucket
            report["errors"][f"{case}/chosen/{where}"] = err
    if report["gguf_available"]:
        rng = np.random.default_rng(0)
        blocks = quantize(rng.standard_normal((OUT_F, IN_F)).astype(np.float32), "Q4_1")
        x = rng.standard_normal((5, IN_F)).astype(np.float32)
        want = torch.from_numpy(x.astype(np.float64) @ dequantize(blocks).astype(np.float64).T)
        report["errors"]["gguf/Q4_1"] = worst(gguf_kernels.gguf_linear(torch.from_numpy(x), gguf_kernels.to_torch(blocks)),
                                              want)
    # the batched greedy screen takes oneDNN's int8 linear only where it multiplies exactly here
    report["int8_linear"] = greedy_head.int8_linear_available()
    if report["int8_linear"]:
        full = torch.full((64,), 127, dtype=torch.int8)
        x, w = torch.stack([full, -full]), torch.stack([full, -full, full])
        got = greedy_head._int8_linear(x, 1.0, greedy_head._prepack(w, len(x)), torch.ones(3),
                                       torch.zeros(3, dtype=torch.int64))
        report["errors"]["int8_linear/saturating"] = worst(got, x.double() @ w.double().T)
    report["built"] = sorted(p.name for p in default_cache_dir().rglob("*.so"))
    Path(report_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
