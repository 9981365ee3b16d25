"""Meter one shard: tokens by class, KV cache hits by tier, TTFT/TPOT, device-seconds and dollars,
and dollars per million tokens by class.

Plain Python (no Dagster); the pipeline's ``cost_metrics`` asset calls :func:`shard_metrics`
with the shard's results table and the stats that prefill and decode committed beside them.
Every column carries its unit in its name. The attribution model (docs/metrics.md says the same):

- **Device-seconds by stage.** ``device_s_prefill = prefill wall x prefill_devices`` at the
  prefill device's hourly price, ``device_s_decode = decode wall x decode_devices`` at the decode
  device's. ``device_s`` is their sum.
- **Decode compute is split** between the prompt tokens decode computed itself (the tail past the
  last stored block, and misses) and the output, by measured step time: the decode stats'
  ``prompt_step_s`` when the engine reports it, else those tokens at the prompt rate prefill
  measured on the same model (``prompt_tokens_computed / wall_s``), capped at the decode wall;
  with neither, by token count.
- **Classes**, each with its dollars and its $/Mtok (null when it has no tokens):
  ``prefill_computed`` (prefill's compute, the storage of the blocks it wrote, prefill's
  object-store requests), ``store_memory`` / ``store_disk`` / ``store_object`` (prompt tokens
  decode loaded from each tier: decode's object-store requests and, when configured, the egress of
  object-tier reads go to the object tier; memory and disk reads cost no extra),
  ``prefix_cache`` (prompt tokens the engine's prefix cache served at decode: no extra cost),
  ``response_cache`` (prompt and output tokens of the rows the response cache answered, the
  results' ``cached`` rows: no compute, only the response cache's own object-store requests),
  ``decode_computed`` (decode's prompt share of its compute, plus storage of blocks decode wrote)
  and ``output`` (the output tokens decode computed: decode's output share, plus the egress of
  the results when they leave the region). The classes' dollars add up to ``cost_usd``.
- **The response cache** (``docs/response-cache.md``): a row it answered computed nothing, so it
  is charged no prefill or decode token: its prompt tokens count in
  ``prompt_tokens_decode_cached`` (served by a cache at decode, never computed) and in
  ``prompt_tokens_response_cache``, its output tokens in ``output_tokens`` (they are delivered)
  and in ``output_tokens_response_cache``, never in the ``output`` class; its latencies (none was
  measured) are left out of the percentiles. ``response_cache_hits`` counts those rows.
  ``response_cache_saved_usd`` is what they did not spend, an estimate: their output tokens at
  the ``output`` class's price of a computed output token (null when no output token was
  computed: nothing to price them by).
- **Storage** is GB-month per tier, prorated by how long the tier keeps a block
  (``retention_days_by_tier`` / 30); **requests** are priced per 1,000 by kind from the KV
  store's counts (``object_requests`` of each connector's stats; absent counts are 0).
- **Blended** ``usd_per_mtok_blended = cost_usd / billable_tokens x 1e6``; billable tokens are
  every prompt token of an answered request, however it was served, plus every output token
  (what a hosted API bills).
- **Reference** (optional): a hosted batch API's $/Mtok for input, cached input and output.
  Input at the full price is the prompt tokens kvbatch computed (at prefill or decode, at most the
  prompt tokens); the other prompt tokens at the cached price. ``savings_usd`` = reference - cost.

Optional inputs, absent when the engine does not produce them (nothing breaks, the columns are
0 or null): per request ``spec_draft_tokens`` / ``spec_accepted_tokens`` / ``spec_target_steps``
(speculative decoding: ``spec_acceptance_rate`` = accepted / drafted, null when nothing was
drafted; ``spec_tokens_per_target_step`` = output tokens / target-model steps), and per shard
``speculative.drafter_time_share`` and ``expert_load_balancedness`` in the decode stats (MoE:
mean / max rank load, 1 is perfect).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from kvbatch.ops.results.metrics import LATENCIES, LATENCY_PERCENTILES

TIERS = ("memory", "disk", "object")
REQUEST_KINDS = ("GET", "PUT", "LIST", "HEAD", "DELETE")
CLASSES = ("prefill_computed", *(f"store_{t}" for t in TIERS), "prefix_cache", "response_cache", "decode_computed",
           "output")
DAYS_PER_MONTH = 30.0
DEFAULT_DEVICE = "cpu-host"


@dataclass(frozen=True)
class ReferencePrices:
    """A hosted batch API's list prices, dollars per million tokens."""

    usd_per_mtok_input: float
    usd_per_mtok_cached_input: float
    usd_per_mtok_output: float


