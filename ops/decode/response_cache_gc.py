"""Retention of the response cache: usage files, and a gc of entries by last use and by size.

The KV store's retention (:mod:`kvbatch.io.kvstore.gc`), applied to response-cache entries:

- **Use is recorded per run, never per hit.** A :class:`~kvbatch.ops.decode.response_cache.ResponseCache`
  remembers the keys it served and writes them, when the run flushes, in create-only usage files
  (:func:`write_usage`): ``<root>/responses/usage/<created ms>-<32 hex>.usage`` (JSON), at most
  :data:`USAGE_KEYS_PER_FILE` keys each. So a night of ten million hits costs about a hundred PUTs
  more, not ten million. An entry's write is a use too (its object's modification time).
- **gc** (:func:`gc_responses`) lists the entries once (a recursive listing: on S3 one request per
  1,000 entries, with each entry's size and time), reads every usage file, deletes the entries
  unused for ``unused_s`` (last use = the latest of the write and every recorded use) and then the
  least recently used until at most ``max_bytes`` remain, and folds the usage files it read into
  new ones holding the kept entries' last use (created first, then the old ones deleted: a gc that
  dies in between leaves both, and the last use is the max either way). Deletes go in batches (on S3
  one ``DeleteObjects`` per 1,000 keys). It removes only paths it builds from a listed name it
  validated (``v1/<2 hex>/<64 hex>.json``); any other name is counted and left alone.
- **Safe against a reader.** Entries are create-only and a lookup that finds nothing is a miss: a
  run reading while gc deletes recomputes the row and writes the entry again, never fails. A run
  that serves an entry records the use at its end, so a gc running meanwhile may delete an entry
  that run used (it is recomputed next time), as the KV store's gc may delete a segment a running
  decode reads.
- **Concurrent gcs.** A usage file listed but gone when read was folded by another gc, whose fold
  was written before it deleted the file, but may postdate this listing: the folder is listed again
  until a pass loses none (:data:`USAGE_RELISTS`), as :func:`kvbatch.io.kvstore.gc.read_usage` does.

Requests are counted by kind in the layout's :class:`~kvbatch.io.kvstore.request_counts.RequestCounter`:
LIST one per 1,000 names listed (at least one per listing), GET one per usage file, PUT one per
usage file written, DELETE one per batch of up to 1,000 objects on S3 (one per object on local disk).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import fsspec

from kvbatch.io.kvstore.faults import RetryPolicy
from kvbatch.io.kvstore.object_layout import ObjectLayout

log = logging.getLogger(__name__)

USAGE_FORMAT = "kvbatch.response-usage"
USAGE_VERSION = 1
USAGE_SUFFIX = ".usage"  # JSON, but not named .json: a count of the entries (``*.json``) never meets one
USAGE_KEYS_PER_FILE = 100_000  # ~7 MB of JSON: a night of 10M hits writes ~100 usage files
USAGE_RELISTS = 8
DELETE_BATCH = 1000  # S3's DeleteObjects takes at most 1,000 keys
_KEY = re.compile(r"[0-9a-f]{64}")
_USAGE_NAME = re.compile(r"[0-9]{13}-[0-9a-f]{32}")


class UsageInvalid(ValueError):
    """A usage file that is not one kvbatch writes: skipped, counted, never deleted."""


def entries_root(root: str) -> str:
    """The folder of the entries (``ResponseCache.path``: ``<root>/responses/v1/<key[:2]>/<key>.json``)."""
    return f"{root.rstrip('/')}/responses/v1"


def usage_root(root: str) -> str:
    return f"{root.rstrip('/')}/responses/usage"


def entry_path(root: str, key: str) -> str:
    return f"{entries_root(root)}/{key[:2]}/{key}.json"


def family_path(root: str, family: str) -> str:
    """Where a row's answer is kept by its family key (every field but ``max_tokens``), for rows that
    ask fewer tokens (``response_cache.truncated``); gc treats it as an entry."""
    return f"{entries_root(root)}/longest/{family[:2]}/{family}.json"


# -- usage files --------------------------------------------------------------------------------

def encode_usage(last_used: dict[str, float]) -> bytes:
    return json.dumps({"format": USAGE_FORMAT, "version": USAGE_VERSION, "keys": last_used},
                      separators=(",", ":"), sort_keys=True).encode()


def decode_usage(raw: bytes, source: str) -> dict[str, float]:
    """``{key: last use}`` of a usage file; :class:`UsageInvalid` naming the problem otherwise."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise UsageInvalid(f"{source}: not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != USAGE_FORMAT or doc.get("version") != USAGE_VERSION:
        raise UsageInvalid(f"{source}: not a kvbatch response-cache usage file of version {USAGE_VERSION}")
    keys = doc.get("keys")
    if not isinstance(keys, dict):
        raise UsageInvalid(f"{source}: keys must be an object of key -> seconds")
    out: dict[str, float] = {}
    for key, t in keys.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise UsageInvalid(f"{source}: {str(key)[:80]!r} is not a response-cache key (64 hex digits)")
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or not 0 <= t <= 1e15:
            raise UsageInvalid(f"{source}: the use of {key} must be a time in seconds, got {str(t)[:40]!r}")
        out[key] = float(t)
    return out


