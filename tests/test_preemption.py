"""Preemption preserves output: a run whose KV cache is too small for its batch (so the
scheduler preempts and later recomputes requests) gives exactly the tokens of a run that never
preempts, greedy and seeded-sampled alike."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.tiny_models import VOCAB, build_tiny

BLOCK = 4
MAX_TOKENS = 12
NUM_REQUESTS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preempt")
    build_tiny("llama", folder, seed=0)
    return folder


def _requests(**sampling) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(4)
    out = []
    for i in range(NUM_REQUESTS):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(6, 15, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                **({"temperature": 0.0} | {k: (v + i if k == "seed" else v) for k, v in sampling.items()}))
        out.append(GenerationRequest(f"r{i}", params, prompt_token_ids=prompt))
    return out


def _run(folder, requests, num_blocks: int) -> tuple[LLM, list]:
    # Batch-invariant numerics: a recomputed prefix gets the very bits it had, so "same tokens"
    # holds exactly for sampling too (the default mode agrees only to rounding).
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_seqs=4,
                                                      batch_invariant=True))
    return llm, llm.generate(requests)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 11}], ids=["greedy", "seeded"])
def test_preempted_run_gives_the_tokens_of_an_unpreempted_one(tiny, sampling):
    requests = _requests(**sampling)
    roomy, want = _run(tiny, requests, num_blocks=NUM_REQUESTS * 7)  # every request fits at once
    # One request needs at most ceil((14 + 12) / 4) = 7 blocks: 8 hold one, never all four.
    tight, got = _run(tiny, requests, num_blocks=8)
    assert roomy.scheduler.num_preemptions == 0 and not any(r.num_preemptions for r in want)
    assert tight.scheduler.num_preemptions > 0
    preempted = [r.request_id for r in got if r.num_preemptions]
    assert preempted and sum(r.num_preemptions for r in got) == tight.scheduler.num_preemptions
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert all(len(r.output_token_ids) == MAX_TOKENS for r in got)
    tight.block_manager.check_invariants([])
    assert tight.block_manager.num_free_blocks == 8
