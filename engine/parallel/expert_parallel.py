"""Expert parallelism: each rank of a worker group holds some experts; tokens travel to them.

:class:`ExpertParallelCompute` is a ``model.expert_compute`` (see :mod:`kvbatch.engine.models.moe`)
for one rank of a ``torch.distributed`` group. It keeps only this rank's physical expert slots
(a :class:`~kvbatch.engine.parallel.eplb.Placement`; slots are rank-major) and, at every MoE layer:

1. maps each (token, expert) pair to a physical slot (:func:`~kvbatch.engine.parallel.eplb.replica_choice`),
   hence to the rank owning the slot;
2. exchanges a small header with every rank (``all_to_all_single``): how many rows it sends
   each rank, and which layer it is at (-1: idle);
3. sends the token rows, each tagged with its slot (one ``all_to_all_single`` of packed bytes);
4. computes what arrived with :func:`kvbatch.engine.models.moe.run_experts` on the local slots
   (gpt-oss's expert biases and clamped SwiGLU included), unweighted, and sends the rows back the
   way they came (``all_to_all_single``);
5. combines on the token's own rank exactly as the local :func:`fused_moe` does (pairs in
   expert order, weighted in fp32, one ``index_add_``), so a token's output is bitwise the
   local one whenever each expert's GEMM rows are (they are when its batch is the same).

Lockstep. Collectives need every rank. A rank that has finished its step (or has no requests
left) calls :meth:`ExpertParallelCompute.finish_step`, which joins rounds as an idle rank
(it still computes rows sent to its experts) until a round in which every rank is idle; all
ranks see the same headers, so all leave together. Because each header names its layer, ranks
need not even be at the same layer, or run the same number of forwards per step (early-exit
drafts, speculative verification).

:meth:`ExpertParallelCompute.rebalance` moves expert weights to a new placement (one
``all_to_all_single`` of whole experts) and swaps it in; call it between steps, on every rank,
with the same placement.

The header and the three payload collectives are the all-to-all traffic; :class:`ExchangeStats`
counts the bytes that left this rank, per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from kvbatch.engine.models.moe import MoELayerWeights, run_experts
from kvbatch.engine.parallel.eplb import Placement, bucket_counts, identity_placement, replica_choice

IDLE = -1  # header layer of a rank that only serves other ranks' rows this round
_SLOT_BYTES = 4  # each dispatched row carries its slot id as int32


@dataclass
class ExchangeStats:
    """All-to-all traffic and expert work of one rank, per model layer index.

    Bytes count only what left for another rank (a rank's rows to itself are a local copy).
    ``tokens`` are this rank's own tokens through the layer; ``rows_computed`` are (token,
    expert) pairs its experts computed, from any rank: the rank's expert load.
    """

    tokens: dict[int, int] = field(default_factory=dict)
    dispatch_bytes: dict[int, int] = field(default_factory=dict)
    combine_bytes: dict[int, int] = field(default_factory=dict)
    rows_computed: dict[int, int] = field(default_factory=dict)
    header_bytes: int = 0
    rounds: int = 0  # exchange rounds joined, active or idle
    idle_rounds: int = 0
    rebalance_bytes: int = 0
    rebalances: int = 0
    # Device-to-host reads (syncs on CUDA): one per round, the split sizes all_to_all_single needs.
    host_reads: int = 0

    def add(self, table: dict[int, int], layer: int, n: int) -> None:
        table[layer] = table.get(layer, 0) + n

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": dict(sorted(self.tokens.items())),
            "dispatch_bytes": dict(sorted(self.dispatch_bytes.items())),
            "combine_bytes": dict(sorted(self.combine_bytes.items())),
            "rows_computed": dict(sorted(self.rows_computed.items())),
            "header_bytes": self.header_bytes,
            "rounds": self.rounds,
            "idle_rounds": self.idle_rounds,
            "rebalance_bytes": self.rebalance_bytes,
            "rebalances": self.rebalances,
            "host_reads": self.host_reads,
        }


def a2a_bytes_per_token_per_layer(per_rank: list[dict[str, Any]]) -> float:
    """Group-wide all-to-all payload bytes (dispatch + combine) per token per MoE layer, from
    every rank's :meth:`ExchangeStats.to_json`."""
    moved = sum(sum(s["dispatch_bytes"].values()) + sum(s["combine_bytes"].values()) for s in per_rank)
    token_layers = sum(sum(s["tokens"].values()) for s in per_rank)
    return moved / token_layers if token_layers else 0.0


