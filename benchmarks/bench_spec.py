"""Speculative decoding against plain decoding, same model, same prompts, one process.

    python benchmarks/bench_spec.py                 # SmolLM2-135M, copy-heavy and open chat
    python benchmarks/bench_spec.py --quick         # a smoke run
    python benchmarks/bench_spec.py --drafters ngram,early-exit:8,draft:smollm2-135m@bf16

Figure: decode throughput = output tokens / engine-step seconds, prompt processing left out.
Requests stop at the model's end of turn (or ``--max-tokens``): a copy task is over when the copy
is, and what a small model babbles after it with ``--ignore-eos`` is open-ended text, not copying.
Batch 1 runs the prompts one at a time and counts decode-only steps. Batch 16 is the steady state
of batch decoding: 3 x 16 requests queue for 16 sequence slots, so the batch stays full as
requests finish; their prompts' KV is computed beforehand (untimed) and served by the prefix
cache, as in kvbatch's decode stage where prompts come prefilled from the KV store. Only steps
with a full batch count (the drain at the end, when fewer than 16 remain, would flatter
speculation: a night's shard has thousands of requests and hardly drains). Each arm runs ``--rounds`` times, interleaved with the baseline, and the median
counts. Every arm's greedy outputs are compared with the plain run's, token for token.

``draft:MODEL@bf16`` drafts with MODEL in bf16 (for the bundled model, the same weights at half
the bytes: a cheaper drafter that agrees with the fp32 target most of the time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.workloads import WorkloadPrompt, chat_workload, copy_workload, default_datasets_dir  # noqa: E402
from kvbatch.engine.models.weights import load_checkpoint  # noqa: E402
from kvbatch.engine.runtime.engine_config import EngineConfig  # noqa: E402
from kvbatch.engine.runtime.llm import LLM, GenerationRequest  # noqa: E402
from kvbatch.engine.runtime.sampling_params import SamplingParams  # noqa: E402
from kvbatch.engine.speculative.controller import SpecConfig  # noqa: E402


@dataclass
class Arm:
    name: str
    spec: SpecConfig | None
    draft_dtype: str | None = None


@dataclass
class Run:
    tokens: int
    seconds: float
    outputs: list[list[int]]
    drafted: int
    accepted: int
    target_steps: int
    draft_s: float
    step_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def decode_run(llm: LLM, requests: list[GenerationRequest], steady: bool = False) -> Run:
    """Drive the engine step by step, timing the steps that decode. ``steady``: prefill the
    prompts first (untimed; their KV stays in the prefix cache) and then count every step that
    runs a full batch."""
    if steady:
        llm.generate([GenerationRequest(f"warm-{r.request_id}", r.sampling, prompt_token_ids=r.prompt_token_ids,
                                        prefill_only=True) for r in requests])
    for r in requests:
        llm.add_request(r)
    st0 = dict(llm.stats)
    tokens, seconds = 0, 0.0
    results = {}
    while llm.scheduler.has_work():
        before_prompt, before_out = llm.stats["computed_prompt_tokens"], llm.stats["output_tokens"]
        full = len(llm.scheduler.running) + len(llm.scheduler.waiting) >= llm.scheduler.max_num_seqs
        t0 = time.perf_counter()
        for res in llm.step():
            results[res.request_id] = res.output_token_ids
        dt = time.perf_counter() - t0
        if (steady and full) or (not steady and llm.stats["computed_prompt_tokens"] == before_prompt):
            tokens += llm.stats["output_tokens"] - before_out
            seconds += dt
    st = llm.stats
    return Run(tokens, seconds, [results[r.request_id] for r in requests],
               st["spec_draft_tokens"] - st0["spec_draft_tokens"],
               st["spec_accepted_tokens"] - st0["spec_accepted_tokens"],
               st["spec_target_steps"] - st0["spec_target_steps"],
               st["draft_s"] - st0["draft_s"], st["step_s"] - st0["step_s"])


def merge(runs: list[Run]) -> Run:
    return Run(sum(r.tokens for r in runs), sum(r.seconds for r in runs), [o for r in runs for o in r.outputs],
               sum(r.drafted for r in runs), sum(r.accepted for r in runs), sum(r.target_steps for r in runs),
               sum(r.draft_s for r in runs), sum(r.step_s for r in runs))


def build(model, dtype: str, arm: Arm, threads: int | None, batch: int) -> LLM:
    spec = arm.spec
    llm = LLM(model, dtype=dtype, num_threads=threads, engine_config=EngineConfig(max_num_seqs=batch),
              speculative=spec)
    if arm.draft_dtype and llm.drafter is not None:  # rebuild the draft engine in its own dtype
        from kvbatch.engine.speculative.drafters import DraftModelDrafter

        draft = LLM(spec.draft_model, dtype=arm.draft_dtype, engine_config=EngineConfig(max_num_seqs=batch))
        llm.drafter = DraftModelDrafter(draft, llm.model_config.vocab_size,
                                        spec.accept_threshold if spec.adaptive else None)
    return llm


def parse_arms(text: str, max_len: int, threshold: float | None = None) -> list[Arm]:
    arms = []
    for item in text.split(","):
        method, _, dtype = item.partition("@")
        for adaptive in (False, True):
            spec = SpecConfig.parse(method, max_len, adaptive)
            if threshold is not None:
                spec = dataclasses.replace(spec, accept_threshold=threshold)
            arms.append(Arm(f"{method}{'@' + dtype if dtype else ''} {'adaptive' if adaptive else f'fixed {max_len}'}",
                            spec, dtype or None))
    return arms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--drafters", default="ngram", help="comma-separated --spec values, optionally METHOD@DTYPE")
    ap.add_argument("--spec-max-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true", help="decode --max-tokens tokens past the end of turn")
    ap.add_argument("--batch1-prompts", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workloads", default="copy-heavy,open chat", help="comma-separated: copy-heavy, open chat")
    ap.add_argument("--accept-threshold", type=float, default=None, help="adaptive survival threshold (default: SpecConfig's)")
    ap.add_argument("--datasets", type=Path, default=default_datasets_dir(),
                    help="folder of the prompt sets (default ../shared/datasets from the repo root)")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, 1 round")
    ap.add_argument("--json", default=None, help="also write every figure here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch1_prompts, args.batch, args.max_tokens, args.rounds = 2, 4, 32, 1
    arms = [Arm("plain", None)] + parse_arms(args.drafters, args.spec_max_len, args.accept_threshold)
    n = max(3 * args.batch, args.batch1_prompts)
    builders = {"copy-heavy": copy_workload, "open chat": chat_workload}
    unknown = set(args.workloads.split(",")) - set(builders)
    if unknown:
        ap.error(f"unknown workload(s) {sorted(unknown)}; choose from {sorted(builders)}")
    # The prompts (from ../shared/datasets) before the model: a missing datasets folder fails at once.
    workloads = {w: builders[w](args.datasets, num_requests=n) for w in args.workloads.split(",")}
    ckpt = load_checkpoint(args.model)
    engines = {a.name: build(ckpt, args.dtype, a, args.threads, args.batch) for a in arms}
    tok = engines["plain"].tokenizer
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.ignore_eos)

    def requests(prompts: list[WorkloadPrompt], tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}-{p.request_id}", sampling, prompt_token_ids=tok.encode_chat(p.messages))
                for p in prompts]

    table = []
    for wname, prompts in workloads.items():
        modes = {"batch 1": [[p] for p in prompts[:args.batch1_prompts]], f"batch {args.batch}": [prompts]}
        for mode, groups in modes.items():
            steady = mode != "batch 1"
            per_arm: dict[str, list[Run]] = {a.name: [] for a in arms}
            for rnd in range(args.rounds):
                for a in arms:  # interleaved, so drift on a shared machine hits every arm alike
                    llm = engines[a.name]
                    run = merge([decode_run(llm, requests(g, f"{rnd}"), steady) for g in groups])
                    per_arm[a.name].append(run)
                    print(f"[{wname} / {mode} / round {rnd}] {a.name}: {run.tok_s:.1f} tok/s", file=sys.stderr)
            base = statistics.median(r.tok_s for r in per_arm["plain"])
            base_out = per_arm["plain"][0].outputs
            for a in arms:
                runs = per_arm[a.name]
                tok_s = statistics.median(r.tok_s for r in runs)
                r0 = merge(runs)
                same = sum(x == y for x, y in zip(runs[0].outputs, base_out))
                table.append({
                    "workload": wname, "mode": mode, "arm": a.name, "tok_s": round(tok_s, 1),
                    "ratio": round(tok_s / base, 3) if base else 0.0,
                    "identical": f"{same}/{len(base_out)}",
                    "acceptance": round(r0.accepted / r0.drafted, 3) if r0.drafted else None,
                    "accepted_per_step": round(r0.accepted / r0.target_steps, 3) if r0.target_steps else None,
                    "drafter_share": round(r0.draft_s / r0.step_s, 3) if r0.step_s else None,
                })
    stop = "ignoring end of turn" if args.ignore_eos else "stopping at end of turn"
    print(f"\nkvbatch speculative decoding, {args.model} {args.dtype}, <= {args.max_tokens} tokens/request {stop}, "
          f"threads={torch.get_num_threads()}, {args.rounds} round(s), median")
    print(f"{'workload':<11} {'mode':<9} {'arm':<26} {'tok/s':>7} {'x plain':>8} {'greedy':>7} "
          f"{'accept':>7} {'acc/step':>8} {'draft%':>7}")
    for row in table:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{row['workload']:<11} {row['mode']:<9} {row['arm']:<26} {row['tok_s']:>7.1f} {row['ratio']:>7.2f}x "
              f"{row['identical']:>7} {fmt(row['acceptance'], '.2f'):>7} {fmt(row['accepted_per_step'], '.2f'):>8} "
              f"{fmt(row['drafter_share'] and 100 * row['drafter_share'], '.1f'):>7}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": table},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
