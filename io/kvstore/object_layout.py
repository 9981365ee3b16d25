"""Where the durable tier's files live under a store's root, and the store's layout marker.

Layout under the store's root (one folder per model fingerprint, so a reader lists only its own
model's packs and gc/stats can still walk them all):

    objects/<fingerprint id>/<created ms>-<digest>.arrow   a pack: many blocks, one Arrow IPC file
    index/<fingerprint id>/<created ms>-<digest>.json      its index: key -> offset, length, checksums

Writes go object first, index second; the index file is what publishes a pack (Mooncake's
PutStart/PutEnd in two PUTs). Objects are immutable and never appended to.

`ObjectLayout` builds (and validates) every path and makes every request, counted by kind;
`coalesce_ranges` merges neighbouring byte ranges into one GET; `ensure_layout` checks (or
writes) the layout marker and refuses a store in another layout (`StoreLayoutError`).
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvbatch.io.kvstore.block_format import LAYOUT_VERSION
from kvbatch.io.kvstore.faults import CircuitBreaker, RetryPolicy
from kvbatch.io.kvstore.index_files import _FPID_NAME, _PACK_NAME, _PARTITION, IndexInvalid, _checked_name, _shown
from kvbatch.io.kvstore.request_counts import RequestCounter
from kvbatch.io.kvstore.tiers import TierCounters, _unlink_quiet
from kvbatch.io.urls import redact

T = TypeVar("T")


class ObjectLayout:
    """Paths under the store's root. Objects: objects/<fpid>/<pack>.arrow; index: index/<fpid>/<pack>.json."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, requests: RequestCounter | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.local = isinstance(fs, LocalFileSystem)
        # Every request below is counted by the kind the store bills it as (request_counts.py).
        self.requests = requests if requests is not None else RequestCounter()

    # -- requests: every call to the store goes through one of these, and is counted --

    def get(self, path: str) -> bytes:
        """A whole object (one GET)."""
        self.requests.add("GET")
        return self.fs.cat_file(path)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (one ranged GET)."""
        self.requests.add("GET")
        return self.fs.cat_file(path, start=start, end=end)

    def get_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[Any]:
        """Many ranges at once (one GET each; concurrent on async stores); an error per failed range."""
        self.requests.add("GET", len(paths))
        return list(self.fs.cat_ranges(paths, starts, ends, on_error="return"))

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes | Exception]:
        """Bytes of each (path, start, end), ranges of one object that touch merged into one GET
        (concurrent on async stores); the error instead where its GET failed."""
        if not ranges:
            return []
        paths, starts, ends, members = coalesce_ranges(ranges)
        out: list[bytes | Exception] = [b""] * len(ranges)
        for r, start, idxs in zip(self.get_ranges(paths, starts, ends), starts, members):
            for i in idxs:
                out[i] = r if isinstance(r, Exception) else bytes(r[ranges[i][1] - start: ranges[i][2] - start])
        return out

    def size(self, path: str) -> int | None:
        """An object's size (one HEAD)."""
        self.requests.add("HEAD")
        return self.fs.size(path)

    def put_new(self, path: str, data: bytes) -> bool:
        """Create an object that must not exist yet: False (and nothing written) if it does.

        Create-only everywhere, so nothing is ever overwritten and two writers of the same name
        cannot interleave: on S3 a PUT with `If-None-Match: *` (s3fs `mode="create"`), on local
        disk a temp file hard-linked into place (`link` fails if the name exists). Names carry
        the digest of what they hold, so "it exists" means "the same bytes are already there".
        """
        self.requests.add("PUT")
        try:
            if self.local:
                parent = path.rsplit("/", 1)[0]
                self.fs.makedirs(parent, exist_ok=True)
                tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
                try:
                    self.fs.pipe_file(tmp, data)
                    os.link(tmp, path)
                finally:
                    _unlink_quiet(tmp)
            else:
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def object_path(self, fpid: str, pack: str) -> str:
        return f"{self.root}/objects/{self._names(fpid, pack)}.arrow"

    def index_path(self, fpid: str, pack: str) -> str:
        return f"{self.root}/index/{self._names(fpid, pack)}.json"

    def _names(self, fpid: str, pack: str) -> str:
        """`<fpid>/<pack>`, refused unless both are names kvbatch makes: no `..`, `/`, NUL or backslash
        can reach a path, whoever wrote the index file or the listing."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        _checked_name(pack, _PACK_NAME, f"kv store {self.root}", "pack name", "a pack name (<created ms>-<32 hex>)")
        return f"{fpid}/{pack}"

    def owns(self, path: str) -> bool:
        """Whether `path` is one this layout builds: `<root>/{objects,index}/<fpid>/<pack>.{arrow,json}`,
        and, on local disk, whose folder really is inside the root (no symlinked folder leads out)."""
        if not path.startswith(self.root + "/"):
            return False
        parts = path[len(self.root) + 1:].split("/")
        ext = {"objects": ".arrow", "index": ".json", "usage": ".json", "generations": ".json",
               "partitions": ".arrow"}.get(parts[0]) if len(parts) == 3 else None
        if ext is None or not parts[2].endswith(ext):
            return False
        name = parts[2][: -len(ext)]
        if parts[0] == "partitions":  # "<generation>.<pp>"
            name, _, pp = name.partition(".")
            if not _PARTITION.fullmatch(pp):
                return False
        if not (_FPID_NAME.fullmatch(parts[1]) and _PACK_NAME.fullmatch(name)):
            return False
        if self.local:
            folder = os.path.realpath(os.path.dirname(path))
            if folder != os.path.join(os.path.realpath(self.root), parts[0], parts[1]):
                return False
        return True

    def remove(self, path: str) -> None:
        """Delete one pack's object or index file: only a path `owns` accepts (gc's only way to delete)."""
        if not self.owns(path):
            raise IndexInvalid(f"kv store {self.root}", "path", f"refusing to delete {_shown(path, 200)}: "
                               "not a pack file inside the store")
        self.requests.add("DELETE")
        self.fs.rm_file(path)

    def ls_names(self, folder: str) -> list[str]:
        """Base names in a folder (fresh listing, temp files left out); [] if it does not exist."""
        self.fs.invalidate_cache(folder)
        try:
            items = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            self.requests.add("LIST")
            return []
        # An object store returns at most 1,000 names per LIST request.
        self.requests.add("LIST", 1 if self.local else max(1, math.ceil(len(items) / 1000)))
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in items]
        return [n for n in names if n and not n.startswith(".tmp-")]

    def list_manifests(self) -> list[tuple[str, str]]:
        """(fpid, pack) of every published pack whose index file is well named."""
        return self.list_index()[0]

    def list_index(self) -> tuple[list[tuple[str, str]], list[str]]:
        """(fpid, pack) of every well-named index file, and the paths of entries named otherwise
        (skipped: never read, never deleted)."""
        return self._list("index", ".json")

    def list_objects(self) -> list[tuple[str, str]]:
        return self._list("objects", ".arrow")[0]

    # -- the persistent index (index.py): generations and their key partitions --

    def generation_path(self, fpid: str, gen: str) -> str:
        return f"{self.root}/generations/{self._names(fpid, gen)}.json"

    def partition_path(self, fpid: str, gen: str, pp: str) -> str:
        if not _PARTITION.fullmatch(pp):
            raise IndexInvalid(f"kv store {self.root}", "partition", f"{_shown(pp)} is not two hex digits")
        return f"{self.root}/partitions/{self._names(fpid, gen)}.{pp}.arrow"

    def list_generations(self, fpid: str) -> list[str]:
        """Generation names of one model (one LIST)."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        return [n[:-5] for n in self.ls_names(f"{self.root}/generations/{fpid}")
                if n.endswith(".json") and _PACK_NAME.fullmatch(n[:-5])]

    def list_partitions(self, fpid: str) -> list[tuple[str, str]]:
        """(generation, partition) of every partition file of one model (one LIST)."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        out = []
        for n in self.ls_names(f"{self.root}/partitions/{fpid}"):
            gen, _, rest = n.partition(".")
            if _PACK_NAME.fullmatch(gen) and rest.endswith(".arrow") and _PARTITION.fullmatch(rest[:-6]):
                out.append((gen, rest[:-6]))
        return out

    def list_index_files(self, fpid: str, prefix: str) -> list[str]:
        """Pack names of one model's index files whose names start with `prefix` (leading digits of
        their time): on S3 one prefix LIST, which costs what it returns, not the folder's size."""
        _checked_name(fpid, _FPID_NAME, f"kv store {self.root}", "fingerprint id", "32 hex digits")
        folder = f"{self.root}/index/{fpid}"
        if self.local or not hasattr(self.fs, "find") or not prefix or \
                type(self.fs).__name__ != "S3FileSystem":
            names = self.ls_names(folder)
        else:
            self.fs.invalidate_cache(folder)
            self.requests.add("LIST")
            try:
                names = [p.rsplit("/", 1)[-1] for p in self.fs.find(folder, prefix=prefix, maxdepth=1)]
            except FileNotFoundError:
                names = []
        packs = [n[:-5] for n in names if n.endswith(".json") and n.startswith(prefix)]
        return [p for p in packs if _PACK_NAME.fullmatch(p)]

    def usage_path(self, fpid: str, name: str) -> str:
        """A usage file: which segments a reader used, and when (see `record_usage`)."""
        return f"{self.root}/usage/{self._names(fpid, name)}.json"

    def list_usage(self) -> list[tuple[str, str]]:
        return self._list("usage", ".json")[0]

    def _list(self, kind: str, ext: str) -> tuple[list[tuple[str, str]], list[str]]:
        good: list[tuple[str, str]] = []
        bad: list[str] = []
        for fpid in self.ls_names(f"{self.root}/{kind}"):
            if not _FPID_NAME.fullmatch(fpid):  # not descended into: a listing's name is not a path
                bad.append(f"{self.root}/{kind}/{fpid}")
                continue
            for name in self.ls_names(f"{self.root}/{kind}/{fpid}"):
                pack = name[: -len(ext)] if name.endswith(ext) else ""
                if _PACK_NAME.fullmatch(pack):
                    good.append((fpid, pack))
                else:
                    bad.append(f"{self.root}/{kind}/{fpid}/{name}")
        return good, bad


