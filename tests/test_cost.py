"""The cost model of ``kvbatch.ops.results.cost`` on hand-made shard stats (no model, no Dagster run):
dollars by token class add up to the total, device-seconds are charged per stage at that stage's
devices, storage is GB-month per tier prorated by retention, requests are priced per 1,000 by
kind, $/Mtok is left out (None) where a class has no tokens, and a day's rollup is the sum of
its shards. Also the SLO verdict, the progress meter and the pricing resource's validation; and
the contract between the meter and the stats a real tiny prefill and decode commit (the meter reads
every key with a default: on real stats it must default none but ``OPTIONAL_STATS``)."""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pytest

from kvbatch.ops.results.cost import (
    CLASSES,
    Pricing,
    ReferencePrices,
    class_tokens,
    day_rollup,
    metrics_table,
    shard_metrics,
)
from kvbatch.ops.results.metrics import LatencySLO, ProgressMeter, check_slo
from kvbatch.resources import PricingResource

GB = 10 ** 9


def _results(**extra) -> pa.Table:
    # 3 requests: 300 prompt tokens = 160 loaded (object 96, disk 64) + 80 prefix-cache hits + 60 computed at decode.
    return pa.table({"prompt_tokens": [100, 100, 100], "loaded_prompt_tokens": [96, 64, 0],
                     "cached_prompt_tokens": [0, 0, 80], "completion_tokens": [10, 20, 30],
                     "ttft_s": [0.1, 0.2, 0.4], "tpot_s": [0.01, 0.02, None], **extra})


PREFILL = {"wall_s": 36.0, "prompt_tokens_computed": 240, "prompt_tokens_already_stored": 0,
           "connector": {"blocks_written": 4, "kv_bytes_written": 3 * GB,
                         "kv_bytes_written_by_tier": {"object": 2 * GB, "disk": 1 * GB},
                         "object_requests": {"PUT": 2000, "HEAD": 1000}}}
DECODE = {"wall_s": 72.0, "results_bytes": GB // 2,
          "connector": {"prompt_tokens_served_by_tier": {"object": 96, "disk": 64},
                        "kv_bytes_read_by_tier": {"object": GB, "disk": GB},
                        "object_requests": {"GET": 4000, "LIST": 1000}}}
PRICING = Pricing(usd_per_device_hour={"cpu-host": 0.5, "h200": 10.0}, prefill_device="cpu-host", prefill_devices=2,
                  decode_device="h200", decode_devices=4,
                  usd_per_gb_month_by_tier={"object": 0.03, "disk": 0.09}, retention_days_by_tier={"object": 15, "disk": 10},
                  usd_per_1k_requests={"PUT": 0.005, "HEAD": 0.0004, "GET": 0.0004, "LIST": 0.005},
                  usd_per_gb_egress=0.1, results_leave_region=True, kv_object_reads_leave_region=True,
                  reference=ReferencePrices(2.0, 1.0, 8.0))


