"""Turns a scheduled step into tensors, runs the model and returns next-token logits.

The runner owns the KV cache tensor and never sees the block manager: everything it needs
(block tables, computed-token counters) is on the scheduled sequences.

The cache and every step tensor live on the model's device. A step's integer arrays (ids,
positions, slot mapping, block tables, context lengths, logits rows) are packed on the host into
one buffer (pinned, reused, on CUDA) and moved with one non-blocking copy (:class:`StepUploader`);
the device never waits on the host and the host never reads the device here. The reference decode
attention's gather workspace exists only where the reference kernels run (the Triton kernels read
the cache in place). ``tests/test_device_placement.py`` runs the runner on an emulated GPU.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from kvbatch.engine.models.llama import ForwardBatch, LlamaModel, WindowTables
from kvbatch.engine.runtime.scheduler import ScheduledSeq
from kvbatch.kernels import dispatch as K
from kvbatch.kernels.reference import DECODE_GROUP


class StepUploader:
    """A step's integer arrays to the device in one copy.

    On CUDA the arrays are written into a pinned host buffer kept across steps (two of them, so
    packing step n + 1 overlaps the copy of step n; an event says when a buffer is free again),
    then copied with ``non_blocking=True``. On the CPU the packed tensor is the result itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._turn = 0
        self.copies = 0  # host-to-device copies made (one per upload on CUDA)

    def _buffer(self, n: int) -> torch.Tensor:
        i = self._turn
        self._turn ^= 1
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the previous copy out of this buffer has finished
        buf = self._buffers[i]
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1 << 14), dtype=torch.int64, pin_memory=True)
            self._buffers[i] = buf
        self._events[i] = torch.cuda.Event()
        return buf

    def upload(self, arrays: list[list[int]]) -> list[torch.Tensor]:
        """int64 tensors on the device, one per array, views of one packed tensor."""
        sizes = [len(a) for a in arrays]
        n = sum(sizes)
        if self.device.type != "cuda":
            return list(torch.tensor(list(itertools.chain.from_iterable(arrays)), dtype=torch.int64).split(sizes))
        i = self._turn
        buf = self._buffer(n)
        buf.numpy()[:n] = list(itertools.chain.from_iterable(arrays))
        on_device = buf[:n].to(self.device, non_blocking=True)
        self._events[i].record()  # type: ignore[union-attr]
        self.copies += 1
        return list(on_device.split(sizes))


