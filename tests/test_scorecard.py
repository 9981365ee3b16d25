"""The day's scorecard (``kvbatch.ops.results.scorecard``) on hand-made tables (no model, no
Dagster): its figures are one account (rows in = rejected + done + failed + not decoded; tokens
in = reused + computed; the tiers add up to the tokens loaded), the shards that need a look are
found and say why, the SLO verdict is at its threshold, the report puts the verdict first, and
the files land beside the day's Parquet. The same figures read back from a real pipeline day are
in ``test_scorecard_pipeline_day`` below (marked slow)."""

from __future__ import annotations

import json

import polars as pl
import pytest

from kvbatch.ops.results.day_tables import DayTables, empty_results, read_day
from kvbatch.ops.results.metrics import LatencySLO
from kvbatch.ops.results.scorecard import build_scorecard, fmt_usd, write_scorecard

DATE = "2026-11-29"
SLO = LatencySLO(ttft_s_p95=30.0, tpot_s_p95=1.0)


def _results() -> pl.DataFrame:
    # Shard 0000: 3 results (one an error); 0001: 2 results of 3 rows, one from the response cache
    # (``cached``: ttft 0 and no tpot, no latency measured) and one slow row; 0002: not decoded.
    return pl.DataFrame({
        "shard": ["0000", "0000", "0000", "0001", "0001"],
        "finish_reason": ["length", "stop", "error", "length", "length"],
        "prompt_tokens": [100, 100, 100, 50, 50], "completion_tokens": [10, 10, 0, 5, 5],
        "cached_prompt_tokens": [0, 32, 0, 0, 0], "loaded_prompt_tokens": [64, 64, 0, 0, 32],
        "cached": [False, False, False, True, False],
        "ttft_s": [0.1, 0.2, 0.3, 0.0, 2.0], "tpot_s": [0.01, 0.02, None, None, 3.0]})


def _metrics(reference: list | None = None) -> pl.DataFrame:
    return pl.DataFrame({
        "shard": ["0000", "0001"], "prompt_tokens_prefill_computed": [64, 32],
        "kv_tokens_hit_memory": [0, 0], "kv_tokens_hit_disk": [64, 0], "kv_tokens_hit_object": [64, 32],
        "billable_tokens": [320, 110], "prefill_wall_s": [1.0, 1.5], "decode_wall_s": [2.0, 2.5],
        "cost_usd": [0.001, 0.002], "reference_cost_usd": reference or [None, None],
        "output_tokens": [20, 10], "output_tokens_response_cache": [0, 5], "cost_output_usd": [0.0006, 0.001],
        "ttft_s_p95": [0.29, 1.9], "tpot_s_p95": [0.02, 2.85]}, schema_overrides={"reference_cost_usd": pl.Float64})


def _day(**kw) -> DayTables:
    base = dict(date=DATE, num_shards=3, valid_rows=9, rejected_at_ingest=2, rejected_at_tokenization=1,
                shard_rows=pl.DataFrame({"shard": ["0000", "0001", "0002"], "rows": [3, 3, 2]}),
                results=_results(), metrics=_metrics())
    return DayTables(**{**base, **kw})


