"""CI runs hypothesis derandomized: tests/conftest.py registers the ``kvbatch-ci`` profile and
loads it when CI=true, and the session header says which profile runs and how its seeds come."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import tests.conftest as c; from hypothesis import settings; "
         "print(settings.get_current_profile_name(), settings.default.derandomize, settings.default.database)")


def _probe(ci: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_ci_runs_hypothesis_derandomized():
    assert _probe("true") == "kvbatch-ci True None"


def test_the_header_names_the_profile_and_its_seeds():
    env = dict(os.environ, CI="true")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co",
                          "tests/test_hypothesis_profile.py"], env=env, cwd=REPO, capture_output=True, text=True,
                         check=False, timeout=120).stdout
    assert "hypothesis: profile 'kvbatch-ci', derandomized" in out, out[-2000:]


def test_a_quiet_run_prints_the_profile_at_its_end():
    """`make test` runs pytest -q, which prints no header: the profile line comes at the end."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_hypothesis_profile.py::test_ci_runs_hypothesis_derandomized"],
                         env=dict(os.environ, CI="true"), cwd=REPO, capture_output=True, text=True,
                         check=False, timeout=120).stdout
    assert "hypothesis: profile 'kvbatch-ci', derandomized" in out, out[-2000:]


def test_make_test_runs_with_ci_set():
    """The suite `make test` (CI) runs loads the derandomized profile even where CI is not set."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "CI=$${CI:-true} $(BIN)/python -m pytest" in recipe, recipe
