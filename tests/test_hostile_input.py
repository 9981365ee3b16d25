"""Hostile input at `kvbatch generate`, `generate --workers N` and `kvbatch prefill` (issue 19,
items 2, 4, 7, 8, 9, 10): each case through the CLI entry point. No bad byte loses a batch, an
unusable input or output fails before the model loads and names itself, the output names the
model that ran, every input line has its output line, and SIGINT / SIGTERM / SIGKILL leave
nothing behind for long. Plus hypothesis fuzzing of the JSONL reader: any bytes in, never a
traceback, every line accounted for."""

from __future__ import annotations

import gzip
import json
import random
import selectors
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.cli.main import main
from kvbatch.io.batch_output import _encode, _host, error_line
from kvbatch.io.batch_requests import ChatRequest, InputStreamError, RejectedRow, read_requests
from tests.tiny_models import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_positions=256)


def _row(cid: str, content: str = "Hello there", **body) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _jsonl(lines) -> bytes:
    return b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _generate(model, src, out, *extra) -> int:
    return main(["generate", "--model", str(model), "--input", str(src), "--output", str(out), "--no-progress",
                 *extra])


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


# ------------------------------------------------------------------ item 2: bad bytes, broken streams


def test_huge_integer_is_a_rejected_row(tiny_chat, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl([_row("a"), '{"custom_id": "x", "body": {"seed": ' + "9" * 5000 + "}}", _row("b")]))
    out = tmp_path / "out.jsonl"
    assert _generate(tiny_chat, src, out) == 1
    rows = _read(out)
    assert [r["custom_id"] for r in rows] == ["a", None, "b"]
    assert rows[0]["error"] is None and rows[2]["error"] is None
    assert rows[1]["error"]["line"] == 2 and rows[1]["error"]["field"] == "$"
    assert "digits" in rows[1]["error"]["message"]