def test_the_figures_are_one_account():
    c = build_scorecard(_day(), SLO)
    # Rows: 11 in = 3 rejected + 4 done + 2 failed (an error, a row without a result) + 2 not decoded.
    assert (c.rows_in, c.rows_rejected, c.rows_done, c.rows_failed, c.rows_pending) == (11, 3, 4, 2, 2)
    assert c.rows_in == c.rows_rejected + c.rows_done + c.rows_failed + c.rows_pending
    # Tokens: 400 in = 160 loaded + 32 prefix-cache + 50 response cache + 158 computed at decode.
    assert (c.tokens_in, c.tokens_loaded_from_kv_store, c.tokens_prefix_cache,
            c.tokens_response_cache) == (400, 160, 32, 50)
    assert c.tokens_computed_at_decode == 400 - 160 - 32 - 50 == 158
    assert c.tokens_computed == 158 + min(96, 160) and c.tokens_in == c.tokens_reused + c.tokens_computed
    assert sum(c.kv_tokens_by_tier.values()) == c.tokens_loaded_from_kv_store
    assert c.response_cache_rows == 1 and c.tokens_out == 30 and c.tokens_out_response_cache == 5
    # What the cached row did not spend: its 5 output tokens at the day's $ per computed output token.
    assert c.response_cache_saved_usd == pytest.approx(5 * 0.0016 / 25)
    # Its latency was not measured: the P95 is over the engine's four rows (0.1, 0.2, 0.3, 2.0), not five.
    assert c.ttft_s_p95 == pytest.approx(pl.Series([0.1, 0.2, 0.3, 2.0]).quantile(0.95, interpolation="linear"))
    md = c.to_markdown()
    assert "| … of which served by the response cache (not decoded) | 5 | – |" in md
    assert f"| not spent thanks to the response cache (its output at the $ of a computed output token) | " \
           f"{fmt_usd(0.00032)} |" in md
    # Ratios from the sums: wall time is prefill + decode over the shards.
    assert c.wall_s == pytest.approx(7.0) and c.tokens_per_s == pytest.approx(430 / 7.0)
    assert c.output_tokens_per_s == pytest.approx(30 / 4.5) and c.prefill_tokens_per_s == pytest.approx(96 / 2.5)
    assert c.kv_hit_rate == pytest.approx((160 + 32) / 400)
    assert c.cost_usd == pytest.approx(0.003) and c.usd_per_mtok == pytest.approx(0.003 / 430 * 1e6)
    assert c.reference_cost_usd is None and c.savings_usd is None  # no hosted price configured


def test_the_shards_that_need_a_look_say_why():
    c = build_scorecard(_day(), SLO)
    got = {p.shard: (p.rows, p.results, p.problem) for p in c.shard_problems}
    assert got == {"0000": (3, 3, "1 error results"),
                   "0001": (3, 2, "1 rows without a result; SLO: tpot_s_p95 2.85 s > 1.0 s"),
                   "0002": (2, 0, "not decoded")}
    assert c.failed_shards == ["0000", "0001", "0002"] and not c.passed
    # A day's shard with no cost row, and a shard table missing: named too.
    no_cost = build_scorecard(_day(metrics=_metrics().filter(pl.col("shard") == "0001")), SLO)
    assert "no cost_metrics row" in {p.shard: p.problem for p in no_cost.shard_problems}["0000"]
    untabled = build_scorecard(_day(shard_rows=pl.DataFrame({"shard": ["0000"], "rows": [3]})), SLO)
    assert {p.shard: p.problem for p in untabled.shard_problems}["0002"] == "no shard table (re-run prompt_shards)"


def test_a_clean_day_passes_and_the_slo_holds_at_its_threshold():
    results = _results().filter(pl.col("finish_reason") != "error", pl.col("shard") == "0000")
    day = _day(num_shards=1, valid_rows=2, rejected_at_ingest=0, rejected_at_tokenization=0,
               shard_rows=pl.DataFrame({"shard": ["0000"], "rows": [2]}), results=results,
               metrics=_metrics().filter(pl.col("shard") == "0000"))
    c = build_scorecard(day, SLO)
    assert c.passed and c.shard_problems == [] and (c.rows_failed, c.rows_pending) == (0, 0)
    at = build_scorecard(day, LatencySLO(ttft_s_p95=30.0, tpot_s_p95=c.tpot_s_p95))
    assert at.slo_passed  # a P95 at exactly the threshold passes
    under = build_scorecard(day, LatencySLO(ttft_s_p95=30.0, tpot_s_p95=c.tpot_s_p95 * 0.99))
    assert not under.slo_passed and under.slo_breaches[0].startswith("tpot_s_p95")
    assert not under.passed