@dataclass(frozen=True)
class Pricing:
    """Rates and where each stage ran. ``Pricing()`` prices everything at 0 (counts only)."""

    usd_per_device_hour: Mapping[str, float] = field(default_factory=lambda: {DEFAULT_DEVICE: 0.0})
    prefill_device: str = DEFAULT_DEVICE
    prefill_devices: int = 1
    decode_device: str = DEFAULT_DEVICE
    decode_devices: int = 1
    usd_per_gb_month_by_tier: Mapping[str, float] = field(default_factory=dict)
    retention_days_by_tier: Mapping[str, float] = field(default_factory=dict)
    usd_per_1k_requests: Mapping[str, float] = field(default_factory=dict)
    usd_per_gb_egress: float = 0.0
    results_leave_region: bool = False
    kv_object_reads_leave_region: bool = False
    reference: ReferencePrices | None = None

    def __post_init__(self) -> None:
        for stage in ("prefill", "decode"):
            kind, n = getattr(self, f"{stage}_device"), getattr(self, f"{stage}_devices")
            if kind not in self.usd_per_device_hour:
                raise ValueError(f"{stage}_device {kind!r} has no price in usd_per_device_hour "
                                 f"(priced: {sorted(self.usd_per_device_hour)})")
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{stage}_devices must be an integer >= 1, got {n!r}")
        for name, allowed in (("usd_per_gb_month_by_tier", TIERS), ("retention_days_by_tier", TIERS),
                              ("usd_per_1k_requests", REQUEST_KINDS)):
            unknown = set(getattr(self, name)) - set(allowed)
            if unknown:
                raise ValueError(f"{name} has unknown keys {sorted(unknown)}; allowed: {list(allowed)}")
        rates = [*self.usd_per_device_hour.values(), *self.usd_per_gb_month_by_tier.values(),
                 *self.retention_days_by_tier.values(), *self.usd_per_1k_requests.values(), self.usd_per_gb_egress]
        if any(not (isinstance(r, (int, float)) and math.isfinite(r) and r >= 0) for r in rates):
            raise ValueError("every price and retention must be a finite number >= 0")

    def device_hour(self, stage: str) -> float:
        return float(self.usd_per_device_hour[getattr(self, f"{stage}_device")])


