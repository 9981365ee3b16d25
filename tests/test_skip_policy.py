"""CI fails a green run that skipped a test for anything but what the machine lacks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.skip_policy import disallowed_skips

REPO = Path(__file__).resolve().parents[1]


def _reasons_in_the_suite() -> list[str]:
    """Every literal skip reason the suite's files spell (reason="..." and pytest.skip("..."))."""
    pattern = re.compile(r"""(?:(?<!\w)reason=f?|pytest\.skip\(f?)(["'])(.+?)\1""")
    return [m.group(2) for path in sorted((REPO / "tests").glob("test_*.py"))
            if path.name != "test_skip_policy.py" for m in pattern.finditer(path.read_text())]


def test_the_machine_reasons_pass_and_the_others_do_not():
    accepted = ["needs a CUDA device", "a CUDA device is here", "no native CPU kernels here: no compiler",
                "no C compiler here", "this torch build has no MKL packed sgemm", "one route only",
                "transparent huge pages are off (/sys/...: never)", "no Chromium at /usr/bin/chromium",
                "history before 2026-11-01 not cloned (a shallow clone)",
                "the kernel tests ran in this process (or triton is missing)"]
    refused = ["could not import 'moto.server': No module named 'moto'", "triton is not installed",
               "benchmarks/gpu_compile.py (another change) is not in this checkout",
               "needs the interpreted Triton kernels",
               "triton missing, or its kernels were compiled before TRITON_INTERPRET=1 was set"]
    assert disallowed_skips(accepted) == []
    assert disallowed_skips(refused) == refused


def test_the_suite_spells_no_unknown_reason_but_these():
    """The reasons the suite may skip for and CI would refuse: each guards a checkout or an
    install CI always has (a skip there is the failure the policy exists for)."""
    refused = set(disallowed_skips(_reasons_in_the_suite()))
    assert refused <= {"triton is not installed (then None is the right answer)", "triton is not installed",
                       "benchmarks/gpu_compile.py (another change) is not in this checkout",
                       "needs the interpreted Triton kernels", "not a git checkout (an unpacked sdist)",
                       "needs the Triton kernels built for the interpreter ",  # (the reason goes on)
                       "Playwright is the ui extra: pip install -e '.[ui]'",
                       "nothing here"}, refused  # (a probe file test_kernels_no_silent_skip writes)


def _run(tmp_path: Path, reason: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(
        f"import pytest\n\ndef test_ok():\n    pass\n\ndef test_skipped():\n    pytest.skip({reason!r})\n")
    env = dict(os.environ, CI="true", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_ci_run_with_a_disallowed_skip_fails_and_says_why(tmp_path):
    bad = _run(tmp_path, "could not import 'moto.server'")
    assert bad.returncode == 1, bad.stdout[-2000:]
    assert "CI does not accept this skip (tests/skip_policy.py): could not import 'moto.server'" in bad.stdout
    good = _run(tmp_path, "needs a CUDA device")
    assert good.returncode == 0, good.stdout[-2000:]
