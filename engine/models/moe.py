"""Mixture-of-experts MLPs: routing, the expert computation hook, and a layer's weights.

One code path serves Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3's MoE layers; a
:class:`MoEConfig` (see :mod:`kvbatch.engine.models.config`) says how each family differs. A layer runs
as ``route`` -> routed experts -> + shared expert (:func:`moe_forward`).

The routed experts are computed by an :class:`ExpertCompute`: by default :class:`LocalExperts`,
which runs all of a layer's experts in this process with :func:`kvbatch.kernels.dispatch.fused_moe`.
Expert parallelism swaps in another implementation on the model (``model.expert_compute``)
without touching the model code; load balancers watch the routing through
``model.routing_observers``.

gpt-oss's experts add biases and a clamped SwiGLU (``MoELayerWeights.gate_up_bias``, ``down_bias``,
``swiglu``), run by :func:`run_experts`; an :class:`ExpertCompute` that computes a layer's experts
elsewhere must pass them on (``kvbatch.kernels.dispatch.fused_moe``'s keywords).

Weight layout (the contract other modules code against): ``w_gate_up`` ``[E, 2 I, H]`` (gate
rows first, then up), ``w_down`` ``[E, H, I]`` — ``[out, in]`` like ``F.linear``, the same as
transformers 5 keeps them in memory (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from kvbatch.engine.models.config import MoEConfig
from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.fp8 import Fp8BlockWeight
from kvbatch.engine.models.mxfp4 import Mxfp4Experts
from kvbatch.kernels import dispatch as K

__all__ = [
    "ExpertCompute",
    "LocalExperts",
    "MoEConfig",
    "MoELayerWeights",
    "RoutingObserver",
    "load_moe_layer",
    "moe_forward",
    "route",
    "run_experts",
    "use_fp8_experts",
    "use_mxfp4_experts",
]

RoutingObserver = Callable[[int, torch.Tensor], None]  # (layer_idx, topk_ids [T, k])
_K = TypeVar("_K")


@dataclass
class MoELayerWeights:
    """The weights of one MoE MLP; names and shapes are the shared contract (module docstring)."""

    router: torch.Tensor  # [E, H], kept in fp32: routing decides discretely, so compute it exactly
    w_gate_up: torch.Tensor  # [E, 2 I, H]
    w_down: torch.Tensor  # [E, H, I]
    correction_bias: torch.Tensor | None = None  # [E] fp32, DeepSeek-V3 (selection only)
    shared_gate_up: torch.Tensor | None = None  # [2 Is, H]
    shared_down: torch.Tensor | None = None  # [H, Is]
    shared_gate: torch.Tensor | None = None  # [1, H], Qwen2-MoE
    # The logical experts whose weights w_gate_up / w_down hold, row by row, when the checkpoint
    # was loaded for one expert-parallel rank only (None: every expert, row e is expert e).
    expert_ids: list[int] | None = None
    # gpt-oss: the router's bias [E] (fp32), the experts' biases [E, 2 I] (gate, then up) and [E, H],
    # and the clamped SwiGLU's (alpha, limit) in place of silu(gate) * up
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    swiglu: tuple[float, float] | None = None
    # An FP8 checkpoint's experts kept as published (CUDA, load_moe_layer's fp8_weights): w_gate_up and
    # w_down are then float8_e4m3fn, these their fp32 scale_inv [E, ceil(2I / bn), ceil(H / bk)] and
    # [E, ceil(H / bn), ceil(I / bk)], fp8_block (bn, bk); None: the weights are in the model dtype
    fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    fp8_block: tuple[int, int] | None = None
    # An MXFP4 checkpoint's experts kept as published (gpt-oss on CUDA, load_moe_layer's mxfp4_experts):
    # w_gate_up and w_down are then uint8 blocks [E, 2I, H / 32, 16] and [E, H, I / 32, 16] (groups of
    # 32 along K), these their uint8 E8M0 scales [E, 2I, H / 32] and [E, H, I / 32]
    mxfp4_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def select_experts(self, rows: torch.Tensor) -> MoELayerWeights:
        """This layer with only the expert rows ``rows`` (int64) of its expert tensors and biases, the
        router and the shared expert as they are: what an expert-parallel rank computes with
        :func:`run_experts` (slot ``i`` is row ``rows[i]``)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, rows)

        scales = None if self.fp8_scales is None else (pick(self.fp8_scales[0]), pick(self.fp8_scales[1]))
        mx = None if self.mxfp4_scales is None else (pick(self.mxfp4_scales[0]), pick(self.mxfp4_scales[1]))
        return replace(self, w_gate_up=self.w_gate_up.index_select(0, rows), w_down=self.w_down.index_select(0, rows),
                       gate_up_bias=pick(self.gate_up_bias), down_bias=pick(self.down_bias), expert_ids=None,
                       fp8_scales=scales, mxfp4_scales=mx)

    def rows_of(self, experts: list[int]) -> list[int]:
        """Rows of the expert tensors holding ``experts`` (logical ids); raises ``ValueError``
        naming the first expert this partial load does not hold."""
        if self.expert_ids is None:
            return list(experts)
        where = {e: i for i, e in enumerate(self.expert_ids)}
        missing = [e for e in experts if e not in where]
        if missing:
            raise ValueError(f"expert {missing[0]} is not among the {len(self.expert_ids)} experts loaded on "
                             f"this rank ({self.expert_ids})")
        return [where[e] for e in experts]


