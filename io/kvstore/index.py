"""The persistent index of the durable KV tier: partitioned by key, compacted, read page by page.

Writers publish one index file per segment (``index/<fpid>/<created ms>-<digest>.json``, see
object_tier). Left alone, a reader would have to list and read all of them. Compaction folds
them into a *generation*:

    partitions/<fpid>/<generation>.<pp>.arrow   one paged partition per key partition (256, by the
                                                first byte of blake2b(key)): a directory, then pages
                                                of rows sorted by key (index_pages.py)
    generations/<fpid>/<generation>.json        names the partitions, their page bits and sizes,
                                                and `covers_before_ms`

A generation is written partitions first, each under a name no one else uses, and published by
its manifest, created only if absent: a compaction that dies leaves unreferenced partitions
(removed by a later compaction after `grace_s`), never a half generation; two compactions at once
each publish a complete generation of their own, and readers take the newest one they can read
whole. Per-writer index files are never deleted by compaction (gc deletes them with their
segment), so no race can lose an entry.

A reader for keys of one model: lists ``generations/<fpid>/`` and reads the newest manifest (two
requests), then only the pages its keys fall in (a directory entry and a page per key, in two
batches of ranged GETs, cached), plus the per-writer index files published since
``covers_before_ms`` (a few prefix LISTs over the name's leading time digits). What it costs
follows the keys asked and the recent writes, not the size of the store. A generation written
before pages (one Arrow IPC table per partition) is read a whole partition at a time; a store
never compacted is read as before: every index file of the model.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pyarrow as pa

from kvbatch.io.kvstore.block_format import LAYOUT_VERSION, BlockEntry, digest
from kvbatch.io.kvstore.index_files import (
    _FPID_NAME,
    _PACK_NAME,
    IndexInvalid,
    PackManifest,
    _checked_entry,
    _checked_name,
    _shown,
    fingerprint_id,
)
from kvbatch.io.kvstore.index_pages import MAX_BITS, directory_range, min_bytes, page_of, parse_directory_entry, read_page

log = logging.getLogger(__name__)

T = TypeVar("T")

PARTITIONS = 256
_GEN_FORMAT = "kvbatch.kv-index-generation"
_PART_FORMAT = "kvbatch.kv-index-partition"
_PP = re.compile(r"[0-9a-f]{2}")
# A reader lists the per-writer files newer than a generation by the leading digits of their
# names (created ms): with at most this many prefixes, the coarsest that covers the span.
_MAX_RECENT_PREFIXES = 8

_PARTITION_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("pack", pa.string()),
    ("object_bytes", pa.int64()),
    ("created_s", pa.float64()),
    ("offset", pa.int64()),
    ("length", pa.int64()),
    ("checksum", pa.string()),
    ("range_checksum", pa.string()),
    ("dtype", pa.string()),
    ("shape", pa.list_(pa.int64())),
])


def partition_of(key: str) -> str:
    """The key's partition: the first byte of blake2b(key), two hex digits (uniform for any key)."""
    return digest(key.encode())[:2]


