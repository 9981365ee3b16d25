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
    from kvbatch.ops.fingerprint import identity_of_checkpoint, remember

    with _LOCK:
        if model not in _CHECKPOINTS:
            _CHECKPOINTS[model] = load_checkpoint(model)
            # Its weights were just hashed: keep the fingerprint for the steps that only tokenize.
            remember(model, identity_of_checkpoint(_CHECKPOINTS[model]))
        return _CHECKPOINTS[model]


class ModelResource(dg.ConfigurableResource):
    """A Hugging Face folder (local or fsspec URL), a ``.gguf`` file or ``smollm2-135m``, and the
    engine settings every step uses (the KV layout depends on ``dtype``: prefill and decode must
    agree, which is why both read this one resource)."""

    model: str = Field(default="smollm2-135m", description="model folder, .gguf file or 'smollm2-135m'")
    dtype: Literal["fp32", "bf16"] = Field(default="fp32", description="weights, activations and KV cache "
                                           "(bf16 is the usual choice on a GPU)")
    device: str = Field(default="auto", description="auto (CUDA when present), cpu, cuda or cuda:N")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="CUDA: share of GPU memory the "
                                          "engine may hold (the KV cache gets what is left after a warm-up)")
    enforce_eager: bool = Field(default=False, description="CUDA: no CUDA graphs for decode steps")
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

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        # The spelling only: the GPU may be on the worker, not on the machine that loads the config.
        from kvbatch.engine.runtime.engine_config import parse_device_spec

        parse_device_spec(value)
        return value

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
                            kv_cache_bytes=int(self.kv_cache_gb * (1 << 30)), batch_invariant=self.deterministic,
                            device=self.device, gpu_memory_utilization=self.gpu_memory_utilization,
                            enforce_eager=self.enforce_eager)

    def kv_fingerprint(self) -> str:
        """From the weights loaded in this process if any, else the kept fingerprint
        (:mod:`kvbatch.ops.fingerprint`): an orchestrating step never hashes weights."""
        from kvbatch.ops.fingerprint import model_identity
        from kvbatch.ops.shards import kv_fingerprint

        loaded = _CHECKPOINTS.get(self.model)
        fingerprint = loaded.fingerprint if loaded is not None else model_identity(self.model).fingerprint
        return kv_fingerprint(fingerprint, self.dtype, self.engine_config().block_size)

    def row_tokenizer(self) -> Any:
        """What tokenizing steps (``prompt_shards``) need: the tokenizer and the KV key root,
        as ``load()``'s engine would tokenize, with no weights loaded."""
        from kvbatch.ops.shards import RowTokenizer

        return RowTokenizer.for_model(self.model, self.dtype, self.engine_config())

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
