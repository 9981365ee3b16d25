"""Print where a pipeline run left its tables and what they say (the end of ``make demo``).

    python -m kvbatch.ops.results.demo_report <root> [<date>]     (every date when none is given)

Every figure is read back from the tables under ``<root>``, so the report shows what a user
finds there, not what the run meant to write; the ``rows`` line says whether every valid row
got its result and where the others went.

The verdict comes first: each day's scorecard (``cost_rollup/date=D/scorecard.json``, written
by the day's rollup with the SLO it was configured with) gives the SLO's pass or fail and the
shards that need a look. The exit status is 3 when a day's scorecard did not pass (an SLO
breach, a shard not decoded or not costed, rows without a result), 1 when a table is missing,
2 for a usage error, else 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl

SCORECARD = "scorecard.json"
CHECK_FAILED = 3  # the exit status when a day's scorecard did not pass


class MissingTable(FileNotFoundError):
    """A table the report reads is not there: the run has not reached that asset yet."""


def _read(base: Path, table: str, date: str | None, columns: list[str] | None = None) -> pl.DataFrame:
    folder = base / table / (f"date={date}" if date else "")
    if not any(folder.glob("**/*.parquet")):
        raise MissingTable(f"no {table} table under {folder}: materialize the assets that write it first "
                           f"(see `make demo`)")
    frame = pl.read_parquet(str(folder / "**" / "*.parquet"), hive_partitioning=True)
    return frame.select(columns) if columns else frame


def scorecards(root: str, date: str | None = None) -> list[dict]:
    """The scorecards the day rollups wrote (one day's, or every day's), in date order."""
    folder = Path(root) / "cost_rollup"
    paths = [folder / f"date={date}" / SCORECARD] if date else sorted(folder.glob(f"date=*/{SCORECARD}"))
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def verdict_lines(cards: list[dict], root: str) -> list[str]:
    """The report's first lines: per day, pass or not, the SLO, the shards that need a look."""
    if not cards:
        return ["verdict:      no scorecard yet (the day's cost_rollup has not run)"]
    lines = []
    for c in cards:
        slo = "PASS" if c["slo_passed"] else "FAIL (" + "; ".join(c["slo_breaches"]) + ")"
        shards = ("none" if not c["shard_problems"] else
                  "; ".join(f"{p['shard']}: {p['problem']}" for p in c["shard_problems"]))
        lines += [f"verdict:      {c['date']} {'PASS' if c['passed'] else 'NEEDS A LOOK'}",
                  f"latency SLO:  {slo}",
                  f"shards needing a look: {shards}",
                  f"scorecard:    {Path(root) / 'cost_rollup' / ('date=' + c['date']) / 'scorecard.md'}"]
    return lines


def report(root: str, date: str | None = None) -> str:
    base = Path(root)
    # Without a date the tables span days; custom_id is unique only within one day's dataset.
    key = ["custom_id"] if date else ["date", "custom_id"]
    results = _read(base, "results", date)
    metrics = _read(base, "cost_metrics", date)
    rejects = _read(base, "rejects", date, key)
    shard_rejects = _read(base, "shard_rejects", date, key)
    valid = _read(base, "prompts", date, key)
    # A valid row that tokenization did not refuse must have a result: count those that have none.
    without_result = (valid.join(shard_rejects, on=key, how="anti")
                      .join(results.select(key), on=key, how="anti").height)
    summed = ("requests", "prompt_tokens", "prompt_tokens_prefill_computed", "prompt_tokens_decode_loaded",
              "prompt_tokens_decode_cached", "prompt_tokens_decode_computed", "output_tokens", "prefill_wall_s",
              "decode_wall_s", "cost_usd")
    totals = metrics.select(pl.col(c).sum() if c in metrics.columns else pl.lit(None).alias(c)
                            for c in summed).row(0, named=True)
    where = f"date={date}" if date else "every date"
    example = "none (no results)"
    if results.height:
        first = results.sort(key).row(0, named=True)
        example = f"{first['custom_id']}: {str(first.get('text', ''))[:120]!r}"
    lines = [
        *verdict_lines(scorecards(root, date), root),
        (f"rows:         {valid.height + rejects.height} input, {rejects.height} rejected at ingest, "
         f"{shard_rejects.height} at tokenization, {valid.height - shard_rejects.height - without_result} "
         f"with a result, {without_result} without"),
        f"results:      {base / 'results'}  ({results.height} rows of {where}, hive-partitioned by date and shard)",
        f"cost metrics: {base / 'cost_metrics'}",
        (f"rejects:      {base / 'rejects'}  ({rejects.height} rows), {base / 'shard_rejects'}  "
         f"({shard_rejects.height} rows)"),
        (f"prompt tokens {totals['prompt_tokens']}: {totals['prompt_tokens_prefill_computed']} computed at prefill, "
         f"{totals['prompt_tokens_decode_loaded']} loaded from the KV store at decode"),
        _prompt_sum(totals),
        (f"output tokens {totals['output_tokens']}; prefill {totals['prefill_wall_s']:.1f} s, "
         f"decode {totals['decode_wall_s']:.1f} s; cost ${totals['cost_usd']:.6f}"),
        f"example: {example}",
    ]
    return "\n".join(lines)


def _prompt_sum(t: dict) -> str:
    """Every prompt token once: loaded + served by a cache at decode + computed at decode (the
    line above names prefill's computed tokens, which are among those loaded, not beside them)."""
    if t["prompt_tokens_decode_cached"] is None or t["prompt_tokens_decode_computed"] is None:
        return "prompt tokens at decode: not in these cost_metrics (written by an older version)"
    return (f"prompt tokens {t['prompt_tokens']} = {t['prompt_tokens_decode_loaded']} loaded from the KV store "
            f"+ {t['prompt_tokens_decode_cached']} cache hits "
            f"+ {t['prompt_tokens_decode_computed']} computed at decode")


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m kvbatch.ops.results.demo_report <root> [<date>]", file=sys.stderr)
        return 2
    date = argv[1] if len(argv) > 1 else None
    try:
        print(report(argv[0], date))
    except MissingTable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    failed = [c["date"] for c in scorecards(argv[0], date) if not c["passed"]]
    if failed:
        print(f"error: the scorecard of {', '.join(failed)} did not pass (see the verdict lines above)",
              file=sys.stderr)
        return CHECK_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
