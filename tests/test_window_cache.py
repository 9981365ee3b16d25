"""Sliding layers keep only their window (engine/runtime/window_blocks.py), in the paged cache, the
prefix cache and the KV store, and the answers stay transformers': a tiny Gemma 3 (window 4,
blocks of 4 tokens) under prompts of 30-60 tokens, so most of every prompt is outside the window."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.block_hash import chain_keys, window_key
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.model_runner import ModelRunner
from kvbatch.engine.runtime.window_blocks import window_pool_blocks
from tests.family_checks import greedy
from tests.kv_roundtrip import fp32_store, store_round_trip
from tests.test_gemma3 import WINDOW, build_tiny_gemma3
from tests.tiny_models import VOCAB

torch.set_num_threads(1)

BS = 4


def _long_prompts(seed: int = 5) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"L{i}": torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate([33, 60, 41, 52])}


def _reference(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()


def test_sliding_layers_hold_only_their_window_and_answer_as_transformers(tmp_path):
    """Two sequences at a time, 16 tokens a step: the window pool has 13 blocks for what the full
    layers keep in up to 128, no running sequence ever holds more than its window's blocks
    after a step, the pool's blocks are reused many times over, and the tokens are transformers'."""
    ref = build_tiny_gemma3(tmp_path)
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=BS, max_num_seqs=2, max_num_batched_tokens=16))
    pool = llm.block_manager.window
    assert pool is not None and pool.num_blocks == window_pool_blocks(WINDOW, BS, 2, 16) == 13
    assert llm.runner.kv_window.shape[2] == 13 and llm.runner.kv_cache.shape[2] == 2 * 256 // BS
    # 1 full layer of 3 over every block, 2 sliding layers over 13 blocks
    assert llm.runner.kv_cache.shape[0] == 1 and llm.runner.kv_window.shape[0] == 2
    per_layer_block = ModelRunner.window_bytes_per_block(llm.model, BS, llm.dtype) // 2
    assert ModelRunner.bytes_per_block(llm.model, BS, llm.dtype) == per_layer_block

    prompts = _long_prompts()
    for rid, prompt in prompts.items():
        llm.add_request(GenerationRequest(rid, greedy(10), prompt_token_ids=prompt))
    out: dict[str, list[int]] = {}
    taken = 0
    while llm.scheduler.has_work():
        before = pool.num_free_blocks
        for r in llm.step():
            out[r.request_id] = r.output_token_ids
        taken += max(0, before - pool.num_free_blocks)
        for seq in llm.scheduler.running:  # the window before its last block boundary, and its last blocks
            assert pool.held(seq) <= -(-(WINDOW - 1) // BS) + 3, (seq.request_id, seq.window_table)
        llm.block_manager.check_invariants(llm.scheduler.running)
    total_blocks = sum(-(-(len(p) + 10) // BS) for p in prompts.values())
    assert total_blocks == 58 > 3 * pool.num_blocks  # the run needed far more blocks than the pool has
    for rid, prompt in prompts.items():
        assert out[rid] == _reference(ref, prompt, 10), rid


def test_a_prefix_hit_needs_the_window_before_it(tmp_path):
    """A prompt sharing 40 tokens of an earlier one hits the prefix cache only as far as the window
    pool still holds the window before the hit; its answer is transformers'."""
    ref = build_tiny_gemma3(tmp_path)
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=BS, max_num_seqs=4))
    first = _long_prompts()["L1"]
    llm.generate([GenerationRequest("a", greedy(4), prompt_token_ids=first)])
    second = first[:40] + [5, 6, 7, 8, 9]
    [res] = llm.generate([GenerationRequest("b", greedy(8), prompt_token_ids=second)])
    assert res.num_cached_tokens == 40  # the window pool kept the keyed blocks that left a's window
    assert res.output_token_ids == _reference(ref, second, 8)
    # Drop the window blocks a's prompt left behind: the full layers' blocks alone are no hit.
    pool = llm.block_manager.window
    for key in list(pool.key_to_block):
        pool.key[pool.key_to_block.pop(key)] = None
    [res] = llm.generate([GenerationRequest("c", greedy(8), prompt_token_ids=second)])
    assert res.num_cached_tokens == 0 and res.output_token_ids == _reference(ref, second, 8)


