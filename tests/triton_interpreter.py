"""What every Triton kernel test file shares: the kernels built for the Triton interpreter on the
CPU, the switch that routes the dispatch point to them, and comparison helpers.

``TRITON_INTERPRET`` must be set before triton decorates the kernels, so this module sets it,
builds them once (the first test file to import it does) and restores the variable, leaving the
rest of the session unaffected; ``use_triton`` sets it again around each kernel test. If the
kernels were compiled for a GPU before this ran, ``INTERPRETED`` is False, the interpreter tests
skip, and each file's fresh-process test re-runs it in a new interpreter instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before triton (and the kernels) are imported below

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from kvbatch.kernels import dispatch  # noqa: E402

KERNELS = dispatch._triton_kernels()  # raises when triton is installed but a kernel module does not import
TRITON_INSTALLED = KERNELS is not None
INTERPRETED = KERNELS is not None and KERNELS.interpreted
if _PREVIOUS_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

CHILD_ENV = "KVBATCH_KERNEL_TESTS_CHILD"  # set in the fresh-process re-run
REPO = Path(__file__).resolve().parents[1]


def interpreter_only(fresh_process_test: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not INTERPRETED,
        reason="triton missing, or its kernels were compiled before TRITON_INTERPRET=1 was set "
        f"({fresh_process_test} covers that case)",
    )


# The fresh-process test of a kernel test file runs only where the kernels came compiled for a GPU.
fresh_process_only = pytest.mark.skipif(INTERPRETED or KERNELS is None or os.environ.get(CHILD_ENV) == "1",
                                        reason="the kernel tests ran in this process (or triton is missing)")


def rerun_in_fresh_interpreter(test_file: str) -> None:
    """The kernels were imported compiled for a GPU before ``test_file`` could set
    TRITON_INTERPRET=1: run that file again in a fresh interpreter process, and fail with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: "1"})
    env.pop("KVBATCH_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test_file],
        check=False, env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    check_rerun(proc.returncode, proc.stdout, proc.stderr)


def check_rerun(returncode: int, stdout: str, stderr: str = "") -> None:
    """The fresh-interpreter rerun passed, and by running tests: exit 0 with every test skipped
    (or none collected) proves nothing about the kernels, so it fails too, as does any test of
    the rerun skipped because the kernels were not interpreted there."""
    tail = stdout[-4000:] + stderr[-2000:]
    assert returncode == 0, tail
    passed = re.search(r"(\d+) passed", stdout)
    assert passed and int(passed.group(1)) > 0, "the fresh-interpreter rerun ran no test:\n" + tail
    assert "compiled before TRITON_INTERPRET" not in stdout, "the rerun skipped interpreter tests:\n" + tail


def compiled_pairs(script: str) -> list[list[dict]]:
    """Run ``script`` (which compiles kernel variants for sm_90 with Triton's own ptxas and prints
    one JSON line per compared pair, a line starting with ``[``) in a fresh process, the kernels
    compiled for a GPU there (no interpreter); fail with its output if it fails. The pairs."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVBATCH_KERNELS")}
    prelude = f"import sys; sys.path[:0] = [{str(REPO / 'benchmarks')!r}]\n"
    proc = subprocess.run([sys.executable, "-c", prelude + script], capture_output=True, text=True, timeout=900,
                          check=False, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]


MOE_KERNELS = ("_moe_gate_up_kernel", "_moe_down_kernel")


def check_moe_variant_pairs(pairs: list[list[dict]], flag: str) -> None:
    """``compiled_pairs`` of a fused MoE weight-format variant (constexpr ``flag`` on) beside the same
    tile without it: three bf16 tiles and fp32's first of each kernel; each variant compiles within
    an SM's shared memory and spills no register where the plain tile spills none."""
    assert sorted((r["kernel"], r["config"]["dtype"]) for r, _ in pairs) == sorted(
        [(k, "bf16") for k in MOE_KERNELS for _ in range(3)] + [(k, "fp32") for k in MOE_KERNELS])
    for variant, plain in pairs:
        assert "error" not in variant and "error" not in plain, (variant, plain)
        assert variant["config"][flag] is True and plain["config"][flag] is False
        assert 0 < variant["shared_bytes"] <= 232448 and variant["registers"] > 0, variant
        assert plain["spills"] > 0 or variant["spills"] == 0, (variant, plain)


def gpu_kernels_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """``benchmarks/gpu_kernels`` (the GPU check's kernel cases) with its tensors on the CPU."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_kernels
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(gpu_kernels.gpu_cases, "DEVICE", "cpu")
    return gpu_kernels


@pytest.fixture
def use_triton(monkeypatch):
    """Route the dispatch point to the interpreted Triton kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    atol, rtol = tol
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 3e-2)}


def interpreter_settings(max_examples: int) -> settings:
    """Hypothesis settings for kernel tests: reproducible examples, and no shrinking (it takes
    minutes in the interpreter)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
