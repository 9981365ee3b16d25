"""Retention of the durable tier: usage files, index scans, gc, and the store's stats.

- `UsageFile` / `UsageSeen` / `read_usage`: which segments (and blocks) readers used, and when;
  written by `ObjectStoreTier.record_usage`, read and folded by gc;
- `scan_index` / `IndexScan`: every index file of a store, read and validated;
- `gc_objects`: TTL, last use and size retention, orphan and dangling files, the rewrite of
  mostly-dead segments (rewrite.py) and the fold of the usage files;
- `object_stats`: packs, blocks and bytes per fingerprint (`kvbatch kv stats`).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbatch.io.kvstore.block_format import LAYOUT_VERSION
from kvbatch.io.kvstore.faults import RetryPolicy
from kvbatch.io.kvstore.index_files import (
    _PACK_NAME,
    IndexInvalid,
    PackManifest,
    _checked_int,
    _checked_name,
    _pack_created_s,
    _shown,
)
from kvbatch.io.kvstore.object_layout import ObjectLayout
from kvbatch.io.kvstore.rewrite import DEFAULT_REWRITE_BELOW, DEFAULT_REWRITE_GRACE_S, plan_rewrites, rewrite_segment
from kvbatch.io.urls import redact_text

log = logging.getLogger(__name__)


@dataclass
class UsageFile:
    """When segments, and which of their blocks, were last used. Written by readers, folded by gc.

    `last_used`: `{pack name: seconds}`, the segment's latest use. `blocks`: `{pack name: {block
    offset: seconds}}`, which blocks were read: gc rewrites a segment whose used blocks are few
    (rewrite.py). A pack named in `last_used` without `blocks` (a reader before block-level
    usage) counts as a use of every block it holds."""

    last_used: dict[str, float]
    blocks: dict[str, dict[int, float]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        blocks = {p: sorted([o, t] for o, t in offs.items()) for p, offs in self.blocks.items()}
        return json.dumps({"format": "kvbatch.kv-usage", "version": LAYOUT_VERSION,
                           "packs": self.last_used, "blocks": blocks}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str) -> UsageFile:
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError):
            raise IndexInvalid(source, "$", "not JSON") from None
        if not isinstance(d, dict) or d.get("format") != "kvbatch.kv-usage" or d.get("version") != LAYOUT_VERSION:
            raise IndexInvalid(source, "format", "not a kvbatch usage file of this layout")
        packs = d.get("packs")
        if not isinstance(packs, dict):
            raise IndexInvalid(source, "packs", f"must be an object, got {_shown(packs)}")
        out: dict[str, float] = {}
        for pack, t in packs.items():
            _checked_name(pack, _PACK_NAME, source, "packs", "a pack name (<created ms>-<32 hex>)")
            out[pack] = _checked_time(t, source, f"packs.{pack}")
        raw_blocks = d.get("blocks", {})
        if not isinstance(raw_blocks, dict):
            raise IndexInvalid(source, "blocks", f"must be an object, got {_shown(raw_blocks)}")
        blocks: dict[str, dict[int, float]] = {}
        for pack, pairs in raw_blocks.items():
            if pack not in out:
                raise IndexInvalid(source, "blocks", f"{_shown(pack)} is not one of the file's packs")
            if not isinstance(pairs, list):
                raise IndexInvalid(source, f"blocks.{pack}", f"must be a list of [offset, time], got {_shown(pairs)}")
            offs: dict[int, float] = {}
            for i, pair in enumerate(pairs):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise IndexInvalid(source, f"blocks.{pack}.{i}", f"must be [offset, time], got {_shown(pair)}")
                offset = _checked_int(pair[0], source, f"blocks.{pack}.{i}.offset", 0)
                offs[offset] = max(offs.get(offset, 0.0), _checked_time(pair[1], source, f"blocks.{pack}.{i}.time"))
            blocks[pack] = offs
        return cls(out, blocks)


def _checked_time(t: Any, source: str, field_name: str) -> float:
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not 0 <= t <= 1e15:
        raise IndexInvalid(source, field_name, f"must be a time in seconds, got {_shown(t)}")
    return float(t)


@dataclass
class UsageSeen:
    """What gc read from every usage file: last use per segment, per block, and whole-segment uses."""

    segments: dict[tuple[str, str], float] = field(default_factory=dict)  # (fpid, pack) -> latest use
    blocks: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)  # -> {offset: time}
    whole: dict[tuple[str, str], float] = field(default_factory=dict)  # uses of every block (older readers)
    files: list[str] = field(default_factory=list)  # the usage files read (folded afterwards)
    invalid: int = 0

    def block_last(self, m: PackManifest, offset: int) -> float:
        """A block's last use: its segment's write, its own reads, or a whole-segment use."""
        k = (m.fingerprint_id, m.pack)
        return max(m.created_s, self.whole.get(k, 0.0), self.blocks.get(k, {}).get(offset, 0.0))


USAGE_RELISTS = 8  # listings of the usage files one gc makes while another gc keeps folding them


def read_usage(layout: ObjectLayout, retry: RetryPolicy) -> UsageSeen:
    """Every usage file of the store, merged (latest use wins); invalid ones counted and left alone.

    A file listed but gone when read was folded by a gc running at the same time, and its content
    is in the fold that gc wrote *before* deleting it, but that fold may postdate this listing: so
    the folder is listed again and the files not read yet are read, until a pass loses none. A gc
    that went on without the fold would see a used segment as unused and delete it."""
    seen = UsageSeen()
    read: set[tuple[str, str]] = set()
    for _ in range(USAGE_RELISTS):
        lost = False
        for fpid, name in retry.call(layout.list_usage, "list usage"):
            if (fpid, name) in read:
                continue
            read.add((fpid, name))
            lost |= not _read_usage_file(layout, retry, seen, fpid, name)
        if not lost:
            return seen
    raise RuntimeError(f"kv gc: usage files kept vanishing across {USAGE_RELISTS} listings (another gc "
                       "folding them?); nothing was deleted, run gc again")


def _read_usage_file(layout: ObjectLayout, retry: RetryPolicy, seen: UsageSeen, fpid: str, name: str) -> bool:
    """Merge one usage file into ``seen``; False if it was gone (folded by another gc meanwhile)."""
    path = layout.usage_path(fpid, name)
    try:
        usage = UsageFile.from_json(retry.call(lambda p=path: layout.get(p), f"read {path}"), path)
    except FileNotFoundError:
        return False
    except IndexInvalid as exc:
        seen.invalid += 1
        log.warning("kv gc: invalid usage file skipped: %s", exc)
        return True
    seen.files.append(path)
    for pack, t in usage.last_used.items():
        k = (fpid, pack)
        seen.segments[k] = max(seen.segments.get(k, 0.0), t)
        if pack not in usage.blocks:
            seen.whole[k] = max(seen.whole.get(k, 0.0), t)
    for pack, offs in usage.blocks.items():
        mine = seen.blocks.setdefault((fpid, pack), {})
        for offset, t in offs.items():
            mine[offset] = max(mine.get(offset, 0.0), t)
    return True


@dataclass
class IndexScan:
    """What one pass over a store's index found: the valid packs and what was skipped."""

    manifests: list[PackManifest]
    invalid: int  # hostile or corrupt: a bad name, bad JSON or a field out of shape (never deleted through)
    unreadable: int  # could not be read (I/O errors after retries); left in place


def scan_index(layout: ObjectLayout, retry: RetryPolicy, what: str) -> IndexScan:
    """Read and validate every index file of the store; an invalid one is skipped, counted and logged."""
    listed, bad_names = retry.call(layout.list_index, "list index")
    scan = IndexScan([], len(bad_names), 0)
    for path in bad_names:
        log.warning("kv %s: %s is not a name the store makes: skipped, never deleted", what, _shown(path, 200))
    for fpid, pack in listed:
        path = layout.index_path(fpid, pack)
        try:
            raw = retry.call(lambda p=path: layout.get(p), f"read {path}")
            scan.manifests.append(PackManifest.from_json(raw, source=path, where=(fpid, pack)))
        except FileNotFoundError:
            continue  # removed between list and read
        except IndexInvalid as exc:
            scan.invalid += 1
            log.warning("kv %s: invalid index file skipped, never deleted through: %s", what, exc)
        except Exception as exc:
            scan.unreadable += 1
            log.warning("kv %s: unreadable index file %s left in place: %s", what, path, exc)
    return scan


def gc_objects(
    layout: ObjectLayout,
    ttl_s: float | None,
    max_bytes: int | None,
    *,
    now: float | None = None,
    orphan_grace_s: float = 3600.0,
    retry: RetryPolicy | None = None,
    unused_s: float | None = None,
    rewrite_below: float = DEFAULT_REWRITE_BELOW,
    rewrite_grace_s: float = DEFAULT_REWRITE_GRACE_S,
) -> dict[str, Any]:
    """Delete packs older than `ttl_s`, those unused for `unused_s`, then the oldest packs until at
    most `max_bytes` remain; with `unused_s`, rewrite the mostly-dead rest (rewrite.py).

    TTL counts from the write; `unused_s` from the last use (a write, or a read a decode recorded),
    block by block. Each pack's index file goes first, then its object, so a fresh reader never
    meets a deleted object; a reader with a stale index gets an "object_deleted" miss. Objects
    without an index file (a writer died between the two writes) are removed once older than
    `orphan_grace_s`. A segment whose live blocks hold less than `rewrite_below` of its block
    bytes is copied into a new segment, and deleted once the copy is `rewrite_grace_s` old.

    Only paths the layout builds from validated names are deleted (`ObjectLayout.remove`): an
    index file that fails validation is counted in `invalid_index_files` and left alone, as is
    everything it names.
    """
    retry = retry or RetryPolicy()
    now = time.time() if now is None else now
    scan = scan_index(layout, retry, "gc")
    manifests = scan.manifests
    refused = 0

    def remove(p: str) -> bool:
        nonlocal refused
        if not layout.owns(p):  # e.g. a folder of the store that is a symlink leading out of it
            refused += 1
            log.warning("kv gc: refusing to delete %s: not a pack file inside the store", _shown(p, 200))
            return False
        try:
            retry.call(lambda: layout.remove(p), f"delete {p}")
        except FileNotFoundError:
            return False
        return True

    def delete(m: PackManifest) -> None:
        for p in (layout.index_path(m.fingerprint_id, m.pack), layout.object_path(m.fingerprint_id, m.pack)):
            remove(p)

    # Retention by last use: a segment's last use is the latest of its write and every recorded
    # read of its blocks; one used within `unused_s` is kept whatever its age.
    usage = read_usage(layout, retry) if unused_s is not None else UsageSeen()

    def last(m: PackManifest) -> float:
        return max(m.created_s, usage.segments.get((m.fingerprint_id, m.pack), 0.0))

    expired = [m for m in manifests if ttl_s is not None and now - m.created_s > ttl_s]
    unused = [m for m in manifests if unused_s is not None and m not in expired and now - last(m) > unused_s]
    expired += unused
    kept = sorted((m for m in manifests if m not in expired), key=lambda m: m.created_s)
    oversize: list[PackManifest] = []
    total = sum(m.object_bytes for m in kept)
    while max_bytes is not None and total > max_bytes and kept:
        m = kept.pop(0)
        oversize.append(m)
        total -= m.object_bytes
    for m in expired + oversize:
        delete(m)

    published = {(m.fingerprint_id, m.pack) for m in manifests}
    objects = retry.call(layout.list_objects, "list objects")
    # Index files whose object is gone serve only misses: remove them.
    present = set(objects)
    dangling = [m for m in kept if (m.fingerprint_id, m.pack) not in present]
    for m in dangling:
        delete(m)
        total -= m.object_bytes
    kept = [m for m in kept if m not in dangling]
    rw = _rewrite_mostly_dead(layout, retry, kept, usage, now, unused_s, rewrite_below, rewrite_grace_s, delete)
    gone, new = rw.pop("gone"), rw.pop("new")
    kept = [m for m in kept if (m.fingerprint_id, m.pack) not in gone] + new
    total = sum(m.object_bytes for m in kept)
    # Fold the usage files read into one per model (created first, then the old ones deleted: a gc
    # that dies in between leaves both, and the last use is the max either way).
    folded = 0
    if usage.files:
        _fold_usage(layout, retry, kept, usage, now)
        for path in usage.files:
            folded += remove(path)
    orphans = 0
    for fpid, pack in objects:
        created = _pack_created_s(pack)
        if (fpid, pack) in published or created is None or now - created <= orphan_grace_s:
            continue
        orphans += remove(layout.object_path(fpid, pack))
    return {
        "packs_expired": len(expired) - len(unused),
        "packs_unused": len(unused),
        "usage_files_folded": folded,
        "invalid_usage_files": usage.invalid,
        "packs_evicted_for_size": len(oversize),
        "blocks_deleted": sum(len(m.entries) for m in expired + oversize),
        "kv_bytes_deleted": sum(m.object_bytes for m in expired + oversize),
        "orphan_objects_deleted": orphans,
        "dangling_index_files_deleted": len(dangling),
        "unreadable_index_files": scan.unreadable,
        "invalid_index_files": scan.invalid,
        "deletes_refused": refused,
        **rw,
        "packs_kept": len(kept),
        "kv_bytes_kept": total,
    }


def _rewrite_mostly_dead(layout: ObjectLayout, retry: RetryPolicy, kept: list[PackManifest], usage: UsageSeen,
                         now: float, unused_s: float | None, below: float, grace_s: float,
                         delete: Callable[[PackManifest], None]) -> dict[str, Any]:
    """Rewrite the kept segments that are mostly dead, and delete the ones they replaced once the
    grace has passed (rewrite.py: the order that keeps every live block readable)."""
    out: dict[str, Any] = {"segments_rewritten": 0, "blocks_rewritten": 0, "kv_bytes_rewritten": 0,
                           "segments_replaced_deleted": 0, "segments_awaiting_grace": 0,
                           "segments_rewrite_failed": 0, "kv_bytes_reclaimed": 0, "gone": set(), "new": []}
    if unused_s is None:
        return out  # liveness is by last use: without --unused-days every block counts as live
    plan = plan_rewrites(kept, usage.block_last, now, unused_s, below, grace_s)

    def drop(m: PackManifest) -> None:
        delete(m)
        out["gone"].add((m.fingerprint_id, m.pack))
        out["segments_replaced_deleted"] += 1
        out["kv_bytes_reclaimed"] += m.object_bytes

    for m, live in plan.rewrite:
        try:
            new = rewrite_segment(layout, retry, m, live, now)
        except Exception as exc:  # noqa: BLE001 - the old segment is untouched; the next gc tries again
            out["segments_rewrite_failed"] += 1
            log.warning("kv gc: cannot rewrite segment %s/%s (kept whole): %s", m.fingerprint_id, m.pack,
                        redact_text(str(exc)))
            continue
        out["segments_rewritten"] += 1
        out["blocks_rewritten"] += len(new.entries)
        out["kv_bytes_rewritten"] += new.object_bytes
        out["kv_bytes_reclaimed"] -= new.object_bytes
        out["new"].append(new)
        if grace_s <= 0:  # its copy is durable and published: nobody need read the old one
            drop(m)
        else:
            out["segments_awaiting_grace"] += 1
    for m in plan.delete:
        drop(m)
    out["segments_awaiting_grace"] += len(plan.waiting)
    return out


def _fold_usage(layout: ObjectLayout, retry: RetryPolicy, kept: list[PackManifest], usage: UsageSeen,
                now: float) -> None:
    """One usage file per model with the last use of every kept segment and of its blocks (a use of
    a whole segment by an older reader becomes a use of each of its blocks)."""
    by_fpid: dict[str, UsageFile] = {}
    for m in kept:
        k = (m.fingerprint_id, m.pack)
        if k not in usage.segments:
            continue
        f = by_fpid.setdefault(m.fingerprint_id, UsageFile({}, {}))
        f.last_used[m.pack] = usage.segments[k]
        whole, blocks = usage.whole.get(k, 0.0), usage.blocks.get(k, {})
        offs = {e.offset: max(whole, blocks.get(e.offset, 0.0)) for e in m.entries.values()}
        f.blocks[m.pack] = {o: t for o, t in offs.items() if t > 0}
    for fpid, f in by_fpid.items():
        path = layout.usage_path(fpid, f"{int(now * 1000):013d}-{uuid.uuid4().hex}")
        body = f.to_json()
        retry.call(lambda p=path, b=body: layout.put_new(p, b), f"write {path}")


def object_stats(layout: ObjectLayout, retry: RetryPolicy | None = None) -> dict[str, Any]:
    """Packs, blocks and bytes in an object store prefix, per fingerprint."""
    retry = retry or RetryPolicy()
    per_fp: dict[str, dict[str, Any]] = {}
    oldest, newest = None, None
    scan = scan_index(layout, retry, "stats")
    for m in scan.manifests:
        s = per_fp.setdefault(m.fingerprint, {"packs": 0, "blocks": 0, "kv_bytes": 0, "keys": set()})
        s["packs"] += 1
        s["blocks"] += len(m.entries)
        s["kv_bytes"] += m.object_bytes
        s["keys"].update(m.entries)
        oldest = m.created_s if oldest is None else min(oldest, m.created_s)
        newest = m.created_s if newest is None else max(newest, m.created_s)
    for s in per_fp.values():
        s["unique_blocks"] = len(s.pop("keys"))
    return {
        "packs": sum(s["packs"] for s in per_fp.values()),
        "blocks": sum(s["blocks"] for s in per_fp.values()),
        "unique_blocks": sum(s["unique_blocks"] for s in per_fp.values()),
        "kv_bytes": sum(s["kv_bytes"] for s in per_fp.values()),
        "oldest_created_s": oldest,
        "newest_created_s": newest,
        "unreadable_index_files": scan.unreadable,
        "invalid_index_files": scan.invalid,
        "fingerprints": per_fp,
    }
