"""Prefill into a KV store in one engine, decode from it in another: the round trip the model
parity tests run for each architecture (the Llama family's in test_kv_handoff, DeepSeek's
compressed blocks, the declared families).

Three prompts share a 26-token system prompt (so their first blocks are one chain in the store),
each with a tail of its own; every engine is built with the same ``EngineConfig`` so that, in
batch-invariant mode, loaded KV equals computed KV to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.spec import EngineSpec
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig

SYSTEM_TOKENS = 26
MAX_TOKENS = 6


def fp32_store(ckpt: Any, url: str, block_size: int) -> KVStore:
    """An object-tier-only store at ``url`` for an fp32 engine over ``ckpt``."""
    return KVStore.from_config(KVStoreConfig(url=url, memory_bytes=0),
                               EngineSpec(dtype="fp32", block_size=block_size).kv_fingerprint(ckpt.fingerprint))


@dataclass
class StoreRoundTrip:
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]  # greedy tokens of an engine with no store
    prefill: LLM  # prefilled every prompt into the store (prefill_only), flushed
    decoder: LLM  # another engine over the same store
    decoded: dict[str, list[int]]  # its greedy tokens, the prompts' blocks loaded

    def requests(self, **kw: Any) -> list[GenerationRequest]:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        return [GenerationRequest(rid, greedy, prompt_token_ids=p, **kw) for rid, p in self.prompts.items()]


def store_round_trip(ckpt: Any, url: str, vocab: int, **config: Any) -> StoreRoundTrip:
    """Generate the prompts without a store, prefill them into the store at ``url``, then decode
    them in a fresh engine that loads their blocks; ``config``: the EngineConfig of all three."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, vocab, (SYSTEM_TOKENS,), generator=g).tolist()
    prompts = {f"q{i}": system + torch.randint(3, vocab, (n,), generator=g).tolist() for i, n in enumerate([3, 9, 5])}
    block_size = config["block_size"]
    trip = StoreRoundTrip(prompts, {}, None, None, {})  # type: ignore[arg-type]
    trip.reference = {r.request_id: r.output_token_ids
                      for r in LLM(ckpt, engine_config=EngineConfig(**config)).generate(trip.requests())}
    trip.prefill = LLM(ckpt, engine_config=EngineConfig(**config), kv_store=fp32_store(ckpt, url, block_size))
    trip.prefill.generate(trip.requests(prefill_only=True))
    trip.prefill.connector.flush()  # the segment is written at the end of a prefill job (or by size, or time)
    trip.decoder = LLM(ckpt, engine_config=EngineConfig(**config), kv_store=fp32_store(ckpt, url, block_size))
    trip.decoded = {r.request_id: r.output_token_ids for r in trip.decoder.generate(trip.requests())}
    return trip