class ExpertParallelCompute:
    """``model.expert_compute`` for one rank of an expert-parallel group (module docstring).

    ``moe_layers``: the model's full MoE weights (layer index -> weights); only this rank's
    slots are copied out of them. ``placement``: rows indexed by model layer (as
    :class:`~kvbatch.engine.parallel.eplb.ExpertLoadWindow` and ``rebalance_experts`` make them); None is
    the identity, which needs the expert count to divide by the group size.
    """

    # Computes each slot with run_experts over MoELayerWeights.select_experts: gpt-oss's expert
    # biases travel with their expert, so moe_forward may hand it such layers.
    runs_biased_experts = True

    def __init__(self, moe_layers: Mapping[int, MoELayerWeights], num_layers: int,
                 placement: Placement | None = None, group: dist.ProcessGroup | None = None) -> None:
        if not moe_layers:
            raise ValueError("expert parallelism needs a model with MoE layers")
        if any(lw.fp8_scales is not None for lw in moe_layers.values()):
            # the exchange sizes activations by the expert weights' dtype and rebalance moves no scales
            raise ValueError("expert parallelism over FP8 experts (kept as float8 for CUDA) is not implemented: "
                             "load the checkpoint without keep_fp8")
        if any(lw.mxfp4_scales is not None for lw in moe_layers.values()):
            # the same: its exchange and rebalance move dtype-sized expert rows and no group scales
            raise ValueError("expert parallelism over MXFP4 experts (kept as MXFP4 for CUDA) is not implemented: "
                             "load the checkpoint without keep_fp8")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.layer_ids = sorted(moe_layers)
        first = moe_layers[self.layer_ids[0]]
        self.num_experts = first.num_experts
        self.dtype = first.w_gate_up.dtype
        self.device = first.w_gate_up.device
        self.hidden = first.w_gate_up.shape[2]
        for li in self.layer_ids:
            # rebalance moves an expert's weights and biases as one row of self.dtype
            for name, t in _expert_tensors(moe_layers[li]).items():
                if t.dtype != self.dtype:
                    raise ValueError(f"layer {li}: expert tensor {name} is {t.dtype}, the expert weights "
                                     f"{self.dtype}: expert parallelism needs them in one dtype")
        if placement is None:
            if self.num_experts % self.world:
                raise ValueError(
                    f"{self.num_experts} experts do not split over {self.world} ranks: add redundant "
                    f"experts so that experts + redundant is a multiple of {self.world}")
            placement = identity_placement(num_layers, self.num_experts, self.world)
        self._check(placement)
        self.placement = placement
        self._routing = self._on_device(placement)
        self.per_rank = placement.slots_per_rank(self.world)
        # layer -> the layer with only this rank's slots (w_gate_up [S/W, 2I, H], w_down [S/W, H, I],
        # expert biases where it has them), slot order.
        self.layers: dict[int, MoELayerWeights] = {}
        for li in self.layer_ids:
            lw = moe_layers[li]
            # Rows of this layer's expert tensors: expert ids, or (a checkpoint loaded for this
            # rank only) where each of its experts sits in the partial tensors.
            rows = torch.tensor(lw.rows_of(placement.experts_on_rank(li, self.rank, self.world).tolist()),
                                dtype=torch.long, device=self.device)
            self.layers[li] = lw.select_experts(rows)
        self.stats = ExchangeStats()
        self.step_offset = 0  # replica_choice offset; advanced per step so remainders rotate

    def _on_device(self, placement: Placement) -> Placement:
        """The placement's tables on the experts' device, for routing: moved once per placement,
        not per layer (a per-layer copy from host memory would wait for the GPU)."""
        return Placement(placement.phy2log.to(self.device), placement.log2phy.to(self.device),
                         placement.logcnt.to(self.device))

    def _check(self, placement: Placement) -> None:
        placement.validate(self.world)
        if placement.num_experts != self.num_experts:
            raise ValueError(f"placement is for {placement.num_experts} experts, the model has {self.num_experts}")
        if placement.num_layers <= self.layer_ids[-1]:
            raise ValueError(f"placement has {placement.num_layers} layer rows; MoE layer {self.layer_ids[-1]} "
                             "needs one (rows are model layer indices)")

    # -- the model hook ----------------------------------------------------------------------------
    def __call__(self, layer_idx: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        out = self._round(layer_idx, x, topk_ids, topk_weights)
        assert out is not None
        return out

    def finish_step(self) -> int:
        """Serve other ranks' rows until every rank has finished its step; returns the idle
        rounds joined. Every rank calls this once per step, after its own forwards (if any)."""
        n = 0
        while self._round(IDLE) is not None:
            n += 1
        self.step_offset += 1
        return n

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (one all_reduce)."""
        return self.any_ranks(flag)[0]

    def any_ranks(self, *flags: bool) -> tuple[bool, ...]:
        """For each flag, True on every rank when it is true on any rank (one all_reduce for all)."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=self._collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(bool(v) for v in t.tolist())

    def _collective_device(self) -> torch.device:
        # NCCL moves CUDA tensors only; gloo is happy with CPU ones.
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    # -- one exchange round ------------------------------------------------------------------------
    def _round(self, layer_idx: int, x: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
               topk_weights: torch.Tensor | None = None) -> torch.Tensor | None:
        """One round of the protocol. Active (``layer_idx`` >= 0): returns the combined routed
        output [T, H]. Idle: returns None when every rank was idle (the step is over), else an
        empty tensor after serving the active ranks."""
        W, rank, st = self.world, self.rank, self.stats
        dev = self._collective_device()
        active = layer_idx != IDLE
        H = self.hidden
        row_bytes = H * torch.empty((), dtype=self.dtype).element_size()
        if active:
            assert x is not None and topk_ids is not None and topk_weights is not None
            T, k = topk_ids.shape
            slots = replica_choice(topk_ids, self._routing, layer_idx, offset=self.step_offset + rank).reshape(-1)
            dest = torch.div(slots, self.per_rank, rounding_mode="floor")
            # Rows grouped by destination rank, then by slot, so each receiver gets runs per slot.
            send_order = torch.argsort(slots, stable=True)
            send_counts = bucket_counts(dest, W)  # on the device: bincount would read the host
        else:
            T, k = 0, 0
            send_counts = torch.zeros(W, dtype=torch.long, device=dev)
        header = torch.stack([send_counts, torch.full_like(send_counts, layer_idx)], dim=1).to(dev)
        recv_header = torch.empty_like(header)
        dist.all_to_all_single(recv_header, header, group=self.group)
        # The round's one host read: what this rank sends and what it receives, as the Python
        # split sizes all_to_all_single takes (rows per layer per rank differ every round, so
        # no read can serve several layers; fixed-capacity splits would move W times the rows).
        sizes = torch.cat([header[:, 0], recv_header.reshape(-1)]).cpu().tolist()
        st.host_reads += 1
        send_list, recv_counts, src_layers = sizes[:W], sizes[W::2], sizes[W + 1::2]
        st.rounds += 1
        st.header_bytes += (W - 1) * header[0].numel() * header.element_size()
        if all(li == IDLE for li in src_layers):
            assert not active
            return None
        if not active:
            st.idle_rounds += 1

        # Dispatch: each row is x[token] as bytes, then its slot id as int32 bytes.
        if active and T * k:
            tokens = torch.div(send_order, k, rounding_mode="floor")
            rows = x.index_select(0, tokens).contiguous().view(torch.uint8).view(T * k, row_bytes)
            tags = slots.index_select(0, send_order).to(torch.int32).view(torch.uint8).view(T * k, _SLOT_BYTES)
            send_buf = torch.cat([rows, tags], dim=1).to(dev)
        else:
            send_buf = torch.empty((0, row_bytes + _SLOT_BYTES), dtype=torch.uint8, device=dev)
        recv_buf = torch.empty((sum(recv_counts), row_bytes + _SLOT_BYTES), dtype=torch.uint8, device=dev)
        dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=recv_counts, input_split_sizes=send_list,
                               group=self.group)
        if active:
            remote = sum(send_list) - send_list[rank]
            st.add(st.tokens, layer_idx, T)
            st.add(st.dispatch_bytes, layer_idx, remote * (row_bytes + _SLOT_BYTES))

        # Compute what arrived, source block by source block, with the layer each source is at.
        recv_buf = recv_buf.to(self.device)
        recv_x = recv_buf[:, :row_bytes].contiguous().view(self.dtype)
        recv_slot = recv_buf[:, row_bytes:].contiguous().view(torch.int32).reshape(-1).long()
        y = torch.empty((recv_x.shape[0], H), dtype=self.dtype, device=self.device)
        start = 0
        blocks: dict[int, list[tuple[int, int]]] = {}
        for src in range(W):
            n = recv_counts[src]
            if n:
                blocks.setdefault(src_layers[src], []).append((start, start + n))
            start += n
        for li, spans in blocks.items():
            rows_idx = torch.cat([torch.arange(a, b, device=self.device) for a, b in spans])
            local_slot = recv_slot.index_select(0, rows_idx) - rank * self.per_rank
            ones = torch.ones((rows_idx.numel(), 1), dtype=torch.float32, device=self.device)
            # Weight 1 keeps the expert's output as is: the weighting happens at home, in fp32.
            y[rows_idx] = run_experts(recv_x.index_select(0, rows_idx), self.layers[li], local_slot.view(-1, 1), ones)
            st.add(st.rows_computed, li, rows_idx.numel())

        # Combine: the rows go back the way they came.
        back = torch.empty((sum(send_list), H), dtype=self.dtype, device=dev)
        dist.all_to_all_single(back, y.to(dev), output_split_sizes=send_list, input_split_sizes=recv_counts,
                               group=self.group)
        for src in range(W):
            if src != rank and recv_counts[src]:
                st.add(st.combine_bytes, src_layers[src], recv_counts[src] * row_bytes)
        if not active:
            return torch.empty(0)
        assert x is not None and topk_weights is not None and topk_ids is not None
        y_pairs = torch.empty((T * k, H), dtype=self.dtype, device=x.device)
        y_pairs[send_order.to(x.device)] = back.to(x.device)
        return _combine(y_pairs, topk_ids, topk_weights, T, H, x.dtype)

    # -- rebalancing -------------------------------------------------------------------------------
    def rebalance(self, placement: Placement) -> int:
        """Move expert weights so this rank holds its slots of ``placement``, then use it.

        Collective: every rank calls it between steps with the same placement. Experts a rank
        already holds are copied locally; the rest come from a rank holding them under the old
        placement (one ``all_to_all_single`` of whole experts). Returns bytes this rank sent.
        """
        self._check(placement)
        old, W, rank = self.placement, self.world, self.rank
        old_per, new_per = old.slots_per_rank(W), placement.slots_per_rank(W)
        dev = self._collective_device()
        # The plan is a pure function of the two placements, so every rank computes the same one.
        # transfers: (src, dst, layer, dst local slot, expert), in a fixed order.
        transfers: list[tuple[int, int, int, int, int]] = []
        for li in self.layer_ids:
            old_row = old.phy2log[li].tolist()
            new_row = placement.phy2log[li].tolist()
            holders: dict[int, list[int]] = {}
            for slot, e in enumerate(old_row):
                r = slot // old_per
                if r not in holders.setdefault(e, []):
                    holders[e].append(r)
            for slot, e in enumerate(new_row):
                dst, j = divmod(slot, new_per)
                if dst in holders[e]:
                    continue
                src = holders[e][slot % len(holders[e])]  # spread the sending over the holders
                transfers.append((src, dst, li, j, e))

        def expert_row(li: int, e: int) -> torch.Tensor:
            local_slot = old_row_of[li].index(e)
            return torch.cat([t[local_slot].reshape(-1) for t in _expert_tensors(self.layers[li]).values()])

        old_row_of = {li: old.experts_on_rank(li, rank, W).tolist() for li in self.layer_ids}
        outgoing = sorted((t for t in transfers if t[0] == rank), key=lambda t: (t[1], t[2], t[3]))
        incoming = sorted((t for t in transfers if t[1] == rank), key=lambda t: (t[0], t[2], t[3]))
        # One expert's row: its weights, then its biases where the model has them (gpt-oss); every
        # MoE layer of a model holds the same tensors, so the first layer sizes every row.
        row_numel = sum(t[0].numel() for t in _expert_tensors(self.layers[self.layer_ids[0]]).values())
        send = (torch.stack([expert_row(li, e) for _, _, li, _, e in outgoing]) if outgoing
                else torch.empty((0, row_numel), dtype=self.dtype, device=self.device))
        recv = torch.empty((len(incoming), row_numel), dtype=self.dtype, device=dev)
        send_counts = [sum(1 for t in outgoing if t[1] == d) for d in range(W)]
        recv_counts = [sum(1 for t in incoming if t[0] == s) for s in range(W)]
        dist.all_to_all_single(recv, send.to(dev), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                               group=self.group)
        recv = recv.to(self.device)
        arrived = {(li, j): recv[i] for i, (_, _, li, j, _) in enumerate(incoming)}
        new_layers: dict[int, MoELayerWeights] = {}
        for li in self.layer_ids:
            held = _expert_tensors(self.layers[li])
            new = {name: t.new_empty((new_per, *t.shape[1:])) for name, t in held.items()}
            for j, e in enumerate(placement.experts_on_rank(li, rank, W).tolist()):
                if (li, j) in arrived:
                    parts = arrived[(li, j)].split([t[0].numel() for t in held.values()])
                    for (name, t), part in zip(held.items(), parts):
                        new[name][j] = part.view(t.shape[1:])
                else:
                    s = old_row_of[li].index(e)
                    for name, t in held.items():
                        new[name][j] = t[s]
            new_layers[li] = replace(self.layers[li], **new)
        # Swap only once every weight is in place: the next step sees the whole new placement.
        self.layers, self.placement, self.per_rank = new_layers, placement, new_per
        self._routing = self._on_device(placement)
        sent = len(outgoing) * row_numel * send.element_size()
        self.stats.rebalance_bytes += sent
        self.stats.rebalances += 1
        return sent

    def local_experts(self) -> dict[int, list[int]]:
        """Layer -> the logical experts in this rank's slots (for tests and logs)."""
        return {li: self.placement.experts_on_rank(li, self.rank, self.world).tolist() for li in self.layer_ids}


