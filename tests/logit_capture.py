"""Record the next-token logits an engine computes, per request, for parity tests."""

from __future__ import annotations

import torch

from kvbatch.engine.llm import LLM


def capture_logits(llm: LLM) -> list[tuple[str, torch.Tensor]]:
    """Wrap ``llm``'s runner so every sampled row's logits are appended, with its request id, to
    the returned list as the engine runs (plain decoding: one row per sampled sequence)."""
    seen: list[tuple[str, torch.Tensor]] = []
    execute = llm.runner.execute

    def spy(step):
        logits, sampled = execute(step)
        for row, s in enumerate(sampled):
            seen.append((s.seq.request_id, logits[row].clone()))
        return logits, sampled

    llm.runner.execute = spy
    return seen