@dataclass
class Generation:
    """A generation manifest: which partitions hold rows, and the per-writer files it may lack."""

    name: str  # "<created ms>-<32 hex>"
    fingerprint: str
    fingerprint_id: str
    covers_before_ms: int  # index files named before this are all in the partitions
    partitions: dict[str, int]  # partition -> rows; absent partitions are empty
    segments: int = 0
    # Paged partitions (index_pages.py): partition -> [page bits, file bytes]. A partition not
    # named here (a generation written before pages) is one Arrow IPC table, read whole.
    pages: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"format": _GEN_FORMAT, "version": LAYOUT_VERSION, "name": self.name,
                           "fingerprint": self.fingerprint, "fingerprint_id": self.fingerprint_id,
                           "covers_before_ms": self.covers_before_ms, "segments": self.segments,
                           "partitions": self.partitions, "pages": self.pages}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str, where: tuple[str, str]) -> Generation:
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError):
            raise IndexInvalid(source, "$", "not JSON") from None
        if not isinstance(d, dict) or d.get("format") != _GEN_FORMAT or d.get("version") != LAYOUT_VERSION:
            raise IndexInvalid(source, "format", "not a kvbatch index generation of this layout")
        name = _checked_name(d.get("name"), _PACK_NAME, source, "name", "a generation name (<created ms>-<32 hex>)")
        fpid = _checked_name(d.get("fingerprint_id"), _FPID_NAME, source, "fingerprint_id", "32 hex digits")
        fp = d.get("fingerprint")
        if not isinstance(fp, str) or fingerprint_id(fp) != fpid:
            raise IndexInvalid(source, "fingerprint", f"{_shown(fp)} is not the fingerprint of id {fpid}")
        if (fpid, name) != where:
            raise IndexInvalid(source, "name", f"describes {fpid}/{name}, but the file is {where[0]}/{where[1]}")
        covers = d.get("covers_before_ms")
        if isinstance(covers, bool) or not isinstance(covers, int) or not 0 <= covers <= 10**18:
            raise IndexInvalid(source, "covers_before_ms", f"must be a time in ms, got {_shown(covers)}")
        parts = d.get("partitions")
        if not isinstance(parts, dict) or not all(isinstance(p, str) and _PP.fullmatch(p) and type(n) is int
                                                  and n > 0 for p, n in parts.items()):
            raise IndexInvalid(source, "partitions", "must map two-hex-digit partitions to row counts")
        pages = d.get("pages", {})
        if not isinstance(pages, dict):
            raise IndexInvalid(source, "pages", f"must be an object, got {_shown(pages)}")
        for pp, v in pages.items():
            if pp not in parts or not (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)
                                       and 0 <= v[0] <= MAX_BITS and v[1] >= min_bytes(v[0])):
                raise IndexInvalid(source, f"pages.{_shown(pp)}", f"must be [bits 0..{MAX_BITS}, file bytes] of "
                                   f"a listed partition, got {_shown(v)}")
        return cls(name, fp, fpid, covers, dict(parts), int(d.get("segments") or 0), dict(pages))


def _partition_bytes(rows: pa.Table, fingerprint: str, pp: str) -> bytes:
    sink = pa.BufferOutputStream()
    schema = _PARTITION_SCHEMA.with_metadata({"format": _PART_FORMAT, "version": str(LAYOUT_VERSION),
                                              "fingerprint": fingerprint, "partition": pp})
    with pa.ipc.new_file(sink, schema) as w:
        w.write_table(rows.cast(schema))
    return sink.getvalue().to_pybytes()


