"""Retry only what failed (issue 44, part 2): a run killed part way leaves the answers it had
finished in the response cache, so running it again computes only the rest.

The first run is a real ``kvbatch generate`` process killed with SIGKILL once some of its rows are
in the cache (no checkpoint, no resume: ``--no-resume``, so what is saved is the cache's doing).
The second run serves exactly those rows from the cache, computes exactly the others, and writes
the same lines as a fresh run without a cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_response_cache import _answers, _entries, _family_copies, _row, _run, _write
from tests.tiny_models import build_tiny_chat_model

ROWS = [_row(f"r{i:02d}", f"Count the sheep, round {i}", temperature=0, max_tokens=24, ignore_eos=True)
        for i in range(40)]


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), max_positions=96)


def _killed_run(model: Path, tmp_path: Path, cache: Path, at_least: int) -> int:
    """Start ``kvbatch generate`` one row at a time and SIGKILL it once ``at_least`` entries are
    in ``cache``; the number of entries it left."""
    src = _write(tmp_path / "night.in.jsonl", ROWS)
    cmd = [sys.executable, "-m", "kvbatch.cli.main", "generate", "--model", str(model), "--input", str(src),
           "--output", str(tmp_path / "killed.out.jsonl"), "--no-progress", "--deterministic", "--no-resume",
           "--max-batch", "1", "--threads", "1", "--response-cache", str(cache)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while len(_entries(cache)) < at_least:
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no entries appeared in 300 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # The run also kept each answer by family key (for a shorter max_tokens), written beside its
    # entry by another thread: a kill can leave a row's copy without its entry, and the copy would
    # serve that row too. Dropped, so what the rerun serves is exactly the entries counted here.
    for copy in _family_copies(cache):
        copy.unlink()
    return len(_entries(cache))


@pytest.mark.slow
def test_a_killed_run_resumes_from_the_cache_computing_only_the_rest(tiny_chat, tmp_path):
    cache = tmp_path / "cache"
    left = _killed_run(tiny_chat, tmp_path, cache, at_least=8)
    assert 8 <= left < len(ROWS), left  # killed part way: some answers kept, not all

    code, lines, metrics = _run(tiny_chat, tmp_path, "rerun", ROWS, str(cache), "--no-resume")
    rc = metrics["response_cache"]
    assert code == 0
    # What the killed run finished is served; only the rest is computed and written.
    assert (rc["hits"], rc["misses"], rc["writes"], rc["corrupt"]) == (left, len(ROWS) - left, len(ROWS) - left, 0)
    # The engine's work is the missing rows' alone: 24 tokens each (ignore_eos), none for a hit.
    assert metrics["output_tokens"] == 24 * (len(ROWS) - left)
    assert rc["output_tokens_served"] == 24 * left
    assert len(_entries(cache)) == len(ROWS)

    fresh = _answers(_run(tiny_chat, tmp_path, "fresh", ROWS, None, "--no-resume")[1])
    assert _answers(lines) == fresh  # every line as a run without the cache writes it, in input order
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in ROWS]