METRICS_SCHEMA = pa.schema([
    ("requests", pa.int64()),
    ("prompt_tokens", pa.int64()),
    ("prompt_tokens_prefill_computed", pa.int64()),
    ("prompt_tokens_prefill_already_stored", pa.int64()),
    ("prompt_tokens_decode_loaded", pa.int64()),
    ("prompt_tokens_decode_cached", pa.int64()),
    ("prompt_tokens_decode_computed", pa.int64()),
    ("output_tokens", pa.int64()),
    ("billable_tokens", pa.int64()),
    ("response_cache_hits", pa.int64()),
    ("prompt_tokens_response_cache", pa.int64()),
    ("output_tokens_response_cache", pa.int64()),
    *[(f"response_cache_requests_{k.lower()}", pa.int64()) for k in REQUEST_KINDS],
    *[(f"kv_tokens_hit_{t}", pa.int64()) for t in TIERS],
    ("kv_blocks_written", pa.int64()),
    ("kv_bytes_written", pa.int64()),
    *[(f"kv_bytes_written_{t}", pa.int64()) for t in TIERS],
    ("kv_bytes_read", pa.int64()),
    *[(f"kv_bytes_read_{t}", pa.int64()) for t in TIERS],
    ("results_bytes", pa.int64()),
    *[(f"kv_requests_{k.lower()}", pa.int64()) for k in REQUEST_KINDS],
    ("spec_draft_tokens", pa.int64()),
    ("spec_accepted_tokens", pa.int64()),
    ("spec_target_steps", pa.int64()),
    ("spec_acceptance_rate", pa.float64()),
    ("spec_tokens_per_target_step", pa.float64()),
    ("spec_drafter_time_share", pa.float64()),
    ("expert_load_balancedness", pa.float64()),
    *[(f"{name}_p{p}", pa.float64()) for name in LATENCIES for p in LATENCY_PERCENTILES],
    ("prefill_wall_s", pa.float64()),
    ("decode_wall_s", pa.float64()),
    ("decode_prompt_s", pa.float64()),
    ("device_s_prefill", pa.float64()),
    ("device_s_decode", pa.float64()),
    ("device_s", pa.float64()),
    ("cost_compute_usd", pa.float64()),
    ("cost_storage_usd", pa.float64()),
    ("cost_requests_usd", pa.float64()),
    ("cost_transfer_usd", pa.float64()),
    ("cost_usd", pa.float64()),
    *[(f"cost_{c}_usd", pa.float64()) for c in CLASSES],
    *[(f"usd_per_mtok_{c}", pa.float64()) for c in CLASSES],
    ("usd_per_mtok_blended", pa.float64()),
    ("reference_cost_usd", pa.float64()),
    ("savings_usd", pa.float64()),
    ("response_cache_saved_usd", pa.float64()),
])

SPEC_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_target_steps")

# The stats keys (``prefill.<key>``, ``decode.<key>``, ``prefill.connector.<key>``...) a real run may
# leave out: the meter reads every key with a default, so stats written before a key existed still
# meter; any other key missing is a stats writer and this meter disagreeing, metered as 0 without
# a word. tests/test_cost.py checks, on what a tiny prefill and decode really commit, that the meter
# defaults no key but these.
OPTIONAL_STATS = frozenset({
    "decode.prompt_step_s",  # an engine that times its prompt steps apart
    "decode.speculative",  # speculative decoding only
    "decode.expert_load_balancedness",  # MoE only
    "decode.response_cache",  # a decode with the response cache only
})


def class_tokens(row: Mapping[str, Any]) -> dict[str, int]:
    """The tokens each cost class is about, from a metrics row (a shard's or a day's sums). A row
    the response cache answered is in its own class, neither a prefix-cache hit nor computed output."""
    # (0 in a row metered before the response cache was: a day's rollup read back from old shards)
    rc_prompt, rc_output = (int(row.get(c) or 0)
                            for c in ("prompt_tokens_response_cache", "output_tokens_response_cache"))
    return {"prefill_computed": int(row["prompt_tokens_prefill_computed"]),
            **{f"store_{t}": int(row[f"kv_tokens_hit_{t}"]) for t in TIERS},
            "prefix_cache": int(row["prompt_tokens_decode_cached"]) - rc_prompt,
            "response_cache": rc_prompt + rc_output,
            "decode_computed": int(row["prompt_tokens_decode_computed"]),
            "output": int(row["output_tokens"]) - rc_output}


def per_mtok(usd: float, tokens: int) -> float | None:
    """Dollars per million tokens; None when there are no tokens (not applicable, not 0)."""
    return round(usd / tokens * 1e6, 9) if tokens else None


def unit_prices(row: Mapping[str, Any]) -> dict[str, float | None]:
    """$/Mtok by class and blended, from summed dollars and tokens (never an average of ratios)."""
    tokens = class_tokens(row)
    out = {f"usd_per_mtok_{c}": per_mtok(float(row[f"cost_{c}_usd"]), tokens[c]) for c in CLASSES}
    out["usd_per_mtok_blended"] = per_mtok(float(row["cost_usd"]), int(row["billable_tokens"]))
    out["response_cache_saved_usd"] = response_cache_saved_usd(row, tokens["output"])
    return out


