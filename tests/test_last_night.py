"""``spec: suffix:last-night``: a pipeline's decode drafting from its own results of the latest
earlier day (``pipelines/last_night.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbatch.engine.spec import EngineSpec
from kvbatch.pipelines.last_night import SUFFIX_LAST_NIGHT, last_night_results, resolve_last_night
from kvbatch.pipelines.layout import DayLayout
from tests.tiny_models import build_tiny_chat_model


def _results(root: Path, date: str, shards: list[str]) -> None:
    for shard in shards:
        part = root / "results" / f"date={date}" / f"shard={shard}" / "part.parquet"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(b"PAR1")  # only its name is looked at here


def test_the_latest_earlier_day_with_results_is_last_night(tmp_path):
    root = tmp_path / "tables"
    assert last_night_results(DayLayout(str(root), "2026-12-05")) is None  # no results/ at all
    _results(root, "2026-12-01", ["0000"])
    _results(root, "2026-12-03", ["0000", "0001"])
    _results(root, "2026-12-05", ["0000"])  # the day itself, and a later one, never count
    _results(root, "2026-12-06", ["0000"])
    (root / "results" / "date=2026-12-04").mkdir()  # a day that started and wrote nothing: passed over
    (root / "results" / "notes").mkdir()
    glob = last_night_results(DayLayout(str(root), "2026-12-05"))
    assert glob == f"{root}/results/date=2026-12-03/shard=*/part.parquet"
    assert last_night_results(DayLayout(str(root), "2026-12-02")) == f"{root}/results/date=2026-12-01/shard=*/part.parquet"
    assert last_night_results(DayLayout(str(root), "2026-12-01")) is None


def test_resolution_names_the_files_or_falls_back_to_prompt_lookup(tmp_path):
    root = tmp_path / "tables"
    spec = EngineSpec(speculative=SUFFIX_LAST_NIGHT)
    first, said = resolve_last_night(spec, DayLayout(str(root), "2026-12-01"))
    assert first.speculative == "ngram" and "found no results of a day before 2026-12-01" in said
    _results(root, "2026-12-01", ["0000"])
    second, said = resolve_last_night(spec, DayLayout(str(root), "2026-12-02"), {"anon": True})
    assert second.speculative == said == f"suffix:{root}/results/date=2026-12-01/shard=*/part.parquet"
    assert second.spec_corpus_options == {"anon": True} and "anon" not in repr(second)
    other = EngineSpec(speculative="ngram")
    assert resolve_last_night(other, DayLayout(str(root), "2026-12-02")) == (other, "ngram")


def test_outside_a_pipeline_last_night_is_refused_naming_what_to_give(tmp_path):
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.engine.speculative.controller import LAST_NIGHT, SpecConfig

    assert SUFFIX_LAST_NIGHT == f"suffix:{LAST_NIGHT}"  # the pipeline's spelling is the engine's
    tiny = build_tiny_chat_model(tmp_path / "tiny", max_positions=96)
    with pytest.raises(ValueError, match="pipeline's own previous night.*suffix:FILE_GLOB_OR_URL"):
        LLM(str(tiny), speculative=SpecConfig.parse(SUFFIX_LAST_NIGHT))


@pytest.mark.slow
def test_the_second_night_drafts_from_the_first_nights_results(tmp_path):
    """Two nights of the same pipeline with ``spec: suffix:last-night``: the first drafts by prompt
    lookup alone, the second from the first's results, and both answer as plain decoding does."""
    import pyarrow.parquet as pq

    from tests.pipeline_day import decode_metadata, prepared_day

    tiny = build_tiny_chat_model(tmp_path / "tiny", max_positions=96)
    root = tmp_path / "data"

    def night(date: str, spec: str | None) -> tuple[list[dict], dict]:
        data = tmp_path / f"{date}.jsonl"
        data.write_text("".join(json.dumps({"custom_id": f"q{i}", "max_tokens": 12, "temperature": 0,
                                            "messages": [{"role": "user", "content": f"Count to {i}, twice."}]})
                                + "\n" for i in range(4)))
        base = root if spec else tmp_path / "plain"
        meta = decode_metadata(prepared_day(base, tiny, data, date, spec=spec))
        rows = pq.read_table(DayLayout(str(base / "kvbatch"), date).shard("results", "0000")).sort_by("custom_id")
        return rows.select(["custom_id", "output_token_ids"]).to_pylist(), meta

    first, meta1 = night("2026-12-01", SUFFIX_LAST_NIGHT)
    assert meta1["spec"].startswith("ngram (suffix:last-night found no results of a day before 2026-12-01")
    second, meta2 = night("2026-12-02", SUFFIX_LAST_NIGHT)
    assert meta2["spec"] == f"suffix:{root}/kvbatch/results/date=2026-12-01/shard=*/part.parquet"
    plain, _ = night("2026-12-02", None)
    assert second == plain == first  # the same questions both nights: greedy answers as plain decoding's


def test_a_corpus_read_with_other_credentials_keeps_the_cache_keys():
    """The corpus's fsspec options (credentials) are not part of the engine's identity."""
    from kvbatch.engine.speculative.controller import SpecConfig
    from kvbatch.ops.decode.response_cache import _plain

    one = SpecConfig.parse("suffix:s3://b/date=2026-12-01/*.parquet", corpus_options={"key": "A", "secret": "x"})
    other = SpecConfig.parse("suffix:s3://b/date=2026-12-01/*.parquet", corpus_options={"key": "B"})
    assert _plain(one) == _plain(other) != _plain(SpecConfig.parse("suffix:s3://b/date=2026-12-02/*.parquet"))
    assert "secret" not in repr(one)
