"""Meter one shard: tokens by class, KV cache hits by tier, TTFT/TPOT, seconds and dollars.

Plain Python (no Dagster); the pipeline's ``cost_metrics`` asset calls :func:`shard_metrics`
with the shard's results table and the stats that prefill and decode committed beside them.

Dollars: ``device_s / 3600 * usd_per_device_hour`` for compute (prefill + decode wall time
times the devices used), ``kv_bytes_written / 1e9 * usd_per_gb_stored`` for the KV blocks the
shard added to the store, and ``(kv_bytes_read + results_bytes) / 1e9 * usd_per_gb_moved`` for
the bytes moved. Every column carries its unit in its name.

Optional inputs, absent when the engine does not produce them (nothing breaks, the columns are
0 or null): per request ``spec_draft_tokens`` / ``spec_accepted_tokens`` / ``spec_target_steps``
(speculative decoding: ``spec_acceptance_rate`` = accepted / drafted, null when nothing was
drafted; ``spec_tokens_per_target_step`` = output tokens / target-model steps), and per shard
``speculative.drafter_time_share`` and ``expert_load_balancedness`` in the decode stats (MoE: mean / max rank load, 1 is perfect).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from kvbatch.ops.metrics import percentile

TIERS = ("memory", "disk", "object")


@dataclass(frozen=True)
class Pricing:
    usd_per_device_hour: float = 0.0
    usd_per_gb_stored: float = 0.0
    usd_per_gb_moved: float = 0.0
    devices: int = 1


METRICS_SCHEMA = pa.schema([
    ("requests", pa.int64()),
    ("prompt_tokens", pa.int64()),
    ("prompt_tokens_prefill_computed", pa.int64()),
    ("prompt_tokens_prefill_already_stored", pa.int64()),
    ("prompt_tokens_decode_loaded", pa.int64()),
    ("prompt_tokens_decode_cached", pa.int64()),
    ("prompt_tokens_decode_computed", pa.int64()),
    ("output_tokens", pa.int64()),
    *[(f"kv_tokens_hit_{t}", pa.int64()) for t in TIERS],
    ("kv_blocks_written", pa.int64()),
    ("kv_bytes_written", pa.int64()),
    ("kv_bytes_read", pa.int64()),
    ("results_bytes", pa.int64()),
    ("spec_draft_tokens", pa.int64()),
    ("spec_accepted_tokens", pa.int64()),
    ("spec_target_steps", pa.int64()),
    ("spec_acceptance_rate", pa.float64()),
    ("spec_tokens_per_target_step", pa.float64()),
    ("spec_drafter_time_share", pa.float64()),
    ("expert_load_balancedness", pa.float64()),
    ("ttft_s_p50", pa.float64()),
    ("ttft_s_p95", pa.float64()),
    ("tpot_s_p50", pa.float64()),
    ("tpot_s_p95", pa.float64()),
    ("prefill_wall_s", pa.float64()),
    ("decode_wall_s", pa.float64()),
    ("device_s", pa.float64()),
    ("cost_compute_usd", pa.float64()),
    ("cost_storage_usd", pa.float64()),
    ("cost_transfer_usd", pa.float64()),
    ("cost_usd", pa.float64()),
])


SPEC_FIELDS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_target_steps")


def _total(cols: Mapping[str, list], name: str) -> int:
    """Sum of an optional integer column (missing column or nulls count as 0)."""
    return int(sum(x for x in cols.get(name, []) if x is not None))


def _speculative(cols: Mapping[str, list]) -> dict[str, Any]:
    drafted, accepted, steps = (_total(cols, f) for f in SPEC_FIELDS)
    # Output tokens of the requests that went through the target model step by step.
    outputs = sum(c for c, s in zip(cols.get("completion_tokens", []), cols.get("spec_target_steps", []), strict=False)
                  if s)
    return {
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_target_steps": steps,
        "spec_acceptance_rate": round(accepted / drafted, 6) if drafted else None,
        "spec_tokens_per_target_step": round(outputs / steps, 6) if steps else None,
    }


def shard_metrics(results: pa.Table, prefill: Mapping[str, Any], decode: Mapping[str, Any],
                  pricing: Pricing) -> dict[str, Any]:
    """One row of :data:`METRICS_SCHEMA` for a shard."""
    cols = results.to_pydict() if results.num_rows else {n: [] for n in results.schema.names}
    ttft = [x for x in cols.get("ttft_s", []) if x is not None]
    tpot = [x for x in cols.get("tpot_s", []) if x is not None]
    prompt = sum(cols.get("prompt_tokens", []))
    loaded = sum(cols.get("loaded_prompt_tokens", []))
    cached = sum(cols.get("cached_prompt_tokens", []))
    pconn = prefill.get("connector", {})
    dconn = decode.get("connector", {})
    served = dconn.get("prompt_tokens_served_by_tier", {})
    read = sum(dconn.get("kv_bytes_read_by_tier", {}).values())
    written = int(pconn.get("kv_bytes_written", 0))
    results_bytes = int(decode.get("results_bytes", 0))
    prefill_s = float(prefill.get("wall_s", 0.0))
    decode_s = float(decode.get("wall_s", 0.0))
    device_s = (prefill_s + decode_s) * pricing.devices
    compute = device_s / 3600 * pricing.usd_per_device_hour
    storage = written / 1e9 * pricing.usd_per_gb_stored
    transfer = (read + results_bytes) / 1e9 * pricing.usd_per_gb_moved
    return {
        "requests": results.num_rows,
        "prompt_tokens": prompt,
        "prompt_tokens_prefill_computed": int(prefill.get("prompt_tokens_computed", 0)),
        "prompt_tokens_prefill_already_stored": int(prefill.get("prompt_tokens_already_stored", 0)),
        "prompt_tokens_decode_loaded": loaded,
        "prompt_tokens_decode_cached": cached,
        "prompt_tokens_decode_computed": prompt - loaded - cached,
        "output_tokens": sum(cols.get("completion_tokens", [])),
        **{f"kv_tokens_hit_{t}": int(served.get(t, 0)) for t in TIERS},
        "kv_blocks_written": int(pconn.get("blocks_written", 0)),
        "kv_bytes_written": written,
        "kv_bytes_read": int(read),
        "results_bytes": results_bytes,
        **_speculative(cols),
        # Seconds drafting / seconds in engine steps (the decode's own view; None without a drafter).
        "spec_drafter_time_share": (decode.get("speculative") or {}).get("drafter_time_share"),
        "expert_load_balancedness": (None if decode.get("expert_load_balancedness") is None
                                     else float(decode["expert_load_balancedness"])),
        "ttft_s_p50": percentile(ttft, 50),
        "ttft_s_p95": percentile(ttft, 95),
        "tpot_s_p50": percentile(tpot, 50),
        "tpot_s_p95": percentile(tpot, 95),
        "prefill_wall_s": round(prefill_s, 6),
        "decode_wall_s": round(decode_s, 6),
        "device_s": round(device_s, 6),
        "cost_compute_usd": round(compute, 9),
        "cost_storage_usd": round(storage, 9),
        "cost_transfer_usd": round(transfer, 9),
        "cost_usd": round(compute + storage + transfer, 9),
    }


def metrics_table(row: Mapping[str, Any]) -> pa.Table:
    return pa.Table.from_pylist([dict(row)], METRICS_SCHEMA)
