"""The cost of structured outputs' token masks per decode step, on the CPU, beside the step itself.

    python benchmarks/bench_grammar_mask.py                  # SmolLM2-135M fp32, batch 64, 24 tokens
    python benchmarks/bench_grammar_mask.py --rows 16 --max-tokens 32 --threads 2

One engine answers ``--rows`` chat requests whose ``response_format`` cycles through three JSON
schemas (an enum, a bounded integer with a boolean, a nested object with an array), greedy, each
at most ``--max-tokens`` tokens. The engine's two grammar calls are timed where it makes them
(``fill_draft_bitmask``: llguidance computes the constrained rows' bitmask on the host;
``apply_token_bitmask``: the tensor ops that unpack it over ``[rows, vocab]`` and mask the
logits), and each step's wall time is taken from the engine's own counter. Printed per decode
step (steps where every scheduled sequence decodes): mask compute, mask apply, the rest of the
step (forward and sampling), and the mask's share. The header names the CPU and the thread count.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

from kvbatch.engine.runtime import llm as llm_module
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.io.batch_requests import parse_response_format
from kvbatch.kernels.cpu.machine import cpu_identity

SCHEMAS = [
    {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
     "required": ["label"], "additionalProperties": False},
    {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "recommend": {"type": "boolean"}},
     "required": ["stars", "recommend"], "additionalProperties": False},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4}},
     "required": ["person", "tags"], "additionalProperties": False},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu, _ = cpu_identity()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  cpu: {cpu}  "
          f"threads: {torch.get_num_threads()}  cores: {os.cpu_count()}  model: {args.model}  rows: {args.rows}")
    llm = LLM(args.model, engine_config=EngineConfig(max_num_seqs=args.rows, device="cpu"))

    timed = {"fill": [], "apply": []}
    fill, apply = llm_module.fill_draft_bitmask, llm_module.apply_token_bitmask

    def timer(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            timed[name].append(time.perf_counter() - t0)
            return out
        return run

    llm_module.fill_draft_bitmask = timer("fill", fill)
    llm_module.apply_token_bitmask = timer("apply", apply)
    formats = [parse_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": s, "strict": True}})
               for s in SCHEMAS]
    reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                      response_format=formats[i % 3]),
                              messages=[{"role": "user", "content": f"Review {i}: the food was good, the service slow."}])
            for i in range(args.rows)]
    # Step times of decode steps only: wrap LLM.step and keep the steps that scheduled no prompt tokens.
    steps: list[tuple[float, int, int]] = []  # (seconds, grammar calls before, batch rows)
    real_step = llm.step

    def step():
        before = len(timed["fill"])
        prefilling = any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running) or bool(
            llm.scheduler.waiting)
        t0 = time.perf_counter()
        out = real_step()
        if not prefilling and len(timed["fill"]) == before + 1:
            steps.append((time.perf_counter() - t0, before, len(llm.scheduler.running) + len(out)))
        return out

    llm.step = step
    t0 = time.perf_counter()
    results = llm.generate(reqs)
    wall = time.perf_counter() - t0
    bad = [r.request_id for r in results if r.error is not None]
    full = [s for s in steps if s[2] == args.rows]
    if not full:
        full = steps
    step_ms = statistics.median(s[0] for s in full) * 1e3
    fill_ms = statistics.median(timed["fill"][s[1]] for s in full) * 1e3
    apply_ms = statistics.median(timed["apply"][s[1]] for s in full) * 1e3
    rest = step_ms - fill_ms - apply_ms
    print(f"decode steps at batch {full[0][2]}: {len(full)} (median)  |  whole run {wall:.2f}s, "
          f"{sum(len(r.output_token_ids) for r in results)} tokens, {len(bad)} rows in error, "
          f"{llm.grammars.compiles} grammar compiles")
    print(f"  mask compute (llguidance fill) {fill_ms:7.3f} ms/step")
    print(f"  mask apply   (tensor ops)      {apply_ms:7.3f} ms/step")
    print(f"  rest of step (forward, sample) {rest:7.3f} ms/step")
    print(f"  step                           {step_ms:7.3f} ms/step   grammar share "
          f"{(fill_ms + apply_ms) / step_ms:.1%}")


if __name__ == "__main__":
    main()
