"""`make demo` in the suite, on a tiny chat model: the commands of the Makefile's demo recipe
(``kvbatch sample-data``, the named jobs launched and waited for: ``kvbatch_ingest`` for the
date, ``kvbatch_shard`` for each (date, shard), ``kvbatch_rollup``; ``python -m
kvbatch.ops.results.demo_report``) run as subprocesses, and what a user would look
at is checked against the tables they wrote.

The Makefile is the one source of truth: the commands are what ``make -n demo`` prints, with
only its variables overridden (the demo folder, rows, rows per shard, date and the venv's bin folder),
so a change to the recipe is a change to what this test runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from tests.tiny_models import build_tiny_chat_model

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv this suite runs in: its kvbatch, dagster and python
DATE, ROWS, ROWS_PER_SHARD = "2026-11-29", 16, 8
SHARDS = 2  # ceil(16 / 8): the demo's day gets as many shards as its rows need


def demo_commands(demo: Path, repo: Path = REPO, bin_dir: Path = BIN) -> list[str]:
    """The demo recipe of ``repo``'s Makefile as shell commands, one per recipe line, as make
    would run them.

    ``-o install`` keeps make from re-installing the venv (the suite already runs in one); a
    recipe line continued with a backslash is one command, which is how make hands it to the
    shell. A ``make test`` above this suite must not pass its flags (``-n``, ``-k``) down."""
    make = shutil.which("make")
    assert make, "the demo test needs `make` (the Makefile's demo recipe is what it runs)"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    printed = subprocess.run(
        [make, "-s", "-n", "-o", "install", "demo", f"DEMO={demo}", f"DEMO_ROWS={ROWS}",
         f"DEMO_ROWS_PER_SHARD={ROWS_PER_SHARD}", f"DEMO_DATE={DATE}", f"BIN={bin_dir}"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    commands, pending = [], ""
    for line in printed.splitlines():
        pending += line + "\n"
        if not line.endswith("\\"):
            commands.append(pending.rstrip("\n"))
            pending = ""
    assert not pending, f"recipe ends inside a continued line: {pending!r}"
    return commands


DEMO_STEPS = ("kvbatch sample-data", "-j kvbatch_ingest", "-j kvbatch_shard", "-j kvbatch_rollup",
              "kvbatch.ops.results.demo_report")


def demo_steps(commands: list[str]) -> list[int]:
    """Which command is each of the demo's steps: a recipe that lost or reordered one fails
    here, before anything runs, rather than passing on what is left."""
    steps = [next((i for i, c in enumerate(commands) if needle in c), None) for needle in DEMO_STEPS]
    assert None not in steps and steps == sorted(steps), f"the demo recipe lacks {DEMO_STEPS} in order: {commands}"
    return steps


def _figures(report: str) -> dict[str, str]:
    """The figures the report prints, by name (each pattern must match exactly once)."""
    patterns = {
        "rows": r"^rows: +(?P<input>\d+) input, (?P<rejected>\d+) rejected at ingest, (?P<refused>\d+) at "
                r"tokenization, (?P<answered>\d+) with a result, (?P<unanswered>\d+) without$",
        "results": r"^results: +(?P<results_url>\S+) +\((?P<results>\d+) rows of date=(?P<date>\S+),",
        "rejects": r"^rejects: +\S+ +\((?P<rejects>\d+) rows\), \S+ +\((?P<shard_rejects>\d+) rows\)$",
        "prompt": r"^prompt tokens (?P<prompt_tokens>\d+): (?P<computed>\d+) computed at prefill, "
                  r"(?P<loaded>\d+) loaded from the KV store at decode$",
        "output": r"^output tokens (?P<output_tokens>\d+); prefill (?P<prefill_s>[\d.]+) s, "
                  r"decode (?P<decode_s>[\d.]+) s; cost \$(?P<cost>[\d.]+)$",
        "example": r"^example: (?P<example_id>\S+): (?P<example_text>.*)$",
    }
    out: dict[str, str] = {}
    for name, pattern in patterns.items():
        found = list(re.finditer(pattern, report, re.MULTILINE))
        assert len(found) == 1, f"report line {name!r} not found once in:\n{report}"
        out.update(found[0].groupdict())
    return out


def test_the_demo_commands_come_from_the_makefile(tmp_path):
    """Fast (no model): the recipe reads as its steps with the overrides in place, and a
    Makefile whose demo lost a step is refused before anything runs."""
    commands = demo_commands(tmp_path / "demo")
    steps = demo_steps(commands)
    assert f"--requests {ROWS}" in commands[steps[0]] and str(tmp_path / "demo" / "requests.jsonl") in commands[steps[0]]
    assert f'"dagster/partition": "{DATE}"' in commands[steps[1]] and f"{DATE}|$shard" in commands[steps[2]]
    assert commands[steps[0]].split()[0] == str(BIN / "kvbatch")  # the venv's, not one on PATH
    makefile = (REPO / "Makefile").read_text()
    lines = [line for line in makefile.splitlines() if "kvbatch.ops.results.demo_report" not in line]
    assert len(lines) == len(makefile.splitlines()) - 1
    drifted = tmp_path / "drifted"
    drifted.mkdir()
    (drifted / "Makefile").write_text("\n".join(lines) + "\n")
    with pytest.raises(AssertionError, match="the demo recipe lacks"):
        demo_steps(demo_commands(tmp_path / "demo", repo=drifted))


FAKE_BIN = """#!/bin/sh
# python: the job launcher and the report exit as told; anything else is the real python.
echo "$(basename "$0") $*" >> "$CALLS"
case "$0:$2" in
  *dagster:*) exit 0 ;;
  *python:kvbatch.pipelines.automation) exit "$WAIT_STATUS" ;;
  *python:kvbatch.ops.results.demo_report) exit "$REPORT_STATUS" ;;
