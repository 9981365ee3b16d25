"""`kvbatch serve` end to end with the official `openai` client on loopback: one server (a real
process, a tiny seeded chat model, state on a local KVBATCH_ROOT, runs in a DAGSTER_HOME
instance) for the module; upload, create, poll, download; bad lines in the error file; outputs
equal to `kvbatch generate`; limits; auth and per-key isolation; cancel; restart mid-batch."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvbatch.cli.main import main
from tests.tiny_models import build_tiny_chat_model

KEY_A = "sk-test-alpha-5f1c9e"  # given in plain
KEY_B = "sk-test-bravo-93ab07"  # given by its hash only
WAIT_S = 240  # generous: the machine is shared; a test fails on status, never on speed


# The line `kvbatch serve` prints once it listens: the address it bound (it is started on port 0).
SERVING = re.compile(rb"kvbatch: serving the Files and Batches API on http://127\.0\.0\.1:(\d+)/v1 ")


class Server:
    """`kvbatch serve` as a process of its own (and of its own process group), on a port the OS
    picks (`--port 0`): each start reads the port bound from the server's own line in its log."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log
        self.port: int | None = None  # known once the server says it listens
        self._log_from = 0  # the log's size at the last spawn: a restart's line is after it
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        assert self.port is not None, "the server has not said which port it bound"
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        self.port = None
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvbatch.cli.main", "serve", "--port", "0", "--chunk-rows", "8",
                 "--max-requests", "700", "--max-file-mb", "1"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            if self.port is None:
                said = SERVING.search(self.log.read_bytes()[self._log_from:])
                if said is None:
                    time.sleep(0.2)
                    continue
                self.port = int(said[1])
                assert self.port > 0, f"the server named the port it was asked for, not the one bound: {said[0]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"server did not come up: {self.log.read_text()[-3000:]}")

    def _children(self) -> list[int]:
        assert self.proc is not None
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:  # field 4 of /proc/PID/stat: the parent's pid
                pids.append(int(stat.parent.name))
        return pids

    def kill_all(self) -> None:
        """SIGKILL the server and the batch worker it started (in a session of its own), as a
        machine crash would."""
        assert self.proc is not None
        for pid in self._children():
            os.kill(pid, signal.SIGKILL)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill_all()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(api_key=key, base_url=self.base_url, max_retries=0, timeout=60)


def serve_tiny_model(base: Path, **env: str) -> Iterator[Server]:
    """`kvbatch serve` over a tiny chat model under ``base`` (its Dagster home, model folder and
    log there), with ``env`` on top of this process's environment; stopped on leaving."""
    (base / "dagster_home").mkdir()
    model = base / "tiny_chat"
    model.mkdir()
    srv = Server(dict(os.environ, KVBATCH_MODEL=str(model), DAGSTER_HOME=str(base / "dagster_home"),
                      HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **env), base / "server.log")
    srv.spawn()  # the server and its worker import while the model is built (the worker loads it per batch)
    try:
        build_tiny_chat_model(model, max_positions=128)
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve")
    yield from serve_tiny_model(base, KVBATCH_ROOT=str(base / "root"), KVBATCH_API_KEYS=f"{KEY_A}, sha256:"
                                + hashlib.sha256(KEY_B.encode()).hexdigest())


@pytest.fixture(scope="module")
def tiny_chat(server) -> Path:
    return Path(server.env["KVBATCH_MODEL"])


def _row(cid: str, content: str = "Hello there", **body) -> str:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _upload(client: openai.OpenAI, path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, until) -> openai.types.Batch:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} stuck at {b.status} {b.request_counts}")


def _done(b) -> bool:
    return b.status in ("completed", "failed", "cancelled", "expired")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def _without_created(line: dict) -> dict:
    line = json.loads(json.dumps(line))
    body = line["response"]["body"]
    body.pop("created", None)
    body.get("usage", {}).pop("prompt_tokens_details", None)
    return line


