"""The night at a glance: one scorecard per day, computed from the day's committed tables.

Plain Python (no Dagster). :func:`build_scorecard` reduces a :class:`~kvbatch.ops.results.day_tables.DayTables`
with polars (no loop over rows) to a :class:`Scorecard`: rows, tokens, cache reuse, throughput,
dollars against a hosted batch price, the latency SLO and the shards that need a look.
``cost_rollup`` writes it beside the day's Parquet (``scorecard.md``, ``scorecard.json``) and shows it
on its page; ``python -m kvbatch.ops.results.demo_report`` prints its headline. docs/scorecard.md
defines every figure.

The token figures are one account, so they agree by construction:

- tokens in (every prompt token of every result) = loaded from the KV store + engine prefix-cache
  hits + served by the response cache + computed at decode;
- computed tonight = computed at decode + the tokens prefill computed that decode then loaded
  (at most the tokens loaded); reused = tokens in - computed tonight (blocks stored before this
  shard's prefill, prefix-cache and response-cache hits). So tokens in = reused + computed.

Rows answered by the response cache are the results marked ``cached`` (``ops/decode/shard.py``):
they computed nothing, so their prompt tokens are reused, their output tokens are delivered but not
decoded (``tokens_out_response_cache``), they measured no latency (left out of the P95s), and
``response_cache_saved_usd`` estimates what they did not spend (``cost.response_cache_saved_usd``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from kvbatch.ops.results.cost import TIERS, response_cache_rows, response_cache_saved_usd
from kvbatch.ops.results.day_tables import DayTables
from kvbatch.ops.results.metrics import LatencySLO, check_slo

ERROR_FINISH = "error"  # a row the engine refused at decode (a schema that cannot compile ...)


@dataclass(frozen=True)
class ShardProblem:
    """A shard that needs a look: its rows, its results, and what is wrong (``; ``-joined)."""

    shard: str
    rows: int
    results: int
    problem: str


@dataclass(frozen=True)
class Scorecard:
    """One day's figures; docs/scorecard.md defines each."""

    date: str
    num_shards: int | None
    shards_costed: int
    # Rows: rows_in = rows_rejected + rows_done + rows_failed + rows_pending.
    rows_in: int
    rows_rejected_at_ingest: int
    rows_rejected_at_tokenization: int
    rows_done: int
    rows_failed: int
    rows_pending: int
    # Tokens: tokens_in = tokens_reused + tokens_computed.
    tokens_in: int
    tokens_out: int
    tokens_loaded_from_kv_store: int
    tokens_prefix_cache: int
    tokens_response_cache: int
    tokens_computed_at_prefill: int
    tokens_computed_at_decode: int
    tokens_computed: int
    tokens_reused: int
    kv_tokens_by_tier: dict[str, int]
    response_cache_rows: int
    tokens_out_response_cache: int  # output tokens served by the response cache (in tokens_out, never decoded)
    # Time and throughput (stage seconds summed over shards).
    prefill_wall_s: float
    decode_wall_s: float
    # Dollars.
    cost_usd: float
    billable_tokens: int
    reference_cost_usd: float | None
    response_cache_saved_usd: float | None  # an estimate (cost.response_cache_saved_usd); None: nothing to price by
    # Latency SLO over every request of the day.
    ttft_s_p95: float | None
    tpot_s_p95: float | None
    slo_ttft_s_p95_max: float
    slo_tpot_s_p95_max: float
    slo_breaches: list[str] = field(default_factory=list)
    shard_problems: list[ShardProblem] = field(default_factory=list)

    # ---- derived figures (ratios are taken from the sums, never averaged over shards)
    @property
    def rows_rejected(self) -> int:
        return self.rows_rejected_at_ingest + self.rows_rejected_at_tokenization

    @property
    def wall_s(self) -> float:
        return self.prefill_wall_s + self.decode_wall_s

    @property
    def tokens_per_s(self) -> float | None:
        """Prompt and output tokens of the day per stage-second (prefill + decode wall, all shards)."""
        return _ratio(self.tokens_in + self.tokens_out, self.wall_s)

    @property
    def output_tokens_per_s(self) -> float | None:
        return _ratio(self.tokens_out, self.decode_wall_s)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return _ratio(self.tokens_computed_at_prefill, self.prefill_wall_s)

    @property
    def kv_hit_rate(self) -> float | None:
        """Prompt tokens decode did not compute because a KV cache held them (store + prefix cache)."""
        return _ratio(self.tokens_loaded_from_kv_store + self.tokens_prefix_cache, self.tokens_in)

    def hit_rate(self, tokens: int) -> float | None:
        return _ratio(tokens, self.tokens_in)

    @property
    def usd_per_mtok(self) -> float | None:
        return _ratio(self.cost_usd * 1e6, self.billable_tokens)

    @property
    def reference_usd_per_mtok(self) -> float | None:
        return None if self.reference_cost_usd is None else _ratio(self.reference_cost_usd * 1e6,
                                                                    self.billable_tokens)

    @property
    def savings_usd(self) -> float | None:
        return None if self.reference_cost_usd is None else self.reference_cost_usd - self.cost_usd

    @property
    def slo_passed(self) -> bool:
        return not self.slo_breaches

    @property
    def failed_shards(self) -> list[str]:
        return [p.shard for p in self.shard_problems]

    @property
    def passed(self) -> bool:
        """The night met its SLO, every valid row has its result, and no shard needs a look."""
        return self.slo_passed and not self.shard_problems and not self.rows_failed and not self.rows_pending

    # ---- output
    def headline(self) -> str:
        """One line: the verdict first, then what a person reads next."""
        slo = "PASS" if self.slo_passed else "FAIL (" + "; ".join(self.slo_breaches) + ")"
        shards = "none" if not self.shard_problems else f"{len(self.shard_problems)} ({', '.join(self.failed_shards)})"
        return (f"{self.date}: SLO {slo}; shards needing a look: {shards}; rows {self.rows_in:,} in, "
                f"{self.rows_done:,} done, {self.rows_rejected:,} rejected, {self.rows_failed:,} failed"
                + (f", {self.rows_pending:,} not decoded yet" if self.rows_pending else "")
                + f"; cost {fmt_usd(self.cost_usd)}")

    def to_json(self) -> dict[str, Any]:
        """Every figure, the derived ones included, as plain JSON values (``scorecard.json``)."""
        out = asdict(self)
        out.update(rows_rejected=self.rows_rejected, wall_s=self.wall_s, tokens_per_s=self.tokens_per_s,
                   output_tokens_per_s=self.output_tokens_per_s, prefill_tokens_per_s=self.prefill_tokens_per_s,
                   kv_hit_rate=self.kv_hit_rate, usd_per_mtok=self.usd_per_mtok,
                   reference_usd_per_mtok=self.reference_usd_per_mtok, savings_usd=self.savings_usd,
                   slo_passed=self.slo_passed, failed_shards=self.failed_shards, passed=self.passed)
        return out

    def to_markdown(self, shard_link: Callable[[str], str] | None = None) -> str:
        """The report a person reads: the verdict at the top, then rows, tokens, cache, cost,
        latency and the shards that need a look. ``shard_link(shard)`` makes each shard a link."""
        verdict = "**PASS**" if self.passed else "**NEEDS A LOOK**"
        lines = [f"# {self.date}: {verdict}", "",
                 f"- **Latency SLO: {'PASS' if self.slo_passed else 'FAIL'}**"
                 + ("" if self.slo_passed else " — " + "; ".join(self.slo_breaches)),
                 f"- **Shards needing a look: {len(self.shard_problems) or 'none'}**"
                 + ("" if not self.shard_problems else " — " + ", ".join(
                     _link(s, shard_link) for s in self.failed_shards)),
                 f"- **Cost: {fmt_usd(self.cost_usd)}** ({fmt_usd(self.usd_per_mtok)} per Mtok"
                 + ("" if self.reference_usd_per_mtok is None else
                    f"; hosted batch price {fmt_usd(self.reference_usd_per_mtok)} per Mtok, saved "
                    f"{fmt_usd(self.savings_usd)}") + ")", ""]
        shards = "" if self.num_shards is None else f" over {self.shards_costed} of {self.num_shards} shards"
        lines += ["## Rows", "", _table(("rows", "count"), [
            ("in (valid + rejected at ingest)", f"{self.rows_in:,}"),
            ("done (a result)", f"{self.rows_done:,}"),
            ("rejected at ingest / at tokenization",
             f"{self.rows_rejected_at_ingest:,} / {self.rows_rejected_at_tokenization:,}"),
            ("failed (no result, or an error result)", f"{self.rows_failed:,}"),
            ("not decoded yet", f"{self.rows_pending:,}"),
            ("answered by the response cache (no compute)", f"{self.response_cache_rows:,}")]), ""]
        lines += ["## Tokens", "", _table(("tokens", "count", "share of tokens in"), [
            ("**in** (prompt tokens of every result)", f"{self.tokens_in:,}", "100%"),
            ("loaded from the KV store", f"{self.tokens_loaded_from_kv_store:,}",
             _pct(self.hit_rate(self.tokens_loaded_from_kv_store))),
            *((f"… from the {t} tier", f"{self.kv_tokens_by_tier[t]:,}", _pct(self.hit_rate(self.kv_tokens_by_tier[t])))
              for t in TIERS),
            ("engine prefix-cache hits at decode", f"{self.tokens_prefix_cache:,}",
             _pct(self.hit_rate(self.tokens_prefix_cache))),
            ("served by the response cache", f"{self.tokens_response_cache:,}",
             _pct(self.hit_rate(self.tokens_response_cache))),
            ("computed at decode", f"{self.tokens_computed_at_decode:,}",
             _pct(self.hit_rate(self.tokens_computed_at_decode))),
            ("computed at prefill (then stored)", f"{self.tokens_computed_at_prefill:,}", "–"),
            ("**computed tonight** (at decode + prefill's tokens decode loaded)", f"{self.tokens_computed:,}",
             _pct(self.hit_rate(self.tokens_computed))),
            ("**reused** (in − computed tonight)", f"{self.tokens_reused:,}", _pct(self.hit_rate(self.tokens_reused))),
            ("**out** (output tokens)", f"{self.tokens_out:,}", "–"),
            ("… of which served by the response cache (not decoded)", f"{self.tokens_out_response_cache:,}", "–")]),
            ""]
        lines += [f"## Time and cost{shards}", "", _table(("figure", "value"), [
            ("KV cache hit rate (store + prefix cache)", _pct(self.kv_hit_rate)),
            ("wall time, prefill + decode (summed over shards)",
             f"{self.wall_s:,.2f} s ({self.prefill_wall_s:,.2f} s + {self.decode_wall_s:,.2f} s)"),
            ("tokens per second (in + out over that wall time)", _rate(self.tokens_per_s)),
            ("output tokens per second of decode", _rate(self.output_tokens_per_s)),
            ("prefill tokens per second (computed)", _rate(self.prefill_tokens_per_s)),
            ("cost", fmt_usd(self.cost_usd)),
            ("billable tokens (in + out)", f"{self.billable_tokens:,}"),
            ("$ per Mtok (blended)", fmt_usd(self.usd_per_mtok)),
            ("hosted batch price: cost / $ per Mtok", "not configured (pricing.reference)"
             if self.reference_cost_usd is None else
             f"{fmt_usd(self.reference_cost_usd)} / {fmt_usd(self.reference_usd_per_mtok)}"),
            ("not spent thanks to the response cache (its output at the $ of a computed output token)",
             "no computed output to price it by" if self.response_cache_saved_usd is None
             else fmt_usd(self.response_cache_saved_usd))]), ""]
        lines += ["## Latency SLO (P95 over every request of the day)", "", _table(
            ("latency", "P95", "SLO", "verdict"),
            [(label, _seconds(value), f"≤ {limit:.3f} s",
              "–" if value is None else ("PASS" if value <= limit else "FAIL"))
             for label, value, limit in (("time to first token", self.ttft_s_p95, self.slo_ttft_s_p95_max),
                                         ("time per output token", self.tpot_s_p95, self.slo_tpot_s_p95_max))]), ""]
        if self.shard_problems:
            lines += ["## Shards needing a look", "", _table(("shard", "rows", "results", "problem"), [
                (_link(p.shard, shard_link), f"{p.rows:,}", f"{p.results:,}", p.problem) for p in self.shard_problems]),
                ""]
        return "\n".join(lines)


