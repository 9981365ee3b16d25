"""docs/development.md#commits: every commit subject since the convention was written is at most
72 characters and has a body that says why."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONVENTION_FROM = "59fc031"  # the last commit before docs/development.md#commits


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def test_commit_subjects_are_short_and_every_commit_has_a_body() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist)")
    try:
        _git("cat-file", "-e", f"{CONVENTION_FROM}^{{commit}}")
    except subprocess.CalledProcessError:
        pytest.skip(f"history before {CONVENTION_FROM} not cloned (a shallow clone)")
    log = _git("log", "--format=%H%x1f%s%x1f%b%x1e", f"{CONVENTION_FROM}..HEAD")
    problems = []
    for entry in filter(None, (e.strip() for e in log.split("\x1e"))):
        sha, subject, body = (entry.split("\x1f") + ["", ""])[:3]
        if len(subject) > 72:
            problems.append(f"{sha[:8]}: subject of {len(subject)} characters: {subject[:40]}...")
        if subject.endswith("."):
            problems.append(f"{sha[:8]}: subject ends with a period")
        if not body.strip():
            problems.append(f"{sha[:8]}: no body saying why: {subject}")
    assert problems == []