@pytest.mark.slow
def test_a_batch_runs_to_completion_like_generate(server, tiny_chat, tmp_path):
    client = server.client(KEY_A)
    system = {"role": "system", "content": "You answer briefly. " * 4}
    lines = [
        _row("a"),
        '{"custom_id": "broken", ',                                               # malformed JSON
        _row("b", temperature=-1),                                                 # bad sampling value
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [system, {"role": "user", "content": "What is up?"}], "max_tokens": 5,
                             "temperature": 0}}),
        _row("a"),                                                                 # duplicate custom_id
        json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [system, {"role": "user", "content": "And now?"}], "max_tokens": 5,
                             "temperature": 0}}),
        _row("e", temperature=0.8, seed=7),
        _row("f", content="Tell me more"),
    ]
    input_path = tmp_path / "in.jsonl"
    file_id = _upload(client, input_path, lines)
    assert client.files.retrieve(file_id).bytes == input_path.stat().st_size
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"team": "search"})
    assert batch.status == "validating" and batch.request_counts.total == 0  # counted once validated
    batch = _wait(client, batch.id, _done)

    assert batch.status == "completed", batch
    assert batch.request_counts.total == len(lines)
    assert batch.metadata == {"team": "search"}
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 3)
    for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "expires_at"):
        assert getattr(batch, stamp) is not None, stamp
    out, err = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
    assert [o["custom_id"] for o in out] == ["a", "c", "d", "e", "f"]  # input order
    assert len(out) + len(err) == len(lines)  # one line per input line
    reasons = {(e["error"]["line"], e["error"]["field"]): e["error"]["message"] for e in err}
    assert set(reasons) == {(2, "$"), (3, "body.temperature"), (5, "custom_id")}
    assert "malformed JSON" in reasons[(2, "$")] and "duplicate of line 1" in reasons[(5, "custom_id")]
    cached = [o["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for o in out]
    prompt = [o["response"]["body"]["usage"]["prompt_tokens"] for o in out]
    # Rows share their first prompt block (the template's opening, a system prompt): a row admitted
    # after another's prefill finds it in the prefix cache, and its usage says so.
    assert all(0 <= c <= p for c, p in zip(cached, prompt, strict=True)) and max(cached) > 0
    assert batch.usage.input_tokens == sum(prompt)
    assert batch.usage.input_tokens_details.cached_tokens == sum(cached)
    completion = [o["response"]["body"]["usage"]["completion_tokens"] for o in out]
    assert batch.usage.output_tokens == sum(completion) > 0
    assert batch.usage.output_tokens_details.reasoning_tokens == 0
    assert batch.usage.total_tokens == sum(prompt) + sum(completion)

    # The same file through `kvbatch generate` with the same model: the same lines.
    gen = tmp_path / "gen.jsonl"
    main(["generate", "--model", str(tiny_chat), "--input", str(input_path), "--output", str(gen),
          "--no-progress"])
    expected = [json.loads(x) for x in gen.read_text().splitlines()]
    assert [_without_created(o) for o in out] == [_without_created(g) for g in expected if g["error"] is None]
    assert err == [g for g in expected if g["error"] is not None]

    assert batch.output_file_id in {f.id for f in client.files.list()}
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


SCHEMAS = {
    "label": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
              "required": ["label"], "additionalProperties": False},
    "stars": {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                               "ok": {"type": "boolean"}},
              "required": ["stars", "ok"], "additionalProperties": False},
}


