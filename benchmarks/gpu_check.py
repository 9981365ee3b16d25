"""The one prepared GPU check: the engine on CUDA, its kernels, and its speed, in one command.

    python benchmarks/gpu_check.py --out DIR            # on a CUDA machine (H100 or H200)
    python benchmarks/gpu_check.py --out DIR --warm-cache  # the same, first compilations in parallel workers
    python benchmarks/gpu_check.py --out DIR --smoke    # every stage on the CPU: tiny shapes, Triton interpreter
    python benchmarks/gpu_check.py --out DIR --compile-only [--arch 90] [--subset]
                                                        # every kernel compiled for sm_90 on the CPU (no GPU):
                                                        # benchmarks/gpu_compile.py, DIR/compile.jsonl

Stages, each in its own subprocess with its own time limit:

1. ``env``: versions, device, free memory, and a device-to-device copy of 1 GiB (bytes read plus
   written per second): the bandwidth every later figure is also compared with.
2. ``kernels``: paged decode on the issue's grid first (head dim 64 with GQA 9:3, 128 with 32:8;
   block 16; contexts 1/15/16/17/4096/32768; batch 1/7/64): max error, µs, GB/s, % of the card's
   nominal HBM bandwidth (by device name: H100 SXM 3.35 TB/s, H200 4.8 TB/s; none for a card not in
   ``gpu_kernels.NOMINAL_PEAKS``) and % of the measured copy; then every Triton kernel against its
   PyTorch twin (``gpu_kernels.check_cases``, bf16 first).
3. ``engine``: the engine on the device against the same engine on the CPU (tiny dense and MoE
   models, and a Gemma 3 whose sliding layers hold only their window; fp32, IEEE matmuls): greedy tokens identical, graph replay equal to eager bit for bit,
   device-to-host syncs per step (``torch.cuda.set_sync_debug_mode``).
4. ``throughput``: random weights of Llama-3.1-8B and SmolLM2-135M shapes, built directly in bf16
   on the device (no fp32 copy), batch 1/64/256, 128 prompt and 256 output tokens: the engine with
   CUDA graphs, transformers ``generate`` on the same model in the same run, then the engine eager:
   tok/s, ms per step, bandwidth of the weights + KV read per step (GB/s, % nominal, % copy).
5. ``kv_staging``: KV-store loads and saves through the pinned staging pool on a side stream
   against the direct copies (SmolLM2 and Llama-3.1-8B cache shapes, bf16): GB/s (host <-> device,
   so not compared with HBM), bytes equal; then blocks written by the engine on the GPU decoded by
   the engine on the CPU, and back.

Results that survive. Every case appends one JSON line to ``DIR/results.jsonl`` as it finishes,
written and flushed by the stage's own process (so a stage killed by its limit keeps what it had
finished): ``run`` (this invocation), ``stage``, ``table``, ``case``, ``ok`` (true, false, or null
when not run), ``figures``, ``seconds``, ``error`` (exception type and message; ``traceback`` holds
its last frames) and, for a case not run, ``skipped: "budget"``. A case that raises is recorded and
the next one runs. The parent adds one line per stage (``table: "stages"``: exit status, wall
time) and rebuilds ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` from this run's lines after
every stage.

Time budgets. The device lends 15 minutes a session, at most 10 per command, and starting a
machine takes about 2 of them. The stage limits (``LIMITS_S``) add up to 380 s, plus about 10 s of
the parent's own start: one run is at most 6.5 minutes, within 8 and well inside one 10-minute
command (run it with ``timeout_s=420``), and 120 s to start + 2 x 390 s = 900 s, so a second run on
the same warm machine still fits the 15 minutes. Inside a stage each case starts only while the
stage's deadline (its limit less ``HEADROOM_S``, for the child's exit and the parent's writes)
leaves room for the slowest case so far (``gpu_kernels.Budget``), so a stage whose first
compilations (~70-80 Triton kernels in ``kernels``) run long records its last cases as skipped
instead of being killed (``--warm-cache`` compiles them first, in parallel: ``WARM_WORKERS``);
cases run in order of importance (the issue's decode grid, then bf16, then
the other dtypes; in ``throughput`` the 8B with graphs, then transformers, then eager).

``--smoke`` runs the same stages on the CPU (Triton interpreter, the CUDA weight layout, tiny
shapes) so the first GPU run cannot die of a typo. Runs from a plain checkout (no ``pip install``:
the repository is mapped to ``kvbatch``) with only torch, triton, transformers, numpy,
safetensors, tokenizers, fsspec and jinja2 installed, on the device image's Python 3.12, torch
2.11 and Triton 3.6 (it touches no Triton API but the version: only the kernels depend on it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_model_stages import stage_engine, stage_kv_staging, stage_throughput  # benchmarks/ is on the path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "kernels", "engine", "throughput", "kv_staging")
# Seconds per stage on an H100 or H200, first Triton compilations included (the arithmetic is in
# the module docstring), and in --smoke on a CPU.
LIMITS_S = {"env": 20, "kernels": 125, "engine": 45, "throughput": 155, "kv_staging": 35}
# The CPU has no device budget: its limits are wide, so a loaded CI machine skips no case.
SMOKE_LIMITS_S = {"env": 60, "kernels": 120, "engine": 150, "throughput": 120, "kv_staging": 150}
# A stage's cases stop starting this long before its limit: the child's exit and the parent's writes.
HEADROOM_S = 5.0
RESULTS = "results.jsonl"
# --warm-cache: (workers, seconds) of the kernels stage's parallel first compilation, on the
# device machine's 16 cores and in --smoke; decode grid points past this context are not warmed
# (eight workers' caches of 32k x 64 sequences would not fit an H100 together).
WARM_WORKERS = (8, 45.0)
WARM_WORKERS_SMOKE = (2, 60.0)
WARM_MAX_CONTEXT = 4096


class _ImportBlocker:
    """A meta-path finder refusing some top-level packages, so a CPU run imports what the H200
    image can (``--block-imports``). ``kvbatch`` blocks only the installed package: the checkout
    is then mapped in its place, as on a machine where it is not installed."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        top = name.split(".")[0]
        if top in self.names and (top != "kvbatch" or name == "kvbatch"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by --block-imports)")


