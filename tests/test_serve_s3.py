"""`kvbatch serve` with every piece of its state on S3 (moto on loopback).

The server and the batch's run are separate processes, each with its own s3fs filesystem, and s3fs
caches listings: a read that decides a batch's state (its parts, ``done.json``, the cancel marker)
must never be answered from a listing made before the other process wrote. The first tests drive
the work folder and ``BatchService`` directly, with the run's writes made through a filesystem
instance of its own (as another process's are); the last runs ``kvbatch serve`` itself on S3
through the official ``openai`` client.
"""

from __future__ import annotations

import io
import json
import os
import time
from typing import Any

import openai
import pytest

from kvbatch.pipelines.batch_api import cancel_requested, list_parts, read_done, request_cancel
from kvbatch.serve.batches import BatchService, coverage_error
from kvbatch.serve.files import FileService
from kvbatch.serve.objects import CreateBatch
from kvbatch.serve.settings import ServeSettings
from kvbatch.serve.state import StateStore

OWNER = "owner-test"


def _other_process_fs(opts: dict[str, Any]):
    """A filesystem instance of its own: its writes do not touch the caller's cached listings,
    exactly as a write by another process does not."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **opts)


def _row_line(cid: str) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}})


def _out_line(cid: str) -> bytes:
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    return (json.dumps({"id": f"r-{cid}", "custom_id": cid, "response": {"status_code": 200, "request_id": cid,
                                                                         "body": body}, "error": None}) + "\n").encode()


def _write_part(fs, work_url: str, lo: int, hi: int) -> None:
    fs.pipe_file(f"{work_url}/part-{lo:08d}-{hi:08d}-{hi - lo:08d}.jsonl",
                 b"".join(_out_line(f"r{i}") for i in range(lo, hi)))


def test_work_folder_reads_see_what_another_process_wrote(s3):
    url, opts, _ = s3
    work = f"{url}/batch_api/work/batch_x"
    run = _other_process_fs(opts)
    _write_part(run, work, 0, 2)
    assert [p.hi for p in list_parts(work, opts)] == [2]  # this process has now listed the folder
    assert read_done(work, opts) is None and not cancel_requested(work, opts)
    _write_part(run, work, 2, 4)
    run.pipe_file(f"{work}/cancel", b"cancel\n")
    run.pipe_file(f"{work}/done.json", json.dumps({"status": "cancelled"}).encode())
    assert [p.hi for p in list_parts(work, opts)] == [2, 4]
    assert cancel_requested(work, opts)
    assert read_done(work, opts) == {"status": "cancelled"}


def test_the_run_sees_a_cancel_the_server_wrote(s3):
    url, opts, _ = s3
    work = f"{url}/batch_api/work/batch_y"
    run = _other_process_fs(opts)
    _write_part(run, work, 0, 2)
    server_opts = dict(opts, skip_instance_cache=True)  # the server: another process, another instance
    assert [p.hi for p in list_parts(work, opts)] == [2]  # the run lists its folder when it starts (to resume)
    assert not cancel_requested(work, opts)
    request_cancel(work, server_opts)
    assert cancel_requested(work, opts)


class FakeLauncher:
    """Launches nothing: the test writes the run's work folder itself, from another instance."""

    def __init__(self) -> None:
        self.launched: list[str] = []
        self.running = True

    def launch(self, batch_id: str, input_url: str, work_url: str, chunk_rows: int,
               endpoint: str | None = None) -> dict[str, Any]:
        self.launched.append(work_url)
        return {"host": "test", "pid": len(self.launched)}

    def alive(self, handle: dict[str, Any] | None) -> bool:
        return self.running