def read_partition(raw: bytes, source: str, fingerprint: str, pp: str) -> list[PackManifest]:
    """Validate one partition file; its rows as (stub) PackManifests holding only those entries.

    Each row is checked as an index file's entry is (index_files._checked_entry), and must
    fall in the partition it is filed under: a row elsewhere could shadow no key, but is a lie."""
    try:
        table = pa.ipc.open_file(pa.py_buffer(raw)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise IndexInvalid(source, "$", f"not an Arrow IPC file ({_shown(str(exc), 120)})") from None
    md = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if md.get("format") != _PART_FORMAT or md.get("version") != str(LAYOUT_VERSION):
        raise IndexInvalid(source, "format", "not a kvbatch index partition of this layout")
    if md.get("fingerprint") != fingerprint or md.get("partition") != pp:
        raise IndexInvalid(source, "fingerprint", f"partition {_shown(md.get('partition'))} of "
                           f"{_shown(md.get('fingerprint'))}, expected {pp} of {_shown(fingerprint)}")
    if not table.schema.remove_metadata().equals(_PARTITION_SCHEMA):
        raise IndexInvalid(source, "schema", f"columns {table.schema.names} are not an index partition's")
    return rows_to_manifests(table, source, fingerprint, pp)


def rows_to_manifests(table: pa.Table, source: str, fingerprint: str, pp: str,
                      page: tuple[int, int] | None = None, where_prefix: str = "rows") -> list[PackManifest]:
    """Index rows as (stub) PackManifests, each row checked as an index file's entry is; a row must
    belong to partition `pp` (and to `page` = (page, bits) of a paged partition)."""
    fpid = fingerprint_id(fingerprint)
    packs: dict[str, PackManifest] = {}
    for i, r in enumerate(table.to_pylist()):
        where = f"{where_prefix}.{i}"
        pack = _checked_name(r["pack"], _PACK_NAME, source, f"{where}.pack", "a pack name (<created ms>-<32 hex>)")
        size, created = r["object_bytes"], r["created_s"]
        if size is None or size < 1:
            raise IndexInvalid(source, f"{where}.object_bytes", f"must be >= 1, got {_shown(size)}")
        if created is None or not math.isfinite(created) or abs(int(created * 1000) - int(pack.split("-")[0])) > 1:
            raise IndexInvalid(source, f"{where}.created_s", f"{_shown(created)} disagrees with pack name {pack}")
        entry = _checked_entry(r, source, where, size)
        if partition_of(entry.key) != pp:
            raise IndexInvalid(source, f"{where}.key", f"{entry.key[:16]} belongs to partition "
                               f"{partition_of(entry.key)}, not {pp}")
        if page is not None and page_of(entry.key, page[1]) != page[0]:
            raise IndexInvalid(source, f"{where}.key", f"{entry.key[:16]} belongs to page "
                               f"{page_of(entry.key, page[1])}, not {page[0]}")
        m = packs.get(pack)
        if m is None:
            m = packs[pack] = PackManifest(pack, fingerprint, fpid, size, float(created), {}, partial=True)
        m.entries[entry.key] = entry
    return list(packs.values())


def _rows(manifests: list[PackManifest]) -> pa.Table:
    cols: dict[str, list[Any]] = {n: [] for n in _PARTITION_SCHEMA.names}
    for m in manifests:
        for e in m.entries.values():
            for name, value in (("key", e.key), ("pack", m.pack), ("object_bytes", m.object_bytes),
                                ("created_s", m.created_s), ("offset", e.offset), ("length", e.length),
                                ("checksum", e.checksum), ("range_checksum", e.range_checksum),
                                ("dtype", e.dtype), ("shape", list(e.shape))):
                cols[name].append(value)
    return pa.table(cols, schema=_PARTITION_SCHEMA)


def recent_prefixes(since_ms: int, until_ms: int) -> list[str]:
    """Name prefixes (leading digits of a 13-digit ms time) covering [since_ms, until_ms]: the
    finest granularity that needs at most _MAX_RECENT_PREFIXES of them."""
    since_ms, until_ms = max(since_ms, 0), max(until_ms, since_ms)
    for drop in range(6, 14):  # buckets of 10^6 ms (~17 min) and coarser
        step = 10**drop
        lo, hi = since_ms // step, until_ms // step
        if hi - lo + 1 <= _MAX_RECENT_PREFIXES:
            width = 13 - drop
            return [f"{b:0{width}d}" if width > 0 else "" for b in range(lo, hi + 1)]
    return [""]


@dataclass
class _ModelIndex:
    """What one reader knows of one model's persistent index."""

    generation: Generation | None = None
    discovered: bool = False
    broken: set[str] = field(default_factory=set)  # generations found incomplete
    loaded: set[str] = field(default_factory=set)  # partitions read from `generation`
    pages: set[tuple[str, int]] = field(default_factory=set)  # (partition, page) read from `generation`
    seen: set[str] = field(default_factory=set)  # per-writer index files read (pack names)
    invalid: set[str] = field(default_factory=set)
    last_recent_s: float = -math.inf


class IndexStore(Protocol):
    """What the reader needs of object_layout.ObjectLayout (every call counted there)."""

    def get(self, path: str) -> bytes: ...
    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | Exception]: ...
    def get_range(self, path: str, start: int, end: int) -> bytes: ...
    def generation_path(self, fpid: str, gen: str) -> str: ...
    def partition_path(self, fpid: str, gen: str, pp: str) -> str: ...
    def index_path(self, fpid: str, pack: str) -> str: ...
    def list_generations(self, fpid: str) -> list[str]: ...
    def list_index_files(self, fpid: str, prefix: str) -> list[str]: ...