def _block_imports() -> None:
    names = [n for n in os.environ.get("KVBATCH_GPU_CHECK_BLOCK", "").split(",") if n]
    if names:
        sys.meta_path.insert(0, _ImportBlocker(names))  # type: ignore[arg-type]


def _map_repo() -> None:
    """``import kvbatch.<folder>`` from a plain checkout: the repository root is the package path."""
    try:
        import kvbatch.engine  # noqa: F401
    except ModuleNotFoundError:
        pkg = types.ModuleType("kvbatch")
        pkg.__path__ = [str(REPO)]
        sys.modules["kvbatch"] = pkg
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))


# ---------------------------------------------------------------------------------------------
# results.jsonl: one line per case, appended as it finishes


def append_line(out: Path, line: dict[str, Any]) -> None:
    """One JSON line, written and flushed at once: a process killed after this keeps it."""
    with (out / RESULTS).open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")
        f.flush()


def read_lines(out: Path, run: str) -> list[dict[str, Any]]:
    """This run's lines (earlier runs into the same folder are kept in the file, not in the report);
    a last line cut short by a kill is ignored."""
    path = out / RESULTS
    lines = []
    for text in path.read_text().splitlines() if path.exists() else []:
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if line.get("run") == run:
            lines.append(line)
    return lines