def write_usage(layout: ObjectLayout, last_used: dict[str, float], now: float | None = None,
                retry: RetryPolicy | None = None) -> int:
    """Create usage files holding ``last_used`` (at most :data:`USAGE_KEYS_PER_FILE` keys each);
    returns how many were written."""
    if not last_used:
        return 0
    retry = retry or RetryPolicy()
    now = time.time() if now is None else now
    keys = sorted(last_used)
    written = 0
    for i in range(0, len(keys), USAGE_KEYS_PER_FILE):
        body = encode_usage({k: last_used[k] for k in keys[i:i + USAGE_KEYS_PER_FILE]})
        path = f"{usage_root(layout.root)}/{int(now * 1000):013d}-{uuid.uuid4().hex}{USAGE_SUFFIX}"
        retry.call(lambda p=path, b=body: layout.put_new(p, b), f"write {path}")
        written += 1
    return written


@dataclass
class UsageSeen:
    """Every usage file read: the latest use of each key, the files (folded afterwards), the invalid ones."""

    last_used: dict[str, float] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    invalid: int = 0


def read_usage(layout: ObjectLayout, retry: RetryPolicy) -> UsageSeen:
    """Every usage file, merged (latest use wins); relisted while files vanish (another gc folding)."""
    seen = UsageSeen()
    read: set[str] = set()
    folder = usage_root(layout.root)
    for _ in range(USAGE_RELISTS):
        lost = False
        for name in retry.call(lambda: layout.ls_names(folder), "list usage"):
            if name in read:
                continue
            read.add(name)
            if not (name.endswith(USAGE_SUFFIX) and _USAGE_NAME.fullmatch(name[: -len(USAGE_SUFFIX)])):
                seen.invalid += 1
                log.warning("response cache gc: %r is not a usage file name kvbatch makes: left alone", name[:200])
                continue
            path = f"{folder}/{name}"
            try:
                usage = decode_usage(retry.call(lambda p=path: layout.get(p), f"read {path}"), path)
            except FileNotFoundError:
                lost = True
                continue
            except UsageInvalid as exc:
                seen.invalid += 1
                log.warning("response cache gc: invalid usage file left alone: %s", exc)
                continue
            seen.files.append(path)
            for key, t in usage.items():
                seen.last_used[key] = max(seen.last_used.get(key, 0.0), t)
        if not lost:
            return seen
    raise RuntimeError(f"response cache gc: usage files kept vanishing across {USAGE_RELISTS} listings (another gc "
                       "folding them?); nothing was deleted, run gc again")


# -- the entries --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    key: str
    path: str
    size: int
    written_s: float  # the object's modification time: its write


def _info_time(info: dict[str, Any]) -> float | None:
    for name in ("mtime", "LastModified", "last_modified", "created"):
        t = info.get(name)
        if isinstance(t, datetime):
            return t.timestamp()
        if isinstance(t, int | float) and not isinstance(t, bool):
            return float(t)
    return None


def list_entries(layout: ObjectLayout, retry: RetryPolicy) -> tuple[list[Entry], list[str], int]:
    """(the entries, temp files of create-only writes, names that are neither: left alone)."""
    base = entries_root(layout.root)
    layout.fs.invalidate_cache(base)
    try:
        found = retry.call(lambda: layout.fs.find(base, detail=True), "list entries")
    except FileNotFoundError:
        found = {}
    # On S3 a recursive listing is one request per 1,000 names (no delimiter, so no folder walk).
    layout.requests.add("LIST", max(1, math.ceil(len(found) / 1000)))
    entries: list[Entry] = []
    temps: list[str] = []
    strange = 0
    for path, info in found.items():
        path = path.rstrip("/")
        name = path.rsplit("/", 1)[-1]
        if info.get("type") == "directory":
            continue
        key = name[:-5] if name.endswith(".json") else ""
        written = _info_time(info)
        if _KEY.fullmatch(key) and written is not None and path in (entry_path(layout.root, key),
                                                                   family_path(layout.root, key)):
            entries.append(Entry(key, path, int(info.get("size") or 0), written))
        elif layout.local and name.startswith(".tmp-") and path.startswith(base + "/"):
            temps.append(path)
        else:
            strange += 1
    return entries, temps, strange


