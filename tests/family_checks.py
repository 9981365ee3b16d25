"""Checks every declared family's parity tests run the same way (test_gemma3, test_gpt_oss): the
KV store round trip with a prefix-cache hit after it, and speculative decoding keeping the
reference model's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.kv_roundtrip import store_round_trip


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def family_prompts(vocab: int, seed: int = 1) -> dict[str, list[int]]:
    """Four prompts of 10 to 29 tokens (longer than the tiny models' windows)."""
    g = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, vocab, (n,), generator=g).tolist() for i, n in enumerate([12, 29, 10, 21])}


def check_store_round_trip_and_prefix_hit(ckpt: Any, kv_url: str, vocab: int, config: dict[str, Any],
                                          prefix_config: dict[str, Any]) -> None:
    """Decode from the KV store equals in-process generate (engines of ``config``); then one engine
    of ``prefix_config`` runs the prompts twice: the second pass reuses the shared 26-token system
    prompt from its prefix cache and answers the same."""
    trip = store_round_trip(ckpt, kv_url, vocab, **config)
    assert trip.prefill.connector.stats.blocks_written > 0
    assert trip.decoded == trip.reference
    assert trip.decoder.connector.stats.blocks_loaded > 0
    assert trip.decoder.stats["computed_prompt_tokens"] < sum(len(p) for p in trip.prompts.values()) - 4 * 6
    again = LLM(ckpt, engine_config=EngineConfig(**prefix_config))
    first = {r.request_id: r.output_token_ids for r in again.generate(trip.requests())}
    computed = again.stats["computed_prompt_tokens"]
    second = {r.request_id: r.output_token_ids for r in again.generate(trip.requests())}
    assert again.stats["computed_prompt_tokens"] - computed < computed - 4 * 6  # the prefix was a hit
    assert first == second == trip.reference


def check_speculation_keeps_reference(folder: Path, reference: Any, vocab: int, spec: str) -> None:
    """Repetitive prompts (n-gram drafts) decoded with ``spec`` (``ngram`` or ``draft:self``, the model
    drafting for itself) keep ``reference``'s (a transformers model's) greedy tokens; drafts were
    verified, and the self-drafter's were kept."""
    from kvbatch.engine.speculative.controller import SpecConfig

    g = torch.Generator().manual_seed(3)
    bases = [torch.randint(3, vocab, (6,), generator=g).tolist() for _ in range(3)]
    prompts = {f"s{i}": b * 3 + b[:2] for i, b in enumerate(bases)}
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=96, max_num_seqs=4),
              speculative=SpecConfig.parse(spec.replace("self", str(folder)), 3, False))
    out = {r.request_id: r.output_token_ids for r in llm.generate(
        [GenerationRequest(rid, greedy(10), prompt_token_ids=p) for rid, p in prompts.items()])}
    assert llm.stats["spec_draft_tokens"] > 0
    if spec.startswith("draft:"):
        assert llm.stats["spec_accepted_tokens"] > 0
    for rid, prompt in prompts.items():
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert out[rid] == want, rid
