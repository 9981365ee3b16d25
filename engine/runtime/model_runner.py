"""Turns a scheduled step into tensors, runs the model and returns next-token logits.

The runner owns the KV cache tensor and never sees the block manager: everything it needs
(block tables, computed-token counters) is on the scheduled sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbatch.engine.models.llama import ForwardBatch, LlamaModel
from kvbatch.engine.runtime.scheduler import ScheduledSeq


@dataclass
class WorkItem:
    """Tokens to compute for one sequence in a forward pass."""

    tokens: list[int]
    start: int  # position of the first token
    block_table: list[int]  # must already cover positions start .. start + len(tokens) - 1
    num_logits: int = 0  # logits wanted for this many of the last tokens


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype):
        self.model = model
        self.block_size = block_size
        self._ws: tuple[torch.Tensor, torch.Tensor] | None = None
        # [layers, K/V, blocks, ...] as the model lays it out (Llama: [L, 2, blocks, block_size,
        # kv_heads, head_dim]; MLA: [L, 1, blocks, block_size, 1, latent + rope]): one block of
        # every layer is the unit the KV store saves and loads. Allocated (and touched) once.
        self.kv_cache = torch.zeros(model.kv_cache_shape(num_blocks, block_size), dtype=kv_dtype)

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V gather buffers for decode attention, kept across steps and grown on demand
        (reused memory is written several times faster than fresh allocations on a CPU)."""
        if self._ws is None or self._ws[0].shape[0] < num_blocks:
            shape = (max(num_blocks, 64), *self.kv_cache.shape[3:])
            self._ws = (torch.zeros(shape, dtype=self.kv_cache.dtype), torch.zeros(shape, dtype=self.kv_cache.dtype))
        return self._ws

    @staticmethod
    def bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=kv_dtype).element_size()
        return math.prod(model.kv_cache_shape(1, block_size)) * elem

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
            items.append(WorkItem(tokens, start, seq.block_table, s.num_spec + 1 if s.samples else 0))
        ids, batch, order = self.build(items)
        return ids, batch, [step[i] for i in order if items[i].num_logits]

    def build(self, items: list[WorkItem]) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """Tensors for one forward pass over ``items``; returns ids, the batch and the item
        order (decode-first) in which their logits rows come back."""
        bs = self.block_size
        decode = [i for i, it in enumerate(items) if len(it.tokens) == 1]
        prefill = [i for i, it in enumerate(items) if len(it.tokens) > 1]
        order = decode + prefill
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        cu = [0]
        for i in order:
            it = items[i]
            end = it.start + len(it.tokens)
            ids.extend(it.tokens)
            positions.extend(range(it.start, end))
            table = it.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(it.start, end))
            logits_rows.extend(range(len(ids) - it.num_logits, len(ids)))
            if len(it.tokens) > 1:
                cu.append(cu[-1] + len(it.tokens))

        def tables(rows: list[int]) -> torch.Tensor:
            width = max((len(items[i].block_table) for i in rows), default=0)
            return torch.tensor([items[i].block_table + [0] * (width - len(items[i].block_table)) for i in rows],
                                dtype=torch.int32).view(len(rows), width)

        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode=len(decode),
            decode_block_tables=tables(decode),
            decode_context_lens=torch.tensor([items[i].start + 1 for i in decode], dtype=torch.int32),
            prefill_block_tables=tables(prefill),
            prefill_cu_query_lens=torch.tensor(cu, dtype=torch.int32),
            prefill_context_lens=torch.tensor([items[i].start + len(items[i].tokens) for i in prefill],
                                              dtype=torch.int32),
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        )
        if decode:
            batch.decode_workspace = self._workspace(batch.decode_block_tables.numel())
        if self.model.batch_invariant:
            batch.block_tables = tables(order)
            batch.seq_index = torch.tensor([r for r, i in enumerate(order) for _ in items[i].tokens],
                                           dtype=torch.int64)
        return torch.tensor(ids, dtype=torch.int64), batch, order

    @torch.inference_mode()
    def run(self, items: list[WorkItem], num_layers: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """One forward pass over raw work items (drafters use it); logits rows come back in the
        returned item order. ``num_layers``: exit early after that many layers."""
        ids, batch, order = self.build(items)
        return self.model.forward(ids, batch, self.kv_cache, num_layers), order

    @torch.inference_mode()
    def execute(self, step: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run one step; returns logits [N, V] (fp32) and the entries they belong to."""
        ids, batch, sampled = self.prepare(step)
        logits = self.model.forward(ids, batch, self.kv_cache)
        return logits, sampled
