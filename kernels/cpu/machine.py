"""What identifies this machine to the caches of measured kernels and built libraries: the CPU
model and flags, the settings that cap the instruction set below them, and the cache folder
(``KVBATCH_CACHE_DIR``, default ``~/.cache/kvbatch``)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
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


# Settings that hold code below the instruction set the CPU has: torch's own kernels (ATen), MKL,
# oneDNN, and the ``-march`` our C kernels are built with (``native`` when unset). A measurement or a
# build made under one cap says nothing of another, so the caches key on them too; ``bench_engine.py
# --isa avx2`` sets all four to run an older CPU's code paths on this one.
ISA_LIMIT_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "KVBATCH_NATIVE_MARCH")


def isa_limits() -> dict[str, str]:
    """The instruction-set caps set in this process's environment (empty: the CPU's own set)."""
    return {name: value for name in ISA_LIMIT_VARS if (value := os.environ.get(name, "").strip())}


@dataclass(frozen=True)
class IsaCap:
    """An older CPU's instruction set, as the four caps spell it, and the flags it needs here."""

    needs: frozenset[str]
    env: dict[str, str]


ISA_CAPS = {
    # Haswell's set, the one of every AVX2 CPU (AMD Zen 1-3 included): no AVX-512
    "avx2": IsaCap(frozenset({"avx2", "fma", "f16c", "bmi2"}),
                   {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                    "ONEDNN_MAX_CPU_ISA": "AVX2", "KVBATCH_NATIVE_MARCH": "haswell"}),
    # Skylake-SP's: AVX-512 without VNNI, bf16 or AMX
    "avx512": IsaCap(frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}),
                     {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                      "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "KVBATCH_NATIVE_MARCH": "skylake-avx512"}),
}


def isa_cap_environment(name: str) -> dict[str, str]:
    """The environment that holds torch, MKL, oneDNN and our C kernels to instruction set ``name``
    (a key of :data:`ISA_CAPS`) on this CPU. Raises ``ValueError`` for an unknown name, or where
    this CPU lacks the set (its code would fault here)."""
    cap = ISA_CAPS.get(name)
    if cap is None:
        raise ValueError(f"unknown instruction set {name!r}: one of {', '.join(ISA_CAPS)}")
    missing = sorted(cap.needs - set(cpu_identity()[1]))
    if missing:
        raise ValueError(f"this CPU ({cpu_identity()[0]}) cannot run {name} code: it lacks {', '.join(missing)}")
    return dict(cap.env)


CACHE_DIR_ENV = "KVBATCH_CACHE_DIR"


def default_cache_dir() -> Path:
    """The folder of every kept measurement and build (kernel choices, GGUF kernels, model
    fingerprints, tokenizer metadata): ``$KVBATCH_CACHE_DIR``, else ``~/.cache/kvbatch``. Torch-free,
    so the tokenizing steps read it without loading the engine."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kvbatch")
