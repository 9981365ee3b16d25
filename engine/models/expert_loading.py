"""An HF checkpoint loaded with only some experts of each MoE layer (an expert-parallel rank's
share, :func:`load_expert_share`): every other expert is read once, for the
fingerprint, and dropped, so resident memory follows the experts kept. Families that convert
their experts at load (gpt-oss: transposed, gate and up de-interleaved, MXFP4 dequantized) convert
one expert at a time, as a whole load would convert it (:func:`_load_converted_share`); a remote
folder is read whole and then cut (:func:`keep_experts`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvbatch.engine.models.errors import ModelLoadError
from kvbatch.engine.models.family import FAMILIES
from kvbatch.engine.models.weights import (
    _EXPERT_PART,
    _MIXTRAL_BLOCK_RE,
    _PER_EXPERT_RE,
    Checkpoint,
    _check_tensors,
    _fingerprint_of,
    _hf_tokenizer_source,
    _join,
    _normalize_hf_config,
    _open_location,
    _reason,
    _safetensors_files,
    load_checkpoint,
    resolve_model,
)

if TYPE_CHECKING:
    import torch

# A fused expert tensor of the final (in-memory) layout and where each expert's rows come from:
# expert j -> [(shard, source tensor name, row of that tensor or None for all of it), ...], in the
# byte order of the fused tensor (gate then up for gate_up; a per-expert matrix or one row of
# an already-fused one).
_ExpertSources = dict[int, list[tuple[str, str, int | None]]]
_FUSED_RE = re.compile(r"^(model\.layers\.(\d+))\.mlp\.experts\.(gate_up_proj|down_proj)$")


def load_expert_share(model: str, experts: Mapping[int, Sequence[int]], dtype: torch.dtype | None = None) -> Checkpoint:
    """:func:`~kvbatch.engine.models.weights.load_checkpoint` of an HF folder keeping only some
    experts: ``experts`` maps a layer index to the logical experts to keep; every other expert's
    weights are read once (for the fingerprint, one expert at a time, through safetensors
    slices) and dropped, so resident memory follows the experts kept. ``dtype`` defaults to
    float32."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    source = resolve_model(model)
    fs, path = _open_location(source)
    if fs.isfile(path):
        raise ModelLoadError(f"{source}: loading only some experts needs an HF folder (GGUF models have none)")
    return _load_hf_experts(fs, path, source, dtype, {int(k): sorted(set(map(int, v))) for k, v in experts.items()})


