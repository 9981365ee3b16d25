"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache,
with mixture-of-experts MLPs where the config has them (Mixtral, Qwen2-MoE, Qwen3-MoE), and the
common decoder of the families declared in :mod:`~kvbatch.engine.models.family` (Qwen3, Phi-3,
Gemma 3): q/k norms, partial rotary, norms by ``1 + w``, sandwich norms, embedding scale, GELU,
per-layer sliding windows and rope bases, logit soft-capping, each as its ``ModelConfig`` says.

Weights are plain tensors, not ``nn.Module``s: the forward pass is a flat loop over layers with
fused QKV and gate/up projections, which keeps the per-layer Python overhead small enough for
batch-1 decode on a CPU. Every hot operation goes through :mod:`kvbatch.kernels.dispatch`, but
a sliding layer's attention (:func:`sliding_plans`: the dispatcher takes no window yet).
Sliding layers keep their K/V in a cache of their own that holds only each sequence's window
(``window_cache``, ``ForwardBatch.window``; :mod:`kvbatch.engine.runtime.window_blocks`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.fp8 import Fp8BlockWeight, kept_projection
from kvbatch.engine.models.moe import (
    ExpertCompute,
    LocalExperts,
    MoELayerWeights,
    RoutingObserver,
    load_moe_layer,
    moe_forward,
)
from kvbatch.engine.models.rope import cos_sin_table, partial_rotary_rows
from kvbatch.kernels import dispatch as K
from kvbatch.kernels import reference
from kvbatch.kernels.cpu import greedy_head, huge_pages, mkl_packed
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.greedy_head import GreedyHead, make_greedy_head
from kvbatch.kernels.cpu.huge_pages import HugePageArena
from kvbatch.kernels.cpu.linear import GGUF, INT8, NATIVE_MAX_ROWS, LinearFormat, choose_linear_format


def refuse_batch_invariant_moe(config: ModelConfig) -> None:
    """Raise :class:`UnsupportedModelError` when ``config`` has a mixture-of-experts layer: each
    expert's GEMM gets however many rows the batch routes to it, and padding those like the
    dense GEMMs is not implemented, so a row's bits would depend on its neighbours. A MoE
    family whose layers are all dense (DeepSeek-V3 with ``first_k_dense_replace`` = layers) runs
    only dense GEMMs and is accepted. Every architecture's model calls this."""
    moe = config.moe
    sparse = [i for i in range(config.num_layers) if moe is not None and moe.is_moe_layer(i)]
    if sparse:
        raise UnsupportedModelError(
            f"batch-invariant (deterministic) mode is not implemented for mixture-of-experts models: "
            f"{config.model_type} has {len(sparse)} MoE layer(s), the first is layer {sparse[0]}")


# Decode steps of at most this many sequences take the fused native path over its own GEMV (one C
# call for every layer; see LlamaModel._fused_layers): the rows that GEMV is measured for. More rows
# are compute-bound, where GEMMs win: there the fused path runs only where MKL's packed GEMM holds
# the projections (its batched schedule, MKL called from the C code).
FUSED_DECODE_MAX_ROWS = NATIVE_MAX_ROWS


# The longest chunk a step may hold and still take the fused decode layers (every token a row
# attending to its sequence up to itself): a speculative verify chunk (max_len + 1 tokens) or a
# prompt's last partial block. A longer chunk is a prompt being prefilled, whose attention the
# prefill kernel computes a block of queries at a time.
FUSED_CHUNK_MAX_QUERY = 16


def _env_switch(name: str, default: str = "1") -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"{name} must be 0 or 1, not {value!r}")
    return value not in ("0", "false", "off")


def fused_decode_enabled() -> bool:
    """Whether models built now run small fp32 and bf16 CPU decode steps through the fused native layers
    (``KVBATCH_FUSED_DECODE``, default on; ``0`` keeps the per-op path, for measurements)."""
    return _env_switch("KVBATCH_FUSED_DECODE")


def greedy_head_enabled() -> bool:
    """Whether fp32 models built now screen a greedy step's LM head in int8 (``KVBATCH_GREEDY_HEAD``,
    default on; ``0`` keeps the full fp32 head, for measurements and whole-row logits)."""
    return _env_switch("KVBATCH_GREEDY_HEAD")


