"""The native kernels built for other x86 CPUs than this one: their code, and their tests run here.

``kernels/cpu/native.c`` (with the parts it includes) and the GGUF kernel pick their SIMD path at
compile time (AVX-512, AVX2 or plain C) from ``-march=native``, so a test run covers only the path
of the CPU it runs on. Here the sources are built again with ``-march=haswell`` (AVX2 + FMA),
``-march=x86-64`` (SSE2 only) and ``-march=skylake-avx512`` (AVX-512 without the bf16
instructions), named by ``KVBATCH_NATIVE_MARCH`` (the setting ``bench_engine.py --isa`` uses),
into a cache of their own. Every build's code is checked on every CPU (compiling needs no such
CPU): it uses its set's widest vectors and nothing newer. Where this CPU can run the build, the
native kernel tests run in a child process against it; where it cannot (an AVX2-only CPU and the
Skylake build), ``bench_engine.py --isa`` refuses the set here, and that refusal is checked instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.kernels.cpu import gguf_kernels, native_build
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.machine import ISA_CAPS, cpu_identity, isa_cap_environment

ROOT = Path(__file__).resolve().parents[1]
# The native kernel tests: each kernel against its PyTorch reference, the fused decode step
# against the layer loop, the int8 GEMV and the GGUF block kernel.
SUITES = ["tests/test_cpu_native.py", "tests/test_int8.py", "tests/test_gguf_native.py"]
# What a build uses, and what a newer build uses and these builds must not, as objdump spells
# it: the vector registers of AVX (ymm), AVX-512 (zmm), SSE (xmm); AVX512-BF16's dot product.
_WIDEST = {"haswell": "%ymm", "x86-64": "%xmm", "skylake-avx512": "%zmm"}
_NEWER = {"haswell": ("%zmm",), "x86-64": ("%zmm", "%ymm"), "skylake-avx512": ("vdpbf16ps",)}
_NEEDS = {"haswell": {"avx2", "fma", "f16c", "bmi2"}, "x86-64": set(),
          "skylake-avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not native_kernels.available() or shutil.which("objdump") is None,
                                 reason="no C compiler for the native kernels, or no objdump")]


def _disassembly(lib: Path) -> str:
    return subprocess.run(["objdump", "-d", str(lib)], check=True, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.parametrize("march", ["haswell", "x86-64", "skylake-avx512"])
def test_an_older_isa_build_holds_to_its_set_and_passes_the_native_kernel_tests_where_it_runs(tmp_path, monkeypatch,
                                                                                             march):
    cache = tmp_path / "cache"
    flags = set(cpu_identity()[1])
    if _NEEDS[march] <= flags:
        env = {**os.environ, "KVBATCH_NATIVE_MARCH": march, "KVBATCH_CACHE_DIR": str(cache),
               "KVBATCH_KERNELS": "native"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                               *SUITES], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        tail = done.stdout[-3000:] + done.stderr[-2000:]
        assert done.returncode == 0, tail
        assert " passed" in done.stdout, tail
    else:
        # this CPU cannot run the build's code (it would fault): the cap that names the march is
        # refused here, and the build is only made, to check its code below
        capped = [name for name, cap in ISA_CAPS.items() if cap.env["KVBATCH_NATIVE_MARCH"] == march]
        assert capped, march
        for name in capped:
            lacks = ", ".join(sorted(ISA_CAPS[name].needs - flags))
            with pytest.raises(ValueError, match=f"cannot run {name} code: it lacks {lacks}"):
                isa_cap_environment(name)
        monkeypatch.setenv("KVBATCH_NATIVE_MARCH", march)
        monkeypatch.setenv("KVBATCH_CACHE_DIR", str(cache))
        for source, folder in ((native_kernels.SOURCE, "cpu-native"), (gguf_kernels.SOURCE, "gguf-kernels")):
            native_build.build(source, native_build.cache_dir(folder))
    built = sorted(cache.rglob("*.so"))
    assert {p.name.rsplit("-", 1)[0] for p in built} == {native_kernels.SOURCE.stem, gguf_kernels.SOURCE.stem}, built
    for lib in built:  # the code built is the set's: its widest vectors, nothing newer
        asm = _disassembly(lib)
        assert _WIDEST[march] in asm, f"{lib.name} built for {march} uses no {_WIDEST[march]}"
        newer = [r for r in _NEWER[march] if r in asm]
        assert not newer, f"{lib.name} built for {march} uses {newer}"


def test_an_avx512_bf16_cpu_multiplies_bf16_queries_and_keys_with_vdpbf16ps():
    # the decode attention's query-key products over a bf16 cache (qk_dots4_dpbf16): present in
    # the machine's own build exactly where the CPU has the instruction
    asm = _disassembly(native_build.build(native_kernels.SOURCE, native_build.cache_dir("cpu-native")))
    assert ("vdpbf16ps" in asm) == ("avx512_bf16" in cpu_identity()[1])
