"""Holding the code to an older CPU's instruction set (``kernels/cpu/machine.py`` ISA_CAPS,
``bench_engine.py --isa``): the caps are set in the process the bench restarts as, our C build
takes its -march from them, the caches of measured kernels and built libraries key on them, the
kernels chosen under them give the right numbers, and a CPU that lacks the set is refused.

What torch, MKL or oneDNN print of themselves (``MKL_VERBOSE``, ``ONEDNN_VERBOSE``, torch's
capability string) is theirs, and differs by vendor (MKL names no ISA on AMD CPUs): no test here
reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbatch.kernels.cpu import gguf_kernels, machine, native_build
from kvbatch.kernels.cpu import kernel_choice as kc
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.linear import onednn_available
from kvbatch.kernels.cpu.machine import ISA_CAPS, ISA_LIMIT_VARS, isa_cap_environment, isa_limits

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


# The process bench_engine.py --isa restarts itself as, with its os.execve pointed at the probe
# (tests/isa_cap_probe.py): the restart and its environment are the bench's own.
_LAUNCH = """
import os, sys
from benchmarks import bench_engine as B
name, probe, report = sys.argv[1:4]
execve = os.execve
B.os.execve = lambda path, argv, env: execve(path, [path, probe, report, *argv[1:]], env)
sys.exit(B.main(["--isa", name, "--quick"]))
"""
# The largest error of any kernel the project would run, relative to the reference's largest
# magnitude: fp32 and int8 weights (the reference over the dequantized values) sum 128 products in
# fp32 (~1e-6 measured); bf16 rounds the output to 8 bits.
_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "gguf": 1e-4, "int8_linear": 2.0 ** -21}


@pytest.mark.parametrize("name", sorted(ISA_CAPS))
def test_under_a_cap_the_restarted_bench_builds_chooses_and_computes_within_it(name, no_caps, tmp_path):
    """What the project controls under ``bench_engine.py --isa NAME``, on whatever CPU this is: the
    restarted process has every cap set; the native kernels are built for the cap's -march (a build
    and a cached kernel choice of their own, beside the uncapped ones); the GGUF kernel takes the
    cap's vector path; and every kernel the choice may pick, and the one it picked, gives the float64
    reference's numbers. Where this CPU lacks the set, the bench refuses it and restarts nothing."""
    cap = ISA_CAPS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("KVBATCH_LINEAR", "KVBATCH_KERNELS")}
    env["KVBATCH_CACHE_DIR"] = str(tmp_path / "cache")  # builds and choices made under the cap alone
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-c", _LAUNCH, name, str(ROOT / "tests" / "isa_cap_probe.py"), str(report)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout[-3000:] + done.stderr[-3000:]
    lacks = sorted(cap.needs - set(machine.cpu_identity()[1]))
    if lacks:  # an older CPU than the set: refused before anything restarts
        assert done.returncode == 2, out
        assert f"--isa {name}: this CPU ({machine.cpu_identity()[0]}) cannot run {name} code: it lacks " \
               f"{', '.join(lacks)}" in done.stderr
        assert not report.exists()
        return
    assert done.returncode == 0 and report.exists(), out
    got = json.loads(report.read_text())
    assert got["argv"] == [str(ROOT / "benchmarks" / "bench_engine.py"), "--isa", name, "--quick"]
    assert got["limits"] == cap.env  # every cap reached the restarted process
    march = cap.env["KVBATCH_NATIVE_MARCH"]
    assert f"-march={march}" in got["cflags"] and "-march=native" not in got["cflags"]
    cc = native_build.compiler()
    if cc is not None:  # the libraries built under the cap, each keyed apart from the CPU's own build
        assert got["native_available"] and got["gguf_available"], out
        assert got["native_key"] != native_build.build_key(native_kernels.SOURCE, cc)
        assert got["gguf_key"] != gguf_kernels.build_key(cc)
        assert got["built"] == sorted([f"{native_kernels.SOURCE.stem}-{got['native_key']}.so",
                                       f"{gguf_kernels.SOURCE.stem}-{got['gguf_key']}.so"])
        assert got["gguf_simd"] == {"avx2": "avx2", "avx512": "avx512"}[name]  # the cap's vector path
    else:
        assert not got["native_available"] and got["built"] == []
    assert ("onednn" in got["candidates"]["fp32/full"]) == onednn_available()
    assert ("onednn" in got["candidates"]["bf16/full"]) == got["onednn_bf16"]  # packed bf16 only where it runs
    for case, choice in got["choices"].items():
        assert set(choice["kinds"]) <= set(got["candidates"][case]), (case, choice)
        if choice["source"] == "measured":  # measured here, under the cap, and cached under its key
            assert choice["cache_key"]["isa_limits"] == cap.env, case
    for case, candidates in got["candidates"].items():  # two kernels or more: measured, not a fallback
        assert (got["choices"][case]["source"] == "measured") == (len(candidates) > 1), case
    errors = got["errors"]
    for case, candidates in got["candidates"].items():
        for kind in candidates:
            assert any(k.startswith(f"{case}/{kind}/") for k in errors), (case, kind)
        assert sum(k.startswith(f"{case}/chosen/") for k in errors) == len(kc.BUCKET_ROWS), case
    assert ("gguf/Q4_1" in errors) == got["gguf_available"]
    assert ("int8_linear/saturating" in errors) == got["int8_linear"]
    wrong = {k: e for k, e in errors.items() if not e <= _TOLERANCE[k.split("/")[0]]}
    assert not wrong, wrong


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