def test_classes_add_up_to_the_total_and_each_is_priced_by_the_model():
    m = shard_metrics(_results(), PREFILL, DECODE, PRICING)
    by_class = {c: m[f"cost_{c}_usd"] for c in CLASSES}
    assert sum(by_class.values()) == pytest.approx(m["cost_usd"], abs=1e-12)
    assert m["cost_usd"] == pytest.approx(m["cost_compute_usd"] + m["cost_storage_usd"] + m["cost_requests_usd"]
                                          + m["cost_transfer_usd"], abs=1e-12)
    # Storage: GB x $/GB-month x retention days / 30, per tier.
    storage = 2 * 0.03 * 15 / 30 + 1 * 0.09 * 10 / 30
    assert m["cost_storage_usd"] == pytest.approx(storage)
    # Requests per 1,000 by kind: prefill's PUT + HEAD go with the blocks it computed, decode's GET + LIST
    # with the tokens the object tier served (and so does the egress of those reads).
    prefill_requests, decode_requests = 2 * 0.005 + 1 * 0.0004, 4 * 0.0004 + 1 * 0.005
    assert m["cost_requests_usd"] == pytest.approx(prefill_requests + decode_requests)
    assert (m["kv_requests_put"], m["kv_requests_get"], m["kv_requests_delete"]) == (2000, 4000, 0)
    assert by_class["prefill_computed"] == pytest.approx(36 * 2 / 3600 * 0.5 + storage + prefill_requests)
    assert by_class["store_object"] == pytest.approx(decode_requests + 1 * 0.1)
    assert by_class["store_disk"] == by_class["store_memory"] == by_class["prefix_cache"] == 0
    # Decode compute ($0.8) split by step time: 60 prompt tokens at prefill's measured 240 / 36 s = 9 s of 72.
    decode_compute = 72 * 4 / 3600 * 10.0
    assert m["decode_prompt_s"] == pytest.approx(9.0)
    assert by_class["decode_computed"] == pytest.approx(decode_compute * 9 / 72)
    assert by_class["output"] == pytest.approx(decode_compute * 63 / 72 + 0.5 * 0.1)
    # $/Mtok: the class's dollars over the class's tokens; blended over billable (prompt + output) tokens.
    tokens = {"prefill_computed": 240, "store_object": 96, "store_disk": 64, "prefix_cache": 80,
              "decode_computed": 60, "output": 60}
    for c, n in tokens.items():
        assert m[f"usd_per_mtok_{c}"] == pytest.approx(by_class[c] / n * 1e6)
    assert m["usd_per_mtok_store_memory"] is None  # no tokens: not applicable, not 0
    assert m["billable_tokens"] == 360 and m["usd_per_mtok_blended"] == pytest.approx(m["cost_usd"] / 360 * 1e6)
    # Reference: the 300 computed prompt tokens (prefill 240 + decode 60) at the input price, none cached.
    assert m["reference_cost_usd"] == pytest.approx((300 * 2.0 + 60 * 8.0) / 1e6)
    assert m["savings_usd"] == pytest.approx(m["reference_cost_usd"] - m["cost_usd"])
    assert metrics_table(m).num_rows == 1  # the row fits the schema


def test_device_seconds_are_charged_per_stage_at_that_stage_devices():
    m = shard_metrics(_results(), PREFILL, DECODE, PRICING)
    assert (m["device_s_prefill"], m["device_s_decode"], m["device_s"]) == (72.0, 288.0, 360.0)
    assert m["cost_compute_usd"] == pytest.approx(72 / 3600 * 0.5 + 288 / 3600 * 10.0)
    wider = shard_metrics(_results(), PREFILL, DECODE, Pricing(**{**PRICING.__dict__, "decode_devices": 8}))
    assert wider["device_s_prefill"] == 72.0 and wider["device_s_decode"] == 576.0  # the decode group alone


def test_decode_split_uses_measured_step_time_then_token_counts():
    m = shard_metrics(_results(), PREFILL, {**DECODE, "prompt_step_s": 18.0}, PRICING)
    assert m["decode_prompt_s"] == 18.0  # the engine's own figure wins over the estimate
    none_computed = shard_metrics(_results(), {**PREFILL, "prompt_tokens_computed": 0}, DECODE, PRICING)
    assert none_computed["decode_prompt_s"] == pytest.approx(72 * 60 / (60 + 60))


def test_works_before_the_store_counts_requests_and_writes_by_tier():
    prefill = {"wall_s": 1.0, "prompt_tokens_computed": 10, "connector": {"kv_bytes_written": GB, "blocks_written": 1}}
    m = shard_metrics(_results(), prefill, {"wall_s": 1.0}, PRICING)
    assert m["kv_bytes_written_object"] == GB and m["kv_bytes_written_disk"] == 0  # the total went to the durable tier
    assert m["cost_requests_usd"] == 0 and m["kv_requests_get"] == 0
    plain = shard_metrics(_results(), {}, {}, Pricing())
    assert plain["cost_usd"] == 0 and plain["reference_cost_usd"] is None and plain["savings_usd"] is None