esac
exec REAL "$@"
"""


def _fake_bin(tmp_path: Path) -> Path:
    """A bin folder whose ``dagster`` launches nothing and whose ``python`` stands in for the job
    launcher and the report with the exit statuses the test sets."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python", "dagster"):
        (fake / name).write_text(FAKE_BIN.replace("REAL", sys.executable))
        (fake / name).chmod(0o755)
    return fake


def test_a_failed_check_does_not_stop_the_demo_and_its_status_is_the_reports(tmp_path):
    """Fast (no model): the recipe's shard loop goes on when the job launcher says a check failed
    (exit 3: the day is still rolled up, so the scorecard lists the shard), stops on any other
    failure, and `make demo` ends with the report's exit status after printing the UI line. The
    demo runs with its own SLO (the Makefile's DEMO_SLO_*)."""
    demo = tmp_path / "demo"
    commands = demo_commands(demo, bin_dir=_fake_bin(tmp_path))
    steps = demo_steps(commands)
    for c in commands[steps[1]:steps[3] + 1]:
        assert "KVBATCH_SLO_TTFT_P95_S=" in c and "KVBATCH_SLO_TPOT_P95_S=" in c, c
    count = demo / "data" / "kvbatch" / "shards" / f"date={DATE}" / "_shard_count.json"
    count.parent.mkdir(parents=True)
    count.write_text(json.dumps({"num_shards": SHARDS}))
    calls = tmp_path / "calls"

    def run(step: int, wait: int, report: int = 0) -> subprocess.CompletedProcess:
        calls.write_text("")
        env = dict(os.environ, CALLS=str(calls), WAIT_STATUS=str(wait), REPORT_STATUS=str(report))
        return subprocess.run(["/bin/sh", "-c", commands[step]], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120, check=False)

    def launched() -> int:
        return sum(line.startswith("dagster job launch") for line in calls.read_text().splitlines())

    assert run(steps[2], wait=3).returncode == 0 and launched() == SHARDS  # every shard, then on
    assert run(steps[2], wait=1).returncode == 1 and launched() == 1  # a failed run stops it
    assert run(steps[3], wait=3).returncode == 0  # a rollup whose SLO check failed: on to the report
    assert run(steps[3], wait=1).returncode == 1
    for status in (0, 3):
        report = run(steps[4], wait=0, report=status)
        assert report.returncode == status and "UI: " in report.stdout


