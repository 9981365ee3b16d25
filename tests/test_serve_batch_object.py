"""The Batch object as OpenAI's (issue 42), through the official ``openai`` client against the app
in this process: ``usage`` summed over the answered rows, ``metadata`` under OpenAI's limits,
``output_expires_after`` (the output and error files expire, then 404), a batch past its
completion window ``expired``, and the batch's ``endpoint`` handed to its run.

The run is faked (the test writes the batch's work folder, as tests/test_serve_s3.py's driver
tests do) and time is an injected clock, so nothing here waits: a day passes in one assignment.
tests/test_serve.py runs the real server and decode for the row whose ``url`` is not the
batch's endpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from kvbatch.serve.app import create_app
from kvbatch.serve.auth import ANONYMOUS
from kvbatch.serve.batches import EXPIRED_MESSAGE, BatchService
from kvbatch.serve.files import FileService
from kvbatch.serve.objects import WINDOW_S
from kvbatch.serve.settings import ServeSettings
from kvbatch.serve.state import StateStore

T0 = 1_800_000_000
CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = float(T0)

    def __call__(self) -> float:
        return self.now


class RecordingLauncher:
    """Launches nothing (the test writes the run's work folder); keeps what each launch was given."""

    def __init__(self) -> None:
        self.launches: list[dict[str, Any]] = []

    def launch(self, batch_id: str, input_url: str, work_url: str, chunk_rows: int,
               endpoint: str | None = None) -> dict[str, Any]:
        self.launches.append({"batch_id": batch_id, "work_url": work_url, "endpoint": endpoint})
        return {"host": "test", "pid": len(self.launches)}

    def alive(self, handle: dict[str, Any] | None) -> bool:
        return True


class Api:
    def __init__(self, root: Path) -> None:
        from fastapi.testclient import TestClient

        self.clock = Clock()
        settings = ServeSettings(root=str(root))
        store = StateStore(settings.state_url)
        self.files = FileService(store, settings, clock=self.clock)
        self.launcher = RecordingLauncher()
        self.service = BatchService(store, self.files, self.launcher, settings)
        self.root = Path(settings.state_url)
        self.client = openai.OpenAI(api_key="anything", base_url="http://testserver/v1", max_retries=0,
                                    http_client=TestClient(create_app(self.files, self.service, keys=None)))

    def upload(self, rows: list[str]) -> str:
        return self.client.files.create(file=("in.jsonl", ("\n".join(rows) + "\n").encode()), purpose="batch").id

    def started(self, n: int, **create: Any) -> openai.types.Batch:
        """A batch of ``n`` chat rows ``r0..``, validated and launched."""
        file_id = self.upload([_row(f"r{i}") for i in range(n)])
        batch = self.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", **create)
        self.service.advance(batch.id)
        assert self.client.batches.retrieve(batch.id).status == "in_progress"
        return batch

    def work(self, batch_id: str) -> Path:
        return self.root / "work" / batch_id

    def write(self, batch_id: str, name: str, lines: list[dict]) -> None:
        work = self.work(batch_id)
        work.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("".join(json.dumps(x) + "\n" for x in lines))

    def finish(self, batch_id: str, lines: list[dict], status: str = "completed") -> openai.types.Batch:
        ok = sum(1 for x in lines if x["error"] is None)
        self.write(batch_id, f"part-{0:08d}-{len(lines):08d}-{ok:08d}.jsonl", lines)
        (self.work(batch_id) / "done.json").write_text(json.dumps({"status": status}))
        self.service.advance(batch_id)
        return self.client.batches.retrieve(batch_id)

    def content(self, file_id: str) -> list[dict]:
        return [json.loads(x) for x in self.client.files.content(file_id).text.splitlines()]


@pytest.fixture
def api(tmp_path) -> Api:
    return Api(tmp_path)


BODIES = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          "/v1/responses": {"input": "hi", "max_output_tokens": 2}, "/v1/completions": {"prompt": "hi", "max_tokens": 2}}


