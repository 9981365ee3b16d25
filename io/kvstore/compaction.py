"""Compaction of the durable KV tier's index: per-segment index files -> a partitioned generation.

The format and the reader are in index.py (its docstring says why this is safe to kill at any
point and to run twice at once); `kvbatch kv compact` and every `kv gc` run this.
"""

from __future__ import annotations

import bisect
import logging
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.compute

from kvbatch.io.kvstore.index import _PARTITION_SCHEMA, PARTITIONS, Generation, _partition_bytes, _rows, partition_of
from kvbatch.io.kvstore.index_files import _FPID_NAME, IndexInvalid, PackManifest
from kvbatch.io.kvstore.index_pages import paged_partition_bytes
from kvbatch.io.kvstore.faults import RetryPolicy
from kvbatch.io.kvstore.gc import scan_index
from kvbatch.io.kvstore.object_layout import ObjectLayout

log = logging.getLogger(__name__)


def compact_index(layout: ObjectLayout, retry: RetryPolicy | None = None, *, now: float | None = None,
                  grace_s: float = 3600.0, keep_generations: int = 2, paged: bool = True) -> dict[str, Any]:
    """Fold every per-writer index file into a new generation per model; remove stale generations.

    Safe to kill at any point and to run twice at once (see the module docstring). Nothing is
    published when an index file could not be read: a generation would then hide its segment
    from readers. `grace_s` bounds how late an index file may be published after its name's time
    and still be found, and how long an old generation stays for readers that hold it. `paged`
    writes paged partitions (index_pages.py: a lookup reads the pages of its keys); False writes
    each partition as one table read whole, as before pages (kept for readers' comparison)."""
    retry = retry or RetryPolicy()
    now = time.time() if now is None else now
    covers_before_ms = int((now - grace_s) * 1000)
    scan = scan_index(layout, retry, "compact")
    out: dict[str, Any] = {"generations_written": 0, "segments_indexed": 0, "blocks_indexed": 0,
                           "partitions_written": 0, "generations_deleted": 0, "partitions_deleted": 0,
                           "invalid_index_files": scan.invalid, "unreadable_index_files": scan.unreadable}
    if scan.unreadable:
        log.warning("kv compact: %d index files could not be read; no generation written (run it again)",
                    scan.unreadable)
        return out
    by_fpid: dict[str, list[PackManifest]] = {}
    for m in scan.manifests:
        by_fpid.setdefault(m.fingerprint_id, []).append(m)
    fingerprints = {m.fingerprint_id: m.fingerprint for m in scan.manifests}
    # A model whose segments are all gone gets an empty generation: its older one names them.
    for fpid in retry.call(lambda: layout.ls_names(f"{layout.root}/generations"), "list generations"):
        if _FPID_NAME.fullmatch(fpid) and fpid not in by_fpid:
            newest = _newest_generation(layout, retry, fpid)
            if newest is not None:
                by_fpid[fpid], fingerprints[fpid] = [], newest.fingerprint
    for fpid, manifests in sorted(by_fpid.items()):
        gen = f"{int(now * 1000):013d}-{uuid.uuid4().hex}"
        table = _rows(manifests)
        table = table.append_column("pp", pa.array([partition_of(k) for k in table.column("key").to_pylist()]))
        table = table.take(pa.compute.sort_indices(
            table, [("pp", "ascending"), ("key", "ascending"), ("created_s", "descending")]))
        pp_list = table.column("pp").to_pylist()
        table = table.drop_columns(["pp"])
        parts: dict[str, int] = {}
        paging: dict[str, list[int]] = {}
        for i in range(PARTITIONS):
            pp = f"{i:02x}"
            lo, hi = bisect.bisect_left(pp_list, pp), bisect.bisect_right(pp_list, pp)
            if hi == lo:
                continue
            path = layout.partition_path(fpid, gen, pp)
            if paged:
                data, bits = paged_partition_bytes(table.slice(lo, hi - lo), _PARTITION_SCHEMA, fingerprints[fpid], pp)
                paging[pp] = [bits, len(data)]
            else:
                data = _partition_bytes(table.slice(lo, hi - lo), fingerprints[fpid], pp)
            retry.call(lambda p=path, d=data: layout.put_new(p, d), f"write {path}")
            parts[pp] = hi - lo
            out["partitions_written"] += 1
        g = Generation(gen, fingerprints[fpid], fpid, covers_before_ms, parts, len(manifests), paging)
        path = layout.generation_path(fpid, gen)
        body = g.to_json()
        retry.call(lambda p=path, b=body: layout.put_new(p, b), f"write {path}")
        out["generations_written"] += 1
        out["segments_indexed"] += len(manifests)
        out["blocks_indexed"] += table.num_rows
        deleted_gens, deleted_parts = _remove_stale(layout, retry, fpid, now, grace_s, keep_generations)
        out["generations_deleted"] += deleted_gens
        out["partitions_deleted"] += deleted_parts
    return out


def _newest_generation(layout: ObjectLayout, retry: RetryPolicy, fpid: str) -> Generation | None:
    for name in sorted(retry.call(lambda: layout.list_generations(fpid), "list generations"), reverse=True):
        path = layout.generation_path(fpid, name)
        try:
            return Generation.from_json(retry.call(lambda p=path: layout.get(p), f"read {path}"), path, (fpid, name))
        except (FileNotFoundError, IndexInvalid):
            continue
    return None


def _remove_stale(layout: ObjectLayout, retry: RetryPolicy, fpid: str, now: float, grace_s: float,
                  keep: int) -> tuple[int, int]:
    """Delete generations beyond the newest `keep` that are older than `grace_s` (manifest first,
    so no reader starts on one whose partitions go next), then partitions no kept generation names."""
    names = sorted(retry.call(lambda: layout.list_generations(fpid), "list generations"), reverse=True)

    def old(name: str) -> bool:
        return now * 1000 - int(name.split("-", 1)[0]) > grace_s * 1000

    stale = [n for i, n in enumerate(names) if i >= keep and old(n)]
    gens = 0
    for n in stale:
        try:
            path = layout.generation_path(fpid, n)
            retry.call(lambda p=path: layout.remove(p), f"delete {path}")
            gens += 1
        except FileNotFoundError:
            pass  # another compaction removed it first
    kept = set(names) - set(stale)
    parts = 0
    for gen, pp in retry.call(lambda: layout.list_partitions(fpid), "list partitions"):
        if gen in kept or not old(gen):  # a young one may belong to a compaction still running
            continue
        try:
            path = layout.partition_path(fpid, gen, pp)
            retry.call(lambda p=path: layout.remove(p), f"delete {path}")
            parts += 1
        except FileNotFoundError:
            pass
    return gens, parts