class ExpertCompute(Protocol):
    """Computes the routed experts' weighted sum for one layer (shared experts excluded).

    Called by :func:`moe_forward` once per MoE layer per step, in layer order, on every rank
    that runs the model. ``x``: [T, H]; ``topk_ids``: [T, k] int64 logical expert ids;
    ``topk_weights``: [T, k] fp32 (normalisation and scaling included). Returns [T, H] in
    ``x.dtype``: ``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])``.
    An implementation that computes gpt-oss's experts (biases, clamped SwiGLU: :func:`run_experts`
    over :meth:`MoELayerWeights.select_experts`) says so with ``runs_biased_experts = True``;
    :func:`moe_forward` refuses the others for such layers.
    """

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor: ...


class LocalExperts:
    """Every expert of every layer in this process: the default :class:`ExpertCompute`.

    Reads the weights from ``layers`` at each call, so a caller that replaces an entry of the
    model's ``moe_layers`` is seen at once.
    """

    # computes gpt-oss's experts (biases, clamped SwiGLU: run_experts); an ExpertCompute without this
    # attribute set is refused for such layers rather than computing plain SiLU experts
    runs_biased_experts = True

    def __init__(self, layers: Mapping[int, MoELayerWeights]) -> None:
        self.layers = layers

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        layer = self.layers[layer_idx]
        if layer.expert_ids is not None:
            raise RuntimeError(f"layer {layer_idx} holds only experts {layer.expert_ids} (loaded for one "
                               "expert-parallel rank): install expert parallelism before running it")
        return run_experts(x, layer, topk_ids, topk_weights)


