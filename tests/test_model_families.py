"""The families declared in their own modules (Qwen3 dense, Phi-3/Phi-4) and FP8 block-scaled
checkpoints, against transformers on tiny seeded checkpoints made here."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.family import FAMILIES
from kvbatch.engine.models.rope import partial_rotary_rows
from kvbatch.engine.models.fp8 import dequantize_fp8_block
from kvbatch.engine.models.weights import ModelLoadError, load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from tests.logit_capture import assert_logits_match, capture_logits
from tests.kv_roundtrip import store_round_trip
from tests.tiny_models import VOCAB, edit_weights

torch.set_num_threads(1)

# qwen3: head_dim 24 apart from hidden / heads (16), q/k norms; phi3: fused projections and half the
# head turned by rotary; phi3_full: the whole head turned, tied embeddings.
FAMILY_ARCHS = ["qwen3", "phi3", "phi3_full"]


def _family_config(arch: str, vocab: int = VOCAB):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=24, rope_theta=10000.0, use_sliding_window=False,
                              tie_word_embeddings=False)
    if arch in ("phi3", "phi3_full"):
        factor = 0.5 if arch == "phi3" else 1.0
        return tf.Phi3Config(**common, sliding_window=None, tie_word_embeddings=arch == "phi3_full",
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": factor})
    raise ValueError(arch)


def build_tiny_family(arch: str, folder: Path, seed: int = 0, vocab: int = VOCAB):
    """Save a random model of ``arch`` into ``folder``; returns the transformers model (eval, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    cls = {"qwen3": tf.Qwen3ForCausalLM, "phi3": tf.Phi3ForCausalLM, "phi3_full": tf.Phi3ForCausalLM}[arch]
    model = cls(_family_config(arch, vocab)).eval()
    with torch.no_grad():  # norms away from 1, so a dropped or misplaced norm cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def _prompts(seed: int = 1) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate([5, 17, 9])}


def _greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _assert_parity(ref, folder: Path, label: str, budget: int = 4096) -> None:
    """Greedy tokens equal transformers' generate, and every logits row its forward within 1e-4."""
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget))
    seen = capture_logits(llm)
    prompts = _prompts()
    results = {r.request_id: r for r in llm.generate(
        [GenerationRequest(rid, _greedy(), prompt_token_ids=p) for rid, p in prompts.items()])}
    for rid, prompt in prompts.items():
        with torch.no_grad():
            hf_tokens = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
        assert results[rid].output_token_ids == hf_tokens, f"{label}: greedy tokens differ for {rid}"
        assert_logits_match(ref, seen, rid, prompt, results[rid].output_token_ids, label)


# ---------------------------------------------------------------- families


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
@pytest.mark.parametrize("budget", [4096, 7])  # 7: prompts are prefilled in several chunks
def test_logits_match_transformers(tmp_path, arch, budget):
    ref = build_tiny_family(arch, tmp_path)
    _assert_parity(ref, tmp_path, arch, budget)


def test_families_declare_their_differences():
    assert FAMILIES["qwen3"].qk_norm and FAMILIES["qwen3"].architecture == "Qwen3ForCausalLM"
    assert FAMILIES["phi3"].partial_rotary and FAMILIES["phi3"].convert_tensors is not None


