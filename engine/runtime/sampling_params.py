"""Per-request sampling parameters, as the engine sees them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy.

    ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0`` switch those filters off.
    ``seed`` makes the request's draws reproducible whatever else shares its batch.
    ``logprobs``: None for none, k >= 0 for the chosen token's log-probability plus the top k.
    ``response_format``: the canonical JSON of a constrained format (json_schema, json_object):
    every token is sampled under the grammar's mask.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    # Structured outputs: the canonical response format (kvbatch.engine.text.structured), or None.
    response_format: str | None = None

    def __post_init__(self) -> None:
        # The edges (io.batch_requests) validate user input with row-level errors; these
        # checks only guard programmatic callers of the engine.
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
