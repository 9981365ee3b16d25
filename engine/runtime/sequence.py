"""A request's state inside the engine.

Progress is two counters, not phase flags: ``num_computed_tokens`` (tokens whose K/V are in
the cache) and ``num_tokens`` (prompt + generated). A step computes some of the difference;
when the two meet the request samples its next token. Chunked prefill, prefix hits,
recompute after preemption and loads from stored KV are all the same arithmetic.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbatch.engine.runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)  # chain hashes of the full blocks so far
    # Sliding-window layers (window_blocks.py): the window pool's block per logical block (the
    # null block before the window), and how many leading entries were given back.
    window_table: list[int] = field(default_factory=list)
    window_released: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_loaded_tokens: int = 0  # prompt tokens loaded from the external KV store
    prefill_only: bool = False  # compute (and store) the prompt's KV, sample nothing
    pending_loads: list[tuple[str, int]] = field(default_factory=list)  # (key, block id) to fetch before the step
    pending_window_loads: list[tuple[str, int]] = field(default_factory=list)  # (key, window block id), likewise
    store_failed: bool = False  # a load of its stored window failed: it recomputes, never loads again
    logprobs: list[dict] = field(default_factory=list)
    # Speculative decoding: how many draft slots to reserve in the next decode step (set by the
    # speculative controller), the drafts of the step in flight, and running totals.
    num_lookahead: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), V], None: deterministic drafter
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_target_steps: int = 0
    # Structured outputs: the grammar's matcher (llguidance), fed every emitted token; why the
    # request ended in error (a schema that cannot compile, a mask that allows nothing).
    matcher: Any = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens that must be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
