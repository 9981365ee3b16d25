"""The CLI ``--workers`` group writes per-rank part files and merges them; no row goes to rank 0
through the process group, and the metrics are summed once over exactly the rows written.

- The merge on hand-made parts (no process group): ranks that broke at different lines give the
  output and the totals of the rows before the earliest break, not of everything a rank read.
- A real group of 2 ranks on gloo over an uneven split (5 rows, one rejected): the output and the
  totals equal a single-process run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbatch.cli.main import main
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.batch_output import error_line, result_line
from kvbatch.io.batch_requests import RejectedRow
from kvbatch.ops.decode import group_outputs
from kvbatch.ops.decode import launch
from kvbatch.ops.decode import worker
from tests.tiny_models import build_tiny_chat_model


def _rank_parts(parts_url: str, rank: int, world: int, rows: int, attempt: str, part_rows: int = 2) -> int:
    """Rank ``rank``'s share of an input of ``rows`` rows through its sink: every 3rd input row is a
    reject, the others a result whose figures name the input row (prompt tokens 10 + row)."""
    sink = group_outputs.RankPartSink(parts_url, rank, world, attempt, part_rows, {}, "key")
    with sink:
        for local, row in enumerate(range(rank, rows, world)):
            if row % 3 == 2:
                sink.put(local, error_line(RejectedRow(row + 1, f"c{row}", "body.max_tokens", "bad")))
                continue
            sink.figures[str(local)] = {"prompt_tokens": 10 + row, "cached_prompt_tokens": 1,
                                        "loaded_prompt_tokens": 2, "output_tokens": row % 4, "preemptions": 0,
                                        "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                                        "spec_target_steps": 0, "ttft_s": 0.1 * row, "tpot_s": None}
            sink.put(local, result_line(f"c{row}", row + 1, text=f"t{row}", finish_reason="stop",
                                        prompt_tokens=10 + row, completion_tokens=row % 4, model="m"))
    return sink.rows


def _rank_info(rows: int, lines_read: int | None, attempt: str = "run1", resumed: int = 0) -> dict:
    broken = None if lines_read is None else {"lines_read": lines_read, "reason": "truncated", "message": "broken"}
    return {"attempt": attempt, "rows": rows, "resumed": resumed, "wall_s": 1.0, "draft_s": 0.0, "step_s_total": 0.5,
            "spec_enabled": False, "ep": None, "balancer": None, "step_s": [], "broken": broken}


def test_uneven_breaks_merge_and_count_only_the_rows_before_the_earliest(tmp_path):
    parts = str(tmp_path / "parts")
    # Rank 0 read 11 rows before its input broke, rank 1 only 7: the output ends after row 6.
    n0 = _rank_parts(parts, 0, 2, 11, "run1")
    n1 = _rank_parts(parts, 1, 2, 7, "run1")
    assert (n0, n1) == (6, 3)  # uneven shares
    spec = {"output": str(tmp_path / "out.jsonl"), "errors": str(tmp_path / "err.jsonl"),
            "metrics": str(tmp_path / "m.json")}
    code = group_outputs.write_outputs(spec, [_rank_info(n0, 11), _rank_info(n1, 7)], 2, parts)
    assert code == launch.EXIT_FATAL  # no launcher report: the group says it broke
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines[:-1]] == [f"c{i}" for i in range(7)]
    assert lines[-1]["error"]["line"] == 8 and "input ends here" in lines[-1]["error"]["message"]
    m = json.loads((tmp_path / "m.json").read_text())
    kept = [i for i in range(7) if i % 3 != 2]  # rows 0..6 that are results
    assert m["prompt_tokens"] == sum(10 + i for i in kept)  # rows 7..10 of rank 0 are not counted
    assert m["output_tokens"] == sum(i % 4 for i in kept)
    assert m["cached_prompt_tokens"] == len(kept) and m["loaded_prompt_tokens"] == 2 * len(kept)
    assert (m["requests"], m["succeeded"], m["rejected"]) == (8, 5, 3)  # 7 rows + the marker line
    assert m["rejects_by_field"] == {"body.max_tokens": 2, "$": 1}
    errors = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["c2", "c5", None]
    assert m["input_broken"]["lines_read"] == 7


def test_a_missing_row_fails_the_merge_naming_it(tmp_path):
    parts = str(tmp_path / "parts")
    n0 = _rank_parts(parts, 0, 2, 6, "run1")
    spec = {"output": str(tmp_path / "out.jsonl")}
    with pytest.raises(RuntimeError, match="miss output row 1"):  # rank 1 committed nothing
        group_outputs.write_outputs(spec, [_rank_info(n0, None), _rank_info(3, None)], 2, parts)
    assert not (tmp_path / "out.jsonl").exists()


def test_parts_of_an_earlier_run_are_merged_with_this_runs(tmp_path):
    """A killed run's parts (the folder's key checked at start: group_resume) and the re-run's
    hold disjoint rows; the output is all of them, in input order, and names the earlier run."""
    parts = str(tmp_path / "parts")
    sink = group_outputs.RankPartSink(parts, 0, 1, "old", 2, {}, "key")
    for row in (0, 1):
        sink.figures[str(row)] = dict.fromkeys(group_outputs._GroupTotals.COUNTS, 1) | {"ttft_s": 0.1, "tpot_s": None}
        sink.put(row, result_line(f"c{row}", row + 1, text="t", finish_reason="stop", prompt_tokens=1,
                                  completion_tokens=1, model="m"))
    sink.close()  # rows 0, 1 committed by the killed run
    new = group_outputs.RankPartSink(parts, 0, 1, "new", 2, {}, "key")
    with new:
        new.put(2, error_line(RejectedRow(3, "c2", "body.max_tokens", "bad")))
    spec = {"output": str(tmp_path / "out.jsonl"), "metrics": str(tmp_path / "m.json")}
    assert group_outputs.write_outputs(spec, [_rank_info(new.rows, None, "new", resumed=2)], 1, parts) == launch.EXIT_REJECTS
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == ["c0", "c1", "c2"]
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["requests"], m["resumed_rows"], m["runs"], m["prompt_tokens"]) == (3, 2, 2, 2)


def test_default_parts_folder_is_a_dot_folder_beside_the_output():
    assert group_outputs.group_parts_url({"output": "s3://b/out/x.jsonl"}) == "s3://b/out/.x.jsonl.kvbatch-parts"
    assert group_outputs.group_parts_url({"output": "x.jsonl", "parts_url": "/tmp/p"}) == "/tmp/p"


def _requests(path: Path, n: int) -> Path:
    rows = []
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"Say {i} " + "more " * (i % 3)}], "max_tokens": 3 + i % 2,
                "temperature": 0}
        rows.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    rows.insert(2, '{"custom_id": "bad", "body": {"messages": []}}')
    path.write_text("\n".join(rows) + "\n")
    return path


TOTALS = ("requests", "succeeded", "rejected", "rejects_by_field", "prompt_tokens", "output_tokens")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))  # ~most of this file's time: build once


def test_a_rank_sends_rank_0_its_counts_never_its_rows(tiny_chat, tmp_path, monkeypatch):
    """One rank in this process (a group of 1 on gloo): what it hands the gather is a few numbers,
    whatever the rows, and its rows reach the output through its part files (3 parts of 2 lines)."""
    import pickle

    import torch.distributed as dist

    from kvbatch.ops.decode import checkpoint as decode_checkpoint

    model = tiny_chat
    src = _requests(tmp_path / "in.jsonl", 4)
    sent, merged_from = [], []
    real_merge = decode_checkpoint.merged_parts

    def gather(obj, gather_list=None, dst=0):
        sent.append(obj)
        gather_list[0] = obj

    def merge(parts_url, schema, storage_options, attempt=None):
        merged_from.extend(sorted(p.name for p in Path(parts_url).glob("part-*.parquet")))
        return real_merge(parts_url, schema, storage_options, attempt)

    monkeypatch.setattr(dist, "gather_object", gather)
    monkeypatch.setattr(group_outputs, "merged_parts", merge)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    spec = {"command": "generate", "engine_spec": EngineSpec(model=str(model), dtype="fp32").to_json(),
            "input": str(src), "output": str(tmp_path / "o.jsonl"), "checkpoint_rows": 2}
    assert worker.run(spec) == launch.EXIT_REJECTS
    [payload] = sent
    assert "lines" not in payload and payload["rows"] == 5 and len(pickle.dumps(payload)) < 2000
    assert len(merged_from) == 3 and all("-r00000-" in name for name in merged_from)
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 5
    assert not (tmp_path / ".o.jsonl.kvbatch-parts").exists()  # the staging folder is gone


@pytest.mark.slow
def test_two_ranks_on_gloo_over_an_uneven_split_equal_one_process(tiny_chat, tmp_path):
    model = tiny_chat
    src = _requests(tmp_path / "in.jsonl", 4)  # 5 rows: rank 0 takes 3, rank 1 takes 2
    runs = {}
    for workers in (1, 2):
        out, metrics = tmp_path / f"o{workers}.jsonl", tmp_path / f"m{workers}.json"
        code = main(["generate", "--model", str(model), "--input", str(src), "--output", str(out), "--metrics",
                     str(metrics), "--no-progress", "--workers", str(workers)])
        assert code == 1  # one rejected row
        runs[workers] = ([json.loads(x) for x in out.read_text().splitlines()], json.loads(metrics.read_text()))
    (lines1, m1), (lines2, m2) = runs[1], runs[2]
    assert [(x["custom_id"], x["response"]["body"].get("choices")) for x in lines2] == \
        [(x["custom_id"], x["response"]["body"].get("choices")) for x in lines1]
    assert {k: m2[k] for k in TOTALS} == {k: m1[k] for k in TOTALS}
    assert m2["workers"] == 2 and m2["requests"] == 5
    usage = [x["response"]["body"]["usage"] for x in lines2 if x["error"] is None]
    assert m2["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage)  # summed once, not per rank
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left