class IndexReader:
    """Finds where keys are stored, loading only what those keys need (see the module docstring).

    `call(fn, what)` is the tier's retried, counted, breaker-guarded call."""

    def __init__(self, layout: IndexStore, call: Callable[[Callable[[], T], str], T], name: str = "object",
                 refresh_s: float = 5.0) -> None:
        self.layout = layout
        self.call = call
        self.name = name
        self.refresh_s = refresh_s
        self._models: dict[str, _ModelIndex] = {}
        self.invalid_files = 0

    def find(self, fingerprint: str, keys: list[str], known: Callable[[tuple[str, str]], bool]) -> list[PackManifest]:
        """Manifests (stubs with the entries read) that may hold `keys`, from the partitions they fall
        in and the per-writer files newer than the generation; `known((fpid, pack))` says which
        per-writer files the caller already has. Raises what the store raised."""
        fpid = fingerprint_id(fingerprint)
        mi = self._models.setdefault(fpid, _ModelIndex())
        out: list[PackManifest] = []
        if not mi.discovered:
            self._discover(mi, fpid)
        for _ in range(3):  # a generation found incomplete falls back to the next older one
            gen = mi.generation
            if gen is None:
                break
            try:
                pages: set[tuple[str, int]] = set()
                for pp in sorted({partition_of(k) for k in keys} - mi.loaded):
                    if pp in gen.pages:
                        continue  # paged: only the pages of the keys asked, below
                    if pp in gen.partitions:  # a generation written before pages: the whole partition
                        path = self.layout.partition_path(fpid, gen.name, pp)
                        raw = self.call(lambda p=path: self.layout.get(p), f"read {path}")
                        out.extend(read_partition(raw, path, fingerprint, pp))
                    mi.loaded.add(pp)
                for k in keys:
                    pp = partition_of(k)
                    if pp in gen.pages and (pp, page_of(k, gen.pages[pp][0])) not in mi.pages:
                        pages.add((pp, page_of(k, gen.pages[pp][0])))
                out.extend(self._read_pages(mi, fpid, fingerprint, gen, sorted(pages)))
                break
            except FileNotFoundError:
                log.info("kv %s tier: generation %s lost a partition; using an older one", self.name, gen.name)
                mi.broken.add(gen.name)
                mi.loaded.clear()
                mi.pages.clear()
                self._discover(mi, fpid)
            except IndexInvalid as exc:
                log.warning("kv %s tier: invalid index partition, generation %s skipped: %s", self.name, gen.name, exc)
                self.invalid_files += 1
                mi.broken.add(gen.name)
                mi.loaded.clear()
                mi.pages.clear()
                self._discover(mi, fpid)
        if time.monotonic() - mi.last_recent_s >= self.refresh_s:
            out.extend(self._recent(mi, fpid, known))
            mi.last_recent_s = time.monotonic()
        return out

    def _read_pages(self, mi: _ModelIndex, fpid: str, fingerprint: str, gen: Generation,
                    pages: list[tuple[str, int]]) -> list[PackManifest]:
        """The rows of these pages of paged partitions: their directory entries in one batch of ranged
        GETs, then the pages (neighbours coalesced), each read once per process."""
        if not pages:
            return []
        paths = {pp: self.layout.partition_path(fpid, gen.name, pp) for pp, _ in pages}
        dirs = self._ranges([(paths[pp], *directory_range(pg)) for pp, pg in pages])
        spans: list[tuple[str, int, int, int]] = []
        for (pp, pg), raw in zip(pages, dirs):
            bits, nbytes = gen.pages[pp]
            start, end = parse_directory_entry(raw, paths[pp], pg, bits, nbytes)
            if end > start:
                spans.append((pp, pg, start, end))
        raws = self._ranges([(paths[pp], a, b) for pp, _, a, b in spans])
        out: list[PackManifest] = []
        for (pp, pg, _, _), raw in zip(spans, raws):
            bits = gen.pages[pp][0]
            table = read_page(raw, _PARTITION_SCHEMA, paths[pp], fingerprint, pp, pg, bits)
            out.extend(rows_to_manifests(table, paths[pp], fingerprint, pp, (pg, bits), f"pages.{pg}.rows"))
        mi.pages.update(pages)
        return out

    def _ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Byte ranges in one batch; a range whose GET failed is asked again on its own, with the
        tier's retries (an error left after them is raised)."""
        got = self.call(lambda: self.layout.read_ranges(ranges), f"read {len(ranges)} index ranges")
        out: list[bytes] = []
        for (path, lo, hi), r in zip(ranges, got):
            if isinstance(r, FileNotFoundError):
                raise r  # the generation lost a partition: the caller falls back to an older one
            if isinstance(r, Exception):
                r = self.call(lambda p=path, a=lo, b=hi: self.layout.get_range(p, a, b), f"read {path}[{lo}:{hi}]")
            out.append(r)
        return out

    def _discover(self, mi: _ModelIndex, fpid: str) -> None:
        names = sorted(self.call(lambda: self.layout.list_generations(fpid), "list generations"), reverse=True)
        mi.generation, mi.discovered = None, True
        for name in names:
            if name in mi.broken:
                continue
            path = self.layout.generation_path(fpid, name)
            try:
                mi.generation = Generation.from_json(self.call(lambda p=path: self.layout.get(p), f"read {path}"),
                                                     path, (fpid, name))
                return
            except FileNotFoundError:
                continue
            except IndexInvalid as exc:
                log.warning("kv %s tier: invalid index generation skipped: %s", self.name, exc)
                self.invalid_files += 1
                mi.broken.add(name)

    def _recent(self, mi: _ModelIndex, fpid: str, known: Callable[[tuple[str, str]], bool]) -> list[PackManifest]:
        """The per-writer index files the generation may lack (all of them when there is none)."""
        if mi.generation is None:
            names = self.call(lambda: self.layout.list_index_files(fpid, ""), "list index")
        else:
            names = []
            now_ms = int(time.time() * 1000) + 600_000  # ten minutes of clock skew between writers
            for prefix in recent_prefixes(mi.generation.covers_before_ms, now_ms):
                names += self.call(lambda p=prefix: self.layout.list_index_files(fpid, p), "list index")
        out = []
        for pack in sorted(set(names) - mi.seen - mi.invalid):
            if known((fpid, pack)):
                mi.seen.add(pack)
                continue
            path = self.layout.index_path(fpid, pack)
            try:
                raw = self.call(lambda p=path: self.layout.get(p), f"read {path}")
                out.append(PackManifest.from_json(raw, source=path, where=(fpid, pack)))
                mi.seen.add(pack)
            except FileNotFoundError:
                mi.seen.add(pack)  # removed by gc between list and read
            except IndexInvalid as exc:
                mi.invalid.add(pack)
                self.invalid_files += 1
                log.warning("kv %s tier: invalid index file skipped: %s", self.name, exc)
        return out