def _service(s3, rows: int) -> tuple[BatchService, FakeLauncher, str, Any]:
    url, opts, _ = s3
    settings = ServeSettings(root=url, storage_options=opts, chunk_rows=2)
    store = StateStore(settings.state_url, settings.storage_options)
    files = FileService(store, settings)
    launcher = FakeLauncher()
    service = BatchService(store, files, launcher, settings)
    data = "\n".join(_row_line(f"r{i}") for i in range(rows)) + "\n"
    f = files.upload(OWNER, "in.jsonl", "batch", io.BytesIO(data.encode()))
    batch = service.create(OWNER, CreateBatch(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h"))
    assert batch.status == "validating" and batch.request_counts.total == 0  # not counted before validation
    service.advance(batch.id)
    batch = service.get(OWNER, batch.id)
    assert batch.status == "in_progress" and batch.request_counts.total == rows
    return service, launcher, batch.id, _other_process_fs(opts)


def test_counts_rise_as_parts_commit_and_the_batch_completes_with_state_on_s3(s3):
    service, launcher, batch_id, run = _service(s3, rows=6)
    work = launcher.launched[0]
    counts = []
    for lo in (0, 2, 4):
        _write_part(run, work, lo, lo + 2)
        service.advance(batch_id)
        counts.append(service.get(OWNER, batch_id).request_counts.completed)
    assert counts == [2, 4, 6]
    assert service.get(OWNER, batch_id).status == "in_progress"
    run.pipe_file(f"{work}/done.json", json.dumps({"status": "completed"}).encode())
    service.advance(batch_id)  # one look after the run's last word: no waiting for a stale listing to go
    batch = service.get(OWNER, batch_id)
    assert batch.status == "completed", batch
    out = b"".join(service.files.read(OWNER, batch.output_file_id)).decode().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == [f"r{i}" for i in range(6)]
    assert len(launcher.launched) == 1


def test_a_cancel_ends_cancelled_once_the_run_says_so(s3):
    service, launcher, batch_id, run = _service(s3, rows=6)
    work = launcher.launched[0]
    _write_part(run, work, 0, 2)
    service.advance(batch_id)
    assert service.cancel(OWNER, batch_id).status == "cancelling"
    assert run.exists(f"{work}/cancel")
    service.advance(batch_id)
    assert service.get(OWNER, batch_id).status == "cancelling"
    run.pipe_file(f"{work}/done.json", json.dumps({"status": "cancelled"}).encode())
    service.advance(batch_id)
    batch = service.get(OWNER, batch_id)
    assert batch.status == "cancelled" and batch.request_counts.completed == 2


@pytest.mark.parametrize(("parts", "reason"), [
    ([(0, 2), (4, 6)], "input lines 3-4 are in no committed part"),
    ([(0, 2), (2, 4)], "input lines 5-6 are in no committed part, yet the run says completed"),
    ([(0, 4), (2, 6)], "input lines 3-4 are in two committed parts"),
])
def test_finalize_fails_a_batch_whose_parts_do_not_cover_its_input(s3, parts, reason):
    service, launcher, batch_id, run = _service(s3, rows=6)
    work = launcher.launched[0]
    for lo, hi in parts:
        _write_part(run, work, lo, hi)
    run.pipe_file(f"{work}/done.json", json.dumps({"status": "completed"}).encode())
    service.advance(batch_id)
    batch = service.get(OWNER, batch_id)
    assert batch.status == "failed" and batch.output_file_id is None
    assert batch.errors.data[0].code == "incomplete_output"
    assert reason in batch.errors.data[0].message and "exactly once" in batch.errors.data[0].message


def test_finalize_checks_each_part_holds_the_rows_its_name_says(s3):
    service, launcher, batch_id, run = _service(s3, rows=4)
    work = launcher.launched[0]
    _write_part(run, work, 0, 2)
    run.pipe_file(f"{work}/part-{2:08d}-{4:08d}-{2:08d}.jsonl", _out_line("r2"))  # one line, not two
    run.pipe_file(f"{work}/done.json", json.dumps({"status": "completed"}).encode())
    service.advance(batch_id)
    batch = service.get(OWNER, batch_id)
    assert batch.status == "failed" and batch.output_file_id is None
    assert "holds 1 lines, not the 2" in batch.errors.data[0].message
    assert [f.purpose for f in service.files.list(OWNER)] == ["batch"]  # no partial output left behind


def test_coverage_of_a_cancelled_run():
    from kvbatch.pipelines.batch_api import Part

    parts = [Part("part-00000000-00000002-00000002.jsonl", 0, 2, 2), Part("tail-00000005.jsonl", 5, 7, 2)]
    assert coverage_error(parts, 10, "cancelled") is None  # rows 2-4 never ran: a cancel keeps what finished
    assert "cancelled run's part" in coverage_error(parts, 10, "completed")


# --------------------------------------------------------------------------------------------
# `kvbatch serve` itself, its state on S3


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory, s3_endpoint):
    import uuid

    import s3fs

    from tests.test_serve import KEY_A, serve_tiny_model

    bucket = f"serve-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3_endpoint).mkdir(bucket)
    yield from serve_tiny_model(tmp_path_factory.mktemp("serve_s3"), KVBATCH_ROOT=f"s3://{bucket}/kvbatch",
                                KVBATCH_S3_ENDPOINT_URL=s3_endpoint, AWS_ACCESS_KEY_ID="testing",
                                AWS_SECRET_ACCESS_KEY="testing", KVBATCH_API_KEYS=KEY_A)


def _wait_done(client: openai.OpenAI, batch_id: str, seen: list, limit_s: float = 240):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        seen.append((b.status, b.request_counts.completed))
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} stuck: {seen[-1]}")


