"""`kvbatch generate --workers W` killed mid-run and run again: how much work the re-run saves.

    .venv/bin/python benchmarks/bench_cli_resume.py --rows 400 --workers 2 --checkpoint-rows 16 --kill-at 0.5

Builds the tiny random chat model of ``tests/tiny_models.py`` and a ``kvbatch sample-data`` file,
then, in one invocation: (1) an uninterrupted run; (2) the same command into another output,
SIGKILLed (launcher and ranks at once) once ``--kill-at`` of the rows are in committed parts;
(3) that command again, which resumes. Prints one JSON line: the three wall times, the rows
committed at the kill, the rows the re-run resumed and answered, and whether its output equals the
uninterrupted run's (ids, order, choices).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]


def _answers(path: Path) -> list[tuple]:
    lines = map(json.loads, path.read_text().splitlines())
    return [(x["custom_id"], x["response"]["body"].get("choices")) for x in lines]


def _committed(parts: Path) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in parts.glob("part-*.parquet"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--checkpoint-rows", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kill-at", type=float, default=0.5, help="share of the rows committed when the kill comes")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.tiny_models import build_tiny_chat_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-cli-resume-"))
    model = build_tiny_chat_model(tmp / "tiny", max_positions=512)  # the sample's system prompts fit
    src = tmp / "in.jsonl"
    kvbatch = [sys.executable, "-m", "kvbatch.cli.main"]
    subprocess.run([*kvbatch, "sample-data", "--output", str(src), "--requests", str(args.rows), "--max-tokens",
                    str(args.max_tokens)], check=True, capture_output=True)

    def cmd(out: str) -> list[str]:
        return [*kvbatch, "generate", "--model", str(model), "--input", str(src), "--output", str(tmp / out),
                "--metrics", str(tmp / f"{out}.m"), "--no-progress", "--workers", str(args.workers),
                "--checkpoint-rows", str(args.checkpoint_rows)]

    started = time.perf_counter()
    subprocess.run(cmd("full.jsonl"), check=False, capture_output=True)
    full_s = time.perf_counter() - started

    parts = tmp / ".out.jsonl.kvbatch-parts"
    started = time.perf_counter()
    proc = subprocess.Popen(cmd("out.jsonl"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while proc.poll() is None and (not parts.exists() or _committed(parts) < args.kill_at * args.rows):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_s = time.perf_counter() - started
    time.sleep(0.5)
    committed = _committed(parts)

    started = time.perf_counter()
    rerun = subprocess.run(cmd("out.jsonl"), check=False, capture_output=True, text=True)
    rerun_s = time.perf_counter() - started
    m = json.loads((tmp / "out.jsonl.m").read_text())
    print(json.dumps({
        "cpu": platform.processor() or platform.machine(), "load_1m": round(os.getloadavg()[0], 2),
        "rows": args.rows, "workers": args.workers, "checkpoint_rows": args.checkpoint_rows,
        "uninterrupted_s": round(full_s, 1), "killed_after_s": round(killed_s, 1), "committed_at_kill": committed,
        "rerun_s": round(rerun_s, 1), "rerun_resumed_rows": m["resumed_rows"],
        "rerun_answered_rows": m["requests"] - m["resumed_rows"], "runs": m["runs"],
        "output_equals_uninterrupted": _answers(tmp / "out.jsonl") == _answers(tmp / "full.jsonl"),
        "parts_left": parts.exists(), "rerun_stderr_first_line": rerun.stderr.splitlines()[0] if rerun.stderr else "",
    }))


if __name__ == "__main__":
    main()
