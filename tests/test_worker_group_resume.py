"""The ``--workers`` group resumes after a kill: a re-run of the same command keeps every row the
killed run committed, answers only the rest, and writes the output an uninterrupted run writes;
a re-run with another input or options discards the parts instead of mixing them in.

- In this process (a group of one on gloo; a crash injected after 5 rows, parts of 2): generate
  and decode resume (the second run answers exactly the rows in no part), and a changed seed, a
  rewritten input or ``--no-resume`` discard the parts, saying why.
- For real (slow): ``kvbatch generate --workers 2`` stopped by SIGTERM to the launcher, then
  SIGKILLed (launcher and ranks at once), each time after each rank committed a part of its own
  run; the third run writes the uninterrupted run's output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvbatch.engine.spec import EngineSpec
from kvbatch.ops.decode import group_outputs
from kvbatch.ops.decode import group_resume
from kvbatch.ops.decode import launch
from kvbatch.ops.decode import worker
from kvbatch.ops.decode.checkpoint import INDEX_COLUMN
from tests.tiny_models import build_tiny_chat_model

N = 9  # rows of the in-process runs, one of them rejected
PART = 2  # rows per part
CRASH_AFTER = 5  # the crashed run commits 2 parts (4 rows) and loses the 5th, buffered


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=128)


def _requests(path: Path, n: int, max_tokens: int = 4) -> Path:
    rows = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": f"Count to {i} " + "and " * (i % 3)}],
                                 "max_tokens": max_tokens + i % 2, "temperature": 0}}) for i in range(n - 1)]
    rows.insert(3, '{"custom_id": "bad", "body": {"messages": []}}')
    path.write_text("\n".join(rows) + "\n")
    return path


def _manifests(tiny: Path, path: Path, n: int) -> Path:
    """Decode manifests of ``n`` greedy requests (no KV store: the ranks compute the prompts)."""
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from kvbatch.io.batch_output import JsonlWriter
    from kvbatch.ops.jobs import Job
    from kvbatch.ops.prefill.manifests import manifest_line

    llm = LLM(str(tiny), engine_config=EngineConfig())
    with JsonlWriter(str(path)) as out:
        for i in range(n):
            ids = llm.tokenizer.encode_chat([{"role": "user", "content": f"Tell me about {i}"}])
            out.write(manifest_line(llm, Job(i, f"id-{i}", i + 1, ids, SamplingParams(max_tokens=4 + i % 2,
                                                                                      temperature=0.0)), "kvbatch"))
    return path


def _spec(tiny: Path, tmp: Path, command: str, output: str, **extra) -> dict:
    # One request at a time: the same numerics whichever rows a run answers, so greedy tokens match.
    spec = {"command": command, "output": str(tmp / output), "metrics": str(tmp / f"{output}.m"),
            "checkpoint_rows": PART, "engine_spec": EngineSpec(model=str(tiny), dtype="fp32", max_batch=1).to_json(),
            **extra}
    if command == "generate":
        spec.setdefault("input", str(_requests(tmp / "in.jsonl", N)))
    else:
        spec.setdefault("manifests", str(_manifests(tiny, tmp / "m.jsonl", N)))
    return spec


def _answers(path: str) -> list[tuple]:
    """What a run answered, line by line (``created`` differs between runs; nothing else may)."""
    out = []
    for x in map(json.loads, Path(path).read_text().splitlines()):
        body = x["response"]["body"]
        out.append((x["id"], x["custom_id"], x["response"]["status_code"], body.get("choices"), body.get("usage"),
                    x["error"]))
    return out


def _part_rows(parts: Path) -> list[int]:
    return sorted(i for p in parts.glob("part-*.parquet") for i in pq.read_table(p).column(INDEX_COLUMN).to_pylist())


@pytest.fixture
def group_of_one(monkeypatch):
    """This process as rank 0 of a group of 1; ``puts`` counts the rows each run answers."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    puts = [0]
    real_put = group_outputs.RankPartSink.put

    def put(self, index, obj):
        puts[0] += 1
        return real_put(self, index, obj)

    monkeypatch.setattr(group_outputs.RankPartSink, "put", put)
    return puts


