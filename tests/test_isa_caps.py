"""Holding the code to an older CPU's instruction set (``kernels/machine.py`` ISA_CAPS,
``bench_engine.py --isa``): the caps reach torch, MKL, oneDNN and our C build, the caches of
measured kernels and built libraries key on them, and a CPU that lacks the set is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbatch.engine.models import kernel_choice as kc
from kvbatch.engine.models.linear import onednn_available
from kvbatch.kernels import machine, native_build
from kvbatch.kernels.machine import ISA_CAPS, ISA_LIMIT_VARS, isa_cap_environment, isa_limits

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_caps(monkeypatch):
    for name in ISA_LIMIT_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_only_the_caps_that_are_set_are_reported(no_caps):
    assert isa_limits() == {}
    no_caps.setenv("MKL_ENABLE_INSTRUCTIONS", " AVX2 ")
    no_caps.setenv("ONEDNN_MAX_CPU_ISA", "")
    assert isa_limits() == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_an_unknown_set_or_one_this_cpu_lacks_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown instruction set 'sse9': one of avx2, avx512"):
        isa_cap_environment("sse9")
    monkeypatch.setattr(machine, "cpu_identity", lambda: ("Old CPU", ["sse2", "avx", "fma"]))
    with pytest.raises(ValueError, match=r"this CPU \(Old CPU\) cannot run avx2 code: it lacks avx2, bmi2, f16c"):
        isa_cap_environment("avx2")
    monkeypatch.setattr(machine, "cpu_identity", lambda: ("New CPU", ["avx2", "fma", "f16c", "bmi2"]))
    assert isa_cap_environment("avx2") == ISA_CAPS["avx2"].env
    assert set(ISA_CAPS["avx2"].env) == set(ISA_LIMIT_VARS)  # every cap of the run, not some


def test_the_native_build_takes_its_march_from_the_setting(no_caps, tmp_path):
    assert "-march=native" in native_build.cflags()
    source = tmp_path / "k.c"
    source.write_text("int k(void) { return 1; }\n")
    cc = native_build.compiler() or "gcc"
    native = native_build.build_key(source, cc)
    no_caps.setenv("KVBATCH_NATIVE_MARCH", "haswell")
    flags = native_build.cflags()
    assert "-march=haswell" in flags and "-march=native" not in flags
    assert native_build.build_key(source, cc) != native  # another build, kept beside the native one


def test_a_cap_is_another_key_for_the_measured_kernels(no_caps):
    shapes = [(96, 64)]
    plain = kc.cache_key(torch.float32, "plain", shapes, 2, ["blas"])
    assert plain["isa_limits"] == {}
    no_caps.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    capped = kc.cache_key(torch.float32, "plain", shapes, 2, ["blas"])
    assert capped["isa_limits"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert kc.cache_file(plain, Path("c")) != kc.cache_file(capped, Path("c"))


_PROBE = """
import torch
x = torch.randn(64, 256)
w = torch.randn(256, 256)
torch.mm(x, w)  # MKL's sgemm
packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), 64)  # oneDNN, as the engine packs
torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
print("capability", torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.skipif(not {"avx512f", "avx2"} <= set(machine.cpu_identity()[1]) or not onednn_available(),
                    reason="the cap shows only where the CPU has more than AVX2 (and oneDNN is built in)")
def test_the_avx2_caps_hold_torch_mkl_and_onednn_to_avx2():
    # MKL and oneDNN say which code they run when asked to be verbose; torch names its kernels' level.
    env = {"PATH": "/usr/bin:/bin", "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1", **isa_cap_environment("avx2")}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-2000:]
    assert "capability AVX2" in out
    mkl = [line for line in out.splitlines() if line.startswith("MKL_VERBOSE") and "Intel(R)" in line]
    assert mkl and all("AVX2" in line and "AVX-512" not in line for line in mkl), mkl
    isa = [line for line in out.splitlines() if "onednn_verbose" in line and "isa:" in line]
    assert isa and all("AVX2" in line and "512" not in line for line in isa), isa


def test_the_bench_restarts_itself_under_the_caps(no_caps, monkeypatch):
    from benchmarks import bench_engine as B

    seen = {}

    def execve(path, argv, env):
        seen.update(path=path, argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(B.os, "execve", execve)
    monkeypatch.setattr(machine, "cpu_identity", lambda: ("New CPU", ["avx2", "fma", "f16c", "bmi2"]))
    with pytest.raises(SystemExit):
        B.main(["--isa", "avx2", "--quick"])
    assert seen["path"] == sys.executable
    assert seen["argv"][1:] == [str(ROOT / "benchmarks" / "bench_engine.py"), "--isa", "avx2", "--quick"]
    assert {k: seen["env"][k] for k in ISA_LIMIT_VARS} == ISA_CAPS["avx2"].env


def test_the_bench_refuses_a_set_this_cpu_lacks(monkeypatch, capsys):
    from benchmarks import bench_engine as B

    monkeypatch.setattr(machine, "cpu_identity", lambda: ("Old CPU", ["sse2"]))
    monkeypatch.setattr(B.os, "execve", lambda *a: pytest.fail("restarted for a set the CPU lacks"))
    assert B.main(["--isa", "avx512", "--quick"]) == 2
    assert "--isa avx512: this CPU (Old CPU) cannot run avx512 code: it lacks avx512bw" in capsys.readouterr().err
