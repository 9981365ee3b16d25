"""The asset checks' specs (name, description, partitions) and the latency SLO check.

Each check runs inside the step of the asset it guards (``check_specs``), once per partition
of that asset: a (date, shard) check is recorded against its (date, shard), so the UI shows
which shard failed. The descriptions are what the UI shows beside each check.
"""

from __future__ import annotations

import os
import warnings
from typing import Literal

import dagster as dg
from pydantic import Field

from kvbatch.ops.results.metrics import LatencySLO, check_slo
from kvbatch.pipelines.partitions import date_partitions

SLO_TTFT_ENV, SLO_TPOT_ENV, SLO_SEVERITY_ENV = "KVBATCH_SLO_TTFT_P95_S", "KVBATCH_SLO_TPOT_P95_S", "KVBATCH_SLO_SEVERITY"


def _spec(name: str, asset: list[str], partitions: dg.PartitionsDefinition, description: str,
          blocking: bool = False) -> dg.AssetCheckSpec:
    from kvbatch.pipelines.check_policy import blocks

    key = asset if isinstance(asset, str) else dg.AssetKey.from_coercible(asset).to_user_string()
    blocking = blocking or blocks(key, name)  # the policy and its reasons: pipelines/check_policy.py
    if blocking and "Blocking" not in description:
        description += (" Blocking: when it fails with severity ERROR the run fails (after the asset is "
                        "recorded) and nothing downstream of the asset runs in it.")
    with warnings.catch_warnings():  # partitioned checks are marked preview; they are how a check names its shard
        warnings.simplefilter("ignore", category=dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset=asset, partitions_def=partitions, description=description,
                                 blocking=blocking)


def prompts_checks(prefix: str) -> list[dg.AssetCheckSpec]:
    """The checks of ``[prefix, "prompts"]``.

    Blocking: a failure fails the ``prompts`` step, so nothing downstream in the same run
    (tokenizing, prefill, decode) touches a table with repeated ids or too many rejects."""
    return [
        _spec("reject_rate_below_threshold", [prefix, "prompts"], date_partitions,
              "Rows rejected at ingest / input rows is at most the run config's max_reject_rate (default 5%). "
              "Blocking: the day's later steps do not run when it fails.", blocking=True),
        _spec("unique_custom_ids", [prefix, "prompts"], date_partitions,
              "Each custom_id appears once in the prompts table every later step reads. "
              "Blocking: the day's later steps do not run when it fails.", blocking=True),
    ]


def decode_checks(prefix: str, shards: dg.PartitionsDefinition) -> list[dg.AssetCheckSpec]:
    """The checks of ``[prefix, "decode_results"]``, one per (date, shard) of ``shards``."""
    return [
        _spec("one_result_per_custom_id", [prefix, "decode_results"], shards,
              "Every row of the shard has exactly one result, and no result belongs to no row."),
        _spec("output_within_max_tokens", [prefix, "decode_results"], shards,
              "No result is longer than its request's own max_tokens (the shard's, not the hand-off's)."),
    ]


SLO_DESCRIPTION = ("P95 time to first token and P95 time per output token within the SLO (cost_metrics / "
                   f"cost_rollup run config, or {SLO_TTFT_ENV} / {SLO_TPOT_ENV}); severity WARN or ERROR "
                   f"({SLO_SEVERITY_ENV}).")


def shard_slo_check(prefix: str, shards: dg.PartitionsDefinition) -> dg.AssetCheckSpec:
    return _spec("latency_p95_within_slo", [prefix, "cost_metrics"], shards, SLO_DESCRIPTION)


def day_slo_check(prefix: str) -> dg.AssetCheckSpec:
    return _spec("latency_p95_within_slo", [prefix, "cost_rollup"], date_partitions, SLO_DESCRIPTION)


class SLOConfig(dg.Config):
    """Latency SLO of the P95 check; defaults from the environment (read at import, like the
    partitions), so a deployment sets them once."""

    ttft_s_p95_max: float = Field(default=float(os.environ.get(SLO_TTFT_ENV, "30")), gt=0,
                                  description=f"P95 time to first token, seconds (default {SLO_TTFT_ENV} or 30)")
    tpot_s_p95_max: float = Field(default=float(os.environ.get(SLO_TPOT_ENV, "1.0")), gt=0,
                                  description=f"P95 time per output token, seconds (default {SLO_TPOT_ENV} or 1.0)")
    slo_severity: Literal["WARN", "ERROR"] = Field(
        default=os.environ.get(SLO_SEVERITY_ENV, "WARN").upper(),  # type: ignore[arg-type]
        description=f"how a breach shows: WARN (yellow) or ERROR (red); default {SLO_SEVERITY_ENV} or WARN")


def slo_check_result(measured: dict, config: SLOConfig) -> dg.AssetCheckResult:
    """The P95 SLO check of one shard's or one day's latencies."""
    verdict = check_slo(measured, LatencySLO(config.ttft_s_p95_max, config.tpot_s_p95_max))
    metadata: dict = {f"{k}_max": v for k, v in (("ttft_s_p95", config.ttft_s_p95_max),
                                                 ("tpot_s_p95", config.tpot_s_p95_max))}
    metadata.update({k: v for k, v in verdict.measured.items() if v is not None})
    if verdict.breaches:
        metadata["breaches"] = "; ".join(verdict.breaches)
    return dg.AssetCheckResult(check_name="latency_p95_within_slo", passed=verdict.passed, metadata=metadata,
                               severity=dg.AssetCheckSeverity[config.slo_severity],
                               description=None if verdict.passed else "SLO breached: " + "; ".join(verdict.breaches))
