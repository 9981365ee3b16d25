"""Turns a scheduled step into tensors, runs the model and returns next-token logits.

The runner owns the KV cache tensor and never sees the block manager: everything it needs
(block tables, computed-token counters) is on the scheduled sequences.
"""

from __future__ import annotations

import torch

from kvbatch.engine.model import ForwardBatch, LlamaModel
from kvbatch.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        c = model.config
        self.model = model
        self.block_size = block_size
        self._ws: tuple[torch.Tensor, torch.Tensor] | None = None
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]: one block of every layer is the
        # unit the KV store saves and loads. Allocated (and touched) once, then reused.
        self.kv_cache = torch.zeros(
            (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim), dtype=kv_dtype
        )

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather buffers for decode attention, kept across steps and grown on demand
        (reused memory is written several times faster than fresh allocations on a CPU)."""
        if self._ws is None or self._ws[0].shape[0] < num_blocks:
            shape = (max(num_blocks, 64), *self.kv_cache.shape[3:])
            self._ws = (torch.zeros(shape, dtype=self.kv_cache.dtype), torch.zeros(shape, dtype=self.kv_cache.dtype))
        return self._ws

    @staticmethod
    def bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: torch.dtype) -> int:
        c = model.config
        elem = torch.empty((), dtype=kv_dtype).element_size()
        return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * elem

    def prepare(self, step: list[ScheduledSeq]) -> tuple[torch.Tensor, ForwardBatch, list[ScheduledSeq]]:
        """Pack the step's tokens decode-first; returns ids, the batch description and the
        scheduled entries in the order of their logits rows."""
        decode = [s for s in step if s.num_new_tokens == 1]
        prefill = [s for s in step if s.num_new_tokens > 1]
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledSeq] = []

        def add_tokens(s: ScheduledSeq) -> None:
            seq = s.seq
            start = seq.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.samples:
                logits_rows.append(len(ids) - 1)
                sampled.append(s)

        for s in decode:
            add_tokens(s)
        cu = [0]
        for s in prefill:
            add_tokens(s)
            cu.append(cu[-1] + s.num_new_tokens)

        def tables(entries: list[ScheduledSeq]) -> torch.Tensor:
            width = max((len(s.seq.block_table) for s in entries), default=0)
            return torch.tensor([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in entries],
                                dtype=torch.int32).view(len(entries), width)

        seq_index = [i for i, s in enumerate(decode)]
        seq_index += [len(decode) + i for i, s in enumerate(prefill) for _ in range(s.num_new_tokens)]
        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode=len(decode),
            decode_block_tables=tables(decode),
            decode_context_lens=torch.tensor([s.seq.num_computed_tokens + 1 for s in decode], dtype=torch.int32),
            prefill_block_tables=tables(prefill),
            prefill_cu_query_lens=torch.tensor(cu, dtype=torch.int32),
            prefill_context_lens=torch.tensor(
                [s.seq.num_computed_tokens + s.num_new_tokens for s in prefill], dtype=torch.int32),
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        )
        if decode:
            batch.decode_workspace = self._workspace(batch.decode_block_tables.numel())
        if self.model.batch_invariant:
            batch.block_tables = tables(decode + prefill)
            batch.seq_index = torch.tensor(seq_index, dtype=torch.int64)
        return torch.tensor(ids, dtype=torch.int64), batch, sampled

    @torch.inference_mode()
    def execute(self, step: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step; returns logits [N, V] (fp32) and the entries they belong to."""
        ids, batch, sampled = self.prepare(step)
        logits = self.model.forward(ids, batch, self.kv_cache)
        return logits, sampled
