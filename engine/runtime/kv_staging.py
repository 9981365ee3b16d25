"""A staging pool between the KV store's host tensors and the paged KV cache, with the copies on a
side stream ordered by events.

Why: a copy between the GPU and pageable host memory cannot run asynchronously, and pinning memory
per step costs milliseconds (``cudaHostAlloc``). So a fixed set of pinned host buffers is allocated
once and reused; a block travels store -> buffer (a host copy) -> cache (one non-blocking copy per
piece on a side stream) on a load, and cache -> buffer -> a tensor the store keeps on a save.

Ordering (a *fence* is a CUDA event on the GPU, an already-passed marker on the CPU):
- A buffer is reused only after the fence of the last copy that used it has passed (the pool
  waits on it, or first hands a save's bytes to their owner), never before.
- A load first makes the side stream wait for the work queued on the compute stream (a block just
  given to this sequence may still be read or written by a step in flight for its last owner); the
  compute stream then waits on the load's last fence before the step that reads those blocks (a
  wait on the GPU: the host does not block).
- A save's copies wait for the compute stream (the step that wrote the blocks); the bytes are
  taken out of a buffer only after its fence (``collect``), and before a later step writes a block
  still being copied out (a freed block reused), the compute stream waits on that copy
  (``guard``). The compute stream never waits on the host.

On the CPU the same code runs with :class:`HostCopyEngine`: plain buffers, copies done at once,
fences always passed. Tests run it with a fake engine whose copies run late, to prove the order.

Geometry: the cache is ``[A, K, blocks, *rest]`` (Llama: ``[layers, 2, ...]``; MLA:
``[layers, 1, ...]``), seen as ``rows x blocks x elems`` with ``rows = A * K`` and ``elems =
prod(rest)``. A run of consecutive block ids is ``[rows, n, elems]``; it is split into pieces
that fit one buffer: whole blocks when one fits, else row ranges of one block, else element ranges
of one row (so any block size works with any buffer size).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

DEFAULT_BUFFERS = 4
DEFAULT_BUFFER_BYTES = 8 << 20  # 4 x 8 MiB pinned: SmolLM2's bf16 blocks are 368 KiB, Llama-3.1-8B's 2 MiB


class Fence(Protocol):
    """A point in the side stream's work: ``query`` says whether it has passed, ``synchronize``
    waits (on the host) until it has."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CopyEngine(Protocol):
    """Where copies run and how they are ordered (CUDA streams and events, or the CPU's no-ops)."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer (pinned where the device needs it for asynchronous copies)."""
        ...

    def side_after_compute(self) -> None:
        """The side stream waits for everything queued on the compute stream so far."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` queued on the side stream (non-blocking)."""
        ...

    def record(self) -> Fence:
        """A fence after everything queued on the side stream so far."""
        ...

    def compute_after(self, fence: Fence) -> None:
        """The compute stream waits for ``fence`` (no host wait)."""
        ...


class PassedFence:
    """The CPU's fence: its copy was done when it was queued."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostCopyEngine:
    """The CPU: plain buffers (pinning needs CUDA and buys nothing here), copies done at once."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def side_after_compute(self) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Fence:
        return PassedFence()

    def compute_after(self, fence: Fence) -> None:
        return None


class CudaCopyEngine:
    """A side stream on ``device``; fences are CUDA events recorded on it. A copy into or out of
    a strided cache view goes through a contiguous temporary that torch takes from its caching
    allocator on the side stream (no ``cudaMalloc`` once warm)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def side_after_compute(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Fence:
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def compute_after(self, fence: Fence) -> None:
        torch.cuda.current_stream(self.device).wait_event(fence)  # type: ignore[arg-type]


def copy_engine_for(device: torch.device) -> CopyEngine:
    return CudaCopyEngine(device) if device.type == "cuda" else HostCopyEngine()


# ---------------------------------------------------------------------------------------------
# geometry

@dataclass(frozen=True)
class Piece:
    """One buffer's worth of a run: blocks ``block .. block + blocks - 1`` (offsets in the run),
    rows ``row0 .. row1 - 1``, elements ``elem0 .. elem1 - 1`` of each row."""

    block: int
    blocks: int
    row0: int
    row1: int
    elem0: int
    elem1: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.row1 - self.row0, self.blocks, self.elem1 - self.elem0


def split_run(num_blocks: int, rows: int, elems: int, elem_bytes: int, capacity: int) -> list[Piece]:
    """Pieces of ``num_blocks`` blocks of ``rows x elems`` elements that each fit ``capacity``
    bytes, covering every element exactly once, in cache order."""
    if capacity < elem_bytes:
        raise ValueError(f"a staging buffer of {capacity} bytes cannot hold one {elem_bytes}-byte element")
    per_block = capacity // (rows * elems * elem_bytes)
    if per_block >= 1:
        return [Piece(j, min(per_block, num_blocks - j), 0, rows, 0, elems) for j in range(0, num_blocks, per_block)]
    out: list[Piece] = []
    per_rows = capacity // (elems * elem_bytes)
    per_elems = capacity // elem_bytes
    for j in range(num_blocks):
        if per_rows >= 1:
            out += [Piece(j, 1, r, min(r + per_rows, rows), 0, elems) for r in range(0, rows, per_rows)]
        else:
            out += [Piece(j, 1, r, r + 1, e, min(e + per_elems, elems))
                    for r in range(rows) for e in range(0, elems, per_elems)]
    return out


def runs(block_ids: list[int]) -> Iterator[tuple[int, int]]:
    """(first position, length) of each maximal run of consecutive block ids."""
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            yield start, i - start
            start = i


def as_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as ``[rows, blocks, elems]`` (a view: the cache is allocated contiguous)."""
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous to be staged")
    a, k, b = kv_cache.shape[:3]
    return kv_cache.view(a * k, b, math.prod(kv_cache.shape[3:]))


