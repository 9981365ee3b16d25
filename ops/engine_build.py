"""The one builder: an :class:`~kvbatch.engine.spec.EngineSpec` into an ``LLM``, its KV store and
its KV fingerprint.

Every entry point (the CLI, the Dagster resources, ``kvbatch serve``'s batches, the worker ranks)
builds its engine here and nowhere else, so a prefill and the decode that reads its blocks, or
the shard step that keys blocks without loading weights, always agree on the KV layout.

A long-lived process (the Dagster code location's steps) keeps checkpoints (``keep=True``: by
model and, for an expert-parallel rank, the experts it holds), so every step of an in-process
run shares one load; a one-shot process (the CLI, a worker rank) does not hold them past its
engine. A kept checkpoint's fingerprint is also remembered (:mod:`kvbatch.ops.fingerprint`) for
steps that only tokenize.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvbatch.engine.spec import EngineSpec

_CHECKPOINTS: dict[tuple[str, Any], Any] = {}
_LOCK = threading.Lock()


def _experts_key(experts: Mapping[int, Sequence[int]] | None) -> Any:
    return None if experts is None else tuple(sorted((int(k), tuple(sorted(v))) for k, v in experts.items()))


def load_checkpoint(model: str, experts: Mapping[int, Sequence[int]] | None = None, *, keep: bool = False) -> Any:
    """``model``'s checkpoint (``experts``: an expert-parallel rank's share of a MoE model's
    experts, see :func:`~kvbatch.engine.models.weights.load_checkpoint`); ``keep``: loaded once
    per process and kept for later calls."""
    from kvbatch.engine.models import weights
    from kvbatch.ops.fingerprint import identity_of_checkpoint, remember

    key = (model, _experts_key(experts))
    with _LOCK:
        ckpt = _CHECKPOINTS.get(key)
        if ckpt is None:
            ckpt = weights.load_checkpoint(model, experts=experts)
            if keep:
                _CHECKPOINTS[key] = ckpt
                # Its weights were just hashed: keep the fingerprint for the steps that only tokenize.
                remember(model, identity_of_checkpoint(ckpt))
        return ckpt


def model_fingerprint(model: str) -> str:
    """The weights' fingerprint: from a checkpoint loaded in this process if any, else the kept
    one (:func:`kvbatch.ops.fingerprint.model_identity`): an orchestrating step never hashes
    weights it has seen before."""
    from kvbatch.ops.fingerprint import model_identity

    loaded = next((c for (m, _), c in _CHECKPOINTS.items() if m == model), None)
    return loaded.fingerprint if loaded is not None else model_identity(model).fingerprint


def resolved(spec: EngineSpec) -> EngineSpec:
    """``spec`` with its dtype fixed by its device (bf16 on CUDA, fp32 on the CPU)."""
    if spec.dtype is not None:
        return spec
    from kvbatch.engine.runtime.engine_config import resolve_device

    return spec.resolved(resolve_device(spec.device))


def kv_fingerprint(spec: EngineSpec) -> str:
    """The KV store fingerprint of ``spec``'s engine (weights, dtype, weight format, block size)."""
    spec = resolved(spec)
    return spec.kv_fingerprint(model_fingerprint(spec.model))


def open_kv_store(spec: EngineSpec, config: Any) -> Any:
    """The tiered KV store of ``config`` (a :class:`~kvbatch.io.kvstore.store.KVStoreConfig`),
    checking blocks against ``spec``'s KV fingerprint."""
    from kvbatch.io.kvstore.store import KVStore

    return KVStore.from_config(config, kv_fingerprint(spec))


def build_llm(spec: EngineSpec, kv_store: Any = None, *, decode: bool = True,
              experts: Mapping[int, Sequence[int]] | None = None, keep: bool = False) -> Any:
    """The ``LLM`` of ``spec``. ``kv_store``: a store opened by :func:`open_kv_store` (or a
    :class:`~kvbatch.io.kvstore.store.KVStoreConfig`, opened here); its fingerprint must be this
    engine's. ``decode``: with the speculative drafter, if the spec names one (prefill never
    drafts). ``experts``: an expert-parallel rank loads only these. ``keep``: see
    :func:`load_checkpoint`."""
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.io.kvstore.store import KVStoreConfig

    spec = resolved(spec)
    ckpt = load_checkpoint(spec.model, experts, keep=keep)
    if isinstance(kv_store, KVStoreConfig):
        kv_store = open_kv_store(spec, kv_store)
    expected = spec.kv_fingerprint(ckpt.fingerprint)
    if kv_store is not None and getattr(kv_store, "fingerprint", expected) != expected:
        raise ValueError(f"the KV store checks blocks against fingerprint {kv_store.fingerprint}, but this engine "
                         f"({spec.model}, {spec.kv_dtype()}, block {spec.block_size}) writes {expected}: "
                         f"open the store with open_kv_store(spec, ...)")
    return LLM(ckpt, dtype=spec.dtype, engine_config=spec.engine_config(), kv_store=kv_store, seed=spec.seed,
               num_threads=spec.threads, speculative=spec.spec_config() if decode else None)
