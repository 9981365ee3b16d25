"""Per-request sampling parameters, as the engine sees them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-100, 100]
PENALTY_RANGE = 2.0  # presence and frequency penalties are in [-2, 2]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy.

    ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0`` switch those filters off.
    ``seed`` makes the request's draws reproducible whatever else shares its batch.
    ``logprobs``: None for none, k >= 0 for the chosen token's log-probability plus the top k.
    ``response_format``: the canonical JSON of a constrained format (json_schema, json_object):
    every token is sampled under the grammar's mask.
    ``logit_bias``: (token id, bias) pairs added to the logits before every choice, greedy ones
    included (OpenAI's); given as a mapping or pairs, kept as pairs sorted by id with float biases,
    so one bias is one value (hashable, and one key in the response cache).
    ``presence_penalty`` is subtracted once, ``frequency_penalty`` once per occurrence, from the
    logit of each token already in the output (OpenAI's; the prompt does not count).
    A grammar's mask applies after them: a biased token the grammar forbids stays forbidden.
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
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        # Frozen: the canonical form is set once, here (a JSON round trip gives lists, a user a dict).
        object.__setattr__(self, "logit_bias", _canonical_bias(self.logit_bias))
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a bias or a penalty changes this request's logits before each choice."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def argmax_only(self) -> bool:
        """Whether only the argmax of this request's raw logits is ever read: greedy, no logprobs,
        no grammar, no bias or penalty (what lets the CPU greedy head screen its LM head)."""
        return self.greedy and self.logprobs is None and self.response_format is None and not self.penalized


def _canonical_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]] | None) -> tuple[tuple[int, float], ...]:
    """``bias`` as (id, bias) pairs sorted by id, each checked (ids >= 0, biases in range, one per id)."""
    pairs = list((bias or {}).items()) if isinstance(bias, Mapping) or bias is None else [tuple(p) for p in bias]
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(pairs)} entries, at most {MAX_LOGIT_BIAS_ENTRIES}")
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias: expected (token id, bias) pairs, got {pair!r}")
        tok, value = pair
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias: token id must be an integer >= 0, got {tok!r}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias: the bias of token {tok} must be a number in [-100, 100], got {value!r}")
        if tok in out:
            raise ValueError(f"logit_bias: token {tok} is given twice")
        out[tok] = float(value)
    return tuple(sorted(out.items()))
