"""Print where a pipeline run left its tables and what they say (the end of ``make demo``).

    python -m kvbatch.ops.demo_report <root> [<date>]     (every date when none is given)
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl


def _read(base: Path, table: str, date: str | None) -> pl.DataFrame:
    folder = base / table / (f"date={date}" if date else "")
    frame = pl.read_parquet(str(folder / "**" / "*.parquet"), hive_partitioning=True)
    return frame


def report(root: str, date: str | None = None) -> str:
    base = Path(root)
    results = _read(base, "results", date)
    metrics = _read(base, "cost_metrics", date)
    rejects = _read(base, "rejects", date)
    totals = metrics.select(
        pl.col("requests").sum(), pl.col("prompt_tokens").sum(), pl.col("prompt_tokens_prefill_computed").sum(),
        pl.col("prompt_tokens_decode_loaded").sum(), pl.col("output_tokens").sum(),
        pl.col("prefill_wall_s").sum(), pl.col("decode_wall_s").sum(), pl.col("cost_usd").sum(),
    ).row(0, named=True)
    example = results.sort("custom_id").row(0, named=True)
    where = f"date={date}" if date else "every date"
    lines = [
        f"results:      {base / 'results'}  ({results.height} rows of {where}, hive-partitioned by date and shard)",
        f"cost metrics: {base / 'cost_metrics'}",
        f"rejects:      {base / 'rejects'}  ({rejects.height} rows)",
        f"prompt tokens {totals['prompt_tokens']}: {totals['prompt_tokens_prefill_computed']} computed at prefill, "
        f"{totals['prompt_tokens_decode_loaded']} loaded from the KV store at decode",
        f"output tokens {totals['output_tokens']}; prefill {totals['prefill_wall_s']:.1f} s, "
        f"decode {totals['decode_wall_s']:.1f} s; cost ${totals['cost_usd']:.6f}",
        f"example: {example['custom_id']}: {str(example.get('text', ''))[:120]!r}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