def test_a_day_before_its_shards_have_run():
    day = _day(results=empty_results(), metrics=pl.DataFrame({"shard": []}, schema={"shard": pl.String}))
    c = build_scorecard(day, SLO)
    assert (c.rows_done, c.rows_pending, c.tokens_in, c.cost_usd, c.ttft_s_p95) == (0, 8, 0, 0.0, None)
    assert c.kv_hit_rate is None and c.tokens_per_s is None and c.slo_passed  # nothing measured cannot breach
    assert [p.problem for p in c.shard_problems] == ["not decoded"] * 3
    from kvbatch.pipelines.scorecard_metadata import plotted_figures

    assert plotted_figures(c) == {"cost_usd": 0.0}  # nothing else measured: left out, not plotted as 0
    md = c.to_markdown()
    assert "| KV cache hit rate (store + prefix cache) | – |" in md and "| time to first token | – |" in md
    assert c.to_json()["kv_hit_rate"] is None and json.loads(json.dumps(c.to_json()))["tokens_per_s"] is None


def test_a_shard_link_opens_its_partition_page():
    from kvbatch.pipelines.scorecard_metadata import shard_link

    link = shard_link(["kvbatch", "cost_metrics"], DATE)
    assert link("0003") == f"/assets/kvbatch/cost_metrics?view=partitions&partition={DATE}%7C0003"


def test_the_report_puts_the_verdict_first_and_links_the_shards():
    c = build_scorecard(_day(metrics=_metrics(reference=[0.01, 0.02])), SLO)
    md = c.to_markdown(lambda shard: f"/assets/cost_metrics?partition={shard}")
    lines = md.splitlines()
    assert lines[0] == f"# {DATE}: **NEEDS A LOOK**"
    assert lines[2].startswith("- **Latency SLO: FAIL** — tpot_s_p95 ")
    assert lines[3] == ("- **Shards needing a look: 3** — [0000](/assets/cost_metrics?partition=0000), "
                        "[0001](/assets/cost_metrics?partition=0001), [0002](/assets/cost_metrics?partition=0002)")
    assert lines[4] == (f"- **Cost: {fmt_usd(0.003)}** ({fmt_usd(c.usd_per_mtok)} per Mtok; hosted batch price "
                        f"{fmt_usd(0.03 / 430 * 1e6)} per Mtok, saved {fmt_usd(0.027)})")
    assert "| time per output token | 2.702 s | ≤ 1.000 s | FAIL |" in md
    assert "| **reused** (in − computed tonight) | 146 | 36.5% |" in md
    assert "```" not in md and "``" not in md
    assert c.headline().startswith(f"{DATE}: SLO FAIL (tpot_s_p95 2.702 s > 1 s); shards needing a look: 3 ")


def test_files_beside_the_days_parquet_and_read_back(tmp_path):
    c = build_scorecard(_day(), SLO)
    md_url, json_url = write_scorecard(c, str(tmp_path / "cost_rollup" / f"date={DATE}"))
    doc = json.loads((tmp_path / "cost_rollup" / f"date={DATE}" / "scorecard.json").read_text())
    assert doc["tokens_in"] == 400 and doc["passed"] is False and doc["failed_shards"] == ["0000", "0001", "0002"]
    assert doc["tokens_per_s"] == pytest.approx(c.tokens_per_s)
    assert (tmp_path / "cost_rollup" / f"date={DATE}" / "scorecard.md").read_text() == c.to_markdown()
    assert md_url.endswith("scorecard.md") and json_url.endswith("scorecard.json")
    # read_day of a root where nothing ran: an empty day, not an error.
    empty = read_day(str(tmp_path), DATE)
    assert (empty.num_shards, empty.valid_rows, empty.results.height, empty.metrics.height) == (None, 0, 0, 0)
    assert build_scorecard(empty, SLO).rows_in == 0


def test_the_docs_example_is_what_the_code_prints():
    """docs/scorecard.md's example: the report's first lines and the demo summary's verdict lines
    of the day built above, as the code writes them."""
    import re
    from pathlib import Path

    from kvbatch.ops.results.demo_report import verdict_lines

    doc = (Path(__file__).resolve().parents[1] / "docs" / "scorecard.md").read_text()
    report_block, summary_block = re.findall(r"```\n(.*?)\n```", doc.split("## Example", 1)[1], re.S)
    c = build_scorecard(_day(), SLO)
    assert report_block.splitlines() == c.to_markdown(lambda shard: "…").splitlines()[:5]
    assert summary_block.splitlines() == verdict_lines([c.to_json()], "<root>")


