"""LongRoPE rope scaling (Phi-3-*-128k, Phi-3.5, Phi-4-mini) against transformers on a tiny seeded
Phi-3 checkpoint whose ``original_max_position_embeddings`` is 16, so test prompts cross it.

transformers picks the short or the long factors per forward call, by that call's largest
position; kvbatch picks them per position (``rope.cos_sin_table``). The two agree on every sequence of at most
``original`` tokens, and past it on transformers' model fed one token per call (each call's largest
position is then its own); they differ from transformers' generate past ``original``, which turns the
whole sequence with the long factors (a longer prompt in its one-call prefill; a shorter one by
dropping its cache and prefilling again when the sequence first passes ``original``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.rope import cos_sin_table, longrope_attention_factor
from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.kv_roundtrip import store_round_trip
from tests.logit_capture import assert_logits_match, capture_logits
from tests.tiny_models import VOCAB

torch.set_num_threads(1)

ORIGINAL = 16
SHORT = [1.0, 1.3, 1.9, 2.6]  # one per rotary pair: head_dim 16, half of it turned
LONG = [2.0, 3.5, 5.0, 7.5]


def _config(rotary: float = 0.5, attention_factor: float | None = None):
    import transformers as tf

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": rotary,
            "short_factor": SHORT if rotary == 0.5 else SHORT * 2, "long_factor": LONG if rotary == 0.5 else LONG * 2}
    if attention_factor is not None:
        rope["attention_factor"] = attention_factor
    return tf.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         original_max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, sliding_window=None, tie_word_embeddings=False,
                         rope_parameters=rope)


def build_longrope(folder: Path, seed: int = 0, **kw):
    """Save a random longrope Phi-3 into ``folder``; returns the transformers model (eval, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Phi3ForCausalLM(_config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def _prompts(lengths: list[int], seed: int = 1) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate(lengths)}


def _run(folder: Path, prompts: dict[str, list[int]], max_tokens: int, budget: int = 4096):
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget))
    seen = capture_logits(llm)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = {r.request_id: r.output_token_ids
           for r in llm.generate([GenerationRequest(rid, greedy, prompt_token_ids=p) for rid, p in prompts.items()])}
    return out, seen


def _stepwise_logits(ref, tokens: list[int]) -> torch.Tensor:
    """transformers' logits over ``tokens`` fed one per forward call through its KV cache: each call's
    largest position is its own, so every position gets the factors of its side of ``original``."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=ref.config), []
    with torch.no_grad():
        for t in tokens:
            rows.append(ref(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(rows)


def test_table_equals_transformers_rotary_embedding():
    """cos/sin of the turned pairs equal transformers' Phi3RotaryEmbedding (a one-position call per
    side of ``original``, attention factor included) bit for bit; pass-through pairs stay (1, 0)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cfg = _config()
    c = ModelConfig.from_hf(cfg.to_dict())
    table = cos_sin_table(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings, c.rotary_dim)
    emb = Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    for pos in (0, 5, ORIGINAL - 1, ORIGINAL, 200):
        cos, sin = emb(x, torch.tensor([[pos]]))
        assert torch.equal(table[pos, :4], cos[0, 0, :4]), pos
        assert torch.equal(table[pos, 8:12], sin[0, 0, :4]), pos
    assert torch.equal(table[:, 4:8], torch.ones(256, 4)) and torch.equal(table[:, 12:], torch.zeros(256, 4))
    # factor 256 / 16: sqrt(1 + ln 16 / ln 16), from the config, so a shorter table has the same rows
    assert longrope_attention_factor(c.rope_scaling, 256) == pytest.approx(2 ** 0.5)
    short_table = cos_sin_table(c.head_dim, c.rope_theta, c.rope_scaling, 64, c.rotary_dim)
    assert torch.equal(short_table, table[:64])
    assert emb.attention_scaling == pytest.approx(2 ** 0.5)


@pytest.mark.parametrize("budget", [4096, 7])  # 7: prompts prefilled in several chunks
def test_short_sequences_match_transformers(tmp_path, budget):
    """Prompt and output within ``original``: the short factors throughout, as transformers."""
    ref = build_longrope(tmp_path)
    prompts = _prompts([5, 10, 9])
    out, seen = _run(tmp_path, prompts, max_tokens=6, budget=budget)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            hf = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out[rid] == hf[0, len(prompt):].tolist(), rid
        assert_logits_match(ref, seen, rid, prompt, out[rid], "longrope-short")


