"""The native GGUF route: ``gguf_kernels.c`` compiled at first use and called on tensors' memory.

ATen's weight-only int4/int8 CPU kernels are not vectorized for an AVX2-only CPU (measured on an
AMD EPYC: ``_weight_int4pack_mm_for_cpu`` 12x slower than fp32 BLAS at one row), so the GGUF
blocks are multiplied by a small C kernel of our own (AVX-512 or AVX2/FMA where the compiler
targets them, plain C otherwise: :func:`simd` says which). It is built with the machine's C compiler at first use and kept for the
next process (:mod:`kvbatch.kernels.cpu.native_build`), and loaded with ctypes (no torch headers).
No compiler, or a failed build: the route is unavailable (:func:`unavailable_reason` says why)
and ``weights="gguf"`` falls back to the dequantized fp32 weights.

How a projection finds its blocks: the model classes hand :meth:`LinearFormat.prepare` the fp32
weight they built (q/k/v and gate/up concatenated), not names. :func:`use_gguf_blocks` installs,
while a model is built, an index of the checkpoint's blocks by the bytes of their fp32 tensor's
first row; :func:`lookup_blocks` walks a weight's rows, finds each part by its first row and
checks the whole part equal (so a wrong match is impossible, and a weight the file held in
another type gets ``None`` and stays fp32).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu import native_build
from kvbatch.kernels.cpu.gguf_blocks import BLOCK, GGUFBlocks, block_bytes, qtype_id

SOURCE = Path(__file__).with_name("gguf_kernels.c")


@dataclass(frozen=True)
class QuantizedBlocks:
    """A projection's blocks as a torch tensor (uint8 ``[out, in / 32 * block_bytes]``) for the kernel."""

    qtype: str
    out_features: int
    in_features: int
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass(frozen=True)
class GGUFWeight:
    """One projection under ``weights="gguf"``: its blocks (``None`` where the file held it in
    another type) and the float layouts the format's other buckets multiply by (a second copy,
    in fp32, only where a float kernel measured faster in some bucket)."""

    blocks: QuantizedBlocks | None
    layouts: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- build and load


def compiler() -> str | None:
    """The C compiler to build with (see :func:`kvbatch.kernels.cpu.native_build.compiler`)."""
    return native_build.compiler()


def build_key(cc: str) -> str:
    """What the built library depends on: the source, the compiler and its flags, the CPU."""
    return native_build.build_key(SOURCE, cc)


