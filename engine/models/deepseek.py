"""DeepSeek-V3: Multi-head Latent Attention (MLA) over a compressed paged KV cache, dense MLPs in
the first ``first_k_dense_replace`` layers and mixture-of-experts MLPs after them.

Per token and layer the cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers (the normalised
latent ``c_kv`` and the shared rotated rope key ``k_pe``), not per-head keys and values: for
DeepSeek-V3 that is 576 numbers against 128 heads x 2 x 192 for the same attention in plain MHA.
Attention reads only that compressed form. ``kv_b_proj`` is split per head into ``W_UK`` and
``W_UV`` and folded into the query (``q_latent = W_UK^T q_nope``) and the output
(``W_UV @ latent``), so no key or value is ever expanded ("weight absorption"); the kernels are
in :mod:`kvbatch.kernels.reference_mla`.

Matches transformers' ``DeepseekV3ForCausalLM``: interleaved rope (``rope_interleave``) is done
by permuting the rope rows of the projections once at load, so the rotary kernel of the Llama
path serves unchanged; YaRN scales cos/sin by its attention factor and the softmax scale by
``mscale(factor, mscale_all_dim)**2``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.fp8 import Fp8BlockWeight, kept_projection
from kvbatch.engine.models.llama import (
    ForwardBatch,
    LlamaModel,
    refuse_batch_invariant_moe,
)
from kvbatch.engine.models.mla_config import MLAConfig
from kvbatch.engine.models.moe import (
    ExpertCompute,
    LocalExperts,
    MoELayerWeights,
    RoutingObserver,
    load_moe_layer,
    moe_forward,
)
from kvbatch.engine.models.rope import cos_sin_table, yarn_inverse_frequencies
from kvbatch.kernels import dispatch as K
from kvbatch.kernels.cpu.linear import (
    LinearFormat,
    blas_invariant_rows,
    choose_linear_format,
)

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps,
# not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLALayerWeights:
    input_norm: torch.Tensor
    # x -> [q_a | c_kv | k_pe] (q_lora_rank set) or [q | c_kv | k_pe] (no q LoRA): one GEMM.
    # The GEMM weights (a_proj, q_b, o_proj, gate_up, down): prepared by LlamaModel.linear, or on CUDA
    # an FP8 checkpoint's Fp8BlockWeight as published
    a_proj: Any  # [out, H]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: Any  # [Hq * (dn + dr), q_lora_rank], None without q LoRA
    kv_a_norm: torch.Tensor  # [C]
    w_uk: torch.Tensor  # [Hq, dn, C]: q_latent[h] = q_nope[h] @ w_uk[h]
    w_uv: torch.Tensor  # [Hq, C, dv]: out[h] = latent[h] @ w_uv[h]
    o_proj: Any
    post_norm: torch.Tensor
    gate_up: Any  # dense MLP; None in a MoE layer
    down: Any
    is_moe: bool = False


def _rope_permutation(rope_dim: int) -> torch.Tensor:
    """Row order that turns interleaved rope pairs (x0, x1), (x2, x3)... into split halves
    (x0, x2, ... | x1, x3, ...): exactly what transformers' ``apply_rotary_pos_emb_interleave``
    rotates, so rotate-half rope on permuted rows equals interleaved rope on the original ones."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def mla_cos_sin_table(rope_dim: int, theta: float, scaling: dict[str, Any] | None,
                      max_positions: int) -> torch.Tensor:
    """``[max_positions, rope_dim]`` cos | sin table (the layout of :func:`cos_sin_table`), with
    YaRN frequencies and its attention factor folded into both halves when configured."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return cos_sin_table(rope_dim, theta, None, max_positions)
    if kind != "yarn":
        raise UnsupportedModelError(f"MLA rope scaling {kind!r} is not implemented")
    assert scaling is not None
    inv_freq, attention_factor = yarn_inverse_frequencies(rope_dim, theta, scaling, max_positions)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)


class DeepseekV3Model(LlamaModel):
    """DeepSeek-V3 over an MLA cache ``[L, 1, num_blocks, block_size, 1, C + R]``.

    Shares :class:`LlamaModel`'s GEMM helpers (the weight layout chosen per dtype and the
    batch-invariant padding) and its interface: ``forward``, ``kv_cache_shape``, ``config``,
    ``dtype``, ``batch_invariant`` and the MoE hooks ``moe_layers``, ``expert_compute`` and
    ``routing_observers``. Its weights and its forward pass are its own.
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 batch_invariant: bool = False, device: torch.device | str = "cpu",
                 expert_ids: dict[int, list[int]] | None = None,
                 fp8_weights: Mapping[str, Fp8BlockWeight] | None = None) -> None:
        if config.mla is None:
            raise UnsupportedModelError(f"{config.model_type}: not an MLA model")
        if batch_invariant:  # the MLA part is invariant; routed experts are not (as in LlamaModel)
            refuse_batch_invariant_moe(config)
        self.config = config
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.device = device = torch.device(device)
        self.linear: LinearFormat = choose_linear_format(dtype, device)  # see LlamaModel.__init__
        c, m = config, config.mla
        self.mla: MLAConfig = m
        Hq, dn, dr, dv, C = c.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank

        def take(name: str) -> torch.Tensor:
            # Cast on the host: the rope permutations below index with host tensors; ``dev``
            # and ``layout`` (which moves to the device) place each finished weight.
            if name not in tensors:
                raise KeyError(f"checkpoint lacks tensor {name!r}")
            return tensors[name].to(dtype).contiguous()

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device).contiguous()

        layout = self.linear.prepare

        perm = _rope_permutation(dr) if m.rope_interleave else None

        def rope_rows(name: str) -> torch.Tensor | None:
            """The row order that de-interleaves a weight's rope rows (each head's of q, the shared
            rope key's of kv_a); None: its rows as stored."""
            if perm is None:
                return None
            if name.endswith("kv_a_proj_with_mqa.weight"):
                return torch.cat([torch.arange(C), C + perm])
            if name.endswith(("q_b_proj.weight", "q_proj.weight")):
                head = torch.cat([torch.arange(dn), dn + perm])
                return (torch.arange(Hq)[:, None] * (dn + dr) + head[None, :]).reshape(-1)
            return None

        # CUDA: the projections an FP8 checkpoint published stay FP8 (as in LlamaModel), rope rows
        # reordered within their blocks; the absorbed kv_b (per-head products, not a GEMM) and
        # anything a join or a reorder would cut stay dequantized.
        fp8 = dict(fp8_weights or {}) if device.type == "cuda" else {}

        def fp8_rows(name: str, w: Fp8BlockWeight) -> Fp8BlockWeight:
            order = rope_rows(name)
            return w if order is None else w.reorder_rows(order)

        def dense_rows(name: str) -> torch.Tensor:
            order, w = rope_rows(name), take(name)
            return w if order is None else w.index_select(0, order)

        def proj(*names: str) -> Any:
            """The GEMM weight of ``names`` joined (rows of each in turn), rope rows de-interleaved."""
            kept = kept_projection(fp8, names, device, fp8_rows)
            return kept if kept is not None else layout(torch.cat([dense_rows(n) for n in names]))

        self.embed = dev(take("model.embed_tokens.weight"))
        self.layers: list[MLALayerWeights] = []  # type: ignore[assignment]
        self.moe_layers: dict[int, MoELayerWeights] = {}
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = f"{p}self_attn."
            kv_name = a + "kv_a_proj_with_mqa.weight"
            if m.q_lora_rank is not None:
                a_proj = proj(a + "q_a_proj.weight", kv_name)
                q_a_norm, q_b = dev(take(a + "q_a_layernorm.weight")), proj(a + "q_b_proj.weight")
            else:
                a_proj = proj(a + "q_proj.weight", kv_name)
                q_a_norm, q_b = None, None
            kv_b = take(a + "kv_b_proj.weight").view(Hq, dn + dv, C)
            lw = MLALayerWeights(
                input_norm=dev(take(p + "input_layernorm.weight")),
                a_proj=a_proj,
                q_a_norm=q_a_norm,
                q_b=q_b,
                kv_a_norm=dev(take(a + "kv_a_layernorm.weight")),
                w_uk=dev(kv_b[:, :dn]),
                w_uv=dev(kv_b[:, dn:].transpose(1, 2)),
                o_proj=proj(a + "o_proj.weight"),
                post_norm=dev(take(p + "post_attention_layernorm.weight")),
                gate_up=None,
                down=None,
            )
            if c.moe is not None and c.moe.is_moe_layer(i):
                lw.is_moe = True
                self.moe_layers[i] = load_moe_layer(tensors, p + "mlp.", c.moe, dtype, device,
                                                    None if expert_ids is None else expert_ids.get(i, []))
            else:
                lw.gate_up = proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
                lw.down = proj(p + "mlp.down_proj.weight")
            self.layers.append(lw)
        self.expert_compute: ExpertCompute = LocalExperts(self.moe_layers)
        self.routing_observers: list[RoutingObserver] = []
        self.norm = dev(take("model.norm.weight"))
        tied = c.tie_word_embeddings or "lm_head.weight" not in tensors
        self.lm_head = layout(take("model.embed_tokens.weight" if tied else "lm_head.weight"))
        self.cos_sin = mla_cos_sin_table(dr, c.rope_theta, c.rope_scaling, c.max_position_embeddings).to(device)
        self.scale = m.softmax_scale

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[L, 1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``: one latent
        row per token (the size-1 axes keep the Llama cache's axis order for block copies)."""
        return (self.config.num_layers, 1, num_blocks, block_size, 1, self.mla.cache_dim)

    def _per_head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x`` [T, Hq, a] times ``w`` [Hq, a, b] head by head -> [T, Hq, b], padded like
        ``_linear`` in batch-invariant mode so a row's bits do not depend on T."""
        T = x.shape[0]
        rows = blas_invariant_rows(T, x.dtype) if self.batch_invariant else T  # bmm is MKL's, whatever self.linear is
        if rows != T:
            x = torch.cat([x, x.new_zeros(rows - T, *x.shape[1:])])
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)[:T]

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                num_layers: int | None = None, window_cache: torch.Tensor | None = None) -> torch.Tensor:
        """Run the packed tokens through the model, writing their latent rows into ``kv_cache``
        (``kv_cache_shape``); return logits [N, V] for ``logits_rows``. ``num_layers``: stop
        after that many layers (early-exit drafting), as in :meth:`LlamaModel.forward`.
        ``window_cache``: unused (MLA models have no sliding layers); taken as every model's forward takes it."""
        c, m = self.config, self.mla
        T = input_ids.shape[0]
        nd = batch.num_decode
        Hq, dn, dr, C = c.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q_width = m.q_lora_rank if m.q_lora_rank is not None else Hq * (dn + dr)

        h = self.embed.index_select(0, input_ids)
        residual: torch.Tensor | None = None
        for li, lw in enumerate(self.layers[:num_layers]):
            x, residual = K.rms_norm(h, lw.input_norm, c.rms_norm_eps, residual)
            a = self._linear(x, lw.a_proj)
            q = a[:, :q_width]
            if lw.q_b is not None:
                q = self._linear(K.rms_norm(q.contiguous(), lw.q_a_norm, LATENT_NORM_EPS)[0], lw.q_b)
            q = q.reshape(T, Hq, dn + dr)
            c_kv = K.rms_norm(a[:, q_width:q_width + C].contiguous(), lw.kv_a_norm, LATENT_NORM_EPS)[0]
            q_pe, k_pe = K.apply_rotary(q[..., dn:].contiguous(), a[:, q_width + C:].reshape(T, 1, dr).contiguous(),
                                        batch.positions, self.cos_sin)
            cache = kv_cache[li, 0]  # [num_blocks, block_size, 1, C + dr]
            K.store_mla_kv(torch.cat([c_kv, k_pe.view(T, dr)], dim=-1), cache, batch.slot_mapping)
            q_latent = self._per_head(q[..., :dn], lw.w_uk)  # [T, Hq, C]
            if self.batch_invariant:
                # MQA with one key "head" [c ; k_pe] whose value is the whole row; the extra dr
                # value columns are dropped. Reuses the fixed-shape kernel, bits and all.
                latent = K.invariant_attention(torch.cat([q_latent, q_pe], dim=-1), cache, cache,
                                               batch.block_tables, batch.seq_index, batch.positions,
                                               self.scale)[..., :C]
            else:
                ws = batch.decode_workspace[0] if batch.decode_workspace is not None else None
                latent = q_latent.new_empty(T, Hq, C)
                if nd:
                    latent[:nd] = K.mla_decode_attention(q_latent[:nd], q_pe[:nd], cache, batch.decode_block_tables,
                                                         batch.decode_context_lens, self.scale, ws)
                if nd < T:
                    latent[nd:] = K.mla_prefill_attention(q_latent[nd:], q_pe[nd:], cache,
                                                          batch.prefill_block_tables, batch.prefill_cu_query_lens,
                                                          batch.prefill_context_lens, self.scale, batch.max_query_len)
            out = self._per_head(latent, lw.w_uv)  # [T, Hq, dv]
            h = self._linear(out.reshape(T, -1), lw.o_proj)
            x, residual = K.rms_norm(h, lw.post_norm, c.rms_norm_eps, residual)
            if lw.is_moe:
                assert c.moe is not None
                h = moe_forward(x, self.moe_layers[li], c.moe, li, self.expert_compute, self.routing_observers)
                continue
            h = self._linear(K.silu_and_mul(self._linear(x, lw.gate_up)), lw.down)
        assert residual is not None
        rows = batch.logits_rows
        # The last residual join, only for the rows whose logits are wanted (as in LlamaModel).
        x, _ = K.rms_norm(h.index_select(0, rows), self.norm, c.rms_norm_eps, residual.index_select(0, rows))
        return self._linear(x, self.lm_head).float()