def test_the_kv_store_holds_full_layers_whole_and_each_prompts_last_window(tmp_path):
    """Prefill -> store -> decode equals in-process generate; the store holds the full layers of
    every full prompt block and the sliding layers of the blocks a decode's hit needs: the window
    before the prompt's last block boundary, not one block more."""
    build_tiny_gemma3(tmp_path / "m")
    ckpt = load_checkpoint(str(tmp_path / "m"))
    trip = store_round_trip(ckpt, (tmp_path / "kv").as_uri(), VOCAB, block_size=BS, num_blocks=128, max_num_seqs=8,
                            batch_invariant=True)
    assert trip.decoded == trip.reference
    assert trip.decoder.connector.stats.blocks_loaded > 0
    pool = trip.prefill.block_manager.window
    store = fp32_store(ckpt, (tmp_path / "kv").as_uri(), BS)
    chains = {rid: _chain(trip.prefill, prompt) for rid, prompt in trip.prompts.items()}
    # a prefill stage computes up to the block boundary before the last token (the decode's hit),
    # and stores the window before that boundary's block (the prompts share their first 6 blocks)
    windows = set()
    for rid, prompt in trip.prompts.items():
        end = (len(prompt) - 1) // BS * BS
        windows |= {window_key(k) for k in chains[rid][pool.first_kept(end):end // BS]}
    every = sorted({k for chain in chains.values() for k in chain})
    assert all(r == "" for r in store.lookup(every))  # full layers: every full block
    held = [window_key(k) for k in every]
    assert [r == "" for r in store.lookup(held)] == [k in windows for k in held]
    assert len(windows) == 5 and len(every) == 10  # half the blocks' sliding layers were never stored


def _chain(llm: LLM, prompt: list[int]) -> list[str]:
    return chain_keys(llm.kv_root_key, prompt, BS)


CONFIG = {"block_size": BS, "num_blocks": 128, "max_num_seqs": 4}


def _stored(tmp_path, prompt: list[int]) -> tuple[object, object, str, LLM]:
    """A tiny Gemma 3 (transformers' model, its checkpoint), a KV store's URL, and the engine that
    prefilled ``prompt`` into that store."""
    ref = build_tiny_gemma3(tmp_path / "m")
    ckpt = load_checkpoint(str(tmp_path / "m"))
    url = (tmp_path / "kv").as_uri()
    pre = LLM(ckpt, engine_config=EngineConfig(**CONFIG), kv_store=fp32_store(ckpt, url, BS))
    pre.generate([GenerationRequest("p", greedy(), prompt_token_ids=prompt, prefill_only=True)])
    pre.connector.flush()
    return ref, ckpt, url, pre


def test_a_stored_prefix_without_its_window_is_recomputed(tmp_path):
    """A new prompt that shares a stored prompt's first 40 tokens: the store holds those blocks' full
    layers but not the window before token 40 (only the stored prompt's last window), so nothing is
    loaded ("window" miss) and the answer is transformers'; the stored prompt itself loads."""
    stored = _long_prompts()["L1"]
    ref, ckpt, url, _ = _stored(tmp_path, stored)
    other = stored[:40] + [9, 8, 7]
    dec = LLM(ckpt, engine_config=EngineConfig(**CONFIG), kv_store=fp32_store(ckpt, url, BS))
    [res] = dec.generate([GenerationRequest("o", greedy(8), prompt_token_ids=other)])
    assert res.output_token_ids == _reference(ref, other, 8)
    assert dec.connector.stats.blocks_loaded == 0 and dec.connector.stats.misses_by_reason["window"] == 1
    dec = LLM(ckpt, engine_config=EngineConfig(**CONFIG), kv_store=fp32_store(ckpt, url, BS))
    [res] = dec.generate([GenerationRequest("s", greedy(8), prompt_token_ids=stored)])
    assert res.output_token_ids == _reference(ref, stored, 8)
    hit = (len(stored) - 1) // BS  # 14 blocks' full layers and the window before token 56: one block
    assert dec.connector.stats.blocks_loaded == hit + 1 and res.num_loaded_tokens == hit * BS
    assert sum(dec.connector.stats.tokens_loaded_by_tier.values()) == hit * BS  # the window part adds no tokens


class _LosesWindows:
    """A store that says it holds every window part but returns none of them (a torn write)."""

    def __init__(self, store, windows: set[str]) -> None:
        self.store = store
        self.windows = windows

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get_many(self, keys):
        got = self.store.get_many(keys)
        return [(None, "checksum") if k in self.windows else g for k, g in zip(keys, got)]


def test_a_window_that_fails_to_load_is_recomputed(tmp_path):
    """The store lists the window but its read fails: the sequence goes back to the queue, is
    recomputed without the store, and answers as transformers do."""
    prompt = _long_prompts()["L3"]
    ref, ckpt, url, pre = _stored(tmp_path, prompt)
    broken = _LosesWindows(fp32_store(ckpt, url, BS), {window_key(k) for k in _chain(pre, prompt)})
    dec = LLM(ckpt, engine_config=EngineConfig(**CONFIG), kv_store=broken)
    [res] = dec.generate([GenerationRequest("s", greedy(8), prompt_token_ids=prompt)])
    assert res.output_token_ids == _reference(ref, prompt, 8)
    assert dec.connector.stats.misses_by_reason["checksum"] == 1
    assert dec.stats["computed_prompt_tokens"] == len(prompt)
