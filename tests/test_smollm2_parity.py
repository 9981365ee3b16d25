"""Correctness on the real default model, SmolLM2-135M-Instruct (dequantized from its GGUF).

1. fp32 greedy parity with transformers on the same weights: token for token on 16 chat
   prompts x 64 tokens, where a difference is allowed only at a near-tie; per-step logits agree.
2. Batch invariance: the same greedy tokens alone and inside a batch of 32 mixed-length
   requests, with the default engine config and with ``batch_invariant=True``.
3. bf16 against fp32: a documented loose tolerance.

The figures go to stdout (``pytest -s``) and to ``smollm2_parity.json`` in pytest's base temp
directory. Cost: ~240 CPU-seconds (measured single-threaded: 303 s wall on a busy 2-core host;
two OpenMP threads on a host that busy took 15 minutes, so prefer OMP_NUM_THREADS=1 there).
"""

from __future__ import annotations

import gc
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"  # the prompt sets, beside the repo
PAD = 2  # <|im_end|>, SmolLM2's EOS and PAD
NEW_TOKENS = 64
NEAR_TIE = 1e-3  # a greedy choice this close may go either way between two fp32 engines
MAX_LOGIT_DIFF = 1e-3

# Short and long first turns (prompt lengths with the default system prompt: 34..446 tokens).
PARITY_MT_BENCH = (81, 104, 90, 105, 120, 124, 133, 144)
PARITY_SHAREGPT = ("fzcoUcK_0", "mv9l4vA_0", "l4MsKo7_0", "GpZfkFE_0", "1LtlS83_0", "5ZTmGcy_0", "D383thR_0",
                   "zAbRguB_0")
# The batch of 32 (34..245 tokens): short enough that batch_invariant=True prefill stays cheap
# (its attention pads every sequence of a step to the step's longest chunk and context), long
# enough that five requests cross position 256 while decoding (its tile size), so the
# multi-tile path runs too.
INVARIANCE_MT_BENCH = (81, 104, 90, 105, 120, 124, 144, 85, 97, 110, 113, 131, 151, 160, 132, 134)
INVARIANCE_SHAREGPT = ("fzcoUcK_0", "mv9l4vA_0", "GpZfkFE_0", "1LtlS83_0", "5ZTmGcy_0", "zAbRguB_0", "Uxnccdl_0",
                       "z9VxpVu_0", "tipbjpG_0", "BZ45pni_0", "NHOvp4w_0", "d05inuw_0", "7zR6M3E_0", "lygk1QO_0",
                       "c24AV7u_0", "A9VfOAM_0")
INVARIANCE_TOKENS = 32

FIGURES: dict = {}


def _first_turns() -> tuple[dict[int, str], dict[str, str]]:
    mt_bench = {}
    with open(DATASETS / "mt_bench/question.jsonl") as f:
        for line in f:
            q = json.loads(line)
            mt_bench[q["question_id"]] = q["turns"][0]
    with open(DATASETS / "sharegpt_500/ShareGPT_V3_filtered_500.json") as f:
        sharegpt = {c["id"]: c["conversations"][0]["value"] for c in json.load(f)}
    return mt_bench, sharegpt


def _chats(mt_ids, sg_ids) -> list[list[dict]]:
    mt_bench, sharegpt = _first_turns()
    texts = [mt_bench[i] for i in mt_ids] + [sharegpt[i] for i in sg_ids]
    return [[{"role": "user", "content": t}] for t in texts]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@contextmanager
def _captured_logits(llm: LLM) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Every sampled row's logits, per request id, in step order (a spy on the runner)."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    execute = llm.runner.execute

    def spy(step):
        logits, sampled = execute(step)
        for row, s in enumerate(sampled):
            seen[s.seq.request_id].append(logits[row].clone())
        return logits, sampled

    llm.runner.execute = spy
    try:
        yield seen
    finally:
        llm.runner.execute = execute