def build_scorecard(day: DayTables, slo: LatencySLO) -> Scorecard:
    """The scorecard of one day's tables against ``slo``."""
    r = day.results
    cached = response_cache_rows(r.columns)
    sums = r.select(
        pl.len().alias("results"),
        (pl.col("finish_reason") == ERROR_FINISH).sum().alias("errors"),
        *(pl.col(c).fill_null(0).sum().alias(c) for c in ("prompt_tokens", "completion_tokens",
                                                           "cached_prompt_tokens", "loaded_prompt_tokens")),
        cached.sum().alias("rc_rows"),
        pl.col("prompt_tokens").filter(cached).fill_null(0).sum().alias("rc_prompt"),
        pl.col("completion_tokens").filter(cached).fill_null(0).sum().alias("rc_output"),
        # A row the response cache answered measured no latency (no engine ran it).
        *(pl.col(n).filter(~cached).drop_nulls().quantile(0.95, interpolation="linear").alias(f"{n}_p95")
          for n in ("ttft_s", "tpot_s")),
    ).row(0, named=True)
    m = day.metrics
    msum = _metric_sums(m)
    tokens_in, loaded = int(sums["prompt_tokens"]), int(sums["loaded_prompt_tokens"])
    prefix = int(sums["cached_prompt_tokens"])
    rc_prompt = int(sums["rc_prompt"] or 0)
    at_decode = tokens_in - loaded - prefix - rc_prompt
    at_prefill = msum["prompt_tokens_prefill_computed"]
    computed = at_decode + min(at_prefill, loaded)
    p95 = {n: None if sums[f"{n}_p95"] is None else round(float(sums[f"{n}_p95"]), 6) for n in ("ttft_s", "tpot_s")}
    verdict = check_slo({f"{n}_p95": v for n, v in p95.items()}, slo)
    problems, failed, pending = _shard_problems(day, slo)
    errors = int(sums["errors"] or 0)
    refs = (m["reference_cost_usd"].drop_nulls() if "reference_cost_usd" in m.columns
            else pl.Series([], dtype=pl.Float64))
    return Scorecard(
        date=day.date, num_shards=day.num_shards, shards_costed=m.height,
        rows_in=day.valid_rows + day.rejected_at_ingest, rows_rejected_at_ingest=day.rejected_at_ingest,
        rows_rejected_at_tokenization=day.rejected_at_tokenization,
        rows_done=int(sums["results"]) - errors, rows_failed=failed + errors, rows_pending=pending,
        tokens_in=tokens_in, tokens_out=int(sums["completion_tokens"]), tokens_loaded_from_kv_store=loaded,
        tokens_prefix_cache=prefix, tokens_response_cache=rc_prompt, tokens_computed_at_prefill=at_prefill,
        tokens_computed_at_decode=at_decode, tokens_computed=computed, tokens_reused=tokens_in - computed,
        kv_tokens_by_tier={t: msum[f"kv_tokens_hit_{t}"] for t in TIERS}, response_cache_rows=int(sums["rc_rows"] or 0),
        tokens_out_response_cache=int(sums["rc_output"] or 0),
        prefill_wall_s=round(msum["prefill_wall_s"], 6), decode_wall_s=round(msum["decode_wall_s"], 6),
        cost_usd=round(msum["cost_usd"], 12), billable_tokens=msum["billable_tokens"],
        reference_cost_usd=round(float(refs.sum()), 12) if refs.len() else None,
        response_cache_saved_usd=response_cache_saved_usd(
            msum, msum["output_tokens"] - msum["output_tokens_response_cache"]),
        ttft_s_p95=p95["ttft_s"], tpot_s_p95=p95["tpot_s"],
        slo_ttft_s_p95_max=slo.ttft_s_p95, slo_tpot_s_p95_max=slo.tpot_s_p95,
        slo_breaches=list(verdict.breaches), shard_problems=problems)


