"""Every asset check of the graph seen failing on data built to break it, and passing on clean
data: ``reject_rate_below_threshold`` and ``unique_custom_ids`` on ``prompts``,
``one_result_per_custom_id`` and ``output_within_max_tokens`` on ``decode_results`` (the latency
SLO checks of ``cost_metrics`` and ``cost_rollup`` are in tests/test_rollup.py). Each check is
recorded against the partition it checked, and carries a description. Each run is
an in-process ``dg.materialize`` on a tiny model and a local folder as the object store; a check
that fails must also say why in its metadata."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbatch.ops.shards.routing import shard_of
from kvbatch.pipelines.default import decode_results, prefill_kv, prompt_shards, prompts
from kvbatch.pipelines.factory import default_pipeline, pipeline_resources
from kvbatch.pipelines.layout import DayLayout
from kvbatch.pipelines.partitions import date_shard_key

PIPELINE = "kvbatch"  # the code location's own pipeline: asset keys [kvbatch, ...], tables under <root>/kvbatch


def keyed(by_kind: dict) -> dict:
    return pipeline_resources(default_pipeline().spec, by_kind)


def tables(root: Path) -> str:
    return str(root / PIPELINE)
from kvbatch.resources import (
    DecodeClusterResource,
    KVStoreResource,
    ModelResource,
    ObjectStoreResource,
    PricingResource,
)
from tests.tiny_models import build_tiny_chat_model

DATE = "2026-11-29"
MAX_TOKENS = 3
SHARD = "0000"
# The decode tests' six rows at 3 rows per shard: a day of 2 shards (prompt_shards' run config).
ROWS_PER_SHARD, NUM_SHARDS = 3, 2


def _ids_in_shard(n: int) -> list[str]:
    """``n`` custom_ids that all hash to ``SHARD`` of a ``NUM_SHARDS``-shard day, so one (date,
    shard) holds every row."""
    ids = [f"q{i:03d}" for i in range(64 * NUM_SHARDS) if shard_of(f"q{i:03d}", NUM_SHARDS) == int(SHARD)]
    assert len(ids) >= n
    return ids[:n]


def _line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "messages": [{"role": "user", "content": f"Say {custom_id}."}],
                       "max_tokens": MAX_TOKENS, "temperature": 0, **body})


def _resources(root: Path, tiny: Path) -> dict:
    return keyed({
        "object_store": ObjectStoreResource(url=str(root)),
        "model": ModelResource(model=str(tiny), max_batch=8),
        "kv_store": KVStoreResource(memory_gb=0),
        "pricing": PricingResource(),
        "decode_cluster": DecodeClusterResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    })


def _checks(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    # decode's checks block (pipelines/check_policy.py): a failed one fails the step and the run,
    # after the asset's materialization is recorded, so the shard's results are still there to read.
    assert result.success is all(c.passed for c in checks.values())
    assert len(result.get_asset_materialization_events()) == 1
    return checks


def _meta(check: dg.AssetCheckEvaluation) -> dict:
    return {k: v.value for k, v in check.metadata.items()}


# ---------------------------------------------------------------- prompts (no model needed)


def _ingest_repeating_rows(monkeypatch, start: int, length: int) -> None:
    """Make the real ingest write rows [start, start + length) of its prompts table a second time:
    an ingest that lost its duplicate check, the only honest way to see ``unique_custom_ids`` fail."""
    import kvbatch.ops.ingest.prompts as ingest_module

    real = ingest_module.ingest

    def ingest_without_duplicate_check(url, prompts_url, *args, **kwargs):
        report = real(url, prompts_url, *args, **kwargs)
        table = pq.read_table(prompts_url)
        pq.write_table(pa.concat_tables([table, table.slice(start, length)]), prompts_url)
        return report

    monkeypatch.setattr(ingest_module, "ingest", ingest_without_duplicate_check)


def _ingest_prompts(tmp_path: Path, lines: list[str], max_reject_rate: float) -> dict[str, dg.AssetCheckEvaluation]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = {"ops": {"kvbatch__prompts": {"config": {"url": str(data), "max_reject_rate": max_reject_rate}}}}
    resources = {"object_store": ObjectStoreResource(url=str(tmp_path / "data"))}
    result = dg.materialize([prompts], resources=resources, partition_key=DATE, selection=[prompts],
                            run_config=config, raise_on_error=False)
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    # The prompts checks are blocking: the step (and so the run) fails exactly when one fails.
    assert result.success is all(c.passed for c in checks.values())
    return checks


@pytest.mark.parametrize("bad, threshold, passed", [(2, 0.25, False), (2, 0.4, True), (0, 0.0, True)])
def test_reject_rate_check_compares_the_rate_with_the_threshold(tmp_path, bad, threshold, passed):
    """2 bad rows of 5 is a rate of 0.4: above 0.25 it fails, at exactly 0.4 it passes (the
    threshold is inclusive); clean data passes even a threshold of 0."""
    lines = [_line(f"ok{i}") for i in range(5 - bad)] + ["not json", _line("hot", temperature="hot")][:bad]
    checks = _ingest_prompts(tmp_path, lines, threshold)
    check = checks["reject_rate_below_threshold"]
    assert check.passed is passed
    assert _meta(check) == {"reject_rate_pct": pytest.approx(100 * bad / 5), "threshold_pct": 100 * threshold}
    assert check.partition == DATE  # recorded against its date partition
    assert checks["unique_custom_ids"].passed  # nothing else is wrong with this data


def test_unique_custom_ids_check_fails_when_the_prompts_table_repeats_an_id(tmp_path, monkeypatch):
    """A repeated custom_id in the *input* never reaches the prompts table: ingest rejects it
    (kept in the rejects table), so the check passes. The check guards that ingest invariant on
    the table every later step reads, so the only honest way to see it fail is an ingest that
    lost it: the real ingest, wrapped to write two of its rows a second time."""
    lines = [_line("a"), _line("b"), _line("c"), _line("a")]
    clean = _ingest_prompts(tmp_path / "clean", lines, 0.5)["unique_custom_ids"]
    assert clean.passed and _meta(clean) == {"duplicates": 0, "duplicate_ids_preview": []}
    rejects = pq.read_table(DayLayout(tables(tmp_path / "clean" / "data"), DATE).table("rejects")).to_pylist()
    assert [(r["custom_id"], r["field"]) for r in rejects] == [("a", "custom_id")]

    _ingest_repeating_rows(monkeypatch, start=1, length=2)
    broken = _ingest_prompts(tmp_path / "broken", lines, 0.5)["unique_custom_ids"]
    assert not broken.passed
    assert _meta(broken) == {"duplicates": 2, "duplicate_ids_preview": ["b", "c"]}


def _materialized(result: dg.ExecuteInProcessResult) -> set[str]:
    return {e.event_specific_data.materialization.asset_key.path[-1] for e in result.get_asset_materialization_events()}


@pytest.mark.slow
def test_a_failed_prompts_check_stops_the_shards_of_that_run(tmp_path, monkeypatch):
    """Blocking checks: with a repeated id in the prompts table, ``prompts`` is recorded, its
    check fails, and ``prompt_shards`` (so no shard, prefill or decode) does not run; clean data
    runs both."""
    tiny = build_tiny_chat_model(tmp_path / "tiny")
    lines = [_line("a"), _line("b"), _line("c")]
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = {"ops": {"kvbatch__prompts": {"config": {"url": str(data), "max_reject_rate": 0.5}}}}

    def run(root: Path) -> dg.ExecuteInProcessResult:
        resources = keyed({"object_store": ObjectStoreResource(url=str(root)), "model": ModelResource(model=str(tiny))})
        return dg.materialize([prompts, prompt_shards], resources=resources, partition_key=DATE,
                              run_config=config, raise_on_error=False)

    clean = run(tmp_path / "clean")
    assert clean.success
    assert _materialized(clean) == {"prompts", "prompt_shards"}

    _ingest_repeating_rows(monkeypatch, start=0, length=1)
    broken = run(tmp_path / "broken")
    assert not broken.success
    assert _materialized(broken) == {"prompts"}
    assert [c.passed for c in broken.get_asset_check_evaluations() if c.check_name == "unique_custom_ids"] == [False]
    assert not (tmp_path / "broken" / PIPELINE / "shards").exists()


# ---------------------------------------------------------------- decode_results


@pytest.fixture(scope="module")
def prefilled(tmp_path_factory) -> tuple[dict, DayLayout, list[str]]:
    """Six requests, all in ``SHARD``, ingested and prefilled once for every decode test below
    (each test changes the hand-off, decodes, and ``handoff`` puts it back)."""
    base = tmp_path_factory.mktemp("checks")
    tiny = build_tiny_chat_model(base / "tiny")
    ids = _ids_in_shard(6)
    data = base / "requests.jsonl"
    data.write_text("\n".join(_line(i) for i in ids) + "\n")
    resources = _resources(base / "data", tiny)
    config = {"ops": {"kvbatch__prompts": {"config": {"url": str(data)}},
                      "kvbatch__prompt_shards": {"config": {"max_rows_per_shard": ROWS_PER_SHARD}}}}
    res = dg.materialize([prompts, prompt_shards], resources=resources, partition_key=DATE, run_config=config,
                         instance=PREFILL_INSTANCE)
    assert res.asset_materializations_for_node("kvbatch__prompt_shards")[0].metadata["num_shards"].value == NUM_SHARDS
    assert dg.materialize([prefill_kv], resources=resources, partition_key=date_shard_key(DATE, SHARD),
                          selection=[prefill_kv], instance=PREFILL_INSTANCE).success
    return resources, DayLayout(tables(base / "data"), DATE), ids


# The instance the prefilled day's (date, shard) partitions were added to (its ingest adds them):
# every decode of that shard runs in it.
PREFILL_INSTANCE = dg.DagsterInstance.ephemeral()


@pytest.fixture
def handoff(prefilled) -> Iterator[tuple[dict, DayLayout, list[str]]]:
    """``prefilled``, with the manifests and the shard table restored after the test."""
    _, day, _ = prefilled
    files = [Path(day.shard("manifests", SHARD, "manifests.jsonl")), Path(day.shard("shards", SHARD))]
    saved = [f.read_bytes() for f in files]
    yield prefilled
    for f, content in zip(files, saved):
        f.write_bytes(content)


def _decode(resources: dict) -> dict[str, dg.AssetCheckEvaluation]:
    return _checks(dg.materialize([decode_results], resources=resources, partition_key=date_shard_key(DATE, SHARD),
                                  selection=[decode_results], instance=PREFILL_INSTANCE, raise_on_error=False))


def _edit_manifests(day: DayLayout, edit) -> None:
    path = Path(day.shard("manifests", SHARD, "manifests.jsonl"))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(m) + "\n" for m in edit(lines)))


CLEAN_ONE_RESULT = {"missing": 0, "unexpected": 0, "duplicates": 0, "missing_ids_preview": [],
                    "unexpected_ids_preview": [], "duplicate_ids_preview": []}


def test_decode_checks_pass_on_a_clean_shard(handoff):
    resources, day, ids = handoff
    checks = _decode(resources)
    assert checks["one_result_per_custom_id"].passed and checks["output_within_max_tokens"].passed
    assert {c.partition for c in checks.values()} == {str(date_shard_key(DATE, SHARD))}  # the check's own shard
    assert _meta(checks["one_result_per_custom_id"]) == CLEAN_ONE_RESULT
    assert _meta(checks["output_within_max_tokens"]) == {"over_limit": 0, "ids_preview": []}
    assert sorted(pq.read_table(day.shard("results", SHARD)).column("custom_id").to_pylist()) == ids


def test_one_result_check_names_an_id_the_handoff_lost(handoff):
    """A manifest that lost a line (a truncated or hand-edited hand-off) decodes one request
    fewer than the shard holds."""
    resources, day, ids = handoff
    _edit_manifests(day, lambda lines: [m for m in lines if m["custom_id"] != ids[2]])
    check = _decode(resources)["one_result_per_custom_id"]
    assert not check.passed
    assert _meta(check) == {**CLEAN_ONE_RESULT, "missing": 1, "missing_ids_preview": [ids[2]]}
    # The check blocks: in a run with the shard's cost_metrics, that step does not run, so the day's
    # scorecard lists the shard (no cost row) instead of counting it done.
    from kvbatch.pipelines.default import cost_metrics

    run = dg.materialize([decode_results, cost_metrics], resources=resources, partition_key=date_shard_key(DATE, SHARD),
                         instance=PREFILL_INSTANCE, raise_on_error=False)
    assert not run.success
    assert {e.asset_key.path[-1] for e in run.get_asset_materialization_events()} == {"decode_results"}
    started = {e.step_key for e in run.all_events if e.event_type_value == "STEP_START"}
    assert started == {decode_results.op.name}  # cost_metrics never started


def test_one_result_check_names_results_of_a_stale_handoff(handoff):
    """The shard re-made (prompt_shards re-run on a corrected dataset: one row dropped, one
    added) after prefill wrote the manifests: decode answers the old rows, so one result has no
    row in the shard and one row has no result. Only the shard table is rewritten, as the re-run
    would leave it; the manifests are prefill's own."""
    resources, day, ids = handoff
    shard = pq.read_table(day.shard("shards", SHARD))
    dropped, added = ids[4], "added-later"
    rows = [r for r in shard.to_pylist() if r["custom_id"] != dropped]
    rows.append(dict(rows[0], custom_id=added))
    pq.write_table(pa.Table.from_pylist(rows, shard.schema), day.shard("shards", SHARD))
    check = _decode(resources)["one_result_per_custom_id"]
    assert not check.passed
    assert _meta(check) == {**CLEAN_ONE_RESULT, "missing": 1, "unexpected": 1, "missing_ids_preview": [added],
                            "unexpected_ids_preview": [dropped]}