def test_phi3_fused_projections_are_split_at_load(tmp_path):
    ref = build_tiny_family("phi3", tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    layer = ref.model.layers[0]
    q, k, v = layer.self_attn.qkv_proj.weight.split([64, 32, 32])
    gate, up = layer.mlp.gate_up_proj.weight.split([96, 96])
    for name, want in [("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                       ("mlp.gate_proj", gate), ("mlp.up_proj", up)]:
        assert torch.equal(ckpt.tensors[f"model.layers.0.{name}.weight"], want)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in ckpt.tensors)
    assert ModelConfig.from_hf(ckpt.config).rotary_dims == 8


def test_partial_rotary_order_pairs_the_turned_dims():
    order = partial_rotary_rows(16, 8).tolist()
    # pair (i, i + 8) of the reordered head is pair (i, i + 4) of the turned dims for i < 4
    assert [(order[i], order[i + 8]) for i in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert sorted(order) == list(range(16))


def test_hub_configs_of_the_families():
    qwen3_8b = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
                "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
                "attention_bias": False}
    c = ModelConfig.from_hf(qwen3_8b)
    assert c.qk_norm and c.head_dim == 128 and c.rotary_dims == 128
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        ModelConfig.from_hf(dict(qwen3_8b, attention_bias=True))
    phi4 = {"model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920,
            "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10, "rms_norm_eps": 1e-5,
            "rope_theta": 250000.0, "max_position_embeddings": 16384, "sliding_window": None,
            "tie_word_embeddings": False}
    assert ModelConfig.from_hf(phi4).rotary_dims == 128
    phi4_mini_like = dict(phi4, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
                          partial_rotary_factor=0.75)
    assert ModelConfig.from_hf(phi4_mini_like).rotary_dim == 96
    with pytest.raises(UnsupportedModelError, match="sliding-window"):  # Phi-3-mini-4k's 2047 of 4096
        ModelConfig.from_hf(dict(phi4, sliding_window=2047, max_position_embeddings=4096))
    # Phi-3-*-128k, Phi-4-mini: longrope with one factor per rotary pair (tests/test_longrope.py: parity)
    longrope = {"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}
    c = ModelConfig.from_hf(dict(phi4, rope_scaling=longrope, original_max_position_embeddings=4096,
                                 max_position_embeddings=131072))
    assert c.rope_scaling["original_max_position_embeddings"] == 4096 and c.rope_scaling["factor"] == 32.0
    with pytest.raises(UnsupportedModelError, match="longrope short_factor must list 64 numbers"):
        ModelConfig.from_hf(dict(phi4, rope_scaling=dict(longrope, short_factor=[1.0]),
                                 original_max_position_embeddings=4096))


def test_unknown_architecture_names_the_supported_list(tmp_path):
    build_tiny_family("qwen3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, architectures=["FalconForCausalLM"],
                                                           model_type="falcon")))
    with pytest.raises(ModelLoadError, match="'FalconForCausalLM'.*Gemma3ForCausalLM.*Phi3ForCausalLM.*Qwen3ForCausalLM") as info:
        load_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_decode_from_the_kv_store_equals_in_process_generate(tmp_path, arch):
    build_tiny_family(arch, tmp_path / "m")
    ckpt = load_checkpoint(str(tmp_path / "m"))
    cfg = dict(block_size=4, num_blocks=128, batch_invariant=True, max_num_seqs=8)
    trip = store_round_trip(ckpt, (tmp_path / "kv").as_uri(), VOCAB, **cfg)
    prompts, reference, requests, decoder = trip.prompts, trip.reference, trip.requests, trip.decoder
    assert trip.prefill.connector.stats.blocks_written > 0
    assert trip.decoded == reference
    assert decoder.connector.stats.blocks_loaded > 0
    assert decoder.stats["computed_prompt_tokens"] < sum(len(p) for p in prompts.values()) - 4 * 6
    # prefix caching inside one engine: the second pass over the same prompts reuses the system prompt
    again = LLM(ckpt, engine_config=EngineConfig(**cfg))
    first = {r.request_id: r.output_token_ids for r in again.generate(requests())}
    second = {r.request_id: r.output_token_ids for r in again.generate(requests())}
    assert first == second == reference


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_cli_generate_runs_each_family(tmp_path, arch, capsys):
    from kvbatch.cli.main import main
    from kvbatch.engine.text.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_model("smollm2-135m")
    folder = tmp_path / "m"
    build_tiny_family(arch, folder, vocab=tok.vocab_size)
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 5,
                      "temperature": 0}} for i, text in enumerate(["Hello there", "What is 2+2?"])]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["generate", "--model", str(folder), "--input", str(src), "--output", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["c0", "c1"]
    assert all(a["error"] is None and a["response"]["status_code"] == 200 for a in answers)


# ---------------------------------------------------------------- FP8 block-scaled checkpoints

FP8_BLOCK = [32, 40]  # 40 does not divide 64: the last block of a row is partial


def _quantize_blocks(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] as float8_e4m3fn with one fp32 scale per [bn, bk] block (amax / 448), the way
    the published FP8 checkpoints are made; returns (weight, weight_scale_inv)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    scales = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = part.abs().max().clamp(min=1e-12) / 448.0
            scales[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (part / s).to(torch.float8_e4m3fn)
    return q, scales


def _reference_dequant(q: torch.Tensor, scales: torch.Tensor, block: list[int]) -> torch.Tensor:
    bn, bk = block
    out = q.to(torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scales[i, j]
    return out


def _quantize_state(state: dict[str, torch.Tensor], block: list[int]) -> tuple[dict, dict]:
    """(the checkpoint as published, every projection FP8 with its ``_scale_inv``; the projections
    dequantized by the reference) for a state dict."""
    stored, dequantized = {}, {}
    for name, t in state.items():
        if name.endswith(("proj.weight", "proj_with_mqa.weight")):  # DeepSeek's kv_a_proj_with_mqa too
            q, s = _quantize_blocks(t.float(), block)
            stored[name], stored[name + "_scale_inv"] = q, s
            dequantized[name] = _reference_dequant(q, s, block)
        else:
            stored[name] = t
    return stored, dequantized


def build_fp8(arch: str, folder: Path, block: list[int] = FP8_BLOCK, method: str = "fp8"):
    """A tiny ``arch`` model with every projection stored as FP8 with per-block scales; returns the
    transformers model holding the dequantized fp32 weights (the reference) and the dequantized
    tensors by name."""
    ref = build_tiny_family(arch, folder)
    stored, dequantized = _quantize_state(load_file(folder / "model.safetensors"), block)
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": block}
    (folder / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        params = dict(ref.named_parameters())
        for name, w in dequantized.items():
            params[name].copy_(w)
    return ref, dequantized


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_fp8_checkpoint_equals_transformers_on_the_dequantized_weights(tmp_path, arch):
    ref, dequantized = build_fp8(arch, tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert not any(n.endswith("_scale_inv") for n in ckpt.tensors)
    if arch == "qwen3":  # phi3's fused projections are split after dequantization
        for name, want in dequantized.items():
            assert torch.equal(ckpt.tensors[name], want), name
    else:
        k = dequantized["model.layers.1.self_attn.qkv_proj.weight"].split([64, 32, 32])[1]
        assert torch.equal(ckpt.tensors["model.layers.1.self_attn.k_proj.weight"], k)
    assert all(t.dtype == torch.float32 for t in ckpt.tensors.values())
    _assert_parity(ref, tmp_path, f"{arch}-fp8")


def test_fp8_fingerprint_is_over_the_dequantized_weights(tmp_path):
    build_fp8("qwen3", tmp_path / "q")
    a, b = load_checkpoint(str(tmp_path / "q")), load_checkpoint(str(tmp_path / "q"))
    assert a.fingerprint == b.fingerprint  # stable across loads
    build_tiny_family("qwen3", tmp_path / "plain")
    assert load_checkpoint(str(tmp_path / "plain")).fingerprint != a.fingerprint  # other weights
    assert load_checkpoint(str(tmp_path / "q"), torch.bfloat16).fingerprint != a.fingerprint  # other dtype
    # one stored FP8 byte changed: another fingerprint
    state = load_file(tmp_path / "q" / "model.safetensors")
    w = state["model.layers.0.mlp.down_proj.weight"].view(torch.uint8).clone()
    w[0, 0] ^= 1
    state["model.layers.0.mlp.down_proj.weight"] = w.view(torch.float8_e4m3fn)
    save_file(state, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    assert load_checkpoint(str(tmp_path / "q")).fingerprint != a.fingerprint


def test_dequantize_fp8_block_matches_the_loop():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 50, generator=g)
    q, s = _quantize_blocks(w, [16, 32])
    assert torch.equal(dequantize_fp8_block(q, s, (16, 32)), _reference_dequant(q, s, [16, 32]))
    with pytest.raises(ValueError, match="expected"):
        dequantize_fp8_block(q, s[:, :1], (16, 32))


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_other_quantization_methods_are_refused_by_name(tmp_path, method):
    build_fp8("qwen3", tmp_path, method=method)
    with pytest.raises(ModelLoadError, match=f"unsupported quantization method '{method}'.*supported: fp8") as info:
        load_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)


def test_fp8_without_block_size_or_scales_is_refused(tmp_path):
    build_fp8("qwen3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "fp8"})))
    with pytest.raises(ModelLoadError, match="weight_block_size"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    edit_weights(tmp_path, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"))
    with pytest.raises(ModelLoadError, match="o_proj.weight has no .*_scale_inv"):
        load_checkpoint(str(tmp_path))


def test_fp8_moe_checkpoint_in_the_hub_layout(tmp_path):
    """Qwen3-*-FP8 and DeepSeek-V3 store each expert's matrices as FP8 with their own scales: they
    are dequantized before the experts are stacked, and the model equals transformers loaded from
    the same weights dequantized into an fp32 folder."""
    import transformers as tf

    from tests.tiny_models import build_tiny_moe

    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    build_tiny_moe("qwen3_moe", fp8)
    state = load_file(fp8 / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in state
    stored, dequantized = _quantize_state(state, FP8_BLOCK)
    dequantized = {**state, **dequantized}  # the fp32 folder: every other tensor as stored
    plain.mkdir()
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    (plain / "config.json").write_text((fp8 / "config.json").read_text())
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": FP8_BLOCK}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    a, b = load_checkpoint(str(fp8)), load_checkpoint(str(plain))
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    ref = tf.Qwen3MoeForCausalLM.from_pretrained(plain).eval()
    _assert_parity(ref, fp8, "qwen3_moe-fp8")


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_bf16_runs_and_mostly_agrees(tmp_path, arch):
    build_tiny_family(arch, tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    reqs = [GenerationRequest(rid, _greedy(4), prompt_token_ids=p) for rid, p in _prompts().items()]
    fp32 = [r.output_token_ids for r in LLM(ckpt).generate(reqs)]
    bf16 = [r.output_token_ids for r in LLM(ckpt, dtype="bf16").generate(reqs)]
    assert sum(a[0] == b[0] for a, b in zip(fp32, bf16)) >= 2
    assert all(0 <= t < VOCAB for out in bf16 for t in out)