def _crashed_run(spec: dict, monkeypatch) -> None:
    """``spec`` run until its 6th answered row, where the rank dies (its 5th row still buffered)."""
    real_put = group_outputs.RankPartSink.put
    count = [0]

    def put(self, index, obj):
        count[0] += 1
        if count[0] > CRASH_AFTER:
            raise RuntimeError("rank killed")
        return real_put(self, index, obj)

    with monkeypatch.context() as m:
        m.setattr(group_outputs.RankPartSink, "put", put)
        with pytest.raises(RuntimeError, match="rank killed"):
            worker.run(spec)


@pytest.mark.parametrize("command", ["generate", "decode"])
def test_a_rerun_after_a_crash_answers_only_the_rows_in_no_part(tiny, tmp_path, monkeypatch, capsys, group_of_one,
                                                                command):
    puts = group_of_one
    ref = _spec(tiny, tmp_path, command, "ref.jsonl")
    worker.run(ref)
    spec = {**ref, "output": str(tmp_path / "out.jsonl"), "metrics": str(tmp_path / "out.m")}  # the same command
    parts = Path(group_outputs.group_parts_url(spec))

    _crashed_run(spec, monkeypatch)
    committed = _part_rows(parts)
    assert len(committed) == 2 * PART  # whole parts only: the 5th row was lost, less than one interval
    assert not Path(spec["output"]).exists()

    puts[0] = 0
    capsys.readouterr()
    worker.run(spec)
    assert puts[0] == N - len(committed)  # the re-run answered exactly the rows in no part
    assert f"resuming: {len(committed)} rows answered by an earlier run" in capsys.readouterr().err
    assert _answers(spec["output"]) == _answers(ref["output"])  # ids, order, text and tokens
    m = json.loads(Path(spec["metrics"]).read_text())
    assert (m["requests"], m["resumed_rows"], m["runs"]) == (N, len(committed), 2)
    assert m["output_tokens"] == json.loads(Path(ref["metrics"]).read_text())["output_tokens"]
    assert not parts.exists()  # removed once the output was committed


@pytest.mark.parametrize("change", ["seed", "input", "no-resume"])
def test_a_rerun_with_other_input_or_options_discards_the_parts(tiny, tmp_path, monkeypatch, capsys, group_of_one,
                                                                change):
    puts = group_of_one
    spec = _spec(tiny, tmp_path, "generate", "out.jsonl")
    _crashed_run(spec, monkeypatch)
    parts = Path(group_outputs.group_parts_url(spec))
    assert len(_part_rows(parts)) == 2 * PART
    if change == "seed":
        spec["engine_spec"] = {**spec["engine_spec"], "seed": 7}
    elif change == "input":  # the same rows, one answer changed: the old parts must not answer it
        src = Path(spec["input"])
        src.write_text(src.read_text().replace('"max_tokens": 4', '"max_tokens": 6'))
    else:
        spec["resume"] = False
    puts[0] = 0
    capsys.readouterr()
    worker.run(spec)
    err = capsys.readouterr().err
    why = {"seed": "made with a different --seed", "input": "made with a different input file",
           "no-resume": "--no-resume"}[change]
    assert f"discarding {2 * PART} rows an earlier run left" in err and why in err and "resuming" not in err
    assert puts[0] == N  # every row answered again
    m = json.loads(Path(spec["metrics"]).read_text())
    assert (m["resumed_rows"], m["runs"]) == (0, 1)
    if change == "input":
        lines = [json.loads(x) for x in Path(spec["output"]).read_text().splitlines()]
        assert {x["response"]["body"]["usage"]["completion_tokens"] for x in lines if x["error"] is None} == {5, 6}
    assert not parts.exists()


