"""kvbatch against transformers ``generate`` on one workload, in one process: tokens/s and ratios.

    python benchmarks/bench_engine.py                  # the full workload (several minutes on 2 cores)
    python benchmarks/bench_engine.py --quick          # a small smoke run
    python benchmarks/bench_engine.py --json out.json  # also save every figure

Both engines get the same token ids (kvbatch's ChatTokenizer) and the same weights (the bundled
SmolLM2 GGUF, dequantized), generate greedily and produce exactly ``--max-tokens`` tokens per
request (kvbatch: ``ignore_eos``; transformers: ``min_new_tokens = max_new_tokens`` with no EOS,
so both carry on past an end-of-turn token and their outputs stay comparable token for token).

Two modes:

* batched: all requests at once. kvbatch gets them in one ``generate`` call (continuous
  batching, up to ``--max-num-seqs`` running); transformers runs left-padded batches of
  ``--hf-batch-size`` in workload order. Figure: output tokens / wall seconds, prefill included.
* batch-1: a few prompts one at a time, decode only. kvbatch: 1 / ``Result.tpot_s``;
  transformers: (N - 1) / (time for N tokens - time for 1 token). Median over the prompts.

Runs alternate between engines (batched rounds, then batch-1 prompt by prompt) and medians are
reported, because the machine may be shared. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `benchmarks.workloads` importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.timing import Stopwatch, Timed  # noqa: E402
from benchmarks.workloads import WorkloadPrompt, chat_workload, default_datasets_dir  # noqa: E402
from kvbatch.engine.models.weights import Checkpoint, load_checkpoint, resolve_model  # noqa: E402
from kvbatch.engine.runtime.engine_config import EngineConfig  # noqa: E402
from kvbatch.engine.runtime.llm import LLM, GenerationRequest  # noqa: E402
from kvbatch.engine.runtime.sampling_params import SamplingParams  # noqa: E402
from kvbatch.engine.text.tokenizer import ChatTokenizer  # noqa: E402

TARGETS = {"batched": 5.0, "batch-1": 2.0}  # kvbatch tok/s over transformers fp32, same mode
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)




@dataclass
class Row:
    engine: str
    dtype: str
    mode: str  # "batched" or "batch-1"
    samples_tokens_per_s: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.samples_tokens_per_s) if self.samples_tokens_per_s else float("nan")


# ------------------------------------------------------------------ transformers reference


class TransformersReference:
    """transformers' LlamaForCausalLM loaded from the same GGUF, fp32, greedy ``generate``."""

    def __init__(self, gguf_path: str, attn_implementation: str) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        folder, name = os.path.split(gguf_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation=attn_implementation
        ).eval()
        self.pad_id = self.model.generation_config.pad_token_id
        if self.pad_id is None:
            self.pad_id = 2

    def generate(self, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        """Greedy, exactly ``new_tokens`` per prompt, left-padded; returns the new ids and the
        time at which each step's tokens were ready (``perf_counter``)."""
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        clock = _TokenClock()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,  # like kvbatch's ignore_eos: an end-of-turn token is emitted, not masked
                pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        new = out[:, width:].tolist()
        assert all(len(ids) == new_tokens for ids in new), "transformers stopped early"
        assert len(clock.times) == new_tokens, f"{len(clock.times)} clock ticks for {new_tokens} tokens"
        return new, clock.times


class _TokenClock(StoppingCriteria):
    """A stopping criterion that never stops: ``generate`` calls it once per step, after the
    step's tokens are chosen, so its timestamps give time to first token and time per token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


# ------------------------------------------------------------------ kvbatch


def make_llm(ckpt: Checkpoint, dtype: str, args: argparse.Namespace) -> LLM:
    llm = LLM(ckpt, dtype=dtype, engine_config=EngineConfig(max_num_seqs=args.max_num_seqs))
    # Warm-up on ids no chat prompt starts with, so the prefix cache holds nothing useful.
    warm = [1] + list(range(1000, 1000 + 40))
    llm.generate([GenerationRequest("warmup", greedy(4), prompt_token_ids=warm)])
    return llm


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def kvbatch_batched(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[Timed, list, dict]:
    requests = [GenerationRequest(f"r{i}", greedy(new_tokens), prompt_token_ids=ids) for i, ids in enumerate(prompts)]
    before = dict(llm.stats)
    with Stopwatch() as sw:
        results = llm.generate(requests)
    assert all(len(r.output_token_ids) == new_tokens for r in results), "kvbatch stopped early"
    stats = {k: llm.stats[k] - before[k] for k in llm.stats}
    stats["num_preemptions"] = sum(r.num_preemptions for r in results)
    stats["num_cached_tokens"] = sum(r.num_cached_tokens for r in results)
    return sw.timed, results, stats


# ------------------------------------------------------------------ the run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 8 requests, 16 tokens, transformers batches of 4, 2 batch-1 prompts")
    p.add_argument("--requests", type=int, help="requests in the batched workload (default 64)")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 64)")
    p.add_argument("--hf-batch-size", type=int, help="transformers batch size (default 16)")
    p.add_argument("--b1-prompts", type=int, help="prompts for the batch-1 decode figure (default 4)")
    p.add_argument("--repeats", type=int, help="kvbatch batched runs per dtype, median reported (default 3)")
    p.add_argument("--hf-repeats", type=int, default=1, help="transformers batched runs (default 1, ~2 min each)")
    p.add_argument("--dtypes", default="fp32,bf16", help="kvbatch dtypes, comma-separated (default fp32,bf16)")
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or GGUF path")
    p.add_argument("--datasets", type=Path, default=default_datasets_dir(),
                   help="folder of the prompt sets (default ../shared/datasets from the repo root)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="kvbatch max_num_seqs (default 64)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="transformers attention")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads (default: the cores this process may use)")
    p.add_argument("--json", type=Path, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    defaults = (dict(requests=8, max_tokens=16, hf_batch_size=4, b1_prompts=2, repeats=1) if args.quick
                else dict(requests=64, max_tokens=64, hf_batch_size=16, b1_prompts=4, repeats=3))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for key in ("requests", "max_tokens", "hf_batch_size", "b1_prompts", "repeats", "hf_repeats", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (decode speed needs a second token)")
    args.b1_prompts = min(args.b1_prompts, args.requests)
    return args


def workload_stats(prompts: list[WorkloadPrompt], ids: list[list[int]], hf_batch: int) -> dict[str, Any]:
    lengths = [len(x) for x in ids]
    padded = sum(max(lengths[i:i + hf_batch]) * len(lengths[i:i + hf_batch]) for i in range(0, len(lengths), hf_batch))
    by_source: dict[str, int] = {}
    for p in prompts:
        by_source[p.source] = by_source.get(p.source, 0) + 1
    return {
        "requests": len(ids),
        "by_source": by_source,
        "with_shared_system_prompt": sum(p.shares_system_prompt for p in prompts),
        "prompt_tokens": sum(lengths),
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_median": statistics.median(lengths),
        "prompt_tokens_max": max(lengths),
        "hf_padded_prompt_tokens": padded,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many outputs are identical token for token, and where the others first differ."""
    first_diff = []
    for x, y in zip(a, b):
        pos = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if pos is not None:
            first_diff.append(pos)
    return {"identical": len(a) - len(first_diff), "total": len(a), "first_divergence_positions": first_diff}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    log(f"torch {torch.__version__}, {args.threads} threads; model {args.model}; dtypes {args.dtypes}")
    prompts = chat_workload(args.datasets, args.requests)
    gguf_path = resolve_model(args.model)
    with Stopwatch() as sw:
        ckpt = load_checkpoint(args.model)
    log(f"kvbatch checkpoint loaded in {sw.timed.wall_s:.1f}s")
    tokenizer = ChatTokenizer.from_checkpoint(ckpt)
    ids = [tokenizer.encode_chat(p.messages) for p in prompts]
    wl = workload_stats(prompts, ids, args.hf_batch_size)
    log(f"workload: {wl['requests']} requests {wl['by_source']}, {wl['prompt_tokens']} prompt tokens "
        f"(min {wl['prompt_tokens_min']}, median {wl['prompt_tokens_median']}, max {wl['prompt_tokens_max']}), "
        f"{wl['with_shared_system_prompt']} share the support system prompt; {args.max_tokens} new tokens each")

    with Stopwatch() as sw:
        hf = TransformersReference(gguf_path, args.attn)
        hf.generate([ids[0][:16]], 2)  # warm-up
    log(f"transformers loaded from {os.path.basename(gguf_path)} in {sw.timed.wall_s:.1f}s")

    n_out = args.requests * args.max_tokens
    hf_row = Row("transformers", "fp32", "batched")
    kv_rows = {d: Row("kvbatch", d, "batched") for d in args.dtypes}
    outputs: dict[str, list[list[int]]] = {}
    llms: dict[str, LLM] = {}

    # Batched: alternate engines round by round; transformers' (slow) runs go first in their rounds.
    for rnd in range(max(args.repeats, args.hf_repeats)):
        if rnd < args.hf_repeats:
            log(f"round {rnd + 1}: transformers batched, {args.requests} requests in batches of {args.hf_batch_size}")
            hf_out: list[list[int]] = []
            prefill_s = decode_s = 0.0
            with Stopwatch() as sw:
                for start in range(0, len(ids), args.hf_batch_size):
                    t = time.perf_counter()
                    new, ticks = hf.generate(ids[start:start + args.hf_batch_size], args.max_tokens)
                    hf_out += new
                    prefill_s += ticks[0] - t
                    decode_s += ticks[-1] - ticks[0]
                    log(f"  transformers batch {start // args.hf_batch_size + 1}: "
                        f"prefill {ticks[0] - t:.1f}s, decode {ticks[-1] - ticks[0]:.1f}s")
            outputs.setdefault("transformers", hf_out)
            hf_row.samples_tokens_per_s.append(n_out / sw.timed.wall_s)
            hf_row.extra.setdefault("runs", []).append(
                {"wall_s": sw.timed.wall_s, "cpu_utilization": sw.timed.utilization(args.threads),
                 "prefill_s": prefill_s, "decode_s": decode_s})
            log(f"  transformers: {n_out / sw.timed.wall_s:.1f} tok/s ({sw.timed.wall_s:.1f}s, "
                f"cpu {sw.timed.utilization(args.threads):.0%})")
        if rnd >= args.repeats:
            continue
        for dtype in args.dtypes:
            llms.pop(dtype, None)  # a fresh engine per run: an empty prefix cache every time
            with Stopwatch() as sw:
                llms[dtype] = llm = make_llm(ckpt, dtype, args)
            log(f"kvbatch {dtype} engine built and warmed up in {sw.timed.wall_s:.1f}s")
            log(f"round {rnd + 1}: kvbatch {dtype} batched, {args.requests} requests at once")
            timed, results, stats = kvbatch_batched(llm, ids, args.max_tokens)
            outputs.setdefault(f"kvbatch-{dtype}", [r.output_token_ids for r in results])
            row = kv_rows[dtype]
            row.samples_tokens_per_s.append(n_out / timed.wall_s)
            row.extra.setdefault("runs", []).append(
                {"wall_s": timed.wall_s, "cpu_utilization": timed.utilization(args.threads),
                 "ttft_s_median": statistics.median(r.ttft_s for r in results), **stats})
            log(f"  kvbatch {dtype}: {n_out / timed.wall_s:.1f} tok/s ({timed.wall_s:.1f}s, "
                f"cpu {timed.utilization(args.threads):.0%}; {stats['steps']} steps, "
                f"{stats['computed_prompt_tokens']}/{stats['prompt_tokens']} prompt tokens computed, "
                f"{stats['num_preemptions']} preemptions)")

    # Batch-1 decode: prompt by prompt, each engine in turn.
    hf_b1 = Row("transformers", "fp32", "batch-1")
    kv_b1 = {d: Row("kvbatch", d, "batch-1") for d in args.dtypes}
    for k in range(args.b1_prompts):
        prompt = ids[k]
        with Stopwatch() as sw:
            _, ticks = hf.generate([prompt], args.max_tokens)
        hf_b1.samples_tokens_per_s.append((len(ticks) - 1) / (ticks[-1] - ticks[0]))
        hf_b1.extra.setdefault("runs", []).append({"prompt_tokens": len(prompt), "wall_s": sw.timed.wall_s,
                                                   "cpu_utilization": sw.timed.utilization(args.threads)})
        msg = [f"transformers {hf_b1.samples_tokens_per_s[-1]:.1f}"]
        for dtype in args.dtypes:
            with Stopwatch() as sw:
                (res,) = llms[dtype].generate(
                    [GenerationRequest(f"b1-{k}", greedy(args.max_tokens), prompt_token_ids=prompt)])
            kv_b1[dtype].samples_tokens_per_s.append(1.0 / res.tpot_s)
            kv_b1[dtype].extra.setdefault("runs", []).append(
                {"prompt_tokens": len(prompt), "wall_s": sw.timed.wall_s, "ttft_s": res.ttft_s,
                 "cpu_utilization": sw.timed.utilization(args.threads)})
            msg.append(f"kvbatch {dtype} {1.0 / res.tpot_s:.1f}")
        log(f"batch-1 prompt {k + 1}/{args.b1_prompts} ({len(prompt)} tokens): decode tok/s " + ", ".join(msg))

    rows = [hf_row, *kv_rows.values(), hf_b1, *kv_b1.values()]
    base = {"batched": hf_row.tokens_per_s, "batch-1": hf_b1.tokens_per_s}
    parity = {name: agreement(out, outputs["transformers"]) for name, out in outputs.items() if name != "transformers"}
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "machine": platform.machine(),
            "cpus_usable": len(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
            "model_path": gguf_path,
        },
        "workload": wl,
        "rows": [
            {"engine": r.engine, "dtype": r.dtype, "mode": r.mode, "output_tokens_per_s": r.tokens_per_s,
             "samples_tokens_per_s": r.samples_tokens_per_s,
             "ratio_vs_transformers": r.tokens_per_s / base[r.mode],
             "target_ratio": None if r.engine == "transformers" else TARGETS[r.mode],
             "meets_target": None if r.engine == "transformers" else r.tokens_per_s / base[r.mode] >= TARGETS[r.mode],
             **r.extra}
            for r in rows
        ],
        "parity_vs_transformers": parity,
    }