def test_one_result_check_names_an_id_answered_twice(handoff):
    """A manifest holding a request twice (two prefill runs' manifests joined): the copy gets
    the next free index, so the manifest is well formed and decode answers it twice."""
    resources, day, ids = handoff
    _edit_manifests(day, lambda lines: lines + [dict(lines[1], index=max(m["index"] for m in lines) + 1)])
    checks = _decode(resources)
    check = checks["one_result_per_custom_id"]
    assert not check.passed
    assert _meta(check) == {**CLEAN_ONE_RESULT, "duplicates": 1, "duplicate_ids_preview": [ids[1]]}
    assert checks["output_within_max_tokens"].passed


def test_output_check_names_rows_longer_than_the_request_allows(handoff):
    """A hand-off that loosened two requests' limit (max_tokens raised in the manifest, EOS
    ignored so the longer output is certain): the engine obeys the manifest, so only a check
    against the request's own max_tokens (the shard's) sees the rows go over it."""
    resources, day, ids = handoff
    loosen = {ids[0], ids[3]}

    def edit(lines):
        return [dict(m, sampling=dict(m["sampling"], max_tokens=MAX_TOKENS + 4, ignore_eos=True))
                if m["custom_id"] in loosen else m for m in lines]

    _edit_manifests(day, edit)
    checks = _decode(resources)
    check = checks["output_within_max_tokens"]
    assert not check.passed
    assert _meta(check) == {"over_limit": 2, "ids_preview": sorted(loosen)}
    results = {r["custom_id"]: r["completion_tokens"] for r in pq.read_table(day.shard("results", SHARD)).to_pylist()}
    assert all(results[i] == MAX_TOKENS + 4 for i in loosen)
    assert checks["one_result_per_custom_id"].passed


def test_every_check_has_a_description_and_its_asset_partitions():
    from kvbatch.pipelines.definitions import defs

    specs = [spec for a in defs.assets for spec in getattr(a, "check_specs", [])]
    assert {s.name for s in specs} >= {"reject_rate_below_threshold", "unique_custom_ids", "one_result_per_custom_id",
                                       "output_within_max_tokens", "latency_p95_within_slo"}
    graph = defs.resolve_asset_graph()
    for spec in specs:
        assert spec.description and len(spec.description) > 20, spec.name
        assert spec.partitions_def == graph.get(spec.asset_key).partitions_def, spec.name