def response_cache_saved_usd(row: Mapping[str, Any], computed_output: int) -> float | None:
    """What the rows the response cache answered did not spend (an estimate): their output tokens
    at the price of an output token computed in the same rows' shard or day; 0 with no such row,
    None when no output token was computed (no price to charge them at)."""
    served = int(row.get("output_tokens_response_cache") or 0)
    if not served:
        return 0.0
    if not computed_output:
        return None
    return round(served * float(row["cost_output_usd"]) / computed_output, 12)


def response_cache_rows(columns: list[str]) -> Any:
    """The results rows the response cache answered (a polars expression): the results' ``cached``
    column (``ops/decode/shard.py``); none in a table written before it existed."""
    import polars as pl

    return pl.col("cached").fill_null(False) if "cached" in columns else pl.lit(False)


# The results columns the meter reads; a missing one counts as 0 (or no latencies).
_SUMMED = ("prompt_tokens", "loaded_prompt_tokens", "cached_prompt_tokens", "completion_tokens", *SPEC_FIELDS)


def results_figures(results: pa.Table) -> dict[str, Any]:
    """One shard's per-request columns reduced with polars: the token sums, the output tokens of
    the requests that speculated (``spec_outputs``) and the latency percentiles."""
    import polars as pl

    present = [c for c in (*_SUMMED, *LATENCIES, "cached") if c in results.schema.names]
    df = pl.from_arrow(results.select(present)) if present else pl.DataFrame()
    exprs = [pl.col(c).sum().alias(c) if c in present else pl.lit(0).alias(c) for c in _SUMMED]
    cached = response_cache_rows(present)
    served = {name: pl.col(c).filter(cached).sum().alias(name) if c in present else pl.lit(0).alias(name)
              for name, c in (("rc_prompt", "prompt_tokens"), ("rc_output", "completion_tokens"))}
    exprs += [cached.sum().alias("rc_rows"), *served.values()]
    if "cached_prompt_tokens" in present:
        # A row the response cache answered computed nothing: its prompt tokens count as served
        # by a cache at decode (with the prefix-cache hits), never as computed at decode.
        exprs[_SUMMED.index("cached_prompt_tokens")] = (pl.col("cached_prompt_tokens").sum()
                                                        + served["rc_prompt"]).alias("cached_prompt_tokens")
    if {"completion_tokens", "spec_target_steps"} <= set(present):
        # Output tokens of the requests that went through the target model step by step.
        exprs.append(pl.col("completion_tokens").filter(pl.col("spec_target_steps").fill_null(0) != 0).sum()
                     .alias("spec_outputs"))
    else:
        exprs.append(pl.lit(0).alias("spec_outputs"))
    for name in LATENCIES:
        for p in LATENCY_PERCENTILES:
            # A row the response cache answered measured no latency (no engine ran it).
            q = (pl.col(name).filter(~cached).drop_nulls().quantile(p / 100, interpolation="linear")
                 if name in present else pl.lit(None, pl.Float64))
            exprs.append(q.alias(f"{name}_p{p}"))
    out = (df if present else pl.DataFrame({"_": [0]})).select(exprs).row(0, named=True)
    for c in (*_SUMMED, "spec_outputs", "rc_rows", "rc_prompt", "rc_output"):
        out[c] = int(out[c] or 0)
    for name in LATENCIES:
        for p in LATENCY_PERCENTILES:
            v = out[f"{name}_p{p}"]
            out[f"{name}_p{p}"] = None if v is None else round(float(v), 6)
    return out


def _speculative(sums: Mapping[str, Any]) -> dict[str, Any]:
    drafted, accepted, steps = (sums[f] for f in SPEC_FIELDS)
    return {
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_target_steps": steps,
        "spec_acceptance_rate": round(accepted / drafted, 6) if drafted else None,
        "spec_tokens_per_target_step": round(sums["spec_outputs"] / steps, 6) if steps else None,
    }


