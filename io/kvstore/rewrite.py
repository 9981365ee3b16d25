"""Rewriting mostly-dead segments: gc copies a segment's live blocks into a new one, then drops it.

Retention is by last use (`kv gc --unused-days N`), block by block: a segment stays while any of
its blocks is used, so one used system prompt could keep a segment of a hundred dead one-off
prompts. A block copy is *live* when it was written or read in the last N days and no newer
copy of its key is live elsewhere (that copy is the key's *keeper*). A segment whose live blocks
hold less than `below` of its block bytes is rewritten:

1. its live blocks are read (one ranged GET per run of neighbours, in one batch) and verified;
2. they are packed, in their order (a prompt's chain stays contiguous), into a new segment with
   a name no one else uses (created ms + the digest of its bytes), created only if absent: the
   object first, then its index file, which publishes it (readers find it through the index
   files written since the last compaction, and the compaction that ends every gc);
3. only then is the old segment deleted, index file first, and only once the new copy has
   existed for `grace_s`: a decode started earlier holds manifests that name the old segment,
   and reads it for that long. Until then the old segment is *waiting*: every block of it has a
   newer live copy, so it is never rewritten twice; the first gc after the grace deletes it.
   A decode that still holds the old location afterwards gets `object_deleted` for it, asks the
   index, and reads the new copy (object_tier.ObjectStoreTier.get_many).

A gc that dies anywhere leaves every live block readable: before step 2's index file the new
object is an unpublished orphan (removed by a later gc after its grace) and the old segment is
untouched; after it both hold the blocks; the old segment goes only after that. Two gcs at once
may each write a copy: the older of the two then has no live block (the newer is each key's
keeper), and a gc past the grace drops it. A rewritten block's life restarts at the rewrite (the new segment's
write counts as a use): it lives at most N more days unless used again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from kvbatch.io.kvstore.block_format import BlockEntry, digest, pack_blocks, unpack_block
from kvbatch.io.kvstore.index_files import PackManifest

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_REWRITE_BELOW = 0.5  # rewrite a segment whose live blocks hold less than half its block bytes
DEFAULT_REWRITE_GRACE_S = 24 * 3600.0  # how long an old segment outlives its replacement


class SegmentStore(Protocol):
    """What a rewrite needs of object_layout.ObjectLayout (every call counted there)."""

    def get_range(self, path: str, start: int, end: int) -> bytes: ...
    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | Exception]: ...
    def put_new(self, path: str, data: bytes) -> bool: ...
    def object_path(self, fpid: str, pack: str) -> str: ...
    def index_path(self, fpid: str, pack: str) -> str: ...


class Retry(Protocol):
    def call(self, fn: Callable[[], T], what: str) -> T: ...


@dataclass
class RewritePlan:
    """What gc does with each kept segment beyond keeping it."""

    rewrite: list[tuple[PackManifest, list[BlockEntry]]] = field(default_factory=list)  # live entries, by offset
    delete: list[PackManifest] = field(default_factory=list)  # no live block; replacements past the grace
    waiting: list[PackManifest] = field(default_factory=list)  # no live block; a replacement still young
    live_fraction: dict[tuple[str, str], float] = field(default_factory=dict)


def plan_rewrites(kept: list[PackManifest], block_last: Callable[[PackManifest, int], float], now: float,
                  unused_s: float, below: float, grace_s: float) -> RewritePlan:
    """Classify the kept segments by their live blocks (see the module docstring).

    `block_last(m, offset)` is a block's last use (its segment's write at least)."""
    newest_first = sorted(kept, key=lambda m: (m.created_s, m.pack), reverse=True)
    keeper: dict[str, PackManifest] = {}
    for m in newest_first:
        for e in m.entries.values():
            if now - block_last(m, e.offset) <= unused_s:
                keeper.setdefault(e.key, m)
    plan = RewritePlan()
    for m in newest_first:
        entries = sorted(m.entries.values(), key=lambda e: e.offset)
        live = [e for e in entries if keeper.get(e.key) is m]
        total = sum(e.length for e in entries)
        frac = sum(e.length for e in live) / total if total else 0.0
        plan.live_fraction[(m.fingerprint_id, m.pack)] = frac
        if live:
            if frac < below:
                plan.rewrite.append((m, live))
            continue
        # No live block here: each key is dead, or kept by a newer segment (a replacement).
        holders = [keeper[e.key] for e in entries if e.key in keeper]
        if all(now - h.created_s >= grace_s for h in holders):
            plan.delete.append(m)
        else:
            plan.waiting.append(m)
    return plan


def rewrite_segment(layout: SegmentStore, retry: Retry, m: PackManifest, live: list[BlockEntry],
                    now: float) -> PackManifest:
    """Copy `live` (entries of `m`, in offset order) into a new, published segment; return its index.

    Raises what reading or writing raised (the old segment is then untouched), and
    block_format.BlockCorrupt when a live block fails verification: a copy is bit-exact or
    not made."""
    path = layout.object_path(m.fingerprint_id, m.pack)
    runs: list[list[BlockEntry]] = []
    for e in live:  # neighbours in the object are one ranged GET
        if runs and runs[-1][-1].offset + runs[-1][-1].length == e.offset:
            runs[-1].append(e)
        else:
            runs.append([e])
    spans = [(path, run[0].offset, run[-1].offset + run[-1].length) for run in runs]
    got = layout.read_ranges(spans)  # one batch (concurrent on async stores); a failed range again alone
    blocks: list[tuple[str, torch.Tensor]] = []
    for run, (_, lo, hi), raw in zip(runs, spans, got):
        if isinstance(raw, Exception):
            raw = retry.call(lambda lo=lo, hi=hi: layout.get_range(path, lo, hi), f"read {path}[{lo}:{hi}]")
        for e in run:
            blocks.append((e.key, unpack_block(bytes(raw[e.offset - lo: e.offset - lo + e.length]), e, m.fingerprint)))
    data, entries = pack_blocks(m.fingerprint, blocks)
    ms = int(now * 1000)
    new = PackManifest(f"{ms:013d}-{digest(data)}", m.fingerprint, m.fingerprint_id, len(data), ms / 1000, entries)
    obj, idx = layout.object_path(new.fingerprint_id, new.pack), layout.index_path(new.fingerprint_id, new.pack)
    # Create-only, object first: the index file publishes it. "Already there" holds the same bytes.
    retry.call(lambda: layout.put_new(obj, data), f"write {obj}")
    retry.call(lambda: layout.put_new(idx, new.to_json()), f"write {idx}")
    return new
