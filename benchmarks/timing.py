"""Timing helpers shared by the benchmarks: wall and process-CPU seconds of a block, and where an
engine step's wall time goes (:class:`StepProfile`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Self


@dataclass
class Timed:
    """One timed run: wall and process CPU seconds (CPU / (wall x threads) well under 1 hints at contention)."""

    wall_s: float
    cpu_s: float

    def utilization(self, threads: int) -> float:
        return self.cpu_s / (self.wall_s * threads) if self.wall_s > 0 else 0.0


class Stopwatch:
    def __enter__(self) -> Self:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timed = Timed(time.perf_counter() - self._wall, time.process_time() - self._cpu)


# ------------------------------------------------------------------ where an engine step's time goes

# (label, where the wrapped function lives, its name): parts inside the model's forward pass first.
# The kernel calls go through ``kvbatch.kernels.dispatch`` (the model calls them as ``K.name``),
# the projections through ``LinearFormat.__call__``, a greedy step's head through ``greedy_head.screened_logits``.
FORWARD_PARTS = (
    ("projections + LM head (matmuls)", "linear", "__call__"),
    ("projections + LM head (matmuls)", "greedy_head", "screened_logits"),  # greedy rows' head
    ("attention (KV gather, softmax, plan)", "dispatch", "paged_decode_attention"),
    ("attention (KV gather, softmax, plan)", "dispatch", "prefill_attention"),
    ("attention (KV gather, softmax, plan)", "dispatch", "plan_decode"),
    ("attention (KV gather, softmax, plan)", "dispatch", "plan_prefill"),
    ("rms_norm + residual", "dispatch", "rms_norm"),
    ("rms_norm + residual", "dispatch", "add_rms_norm"),
    ("rotary", "dispatch", "apply_rotary"),
    ("rotary", "dispatch", "rotary_table"),
    ("rotary", "dispatch", "rotate_qk"),
    ("KV cache writes", "dispatch", "store_kv"),
    ("KV cache writes", "dispatch", "store_kv_layer"),
    # a decode step whose every layer runs in one native call (LlamaModel._fused_layers): its
    # projections, attention and small ops are not split out
    ("fused decode layers (one native call)", "dispatch", "decode_layers"),
)
FORWARD_REST = "forward: rest (embedding, slices, activation, layer loop)"
HOST_PARTS = (("scheduler", "scheduler", "schedule"), ("step tensors (runner.prepare)", "runner", "prepare"))
HOST_REST = "sampling, stop checks, bookkeeping (rest of LLM.step)"


class StepProfile:
    """Wall time of ``LLM.step`` split by part, for one engine, while the ``with`` block lasts.

    Each part's function is wrapped with a clock (and put back on exit); ``table`` gives ms per
    step and share of the step per part. The parts inside the forward pass (projections,
    attention, norms, rotary, cache writes) are what the model calls; what the forward pass spends
    between them is its own row, and what ``LLM.step`` spends outside the scheduler, the step
    tensors and the forward pass (the sampler, stop checks, block commits, results) another."""

    def __init__(self, llm: Any) -> None:
        from kvbatch.kernels import dispatch
        from kvbatch.kernels.cpu import greedy_head, linear

        self.llm = llm
        self._owners = {"linear": linear.LinearFormat, "greedy_head": greedy_head, "dispatch": dispatch,
                        "scheduler": llm.scheduler,
                        "runner": llm.runner}
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self._undo: list[tuple[object, str, object, bool]] = []

    def _wrap(self, owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)
        had_own = name in vars(owner) if not isinstance(owner, type) else True
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, fn if had_own else None, had_own))

    def __enter__(self) -> Self:
        for label, owner, name in FORWARD_PARTS + HOST_PARTS:
            self._wrap(self._owners[owner], name, label)
        self._wrap(self.llm.runner.model, "forward", "forward")
        self._wrap(self.llm, "step", "step")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)  # an instance attribute shadowing the class's method
        self._undo.clear()

    def reset(self) -> None:
        self.seconds.clear()

    def table(self, steps: int) -> list[tuple[str, float, float]]:
        """``(part, ms per step, share of the step)`` rows over the last ``steps`` steps; the
        shares add up to 1."""
        s = self.seconds
        step = s.get("step", 0.0)
        inner = list(dict.fromkeys(label for label, _, _ in FORWARD_PARTS))
        host = [label for label, _, _ in HOST_PARTS]
        rows = [(label, s.get(label, 0.0)) for label in host + inner]
        rows.append((FORWARD_REST, s.get("forward", 0.0) - sum(s.get(label, 0.0) for label in inner)))
        rows.append((HOST_REST, step - s.get("forward", 0.0) - sum(s.get(label, 0.0) for label in host)))
        return [(label, sec / steps * 1e3, sec / step if step else 0.0) for label, sec in rows]


def profile_decode_steps(llm: Any, prompts: list[list[int]], steps: int) -> tuple[float, list[tuple[str, float, float]]]:
    """Decode ``len(prompts)`` requests together (greedy, no end) for ``steps`` steps after their
    prefill and two warm-up steps; returns the mean ms per step and its :class:`StepProfile`
    table. The requests are dropped afterwards (the engine can take the next batch)."""
    from kvbatch.engine.runtime.llm import GenerationRequest
    from kvbatch.engine.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10**9, temperature=0.0, ignore_eos=True)
    seqs = [llm.add_request(GenerationRequest(f"profile-{time.perf_counter_ns()}-{i}", params, prompt_token_ids=p))
            for i, p in enumerate(prompts)]
    while llm.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        llm.step()
    for _ in range(2):
        llm.step()
    with StepProfile(llm) as prof:
        for _ in range(steps):
            llm.step()
    for seq in seqs:
        if not seq.is_finished:
            llm.scheduler.finish(seq, "abort")
    table = prof.table(steps)
    return prof.seconds.get("step", 0.0) / steps * 1e3, table