class _Clock:
    """Wall and process-CPU seconds of a block (CPU time is steadier on a busy host at one thread)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> "_Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        FIGURES.setdefault("timings", {})[self.name] = {
            "wall_s": round(time.perf_counter() - self.wall, 1), "cpu_s": round(time.process_time() - self.cpu, 1)}


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _margin(logits: torch.Tensor) -> tuple[float, list[int]]:
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


@pytest.fixture(scope="module", autouse=True)
def _write_figures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    path = tmp_path_factory.getbasetemp() / "smollm2_parity.json"
    path.write_text(json.dumps(FIGURES, indent=2))
    print(f"\nsmollm2 parity figures -> {path}\n{json.dumps({k: v for k, v in FIGURES.items() if k != 'per_prompt'})}")


@pytest.fixture(scope="module")
def parity_prompts(smollm2_llm: LLM) -> list[list[int]]:
    return [smollm2_llm.tokenizer.encode_chat(c) for c in _chats(PARITY_MT_BENCH, PARITY_SHAREGPT)]


@pytest.fixture(scope="module")
def kv_fp32(smollm2_llm: LLM, parity_prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """kvbatch's greedy tokens and per-step logits [64, V] for the 16 prompts, in one batch."""
    reqs = [GenerationRequest(f"p{i}", _greedy(NEW_TOKENS), prompt_token_ids=p) for i, p in enumerate(parity_prompts)]
    with _Clock("kvbatch_fp32_generate"), _captured_logits(smollm2_llm) as seen:
        results = smollm2_llm.generate(reqs)
    tokens = [r.output_token_ids for r in results]
    logits = [torch.stack(seen[r.request_id]) for r in reqs]
    assert all(len(t) == NEW_TOKENS and len(l) == NEW_TOKENS for t, l in zip(tokens, logits))
    return tokens, logits


