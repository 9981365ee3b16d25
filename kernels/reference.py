"""Readable PyTorch twins of every hot-path kernel.

These are the specification: each Triton kernel in this package is tested against the
function of the same name here, and on a CPU the engine runs these directly. They are
written for clarity first and for a CPU second (one gather per layer, no per-token loops).

Layouts (shared with the engine and the Triton kernels):
- KV cache of one layer: ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- ``slot_mapping[t] = block_id * block_size + offset``: where token ``t``'s K/V live.
- ``block_tables[b, i]``: the i-th block of sequence b (padding entries may hold any valid id).
- ``context_lens[b]``: tokens of sequence b whose K/V are in the cache, the new ones included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvbatch.kernels import reference_sparse_decode as sparse_decode


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm fused with the residual add.

    Returns ``(normed, new_residual)`` with ``new_residual = x + residual`` (or ``x`` when
    there is no residual) and ``normed = rmsnorm(new_residual) * weight``, computed in fp32
    like transformers' LlamaRMSNorm and cast back to the input dtype.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rms_norm_fp32(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` in Gemma's order: normalized and multiplied by ``weight`` in fp32, rounded
    to ``x.dtype`` once (Llama rounds before the weight). For fp32 ``x`` and ``weight`` the same
    bits as :func:`rms_norm`; the model uses it for 16-bit models whose norm weights (``1 + w``,
    which 16 bits would round) it keeps in fp32."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype), x


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul` with ``gelu(gate, approximate="tanh")`` (transformers'
    ``gelu_pytorch_tanh``: Gemma) in place of SiLU."""
    if x.shape[-1] % 2:
        raise ValueError(f"gelu_tanh_and_mul: the last axis holds gate and up halves, got odd width {x.shape[-1]}")
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: ``silu(gate) * up`` for ``x`` = ``[..., 2 I]`` laid out as the
    gate/up projection returns it (gate columns first, then up). Returns ``[..., I]`` in
    ``x.dtype``: ``F.silu`` rounds to that dtype, then the product rounds again (what the
    PyTorch MLP computes)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last axis holds gate and up halves, got odd width {x.shape[-1]}")
    gate, up = x.split(x.shape[-1] // 2, dim=-1)  # one op for both halves
    return F.silu(gate) * up


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the Llama ("rotate half", GPT-NeoX) convention.

    ``q``: [T, Hq, D], ``k``: [T, Hkv, D], ``positions``: [T] int64,
    ``cos_sin``: [max_positions, D] holding ``cos`` in the first D/2 columns and ``sin`` in
    the last D/2 (one frequency per pair). Returns new tensors; the Triton twin works in place.
    """
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions)
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        xf1, xf2 = x1.float(), x2.float()
        return torch.cat((xf1 * cos - xf2 * sin, xf2 * cos + xf1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their cache slots, in place."""
    k_flat = k_cache.view(-1, k_cache.shape[-2], k_cache.shape[-1])
    v_flat = v_cache.view(-1, v_cache.shape[-2], v_cache.shape[-1])
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


# ------------------------------------------------------------------ the same, in fewer ops
# A batch-1 decode step of a 30-layer model runs ~2,000 small ops around its matmuls, and on a CPU
# each op costs microseconds of dispatch whatever its size. The twins below compute the same bits
# as ``rms_norm``, ``apply_rotary`` and ``store_kv`` above (tests pin them bit for bit) with about
# half the ops: in place where the caller hands over its buffer, q and k rotated in one pass over
# the fused qkv output, K and V written with one ``index_copy_``, and the rotary rows looked up once
# per forward pass instead of once per layer. The batch-invariant path keeps the functions above.


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm`, bit for bit, adding ``residual`` into ``x`` in place: the caller hands
    ``x`` over (it becomes the returned new residual) and must not use it otherwise."""
    if residual is not None:
        x = x.add_(residual)  # x + residual, the same rounding
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # In fp32, ATen's rms_norm computes what rms_norm above does (mean of squares, + eps,
        # rsqrt, scale, times weight) in one call from Python, bit for bit (tested). In bf16/fp16
        # its bits differ from rms_norm's (measured, torch 2.13), so those take the long way.
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    return rms_norm(x, weight, eps)[0], x


@dataclass
class RotaryTable:
    """Every token's rotary row for one forward pass, laid out so that rotating ``[T, H, D]`` is
    ``x * cos + swap_halves(x) * sin``: ``cos`` is ``[T, 1, D]`` = (cos, cos), ``sin`` (-sin, sin),
    both fp32. ``x1 * cos + x2 * -sin`` rounds exactly as ``x1 * cos - x2 * sin``."""

    cos: torch.Tensor
    sin: torch.Tensor


def rotary_table(positions: torch.Tensor, cos_sin: torch.Tensor) -> RotaryTable:
    """The :class:`RotaryTable` of ``positions`` ([T] int64) from ``cos_sin`` ([max_positions, D],
    cos then sin, as :func:`apply_rotary` takes it); the same for every layer."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin.index_select(0, positions).float()[:, None, :]
    cos, sin = cs[..., :half], cs[..., half:]
    return RotaryTable(torch.cat((cos, cos), dim=-1), torch.cat((sin.neg(), sin), dim=-1))


def rotate_qk(qk: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Rotate ``qk`` ([T, Hq + Hkv, D]: the query heads then the key heads, e.g. a view of the
    fused qkv projection's output) in place, as :func:`apply_rotary` rotates q and k, bit for bit;
    returns ``qk``. Computed in fp32 and rounded once, like :func:`apply_rotary`."""
    x = qk if qk.dtype == torch.float32 else qk.float()  # no-op casts still cost a dispatch
    swapped = torch.roll(x, qk.shape[-1] // 2, -1)  # (x2, x1): a new tensor
    swapped.mul_(table.sin)
    if x is qk:
        torch.add(x * table.cos, swapped, out=qk)
    else:
        qk.copy_(x.mul_(table.cos).add_(swapped))
    return qk


def slot_major(kv_layer: torch.Tensor) -> torch.Tensor:
    """``kv_layer`` [2, num_blocks, block_size, Hkv, D] seen as [num_blocks * block_size, 2, Hkv, D]
    (a strided view: row s holds slot s's K and V), the layout :func:`store_kv_layer` writes
    through; the engine makes it once per cache tensor."""
    return kv_layer.view(2, -1, kv_layer.shape[-2], kv_layer.shape[-1]).transpose(0, 1)


def store_kv_layer(kv: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
                   slots_view: torch.Tensor | None = None) -> None:
    """:func:`store_kv` with K and V together: ``kv`` [T, 2, Hkv, D] (K then V of each token, e.g.
    a view of the fused qkv output) into ``kv_layer`` [2, num_blocks, block_size, Hkv, D] (one
    layer of the engine's cache) with one ``index_copy_``; ``slots_view``: :func:`slot_major` of
    ``kv_layer`` when the caller keeps it."""
    dst = slot_major(kv_layer) if slots_view is None else slots_view
    dst.index_copy_(0, slot_mapping, kv if kv.dtype == dst.dtype else kv.to(dst.dtype))


def gather_slots(block_tables: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """Flat cache slot of every key position ``[B, max_len]`` (positions past a sequence's
    end point at whatever its block table pads with; callers mask them)."""
    pos = torch.arange(max_len, device=block_tables.device)
    blocks = block_tables.long().index_select(1, pos // block_size)
    return blocks * block_size + pos % block_size


DECODE_GROUP = 16  # sequences per padded attention call in the CPU decode path
# From this many decode rows on, CPU fp32 decode attends over the cache in place
# (kernels/reference_sparse_decode.py); below it the padded path's few ops cost less (measured:
# benchmarks/bench_decode_attention.py).
SPARSE_DECODE_MIN_ROWS = 4


@dataclass
class DecodeGroup:
    """One padded attention call over decode rows (see :func:`plan_decode`)."""

    index: torch.Tensor | None  # rows of q in this call (None: all of them, in order)
    blocks: torch.Tensor  # [rows * width] int64: cache blocks to gather
    width: int  # blocks per row
    keys: int  # key positions to attend over (all rows see this many when mask is None)
    mask: torch.Tensor | None  # [rows, 1, 1, keys]: valid keys; None when every row has ``keys``


@dataclass
class DecodePlan:
    """What :func:`paged_decode_attention` derives from the block tables and context lengths
    alone, the same for every layer: built once per forward pass by the engine.

    ``slots`` (every context token's cache slot, set where the sparse path may run) serve the
    sparse path, which builds its pattern for a head layout and cache size on first use and keeps
    it for the other layers; ``groups`` serve the padded path (worked out at once where ``slots``
    is None, on first use otherwise: a 16-bit cache takes the padded path whatever the batch)."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    slots: torch.Tensor | None = None  # [sum(lens)] int64 cache slots, sequence by sequence
    _groups: list[DecodeGroup] | None = None
    _sparse: dict[tuple, sparse_decode.SparseDecode] = field(default_factory=dict)

    @property
    def groups(self) -> list[DecodeGroup]:
        if self._groups is None:
            self._groups = _decode_groups(self.block_tables, self.context_lens, self.block_size)
        return self._groups

    def sparse(self, num_heads: int, num_kv_heads: int, cache_rows: int,
               dtype: torch.dtype) -> sparse_decode.SparseDecode:
        key = (num_heads, num_kv_heads, cache_rows, dtype)
        if key not in self._sparse:
            self._sparse[key] = sparse_decode.plan(self.slots, self.context_lens, num_heads, num_kv_heads,
                                                   cache_rows, dtype)
        return self._sparse[key]


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                sparse: bool = True) -> DecodePlan:
    """``sparse=False``: the padded path whatever the batch (the benchmark's baseline)."""
    plan = DecodePlan(block_tables, context_lens, block_size)
    if sparse and block_tables.shape[0] >= SPARSE_DECODE_MIN_ROWS and not block_tables.is_cuda:
        plan.slots = sparse_decode.sorted_slots(block_tables, context_lens, block_size)
    else:
        plan.groups  # noqa: B018 (the padded plan, worked out now, once)
    return plan


def _decode_groups(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> list[DecodeGroup]:
    B = block_tables.shape[0]
    if B <= DECODE_GROUP:
        return [_decode_group(None, block_tables, context_lens, block_size)]
    # Sequences of similar length together: each group pads only to its own longest context,
    # which saves most of the padding of a mixed-length batch.
    order = torch.argsort(context_lens, stable=True)
    groups = []
    for start in range(0, B, DECODE_GROUP):
        idx = order[start:start + DECODE_GROUP]
        groups.append(_decode_group(idx, block_tables.index_select(0, idx), context_lens.index_select(0, idx),
                                    block_size))
    return groups


def _decode_group(index: torch.Tensor | None, tables: torch.Tensor, lens: torch.Tensor,
                  block_size: int) -> DecodeGroup:
    longest = int(lens.max())
    width = -(-longest // block_size)
    blocks = tables[:, :width].reshape(-1).long()
    if bool((lens == longest).all()):  # one length (always at batch 1): attend over exactly it, no mask
        return DecodeGroup(index, blocks, width, longest, None)
    keys = width * block_size
    mask = (torch.arange(keys, device=lens.device)[None, :] < lens[:, None].long())[:, None, None, :]
    return DecodeGroup(index, blocks, width, keys, mask)


# Queries of one attention-with-sinks call are taken this many score elements at a time, so a long
# prompt's scores never need more than 64 Mi floats at once.
SINK_CHUNK_ELEMENTS = 1 << 26


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         causal: bool, scale: float, sinks: torch.Tensor, fast: bool = True) -> torch.Tensor:
    """Scaled dot-product attention whose softmax has one more term in its denominator per query
    row: ``exp(sink)`` (gpt-oss's attention sinks, transformers' ``eager_attention_forward``).

    ``q`` [..., Hq, n, D], ``k``/``v`` [..., Hkv, L, D] (query head h reads KV head h // (Hq / Hkv));
    ``mask`` (bool, broadcastable to [..., Hq, n, L]: True where a key is seen) or ``causal`` (the
    n queries are the last n of the L positions); ``sinks`` broadcastable to [..., Hq, n, 1], fp32.
    In fp32: ``m = max(max_j s_j, sink)``, ``out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) +
    exp(sink - m))``; a row that sees no key gets zeros. Rounded to ``q.dtype``.

    On the CPU (fp32, bf16) the softmax without the sink comes from torch's flash kernel with its
    log-sum-exp ``lse``, and the sink rescales it: ``out = o * sigmoid(lse - sink)`` (= ``Z / (Z +
    exp(sink))``, ``Z = exp(lse)``), in fp32: the same attention without materializing the scores
    (``fast=False``: the scores written out, in query chunks)."""
    n, L = q.shape[-2], k.shape[-2]
    if q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    if fast and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and q.dim() == 4:
        return _flash_with_sinks(q, k.to(q.dtype), v.to(q.dtype), mask, causal and n == L, causal, scale, sinks)
    kf, vf = k.float(), v.float()
    if causal:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    sinks = sinks.float().expand(*q.shape[:-1], 1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    step = max(1, SINK_CHUNK_ELEMENTS // max(1, L * q[..., :1, :1].numel()))
    for a in range(0, n, step):
        b = min(n, a + step)
        scores = torch.matmul(q[..., a:b, :].float(), kf.transpose(-1, -2)) * scale
        if mask is not None:
            rows = mask if mask.shape[-2] == 1 else mask[..., a:b, :]
            scores = scores.masked_fill(~rows, float("-inf"))
        sink = sinks[..., a:b, :]
        m = torch.maximum(scores.amax(-1, keepdim=True), sink)
        e = torch.exp(scores - m)
        den = e.sum(-1, keepdim=True) + torch.exp(sink - m)
        out[..., a:b, :] = (torch.matmul(e, vf) / den).to(q.dtype)
    return out



def _flash_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      square_causal: bool, causal: bool, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """:func:`attention_with_sinks` through torch's CPU flash kernel (q, k, v [B, H, n|L, D], one dtype)."""
    n, L = q.shape[-2], k.shape[-2]
    additive = None
    if causal and not square_causal:  # the kernel's is_causal aligns to the top left; ours to the bottom right
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask is not None and not square_causal:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        additive = additive.expand(*q.shape[:-1], L) if additive.dim() < 4 else additive
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, square_causal,
                                                                         attn_mask=additive, scale=scale)
    keep = torch.sigmoid(lse.float()[..., None] - sinks.float())  # Z / (Z + exp(sink)); 0 where no key is seen
    return (o.float() * keep).nan_to_num_(0.0).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    plan: DecodePlan | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    ``q``: [B, Hq, D] -> [B, Hq, D]. Grouped-query attention: query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. ``slots`` is accepted for the Triton twin (it sizes its grid from it)
    and unused here. ``plan``: :func:`plan_decode` of these arguments, when the caller has it
    (built here otherwise).

    Two paths, the same attention up to fp32 rounding. From ``SPARSE_DECODE_MIN_ROWS`` rows on,
    fp32 tensors on the CPU attend over the cache in place, nothing copied
    (:mod:`kvbatch.kernels.reference_sparse_decode`). Otherwise (small batches, 16-bit caches)
    each group of sequences is gathered block by block into ``workspace`` (two reusable buffers
    of at least ``[B * block_tables.shape[1], block_size, Hkv, D]``; gathering whole blocks into
    memory that is already mapped is several times faster on a CPU than gathering token by
    token into fresh memory) for one padded SDPA call.

    ``sinks`` [Hq] fp32 (gpt-oss): each head's sink logit joins its softmax's denominator
    (:func:`attention_with_sinks`); those calls take the padded path.
    """
    B, Hq, D = q.shape
    if B == 0:
        return q.new_empty((0, Hq, D))
    if plan is None:
        plan = plan_decode(block_tables, context_lens, k_cache.shape[1])
    if plan.slots is not None and sinks is None and sparse_decode.applies(q, k_cache, v_cache):
        sp = plan.sparse(Hq, k_cache.shape[-2], k_cache.numel() // D, q.dtype)
        return sparse_decode.attention(q, k_cache, v_cache, sp, scale)
    groups = plan.groups
    if len(groups) == 1 and groups[0].index is None:
        return _decode_group_attention(q, k_cache, v_cache, groups[0], scale, workspace, sinks)
    out = torch.empty_like(q)
    for g in groups:
        out[g.index] = _decode_group_attention(q.index_select(0, g.index), k_cache, v_cache, g, scale, workspace,
                                               sinks)
    return out


def _decode_group_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                            scale: float, workspace: tuple[torch.Tensor, torch.Tensor] | None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    B, Hq, D = q.shape
    Hkv, block_size = k_cache.shape[-2], k_cache.shape[1]
    if workspace is None:
        k = k_cache.index_select(0, g.blocks)
        v = v_cache.index_select(0, g.blocks)
    else:
        n = g.blocks.numel()
        k = torch.index_select(k_cache, 0, g.blocks, out=workspace[0][:n])
        v = torch.index_select(v_cache, 0, g.blocks, out=workspace[1][:n])
    # [B * width, bs, Hkv, D] -> [B, Hkv, keys, D] (a strided view, no copy).
    k = k.view(B, g.width * block_size, Hkv, D)[:, :g.keys].transpose(1, 2)
    v = v.view(B, g.width * block_size, Hkv, D)[:, :g.keys].transpose(1, 2)
    # The query heads that share a KV head become extra query rows of that head.
    qg = q.view(B, Hkv, Hq // Hkv, D).to(k.dtype)
    if sinks is not None:  # row (kvh, j) is query head kvh * group + j
        out = attention_with_sinks(qg, k, v, g.mask, False, scale, sinks.view(Hkv, Hq // Hkv, 1))
    else:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
    return out.reshape(B, Hq, D).to(q.dtype)


@dataclass
class ShortChunkGroup:
    """One batched attention call over several short chunks (see :func:`plan_prefill`)."""

    rows: torch.Tensor  # [R] rows of q / out holding the chunks' tokens
    pad_pos: torch.Tensor  # [R] where each sits in the padded [S * qmax] query block
    blocks: torch.Tensor  # [S * width] int64: cache blocks to gather, sequence after sequence
    mask: torch.Tensor  # [S, 1, group * qmax, width * block_size]: keys each query row may see
    num_seqs: int
    qmax: int


@dataclass
class LongChunk:
    """One sequence's chunk, attended on its own."""

    start: int
    end: int
    slots: torch.Tensor  # [L] cache slots of its context
    # [n_new, L] causal mask aligned to the lower right (the new tokens are the context's last);
    # None for a whole prompt (n_new == L), which SDPA's is_causal covers. Under a sliding window
    # ``slots`` start at the first key the chunk's first token sees, and the mask keeps the window.
    mask: torch.Tensor | None


@dataclass
class PrefillPlan:
    """Everything :func:`prefill_attention` derives from the batch layout alone (which rows go
    where, what to gather, the causal masks): the same for every layer, so a forward pass
    builds it once. At batch 16 with drafts, building it in every layer cost more than the
    attention arithmetic of the verification rows."""

    short: list[ShortChunkGroup]
    long: list[LongChunk]


def plan_prefill(block_tables: torch.Tensor, cu_query_lens: torch.Tensor, context_lens: torch.Tensor,
                 block_size: int, group: int, window: int = 0) -> PrefillPlan:
    """The plan for a batch of chunks; ``group``: query heads per KV head. ``window`` > 0: a
    sliding window, the query at position p sees keys ``p - window + 1 .. p`` only (transformers'
    ``kv_idx > q_idx - sliding_window``); the cache still holds every key, the plan gathers from
    the first one the window lets in. Decode rows may come as chunks of one token."""
    cu = cu_query_lens.tolist()
    lens = context_lens.tolist()
    short = [s for s in range(len(lens)) if 0 < cu[s + 1] - cu[s] <= SHORT_CHUNK]
    if len(short) < 2:
        short = []
    # Many short chunks (speculative verification: 1 + k tokens per sequence) run batched,
    # like decode, instead of one attention call per sequence; sequences of similar context
    # length go together, so each call pads only to its own longest context.
    short.sort(key=lambda s: lens[s])
    groups = [_short_chunk_group(block_tables, cu, lens, short[g:g + DECODE_GROUP], block_size, group, window)
              for g in range(0, len(short), DECODE_GROUP)]
    done = set(short)
    long = []
    for s in range(len(lens)):
        n_new, n_ctx = cu[s + 1] - cu[s], lens[s]
        if n_new == 0 or s in done:
            continue
        slots = gather_slots(block_tables[s : s + 1], n_ctx, block_size)[0]
        if 0 < window < n_ctx:  # the window bites: keys from the first the chunk's first token sees
            lo = max(0, n_ctx - n_new - window + 1)
            dev = block_tables.device
            q_pos = torch.arange(n_ctx - n_new, n_ctx, device=dev)[:, None]
            k_pos = torch.arange(lo, n_ctx, device=dev)[None, :]
            long.append(LongChunk(cu[s], cu[s + 1], slots[lo:], (k_pos <= q_pos) & (k_pos > q_pos - window)))
            continue
        mask = (None if n_new == n_ctx
                else torch.ones(n_new, n_ctx, dtype=torch.bool, device=block_tables.device).tril(n_ctx - n_new))
        long.append(LongChunk(cu[s], cu[s + 1], slots, mask))
    return PrefillPlan(groups, long)


def _short_chunk_group(block_tables: torch.Tensor, cu: list[int], lens: list[int], seqs: list[int],
                       block_size: int, group: int, window: int = 0) -> ShortChunkGroup:
    if window > 0:
        return _window_chunk_group(block_tables, cu, lens, seqs, block_size, group, window)
    S = len(seqs)
    n = [cu[s + 1] - cu[s] for s in seqs]
    qmax = max(n)
    width = -(-max(lens[s] for s in seqs) // block_size)
    dev = block_tables.device  # every index and mask lives where the cache and the queries do
    idx = torch.tensor(seqs, dtype=torch.long, device=dev)
    blocks = block_tables.index_select(0, idx)[:, :width].reshape(-1).long()
    rows = torch.tensor([r for s in seqs for r in range(cu[s], cu[s + 1])], dtype=torch.long, device=dev)
    pad_pos = torch.tensor([i * qmax + j for i, m in enumerate(n) for j in range(m)], dtype=torch.long, device=dev)
    # [S, qmax]: the position of each padded query row (worked out on the host, one copy)
    q_pos = torch.tensor([[lens[s] - m + j for j in range(qmax)] for s, m in zip(seqs, n)], dtype=torch.long,
                         device=dev)
    # padded rows see key 0 at least
    mask = torch.arange(width * block_size, device=dev)[None, None, :] <= q_pos[:, :, None]
    return ShortChunkGroup(rows, pad_pos, blocks, mask.repeat(1, group, 1)[:, None], S, qmax)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: PrefillPlan | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for chunks of new tokens over a cached prefix plus themselves.

    ``q``: [T, Hq, D], the new tokens of S sequences packed back to back
    (``cu_query_lens``: [S+1] offsets). Sequence s's new tokens sit at positions
    ``context_lens[s] - q_len_s .. context_lens[s] - 1``; their K/V are already in the cache.
    Query at position p attends to keys ``0..p``. ``plan``: :func:`plan_prefill` of these
    arguments, when the caller has it (built here otherwise). ``sinks`` [Hq] fp32 (gpt-oss): each
    head's sink logit joins its softmax's denominator (:func:`attention_with_sinks`).
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    group = Hq // Hkv
    if plan is None:
        plan = plan_prefill(block_tables, cu_query_lens, context_lens, k_cache.shape[1], group)
    out = torch.empty_like(q)
    for g in plan.short:
        _short_chunks_attention(q, out, k_cache, v_cache, g, scale, sinks)
    k_flat = k_cache.view(-1, Hkv, D)
    v_flat = v_cache.view(-1, Hkv, D)
    for c in plan.long:
        k = k_flat.index_select(0, c.slots).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_flat.index_select(0, c.slots).transpose(0, 1)[None]
        qh = q[c.start:c.end].transpose(0, 1)[None].to(k.dtype)  # [1, Hq, n_new, D]
        if sinks is not None:
            o = attention_with_sinks(qh, k, v, c.mask, c.mask is None, scale, sinks.view(Hq, 1, 1))
            out[c.start:c.end] = o[0].transpose(0, 1).to(q.dtype)
            continue
        # Query heads as heads (enable_gqa: head h reads KV head h // group, as the cache is laid
        # out), not folded into rows under one mask: a whole prompt then runs SDPA's is_causal, so
        # torch's CPU flash kernel skips the blocks above the diagonal and reads no mask, and a
        # chunk over a cached prefix reads a mask of its own rows only. The end-of-turn workload's
        # 275 chunks: 1.78x less time held to AVX2, a 2,000-token prompt 7x (docs/performance.md).
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=c.mask, is_causal=c.mask is None, scale=scale,
                                           enable_gqa=group > 1)
        out[c.start:c.end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _window_chunk_group(block_tables: torch.Tensor, cu: list[int], lens: list[int], seqs: list[int],
                        block_size: int, group: int, window: int) -> ShortChunkGroup:
    """:func:`_short_chunk_group` under a sliding window: each sequence's blocks are gathered from
    the block holding the first key its chunk sees (however long its context, at most
    ``(qmax + window) / block_size + 1`` blocks), and the mask keeps query p to keys
    ``p - window + 1 .. p``. Padded query rows repeat their sequence's last position."""
    S = len(seqs)
    n = [cu[s + 1] - cu[s] for s in seqs]
    qmax = max(n)
    dev = block_tables.device
    first = [max(0, lens[s] - m - window + 1) // block_size for s, m in zip(seqs, n)]  # first block seen
    width = max(-(-lens[s] // block_size) - b for s, b in zip(seqs, first))
    tables = block_tables.index_select(0, torch.tensor(seqs, dtype=torch.long, device=dev)).long()
    cols = (torch.tensor(first, dtype=torch.long, device=dev)[:, None] + torch.arange(width, device=dev)[None, :])
    # columns past a table's end: keys past the sequence's end, masked below
    blocks = tables.gather(1, cols.clamp(max=tables.shape[1] - 1)).reshape(-1)
    rows = torch.tensor([r for s in seqs for r in range(cu[s], cu[s + 1])], dtype=torch.long, device=dev)
    pad_pos = torch.tensor([i * qmax + j for i, m in enumerate(n) for j in range(m)], dtype=torch.long, device=dev)
    q_pos = torch.tensor([[lens[s] - m + min(j, m - 1) for j in range(qmax)] for s, m in zip(seqs, n)],
                         dtype=torch.long, device=dev)
    k_pos = (torch.tensor(first, dtype=torch.long, device=dev)[:, None] * block_size
             + torch.arange(width * block_size, device=dev)[None, :])[:, None, :]  # [S, 1, keys]
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos > q_pos[:, :, None] - window)
    return ShortChunkGroup(rows, pad_pos, blocks, mask.repeat(1, group, 1)[:, None], S, qmax)


SHORT_CHUNK = 16  # chunks up to this many tokens are batched across sequences


def _short_chunks_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            g: ShortChunkGroup, scale: float, sinks: torch.Tensor | None = None) -> None:
    """Causal attention of several short chunks at once: each sequence's blocks are gathered
    once, its queries padded to the longest chunk, and the mask keeps query j of sequence s to
    keys ``0 .. lens[s] - n_s + j``. Writes into ``out``."""
    _, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    group = Hq // Hkv
    S, qmax = g.num_seqs, g.qmax
    k = k_cache.index_select(0, g.blocks).view(S, -1, Hkv, D).transpose(1, 2)
    v = v_cache.index_select(0, g.blocks).view(S, -1, Hkv, D).transpose(1, 2)
    qp = q.new_zeros(S * qmax, Hq, D)
    qp[g.pad_pos] = q.index_select(0, g.rows)
    # [S, qmax, Hkv, group, D] -> [S, Hkv, group * qmax, D]: row (g, j) is head kvh*group+g, query j.
    qs = qp.view(S, qmax, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(S, Hkv, group * qmax, D)
    if sinks is not None:  # row (g, j) is head kvh * group + g
        head_sinks = sinks.view(Hkv, group, 1, 1).expand(Hkv, group, qmax, 1).reshape(Hkv, group * qmax, 1)
        o = attention_with_sinks(qs.to(k.dtype), k, v, g.mask, False, scale, head_sinks)
    else:
        o = F.scaled_dot_product_attention(qs.to(k.dtype), k, v, attn_mask=g.mask, scale=scale)
    o = o.view(S, Hkv, group, qmax, D).permute(0, 3, 1, 2, 4).reshape(S * qmax, Hq, D)
    out[g.rows] = o.index_select(0, g.pad_pos).to(q.dtype)


# Fixed GEMM shapes for the batch-invariant path: every attention matmul is a
# [ROWS x D] x [D x TILE] or [ROWS x TILE] x [TILE x D] product, whatever the batch, chunking or
# context length, so CPU BLAS always runs the same kernel and a row's bits never depend on
# its neighbours. Tiles are combined in a fixed order with exact zeros for masked tiles.
INVARIANT_TILE = 256
INVARIANT_ROWS = 16


def invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal paged attention whose result for a token is bitwise independent of the batch.

    ``q``: [T, Hq, D]; token t belongs to sequence ``seq_index[t]`` (a row of ``block_tables``)
    and sits at ``positions[t]``, attending keys ``0..positions[t]`` of its sequence. Tokens of
    one sequence must be contiguous and in position order. Serves prefill chunks and decode
    tokens alike, so a token computes the same bits whether it was part of a long prefill, a
    short tail after a prefix hit, or a decode step in any batch. ``window`` > 0: a sliding
    window, keys ``positions[t] - window + 1 .. positions[t]`` only (masked within the same tiles).
    """
    T, Hq, D = q.shape
    if T == 0:
        return q.new_empty((0, Hq, D))
    seqs, counts = torch.unique_consecutive(seq_index, return_counts=True)
    counts_l = counts.tolist()
    starts = [0]
    for c in counts_l[:-1]:
        starts.append(starts[-1] + c)
    if len(counts_l) == 1 or all(c == 1 for c in counts_l):
        return _invariant_attention(q, k_cache, v_cache, block_tables, seqs, counts_l, starts, positions, scale,
                                    window)
    # Every shape inside is fixed, so splitting the step changes no bit; it only spares the
    # decode tokens from being padded to the longest prefill chunk. Decode tokens (one per
    # sequence) run together; each prefill chunk runs on its own.
    out = torch.empty_like(q)
    single = [i for i, c in enumerate(counts_l) if c == 1]
    if single:
        rows = torch.tensor([starts[i] for i in single], device=q.device)
        at = torch.tensor(single, device=seqs.device)
        out[rows] = _invariant_attention(q.index_select(0, rows), k_cache, v_cache, block_tables,
                                         seqs.index_select(0, at), [1] * len(single), list(range(len(single))),
                                         positions.index_select(0, rows), scale, window)
    for i, c in enumerate(counts_l):
        if c > 1:
            st = starts[i]
            out[st:st + c] = _invariant_attention(q[st:st + c], k_cache, v_cache, block_tables, seqs[i:i + 1],
                                                  [c], [0], positions[st:st + c], scale, window)
    return out


def _invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqs: torch.Tensor,
    counts: list[int],
    starts: list[int],
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """:func:`invariant_attention` for the sequences ``seqs`` (rows of ``block_tables``) whose
    tokens are ``q[starts[i]:starts[i] + counts[i]]``."""
    Hq, D = q.shape[1:]
    Hkv = k_cache.shape[-2]
    G = Hq // Hkv
    R, TILE = INVARIANT_ROWS, INVARIANT_TILE
    block_size = k_cache.shape[1]
    # Rows of one sequence and one KV head: (token, group member), packed into groups of R.
    n_groups = [-(-c * G // R) for c in counts]
    max_pos = int(positions.max()) + 1
    L = -(-max_pos // TILE) * TILE
    S = len(counts)
    tables = block_tables.index_select(0, seqs.long())
    width = -(-L // block_size)
    if tables.shape[1] < width:  # keys past a sequence's end are masked; any valid block will do
        tables = torch.cat([tables, tables.new_zeros(S, width - tables.shape[1])], dim=1)
    slots = gather_slots(tables, L, block_size)  # [S, L]
    k = k_cache.view(-1, Hkv, D).index_select(0, slots.reshape(-1)).view(S, L, Hkv, D)
    v = v_cache.view(-1, Hkv, D).index_select(0, slots.reshape(-1)).view(S, L, Hkv, D)
    nt = L // TILE
    k_tiles = k.permute(0, 2, 1, 3).reshape(S, Hkv, nt, TILE, D)
    v_tiles = v.permute(0, 2, 1, 3).reshape(S, Hkv, nt, TILE, D)
    NG = max(n_groups)
    # Query rows [S, Hkv, NG * R, D], padded with zeros; row positions (-1 = padding).
    rows = q.new_zeros(S, Hkv, NG * R, D)
    row_pos = torch.full((S, NG * R), -1, dtype=torch.long, device=q.device)
    for i, (st, c) in enumerate(zip(starts, counts)):
        qs = q[st:st + c].view(c, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, c * G, D)
        rows[i, :, : c * G] = qs
        row_pos[i, : c * G] = positions[st:st + c].repeat_interleave(G)
    rows = rows.view(S, Hkv, NG, 1, R, D).to(k.dtype)
    scores = torch.matmul(rows, k_tiles.view(S, Hkv, 1, nt, TILE, D).transpose(-1, -2)) * scale
    key_pos = torch.arange(L, device=q.device).view(nt, TILE)
    valid = key_pos.view(1, 1, nt, 1, TILE) <= row_pos.view(S, NG, 1, R, 1)  # [S, NG, nt, R, TILE]
    if window > 0:
        valid &= key_pos.view(1, 1, nt, 1, TILE) > row_pos.view(S, NG, 1, R, 1) - window
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    m = scores.amax(-1, keepdim=True)  # [S, Hkv, NG, nt, R, 1]
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - m_safe)
    l_tile = e.sum(-1, keepdim=True)
    o_tile = torch.matmul(e, v_tiles.view(S, Hkv, 1, nt, TILE, D))  # [S, Hkv, NG, nt, R, D]
    # Combine tiles in order; a fully masked tile contributes exact zeros.
    m_all = m.amax(3, keepdim=True)
    m_all = torch.where(torch.isinf(m_all), torch.zeros_like(m_all), m_all)
    alpha = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(m_safe - m_all))
    num = torch.zeros_like(o_tile[:, :, :, 0])
    den = torch.zeros_like(l_tile[:, :, :, 0])
    for t in range(nt):
        num = num + alpha[:, :, :, t] * o_tile[:, :, :, t]
        den = den + alpha[:, :, :, t] * l_tile[:, :, :, t]
    out_rows = (num / den.clamp_min(torch.finfo(den.dtype).tiny)).view(S, Hkv, NG * R, D)
    out = torch.empty_like(q)
    for i, (st, c) in enumerate(zip(starts, counts)):
        o = out_rows[i, :, : c * G].reshape(Hkv, c, G, D).permute(1, 0, 2, 3).reshape(c, Hq, D)
        out[st:st + c] = o.to(q.dtype)
    return out


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The routed experts of a mixture-of-experts MLP, grouped by expert.

    ``x``: [T, H]; ``w_gate_up``: [E, 2 I, H] (gate rows, then up rows); ``w_down``: [E, H, I];
    ``topk_ids``: [T, k] int64; ``topk_weights``: [T, k]. Returns [T, H] in ``x.dtype`` with
    ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``,
    ``e = topk_ids[t, j]``. An id outside ``0..E-1`` contributes nothing (a slot whose
    expert lives elsewhere, under expert parallelism).

    The (token, choice) pairs are sorted by expert, so each expert with tokens runs one GEMM
    over all of its rows (experts with none are skipped), and the weighted rows are added back
    to their tokens in fp32.

    gpt-oss: ``gate_up_bias`` [E, 2 I] and ``down_bias`` [E, H] are added to the projections, and
    ``swiglu`` = (alpha, limit) replaces ``silu(gate) * up`` by transformers' ``GptOssExperts``
    activation: ``g = gate.clamp(max=limit)``, ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``.
    """
    T, H = x.shape
    E = w_gate_up.shape[0]
    k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    if T == 0 or k == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair p = t * k + j, grouped by expert
    sorted_ids = flat.index_select(0, order)
    valid = (sorted_ids >= 0) & (sorted_ids < E)
    if not bool(valid.all()):
        order, sorted_ids = order[valid], sorted_ids[valid]
    counts = torch.bincount(sorted_ids, minlength=E).tolist()
    tokens = order // k
    rows = x.index_select(0, tokens)  # [P, H], expert by expert
    weights = topk_weights.reshape(-1).index_select(0, order).float()
    ys = torch.empty((rows.shape[0], H), dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = rows[start:start + n]
        gate_up = F.linear(xe, w_gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        inter = gate_up.shape[1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if swiglu is None:
            act = F.silu(gate) * up
        else:
            alpha, limit = swiglu
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        ys[start:start + n] = F.linear(act, w_down[e], None if down_bias is None else down_bias[e]).float()
        start += n
    out.index_add_(0, tokens, ys * weights[:, None])
    return out.to(x.dtype)
