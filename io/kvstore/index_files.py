"""The index file format of the durable KV tier: names, entries and their validation.

Everything an index file (or a listing, or a manifest's block location) says later becomes a
path or a byte range, so each field is checked against the one shape kvbatch itself produces
before it is used (object_tier.py reads per-segment index files with it, index.py its
partitions and the manifests' locations).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from kvbatch.io.kvstore.block_format import DTYPES, LAYOUT_VERSION, BlockEntry, digest
from kvbatch.io.kvstore.tiers import check_key

# -- names and ranges read from the store ------------------------------------------------------
#
# Everything an index file (or a listing) says later becomes a path (pack, fingerprint id) or a
# byte range (offset, length). Anyone who can write one file into a shared store writes these,
# so each is checked against the one shape kvbatch itself produces before it is used, and the
# layout builds paths from checked names only.

_PACK_NAME = re.compile(r"[0-9]{13,20}-[0-9a-f]{32}")  # f"{created ms:013d}-{digest(object)}", see _write_pack
_FPID_NAME = re.compile(r"[0-9a-f]{32}")  # fingerprint_id(): a blake2b-128 hex digest
_DIGEST = re.compile(r"[0-9a-f]{32}")  # block_format.digest()
_PARTITION = re.compile(r"[0-9a-f]{2}")  # index.partition_of()
_MAX_DIMS = 8  # a KV block is [layers, 2, heads, block, dim] or fewer; more is not ours
_MAX_FINGERPRINT_CHARS = 4096


class IndexInvalid(ValueError):
    """An index file (or a name in the store) that fails validation: hostile or corrupt.

    It is skipped and counted (`invalid_index_files`), never used to find data, and nothing is
    ever deleted through it. The message names the file and the field.
    """

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source, self.field, self.reason = source, field, reason
        super().__init__(f"{source}: {field}: {reason}")


def _shown(value: Any, limit: int = 60) -> str:
    s = repr(value)  # repr, not str: a NUL, a backslash or a newline shows as itself
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _checked_name(value: Any, pattern: re.Pattern[str], source: str, field: str, shape: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise IndexInvalid(source, field, f"{_shown(value)} is not {shape}")
    return value


def _checked_int(value: Any, source: str, field: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):  # JSON true is not a number here
        raise IndexInvalid(source, field, f"must be an integer, got {_shown(value)}")
    if value < lo:
        raise IndexInvalid(source, field, f"must be >= {lo}, got {value}")
    return value


def _checked_entry(b: Any, source: str, field: str, object_bytes: int) -> BlockEntry:
    if not isinstance(b, dict):
        raise IndexInvalid(source, field, f"must be an object, got {_shown(b)}")
    try:
        key = check_key(b.get("key"))
    except ValueError as exc:
        raise IndexInvalid(source, f"{field}.key", str(exc)) from None
    offset = _checked_int(b.get("offset"), source, f"{field}.offset", 0)
    length = _checked_int(b.get("length"), source, f"{field}.length", 1)
    if offset + length > object_bytes:
        raise IndexInvalid(source, f"{field}.length", f"block [{offset}, {offset + length}) ends past the "
                           f"{object_bytes} bytes the index gives its object")
    checksum = _checked_name(b.get("checksum"), _DIGEST, source, f"{field}.checksum", "a 32-hex digest")
    range_checksum = _checked_name(b.get("range_checksum"), _DIGEST, source, f"{field}.range_checksum",
                                   "a 32-hex digest")
    dtype = b.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise IndexInvalid(source, f"{field}.dtype", f"{_shown(dtype)} is not one of {sorted(DTYPES)}")
    shape = b.get("shape")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise IndexInvalid(source, f"{field}.shape", f"must be a list of at most {_MAX_DIMS} sizes, got {_shown(shape)}")
    dims = tuple(_checked_int(s, source, f"{field}.shape.{i}", 0) for i, s in enumerate(shape))
    # The range holds the tensor's raw bytes plus their IPC framing: a shape whose bytes cannot fit
    # is a lie, refused here rather than by an allocation later.
    nbytes = math.prod(dims) * torch.empty((), dtype=DTYPES[dtype]).element_size()
    if nbytes > length:
        raise IndexInvalid(source, f"{field}.shape", f"{dtype}{list(dims)} needs {nbytes} bytes, more than the "
                           f"block's {length}-byte range")
    return BlockEntry(key, offset, length, checksum, range_checksum, dtype, dims)


@dataclass
class PackManifest:
    """The index file of one packed object: published after the object is whole."""

    pack: str  # "<created_ms>-<digest>"
    fingerprint: str
    fingerprint_id: str
    object_bytes: int
    created_s: float
    entries: dict[str, BlockEntry]
    # True for a stub holding only some of the pack's entries (read from an index partition or a
    # manifest's locations); False for a whole index file.
    partial: bool = False

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": "kvbatch.kvpack-index",
                "version": LAYOUT_VERSION,
                "pack": self.pack,
                "fingerprint": self.fingerprint,
                "fingerprint_id": self.fingerprint_id,
                "object_bytes": self.object_bytes,
                "created_s": self.created_s,
                "blocks": [e.to_json() for e in self.entries.values()],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str = "index file", where: tuple[str, str] | None = None) -> PackManifest:
        """Parse and validate an index file; raise IndexInvalid naming `source` and the field.

        `where` is (fingerprint id, pack) as the file's own path names them: an index file may
        describe only the pack it is named for, so it can never point gc at another pack.
        """
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nested too deeply
            raise IndexInvalid(source, "$", f"not JSON ({_shown(str(exc), 120)})") from None
        if not isinstance(d, dict):
            raise IndexInvalid(source, "$", f"must be a JSON object, got {type(d).__name__}")
        if d.get("format") != "kvbatch.kvpack-index":
            raise IndexInvalid(source, "format", f"not a kvbatch pack index (format {_shown(d.get('format'))})")
        if type(d.get("version")) is not int or d["version"] != LAYOUT_VERSION:
            raise IndexInvalid(source, "version", f"version {_shown(d.get('version'))}, this reader knows "
                               f"{LAYOUT_VERSION}")
        pack = _checked_name(d.get("pack"), _PACK_NAME, source, "pack", "a pack name (<created ms>-<32 hex>)")
        fingerprint = d.get("fingerprint")
        if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= _MAX_FINGERPRINT_CHARS:
            raise IndexInvalid(source, "fingerprint", f"must be a non-empty string, got {_shown(fingerprint)}")
        fpid = _checked_name(d.get("fingerprint_id"), _FPID_NAME, source, "fingerprint_id", "32 hex digits")
        if fpid != fingerprint_id(fingerprint):
            raise IndexInvalid(source, "fingerprint_id", f"{fpid} is not the id of fingerprint {_shown(fingerprint)}")
        if where is not None and (fpid, pack) != where:
            raise IndexInvalid(source, "pack", f"describes pack {fpid}/{pack}, but the file is the index of "
                               f"{where[0]}/{where[1]}")
        object_bytes = _checked_int(d.get("object_bytes"), source, "object_bytes", 1)
        created_s = d.get("created_s")
        if isinstance(created_s, bool) or not isinstance(created_s, int | float) or not math.isfinite(created_s) \
                or not 0 <= created_s <= 1e15:
            raise IndexInvalid(source, "created_s", f"must be a time in seconds, got {_shown(created_s)}")
        # The pack's name carries its write time: retention must not be steered by a second clock.
        if abs(int(created_s * 1000) - int(pack.split("-", 1)[0])) > 1:
            raise IndexInvalid(source, "created_s", f"{created_s} disagrees with the time in pack name {pack}")
        blocks = d.get("blocks")
        if not isinstance(blocks, list) or not blocks:
            raise IndexInvalid(source, "blocks", f"must be a non-empty list, got {_shown(blocks)}")
        entries: dict[str, BlockEntry] = {}
        for i, b in enumerate(blocks):
            e = _checked_entry(b, source, f"blocks.{i}", object_bytes)
            if e.key in entries:
                raise IndexInvalid(source, f"blocks.{i}.key", f"block {e.key} is listed twice")
            entries[e.key] = e
        # pack_blocks writes each block as its own IPC message, one after the other: ranges never overlap.
        ordered = sorted(entries.values(), key=lambda e: e.offset)
        for a, b in itertools.pairwise(ordered):
            if b.offset < a.offset + a.length:
                raise IndexInvalid(source, "blocks", f"the ranges of blocks {a.key[:16]} and {b.key[:16]} overlap")
        return cls(pack=pack, fingerprint=fingerprint, fingerprint_id=fpid, object_bytes=object_bytes,
                   created_s=float(created_s), entries=entries)


def fingerprint_id(fingerprint: str) -> str:
    """A short, path-safe name for a fingerprint: each model's packs live in their own folder."""
    return digest(fingerprint.encode())


def _pack_created_s(pack: str) -> float | None:
    head = pack.split("-", 1)[0]
    return int(head) / 1000 if head.isdigit() else None