def huge_pages_enabled() -> bool:
    """Whether CPU models built now copy their projections into transparent huge pages
    (``KVBATCH_HUGE_PAGES``, default on; ``0`` keeps torch's 4 KiB pages, for measurements)."""
    return _env_switch("KVBATCH_HUGE_PAGES")


def huge_pages_wanted(device: torch.device | str) -> bool:
    """Whether a model built now on ``device`` holds its projections and KV cache in huge pages: a
    CPU model, the switch on, and Linux offering them (kernels/cpu/huge_pages.py)."""
    return (torch.device(device).type == "cpu" and huge_pages_enabled()
            and huge_pages.unavailable_reason() is None)


def lean_ops_enabled() -> bool:
    """Whether models built now take the lean small-op path (``KVBATCH_LEAN_OPS``, default on;
    ``0`` restores the per-tensor ops, for before/after measurements)."""
    return _env_switch("KVBATCH_LEAN_OPS")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H] prepared by LlamaModel.linear (packed or transposed)
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 I, H] prepared likewise; None in a MoE layer
    down: torch.Tensor | None
    is_moe: bool = False  # the MLP is LlamaModel.moe_layers[layer index]
    q_norm: torch.Tensor | None = None  # [D], Qwen3: RMSNorm per query head before rotary
    k_norm: torch.Tensor | None = None
    # Sandwich norms (Gemma): on the attention output and on the MLP output, before each residual add
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None  # gpt-oss: o_proj's bias
    sinks: torch.Tensor | None = None  # [Hq] fp32, gpt-oss: each head's sink logit (in the softmax's denominator)


@dataclass
class WindowTables:
    """A step's slots and block tables in the sliding layers' window cache (window_blocks.py):
    shaped as the full layers' ones in :class:`ForwardBatch`, null-block entries before each window."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    prefill_block_tables: torch.Tensor  # [S, max_blocks] int32
    block_tables: torch.Tensor | None = None  # batch-invariant mode: [num_decode + S, max_blocks] int32


@dataclass
class ForwardBatch:
    """Everything one step needs besides the token ids, built by the model runner.

    Tokens are ordered decode-first: the first ``num_decode`` rows are one token each of
    ``num_decode`` sequences, the rest are prefill chunks described by ``cu_query_lens``.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefill_block_tables: torch.Tensor  # [S, max_blocks] int32
    prefill_cu_query_lens: torch.Tensor  # [S + 1] int32
    prefill_context_lens: torch.Tensor  # [S] int32
    logits_rows: torch.Tensor  # [N] int64: rows whose next-token logits are wanted
    # The longest prefill chunk, known on the host: sizes the prefill kernel's grid without a
    # device-to-host read of cu_query_lens (0: no prefill rows).
    max_query_len: int = 0
    # The same step as one list of sequences (decode ones first), for the batch-invariant path.
    decode_workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # reusable gather buffers
    block_tables: torch.Tensor | None = None  # [num_decode + S, max_blocks] int32
    seq_index: torch.Tensor | None = None  # [T] int64: row of block_tables each token belongs to
    # Every logits row belongs to a greedy request that wants no logprobs: only the argmax of each
    # row will be read, so an fp32 model may screen its head in int8 (greedy_head.py).
    greedy_only: bool = False
    # Models with sliding layers: those layers' slots and block tables in the window cache.
    window: WindowTables | None = None

    def with_tables(self, tables: WindowTables) -> ForwardBatch:
        """This step as the sliding layers see it: the same rows, the window cache's slots and tables."""
        return dataclasses.replace(self, slot_mapping=tables.slot_mapping,
                                   decode_block_tables=tables.decode_block_tables,
                                   prefill_block_tables=tables.prefill_block_tables,
                                   block_tables=tables.block_tables)


def tokens_as_decode_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of ``batch`` as a decode row: its sequence's block table and a context up to
    and including itself ([T, width] int32, [T] int32). The fused decode layers store every row's
    K/V before any row attends (``native_decode_layers.c``), so a chunk's later rows see its
    earlier ones: a chunk of drafted tokens gets its causal attention at a decode row's cost."""
    dt, pt = batch.decode_block_tables, batch.prefill_block_tables
    width = max(dt.shape[1], pt.shape[1])
    chunk_lens = (batch.prefill_cu_query_lens[1:] - batch.prefill_cu_query_lens[:-1]).long()
    tables = torch.cat([torch.nn.functional.pad(dt, (0, width - dt.shape[1])),
                        torch.nn.functional.pad(pt, (0, width - pt.shape[1])).repeat_interleave(chunk_lens, dim=0)])
    return tables, (batch.positions + 1).to(torch.int32)


