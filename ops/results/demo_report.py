"""Print where a pipeline run left its tables and what they say (the end of ``make demo``).

    python -m kvbatch.ops.results.demo_report <root> [<date>]     (every date when none is given)

Every figure is read back from the tables under ``<root>``, so the report shows what a user
finds there, not what the run meant to write; the ``rows`` line says whether every valid row
got its result and where the others went.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl


class MissingTable(FileNotFoundError):
    """A table the report reads is not there: the run has not reached that asset yet."""


def _read(base: Path, table: str, date: str | None, columns: list[str] | None = None) -> pl.DataFrame:
    folder = base / table / (f"date={date}" if date else "")
    if not any(folder.glob("**/*.parquet")):
        raise MissingTable(f"no {table} table under {folder}: materialize the assets that write it first "
                           f"(see `make demo`)")
    frame = pl.read_parquet(str(folder / "**" / "*.parquet"), hive_partitioning=True)
    return frame.select(columns) if columns else frame


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
    totals = metrics.select(
        pl.col("requests").sum(), pl.col("prompt_tokens").sum(), pl.col("prompt_tokens_prefill_computed").sum(),
        pl.col("prompt_tokens_decode_loaded").sum(), pl.col("output_tokens").sum(),
        pl.col("prefill_wall_s").sum(), pl.col("decode_wall_s").sum(), pl.col("cost_usd").sum(),
    ).row(0, named=True)
    where = f"date={date}" if date else "every date"
    example = "none (no results)"
    if results.height:
        first = results.sort(key).row(0, named=True)
        example = f"{first['custom_id']}: {str(first.get('text', ''))[:120]!r}"
    lines = [
        (f"rows:         {valid.height + rejects.height} input, {rejects.height} rejected at ingest, "
         f"{shard_rejects.height} at tokenization, {valid.height - shard_rejects.height - without_result} "
         f"with a result, {without_result} without"),
        f"results:      {base / 'results'}  ({results.height} rows of {where}, hive-partitioned by date and shard)",
        f"cost metrics: {base / 'cost_metrics'}",
        (f"rejects:      {base / 'rejects'}  ({rejects.height} rows), {base / 'shard_rejects'}  "
         f"({shard_rejects.height} rows)"),
        (f"prompt tokens {totals['prompt_tokens']}: {totals['prompt_tokens_prefill_computed']} computed at prefill, "
         f"{totals['prompt_tokens_decode_loaded']} loaded from the KV store at decode"),
        (f"output tokens {totals['output_tokens']}; prefill {totals['prefill_wall_s']:.1f} s, "
         f"decode {totals['decode_wall_s']:.1f} s; cost ${totals['cost_usd']:.6f}"),
        f"example: {example}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m kvbatch.ops.results.demo_report <root> [<date>]", file=sys.stderr)
        return 2
    try:
        print(report(argv[0], argv[1] if len(argv) > 1 else None))
    except MissingTable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