def print_report(report: dict[str, Any]) -> None:
    cfg, wl = report["config"], report["workload"]
    print(f"\nkvbatch vs transformers generate — {cfg['model']}, {report['environment']['threads']} threads, "
          f"torch {report['environment']['torch']}, transformers {report['environment']['transformers']}")
    print(f"workload: {wl['requests']} chat requests ({', '.join(f'{v} {k}' for k, v in wl['by_source'].items())}), "
          f"{wl['with_shared_system_prompt']} sharing a ~300-token system prompt; prompt tokens "
          f"{wl['prompt_tokens']} (min {wl['prompt_tokens_min']}, median {wl['prompt_tokens_median']:g}, "
          f"max {wl['prompt_tokens_max']}); {cfg['max_tokens']} greedy tokens each, EOS ignored")
    print(f"batched: output tokens / wall s incl. prefill (transformers: left-padded batches of {cfg['hf_batch_size']}, "
          f"{wl['hf_padded_prompt_tokens']} padded prompt tokens; kvbatch: all at once, max_num_seqs "
          f"{cfg['max_num_seqs']}). batch-1: decode tokens/s on {cfg['b1_prompts']} prompts, prefill excluded.")
    print(f"medians of {cfg['repeats']} kvbatch / {cfg['hf_repeats']} transformers batched runs, "
          f"{cfg['b1_prompts']} batch-1 prompts.\n")
    header = (f"{'engine':<13} {'dtype':<5} {'mode':<8} {'output tok/s':>12} {'vs transformers':>16} "
              f"{'target':>7}  {'result':<6} {'cpu':>5}")
    print(header)
    print("-" * len(header))
    busy: list[float] = []
    for r in report["rows"]:
        target = f">={r['target_ratio']:g}x" if r["target_ratio"] else ""
        result = "" if r["meets_target"] is None else ("PASS" if r["meets_target"] else "MISS")
        cpu = statistics.median(run["cpu_utilization"] for run in r["runs"])
        busy.append(cpu)
        print(f"{r['engine']:<13} {r['dtype']:<5} {r['mode']:<8} {r['output_tokens_per_s']:>12.1f} "
              f"{r['ratio_vs_transformers']:>15.2f}x {target:>7}  {result:<6} {cpu:>5.0%}")
    print(f"\ntargets: kvbatch over transformers fp32 in the same mode, batched >= {TARGETS['batched']:g}x, "
          f"batch-1 >= {TARGETS['batch-1']:g}x. cpu: process CPU time / (wall time x threads), median over runs.")
    if min(busy) < 0.8:
        print(f"note: cpu went down to {min(busy):.0%}: threads sat idle (single-threaded Python) or other work "
              "took the cores; if the latter, these figures are noisy (compare ratios, rerun when idle)")
    print()
    for name, agree in report["parity_vs_transformers"].items():
        diffs = agree["first_divergence_positions"]
        where = f"; the others first differ at token {sorted(diffs)}" if diffs else ""
        print(f"greedy agreement {name} vs transformers (batched): {agree['identical']}/{agree['total']} "
              f"outputs identical token for token{where}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
