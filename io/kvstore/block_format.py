"""KV block format: many KV blocks packed into one Arrow IPC file.

Why this shape:
- Object stores are slow at many small objects, so prefill packs many blocks into one object.
- A decode worker needs a few blocks out of a pack, so each block is one record batch (one
  encapsulated IPC message) whose byte range the index records: a reader fetches that range
  alone and decodes it against a fixed schema, without the rest of the object.
- The object stays a valid Arrow IPC *file*: `pyarrow.ipc.open_file` reads it whole, and its
  schema metadata says what it holds (fingerprint, dtype, shape, layout version).
- A block that is truncated, corrupted or from another model must never be served. Two digests
  guard it: `checksum` over the tensor's raw bytes (in the index and in the batch's metadata)
  and `range_checksum` over the whole encoded message (index only), so a flipped byte anywhere
  in a block's range is caught, padding and metadata included.

Tensors are stored as raw little-endian bytes (a uint8 view), so every dtype, bfloat16 and NaN
payloads included, round-trips bit-exactly.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass

import pyarrow as pa
import torch

LAYOUT_VERSION = 2  # 2: segments of many sequences, create-only writes, a layout marker (object_layout)
FORMAT_NAME = "kvbatch.kvblock"

# Dtypes a block may have, by the name written into metadata. Names are torch's own.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# The schema every block message is decoded against. Metadata is per object (schema) and per
# block (batch custom metadata); the column layout itself never changes within a layout version.
_DATA_FIELD = pa.field("data", pa.large_binary(), nullable=False)
_BASE_SCHEMA = pa.schema([_DATA_FIELD])
_BASE_SCHEMA_MESSAGE = _BASE_SCHEMA.serialize().to_pybytes()
_FILE_MAGIC_PADDED = 8  # b"ARROW1" + 2 padding bytes before the schema message
_CONTINUATION = b"\xff\xff\xff\xff"

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("kvbatch's KV block format assumes a little-endian host")

# Reasons a block is refused. KVStore reports them as miss reasons.
CORRUPT_REASONS = ("truncated", "checksum", "fingerprint", "dtype", "shape", "key", "unreadable", "layout")


class BlockCorrupt(Exception):
    """A stored block cannot be trusted; `reason` is one of CORRUPT_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in CORRUPT_REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class BlockEntry:
    """Where one block lives inside a packed object, and what it must decode to."""

    key: str
    offset: int
    length: int
    checksum: str  # blake2b-128 hex of the tensor's raw bytes
    range_checksum: str  # blake2b-128 hex of bytes [offset, offset + length) of the object
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "BlockEntry":
        return cls(
            key=str(d["key"]),
            offset=int(d["offset"]),
            length=int(d["length"]),
            checksum=str(d["checksum"]),
            range_checksum=str(d["range_checksum"]),
            dtype=str(d["dtype"]),
            shape=tuple(int(x) for x in d["shape"]),
        )