def _done_at(server, batch_id: str) -> float | None:
    """When the run wrote done.json (its LastModified on S3), read from outside the server."""
    import s3fs

    root = server.env["KVBATCH_ROOT"].removeprefix("s3://")
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=server.env["KVBATCH_S3_ENDPOINT_URL"],
                           skip_instance_cache=True)
    try:
        return fs.info(f"{root}/batch_api/work/{batch_id}/done.json")["LastModified"].timestamp()
    except FileNotFoundError:
        return None


@pytest.mark.slow
def test_serve_with_its_state_on_s3_runs_batches_to_the_end(s3_server, tmp_path):
    from tests.test_serve import KEY_A, _row

    client = s3_server.client(KEY_A)
    n = 24
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(_row(f"r{i}", content=f"Say {i}", max_tokens=24, ignore_eos=True)
                              for i in range(n)) + "\n")
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    seen: list = []
    batch = _wait_done(client, batch.id, seen)
    assert batch.status == "completed", (batch, s3_server.log.read_text()[-3000:])
    assert batch.request_counts.total == n and batch.request_counts.completed == n
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(n)]  # every row once, in order
    # Finalized within seconds of the run's last word (a stale listing left batches here for good).
    done_at = _done_at(s3_server, batch.id)
    assert done_at is not None and batch.completed_at - done_at < 15

    # A cancel ends cancelled, with the rows that finished.
    rows = [_row(f"c{i}", content=f"Count to {i}", max_tokens=48, ignore_eos=True) for i in range(400)]
    path.write_text("\n".join(rows) + "\n")
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    seen = []
    deadline = time.monotonic() + 240
    while client.batches.retrieve(batch.id).request_counts.completed == 0 and time.monotonic() < deadline:
        time.sleep(0.1)  # counts rise as parts commit (they froze at the first listing before)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = _wait_done(client, batch.id, seen)
    assert batch.status == "cancelled", batch
    done_at = _done_at(s3_server, batch.id)
    assert done_at is not None and batch.cancelled_at - done_at < 15
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    ids = [o["custom_id"] for o in out]
    assert 0 < len(ids) == batch.request_counts.completed < 400 and len(set(ids)) == len(ids)
    assert "Traceback" not in s3_server.log.read_text()


@pytest.mark.slow
def test_a_restarted_server_adopts_the_run_its_worker_is_still_doing(s3_server, tmp_path):
    """The server alone is killed (SIGKILL) mid-batch; its worker, in a session of its own, goes on.
    The restarted server follows that run to the end instead of launching a second one."""
    import signal

    import dagster as dg
    import s3fs
    from dagster._core.instance.ref import InstanceRef

    from tests.test_serve import KEY_A, _row

    client = s3_server.client(KEY_A)
    n = 96
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(_row(f"r{i}", content=f"Say {i}", max_tokens=2 if i < 8 else 64, ignore_eos=True)
                              for i in range(n)) + "\n")
    with open(path, "rb") as f:
        file_id = client.files.create(file=f, purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 240
    while client.batches.retrieve(batch.id).request_counts.completed == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    # The worker (and its decode) is paused while the server is down and while the restarted one
    # looks at the batch: alive and not finished, whatever this machine's speed. (Without the
    # pause a fast worker can finish first, and a server that relaunches every run it did not
    # start would pass too.) A second batch run to its end by the new server's own worker means
    # the driver has passed over the first one several times meanwhile.
    [worker] = s3_server._children()
    os.killpg(worker, signal.SIGSTOP)  # the worker leads a session of its own, its decode in it
    try:
        assert _done_at(s3_server, batch.id) is None, "the run finished before it was paused"
        os.killpg(s3_server.proc.pid, signal.SIGKILL)  # the server's own group: its worker is in another session
        s3_server.proc.wait()
        s3_server.start()
        client = s3_server.client(KEY_A)
        (tmp_path / "other.jsonl").write_text(_row("o0", max_tokens=2) + "\n")
        with open(tmp_path / "other.jsonl", "rb") as f:
            other = client.batches.create(input_file_id=client.files.create(file=f, purpose="batch").id,
                                          endpoint="/v1/chat/completions", completion_window="24h")
        assert _wait_done(client, other.id, []).status == "completed"
        assert client.batches.retrieve(batch.id).status == "in_progress", "the restarted server ran the batch again"
    finally:
        os.killpg(worker, signal.SIGCONT)
    seen: list = []
    batch = _wait_done(client, batch.id, seen)
    assert batch.status == "completed", (batch, s3_server.log.read_text()[-3000:])
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(n)]  # every row once, in order

    root = s3_server.env["KVBATCH_ROOT"].removeprefix("s3://")
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3_server.env["KVBATCH_S3_ENDPOINT_URL"],
                           skip_instance_cache=True)
    record = json.loads(fs.cat_file(f"{root}/batch_api/batches/{batch.id}.json"))
    assert record["attempts"] == 1  # adopted, not launched again
    done = json.loads(fs.cat_file(f"{root}/batch_api/work/{batch.id}/done.json"))
    assert done["resumed_from"] == 0 and done["rows"] == n  # one run did every row
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(s3_server.env["DAGSTER_HOME"]))
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"kvbatch/batch_id": batch.id}))
    assert len(runs) == 1


