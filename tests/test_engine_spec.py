"""One spec, one builder: every entry point builds its engine from an ``EngineSpec`` through
``kvbatch.ops.engine_build``, and the KV layout's identity (block keys, store fingerprint) is
derived from the spec alone, the weight format included, so int8, GGUF and full weights never
share blocks and the CLI and the pipeline agree on the fingerprint of the same model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvbatch.cli.main import build_parser, main
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
from kvbatch.ops import engine_build
from kvbatch.ops.fingerprint import model_identity
from kvbatch.ops.shards.build import RowTokenizer
from kvbatch.resources import ModelResource
from tests.tiny_models import build_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You answer in one short sentence and name the aisle. " * 4


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_positions=512)


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory) -> Path:
    rows = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        "max_tokens": 6, "temperature": 0}}) for i, q in enumerate(["hammers?", "rope?", "paint rollers?"])]
    path = tmp_path_factory.mktemp("data") / "requests.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_weight_format_dtype_and_block_size_are_part_of_the_kv_identity() -> None:
    fp = "ab" * 32
    specs = [EngineSpec(dtype="fp32"), EngineSpec(dtype="fp32", weights="int8"),
             EngineSpec(dtype="fp32", weights="gguf"), EngineSpec(dtype="bf16"), EngineSpec(dtype="fp32", block_size=8)]
    assert len({s.kv_fingerprint(fp) for s in specs}) == len(specs)
    assert len({s.kv_root_key(fp) for s in specs}) == len(specs)
    # Settings that do not change the numbers of a block do not change its identity.
    assert EngineSpec(dtype="fp32", max_batch=3, seed=9).kv_fingerprint(fp) == EngineSpec(dtype="fp32").kv_fingerprint(fp)
    # "fp32" and torch's "float32" are one dtype.
    assert EngineSpec(dtype="float32").kv_fingerprint(fp) == EngineSpec(dtype="fp32").kv_fingerprint(fp)


def test_a_spec_whose_dtype_follows_its_device_derives_no_keys_until_resolved() -> None:
    with pytest.raises(ValueError, match="resolve it first"):
        EngineSpec().kv_fingerprint("ab" * 32)
    assert engine_build.resolved(EngineSpec(device="cpu")).dtype == "fp32"


def test_a_spec_travels_as_json_and_refuses_what_it_does_not_know() -> None:
    spec = EngineSpec(model="m", dtype="bf16", weights="int8", speculative="ngram", threads=2)
    assert EngineSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ValueError, match="unknown engine spec field.*dtyp"):
        EngineSpec.from_json({"dtyp": "fp32"})
    for bad in ({"weights": "int4"}, {"linear": "fast"}, {"dtype": "fp8"}, {"device": "tpu"},
                {"speculative": "magic"}):
        with pytest.raises(ValueError):
            EngineSpec(**bad)


def test_the_cli_and_the_pipeline_resource_make_the_same_spec_and_fingerprint(tiny_chat) -> None:
    argv = ["prefill", "--input", "x.jsonl", "--manifests", "m.jsonl", "--store", "kv", "--model", str(tiny_chat),
            "--device", "cpu", "--dtype", "fp32", "--weights", "int8", "--max-batch", "8", "--deterministic"]
    from kvbatch.cli.main import _engine_spec

    cli_spec = _engine_spec(build_parser().parse_args(argv))
    resource = ModelResource(model=str(tiny_chat), device="cpu", dtype="fp32", weights="int8", max_batch=8,
                             deterministic=True)
    assert resource.engine_spec() == cli_spec
    model_identity(str(tiny_chat))  # the kept fingerprint the orchestrating step reads
    assert resource.kv_fingerprint() == engine_build.kv_fingerprint(cli_spec)
    assert resource.kv_fingerprint() != ModelResource(model=str(tiny_chat), device="cpu").kv_fingerprint()


def _run(argv: list[str]) -> None:
    assert main(argv) == 0, argv


def _texts(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["custom_id"]] = row["response"]["body"]["choices"][0]["message"]["content"]
    return out


def _prefill_decode_equals_generate(model: str, weights: str, requests: Path, tmp: Path) -> Path:
    # One request per step (int8 and GGUF weights have no batch-invariant mode): each answer is
    # computed alone, in generate and in decode alike.
    common = ["--model", model, "--device", "cpu", "--dtype", "fp32", "--weights", weights, "--max-batch", "1",
              "--no-progress"]
    store = str(tmp / "kv")
    _run(["generate", "--input", str(requests), "--output", str(tmp / "gen.jsonl"), *common])
    _run(["prefill", "--input", str(requests), "--manifests", str(tmp / "man.jsonl"), "--store", store, *common])
    _run(["decode", "--manifests", str(tmp / "man.jsonl"), "--output", str(tmp / "dec.jsonl"), "--store", store,
          "--metrics", str(tmp / "dec.json"), *common])
    assert _texts(tmp / "dec.jsonl") == _texts(tmp / "gen.jsonl")
    # Decode loaded the prompts' blocks from the store rather than computing them again.
    manifests = [json.loads(line) for line in (tmp / "man.jsonl").read_text().splitlines()]
    stored = sum(len(m["block_keys"]) for m in manifests) * 16
    metrics = json.loads((tmp / "dec.json").read_text())
    # (the shared system prompt's blocks, loaded once, serve the later rows from the prefix cache)
    assert stored > 0 and metrics["loaded_prompt_tokens"] > 0
    assert metrics["loaded_prompt_tokens"] + metrics["cached_prompt_tokens"] == stored
    return tmp / "man.jsonl"


def test_prefill_then_decode_with_int8_weights_equals_generate(tiny_chat, requests_file, tmp_path) -> None:
    manifests = _prefill_decode_equals_generate(str(tiny_chat), "int8", requests_file, tmp_path)
    # The blocks are under the int8 layout: the pipeline's resource with the same weights finds
    # them, the same model with full weights does not (its blocks would be other K/V).
    keys = [k for line in manifests.read_text().splitlines() for k in json.loads(line)["block_keys"]]
    for weights, found in (("int8", True), ("full", False)):
        resource = ModelResource(model=str(tiny_chat), device="cpu", weights=weights)
        store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0),
                                    resource.kv_fingerprint())
        assert all(store.contains(keys)) is found, weights
        # The shard step keys prompts as this engine does, without loading weights.
        tokenizer = RowTokenizer.for_spec(resource.engine_spec())
        assert (tokenizer.kv_root_key == engine_build.build_llm(resource.engine_spec()).kv_root_key) is True


@pytest.mark.slow
def test_prefill_then_decode_with_gguf_weights_equals_generate(requests_file, tmp_path) -> None:
    _prefill_decode_equals_generate("smollm2-135m", "gguf", requests_file, tmp_path)


def test_the_builder_refuses_a_store_opened_for_another_layout(tiny_chat, tmp_path) -> None:
    spec = EngineSpec(model=str(tiny_chat), dtype="fp32")
    other = engine_build.open_kv_store(EngineSpec(model=str(tiny_chat), dtype="fp32", weights="int8"),
                                       KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0))
    with pytest.raises(ValueError, match="fingerprint"):
        engine_build.build_llm(spec, other)


def test_every_entry_point_builds_through_the_one_builder(tiny_chat, requests_file, tmp_path, monkeypatch) -> None:
    """A spy on the builder and on ``LLM``: every engine the CLI and the Dagster resource make
    comes out of ``build_llm`` (serve's batches and the pipeline's steps build through the resource)."""
    from kvbatch.engine.runtime import llm as llm_module

    built, constructed, depth = [], [], [0]
    real_build, real_init = engine_build.build_llm, llm_module.LLM.__init__

    def spy_build(*args, **kwargs):
        depth[0] += 1
        try:
            engine = real_build(*args, **kwargs)
        finally:
            depth[0] -= 1
        built.append(engine)
        return engine

    def spy_init(self, *args, **kwargs):
        constructed.append(depth[0] > 0)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(engine_build, "build_llm", spy_build)
    monkeypatch.setattr(llm_module.LLM, "__init__", spy_init)
    common = ["--model", str(tiny_chat), "--device", "cpu", "--no-progress", "--max-batch", "4"]
    _run(["generate", "--input", str(requests_file), "--output", str(tmp_path / "g.jsonl"), *common])
    _run(["prefill", "--input", str(requests_file), "--manifests", str(tmp_path / "m.jsonl"),
          "--store", str(tmp_path / "kv"), *common])
    _run(["decode", "--manifests", str(tmp_path / "m.jsonl"), "--output", str(tmp_path / "d.jsonl"),
          "--store", str(tmp_path / "kv"), *common])
    ModelResource(model=str(tiny_chat), device="cpu").load()
    assert len(built) == 4
    assert constructed and all(constructed), "an LLM was constructed outside the builder"


def test_no_entry_point_constructs_an_engine_or_a_store_itself() -> None:
    """The static half of the spy: outside the builder, no module of the entry-point packages
    calls ``LLM(...)`` or opens a KV store with a fingerprint of its own."""
    offenders = []
    for folder in ("cli", "serve", "pipelines", "resources", "ops"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "engine_build.py":
                continue
            text = path.read_text()
            for pattern in (r"(?<![\w.])LLM\(", r"KVStore\.from_config\(", r"\bstore_fingerprint\(", r"\broot_key\("):
                if re.search(pattern, text):
                    offenders.append(f"{path.relative_to(ROOT)}: {pattern}")
    assert offenders == []