def _load_hf_experts(fs: fsspec.AbstractFileSystem, path: str, source: str, dtype: torch.dtype,
                     keep: dict[int, list[int]]) -> Checkpoint:
    """:func:`load_expert_share` once the folder is found.

    The fingerprint is computed as for a whole load, over the same names, shapes and bytes in
    the same order, streaming each expert's bytes (cast to ``dtype``) through the hash, so every
    rank and a single process agree on the cache keys."""
    import torch

    if isinstance(fs, LocalFileSystem) and fs.exists(_join(path, "config.json")):
        try:
            raw = json.loads(fs.cat_file(_join(path, "config.json")))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raw = None  # reported below
        family = FAMILIES.get(raw.get("model_type")) if isinstance(raw, dict) else None
        if family is not None and family.moe is not None:  # gpt-oss: experts converted (MXFP4 too) one by one
            return _load_converted_share(fs, path, source, dtype, keep)
        if isinstance(raw, dict) and raw.get("quantization_config"):  # FP8 is dequantized by whole loads only
            raise ModelLoadError(f"{source}: loading only some experts of a quantized checkpoint is not implemented")
    if not isinstance(fs, LocalFileSystem):
        # safetensors slices need a local file; a remote one is read whole, then filtered.
        ckpt = load_checkpoint(source, dtype)
        return keep_experts(ckpt, keep)
    config_path = _join(path, "config.json")
    if not fs.exists(config_path):
        raise ModelLoadError(f"{source}: no config.json in this folder (expected an HF model folder or a .gguf file)")
    try:
        config = _normalize_hf_config(json.loads(fs.cat_file(config_path)), source, dtype)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ModelLoadError(f"{source}: config.json is not a valid JSON object ({exc})") from exc
    handles = _open_shards(fs, path, source)
    plain: dict[str, tuple[str, str]] = {}  # final name -> (shard, source name)
    fused: dict[str, _ExpertSources] = {}
    shapes: dict[str, list[int]] = {}
    for shard, f in handles.items():
        for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            if config["tie_word_embeddings"] and name == "lm_head.weight":
                continue
            if match := _PER_EXPERT_RE.match(name):
                layer, j, part = match.group(1), int(match.group(2)), _EXPERT_PART[match.group(3)]
                final = f"{layer}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
                parts = fused.setdefault(final, {}).setdefault(j, [])
                parts.append((shard, name, None))
                if part != "down":  # gate rows first, then up
                    parts.sort(key=lambda src: _EXPERT_PART[_PER_EXPERT_RE.match(src[1]).group(3)] != "gate")
                continue
            final = name
            if match := _MIXTRAL_BLOCK_RE.match(name):
                final = f"{match.group(1)}.mlp.{match.group(2)}"
            if _FUSED_RE.match(final):
                count = f.get_slice(name).get_shape()[0]
                fused[final] = {j: [(shard, name, j)] for j in range(count)}
                shapes[final] = list(f.get_slice(name).get_shape())
            else:
                plain[final] = (shard, name)

    def read(shard: str, name: str, row: int | None = None) -> torch.Tensor:
        return _read(handles, source, shard, name, row)[0 if row is not None else slice(None)].to(dtype).contiguous()

    for final, by_expert in fused.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ModelLoadError(f"{source}: {final} lacks some experts")
        if final not in shapes:
            first = [read(*src) for src in by_expert[0]]
            shapes[final] = [len(by_expert), sum(t.shape[0] for t in first), first[0].shape[1]]

    tensors: dict[str, torch.Tensor] = {}
    kept: dict[int, list[int]] = {}
    hasher = hashlib.blake2b(digest_size=32)
    names = sorted([*plain, *fused])
    for name in names:
        hasher.update(name.encode())
        if name in plain:
            tensors[name] = read(*plain[name])
            hasher.update(tensors[name].reshape(-1).view(torch.uint8).numpy().data)
            continue
        layer = int(_FUSED_RE.match(name).group(2))
        held = keep.get(layer, [])
        rows: list[torch.Tensor] = []
        for j in range(shapes[name][0]):
            expert = torch.cat([read(*src) for src in fused[name][j]])
            hasher.update(expert.reshape(-1).view(torch.uint8).numpy().data)
            if j in held:
                rows.append(expert)
        tensors[name] = (torch.stack(rows) if rows else
                         torch.empty((0, *shapes[name][1:]), dtype=dtype))
        kept[layer] = [j for j in held if j < shapes[name][0]]
    layout = [[n, shapes[n] if n in fused else list(tensors[n].shape), str(dtype).removeprefix("torch.")]
              for n in names]
    fingerprint = _fingerprint_of(config, layout, hasher.hexdigest())
    _check_tensors(tensors, config, source)
    return Checkpoint(config=config, tensors=tensors, source=source, fingerprint=fingerprint,
                      tokenizer_source=_hf_tokenizer_source(fs, path, source), expert_ids=kept)


def _open_shards(fs: fsspec.AbstractFileSystem, path: str, source: str) -> dict[str, Any]:
    """A safetensors handle per shard of the local folder (tensors are read when asked)."""
    from safetensors import SafetensorError, safe_open

    handles: dict[str, Any] = {}
    try:
        for shard in _safetensors_files(fs, path, source):
            handles[shard] = safe_open(shard, framework="pt")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{source}: a safetensors file is corrupt or truncated ({_reason(exc)})") from exc
    return handles


def _read(handles: dict[str, Any], source: str, shard: str, name: str, row: int | None = None) -> torch.Tensor:
    """Tensor ``name`` as stored, whole, or only its leading index ``row`` (kept as a leading axis of 1)."""
    from safetensors import SafetensorError

    try:
        return handles[shard].get_tensor(name) if row is None else handles[shard].get_slice(name)[row:row + 1]
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{source}: {name} cannot be read ({_reason(exc)})") from exc


# A stored expert tensor of a converting family (gpt-oss's fused experts, their biases, MXFP4 halves).
_STORED_EXPERT_RE = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts\.)\w+$")


