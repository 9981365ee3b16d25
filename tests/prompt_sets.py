"""The real prompts the tests read: small subsets of public prompt sets, kept in ``tests/data/``.

They live in the repository (``tests/data/README.md`` says where each file came from, how it
was cut and under which licence) so that the suite runs the same on a fresh clone as on a
machine that also has the team's shared datasets folder beside the checkout; no test skips for want of data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
MT_BENCH = DATA / "mt_bench" / "question.jsonl"  # all 80 questions, byte for byte
GSM8K = DATA / "gsm8k_test" / "test_first200.jsonl"  # the first 200 lines of the test split


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():  # a checkout without tests/data/ is broken, not a reason to skip
        raise FileNotFoundError(f"{path}: test prompt set missing (it is tracked in git: see tests/data/README.md)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def mt_bench() -> dict[int, dict[str, Any]]:
    """MT-Bench's 80 questions by ``question_id`` (81..160): ``category``, two ``turns``, maybe ``reference``."""
    return {q["question_id"]: q for q in _jsonl(MT_BENCH)}


def gsm8k() -> list[dict[str, Any]]:
    """GSM8K test records 0..199 in file order: ``question`` and ``answer`` (worked, with ``<<calc>>`` notes)."""
    return _jsonl(GSM8K)