@pytest.mark.slow
def test_make_demo_runs_end_to_end_on_a_tiny_model(tmp_path):
    """Every command exits 0, every sample row has exactly one result, and each figure the
    report prints equals the tables'. Slow (~110 s of CPU on this 2-core machine): the
    multiprocess executor starts a Python process per step, and each imports torch."""
    tiny = build_tiny_chat_model(tmp_path / "tiny", max_positions=512)  # the sample's system prompts fit
    demo = tmp_path / "demo"
    commands = demo_commands(demo)
    steps = demo_steps(commands)
    for c in commands[steps[1]:steps[2] + 1]:
        assert all(f"{k}=" in c for k in ("DAGSTER_HOME", "KVBATCH_ROOT")), c
        assert f"KVBATCH_MAX_ROWS_PER_SHARD={ROWS_PER_SHARD}" in c and "KVBATCH_TIMEZONE=UTC" in c, c
        assert "KVBATCH_NUM_SHARDS" not in c, c

    # The recipe sets where things go; the model is the one thing the demo leaves to the
    # environment. Nothing else of this process's environment may steer the run.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBATCH_", "DAGSTER_"))}
    env["KVBATCH_MODEL"] = str(tiny)
    outputs = []
    for command in commands:
        run = subprocess.run(["/bin/sh", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=400, check=False)
        assert run.returncode == 0, f"{command}\nexit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        outputs.append(run.stdout)

    data = demo / "data" / "kvbatch"  # the demo pipeline's (defs/demo/defs.yaml, name kvbatch) tables
    sample = [json.loads(line) for line in (demo / "requests.jsonl").read_text().splitlines()]
    assert len(sample) == ROWS

    def table(name: str) -> pl.DataFrame:
        return pl.read_parquet(str(data / name / f"date={DATE}" / "**" / "*.parquet"), hive_partitioning=True)

    results, metrics = table("results"), table("cost_metrics")
    rejected = set(table("rejects")["custom_id"].to_list()) | set(table("shard_rejects")["custom_id"].to_list())
    # Every valid sample row has exactly one result (the sample is generated valid: none is rejected).
    assert not rejected
    assert sorted(results["custom_id"].to_list()) == sorted(r["custom_id"] for r in sample)
    assert sorted(int(s) for s in metrics["shard"]) == list(range(SHARDS))  # hive reads "0000" as 0

    # The report says what the tables say.
    fig = _figures(outputs[steps[4]])
    assert fig["date"] == DATE and Path(fig["results_url"]) == data / "results"
    assert (int(fig["input"]), int(fig["rejected"]), int(fig["refused"])) == (ROWS, 0, 0)
    assert (int(fig["answered"]), int(fig["unanswered"]), int(fig["results"])) == (ROWS, 0, results.height)
    assert (int(fig["rejects"]), int(fig["shard_rejects"])) == (0, 0)
    assert int(fig["prompt_tokens"]) == results["prompt_tokens"].sum() == metrics["prompt_tokens"].sum()
    assert int(fig["output_tokens"]) == results["completion_tokens"].sum() == metrics["output_tokens"].sum()
    assert int(fig["computed"]) == metrics["prompt_tokens_prefill_computed"].sum()
    assert int(fig["loaded"]) == metrics["prompt_tokens_decode_loaded"].sum() == results["loaded_prompt_tokens"].sum()
    assert float(fig["prefill_s"]) == pytest.approx(metrics["prefill_wall_s"].sum(), abs=0.051)
    assert float(fig["decode_s"]) == pytest.approx(metrics["decode_wall_s"].sum(), abs=0.051)
    assert float(fig["cost"]) == pytest.approx(metrics["cost_usd"].sum(), abs=5.1e-7) and float(fig["cost"]) > 0
    first = results.sort("custom_id").row(0, named=True)
    assert fig["example_id"] == first["custom_id"] and fig["example_text"] == repr(first["text"][:120])
    # What the demo is there to show: the shared system prompts are prefilled once per block and
    # loaded from the KV store at decode.
    assert 0 < int(fig["computed"]) < int(fig["prompt_tokens"]) and int(fig["loaded"]) > 0


def test_report_counts_rejects_and_rows_left_without_a_result(tmp_path):
    """Fast, on hand-made tables: the sample data of the slow test is all valid, so the rejects
    and a row left without a result are shown here."""
    from kvbatch.ops.results.demo_report import MissingTable, main, report

    def write(table: str, frame: pl.DataFrame, shard: str | None = None) -> None:
        folder = tmp_path / table / f"date={DATE}" / (f"shard={shard}" if shard else "")
        folder.mkdir(parents=True)
        frame.write_parquet(folder / "part.parquet")

    write("prompts", pl.DataFrame({"custom_id": ["a", "b", "c", "d"]}))
    write("rejects", pl.DataFrame({"custom_id": ["x"], "field": ["temperature"]}))
    write("shard_rejects", pl.DataFrame({"custom_id": ["d"], "field": ["body.messages"]}))
    write("results", pl.DataFrame({"custom_id": ["b", "a"], "text": ["B", "A"]}), "0000")
    write("cost_metrics", pl.DataFrame({k: [v] for k, v in {
        "requests": 2, "prompt_tokens": 10, "prompt_tokens_prefill_computed": 6, "prompt_tokens_decode_loaded": 4,
        "output_tokens": 3, "prefill_wall_s": 0.25, "decode_wall_s": 1.0, "cost_usd": 0.0000125}.items()}), "0000")
    fig = _figures(report(str(tmp_path), DATE))
    assert {k: fig[k] for k in ("input", "rejected", "refused", "answered", "unanswered", "rejects",
                                "shard_rejects", "results", "example_id")} == {
        "input": "5", "rejected": "1", "refused": "1", "answered": "2", "unanswered": "1", "rejects": "1",
        "shard_rejects": "1", "results": "2", "example_id": "a"}
    assert (fig["prompt_tokens"], fig["computed"], fig["loaded"], fig["output_tokens"], fig["cost"]) == (
        "10", "6", "4", "3", "0.000013")
    with pytest.raises(MissingTable, match=r"no results table under .*date=2026-11-30"):
        report(str(tmp_path), "2026-11-30")
    assert main([str(tmp_path), "2026-11-30"]) == 1 and main([]) == 2