def stage_result(lines: list[dict[str, Any]], stage: str) -> dict[str, Any]:
    """A stage's result as the report shows it, from its lines: each table's rows (the case, its
    figures, ok, seconds, and the error or skip), the untabled cases' figures as scalars, and the
    counts of cases, failures and skips."""
    result: dict[str, Any] = {}
    mine = [ln for ln in lines if ln["stage"] == stage and ln.get("table") != "stages"]
    for ln in mine:
        if ln.get("table"):
            row = {"case": ln["case"], **ln.get("figures", {}), "ok": ln["ok"], "s": ln.get("seconds")}
            for key in ("error", "skipped"):
                if ln.get(key):
                    row[key] = ln[key]
            result.setdefault(ln["table"], []).append(row)
        else:
            result.update(ln.get("figures", {}))
        if ln.get("error") or ln.get("skipped"):
            result.setdefault("not_ok", []).append({"case": ln["case"], "error": ln.get("error") or "",
                                                    "skipped": ln.get("skipped") or ""})
    result.update(cases=len(mine), failed=sum(ln["ok"] is False for ln in mine),
                  skipped=sum(bool(ln.get("skipped")) for ln in mine))
    return result


# ---------------------------------------------------------------------------------------------
# the parent: stages in subprocesses, the report after each


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"


