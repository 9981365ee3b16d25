"""Rewriting mostly-dead segments (io/kvstore/rewrite.py): `kv gc --unused-days` copies the used blocks
of a segment that is mostly unused into a new segment, publishes it, and deletes the old one only
after that and after a grace (decodes holding manifests that name it read it meanwhile, and the
index afterwards); a gc killed at any write or delete, or two gcs at once, leave every used block
readable."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.cli.main import main
from kvbatch.io.kvstore.compaction import compact_index
from kvbatch.io.kvstore.faults import RetryPolicy
from kvbatch.io.kvstore.gc import UsageFile, gc_objects
from kvbatch.io.kvstore.object_layout import ObjectLayout
from kvbatch.io.kvstore.store import KVStore, KVStoreConfig, kv_gc, kv_stats
from tests.concurrency import run_at_once

FP = "rewrite-test-fp"
DAY = 86400.0
HOUR = 3600.0


def chain(name: str, n: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    return [(hashlib.sha256(f"{name}/{i}".encode()).hexdigest(), torch.randn(2, 2, 4, 2, 8, generator=g))
            for i in range(n)]


def keys(c) -> list[str]:
    return [k for k, _ in c]


def store(url: str, opts: dict | None = None, clock: Callable[[], float] = time.time) -> KVStore:
    cfg = KVStoreConfig(url=url, storage_options=opts or {}, memory_bytes=0, index_refresh_s=0,
                        retry_attempts=1)
    return KVStore.from_config(cfg, FP, clock=clock)


def ten_days_ago() -> float:
    """Night 1's store clock (that store's only: `time.time` stays the real one)."""
    return time.time() - 10 * DAY


def same(got, blocks) -> bool:
    return all(t is not None and torch.equal(t, b) for (t, _), (_, b) in zip(got, blocks, strict=True))


def night_one_then_two(url: str, opts: dict | None, used: list[int], n_chains: int = 10):
    """Night 1, ten days ago: `n_chains` prompts in one segment. Night 2, now: a decode reads the
    chains `used` (given their locations by the manifests) and records the use. Returns (chains,
    the locations night 2's manifests held)."""
    chains = [chain(f"{url}/c{i}") for i in range(n_chains)]
    night1 = store(url, opts, clock=ten_days_ago)
    for c in chains:
        night1.put_many(c)
    night1.flush()
    locations = night1.locations([k for i in used for k in keys(chains[i])])
    night2 = store(url, opts)
    night2.add_locations(locations)
    assert same(night2.get_many([k for i in used for k in keys(chains[i])]), [b for i in used for b in chains[i]])
    night2.stats()  # the end of the decode: one usage file, naming the blocks read
    return chains, locations


def segments(url: str, opts: dict | None = None) -> int:
    return kv_stats(url, opts)["packs"]


# ------------------------------------------------------------------------------ the rewrite


def test_a_mostly_dead_segment_is_rewritten_down_to_its_used_blocks(tmp_path):
    url = str(tmp_path / "kv")
    chains, _ = night_one_then_two(url, None, used=[0])
    before = kv_stats(url)["kv_bytes"]
    out = kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0)
    assert out["packs_unused"] == 0 and out["segments_rewritten"] == 1 and out["blocks_rewritten"] == 3
    assert out["segments_replaced_deleted"] == 1 and out["packs_kept"] == 1
    after = kv_stats(url)
    assert after["packs"] == 1 and after["blocks"] == 3 and after["kv_bytes"] < before / 5
    assert out["kv_bytes_reclaimed"] == before - after["kv_bytes"]
    r = store(url)
    assert same(r.get_many(keys(chains[0])), chains[0])  # bit-exact, found through the index
    assert [why for _, why in r.get_many(keys(chains[1]))] == ["missing"] * 3
    # The chain stays contiguous in the new segment: one ranged GET.
    fresh = store(url)
    fresh.contains(keys(chains[0]))
    before_req = fresh.request_counts()
    fresh.get_many(keys(chains[0]))
    assert fresh.durable.layout.requests.since(before_req)["GET"] == 1
    # The copy restarts its life at the rewrite: the next gc keeps it whole and rewrites nothing.
    again = kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0)
    assert again["segments_rewritten"] == 0 and again["packs_kept"] == 1


def test_without_the_rewrite_a_used_block_keeps_its_whole_segment(tmp_path):
    url = str(tmp_path / "kv")
    night_one_then_two(url, None, used=[0])
    out = kv_gc(url, None, None, unused_s=3 * DAY, rewrite_below=0)
    assert out["segments_rewritten"] == 0 and kv_stats(url)["blocks"] == 30


