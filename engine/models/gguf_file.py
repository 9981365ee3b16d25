"""A GGUF file's metadata and tensor index, read in one pass over its header.

``gguf.GGUFReader`` (gguf-py) builds a numpy view for every part of every metadata value before
it returns: SmolLM2's 49,152-token vocabulary and 48,900 merges are ~250,000 views, 1.6-3.9 s of
every engine load on a 2-vCPU machine, for values read once. This reader walks the same header
with ``struct`` and slices of one memory map (the vocabulary as Python strings straight away), and
hands out each tensor's bytes exactly as ``GGUFReader`` shapes them (so ``gguf.quants.dequantize``
and the native block kernels take them unchanged); the quantization types and their block sizes
still come from gguf-py's tables. ``tests/test_gguf_file.py`` holds both readers equal on every
GGUF the suite builds and on the embedded SmolLM2.

Format (GGUF v2 and v3, little-endian): magic, version, tensor count, metadata count; each
metadata pair (key, value type, value; arrays as element type, count, elements); each tensor's
(name, dims innermost first, type, offset); the data from the next ``general.alignment`` boundary.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS: dict[int, tuple[str, int]] = {  # GGUF value type -> (struct code, size)
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
    7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
# Element-typed tensor data (GGUFReader's choice): every other type is read as its blocks' bytes.
_ELEMENT_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (the message says where and why)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``shape`` innermost dimension first (as GGUF stores it), ``data``
    a read-only view of its bytes shaped as ``gguf.GGUFReader`` shapes them."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class GGUFFile:
    """``metadata`` (key -> Python value; arrays as lists) and ``tensors`` of the GGUF at ``path``.
    The tensors' data are views of the file's memory map, which lives as long as any of them."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise GGUFFormatError(f"cannot map the file: {e}") from None
        self._buf = memoryview(self._map)
        self._at = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        self._read()

    # -- the header ---------------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        end = self._at + n
        if n < 0 or end > len(self._buf):
            raise GGUFFormatError(f"truncated: {n} bytes wanted at offset {self._at} of {len(self._buf)}")
        view, self._at = self._buf[self._at:end], end
        return view

    def _scalar(self, kind: int) -> Any:
        code, size = _SCALARS[kind]
        return struct.unpack("<" + code, self._take(size))[0]

    def _string(self) -> str:
        n = self._scalar(10)
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"a string at offset {self._at - n} is not UTF-8 ({e.reason})") from None

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(kind)
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind} at offset {self._at - 4}")
        elem, count = self._scalar(4), self._scalar(10)
        if elem in _NUMPY:  # numbers in one read
            size = np.dtype(_NUMPY[elem]).itemsize
            return np.frombuffer(self._take(count * size), dtype=_NUMPY[elem]).tolist()
        if count > len(self._buf):  # each element takes at least one byte: a corrupt count
            raise GGUFFormatError(f"an array of {count} elements at offset {self._at - 12} cannot fit the file")
        return [self._value(elem) for _ in range(count)]

    def _read(self) -> None:
        import gguf

        if bytes(self._take(4)) != b"GGUF":
            raise GGUFFormatError("not a GGUF file (the first 4 bytes are not 'GGUF')")
        version = self._scalar(4)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file "
                                  "reads as a huge version)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            dims = np.frombuffer(self._take(8 * n_dims), dtype="<u8").copy()
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFFormatError(f"general.alignment must be a positive integer, got {alignment!r}")
        start = -(-self._at // alignment) * alignment
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims)) if len(dims) else 1
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            element = _ELEMENT_DTYPES.get(qtype.name)
            if element is not None:
                dtype, count = np.dtype(element).newbyteorder("<"), n_elems
            else:
                dtype, count = np.dtype(np.uint8), n_elems * type_size // block
                shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            at = start + offset
            if at + count * dtype.itemsize > len(self._buf):
                raise GGUFFormatError(f"tensor {name!r} runs past the end of the file (truncated?)")
            data = np.frombuffer(self._map, dtype=dtype, count=count, offset=at).reshape(shape)
            self.tensors.append(GGUFTensor(name, qtype, dims, data))
