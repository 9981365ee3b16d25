"""CPU weights in transparent huge pages (2 MiB), for decode steps that stream them.

A batch-1 decode step reads every weight once, front to back, at the memory's bandwidth; with
4 KiB pages it also walks the page tables for each 4 KiB it reads (104,000 walks a step for
SmolLM2's 425 MB of fp32 projections), and each walk stalls the stream. Linux backs anonymous
memory with 2 MiB pages where a private mapping asks for them (``madvise(MADV_HUGEPAGE)``, honoured
when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``): a plain read of
420 MB on 2 threads went from 20.7-21.8 GB/s to 28.8-29.2, and SmolLM2's fp32 decode step from
19.0-19.9 ms to 17.3-17.6 ms at 351 tokens (Xeon 167, docs/performance.md). Torch's allocator
asks for no such pages, so :class:`HugePageArena` copies the weights it is handed into private
anonymous mappings that do.

The arena hands out tensors from chunks of at least :data:`CHUNK` bytes, each one mapping whose
start is aligned to 2 MiB; a chunk lives while any tensor cut from it does (the tensors hold the
mapping). Copying one weight at a time keeps the load's extra memory to one chunk, where copying
the whole model at once would need it twice; the unused tail of a chunk is never touched, so it
costs address space, not memory. Where huge pages are not offered (another OS, THP ``never``),
:func:`unavailable_reason` says why and the arena is not used: the weights stay where torch put
them. ``KVBATCH_HUGE_PAGES=0`` turns it off (read by the model beside its other switches).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # a chunk's tail past its last tensor is at most one partly used huge page
_ALIGN = 64  # each tensor starts on a cache line
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def unavailable_reason() -> str | None:
    """Why weights cannot be placed in transparent huge pages here, or None when they can."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return "this platform's mmap has no MADV_HUGEPAGE (Linux only)"
    try:
        setting = _THP.read_text()
    except OSError as e:
        return f"cannot read {_THP}: {e}"
    if "[never]" in setting:
        return f"transparent huge pages are off ({_THP}: {setting.strip()})"
    return None


class HugePageArena:
    """Copies CPU tensors into memory that asks for 2 MiB pages (module docstring)."""

    def __init__(self, chunk_bytes: int = CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 over the current chunk, from its aligned start
        self._used = 0
        self.bytes_placed = 0

    def _new_chunk(self, nbytes: int) -> None:
        size = max(self.chunk_bytes, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults then take 2 MiB pages
        whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while any view lives
        start = -whole.data_ptr() % HUGE_PAGE
        self._chunk, self._used = whole[start:start + size], 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Arena bytes never handed out before, as a tensor: untouched (a fresh mapping's bytes read
        zero, and take memory only where written: MKL's packed buffers, whose size is an upper bound)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._new_chunk(nbytes)
        at = self._used
        self._used = -(-(at + nbytes) // _ALIGN) * _ALIGN
        self.bytes_placed += nbytes
        return self._chunk[at:at + nbytes].view(dtype).view(shape)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor ``t`` in the arena (same dtype, shape and values)."""
        if t.device.type != "cpu":
            raise ValueError(f"huge pages hold CPU tensors, got one on {t.device}")
        if t.numel() == 0:
            return t.contiguous()
        return self.empty(tuple(t.shape), t.dtype).copy_(t)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor in the arena, every page touched now (its faults at allocation, not in
        the code that first writes it; the KV cache takes :meth:`empty` instead, which also reads
        zero, so that a cache larger than its work costs nothing for the part never written)."""
        if torch.Size(shape).numel() == 0:
            return torch.zeros(shape, dtype=dtype)
        return self.empty(tuple(shape), dtype).zero_()


def huge_page_bytes(t: torch.Tensor) -> int:
    """How many bytes of the mapping holding ``t``'s first byte the kernel backs with huge pages
    now (``AnonHugePages`` of that mapping in ``/proc/self/smaps``); 0 where it cannot tell."""
    address = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's header: start-end perms ...
            lo, _, hi = head.partition("-")
            inside = int(lo, 16) <= address < int(hi, 16)
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0