def test_generation_crossing_original(tmp_path):
    """A prompt of at most ``original`` tokens whose output runs past it: every logits row equals
    transformers fed one token per call (within 1e-4, greedy tokens equal), so equals transformers'
    generate up to ``original``; from there generate re-prefills the whole sequence with the long
    factors (Phi3ForCausalLM.prepare_inputs_for_generation drops its cache) and differs."""
    ref = build_longrope(tmp_path)
    prompts = _prompts([12, 16, 7], seed=2)
    out, seen = _run(tmp_path, prompts, max_tokens=14)
    for rid, prompt in prompts.items():
        want = _stepwise_logits(ref, prompt + out[rid])[len(prompt) - 1:-1]
        got = torch.stack([row for r, row in seen if r == rid])
        assert out[rid] == want.argmax(-1).tolist(), rid
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            hf = ref.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
        gen = torch.cat(hf.logits)
        short_rows = ORIGINAL - len(prompt) + 1  # rows predicting a position below ``original``
        torch.testing.assert_close(got[:short_rows], gen[:short_rows], atol=1e-4, rtol=1e-4)
        assert (got[short_rows] - gen[short_rows]).abs().max() > 1e-3  # generate switched to long keys


@pytest.mark.parametrize("budget", [4096, 7])
def test_longer_prompt_is_keyed_by_position(tmp_path, budget):
    """A prompt longer than ``original``: kvbatch equals transformers fed one token per call, in one
    prefill and in chunks; transformers' one-call prefill (long factors at every position) differs."""
    ref = build_longrope(tmp_path)
    prompts = _prompts([21, 30], seed=3)
    out, seen = _run(tmp_path, prompts, max_tokens=5, budget=budget)
    for rid, prompt in prompts.items():
        want = _stepwise_logits(ref, prompt + out[rid])[len(prompt) - 1:-1]
        got = torch.stack([row for r, row in seen if r == rid])
        assert out[rid] == want.argmax(-1).tolist(), rid
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            one_call = ref(torch.tensor([prompt])).logits[0, -1]
        assert (one_call - got[0]).abs().max() > 1e-3  # the documented difference is real


def test_decode_from_the_kv_store_equals_in_process_generate(tmp_path):
    """Prompts of 29-35 tokens (past ``original``) through the KV store, in batch-invariant mode."""
    build_longrope(tmp_path / "m")
    ckpt = load_checkpoint(str(tmp_path / "m"))
    trip = store_round_trip(ckpt, (tmp_path / "kv").as_uri(), VOCAB, block_size=4, num_blocks=128,
                            batch_invariant=True, max_num_seqs=8)
    assert trip.decoder.connector.stats.blocks_loaded > 0
    assert trip.decoded == trip.reference


def test_hub_config_spellings_and_bad_factors():
    """Phi-3.5-mini's config.json: ``rope_scaling: {type: longrope, ...}`` and
    ``original_max_position_embeddings`` beside it; a stated ``attention_factor`` wins."""
    hub = {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
           "sliding_window": 262144, "tie_word_embeddings": False,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48}}
    c = ModelConfig.from_hf(hub)
    assert c.rope_scaling["original_max_position_embeddings"] == 4096
    assert longrope_attention_factor(c.rope_scaling, c.max_position_embeddings) == pytest.approx(
        (1 + torch.log(torch.tensor(32.0)).item() / torch.log(torch.tensor(4096.0)).item()) ** 0.5)
    stated = dict(hub, rope_scaling=dict(hub["rope_scaling"], attention_factor=1.25))
    assert longrope_attention_factor(ModelConfig.from_hf(stated).rope_scaling, 131072) == 1.25
    # Phi-4-mini: partial rotary 0.75 of 128 dims, 48 pairs
    mini = dict(hub, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75)
    assert ModelConfig.from_hf(mini).rotary_dim == 96
    with pytest.raises(UnsupportedModelError, match="short_factor must list 48 numbers"):
        ModelConfig.from_hf(dict(hub, rope_scaling=dict(hub["rope_scaling"], short_factor=[1.0] * 47)))
    with pytest.raises(UnsupportedModelError, match="without original_max_position_embeddings"):
        ModelConfig.from_hf({k: v for k, v in hub.items() if k != "original_max_position_embeddings"})


def test_saved_checkpoint_config_loads(tmp_path):
    """transformers 5 writes the scaling into ``rope_parameters``: read from there."""
    build_longrope(tmp_path, attention_factor=1.1, rotary=1.0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in cfg
    c = ModelConfig.from_hf(cfg)
    assert c.rope_scaling["rope_type"] == "longrope" and c.rotary_dim == 0
    table = cos_sin_table(c.head_dim, c.rope_theta, c.rope_scaling, 256)
    assert table[0, 0] == pytest.approx(1.1)  # cos 0 times the stated attention factor
