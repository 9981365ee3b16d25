"""The engine end to end on the Triton kernels (in the interpreter, on the CPU) with the CUDA
code path's weight layout (plain ``[out, in]`` weights, ``F.linear``): tiny Llama, Mixtral and
DeepSeek-V3 models give transformers' logits at every step, and the same greedy tokens as the
reference kernels, with and without the speculative verifier."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.kernels import dispatch
from tests.logit_capture import assert_logits_match, capture_logits
from tests.tiny_deepseek import build_tiny_deepseek
from tests.tiny_models import VOCAB, build_tiny, build_tiny_moe
from tests.triton_interpreter import interpreter_only

pytestmark = [pytest.mark.slow, interpreter_only("benchmarks/gpu_check.py --smoke (tests/test_gpu_check.py)")]

BUILDERS = {"llama": lambda folder: build_tiny("llama", folder),
            "mixtral": lambda folder: build_tiny_moe("mixtral", folder),
            "deepseek_v3": lambda folder: build_tiny_deepseek(folder)}


def _prompts(n: tuple[int, ...] = (4, 7)) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    return {f"r{i}": torch.randint(3, VOCAB, (k,), generator=g).tolist() for i, k in enumerate(n)}


def _requests(prompts: dict[str, list[int]], tokens: int) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [GenerationRequest(rid, params, prompt_token_ids=p) for rid, p in prompts.items()]


def _engine(folder, monkeypatch, kernels: str, **kw) -> LLM:
    monkeypatch.setenv("KVBATCH_KERNELS", kernels)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_LINEAR", "cublas")
    return LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=48, max_num_batched_tokens=7,
                                                       device="cpu"), **kw)


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_engine_on_triton_kernels_matches_transformers(tmp_path, monkeypatch, arch):
    """Chunked prefill (budget 7) next to decode rows, then decode: every logits row equals
    transformers' within 1e-4, and the greedy tokens equal the reference kernels'."""
    ref = BUILDERS[arch](tmp_path)
    prompts = _prompts()
    llm = _engine(tmp_path, monkeypatch, "triton")
    seen = capture_logits(llm)
    kernels = dispatch._triton_kernels()
    calls = {"silu_and_mul": 0, "rms_norm": 0, "prefill_attention": 0}

    def counted(name):
        kernel = getattr(kernels, name)

        def spy(*args, **kw):
            calls[name] += 1
            return kernel(*args, **kw)
        return spy

    for name in calls:  # the MLP activation, the residual joins and prefill run as Triton kernels
        monkeypatch.setattr(kernels, name, counted(name))
    got = {r.request_id: r.output_token_ids for r in llm.generate(_requests(prompts, 2))}
    for rid, prompt in prompts.items():
        assert_logits_match(ref, seen, rid, prompt, got[rid], arch)
    # Chunked prefill through the Triton prefill kernel: DeepSeek-V3's MLA prefill runs on it too.
    assert calls["rms_norm"] > 0 and calls["prefill_attention"] > 0
    # Mixtral's MLPs are all routed experts (fused_moe applies its own activation); the dense
    # Llama MLP and DeepSeek's dense layer and shared experts go through silu_and_mul.
    assert (calls["silu_and_mul"] > 0) == (arch != "mixtral"), calls
    want = {r.request_id: r.output_token_ids
            for r in _engine(tmp_path, monkeypatch, "reference").generate(_requests(prompts, 2))}
    assert got == want


def test_speculative_verifier_on_triton_kernels_keeps_greedy_tokens(tmp_path, monkeypatch):
    """n-gram drafts verified by multi-token passes through the Triton prefill kernel: the tokens
    are those of plain decoding on the reference kernels, and drafts were really verified."""
    build_tiny("llama", tmp_path)
    # A repeating prompt, so the n-gram drafter finds something to propose.
    prompts = {"rep": [5, 6, 7, 8] * 3, "other": [9, 10, 11, 12, 9, 10]}
    spec = _engine(tmp_path, monkeypatch, "triton", speculative=SpecConfig("ngram", max_len=3, adaptive=False))
    got = {r.request_id: r.output_token_ids for r in spec.generate(_requests(prompts, 4))}
    plain = _engine(tmp_path, monkeypatch, "reference")
    want = {r.request_id: r.output_token_ids for r in plain.generate(_requests(prompts, 4))}
    assert got == want
    assert spec.stats["spec_draft_tokens"] > 0