def test_latency_percentiles_per_shard():
    m = shard_metrics(_results(), PREFILL, DECODE, PRICING)
    assert (m["ttft_s_p50"], m["ttft_s_p95"], m["ttft_s_p99"]) == (0.2, 0.38, 0.396)
    assert m["tpot_s_p50"] == 0.015 and m["tpot_s_p99"] == pytest.approx(0.0199)


@pytest.mark.parametrize("bad, message", [
    ({"prefill_device": "h100"}, "prefill_device 'h100' has no price"),
    ({"decode_devices": 0}, "decode_devices must be an integer >= 1"),
    ({"usd_per_gb_month_by_tier": {"tape": 1.0}}, "unknown keys \\['tape'\\]"),
    ({"usd_per_1k_requests": {"GET": -1.0}}, "finite number >= 0"),
])
def test_pricing_refuses_bad_rates_naming_them(bad, message):
    with pytest.raises(ValueError, match=message):
        Pricing(**{**PRICING.__dict__, **bad})


def test_pricing_resource_validates_and_builds_the_model():
    with pytest.raises(Exception, match="decode_device 'h200' has no price"):
        PricingResource(decode_device="h200")
    with pytest.raises(Exception, match="greater than or equal to 0"):
        PricingResource(usd_per_gb_egress=-1)
    res = PricingResource(usd_per_device_hour={"cpu-host": 0.08, "h200": 4.0}, decode_device="h200",
                          reference={"usd_per_mtok_input": 1.0, "usd_per_mtok_cached_input": 0.1,
                                     "usd_per_mtok_output": 4.0})
    p = res.pricing(decode_devices=8)
    assert (p.prefill_device, p.prefill_devices, p.decode_device, p.decode_devices) == ("cpu-host", 1, "h200", 8)
    assert p.reference == ReferencePrices(1.0, 0.1, 4.0) and p.usd_per_1k_requests["PUT"] == 0.005


def test_day_rollup_is_the_sum_of_its_shards():
    a = shard_metrics(_results(), PREFILL, {**DECODE, "expert_load_balancedness": 0.9}, PRICING)
    b = shard_metrics(_results(), {**PREFILL, "wall_s": 10.0}, {**DECODE, "wall_s": 5.0,
                                                              "expert_load_balancedness": 0.8}, PRICING)
    frame = pl.from_arrow(pa.concat_tables([metrics_table(a), metrics_table(b)]))
    latencies = pl.DataFrame({"ttft_s": [0.1, 0.2, 0.4, 0.1, 0.2, 0.4], "tpot_s": [0.01, 0.02, None] * 2})
    day = day_rollup(frame, latencies)
    assert day["shards"] == 2 and day["billable_tokens"] == 720
    assert day["cost_usd"] == pytest.approx(a["cost_usd"] + b["cost_usd"])
    assert day["usd_per_mtok_output"] == pytest.approx((a["cost_output_usd"] + b["cost_output_usd"]) / 120 * 1e6)
    assert day["device_s_decode"] == pytest.approx(288 + 20)
    assert day["ttft_s_p95"] == pytest.approx(0.4) and day["tpot_s_p50"] == pytest.approx(0.015)
    assert day["spec_acceptance_rate"] is None  # nothing drafted: not applicable
    assert day["expert_load_balancedness"] == 0.8  # the worst shard's
    assert day["savings_usd"] == pytest.approx(a["savings_usd"] + b["savings_usd"])
    with pytest.raises(ValueError, match="no cost_metrics shard"):
        day_rollup(frame.head(0), latencies)


def test_slo_verdict_at_and_over_the_threshold():
    slo = LatencySLO(ttft_s_p95=0.5, tpot_s_p95=0.05)
    assert check_slo({"ttft_s_p95": 0.5, "tpot_s_p95": 0.01}, slo).passed  # at the threshold passes
    over = check_slo({"ttft_s_p95": 0.51, "tpot_s_p95": None}, slo)
    assert not over.passed and over.breaches == ["ttft_s_p95 0.51 s > 0.5 s"]
    with pytest.raises(ValueError, match="tpot_s_p95 must be a positive number"):
        LatencySLO(1.0, 0)