def test_the_key_follows_the_answers_not_the_split(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    engine = EngineSpec(model="m", dtype="fp32", max_batch=4)
    base = {"command": "generate", "input": str(src), "model_name": "m", "engine_spec": engine.to_json()}
    key = group_resume.group_key(base, "fp")
    # World size, batching and checkpoint size change no answer: the same key.
    assert group_resume.group_key(
        {**base, "engine_spec": {**engine.to_json(), "max_batch": 64}, "checkpoint_rows": 9}, "fp") == key
    assert group_resume.group_key({**base, "input": f"file://{src}"}, "fp") == key
    changed = {"model weights": group_resume.group_key(base, "other"),
               "--strict": group_resume.group_key({**base, "strict": True}, "fp"),
               "--model": group_resume.group_key({**base, "model_name": "n"}, "fp"),
               "--spec": group_resume.group_key({**base, "engine_spec": {**engine.to_json(), "speculative": "ngram"}}, "fp")}
    for flag, other in changed.items():
        assert group_resume.key_difference(key, other) == [flag]
    os.utime(src, ns=(1, 1))  # the same bytes, touched: another identity (the safe side)
    assert group_resume.key_difference(key, group_resume.group_key(base, "fp")) == ["input file"]
    assert group_resume.key_difference("0123abcd", key) == ["parts format (kvbatch version)"]


def test_unanswered_skips_the_done_rows_of_this_ranks_share_keeping_their_places():
    skipped = [0]
    # rank 1 of 2 takes input rows 1, 3, 5, 7, 9 (places 0..4); rows 3 and 7 were committed
    pairs = list(group_resume.unanswered(range(10), 1, 2, np.array([3, 7]), skipped))
    assert pairs == [(0, 1), (2, 5), (4, 9)] and skipped == [2]

    class J:
        index = -1

    jobs = list(group_resume.with_indexes(lambda items: (J() for _ in items), pairs))
    assert [j.index for j in jobs] == [0, 2, 4]


def _put(sink: group_outputs.RankPartSink, local: int, row: int) -> None:
    from kvbatch.io.batch_output import result_line

    sink.figures[str(local)] = dict.fromkeys(group_outputs._GroupTotals.COUNTS, 1) | {"ttft_s": 0.1, "tpot_s": None}
    sink.put(local, result_line(f"c{row}", row + 1, text=f"t{row}", finish_reason="stop", prompt_tokens=1,
                                completion_tokens=1, model="m"))


def _info(attempt: str, rows: int, resumed: int) -> dict:
    return {"attempt": attempt, "rows": rows, "resumed": resumed, "wall_s": 1.0, "draft_s": 0.0,
            "step_s_total": 0.0, "spec_enabled": False, "ep": None, "balancer": None, "step_s": [], "broken": None}


def test_parts_of_a_group_of_one_are_resumed_by_a_group_of_two(tmp_path):
    """A part row is keyed by its input line, not by the rank that answered it: rows 0-3 of a
    killed group of 1, then a group of 2 over the same 6 rows answers only rows 4 and 5."""
    from kvbatch.ops.decode.checkpoint import done_index_array

    parts = str(tmp_path / "parts")
    old = group_outputs.RankPartSink(parts, 0, 1, "old", 2, {}, "key")
    for row in range(4):
        _put(old, row, row)
    infos = []
    for rank in (0, 1):
        skipped = [0]
        pairs = list(group_resume.unanswered(range(6), rank, 2, done_index_array(parts, None, rank, 2), skipped))
        assert pairs == [(2, 4 + rank)] and skipped == [2]  # row 4 + rank is place 2 of the rank's share
        with group_outputs.RankPartSink(parts, rank, 2, "new", 2, {}, "key") as sink:
            for place, row in pairs:
                _put(sink, place, row)
        infos.append(_info("new", sink.rows, skipped[0]))
    spec = {"output": str(tmp_path / "out.jsonl"), "metrics": str(tmp_path / "m.json")}
    assert group_outputs.write_outputs(spec, infos, 2, parts) == launch.EXIT_OK
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == \
        [f"c{i}" for i in range(6)]
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["requests"], m["resumed_rows"], m["runs"]) == (6, 4, 2)


