"""kvbatch: batch LLM inference as a Dagster asset graph.

The package's folders are its sub-packages (``kvbatch.engine``, ``kvbatch.pipelines``... see
pyproject.toml); this root only names what a Dagster project refers to by type,
``type: kvbatch.BatchInference`` in a ``defs.yaml``. It is loaded on first use, so ``import
kvbatch`` (a decode worker, the CLI) imports no Dagster.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "BatchInference": "kvbatch.pipelines.component",
    "PipelineSpec": "kvbatch.pipelines.factory",
    "build_pipeline": "kvbatch.pipelines.factory",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvbatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
