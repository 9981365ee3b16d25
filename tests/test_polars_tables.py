"""The table paths moved off per-row Python (issue 15): the shard meter's sums, speculative figures
and percentiles (polars), and the hive-partitioned shard reader (pyarrow dataset). Each pinned
against figures worked out by hand from the rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.io.shard_tables import read_shards, shard_url, write_table
from kvbatch.ops.results.cost import Pricing, results_figures, shard_metrics


def _results() -> pa.Table:
    # 4 requests; two speculated (target steps 3 and 2), one did not (null), one ran 0 target steps.
    return pa.table({
        "prompt_tokens": [10, 20, 30, 40], "loaded_prompt_tokens": [8, 0, 16, 0],
        "cached_prompt_tokens": [0, 4, 0, 0], "completion_tokens": [6, 4, 5, 1],
        "spec_draft_tokens": pa.array([8, 4, None, 0], pa.int64()),
        "spec_accepted_tokens": pa.array([4, 2, None, 0], pa.int64()),
        "spec_target_steps": pa.array([3, 2, None, 0], pa.int64()),
        "ttft_s": [0.4, 0.1, None, 0.3], "tpot_s": pa.array([None, None, None, 0.05], pa.float64())})


def test_the_meter_sums_speculation_and_percentiles_from_the_columns():
    m = shard_metrics(_results(), {}, {}, Pricing())
    assert (m["prompt_tokens"], m["output_tokens"], m["prompt_tokens_decode_loaded"],
            m["prompt_tokens_decode_cached"], m["prompt_tokens_decode_computed"]) == (100, 16, 24, 4, 72)
    assert (m["spec_draft_tokens"], m["spec_accepted_tokens"], m["spec_target_steps"]) == (12, 6, 5)
    assert m["spec_acceptance_rate"] == 0.5
    assert m["spec_tokens_per_target_step"] == 2.0  # (6 + 4) output tokens of the speculating rows / 5 steps
    assert (m["ttft_s_p50"], m["ttft_s_p95"]) == (0.3, 0.39)  # nulls skipped, linear interpolation
    assert m["tpot_s_p50"] == m["tpot_s_p99"] == 0.05


def test_the_meter_takes_results_without_optional_columns_or_rows():
    bare = shard_metrics(pa.table({"prompt_tokens": [5, 7], "completion_tokens": [1, 2]}), {}, {}, Pricing())
    assert (bare["prompt_tokens"], bare["prompt_tokens_decode_loaded"], bare["output_tokens"]) == (12, 0, 3)
    assert bare["spec_target_steps"] == 0 and bare["spec_tokens_per_target_step"] is None
    assert bare["ttft_s_p50"] is None and bare["tpot_s_p95"] is None
    empty = results_figures(_results().slice(0, 0))
    assert empty["prompt_tokens"] == 0 and empty["spec_outputs"] == 0 and empty["ttft_s_p99"] is None


def test_shards_read_as_a_hive_dataset_with_string_keys_and_promoted_columns(tmp_path):
    root = str(tmp_path)
    write_table(pa.table({"a": [1, 2], "t": [0.5, None]}), shard_url(root, "results", "0010"))
    write_table(pa.table({"a": [3]}), shard_url(root, "results", "0002"))  # older shard: no column t
    (tmp_path / "results" / "shard=0002" / "part.parquet.tmp-dead").write_bytes(b"half a file")
    (tmp_path / "results" / "shard=0003").mkdir()  # a shard never committed
    pq.write_table(pa.table({"a": [99]}), tmp_path / "results" / "stray.parquet")  # not a shard folder
    t = read_shards(root, "results")
    assert t.to_pydict() == {"a": [3, 1, 2], "t": [None, 0.5, None], "shard": ["0002", "0010", "0010"]}
    assert t.schema.field("shard").type == pa.string()  # "0002", not the number 2
    assert read_shards(root, "results", columns=["a"]).column_names == ["a", "shard"]
    assert read_shards(root, "nothing").num_rows == 0


def test_shards_read_through_the_object_store(s3):
    url, opts, _ = s3
    write_table(pa.table({"a": [1]}), shard_url(url, "m", "0001"), storage_options=opts)
    write_table(pa.table({"a": [2, 3]}), shard_url(url, "m", "0000"), storage_options=opts)
    t = read_shards(url, "m", storage_options=opts)
    assert t.to_pydict() == {"a": [2, 3, 1], "shard": ["0000", "0000", "0001"]}