@dataclass
class WorkItem:
    """Tokens to compute for one sequence in a forward pass."""

    tokens: list[int]
    start: int  # position of the first token
    block_table: list[int]  # must already cover positions start .. start + len(tokens) - 1
    num_logits: int = 0  # logits wanted for this many of the last tokens
    window_table: list[int] | None = None  # models with sliding layers: the window cache's blocks, likewise


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 num_window_blocks: int | None = None):
        self.model = model
        self.block_size = block_size
        self.device = torch.device(getattr(model, "device", "cpu"))
        self._ws: tuple[torch.Tensor, torch.Tensor] | None = None
        self.uploader = StepUploader(self.device)
        # [layers, K/V, blocks, ...] as the model lays it out (Llama: [L, 2, blocks, block_size,
        # kv_heads, head_dim], L its full-attention layers; MLA: [L, 1, blocks, block_size, 1,
        # latent + rope]): one block of its layers is the unit the KV store saves and loads (a
        # sliding layer's window cache, kv_window, is saved apart). Allocated once, on the model's
        # device; on the CPU in the model's huge-page arena where it keeps one (attention streams
        # the cache as the projections stream the weights: kernels/cpu/huge_pages.py), untouched:
        # a fresh mapping reads zero and takes memory as blocks are first written, so an engine
        # whose work fills a tenth of its budget neither zeroes nor holds the rest (zeroing the
        # default 1 GiB up front was 1-5 s of every engine build on a 2-vCPU machine).
        shape = model.kv_cache_shape(num_blocks, block_size)
        arena = getattr(model, "arena", None)

        def allocate(shape: tuple[int, ...]) -> torch.Tensor:
            return (arena.empty(shape, kv_dtype) if arena is not None and self.device.type == "cpu"
                    else torch.zeros(shape, dtype=kv_dtype, device=self.device))

        self.kv_cache = allocate(shape)
        # The sliding layers' cache (window_blocks.py: block 0 is the null block, never written),
        # num_window_blocks blocks; None for a model without sliding layers.
        window_shape = getattr(model, "window_cache_shape", lambda n, b: None)(
            max(2, num_window_blocks or num_blocks), block_size)  # the null block and one more, at least
        self.kv_window = allocate(window_shape) if window_shape is not None else None
        self.graphs = None  # a CudaGraphRunner once captured (LLM does it on CUDA, unless eager)
        self.released = False

    def gathers(self) -> bool:
        """Whether decode attention gathers blocks into the workspace: the reference kernels do;
        the Triton kernels read the cache in place, so on their path no workspace is allocated."""
        return K.backend(self.kv_cache) == "reference"

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather buffers for the reference decode attention, kept across steps and grown
        on demand (reused memory is written several times faster than fresh allocations on a CPU)."""
        if self._ws is None or self._ws[0].shape[0] < num_blocks:
            shape = (max(num_blocks, 64), *self.kv_cache.shape[3:])
            kw = {"dtype": self.kv_cache.dtype, "device": self.device}
            self._ws = (torch.zeros(shape, **kw), torch.zeros(shape, **kw))
        return self._ws

    def warm_up(self, tokens: int, num_logits: int, decode_rows: int = 0, context_len: int = 0) -> None:
        """Run the largest steps the engine can schedule over this runner's (scratch) cache, for a
        caller that measures their memory peak (``cuda_graphs.blocks_after_warmup``): one prefill of
        ``tokens`` tokens wanting ``num_logits`` logits rows, then one decode step of
        ``decode_rows`` sequences ``context_len`` tokens long (on the reference path that is the
        workspace at its widest and attention over the longest contexts). Block tables cycle
        through the cache's blocks, however few: only the memory of the step is of interest."""
        blocks = self.kv_cache.shape[2]
        window_blocks = self.kv_window.shape[2] if self.kv_window is not None else 0

        def item(tokens: list[int], start: int, num_logits: int) -> WorkItem:
            n = -(-(start + len(tokens)) // self.block_size)
            window = [1 + i % (window_blocks - 1) for i in range(n)] if window_blocks > 1 else None
            return WorkItem(tokens, start, [i % blocks for i in range(n)], num_logits, window)

        self.run([item([0] * tokens, 0, max(1, min(tokens, num_logits)))])
        if decode_rows > 0 and context_len > 0:
            self.run([item([0], context_len - 1, 1) for _ in range(decode_rows)])

    def release(self) -> None:
        """Free the cache's and the workspace's memory now, whoever still holds views of them (the
        model keeps per-layer views of the last cache it ran over until it runs over another): a
        warm-up's scratch runner must leave nothing behind when the KV cache is then sized from
        the memory left. Memory shared with other tensors (a CPU huge-page arena) is left alone.
        The runner cannot run afterwards."""
        for t in (self.kv_cache, *((self.kv_window,) if self.kv_window is not None else ()), *(self._ws or ())):
            storage = t.untyped_storage()
            if storage.resizable() and storage.nbytes() == t.numel() * t.element_size():
                storage.resize_(0)
        self._ws = None
        self.released = True

    @staticmethod
    def bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=kv_dtype).element_size()
        return math.prod(model.kv_cache_shape(1, block_size)) * elem

    @staticmethod
    def window_bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes of one block of the sliding layers' cache; 0 for a model without sliding layers."""
        shape = getattr(model, "window_cache_shape", lambda n, b: None)(1, block_size)
        return 0 if shape is None else math.prod(shape) * torch.empty((), dtype=kv_dtype).element_size()

    def prepare(self, step: list[ScheduledSeq]) -> tuple[torch.Tensor, ForwardBatch, list[ScheduledSeq]]:
        """Pack the step's tokens decode-first; returns ids, the batch description and the
        scheduled entries whose logits are wanted, in the order of their logits rows (an entry
        carrying ``num_spec`` drafted tokens gets ``num_spec + 1`` rows: one per draft to verify
        plus the bonus position)."""
        items: list[WorkItem] = []
        for s in step:
            seq = s.seq
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + s.num_new_tokens - s.num_spec]
            if s.num_spec:
                tokens = tokens + seq.spec_token_ids[:s.num_spec]
            items.append(WorkItem(tokens, start, seq.block_table, s.num_spec + 1 if s.samples else 0,
                                  seq.window_table if self.kv_window is not None else None))
        ids, batch, order = self.build(items)
        # Only argmaxes of the raw logits will be read from this step (LLM samples greedy rows by
        # argmax, and the verifier keeps a greedy request's drafts while they are the argmax); a
        # bias or penalty moves logits after the head, so such a row needs every one of them.
        batch.greedy_only = all(s.seq.sampling.argmax_only for s in step if s.samples)
        return ids, batch, [step[i] for i in order if items[i].num_logits]

    def build(self, items: list[WorkItem]) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Tensors for one forward pass over ``items``; returns ids, the batch and the item
        order (decode-first) in which their logits rows come back."""
        if self.released:
            raise RuntimeError("this model runner's KV cache was released (ModelRunner.release): it cannot run")
        bs = self.block_size
        decode = [i for i, it in enumerate(items) if len(it.tokens) == 1]
        prefill = [i for i, it in enumerate(items) if len(it.tokens) > 1]
        order = decode + prefill
        windowed = self.kv_window is not None
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        window_slots: list[int] = []
        logits_rows: list[int] = []
        cu = [0]
        for i in order:
            it = items[i]
            end = it.start + len(it.tokens)
            ids.extend(it.tokens)
            positions.extend(range(it.start, end))
            table = it.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(it.start, end))
            if windowed:
                wt = it.window_table
                assert wt is not None, "a model with sliding layers needs each item's window table"
                window_slots.extend(wt[p // bs] * bs + p % bs for p in range(it.start, end))
            logits_rows.extend(range(len(ids) - it.num_logits, len(ids)))
            if len(it.tokens) > 1:
                cu.append(cu[-1] + len(it.tokens))

        def table(rows: list[int], window: bool = False) -> tuple[list[int], int]:
            """Rows' block tables (or window tables), zero-padded to the widest, flattened; and that width."""
            tables = [items[i].window_table if window else items[i].block_table for i in rows]
            width = max((len(t) for t in tables), default=0)  # type: ignore[arg-type]
            flat = [b for t in tables for b in t + [0] * (width - len(t))]  # type: ignore[operator]
            return flat, width

        decode_table, decode_width = table(decode)
        prefill_table, prefill_width = table(prefill)
        arrays = [ids, positions, slots, logits_rows, decode_table, [items[i].start + 1 for i in decode],
                  prefill_table, cu, [items[i].start + len(items[i].tokens) for i in prefill]]
        invariant = self.model.batch_invariant
        if invariant:
            all_table, all_width = table(order)
            arrays += [all_table, [r for r, i in enumerate(order) for _ in items[i].tokens]]
        w = len(arrays)  # where the sliding layers' slots and tables start, after everything else
        if windowed:
            w_decode, w_decode_width = table(decode, True)
            w_prefill, w_prefill_width = table(prefill, True)
            arrays += [window_slots, w_decode, w_prefill]
            if invariant:
                w_all, w_all_width = table(order, True)
                arrays.append(w_all)
        up = self.uploader.upload(arrays)
        i32 = torch.int32
        batch = ForwardBatch(
            positions=up[1],
            slot_mapping=up[2],
            num_decode=len(decode),
            decode_block_tables=up[4].to(i32).view(len(decode), decode_width),
            decode_context_lens=up[5].to(i32),
            prefill_block_tables=up[6].to(i32).view(len(prefill), prefill_width),
            prefill_cu_query_lens=up[7].to(i32),
            prefill_context_lens=up[8].to(i32),
            logits_rows=up[3],
            max_query_len=max((len(items[i].tokens) for i in prefill), default=0),
        )
        if decode and self.gathers():
            # The reference attends over at most DECODE_GROUP rows at a time (decode and MLA alike):
            # a larger batch needs no larger workspace.
            batch.decode_workspace = self._workspace(min(len(decode), DECODE_GROUP) * decode_width)
        if invariant:
            batch.block_tables = up[9].to(i32).view(len(order), all_width)
            batch.seq_index = up[10]
        if windowed:
            batch.window = WindowTables(
                slot_mapping=up[w], decode_block_tables=up[w + 1].to(i32).view(len(decode), w_decode_width),
                prefill_block_tables=up[w + 2].to(i32).view(len(prefill), w_prefill_width),
                block_tables=up[w + 3].to(i32).view(len(order), w_all_width) if invariant else None)
        return up[0], batch, order

    @torch.inference_mode()
    def run(self, items: list[WorkItem], num_layers: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over raw work items (drafters use it); logits rows come back in the
        returned item order. ``num_layers``: exit early after that many layers."""
        ids, batch, order = self.build(items)
        return self.model.forward(ids, batch, self.kv_cache, num_layers, window_cache=self.kv_window), order

    @torch.inference_mode()
    def execute(self, step: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step; returns logits [N, V] (fp32, on the device) and the entries they belong
        to. A decode-only step replays a captured CUDA graph when one fits its batch."""
        if self.graphs is not None:
            replayed = self.graphs.try_execute(self, step)
            if replayed is not None:
                return replayed
        ids, batch, sampled = self.prepare(step)
        logits = self.model.forward(ids, batch, self.kv_cache, window_cache=self.kv_window)
        return logits, sampled