def test_a_segment_mostly_used_is_kept_whole(tmp_path):
    url = str(tmp_path / "kv")
    night_one_then_two(url, None, used=list(range(6)))  # 60% used: above the 0.5 default
    out = kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0)
    assert out["segments_rewritten"] == 0 and kv_stats(url)["blocks"] == 30


def test_an_older_reader_s_usage_counts_for_every_block(tmp_path):
    url = str(tmp_path / "kv")
    night_one_then_two(url, None, used=[0])
    usage = next((tmp_path / "kv" / "usage").rglob("*.json"))
    d = json.loads(usage.read_text())
    usage.write_text(json.dumps({**d, "blocks": {}}))  # what a reader before block-level usage wrote
    assert kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0)["segments_rewritten"] == 0


def test_a_usage_file_with_a_bad_block_entry_is_counted_and_left_alone(tmp_path):
    url = str(tmp_path / "kv")
    night_one_then_two(url, None, used=[0])
    usage = next((tmp_path / "kv" / "usage").rglob("*.json"))
    d = json.loads(usage.read_text())
    pack = next(iter(d["packs"]))
    bad = usage.with_name(f"{1000:013d}-{'e' * 32}.json")
    bad.write_text(json.dumps({**d, "blocks": {pack: [[-1, 5.0]]}}))
    out = kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0)
    assert out["invalid_usage_files"] == 1 and bad.exists() and out["segments_rewritten"] == 1
    with pytest.raises(ValueError, match="blocks"):
        UsageFile.from_json(json.dumps({**d, "blocks": {"x": []}}).encode(), "u.json")