_SUMMED_METRICS = {"prompt_tokens_prefill_computed": 0, **{f"kv_tokens_hit_{t}": 0 for t in TIERS},
                   "billable_tokens": 0, "prefill_wall_s": 0.0, "decode_wall_s": 0.0, "cost_usd": 0.0,
                   "output_tokens": 0, "output_tokens_response_cache": 0, "cost_output_usd": 0.0}


def _metric_sums(m: pl.DataFrame) -> dict[str, Any]:
    """The cost rows' sums the scorecard uses (0 for a day with no cost row yet)."""
    row = m.select([pl.col(c).fill_null(0).sum() if c in m.columns else pl.lit(zero).alias(c)
                    for c, zero in _SUMMED_METRICS.items()]).row(0, named=True) if m.height else dict(_SUMMED_METRICS)
    return {c: type(zero)(row[c] or 0) for c, zero in _SUMMED_METRICS.items()}


def _shard_problems(day: DayTables, slo: LatencySLO) -> tuple[list[ShardProblem], int, int]:
    """(the shards that need a look, rows without a result in decoded shards, rows not decoded yet).

    The day's shards are 0..n-1 of its shard count (those seen in any table when it has none).
    A shard needs a look when it has no shard table, no results ("not decoded"), fewer results
    than rows, error results, no cost row, or a P95 over the SLO."""
    seen = pl.concat([t.select("shard") for t in (day.shard_rows, day.results, day.metrics)]).unique()
    keys = (pl.DataFrame({"shard": [f"{i:04d}" for i in range(day.num_shards)]}, schema={"shard": pl.String})
            if day.num_shards is not None else seen)
    per_result = day.results.group_by("shard").agg(
        pl.len().alias("results"), (pl.col("finish_reason") == ERROR_FINISH).sum().alias("errors"))
    latency = [c for c in ("ttft_s_p95", "tpot_s_p95") if c in day.metrics.columns]
    costed = day.metrics.select("shard", *latency).with_columns(pl.lit(True).alias("costed"))
    for c in ("ttft_s_p95", "tpot_s_p95"):
        if c not in costed.columns:
            costed = costed.with_columns(pl.lit(None, pl.Float64).alias(c))
    f = (keys.join(day.shard_rows, on="shard", how="left").join(per_result, on="shard", how="left")
         .join(costed, on="shard", how="left")
         .with_columns(pl.col("rows").is_not_null().alias("tokenized"),
                       pl.col("results").is_not_null().alias("decoded"),
                       pl.col("rows").fill_null(0), pl.col("results").fill_null(0), pl.col("errors").fill_null(0),
                       pl.col("costed").fill_null(False))
         .with_columns((pl.col("rows") - pl.col("results")).clip(lower_bound=0).alias("missing"))
         .sort("shard"))
    parts = [
        pl.when(~pl.col("tokenized")).then(pl.lit("no shard table (re-run prompt_shards)")),
        pl.when(pl.col("tokenized") & ~pl.col("decoded")).then(pl.lit("not decoded")),
        pl.when(pl.col("decoded") & (pl.col("missing") > 0))
          .then(pl.format("{} rows without a result", pl.col("missing"))),
        pl.when(pl.col("errors") > 0).then(pl.format("{} error results", pl.col("errors"))),
        pl.when(pl.col("decoded") & ~pl.col("costed")).then(pl.lit("no cost_metrics row")),
        pl.when(pl.col("ttft_s_p95") > slo.ttft_s_p95)
          .then(pl.format("SLO: ttft_s_p95 {} s > {} s", pl.col("ttft_s_p95").round(4), pl.lit(slo.ttft_s_p95))),
        pl.when(pl.col("tpot_s_p95") > slo.tpot_s_p95)
          .then(pl.format("SLO: tpot_s_p95 {} s > {} s", pl.col("tpot_s_p95").round(4), pl.lit(slo.tpot_s_p95))),
    ]
    f = f.with_columns(pl.concat_str(parts, separator="; ", ignore_nulls=True).alias("problem"))
    counts = f.select(pl.col("missing").filter(pl.col("decoded")).sum().alias("failed"),
                      pl.col("rows").filter(~pl.col("decoded")).sum().alias("pending")).row(0, named=True)
    # Valid rows in no shard table at all (prompt_shards has not run): not decoded yet either.
    untabled = max(day.valid_rows - day.rejected_at_tokenization - int(day.shard_rows["rows"].sum()), 0)
    flagged = f.filter(pl.col("problem") != "").select("shard", "rows", "results", "problem")
    problems = [ShardProblem(**r) for r in flagged.to_dicts()]  # only the flagged shards, for the report
    return problems, int(counts["failed"] or 0), int(counts["pending"] or 0) + untabled