def test_progress_meter_reports_rows_rate_and_eta():
    now = [0.0]
    said: list[str] = []
    meter = ProgressMeter("decode", 10, said.append, every_s=5, clock=lambda: now[0])
    now[0] = 2.0
    meter.advance(2, 40)  # under every_s since the start: nothing said yet
    assert said == []
    now[0] = 5.0
    meter.advance(3, 60)
    assert said == ["decode: 5/10 rows (50%), 100 tokens, 20.0 tokens/s, ETA 5 s"]
    now[0] = 10.0
    meter.advance(5, 100)
    meter.finish()
    assert said[-1] == "decode: 10/10 rows (100%), 200 tokens, 20.0 tokens/s, ETA 0 s"


def test_the_summary_shows_units_and_explains_the_token_sums():
    from kvbatch.ops.results.cost import class_tokens
    from kvbatch.ops.results.scorecard import fmt_usd
    from kvbatch.pipelines.assets import cost_markdown, mib, pct

    assert [fmt_usd(x) for x in (None, 0, 0.0000678, 0.000906179, -1.036, 1234.5)] == [
        "n/a", "$0", "$0.0000678", "$0.0009062", "-$1.04", "$1,234.50"]
    assert (mib(3 * 2 ** 20 + 2 ** 19), pct(0.12345)) == (3.5, 12.35)
    m = shard_metrics(_results(), PREFILL, DECODE, PRICING)
    md = cost_markdown(m, class_tokens(m))
    assert "| output | 60 | $0.75 | $12,500.00 |" in md  # $0.70 of decode compute + $0.05 egress
    assert "| prompt, served by the KV store: memory |" not in md  # no tokens, no dollars: left out
    assert "Prompt tokens 300 = served by the KV store 160 + prefix-cache hits 80 + computed at decode 60" in md
    assert "| time to first token p50 / p95 / p99 | 0.200 s / 0.380 s / 0.396 s |" in md
    assert "MiB" in md and "speculative" not in md and "█" not in md


def test_a_class_with_dollars_and_no_tokens_shows_a_dash_and_says_why():
    """A re-run whose blocks were all stored: prefill computed 0 tokens but paid for its lookups."""
    from kvbatch.ops.results.cost import class_tokens
    from kvbatch.pipelines.assets import cost_markdown

    stored = {**PREFILL, "prompt_tokens_computed": 0, "prompt_tokens_already_stored": 240}
    m = shard_metrics(_results(), stored, DECODE, PRICING)
    assert class_tokens(m)["prefill_computed"] == 0 and m["cost_prefill_computed_usd"] > 0
    md = cost_markdown(m, class_tokens(m))
    [line] = [x for x in md.splitlines() if x.startswith("| prompt, computed at prefill |")]
    assert line.split(" | ")[1] == "–" and "| 0 |" not in line
    assert ("Note: prefill computed nothing (every block was already stored): the $ is its store lookups and "
            "manifests.") in md
    computed = shard_metrics(_results(), PREFILL, DECODE, PRICING)
    assert "Note:" not in cost_markdown(computed, class_tokens(computed))  # every priced class has tokens


def test_progress_eta_counts_rows_in_flight():
    """Continuous batching finishes rows together near the end: 1 row of 58 after 25 s read as
    "ETA 1425 s". With the work measured in flight (output tokens so far of the rows' budget) the
    smaller estimate wins."""
    now, generated = [0.0], [0]
    said: list[str] = []
    meter = ProgressMeter("decode", 58, said.append, every_s=5, clock=lambda: now[0])
    now[0], generated[0] = 25.0, 5_000
    meter.advance(1, 16)
    assert said[-1].endswith("ETA 1425 s")  # rows alone
    meter.track(lambda: generated[0], total=5_800)
    # The same moment, now with the work in flight: 25 s x 800 / 5,000.
    assert meter.message() == "decode: 1/58 rows (2%), 16 tokens, 0.6 tokens/s, ETA 4 s"
    meter.track(lambda: generated[0], total=0)  # no budget: ignored, rows alone again
    assert meter.message().endswith("ETA 4 s")