def _requests(conn: Mapping[str, Any]) -> dict[str, int]:
    got = conn.get("object_requests", {}) or {}
    return {k: int(got.get(k, 0)) for k in REQUEST_KINDS}


def _written_by_tier(conn: Mapping[str, Any]) -> dict[str, int]:
    """Bytes a connector wrote by tier; a connector that reports only a total wrote it to the
    durable (object) tier, which is the one that keeps blocks across runs."""
    by_tier = conn.get("kv_bytes_written_by_tier", {}) or {}
    if not by_tier and conn.get("kv_bytes_written"):
        by_tier = {"object": conn["kv_bytes_written"]}
    return {t: int(by_tier.get(t, 0)) for t in TIERS}


def _storage_usd(written: Mapping[str, int], pricing: Pricing) -> float:
    return sum(written[t] / 1e9 * pricing.usd_per_gb_month_by_tier.get(t, 0.0)
               * pricing.retention_days_by_tier.get(t, 0.0) / DAYS_PER_MONTH for t in TIERS)


def _requests_usd(counts: Mapping[str, int], pricing: Pricing) -> float:
    return sum(counts[k] / 1000 * pricing.usd_per_1k_requests.get(k, 0.0) for k in REQUEST_KINDS)


def _decode_prompt_seconds(decode: Mapping[str, Any], prefill: Mapping[str, Any], decode_s: float,
                           prompt_computed: int, output: int) -> float:
    """Seconds of decode's wall time spent on prompt tokens (see the module docstring)."""
    if not decode_s or not prompt_computed:
        return 0.0
    if decode.get("prompt_step_s") is not None:
        return min(float(decode["prompt_step_s"]), decode_s)
    prefill_tokens, prefill_s = int(prefill.get("prompt_tokens_computed", 0)), float(prefill.get("wall_s", 0.0))
    if prefill_tokens and prefill_s > 0:
        return min(prompt_computed / (prefill_tokens / prefill_s), decode_s)
    return decode_s * prompt_computed / (prompt_computed + output)


def _reference_usd(ref: ReferencePrices | None, prompt: int, computed: int, output: int) -> float | None:
    if ref is None:
        return None
    fresh = min(prompt, computed)
    return ((fresh * ref.usd_per_mtok_input + (prompt - fresh) * ref.usd_per_mtok_cached_input
             + output * ref.usd_per_mtok_output) / 1e6)


