"""CUDA-only parts of the runner: the KV cache sized from device memory after a warm-up pass, and
decode steps replayed from CUDA graphs captured per (batch size, context length) bucket.

Kept apart from :mod:`kvbatch.engine.runtime.model_runner` so the eager path stays readable and
everything here is guarded: a model or kernel that cannot be captured (the reference kernels,
expert parallelism, batch-invariant mode) runs eagerly, with one warning, never wrongly.

Graphs. After the cache exists, one graph per bucket pair is captured over static input tensors
sized for the largest, in one shared memory pool (largest first, so the smaller ones reuse its
memory): batch buckets 1, 2, 4, 8, ... up to ``max_num_seqs``, times block-table widths for
contexts of 512, 1024, 2048, ... tokens up to ``max_model_len`` (:func:`context_widths`). The
decode kernels' grids depend only on the batch and the block-table width (the width sizes the
split over the context, see :func:`kvbatch.kernels.triton_attention.decode_partition_size`),
never on sequence lengths, so one capture serves every step that fits it; a graph captured only
for ``max_model_len`` would make every short context launch the programs of the longest. A step of
``n`` decode rows whose longest context needs ``w`` blocks copies its inputs into the first ``n``
static rows, pads the rest (slot -1: nothing is written; context 1 over block 0: read and
discarded) and replays the smallest pair covering ``(n, w)`` (:func:`pick_bucket`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from kvbatch.engine.models.llama import ForwardBatch, WindowTables
from kvbatch.engine.runtime.engine_config import EngineConfig, kv_blocks_from_memory
from kvbatch.kernels import dispatch as K

PAD_SLOT = -1  # store_kv skips negative slots: a padded row writes nothing


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    out = [1 << i for i in range(max(1, max_num_seqs).bit_length()) if 1 << i <= max_num_seqs]
    if out[-1] != max_num_seqs:
        out.append(max_num_seqs)
    return out


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows, or None when ``n`` exceeds them all."""
    return next((b for b in buckets if b >= n), None)


SMALLEST_CONTEXT_BUCKET = 512  # tokens; below it the decode kernels' grids barely shrink further


def context_widths(max_model_len: int, block_size: int, smallest: int = SMALLEST_CONTEXT_BUCKET) -> list[int]:
    """Block-table widths of the context buckets: ``smallest``, twice that, ... tokens while below
    ``max_model_len``, and ``max_model_len`` itself, each in blocks of ``block_size`` (ascending,
    without repeats). A context needing ``w`` blocks gets a table under ``max(first, 2 w)`` wide."""
    if max_model_len < 1 or block_size < 1 or smallest < 1:
        raise ValueError(f"context_widths: max_model_len ({max_model_len}), block_size ({block_size}) and "
                         f"smallest ({smallest}) must be >= 1")
    tokens = []
    t = smallest
    while t < max_model_len:
        tokens.append(t)
        t *= 2
    tokens.append(max_model_len)
    return sorted({math.ceil(t / block_size) for t in tokens})


def pick_bucket(n: int, width: int, batch_buckets: list[int], widths: list[int]) -> tuple[int, int] | None:
    """The captured (batch, width) pair for ``n`` rows whose longest block table is ``width``
    blocks: the smallest batch bucket >= ``n`` and the smallest width >= ``width`` (both lists
    ascending, every pair captured, so that pair is the least covering one in both), or None."""
    b, w = bucket_for(n, batch_buckets), bucket_for(width, widths)
    return None if b is None or w is None else (b, w)


def needed_width(starts: list[int], block_size: int) -> int:
    """Blocks the longest row of a decode step reads: a row writing position ``p`` has ``p + 1``
    tokens of context (its table may hold blocks reserved past them; the kernels never read those)."""
    return max(math.ceil((p + 1) / block_size) for p in starts)


def warmup_tokens(ec: EngineConfig, max_model_len: int) -> int:
    """Tokens of the warm-up pass: a full step budget, within the context window."""
    return max(1, min(ec.max_num_batched_tokens, max_model_len - 1))