def _truncated(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def _corrupted(data: bytes) -> bytes:
    at = len(data) * 3 // 4
    return data[:at] + bytes(b ^ 0x5A for b in data[at: at + 16]) + data[at + 16:]


@pytest.mark.parametrize("damage", [_truncated, _corrupted], ids=["truncated", "corrupt"])
def test_broken_gzip_answers_every_row_read_before_the_break(tiny_chat, tmp_path, capsys, damage):
    # Incompressible padding (an ignored field), so the damage lands well past gzip's first
    # read buffer (8 KiB) and some rows come out before the break.
    lines = [_row(f"r{i}", content=f"question {i}", max_tokens=1, metadata={"pad": random.Random(i).randbytes(512).hex()})
             for i in range(40)]
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(damage(gzip.compress(_jsonl(lines), mtime=0)))
    out = tmp_path / "out.jsonl"
    code = _generate(tiny_chat, src, out)
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2
    assert len(err) == 1 and str(src) in err[0] and "cannot read" in err[0]
    rows = _read(out)
    answered, marker = rows[:-1], rows[-1]
    assert 0 < len(answered) <= len(lines)  # a bad CRC is found only at the end of the stream
    # Every line read before the break is answered, in order (a corrupt block may yield garbage
    # lines first: rejected rows like any other), and the last line says where the input ended.
    ok = [int(r["custom_id"][1:]) for r in answered if r["error"] is None]
    assert ok and ok[0] == 0 and ok == sorted(set(ok))
    assert marker["custom_id"] is None and marker["error"]["line"] == len(answered) + 1
    assert "input ends here" in marker["error"]["message"]
    assert _temps(tmp_path) == []


# ------------------------------------------------------------------ items 4 and 10: fail before the model loads


def _unusable_paths(tmp: Path) -> tuple[Path, Path, Path, Path]:
    """(a good input, a .gz that is not gzip, a directory, a plain file) for the fail-first cases
    of generate and prefill."""
    good = tmp / "in.jsonl"
    good.write_bytes(_jsonl([_row("a")]))
    notgz = tmp / "plain.jsonl.gz"
    notgz.write_bytes(_jsonl([_row("a")]))
    folder = tmp / "folder"
    folder.mkdir()
    a_file = tmp / "a_file"
    a_file.write_text("x")
    return good, notgz, folder, a_file


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    good, notgz, folder, a_file = _unusable_paths(tmp)
    out = str(tmp / "out.jsonl")
    return {
        "input missing": (["--input", str(tmp / "nope.jsonl"), "--output", out], "nope.jsonl"),
        "input is a directory": (["--input", str(folder), "--output", out], "is a directory"),
        "input not gzip": (["--input", str(notgz), "--output", out], "gzip"),
        "output is a directory": (["--input", str(good), "--output", str(folder)], "is a directory"),
        "output under a file": (["--input", str(good), "--output", str(a_file / "o.jsonl")], "a_file/o.jsonl"),
        "metrics under a file": (["--input", str(good), "--output", out, "--metrics", str(a_file / "m.json")],
                                 "a_file/m.json"),
        "errors is a directory": (["--input", str(good), "--output", out, "--errors", str(folder)],
                                  "is a directory"),
        "errors is the output": (["--input", str(good), "--output", out, "--errors", out], "same path"),
    }


@pytest.mark.parametrize("case", ["input missing", "input is a directory", "input not gzip", "output is a directory",
                                  "output under a file", "metrics under a file", "errors is a directory",
                                  "errors is the output"])
def test_unusable_input_or_output_fails_before_the_model_loads(tmp_path, capsys, case):
    """The model named here does not exist: if the input and outputs were not checked first,
    the error would be about the model (or, before, a traceback after the whole batch)."""
    args, expected = _cases(tmp_path)[case]
    code = main(["generate", "--model", str(tmp_path / "no-such-model"), "--no-progress", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and expected in err[0] and "no-such-model" not in err[0], err
    assert not (tmp_path / "out.jsonl").exists() and _temps(tmp_path) == []


# ------------------------------------------------------------------ item 7: the model that ran


def test_output_names_the_model_that_ran(tiny_chat, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl([_row("a", model="gpt-4o"), _row("b", model="gpt-4o"), _row("c")]))
    out = tmp_path / "out.jsonl"
    assert _generate(tiny_chat, src, out) == 0
    assert {r["response"]["body"]["model"] for r in _read(out)} == {str(tiny_chat)}
    warnings = [line for line in capsys.readouterr().err.splitlines() if "gpt-4o" in line]
    assert len(warnings) == 1 and "warning" in warnings[0]


# ------------------------------------------------------------------ item 8: every line accounted for


def test_blank_lines_are_answered_and_unknown_fields_warned_once(tiny_chat, tmp_path, capsys):
    lines = [_row("a"), b"", b"  \t\r", _row("b", max_token=3, temprature=0), _row("c", max_token=2)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(lines))
    out = tmp_path / "out.jsonl"
    assert _generate(tiny_chat, src, out) == 1
    rows = _read(out)
    assert len(rows) == len(lines)
    assert [r["custom_id"] for r in rows] == ["a", None, None, "b", "c"]
    assert [(r["error"]["line"], r["error"]["field"]) for r in rows if r["error"]] == [(2, "$"), (3, "$")]
    assert all("blank line" in r["error"]["message"] for r in rows if r["error"])
    err = capsys.readouterr().err.splitlines()
    assert len([x for x in err if "'body.max_token'" in x]) == 1
    assert len([x for x in err if "'body.temprature'" in x]) == 1

    strict_out = tmp_path / "strict.jsonl"
    assert _generate(tiny_chat, src, strict_out, "--strict") == 1
    strict = _read(strict_out)
    assert strict[3]["error"]["field"] == "body.max_token" and strict[4]["error"]["field"] == "body.max_token"
    assert strict[0]["error"] is None


# ------------------------------------------------------------------ item 9: signals and stale temp files


def _start(tiny_chat: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A generate run with plenty to do, returned once it says it is generating."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl([_row(f"r{i}", content=f"tell me about {i}", max_tokens=200, ignore_eos=True)
                            for i in range(64)]))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvbatch.cli.main", "generate", "--model", str(tiny_chat),
                             "--input", str(src), "--output", str(out), "--no-progress", "--max-batch", "2"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    seen = b""
    for _ in range(200):  # bounded: each wait is at most 120 s, and a run prints a few lines
        if not sel.select(timeout=120):
            break
        line = proc.stderr.readline()
        seen += line
        if not line or b"generating" in line:
            break
    sel.close()
    if b"generating" not in seen:
        proc.kill()
        proc.wait()
        pytest.fail(f"generate never started: {seen.decode(errors='replace')}")
    return proc, out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_exits_cleanly_in_one_line(tiny_chat, tmp_path, signum):
    proc, out = _start(tiny_chat, tmp_path)
    proc.send_signal(signum)
    _, rest = proc.communicate(timeout=120)
    rest = rest.decode()
    assert proc.returncode == 128 + signum, rest
    # One line for the signal; warnings about rows read before it (such as the model a row names)
    # may come first, since rows are read as the run goes.
    lines = [ln for ln in rest.strip().splitlines() if not ln.startswith("kvbatch: warning:")]
    assert len(lines) == 1 and signal.Signals(signum).name in lines[0], rest
    assert "Traceback" not in rest
    assert not out.exists() and _temps(tmp_path) == []


def test_next_run_removes_a_killed_runs_temp_file_and_no_live_one(tiny_chat, tmp_path):
    proc, out = _start(tiny_chat, tmp_path)
    proc.kill()  # SIGKILL: no handler runs, the temp file stays
    proc.wait(timeout=60)
    stale = _temps(tmp_path)
    assert len(stale) == 1 and str(proc.pid) in stale[0]
    # A live writer of the same name (another process on this host) and one from another host
    # sharing the folder: nothing here can prove them dead, so they must survive.
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        keep = [f".out.jsonl.tmp-{_host()}-{live.pid}-{'a' * 12}", f".out.jsonl.tmp-elsewhere-{proc.pid}-{'b' * 12}"]
        for name in keep:
            (tmp_path / name).write_text("partial")
        src = tmp_path / "small.jsonl"
        src.write_bytes(_jsonl([_row("a")]))
        assert _generate(tiny_chat, src, out) == 0
        assert _temps(tmp_path) == sorted(keep)
        assert [r["custom_id"] for r in _read(out)] == ["a"]
    finally:
        live.stdin.close()
        live.wait(timeout=60)


# ------------------------------------------------------------------ the JSONL reader, fuzzed

_KNOWN = ["custom_id", "method", "url", "body", "messages", "model", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs",
          "n", "ignore_eos", "role", "content", "type", "text", "max_token"]
_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30) | st.floats()
    | st.text(max_size=8) | st.sampled_from(["user", "POST", "/v1/chat/completions", "text", "\ud800"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(_KNOWN), kids, max_size=5),
    max_leaves=12,
)
_line = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    _json.map(lambda v: json.dumps(v, allow_nan=True).encode("utf-8", "surrogatepass")),
    st.integers(min_value=4000, max_value=6000).map(lambda n: b'{"custom_id":"x","seed":' + b"7" * n + b"}"),
    st.just(b""), st.just(b" \t\r"),
)