def run_experts(x: torch.Tensor, layer: MoELayerWeights, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts of ``layer`` held here (:func:`kvbatch.kernels.dispatch.fused_moe`), with
    the layer's expert biases and activation (gpt-oss) where it has them, and its FP8 experts'
    block scales (or MXFP4 experts' group scales) where it keeps them quantized."""
    return K.fused_moe(x, layer.w_gate_up, layer.w_down, topk_ids, topk_weights,
                       gate_up_bias=layer.gate_up_bias, down_bias=layer.down_bias, swiglu=layer.swiglu,
                       fp8_scales=layer.fp8_scales, fp8_block=layer.fp8_block, mxfp4_scales=layer.mxfp4_scales)


def route(x: torch.Tensor, layer: MoELayerWeights, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``cfg.top_k`` experts per token and their weights.

    ``x``: [T, H]. Returns ``(topk_ids [T, k] int64, topk_weights [T, k] fp32)``; the weights
    already carry the family's normalisation and ``routed_scaling_factor``. Computed in fp32
    whatever the model dtype (a flipped choice changes a token's output wholesale).

    - softmax (Mixtral, Qwen): top-k of ``softmax(logits)``, renormalised when ``norm_topk_prob``
      (Mixtral always).
    - softmax_topk (gpt-oss): the top-k logits (the router's bias added), then the softmax over those k.
    - sigmoid (DeepSeek-V3): ``s = sigmoid(logits)``; selection ranks ``s + correction_bias``,
      first keeping the ``topk_group`` groups whose two best experts score highest, then the
      top-k experts inside them; the weights are the un-biased ``s`` of the chosen experts,
      renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
    """
    bias = None if layer.router_bias is None else layer.router_bias.float()
    logits = F.linear(x.float(), layer.router.float(), bias)
    k = cfg.top_k
    if cfg.scoring == "softmax_topk":
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif cfg.scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif cfg.scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if layer.correction_bias is None else scores + layer.correction_bias.float()
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            T, E = choice.shape
            grouped = choice.view(T, cfg.n_group, E // cfg.n_group)
            group_scores = grouped.topk(min(2, E // cfg.n_group), dim=-1)[0].sum(dim=-1)  # [T, G]
            keep = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).view(T, E)
        ids = torch.topk(choice, k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"unknown MoE scoring {cfg.scoring!r}")
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return ids, weights


def moe_forward(
    x: torch.Tensor,
    layer: MoELayerWeights,
    cfg: MoEConfig,
    layer_idx: int,
    experts: ExpertCompute | None = None,
    observers: Iterable[RoutingObserver] = (),
) -> torch.Tensor:
    """One MoE MLP on ``x`` [T, H] (already normed): route, tell ``observers``
    ``(layer_idx, topk_ids)``, run the routed experts through ``experts`` (default: all local,
    from ``layer``), then add the shared expert. Returns [T, H] in ``x.dtype``."""
    topk_ids, topk_weights = route(x, layer, cfg)
    for observe in observers:
        observe(layer_idx, topk_ids)
    if experts is None:
        out = run_experts(x, layer, topk_ids, topk_weights)
    elif layer.swiglu is not None and not getattr(experts, "runs_biased_experts", False):
        raise UnsupportedModelError(
            f"layer {layer_idx}: {type(experts).__name__} computes plain SiLU experts; this model's experts have "
            "biases and a clamped SwiGLU (gpt-oss): it must compute them with moe.run_experts "
            "(MoELayerWeights.select_experts) and set runs_biased_experts = True")
    else:
        out = experts(layer_idx, x, topk_ids, topk_weights)
    if layer.shared_gate_up is not None:
        assert layer.shared_down is not None
        shared = F.linear(K.silu_and_mul(F.linear(x, layer.shared_gate_up)), layer.shared_down)
        if layer.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, layer.shared_gate)) * shared
        out = out + shared
    return out


# The FP8 experts a model under construction may keep (``Checkpoint.fp8_weights``): installed by
# ``factory.build_model`` around a CUDA model's construction, because the decoders call
# load_moe_layer without them (a context, like the linear format and the GGUF blocks).
_FP8_EXPERTS: ContextVar[Mapping[str, Fp8BlockWeight] | None] = ContextVar("fp8_experts", default=None)


# The same for an MXFP4 checkpoint's experts (``Checkpoint.mxfp4_experts``, gpt-oss), on CUDA.
_MXFP4_EXPERTS: ContextVar[Mapping[str, Mxfp4Experts] | None] = ContextVar("mxfp4_experts", default=None)


@contextlib.contextmanager
def _installed(var: ContextVar[_K], value: _K) -> Iterator[None]:
    """``var`` set to ``value`` within the block."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def use_fp8_experts(fp8_weights: Mapping[str, Fp8BlockWeight] | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, :func:`load_moe_layer` keeps the experts ``fp8_weights`` holds as FP8."""
    return _installed(_FP8_EXPERTS, fp8_weights)


def use_mxfp4_experts(mxfp4_experts: Mapping[str, Mxfp4Experts] | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, :func:`load_moe_layer` keeps the experts ``mxfp4_experts`` holds as MXFP4."""
    return _installed(_MXFP4_EXPERTS, mxfp4_experts)


def load_moe_layer(tensors: Mapping[str, torch.Tensor], prefix: str, cfg: MoEConfig,
                   dtype: torch.dtype, device: torch.device | str = "cpu",
                   expert_ids: list[int] | None = None,
                   fp8_weights: Mapping[str, Fp8BlockWeight] | None = None,
                   mxfp4_experts: Mapping[str, Mxfp4Experts] | None = None) -> MoELayerWeights:
    """A layer's MoE weights from HF-named ``tensors`` under ``prefix`` (e.g. ``"model.layers.3.mlp."``).

    Reads the names transformers 5 uses in memory (``gate.weight``,
    ``gate.e_score_correction_bias``, ``experts.gate_up_proj``, ``experts.down_proj``,
    ``shared_expert(s).{gate,up,down}_proj.weight``, ``shared_expert_gate.weight``), which is
    what :func:`kvbatch.engine.models.weights.load_checkpoint` produces from either the fused or the
    hub's per-expert layout. Experts are cast to ``dtype``; the router and its bias stay fp32.
    Everything is moved to ``device``. ``expert_ids``: the checkpoint was loaded with only these
    logical experts of this layer (in this order, rows of the expert tensors); None: all of them.
    ``fp8_weights`` (default: what :func:`use_fp8_experts` installed): where it holds this layer's
    ``experts.gate_up_proj`` and ``experts.down_proj`` (an FP8 checkpoint loaded with ``keep_fp8``),
    the experts stay float8 with their block scales (``MoELayerWeights.fp8_scales``) and the
    dequantized tensors are not taken. ``mxfp4_experts`` (default: what :func:`use_mxfp4_experts`
    installed) likewise keeps an MXFP4 checkpoint's experts as uint8 blocks with their E8M0 scales
    (``MoELayerWeights.mxfp4_scales``).
    """

    def take(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        if prefix + name not in tensors:
            raise KeyError(f"checkpoint lacks tensor {prefix + name!r}")
        return tensors[prefix + name].to(device=device, dtype=as_dtype).contiguous()

    E, I = cfg.num_experts, cfg.moe_intermediate_size
    held = E if expert_ids is None else len(expert_ids)
    fp8 = _FP8_EXPERTS.get() if fp8_weights is None else fp8_weights
    kept = [(fp8 or {}).get(prefix + n) for n in ("experts.gate_up_proj", "experts.down_proj")]
    mx = _MXFP4_EXPERTS.get() if mxfp4_experts is None else mxfp4_experts
    kept_mx = [(mx or {}).get(prefix + n) for n in ("experts.gate_up_proj", "experts.down_proj")]
    shapes = None  # the dequantized experts' shapes, where the weights are MXFP4 blocks
    if all(w is not None for w in kept_mx):
        gate_up_mx, down_mx = (w.to(device) for w in kept_mx)
        layer = MoELayerWeights(router=take("gate.weight", torch.float32), w_gate_up=gate_up_mx.blocks,
                                w_down=down_mx.blocks, expert_ids=expert_ids,
                                mxfp4_scales=(gate_up_mx.scales, down_mx.scales))
        shapes = (gate_up_mx.shape, down_mx.shape)
    elif all(w is not None for w in kept):
        gate_up, down = (w.to(device) for w in kept)
        layer = MoELayerWeights(router=take("gate.weight", torch.float32), w_gate_up=gate_up.weight.contiguous(),
                                w_down=down.weight.contiguous(), expert_ids=expert_ids,
                                fp8_scales=(gate_up.scale_inv.contiguous(), down.scale_inv.contiguous()),
                                fp8_block=gate_up.block)
    else:
        layer = MoELayerWeights(router=take("gate.weight", torch.float32), w_gate_up=take("experts.gate_up_proj"),
                                w_down=take("experts.down_proj"), expert_ids=expert_ids)
    H = layer.router.shape[1]
    gate_up_shape, down_shape = shapes or (layer.w_gate_up.shape, layer.w_down.shape)
    for name, got, want in (("gate.weight", layer.router.shape, (E, H)),
                            ("experts.gate_up_proj", gate_up_shape, (held, 2 * I, H)),
                            ("experts.down_proj", down_shape, (held, H, I))):
        if tuple(got) != want:
            raise ValueError(f"{prefix}{name} has shape {tuple(got)}, the config says {want}")
    if cfg.has_correction_bias:
        layer.correction_bias = take("gate.e_score_correction_bias", torch.float32)
    if cfg.router_bias:
        layer.router_bias = take("gate.bias", torch.float32)
    if cfg.expert_bias:
        layer.gate_up_bias, layer.down_bias = take("experts.gate_up_proj_bias"), take("experts.down_proj_bias")
        for name, got, want in (("experts.gate_up_proj_bias", layer.gate_up_bias.shape, (held, 2 * I)),
                                ("experts.down_proj_bias", layer.down_bias.shape, (held, H))):
            if tuple(got) != want:
                raise ValueError(f"{prefix}{name} has shape {tuple(got)}, the config says {want}")
    if cfg.swiglu_limit is not None:
        layer.swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit)
    if cfg.shared_expert_intermediate_size:
        # Qwen2-MoE names it shared_expert, DeepSeek shared_experts.
        shared = "shared_expert." if prefix + "shared_expert.gate_proj.weight" in tensors else "shared_experts."
        layer.shared_gate_up = torch.cat([take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")])
        layer.shared_down = take(shared + "down_proj.weight")
        if cfg.shared_expert_gate:
            layer.shared_gate = take("shared_expert_gate.weight")
    return layer
