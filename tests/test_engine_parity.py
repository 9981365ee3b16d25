"""The engine's logits match transformers' on tiny seeded checkpoints, prefill and every decode step."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.logit_capture import assert_logits_match, capture_logits
from tests.tiny_models import ARCHS, VOCAB, build_tiny


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [4096, 7])  # 7: prompts are prefilled in several chunks
@pytest.mark.parametrize("invariant", [False, True])
def test_logits_match_transformers(tmp_path, arch, budget, invariant):
    ref = build_tiny(arch, tmp_path)
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget,
                                                        batch_invariant=invariant))
    seen = capture_logits(llm)
    g = torch.Generator().manual_seed(1)
    prompts = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate([5, 17, 9])}
    reqs = [GenerationRequest(rid, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), prompt_token_ids=p)
            for rid, p in prompts.items()]
    results = {r.request_id: r for r in llm.generate(reqs)}
    for rid, prompt in prompts.items():
        assert len(results[rid].output_token_ids) == 6
        assert_logits_match(ref, seen, rid, prompt, results[rid].output_token_ids, arch)


def _run_logits(folder, prompts, **cfg):
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=256, batch_invariant=True, **cfg))
    seen = capture_logits(llm)
    reqs = [GenerationRequest(rid, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), prompt_token_ids=p)
            for rid, p in prompts.items()]
    llm.generate(reqs)
    return {rid: torch.stack([l for r, l in seen if r == rid]) for rid in prompts}


def test_batch_invariant_mode_is_bitwise_stable(tmp_path):
    """In batch-invariant mode a request's logits do not change by a single bit whether it runs
    alone, inside a batch, prefilled in chunks, or on top of a cached prefix."""
    build_tiny("llama", tmp_path)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    target = shared + torch.randint(3, VOCAB, (9,), generator=g).tolist()
    others = {f"o{i}": torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate([3, 30, 70, 11])}
    alone = _run_logits(tmp_path, {"t": target}, enable_prefix_caching=False)["t"]
    batched = _run_logits(tmp_path, {**others, "t": target}, enable_prefix_caching=False)["t"]
    chunked = _run_logits(tmp_path, {"t": target}, enable_prefix_caching=False, max_num_batched_tokens=8)["t"]
    # The shared prefix is computed by another request first, then served from the cache.
    hit = _run_logits(tmp_path, {"first": shared + [5, 6], "t": target}, max_num_seqs=1)["t"]
    assert torch.equal(alone, batched)
    assert torch.equal(alone, chunked)
    assert torch.equal(alone, hit)
