"""The CMake arguments to build ``llama-cpp-python``, bench_engine's optional llama.cpp peer, for this CPU.

``make install-peers`` builds it from source with these (``CMAKE_ARGS``). llama.cpp's default
(``GGML_NATIVE=ON``: ``-march=native``) built 0.3.36 into a library that segfaulted at its first
decode on a 2-vCPU Intel Xeon (family 6 model 167, AVX-512 with VNNI and BF16, AMX); a build with
``GGML_NATIVE=OFF`` and AVX-512 named explicitly ran (Q4_1 batch-1, 71.7 tok/s there, 2026-12-02;
objdump of its libggml-cpu.so: zmm code, no ``vpdpbusd``, ``vdpbf16ps`` or AMX tile
instructions). So the base SIMD levels up to AVX-512 F/CD/VL/DQ/BW are read from the CPU's flags
here, and the extensions past them (VNNI, BF16, VBMI, AMX), which the crashing build had and the
working one did not, are left off; which of them crashed was not isolated.

    python benchmarks/llama_cpp_build.py      # prints the CMAKE_ARGS value for this machine
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbatch.kernels.cpu.machine import cpu_identity

# llama.cpp's option -> the /proc/cpuinfo flags it needs (all of them)
_LEVELS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    # GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
)
_OFF = ("GGML_NATIVE", "GGML_AVX_VNNI", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16",
        "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_args(flags: Iterable[str]) -> list[str]:
    """``-D`` options for a CPU with these flags: native detection and the extensions past
    AVX-512 off, each base SIMD level on exactly when the CPU has every flag it compiles for
    (AVX-512 only with AVX2 too)."""
    have = set(flags)
    args = [f"-D{name}=OFF" for name in _OFF]
    for name, needs in _LEVELS:
        on = set(needs) <= have and (name != "GGML_AVX512" or "avx2" in have)
        args.append(f"-D{name}={'ON' if on else 'OFF'}")
    return args


if __name__ == "__main__":
    print(" ".join(cmake_args(cpu_identity()[1])))