def _expected_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _check_items(items: list) -> None:
    assert [i.line_no for i in items] == list(range(1, len(items) + 1))
    for item in items:
        assert isinstance(item, (ChatRequest, RejectedRow))
        if isinstance(item, RejectedRow):
            assert item.reason and item.field
            _encode(error_line(item))  # every rejection can be written as an output line


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=8), tail_newline=st.booleans(), compress=st.booleans())
def test_reader_accounts_for_every_line_of_any_input(lines, tail_newline, compress):
    data = b"\n".join(lines) + (b"\n" if tail_newline and lines else b"")
    url = f"memory://kvbatch-fuzz-{uuid.uuid4().hex}/in.jsonl" + (".gz" if compress else "")
    with fsspec.open(url, "wb") as f:
        f.write(gzip.compress(data, mtime=0) if compress else data)
    items = list(read_requests(url))
    assert len(items) == _expected_lines(data)
    _check_items(items)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=400), cut=st.floats(min_value=0.0, max_value=1.0))
def test_reader_on_damaged_gzip_yields_lines_then_one_clear_error(data, cut):
    packed = gzip.compress(data, mtime=0)
    url = f"memory://kvbatch-fuzz-{uuid.uuid4().hex}/in.jsonl.gz"
    with fsspec.open(url, "wb") as f:
        f.write(packed[: int(len(packed) * cut)])
    items: list = []
    try:
        items.extend(read_requests(url))
    except InputStreamError as exc:
        assert exc.lines_read == len(items) and url in str(exc)
    _check_items(items)


# ------------------------------------------------------------------ prefill and the worker group meet the same input


def _broken_gz(tmp: Path, n: int = 40, odd_rows: dict | None = None) -> tuple[Path, int]:
    """A truncated .gz of ``n`` rows ``r<i>-<pad>`` (the incompressible padding puts the cut well
    past gzip's first read buffer, so some rows come out before the break), ``odd_rows`` added to
    the body of every odd row; returns it and ``n``."""
    lines = [_row(f"r{i}-{random.Random(i).randbytes(512).hex()}", content=f"question {i}", max_tokens=1,
                  **(odd_rows if odd_rows and i % 2 else {})) for i in range(n)]
    src = tmp / "in.jsonl.gz"
    src.write_bytes(_truncated(gzip.compress(_jsonl(lines), mtime=0)))
    return src, n


def _ids(rows: list[dict]) -> list[str | None]:
    return [r["custom_id"] and r["custom_id"].split("-")[0] for r in rows]


def _prefill(model, src, manifests, *extra, store=None) -> int:
    return main(["prefill", "--model", str(model), "--store", str(store or Path(manifests).parent / "kv"),
                 "--input", str(src), "--manifests", str(manifests), "--no-progress", *extra])


