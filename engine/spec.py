"""``EngineSpec``: every setting that decides a run's numbers, in one plain record.

The CLI, the Dagster resources, ``kvbatch serve`` and every worker describe the engine they want
as an ``EngineSpec`` and hand it to the one builder (:func:`kvbatch.ops.engine_build.build_llm`),
so they can never disagree on the model, the dtype, the weight format or the KV layout. The KV
layout's identity is derived here and nowhere else: :meth:`EngineSpec.kv_root_key` roots every
block key, :meth:`EngineSpec.kv_fingerprint` is what the KV store checks blocks against, and both
include the weight format (int8 or GGUF weights give other K/V than full ones: their blocks must
never mix).

Torch-free: a tokenizing step derives block keys from a spec without loading the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvbatch.engine.runtime.block_hash import kv_layout_dtype, root_key, store_fingerprint
from kvbatch.engine.runtime.engine_config import (
    LINEAR_CHOICES,
    EngineConfig,
    dtype_name,
    parse_device_spec,
)

DEFAULT_MODEL = "smollm2-135m"
WEIGHT_FORMATS = ("full", "int8", "gguf")


@dataclass(frozen=True)
class EngineSpec:
    """The engine a run asks for. ``dtype`` None means the device's default (bf16 on CUDA, fp32
    on the CPU), fixed by :meth:`resolved` once the device is known."""

    model: str = DEFAULT_MODEL  # a Hugging Face folder (local or fsspec URL), a .gguf file, or smollm2-135m
    dtype: str | None = None  # fp32 | bf16 (weights, activations and KV cache)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    weights: str = "full"  # full | int8 | gguf (dense projection weights)
    linear: str = "auto"  # CPU projection kernel: auto | onednn | blas | mkl
    deterministic: bool = False  # batch-invariant numerics
    block_size: int = 16  # tokens per KV block
    max_batch: int = 64  # most sequences decoded together
    max_step_tokens: int = 2048  # token budget of one engine step
    kv_cache_gb: float = 1.0  # memory for the paged KV cache (CPU)
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory the engine may hold
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    seed: int = 0  # seed for requests that give none
    threads: int | None = None  # torch threads (None: all cores)
    speculative: str | None = None  # ngram | draft:MODEL | early-exit:K | suffix:ANSWERS (None: plain)
    spec_max_len: int = 8  # most tokens drafted per step
    spec_adaptive: bool = True  # adaptive, cost-aware draft length
    # fsspec options for suffix:ANSWERS on an object store (out of repr: they may hold credentials)
    spec_corpus_options: dict | None = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype is not None:
            dtype_name(self.dtype)  # raises naming the accepted names
        parse_device_spec(self.device)
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.linear not in LINEAR_CHOICES:
            raise ValueError(f"linear must be one of {', '.join(LINEAR_CHOICES)}, got {self.linear!r}")
        if self.block_size < 1 or self.max_batch < 1 or self.max_step_tokens < 1:
            raise ValueError("block_size, max_batch and max_step_tokens must be >= 1")
        if not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative:
            self.spec_config()  # raises with the accepted forms named

    # -- the numbers' identity ----------------------------------------------------------------
    def kv_dtype(self) -> str:
        """The KV layout's dtype with the weight format (:func:`~kvbatch.engine.runtime.block_hash.kv_layout_dtype`)."""
        if self.dtype is None:
            raise ValueError("the spec's dtype follows its device: resolve it first "
                             "(kvbatch.ops.engine_build.resolved) before deriving KV keys")
        return kv_layout_dtype(self.dtype, self.weights)

    def kv_root_key(self, model_fingerprint: str) -> str:
        """The root of every block key of this engine over a model with ``model_fingerprint``."""
        return root_key(model_fingerprint, self.kv_dtype(), self.block_size)

    def kv_fingerprint(self, model_fingerprint: str) -> str:
        """What the KV store checks every block against: the exact KV layout of this engine."""
        return store_fingerprint(model_fingerprint, self.kv_dtype(), self.block_size)

    # -- what the engine is built from ---------------------------------------------------------
    def resolved(self, device: Any) -> EngineSpec:
        """This spec with ``dtype`` fixed for ``device`` (a ``torch.device`` or its name)."""
        if self.dtype is not None:
            return self
        from kvbatch.engine.runtime.engine_config import default_dtype_name

        return dataclasses.replace(self, dtype=default_dtype_name(device))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(block_size=self.block_size, max_num_seqs=self.max_batch,
                            max_num_batched_tokens=self.max_step_tokens,
                            kv_cache_bytes=int(self.kv_cache_gb * (1 << 30)), batch_invariant=self.deterministic,
                            device=self.device, gpu_memory_utilization=self.gpu_memory_utilization,
                            enforce_eager=self.enforce_eager, linear=self.linear, weights=self.weights)

    def spec_config(self) -> Any:
        """The speculative-decoding config, or None for plain decoding."""
        if not self.speculative:
            return None
        from kvbatch.engine.speculative.controller import SpecConfig

        return SpecConfig.parse(self.speculative, self.spec_max_len, self.spec_adaptive, self.spec_corpus_options)

    # -- on the wire (worker spec files, Pipes extras) -------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> EngineSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"unknown engine spec field(s): {', '.join(unknown)}")
        return cls(**doc)
