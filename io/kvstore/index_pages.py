"""Paged partitions of the KV index: a reader fetches the rows of the keys it asks, not the partition.

A partition holds 1/256 of a model's blocks, so reading it whole costs what the store holds. A
paged partition splits its rows into 2^bits pages by the next `bits` bits of blake2b(key) after
the partition's byte (`page_of`), `bits` chosen at compaction so that a page holds about
`PAGE_ROWS` rows whatever the store's size:

    0        8 bytes   magic b"KVIDXPG1"
    8        8 x (2^bits + 1) bytes: the little-endian uint64 offset of each page, then the end
    ...      the pages: one Arrow IPC message each (a record batch of the index's row schema,
             sorted by key; its custom metadata names the fingerprint, partition, page and bits)

A lookup of a key is two ranged GETs, batched over the keys asked and coalesced where they touch:
the 16 bytes of its page's directory entry (start, end; an empty page ends there), then the page.
What it reads follows the keys asked, never the partition's size.
"""

from __future__ import annotations

import bisect
import math
import struct

import pyarrow as pa
import pyarrow.compute

from kvbatch.io.kvstore.block_format import LAYOUT_VERSION, digest
from kvbatch.io.kvstore.index_files import IndexInvalid, _shown

PAGE_ROWS = 4  # rows per page on average: a lookup reads about this many rows per key
MAX_BITS = 24
MAGIC = b"KVIDXPG1"
_PAGE_FORMAT = "kvbatch.kv-index-page"
_CONTINUATION = b"\xff\xff\xff\xff"


def page_bits(rows: int) -> int:
    """Page bits for a partition of `rows` rows: about PAGE_ROWS rows a page (0: one page)."""
    return 0 if rows <= PAGE_ROWS else min(MAX_BITS, round(math.log2(rows / PAGE_ROWS)))


def page_of(key: str, bits: int) -> int:
    """The page of a key: the `bits` bits of blake2b(key) after the partition's byte."""
    return int(digest(key.encode())[2:10], 16) >> (32 - bits) if bits else 0


def directory_range(page: int) -> tuple[int, int]:
    """Bytes [start, end) of a page's directory entry: its offset and the next page's."""
    lo = len(MAGIC) + 8 * page
    return lo, lo + 16


def min_bytes(bits: int) -> int:
    """The size of a paged partition with no rows: magic and directory."""
    return len(MAGIC) + 8 * ((1 << bits) + 1)


def _page_message(rows: pa.Table, schema: pa.Schema, md: dict[str, str]) -> bytes:
    """One record batch as an encapsulated IPC message (decoded later against `schema`)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(rows.combine_chunks().to_batches()[0], custom_metadata=md)
    full = sink.getvalue().to_pybytes()
    msg = full[len(schema.serialize()): len(full) - 8]  # less the schema message and end-of-stream
    assert msg[:4] == _CONTINUATION, "a page does not start at an IPC message"
    return msg


def paged_partition_bytes(rows: pa.Table, schema: pa.Schema, fingerprint: str, pp: str) -> tuple[bytes, int]:
    """(file bytes, bits) of one paged partition from its rows (the index row schema)."""
    bits = page_bits(rows.num_rows)
    pages = [page_of(k, bits) for k in rows.column("key").to_pylist()]
    rows = rows.append_column("page", pa.array(pages, pa.int64()))
    rows = rows.take(pa.compute.sort_indices(
        rows, [("page", "ascending"), ("key", "ascending"), ("created_s", "descending")]))
    pages = rows.column("page").to_pylist()
    rows = rows.drop_columns(["page"]).cast(schema)
    bodies: list[bytes] = []
    for p in range(1 << bits):
        lo, hi = bisect.bisect_left(pages, p), bisect.bisect_right(pages, p)
        md = {"format": _PAGE_FORMAT, "version": str(LAYOUT_VERSION), "fingerprint": fingerprint,
              "partition": pp, "page": str(p), "bits": str(bits)}
        bodies.append(_page_message(rows.slice(lo, hi - lo), schema, md) if hi > lo else b"")
    offsets = [min_bytes(bits)]
    for b in bodies:
        offsets.append(offsets[-1] + len(b))
    return MAGIC + struct.pack(f"<{len(offsets)}Q", *offsets) + b"".join(bodies), bits


def parse_directory_entry(raw: bytes, source: str, page: int, bits: int, file_bytes: int) -> tuple[int, int]:
    """A page's [start, end) from its 16 directory bytes, checked against the file's size."""
    if len(raw) != 16:
        raise IndexInvalid(source, f"directory.{page}", f"{len(raw)} bytes where 16 were expected")
    start, end = struct.unpack("<2Q", raw)
    if not min_bytes(bits) <= start <= end <= file_bytes:
        raise IndexInvalid(source, f"directory.{page}", f"page range [{start}, {end}) is not inside the "
                           f"{file_bytes}-byte partition after its directory")
    return start, end


def read_page(raw: bytes, schema: pa.Schema, source: str, fingerprint: str, pp: str, page: int,
              bits: int) -> pa.Table:
    """Decode and check one page; its rows (each still to be checked as an index entry)."""
    try:
        reader = pa.ipc.open_stream(schema.serialize().to_pybytes() + bytes(raw))
        batch, md = reader.read_next_batch_with_custom_metadata()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types on malformed input
        raise IndexInvalid(source, f"pages.{page}", f"not an index page ({_shown(str(exc), 120)})") from None
    got = {k.decode(): v.decode() for k, v in (md or {}).items()}
    want = {"format": _PAGE_FORMAT, "version": str(LAYOUT_VERSION), "fingerprint": fingerprint,
            "partition": pp, "page": str(page), "bits": str(bits)}
    if got != want:
        raise IndexInvalid(source, f"pages.{page}", f"its metadata {_shown(got, 200)} is not page {page} of "
                           f"partition {pp} ({bits} bits) of {_shown(fingerprint)}")
    return pa.Table.from_batches([batch])
