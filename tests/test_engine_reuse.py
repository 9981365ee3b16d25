"""One engine preparation per process for the steps of a run (ops/engine_build.py): an engine
built with ``keep=True`` reuses the model an earlier one built with the same weights' settings
and gives the same tokens as a fresh engine; other settings get their own model; a shard run
executed in one process (the default executor) prepares the weights once for its prefill and
its decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbatch.engine.models import factory
from kvbatch.engine.runtime.llm import GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.spec import EngineSpec
from kvbatch.ops import engine_build
from tests.tiny_models import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=256)


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The models ``build_model`` prepared in this test, by dtype; the process's kept models and
    checkpoints dropped before and after, so no other test's engine is reused here."""
    seen: list[str] = []
    real = factory.build_model

    def counting(config, tensors, dtype, *args, **kwargs):
        seen.append(str(dtype))
        return real(config, tensors, dtype, *args, **kwargs)

    monkeypatch.setattr("kvbatch.engine.runtime.llm.build_model", counting)
    monkeypatch.setattr(engine_build, "_MODELS", {})
    monkeypatch.setattr(engine_build, "_CHECKPOINTS", {})
    return seen


def _tokens(llm) -> list[list[int]]:
    reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                              prompt_token_ids=p) for i, p in enumerate([[1, 5, 9, 33], [1, 2, 3, 4, 5, 6, 7]])]
    return [r.output_token_ids for r in llm.generate(reqs)]


def test_a_kept_engine_reuses_the_model_and_answers_the_same(tiny, builds) -> None:
    spec = EngineSpec(model=str(tiny), device="cpu", dtype="fp32", deterministic=True)
    first = engine_build.build_llm(spec, keep=True, decode=False)
    second = engine_build.build_llm(spec, keep=True, decode=True)
    assert second.model is first.model and builds == ["torch.float32"]
    assert second.runner.kv_cache.data_ptr() != first.runner.kv_cache.data_ptr()  # each its own cache
    fresh = engine_build.build_llm(spec, keep=False)  # a one-shot build prepares its own
    assert fresh.model is not first.model and len(builds) == 2
    assert _tokens(second) == _tokens(fresh) == _tokens(first)


def test_other_weight_settings_get_their_own_model(tiny, builds) -> None:
    base = EngineSpec(model=str(tiny), device="cpu", dtype="fp32")
    a = engine_build.build_llm(base, keep=True)
    b = engine_build.build_llm(EngineSpec(model=str(tiny), device="cpu", dtype="bf16"), keep=True)
    c = engine_build.build_llm(EngineSpec(model=str(tiny), device="cpu", dtype="fp32", weights="int8"), keep=True)
    d = engine_build.build_llm(EngineSpec(model=str(tiny), device="cpu", dtype="fp32", deterministic=True), keep=True)
    assert len({id(x.model) for x in (a, b, c, d)}) == 4 and len(builds) == 4
    # Batch limits and the KV budget are the engine's own: they share the model.
    e = engine_build.build_llm(EngineSpec(model=str(tiny), device="cpu", dtype="fp32", max_batch=3, kv_cache_gb=0.25),
                               keep=True)
    assert e.model is a.model and len(builds) == 4


@pytest.mark.slow
def test_a_shard_run_in_one_process_prepares_the_weights_once(tiny, builds, tmp_path) -> None:
    from tests.test_pipeline import DATE, ingested_local_day

    defs, instance, _ = ingested_local_day(tiny, tmp_path)
    before = len(builds)
    run = defs.resolve_job_def("kvbatch_shard").execute_in_process(partition_key=f"{DATE}|0000", instance=instance)
    assert run.success
    steps = {e.step_key for e in run.all_events if e.is_step_success}
    assert {"kvbatch__prefill_kv", "kvbatch__decode_results"} <= steps
    assert len(builds) - before == 1, builds  # prefill built it; decode reused it
