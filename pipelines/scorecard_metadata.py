"""The day's scorecard as the ``cost_rollup`` asset's metadata: what its page shows.

Dagster plots every numeric metadata key over the partitions, so only the curated figures a
person follows night by night are numbers (:data:`PLOTTED`: cost in $, tokens/s, KV hit rate,
TTFT and TPOT P95); every other figure is in the Markdown report (shown first, verdict at its
top) and in ``scorecard.json``. The SLO and the shards that need a look are typed tables, narrow
enough to show whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from urllib.parse import quote

import dagster as dg

from kvbatch.ops.results.scorecard import Scorecard, fmt_usd

# key -> (what it is, with its unit): the description docs/scorecard.md gives each plotted key.
PLOTTED = {
    "cost_usd": "the day's cost, dollars",
    "tokens_per_s": "prompt + output tokens per stage-second (prefill + decode wall, all shards)",
    "kv_hit_rate_pct": "prompt tokens served by the KV store or the prefix cache, percent of tokens in",
    "ttft_s_p95": "P95 time to first token over every request of the day, seconds",
    "tpot_s_p95": "P95 time per output token over every request of the day, seconds",
}


def shard_link(asset_path: Sequence[str], date: str) -> Callable[[str], str]:
    """A shard's page in the Dagster UI (relative, so it works behind any host): the
    ``cost_metrics`` asset at partition ``date|shard``."""
    base = "/assets/" + "/".join(quote(p, safe="") for p in asset_path)
    return lambda shard: f"{base}?view=partitions&partition={quote(f'{date}|{shard}', safe='')}"


def plotted_figures(card: Scorecard) -> dict[str, float]:
    """The curated numbers, rounded for reading; a figure that was not measured is left out."""
    values = {
        "cost_usd": float(f"{card.cost_usd:.4g}"),
        "tokens_per_s": None if card.tokens_per_s is None else round(card.tokens_per_s, 1),
        "kv_hit_rate_pct": None if card.kv_hit_rate is None else round(100 * card.kv_hit_rate, 2),
        "ttft_s_p95": None if card.ttft_s_p95 is None else round(card.ttft_s_p95, 4),
        "tpot_s_p95": None if card.tpot_s_p95 is None else round(card.tpot_s_p95, 4),
    }
    return {k: v for k, v in values.items() if v is not None}


def _table(columns: dict[str, str], records: list[dict]) -> dg.MetadataValue:
    schema = dg.TableSchema(columns=[dg.TableColumn(n, t) for n, t in columns.items()])
    return dg.MetadataValue.table([dg.TableRecord(r) for r in records], schema=schema)


def slo_table(card: Scorecard) -> dg.MetadataValue:
    rows = []
    for label, value, limit in (("time to first token", card.ttft_s_p95, card.slo_ttft_s_p95_max),
                                ("time per output token", card.tpot_s_p95, card.slo_tpot_s_p95_max)):
        rows.append({"latency": label, "P95 (s)": "–" if value is None else f"{value:.3f}", "SLO (s)": f"{limit:.3f}",
                     "verdict": "not measured" if value is None else ("PASS" if value <= limit else "FAIL")})
    return _table({"latency": "string", "P95 (s)": "string", "SLO (s)": "string", "verdict": "string"}, rows)


def problems_table(card: Scorecard) -> dg.MetadataValue:
    """Every shard that needs a look (none: an empty table, not a JSON blob). Four narrow
    columns; the links to the shards' pages are in the report, where they can be clicked."""
    rows = [{"shard": p.shard, "rows": p.rows, "results": p.results, "problem": p.problem}
            for p in card.shard_problems]
    return _table({"shard": "string", "rows": "int", "results": "int", "problem": "string"}, rows)


def shard_figures(metrics) -> dg.MetadataValue:
    """The day's shards side by side (every shard: five narrow columns, units in the headers)."""
    cols = ["shard", "requests", "cost_usd", "ttft_s_p95", "tpot_s_p95"]
    rows = [{"shard": r["shard"], "requests": int(r["requests"]), "cost ($)": fmt_usd(r["cost_usd"]),
             "TTFT p95 (s)": "–" if r["ttft_s_p95"] is None else f"{r['ttft_s_p95']:.3f}",
             "TPOT p95 (s)": "–" if r["tpot_s_p95"] is None else f"{r['tpot_s_p95']:.3f}"}
            for r in metrics.sort("shard").select(cols).to_dicts()]
    return _table({"shard": "string", "requests": "int", "cost ($)": "string", "TTFT p95 (s)": "string",
                   "TPOT p95 (s)": "string"}, rows)


def scorecard_metadata(card: Scorecard, metrics, *, link: Callable[[str], str] | None, md_url: str,
                       json_url: str) -> dict[str, object]:
    """The rollup's metadata, in the order the page shows it: the report (verdict first), the
    plotted figures, the SLO and problem tables, the per-shard table, where the files are."""
    meta: dict[str, object] = {"scorecard": dg.MetadataValue.md(card.to_markdown(link))}
    meta.update({k: dg.MetadataValue.float(v) for k, v in plotted_figures(card).items()})
    meta["slo"] = slo_table(card)
    meta["shards_needing_a_look"] = problems_table(card)
    meta["shard_figures"] = shard_figures(metrics)
    meta["scorecard_md"] = dg.MetadataValue.path(md_url)
    meta["scorecard_json"] = dg.MetadataValue.path(json_url)
    return meta
