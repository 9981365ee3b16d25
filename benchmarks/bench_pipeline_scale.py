"""Ingest and shard at scale: rows/s and peak RSS (whole process tree) of the columnar paths,
of this tree's per-row paths and of a baseline commit's code, in the same run, on
`kvbatch sample-data` datasets.

    python benchmarks/bench_pipeline_scale.py                       # 100k and 1M rows; per-row and baseline at 100k
    python benchmarks/bench_pipeline_scale.py --sizes 100000 --baseline-max-rows 100000
    python benchmarks/bench_pipeline_scale.py --baseline-ref HEAD --json out.json

This docstring describes the ingest/shard part (``main``); the decode part is its own entry
further down (``... decode``, see its section). Each stage of each implementation runs in its own subprocess, which this process
watches (psutil, every 20 ms): peak RSS is the largest sum of RSS over the child and all its
descendants (the tokenizer pool included) seen while it ran; rows/s is input rows over the
stage's wall time, process start-up and imports included for every implementation alike (also
printed: the rate after start-up, from the first row on, and the start-up seconds).

- "columnar": the working tree's defaults: ``ingest(columnar=True)`` (Arrow's JSON reader and
  vectorized checks, :mod:`kvbatch.io.request_columns`) and ``build_shards(path="columnar")``
  (:mod:`kvbatch.ops.shards.prompt_columns`), tokenizing in the stage's own process.
- "rows": the working tree's per-row paths (``ingest(columnar=False)``, ``build_shards(path="rows")``
  with the default tokenizer workers, min(4, CPUs)): what the columnar paths replaced.
- "baseline": the code of ``--baseline-ref`` (default HEAD), extracted with ``git archive`` into
  a temporary folder and imported in place of the working tree (the editable install's mapping
  is pointed there), run as that commit's ``prompts`` and ``prompt_shards`` assets ran it.

Every shard step gets ``ModelResource().row_tokenizer()`` (the tokenizer and the kept
fingerprint, no weights); the fingerprint and the tokenizer are kept by a warm-up before any
timing (each is computed once per model, not per run). Shards as the pipeline sizes them:
``shards_for_rows(rows, --max-rows-per-shard)`` (10,000 by default: 10 at 100k rows, 100 at 1M). The per-row and baseline runs
at 1M rows are skipped by default (many minutes on 2 cores); ``--baseline-max-rows`` sets it.
Prints the CPU (lscpu) and the load average next to the figures: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbatch.ops.shards.routing import DEFAULT_MAX_ROWS_PER_SHARD, shards_for_rows

REPO = Path(__file__).resolve().parent.parent

# The child's program: point the editable install at ROOT, then run one stage and print its report.
CHILD = r"""
import json, sys, time
root, stage, impl, src, out, num_shards = sys.argv[1:7]
for mod in list(sys.modules.values()):
    mapping = getattr(mod, "MAPPING", None)
    if getattr(mod, "__name__", "").startswith("__editable___kvbatch") and isinstance(mapping, dict):
        for k, v in list(mapping.items()):
            mapping[k] = root + v[len(v.rstrip("/").rsplit("/", 1)[0]):]
t0 = time.perf_counter()
if stage == "ingest":
    from kvbatch.ops.ingest.prompts import ingest
    kw = {} if impl == "baseline" else {"columnar": impl == "columnar"}
    t1 = time.perf_counter()
    rep = ingest(src, out + "/prompts.parquet", out + "/rejects.parquet", **kw)
    result = {"rows": rep.rows, "valid": rep.valid}
else:
    from kvbatch.ops.shards.build import build_shards
    from kvbatch.resources import ModelResource
    kw = {} if impl == "baseline" else {"path": "columnar" if impl == "columnar" else "rows"}
    tokenizer = ModelResource().row_tokenizer()
    t1 = time.perf_counter()
    rep = build_shards(tokenizer, out + "/prompts.parquet", out, int(num_shards), rejects_url=out + "/shard_rejects.parquet", **kw)
    result = {"rows": rep.rows, "tokenized": rep.tokenized, "workers": rep.tokenize_workers}