def test_progress_last_line_is_the_steps_own_figures():
    now = [0.0]
    said: list[str] = []
    meter = ProgressMeter("prefill", 4, said.append, clock=lambda: now[0])
    now[0] = 3.0
    meter.restart()  # the table read before the work is not in the rate
    now[0] = 5.0
    meter.advance(4, 1440)
    meter.finish(tokens=144, elapsed_s=0.3464)
    assert said[-1] == "prefill: 4/4 rows (100%), 144 tokens, 415.7 tokens/s, ETA 0 s"
    meter.finish()
    assert said[-1] == "prefill: 4/4 rows (100%), 1,440 tokens, 720.0 tokens/s, ETA 0 s"


def _with_cached_row() -> pa.Table:
    """``_results()`` plus a fourth row the response cache answered (``cached``): 40 prompt tokens,
    7 output tokens, no latency measured (the loop gives it ttft 0 and no tpot)."""
    return pa.table({"prompt_tokens": [100, 100, 100, 40], "loaded_prompt_tokens": [96, 64, 0, 0],
                     "cached_prompt_tokens": [0, 0, 80, 0], "completion_tokens": [10, 20, 30, 7],
                     "cached": [False, False, False, True],
                     "ttft_s": [0.1, 0.2, 0.4, 0.0], "tpot_s": [0.01, 0.02, None, None]})


RC_DECODE = {**DECODE, "response_cache": {"hits": 1, "misses": 3, "requests": {"GET": 4000, "PUT": 3000}}}


