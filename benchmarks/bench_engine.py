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

Also measured in the same run:

* eot-honoured: a realistic workload of ``--eot-requests`` (default 256) requests that stop at
  their end-of-turn token (up to ``--eot-max-tokens``), so requests finish at different times and
  continuous batching must refill the batch; transformers stops each batch when its last
  sequence ends. Figure: each engine's own output tokens / wall seconds.
* the machine's streaming-read bandwidth (a large tensor summed, best of 5, at the start; and
  best of 3 again just before each batch-1 prompt) and the batch-1 floor it sets: the weight bytes
  a decode step streams (dense projections and LM head, in their stored dtype) / bandwidth;
  kvbatch's batch-1 rows show their share of that ceiling, each prompt's decode against the
  bandwidth measured beside it (the median over prompts): on a shared VM the figure moved 34-82
  GB/s within an hour, so a floor from the start of a 30-minute run could be another machine's.
* ``--dtypes fp32+int8``: kvbatch with weight-only int8 projections (``EngineConfig.weights``);
  ``fp32+gguf``: the GGUF file's own Q4_1/Q8_0 blocks multiplied natively where that measured
  faster (its floor counts the quantized bytes when batch 1 runs on them).
* llama.cpp (``llama-cpp-python``, batch-1, the bundled Q4_1 GGUF) when it is importable; it is
  an optional peer and never installed by ``make test``.

Every table is printed under the CPU model and its SIMD flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `benchmarks.workloads` importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.timing import Stopwatch, Timed, profile_decode_steps
from benchmarks.workloads import WorkloadPrompt, chat_workload, default_datasets_dir
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.llama import huge_pages_wanted
from kvbatch.engine.models.weights import Checkpoint, load_checkpoint, resolve_model
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest, parse_dtype
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.kernels.cpu import greedy_head, huge_pages
from kvbatch.kernels.cpu.gguf_blocks import layer_qtype
from kvbatch.kernels.cpu.huge_pages import HugePageArena
from kvbatch.kernels.cpu.kernel_choice import LINEAR_CHOICES, choose_kernels, cpu_identity, dense_shapes
from kvbatch.kernels.cpu.linear import GGUF, GGUF_NATIVE
from kvbatch.kernels.cpu.machine import ISA_CAPS, isa_cap_environment, isa_limits

# Issue 18's targets, per (kvbatch variant, mode): the ratio over transformers fp32 in the same mode
# (both batched workloads, end-of-turn ignored and honoured, take the batched target); batch-1 fp32
# also at least FLOOR_TARGET of the bandwidth floor; batch-1 int8 at least llama.cpp's batch-1
# speed, when its row has a figure. Other rows have none.
TARGETS = {("fp32", "batched"): 5.0, ("fp32", "eot-honoured"): 5.0, ("bf16", "batched"): 8.0,
           ("bf16", "eot-honoured"): 8.0, ("fp32", "batch-1"): 2.0}
FLOOR_TARGET = 0.70  # batch-1 fp32: at least 70% of the bandwidth ceiling
INT8_VARIANT = "fp32+int8"  # the variant held to llama.cpp at batch 1


def row_target(r: Row, base: dict[str, float], llama_cpp: float | None) -> tuple[str | None, bool | None]:
    """(what the row is held to, whether it meets it); (None, None) for a row with no target."""
    if r.engine != "kvbatch":
        return None, None
    ratio = r.tokens_per_s / base[r.mode]
    if r.dtype == INT8_VARIANT and r.mode == "batch-1":
        if llama_cpp is None:
            return None, None
        return "llama.cpp", r.tokens_per_s >= llama_cpp
    want = TARGETS.get((r.dtype, r.mode))
    if want is None:
        return None, None
    if r.mode == "batch-1":
        return f">={want:g}x, {FLOOR_TARGET:.0%}", ratio >= want and r.extra["share_of_ceiling"] >= FLOOR_TARGET
    return f">={want:g}x", ratio >= want
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "amx_bf16", "amx_int8", "amx_tile")
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)