def _row(cid: str, url: str = CHAT) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": BODIES[url]})


def _chat_answer(cid: str, prompt: int, cached: int, completion: int) -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
    body = {"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "ok"}}], "usage": usage}
    return {"id": f"r-{cid}", "custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None}


def _completions_answer(cid: str, prompt: int, cached: int, completion: int) -> dict:
    line = _chat_answer(cid, prompt, cached, completion)
    line["response"]["body"].update(object="text_completion", choices=[{"index": 0, "text": "ok"}])
    return line


def _responses_answer(cid: str, prompt: int, cached: int, completion: int) -> dict:
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}
    body = {"object": "response", "output": [], "usage": usage}
    return {"id": f"r-{cid}", "custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None}


def _error(cid: str, line: int) -> dict:
    return {"id": f"e-{cid}", "custom_id": cid, "response": {"status_code": 400, "body": {}},
            "error": {"code": "invalid_request", "message": "bad", "line": line, "field": "body"}}


# -- usage


def test_usage_sums_the_answered_rows_of_every_endpoint_shape(api):
    batch = api.started(4)
    done = api.finish(batch.id, [_chat_answer("r0", 10, 4, 3), _error("r1", 2), _responses_answer("r2", 7, 2, 5),
                                 _completions_answer("r3", 1, 0, 1)])
    assert done.status == "completed"
    u = done.usage
    assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens) == (18, 6, 9)
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.total_tokens == 27  # input + output; the failed row counts nothing
    assert done.model_dump()["usage"] == {"input_tokens": 18, "input_tokens_details": {"cached_tokens": 6},
                                          "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 0},
                                          "total_tokens": 27}


def test_usage_is_null_until_the_batch_is_finalized(api):
    batch = api.started(2)
    assert api.client.batches.retrieve(batch.id).usage is None


# -- metadata


def test_metadata_at_openais_limits_is_stored_and_returned_on_retrieve_and_list(api):
    file_id = api.upload([_row("x")])
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # 16 pairs, 64-char keys, 512-char values
    batch = api.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                      metadata=metadata)
    assert batch.metadata == metadata
    assert api.client.batches.retrieve(batch.id).metadata == metadata
    assert [b.metadata for b in api.client.batches.list().data] == [metadata]
    restarted = BatchService(api.service.store, api.files, api.launcher, api.service.settings)  # a new server
    assert restarted.get(ANONYMOUS, batch.id).metadata == metadata


@pytest.mark.parametrize(("metadata", "message"), [
    ({f"k{i}": "v" for i in range(17)}, "metadata: at most 16 pairs, got 17"),
    ({"k" * 65: "v"}, f"metadata: key {'k' * 64!r}... is 65 characters; keys are at most 64"),
    ({"team": "v" * 513}, "metadata: the value of key 'team' is 513 characters; values are at most 512"),
    ({"team": 7}, "metadata.team: Input should be a valid string"),
])
def test_bad_metadata_is_a_400_naming_the_problem(api, metadata, message):
    file_id = api.upload([_row("x")])
    with pytest.raises(openai.BadRequestError) as exc:
        api.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata=metadata)
    assert exc.value.body["message"] == message
    assert exc.value.param.startswith("metadata")
    assert api.client.batches.list().data == []


# -- output_expires_after


@pytest.mark.parametrize(("value", "message"), [
    ({"anchor": "created_at", "seconds": 3599},
     "output_expires_after.seconds: must be between 3600 (1 hour) and 2592000 (30 days), got 3599"),
    ({"anchor": "created_at", "seconds": 2592001},
     "output_expires_after.seconds: must be between 3600 (1 hour) and 2592000 (30 days), got 2592001"),
    ({"anchor": "completed_at", "seconds": 3600}, "output_expires_after.anchor: Input should be 'created_at'"),
    ({"anchor": "created_at"}, "output_expires_after.seconds: Field required"),
])
def test_a_bad_output_expires_after_is_a_400_naming_it(api, value, message):
    file_id = api.upload([_row("x")])
    with pytest.raises(openai.BadRequestError) as exc:
        api.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                  output_expires_after=value)
    assert exc.value.body["message"] == message