def test_a_row_in_two_parts_is_refused_not_written_twice(tmp_path):
    parts = str(tmp_path / "parts")
    with group_outputs.RankPartSink(parts, 0, 1, "a", 2, {}, "key") as first:
        _put(first, 0, 0)
        _put(first, 1, 1)
    with group_outputs.RankPartSink(parts, 0, 1, "b", 2, {}, "key") as second:  # a second run at once, answering row 1 too
        _put(second, 1, 1)
    with pytest.raises(RuntimeError, match="hold output row 1 twice"):
        group_outputs.write_outputs({"output": str(tmp_path / "out.jsonl")}, [_info("b", 1, 2)], 1, parts)
    assert not (tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------------------------------------------
# For real: a 2-rank group SIGKILLed mid-run, then the same command again


@pytest.mark.slow
def test_a_two_rank_group_stopped_twice_resumes_to_the_uninterrupted_output(tiny, tmp_path):
    """SIGTERM to the launcher once each rank committed a part, then, in the re-run, SIGKILL of the
    launcher and both ranks at once once each rank committed another; the third run finishes."""
    n, part = 32, 2
    src = _requests(tmp_path / "in.jsonl", n, max_tokens=16)

    def cmd(out: str, workers: int) -> list[str]:
        return [sys.executable, "-m", "kvbatch.cli.main", "generate", "--model", str(tiny), "--input", str(src),
                "--output", str(tmp_path / out), "--metrics", str(tmp_path / f"{out}.m"), "--no-progress",
                "--max-batch", "1", "--workers", str(workers), "--checkpoint-rows", str(part)]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = subprocess.run(cmd("ref.jsonl", 1), env=env, capture_output=True, text=True, timeout=300, check=False)
    assert ref.returncode == 1, ref.stderr  # one rejected row
    parts = tmp_path / ".out.jsonl.kvbatch-parts"

    def stopped(how: int) -> subprocess.Popen:
        """The group, stopped by ``how`` once each rank has committed a part of its own run."""
        before = set(parts.glob("part-*.parquet"))
        # A session of its own, so that one SIGKILL takes the launcher and both ranks at once.
        proc = subprocess.Popen(cmd("out.jsonl", 2), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            for _ in range(3000):  # at most ~150 s: until each rank has committed a part, or the run ends
                new = [p.name for p in set(parts.glob("part-*.parquet")) - before]
                if all(any(f"-r0000{r}-" in x for x in new) for r in (0, 1)) or proc.poll() is not None:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, f"the group ended before it could be stopped: {proc.stderr.read().decode()}"
            if how == signal.SIGKILL:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(how)  # the launcher alone: it stops its ranks
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        time.sleep(0.5)  # the ranks' exits land
        assert not (tmp_path / "out.jsonl").exists()
        committed = _part_rows(parts)
        assert 0 < len(committed) < n and len(committed) == len(set(committed))
        for rank in (0, 1):  # only whole parts: a rank loses less than one interval
            assert len([i for i in committed if i % 2 == rank]) % part == 0
        return proc

    assert stopped(signal.SIGTERM).returncode == 128 + signal.SIGTERM  # its parts kept
    first = len(_part_rows(parts))
    assert stopped(signal.SIGKILL).returncode == -signal.SIGKILL
    committed = _part_rows(parts)
    assert len(committed) >= first + 2 * part  # the second run resumed and committed more

    again = subprocess.run(cmd("out.jsonl", 2), env=env, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 1, again.stderr
    assert f"resuming: {len(committed)} rows answered by an earlier run" in again.stderr
    assert f", {len(committed)} of the {n} rows resumed from an earlier run;" in again.stderr
    m = json.loads((tmp_path / "out.jsonl.m").read_text())
    assert (m["requests"], m["resumed_rows"], m["runs"]) == (n, len(committed), 3)  # the rest answered now
    answers = _answers(str(tmp_path / "out.jsonl"))
    assert answers == _answers(str(tmp_path / "ref.jsonl"))  # ids, order, text and tokens
    assert len({a[1] for a in answers}) == n  # no id twice
    assert not parts.exists()