def build(cache_dir: Path | None = None) -> Path:
    """The compiled library's path, building it when the cache lacks it. Raises ``RuntimeError``
    with the reason (no compiler, compiler errors) when it cannot be had."""
    return native_build.build(SOURCE, cache_dir if cache_dir is not None else native_build.cache_dir("gguf-kernels"))


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernel, or the reason there is none (cached: one build per process)."""
    lib = native_build.load(build, "kvb_abi_version", 2)
    if isinstance(lib, str):
        return lib
    fn = lib.kvb_gguf_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int]
    lib.kvb_simd.restype = ctypes.c_int
    lib.kvb_gguf_cols_max_rows.restype = ctypes.c_int
    lib.kvb_gguf_cols_max_k.restype = ctypes.c_int
    return lib


def available() -> bool:
    return not unavailable_reason()


def unavailable_reason() -> str:
    """Why the native route is off ('' when it is on)."""
    return native_build.reason(_library())


_SIMD = {0: "c", 1: "avx2", 2: "avx512"}


def simd() -> str:
    """The loaded kernel's vector path: ``avx512``, ``avx2`` (with FMA and F16C) or ``c`` (plain C;
    also when there is no kernel)."""
    lib = _library()
    return "c" if isinstance(lib, str) else _SIMD[lib.kvb_simd()]


def identity() -> str:
    """Names the kernel a measurement timed (for kernel_choice's cache key)."""
    cc = compiler()
    return f"{build_key(cc)}-{simd()}" if cc and available() else "unavailable"


# ---------------------------------------------------------------- the multiply


def gguf_linear(x: torch.Tensor, w: QuantizedBlocks, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [rows, in] fp32 times the blocks -> [rows, out] fp32 (plus ``b``), on torch's thread count."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"the native GGUF kernel is unavailable: {lib}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"gguf_linear takes fp32 CPU rows of {w.in_features}, got {tuple(x.shape)} {x.dtype} {x.device}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    rc = lib.kvb_gguf_matmul(qtype_id(w.qtype), w.data.data_ptr(), w.out_features, w.in_features, x.data_ptr(),
                             x.shape[0], y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"the GGUF kernel refused a {w.qtype} [{w.out_features}, {w.in_features}] weight")
    return y + b if b is not None else y


def fused_weight(w: QuantizedBlocks) -> native_kernels.ColumnsWeight | None:
    """The blocks as the fused decode layers take them (:class:`~kvbatch.kernels.cpu.native.ColumnsWeight`:
    the kernel's ``kvb_gguf_cols``, which computes a thread's range of outputs with the same sums
    as :func:`gguf_linear`), or None where that entry cannot run them: no kernel here, or rows
    longer than it holds block sums for (32,768 inputs)."""
    lib = _library()
    if isinstance(lib, str) or w.in_features > lib.kvb_gguf_cols_max_k():
        return None
    cols = ctypes.cast(lib.kvb_gguf_cols, ctypes.c_void_p).value
    return native_kernels.ColumnsWeight(cols, w.data, qtype_id(w.qtype), w.in_features, w.out_features,
                                    lib.kvb_gguf_cols_max_rows())


def to_torch(blocks: GGUFBlocks) -> QuantizedBlocks:
    data = torch.from_numpy(np.array(blocks.data, dtype=np.uint8, copy=True))  # own it: the file's map is read-only
    return QuantizedBlocks(blocks.qtype, blocks.shape[0], blocks.shape[1], data.contiguous())


def random_blocks(qtype: str, out_features: int, in_features: int, generator: torch.Generator) -> QuantizedBlocks:
    """Blocks of random quants with small finite scales: weights to time the kernel on."""
    nb, size = in_features // BLOCK, block_bytes(qtype)
    data = torch.randint(0, 256, (out_features, nb, size), dtype=torch.uint8, generator=generator)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)  # d (and m for Q4_1)
    data[:, :, 0:2] = scale
    if qtype == "Q4_1":
        data[:, :, 2:4] = scale
    return QuantizedBlocks(qtype, out_features, in_features, data.reshape(out_features, nb * size))


# ---------------------------------------------------------------- finding a projection's blocks


class BlockIndex:
    """The checkpoint's blocks, findable from the fp32 weight a model class builds (see the module
    docstring): ``tensors`` are the checkpoint's fp32 tensors, ``blocks`` their GGUF blocks by name."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], blocks: Mapping[str, GGUFBlocks]) -> None:
        self._by_first_row: dict[tuple[int, bytes], list[tuple[torch.Tensor, GGUFBlocks]]] = {}
        for name, blk in blocks.items():
            t = tensors.get(name)
            if t is None or t.dtype != torch.float32 or tuple(t.shape) != blk.shape:
                continue
            key = (blk.shape[1], t[0].contiguous().numpy().tobytes())
            self._by_first_row.setdefault(key, []).append((t, blk))

    def __len__(self) -> int:
        return sum(map(len, self._by_first_row.values()))

    def lookup(self, w: torch.Tensor) -> QuantizedBlocks | None:
        """The blocks whose dequantized values are exactly ``w`` [out, in] (fp32, rows stacked from
        one or more checkpoint tensors of one GGUF type), or None."""
        if w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
            return None
        parts: list[GGUFBlocks] = []
        row, rows, in_f = 0, w.shape[0], w.shape[1]
        while row < rows:
            found = None
            for t, blk in self._by_first_row.get((in_f, w[row].contiguous().numpy().tobytes()), []):
                n = t.shape[0]
                if row + n <= rows and torch.equal(w[row:row + n], t):
                    found = blk
                    break
            if found is None or (parts and found.qtype != parts[0].qtype):
                return None
            parts.append(found)
            row += found.shape[0]
        data = np.concatenate([p.data for p in parts]) if len(parts) > 1 else parts[0].data
        return to_torch(GGUFBlocks(parts[0].qtype, (rows, in_f), data))


_INDEX: ContextVar[BlockIndex | None] = ContextVar("kvbatch_gguf_blocks", default=None)


@contextlib.contextmanager
def use_gguf_blocks(index: BlockIndex | None) -> Iterator[None]:
    """While inside, :func:`lookup_blocks` searches ``index`` (build_model sets it around a build)."""
    token = _INDEX.set(index)
    try:
        yield
    finally:
        _INDEX.reset(token)


def lookup_blocks(w: torch.Tensor) -> QuantizedBlocks | None:
    index = _INDEX.get()
    return None if index is None else index.lookup(w)
