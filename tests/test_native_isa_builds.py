"""The native kernels built for older x86 CPUs than this one, run here.

``kernels/cpu_native.c`` and the GGUF kernel pick their SIMD path at compile time (AVX-512, AVX2
or plain C) from ``-march=native``, so a test run covers only the path of the CPU it runs on. Here
the sources are built again with ``-march=haswell`` (AVX2 + FMA), ``-march=x86-64`` (SSE2 only)
and ``-march=skylake-avx512`` (AVX-512 without the bf16 instructions), named by
``KVBATCH_NATIVE_MARCH`` (the setting ``bench_engine.py --isa`` uses), into a cache of their own,
and the native kernel tests run in a child process against each build. A CPU that lacks AVX2
skips the Haswell build (its code would not run here), one without AVX-512 the Skylake build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.kernels import cpu_native, native_build
from kvbatch.kernels.machine import cpu_identity

ROOT = Path(__file__).resolve().parents[1]
# The native kernel tests: each kernel against its PyTorch reference, the fused decode step
# against the layer loop, the int8 GEMV and the GGUF block kernel.
SUITES = ["tests/test_cpu_native.py", "tests/test_int8.py", "tests/test_gguf_native.py"]
# What a newer build uses and these builds must not, as objdump spells it: the vector registers of
# AVX-512 (resp. AVX), AVX512-BF16's dot product.
_NEWER = {"haswell": ("%zmm",), "x86-64": ("%zmm", "%ymm"), "skylake-avx512": ("vdpbf16ps",)}
_NEEDS = {"haswell": {"avx2", "fma", "bmi2"}, "x86-64": set(),
          "skylake-avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_native.available() or shutil.which("objdump") is None,
                                 reason="no C compiler for the native kernels, or no objdump")]


def _disassembly(lib: Path) -> str:
    return subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, timeout=120).stdout


@pytest.mark.parametrize("march", ["haswell", "x86-64", "skylake-avx512"])
def test_the_native_kernel_tests_pass_on_an_older_isa_build(tmp_path, march):
    flags = set(cpu_identity()[1])
    if not _NEEDS[march] <= flags:
        pytest.skip(f"this CPU cannot run {march} code")
    cache = tmp_path / "cache"
    env = {**os.environ, "KVBATCH_NATIVE_MARCH": march, "KVBATCH_CACHE_DIR": str(cache), "KVBATCH_KERNELS": "native"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                           *SUITES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout, tail
    built = sorted(cache.rglob("*.so"))
    assert {p.name.rsplit("-", 1)[0] for p in built} == {"cpu_native", "gguf_kernels"}, built
    for lib in built:  # what ran is the older ISA's code
        asm = _disassembly(lib)
        newer = [r for r in _NEWER[march] if r in asm]
        assert not newer, f"{lib.name} built for {march} uses {newer}"


def test_an_avx512_bf16_cpu_multiplies_bf16_queries_and_keys_with_vdpbf16ps():
    # the decode attention's query-key products over a bf16 cache (qk_dots4_dpbf16): present in
    # the machine's own build exactly where the CPU has the instruction
    asm = _disassembly(native_build.build(cpu_native.SOURCE, native_build.cache_dir("cpu-native")))
    assert ("vdpbf16ps" in asm) == ("avx512_bf16" in cpu_identity()[1])