# --------------------------------------------------------------------------------------------
# Recovery paths of the driver, state on S3 (the run faked: its work folder written by the test)


def test_a_run_that_keeps_dying_is_retried_then_failed_with_the_reason(s3):
    service, launcher, batch_id, _ = _service(s3, rows=6)
    launcher.running = False  # the worker died without a word
    service.advance(batch_id)
    service.advance(batch_id)
    assert len(launcher.launched) == service.settings.max_attempts == 3  # each a new run, resuming
    assert service.get(OWNER, batch_id).status == "in_progress"
    service.advance(batch_id)
    batch = service.get(OWNER, batch_id)
    assert batch.status == "failed" and "stopped 3 times without finishing" in batch.errors.data[0].message


def test_cancel_while_validating_and_of_a_run_that_is_gone(s3):
    service, launcher, batch_id, _ = _service(s3, rows=4)
    queued = service.create(OWNER, CreateBatch(input_file_id=service.get(OWNER, batch_id).input_file_id,
                                               endpoint="/v1/chat/completions", completion_window="24h"))
    assert service.cancel(OWNER, queued.id).status == "cancelled"  # no run yet: nothing to stop
    service.advance(queued.id)
    assert len(launcher.launched) == 1  # and none is started for it
    assert service.cancel(OWNER, batch_id).status == "cancelling"
    launcher.running = False  # its run is gone before it read the cancel
    service.advance(batch_id)
    assert service.get(OWNER, batch_id).status == "cancelled"


def test_a_finalize_interrupted_is_finished_by_the_next_server(s3, monkeypatch):
    service, launcher, batch_id, run = _service(s3, rows=4)
    work = launcher.launched[0]
    _write_part(run, work, 0, 2)
    run.pipe_file(f"{work}/part-{2:08d}-{4:08d}-{0:08d}.jsonl",
                  b"".join(json.dumps({"id": f"e{i}", "custom_id": f"r{i}", "response": None,
                                       "error": {"code": "invalid_request", "message": "x"}}).encode() + b"\n"
                           for i in (2, 3)))
    run.pipe_file(f"{work}/done.json", json.dumps({"status": "completed"}).encode())
    real_write = service.files.write_output

    def dies_at_the_error_file(owner, filename, lines, **kw):
        if filename.endswith("_error.jsonl"):
            raise KeyboardInterrupt  # the server is killed between the two files
        return real_write(owner, filename, lines, **kw)

    monkeypatch.setattr(service.files, "write_output", dies_at_the_error_file)
    with pytest.raises(KeyboardInterrupt):
        service.advance(batch_id)
    assert service.get(OWNER, batch_id).status == "finalizing"

    settings = service.settings  # a new server over the same state
    store = StateStore(settings.state_url, settings.storage_options)
    files = FileService(store, settings)
    restarted = BatchService(store, files, FakeLauncher(), settings)
    restarted.advance(batch_id)
    batch = restarted.get(OWNER, batch_id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 2)
    outputs = [f.filename for f in files.list(OWNER, purpose="batch_output")]
    assert sorted(outputs) == [f"{batch_id}_error.jsonl", f"{batch_id}_output.jsonl"]  # none left twice


@pytest.mark.parametrize(("content", "reason"), [
    (b"custom_id,prompt\na,hello\n", "line 1 is malformed JSON"),
    (b'[{"custom_id": "a"}]\n', "line 1 is a JSON array, not an object"),
    (b"\n   \n", "every line is blank"),
])
def test_an_upload_that_is_not_jsonl_is_refused_and_nothing_is_kept(s3, content, reason):
    from kvbatch.serve.errors import ApiError

    url, opts, _ = s3
    settings = ServeSettings(root=url, storage_options=opts)
    files = FileService(StateStore(settings.state_url, opts), settings)
    with pytest.raises(ApiError) as exc:
        files.upload(OWNER, "table.csv", "batch", io.BytesIO(content))
    assert exc.value.status == 400 and exc.value.code == "invalid_file_format"
    assert "file is not JSONL" in exc.value.message and reason in exc.value.message
    assert files.list(OWNER) == [] and not _other_process_fs(opts).find(f"{url}/batch_api/files")
    ok = files.upload(OWNER, "in.jsonl", "batch", io.BytesIO(b'not json\n{"custom_id": "a"}\n'))  # a bad row is a row
    assert ok.bytes == 28