def _load_converted_share(fs: fsspec.AbstractFileSystem, path: str, source: str, dtype: torch.dtype,
                          keep: dict[int, list[int]]) -> Checkpoint:
    """:func:`load_expert_share` for a family that converts its experts at load (gpt-oss).

    Each expert is read alone (a safetensors slice of its leading index), dequantized and cast
    as a whole load does it, then converted by the family (:func:`_convert_family_tensors`, on a
    one-expert tensor: the conversions act within an expert), hashed and kept or dropped. A whole
    load's fused tensor [E, ...] is its experts' tensors one after another, so hashing them in
    name order, expert by expert, gives the whole load's fingerprint; resident memory follows the
    experts kept, and only one expert's tensors are converted at a time."""
    import torch

    from kvbatch.engine.models.mxfp4 import SUFFIXES, dequantize_mxfp4_weights, is_mxfp4, is_mxfp4_part
    from kvbatch.engine.models.weights import _convert_family_tensors

    try:
        config = _normalize_hf_config(json.loads(fs.cat_file(_join(path, "config.json"))), source, dtype)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ModelLoadError(f"{source}: config.json is not a valid JSON object ({exc})") from exc
    mxfp4 = is_mxfp4(config, source)
    handles = _open_shards(fs, path, source)
    stored: dict[str, dict[str, str]] = {}  # a layer's expert prefix -> stored name -> shard
    plain: dict[str, torch.Tensor] = {}
    for shard, f in handles.items():
        for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            if match := _STORED_EXPERT_RE.match(name):
                stored.setdefault(match.group(1), {})[name] = shard
            elif not (config["tie_word_embeddings"] and name == "lm_head.weight"):
                t = _read(handles, source, shard, name)
                plain[name] = t if mxfp4 and is_mxfp4_part(name, t) else t.to(dtype)

    def converted(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stored tensors as a whole load turns them into the engine's (dequantize, cast, convert)."""
        quantized = {n: t for n, t in parts.items() if mxfp4 and is_mxfp4_part(n, t)}
        out = {n: t.to(dtype) for n, t in parts.items() if n not in quantized}
        if quantized:
            out.update(dequantize_mxfp4_weights(quantized, dtype, source))
        return _convert_family_tensors(out, config, source)

    tensors = converted(plain)
    counts: dict[str, int] = {}  # a final expert tensor's name -> experts in it
    sources: dict[str, dict[str, str]] = {}  # a final expert tensor's name -> the stored tensors it comes from
    for prefix, names in stored.items():
        count = {handles[shard].get_slice(n).get_shape()[0] for n, shard in names.items()}
        if len(count) != 1:
            raise ModelLoadError(f"{source}: the expert tensors under {prefix} hold different numbers of experts")
        experts = count.pop()
        for final in converted({n: _read(handles, source, shard, n, 0) for n, shard in names.items()}):
            # the stored tensors of one final one: its name, or its MXFP4 halves (all the layer's if renamed)
            own = {n: s for n, s in names.items() if n == final or n in {final + x for x in SUFFIXES}}
            sources[final], counts[final] = own or names, experts
    hasher = hashlib.blake2b(digest_size=32)
    layout: list[list[Any]] = []
    kept: dict[int, list[int]] = {}
    for name in sorted([*tensors, *sources]):
        hasher.update(name.encode())
        if name in tensors:
            t = tensors[name].detach().contiguous()
            hasher.update(t.reshape(-1).view(torch.uint8).numpy().data)
            layout.append([name, list(t.shape), str(t.dtype).removeprefix("torch.")])
            continue
        layer = int(_STORED_EXPERT_RE.match(name).group(2))
        held = [j for j in keep.get(layer, []) if j < counts[name]]
        rows, shape = [], None
        for j in range(counts[name]):
            expert = converted({n: _read(handles, source, shard, n, j) for n, shard in sources[name].items()})[name]
            expert = expert.contiguous()
            hasher.update(expert.reshape(-1).view(torch.uint8).numpy().data)
            shape = list(expert.shape[1:])
            if j in held:
                rows.append(expert[0])
        tensors[name] = torch.stack(rows) if rows else torch.empty((0, *shape), dtype=dtype)
        layout.append([name, [counts[name], *shape], str(dtype).removeprefix("torch.")])
        kept[layer] = held
    _check_tensors(tensors, config, source)
    return Checkpoint(config=config, tensors=tensors, source=source,
                      fingerprint=_fingerprint_of(config, layout, hasher.hexdigest()),
                      tokenizer_source=_hf_tokenizer_source(fs, path, source), expert_ids=kept)


def keep_experts(ckpt: Checkpoint, keep: dict[int, list[int]]) -> Checkpoint:
    """``ckpt`` (loaded whole) with only ``keep``'s experts left in its fused expert tensors (and
    their biases, gpt-oss's), and in the FP8 experts it keeps for CUDA (``Checkpoint.fp8_weights``:
    the same rows of the weights and of their block scales)."""
    from kvbatch.engine.models.fp8 import Fp8BlockWeight

    kept: dict[int, list[int]] = {}
    for name in list(ckpt.tensors):
        if match := _FUSED_RE.match(name.removesuffix("_bias")):
            layer = int(match.group(2))
            held = [j for j in keep.get(layer, []) if j < ckpt.tensors[name].shape[0]]
            ckpt.tensors[name] = ckpt.tensors[name][held].clone()
            kept[layer] = held
            if (fp8 := ckpt.fp8_weights.get(name)) is not None:
                ckpt.fp8_weights[name] = Fp8BlockWeight(fp8.weight[held].clone(), fp8.scale_inv[held].clone(),
                                                        fp8.block)
    ckpt.expert_ids = kept
    return ckpt
