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
from kvbatch.engine.runtime.kv_connector import TierCost
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig, MemoryTier, ObjectStoreTier
from kvbatch.engine.spec import EngineSpec
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
                                EngineSpec(dtype="fp32", block_size=BLOCK).kv_fingerprint(ckpt.fingerprint))
    prefill = _llm(ckpt, store, write=True)
    prefill.generate([GenerationRequest(r.request_id, r.sampling, prompt_token_ids=r.prompt_token_ids, prefill_only=True)
                      for r in requests])
    assert prefill.connector.stats.blocks_written == sum(n // BLOCK for n in PROMPT_LENS)
    prefill.connector.flush()  # the end of the prefill: the segment is written for other readers
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


# ---------------------------------------------------------------- per tier (issue 14)


def _object_only(store: KVStore) -> KVStore:
    return KVStore([ObjectStoreTier(store.durable.url)], store.fingerprint)


def _decode_with(setup, store: KVStore, costs: dict[str, TierCost], prefill_tokens_per_s: float = 1e3,
                 usd_per_device_s: float = 0.0):
    ckpt, _, requests, want = setup
    llm = _llm(ckpt, store)
    llm.connector.tier_costs = costs
    llm.connector.prefill_tokens_per_s = prefill_tokens_per_s
    llm.connector.usd_per_device_s = usd_per_device_s
    out = llm.generate(requests)
    assert [r.output_token_ids for r in out] == want
    return llm, out


def test_blocks_on_a_fast_tier_load_and_those_on_a_slow_tier_recompute(setup):
    ckpt, store, requests, _ = setup
    two = KVStore([MemoryTier(1 << 24), ObjectStoreTier(store.durable.url)], store.fingerprint)
    warm = _llm(ckpt, two)  # loads the first request's blocks once: they are promoted into memory
    warm.connector.tier_costs, warm.connector.prefill_tokens_per_s = {"object": TierCost(bytes_per_s=1e12)}, 1.0
    warm.generate([GenerationRequest("w", requests[0].sampling, prompt_token_ids=requests[0].prompt_token_ids,
                                     prefill_only=True)])
    promoted = warm.connector.stats.tokens_loaded_by_tier["object"]  # the blocks now in memory as well
    assert promoted >= BLOCK
    llm, out = _decode_with(setup, two, {"memory": TierCost(bytes_per_s=1e12), "object": TierCost(bytes_per_s=1.0)})
    s = llm.connector.stats
    # The first request loads its leading blocks from memory and recomputes any behind them that
    # only the slow object tier holds; the others, held by the object tier only, recompute.
    assert dict(s.decisions) == {"load": 1, "recompute": 2}
    assert dict(s.tokens_loaded_by_tier) == {"memory": promoted}
    assert dict(s.decisions_by_tier) == {"memory:load": promoted // BLOCK,
                                         "object:recompute": sum(n // BLOCK for n in PROMPT_LENS) - promoted // BLOCK}
    assert [r.num_loaded_tokens for r in out] == [promoted, 0, 0]


@pytest.mark.parametrize(("cost", "usd_per_device_s", "decision"), [
    (TierCost(bytes_per_s=1e12, request_s=0.0), 0.0, "load"),
    (TierCost(bytes_per_s=1e12, request_s=10.0), 0.0, "recompute"),  # a slow first byte outweighs it
    (TierCost(bytes_per_s=1e12, usd_per_request=1.0), 1e-3, "recompute"),  # a GET dearer than the compute
])
def test_a_tiers_request_cost_is_in_the_decision(setup, cost, usd_per_device_s, decision):
    _, store, _, _ = setup
    llm, _ = _decode_with(setup, _object_only(store), {"object": cost}, usd_per_device_s=usd_per_device_s)
    assert dict(llm.connector.stats.decisions) == {decision: len(PROMPT_LENS)}
    assert llm.connector.stats.to_json()["retain_or_recompute"]["bytes_per_s_by_tier"]["object"] > 0