def shard_metrics(results: pa.Table, prefill: Mapping[str, Any], decode: Mapping[str, Any],
                  pricing: Pricing) -> dict[str, Any]:
    """One row of :data:`METRICS_SCHEMA` for a shard."""
    sums = results_figures(results)
    prompt, loaded, cached = sums["prompt_tokens"], sums["loaded_prompt_tokens"], sums["cached_prompt_tokens"]
    output = sums["completion_tokens"]
    decode_computed = prompt - loaded - cached
    prefill_computed = int(prefill.get("prompt_tokens_computed", 0))
    pconn, dconn = prefill.get("connector", {}) or {}, decode.get("connector", {}) or {}
    served = dconn.get("prompt_tokens_served_by_tier", {}) or {}
    read_by_tier = {t: int((dconn.get("kv_bytes_read_by_tier", {}) or {}).get(t, 0)) for t in TIERS}
    p_written, d_written = _written_by_tier(pconn), _written_by_tier(dconn)
    p_requests, d_requests = _requests(pconn), _requests(dconn)
    # The response cache's lookups and writes (its own object-store requests, apart from the KV store's).
    rc_requests = _requests({"object_requests": (decode.get("response_cache") or {}).get("requests")})
    results_bytes = int(decode.get("results_bytes", 0))

    prefill_s, decode_s = float(prefill.get("wall_s", 0.0)), float(decode.get("wall_s", 0.0))
    device_prefill, device_decode = prefill_s * pricing.prefill_devices, decode_s * pricing.decode_devices
    compute_prefill = device_prefill / 3600 * pricing.device_hour("prefill")
    compute_decode = device_decode / 3600 * pricing.device_hour("decode")
    prompt_s = _decode_prompt_seconds(decode, prefill, decode_s, decode_computed, output)
    decode_prompt_share = prompt_s / decode_s if decode_s else 0.0
    storage_prefill, storage_decode = _storage_usd(p_written, pricing), _storage_usd(d_written, pricing)
    requests_prefill, requests_decode = _requests_usd(p_requests, pricing), _requests_usd(d_requests, pricing)
    requests_rc = _requests_usd(rc_requests, pricing)
    egress_gb = pricing.usd_per_gb_egress / 1e9
    egress_kv = read_by_tier["object"] * egress_gb if pricing.kv_object_reads_leave_region else 0.0
    egress_results = results_bytes * egress_gb if pricing.results_leave_region else 0.0

    by_class = {
        "prefill_computed": compute_prefill + storage_prefill + requests_prefill,
        "store_memory": 0.0,
        "store_disk": 0.0,
        "store_object": requests_decode + egress_kv,
        "prefix_cache": 0.0,
        "response_cache": requests_rc,
        "decode_computed": compute_decode * decode_prompt_share + storage_decode,
        "output": compute_decode * (1 - decode_prompt_share) + egress_results,
    }
    by_class = {c: round(v, 12) for c, v in by_class.items()}
    total = round(sum(by_class.values()), 12)
    reference = _reference_usd(pricing.reference, prompt, prefill_computed + decode_computed, output)
    row = {
        "requests": results.num_rows,
        "prompt_tokens": prompt,
        "prompt_tokens_prefill_computed": prefill_computed,
        "prompt_tokens_prefill_already_stored": int(prefill.get("prompt_tokens_already_stored", 0)),
        "prompt_tokens_decode_loaded": loaded,
        "prompt_tokens_decode_cached": cached,
        "prompt_tokens_decode_computed": decode_computed,
        "output_tokens": output,
        "billable_tokens": prompt + output,
        "response_cache_hits": sums["rc_rows"],
        "prompt_tokens_response_cache": sums["rc_prompt"],
        "output_tokens_response_cache": sums["rc_output"],
        **{f"response_cache_requests_{k.lower()}": rc_requests[k] for k in REQUEST_KINDS},
        **{f"kv_tokens_hit_{t}": int(served.get(t, 0)) for t in TIERS},
        "kv_blocks_written": int(pconn.get("blocks_written", 0)),
        "kv_bytes_written": int(pconn.get("kv_bytes_written", 0)),
        **{f"kv_bytes_written_{t}": p_written[t] + d_written[t] for t in TIERS},
        "kv_bytes_read": sum(read_by_tier.values()),
        **{f"kv_bytes_read_{t}": read_by_tier[t] for t in TIERS},
        "results_bytes": results_bytes,
        **{f"kv_requests_{k.lower()}": p_requests[k] + d_requests[k] for k in REQUEST_KINDS},
        **_speculative(sums),
        # Seconds drafting / seconds in engine steps (the decode's own view; None without a drafter).
        "spec_drafter_time_share": (decode.get("speculative") or {}).get("drafter_time_share"),
        "expert_load_balancedness": (None if decode.get("expert_load_balancedness") is None
                                     else float(decode["expert_load_balancedness"])),
        **{f"{n}_p{p}": sums[f"{n}_p{p}"] for n in LATENCIES for p in LATENCY_PERCENTILES},
        "prefill_wall_s": round(prefill_s, 6),
        "decode_wall_s": round(decode_s, 6),
        "decode_prompt_s": round(prompt_s, 6),
        "device_s_prefill": round(device_prefill, 6),
        "device_s_decode": round(device_decode, 6),
        "device_s": round(device_prefill + device_decode, 6),
        "cost_compute_usd": round(compute_prefill + compute_decode, 12),
        "cost_storage_usd": round(storage_prefill + storage_decode, 12),
        "cost_requests_usd": round(requests_prefill + requests_decode + requests_rc, 12),
        "cost_transfer_usd": round(egress_kv + egress_results, 12),
        "cost_usd": total,
        **{f"cost_{c}_usd": v for c, v in by_class.items()},
        "reference_cost_usd": None if reference is None else round(reference, 12),
        "savings_usd": None if reference is None else round(reference - total, 12),
    }
    row.update(unit_prices(row))
    return row