def test_prefill_of_a_broken_stream_stores_and_lists_every_row_read(tiny_chat, tmp_path, capsys):
    src, n = _broken_gz(tmp_path)
    manifests, metrics = tmp_path / "m.jsonl", tmp_path / "p.json"
    code = _prefill(tiny_chat, src, manifests, "--metrics", str(metrics))
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2
    assert len(err) == 1 and str(src) in err[0] and "cannot read" in err[0] and str(manifests) in err[0], err
    rows = _read(manifests)
    done, marker = rows[:-1], rows[-1]
    assert 0 < len(done) < n
    assert _ids(done) == [f"r{i}" for i in range(len(done))]
    assert all("rejected" not in r and r["block_keys"] for r in done)
    assert marker["custom_id"] is None and marker["line_no"] == len(done) + 1 and marker["index"] == len(done)
    assert marker["rejected"]["field"] == "$" and "input ends here" in marker["rejected"]["reason"]
    m = json.loads(metrics.read_text())
    assert m["requests"] == len(rows) and m["blocks_written"] == len({k for r in done for k in r["block_keys"]})
    # Decode reads the marker as a rejected row: the results say where the input ended too.
    out = tmp_path / "out.jsonl"
    assert main(["decode", "--model", str(tiny_chat), "--store", str(tmp_path / "kv"), "--manifests", str(manifests),
                 "--output", str(out), "--no-progress"]) == 1
    results = _read(out)
    assert len(results) == len(rows) and "input ends here" in results[-1]["error"]["message"]
    assert all(r["error"] is None for r in results[:-1])
    assert _temps(tmp_path) == []


def _prefill_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    good, notgz, folder, a_file = _unusable_paths(tmp)
    m = str(tmp / "m.jsonl")
    return {
        "input is a directory": (["--input", str(folder), "--manifests", m], "is a directory"),
        "input not gzip": (["--input", str(notgz), "--manifests", m], "gzip"),
        "manifests is a directory": (["--input", str(good), "--manifests", str(folder)], "is a directory"),
        "manifests under a file": (["--input", str(good), "--manifests", str(a_file / "m.jsonl")], "a_file/m.jsonl"),
        "metrics under a file": (["--input", str(good), "--manifests", m, "--metrics", str(a_file / "p.json")],
                                 "a_file/p.json"),
        "manifests over the input": (["--input", str(good), "--manifests", str(good)], "same path"),
    }


@pytest.mark.parametrize("case", ["input is a directory", "input not gzip", "manifests is a directory",
                                  "manifests under a file", "metrics under a file", "manifests over the input"])
def test_prefill_fails_before_the_model_loads(tmp_path, capsys, case):
    args, expected = _prefill_cases(tmp_path)[case]
    code = main(["prefill", "--model", str(tmp_path / "no-such-model"), "--store", str(tmp_path / "kv"),
                 "--no-progress", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and expected in err[0] and "no-such-model" not in err[0], err
    assert not (tmp_path / "m.jsonl").exists() and _temps(tmp_path) == []
    assert (tmp_path / "in.jsonl").read_bytes() == _jsonl([_row("a")])  # the input is never replaced


def test_worker_group_answers_a_broken_stream_up_to_the_break_and_carries_strict(tiny_chat, tmp_path):
    # A subprocess, as a user runs it: the ranks' own stderr is part of what must be one line.
    src, n = _broken_gz(tmp_path, odd_rows={"max_token": 3})  # a typo in odd rows: --strict rejects them
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    proc = subprocess.run([sys.executable, "-m", "kvbatch.cli.main", "generate", "--model", str(tiny_chat),
                           "--input", str(src), "--output", str(out), "--errors", str(errors), "--no-progress",
                           "--workers", "2", "--strict"], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]  # (rows name a model: a warning too)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(src) in lines[0] and "cannot read" in lines[0] and str(out) in lines[0]
    rows = _read(out)
    answered, marker = rows[:-1], rows[-1]
    assert 0 < len(answered) < n
    assert _ids(answered) == [f"r{i}" for i in range(len(answered))]  # both ranks' rows, in order
    assert [r["error"] and r["error"]["field"] for r in answered] == \
        [None if i % 2 == 0 else "body.max_token" for i in range(len(answered))]
    assert marker["custom_id"] is None and marker["error"]["line"] == len(answered) + 1
    assert "input ends here" in marker["error"]["message"]
    assert _read(errors) == [r for r in rows if r["error"] is not None]  # the marker too
    assert _temps(tmp_path) == []