def test_a_field_the_server_does_not_know_is_still_refused(api):
    file_id = api.upload([_row("x")])
    with pytest.raises(openai.BadRequestError) as exc:
        api.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                                  extra_body={"priority": "high"})
    assert exc.value.body["message"].startswith("priority: not supported by this server")
    assert exc.value.param == "priority"


@pytest.mark.parametrize("seconds", [3600, 2592000])
def test_output_and_error_files_expire_seconds_after_their_creation_then_404(api, seconds):
    batch = api.started(2, output_expires_after={"anchor": "created_at", "seconds": seconds})
    api.clock.now += 600  # the files are created at finalize: the anchor is their creation, not the batch's
    done = api.finish(batch.id, [_chat_answer("r0", 3, 0, 1), _error("r1", 2)])
    assert done.status == "completed"
    made = T0 + 600
    ids = (done.output_file_id, done.error_file_id)
    for file_id in ids:
        f = api.client.files.retrieve(file_id)
        assert (f.created_at, f.expires_at) == (made, made + seconds)
    api.clock.now = made + seconds - 1
    assert [x["custom_id"] for x in api.content(done.output_file_id)] == ["r0"]
    api.clock.now = made + seconds  # from expires_at on, the files are gone
    for file_id in ids:
        with pytest.raises(openai.NotFoundError):
            api.client.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            api.client.files.retrieve(file_id)
    assert not set(ids) & {f.id for f in api.client.files.list()}
    assert {p.name for p in (api.root / "files").iterdir()} >= {f"{i}.jsonl" for i in ids}  # not swept yet
    api.service.advance_all()  # the server's poll deletes them from the store
    assert not {p.name for p in (api.root / "files").iterdir()} & {f"{i}{e}" for i in ids for e in (".json", ".jsonl")}
    # The batch itself ended in time: it stays completed (OpenAI's does), naming files now gone.
    after = api.client.batches.retrieve(batch.id)
    assert after.status == "completed" and after.output_file_id == done.output_file_id


def test_without_output_expires_after_the_files_do_not_expire(api):
    batch = api.started(1)
    done = api.finish(batch.id, [_chat_answer("r0", 3, 0, 1)])
    assert api.client.files.retrieve(done.output_file_id).expires_at is None
    api.clock.now += 10 * 365 * 24 * 3600
    api.service.advance_all()
    assert [x["custom_id"] for x in api.content(done.output_file_id)] == ["r0"]


# -- a batch past its completion window


def test_a_batch_running_past_its_window_expires_keeping_what_ran(api):
    batch = api.started(6)
    assert (batch.created_at, batch.expires_at) == (T0, T0 + 24 * 3600)
    work = api.work(batch.id)
    api.write(batch.id, f"part-{0:08d}-{2:08d}-{1:08d}.jsonl", [_chat_answer("r0", 3, 1, 2), _error("r1", 2)])
    api.clock.now = T0 + WINDOW_S - 1
    api.service.advance(batch.id)
    assert not (work / "cancel").exists()
    api.clock.now = T0 + WINDOW_S
    api.service.advance(batch.id)
    assert (work / "cancel").exists()  # the run is told to stop
    assert api.client.batches.retrieve(batch.id).status == "in_progress"  # until it has
    api.write(batch.id, f"tail-{4:08d}.jsonl", [_chat_answer("r4", 3, 0, 2)])  # finished out of order
    (work / "done.json").write_text(json.dumps({"status": "cancelled"}))
    api.clock.now += 5
    api.service.advance(batch.id)
    done = api.client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at == T0 + WINDOW_S + 5
    assert done.cancelled_at is None and done.completed_at is None
    assert [x["custom_id"] for x in api.content(done.output_file_id)] == ["r0", "r4"]
    errors = api.content(done.error_file_id)
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [("r1", 2), ("r2", 3), ("r3", 4), ("r5", 6)]
    assert errors[1]["response"] is None
    assert errors[1]["error"] == {"code": "batch_expired", "message": EXPIRED_MESSAGE, "line": 3}
    assert EXPIRED_MESSAGE == "This request could not be executed before the completion window expired."
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (6, 2, 4)
    assert done.usage.input_tokens == 6 and done.usage.output_tokens == 4