def warmup_pass(model: Any, tokens: int, block_size: int, num_logits: int, dtype: torch.dtype,
                decode_rows: int = 0, context_len: int = 0) -> int:
    """The largest steps the engine can schedule, through ``model`` over a scratch cache of its own:
    one prefill of ``tokens`` tokens, then one decode step of ``decode_rows`` sequences
    ``context_len`` tokens long (``ModelRunner.warm_up``); returns the scratch cache's bytes. The
    scratch memory is released before returning (``ModelRunner.release``: dropping the runner is
    not enough, the model keeps views of the last cache it ran over), so the KV cache is sized
    from what is really left."""
    from kvbatch.engine.runtime.model_runner import ModelRunner

    runner = ModelRunner(model, math.ceil(tokens / block_size), block_size, dtype)
    runner.warm_up(tokens, num_logits, decode_rows, context_len)
    nbytes = sum(t.numel() * t.element_size() for t in (runner.kv_cache, runner.kv_window) if t is not None)
    runner.release()
    return nbytes


def blocks_after_warmup(model: Any, ec: EngineConfig, bytes_per_block: int, dtype: torch.dtype,
                        max_model_len: int) -> int:
    """KV blocks for the device cache: ``gpu_memory_utilization`` of the device's memory, less
    what is held now (weights, other processes) and the warm-up pass's activation peak."""
    dev = model.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    scratch = warmup_pass(model, warmup_tokens(ec, max_model_len), ec.block_size, ec.max_num_seqs, dtype,
                          decode_rows=ec.max_num_seqs, context_len=max_model_len)
    torch.cuda.synchronize(dev)
    peak = max(0, torch.cuda.max_memory_allocated(dev) - before - scratch)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return kv_blocks_from_memory(total, total - free, peak, ec.gpu_memory_utilization, bytes_per_block)


@dataclass
class DecodeInputs:
    """One decode step's rows padded to a bucket, as host lists (what the static tensors get)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[int]  # [bucket, width] flattened
    context_lens: list[int]


def pad_decode_inputs(tokens: list[int], starts: list[int], block_tables: list[list[int]], bucket: int,
                      width: int, block_size: int) -> DecodeInputs:
    """Rows ``i < n``: token ``tokens[i]`` at position ``starts[i]`` of a sequence with block table
    ``block_tables[i]``; rows ``n .. bucket - 1``: padding that writes nothing and reads block 0."""
    n = len(tokens)
    pad = bucket - n
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(block_tables, starts)]
    tables = [b for t in block_tables for b in t + [0] * (width - len(t))]
    return DecodeInputs(ids=tokens + [0] * pad, positions=starts + [0] * pad, slots=slots + [PAD_SLOT] * pad,
                        tables=tables + [0] * (pad * width), context_lens=[p + 1 for p in starts] + [1] * pad)


def graphs_unsupported(runner: Any) -> str | None:
    """Why ``runner``'s model cannot be captured, or None when it can."""
    from kvbatch.engine.models.moe import LocalExperts

    model = runner.model
    if runner.device.type != "cuda":
        return "not on CUDA"
    if model.batch_invariant:
        return "batch-invariant mode"
    if model.moe_layers and not isinstance(model.expert_compute, LocalExperts):
        return "expert parallelism (collectives and host-side counts every layer)"
    if K.backend(runner.kv_cache) != "triton":
        return "the reference kernels (they plan on the host)"
    return None