# ---------------------------------------------------------------------------------------------
# A real pipeline day: every figure read back agrees with every other.

SYSTEM = "You answer questions about a small bakery. Be brief and polite, and never invent prices. " * 2


def _dataset(path) -> int:
    lines = [json.dumps({"custom_id": f"r{i:02d}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}],
        "max_tokens": 4 + i % 3, "temperature": 0}}) for i in range(12)]
    lines.insert(3, '{"custom_id": "bad-temp", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}')
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def _run_logs(instance, result, prefix: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(result.run_id) if e.user_message.startswith(prefix)]


@pytest.mark.slow
def test_scorecard_pipeline_day(tmp_path):
    """A day of 12 valid rows and one rejected through every asset in process (tiny model, a local
    folder as the object store, 2 shards): the scorecard's totals are the sums of the shards'
    cost rows, tokens in = reused + computed, the rollup's page and the demo summary say the same,
    the prefill log's last line says what prefill's metadata says, and a strict SLO turns the
    day's verdict, the summary's and its exit status."""
    import dagster as dg

    from kvbatch.ops.results import demo_report
    from kvbatch.pipelines.default import (
        PIPELINE,
        cost_metrics,
        cost_rollup,
        decode_results,
        prefill_kv,
        prompt_shards,
        prompts,
    )
    from kvbatch.pipelines.default import resources as keyed
    from kvbatch.pipelines.partitions import date_shard_key
    from kvbatch.resources import (
        DecodeClusterResource,
        KVStoreResource,
        ModelResource,
        ObjectStoreResource,
        PricingResource,
    )
    from tests.tiny_models import build_tiny_chat_model

    tiny = build_tiny_chat_model(tmp_path / "tiny", max_positions=512)
    data, root = tmp_path / "requests.jsonl", tmp_path / "data"
    n_lines = _dataset(data)
    spec = PIPELINE.spec
    resources = keyed({
        "object_store": ObjectStoreResource(url=str(root)),
        "model": ModelResource(model=str(tiny), max_batch=8, deterministic=True),
        "kv_store": KVStoreResource(), "decode_cluster": DecodeClusterResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
        "pricing": PricingResource(usd_per_device_hour={"cpu-host": 3.6}, reference={
            "usd_per_mtok_input": 1.0, "usd_per_mtok_cached_input": 0.1, "usd_per_mtok_output": 4.0})})
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([prompts, prompt_shards], resources=resources, partition_key=DATE, instance=instance,
                          run_config={"ops": {prompts.op.name: {"config": {"url": str(data), "max_reject_rate": 0.5}},
                                              prompt_shards.op.name: {"config": {"max_rows_per_shard": 6}}}}).success
    slo = {"config": {"ttft_s_p95_max": 600.0, "tpot_s_p95_max": 600.0, "slo_severity": "WARN"}}
    prefill_meta, prefill_lines = [], []
    for shard in ("0000", "0001"):
        run = dg.materialize([prefill_kv, decode_results, cost_metrics], resources=resources, instance=instance,
                             partition_key=date_shard_key(DATE, shard), run_config={"ops": {cost_metrics.op.name: slo}})
        assert run.success
        prefill_meta.append(run.asset_materializations_for_node(prefill_kv.op.name)[0].metadata)
        prefill_lines.append(_run_logs(instance, run, "prefill:")[-1])
    rolled = dg.materialize([cost_rollup], resources=resources, partition_key=DATE, instance=instance,
                            run_config={"ops": {cost_rollup.op.name: slo}})
    assert rolled.success

    root = root / spec.name  # each pipeline's tables live under its own folder of the store
    folder = root / "cost_rollup" / f"date={DATE}"
    card = json.loads((folder / "scorecard.json").read_text())
    rows = pl.read_parquet(str(root / "cost_metrics" / f"date={DATE}" / "**" / "*.parquet"))
    day = pl.read_parquet(folder / "part.parquet").row(0, named=True)
    results = pl.read_parquet(str(root / "results" / f"date={DATE}" / "**" / "*.parquet"))
    # Rows: 13 lines in = 1 rejected + 12 done, nothing failed or left.
    assert (card["rows_in"], card["rows_rejected"], card["rows_done"], card["rows_failed"], card["rows_pending"]) == (
        n_lines, 1, 12, 0, 0)
    # The scorecard's totals are the sums of the shards' cost rows (and of the results).
    sums = rows.select(pl.all().exclude("shard").sum()).row(0, named=True)
    assert card["tokens_in"] == sums["prompt_tokens"] == results["prompt_tokens"].sum()
    assert card["tokens_out"] == sums["output_tokens"] == results["completion_tokens"].sum()
    assert card["tokens_loaded_from_kv_store"] == sums["prompt_tokens_decode_loaded"] > 0
    assert card["tokens_prefix_cache"] + card["tokens_response_cache"] == sums["prompt_tokens_decode_cached"]
    assert card["tokens_computed_at_decode"] == sums["prompt_tokens_decode_computed"]
    assert card["tokens_computed_at_prefill"] == sums["prompt_tokens_prefill_computed"] > 0
    assert card["tokens_in"] == card["tokens_reused"] + card["tokens_computed"]
    assert sum(card["kv_tokens_by_tier"].values()) == card["tokens_loaded_from_kv_store"]
    assert card["cost_usd"] == pytest.approx(sums["cost_usd"], abs=1e-12) == pytest.approx(day["cost_usd"], abs=1e-12)
    assert card["reference_cost_usd"] == pytest.approx(sums["reference_cost_usd"], abs=1e-12)
    assert card["billable_tokens"] == sums["billable_tokens"] == card["tokens_in"] + card["tokens_out"]
    assert card["wall_s"] == pytest.approx(sums["prefill_wall_s"] + sums["decode_wall_s"], abs=1e-5)
    assert (card["ttft_s_p95"], card["tpot_s_p95"]) == (day["ttft_s_p95"], day["tpot_s_p95"])
    # Each shard's prefill: the log's last line says what its metadata says.
    for meta, line in zip(prefill_meta, prefill_lines):
        assert f", {meta['prompt_tokens_computed'].value:,} tokens, " in line, line
        assert f"{meta['prefill_tokens_per_s'].value:,.1f} tokens/s" in line, line
    # The rollup's page: the report is the file's, the plotted figures are the scorecard's.
    meta = rolled.asset_materializations_for_node(cost_rollup.op.name)[0].metadata
    assert meta["scorecard"].value == (folder / "scorecard.md").read_text()
    assert meta["cost_usd"].value == float(f"{card['cost_usd']:.4g}")
    assert meta["tokens_per_s"].value == round(card["tokens_per_s"], 1)
    assert meta["kv_hit_rate_pct"].value == round(100 * card["kv_hit_rate"], 2)
    assert meta["tpot_s_p95"].value == round(card["tpot_s_p95"], 4)
    # The demo summary: the verdict first, the prompt tokens as one sum, exit 0.
    text = demo_report.report(str(root), DATE)
    assert text.splitlines()[0] == f"verdict:      {DATE} PASS"
    assert (f"prompt tokens {card['tokens_in']} = {card['tokens_loaded_from_kv_store']} loaded from the KV store + "
            f"{sums['prompt_tokens_decode_cached']} cache hits + {card['tokens_computed_at_decode']} computed at decode"
            in text.splitlines())
    assert demo_report.main([str(root), DATE]) == 0

    # A strict SLO: the day needs a look, and the summary's exit status says so.
    strict = {"config": {"ttft_s_p95_max": 600.0, "tpot_s_p95_max": 1e-9, "slo_severity": "WARN"}}
    assert dg.materialize([cost_rollup], resources=resources, partition_key=DATE, instance=instance,
                          run_config={"ops": {cost_rollup.op.name: strict}}).success  # WARN: the run stays green
    assert demo_report.report(str(root), DATE).splitlines()[:2] == [
        f"verdict:      {DATE} NEEDS A LOOK", f"latency SLO:  FAIL (tpot_s_p95 {card['tpot_s_p95']:.4g} s > 1e-09 s)"]
    assert demo_report.main([str(root), DATE]) == demo_report.CHECK_FAILED
