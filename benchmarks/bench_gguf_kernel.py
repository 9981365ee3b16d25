"""The native GGUF block multiply against fp32 weights, on SmolLM2-135M's projection shapes.

    python benchmarks/bench_gguf_kernel.py                 # Q4_1 and Q8_0, 1/4/8 rows, 2 threads
    python benchmarks/bench_gguf_kernel.py --qtypes Q4_1 --rows 1 --rounds 9

One "step" is every projection of a SmolLM2-135M decode step (30 layers of the fused q/k/v
[960, 576], o [576, 576], gate/up [3072, 576] and down [576, 1536]) at the given rows: the
blocks through ``gguf_kernels.gguf_linear`` (the ``gguf-native`` kernel), against the same
weights dequantized to fp32 through ``torch.nn.functional.linear`` (the baseline, measured in the
same rounds, alternated). Random quants (``gguf_kernels.random_blocks``); 30 distinct layers, so
the weights stream from memory as in a real step, not from cache. Printed: ms per step, the
blocks' GB/s, and fp32 ms over gguf ms (above 1: the blocks are faster). The CPU model, its SIMD
flags, the kernel's vector path and the load average come with every table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvbatch.kernels.cpu import gguf_blocks, gguf_kernels  # noqa: E402
from kvbatch.kernels.cpu.machine import cpu_identity  # noqa: E402

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # [out, in] of one layer's projections
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")


def dequantized(w: gguf_kernels.QuantizedBlocks) -> torch.Tensor:
    blocks = gguf_blocks.GGUFBlocks(w.qtype, (w.out_features, w.in_features), w.data.numpy())
    return torch.from_numpy(gguf_blocks.dequantize(blocks)).float().reshape(w.out_features, w.in_features)


def step_times(qtype: str, rows: int, rounds: int) -> tuple[list[float], list[float], int, float]:
    """Per-round step times (ms) of the blocks and of fp32, alternated; the blocks' bytes; the
    largest difference of one projection's outputs (gguf against fp32, over the output scale)."""
    gen = torch.Generator().manual_seed(0)
    layers = [[gguf_kernels.random_blocks(qtype, o, i, gen) for o, i in SHAPES] for _ in range(LAYERS)]
    fp32 = [[dequantized(w) for w in layer] for layer in layers]
    xs = {i: torch.randn(rows, i, generator=gen) for _, i in SHAPES}
    nbytes = sum(w.data.numel() for layer in layers for w in layer)
    a, b = gguf_kernels.gguf_linear(xs[576], layers[0][0]), F.linear(xs[576], fp32[0][0])
    diff = float((a - b).abs().max() / b.abs().max())

    def run_gguf() -> None:
        for layer in layers:
            for w in layer:
                gguf_kernels.gguf_linear(xs[w.in_features], w)

    def run_fp32() -> None:
        for layer in fp32:
            for w in layer:
                F.linear(xs[w.shape[1]], w)

    paths = [run_gguf, run_fp32]
    for fn in paths:  # warm
        fn()
    times: dict[object, list[float]] = {fn: [] for fn in paths}
    for r in range(rounds):
        for fn in paths if r % 2 == 0 else paths[::-1]:
            t = time.perf_counter()
            fn()
            times[fn].append((time.perf_counter() - t) * 1e3)
    return times[run_gguf], times[run_fp32], nbytes, diff


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qtypes", default="Q4_1,Q8_0", help="comma-separated GGUF block types (Q4_0, Q4_1, Q8_0)")
    p.add_argument("--rows", default="1,4,8", help="comma-separated rows of x")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    if not gguf_kernels.available():
        print(f"the native GGUF kernel is unavailable here: {gguf_kernels.unavailable_reason()}")
        return 1
    torch.set_num_threads(args.threads)
    model, flags = cpu_identity()
    print(f"GGUF blocks vs fp32 weights, SmolLM2-135M projections ({LAYERS} layers); CPU: {model}; SIMD flags: "
          f"{' '.join(f for f in SIMD_FLAGS if f in flags)}; kernel path {gguf_kernels.simd()}; "
          f"{args.threads} threads; torch {torch.__version__}; {args.rounds} rounds, medians")
    print(f"  load average before {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  {'qtype':<6} {'rows':>4} {'gguf ms':>8} {'GB/s':>6} {'fp32 ms':>8} {'fp32/gguf':>10} {'max rel diff':>13}")
    for qtype in args.qtypes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            g, f, nbytes, diff = step_times(qtype, rows, args.rounds)
            gm, fm = statistics.median(g), statistics.median(f)
            print(f"  {qtype:<6} {rows:>4} {gm:8.2f} {nbytes / gm / 1e6:6.1f} {fm:8.2f} {fm / gm:9.2f}x {diff:13.1e}")
    print(f"  load average after {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
