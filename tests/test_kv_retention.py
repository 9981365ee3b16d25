"""Retention by last use (issue 14): decode records the segments it read (one usage file per
reader per flush), `kv gc --unused-days N` never removes a segment used in the last N days
however old, gc folds the usage files into one, and a gc that dies while folding, or two gcs at
once, lose no use."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvbatch.cli.main import main
from kvbatch.io.kvstore.object_layout import ObjectLayout
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig, kv_gc
from tests.concurrency import run_at_once

FP = "retention-test-fp"
DAY = 86400.0


def chain(name: str, n: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(len(name))
    return [(hashlib.sha256(f"{name}/{i}".encode()).hexdigest(), torch.randn(2, 2, 4, 2, 8, generator=g))
            for i in range(n)]


def store(root: Path, clock: Callable[[], float] = time.time) -> KVStore:
    return KVStore.from_config(KVStoreConfig(url=str(root), memory_bytes=0, index_refresh_s=0), FP, clock=clock)


def ten_days_ago() -> float:
    """The store's clock on night 1 (handed to that store only: `time.time` stays the real one)."""
    return time.time() - 10 * DAY


def keys(c) -> list[str]:
    return [k for k, _ in c]


@pytest.fixture
def two_nights(tmp_path):
    """Night 1, ten days ago, stored a shared system prompt and a one-off prompt (one segment
    each); night 2, now, read the system prompt only."""
    root = tmp_path / "kv"
    night1 = store(root, clock=ten_days_ago)
    for c in (chain("system"), chain("one-off")):
        night1.put_many(c)
        night1.flush()
    night2 = store(root)
    assert all(t is not None for t, _ in night2.get_many(keys(chain("system"))))
    night2.stats()  # the end of the decode: flushes, and records what it used
    assert len(list((root / "usage").rglob("*.json"))) == 1
    return root


def test_gc_by_last_use_keeps_what_night_two_used(two_nights, capsys):
    assert main(["kv", "gc", "--store", str(two_nights), "--unused-days", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["packs_unused"] == 1 and out["packs_expired"] == 0 and out["packs_kept"] == 1
    assert out["usage_files_folded"] == 1 and len(list((two_nights / "usage").rglob("*.json"))) == 1
    reader = store(two_nights)
    assert all(t is not None for t, _ in reader.get_many(keys(chain("system"))))
    assert [r for _, r in reader.get_many(keys(chain("one-off")))] == ["missing"] * 3
    # The folded usage file still vouches for the system prompt at the next gc.
    assert kv_gc(str(two_nights), None, None, unused_s=3 * DAY)["packs_unused"] == 0


def test_age_alone_would_remove_the_used_segment(two_nights):
    out = kv_gc(str(two_nights), ttl_s=3 * DAY, max_bytes=None)
    assert out["packs_expired"] == 2  # why retention by age is not enough


def test_a_gc_that_dies_while_folding_loses_no_use(two_nights, monkeypatch):
    real_remove = ObjectLayout.remove

    def dies_on_usage(self, path):
        if "/usage/" in path:
            raise RuntimeError("killed")
        return real_remove(self, path)

    monkeypatch.setattr(ObjectLayout, "remove", dies_on_usage)
    with pytest.raises(RuntimeError, match="killed"):
        kv_gc(str(two_nights), None, None, unused_s=3 * DAY)
    monkeypatch.setattr(ObjectLayout, "remove", real_remove)
    assert len(list((two_nights / "usage").rglob("*.json"))) == 2  # the fold written, the old one left
    out = kv_gc(str(two_nights), None, None, unused_s=3 * DAY)
    assert out["packs_kept"] == 1 and out["usage_files_folded"] == 2
    assert all(t is not None for t, _ in store(two_nights).get_many(keys(chain("system"))))


def test_a_gc_whose_usage_file_another_gc_folds_meanwhile_keeps_the_use(two_nights, monkeypatch):
    """The race the test below hits now and then, made certain: gc B lists the usage files, then gc A
    folds them (writes its fold, deletes the originals) before B reads them. B must find A's fold."""
    real_get = ObjectLayout.get
    inner: list[dict] = []

    def get(self, path):
        if "/usage/" in path and not inner:
            inner.append({})  # once, and not inside the inner gc
            inner[0] = kv_gc(str(two_nights), None, None, unused_s=3 * DAY)
        return real_get(self, path)

    monkeypatch.setattr(ObjectLayout, "get", get)
    outer = kv_gc(str(two_nights), None, None, unused_s=3 * DAY)
    assert inner[0]["usage_files_folded"] == 1 and inner[0]["packs_unused"] == 1
    # The outer gc scanned the index before the inner one ran: it still counts the one-off segment
    # (already gone), and must keep the system prompt's.
    assert outer["packs_unused"] == 1 and outer["packs_kept"] == 1
    assert all(t is not None for t, _ in store(two_nights).get_many(keys(chain("system"))))


def test_two_gcs_at_once_keep_every_use(two_nights):
    outs, errors = run_at_once(lambda: kv_gc(str(two_nights), None, None, unused_s=3 * DAY))
    assert not errors and len(outs) == 2
    assert all(t is not None for t, _ in store(two_nights).get_many(keys(chain("system"))))
    # Whatever each folded, a later gc still sees the use.
    assert kv_gc(str(two_nights), None, None, unused_s=3 * DAY)["packs_kept"] == 1


def test_an_invalid_usage_file_is_counted_and_left_alone(two_nights):
    bad = next((two_nights / "usage").iterdir()) / f"{1000:013d}-{'f' * 32}.json"
    bad.write_text('{"format": "kvbatch.kv-usage", "version": 2, "packs": {"../../x": 1}}')
    out = kv_gc(str(two_nights), None, None, unused_s=3 * DAY)
    assert out["invalid_usage_files"] == 1 and bad.exists()
    with pytest.raises(ValueError, match="unused_s"):
        kv_gc(str(two_nights), None, None, unused_s=0)