def test_a_response_cache_row_costs_no_compute_and_shows_its_saving():
    """A row marked ``cached`` computed nothing: no prefill or decode token is charged for it, its
    tokens are the response_cache class (priced at the cache's own requests), its latency is not
    in the percentiles, and the saving is its output at the price of a computed output token."""
    before, m = shard_metrics(_results(), PREFILL, DECODE, PRICING), shard_metrics(_with_cached_row(), PREFILL,
                                                                                   RC_DECODE, PRICING)
    rc = (m["response_cache_hits"], m["prompt_tokens_response_cache"], m["output_tokens_response_cache"])
    assert rc == (1, 40, 7)
    # Prompt: served by a cache at decode, never computed; the three decode terms still add up.
    assert m["prompt_tokens_decode_cached"] == before["prompt_tokens_decode_cached"] + 40
    assert m["prompt_tokens_decode_computed"] == before["prompt_tokens_decode_computed"] == 60
    assert (m["prompt_tokens_decode_loaded"] + m["prompt_tokens_decode_cached"] + m["prompt_tokens_decode_computed"]
            == m["prompt_tokens"] == 340)
    # Output: delivered (and billable), but not in the computed output class.
    assert m["output_tokens"] == 67 and m["billable_tokens"] == 407
    tokens = class_tokens(m)
    assert (tokens["output"], tokens["prefix_cache"], tokens["response_cache"]) == (60, 80, 47)
    assert m["cost_output_usd"] == before["cost_output_usd"]  # the same decode: the cached row added no $
    assert m["usd_per_mtok_output"] == before["usd_per_mtok_output"]
    # The cache's own requests are its class's dollars, and in the requests' total.
    rc_usd = 4 * 0.0004 + 3 * 0.005
    assert (m["response_cache_requests_get"], m["response_cache_requests_put"]) == (4000, 3000)
    assert m["cost_response_cache_usd"] == pytest.approx(rc_usd)
    assert m["usd_per_mtok_response_cache"] == pytest.approx(rc_usd / 47 * 1e6)
    assert m["cost_requests_usd"] == pytest.approx(before["cost_requests_usd"] + rc_usd)
    assert sum(m[f"cost_{c}_usd"] for c in CLASSES) == pytest.approx(m["cost_usd"], abs=1e-12)
    assert m["response_cache_saved_usd"] == pytest.approx(7 * m["cost_output_usd"] / 60)
    assert before["response_cache_saved_usd"] == 0.0 and before["response_cache_hits"] == 0
    # Latencies: the engine's rows only (the cached row's ttft 0 would pull the percentiles down).
    assert {k: m[k] for k in m if k.startswith(("ttft_s_p", "tpot_s_p"))} == {
        k: before[k] for k in before if k.startswith(("ttft_s_p", "tpot_s_p"))}
    # A shard of hits only: nothing computed to price the saving by (not 0, not a guess).
    all_hits = pa.table({"prompt_tokens": [40], "loaded_prompt_tokens": [0], "cached_prompt_tokens": [0],
                         "completion_tokens": [7], "cached": [True], "ttft_s": [0.0], "tpot_s": [None]},
                        schema=pa.schema([("prompt_tokens", pa.int64()), ("loaded_prompt_tokens", pa.int64()),
                                          ("cached_prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                                          ("cached", pa.bool_()), ("ttft_s", pa.float64()), ("tpot_s", pa.float64())]))
    h = shard_metrics(all_hits, {}, {"wall_s": 0.01}, PRICING)
    assert h["prompt_tokens_decode_computed"] == 0 and class_tokens(h)["output"] == 0
    assert h["response_cache_saved_usd"] is None and h["ttft_s_p50"] is None
    # The day: the saving recomputed from the summed rows, so the hits-only shard is priced by the other.
    day = day_rollup(pl.from_arrow(pa.concat_tables([metrics_table(m), metrics_table(h)])),
                     pl.DataFrame({"ttft_s": [0.1], "tpot_s": [0.01]}))
    assert day["response_cache_hits"] == 2 and day["output_tokens_response_cache"] == 14
    assert day["response_cache_saved_usd"] == pytest.approx(14 * (m["cost_output_usd"] + h["cost_output_usd"]) / 60)
    # The shard's page says it: the class row, the prompt sum, the hits and the saving.
    from kvbatch.pipelines.assets import cost_markdown, cost_metadata

    md = cost_markdown(m, tokens)
    assert ("Prompt tokens 340 = served by the KV store 160 + prefix-cache hits 80 + answered by the response "
            "cache 40 + computed at decode 60.") in md
    assert "| prompt + output, answered by the response cache (no compute) | 47 |" in md
    meta = cost_metadata(m)
    assert meta["response_cache_hits"] == 1 and meta["response_cache_saved_usd"] > 0
    assert "response_cache_hits" not in cost_metadata(before)  # no cache: the page is as before
    # A results table written before the column existed: no row counts as cached.
    assert shard_metrics(_results(), PREFILL, DECODE, PRICING)["response_cache_hits"] == 0


def test_batch_report_keeps_response_cache_rows_apart_and_reconcilable():
    """The engine's figures stay the engine's; the rows the response cache answered are counted
    beside them, so prompt_tokens + response_cache_prompt_tokens is every answered row's."""
    from kvbatch.engine.runtime.llm import Result
    from kvbatch.ops.decode.report import BatchReport

    def result(prompt: int, output: int, ttft: float) -> Result:
        return Result("r", list(range(prompt)), list(range(output)), "", "length", 0, ttft, None)

    report = BatchReport()
    report.add_result(result(10, 4, 0.5))
    report.add_cached(result(7, 3, 0.0))
    assert report.to_json().get("response_cache_rows") is None  # no cache this run: the file is as before
    report.response_cache = {"hits": 1}
    got = report.to_json()
    assert (got["succeeded"], got["prompt_tokens"], got["output_tokens"]) == (2, 10, 4)
    assert (got["response_cache_rows"], got["response_cache_prompt_tokens"], got["response_cache_output_tokens"]) == (
        1, 7, 3)


# -- the contract with what a real run writes ---------------------------------------------------------


class _Probe(dict):
    """A stats document that records every key the meter asks for and does not find."""

    def __init__(self, doc: dict, path: str, missing: set[str]) -> None:
        super().__init__(doc)
        self.path, self.missing = path, missing

    def get(self, key, default=None):
        if key not in self:
            self.missing.add(f"{self.path}.{key}")
        value = super().get(key, default)
        if key == "connector" and isinstance(value, dict):  # its keys are schema; a *_by_tier dict's are data
            return _Probe(value, f"{self.path}.connector", self.missing)
        return value


def test_the_meter_defaults_nothing_a_real_prefill_and_decode_commit(tmp_path):
    """A tiny model's shard, prefilled into a KV store and decoded from it, exactly as the pipeline's
    steps do: the results table has every column the meter sums, the stats files have every key it
    reads (bar the optional ones), and the metered tokens are those the run reports."""
    import json

    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
    from kvbatch.io.shard_tables import read_table, shard_url
    from kvbatch.ops.decode.shard import decode_shard
    from kvbatch.ops.ingest.prompts import ingest
    from kvbatch.ops.prefill.prefill import prefill_shard
    from kvbatch.ops.results.cost import _SUMMED, OPTIONAL_STATS, SPEC_FIELDS
    from kvbatch.ops.results.metrics import LATENCIES
    from kvbatch.ops.shards.build import build_shards
    from tests.tiny_models import build_tiny_chat_model

    tiny = build_tiny_chat_model(tmp_path / "tiny", max_positions=256)
    system = "You answer for a library: name one book and its author, in one sentence. " * 2
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"A book about {i}?"}],
        "max_tokens": 3, "temperature": 0}) + "\n" for i in range(4)))
    ingest(str(src), str(tmp_path / "prompts.parquet"), str(tmp_path / "rejects.parquet"))

    def llm(store=None) -> LLM:
        return LLM(str(tiny), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=4), kv_store=store)

    root = str(tmp_path / "day")
    build_shards(llm(), str(tmp_path / "prompts.parquet"), root, 1, rejects_url=str(tmp_path / "sr.parquet"))
    fingerprint = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(llm().checkpoint.fingerprint)
    store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), fingerprint)
    manifests, results = shard_url(root, "manifests", "0000", "manifests.jsonl"), shard_url(root, "results", "0000")
    prefill_url, decode_url = str(tmp_path / "prefill_stats.json"), str(tmp_path / "decode_stats.json")
    prefill_shard(llm(store), shard_url(root, "shards", "0000"), manifests, stats_url=prefill_url)
    decode_shard(llm(store), manifests, results, stats_url=decode_url)

    table = read_table(results)
    assert set(_SUMMED) - set(SPEC_FIELDS) | set(LATENCIES) <= set(table.schema.names)
    missing: set[str] = set()
    prefill = _Probe(json.loads(open(prefill_url).read()), "prefill", missing)
    decode = _Probe(json.loads(open(decode_url).read()), "decode", missing)
    m = shard_metrics(table, prefill, decode, PRICING)
    assert missing <= OPTIONAL_STATS, sorted(missing - OPTIONAL_STATS)
    metrics_table(m)  # the row fits the table the pipeline commits
    assert m["requests"] == 4 and m["prompt_tokens"] == decode["prompt_tokens"] > 0
    assert m["output_tokens"] == decode["output_tokens"] > 0
    assert m["prompt_tokens_prefill_computed"] == prefill["prompt_tokens_computed"] > 0
    assert m["prompt_tokens_decode_loaded"] == decode["loaded_prompt_tokens"] > 0
    assert m["kv_blocks_written"] == prefill["connector"]["blocks_written"] > 0
    assert m["prefill_wall_s"] > 0 and m["decode_wall_s"] > 0 and m["cost_usd"] > 0