def _schema_format(name: str, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": strict, "schema": SCHEMAS[name]}}


@pytest.mark.slow
def test_response_format_json_schema_through_the_official_client(server, tmp_path):
    """A batch written for OpenAI with ``response_format`` (json_schema strict and not, greedy and
    seeded, json_object, text) answers schema-valid JSON in ``choices[0].message.content``; a schema
    the grammar engine cannot compile is that row's 400 in the error file, naming the field."""
    import jsonschema

    client = server.client(KEY_A)
    lines = [
        _row("label", content="Classify: great food", max_tokens=40, response_format=_schema_format("label")),
        _row("stars", content="Rate it", max_tokens=40, temperature=1.0, seed=5,
             response_format=_schema_format("stars", strict=False)),
        _row("free", content="Rate it"),
        _row("obj", content="Any object", max_tokens=40, response_format={"type": "json_object"}),
        _row("text", content="Plain", response_format={"type": "text"}),
        _row("bad", response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}}),
    ]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path / "in.jsonl", lines),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = _wait(client, batch.id, _done)
    assert batch.status == "completed", batch
    out = {o["custom_id"]: o["response"]["body"]["choices"][0] for o in _lines(client, batch.output_file_id)}
    assert list(out) == ["label", "stars", "free", "obj", "text"]
    for cid in ("label", "stars"):
        assert out[cid]["finish_reason"] == "stop", out[cid]
        jsonschema.validate(json.loads(out[cid]["message"]["content"]), SCHEMAS[cid])
    # A random model may wander inside a JSON string until max_tokens; under the grammar it still
    # opens an object, and one that ends is one.
    obj = out["obj"]
    assert obj["message"]["content"].startswith("{")
    assert obj["finish_reason"] == "length" or isinstance(json.loads(obj["message"]["content"]), dict)
    (err,) = _lines(client, batch.error_file_id)
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["error"]["field"] == "body.response_format.json_schema.schema"
    assert "the JSON schema cannot be compiled" in err["error"]["message"] and "nope" in err["error"]["message"]


@pytest.mark.slow
def test_each_refused_request_field_is_a_400_naming_it(server, tmp_path):
    """Every field docs/batch-api.md's table marks refused, sent through a batch with the official
    client: that row is a 400 in the error file whose field and message name it, never an answer
    that ignored it; a row carrying every ignored field is answered."""
    from tests.test_batch_io import IGNORED_SAMPLES, REFUSED_SAMPLES, request_field_table

    table = request_field_table()
    refused = [name for name, kind in table.items() if kind == "refused"]
    client = server.client(KEY_A)
    lines = [_row(f"refused-{name}", **{name: REFUSED_SAMPLES[name]}) for name in refused]
    lines += [_row("ignored", **IGNORED_SAMPLES), _row("functions-auto", functions=REFUSED_SAMPLES["functions"],
                                                        function_call="auto")]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path / "in.jsonl", lines),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = _wait(client, batch.id, _done)
    assert batch.status == "completed", batch
    assert [o["custom_id"] for o in _lines(client, batch.output_file_id)] == ["ignored"]
    errors = {e["custom_id"]: e for e in _lines(client, batch.error_file_id)}
    assert list(errors) == [f"refused-{name}" for name in refused] + ["functions-auto"]
    for name in refused:
        e = errors[f"refused-{name}"]
        assert e["response"]["status_code"] == 400 and e["error"]["field"] == f"body.{name}"
        assert f"body.{name}: " in e["error"]["message"]
    both = errors["functions-auto"]["error"]["message"]  # every reason, not "(and 1 more)"
    assert "body.functions: function calling" in both and "body.function_call: function calling" in both


@pytest.mark.slow
def test_a_row_whose_url_is_not_the_batchs_endpoint_is_its_400(server, tmp_path):
    """Every row of a batch must be for the batch's endpoint (OpenAI's rule): a `/v1/completions`
    row in a chat batch, or a chat row in a `/v1/completions` batch, is that row's 400 in the error
    file, field `url`, naming both; the batch's other rows are answered."""
    client = server.client(KEY_A)
    other = json.dumps({"custom_id": "other", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "Hello", "max_tokens": 3}})
    for endpoint, rows, answered, refused in [
            ("/v1/chat/completions", [_row("chat"), other], "chat", ("other", "/v1/completions")),
            ("/v1/completions", [_row("chat"), other], "other", ("chat", "/v1/chat/completions"))]:
        batch = client.batches.create(input_file_id=_upload(client, tmp_path / "in.jsonl", rows), endpoint=endpoint,
                                      completion_window="24h")
        batch = _wait(client, batch.id, _done)
        assert batch.status == "completed", batch
        assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
        assert [o["custom_id"] for o in _lines(client, batch.output_file_id)] == [answered]
        (err,) = _lines(client, batch.error_file_id)
        cid, url = refused
        assert err["custom_id"] == cid and err["response"]["status_code"] == 400
        assert err["error"]["field"] == "url"
        line = rows.index(next(r for r in rows if json.loads(r)["custom_id"] == cid)) + 1
        assert err["error"]["message"] == f"line {line}: url: the batch's endpoint is {endpoint}; this row's url is {url}"