@dataclass
class SlidingStep:
    """How one step's sliding layers of one window attend (:func:`sliding_plans`)."""

    # "reference": every row through ``plan``; "native": decode rows through the native kernel's
    # window, prefill rows through ``plan``; "triton": both through the Triton kernels' window
    route: str
    tables: torch.Tensor  # block tables, cu_query_lens and context_lens of the rows ``plan`` covers
    cu: torch.Tensor
    lens: torch.Tensor
    plan: reference.PrefillPlan | None  # None: no row for it, or the Triton route


def sliding_plans(model: LlamaModel, h: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                  num_layers: int) -> dict[int, SlidingStep]:
    """For each sliding window among the first ``num_layers`` layers, how the step attends under
    it; {} when no layer slides, and in batch-invariant mode (``invariant_attention`` takes the
    window itself). The window cache holds only each window's blocks; each path reads from the window's
    first block, never the null blocks before it.

    Where the Triton kernels run, their decode and prefill kernels take the window. Elsewhere decode
    rows take the native decode kernel's window where the native kernels run (fp32 or bf16 CPU
    tensors), or else join the prefill chunks as chunks of one token; prefill chunks run through the
    reference's prefill path with a plan keeping the window (:func:`reference.plan_prefill`).
    (``K.paged_decode_attention`` and ``K.prefill_attention`` take no window, hence the kernels
    called here by the same rules and the reference's plan passed to the dispatcher.)"""
    c = model.config
    if not c.layer_windows or model.batch_invariant:
        return {}
    windows = set(c.layer_windows[:num_layers]) - {0}
    if not windows:
        return {}
    nd = batch.num_decode
    if K.backend(h) == "triton":  # the Triton kernels take the window and the sinks (gpt-oss) themselves
        return {w: SlidingStep("triton", batch.prefill_block_tables, batch.prefill_cu_query_lens,
                               batch.prefill_context_lens, None) for w in windows}
    group = c.num_heads // c.num_kv_heads
    native = nd > 0 and K.native(h, bf16=True) and kv_cache.dtype == h.dtype
    if native or nd == 0:  # the prefill rows alone (if any)
        tables, cu, lens = batch.prefill_block_tables, batch.prefill_cu_query_lens, batch.prefill_context_lens
    else:  # every row, decode ones as chunks of one token first
        dt, pt = batch.decode_block_tables, batch.prefill_block_tables
        width = max(dt.shape[1], pt.shape[1])
        tables = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (dt, pt)])
        cu = torch.cat([torch.arange(nd, dtype=torch.int32, device=tables.device), nd + batch.prefill_cu_query_lens])
        lens = torch.cat([batch.decode_context_lens, batch.prefill_context_lens])
    rows = lens.shape[0] > 0
    return {w: SlidingStep("native" if native else "reference", tables, cu, lens,
                           reference.plan_prefill(tables, cu, lens, kv_cache.shape[3], group, w) if rows else None)
            for w in windows}


