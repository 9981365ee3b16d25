"""What identifies this machine to the caches of measured kernels and built libraries: the CPU
model and flags, and the cache folder (``KVBATCH_CACHE_DIR``, default ``~/.cache/kvbatch``)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_identity() -> tuple[str, list[str]]:
    """This CPU's model name and feature flags (from /proc/cpuinfo where there is one)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, fields.get("flags", "").split()


CACHE_DIR_ENV = "KVBATCH_CACHE_DIR"


def default_cache_dir() -> Path:
    """The folder of every kept measurement and build (kernel choices, GGUF kernels, model
    fingerprints, tokenizer metadata): ``$KVBATCH_CACHE_DIR``, else ``~/.cache/kvbatch``. Torch-free,
    so the tokenizing steps read it without loading the engine."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kvbatch")
