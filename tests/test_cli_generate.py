"""`kvbatch generate` end to end on a tiny chat model: every line answered, in order, bad rows
reported with line, field and reason, exit status telling whether anything failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.cli.main import main
from tests.tiny_models import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_positions=96)


def _row(cid, content="Hello there", **body):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tiny_chat, tmp_path, lines, *extra) -> tuple[int, list[dict], Path]:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(tiny_chat), "--input", str(src), "--output", str(out),
                 "--no-progress", *extra])
    return code, _read(out), src


def test_mixed_batch_answers_every_line_in_order(tiny_chat, tmp_path):
    lines = [
        _row("a"),
        b'{"custom_id": "broken", ',                                   # malformed JSON
        _row("b", temperature=-1),                                      # bad sampling value
        _row("a"),                                                      # duplicate custom_id
        json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "robot", "content": "x"}]}}),  # unknown role
        b'{"custom_id": "d", "body": {"messages": [{"role": "user", "content": "\xff\xfe"}]}}',  # bad UTF-8
        json.dumps({"method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "x"}]}}),  # no custom_id
        _row("long", content="word " * 200),                            # longer than the context
        _row("e", temperature=0.7, seed=3),
    ]
    errors = tmp_path / "errors.jsonl"
    metrics = tmp_path / "metrics.json"
    code, out, _ = _run(tiny_chat, tmp_path, lines, "--errors", str(errors), "--metrics", str(metrics))
    assert code == 1
    assert len(out) == len(lines)
    ok = [o for o in out if o["error"] is None]
    assert [o["custom_id"] for o in ok] == ["a", "e"]
    assert out[0]["custom_id"] == "a" and out[-1]["custom_id"] == "e"
    fields = {o["error"]["line"]: o["error"]["field"] for o in out if o["error"]}
    assert fields[2] == "$"
    assert fields[3] == "body.temperature"
    assert fields[4] == "custom_id" and "duplicate of line 1" in out[3]["error"]["message"]
    assert fields[5] == "body.messages.0.role"
    assert fields[6] == "$" and "UTF-8" in out[5]["error"]["message"]
    assert fields[7] == "custom_id"
    assert fields[8] == "body.messages" and "context window is 96" in out[7]["error"]["message"]
    assert len(_read(errors)) == 7
    m = json.loads(metrics.read_text())
    assert m["requests"] == 9 and m["succeeded"] == 2 and m["rejected"] == 7
    assert m["output_tokens"] == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in ok)
    for key in ("wall_s", "output_tokens_per_s", "ttft_s_p50", "ttft_s_p95", "tpot_s_p50", "tpot_s_p95"):
        assert key in m


def test_clean_batch_exits_zero_and_is_reproducible(tiny_chat, tmp_path):
    lines = [_row(f"r{i}", content=f"Question number {i}?", temperature=0.9, seed=i) for i in range(5)]
    code, first, _ = _run(tiny_chat, tmp_path, lines)
    assert code == 0
    code, second, _ = _run(tiny_chat, tmp_path, lines[::-1])
    texts1 = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in first}
    texts2 = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in second}
    assert texts1 == texts2  # seeded requests draw the same tokens whatever their neighbours


def test_stop_string_cuts_text(tiny_chat, tmp_path):
    code, out, _ = _run(tiny_chat, tmp_path, [_row("s", max_tokens=12)])
    text = out[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert len(text) > 4
    stop = text[2:4]
    code, out, _ = _run(tiny_chat, tmp_path, [_row("s", max_tokens=12, stop=[stop])])
    choice = out[0]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(stop)]


def test_missing_model_fails_at_once_with_one_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(_row("a") + "\n")
    code = main(["generate", "--model", str(tmp_path / "nope"), "--input", str(src),
                 "--output", str(tmp_path / "o.jsonl"), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]


def test_corrupt_weights_fail_at_once(tiny_chat, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_chat.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "model.safetensors").write_bytes((tiny_chat / "model.safetensors").read_bytes()[:1000])
    src = tmp_path / "in.jsonl"
    src.write_text(_row("a") + "\n")
    code = main(["generate", "--model", str(bad), "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                 "--no-progress"])
    assert code == 2
    assert "safetensors" in capsys.readouterr().err


def test_console_script_runs(tiny_chat, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(_row("a") + "\n")
    out = tmp_path / "o.jsonl"
    proc = subprocess.run([sys.executable, "-m", "kvbatch.cli.main", "generate", "--model", str(tiny_chat),
                           "--input", str(src), "--output", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "1 succeeded, 0 rejected" in proc.stderr
    assert len(_read(out)) == 1


def test_logprobs_are_reported(tiny_chat, tmp_path):
    code, out, _ = _run(tiny_chat, tmp_path, [_row("lp", max_tokens=3, logprobs=True, top_logprobs=2)])
    assert code == 0
    content = out[0]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