def digest(data: bytes | bytearray | memoryview) -> str:
    """The checksum used everywhere in the KV store: blake2b with a 16-byte digest, as hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """The metadata name of a torch dtype; raises ValueError for dtypes the format does not carry."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"KV block dtype {dtype} is not supported; use one of {sorted(DTYPES)}") from None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor in C order (a uint8 view: bit-exact for every dtype)."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a tensor from raw bytes; the result owns its memory."""
    td = DTYPES[dtype]
    if len(data) == 0:
        return torch.empty(shape, dtype=td)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(td).reshape(shape)


def _expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=DTYPES[dtype]).element_size()


def pack_blocks(fingerprint: str, blocks: list[tuple[str, torch.Tensor]]) -> tuple[bytes, dict[str, BlockEntry]]:
    """Pack blocks into one Arrow IPC file; return its bytes and key -> BlockEntry.

    A key given twice is packed once (the first tensor wins: a content-addressed key names
    one content). Raises ValueError on an empty list, an empty key or an unsupported dtype.
    """
    if not blocks:
        raise ValueError("pack_blocks needs at least one block")
    seen: set[str] = set()
    unique: list[tuple[str, torch.Tensor]] = []
    for key, t in blocks:
        if not isinstance(key, str) or not key:
            raise ValueError(f"KV block key must be a non-empty string, got {key!r}")
        if key not in seen:
            seen.add(key)
            unique.append((key, t))

    dtypes = {dtype_name(t.dtype) for _, t in unique}
    shapes = {tuple(t.shape) for _, t in unique}
    schema_md = {
        "kvbatch.format": FORMAT_NAME,
        "kvbatch.layout_version": str(LAYOUT_VERSION),
        "kvbatch.fingerprint": fingerprint,
        "kvbatch.byte_order": "little",
        # One dtype/shape per object is the normal case (one model); "mixed" otherwise, and
        # each block's own metadata is authoritative.
        "kvbatch.dtype": dtypes.pop() if len(dtypes) == 1 else "mixed",
        "kvbatch.shape": json.dumps(list(shapes.pop())) if len(shapes) == 1 else "mixed",
        "kvbatch.num_blocks": str(len(unique)),
    }
    schema = _BASE_SCHEMA.with_metadata(schema_md)

    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_file(sink, schema)
    # The writer emits magic + schema lazily with the first batch, so the first block's message
    # starts right after them.
    first_offset = _FILE_MAGIC_PADDED + len(schema.serialize())
    spans: list[tuple[str, int, int, str, str, tuple[int, ...]]] = []
    for i, (key, t) in enumerate(unique):
        raw = tensor_bytes(t)
        name = dtype_name(t.dtype)
        shape = tuple(int(s) for s in t.shape)
        checksum = digest(raw)
        batch_md = {
            "key": key,
            "fingerprint": fingerprint,
            "layout_version": str(LAYOUT_VERSION),
            "dtype": name,
            "shape": json.dumps(list(shape)),
            "checksum": checksum,
            "nbytes": str(len(raw)),
        }
        start = sink.tell() if i else first_offset
        batch = pa.record_batch([pa.array([raw], type=pa.large_binary())], schema=schema)
        writer.write_batch(batch, custom_metadata=batch_md)
        spans.append((key, start, sink.tell() - start, checksum, name, shape))
    writer.close()
    data = sink.getvalue().to_pybytes()

    entries: dict[str, BlockEntry] = {}
    for key, start, length, checksum, name, shape in spans:
        assert data[start : start + 4] == _CONTINUATION, "block offset does not point at an IPC message"
        entries[key] = BlockEntry(
            key=key,
            offset=start,
            length=length,
            checksum=checksum,
            range_checksum=digest(memoryview(data)[start : start + length]),
            dtype=name,
            shape=shape,
        )
    return data, entries


def _decode_message(raw: bytes) -> tuple[pa.RecordBatch, dict[str, str]]:
    try:
        reader = pa.ipc.open_stream(_BASE_SCHEMA_MESSAGE + bytes(raw))
        batch, md = reader.read_next_batch_with_custom_metadata()
    except Exception as exc:  # pyarrow raises several types on malformed input
        raise BlockCorrupt("unreadable", f"cannot decode the block's IPC message: {exc}") from exc
    return batch, {k.decode(): v.decode() for k, v in (md or {}).items()}


def _check_and_build(
    batch: pa.RecordBatch, md: dict[str, str], expected_fingerprint: str, key: str | None
) -> tuple[str, torch.Tensor]:
    """Verify one decoded block against its own metadata and the expectations; build the tensor."""
    if md.get("layout_version") != str(LAYOUT_VERSION):
        raise BlockCorrupt("layout", f"block layout version {md.get('layout_version')!r}, expected {LAYOUT_VERSION}")
    if md.get("fingerprint") != expected_fingerprint:
        raise BlockCorrupt(
            "fingerprint", f"block fingerprint {md.get('fingerprint')!r} is not {expected_fingerprint!r}"
        )
    if key is not None and md.get("key") != key:
        raise BlockCorrupt("key", f"block holds key {md.get('key')!r}, expected {key!r}")
    dtype = md.get("dtype", "")
    if dtype not in DTYPES:
        raise BlockCorrupt("dtype", f"unknown dtype {dtype!r}")
    try:
        shape = tuple(int(x) for x in json.loads(md.get("shape", "")))
    except (ValueError, TypeError) as exc:
        raise BlockCorrupt("shape", f"unreadable shape {md.get('shape')!r}") from exc
    if batch.num_rows != 1 or batch.num_columns != 1:
        raise BlockCorrupt("unreadable", f"block batch has {batch.num_rows} rows, {batch.num_columns} columns")
    value = batch.column(0)[0].as_buffer()
    data = memoryview(value) if value is not None else memoryview(b"")
    if len(data) != _expected_nbytes(dtype, shape):
        raise BlockCorrupt("truncated", f"{len(data)} data bytes for {dtype}{list(shape)}")
    if digest(data) != md.get("checksum"):
        raise BlockCorrupt("checksum", "block data does not match its checksum")
    return dtype, tensor_from_bytes(data, dtype, shape)


def unpack_block(raw: bytes, entry: BlockEntry, expected_fingerprint: str) -> torch.Tensor:
    """Decode one block from its byte range `raw` = object[entry.offset : entry.offset + entry.length].

    Verifies length, range checksum, layout version, fingerprint, key, dtype, shape and data
    checksum; raises BlockCorrupt(reason) on the first mismatch, so a caller either gets the
    exact tensor that was packed or an exception saying why not.
    """
    if len(raw) != entry.length:
        raise BlockCorrupt("truncated", f"got {len(raw)} bytes of a {entry.length}-byte block")
    if digest(raw) != entry.range_checksum:
        raise BlockCorrupt("checksum", "block bytes do not match the index's range checksum")
    batch, md = _decode_message(raw)
    dtype, tensor = _check_and_build(batch, md, expected_fingerprint, entry.key)
    if dtype != entry.dtype:
        raise BlockCorrupt("dtype", f"block dtype {dtype}, index says {entry.dtype}")
    if tuple(tensor.shape) != tuple(entry.shape):
        raise BlockCorrupt("shape", f"block shape {list(tensor.shape)}, index says {list(entry.shape)}")
    if md.get("checksum") != entry.checksum:
        raise BlockCorrupt("checksum", "block checksum differs from the index's")
    return tensor


def read_pack(data: bytes, expected_fingerprint: str) -> dict[str, torch.Tensor]:
    """Read every block of a whole packed object (for single-block disk files and inspection).

    Checks each block against its own metadata; the caller checks the object's digest if it
    needs byte-exact integrity of padding and metadata too.
    """
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        md = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    except Exception as exc:
        raise BlockCorrupt("unreadable", f"not an Arrow IPC file: {exc}") from exc
    if md.get("kvbatch.format") != FORMAT_NAME:
        raise BlockCorrupt("unreadable", f"not a kvbatch KV pack (format {md.get('kvbatch.format')!r})")
    if md.get("kvbatch.fingerprint") != expected_fingerprint:
        raise BlockCorrupt(
            "fingerprint", f"pack fingerprint {md.get('kvbatch.fingerprint')!r} is not {expected_fingerprint!r}"
        )
    out: dict[str, torch.Tensor] = {}
    for i in range(reader.num_record_batches):
        try:
            batch, bmd = reader.get_batch_with_custom_metadata(i)
        except Exception as exc:
            raise BlockCorrupt("unreadable", f"block {i}: {exc}") from exc
        bmd_s = {k.decode(): v.decode() for k, v in (bmd or {}).items()}
        _, tensor = _check_and_build(batch, bmd_s, expected_fingerprint, None)
        out[bmd_s["key"]] = tensor
    return out


def pack_metadata(data: bytes) -> dict[str, str]:
    """The schema metadata of a packed object (fingerprint, dtype, shape, layout version)."""
    reader = pa.ipc.open_file(pa.py_buffer(data))
    return {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