def test_cli_gc_rewrites_and_refuses_bad_flags(tmp_path, capsys):
    url = str(tmp_path / "kv")
    chains, _ = night_one_then_two(url, None, used=[2])
    assert main(["kv", "gc", "--store", url, "--unused-days", "3", "--rewrite-below", "1.5"]) == 2
    assert "--rewrite-below must be in [0, 1]" in capsys.readouterr().err
    assert main(["kv", "gc", "--store", url, "--unused-days", "3", "--rewrite-grace-hours", "-1"]) == 2
    capsys.readouterr()
    assert main(["kv", "gc", "--store", url, "--unused-days", "3", "--rewrite-grace-hours", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["segments_rewritten"] == 1 and out["segments_replaced_deleted"] == 1
    assert same(store(url).get_many(keys(chains[2])), chains[2])


# ------------------------------------------------------------------------------ running decodes


def test_the_old_segment_outlives_its_copy_by_the_grace_then_decodes_read_the_copy(s3):
    url, opts, _ = s3
    chains, locations = night_one_then_two(url, opts, used=[0])
    first = kv_gc(url, None, None, opts, unused_s=3 * DAY, rewrite_grace_s=24 * HOUR)
    assert first["segments_rewritten"] == 1 and first["segments_awaiting_grace"] == 1
    assert first["segments_replaced_deleted"] == 0 and segments(url, opts) == 2
    # A decode that holds night 2's manifests still reads the old segment, by its locations.
    running = store(url, opts)
    running.add_locations(locations)
    before = running.request_counts()
    assert same(running.get_many(keys(chains[0])), chains[0])
    assert running.durable.layout.requests.since(before) == {"GET": 1, "PUT": 0, "LIST": 0, "HEAD": 0, "DELETE": 0}
    # Within the grace, a second gc neither rewrites it again nor deletes it.
    second = kv_gc(url, None, None, opts, now=time.time() + HOUR, unused_s=3 * DAY, rewrite_grace_s=24 * HOUR)
    assert second["segments_rewritten"] == 0 and second["segments_awaiting_grace"] == 1 and segments(url, opts) == 2
    # Past the grace it goes; a decode still holding the old locations reads the copy via the index.
    third = kv_gc(url, None, None, opts, now=time.time() + 25 * HOUR, unused_s=3 * DAY, rewrite_grace_s=24 * HOUR)
    assert third["segments_replaced_deleted"] == 1 and third["segments_rewritten"] == 0 and segments(url, opts) == 1
    late = store(url, opts)
    late.add_locations(locations)
    got = late.get_many(keys(chains[0]))
    assert same(got, chains[0]) and late.stats()["misses"] == 0


# ------------------------------------------------------------------------------ crashes and races


class Killed(RuntimeError):
    pass


def dying_layout(layout: ObjectLayout, crash_at: int) -> dict:
    """Make the layout's writes and deletes raise after `crash_at` of them (a gc killed there)."""
    calls = {"n": 0}

    def dying(fn):
        def wrapped(*a, **kw):
            calls["n"] += 1
            if calls["n"] > crash_at:
                raise Killed(f"killed at write/delete {calls['n']}")
            return fn(*a, **kw)
        return wrapped

    layout.put_new, layout.remove = dying(layout.put_new), dying(layout.remove)
    return calls


def run_gc(layout: ObjectLayout, **kw) -> dict:
    return gc_objects(layout, None, None, retry=RetryPolicy(attempts=1), unused_s=3 * DAY, rewrite_grace_s=0, **kw)


def all_used_readable(url: str, opts: dict | None, chains, used, locations) -> bool:
    want = [b for i in used for b in chains[i]]
    asked = [k for i in used for k in keys(chains[i])]
    fresh = store(url, opts)  # a cross-run reader: the index
    held = store(url, opts)  # a running decode: the manifests' locations, then the index
    held.add_locations(locations)
    return same(fresh.get_many(asked), want) and same(held.get_many(asked), want)


def test_a_gc_killed_at_every_write_or_delete_of_a_rewrite_loses_no_used_block_on_s3(s3):
    url, opts, fs = s3
    chains, locations = night_one_then_two(url, opts, used=[0, 1], n_chains=8)
    # A generation of the index names the old segment: a fresh reader finds its blocks there first.
    assert compact_index(store(url, opts).durable.layout, now=time.time(), grace_s=0)["segments_indexed"] == 1
    template = url.removeprefix("s3://")
    crash_at, total = 0, None
    while total is None or crash_at <= total:
        copy = f"{template}-{crash_at}"  # the same store, for each crash point afresh
        fs.copy(template, copy, recursive=True)
        fs.invalidate_cache()
        lay = store(f"s3://{copy}", opts).durable.layout
        calls = dying_layout(lay, crash_at)
        try:
            run_gc(lay)
            total = calls["n"]  # the writes and deletes of a whole gc: every one was a crash point
        except Killed:
            pass
        assert all_used_readable(f"s3://{copy}", opts, chains, [0, 1], locations), crash_at
        # The next gc finishes the job: one segment holding just the used chains.
        out = run_gc(store(f"s3://{copy}", opts).durable.layout)
        assert out["segments_rewrite_failed"] == 0
        assert kv_stats(f"s3://{copy}", opts)["unique_blocks"] == 6, crash_at
        crash_at += 1
    assert total >= 4  # at least: new object, its index file, the old index file, the old object


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(used=st.sets(st.integers(0, 5), min_size=1, max_size=6), crash_at=st.integers(0, 12),
       grace_h=st.sampled_from([0.0, 24.0]))
def test_any_usage_any_crash_point_keeps_every_used_block(used, crash_at, grace_h):
    with tempfile.TemporaryDirectory() as d:
        url = str(Path(d) / "kv")
        chains, locations = night_one_then_two(url, None, used=sorted(used), n_chains=6)
        lay = store(url).durable.layout
        dying_layout(lay, crash_at)
        try:
            gc_objects(lay, None, None, retry=RetryPolicy(attempts=1), unused_s=3 * DAY,
                       rewrite_grace_s=grace_h * HOUR)
        except Killed:
            pass
        assert all_used_readable(url, None, chains, sorted(used), locations)
        # Two clean gcs a grace apart leave exactly the used blocks when they were under half.
        for hours in (25, 50):
            kv_gc(url, None, None, now=time.time() + hours * HOUR, unused_s=3 * DAY, rewrite_grace_s=grace_h * HOUR)
        blocks = kv_stats(url)["unique_blocks"]
        assert blocks == (3 * len(used) if len(used) < 3 else 18)
        assert all_used_readable(url, None, chains, sorted(used), locations)


def test_two_gcs_rewriting_at_once_keep_every_used_block(tmp_path):
    url = str(tmp_path / "kv")
    chains, locations = night_one_then_two(url, None, used=[0])
    outs, errors = run_at_once(lambda: kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0))
    assert not errors and len(outs) == 2
    assert all_used_readable(url, None, chains, [0], locations)
    # Two copies at most; a later gc keeps the newer, and the chain once.
    kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0)
    assert kv_stats(url)["packs"] == 1 and kv_stats(url)["blocks"] == 3
    assert all_used_readable(url, None, chains, [0], locations)


def test_a_used_block_that_fails_verification_keeps_its_segment_whole(tmp_path):
    url = str(tmp_path / "kv")
    _, locations = night_one_then_two(url, None, used=[0])
    obj = next((tmp_path / "kv" / "objects").rglob("*.arrow"))
    raw = bytearray(obj.read_bytes())
    raw[locations[0]["offset"] + locations[0]["length"] - 1] ^= 0xFF  # the last byte of a used block
    obj.write_bytes(bytes(raw))
    out = kv_gc(url, None, None, unused_s=3 * DAY, rewrite_grace_s=0)
    assert out["segments_rewrite_failed"] == 1 and out["segments_rewritten"] == 0
    assert kv_stats(url)["blocks"] == 30  # nothing copied, nothing deleted
