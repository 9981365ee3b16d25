"""A batch-1 decode step with the lean small-op path against the per-tensor ops it replaced, in one
process, interleaved: ms per step, ops per step, the ratio. ``--paths``: instead, a decode step of
``--rows`` sequences through each CPU kernel path (the fused native layers, the native kernels op
by op, the native attention alone, the PyTorch reference), interleaved the same way.

    python benchmarks/bench_small_ops.py                      # SmolLM2 fp32, 1 and 2 threads
    python benchmarks/bench_small_ops.py --threads 1 --steps 40 --json out.json
    python benchmarks/bench_small_ops.py --paths --threads 2 --rows 1,16,64 --prompt-len 400

One model, one prompt prefilled once; then the same decode step (one new token at the prompt's
end, its K/V slot rewritten each time) runs ``--steps`` times in each mode, the modes taking turns
step by step (``LlamaModel.lean_ops`` switched between calls), so both meet the same machine load.
The logits of the two modes are compared bit for bit. Ops per step are the top-level aten ops
``torch.profiler`` records (the ones the engine calls from Python; each costs a dispatch); the
matmuls are counted apart. The header prints the CPU model, its SIMD flags and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

from kvbatch.engine.runtime.engine_config import EngineConfig  # noqa: E402
from kvbatch.engine.runtime.llm import LLM  # noqa: E402
from kvbatch.engine.runtime.model_runner import WorkItem  # noqa: E402
from kvbatch.kernels import dispatch  # noqa: E402
from kvbatch.kernels.cpu.kernel_choice import LINEAR_CHOICES, cpu_identity  # noqa: E402

SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
MATMULS = ("aten::mm", "aten::addmm", "aten::matmul", "mkldnn::_linear_pointwise")


def top_level_ops(fn: Callable[[], Any], calls: int = 1) -> Counter[str]:
    """The aten ops ``fn`` calls directly from Python (no op's children), summed over ``calls``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    return Counter(e.name for e in prof.events() if e.cpu_parent is None and "::" in e.name)


def decode_step(llm: LLM, prompt_len: int, rows: int = 1) -> Callable[[], torch.Tensor]:
    """Prefill ``rows`` different ``prompt_len``-token prompts; returns a function that runs one
    decode step of all of them after it (step tensors and forward pass; always the same positions)."""
    runner = llm.runner
    bs = runner.block_size
    per_seq = 2 + prompt_len // bs
    items = []
    with torch.inference_mode():
        for r in range(rows):
            table = list(range(1 + r * per_seq, 1 + (r + 1) * per_seq))
            prompt = [1] + [1000 + (i * 7 + r) % 5000 for i in range(prompt_len - 1)]
            runner.run([WorkItem(prompt, 0, table, 1)])
            items.append(WorkItem([5], prompt_len, table, 1))

    @torch.inference_mode()
    def step() -> torch.Tensor:
        ids, batch, _ = runner.build(items)
        return runner.model.forward(ids, batch, runner.kv_cache)

    return step


# --paths: name -> (KVBATCH_KERNELS, fused decode on, native attention only)
PATHS = {"fused": ("auto", True, False), "native ops": ("auto", False, False),
         "native attention only": ("auto", False, True), "reference": ("reference", False, False)}


@contextlib.contextmanager
def kernel_path(llm: LLM, name: str) -> Iterator[None]:
    """Run inside with the CPU kernel path ``name`` of PATHS. "native attention only" keeps the
    native decode attention and sends the other native small ops to the reference (the attention
    is the one caller of ``dispatch.native`` with ``bf16=True``)."""
    kernels, fused, attention_only = PATHS[name]
    saved = os.environ.get("KVBATCH_KERNELS"), dispatch.native, llm.model.fused_decode
    native = saved[1]
    os.environ["KVBATCH_KERNELS"] = kernels
    if attention_only:
        dispatch.native = lambda t, bf16=False: native(t, bf16) if bf16 else False
    llm.model.fused_decode = fused
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop("KVBATCH_KERNELS", None)
        else:
            os.environ["KVBATCH_KERNELS"] = saved[0]
        dispatch.native, llm.model.fused_decode = saved[1], saved[2]


def compare_paths(llm: LLM, step: Callable[[], torch.Tensor], steps: int) -> dict[str, Any]:
    """Every path of PATHS, ``steps`` interleaved calls each after 3 warm-ups: medians, each
    path's ratio to the reference, the largest logit difference from the reference."""
    logits, ms = {}, {name: [] for name in PATHS}
    for name in PATHS:
        with kernel_path(llm, name):
            for _ in range(3):
                logits[name] = step()
    for _ in range(steps):
        for name in PATHS:
            with kernel_path(llm, name):
                t0 = time.perf_counter()
                step()
                ms[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(v) for name, v in ms.items()}
    return {"median_ms": med, "reference_over": {n: med["reference"] / m for n, m in med.items()},
            "max_logit_diff": {n: float((logits[n] - logits["reference"]).abs().max()) for n in PATHS}}


def compare(llm: LLM, step: Callable[[], torch.Tensor], steps: int) -> dict[str, Any]:
    """Both modes, ``steps`` interleaved calls each after 3 warm-ups; medians, ratio, op counts."""
    model = llm.model
    modes = {"before": False, "after": True}
    logits, ms, ops = {}, {m: [] for m in modes}, {}
    for mode, lean in modes.items():
        model.lean_ops = lean
        for _ in range(3):
            logits[mode] = step()
        counted = top_level_ops(step)
        ops[mode] = {"total": sum(counted.values()), "matmuls": sum(counted[k] for k in MATMULS),
                     "top": counted.most_common(8)}
    for _ in range(steps):
        for mode, lean in modes.items():
            model.lean_ops = lean
            t0 = time.perf_counter()
            step()
            ms[mode].append((time.perf_counter() - t0) * 1e3)
    model.lean_ops = True
    med = {m: statistics.median(v) for m, v in ms.items()}
    return {"median_ms": med, "min_ms": {m: min(v) for m, v in ms.items()},
            "ratio_before_over_after": med["before"] / med["after"], "ops_per_step": ops,
            "logits_bit_equal": bool(torch.equal(logits["before"], logits["after"]))}


def run_paths(llm: LLM, args: argparse.Namespace, rows: list[int], kind: str, cpu_model: str) -> int:
    """--paths: per thread count and batch size, every kernel path's ms per decode step."""
    report: dict[str, Any] = {"cpu_model": cpu_model, "model": args.model, "dtype": args.dtype, "linear": kind,
                              "prompt_len": args.prompt_len, "paths": []}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for n in rows:
            load0 = os.getloadavg()[0]
            r = compare_paths(llm, decode_step(llm, args.prompt_len, n), args.steps)
            r.update(threads=threads, rows=n, load_average=[load0, os.getloadavg()[0]])
            report["paths"].append(r)
            print(f"\n{args.model} {args.dtype}, {n} sequence(s) at context {args.prompt_len}, {threads} thread(s), "
                  f"linear {kind} (fused where BLAS or the native GEMV has the row bucket, or MKL at any row count), "
                  f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
            for name in PATHS:
                print(f"  {name:<22} median {r['median_ms'][name]:8.2f} ms   reference / this "
                      f"{r['reference_over'][name]:5.2f}x   max |logit diff| {r['max_logit_diff'][name]:.1e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--linear", default="auto", choices=LINEAR_CHOICES)
    p.add_argument("--paths", action="store_true",
                   help="compare the CPU kernel paths (fused, native ops, native attention only, reference)")
    p.add_argument("--rows", default="1", help="--paths: comma-separated decode batch sizes (default 1)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if min(rows) < 1 or (not args.paths and rows != [1]):
        p.error("--rows takes sizes >= 1, and only with --paths")
    cpu_model, flags = cpu_identity()
    print(f"CPU: {cpu_model}; SIMD flags: {' '.join(f for f in SIMD_FLAGS if f in flags)}; "
          f"torch {torch.__version__}; load average at start {os.getloadavg()[0]:.2f}")
    blocks = max(rows) * (2 + args.prompt_len // 16) + 16
    llm = LLM(args.model, dtype=args.dtype, engine_config=EngineConfig(linear=args.linear, max_num_seqs=max(4, *rows),
                                                                        num_blocks=max(blocks, 256)))
    kind = f"{llm.model.linear.kind} {'/'.join(llm.model.linear.bucket_kinds)}".strip()
    if args.paths:
        return run_paths(llm, args, rows, kind, cpu_model)
    step = decode_step(llm, args.prompt_len)
    report: dict[str, Any] = {"cpu_model": cpu_model, "model": args.model, "dtype": args.dtype, "linear": kind,
                              "prompt_len": args.prompt_len, "runs": []}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        load0 = os.getloadavg()[0]
        r = compare(llm, step, args.steps)
        r.update(threads=threads, load_average=[load0, os.getloadavg()[0]])
        report["runs"].append(r)
        o = r["ops_per_step"]
        print(f"\n{args.model} {args.dtype}, batch 1, {threads} thread(s), linear {kind}, "
              f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        print(f"  before (per-tensor ops): median {r['median_ms']['before']:.2f} ms (min {r['min_ms']['before']:.2f}), "
              f"{o['before']['total']} ops/step ({o['before']['matmuls']} matmuls)")
        print(f"  after  (lean ops):       median {r['median_ms']['after']:.2f} ms (min {r['min_ms']['after']:.2f}), "
              f"{o['after']['total']} ops/step ({o['after']['matmuls']} matmuls)")
        print(f"  before / after: {r['ratio_before_over_after']:.3f}x; logits bit-equal: {r['logits_bit_equal']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