class CudaGraphRunner:
    """Decode-only steps replayed from graphs captured per (batch, width) bucket (module docstring)."""

    def __init__(self, runner: Any, buckets: list[int], widths: list[int]) -> None:
        dev = runner.device
        B = buckets[-1]
        self.buckets = buckets
        self.widths = widths
        self.width = widths[-1]
        self.ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slots = torch.full((B,), PAD_SLOT, dtype=torch.int64, device=dev)
        # One flat buffer: bucket (b, w) reads its first b * w entries as a contiguous [b, w] table.
        self.tables = torch.zeros(B * self.width, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.rows = torch.arange(B, dtype=torch.int64, device=dev)
        # A model with sliding layers: their slots and tables in the window cache, likewise
        # (window_blocks.py; padding rows read the null block and write nothing)
        self.windowed = getattr(runner, "kv_window", None) is not None
        self.window_slots = torch.full((B,), PAD_SLOT, dtype=torch.int64, device=dev) if self.windowed else None
        self.window_tables = torch.zeros(B * self.width, dtype=torch.int32, device=dev) if self.windowed else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        self.last_bucket = (0, 0)

    def _batch(self, b: int, w: int) -> ForwardBatch:
        dev = self.ids.device
        no_prefill = torch.zeros((0, 0), dtype=torch.int32, device=dev)
        window = None
        if self.windowed:
            assert self.window_slots is not None and self.window_tables is not None
            window = WindowTables(slot_mapping=self.window_slots[:b],
                                  decode_block_tables=self.window_tables[:b * w].view(b, w),
                                  prefill_block_tables=no_prefill)
        return ForwardBatch(positions=self.positions[:b], slot_mapping=self.slots[:b], num_decode=b,
                            decode_block_tables=self.tables[:b * w].view(b, w),
                            decode_context_lens=self.context_lens[:b],
                            prefill_block_tables=no_prefill,
                            prefill_cu_query_lens=torch.zeros(1, dtype=torch.int32, device=dev),
                            prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
                            logits_rows=self.rows[:b], window=window)

    @classmethod
    @torch.inference_mode()
    def capture(cls, runner: Any, max_num_seqs: int, max_model_len: int) -> CudaGraphRunner | None:
        """Capture every bucket's graph, or return None (with a warning saying why) where the
        model cannot be captured; the runner then stays eager."""
        why = graphs_unsupported(runner)
        if why is not None:
            warnings.warn(f"CUDA graphs off: {why}; decode runs eagerly", stacklevel=2)
            return None
        self = cls(runner, batch_buckets(max_num_seqs), context_widths(max_model_len, runner.block_size))
        model, cache, window_cache = runner.model, runner.kv_cache, runner.kv_window
        pool = torch.cuda.graph_pool_handle()
        try:
            # The largest first: the smaller ones reuse its pool.
            for b, w in sorted(((b, w) for b in self.buckets for w in self.widths), reverse=True):
                batch = self._batch(b, w)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                    for _ in range(2):
                        model.forward(self.ids[:b], batch, cache, window_cache=window_cache)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = model.forward(self.ids[:b], batch, cache, window_cache=window_cache)
                self.graphs[(b, w)] = (graph, out)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager, said once
            warnings.warn(f"CUDA graphs off: capture failed ({type(exc).__name__}: {exc}); decode runs eagerly",
                          stacklevel=2)
            return None
        torch.cuda.synchronize(runner.device)
        return self

    def try_execute(self, runner: Any, step: list[Any]) -> tuple[torch.Tensor, list[Any]] | None:
        """Replay the graph for a decode-only ``step`` (every entry one new token, sampled, no
        drafts) whose contexts fit; None otherwise (the caller runs it eagerly)."""
        if not step or any(s.num_new_tokens != 1 or s.num_spec or not s.samples for s in step):
            return None
        bs = runner.block_size
        starts = [s.seq.num_computed_tokens for s in step]
        picked = pick_bucket(len(step), needed_width(starts, bs), self.buckets, self.widths)
        if picked is None:
            return None
        b, w = picked
        # Only the blocks the context reads: blocks reserved past it would not fit a narrower table.
        tables = [s.seq.block_table[:math.ceil((p + 1) / bs)] for s, p in zip(step, starts)]
        inputs = pad_decode_inputs([s.seq.token_ids[p] for s, p in zip(step, starts)], starts, tables, b, w, bs)
        arrays = [inputs.ids, inputs.positions, inputs.slots, inputs.tables, inputs.context_lens]
        if self.windowed:  # the same rows over the window tables (null blocks before each window)
            window = pad_decode_inputs(inputs.ids[:len(step)], starts,
                                       [s.seq.window_table[:math.ceil((p + 1) / bs)] for s, p in zip(step, starts)],
                                       b, w, bs)
            arrays += [window.slots, window.tables]
        up = runner.uploader.upload(arrays)
        ids, positions, slots, flat_tables, ctx = up[:5]
        if self.windowed:
            assert self.window_slots is not None and self.window_tables is not None
            self.window_slots[:b].copy_(up[5])
            self.window_tables[:b * w].copy_(up[6])
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(slots)
        self.tables[:b * w].copy_(flat_tables)
        self.context_lens[:b].copy_(ctx)
        graph, out = self.graphs[(b, w)]
        graph.replay()
        self.replays += 1
        self.last_bucket = (b, w)
        return out[:len(step)].clone(), list(step)

    @torch.inference_mode()
    def replay_and_eager(self, runner: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The last replayed bucket run again both ways over the same static inputs: (graph
        replay, eager forward). Equal bit for bit when capture is sound. Both rewrite the same
        K/V into the same slots, so the cache is left as it was."""
        b, w = self.last_bucket
        graph, out = self.graphs[(b, w)]
        graph.replay()
        replayed = out.clone()
        eager = runner.model.forward(self.ids[:b], self._batch(b, w), runner.kv_cache, window_cache=runner.kv_window)
        return replayed, eager