@dataclass
class Row:
    engine: str
    dtype: str
    mode: str  # "batched", "eot-honoured" or "batch-1"
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

    def generate(self, batch: list[list[int]], new_tokens: int,
                 eos_ids: list[int] | None = None) -> tuple[list[list[int]], list[float]]:
        """Greedy, exactly ``new_tokens`` per prompt (or, with ``eos_ids``, up to the end-of-turn
        token), left-padded; returns the new ids (cut after the first end-of-turn token) and the
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
                min_new_tokens=None if eos_ids else new_tokens,
                eos_token_id=eos_ids or None,  # None: like kvbatch's ignore_eos, an end-of-turn token is emitted
                pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        new = out[:, width:].tolist()
        if eos_ids:
            return [_cut_at_eos(ids, eos_ids) for ids in new], clock.times
        assert all(len(ids) == new_tokens for ids in new), "transformers stopped early"
        assert len(clock.times) == new_tokens, f"{len(clock.times)} clock ticks for {new_tokens} tokens"
        return new, clock.times


def _cut_at_eos(ids: list[int], eos_ids: list[int]) -> list[int]:
    """The tokens up to and including the first end-of-turn one (the rest is padding)."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i + 1]
    return ids


class _TokenClock(StoppingCriteria):
    """A stopping criterion that never stops: ``generate`` calls it once per step, after the
    step's tokens are chosen, so its timestamps give time to first token and time per token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


# ------------------------------------------------------------------ kvbatch


def split_variant(variant: str) -> tuple[str, str]:
    """``fp32`` -> (fp32, full); ``fp32+int8`` -> (fp32, int8); ``fp32+gguf`` -> (fp32, gguf)."""
    dtype, _, weights = variant.partition("+")
    return dtype, weights or "full"


def make_llm(ckpt: Checkpoint, variant: str, args: argparse.Namespace) -> LLM:
    dtype, weights = split_variant(variant)
    llm = LLM(ckpt, dtype=dtype, engine_config=EngineConfig(max_num_seqs=args.max_num_seqs, weights=weights,
                                                            linear=args.linear))
    # Warm-up on ids no chat prompt starts with, so the prefix cache holds nothing useful.
    warm = [1] + list(range(1000, 1000 + 40))
    llm.generate([GenerationRequest("warmup", greedy(4), prompt_token_ids=warm)])
    return llm


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def kvbatch_batched(llm: LLM, prompts: list[list[int]], new_tokens: int,
                    honour_eos: bool = False) -> tuple[Timed, list, dict]:
    params = (SamplingParams(max_tokens=new_tokens, temperature=0.0) if honour_eos else greedy(new_tokens))
    requests = [GenerationRequest(f"r{i}", params, prompt_token_ids=ids) for i, ids in enumerate(prompts)]
    before = dict(llm.stats)
    with Stopwatch() as sw:
        results = llm.generate(requests)
    assert honour_eos or all(len(r.output_token_ids) == new_tokens for r in results), "kvbatch stopped early"
    stats = {k: llm.stats[k] - before[k] for k in llm.stats}
    stats["num_preemptions"] = sum(r.num_preemptions for r in results)
    stats["num_cached_tokens"] = sum(r.num_cached_tokens for r in results)
    return sw.timed, results, stats


# ------------------------------------------------------------------ the run


def probe_buffer(mib: int) -> torch.Tensor:
    """The bandwidth probe's ``mib`` MiB of fp32 ones, in the pages the engine streams its weights
    from: huge pages where it uses them (a 4 KiB-page probe read 25-26 GB/s where the engine's
    2 MiB-page decode step streamed 27, Xeon 167: a floor under the engine's own rate)."""
    if huge_pages_wanted("cpu"):
        return HugePageArena().zeros((mib << 18,), torch.float32).fill_(1.0)
    return torch.ones(mib << 18)


def stream_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Streaming-read bandwidth in GB/s: the best of ``repeats`` sums over a ``mib`` MiB fp32
    tensor (far past any cache; :func:`probe_buffer`), all threads."""
    x = probe_buffer(mib)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def kernel_choice_at_load(ckpt: Checkpoint, variant: str, linear: str) -> dict[str, Any]:
    """What the load-time kernel measurement costs on this machine: ``choose_kernels`` as
    ``build_model`` calls it, with an empty cache (a temporary folder), so it always measures."""
    dtype, weights = split_variant(variant)
    with tempfile.TemporaryDirectory() as cache_dir:
        t0 = time.perf_counter()
        choice = choose_kernels(parse_dtype(dtype), dense_shapes(ckpt.tensors),
                                num_layers=ModelConfig.from_hf(ckpt.config).num_layers, linear=linear,
                                weights=weights, cache_dir=cache_dir,
                                gguf_qtype=layer_qtype(ckpt.gguf_blocks) if weights == "gguf" else None,
                                huge_pages=huge_pages_wanted("cpu"))
        wall_s = time.perf_counter() - t0
    return {"variant": variant, "source": choice.source, "wall_s": wall_s, "timed_calls": choice.timed_calls,
            "kinds": list(choice.fmt.bucket_kinds) or [choice.fmt.kind],
            "timings_ms": {k: [None if math.isinf(t) else t for t in v] for k, v in choice.timings_ms.items()}}


def floor_share(rates: list[float], bandwidths_gbs: list[float], weight_bytes: int) -> dict[str, Any]:
    """A batch-1 row's figures against the bandwidth floor: prompt k's decode rate (tok/s) over
    the ceiling ``bandwidths_gbs[k]`` sets for ``weight_bytes`` a token; the median of those
    shares, and the median bandwidth's floor and ceiling."""
    if len(rates) != len(bandwidths_gbs) or not rates:
        raise ValueError(f"one bandwidth per prompt: {len(rates)} rates, {len(bandwidths_gbs)} bandwidths")
    shares = [rate * weight_bytes / (bw * 1e9) for rate, bw in zip(rates, bandwidths_gbs)]
    ceiling = statistics.median(bandwidths_gbs) * 1e9 / weight_bytes
    return {"weight_bytes": weight_bytes, "bandwidth_gbs": statistics.median(bandwidths_gbs),
            "floor_ms": 1e3 / ceiling, "ceiling_tokens_per_s": ceiling, "shares_of_ceiling": shares,
            "share_of_ceiling": statistics.median(shares)}


def decode_weight_bytes(llm: LLM) -> int:
    """Bytes one greedy decode step streams from the weights: every dense projection and the LM
    head as the engine holds them (fp32, bf16 or int8 plus scales; GGUF blocks where one row runs
    on them, the fp32 layout where it does not; an fp32 head that greedy rows screen in int8, its
    int8 copy and scales); the embedding is one row."""
    c = llm.model_config
    D = c.head_dim
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * D + c.num_heads * D * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    rows = c.num_layers * ((c.num_heads + 2 * c.num_kv_heads) * D + c.hidden_size + 3 * c.intermediate_size) + c.vocab_size
    if llm.engine_config.weights == "int8":
        return params + 4 * rows  # int8 values and one fp32 scale per output channel
    fmt = llm.model.linear
    if fmt.kind == GGUF and fmt.kind_for(1) == GGUF_NATIVE:
        m = llm.model
        weights = [w for lw in m.layers for w in (lw.qkv, lw.o_proj, lw.gate_up, lw.down) if w is not None]
        weights.append(m.lm_head)
        return sum(w.blocks.nbytes if w.blocks is not None else 4 * next(iter(w.layouts.values())).numel()
                   for w in weights)
    screen = getattr(llm.model, "greedy_head", None)
    if screen is not None:  # the greedy rows' head streams its int8 screen (and a few fp32 rows)
        return (params - c.vocab_size * c.hidden_size) * llm.dtype.itemsize + screen.screen_bytes
    return params * llm.dtype.itemsize


def _llama_cpp_decode(gguf_path: str, prompts: list[list[int]], new_tokens: int, threads: int) -> list[float]:
    """llama.cpp's batch-1 decode tok/s per prompt (run in a child process: see llama_cpp_batch1)."""
    from llama_cpp import Llama  # optional peer, never a dependency

    llm = Llama(model_path=gguf_path, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    rates = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)  # prefill
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        rates.append((new_tokens - 1) / (time.perf_counter() - t0))
    return rates


def llama_cpp_batch1(gguf_path: str, prompts: list[list[int]], new_tokens: int, threads: int) -> Row | None:
    """llama.cpp's batch-1 decode tok/s on the same GGUF (its native Q4_1), when
    ``llama-cpp-python`` is importable; None otherwise. It runs in a child process, so a peer that
    crashes (seen: a source build of llama-cpp-python 0.3.36 segfaulting at its first decode on an
    Intel Xeon with AMX) costs its row, not the run; the row then says why it has no figure."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    row = Row("llama.cpp", "Q4_1", "batch-1")
    job = json.dumps({"gguf": gguf_path, "prompts": prompts, "new_tokens": new_tokens, "threads": threads})
    code = ("import json, sys; from benchmarks.bench_engine import _llama_cpp_decode as f; a = json.loads(sys.stdin.read()); "
            "print(json.dumps(f(a['gguf'], a['prompts'], a['new_tokens'], a['threads'])))")
    try:
        done = subprocess.run([sys.executable, "-c", code], input=job, capture_output=True, text=True,
                              cwd=REPO_ROOT, timeout=900)
    except subprocess.TimeoutExpired:
        row.extra["failed"] = "llama.cpp peer ran past 900 s"
        return row
    if done.returncode != 0:
        tail = " ".join(done.stderr.split()[-12:])
        row.extra["failed"] = f"llama.cpp peer exited with code {done.returncode}" + (f": {tail}" if tail else "")
        return row
    for prompt, rate in zip(prompts, json.loads(done.stdout.strip().splitlines()[-1])):
        row.samples_tokens_per_s.append(rate)
        row.extra.setdefault("runs", []).append({"prompt_tokens": len(prompt), "cpu_utilization": float("nan")})
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 8 requests, 16 tokens, transformers batches of 4, 2 batch-1 prompts; "
                        "16 end-of-turn-honoured requests of up to 32 tokens")
    p.add_argument("--requests", type=int, help="requests in the batched workload (default 64)")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (default 64)")
    p.add_argument("--hf-batch-size", type=int, help="transformers batch size (default 16)")
    p.add_argument("--b1-prompts", type=int, help="prompts for the batch-1 decode figure (default 4)")
    p.add_argument("--repeats", type=int, help="kvbatch batched runs per dtype, median reported (default 3)")
    p.add_argument("--hf-repeats", type=int, default=1, help="transformers batched runs (default 1, ~2 min each)")
    p.add_argument("--dtypes", default="fp32,bf16,fp32+int8,fp32+gguf",
                   help="kvbatch variants, comma-separated: a dtype, + int8 for int8 weights, + gguf for the GGUF "
                        "file's own blocks (default fp32,bf16,fp32+int8,fp32+gguf)")
    p.add_argument("--linear", default="auto", choices=LINEAR_CHOICES,
                   help="kvbatch CPU kernel (default auto)")
    p.add_argument("--eot-requests", type=int, help="requests in the end-of-turn-honoured workload (default 256)")
    p.add_argument("--eot-max-tokens", type=int, help="token cap of an end-of-turn-honoured request (default 256)")
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or GGUF path")
    p.add_argument("--datasets", type=Path, default=default_datasets_dir(),
                   help="folder of the prompt sets (default ../shared/datasets from the repo root)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="kvbatch max_num_seqs (default 64)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="transformers attention")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads (default: the cores this process may use)")
    p.add_argument("--isa", choices=sorted(ISA_CAPS),
                   help="hold torch, MKL, oneDNN and kvbatch's C kernels to an older CPU's instruction set (avx2: "
                        "Haswell's and every AVX2 CPU's; avx512: Skylake-SP's, no bf16 or AMX), to run its code paths "
                        "here: the memory, caches and clocks stay this CPU's. llama.cpp is left out (its build is this "
                        "CPU's). The run restarts itself with the caps in its environment")
    p.add_argument("--json", type=Path, help="write every figure to this JSON file")
    p.add_argument("--step-profile", type=int, default=0, metavar="STEPS",
                   help="instead of the comparison: where a decode step's time goes, over STEPS steps at batch 1 "
                        "and at --max-num-seqs, per kvbatch variant (benchmarks/timing.py StepProfile)")
    args = p.parse_args(argv)
    quick = {"requests": 8, "max_tokens": 16, "hf_batch_size": 4, "b1_prompts": 2, "repeats": 1,
             "eot_requests": 16, "eot_max_tokens": 32}
    full = {"requests": 64, "max_tokens": 64, "hf_batch_size": 16, "b1_prompts": 4, "repeats": 3,
            "eot_requests": 256, "eot_max_tokens": 256}
    defaults = quick if args.quick else full
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.step_profile < 0:
        p.error("--step-profile must be >= 0")
    for key in ("requests", "max_tokens", "hf_batch_size", "b1_prompts", "repeats", "hf_repeats", "threads",
                "eot_requests", "eot_max_tokens"):
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
    cpu_model, flags = cpu_identity()
    simd = [f for f in SIMD_FLAGS if f in flags]
    log(f"CPU {cpu_model} [{' '.join(simd)}]; torch {torch.__version__}, {args.threads} threads; "
        f"model {args.model}; kvbatch variants {args.dtypes}")
    if isa_limits():
        log(f"instruction set capped: {isa_cap_text()}")
    bandwidth = stream_bandwidth_gbs()
    log(f"streaming-read bandwidth {bandwidth:.1f} GB/s")
    prompts = chat_workload(args.datasets, args.requests)
    gguf_path = resolve_model(args.model)
    with Stopwatch() as sw:
        ckpt = load_checkpoint(args.model)
    log(f"kvbatch checkpoint loaded in {sw.timed.wall_s:.1f}s")
    choices = [kernel_choice_at_load(ckpt, d, args.linear) for d in args.dtypes]
    for c in choices:
        log(f"kernel choice {c['variant']}, uncached: {c['source']} in {c['wall_s'] * 1e3:.0f} ms "
            f"({c['timed_calls']} timed calls) -> {'/'.join(c['kinds'])}")
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
            log(f"kvbatch {dtype} engine built and warmed up in {sw.timed.wall_s:.1f}s; projections "
                f"{llm.model.linear.kind} {llm.model.linear.bucket_kinds or ''} ({llm.model.kernel_choice.source}); "
                f"greedy LM head for batched rows: {batched_head_status(llm)}")
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

    # End-of-turn honoured: another, larger workload; requests finish when the model says so.
    eot_prompts = chat_workload(args.datasets, args.eot_requests, seed=1)
    eot_ids = [tokenizer.encode_chat(p.messages) for p in eot_prompts]
    eos_ids = sorted(next(iter(llms.values())).eos_token_ids)
    log(f"eot-honoured: {len(eot_ids)} requests, up to {args.eot_max_tokens} tokens, end-of-turn ids {eos_ids}")
    hf_eot = Row("transformers", "fp32", "eot-honoured")
    with Stopwatch() as sw:
        hf_tokens = 0
        for start in range(0, len(eot_ids), args.hf_batch_size):
            new, _ = hf.generate(eot_ids[start:start + args.hf_batch_size], args.eot_max_tokens, eos_ids)
            hf_tokens += sum(len(x) for x in new)
    hf_eot.samples_tokens_per_s.append(hf_tokens / sw.timed.wall_s)
    hf_eot.extra["runs"] = [{"wall_s": sw.timed.wall_s, "output_tokens": hf_tokens,
                             "cpu_utilization": sw.timed.utilization(args.threads)}]
    log(f"  transformers eot-honoured: {hf_tokens} tokens, {hf_tokens / sw.timed.wall_s:.1f} tok/s")
    kv_eot = {}
    for dtype in args.dtypes:
        llms[dtype] = llm = make_llm(ckpt, dtype, args)  # an empty prefix cache
        timed, results, stats = kvbatch_batched(llm, eot_ids, args.eot_max_tokens, honour_eos=True)
        tokens = sum(len(r.output_token_ids) for r in results)
        row = kv_eot[dtype] = Row("kvbatch", dtype, "eot-honoured", [tokens / timed.wall_s])
        row.extra["runs"] = [{"wall_s": timed.wall_s, "output_tokens": tokens,
                              "finished_on_eot": sum(r.finish_reason == "stop" for r in results),
                              "cpu_utilization": timed.utilization(args.threads), **stats}]
        log(f"  kvbatch {dtype} eot-honoured: {tokens} tokens, {tokens / timed.wall_s:.1f} tok/s, "
            f"{row.extra['runs'][0]['finished_on_eot']}/{len(results)} ended on end-of-turn")

    # Batch-1 decode: prompt by prompt, each engine in turn.
    hf_b1 = Row("transformers", "fp32", "batch-1")
    kv_b1 = {d: Row("kvbatch", d, "batch-1") for d in args.dtypes}
    b1_bandwidths = []  # GB/s just before each prompt's kvbatch runs: the floor beside them
    for k in range(args.b1_prompts):
        prompt = ids[k]
        with Stopwatch() as sw:
            _, ticks = hf.generate([prompt], args.max_tokens)
        hf_b1.samples_tokens_per_s.append((len(ticks) - 1) / (ticks[-1] - ticks[0]))
        hf_b1.extra.setdefault("runs", []).append({"prompt_tokens": len(prompt), "wall_s": sw.timed.wall_s,
                                                   "cpu_utilization": sw.timed.utilization(args.threads)})
        msg = [f"transformers {hf_b1.samples_tokens_per_s[-1]:.1f}"]
        b1_bandwidths.append(stream_bandwidth_gbs(repeats=3))
        for dtype in args.dtypes:
            with Stopwatch() as sw:
                (res,) = llms[dtype].generate(
                    [GenerationRequest(f"b1-{k}", greedy(args.max_tokens), prompt_token_ids=prompt)])
            kv_b1[dtype].samples_tokens_per_s.append(1.0 / res.tpot_s)
            kv_b1[dtype].extra.setdefault("runs", []).append(
                {"prompt_tokens": len(prompt), "wall_s": sw.timed.wall_s, "ttft_s": res.ttft_s,
                 "cpu_utilization": sw.timed.utilization(args.threads)})
            msg.append(f"kvbatch {dtype} {1.0 / res.tpot_s:.1f}")
        log(f"batch-1 prompt {k + 1}/{args.b1_prompts} ({len(prompt)} tokens, bandwidth beside it "
            f"{b1_bandwidths[-1]:.1f} GB/s): decode tok/s " + ", ".join(msg))

    cpp_b1 = None if args.isa else llama_cpp_batch1(gguf_path, ids[:args.b1_prompts], args.max_tokens, args.threads)
    if args.isa:
        log(f"llama.cpp left out: its build uses this CPU's whole instruction set, not --isa {args.isa}")
    if cpp_b1 is not None:
        log(f"llama.cpp batch-1: {cpp_b1.extra.get('failed') or f'{cpp_b1.tokens_per_s:.1f} tok/s'}")
    for dtype, row in kv_b1.items():
        row.extra.update(floor_share(row.samples_tokens_per_s, b1_bandwidths, decode_weight_bytes(llms[dtype])),
                         linear=f"{llms[dtype].model.linear.kind} {llms[dtype].model.linear.bucket_kinds or ''}".strip())
    rows = [hf_row, *kv_rows.values(), hf_eot, *kv_eot.values(), hf_b1, *kv_b1.values(),
            *([cpp_b1] if cpp_b1 is not None else [])]
    base = {"batched": hf_row.tokens_per_s, "batch-1": hf_b1.tokens_per_s, "eot-honoured": hf_eot.tokens_per_s}
    cpp_rate = cpp_b1.tokens_per_s if cpp_b1 is not None and "failed" not in cpp_b1.extra else None
    parity = {name: agreement(out, outputs["transformers"]) for name, out in outputs.items() if name != "transformers"}
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "machine": platform.machine(),
            "cpus_usable": len(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
            "model_path": gguf_path, "cpu_model": cpu_model, "cpu_simd_flags": simd, "cpu_flags": flags,
            "stream_bandwidth_gbs": bandwidth, "b1_bandwidths_gbs": b1_bandwidths, "kernel_choice_at_load": choices,
            "huge_pages": huge_pages_status(), "isa_limits": isa_limits(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "workload": wl,
        "rows": [
            {"engine": r.engine, "dtype": r.dtype, "mode": r.mode, "output_tokens_per_s": r.tokens_per_s,
             "samples_tokens_per_s": r.samples_tokens_per_s,
             "ratio_vs_transformers": r.tokens_per_s / base[r.mode],
             **dict(zip(("target", "meets_target"), row_target(r, base, cpp_rate))),
             **r.extra}
            for r in rows
        ],
        "parity_vs_transformers": parity,
    }


def isa_cap_text(limits: dict[str, str] | None = None, torch_capability: str | None = None) -> str:
    """The instruction-set caps of the run, and what they leave unchanged, in words."""
    limits = isa_limits() if limits is None else limits
    capability = torch_capability or torch.backends.cpu.get_cpu_capability()
    return (f"{', '.join(f'{k}={v}' for k, v in limits.items())} (torch reports {capability}); the memory, caches "
            f"and clocks are this CPU's, not an older one's")


def batched_head_status(llm: LLM) -> str:
    """Which LM head a batched greedy step runs, and the load-time timings that chose it
    (kernels/cpu/greedy_head.py)."""
    head = getattr(llm.model, "greedy_head", None)
    if head is None:
        return "the full head (no greedy screen for this model)"
    if head.batched is None:
        return ("the full head (the int8 screen lost its load-time measurement, or oneDNN's int8 linear is missing "
                "or not exact here)")
    screened, full = head.batched.timings_ms
    return (f"the int8 screen ({screened:.1f} ms against the fp32 head's {full:.1f} at "
            f"{greedy_head.MEASURE_ROWS} rows, measured at load)")


def huge_pages_status() -> str:
    """Where the engine's CPU models hold their projections and KV cache (kernels/cpu/huge_pages.py)."""
    if huge_pages_wanted("cpu"):
        return "in transparent huge pages (2 MiB)"
    reason = huge_pages.unavailable_reason()
    return f"in 4 KiB pages ({reason or 'KVBATCH_HUGE_PAGES=0'})"


def print_report(report: dict[str, Any]) -> None:
    cfg, wl, env = report["config"], report["workload"], report["environment"]
    print(f"\nkvbatch vs transformers generate — {cfg['model']}, {env['threads']} threads, "
          f"torch {env['torch']}, transformers {env['transformers']}")
    print(f"CPU: {env['cpu_model']}; SIMD flags: {' '.join(env['cpu_simd_flags']) or 'none of ' + ', '.join(SIMD_FLAGS)}; "
          f"streaming-read bandwidth {env['stream_bandwidth_gbs']:.1f} GB/s at the start, "
          f"{', '.join(f'{b:.1f}' for b in env.get('b1_bandwidths_gbs', []))} beside the batch-1 prompts")
    if env.get("isa_limits"):
        print(f"instruction set capped: {isa_cap_text(env['isa_limits'], env['torch_cpu_capability'])}")
    if "huge_pages" in env:  # (reports written before it was recorded lack it)
        print(f"kvbatch's projections and KV cache: {env['huge_pages']}")
    for c in env["kernel_choice_at_load"]:
        print(f"kernel choice at load ({c['variant']}, empty cache): {c['source']}, {c['wall_s'] * 1e3:.0f} ms, "
              f"{c['timed_calls']} timed calls -> per bucket (1, 2-8, 9-64, 65+ rows) {'/'.join(c['kinds'])}")
    print(f"workload: {wl['requests']} chat requests ({', '.join(f'{v} {k}' for k, v in wl['by_source'].items())}), "
          f"{wl['with_shared_system_prompt']} sharing a ~300-token system prompt; prompt tokens "
          f"{wl['prompt_tokens']} (min {wl['prompt_tokens_min']}, median {wl['prompt_tokens_median']:g}, "
          f"max {wl['prompt_tokens_max']}); {cfg['max_tokens']} greedy tokens each, EOS ignored")
    print(f"batched: output tokens / wall s incl. prefill (transformers: left-padded batches of {cfg['hf_batch_size']}, "
          f"{wl['hf_padded_prompt_tokens']} padded prompt tokens; kvbatch: all at once, max_num_seqs "
          f"{cfg['max_num_seqs']}). batch-1: decode tokens/s on {cfg['b1_prompts']} prompts, prefill excluded.")
    print(f"medians of {cfg['repeats']} kvbatch / {cfg['hf_repeats']} transformers batched runs, "
          f"{cfg['b1_prompts']} batch-1 prompts.\n")
    header = (f"{'engine':<13} {'dtype':<9} {'mode':<12} {'output tok/s':>12} {'vs transformers':>16} "
              f"{'target':>12}  {'result':<6} {'cpu':>5}  {'% of bandwidth floor':<22}")
    print(header)
    print("-" * len(header))
    busy: list[float] = []
    for r in report["rows"]:
        target = r["target"] or ""
        result = "" if r["meets_target"] is None else ("PASS" if r["meets_target"] else "MISS")
        runs = r.get("runs", [])
        cpu = statistics.median(run["cpu_utilization"] for run in runs) if runs else float("nan")
        if not math.isnan(cpu):  # llama.cpp's is not measured
            busy.append(cpu)
        floor = f"no figure: {r['failed']}" if "failed" in r else ""
        if "share_of_ceiling" in r:
            floor = (f"{r['share_of_ceiling']:.0%} (floor {r['floor_ms']:.1f} ms/token = {r['weight_bytes'] / 1e6:.0f} MB"
                     f" / {r['bandwidth_gbs']:.1f} GB/s, the median beside the prompts; {r['linear']})")
        print(f"{r['engine']:<13} {r['dtype']:<9} {r['mode']:<12} {r['output_tokens_per_s']:>12.1f} "
              f"{r['ratio_vs_transformers']:>15.2f}x {target:>12}  {result:<6} "
              f"{'' if math.isnan(cpu) else format(cpu, '.0%'):>5}  {floor}")  # blank: not measured (llama.cpp)
    print(f"\ntargets (issue 18): kvbatch over transformers fp32 in the same mode, both batched modes fp32 >= "
          f"{TARGETS['fp32', 'batched']:g}x and bf16 >= {TARGETS['bf16', 'batched']:g}x; batch-1 fp32 >= "
          f"{TARGETS['fp32', 'batch-1']:g}x and >= {FLOOR_TARGET:.0%} of the bandwidth floor; batch-1 "
          f"{INT8_VARIANT} at least llama.cpp's batch-1 tok/s (when it ran). cpu: process CPU time / (wall time x "
          "threads), median over runs.")
    if min(busy) < 0.8:
        print(f"note: cpu went down to {min(busy):.0%}: threads sat idle (single-threaded Python) or other work "
              "took the cores; if the latter, these figures are noisy (compare ratios, rerun when idle)")
    print()
    for name, agree in report["parity_vs_transformers"].items():
        diffs = agree["first_divergence_positions"]
        where = f"; the others first differ at token {sorted(diffs)}" if diffs else ""
        print(f"greedy agreement {name} vs transformers (batched): {agree['identical']}/{agree['total']} "
              f"outputs identical token for token{where}")


def run_step_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Per kvbatch variant, batch 1 and batch ``--max-num-seqs``: the decode step's wall time split
    by part (the engine's own functions, timed where they are called); printed as it goes."""
    torch.set_num_threads(args.threads)
    cpu_model, flags = cpu_identity()
    print(f"step profile — {args.model}, {args.threads} threads, torch {torch.__version__}; CPU: {cpu_model}; "
          f"SIMD flags: {' '.join(f for f in SIMD_FLAGS if f in flags)}")
    if isa_limits():
        print(f"instruction set capped: {isa_cap_text()}")
    ckpt = load_checkpoint(args.model)
    tokenizer = ChatTokenizer.from_checkpoint(ckpt)
    prompts = [tokenizer.encode_chat(p.messages) for p in chat_workload(args.datasets, args.max_num_seqs)]
    report: dict[str, Any] = {"cpu_model": cpu_model, "threads": args.threads, "steps": args.step_profile,
                              "profiles": []}
    for variant in args.dtypes:
        llm = make_llm(ckpt, variant, args)
        linear = f"{llm.model.linear.kind} {'/'.join(llm.model.linear.bucket_kinds)}".strip()
        for batch in dict.fromkeys((1, args.max_num_seqs)):
            ms, table = profile_decode_steps(llm, prompts[:batch], args.step_profile)
            print(f"\nkvbatch {variant}, batch {batch} ({linear}; {args.step_profile} decode steps): "
                  f"{ms:.1f} ms per step")
            for part, part_ms, share in table:
                print(f"  {part:<58} {part_ms:9.2f} ms {share:7.1%}")
            report["profiles"].append({"variant": variant, "batch": batch, "linear": linear, "step_ms": ms,
                                       "parts": [{"part": p, "ms": m, "share": f} for p, m, f in table]})
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isa:
        try:
            caps = isa_cap_environment(args.isa)
        except ValueError as exc:
            print(f"bench_engine.py: error: --isa {args.isa}: {exc}", file=sys.stderr)
            return 2
        if any(os.environ.get(k) != v for k, v in caps.items()):
            # torch, MKL and oneDNN read their caps when they load, which this process has done
            argv = sys.argv[1:] if argv is None else argv
            os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], {**os.environ, **caps})
    if args.step_profile:
        report = run_step_profile(args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        return 0
    report = run(args)
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
