"""Check every Triton kernel against its PyTorch twin on a CUDA device, then time both.

    python benchmarks/gpu_kernels.py               # checks, then the table
    python benchmarks/gpu_kernels.py --check-only  # checks only (what tests/test_kernels.py runs on a GPU)
    python benchmarks/gpu_kernels.py --sweep       # also sweep decode / MoE / MLA tuning knobs

Every case is guarded (``run_case``): a case that raises is recorded with its error and the next
one runs; under a ``Budget`` a case starts only while the stage's deadline leaves room for the
slowest case so far, and the rest are recorded as skipped (``benchmarks/gpu_check.py`` streams
each one to ``results.jsonl``).

Table columns: kernel, shape, time (ms, median of CUDA-event timings, L2 flushed between
iterations), achieved GB/s (the fewest bytes the kernel must move: each input read once, each
output written once) as % of the card's nominal HBM bandwidth (``NOMINAL_PEAKS``, by device
name: H100 SXM 3.35 TB/s, H200 4.8 TB/s; "n/a" for a card not in the table) and as % of a
device-to-device copy measured on the card (bytes read plus written, counted as the kernels
count theirs), TFLOP/s and % of the card's dense bf16 FLOP/s, the PyTorch reference's time and
the speedup over it. The headline is decode attention at long contexts: 32 sequences x 8k
context, 32 q / 8 kv heads, D=128, bf16 (goal: >= 70% of the measured copy); the fused MoE's goal
is >= 2x the PyTorch reference (its bytes are the weights of the experts the batch touches, its
FLOPs ``6 * pairs * I * H``). Kernels: paged decode and prefill attention (also with gpt-oss's
sinks and sliding window), RMSNorm + residual,
rotary, silu_and_mul, store_kv, fused MoE, MLA decode and prefill attention, the speculative
accept/reject step.

Without a CUDA device it says so and exits 0. It runs from a plain checkout too (without
``pip install``): ``kernels/`` is then loaded as ``kvbatch.kernels``.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import queue
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The cases (benchmarks/ is on the path: the script's folder, or put there by gpu_check and the tests).
import gpu_cases
from gpu_cases import (
    decode_case,
    fp8_gemm_case,
    mla_case,
    mla_prefill_case,
    moe_case,
    prefill_case,
    rms_norm_case,
    rotary_case,
    silu_and_mul_case,
    sinks_decode_case,
    sinks_prefill_case,
    store_kv_case,
    verify_case,
)

HEADLINE_GOAL = 0.70
MOE_SPEEDUP_GOAL = 2.0


def import_kernels():
    """(reference, dispatch, triton_attention, triton_rms_norm, triton_rotary, triton_store_kv,
    triton_moe, triton_mla, triton_verify, reference_mla, reference_verify, triton_activation,
    triton_fp8_gemm)."""
    try:
        import kvbatch.kernels  # noqa: F401
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[1]
        pkg = types.ModuleType("kvbatch")
        pkg.__path__ = []
        sys.modules["kvbatch"] = pkg
        spec = importlib.util.spec_from_file_location(
            "kvbatch.kernels", root / "kernels" / "__init__.py", submodule_search_locations=[str(root / "kernels")]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kvbatch.kernels"] = mod
        spec.loader.exec_module(mod)
    from kvbatch.kernels import (
        dispatch,
        reference,
        reference_mla,
        reference_verify,
        triton_activation,
        triton_attention,
        triton_fp8_gemm,
        triton_mla,
        triton_moe,
        triton_rms_norm,
        triton_rotary,
        triton_store_kv,
        triton_verify,
    )

    return (reference, dispatch, triton_attention, triton_rms_norm, triton_rotary, triton_store_kv,
            triton_moe, triton_mla, triton_verify, reference_mla, reference_verify, triton_activation, triton_fp8_gemm)


# ---------------------------------------------------------------------------------------------
# inputs



# ---------------------------------------------------------------------------------------------
# peaks by device name, and the device's own copy bandwidth


@dataclass(frozen=True)
class Peaks:
    """A card's nominal figures, from its data sheet: HBM bytes per second and dense bf16 FLOP/s."""

    hbm_bytes_per_s: float
    bf16_flop_per_s: float


