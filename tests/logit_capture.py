"""Record the next-token logits an engine computes, per request, and compare them with a
transformers reference model, for parity tests."""

from __future__ import annotations

import torch

from kvbatch.engine.runtime.llm import LLM


def full_head(llm: LLM) -> LLM:
    """``llm`` with its greedy LM-head screen off (kernels/cpu/greedy_head.py): a screened row is
    -inf wherever the screen ruled a token out, and parity tests compare whole rows."""
    llm.runner.model.greedy_head = None
    return llm


def capture_logits(llm: LLM) -> list[tuple[str, torch.Tensor]]:
    """Wrap ``llm``'s runner so every sampled row's logits are appended, with its request id, to
    the returned list as the engine runs (plain decoding: one row per sampled sequence), computed
    by the full head (:func:`full_head`)."""
    full_head(llm)
    seen: list[tuple[str, torch.Tensor]] = []
    execute = llm.runner.execute

    def spy(step):
        logits, sampled = execute(step)
        for row, s in enumerate(sampled):
            seen.append((s.seq.request_id, logits[row].clone()))
        return logits, sampled

    llm.runner.execute = spy
    return seen


def assert_logits_match(ref, seen: list[tuple[str, torch.Tensor]], request_id: str, prompt: list[int],
                        output: list[int], label: str) -> torch.Tensor:
    """Every logits row ``seen`` for ``request_id`` (one per output token, plain decoding) equals,
    within 1e-4, the reference model's logits at that position over ``prompt + output``;
    returns the reference logits [len(prompt + output), V]."""
    with torch.no_grad():
        want = ref(torch.tensor([prompt + output])).logits[0]
    got = [logits for r, logits in seen if r == request_id]
    assert len(got) == len(output), f"{label}: {len(got)} logits rows for {len(output)} tokens"
    for i, logits in enumerate(got):
        pos = len(prompt) - 1 + i
        torch.testing.assert_close(logits, want[pos], atol=1e-4, rtol=1e-4, msg=f"{label}: step {i} (position {pos})")
    return want