def write_scorecard(card: Scorecard, folder_url: str, *, storage_options: dict | None = None,
                    shard_link: Callable[[str], str] | None = None) -> tuple[str, str]:
    """``scorecard.md`` and ``scorecard.json`` in ``folder_url`` (beside the day's Parquet), each
    committed atomically (a reader sees the old file or the new); returns their URLs."""
    from kvbatch.io.batch_output import AtomicSink
    from kvbatch.io.shard_tables import join, write_json

    md, js = join(folder_url, "scorecard.md"), join(folder_url, "scorecard.json")
    sink = AtomicSink(md, storage_options)
    try:
        sink.write(card.to_markdown(shard_link).encode("utf-8"))
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    write_json(card.to_json(), js, storage_options=storage_options)
    return md, js


# ---- formatting (a person reads these; the JSON keeps the full precision)

def fmt_usd(amount: float | None) -> str:
    """Dollars as a person reads them: $1,234.56 from a dollar up, else four significant digits."""
    if amount is None:
        return "n/a"
    if amount < 0:
        return "-" + fmt_usd(-amount)
    if amount >= 1:
        return f"${amount:,.2f}"
    if amount == 0:
        return "$0"
    digits = 3 - math.floor(math.log10(amount))  # four significant digits, never an exponent
    return "$" + f"{amount:.{digits}f}".rstrip("0").rstrip(".")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _rate(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f} tokens/s"


def _seconds(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f} s"


def _link(shard: str, link: Callable[[str], str] | None) -> str:
    return shard if link is None else f"[{shard}]({link(shard)})"


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])

