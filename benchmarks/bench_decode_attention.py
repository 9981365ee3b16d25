"""CPU decode attention: the padded gather path, the in-place PyTorch path and the native C kernel.

    python benchmarks/bench_decode_attention.py            # 1 and 2 threads, 64 sequences, 5 rounds
    python benchmarks/bench_decode_attention.py --quick    # 1 thread, 2 rounds, fewer cases

One "step" is what a decode step of SmolLM2-135M (fp32; 30 layers, 9 query heads over 3 KV heads
of dim 64, block size 16) spends in decode attention: the plan built once
(``reference.plan_decode``), then ``paged_decode_attention`` once per layer, each layer over its
own slice of one ``[L, 2, blocks, 16, 3, 64]`` cache as the engine lays it out.

- *padded*: ``plan_decode(..., sparse=False)``: every sequence's K/V gathered block by block into
  the engine's reusable workspace, one padded SDPA call per group of 16 sequences (the path
  before issue 18's change; still the path for small batches and 16-bit caches);
- *in place*: ``plan_decode(...)`` as the engine calls it (from
  ``reference.SPARSE_DECODE_MIN_ROWS`` rows on: sampled_addmm, segmented softmax, embedding_bag
  over the cache, nothing copied);
- *native*: ``kvbatch.kernels.cpu.native.paged_decode_attention``, the C kernel the engine runs for fp32
  CPU tensors where it builds (``KVBATCH_KERNELS=auto``), also reading the cache in place;
- *native bf16*: the same kernel over the same cache, queries and context rounded to bf16 (a bf16
  model's step): half the bytes; on a CPU with AVX512-BF16 its query-key products are
  ``vdpbf16ps``. Its ratio is fp32 native over bf16 native, both measured in the same rounds.

Context lengths: the prompt lengths of the engine benchmark's 64-request chat workload
(``chat_workload(None, 64)`` through SmolLM2's chat template, 34-533 tokens; listed below so this
file needs neither the datasets nor the model), plus ``--new-tokens`` already generated. Requests
``i`` with ``(i // 4) % 2 == 0`` share the support system prompt: their first 18 blocks are the
same cache blocks, as the prefix cache leaves them. Every other block is placed at random in the
cache (decode allocates blocks to many sequences in turn, so a sequence's blocks are scattered).

The paths alternate within each round (their order reversed every round), so all see the same
machine load; the ratios are of the medians. The CPU model, its SIMD flags and the load
average (before and after each table) are printed with every table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvbatch.kernels import reference as R  # noqa: E402
from kvbatch.kernels.cpu import native as N  # noqa: E402
from kvbatch.kernels.cpu.kernel_choice import cpu_identity  # noqa: E402

# chat_workload(None, 64) prompt lengths with SmolLM2-135M-Instruct's tokenizer (2026-12-01).
PROMPT_LENS = (351, 533, 344, 405, 49, 92, 151, 103, 358, 371, 449, 363, 84, 62, 372, 92, 362, 382, 357, 391,
               147, 101, 34, 92, 444, 356, 342, 386, 35, 68, 45, 96, 361, 399, 344, 382, 58, 54, 118, 81, 376,
               347, 517, 374, 39, 243, 63, 66, 459, 350, 355, 374, 89, 71, 41, 109, 372, 348, 357, 366, 108, 196,
               39, 72)
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
SHARED_BLOCKS = 18  # the support system prompt's full blocks, shared by half the requests
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


class Case:
    """One step's inputs: a cache of every layer, block tables, context lengths, queries."""

    def __init__(self, lens: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // BLOCK) for n in lens]
        shares = [(i // 4) % 2 == 0 and n > SHARED_BLOCKS for i, n in enumerate(need)]
        private = sum(n - SHARED_BLOCKS if s else n for n, s in zip(need, shares))
        num_blocks = SHARED_BLOCKS + private + 16
        perm = torch.randperm(num_blocks, generator=gen)
        shared, free = perm[:SHARED_BLOCKS], perm[SHARED_BLOCKS:]
        width = max(need)
        tables = torch.zeros(len(lens), width, dtype=torch.int32)
        used = 0
        for b, (n, s) in enumerate(zip(need, shares)):
            start = SHARED_BLOCKS if s else 0
            if s:
                tables[b, :SHARED_BLOCKS] = shared
            tables[b, start:n] = free[used:used + n - start]
            used += n - start
        self.tables = tables
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.kv = torch.randn(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
        self.q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen)
        shape = (tables.numel(), BLOCK, KV_HEADS, HEAD_DIM)  # the model runner's workspace
        self.workspace = (torch.zeros(shape), torch.zeros(shape))
        self.kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 4 * 2  # K and V a layer reads, unpadded
        self.kv16: torch.Tensor | None = None  # the bf16 copies, made on first use
        self.q16: torch.Tensor | None = None

    def step(self, sparse: bool | str | None) -> torch.Tensor:
        """One decode step's attention, every layer; returns the last layer's output. ``sparse``:
        the reference's in-place path (True) or padded path (False); None: the native kernel;
        ``"bf16"``: the native kernel over bf16 copies of the cache and queries."""
        if sparse == "bf16":
            if self.kv16 is None:
                self.kv16, self.q16 = self.kv.bfloat16(), self.q.bfloat16()
            for li in range(LAYERS):
                out = N.paged_decode_attention(self.q16, self.kv16[li, 0], self.kv16[li, 1], self.tables,
                                               self.lens, HEAD_DIM ** -0.5)
            return out
        if sparse is None:
            for li in range(LAYERS):
                out = N.paged_decode_attention(self.q, self.kv[li, 0], self.kv[li, 1], self.tables, self.lens,
                                               HEAD_DIM ** -0.5)
            return out
        plan = R.plan_decode(self.tables, self.lens, BLOCK, sparse=sparse)
        for li in range(LAYERS):
            out = R.paged_decode_attention(self.q, self.kv[li, 0], self.kv[li, 1], self.tables, self.lens,
                                           HEAD_DIM ** -0.5, None, self.workspace, plan)
        return out


def interleaved(case: Case, rounds: int, native: bool) -> dict[str, list[float]]:
    """Per-round step times (ms) of each path (padded, in place, and native when it builds), alternating."""
    paths = {"padded": False, "in place": True, **({"native": None, "native bf16": "bf16"} if native else {})}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for sparse in paths.values():  # warm: workspace pages, allocator, thread pool
        case.step(sparse)
    for r in range(rounds):
        for name, sparse in (list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]):
            t = time.perf_counter()
            case.step(sparse)
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def run_table(title: str, cases: list[tuple[str, list[int]]], rounds: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    native = N.available()
    print(f"\n{title}; {threads} thread(s); load average before {load()}")
    print(f"  {'case':<34} {'padded ms':>10} {'in place ms':>12} {'ratio':>7} {'native ms':>10} {'ratio':>7} "
          f"{'max |diff|':>11} {'KV MB/layer':>12} {'bf16 ms':>8} {'ratio':>7}")
    rows = []
    for name, lens in cases:
        case = Case(lens)
        ref = case.step(False)
        diff = max((ref - case.step(s)).abs().max().item() for s in ((True, None) if native else (True,)))
        times = interleaved(case, rounds, native)
        med = {k: statistics.median(v) for k, v in times.items()}
        p, n = med["padded"], med["in place"]
        c = med.get("native", float("nan"))
        c16 = med.get("native bf16", float("nan"))
        print(f"  {name:<34} {p:10.1f} {n:12.1f} {p / n:6.2f}x {c:10.1f} {n / c:6.2f}x {diff:11.1e} "
              f"{case.kv_bytes / 1e6:12.1f} {c16:8.1f} {c / c16:6.2f}x")
        rows.append({"case": name, "threads": threads, "padded_ms": p, "in_place_ms": n, "native_ms": c,
                     "native_bf16_ms": c16, "ratio": p / n, "in_place_over_native": n / c,
                     "native_over_bf16": c / c16, "max_abs_diff": diff})
        del case
    print(f"  load average after {load()}"
          + ("" if native else f"; no native column: {N.unavailable_reason()}"))
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", default="0,128,256", help="tokens generated so far (comma-separated)")
    p.add_argument("--quick", action="store_true", help="1 thread, 2 rounds, 128 new tokens, a short sweep")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.threads, args.rounds, args.new_tokens = "1", 2, "128"
    cpu_model, flags = cpu_identity()
    print(f"decode attention, SmolLM2-135M shapes ({LAYERS} layers, {HEADS}/{KV_HEADS} heads, dim {HEAD_DIM}, "
          f"block {BLOCK}), fp32 (bf16: the last column); torch {torch.__version__}; CPU: {cpu_model}; "
          f"SIMD flags: {' '.join(f for f in SIMD_FLAGS if f in flags)}; {os.cpu_count()} CPUs; "
          f"{args.rounds} rounds; padded path below {R.SPARSE_DECODE_MIN_ROWS} rows")
    news = [int(x) for x in args.new_tokens.split(",")]
    batch64 = [(f"64 seqs, +{n} tokens", [p + n for p in PROMPT_LENS]) for n in news]
    sizes = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32)
    sweep = [(f"{b} seqs, +{news[0]} tokens", [p + news[0] for p in PROMPT_LENS[:b]]) for b in sizes]
    for threads in (int(x) for x in args.threads.split(",")):
        run_table("one step's decode attention (plan + every layer), 64 sequences", batch64, args.rounds, threads)
        # Below SPARSE_DECODE_MIN_ROWS the padded and in-place columns are both the padded path:
        # the threshold's evidence is where their ratio crosses 1 with the threshold lowered.
        saved = R.SPARSE_DECODE_MIN_ROWS
        R.SPARSE_DECODE_MIN_ROWS = 1
        try:
            run_table("smaller batches, the in-place path forced at every size", sweep, args.rounds, threads)
        finally:
            R.SPARSE_DECODE_MIN_ROWS = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
