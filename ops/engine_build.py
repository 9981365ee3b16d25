"""The one builder: an :class:`~kvbatch.engine.spec.EngineSpec` into an ``LLM``, its KV store and
its KV fingerprint.

Every entry point (the CLI, the Dagster resources, ``kvbatch serve``'s batches, the worker ranks)
builds its engine here and nowhere else, so a prefill and the decode that reads its blocks, or
the shard step that keys blocks without loading weights, always agree on the KV layout.

A long-lived process (the Dagster code location's steps) keeps checkpoints (``keep=True``: by
model and, for an expert-parallel rank, the experts it holds) and the model built from each (by
everything its weights' preparation depends on: dtype, device, numerics mode, linear kernels,
weight format), so every step of an in-process run shares one load and one preparation: a shard
run's decode builds its engine in well under a second after its prefill built the same one
(docs/pipeline.md#one-process-per-run). A one-shot process (the CLI, a worker rank) does not hold
them past its engine. A kept checkpoint's fingerprint is also remembered (:mod:`kvbatch.ops.fingerprint`) for
steps that only tokenize.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvbatch.engine.spec import EngineSpec

_CHECKPOINTS: dict[tuple[str, Any, bool], Any] = {}  # by (model, experts, keep_fp8)
_MODELS: dict[tuple[Any, ...], Any] = {}  # built models of kept checkpoints (module docstring)
_LOCK = threading.Lock()


def _experts_key(experts: Mapping[int, Sequence[int]] | None) -> Any:
    return None if experts is None else tuple(sorted((int(k), tuple(sorted(v))) for k, v in experts.items()))


def load_checkpoint(model: str, experts: Mapping[int, Sequence[int]] | None = None, *, keep: bool = False,
                    keep_fp8: bool = False) -> Any:
    """``model``'s checkpoint (``experts``: an expert-parallel rank's share of a MoE model's
    experts, see :func:`~kvbatch.engine.models.expert_loading.load_expert_share`); ``keep``: loaded once
    per process and kept for later calls; ``keep_fp8``: an FP8 checkpoint's projections also as
    published, for a CUDA model's block-scaled GEMM."""
    from kvbatch.engine.models import weights
    from kvbatch.engine.models.expert_loading import load_expert_share
    from kvbatch.ops.fingerprint import identity_of_checkpoint, remember

    key = (model, _experts_key(experts), keep_fp8)
    with _LOCK:
        ckpt = _CHECKPOINTS.get(key)
        if ckpt is None:
            # (a share of a quantized checkpoint is refused by load_expert_share, naming it)
            ckpt = (weights.load_checkpoint(model, keep_fp8=keep_fp8) if experts is None
                    else load_expert_share(model, experts))
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

    loaded = next((c for (m, *_), c in _CHECKPOINTS.items() if m == model), None)
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

    from kvbatch.engine.runtime.engine_config import resolve_device

    spec = resolved(spec)
    on_cuda = resolve_device(spec.device).type == "cuda"  # FP8 projections stay FP8 there
    ckpt = load_checkpoint(spec.model, experts, keep=keep, keep_fp8=on_cuda)
    if isinstance(kv_store, KVStoreConfig):
        kv_store = open_kv_store(spec, kv_store)
    expected = spec.kv_fingerprint(ckpt.fingerprint)
    if kv_store is not None and getattr(kv_store, "fingerprint", expected) != expected:
        raise ValueError(f"the KV store checks blocks against fingerprint {kv_store.fingerprint}, but this engine "
                         f"({spec.model}, {spec.kv_dtype()}, block {spec.block_size}) writes {expected}: "
                         f"open the store with open_kv_store(spec, ...)")
    config = spec.engine_config()
    # What the prepared weights depend on; the rest of the config (batch limits, KV budget) is the
    # engine's, built fresh each time. A model is shared by engines used one after another (a
    # run's steps), never by two engines stepping at once: each step builds and drops its own.
    model_key = (spec.model, _experts_key(experts), spec.dtype, config.device, config.batch_invariant,
                 config.linear, config.weights)
    llm = LLM(ckpt, dtype=spec.dtype, engine_config=config, kv_store=kv_store, seed=spec.seed,
              num_threads=spec.threads, speculative=spec.spec_config() if decode else None,
              built_model=_MODELS.get(model_key) if keep else None)
    if keep:
        with _LOCK:
            _MODELS[model_key] = llm.model
    return llm
