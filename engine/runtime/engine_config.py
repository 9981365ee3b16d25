"""The engine's own settings: cache geometry, batch limits, numerics mode. Independent of the
model (that is :class:`~kvbatch.engine.models.config.ModelConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineConfig:
    """Knobs of the engine, independent of the model."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (decode tokens + prefill chunks)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Pad small GEMMs so that a row's result does not depend on how many other rows share the
    # step (bitwise batch invariance on CPU BLAS; costs up to ~2x at batch 1, off by default).
    batch_invariant: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
