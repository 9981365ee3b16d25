"""The inference engine: ``models`` (architectures and weight loading), ``text`` (tokenizer),
``runtime`` (the LLM facade, scheduler, paged KV cache, sampling), ``speculative`` (drafters,
controller, verifier) and ``parallel`` (expert parallelism, EPLB).

The public API is importable from here; it loads lazily, so ``import kvbatch.engine`` alone
(as every submodule import does) stays cheap::

    from kvbatch.engine import LLM, GenerationRequest, SamplingParams, EngineConfig
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "LLM": "kvbatch.engine.runtime.llm",
    "GenerationRequest": "kvbatch.engine.runtime.llm",
    "Result": "kvbatch.engine.runtime.llm",
    "SamplingParams": "kvbatch.engine.runtime.sampling_params",
    "EngineConfig": "kvbatch.engine.runtime.engine_config",
    "SpecConfig": "kvbatch.engine.speculative.controller",
}
__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ below
    from kvbatch.engine.runtime.engine_config import EngineConfig  # noqa: F401
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest, Result  # noqa: F401
    from kvbatch.engine.runtime.sampling_params import SamplingParams  # noqa: F401
    from kvbatch.engine.speculative.controller import SpecConfig  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvbatch.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