def metrics_table(row: Mapping[str, Any]) -> pa.Table:
    return pa.Table.from_pylist([dict(row)], METRICS_SCHEMA)


# ------------------------------------------------------------------ the day: a sum of its shards

RATIO_COLUMNS = {"spec_acceptance_rate", "spec_tokens_per_target_step", "spec_drafter_time_share",
                 "expert_load_balancedness", *(f"usd_per_mtok_{c}" for c in (*CLASSES, "blended")),
                 *(f"{n}_p{p}" for n in LATENCIES for p in LATENCY_PERCENTILES), "reference_cost_usd", "savings_usd",
                 "response_cache_saved_usd"}
SUM_COLUMNS = tuple(f.name for f in METRICS_SCHEMA if f.name not in RATIO_COLUMNS)


def day_rollup(metrics: Any, latencies: Any) -> dict[str, Any]:
    """One day from its shards' cost rows (a polars frame of :data:`METRICS_SCHEMA` rows) and its
    requests' ``ttft_s`` / ``tpot_s`` (a polars frame): counts, seconds and dollars summed; $/Mtok,
    hit rates and acceptance recomputed from the sums (never averaged over shards); p50/p95/p99 over
    every request of the day (percentiles do not add)."""
    import polars as pl

    if metrics.height == 0:
        raise ValueError("no cost_metrics shard of this day is committed: materialize cost_metrics first")
    # A column no shard has (every cost row written before it existed) sums to 0.
    row: dict[str, Any] = metrics.select([pl.col(c).sum() if c in metrics.columns else pl.lit(0).alias(c)
                                          for c in SUM_COLUMNS]).row(0, named=True)
    row = {k: (float(v) if METRICS_SCHEMA.field(k).type == pa.float64() else int(v)) for k, v in row.items()}
    row["shards"] = metrics.height
    row.update(unit_prices(row))
    drafted, accepted, steps = row["spec_draft_tokens"], row["spec_accepted_tokens"], row["spec_target_steps"]
    row["spec_acceptance_rate"] = round(accepted / drafted, 6) if drafted else None
    row["spec_tokens_per_target_step"] = None if not steps else round(
        float(metrics.select((pl.col("spec_tokens_per_target_step").fill_null(0) * pl.col("spec_target_steps")).sum())
              .item()) / steps, 6)
    balance = metrics["expert_load_balancedness"].drop_nulls()
    row["expert_load_balancedness"] = round(float(balance.min()), 6) if balance.len() else None  # the worst shard
    row["spec_drafter_time_share"] = None
    refs = metrics["reference_cost_usd"].drop_nulls()
    row["reference_cost_usd"] = round(float(refs.sum()), 12) if refs.len() else None
    row["savings_usd"] = None if row["reference_cost_usd"] is None else round(row["reference_cost_usd"]
                                                                              - row["cost_usd"], 12)
    for name in LATENCIES:
        values = latencies[name].drop_nulls() if name in latencies.columns else pl.Series(name, [], pl.Float64)
        for p in LATENCY_PERCENTILES:
            q = values.quantile(p / 100, interpolation="linear") if values.len() else None
            row[f"{name}_p{p}"] = None if q is None else round(float(q), 6)
    return row


ROLLUP_SCHEMA = METRICS_SCHEMA.append(pa.field("shards", pa.int64()))