# Matched against the words of ``torch.cuda.get_device_name()``, most specific first: the SXM H100
# calls itself "NVIDIA H100 80GB HBM3", the others add "PCIe" or "NVL"; "NVIDIA GH200 480GB" has
# the word GH200, not H200, and is unknown here (its memory differs by model).
NOMINAL_PEAKS: tuple[tuple[tuple[str, ...], Peaks], ...] = (
    (("H100", "PCIE"), Peaks(2.0e12, 756e12)),
    (("H100", "NVL"), Peaks(3.9e12, 835e12)),
    (("H100",), Peaks(3.35e12, 989e12)),
    (("H200",), Peaks(4.8e12, 989e12)),
)


def nominal_peaks(device_name: str) -> Peaks | None:
    """The nominal peaks of the card called ``device_name``; None for a card not in the table (its
    figures are then reported against the measured copy only)."""
    words = set(device_name.upper().replace("-", " ").split())
    for key, peaks in NOMINAL_PEAKS:
        if all(w in words for w in key):
            return peaks
    return None


# 1 GiB on CUDA: twenty times an H100's or H200's L2, so the copy reads and writes HBM.
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}


def copy_bytes_per_s(device: str | torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes read plus bytes written per second by a device-to-device ``copy_`` of ``nbytes``
    (``COPY_BYTES`` by default): the bandwidth a memory-bound kernel can hope for on this card,
    counted the way the kernels' own figures count theirs."""
    device = torch.device(device)
    nbytes = nbytes or COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def bandwidth_figures(nbytes: float, seconds: float, peaks: Peaks | None,
                      copy_per_s: float | None) -> dict[str, float | None]:
    """GB/s of ``nbytes`` moved in ``seconds``, as % of the card's nominal HBM bandwidth (None for a
    card not in the table) and as % of the copy measured on it (None when none was measured)."""
    per_s = nbytes / seconds if seconds > 0 else math.inf
    return {"GB/s": round(per_s / 1e9, 1),
            "%nominal": round(100 * per_s / peaks.hbm_bytes_per_s, 1) if peaks else None,
            "%copy": round(100 * per_s / copy_per_s, 1) if copy_per_s else None}


# ---------------------------------------------------------------------------------------------
# guarded cases under a time budget


class Budget:
    """A stage's time for its cases. A case starts only while the deadline leaves room for the
    slowest case run so far (and at least ``min_case_s``): the stage then skips its last cases, each
    recorded as skipped, instead of being killed by its time limit in the middle of one."""

    def __init__(self, deadline: float | None, min_case_s: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.deadline = deadline  # on ``clock``'s scale (seconds since the epoch by default)
        self.min_case_s = min_case_s
        self.clock = clock
        self.slowest_s = 0.0

    def left_s(self) -> float:
        return math.inf if self.deadline is None else self.deadline - self.clock()

    def allows(self) -> bool:
        return self.left_s() >= max(self.min_case_s, self.slowest_s)

    def spent(self, seconds: float) -> None:
        self.slowest_s = max(self.slowest_s, seconds)


Record = Callable[[dict[str, Any]], None]


def run_case(name: str, fn: Callable[[], dict[str, Any] | None], budget: Budget | None = None,
             record: Record | None = None) -> dict[str, Any]:
    """Run one case, guarded: ``fn`` returns its figures (``ok`` among them when it checks
    something). Returns, and hands to ``record``, ``{case, ok, figures, seconds, error}``: an
    exception is caught and recorded (type, message, the last frames of its traceback), so the
    next case runs; a case the budget has no room for is not run and is recorded as
    ``skipped: "budget"`` with ``ok`` None."""
    clock = budget.clock if budget is not None else time.perf_counter
    row: dict[str, Any] = {"case": name, "ok": None, "figures": {}, "seconds": 0.0, "error": None}
    if budget is not None and not budget.allows():
        row["skipped"] = "budget"
    else:
        t0 = clock()
        try:
            figures = dict(fn() or {})
            row["ok"] = bool(figures.pop("ok", True))
            row["figures"] = figures
        except Exception as exc:  # noqa: BLE001 - recorded; one failing case must not lose the others
            row["ok"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["traceback"] = "".join(traceback.format_exception(exc, limit=-6))[-3000:]
            _release_device_memory()
        row["seconds"] = round(clock() - t0, 3)
        if budget is not None:
            budget.spent(row["seconds"])
    if record is not None:
        record(row)
    return row


def _release_device_memory() -> None:
    """After a failed case: what it held goes back to the device (a broken context may refuse)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - the next case reports the broken context itself
            pass


def check_figures(case: tuple) -> dict[str, Any]:
    """A case's check, as figures: its verdict and largest error."""
    ok, err = case[2]()
    return {"ok": ok, "max_err": err}


# ---------------------------------------------------------------------------------------------
# timing


class Timer:
    def __init__(self, flush_bytes: int = 512 << 20):
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=gpu_cases.DEVICE)

    def median_ms(self, fn, warmup: int = 3, iters: int = 20) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            self.flush.zero_()  # evict L2 so every iteration reads from HBM
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


# bf16 first: the engine's dtype on a GPU, so a stage cut short by its budget loses the others.
CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_cases(K) -> list[tuple[str, Callable[[], tuple]]]:
    """Edge cases and mixed shapes, every kernel, every KV dtype: (name, builder) pairs. A case's
    inputs are built only when it runs, so one that fails to build is recorded like one that fails
    its check, and only one case's tensors are alive at a time."""
    cases: list[tuple[str, Callable[[], tuple]]] = []

    def add(name: str, make: Callable[..., tuple], *args: Any, **kwargs: Any) -> None:
        cases.append((name, functools.partial(make, K, *args, **kwargs)))

    for dtype in CHECK_DTYPES:
        dn = str(dtype).removeprefix("torch.")
        add(f"decode {dn} mixed lens, split", decode_case, 0, 0, 32, 8, 128, dtype,
            lens=[1, 17, 4096, 1000, 513, 16], seed=1)
        add(f"decode {dn} short, no split", decode_case, 0, 0, 12, 4, 64, dtype, lens=[1, 7, 300, 33], seed=2)
        add(f"decode {dn} D=80 group 5, block 32", decode_case, 0, 0, 10, 2, 80, dtype, block_size=32,
            lens=[77, 1025, 3], seed=3)
        add(f"decode {dn} empty context", decode_case, 0, 0, 8, 8, 128, dtype, lens=[0, 5, 0], seed=4)
        add(f"prefill {dn} chunked + full", prefill_case, [700, 1, 1500, 64], [300, 1, 1500, 0], 32, 8, 128,
            dtype, seed=5)
        add(f"prefill {dn} D=64 block 8", prefill_case, [129, 33], [65, 33], 9, 3, 64, dtype, block_size=8, seed=6)
        # gpt-oss's attention (64 q / 8 kv heads, D=64, sinks): a sliding layer's window of 128 and a full layer
        add(f"decode sinks {dn} gpt-oss, window 128, split", sinks_decode_case, [1, 17, 4096, 1000, 129, 128],
            64, 8, 64, dtype, window=128, seed=23)
        add(f"decode sinks {dn} gpt-oss full layer, split", sinks_decode_case, [1, 17, 4096, 1000, 513], 64, 8, 64,
            dtype, seed=24)
        add(f"decode sinks {dn} gpt-oss full layer, no split", sinks_decode_case, [1, 7, 300, 33], 64, 8, 64, dtype,
            seed=25, partition_size=2048)
        add(f"prefill sinks {dn} gpt-oss, window 128, chunked + full", sinks_prefill_case, [700, 1, 1500, 64],
            [300, 1, 1500, 64], 64, 8, 64, dtype, window=128, seed=26)
        add(f"prefill sinks {dn} gpt-oss full layer, block 8", sinks_prefill_case, [129, 33], [65, 33], 64, 8, 64,
            dtype, block_size=8, seed=27)
        add(f"rms_norm {dn} residual", rms_norm_case, 333, 4096, dtype)
        add(f"rms_norm {dn} no residual H=576", rms_norm_case, 7, 576, dtype, residual=False)
        add(f"rotary {dn} 9/3 heads D=64", rotary_case, 100, 9, 3, 64, dtype)
        add(f"silu_and_mul {dn} I=1536 (SmolLM2)", silu_and_mul_case, 7, 1536, dtype)
        add(f"silu_and_mul {dn} I=14336, odd rows", silu_and_mul_case, 333, 14336, dtype)
        add(f"store_kv {dn}", store_kv_case, 1000, 8, 128, dtype)
        add(f"fused_moe {dn} decode E64 k6", moe_case, 7, 1024, 352, 64, 6, dtype, seed=11)
        add(f"fused_moe {dn} prefill E8 k2, dropped ids", moe_case, 333, 512, 200, 8, 2, dtype, seed=12,
            out_of_range=0.3)
        add(f"fused_moe {dn} gpt-oss biases + clamped SwiGLU, E32 k4", moe_case, 9, 2880, 2880, 32, 4, dtype,
            seed=13, gpt_oss=True)
        add(f"fused_moe {dn} FP8 experts 128x128 blocks, E32 k4", moe_case, 9, 1024, 384, 32, 4, dtype, seed=28,
            fp8=True)
        add(f"fused_moe {dn} FP8 experts 32x40 blocks (scale gather), prefill", moe_case, 200, 320, 200, 8, 2,
            dtype, seed=29, fp8=True, block=(32, 40))
        add(f"fused_moe {dn} MXFP4 experts (gpt-oss-20b shapes) + biases + clamped SwiGLU, E32 k4", moe_case, 9,
            2880, 2880, 32, 4, dtype, seed=30, gpt_oss=True, mxfp4=True)
        add(f"fp8 gemm {dn} decode M=1, partial blocks", fp8_gemm_case, 1, 700, 1000, dtype, seed=20)
        add(f"fp8 gemm {dn} prefill M=333, bias", fp8_gemm_case, 333, 1536, 7168, dtype, seed=21, bias=True)
        add(f"fp8 gemm {dn} 32x40 blocks (scale gather)", fp8_gemm_case, 65, 100, 300, dtype, block=(32, 40), seed=22)
        add(f"mla decode {dn} mixed lens, split", mla_case, [1, 17, 4096, 1000, 513, 16], 16, 512, 64, dtype,
            seed=13)
        add(f"mla decode {dn} 128 heads, block 64", mla_case, [77, 1025, 3], 128, 512, 64, dtype, block_size=64,
            seed=14)
        add(f"mla prefill {dn} chunked + full, 16 heads C512 R64", mla_prefill_case, [700, 33, 1500],
            [300, 33, 1], 16, 512, 64, dtype, seed=19)
    add("store_kv fp32 -> bf16 cache", store_kv_case, 257, 3, 64, torch.bfloat16, block_size=5,
        src_dtype=torch.float32)
    add("decode B=0", decode_case, 0, 0, 8, 2, 64, torch.bfloat16, lens=[])
    add("mla decode empty context", mla_case, [0, 5, 0], 16, 512, 64, torch.bfloat16, seed=15)
    add("fused_moe T=0", moe_case, 0, 256, 128, 4, 2, torch.bfloat16)
    add("spec verify, draft probs", verify_case, 100, 4, 32000, seed=16)
    add("spec verify, one-hot drafts", verify_case, 37, 3, 1000, seed=17, one_hot=True)
    add("spec verify, k=0", verify_case, 5, 0, 100, seed=18)
    return cases


def check_suite(K, budget: Budget | None = None, record: Record | None = None) -> list[dict[str, Any]]:
    """Every case of ``check_cases``, each guarded (``run_case``): a case that raises is recorded
    with its error and the next one runs; cases the budget has no room for are recorded as skipped."""
    return [run_case(name, lambda make=make: check_figures(make()), budget, record)
            for name, make in check_cases(K)]


# A case a warm-up worker runs: the name of a ``*_case`` function of gpu_cases and its arguments after K.
WarmCase = tuple[str, tuple, dict]


def warm_spec(make: Callable[[], tuple]) -> WarmCase:
    """The picklable form of a ``check_cases`` builder (a partial of a ``*_case`` function over K)."""
    assert isinstance(make, functools.partial) and make.func.__module__ == gpu_cases.__name__, make
    return make.func.__name__, make.args[1:], dict(make.keywords)


def warm_cache(cases: list[WarmCase], workers: int, timeout_s: float) -> dict[str, Any]:
    """Compile ahead, in parallel: ``workers`` spawned processes share ``cases`` and launch each
    case's Triton kernel once. A launch compiles into Triton's on-disk cache, which every process of
    the machine shares, so the stage's own cases then load their kernels instead of compiling them
    one after another (~70-80 first compilations are most of the kernels stage on a fresh machine).
    Workers still running at ``timeout_s`` are stopped; what they compiled stays cached."""
    import multiprocessing

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # a spawned worker imports this module by name, from the parent's sys.path
        sys.path.append(here)
    ctx = multiprocessing.get_context("spawn")  # a fresh CUDA context per worker (fork cannot share one)
    results = ctx.Queue()
    procs = [ctx.Process(target=_warm_worker, args=(cases[i::workers], gpu_cases.DEVICE, results), daemon=True)
             for i in range(workers)]
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stopped = 0
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
            stopped += 1
    done = []
    for _ in range(sum(p.exitcode == 0 for p in procs)):  # one report per worker that finished
        try:
            done.append(results.get(timeout=5))
        except queue.Empty:
            break
    return {"workers": workers, "cases": len(cases), "launched": sum(d["launched"] for d in done),
            "failed": sum(d["failed"] for d in done), "stopped_at_timeout": stopped}


def _warm_worker(cases: list[WarmCase], device: str, results: Any) -> None:
    """One warm-up process: each case built and its Triton side run once; failures are left to
    the stage's own run of the case to report."""
    gpu_cases.DEVICE = device
    K = import_kernels()
    launched = failed = 0
    for name, args, kwargs in cases:
        try:
            getattr(gpu_cases, name)(K, *args, **kwargs)[0]()
            launched += 1
        except Exception:  # noqa: BLE001 - the stage's own run of this case records the error
            failed += 1
    results.put({"launched": launched, "failed": failed})


def bench_cases(K) -> list[tuple[str, str, Callable[[], tuple]]]:
    """(kernel, shape, builder): the timed cases, built one at a time when they run."""
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    mixed = torch.randint(1, 4097, (256,), generator=gen).tolist()
    P = functools.partial
    return [
        ("decode (headline)", "32 seq x 8k ctx, 32q/8kv, D128, bf16", P(decode_case, K, 32, 8192, 32, 8, 128, bf16)),
        ("decode", "32 seq x 32k ctx, 32q/8kv, D128, bf16", P(decode_case, K, 32, 32768, 32, 8, 128, bf16)),
        ("decode", "256 seq x 1..4k ctx, 32q/8kv, D128, bf16", P(decode_case, K, 0, 0, 32, 8, 128, bf16, lens=mixed)),
        ("decode", "32 seq x 8k ctx, 32q/8kv, D128, fp16", P(decode_case, K, 32, 8192, 32, 8, 128, torch.float16)),
        ("decode", "64 seq x 2k ctx, 9q/3kv, D64, bf16 (SmolLM2)", P(decode_case, K, 64, 2048, 9, 3, 64, bf16)),
        ("prefill", "4 x (2k cached + 2k new), 32q/8kv, D128, bf16",
         P(prefill_case, K, [4096] * 4, [2048] * 4, 32, 8, 128, bf16)),
        ("prefill", "8 x 1k new, 32q/8kv, D128, bf16", P(prefill_case, K, [1024] * 8, [1024] * 8, 32, 8, 128, bf16)),
        ("decode + sinks", "gpt-oss full layer: 32 seq x 8k ctx, 64q/8kv, D64, bf16",
         P(sinks_decode_case, K, [8192] * 32, 64, 8, 64, bf16)),
        ("prefill + sinks", "gpt-oss window 128: 4 x 2k new, 64q/8kv, D64, bf16",
         P(sinks_prefill_case, K, [2048] * 4, [2048] * 4, 64, 8, 64, bf16, window=128)),
        ("rms_norm + residual", "16k tok x 4096, bf16", P(rms_norm_case, K, 16384, 4096, bf16)),
        ("rotary (in place)", "16k tok, 32q/8kv, D128, bf16", P(rotary_case, K, 16384, 32, 8, 128, bf16)),
        ("silu_and_mul", "16k tok x I14336 (Llama-3.1-8B MLP), bf16", P(silu_and_mul_case, K, 16384, 14336, bf16)),
        ("silu_and_mul", "64 tok x I1536 (SmolLM2 decode), bf16", P(silu_and_mul_case, K, 64, 1536, bf16)),
        ("store_kv", "16k tok, 8kv, D128, bf16", P(store_kv_case, K, 16384, 8, 128, bf16)),
        ("fused MoE", "Mixtral decode: 32 tok, E8 k2, H4096 I14336, bf16", P(moe_case, K, 32, 4096, 14336, 8, 2, bf16)),
        ("fused MoE", "Qwen3-30B-A3B decode: 64 tok, E128 k8, H2048 I768",
         P(moe_case, K, 64, 2048, 768, 128, 8, bf16)),
        ("fused MoE", "Qwen3-30B-A3B prefill: 8k tok, E128 k8, bf16", P(moe_case, K, 8192, 2048, 768, 128, 8, bf16)),
        ("fused MoE", "Mixtral prefill: 4k tok, E8 k2, bf16", P(moe_case, K, 4096, 4096, 14336, 8, 2, bf16)),
        ("MLA decode", "32 seq x 8k ctx, 16 heads, C512 R64, bf16", P(mla_case, K, [8192] * 32, 16, 512, 64, bf16)),
        ("MLA decode", "32 seq x 8k ctx, 128 heads, C512 R64, bf16", P(mla_case, K, [8192] * 32, 128, 512, 64, bf16)),
        ("MLA decode", "128 seq x 1..4k ctx, 16 heads, C512 R64, bf16", P(mla_case, K, mixed[:128], 16, 512, 64, bf16)),
        ("MLA prefill", "4 x (2k cached + 2k new), 16 heads, C512 R64, bf16",
         P(mla_prefill_case, K, [4096] * 4, [2048] * 4, 16, 512, 64, bf16)),
        ("spec verify", "256 req x 4 drafts, V=152k, draft probs", P(verify_case, K, 256, 4, 152064)),
        # the FP8 GEMM against cuBLAS over the dequantized bf16 weight (Qwen3-8B-FP8, DeepSeek-V3 shapes)
        ("FP8 GEMM", "Qwen3-8B gate/up decode: 32 x 4096 -> 24576, bf16", P(fp8_gemm_case, K, 32, 24576, 4096, bf16)),
        ("FP8 GEMM", "Qwen3-8B down decode: 1 x 12288 -> 4096, bf16", P(fp8_gemm_case, K, 1, 4096, 12288, bf16)),
        ("FP8 GEMM", "DeepSeek-V3 q_a decode: 64 x 7168 -> 1536, bf16", P(fp8_gemm_case, K, 64, 1536, 7168, bf16)),
        ("FP8 GEMM", "Qwen3-8B qkv prefill: 8k x 4096 -> 6144, bf16", P(fp8_gemm_case, K, 8192, 6144, 4096, bf16)),
    ]


def bench_figures(case: tuple, timer: Timer, peaks: Peaks | None, copy_per_s: float | None,
                  time_reference: bool = True) -> dict[str, Any]:
    """One timed case: its check, its time and the reference's, and whichever roofline binds (the
    larger fraction of the card's nominal FLOP/s or bandwidth; bandwidth also against the copy)."""
    run, ref, check, nbytes, flops = case
    ok, _ = check()
    ms = timer.median_ms(run)
    ref_ms = timer.median_ms(ref, warmup=1, iters=5) if time_reference else math.nan
    figures: dict[str, Any] = {"ok": ok, "ms": round(ms, 4), **bandwidth_figures(nbytes, ms * 1e-3, peaks, copy_per_s),
                               "TF/s": round(flops / ms / 1e9, 1),
                               "%nominal_flops": round(100 * flops / (ms * 1e-3) / peaks.bf16_flop_per_s, 1)
                               if peaks else None,
                               "ref_ms": round(ref_ms, 4), "speedup": round(ref_ms / ms, 2)}
    return figures


def _sweep(label: str, header: str, configs: list[tuple[tuple, Callable[[], tuple]]], timer: Timer,
           peaks: Peaks | None, copy_per_s: float | None) -> None:
    print(f"\n{label}:\n{header}")
    for knobs, make in configs:
        def timed(make: Callable[[], tuple] = make) -> dict[str, Any]:
            run, _, check, nbytes, _ = make()
            ok, _ = check()
            ms = timer.median_ms(run, iters=10)
            return {"ok": ok, "ms": ms, **bandwidth_figures(nbytes, ms * 1e-3, peaks, copy_per_s)}

        # A config that does not compile (shared memory, say) is printed as failed; the sweep goes on.
        row = run_case(str(knobs), timed)
        cols = " ".join(f"{k:>6}" for k in knobs)
        if row["error"]:
            print(f"{cols}  failed: {row['error'].split(':')[0]}")
            continue
        f = row["figures"]
        print(f"{cols} {f['ms']:8.3f} {f['GB/s']:7.0f} {_pct(f['%nominal']):>8} {_pct(f['%copy']):>6}"
              f"{'' if row['ok'] else '  WRONG'}")
        _release_device_memory()


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%"


def sweep_decode(K, timer: Timer, peaks: Peaks | None = None, copy_per_s: float | None = None) -> None:
    configs = [((block_n, partition_size, num_warps, num_stages),
                functools.partial(decode_case, K, 32, 8192, 32, 8, 128, torch.bfloat16, block_n=block_n,
                                  partition_size=partition_size, num_warps=num_warps, num_stages=num_stages))
               for block_n in (32, 64, 128) for partition_size in (256, 512, 1024, 2048)
               for num_warps in (4, 8) for num_stages in (2, 3, 4)]
    _sweep("decode sweep, 32 seq x 8k ctx, 32q/8kv, D128, bf16",
           "block_n partit  warps stages       ms    GB/s %nominal  %copy", configs, timer, peaks, copy_per_s)


def sweep_moe_mla(K, timer: Timer, peaks: Peaks | None = None, copy_per_s: float | None = None) -> None:
    """Tile configurations of the fused MoE (decode and prefill shapes) and of MLA decode."""
    bf16 = torch.bfloat16
    for label, (T, H, I, E, k) in (("Qwen3-MoE decode 64 tok", (64, 2048, 768, 128, 8)),
                                   ("Qwen3-MoE prefill 8k tok", (8192, 2048, 768, 128, 8))):
        configs = [((bm, bn, bk, num_warps, num_stages),
                    functools.partial(moe_case, K, T, H, I, E, k, bf16, block_m=bm, block_n=bn, block_k=bk,
                                      num_warps=num_warps, num_stages=num_stages))
                   for bm in (16, 32, 64) for bn, bk in ((64, 64), (64, 128), (128, 64), (128, 128))
                   for num_warps, num_stages in ((4, 3), (4, 4), (8, 3))]
        _sweep(f"fused MoE sweep, {label}", "    bm     bn     bk  warps stages       ms    GB/s %nominal  %copy",
               configs, timer, peaks, copy_per_s)
    configs = [((block_n, partition_size, num_warps, num_stages),
                functools.partial(mla_case, K, [8192] * 32, 16, 512, 64, bf16, block_n=block_n,
                                  partition_size=partition_size, num_warps=num_warps, num_stages=num_stages))
               for block_n in (16, 32, 64) for partition_size in (512, 1024, 2048)
               for num_warps, num_stages in ((4, 2), (4, 3), (8, 2))]
    _sweep("MLA decode sweep, 32 seq x 8k ctx, 16 heads, C512 R64, bf16",
           "block_n partit  warps stages       ms    GB/s %nominal  %copy", configs, timer, peaks, copy_per_s)


def _verdict(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return "skip"
    return "ok" if row["ok"] else ("ERR" if row["error"] else "FAIL")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true", help="check the kernels against their twins; no timing")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep the tuning arguments of decode attention, fused MoE and MLA decode")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the PyTorch reference")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; the GPU checks and figures need one (nothing to do).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu_kernels: triton is not importable; the Triton kernels need it.")
        return 1
    K = import_kernels()
    dispatch = K[1]
    assert dispatch.backend(torch.empty(1, device=gpu_cases.DEVICE)) in ("triton", "reference")
    name = torch.cuda.get_device_name()
    peaks = nominal_peaks(name)
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"dispatch on CUDA -> {dispatch.backend(torch.empty(1, device=gpu_cases.DEVICE))}")

    failed = 0
    print(f"\n{'check':<48} {'ok':>4} {'max |err|':>10}")
    for row in check_suite(K):
        failed += row["ok"] is False
        err = row["figures"].get("max_err", math.nan)
        print(f"{row['case']:<48} {_verdict(row):>4} {err:10.2e}" + (f"  {row['error']}" if row["error"] else ""))
    if args.check_only:
        print(f"\n{failed} check(s) failed" if failed else "\nall checks passed")
        return 1 if failed else 0

    copy_per_s = copy_bytes_per_s(gpu_cases.DEVICE)
    nominal = f"{peaks.hbm_bytes_per_s / 1e12:.2f} TB/s nominal" if peaks else "not in the peak table"
    print(f"\ndevice-to-device copy: {copy_per_s / 1e9:.0f} GB/s (read + written); HBM {nominal}")
    timer = Timer()
    header = (f"{'kernel':<20} {'shape':<46} {'ms':>8} {'GB/s':>7} {'%nominal':>8} {'%copy':>6} {'TF/s':>7} "
              f"{'%nomFLOP':>8} {'ref ms':>8} {'speedup':>7} {'check':>5}")
    rows = [header, "-" * len(header)]
    headline: float | None = None
    moe_speedups = []
    for kernel, shape, make in bench_cases(K):
        row = run_case(f"{kernel}: {shape}", lambda make=make: bench_figures(make(), timer, peaks, copy_per_s,
                                                                                not args.skip_reference))
        failed += row["ok"] is False
        if row["error"]:
            rows.append(f"{kernel:<20} {shape:<46} failed: {row['error']}")
            continue
        f = row["figures"]
        if kernel == "fused MoE":
            moe_speedups.append(f["speedup"])
        if headline is None and kernel.startswith("decode"):
            headline = f["%copy"]
        rows.append(f"{kernel:<20} {shape:<46} {f['ms']:8.3f} {f['GB/s']:7.0f} {_pct(f['%nominal']):>8} "
                    f"{_pct(f['%copy']):>6} {f['TF/s']:7.1f} {_pct(f['%nominal_flops']):>8} {f['ref_ms']:8.3f} "
                    f"{f['speedup']:6.1f}x {_verdict(row):>5}")
        _release_device_memory()
    if args.sweep:
        sweep_decode(K, timer, peaks, copy_per_s)
        sweep_moe_mla(K, timer, peaks, copy_per_s)
    print()
    print("\n".join(rows))
    if headline is not None:
        print(f"\nheadline decode: {headline:.0f}% of the measured copy bandwidth (goal >= {HEADLINE_GOAL:.0%})"
              f"{'' if headline >= 100 * HEADLINE_GOAL else ' -- BELOW GOAL'}")
    if moe_speedups and not args.skip_reference:
        worst = min(moe_speedups)
        print(f"fused MoE: at least {worst:.1f}x the PyTorch reference (goal >= {MOE_SPEEDUP_GOAL:.0f}x)"
              f"{'' if worst >= MOE_SPEEDUP_GOAL else ' -- BELOW GOAL'}")
    print(f"{failed} check(s) failed" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
