"""Rotary position embedding tables, computed exactly the way transformers computes them (default,
linear, llama3, longrope, yarn)."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbatch.engine.models.mla_config import yarn_mscale


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies, with Llama 3 or linear scaling applied when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def yarn_inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any], max_positions: int
                             ) -> tuple[torch.Tensor, float]:
    """YaRN's per-pair inverse frequencies and cos/sin attention factor, as transformers'
    ``_compute_yarn_parameters`` computes them: each pair blends its original frequency and the one
    stretched by ``factor`` along a linear ramp between the dims that turn ``beta_fast`` and
    ``beta_slow`` times over ``original_max_position_embeddings`` (``truncate``, default on, rounds
    the ramp's ends to whole dims: gpt-oss states it off); the factor is the stated
    ``attention_factor``, else ``yarn_mscale(factor)`` (or the ratio of the two mscales where
    ``mscale`` and ``mscale_all_dim`` are both stated)."""
    original = scaling["original_max_position_embeddings"]
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the original frequency, 0: the stretched one
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def longrope_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """LongRoPE's cos/sin factor, as transformers' ``_compute_longrope_parameters`` sets it: the
    stated ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))`` where ``factor`` (stated,
    else ``max_positions / original``) stretches the context, 1 where it does not."""
    original = int(scaling["original_max_position_embeddings"])
    stated = scaling.get("attention_factor")
    if stated is not None:
        return float(stated)
    factor = float(scaling.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any], long: bool) -> torch.Tensor:
    """LongRoPE's per-pair inverse frequencies with the ``long_factor`` (``long``) or ``short_factor``
    list, in transformers' order of operations: ``1 / (factor_i * theta ** (2i / dim))``."""
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta**shape)


def _angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def cos_sin_table(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, rotary_dim: int = 0
) -> torch.Tensor:
    """``[max_positions, head_dim]``: cos of each pair's angle in the first half, sin in the second.

    ``rotary_dim`` (0: all of ``head_dim``): partial rotary, the frequencies of a ``rotary_dim``
    head, then pairs of angle 0 (cos 1, sin 0: left as they are) for the rest. This turns pair
    ``(i, i + head_dim / 2)``, so it matches transformers' partial rotary (pairs ``(i, i + rotary_dim
    / 2)`` of the first ``rotary_dim`` dims) on heads whose rows :func:`partial_rotary_rows` reordered.

    ``longrope`` scaling: rows below ``original_max_position_embeddings`` from the short factors,
    the rows from there on from the long factors, the turned pairs' cos and sin times
    :func:`longrope_attention_factor` (pass-through pairs stay cos 1, sin 0). A row is a function
    of its position alone, so a cached key (prefix cache, KV store, chunked prefill) never depends on
    what else was computed with it. transformers' model picks by the largest position of each forward
    call, and its generate turns the whole sequence with the long factors once it is longer than
    ``original`` (re-prefilling it when it first passes): the same for sequences of at most
    ``original`` tokens, not past it (docs/models.md).

    ``yarn`` scaling (gpt-oss): :func:`yarn_inverse_frequencies`' frequencies, cos and sin times its
    attention factor."""
    dim = rotary_dim or head_dim
    positions = torch.arange(max_positions, dtype=torch.int64)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "longrope":
        assert scaling is not None
        original = int(scaling["original_max_position_embeddings"])
        short = _angles(longrope_inverse_frequencies(dim, theta, scaling, long=False), positions[:original])
        long = _angles(longrope_inverse_frequencies(dim, theta, scaling, long=True), positions[original:])
        factor = longrope_attention_factor(scaling, max_positions)
        cos, sin = (torch.cat((a, b)) * factor for a, b in zip(short, long))
    elif kind == "yarn":  # transformers scales cos and sin by the attention factor in fp32
        assert scaling is not None
        inv_freq, factor = yarn_inverse_frequencies(dim, theta, scaling, max_positions)
        cos, sin = (t * factor for t in _angles(inv_freq, positions))
    else:
        cos, sin = _angles(inverse_frequencies(dim, theta, scaling), positions)
    if dim != head_dim:
        rest = (head_dim - dim) // 2
        cos = torch.cat((cos, cos.new_ones(max_positions, rest)), dim=-1)
        sin = torch.cat((sin, sin.new_zeros(max_positions, rest)), dim=-1)
    return torch.cat((cos, sin), dim=-1)


def partial_rotary_rows(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under which partial rotary is rotary over the whole head with a
    table from :func:`cos_sin_table` (``rotary_dim`` given): the first half of the turned dims,
    the first half of the rest, the second half of the turned dims, the second half of the rest.

    q and k heads reordered alike give the same attention scores (a dot product does not see the
    order of its terms); v and the output projection are untouched."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot, rest = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    return torch.cat((rot[:r], rest[:p], rot[r:], rest[p:]))
