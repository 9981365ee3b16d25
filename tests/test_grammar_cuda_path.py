"""Structured outputs on the CUDA code path (issue 42: "masks work on the CPU and on CUDA, a bitmask
applied on the device, no per-row host work in the decode step"): the Triton kernels in the
interpreter and the cuBLAS weight layout, the path a GPU runs, on the CPU. Constrained rows, greedy
and seeded, with and without n-gram drafts, give the CPU path's answers, valid against their schema,
and every step that samples reads the device once (``HostReadback.read``): the masks go to the device
and are applied there, never read back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvbatch.engine import LLM, GenerationRequest, SamplingParams
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.speculative.controller import SpecConfig
from tests.test_grammar_drafts import ITEMS
from tests.test_grammar_drafts import MESSAGES as REPEAT_MESSAGES
from tests.test_structured_outputs import MESSAGES, SCHEMAS, _schema_format, tiny_chat  # noqa: F401 - fixture
from tests.test_verifier_batched import _syncs_per_step

# (schema, temperature, seed): the items array copies its prompt, so n-gram drafts find matches.
ROWS = [("items", 0.0, None), ("nested", 0.0, None), ("items", 1.0, 5)]
SCHEMAS = {**SCHEMAS, "items": ITEMS}


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"{name}-{seed}", SamplingParams(max_tokens=96, temperature=t, seed=seed,
                                                               response_format=_schema_format(SCHEMAS[name])),
                              messages=REPEAT_MESSAGES if name == "items" else MESSAGES) for name, t, seed in ROWS]


@pytest.mark.slow  # the Triton kernels in the interpreter
@pytest.mark.parametrize("spec", [None, SpecConfig("ngram", 3, adaptive=False)])
def test_constrained_rows_on_the_cuda_code_path_read_the_device_once_per_step(tiny_chat, monkeypatch, spec):  # noqa: F811
    cpu = {r.request_id: r.output_token_ids for r in LLM(str(tiny_chat), speculative=spec).generate(_requests())}
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_LINEAR", "cublas")
    llm = LLM(str(tiny_chat), engine_config=EngineConfig(device="cpu"), speculative=spec)
    steps, stray, results = _syncs_per_step(llm, _requests(), monkeypatch, stray=True)
    assert steps and set(steps) == {1}, steps
    assert stray == [], stray
    assert {rid: ids for rid, (ids, _) in results.items()} == cpu
    assert spec is None or llm.stats["spec_draft_tokens"] > 0  # the drafts' masks went through the path too
    tok = llm.tokenizer
    for name, _, seed in ROWS:
        jsonschema.validate(json.loads(tok.decode(results[f"{name}-{seed}"][0])), SCHEMAS[name])