import kvbatch.ops.ingest.prompts as m
result["code"] = m.__file__
result["stage_s"] = time.perf_counter() - t0
result["startup_s"] = t1 - t0  # imports and the tokenizer, before the first row
result["rows_per_s_after_startup"] = round(result["rows"] / (time.perf_counter() - t1))
print("RESULT " + json.dumps(result))
"""


def tree_rss(proc) -> int:
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_stage(root: Path, stage: str, impl: str, src: str, out: Path, num_shards: int) -> dict:
    import psutil

    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), stage, impl, src, str(out), str(num_shards)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watched, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            peak = max(peak, tree_rss(watched))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    stdout, stderr = child.communicate()
    if child.returncode:
        raise RuntimeError(f"{stage} failed ({child.returncode}):\n{stderr[-3000:]}")
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {**result, "wall_s": round(wall, 2), "peak_rss_mb": round(peak / 2**20), "rows_per_s": round(result["rows"] / wall)}


def baseline_tree(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def cpu() -> str:
    """lscpu's model, family, CPU count and the vector flags (the whole flag list is ~1,500 characters)."""
    out = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    keep = [line for line in out.splitlines() if line.split(":")[0] in ("Model name", "CPU family", "Model", "CPU(s)")]
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    vector = [f for f in flags if f.startswith(("sse4", "avx", "fma", "f16c", "amx", "sha"))]
    return "\n".join([*keep, "Vector flags: " + " ".join(vector)])


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--baseline-ref", default="HEAD")
    ap.add_argument("--baseline-max-rows", type=int, default=100_000,
                    help="skip the per-row and baseline runs above this size")
    ap.add_argument("--workdir", default=None, help="where datasets and outputs go (default: a temp folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-rows-per-shard", type=int, default=DEFAULT_MAX_ROWS_PER_SHARD,
                    help="the shard count of each size, as prompt_shards sizes it (default %(default)s)")
    args = ap.parse_args()
    print(cpu(), flush=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    base = baseline_tree(args.baseline_ref, Path(tempfile.mkdtemp(prefix="bench-baseline-", dir=work)))
    subprocess.run([sys.executable, "-c", ("from kvbatch.resources import ModelResource as M; "
                    "print('fingerprint and tokenizer kept', M().row_tokenizer().kv_root_key[:12])")],
                   check=True)  # warm-up, untimed
    rows = []
    for n in args.sizes:
        data = work / f"sample-{n}.jsonl"
        if not data.exists():
            subprocess.run([str(Path(sys.executable).parent / "kvbatch"), "sample-data", "--output", str(data),
                            "--requests", str(n)], check=True, stdout=subprocess.DEVNULL)
        shards = shards_for_rows(n, args.max_rows_per_shard)
        impls = [("columnar", REPO)] + ([("rows", REPO), ("baseline", base)] if n <= args.baseline_max_rows else [])
        for impl, root in impls:
            out = work / f"out-{impl}-{n}"
            out.mkdir(exist_ok=True)
            before = load()
            ing = run_stage(root, "ingest", impl, str(data), out, shards)
            shard = run_stage(root, "shard", impl, str(data), out, shards)
            both = n / (ing["wall_s"] + shard["wall_s"])
            row = {"rows": n, "shards": shards, "impl": impl, "ingest": ing, "shard": shard, "ingest_plus_shard_rows_per_s": round(both),
                   "load_before": before, "load_after": load()}
            rows.append(row)
            print(f"{impl:8s} {n:>9,} rows, {shards:,} shards: ingest {ing['rows_per_s']:>7,} rows/s peak {ing['peak_rss_mb']:>5} MB | "
                  f"shard {shard['rows_per_s']:>7,} rows/s peak {shard['peak_rss_mb']:>5} MB "
                  f"(workers {shard['workers']}) | ingest+shard {round(both):>7,} rows/s | after start-up: ingest "
                  f"{ing['rows_per_s_after_startup']:,}, shard {shard['rows_per_s_after_startup']:,} rows/s (start-up "
                  f"{ing['startup_s']:.1f} s + {shard['startup_s']:.1f} s) | {before}", flush=True)
    cur = {r["rows"]: r for r in rows if r["impl"] == "columnar"}
    for other in ("rows", "baseline"):
        old = {r["rows"]: r for r in rows if r["impl"] == other}
        for n in sorted(set(cur) & set(old)):
            print(f"{n:,} rows: ingest+shard columnar / {other} x"
                  f"{cur[n]['ingest_plus_shard_rows_per_s'] / old[n]['ingest_plus_shard_rows_per_s']:.1f}, "
                  f"shard peak RSS {cur[n]['shard']['peak_rss_mb']} MB vs {old[n]['shard']['peak_rss_mb']} MB")
    if len(cur) >= 2:
        small, large = min(cur), max(cur)
        for stage in ("ingest", "shard"):
            ratio = cur[large][stage]["peak_rss_mb"] / cur[small][stage]["peak_rss_mb"]
            print(f"columnar {stage} peak RSS {large:,} / {small:,} rows: x{ratio:.2f} (target <= 1.2)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu(), "runs": rows}, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------
# Decode of one shard (issue 15): RSS through the shard, SIGKILL at 60 %, re-run (its own entry:
# `python benchmarks/bench_pipeline_scale.py decode [--rows 5000] [--checkpoint-rows 256]`).


def _decode_fixture(work: Path, rows: int, max_tokens: int) -> tuple[Path, str]:
    """A tiny random chat model (tests/tiny_models.py) and the manifests of ``rows`` greedy requests."""
    sys.path.insert(0, str(REPO))
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from kvbatch.io.batch_output import JsonlWriter
    from kvbatch.ops.jobs import Job
    from kvbatch.ops.prefill.manifests import manifest_line
    from tests.tiny_models import build_tiny_chat_model

    model = build_tiny_chat_model(work / "tiny", max_positions=128)
    llm = LLM(str(model), engine_config=EngineConfig(max_num_seqs=32))
    manifests = work / "manifests.jsonl"
    with JsonlWriter(str(manifests)) as out:
        for i in range(rows):
            ids = llm.tokenizer.encode_chat([{"role": "user", "content": f"Question {i}: tell me about {i % 97}"}])
            out.write(manifest_line(llm, Job(i, f"id-{i}", i + 1, ids, SamplingParams(max_tokens=max_tokens,
                                                                                        temperature=0.0)), "kvbatch"))
    return model, str(manifests)


def _committed_rows(parts: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in parts.glob("part-*.parquet"))


def _watch_decode(cmd: list[str], parts: Path, rows: int, kill_at: float | None) -> dict:
    """Run one decode worker; sample its tree RSS against committed rows; SIGKILL it once
    ``kill_at`` of the rows are committed (None: let it finish)."""
    import os
    import signal

    import psutil

    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "2"})
    watched, samples, killed = psutil.Process(child.pid), [], None
    last_commit = (0, t0)
    while child.poll() is None:
        done = _committed_rows(parts) if parts.exists() else 0
        now = time.perf_counter()
        if done != last_commit[0]:
            last_commit = (done, now)
        try:
            samples.append((done, tree_rss(watched)))
        except psutil.Error:
            pass
        if kill_at is not None and done >= kill_at * rows:
            child.send_signal(signal.SIGKILL)
            killed = {"killed_at_s": round(now - t0, 2), "committed_rows": done,
                      "s_since_last_commit": round(now - last_commit[1], 3)}
            child.wait()
            break
        time.sleep(0.05)
    stdout, stderr = child.communicate()
    wall = time.perf_counter() - t0
    if killed is None and child.returncode:
        raise RuntimeError(f"decode failed ({child.returncode}):\n{stderr[-3000:]}")
    by_decile = {}
    for done, rss in samples:  # the largest RSS seen while each tenth of the shard was being decoded
        d = min(9, int(10 * done / rows))
        by_decile[d] = max(by_decile.get(d, 0), rss)
    out = {"wall_s": round(wall, 2), "peak_rss_mb_by_decile": {f"{10 * d}%": round(v / 2**20)
                                                               for d, v in sorted(by_decile.items())}}
    if killed:
        out.update(killed)
    else:
        out["stats"] = json.loads(stdout.strip().splitlines()[-1])
    return out


