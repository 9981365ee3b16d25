"""The model that prefills and decodes, and how the engine runs it."""

from __future__ import annotations

from typing import Any, Literal

import dagster as dg
from pydantic import Field, field_validator


def check_device(value: str) -> str:
    """A device spelling (auto, cpu, cuda, cuda:N). The spelling only: the GPU may be on the
    worker, not on the machine that loads the config."""
    from kvbatch.engine.runtime.engine_config import parse_device_spec

    parse_device_spec(value)
    return value


def check_spec(value: str | None) -> str | None:
    """A speculative-decoding method as ``--spec`` takes it, or None; raises naming the accepted forms."""
    if value:
        from kvbatch.engine.speculative.controller import SpecConfig

        SpecConfig.parse(value)
    return value or None


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
    weights: Literal["full", "int8", "gguf"] = Field(default="full", description="dense projection weights: full "
                                                     "(the dtype), int8 (weight-only, CPU) or gguf (the file's own "
                                                     "blocks, CPU); part of the KV fingerprint")
    linear: Literal["auto", "onednn", "blas", "mkl"] = Field(default="auto", description="CPU projection kernel "
                                                             "(auto: measured on the machine at load)")
    spec: str | None = Field(default=None, description="speculative decoding at decode: ngram, draft:MODEL, "
                                                        "early-exit:K, suffix:ANSWERS (earlier runs' results "
                                                        "Parquet or output JSONL) or suffix:last-night (this "
                                                        "pipeline's results of its latest earlier day); none by "
                                                        "default")
    spec_max_len: int = Field(default=8, ge=1, description="most tokens drafted per step")
    spec_adaptive: bool = Field(default=True, description="adaptive, cost-aware draft length")

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        return check_device(value)

    @field_validator("spec")
    @classmethod
    def _check_spec(cls, value: str | None) -> str | None:
        return check_spec(value)

    def engine_spec(self) -> Any:
        """The :class:`~kvbatch.engine.spec.EngineSpec` every step builds from (the one builder,
        :mod:`kvbatch.ops.engine_build`, derives the engine and the KV fingerprint from it)."""
        from kvbatch.engine.spec import EngineSpec

        return EngineSpec(model=self.model, dtype=self.dtype, device=self.device, weights=self.weights,
                          linear=self.linear, deterministic=self.deterministic, max_batch=self.max_batch,
                          max_step_tokens=self.max_step_tokens, kv_cache_gb=self.kv_cache_gb,
                          gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=self.enforce_eager,
                          seed=self.seed, threads=self.threads, speculative=self.spec,
                          spec_max_len=self.spec_max_len, spec_adaptive=self.spec_adaptive)

    def engine_config(self) -> Any:
        return self.engine_spec().engine_config()

    def kv_fingerprint(self) -> str:
        """From the weights loaded in this process if any, else the kept fingerprint
        (:mod:`kvbatch.ops.fingerprint`): an orchestrating step never hashes weights."""
        from kvbatch.ops.engine_build import kv_fingerprint

        return kv_fingerprint(self.engine_spec())

    def row_tokenizer(self) -> Any:
        """What tokenizing steps (``prompt_shards``) need: the tokenizer and the KV key root,
        as ``load()``'s engine would tokenize, with no weights loaded."""
        from kvbatch.ops.shards.build import RowTokenizer

        return RowTokenizer.for_spec(self.engine_spec())

    def load(self, kv_store: Any = None, decode: bool = False, engine_spec: Any = None) -> Any:
        """A fresh ``LLM`` (engines are cheap next to the weights, which are kept per process and
        shared); ``decode``: with the speculative drafter, if one is configured (prefill never drafts).
        ``engine_spec``: this resource's spec as a step resolved it (``suffix:last-night``)."""
        from kvbatch.ops.engine_build import build_llm

        return build_llm(engine_spec or self.engine_spec(), kv_store, decode=decode, keep=True)
