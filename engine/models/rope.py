"""Rotary position embedding tables, computed exactly the way transformers computes them."""

from __future__ import annotations

import math
from typing import Any

import torch


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


def cos_sin_table(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, rotary_dim: int = 0
) -> torch.Tensor:
    """``[max_positions, head_dim]``: cos of each pair's angle in the first half, sin in the second.

    ``rotary_dim`` (0: all of ``head_dim``): partial rotary, the frequencies of a ``rotary_dim``
    head, then pairs of angle 0 (cos 1, sin 0: left as they are) for the rest. This turns pair
    ``(i, i + head_dim / 2)``, so it matches transformers' partial rotary (pairs ``(i, i + rotary_dim
    / 2)`` of the first ``rotary_dim`` dims) on heads whose rows :func:`partial_rotary_rows` reordered."""
    inv_freq = inverse_frequencies(rotary_dim or head_dim, theta, scaling)
    if rotary_dim and rotary_dim != head_dim:
        inv_freq = torch.cat((inv_freq, inv_freq.new_zeros((head_dim - rotary_dim) // 2)))
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def partial_rotary_rows(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under which partial rotary is rotary over the whole head with a
    table from :func:`cos_sin_table` (``rotary_dim`` given): the first half of the turned dims,
    the first half of the rest, the second half of the turned dims, the second half of the rest.

    q and k heads reordered alike give the same attention scores (a dot product does not see the
    order of its terms); v and the output projection are untouched."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot, rest = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    return torch.cat((rot[:r], rest[:p], rot[r:], rest[p:]))
