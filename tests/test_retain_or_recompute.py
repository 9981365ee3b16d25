"""Retain-or-recompute (engine/runtime/kv_connector.py): a request whose prompt blocks the KV
store holds loads them when ``n * block_bytes / load_bandwidth`` is below the recompute estimate
``n * block_size / prefill_tokens_per_s``, and recomputes them otherwise. Both branches, driven
by those two figures: the decision counters, the loaded and computed token counts, and the same
tokens either way."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.io.kv_store import KVStore, KVStoreConfig
from kvbatch.ops.shards import kv_fingerprint
from tests.tiny_models import VOCAB, build_tiny

BLOCK = 4
PROMPT_LENS = (13, 18, 9)  # 3, 4 and 2 full blocks; the last token is never covered by a block


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint, store holding every prompt's full blocks, requests, tokens of a store-less run)."""
    folder = tmp_path_factory.mktemp("ror_model")
    build_tiny("llama", folder, seed=0)
    ckpt = load_checkpoint(str(folder))
    g = torch.Generator().manual_seed(5)
    requests = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                  prompt_token_ids=torch.randint(3, VOCAB, (n,), generator=g).tolist())
                for i, n in enumerate(PROMPT_LENS)]
    want = [r.output_token_ids for r in _llm(ckpt).generate(requests)]
    store = KVStore.from_config(KVStoreConfig(url=(tmp_path_factory.mktemp("ror_kv")).as_uri()),
                                kv_fingerprint(ckpt.fingerprint, "fp32", BLOCK))
    prefill = _llm(ckpt, store, write=True)
    prefill.generate([GenerationRequest(r.request_id, r.sampling, prompt_token_ids=r.prompt_token_ids, prefill_only=True)
                      for r in requests])
    assert prefill.connector.stats.blocks_written == sum(n // BLOCK for n in PROMPT_LENS)
    return ckpt, store, requests, want


def _llm(ckpt, store=None, write: bool = False) -> LLM:
    # Batch-invariant: loaded KV and recomputed KV are then the same bits, so are the tokens.
    return LLM(ckpt, engine_config=EngineConfig(block_size=BLOCK, num_blocks=64, max_num_seqs=4,
                                                batch_invariant=True), kv_store=store, kv_store_write=write)


def _decode(setup, load_bytes_per_s: float, prefill_tokens_per_s: float):
    ckpt, store, requests, want = setup
    llm = _llm(ckpt, store)
    llm.connector.load_bytes_per_s = load_bytes_per_s
    llm.connector.prefill_tokens_per_s = prefill_tokens_per_s
    out = llm.generate(requests)
    assert [r.output_token_ids for r in out] == want  # the same tokens whichever way the KV came
    return llm, out


def test_fast_store_slow_prefill_loads(setup):
    # A block (2 layers x K/V x 4 tokens x 2 heads x 16 dims x 4 bytes = 2 KiB) in a microsecond
    # against 4 tokens in 4 s of prefill: fetching wins by far, and stays ahead as the measured
    # rates pull both figures towards this machine's (the updates are moving averages).
    llm, out = _decode(setup, load_bytes_per_s=1e12, prefill_tokens_per_s=1.0)
    assert llm.block_bytes == 2048
    s = llm.connector.stats
    assert dict(s.decisions) == {"load": len(PROMPT_LENS)}
    assert 0 < s.est_load_s < s.est_recompute_s
    full = [n // BLOCK * BLOCK for n in PROMPT_LENS]
    assert [r.num_loaded_tokens for r in out] == full
    assert s.blocks_loaded == sum(full) // BLOCK
    assert llm.stats["computed_prompt_tokens"] == sum(PROMPT_LENS) - sum(full)  # only the tails


def test_slow_store_fast_prefill_recomputes(setup):
    # One byte a second against a trillion tokens a second: recomputing wins; nothing is fetched.
    llm, out = _decode(setup, load_bytes_per_s=1.0, prefill_tokens_per_s=1e12)
    s = llm.connector.stats
    assert dict(s.decisions) == {"recompute": len(PROMPT_LENS)}
    assert 0 < s.est_recompute_s < s.est_load_s
    assert [r.num_loaded_tokens for r in out] == [0] * len(PROMPT_LENS)
    assert s.blocks_loaded == 0 and not s.bytes_loaded_by_tier
    assert llm.stats["computed_prompt_tokens"] == sum(PROMPT_LENS)  # every prompt token computed