def entry_location(m: PackManifest, e: BlockEntry) -> dict[str, Any]:
    """Where one block is, as prefill hands it to decode in a manifest line."""
    return {"segment": f"{m.fingerprint_id}/{m.pack}", "segment_bytes": m.object_bytes, **e.to_json()}


def parse_location(d: Any, source: str, field: str, fingerprint: str) -> PackManifest:
    """A manifest's block location, validated as an index entry is; a stub manifest holding it."""
    if not isinstance(d, dict):
        raise IndexInvalid(source, field, f"must be an object, got {_shown(d)}")
    seg = d.get("segment")
    fpid, _, pack = seg.partition("/") if isinstance(seg, str) else ("", "", "")
    _checked_name(fpid, _FPID_NAME, source, f"{field}.segment", "<fingerprint id>/<segment name>")
    _checked_name(pack, _PACK_NAME, source, f"{field}.segment", "<fingerprint id>/<segment name>")
    if fpid != fingerprint_id(fingerprint):
        raise IndexInvalid(source, f"{field}.segment", f"{fpid} is not this model's fingerprint id")
    size = d.get("segment_bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise IndexInvalid(source, f"{field}.segment_bytes", f"must be an integer >= 1, got {_shown(size)}")
    entry = _checked_entry(d, source, field, size)
    return PackManifest(pack, fingerprint, fpid, size, int(pack.split("-")[0]) / 1000, {entry.key: entry},
                        partial=True)
