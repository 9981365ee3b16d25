"""Speculative verify steps through the fused native decode layers (``LlamaModel.forward``,
``tokens_as_decode_rows``): a chunk of drafted tokens as rows of their own."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.kernels.cpu import native as N
from tests.logit_capture import full_head
from tests.test_cpu_native import _close, _fused_calls
from tests.tiny_models import VOCAB, build_tiny

pytestmark = pytest.mark.skipif(not N.available(), reason=f"no native CPU kernels here: {N.unavailable_reason()}")

def test_verify_steps_run_fused_with_each_drafted_token_a_row(tmp_path, monkeypatch):
    """A step verifying drafts (chunks of at most FUSED_CHUNK_MAX_QUERY tokens) takes the fused layers,
    each drafted token a row attending to its sequence up to itself: its logits match the per-op
    path's and greedy speculation keeps plain decoding's tokens."""
    build_tiny("llama", tmp_path / "dense")
    calls = _fused_calls(monkeypatch)
    prompt = list(range(3, VOCAB)) * 2  # every token occurs: prompt lookup has a draft at every step

    def run(fused: str, spec: SpecConfig | None) -> tuple[list[list[int]], list[torch.Tensor], int]:
        monkeypatch.setenv("KVBATCH_KERNELS", "native")
        monkeypatch.setenv("KVBATCH_FUSED_DECODE", fused)
        monkeypatch.setenv("KVBATCH_LINEAR", "blas")
        llm = full_head(LLM(str(tmp_path / "dense"), engine_config=EngineConfig(block_size=4, num_blocks=256),
                            speculative=spec))
        seen, execute = [], llm.runner.execute
        llm.runner.execute = lambda step, execute=execute: seen.append(execute(step)) or seen[-1]
        reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                                  prompt_token_ids=prompt[i:]) for i in range(2)]
        tokens = [r.output_token_ids for r in llm.generate(reqs)]
        return tokens, [s[0].clone() for s in seen], llm.stats["spec_draft_tokens"]

    spec = SpecConfig("ngram", max_len=3, adaptive=False)
    plain_tokens, _, _ = run("1", None)
    calls.clear()
    fused_tokens, fused_logits, fused_drafted = run("1", spec)
    assert any(rows > 2 for rows in calls), calls  # 2 sequences, more rows: drafted tokens verified fused
    assert fused_drafted > 0
    unfused_tokens, unfused_logits, _ = run("0", spec)
    assert fused_tokens == unfused_tokens == plain_tokens
    assert len(fused_logits) == len(unfused_logits)
    for a, b in zip(fused_logits, unfused_logits):
        _close(a, b, rel=1e-5)