def _expert_tensors(lw: MoELayerWeights) -> dict[str, torch.Tensor]:
    """The tensors of ``lw`` indexed by expert slot, by field name: the weights, and the biases
    where the model has them (gpt-oss): what moves with an expert in :meth:`ExpertParallelCompute.rebalance`."""
    held = {"w_gate_up": lw.w_gate_up, "w_down": lw.w_down, "gate_up_bias": lw.gate_up_bias,
            "down_bias": lw.down_bias}
    return {name: t for name, t in held.items() if t is not None}


def _combine(y_pairs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, T: int, H: int,
             dtype: torch.dtype) -> torch.Tensor:
    """``sum_j w[t, j] * y[t, j]`` with the arithmetic of the local ``fused_moe``: pairs in expert
    order (stable), weighted in fp32, added into zeros with one ``index_add_``."""
    k = topk_ids.shape[1]
    out = torch.zeros((T, H), dtype=torch.float32, device=y_pairs.device)
    if T * k == 0:
        return out.to(dtype)
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    weights = topk_weights.reshape(-1).index_select(0, order).float()
    ys = y_pairs.index_select(0, order).float()
    out.index_add_(0, torch.div(order, k, rounding_mode="floor"), ys * weights[:, None])
    return out.to(dtype)


def rank_expert_ids(config: dict[str, Any], rank: int, world: int, redundant: int = 0) -> dict[int, list[int]] | None:
    """The logical experts rank ``rank`` of ``world`` holds under the initial placement (identity,
    or round-robin over ``E + redundant`` slots), per MoE layer of an HF ``config``; None for a
    dense model. What :func:`~kvbatch.engine.models.weights.load_checkpoint` takes as
    ``experts`` so a rank reads only its own experts."""
    from kvbatch.engine.models.config import MoEConfig

    moe = MoEConfig.from_hf(config)
    if moe is None:
        return None
    layers = int(config["num_hidden_layers"])
    slots = moe.num_experts + redundant
    if slots % world:
        raise ValueError(f"{moe.num_experts} experts + {redundant} redundant = {slots} slots do not split over "
                         f"{world} workers: choose --redundant-experts so the sum is a multiple of {world}")
    placement = identity_placement(layers, moe.num_experts, world, slots)
    return {li: sorted(set(placement.experts_on_rank(li, rank, world).tolist()))
            for li in range(layers) if moe.is_moe_layer(li)}


def install(model: Any, placement: Placement | None = None,
            group: dist.ProcessGroup | None = None) -> ExpertParallelCompute:
    """Put an :class:`ExpertParallelCompute` on ``model`` (its ``expert_compute``) and drop the
    model's full expert weights, which this rank no longer needs."""
    ep = ExpertParallelCompute(model.moe_layers, model.config.num_layers, placement, group)
    model.expert_compute = ep
    for lw in model.moe_layers.values():
        # Shapes stay [0, ...] so code that reads them sees no experts, not stale ones (the
        # expert biases too, where the model has them).
        for name, t in _expert_tensors(lw).items():
            setattr(lw, name, t.new_empty((0, *t.shape[1:])))
    return ep
