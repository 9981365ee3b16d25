"""Recovery paths of `kvbatch serve` that tests/test_serve.py and tests/test_serve_s3.py leave out,
with the real server, its real warm worker and the real decode (tiny chat model), except where
a moment cannot be caught from outside (a cancel while finalizing: the run is faked there, as in
tests/test_serve_s3.py's driver tests):

- a cancel while the batch is queued behind another on the worker: it ends ``cancelled`` with no
  row run, and the batch ahead of it is untouched;
- a cancel while finalizing: every row has run, so the batch finalizes (``completed``), also
  when the finalize is interrupted and a restarted server finishes it;
- the worker killed (SIGKILL) while it decodes the batch, again and again: each death starts a
  new run that resumes after the last committed part, up to ``max_attempts``; then the batch is
  ``failed`` with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.test_serve import KEY_A, WAIT_S, _done, _lines, _row, _upload, _wait, serve_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve_recovery")
    yield from serve_tiny_model(base, KVBATCH_ROOT=str(base / "root"), KVBATCH_API_KEYS=KEY_A)


def _record(server, batch_id: str) -> dict:
    return json.loads((Path(server.env["KVBATCH_ROOT"]) / "batch_api" / "batches" / f"{batch_id}.json").read_text())


def _work(server, batch_id: str) -> Path:
    return Path(server.env["KVBATCH_ROOT"]) / "batch_api" / "work" / batch_id


def _long_rows(prefix: str, n: int) -> list[str]:
    return [_row(f"{prefix}{i}", content=f"Count to {i}", max_tokens=2 if i < 8 else 80, ignore_eos=True)
            for i in range(n)]


def _until(what, limit_s: float = WAIT_S):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not reached in {limit_s} s: {what.__doc__}")


@pytest.mark.slow
def test_a_batch_cancelled_while_queued_never_runs_and_the_one_ahead_completes(server, tmp_path):
    client = server.client(KEY_A)
    ahead = client.batches.create(input_file_id=_upload(client, tmp_path / "a.jsonl", _long_rows("a", 96)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    queued = client.batches.create(input_file_id=_upload(client, tmp_path / "q.jsonl", _long_rows("q", 16)),
                                   endpoint="/v1/chat/completions", completion_window="24h")

    def both_launched_and_ahead_running() -> bool:
        """the batch ahead committed a part while the second is launched behind it"""
        return bool(list(_work(server, ahead.id).glob("part-*"))) and _record(server, queued.id)["attempts"] == 1

    _until(both_launched_and_ahead_running)
    assert not list(_work(server, queued.id).glob("part-*"))  # queued: the worker is on the batch ahead
    assert client.batches.cancel(queued.id).status == "cancelling"
    queued = _wait(client, queued.id, _done)
    assert queued.status == "cancelled" and queued.request_counts.completed == 0, queued
    assert _lines(client, queued.output_file_id) == []
    ahead = _wait(client, ahead.id, _done)
    assert ahead.status == "completed" and ahead.request_counts.completed == 96
    assert [o["custom_id"] for o in _lines(client, ahead.output_file_id)] == [f"a{i}" for i in range(96)]


@pytest.mark.slow
def test_a_worker_killed_each_time_is_retried_up_to_max_attempts_then_failed_with_the_reason(server, tmp_path):
    """SIGKILL of the worker's whole session (the worker and the decode it runs), each time after its
    run committed a part: the server starts another run, which resumes; at the third death the
    batch fails saying so."""
    client = server.client(KEY_A)
    batch = client.batches.create(input_file_id=_upload(client, tmp_path / "k.jsonl", _long_rows("k", 256)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    work = _work(server, batch.id)
    killed = []
    for attempt in (1, 2, 3):
        def running_and_committed() -> int | None:
            """the batch's run of this attempt is alive and has committed a part beyond the last run's"""
            rec = _record(server, batch.id)
            parts = len(list(work.glob("part-*")))
            if rec["attempts"] == attempt and rec["worker"] and parts > len(killed) and \
                    Path(f"/proc/{rec['worker']['pid']}").exists():
                return rec["worker"]["pid"]
            return None

        pid = _until(running_and_committed)
        assert pid not in killed  # a new worker each time
        assert client.batches.retrieve(batch.id).status == "in_progress"
        os.killpg(pid, signal.SIGKILL)  # the worker leads a session of its own: this takes its decode too
        killed.append(pid)
    batch = _wait(client, batch.id, _done)
    assert batch.status == "failed", batch
    assert "the batch's run stopped 3 times without finishing" in batch.errors.data[0].message
    assert _record(server, batch.id)["attempts"] == 3
    # The second and third runs resumed after the parts of the one before: no row ran twice.
    done = [p.name for p in work.glob("part-*")]
    spans = sorted(tuple(int(x) for x in name.split("-")[1:3]) for name in done)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_a_cancel_while_finalizing_finalizes_also_after_an_interrupted_finalize(s3, monkeypatch):
    from kvbatch.serve.batches import BatchService
    from kvbatch.serve.files import FileService
    from kvbatch.serve.state import StateStore
    from tests.test_serve_s3 import OWNER, FakeLauncher, _service, _write_part

    service, launcher, batch_id, run = _service(s3, rows=4)
    work = launcher.launched[0]
    _write_part(run, work, 0, 4)
    run.pipe_file(f"{work}/done.json", json.dumps({"status": "completed"}).encode())
    real_write = service.files.write_output

    def dies_at_the_error_file(owner, filename, lines, **kw):
        if filename.endswith("_error.jsonl"):
            raise KeyboardInterrupt  # the server is killed in the middle of finalizing
        return real_write(owner, filename, lines, **kw)

    monkeypatch.setattr(service.files, "write_output", dies_at_the_error_file)
    with pytest.raises(KeyboardInterrupt):
        service.advance(batch_id)
    assert service.get(OWNER, batch_id).status == "finalizing"
    # Every row has run: a cancel now changes nothing (OpenAI's batches behave the same way).
    assert service.cancel(OWNER, batch_id).status == "finalizing"
    assert not run.exists(f"{work}/cancel")

    settings = service.settings  # a new server over the same state
    store = StateStore(settings.state_url, settings.storage_options)
    restarted = BatchService(store, FileService(store, settings), FakeLauncher(), settings)
    assert restarted.cancel(OWNER, batch_id).status == "finalizing"
    restarted.advance(batch_id)
    batch = restarted.get(OWNER, batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 4, batch
    out = b"".join(restarted.files.read(OWNER, batch.output_file_id)).decode().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == [f"r{i}" for i in range(4)]
