"""Tampered manifests (issue 19, item 5): each bad line of a manifest is a rejected row with
its field and reason, the decode goes on and answers every other row; whatever bytes the
manifest holds, decode never raises and answers exactly one row per line.

Line rule (ops/prefill/manifests.py): every line of the file, i.e. the bytes up to each b"\\n" plus a
last line without one, is one row; blank lines are rows too (rejected), so the output has
exactly `_lines(data)` lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.cli.main import EXIT_REJECTS, main
from kvbatch.engine.spec import EngineSpec
from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.ops.jobs import Job, Rejected
from kvbatch.ops.decode.generate import run_decode
from kvbatch.ops.prefill.manifests import ManifestMismatch, manifest_jobs, manifest_line, read_manifests
from tests.tiny_models import VOCAB, build_tiny

MAX_POSITIONS = 256  # tiny_models' max_position_embeddings
IDENTITY = ("fingerprint", "kv_root", "block_size", "dtype")


def _lines(data: bytes) -> int:
    """How many rows a manifest of these bytes is (the rule in the module docstring)."""
    return 0 if not data else data.count(b"\n") + (not data.endswith(b"\n"))


def _engine(model: Path) -> LLM:
    ckpt = load_checkpoint(str(model))
    store = KVStore.from_config(KVStoreConfig(url=str(model.parent / "kv"), memory_bytes=0),
                                EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(ckpt.fingerprint))
    return LLM(ckpt, engine_config=EngineConfig(max_num_seqs=8), kv_store=store)


def _answers(rows: list[dict]) -> dict[str, tuple]:
    out = {}
    for o in rows:
        c = o["response"]["body"]["choices"][0]
        out[o["custom_id"]] = (c["message"]["content"], c["finish_reason"], o["response"]["body"]["usage"])
    return out


@pytest.fixture(scope="module")
def handoff(tmp_path_factory) -> dict:
    """A tiny model, its store and the manifests of three prefilled requests, plus a clean decode
    of them. A tokenizer-free model keeps the set-up short; the manifest lines are prefill's own
    (manifest_line), and prefill_only requests store the blocks as `kvbatch prefill` does."""
    base = tmp_path_factory.mktemp("handoff")
    model = base / "model"
    build_tiny("llama", model)
    llm = _engine(model)
    jobs = [Job(i, f"q{i}", i + 1, [(7 * i + 3 * j + 1) % VOCAB for j in range(40)],
                SamplingParams(max_tokens=3, temperature=0)) for i in range(3)]
    for _ in llm.stream(GenerationRequest(str(j.index), j.sampling, prompt_token_ids=j.prompt_token_ids,
                                          prefill_only=True) for j in jobs):
        pass
    lines = [manifest_line(llm, j, "tiny") for j in jobs]
    assert all(len(m["block_keys"]) == 2 for m in lines)  # the prompts span stored blocks
    manifests, ref = base / "manifests.jsonl", base / "ref.jsonl"
    manifests.write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert run_decode(llm, str(manifests), str(ref)).succeeded == 3
    return {"model": model, "store": base / "kv", "lines": lines, "answers": _answers([json.loads(x) for x in ref.read_text().splitlines()]), "base": base,
            "llm": llm}


def _tampered(lines: list[dict]) -> dict[str, tuple[bytes, str, str]]:
    """case -> (manifest line, field the rejection must name, words its reason must hold).

    Each line is a copy of a good line (index past every earlier one unless the case is about the
    index), so only the tampering makes it bad."""
    good = lines[1]
    cases: dict[str, tuple[bytes, str, str]] = {}

    def add(name: str, field: str, words: str, **change) -> None:
        m = json.loads(json.dumps(good))
        m.update(index=100 + len(cases), custom_id=f"t-{name}")
        for k, v in change.items():
            if "__" in k:
                outer, inner = k.split("__")
                m[outer][inner] = v
            elif v is ...:
                m.pop(k)
            else:
                m[k] = v
        cases[name] = (json.dumps(m).encode(), field, words)

    ids = list(good["prompt_token_ids"])
    add("token_too_big", "manifest.prompt_token_ids.3", "outside the model's vocabulary",
        prompt_token_ids=ids[:3] + [VOCAB] + ids[4:])
    add("token_negative", "manifest.prompt_token_ids.5", "token id -7 is outside",
        prompt_token_ids=ids[:5] + [-7] + ids[6:])
    add("token_not_int", "manifest.prompt_token_ids.0", "valid integer", prompt_token_ids=["1"] + ids[1:])
    add("duplicate_index", "manifest.index", "repeats index", index=100 + len(cases) - 1)
    add("index_goes_back", "manifest.index", "goes back", index=0)
    add("index_is_bool", "manifest.index", "valid integer", index=True)
    add("custom_id_not_str", "manifest.custom_id", "valid string", custom_id=123)
    add("temperature_negative", "manifest.sampling.temperature", "greater than or equal to 0", sampling__temperature=-1)
    add("top_p_string", "manifest.sampling.top_p", "valid number", sampling__top_p="0.5")
    add("sampling_missing", "manifest.sampling", "required field is missing", sampling=...)
    add("stop_token_out_of_vocab", "manifest.sampling.stop_token_ids.0", "outside the model's vocabulary",
        sampling__stop_token_ids=[VOCAB + 5])
    add("block_key_path", "manifest.block_keys.0", "not a hex/ASCII-word", block_keys=["../../etc/passwd"])
    add("block_keys_altered", "manifest.block_keys", "do not match prompt_token_ids",
        block_keys=["0" * 64] * len(good["block_keys"]))
    add("prompt_too_long", "manifest.prompt_token_ids", "context window",
        prompt_token_ids=(ids * (MAX_POSITIONS // len(ids) + 1))[:MAX_POSITIONS],
        block_keys=[])  # checked before the keys
    add("rejected_form_broken", "manifest.rejected", "valid dictionary", rejected="no")
    cases["not_json"] = (b'{"index": 200, "custom_id": "t-not_json", ', "manifest", "malformed JSON")
    cases["bad_utf8"] = (b'{"index": 201, "custom_id": "t-\xff\xfe"}', "manifest", "invalid UTF-8")
    cases["not_object"] = (b"[1, 2, 3]", "manifest", "must be a JSON object")
    cases["blank"] = (b"   ", "manifest", "blank line")
    return cases


@pytest.fixture(scope="module")
def tampered_run(handoff) -> dict:
    """One `kvbatch decode` over the three good lines with every tampered line after them."""
    cases = _tampered(handoff["lines"])
    good = [json.dumps(m).encode() for m in handoff["lines"]]
    data = b"\n".join(good + [c[0] for c in cases.values()]) + b"\n"
    manifests = handoff["base"] / "tampered.jsonl"
    manifests.write_bytes(data)
    out, errors = handoff["base"] / "tampered_out.jsonl", handoff["base"] / "tampered_errors.jsonl"
    code = main(["decode", "--model", str(handoff["model"]), "--store", str(handoff["store"]),
                 "--manifests", str(manifests), "--output", str(out), "--errors", str(errors), "--no-progress"])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return {"code": code, "rows": rows, "errors": [json.loads(x) for x in errors.read_text().splitlines()],
            "cases": cases, "n": _lines(data)}


def test_a_tampered_manifest_is_decoded_with_every_bad_line_rejected(tampered_run, handoff):
    # Exit 1 is the CLI's "the batch ran, some rows were rejected" (2 would be a failed run).
    assert tampered_run["code"] == EXIT_REJECTS
    rows = tampered_run["rows"]
    assert len(rows) == tampered_run["n"] == 3 + len(tampered_run["cases"])
    for row, want in zip(rows[:3], ("q0", "q1", "q2")):  # every good row answered, as a clean decode does
        assert row["custom_id"] == want and row["error"] is None
    assert _answers(rows[:3]) == handoff["answers"]
    assert len(tampered_run["errors"]) == len(tampered_run["cases"])


_SHAPE = {"prompt_token_ids": list(range(40)), "block_keys": ["k", "k"], "sampling": {}, "index": 1}


@pytest.mark.parametrize("case", list(_tampered([_SHAPE, _SHAPE])))  # the case names, known before any model is built
def test_each_tampered_line_is_its_own_rejected_row(tampered_run, case):
    names = list(tampered_run["cases"])
    _, field, words = tampered_run["cases"][case]
    row = tampered_run["rows"][3 + names.index(case)]
    assert row["error"] is not None, f"{case}: the tampered line was answered: {row}"
    assert row["error"]["field"] == field, row["error"]
    line = 4 + names.index(case)
    assert f"manifest line {line}: " in row["error"]["message"] and words in row["error"]["message"], row["error"]
    if row["custom_id"] is not None:
        assert row["custom_id"] == f"t-{case}"


# ---------------------------------------------------------------------------------- fuzzing


@pytest.fixture(scope="module")
def decoder(handoff) -> LLM:
    return handoff["llm"]


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=8), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                                max_size=3),
                     max_leaves=6)


@st.composite
def _manifest_bytes(draw, lines: list[dict]) -> tuple[bytes, bool]:
    """Manifest files: good lines, good lines with one field replaced by any JSON value, raw
    bytes, truncated lines, joined by newlines. Also says whether an identity field was changed
    (the one case where refusing the whole file is right)."""
    out: list[bytes] = []
    identity_changed = False
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["good", "field", "bytes", "cut"]))
        m = json.loads(json.dumps(draw(st.sampled_from(lines))))
        if kind == "bytes":
            out.append(draw(st.binary(max_size=40)).replace(b"\n", b""))
            continue
        if kind == "field":
            key = draw(st.sampled_from(sorted(m) + ["sampling.max_tokens", "sampling.stop", "rejected"]))
            value = draw(_json)
            if key.startswith("sampling."):
                m["sampling"][key.split(".", 1)[1]] = value
            else:
                m[key] = value
            identity_changed |= key in IDENTITY
        line = json.dumps(m).encode()
        if kind == "cut":
            line = line[: draw(st.integers(0, len(line)))]
        out.append(line)
    data = b"\n".join(out)
    if out and draw(st.booleans()):
        data += b"\n"
    return data, identity_changed


def test_any_manifest_bytes_are_answered_line_for_line(handoff, decoder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")

    @settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])
    @given(_manifest_bytes(handoff["lines"]))
    def check(sample: tuple[bytes, bool]) -> None:
        data, identity_changed = sample
        manifests, out = folder / "m.jsonl", folder / "out.jsonl"
        manifests.write_bytes(data)
        try:
            report = run_decode(decoder, str(manifests), str(out))
        except ManifestMismatch:
            assert identity_changed  # a well-formed line for another model: the whole file is refused
            return
        rows = [json.loads(x) for x in out.read_bytes().splitlines()]
        assert len(rows) == _lines(data) == report.requests
        assert report.succeeded + report.rejected == report.requests
        assert sum(r["error"] is not None for r in rows) == report.rejected

    check()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_raw_bytes_never_raise(tmp_path_factory, decoder, data):
    """Bytes from nowhere: every line is a rejected row (no line of noise is a valid manifest)."""
    path = tmp_path_factory.getbasetemp() / "raw.jsonl"
    path.write_bytes(data)
    items = list(manifest_jobs(decoder, read_manifests(str(path))))
    assert len(items) == _lines(data)
    assert all(isinstance(i, Rejected) for i in items)