def coalesce_ranges(ranges: list[tuple[str, int, int]]) -> tuple[list[str], list[int], list[int], list[list[int]]]:
    """Merge (path, start, end) ranges that touch or overlap within one object into one request.

    Returns (paths, starts, ends, members): one merged range per request, and for each the
    indexes of the input ranges it covers. A prompt's chain is written contiguously, so its
    blocks come back in one GET."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
    paths: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    members: list[list[int]] = []
    for i in order:
        path, start, end = ranges[i]
        if paths and paths[-1] == path and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
            members[-1].append(i)
        else:
            paths.append(path)
            starts.append(start)
            ends.append(end)
            members.append([i])
    return paths, starts, ends, members


class StoreLayoutError(RuntimeError):
    """The store at this URL is in a layout this kvbatch does not read (an older one, or newer)."""


LAYOUT_MARKER = "kvbatch-kv-layout"  # JSON; no .json, so it is never taken for an index file
_LAYOUT_FORMAT = "kvbatch.kv-store"
_LAYOUT_BODY = json.dumps({"format": _LAYOUT_FORMAT, "layout_version": LAYOUT_VERSION}).encode()


def ensure_layout(layout: ObjectLayout, retry: RetryPolicy, counters: TierCounters | None = None,
                  breaker: CircuitBreaker | None = None, *, create: bool = True) -> int:
    """Check the store's layout marker (one GET); on a new, empty store write it (create-only).

    A store holding packs but no marker was written by a kvbatch before layout 2 (one pack and
    one index file per sequence per step): it is refused, with a message saying so and what to
    do, rather than read half-right. Returns the layout version (0 for an empty store left
    unmarked when `create` is False)."""
    marker = f"{layout.root}/{LAYOUT_MARKER}"

    def call(fn: Callable[[], T], what: str) -> T:
        return retry.call(fn, what, counters, breaker)

    for _ in range(2):  # a second pass reads the marker a concurrent writer just created
        try:
            raw = call(lambda: layout.get(marker), f"read {marker}")
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                d = json.loads(raw)
                version = d["layout_version"] if isinstance(d, dict) and d.get("format") == _LAYOUT_FORMAT else None
            except ValueError:
                version = None
            if version != LAYOUT_VERSION:
                raise StoreLayoutError(
                    f"kv store {redact(layout.root)} is in KV store layout {version!r}; this kvbatch reads layout "
                    f"{LAYOUT_VERSION}: use another store URL, or remove the store's contents")
            return LAYOUT_VERSION
        top = call(lambda: layout.ls_names(layout.root), f"list {layout.root}")
        if {"objects", "index"} & set(top):
            raise StoreLayoutError(
                f"kv store {redact(layout.root)} is in the old KV store layout 1 (packs without a "
                f"{LAYOUT_MARKER}); this kvbatch reads layout {LAYOUT_VERSION} (segments, create-only "
                "writes): use another store URL, or delete the old store (its blocks are recomputed on demand)")
        if not create:
            return 0
        if call(lambda: layout.put_new(marker, _LAYOUT_BODY), f"write {marker}"):
            return LAYOUT_VERSION
    raise StoreLayoutError(f"kv store {redact(layout.root)}: its layout marker vanished while being read")