def test_a_batch_still_validating_past_its_window_expires_without_a_run(api):
    file_id = api.upload([_row("a"), "not json", _row("c")])
    batch = api.client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    api.clock.now = T0 + WINDOW_S  # the server was down for the whole window
    api.service.advance(batch.id)
    done = api.client.batches.retrieve(batch.id)
    assert done.status == "expired" and api.launcher.launches == []
    assert done.output_file_id is None
    errors = api.content(done.error_file_id)
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        ("a", "batch_expired", 1), (None, "batch_expired", 2), ("c", "batch_expired", 3)]
    assert (done.request_counts.total, done.request_counts.failed) == (3, 3)


def test_a_batch_that_ends_in_time_or_is_cancelled_does_not_expire(api):
    finished = api.started(1)
    api.finish(finished.id, [_chat_answer("r0", 3, 0, 1)])
    cancelled = api.started(2)
    assert api.client.batches.cancel(cancelled.id).status == "cancelling"
    api.clock.now = T0 + WINDOW_S
    (api.work(cancelled.id) / "done.json").write_text(json.dumps({"status": "cancelled"}))
    api.service.advance_all()
    assert api.client.batches.retrieve(finished.id).status == "completed"
    assert api.client.batches.retrieve(cancelled.id).status == "cancelled"
    # A cancel sent while an expiry is stopping the run: the batch ends cancelled, as asked.
    late = api.started(2)
    api.clock.now = T0 + 2 * WINDOW_S
    api.service.advance(late.id)
    api.client.batches.cancel(late.id)
    (api.work(late.id) / "done.json").write_text(json.dumps({"status": "cancelled"}))
    api.service.advance(late.id)
    assert api.client.batches.retrieve(late.id).status == "cancelled"


# -- the batch's endpoint reaches its run


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/responses", "/v1/completions"])
def test_the_run_is_given_the_batchs_endpoint(api, endpoint):
    file_id = api.upload([_row("x", url=endpoint)])
    batch = api.client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")
    api.service.advance(batch.id)
    assert api.client.batches.retrieve(batch.id).status == "in_progress"
    assert [(x["batch_id"], x["endpoint"]) for x in api.launcher.launches] == [(batch.id, endpoint)]


def test_the_worker_puts_the_endpoint_in_the_runs_config(monkeypatch):
    from kvbatch.serve import worker

    seen: dict[str, Any] = {}

    class Job:
        def execute_in_process(self, run_config, **kw):
            seen.update(run_config["ops"]["batch_api_run"]["config"])
            return type("R", (), {"success": True})()

    class Defs:
        def get_job_def(self, name):
            return Job()

    class Instance:
        def get_runs(self, filters):
            return []

    import sys
    import types

    fake = types.ModuleType("kvbatch.pipelines.definitions")  # the real one loads every pipeline
    fake.defs = Defs()
    monkeypatch.setitem(sys.modules, "kvbatch.pipelines.definitions", fake)
    assert worker.run_one(Instance(), {"batch_id": "b", "input_url": "i", "work_url": "w", "chunk_rows": 8,
                                       "endpoint": "/v1/responses"})
    assert seen["endpoint"] == "/v1/responses"
