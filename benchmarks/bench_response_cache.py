"""A repeated night through the response cache: the second run of the same file.

    .venv/bin/python benchmarks/bench_response_cache.py --model smollm2-135m --rows 64 --max-tokens 32

Writes a ``kvbatch sample-data`` file (greedy rows), then, in one invocation: (1) ``kvbatch
generate --deterministic --response-cache DIR`` into an empty cache (every row a miss, computed
and written); (2) the same command again (every row served). Each run is a fresh process, model
load included, as a night's run is. Prints one JSON line: both wall times (the process's and the
batch's own, ``wall_s`` of ``--metrics``), the share of rows served, the cache's counters and
requests, and whether the second output equals the first (ids, choices).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _answers(path: Path) -> list[tuple]:
    lines = map(json.loads, path.read_text().splitlines())
    return [(x["custom_id"], x["response"]["body"].get("choices")) for x in lines]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvbatch-bench-rc-") as tmp:
        work = Path(tmp)
        src = work / "in.jsonl"
        kvbatch = [sys.executable, "-m", "kvbatch.cli.main"]
        subprocess.run([*kvbatch, "sample-data", "--output", str(src), "--requests", str(args.rows),
                        "--max-tokens", str(args.max_tokens)], check=True, cwd=ROOT)
        # Greedy rows: the reproducible kind (the sample's rows sample with no seed otherwise).
        rows = [json.loads(x) for x in src.read_text().splitlines()]
        for r in rows:
            r["body"]["temperature"] = 0
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs = []
        for name in ("first", "second"):
            out, metrics = work / f"{name}.jsonl", work / f"{name}.json"
            cmd = [*kvbatch, "generate", "--model", args.model, "--input", str(src), "--output", str(out),
                   "--metrics", str(metrics), "--deterministic", "--no-progress",
                   "--response-cache", str(work / "cache"),
                   *(["--threads", str(args.threads)] if args.threads else [])]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=ROOT, stderr=subprocess.DEVNULL)
            runs.append((time.perf_counter() - t0, json.loads(metrics.read_text()), out))
        (w1, m1, o1), (w2, m2, o2) = runs
        print(json.dumps({
            "model": args.model, "rows": args.rows, "max_tokens": args.max_tokens, "machine": platform.processor()
            or platform.machine(),
            "first_process_s": round(w1, 2), "second_process_s": round(w2, 2),
            "first_batch_s": m1["wall_s"], "second_batch_s": m2["wall_s"],
            "batch_time_ratio": round(m2["wall_s"] / m1["wall_s"], 4) if m1["wall_s"] else None,
            "served_share": round(m2["response_cache"]["hits"] / args.rows, 4),
            "first_cache": {k: m1["response_cache"][k] for k in ("hits", "misses", "writes", "requests")},
            "second_cache": {k: m2["response_cache"][k] for k in ("hits", "misses", "writes", "requests")},
            "outputs_equal": _answers(o1) == _answers(o2),
        }))


if __name__ == "__main__":
    main()
