"""Drafts from last night: suffix drafting on a near-duplicate second night, against plain
decoding and prompt lookup, same model, same prompts, one process.

    python benchmarks/bench_suffix.py            # SmolLM2-135M, GSM8K, batch 1 and batch 32
    python benchmarks/bench_suffix.py --quick    # a smoke run

Night 1 answers GSM8K questions (greedy, to the end of turn; untimed): its answers' token ids go
into a results Parquet, as the pipeline's ``decode_results`` writes them. Night 2 asks the same
questions as near-duplicates (``--variant``): ``reworded`` adds a lead-in sentence and a closing
one around the unchanged question (the same problem asked in other words); ``renumbered`` adds the
lead-in and changes the first number by one (a different problem: the answers follow last night's
wording but not its arithmetic, a harder case for any corpus). Night 2 is
decoded by three arms, interleaved per round: plain, ``--spec ngram`` (prompt lookup) and
``--spec suffix:NIGHT1`` (last night's answers beside prompt lookup), all adaptive. The figure is
decode throughput as ``bench_spec.py`` measures it (output tokens / decode-step seconds; batch 1
counts decode-only steps, batch N the steps with a full batch after an untimed prefill), median
over ``--rounds``, with every arm's greedy answers compared with plain decoding's.

Every arm is first warmed on two other prompts (untimed). Targets (issue 44): suffix >= 1.5x plain
at batch 1, never below 1.0x at batch 32.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_kv_scale import cpu_line  # noqa: E402
from benchmarks.bench_spec import Run, decode_run, merge  # noqa: E402
from benchmarks.workloads import _gsm8k, default_datasets_dir  # noqa: E402
from kvbatch.engine.models.weights import load_checkpoint  # noqa: E402
from kvbatch.engine.runtime.engine_config import EngineConfig  # noqa: E402
from kvbatch.engine.runtime.llm import LLM, GenerationRequest  # noqa: E402
from kvbatch.engine.runtime.sampling_params import SamplingParams  # noqa: E402
from kvbatch.engine.speculative.controller import SpecConfig  # noqa: E402

LEAD_INS = ("Here is a question.", "Please solve this.", "A word problem:", "Think it through.")
_NUMBER = re.compile(r"\d+")


CLOSINGS = ("Show your steps.", "Explain briefly.", "Give the final number.", "Be concise.")


def near_duplicate(question: str, i: int, variant: str = "reworded") -> str:
    """Night 2's version of a question (see the module docstring)."""
    if variant == "renumbered":
        changed = _NUMBER.sub(lambda m: str(int(m.group()) + 1), question, count=1)
        return f"{LEAD_INS[i % len(LEAD_INS)]} {changed}"
    return f"{LEAD_INS[i % len(LEAD_INS)]} {question} {CLOSINGS[i % len(CLOSINGS)]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch1-prompts", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", choices=["reworded", "renumbered"], default="reworded",
                    help="how night 2's questions differ from night 1's (see above)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--datasets", type=Path, default=default_datasets_dir())
    ap.add_argument("--quick", action="store_true", help="2 prompts at batch 1, batch 4, 32 tokens, 1 round")
    ap.add_argument("--json", default=None, help="also write every figure here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch1_prompts, args.batch, args.max_tokens, args.rounds = 2, 4, 32, 1
    n = max(3 * args.batch, args.batch1_prompts)
    questions = _gsm8k(args.datasets, 600)[:n]
    ckpt = load_checkpoint(args.model)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    plain = LLM(ckpt, num_threads=args.threads, engine_config=EngineConfig(max_num_seqs=args.batch))
    tok = plain.tokenizer

    def requests(texts: list[str], tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}-{i}", sampling, prompt_token_ids=tok.encode_chat([{"role": "user", "content": t}]))
                for i, t in enumerate(texts)]

    night1 = plain.generate(requests(questions, "night1"))
    corpus = Path(tempfile.mkdtemp(prefix="kvbatch-suffix-")) / "night1.parquet"
    pq.write_table(pa.table({"custom_id": [r.request_id for r in night1],
                             "output_token_ids": [r.output_token_ids for r in night1]}), corpus)
    engines = {
        "plain": plain,
        "ngram adaptive": LLM(ckpt, num_threads=args.threads, engine_config=EngineConfig(max_num_seqs=args.batch),
                              speculative=SpecConfig("ngram")),
        "suffix adaptive": LLM(ckpt, num_threads=args.threads, engine_config=EngineConfig(max_num_seqs=args.batch),
                               speculative=SpecConfig.parse(f"suffix:{corpus}")),
    }
    tonight = [near_duplicate(q, i, args.variant) for i, q in enumerate(questions)]
    modes = {"batch 1": [[t] for t in tonight[:args.batch1_prompts]], f"batch {args.batch}": [tonight]}
    # Warm every arm on other prompts first (untimed): the first passes at each verify width pick
    # and build their kernels, which would otherwise be charged to whichever arm runs first.
    warm = [near_duplicate(q, i + 1, args.variant) for i, q in enumerate(questions[:2])]
    for name, llm in engines.items():
        decode_run(llm, requests(warm, f"warm-{name}"), False)
    table = []
    for mode, groups in modes.items():
        steady = mode != "batch 1"
        per_arm: dict[str, list[Run]] = {a: [] for a in engines}
        for rnd in range(args.rounds):
            for name, llm in engines.items():  # interleaved: drift on a shared machine hits every arm alike
                run = merge([decode_run(llm, requests(g, f"{rnd}-{mode}-{j}"), steady) for j, g in enumerate(groups)])
                per_arm[name].append(run)
                print(f"[{mode} / round {rnd}] {name}: {run.tok_s:.1f} tok/s", file=sys.stderr)
        base = statistics.median(r.tok_s for r in per_arm["plain"])
        base_out = per_arm["plain"][0].outputs
        for name, runs in per_arm.items():
            tok_s = statistics.median(r.tok_s for r in runs)
            r0 = merge(runs)
            table.append({
                "mode": mode, "arm": name, "tok_s": round(tok_s, 1), "ratio": round(tok_s / base, 3) if base else 0.0,
                "identical": f"{sum(x == y for x, y in zip(runs[0].outputs, base_out))}/{len(base_out)}",
                "acceptance": round(r0.accepted / r0.drafted, 3) if r0.drafted else None,
                "accepted_per_step": round(r0.accepted / r0.target_steps, 3) if r0.target_steps else None,
            })
    print(f"\nkvbatch suffix drafting on a near-duplicate night ({args.variant}): {args.model} fp32, GSM8K, "
          f"<= {args.max_tokens} "
          f"tokens to end of turn, corpus {sum(len(r.output_token_ids) for r in night1)} tokens of {len(night1)} "
          f"answers, threads={torch.get_num_threads()}, {args.rounds} round(s), median")
    print(f"CPU: {cpu_line()}")
    print(f"{'mode':<9} {'arm':<16} {'tok/s':>7} {'x plain':>8} {'greedy':>7} {'accept':>7} {'acc/step':>8}")
    for row in table:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"{row['mode']:<9} {row['arm']:<16} {row['tok_s']:>7.1f} {row['ratio']:>7.2f}x {row['identical']:>7} "
              f"{fmt(row['acceptance'], '.2f'):>7} {fmt(row['accepted_per_step'], '.2f'):>8}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": table},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