@pytest.mark.slow
def test_limits_and_bad_requests_are_clear_400s(server, tmp_path):
    client = server.client(KEY_A)
    with pytest.raises(openai.BadRequestError, match="701 requests; the limit is 700"):
        _upload(client, tmp_path / "many.jsonl", [_row(f"r{i}") for i in range(701)])
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * ((1 << 20) + 10))
    with open(big, "rb") as f, pytest.raises(openai.BadRequestError, match="larger than the limit of 1 MB"):
        client.files.create(file=f, purpose="batch")
    huge = tmp_path / "huge.jsonl"  # over the limit by more than the form's overhead: refused unread
    huge.write_bytes(b"x" * ((2 << 20) + (256 << 10)))
    with open(huge, "rb") as f, pytest.raises(openai.BadRequestError,
                                              match=r"an upload of \d+ bytes is larger than the limit of 1 MB"):
        client.files.create(file=f, purpose="batch")
    with open(big, "rb") as f, pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=f, purpose="fine-tune")
    file_id = _upload(client, tmp_path / "one.jsonl", [_row("x")])
    with pytest.raises(openai.BadRequestError, match="endpoint: must be one of"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="limit must be between 1 and 100"):
        client.batches.list(limit=101)
    with pytest.raises(openai.BadRequestError, match="priority: not supported by this server") as exc:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              extra_body={"priority": "high"})
    assert exc.value.param == "priority"
    with pytest.raises(openai.BadRequestError, match="at most 16 pairs"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={f"k{i}": "v" for i in range(17)})
    # A file that is not JSONL is refused at upload, with the reason.
    with pytest.raises(openai.BadRequestError, match="not JSONL.*line 1 is malformed JSON"):
        _upload(client, tmp_path / "table.csv", ["custom_id,prompt", "a,hello"])
    with pytest.raises(openai.BadRequestError, match="line 1 is a JSON array, not an object"):
        _upload(client, tmp_path / "array.jsonl", ['[{"custom_id": "a"}]'])
    # JSONL with no request in it at all does not validate: the batch fails with the reasons.
    no_requests = _upload(client, tmp_path / "objects.jsonl", ['{"prompt": "hello"}', '{"prompt": "bye"}'])
    batch = client.batches.create(input_file_id=no_requests, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = _wait(client, batch.id, _done)
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    assert [(e.line, e.code) for e in batch.errors.data] == [(1, "invalid_request"), (2, "invalid_request")]
    assert "custom_id" in batch.errors.data[0].message

    # Nothing of a refused upload is kept: every stored name is a record or the content of a listed file.
    known = {f.id for c in (client, server.client(KEY_B)) for f in c.files.list()}
    stored = {p.name for p in (Path(server.env["KVBATCH_ROOT"]) / "batch_api" / "files").iterdir()}
    assert stored == {f"{i}{ext}" for i in known for ext in (".json", ".jsonl")}


@pytest.mark.slow
def test_auth_and_per_key_isolation(server, tmp_path):
    a, b = server.client(KEY_A), server.client(KEY_B)
    with pytest.raises(openai.AuthenticationError) as exc:
        server.client("sk-wrong-key-123").batches.list()
    assert "sk-wrong-key-123" not in str(exc.value)
    with pytest.raises(urllib.error.HTTPError) as no_key:  # no Authorization header at all
        urllib.request.urlopen(f"{server.base_url}/files", timeout=30)
    assert no_key.value.code == 401
    file_id = _upload(a, tmp_path / "in.jsonl", [_row("x")])
    first = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    second = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.cancel(first.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(file_id)
    with pytest.raises(openai.NotFoundError):  # nor may B start a batch over A's file
        b.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert not {first.id, second.id} & {x.id for x in b.batches.list().data}
    assert file_id not in {f.id for f in b.files.list()}

    # Newest first, paged with limit and after.
    page = a.batches.list(limit=1)
    assert [x.id for x in page.data] == [second.id] and page.has_more
    assert [x.id for x in a.batches.list(limit=1, after=second.id).data] == [first.id]
    for batch in (first, second):
        done = _wait(a, batch.id, _done)
        assert done.status == "completed"
    with pytest.raises(openai.ConflictError, match="only a batch that has not ended can be cancelled"):
        a.batches.cancel(first.id)
    outputs = {f.id for f in a.files.list(purpose="batch_output")}
    assert done.output_file_id in outputs and file_id not in outputs


@pytest.mark.slow
def test_the_docs_five_lines_run_a_batch(server, tmp_path, monkeypatch, capsys):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "batch-api.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert code.count("\n") <= 9  # the five lines, their imports and the poll loop's body
    code = code.replace("http://127.0.0.1:8000/v1", server.base_url).replace("sk-my-key", KEY_A)
    (tmp_path / "requests.jsonl").write_text("\n".join([_row("one"), _row("two", content="Bye")]) + "\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/batch-api.md", "exec"), {})  # noqa: S102 - the docs' example, run as written
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert [p["custom_id"] for p in printed] == ["one", "two"]


@pytest.mark.slow
def test_cancel_stops_the_run_and_keeps_finished_rows(server, tmp_path):
    client = server.client(KEY_B)
    n = 600
    rows = [_row(f"r{i}", content=f"Count to {i}", max_tokens=48, ignore_eos=True) for i in range(n)]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path / "in.jsonl", rows),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    _wait(client, batch.id, lambda b: b.request_counts.completed > 0 or _done(b))
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = _wait(client, batch.id, _done)
    assert batch.status == "cancelled" and batch.cancelled_at is not None and batch.cancelling_at is not None
    out = _lines(client, batch.output_file_id)
    assert 0 < len(out) == batch.request_counts.completed < n
    ids = [o["custom_id"] for o in out]
    assert len(set(ids)) == len(ids) and set(ids) <= {f"r{i}" for i in range(n)}