class LlamaModel:
    """Holds the weights; ``forward`` runs one step over a packed batch of tokens.

    MoE hooks (used by expert parallelism and load balancing, never by the dense path):
    ``moe_layers`` maps a layer index to its :class:`MoELayerWeights`; ``expert_compute``
    computes the routed experts (default: all of them, locally); ``routing_observers`` are
    called with ``(layer_idx, topk_ids)`` at every MoE layer of every step.
    """

    # The sliding layers and their widest window (set by __init__; a subclass that builds itself,
    # DeepSeek's MLA, has none)
    window_layers: tuple[int, ...] = ()
    cache_window = 0

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 batch_invariant: bool = False, device: torch.device | str = "cpu",
                 expert_ids: dict[int, list[int]] | None = None,
                 fp8_weights: Mapping[str, Fp8BlockWeight] | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.device = device = torch.device(device)
        c = config
        if batch_invariant:
            refuse_batch_invariant_moe(c)

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KeyError(f"checkpoint lacks tensor {name!r}")
            return tensors[name].to(device=device, dtype=dtype).contiguous()

        self.linear: LinearFormat = choose_linear_format(dtype, device)
        # The projections a decode step streams, in 2 MiB pages where Linux offers them
        # (kernels/cpu/huge_pages.py; KVBATCH_HUGE_PAGES=0 leaves them where torch put them).
        arena = HugePageArena() if huge_pages_wanted(device) else None
        self.arena = arena  # the runner's KV cache comes from it too
        # CUDA: the projections an FP8 checkpoint published stay FP8 (Checkpoint.fp8_weights), multiplied
        # by the block-scaled Triton GEMM (_linear); where a join or a reorder would cut a block, and on
        # the CPU, the dequantized tensor serves.
        fp8 = dict(fp8_weights or {}) if device.type == "cuda" else {}

        def take_fp8(names: tuple[str, ...], reorder: Any = None) -> Fp8BlockWeight | None:
            return kept_projection(fp8, names, device, reorder)

        def take_t(*names: str) -> Any:
            kept = take_fp8(names)
            return kept if kept is not None else self.linear.prepare(torch.cat([take(n) for n in names]), arena)

        # Partial rotary (Phi): each q/k head's dims reordered so rotary over the whole head turns
        # the right pairs (rope.partial_rotary_rows); q/k weights, biases and norms alike.
        order = (partial_rotary_rows(c.head_dim, c.rotary_dims) if c.rotary_dims != c.head_dim else None)

        def take_qk(name: str) -> torch.Tensor:
            t = take(name)
            if order is None or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias",
                                                  "q_norm.weight", "k_norm.weight")):
                return t
            rows = t.shape[0] // c.head_dim
            return t.view(rows, c.head_dim, *t.shape[1:])[:, order].reshape(t.shape).contiguous()

        def fp8_qk_rows(name: str, w: Fp8BlockWeight) -> Fp8BlockWeight:
            if order is None or not name.endswith(("q_proj.weight", "k_proj.weight")):
                return w
            heads = w.shape[0] // c.head_dim
            return w.reorder_rows((torch.arange(heads)[:, None] * c.head_dim + order[None, :]).reshape(-1))

        def take_qkv_t(*names: str) -> Any:
            kept = take_fp8(names, fp8_qk_rows)
            return kept if kept is not None else self.linear.prepare(torch.cat([take_qk(n) for n in names]), arena)

        def norm_weight(t: torch.Tensor) -> torch.Tensor:
            # Gemma scales by 1 + w, added in fp32 to the weight as the model dtype holds it, and
            # kept in fp32 (16 bits would round 1 + w to 1/128 steps)
            return t.float() + 1.0 if c.norm_unit_offset else t

        # Sandwich norms: the pre-MLP norm is the checkpoint's pre_feedforward_layernorm, and its
        # post_attention_layernorm norms the attention output instead
        pre_mlp = "pre_feedforward_layernorm" if c.sandwich_norms else "post_attention_layernorm"

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        self.moe_layers: dict[int, MoELayerWeights] = {}
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = take_qkv_t(*(p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")))
            bias = None
            if c.attention_bias:
                bias = torch.cat([take_qk(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")])
            lw = LayerWeights(
                input_norm=norm_weight(take(p + "input_layernorm.weight")),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=take_t(p + "self_attn.o_proj.weight"),
                post_norm=norm_weight(take(p + f"{pre_mlp}.weight")),
                gate_up=None,
                down=None,
            )
            if c.qk_norm:
                lw.q_norm = norm_weight(take_qk(p + "self_attn.q_norm.weight"))
                lw.k_norm = norm_weight(take_qk(p + "self_attn.k_norm.weight"))
            if c.o_proj_bias:
                lw.o_bias = take(p + "self_attn.o_proj.bias")
            if c.attention_sinks:
                lw.sinks = take(p + "self_attn.sinks").float()
            if c.sandwich_norms:
                lw.attn_out_norm = norm_weight(take(p + "post_attention_layernorm.weight"))
                lw.mlp_out_norm = norm_weight(take(p + "post_feedforward_layernorm.weight"))
            if c.moe is not None and c.moe.is_moe_layer(i):
                lw.is_moe = True
                self.moe_layers[i] = load_moe_layer(tensors, p + "mlp.", c.moe, dtype, device,
                                                    None if expert_ids is None else expert_ids.get(i, []))
            else:
                lw.gate_up = take_t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
                lw.down = take_t(p + "mlp.down_proj.weight")
            self.layers.append(lw)
        self.expert_compute: ExpertCompute = LocalExperts(self.moe_layers)
        self.routing_observers: list[RoutingObserver] = []
        self.norm = norm_weight(take("model.norm.weight"))
        tied = c.tie_word_embeddings or "lm_head.weight" not in tensors
        self.lm_head = take_t("model.embed_tokens.weight" if tied else "lm_head.weight")
        # Greedy rows' head: an int8 screen, exact fp32 logits for what it keeps (fp32 CPU models whose
        # head is held in fp32: int8 and GGUF heads stream no more bytes than the screen would; a
        # tied head's rows are the embedding table itself)
        self.greedy_head: GreedyHead | None = None
        if (dtype == torch.float32 and device.type == "cpu" and not batch_invariant
                and self.linear.kind not in (INT8, GGUF) and greedy_head_enabled()):
            self.greedy_head = make_greedy_head(self.embed if tied else take("lm_head.weight"), arena)
        self.cos_sin = cos_sin_table(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings,
                                     c.rotary_dim).to(device)
        # Per layer: the sliding layers' own rope base (Gemma: unscaled local rotary), else cos_sin
        local = (cos_sin_table(c.head_dim, c.local_rope_theta, None, c.max_position_embeddings, c.rotary_dim).to(device)
                 if c.local_rope_theta is not None and any(c.layer_windows) else None)
        self.layer_cos_sin = [local if local is not None and c.window(i) else self.cos_sin for i in range(c.num_layers)]
        self.rope_tables = [self.cos_sin] if local is None else [self.cos_sin, local]  # the distinct ones
        self.scale = c.attention_scale if c.attention_scale is not None else c.head_dim ** -0.5
        self.embed_multiplier = (None if c.embedding_multiplier is None  # rounded to the embeddings' dtype, as HF does
                                 else torch.tensor(c.embedding_multiplier).to(device=device, dtype=dtype))
        if c.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"{c.model_type}: hidden_act {c.hidden_act!r} (silu or gelu_pytorch_tanh)")
        self.act = K.silu_and_mul if c.hidden_act == "silu" else reference.gelu_tanh_and_mul
        # Norms multiplied by their fp32 weight in fp32 (Gemma's 1 + w): in fp32 every norm kernel
        # computes that; a 16-bit model takes the reference's fp32 norm
        self.norm_fp32 = c.norm_unit_offset and dtype != torch.float32
        # Whether every layer is the plain Llama layer the fused native decode layers compute
        self.plain_layers = not (c.sandwich_norms or c.hidden_act != "silu" or any(c.layer_windows)
                                 or c.attention_sinks or c.o_proj_bias
                                 or c.embedding_multiplier is not None or c.norm_unit_offset)
        # The lean small-op path (KVBATCH_LEAN_OPS=0 turns it off, to measure against it).
        self.lean_ops = lean_ops_enabled()
        self.fused_decode = fused_decode_enabled()
        # Sliding layers keep their K/V in a cache of their own, which holds only each sequence's
        # window (runtime/window_blocks.py); each layer's index in its cache (full or window).
        self.window_layers = tuple(i for i in range(c.num_layers) if c.window(i))
        self.cache_window = max(c.layer_windows, default=0)
        counts = [0, 0]
        self.cache_index: list[int] = []
        for i in range(c.num_layers):
            self.cache_index.append(counts[bool(c.window(i))])
            counts[bool(c.window(i))] += 1
        self._views: tuple[tuple[torch.Tensor, torch.Tensor | None], list[tuple[torch.Tensor, ...]]] | None = None
        # per schedule (MKL's GEMM or not: LinearFormat.fused_gemm), the cache tensor and its fused layers
        self._fused: dict[bool, tuple[torch.Tensor, K.FusedLayers | None]] = {}

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[L, 2 (K, V), num_blocks, block_size, Hkv, D]`` over the full-attention layers (every
        layer but the sliding ones); the runner allocates this and the KV store saves ``[:, :,
        block]`` slices of it (other attention kinds override the shape)."""
        c = self.config
        return (c.num_layers - len(self.window_layers), 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def window_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...] | None:
        """The sliding layers' cache, laid out as :meth:`kv_cache_shape`; None: no layer slides."""
        c = self.config
        if not self.window_layers:
            return None
        return (len(self.window_layers), 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, Fp8BlockWeight):  # CUDA, an FP8 checkpoint: the block-scaled Triton GEMM
            return w.linear(x, b)
        return self.linear(x, w, b, self.batch_invariant)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                num_layers: int | None = None, window_cache: torch.Tensor | None = None) -> torch.Tensor:
        """Run the packed tokens through the model, writing their K/V into ``kv_cache``
        ([L, 2, num_blocks, block_size, Hkv, D]) and, for sliding layers, ``window_cache`` at
        ``batch.window``'s slots; return logits [N, V] for ``logits_rows``.
        ``num_layers``: stop after that many layers and apply the final norm and head to what
        they give (early-exit self-speculation drafts this way)."""
        c = self.config
        if self.window_layers and (window_cache is None or batch.window is None):
            raise ValueError(f"{c.model_type}: sliding layers need the window cache and the batch's window tables")
        # The sliding layers' step: the same positions, their own cache's slots and block tables
        wbatch = batch.with_tables(batch.window) if batch.window is not None else batch
        T = input_ids.shape[0]
        nd = batch.num_decode
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = Hq * D, Hkv * D

        h = self.embed.index_select(0, input_ids)
        if self.embed_multiplier is not None:
            h = h * self.embed_multiplier
        residual: torch.Tensor | None = None
        layers = self.layers[:num_layers]
        # The lean path (fewer small ops, the same bits: see _lean_qkv and tests/test_small_ops.py)
        # everywhere but the batch-invariant mode, which keeps the code it was pinned with; layers
        # with Qwen3's q/k norms take its norms but rotate and store q and k one by one.
        lean = self.lean_ops and not self.batch_invariant
        norm = reference.rms_norm_fp32 if self.norm_fp32 else K.add_rms_norm if lean else K.rms_norm
        head_norm = reference.rms_norm_fp32 if self.norm_fp32 else K.rms_norm
        # Decode steps, and steps whose chunks are short (drafted tokens to verify, the tail of a
        # prompt the prefix cache or the KV store did not hold), take the fused layers, each
        # token of a chunk a row of its own.
        fused = self._fused_layers(kv_cache, T) if lean and batch.max_query_len <= FUSED_CHUNK_MAX_QUERY else None
        if fused is not None:  # every layer in one native call; the loop below then has nothing left
            tables, lens = ((batch.decode_block_tables, batch.decode_context_lens) if nd == T
                            else tokens_as_decode_rows(batch))
            h, residual = K.decode_layers(fused, len(layers), h, residual, batch.positions, batch.slot_mapping,
                                          self.cos_sin, tables, lens, c.rms_norm_eps, self.scale)
            layers = []
        # Attention bookkeeping that is the same in every layer, worked out once, for the per-op
        # layers below (the fused ones need none of it: at batch 1 it was a tenth of a millisecond
        # of every step).
        plan = decode_plan = None
        windows: dict[int, SlidingStep] = {}
        ropes: dict[int, Any] = {}
        if layers:
            if not self.batch_invariant:
                if nd < T:
                    plan = K.plan_prefill(h, batch.prefill_block_tables, batch.prefill_cu_query_lens,
                                          batch.prefill_context_lens, kv_cache.shape[3], Hq // Hkv)
                if nd:
                    decode_plan = K.plan_decode(h, batch.decode_block_tables, batch.decode_context_lens,
                                                kv_cache.shape[3])
            windows = sliding_plans(self, h, wbatch, kv_cache if window_cache is None else window_cache, len(layers))
            # one rotary table per distinct rope (sliding layers may have their own)
            ropes = {id(t): K.rotary_table(h, batch.positions, t) for t in self.rope_tables} if lean else {}
        views = self._cache_views(kv_cache, window_cache) if lean else []
        for li, lw in enumerate(layers):
            cos_sin, window = self.layer_cos_sin[li], c.window(li)
            lb = wbatch if window else batch  # this layer's slots and block tables
            x, residual = norm(h, lw.input_norm, c.rms_norm_eps, residual)
            qkv = self._linear(x, lw.qkv, lw.qkv_bias)
            if lean and lw.q_norm is None:
                q, k_cache, v_cache = self._lean_qkv(qkv, views[li], lb, ropes.get(id(cos_sin)), cos_sin)
            else:
                q = qkv[:, :q_size].view(T, Hq, D)
                k = qkv[:, q_size:q_size + kv_size].view(T, Hkv, D)
                v = qkv[:, q_size + kv_size:].view(T, Hkv, D)
                if lw.q_norm is not None:  # Qwen3, Gemma: per-head RMSNorm of q and k, before rotary
                    q = head_norm(q.reshape(T * Hq, D), lw.q_norm, c.rms_norm_eps)[0].view(T, Hq, D)
                    k = head_norm(k.reshape(T * Hkv, D), lw.k_norm, c.rms_norm_eps)[0].view(T, Hkv, D)
                q, k = K.apply_rotary(q, k, batch.positions, cos_sin)
                cache, ci = (window_cache if window else kv_cache), self.cache_index[li]
                k_cache, v_cache = cache[ci, 0], cache[ci, 1]  # type: ignore[index]
                K.store_kv(k, v, k_cache, v_cache, lb.slot_mapping)
            if self.batch_invariant:
                attn = K.invariant_attention(q, k_cache, v_cache, lb.block_tables, batch.seq_index,
                                             batch.positions, self.scale, window)
            elif window:
                attn = self._sliding_attention(q, k_cache, v_cache, wbatch, window, windows[window], lw.sinks)
            elif nd == T:
                attn = K.paged_decode_attention(q, k_cache, v_cache, batch.decode_block_tables,
                                                batch.decode_context_lens, self.scale, None,
                                                batch.decode_workspace, decode_plan, lw.sinks)
            else:
                attn = torch.empty_like(q)
                if nd:
                    attn[:nd] = K.paged_decode_attention(q[:nd], k_cache, v_cache, batch.decode_block_tables,
                                                         batch.decode_context_lens, self.scale, None,
                                                         batch.decode_workspace, decode_plan, lw.sinks)
                attn[nd:] = K.prefill_attention(q[nd:], k_cache, v_cache, batch.prefill_block_tables,
                                                 batch.prefill_cu_query_lens, batch.prefill_context_lens,
                                                 self.scale, plan, batch.max_query_len, lw.sinks)
            h = self._linear(attn.view(T, q_size), lw.o_proj, lw.o_bias)
            if lw.attn_out_norm is not None:  # Gemma: the attention output normed before the residual add
                h = norm(h, lw.attn_out_norm, c.rms_norm_eps)[0]
            x, residual = norm(h, lw.post_norm, c.rms_norm_eps, residual)
            if lw.is_moe:
                h = moe_forward(x, self.moe_layers[li], c.moe, li, self.expert_compute, self.routing_observers)
            else:  # gate_up output is [T, 2 I] in either layout: gate columns, then up
                h = self._linear(self.act(self._linear(x, lw.gate_up)), lw.down)
            if lw.mlp_out_norm is not None:
                h = norm(h, lw.mlp_out_norm, c.rms_norm_eps)[0]
        assert residual is not None
        rows = batch.logits_rows
        # The last residual join, only for the rows whose logits are wanted: one fused add + norm.
        x, _ = norm(h.index_select(0, rows), self.norm, c.rms_norm_eps, residual.index_select(0, rows))
        if batch.greedy_only and greedy_head.takes(self.greedy_head, x.shape[0]):
            logits = greedy_head.screened_logits(self.greedy_head, x)  # the argmax's logits; -inf where it cannot be
        else:
            logits = self._linear(x, self.lm_head).float()
        cap = c.final_logit_softcap
        if cap:  # cap * tanh(logits / cap): -inf (a screened-out token) stays -inf, the order stays
            logits = torch.where(torch.isinf(logits), logits, torch.tanh(logits / cap) * cap)
        return logits

    def _sliding_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           batch: ForwardBatch, window: int, step: SlidingStep,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of a sliding layer's rows over the last ``window`` keys (see :func:`sliding_plans`);
        ``sinks``: the layer's sink logits (gpt-oss), on every route."""
        nd, T = batch.num_decode, q.shape[0]
        if step.route == "reference":
            return K.prefill_attention(q, k_cache, v_cache, step.tables, step.cu, step.lens, self.scale, step.plan,
                                       max(batch.max_query_len, 1), sinks)
        triton = None
        if step.route == "triton":  # importable: the dispatcher chose it
            from kvbatch.kernels import triton_attention as triton
        attn = torch.empty_like(q)
        if nd:
            decode = (native_kernels.paged_decode_attention if triton is None else triton.paged_decode_attention)
            sink = {} if sinks is None else {"sinks": sinks}
            out = decode(q[:nd], k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, self.scale,
                         window=window, **sink)
            if nd == T:
                return out
            attn[:nd] = out
        if nd < T:
            if triton is None:
                attn[nd:] = K.prefill_attention(q[nd:], k_cache, v_cache, step.tables, step.cu, step.lens, self.scale,
                                                step.plan, batch.max_query_len, sinks)
            else:
                attn[nd:] = triton.prefill_attention(q[nd:], k_cache, v_cache, step.tables, step.cu, step.lens,
                                                     self.scale, max_query_len=batch.max_query_len or None,
                                                     window=window, sinks=sinks)
        return attn

    def _lean_qkv(self, qkv: torch.Tensor, views: tuple[torch.Tensor, ...], batch: ForwardBatch,
                  rope: object, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary and the cache write of one layer on the fused qkv output [T, (Hq + 2 Hkv) D], in
        place: in the reference, three kernel calls (q and k rotated together, K and V stored
        together) with the same bits as the per-tensor path; natively one call. Returns q [T, Hq,
        D] and the layer's K and V caches."""
        Hq, Hkv = self.config.num_heads, self.config.num_kv_heads
        layer, slots, k_cache, v_cache = views
        qk = K.rotate_and_store(qkv, Hq, Hkv, batch.positions, cos_sin, rope, layer, batch.slot_mapping, slots)
        return qk[:, :Hq], k_cache, v_cache

    def _fused_layers(self, kv_cache: torch.Tensor, rows: int) -> K.FusedLayers | None:
        """The model's layers over ``kv_cache`` laid out for :func:`K.decode_layers`, when a decode
        step of ``rows`` sequences can take that path: fp32 or bf16 on the CPU with the native
        kernels built, every layer dense without q/k norms, and the projections held in a layout the
        fused layers take for this many rows. Up to FUSED_DECODE_MAX_ROWS rows: the kernel choice
        gave the bucket to the native GEMV (the fused layers' own, measured against BLAS and
        oneDNN), to BLAS (the same layout; the fused step still saves the small ops between the
        GEMVs) or, for int8 weights, to the native int8 GEMV (its blocks); in bf16, to the native
        GEMV (its bf16 blocks: bf16 BLAS keeps no layout the fused layers take); for GGUF weights, to
        the native GGUF kernel (the file's blocks, through the kernel's own entry for a thread's
        outputs). At any row count: to MKL's packed GEMM, which the fused layers call between their
        small ops (the batched schedule: the per-op path's bits without its Python). Where oneDNN's
        packed layout or another int8 route won, or a GGUF weight the file held in another type has
        no plain fp32 layout, the per-op path keeps it. Made once per cache tensor and schedule."""
        gemm = self.linear.fused_gemm(rows)
        if not (self.fused_decode and 0 < rows and (rows <= FUSED_DECODE_MAX_ROWS or gemm)
                and K.native(kv_cache, bf16=True) and self.linear.fused_rows(rows)):
            return None
        held = self._fused.get(gemm)
        if held is None or held[0] is not kv_cache:
            fused = None
            if self.plain_layers and all(not lw.is_moe and lw.q_norm is None for lw in self.layers):
                projs = [[self.linear.fused_weight(w, rows) for w in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
                         for lw in self.layers]
                if all(w is not None for ws in projs for w in ws):  # None: a weight with no such layout
                    fused = K.fuse_layers([
                        K.DenseLayer(lw.input_norm, lw.post_norm, qkv, lw.qkv_bias, o, gate_up, down, kv_cache[li])
                        for li, (lw, (qkv, o, gate_up, down)) in enumerate(zip(self.layers, projs))],
                        mkl_packed.sgemm_compute_address() if gemm else None)
            held = self._fused[gemm] = (kv_cache, fused)
        return held[1]

    def _cache_views(self, kv_cache: torch.Tensor,
                     window_cache: torch.Tensor | None = None) -> list[tuple[torch.Tensor, ...]]:
        """Per layer ``(cache[i], its slot-major view, cache[i, 0], cache[i, 1])``, ``cache`` the
        layer's (the window cache for sliding layers), ``i`` its index there; made once per pair of
        cache tensors (the runner keeps them for its life) instead of view, select and transpose
        ops in every layer of every step."""
        held = self._views
        if held is None or held[0][0] is not kv_cache or held[0][1] is not window_cache:
            views = []
            for li in range(self.config.num_layers):
                cache = window_cache if self.config.window(li) else kv_cache
                if cache is None:
                    views.append(())
                    continue
                i = self.cache_index[li]
                views.append((cache[i], K.slot_major(cache[i]), cache[i, 0], cache[i, 1]))
            held = self._views = ((kv_cache, window_cache), views)
        return held[1]