@pytest.fixture(scope="module")
def hf_fp32(smollm2_hf, parity_prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens and raw per-step logits, left-padded batches of 8 by length.

    No ``min_new_tokens``: transformers implements it by masking EOS, which changes the argmax
    wherever the model wants to end its turn. kvbatch's ``ignore_eos`` keeps EOS choosable and
    just goes on, so transformers gets ``eos_token_id=None`` instead (never stops, masks nothing).
    """
    n = len(parity_prompts)
    order = sorted(range(n), key=lambda i: len(parity_prompts[i]))
    tokens: list[list[int]] = [[] for _ in range(n)]
    logits: list[torch.Tensor] = [torch.empty(0)] * n
    with _Clock("transformers_fp32_generate"):
        for start in range(0, n, 8):
            group = order[start:start + 8]
            width = max(len(parity_prompts[i]) for i in group)
            ids = torch.tensor([[PAD] * (width - len(parity_prompts[i])) + parity_prompts[i] for i in group])
            mask = torch.tensor([[0] * (width - len(parity_prompts[i])) + [1] * len(parity_prompts[i]) for i in group])
            with torch.inference_mode():
                out = smollm2_hf.generate(
                    input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                    eos_token_id=None, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
            steps = torch.stack(out.logits, 1).float()  # raw logits, before any processor
            for row, i in enumerate(group):
                tokens[i] = out.sequences[row, width:].tolist()
                logits[i] = steps[row].clone()
    assert all(len(t) == NEW_TOKENS for t in tokens), "transformers stopped early"
    return tokens, logits


# ------------------------------------------------------------------------------- 1. fp32 parity


def test_fp32_greedy_matches_transformers(kv_fp32, hf_fp32, parity_prompts) -> None:
    kv_tokens, kv_logits = kv_fp32
    hf_tokens, hf_logits = hf_fp32
    per_prompt, max_diff, problems = [], 0.0, []
    for i, (kt, ht) in enumerate(zip(kv_tokens, hf_tokens)):
        k = _first_divergence(kt, ht)
        upto = NEW_TOKENS if k is None else k + 1  # the logits at the divergence share their prefix too
        diff = float((kv_logits[i][:upto] - hf_logits[i][:upto]).abs().max())
        max_diff = max(max_diff, diff)
        entry = {"prompt_tokens": len(parity_prompts[i]), "first_divergence": k, "max_abs_logit_diff": diff}
        if k is not None:
            (kv_gap, kv_top), (hf_gap, hf_top) = _margin(kv_logits[i][k]), _margin(hf_logits[i][k])
            entry.update(kvbatch_top2=kv_top, kvbatch_margin=kv_gap, transformers_top2=hf_top,
                         transformers_margin=hf_gap)
            if not (kv_gap < NEAR_TIE and hf_gap < NEAR_TIE and set(kv_top) == set(hf_top)):
                problems.append(f"prompt {i}: diverges at step {k} without a near-tie: {entry}")
        per_prompt.append(entry)
    identical = sum(e["first_divergence"] is None for e in per_prompt)
    FIGURES["fp32_parity"] = {"identical": identical, "prompts": len(per_prompt), "tokens_each": NEW_TOKENS,
                              "max_abs_logit_diff_on_matching_prefix": max_diff}
    FIGURES["per_prompt"] = per_prompt
    print(f"\nfp32 parity: {identical}/{len(per_prompt)} identical over {NEW_TOKENS} tokens; "
          f"max |logit diff| on matching prefixes {max_diff:.2e}")
    for e in per_prompt:
        if e["first_divergence"] is not None:
            print(f"  divergence: {e}")
    assert not problems, "\n".join(problems)
    assert identical >= len(per_prompt) - 1, per_prompt
    assert max_diff < MAX_LOGIT_DIFF, per_prompt


# ------------------------------------------------------------------------------- 2. batch invariance


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_greedy_tokens_same_alone_and_in_a_batch_of_32(smollm2_checkpoint, batch_invariant: bool) -> None:
    # Prefix caching off: an "alone" run must not reuse KV that the batched run computed, or
    # the reverse, or the comparison would be partly with itself.
    llm = LLM(smollm2_checkpoint, engine_config=EngineConfig(
        enable_prefix_caching=False, batch_invariant=batch_invariant, kv_cache_bytes=512 << 20))
    chats = _chats(INVARIANCE_MT_BENCH, INVARIANCE_SHAREGPT)
    prompts = [llm.tokenizer.encode_chat(c) for c in chats]
    # Shortest first (3,689 prompt tokens): the first 2048-token step prefills the 24 shortest
    # and chunks of two more, the second prefills the rest beside 24 decodes, then all 32
    # decode together. (The order matters only for cost: with batch_invariant=True, a
    # long chunk in a step with many decodes pads every one of them to its length.)
    prompts.sort(key=len)
    reqs = [GenerationRequest(f"r{i}", _greedy(INVARIANCE_TOKENS), prompt_token_ids=p) for i, p in enumerate(prompts)]
    name = "batch_invariant" if batch_invariant else "default"
    with _Clock(f"invariance_{name}_alone"):
        alone = [llm.generate([r])[0].output_token_ids for r in reqs]
    steps_before = llm.stats["steps"]
    with _Clock(f"invariance_{name}_batch32"):
        batched_results = llm.generate(reqs)
    batched = [r.output_token_ids for r in batched_results]
    batch_steps = llm.stats["steps"] - steps_before
    same = sum(a == b for a, b in zip(alone, batched))
    differing = {i: _first_divergence(a, b) for i, (a, b) in enumerate(zip(alone, batched)) if a != b}
    FIGURES.setdefault("batch_invariance", {})[name] = {
        "same": same, "requests": len(reqs), "fraction": same / len(reqs), "tokens_each": INVARIANCE_TOKENS,
        "batched_run_steps": batch_steps, "preemptions": sum(r.num_preemptions for r in batched_results), "first_divergence_by_request": differing,
        "prompt_tokens_min_max": [min(map(len, prompts)), max(map(len, prompts))]}
    print(f"\nbatch invariance ({name}): {same}/{len(reqs)} = {same / len(reqs):.3f} requests identical alone vs "
          f"in a batch of {len(reqs)} ({batch_steps} steps); first divergences {differing}")
    assert batch_steps < 2 * INVARIANCE_TOKENS, "the 32 requests did not share steps"
    if batch_invariant:
        assert same == len(reqs), differing
    else:
        assert same >= len(reqs) - 1, differing
    del llm
    gc.collect()


# ------------------------------------------------------------------------------- 3. bf16 tolerance

# The bf16 parity tolerance. bf16 rounds the weights and every activation (8 significant bits),
# so greedy paths part from fp32 at the first close call, sometimes at the first token.
# Observed (2-core Zen 4, torch 2.13 CPU, 1 or 2 threads, 16 prompts x 64 tokens): 3/16
# identical; matching leading tokens [0, 4, 11, 20, 14, 3, 0, 32, 64, 37, 64, 26, 16, 63, 9, 64],
# mean 26.7; first 4 match for 13/16, first 8 for 12/16; first-step |logit diff| max 0.53,
# mean 0.094; fp32's own top-2 margin where bf16 turns away is 0.007..0.21.
BF16_LEADING = 4  # the first 4 tokens match fp32 ...
BF16_MIN_PROMPTS = 10  # ... for at least 10 of the 16 prompts,
BF16_MIN_MEAN_LEADING = 12  # on average the first 12 tokens match,
BF16_MAX_FLIPPED_MARGIN = 0.5  # and bf16 turns away only where fp32's top-2 margin is under 0.5.


def test_bf16_stays_close_to_fp32(smollm2_checkpoint, kv_fp32, parity_prompts) -> None:
    fp32_tokens, fp32_logits = kv_fp32
    llm = LLM(smollm2_checkpoint, dtype="bf16", engine_config=EngineConfig(kv_cache_bytes=256 << 20))
    reqs = [GenerationRequest(f"b{i}", _greedy(NEW_TOKENS), prompt_token_ids=p) for i, p in enumerate(parity_prompts)]
    with _Clock("kvbatch_bf16_generate"), _captured_logits(llm) as seen:
        bf16_tokens = [r.output_token_ids for r in llm.generate(reqs)]
    # The first step sees the same prompt in both dtypes: how far apart are the logits there?
    first = [(seen[r.request_id][0] - fp32_logits[i][0]).abs() for i, r in enumerate(reqs)]
    del seen
    leading = [NEW_TOKENS if (k := _first_divergence(a, b)) is None else k for a, b in zip(bf16_tokens, fp32_tokens)]
    # How close a call fp32 itself had where bf16 went another way (for the report).
    fp32_margins = [round(_margin(fp32_logits[i][k])[0], 4) for i, k in enumerate(leading) if k < NEW_TOKENS]
    identical = sum(n == NEW_TOKENS for n in leading)
    ok = sum(n >= BF16_LEADING for n in leading)
    mean = sum(leading) / len(leading)
    FIGURES["bf16_vs_fp32"] = {
        "identical": identical, "prompts": len(leading), "tokens_each": NEW_TOKENS,
        "mean_matching_leading_tokens": mean, "matching_leading_tokens": leading,
        f"first_{BF16_LEADING}_match": ok, "first_8_match": sum(n >= 8 for n in leading),
        "first_step_max_abs_logit_diff": max(float(d.max()) for d in first),
        "first_step_mean_abs_logit_diff": sum(float(d.mean()) for d in first) / len(first),
        "fp32_top2_margin_where_bf16_diverges": fp32_margins}
    print(f"\nbf16 vs fp32: {identical}/{len(leading)} identical over {NEW_TOKENS} tokens; mean matching leading "
          f"tokens {mean:.1f}; first {BF16_LEADING} match for {ok}/{len(leading)}; per prompt {leading}; first-step "
          f"|logit diff| max {FIGURES['bf16_vs_fp32']['first_step_max_abs_logit_diff']:.3f} mean "
          f"{FIGURES['bf16_vs_fp32']['first_step_mean_abs_logit_diff']:.4f}; fp32 top-2 margins where bf16 diverges "
          f"{fp32_margins}")
    assert ok >= BF16_MIN_PROMPTS, leading
    assert mean >= BF16_MIN_MEAN_LEADING, leading
    assert max(fp32_margins, default=0.0) < BF16_MAX_FLIPPED_MARGIN, fp32_margins
    del llm
    gc.collect()
