"""The step profiler of the benchmarks (``benchmarks/timing.py``) splits an engine step's wall time
into the engine's own parts, accounts for all of it, and leaves the engine as it found it."""

from __future__ import annotations

import math

import torch

from benchmarks.timing import FORWARD_PARTS, FORWARD_REST, HOST_PARTS, HOST_REST, StepProfile, profile_decode_steps
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch
from kvbatch.kernels.cpu.linear import LinearFormat
from tests.tiny_models import VOCAB, build_tiny


def _prompts(n: int) -> list[list[int]]:
    return [torch.randint(3, VOCAB, (5 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(n)]


def test_a_decode_step_is_split_into_parts_that_add_up(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")  # no kernel measurement: this test times the step only
    build_tiny("llama", tmp_path / "model")
    llm = LLM(str(tmp_path / "model"), engine_config=EngineConfig(block_size=4, num_blocks=64))
    originals = (LinearFormat.__call__, dispatch.rms_norm, dispatch.paged_decode_attention)
    ms, table = profile_decode_steps(llm, _prompts(3), steps=4)
    labels = [label for label, _, _ in table]
    expected = ([label for label, _, _ in HOST_PARTS] + list(dict.fromkeys(label for label, _, _ in FORWARD_PARTS))
                + [FORWARD_REST, HOST_REST])
    assert labels == expected
    part = {label: (part_ms, share) for label, part_ms, share in table}
    # Every decode step multiplies, normalises, schedules and builds its tensors, and attends: per op,
    # or inside the fused decode layers (which then need no attention plan of their own).
    for label in ("projections + LM head (matmuls)", "rms_norm + residual", "scheduler",
                  "step tensors (runner.prepare)"):
        assert part[label][0] > 0, label
    assert part["attention (KV gather, softmax, plan)"][0] > 0 or part["fused decode layers (one native call)"][0] > 0
    assert all(part_ms >= 0 for _, part_ms, _ in table)  # the rests are what is left of an enclosing clock
    assert math.isclose(sum(share for _, _, share in table), 1.0, rel_tol=1e-9)
    assert math.isclose(sum(part_ms for _, part_ms, _ in table), ms, rel_tol=1e-9)
    # The wrappers are gone afterwards: the class, the kernel module and the engine's own objects.
    assert (LinearFormat.__call__, dispatch.rms_norm, dispatch.paged_decode_attention) == originals
    assert "schedule" not in vars(llm.scheduler) and "step" not in vars(llm) and "forward" not in vars(llm.model)
    assert not llm.scheduler.running and not llm.scheduler.waiting  # the profiled requests were dropped


def test_the_profiler_changes_no_token(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")
    build_tiny("llama", tmp_path / "model")
    llm = LLM(str(tmp_path / "model"), engine_config=EngineConfig(block_size=4, num_blocks=64))
    requests = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                                  prompt_token_ids=p) for i, p in enumerate(_prompts(2))]
    plain = [r.output_token_ids for r in llm.generate(requests)]
    with StepProfile(llm) as prof:
        profiled = [r.output_token_ids for r in llm.generate(requests)]
    assert profiled == plain
    assert prof.seconds["step"] > 0 and prof.seconds["projections + LM head (matmuls)"] > 0