def block_shape(kv_cache: torch.Tensor) -> tuple[int, ...]:
    """The shape of one block as the store holds it: ``kv_cache[:, :, b]``."""
    return (*kv_cache.shape[:2], *kv_cache.shape[3:])


# ---------------------------------------------------------------------------------------------
# the pool

class StagingPool:
    """``num_buffers`` host buffers of ``buffer_bytes``, allocated once, handed out in turn. A
    buffer comes back with the fence of the copy that used it, and optionally an owner (a save
    whose bytes are still in it); ``acquire`` settles both before handing it out again."""

    def __init__(self, engine: CopyEngine, num_buffers: int, buffer_bytes: int) -> None:
        if num_buffers < 1 or buffer_bytes < 1:
            raise ValueError(f"a staging pool needs buffers and bytes, got {num_buffers} x {buffer_bytes}")
        self.buffer_bytes = buffer_bytes
        self.buffers = [engine.host_buffer(buffer_bytes) for _ in range(num_buffers)]
        self._fences: list[Fence | None] = [None] * num_buffers
        self._owners: list[_PendingPiece | None] = [None] * num_buffers
        self._next = 0
        self.waits = 0  # host waits for a copy still running (a buffer wanted back, a save's bytes)

    def acquire(self, settle_owner: Callable[[_PendingPiece], None]) -> int:
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        owner = self._owners[i]
        if owner is not None:
            settle_owner(owner)  # waits on its fence and takes its bytes out; frees the buffer
        fence = self._fences[i]
        if fence is not None and not fence.query():
            self.waits += 1
            fence.synchronize()
        self._fences[i] = None
        return i

    def release(self, i: int, fence: Fence, owner: _PendingPiece | None = None) -> None:
        self._fences[i] = fence
        self._owners[i] = owner

    def free(self, i: int) -> None:
        self._fences[i] = None
        self._owners[i] = None

    def view(self, i: int, dtype: torch.dtype, shape: tuple[int, int, int]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        return self.buffers[i][:nbytes].view(dtype).view(shape)


@dataclass
class _SaveBatch:
    keys: list[str]
    outs: list[torch.Tensor]  # one host tensor per block, in the store's block shape
    rows: int
    elems: int
    pieces_left: int = 0


@dataclass
class _PendingPiece:
    buffer: int
    fence: Fence
    batch: _SaveBatch
    first: int  # position of the piece's first block in the batch
    piece: Piece
    block_ids: list[int] = field(default_factory=list)


class KVStaging:
    """Loads into and saves out of a paged KV cache through a :class:`StagingPool`."""

    def __init__(self, engine: CopyEngine, num_buffers: int = DEFAULT_BUFFERS,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        self.engine = engine
        self.pool = StagingPool(engine, num_buffers, buffer_bytes)
        self._pending: deque[_PendingPiece] = deque()  # save pieces whose bytes are still in a buffer
        self._batches: deque[_SaveBatch] = deque()
        self._reading: dict[int, tuple[int, Fence]] = {}  # block id -> (order, fence) of a save copying it
        self._order = 0
        self.copies = 0  # side-stream copies queued
        self.guard_waits = 0  # times the compute stream was made to wait for a save still reading

    def _pieces(self, kv_cache: torch.Tensor, block_ids: list[int]) -> Iterator[tuple[int, int, Piece]]:
        """(position of the run's first block, its block id, piece) over every run."""
        rows, _, elems = as_rows(kv_cache).shape
        for pos, n in runs(block_ids):
            for p in split_run(n, rows, elems, kv_cache.element_size(), self.pool.buffer_bytes):
                yield pos, block_ids[pos], p

    def load(self, kv_cache: torch.Tensor, tensors: list[torch.Tensor], block_ids: list[int]) -> None:
        """Copy host block tensors (``block_shape(kv_cache)``) into their blocks. Returns once the
        copies are queued; the compute stream is ordered after them."""
        if not block_ids:
            return
        cache = as_rows(kv_cache)
        rows, _, elems = cache.shape
        self.engine.side_after_compute()
        last: Fence | None = None
        for pos, bid, p in self._pieces(kv_cache, block_ids):
            i = self.pool.acquire(self._settle)
            stage = self.pool.view(i, kv_cache.dtype, p.shape)
            first = pos + p.block
            torch.stack([t.reshape(rows, elems)[p.row0:p.row1, p.elem0:p.elem1]
                         for t in tensors[first:first + p.blocks]], dim=1, out=stage)
            b = bid + p.block
            self.engine.copy(cache[p.row0:p.row1, b:b + p.blocks, p.elem0:p.elem1], stage)
            self.copies += 1
            last = self.engine.record()
            self.pool.release(i, last)
        assert last is not None
        self.engine.compute_after(last)

    def save(self, kv_cache: torch.Tensor, keys: list[str], block_ids: list[int]) -> None:
        """Queue copies of blocks out of the cache; ``collect`` hands them over once they landed."""
        if not block_ids:
            return
        cache = as_rows(kv_cache)
        shape = block_shape(kv_cache)
        # A host tensor per block: the store keeps them (they must not be staging memory). One per
        # block rather than one for the save: a large fresh allocation is written several times
        # slower (its pages are faulted in), while block-sized ones reuse freed memory.
        rows, elems = cache.shape[0], cache.shape[2]
        batch = _SaveBatch(list(keys), [torch.empty(shape, dtype=kv_cache.dtype) for _ in block_ids], rows, elems)
        self.engine.side_after_compute()
        for pos, bid, p in self._pieces(kv_cache, block_ids):
            i = self.pool.acquire(self._settle)
            stage = self.pool.view(i, kv_cache.dtype, p.shape)
            b = bid + p.block
            self.engine.copy(stage, cache[p.row0:p.row1, b:b + p.blocks, p.elem0:p.elem1])
            self.copies += 1
            fence = self.engine.record()
            pending = _PendingPiece(i, fence, batch, pos + p.block, p, list(range(b, b + p.blocks)))
            self.pool.release(i, fence, pending)
            self._pending.append(pending)
            batch.pieces_left += 1
            self._order += 1
            for blk in pending.block_ids:
                self._reading[blk] = (self._order, fence)
        self._batches.append(batch)

    def _settle(self, target: _PendingPiece) -> None:
        """Take the bytes of every pending save piece up to ``target`` out of their buffers."""
        while self._pending:
            pending = self._pending.popleft()
            self._take(pending)
            if pending is target:
                return

    def _take(self, pending: _PendingPiece) -> None:
        if not pending.fence.query():
            self.pool.waits += 1
            pending.fence.synchronize()
        p = pending.piece
        batch = pending.batch
        stage = self.pool.view(pending.buffer, batch.outs[0].dtype, p.shape)
        for j in range(p.blocks):
            out = batch.outs[pending.first + j].view(batch.rows, batch.elems)
            out[p.row0:p.row1, p.elem0:p.elem1].copy_(stage[:, j])
        pending.batch.pieces_left -= 1
        self.pool.free(pending.buffer)
        for blk in pending.block_ids:
            if self._reading.get(blk, (None, None))[1] is pending.fence:
                del self._reading[blk]

    def collect(self, wait: bool = False) -> list[tuple[list[str], list[torch.Tensor]]]:
        """Saves whose every copy has landed, oldest first, as (keys, host tensors); with
        ``wait``, all of them (waiting on the host for the copies)."""
        while self._pending and (wait or self._pending[0].fence.query()):
            self._take(self._pending.popleft())
        done = []
        while self._batches and self._batches[0].pieces_left == 0:
            batch = self._batches.popleft()
            done.append((batch.keys, batch.outs))
        return done

    def pending_saves(self) -> int:
        return len(self._batches)

    def copying_out(self) -> bool:
        """Whether some save's copy out of the cache may still be running."""
        return bool(self._reading)

    def guard(self, block_ids: list[int]) -> None:
        """Before a step writes ``block_ids``: the compute stream waits for any save still copying
        one of them out (the side stream runs in order: the latest such fence covers the rest)."""
        if not self._reading:
            return
        latest = max((self._reading[b] for b in block_ids if b in self._reading), default=None,
                     key=lambda item: item[0])
        if latest is not None:
            self.guard_waits += 1
            self.engine.compute_after(latest[1])
