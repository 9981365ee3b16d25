"""The model that prefills and decodes, and how the engine runs it."""

from __future__ import annotations

import threading
from typing import Any, Literal

import dagster as dg
from pydantic import Field, field_validator

_CHECKPOINTS: dict[str, Any] = {}
_LOCK = threading.Lock()


def _checkpoint(model: str) -> Any:
    """Checkpoints are cached per process: every step of an in-process run shares one load."""
    from kvbatch.engine.models.weights import load_checkpoint

    with _LOCK:
        if model not in _CHECKPOINTS:
            _CHECKPOINTS[model] = load_checkpoint(model)
        return _CHECKPOINTS[model]


class ModelResource(dg.ConfigurableResource):
    """A Hugging Face folder (local or fsspec URL), a ``.gguf`` file or ``smollm2-135m``, and the
    engine settings every step uses (the KV layout depends on ``dtype``: prefill and decode must
    agree, which is why both read this one resource)."""

    model: str = Field(default="smollm2-135m", description="model folder, .gguf file or 'smollm2-135m'")
    dtype: Literal["fp32", "bf16"] = Field(default="fp32", description="weights, activations and KV cache")
    max_batch: int = Field(default=64, ge=1, description="most sequences decoded together")
    max_step_tokens: int = Field(default=2048, ge=16, description="token budget of one engine step")
    kv_cache_gb: float = Field(default=1.0, gt=0, description="memory for the paged KV cache")
    seed: int = Field(default=0, description="seed for requests that give none")
    threads: int | None = Field(default=None, ge=1, description="torch threads (default: all cores)")
    deterministic: bool = Field(default=False, description="batch-invariant numerics")
    spec: str | None = Field(default=None, description="speculative decoding at decode: ngram, draft:MODEL or "
                                                        "early-exit:K (none by default)")
    spec_max_len: int = Field(default=8, ge=1, description="most tokens drafted per step")
    spec_adaptive: bool = Field(default=True, description="adaptive, cost-aware draft length")

    @field_validator("spec")
    @classmethod
    def _check_spec(cls, value: str | None) -> str | None:
        if value:
            from kvbatch.engine.speculative.controller import SpecConfig

            SpecConfig.parse(value)  # raises with the accepted forms named
        return value or None

    def speculative(self) -> dict[str, Any] | None:
        """The decode worker's ``speculative`` entry (None: plain decoding)."""
        if not self.spec:
            return None
        return {"method": self.spec, "max_len": self.spec_max_len, "adaptive": self.spec_adaptive}

    def engine_config(self) -> Any:
        from kvbatch.engine.runtime.engine_config import EngineConfig

        return EngineConfig(max_num_seqs=self.max_batch, max_num_batched_tokens=self.max_step_tokens,
                            kv_cache_bytes=int(self.kv_cache_gb * (1 << 30)), batch_invariant=self.deterministic)

    def kv_fingerprint(self) -> str:
        from kvbatch.ops.shards import kv_fingerprint

        return kv_fingerprint(_checkpoint(self.model).fingerprint, self.dtype, self.engine_config().block_size)

    def load(self, kv_store: Any = None, decode: bool = False) -> Any:
        """A fresh ``LLM`` (engines are cheap next to the weights, which are shared); ``decode``:
        with the speculative drafter, if one is configured (prefill never drafts)."""
        from kvbatch.engine.runtime.llm import LLM
        from kvbatch.engine.speculative.controller import SpecConfig

        spec = None
        if decode and self.spec:
            spec = SpecConfig.parse(self.spec, self.spec_max_len, self.spec_adaptive)
        return LLM(_checkpoint(self.model), dtype=self.dtype, engine_config=self.engine_config(),
                   kv_store=kv_store, seed=self.seed, num_threads=self.threads, speculative=spec)