def _delete(layout: ObjectLayout, retry: RetryPolicy, paths: list[str]) -> None:
    """Delete ``paths`` (one DeleteObjects per 1,000 on an object store, one unlink each on disk);
    one already gone is no error."""
    if layout.local:
        for p in paths:
            layout.requests.add("DELETE")
            try:
                layout.fs.rm_file(p)
            except FileNotFoundError:
                pass
        return
    for i in range(0, len(paths), DELETE_BATCH):
        batch = paths[i:i + DELETE_BATCH]
        layout.requests.add("DELETE")
        retry.call(lambda b=batch: layout.fs.rm(b), f"delete {len(batch)} objects")


def gc_responses(
    layout: ObjectLayout,
    *,
    unused_s: float | None = None,
    max_bytes: int | None = None,
    now: float | None = None,
    temp_grace_s: float = 3600.0,
    retry: RetryPolicy | None = None,
) -> dict[str, Any]:
    """Delete the entries unused for ``unused_s``, then the least recently used until at most
    ``max_bytes`` remain; fold the usage files; remove create-only temp files older than
    ``temp_grace_s`` (a writer that died). See the module docstring."""
    if unused_s is None and max_bytes is None:
        raise ValueError("response cache gc needs unused_s and/or max_bytes")
    if unused_s is not None and not (math.isfinite(unused_s) and unused_s >= 0):
        raise ValueError(f"response cache gc: unused_s must be a number of seconds >= 0, got {unused_s}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"response cache gc: max_bytes must be >= 0, got {max_bytes}")
    retry = retry or RetryPolicy()
    now = time.time() if now is None else now
    before = layout.requests.snapshot()
    usage = read_usage(layout, retry)
    entries, temps, strange = list_entries(layout, retry)

    def last(e: Entry) -> float:
        return max(e.written_s, usage.last_used.get(e.key, 0.0))

    unused = [e for e in entries if unused_s is not None and now - last(e) > unused_s]
    gone = {e.key for e in unused}
    kept = sorted((e for e in entries if e.key not in gone), key=last)
    total = sum(e.size for e in kept)
    evicted: list[Entry] = []
    while max_bytes is not None and total > max_bytes and kept:
        e = kept.pop(0)  # the least recently used first
        evicted.append(e)
        total -= e.size
    _delete(layout, retry, [e.path for e in unused + evicted])
    # Fold the usage files read into new ones with the kept entries' last use (created first).
    folded = {e.key: usage.last_used[e.key] for e in kept if e.key in usage.last_used}
    usage_written = write_usage(layout, folded, now, retry) if usage.files else 0
    _delete(layout, retry, usage.files)
    old_temps = [p for p in temps if _local_age(layout, p, now) > temp_grace_s]
    _delete(layout, retry, old_temps)
    return {
        "entries_unused_deleted": len(unused),
        "entries_evicted_for_size": len(evicted),
        "bytes_deleted": sum(e.size for e in unused + evicted),
        "entries_kept": len(kept),
        "bytes_kept": total,
        "usage_files_read": len(usage.files),
        "usage_files_written": usage_written,
        "invalid_usage_files": usage.invalid,
        "unknown_names": strange,
        "temp_files_deleted": len(old_temps),
        "requests": {k: v for k, v in layout.requests.since(before).items() if v},
    }


def _local_age(layout: ObjectLayout, path: str, now: float) -> float:
    try:
        return now - float(layout.fs.info(path)["mtime"])
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return 0.0


def open_layout(url: str, storage_options: dict[str, Any] | None = None) -> ObjectLayout:
    """The layout of the response cache at ``url`` (the URL ``--response-cache`` takes)."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return ObjectLayout(fs, root)


def response_cache_gc(url: str, *, unused_days: float | None = None, max_gb: float | None = None,
                      storage_options: dict[str, Any] | None = None, now: float | None = None) -> dict[str, Any]:
    """:func:`gc_responses` on the cache at ``url``, retention in days and GB (``kvbatch response-cache gc``)."""
    unused_s = None if unused_days is None else unused_days * 86400
    max_bytes = None if max_gb is None else int(max_gb * (1 << 30))
    return gc_responses(open_layout(url, storage_options), unused_s=unused_s, max_bytes=max_bytes, now=now)