def _records(server: Server) -> dict[str, dict]:
    folder = Path(server.env["KVBATCH_ROOT"]) / "batch_api" / "batches"
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


@pytest.mark.slow
def test_one_warm_worker_runs_the_batches_without_the_keys(server):
    """Every batch so far ran on the worker the server started with; its environment has no key."""
    pids = {r["worker"]["pid"] for r in _records(server).values() if r["worker"]}
    assert len(pids) == 1 and len(_records(server)) >= 3
    environ = Path(f"/proc/{pids.pop()}/environ").read_bytes()
    assert b"KVBATCH_API_KEYS" not in environ and KEY_A.encode() not in environ


@pytest.mark.slow
def test_restart_mid_batch_then_the_batch_completes(server, tmp_path):
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    client = server.client(KEY_A)
    # The first part (8 short rows) is committed at once; the long rows keep the run busy for two
    # waves of the engine's 64 sequences, so the kill always lands mid-batch.
    n = 128
    rows = [_row(f"r{i}", content=f"Say {i}", max_tokens=2 if i < 8 else 80, ignore_eos=True) for i in range(n)]
    batch = client.batches.create(input_file_id=_upload(client, tmp_path / "in.jsonl", rows),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    work = Path(server.env["KVBATCH_ROOT"]) / "batch_api" / "work" / batch.id
    deadline = time.monotonic() + WAIT_S
    while not list(work.glob("part-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    files_before = client.files.list().model_dump()["data"]
    batches_before = {b.id: b for b in client.batches.list(limit=100).data if b.id != batch.id}
    server.kill_all()  # the server and the batch's run die together, as on a machine crash
    server.start()
    client = server.client(KEY_A)
    # The same files and batches (and, if the batch has finished already, its own output files).
    files_after = [f for f in client.files.list().model_dump()["data"] if not f["filename"].startswith(batch.id)]
    assert files_after == files_before
    assert {b.id: b for b in client.batches.list(limit=100).data if b.id != batch.id} == batches_before
    assert client.batches.retrieve(batch.id).status in ("in_progress", "finalizing", "completed")
    batch = _wait(client, batch.id, _done)
    assert batch.status == "completed"
    assert batch.request_counts.completed == n and batch.request_counts.failed == 0
    out = _lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(n)]  # every row once, in order
    assert json.loads((work / "done.json").read_text())["resumed_from"] >= 8  # not started over

    # Both runs are in the Dagster instance: the dead one marked failed, the resumed one succeeded.
    # The batch reads completed once its output is written; the run's own end is recorded a moment
    # later, when its step returns (a fresh-clone CI once saw it still STARTED): wait for it, bounded.
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(server.env["DAGSTER_HOME"]))
    deadline = time.monotonic() + WAIT_S
    while True:
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"kvbatch/batch_id": batch.id}))
        if all(r.is_finished for r in runs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(r.status.value for r in runs) == ["FAILURE", "SUCCESS"]
    assert {r.job_name for r in runs} == {"kvbatch_batch_api"}
    ok = next(r for r in runs if r.status.value == "SUCCESS")
    outputs = instance.all_logs(ok.run_id, of_type=dg.DagsterEventType.STEP_OUTPUT)
    metadata = outputs[0].dagster_event.event_specific_data.metadata
    assert metadata["requests_succeeded"].value == n and metadata["resumed_from_row"].value > 0


@pytest.mark.slow
def test_keys_never_reach_state_logs_or_runs(server):
    """After every test above: no key in the server's log, its state files or the Dagster instance."""
    roots = [Path(server.env["KVBATCH_ROOT"]), Path(server.env["DAGSTER_HOME"]), server.log]
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert KEY_A.encode() not in data and KEY_B.encode() not in data, path


def test_serve_refuses_to_start_without_keys(monkeypatch, capsys):
    monkeypatch.delenv("KVBATCH_API_KEYS", raising=False)
    assert main(["serve", "--port", "1"]) == 2
    assert "--insecure-no-auth" in capsys.readouterr().err
    monkeypatch.setenv("KVBATCH_API_KEYS", "sha256:not-hex")
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "entry 1" in err and "not-hex" not in err


def test_serve_refuses_a_port_it_cannot_listen_on_saying_which(monkeypatch, capsys):
    """Every server above runs on `--port 0` and reads the port from its line (Server.wait_ready);
    a port in use, or out of range, is refused before any batch is touched."""
    monkeypatch.setenv("KVBATCH_API_KEYS", KEY_A)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port must be in 0..65535 (0: any free port), got 70000" in capsys.readouterr().err


def test_api_keys_by_value_or_hash_and_owner_tags():
    from kvbatch.serve.auth import ApiKeys, owner_tag

    keys = ApiKeys.parse(f" {KEY_A} ,, sha256:{hashlib.sha256(KEY_B.encode()).hexdigest().upper()}")
    a, b = keys.owner_of(KEY_A), keys.owner_of(KEY_B)
    assert a and b and a != b and keys.owner_of("sk-other") is None
    assert a == owner_tag(hashlib.sha256(KEY_A.encode()).hexdigest())
    assert KEY_A not in a and hashlib.sha256(KEY_A.encode()).hexdigest() not in a


def test_insecure_no_auth_serves_everyone_as_one_owner(tmp_path):
    from fastapi.testclient import TestClient

    from kvbatch.serve.app import create_app
    from kvbatch.serve.batches import BatchService
    from kvbatch.serve.files import FileService
    from kvbatch.serve.server import api_keys
    from kvbatch.serve.settings import ServeSettings
    from kvbatch.serve.state import StateStore

    assert api_keys(None, insecure_no_auth=True) is None
    settings = ServeSettings(root=str(tmp_path))
    store = StateStore(settings.state_url)
    files = FileService(store, settings)
    app = create_app(files, BatchService(store, files, launcher=None, settings=settings), keys=None)
    with TestClient(app) as http:
        up = http.post("/v1/files", files={"file": ("in.jsonl", _row("x").encode())}, data={"purpose": "batch"})
        assert up.status_code == 200, up.text
        listed = http.get("/v1/files", headers={"Authorization": "Bearer anything"}).json()["data"]
        assert [f["id"] for f in listed] == [up.json()["id"]]