def run_stages(out: Path, smoke: bool, stages: tuple[str, ...], block: str = "",
               limits: dict[str, float] | None = None, warm_cache: bool = False) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    limits = limits or (SMOKE_LIMITS_S if smoke else LIMITS_S)
    run = new_run_id()
    report: dict[str, Any] = {"run": run, "smoke": smoke, "warm_cache": warm_cache, "blocked_imports": block,
                              "stages": {}}
    for stage in stages:
        deadline = time.time() + limits[stage] - HEADROOM_S
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--out", str(out),
               "--run-id", run, "--deadline", f"{deadline:.3f}"]
        if smoke:
            cmd.append("--smoke")
        if warm_cache:
            cmd.append("--warm-cache")
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limits[stage],
                                  env={**_stage_env(smoke), "KVBATCH_GPU_CHECK_BLOCK": block}, check=False)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            status = f"timeout after {limits[stage]} s"
            tail = ((exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace"))[-3000:]
        wall = round(time.perf_counter() - started, 1)
        append_line(out, {"run": run, "stage": stage, "table": "stages", "case": f"stage {stage}",
                          "ok": status == "ok", "figures": {"status": status, "limit_s": limits[stage]},
                          "seconds": wall, "error": None if status == "ok" else f"{status}: {tail[-500:]}"})
        report["stages"][stage] = {"status": status, "wall_s": wall,
                                   "result": stage_result(read_lines(out, run), stage),
                                   **({"log_tail": tail} if status != "ok" else {})}
        write_report(out, report)
        res = report["stages"][stage]["result"]
        print(f"gpu_check: {stage}: {status} ({wall} s; {res['cases']} cases, {res['failed']} failed, "
              f"{res['skipped']} skipped)", flush=True)
    return report


def _stage_env(smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    if smoke:  # before triton is imported in the child
        env.update(TRITON_INTERPRET="1", KVBATCH_KERNELS="triton", KVBATCH_LINEAR="cublas")
    return env


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "error"))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")
    return lines


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None:
        return "n/a"
    return str(v).replace("|", "/").replace("\n", " ")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check{' (smoke, CPU)' if report['smoke'] else ''}", "", f"run {report['run']}", ""]
    for stage, entry in report["stages"].items():
        lines += [f"## {stage}: {entry['status']} ({entry['wall_s']} s)", ""]
        for key, value in entry["result"].items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                lines += [f"### {key}", "", *_table(value), ""]
            else:
                lines.append(f"- {key}: {_cell(value)}")
        if "log_tail" in entry:
            lines += ["", "```", entry["log_tail"], "```"]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the stages (each in a child process; every case goes through ``Stage.case``)


class Stage:
    """One stage's process: its device, its budget, and its cases' lines in ``results.jsonl``."""

    def __init__(self, out: Path, name: str, smoke: bool, run: str = "", deadline: float | None = None,
                 warm_cache: bool = False) -> None:
        import gpu_kernels as G
        import torch

        self.out, self.name, self.smoke, self.run, self.warm_cache = out, name, smoke, run, warm_cache
        self.device = torch.device("cpu" if smoke else "cuda")
        self.budget = G.Budget(deadline)
        self.lines: list[dict[str, Any]] = []
        self._copy_per_s: float | None = None
        self._copy_looked = False

    def case(self, name: str, fn: Callable[[], dict[str, Any] | None], table: str | None = None,
             budgeted: bool = True) -> dict[str, Any]:
        """Run ``fn`` as one guarded, budgeted case (``gpu_kernels.run_case``) and append its line."""
        import gpu_kernels as G

        return G.run_case(name, fn, self.budget if budgeted else None, lambda row: self.record(row, table))

    def summary(self, **figures: Any) -> None:
        """The stage's verdict over its cases, as one more line: outside the budget (it takes no
        time, and a stage cut short must still say so)."""
        import gpu_kernels as G

        G.run_case("summary", lambda: figures, None, lambda row: self.record(row, None))

    def record(self, row: dict[str, Any], table: str | None) -> None:
        line = {"run": self.run, "stage": self.name, "table": table, **row}
        append_line(self.out, line)
        self.lines.append(line)

    def rows(self, table: str) -> list[dict[str, Any]]:
        return [ln for ln in self.lines if ln["table"] == table]

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @property
    def peaks(self) -> Any:
        """The card's nominal peaks by its name (None on the CPU and for a card not in the table)."""
        import gpu_kernels as G
        import torch

        return G.nominal_peaks(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None

    def copy_per_s(self) -> float | None:
        """The device copy the env stage of this run measured; measured here (and recorded) if none."""
        if not self._copy_looked:
            self._copy_looked = True
            for ln in read_lines(self.out, self.run):
                if ln["stage"] == "env" and ln.get("figures", {}).get("copy_GB_s"):
                    self._copy_per_s = ln["figures"]["copy_GB_s"] * 1e9
            if self._copy_per_s is None:
                self.case("device copy", lambda: copy_figures(self))
                self._copy_per_s = (self.lines[-1]["figures"].get("copy_GB_s") or 0) * 1e9 or None
        return self._copy_per_s

    def bandwidth(self, nbytes: float, seconds: float) -> dict[str, Any]:
        import gpu_kernels as G

        return G.bandwidth_figures(nbytes, seconds, self.peaks, self.copy_per_s())


def copy_figures(st: Stage) -> dict[str, Any]:
    import gpu_kernels as G

    per_s = G.copy_bytes_per_s(st.device)
    peaks = st.peaks
    return {"copy_GB_s": round(per_s / 1e9, 1),
            "nominal_HBM_GB_s": round(peaks.hbm_bytes_per_s / 1e9) if peaks else None,
            "copy_%nominal": round(100 * per_s / peaks.hbm_bytes_per_s, 1) if peaks else None}


def stage_env(st: Stage) -> None:
    st.case("versions", lambda: env_info(st))
    st.case("device copy", lambda: copy_figures(st))


def env_info(st: Stage) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine()}
    for name in ("triton", "transformers", "numpy", "safetensors"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "missing"
    for name in ("pydantic", "polars", "dagster"):  # the engine's GPU path must not need them
        info[f"{name}_present"] = _importable(name)
    if st.device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        info.update(device=torch.cuda.get_device_name(),
                    capability=".".join(map(str, torch.cuda.get_device_capability())),
                    free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1),
                    peaks_known=st.peaks is not None)
    else:
        info.update(device="cpu (smoke)", threads=torch.get_num_threads())
    from kvbatch.engine.runtime.llm import LLM  # noqa: F401 - the engine imports without pydantic & co
    from kvbatch.kernels import dispatch

    info["dispatch"] = dispatch.backend(torch.empty(1, device=st.device))
    return info


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _time_us(st: Stage, fn: Any, iters: int) -> float:
    import statistics

    import torch

    fn()
    if st.device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def decode_grid(smoke: bool) -> list[tuple[int, int, int, int, int]]:
    """(D, Hq, Hkv, context, batch) of the paged decode grid, in the order it runs."""
    if smoke:
        grid, contexts, batches = [(64, 9, 3)], [1, 15, 16, 17], [1, 3]
    else:
        grid, contexts, batches = [(64, 9, 3), (128, 32, 8)], [1, 15, 16, 17, 4096, 32768], [1, 7, 64]
    return [(D, Hq, Hkv, ctx, B) for D, Hq, Hkv in grid for ctx in contexts for B in batches]


def smoke_check_cases(K: Any) -> list[tuple[str, Callable[[], tuple]]]:
    """In --smoke: each kernel once, on small shapes (the interpreter is ~100x slower than torch)."""
    import functools

    import gpu_kernels as G
    import torch

    f32, P = torch.float32, functools.partial
    return [("prefill", P(G.prefill_case, K, [20, 5], [9, 5], 9, 3, 64, f32)),
            ("rms_norm", P(G.rms_norm_case, K, 7, 64, f32)), ("rotary", P(G.rotary_case, K, 5, 9, 3, 64, f32)),
            ("store_kv", P(G.store_kv_case, K, 9, 3, 64, f32)), ("fused_moe", P(G.moe_case, K, 5, 32, 16, 4, 2, f32)),
            ("mla_decode", P(G.mla_case, K, [1, 17], 4, 32, 16, f32)), ("spec_verify", P(G.verify_case, K, 4, 2, 50)),
            ("silu_and_mul", P(G.silu_and_mul_case, K, 5, 40, f32)),
            ("mla_prefill", P(G.mla_prefill_case, K, [9, 5], [4, 5], 2, 16, 8, f32, block_size=4)),
            ("fp8_gemm", P(G.fp8_gemm_case, K, 3, 70, 100, f32)),
            ("sinks_decode", P(G.sinks_decode_case, K, [1, 17, 40], 8, 2, 16, f32, window=8, partition_size=16)),
            ("sinks_prefill", P(G.sinks_prefill_case, K, [20, 5], [9, 5], 8, 2, 16, f32, window=8))]


def stage_kernels(st: Stage) -> None:
    import gpu_kernels as G
    import torch

    st.copy_per_s()
    G.gpu_cases.DEVICE = str(st.device)  # the cases are built on the stage's device
    K = G.import_kernels()
    dtype = torch.float32 if st.smoke else torch.bfloat16
    checks = smoke_check_cases(K) if st.smoke else G.check_cases(K)
    if st.warm_cache:  # outside the budget's slowest-case rule: it runs once, first
        warm = [G.warm_spec(make) for _, make in checks] + [
            ("decode_case", (B, ctx, Hq, Hkv, D, dtype), {"block_size": 16})
            for D, Hq, Hkv, ctx, B in decode_grid(st.smoke) if ctx <= WARM_MAX_CONTEXT]
        workers, timeout_s = WARM_WORKERS_SMOKE if st.smoke else WARM_WORKERS
        st.case("warm Triton cache", lambda: G.warm_cache(warm, workers, timeout_s), budgeted=False)
    for D, Hq, Hkv, ctx, B in decode_grid(st.smoke):
        def decode(D: int = D, Hq: int = Hq, Hkv: int = Hkv, ctx: int = ctx, B: int = B) -> dict[str, Any]:
            run, _, check, nbytes, _ = G.decode_case(K, B, ctx, Hq, Hkv, D, dtype, block_size=16)
            ok, err = check()
            us = _time_us(st, run, 1 if st.smoke else 20)
            return {"D": D, "GQA": f"{Hq}:{Hkv}", "ctx": ctx, "batch": B, "ok": ok, "max_err": err,
                    "us": round(us, 1), **st.bandwidth(nbytes, us * 1e-6)}

        st.case(f"decode D{D} {Hq}:{Hkv} ctx {ctx} batch {B}", decode, table="decode")
    if st.smoke:
        for name, make in checks:
            st.case(name, lambda make=make: G.check_figures(make()), table="checks")
    else:
        G.check_suite(K, st.budget, lambda row: st.record(row, "checks"))




STAGE_FUNCTIONS: dict[str, Callable[[Stage], None]] = {
    "env": stage_env, "kernels": stage_kernels, "engine": stage_engine, "throughput": stage_throughput,
    "kv_staging": stage_kv_staging}


def run_stage(stage: str, out: Path, smoke: bool, run: str = "", deadline: float | None = None,
              warm_cache: bool = False) -> int:
    """The child: the stage's cases, each line appended as it finishes. An error outside any case
    (the stage's own set-up) is recorded as a line too, and the exit status says it failed."""
    _block_imports()
    _map_repo()
    st = Stage(out, stage, smoke, run, deadline, warm_cache)
    try:
        STAGE_FUNCTIONS[stage](st)
    except Exception as exc:  # noqa: BLE001 - recorded, then the exit status says it failed
        st.record({"case": f"stage {stage} set-up", "ok": False, "figures": {}, "seconds": 0.0,
                   "error": f"{type(exc).__name__}: {exc}"[:2000],
                   "traceback": traceback.format_exc()[-3000:]}, None)
        traceback.print_exc()
        return 1
    return 0


def compile_only(out: Path, arch: int, subset: bool) -> int:
    """``--compile-only``: every kernel compiled for ``sm_<arch>`` on this machine, no GPU needed
    (``benchmarks/gpu_compile.py`` writes ``out/compile.jsonl``)."""
    _map_repo()
    try:
        import gpu_compile
    except ModuleNotFoundError as exc:
        if exc.name != "gpu_compile":
            raise
        print("gpu_check: --compile-only needs benchmarks/gpu_compile.py, which is not in this checkout",
              file=sys.stderr)
        return 2
    return int(gpu_compile.main(["--arch", str(arch), "--out", str(out), *(["--subset"] if subset else [])]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for results.jsonl, gpu_check.json, "
                        "gpu_check.md (compile.jsonl with --compile-only)")
    parser.add_argument("--smoke", action="store_true", help="every stage on the CPU, tiny shapes, Triton interpreter")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--block-imports", default="", metavar="PKGS",
                        help="comma-separated packages the stages must run without (e.g. what the H200 image "
                             "lacks: pydantic,polars,dagster,s3fs,gguf; kvbatch: as from a plain checkout)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile every kernel configuration for --arch on this machine (no GPU), "
                             "write OUT/compile.jsonl, and run no stage")
    parser.add_argument("--arch", type=int, default=90, help="with --compile-only: the sm_ version (90: Hopper)")
    parser.add_argument("--subset", action="store_true", help="with --compile-only: the representative subset CI runs")
    parser.add_argument("--warm-cache", action="store_true",
                        help="kernels stage: first launch every checked kernel once in parallel worker processes, "
                             "filling Triton's cache, so the stage's cases do not compile one after another")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--run-id", default="", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # seconds since the epoch
    args = parser.parse_args(argv)
    if args.stage:
        return run_stage(args.stage, args.out, args.smoke, args.run_id, args.deadline, args.warm_cache)
    if args.compile_only:
        if args.smoke:
            parser.error("--compile-only runs no stage; leave out --smoke")
        return compile_only(args.out, args.arch, args.subset)
    stages = tuple(s for s in args.stages.split(",") if s)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage {unknown[0]!r} (stages: {', '.join(STAGES)})")
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --smoke to check every stage on the CPU", file=sys.stderr)
            return 2
    report = run_stages(args.out, args.smoke, stages, args.block_imports, warm_cache=args.warm_cache)
    bad = [s for s, e in report["stages"].items() if e["status"] != "ok"]
    failed = sum(e["result"]["failed"] for e in report["stages"].values())
    skipped = sum(e["result"]["skipped"] for e in report["stages"].values())
    print(f"gpu_check: {len(stages) - len(bad)} of {len(stages)} stages ok, {failed} case(s) failed, "
          f"{skipped} skipped -> {args.out / 'gpu_check.md'}, {args.out / RESULTS}")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