def decode_main(argv: list[str]) -> int:
    """Decode a shard of ``--rows`` requests with a tiny model: RSS through the shard, then a run
    SIGKILLed at 60 % and its re-run: the work lost and the exactly-once output."""
    import pyarrow.parquet as pq

    from kvbatch.engine.spec import EngineSpec

    ap = argparse.ArgumentParser(prog="bench_pipeline_scale.py decode")
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--checkpoint-rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kill-at", type=float, default=0.6)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-uninterrupted", action="store_true",
                    help="only the killed run and its re-run (the rate then comes from the killed run)")
    args = ap.parse_args(argv)
    print(cpu(), flush=True)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-decode-"))
    model, manifests = _decode_fixture(work, args.rows, args.max_tokens)

    def spec(name: str) -> list[str]:
        s = {"command": "shard", "engine_spec": EngineSpec(model=str(model), dtype="fp32", max_batch=32).to_json(),
             "manifests_url": manifests,
             "results_url": str(work / name / "part.parquet"), "parts_url": str(work / name / "parts"),
             "checkpoint_rows": args.checkpoint_rows, "rows": args.rows}
        (work / f"{name}.json").write_text(json.dumps(s))
        return [sys.executable, "-m", "kvbatch.ops.decode.worker", "--spec", str(work / f"{name}.json")]

    rps = None
    if not args.skip_uninterrupted:
        whole = _watch_decode(spec("whole"), work / "whole" / "parts", args.rows, None)
        rps = args.rows / whole["stats"]["wall_s"]
        print(f"uninterrupted: {args.rows:,} rows in {whole['wall_s']} s ({rps:,.0f} rows/s decode), "
              f"peak RSS by tenth of the shard (MB): {whole['peak_rss_mb_by_decile']}", flush=True)
    killed = _watch_decode(spec("killed"), work / "killed" / "parts", args.rows, args.kill_at)
    print(f"killed run: peak RSS by tenth of the shard (MB): {killed['peak_rss_mb_by_decile']}", flush=True)
    # Start-up included: this rate, and so the loss estimate, is on the low side (the bound: one interval).
    rps = rps or killed["committed_rows"] / killed["killed_at_s"]
    again = _watch_decode(spec("killed"), work / "killed" / "parts", args.rows, None)
    ids = pq.read_table(work / "killed" / "part.parquet", columns=["custom_id"]).column(0).to_pylist()
    lost_rows_est = killed["s_since_last_commit"] * rps  # finished after the last part, before the kill
    resumed = again["stats"]["resumed_rows"]
    print(f"SIGKILL at {killed['committed_rows']:,} committed rows ({killed['killed_at_s']} s); re-run "
          f"resumed {resumed:,} rows (= committed: {resumed == killed['committed_rows']}) and decoded the other "
          f"{args.rows - resumed:,} in {again['wall_s']} s; work lost at the kill: about "
          f"{lost_rows_est:,.0f} rows ({killed['s_since_last_commit']} s since the last part; bound: "
          f"{args.checkpoint_rows} rows, one interval)", flush=True)
    print(f"exactly once: {len(ids) == len(set(ids)) == args.rows} ({len(ids):,} rows, {len(set(ids)):,} ids)")
    return 0 if len(ids) == len(set(ids)) == args.rows else 1


if __name__ == "__main__":
    sys.exit(decode_main(sys.argv[2:]) if sys.argv[1:2] == ["decode"] else main())
