"""What one batch did: requests answered and rejected, tokens by class, latency, speculation.

Filled by :func:`kvbatch.ops.decode.generate.run_jobs` (the CLI's generate and decode, the
pipeline's decode); ``to_json`` is the ``--metrics`` file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvbatch.engine.runtime.llm import LLM, Result
from kvbatch.ops.results.metrics import percentile


@dataclass
class BatchReport:
    """What one batch did; ``to_json`` is the ``--metrics`` file."""

    requests: int = 0
    succeeded: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # served by the engine's in-memory prefix cache
    loaded_prompt_tokens: int = 0  # served by the external KV store
    output_tokens: int = 0
    wall_s: float = 0.0
    preemptions: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    rejects_by_field: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: drafted tokens, drafts kept, target passes that decoded, seconds
    # spent drafting and in engine steps (the drafter's share of the step time).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_target_steps: int = 0
    spec_enabled: bool = False
    draft_s: float = 0.0
    step_s: float = 0.0
    # The response cache's counters (ops/decode/response_cache.py), when the run had one, and the
    # rows it answered with their tokens: kept apart from the engine's figures above, so that
    # prompt_tokens + response_cache_prompt_tokens is the prompt tokens of every answered row
    # (what the results table and cost_metrics count).
    response_cache: dict[str, Any] | None = None
    response_cache_rows: int = 0
    response_cache_prompt_tokens: int = 0
    response_cache_output_tokens: int = 0
    _since: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    @classmethod
    def start(cls, llm: LLM) -> "BatchReport":
        """An empty report for a run of ``llm`` from now (its clock and drafter counters)."""
        report = cls(spec_enabled=llm.spec is not None)
        report._since = (time.perf_counter(), llm.stats["draft_s"], llm.stats["step_s"])
        return report

    def finish(self, llm: LLM) -> None:
        """Close the run started by :meth:`start`: wall time and the drafter's share of it."""
        t0, draft0, step0 = self._since
        self.wall_s = time.perf_counter() - t0
        self.draft_s = llm.stats["draft_s"] - draft0
        self.step_s = llm.stats["step_s"] - step0

    def add_result(self, result: Result) -> None:
        self.succeeded += 1
        self.prompt_tokens += len(result.prompt_token_ids)
        self.cached_prompt_tokens += result.num_cached_tokens
        self.loaded_prompt_tokens += result.num_loaded_tokens
        self.output_tokens += len(result.output_token_ids)
        self.preemptions += result.num_preemptions
        self.spec_draft_tokens += result.spec_draft_tokens
        self.spec_accepted_tokens += result.spec_accepted_tokens
        self.spec_target_steps += result.spec_target_steps
        self.ttft_s.append(result.ttft_s)
        if result.tpot_s is not None:
            self.tpot_s.append(result.tpot_s)

    def add_cached(self, result: Result) -> None:
        """A row answered from the response cache: it succeeded, at no engine time or tokens;
        the tokens it served are counted apart (``response_cache_*``)."""
        self.succeeded += 1
        self.response_cache_rows += 1
        self.response_cache_prompt_tokens += len(result.prompt_token_ids)
        self.response_cache_output_tokens += len(result.output_token_ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "rejected": self.rejected,
            "rejects_by_field": dict(sorted(self.rejects_by_field.items())),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "loaded_prompt_tokens": self.loaded_prompt_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 4),
            "output_tokens_per_s": round(self.output_tokens / self.wall_s, 3) if self.wall_s else 0.0,
            "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / self.wall_s, 3)
            if self.wall_s else 0.0,
            "ttft_s_p50": percentile(self.ttft_s, 50),
            "ttft_s_p95": percentile(self.ttft_s, 95),
            "tpot_s_p50": percentile(self.tpot_s, 50),
            "tpot_s_p95": percentile(self.tpot_s, 95),
            "preemptions": self.preemptions,
            **(self._spec_json() if self.spec_enabled else {}),
            **({"response_cache": self.response_cache,
                "response_cache_rows": self.response_cache_rows,
                "response_cache_prompt_tokens": self.response_cache_prompt_tokens,
                "response_cache_output_tokens": self.response_cache_output_tokens}
               if self.response_cache is not None else {}),
        }

    def _spec_json(self) -> dict[str, Any]:
        steps = self.spec_target_steps
        return {"speculative": {
            "draft_tokens": self.spec_draft_tokens,
            "accepted_tokens": self.spec_accepted_tokens,
            "acceptance_rate": round(self.spec_accepted_tokens / self.spec_draft_tokens, 4)
            if self.spec_draft_tokens else 0.0,
            "target_steps": steps,
            # Tokens each decoding target pass kept from the drafter (the bonus token not counted).
            "mean_accepted_per_step": round(self.spec_accepted_tokens / steps, 4) if steps else 0.0,
            "drafter_time_share": round(self.draft_s / self.step_s, 4) if self.step_s else 0.0,
        }}



def sum_counters(docs: list[Any]) -> Any:
    """Numeric leaves summed across documents of the same shape (per-rank or per-run counters:
    the KV connector's, the response cache's); a leaf that is not a number is the first document's."""
    first = docs[0]
    if isinstance(first, dict):
        keys = {k for d in docs if isinstance(d, dict) for k in d}
        return {k: sum_counters([d[k] for d in docs if isinstance(d, dict) and k in d]) for k in sorted(keys)}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(d for d in docs if isinstance(d, (int, float)))
    return first
