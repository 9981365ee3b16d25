"""Expert-parallel load balancing (EPLB): live expert loads, replica placement, balance metrics.

With expert parallelism every rank holds ``S / W`` expert *slots* and a MoE layer waits for its
slowest rank, so a few hot experts make the whole step wait. The balancer gives the hot experts
more replicas and spreads the replicas so each rank gets about the same number of tokens.

- :class:`ExpertLoadWindow` counts tokens per (layer, expert) over the last N steps; its
  :meth:`~ExpertLoadWindow.observe` plugs into ``model.routing_observers``.
- :func:`rebalance_experts` turns those loads into a :class:`Placement` (DeepSeek's convention:
  ``phy2log``, ``log2phy``, ``logcnt``). The algorithm follows deepseek-ai/EPLB (re-implemented,
  not copied): replicate the expert with the highest load per replica until the slots are used,
  then pack replicas onto ranks heaviest first, each into the lightest rank that still has room.
  The hierarchical form first packs expert groups onto nodes (so a token's experts stay on few
  nodes) and balances inside each node; the global form treats all ranks as one node.
- :func:`replica_choice` sends each (token, expert) pair to one replica of that expert.
- :func:`rank_loads` and :func:`balancedness` measure the result (mean / max rank load, 1 is perfect).

Two deliberate differences from DeepSeek's reference, both about never putting two replicas of
one expert on one rank (a second copy on the same rank holds more weights and balances nothing):

1. an expert gets at most one replica per rank of its node (the cap is lifted only when the
   slots cannot be filled otherwise, i.e. ``S / N > (E / N) * (W / N)``);
2. when the greedy would have to put a replica on a rank that already holds the expert, it swaps
   in an item from a full rank instead.

Guarantees (tested in tests/test_eplb.py): every expert has >= 1 replica; replicas sum to S;
each rank owns exactly S / W consecutive slots; ``phy2log``/``log2phy``/``logcnt`` agree; no rank
holds an expert twice whenever ``S / N <= (E / N) * (W / N)`` (always true for the global form
when ``S <= E * W``); the hierarchical form keeps each expert group on one node and each
expert's replicas on that node. With one slot per rank (S == W) the max rank load is the
smallest possible for S slots. The global form is never worse, layer by layer, than the
load-blind layout with the same S (slot i -> expert i % E, the identity when S == E): it keeps
that layout for a layer where the greedy loses to it (the greedy is a heuristic; it happens on
~1% of small random shapes). The hierarchical form has no such fallback (the load-blind layout
need not respect the node grouping).

A local search follows the greedy packing: swap an item of the heaviest rank with a lighter one
elsewhere while that lowers the heaviest rank.

Everything here is plain torch on whatever device the tensors live on; the placement search
runs on the CPU (it is small: a loop over layers x slots).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Placement:
    """Where each expert's replicas live, per MoE layer (DeepSeek's format).

    ``S`` physical slots over ``W`` ranks, rank-major: rank ``r`` owns slots
    ``[r * S / W, (r + 1) * S / W)``. Rows are indexed like the load they came from (with
    :class:`ExpertLoadWindow`, by the model's layer index; dense layers get a harmless placement).
    """

    phy2log: Tensor  # LongTensor[L, S]: slot -> logical expert
    log2phy: Tensor  # LongTensor[L, E, R]: logical expert -> its slots (ascending), -1 padded
    logcnt: Tensor  # LongTensor[L, E]: replicas per expert

    @classmethod
    def from_phy2log(cls, phy2log: Tensor, num_experts: int) -> Placement:
        """Builds ``log2phy`` and ``logcnt`` from the slot -> expert map (replica j of expert e
        is its j-th slot in ascending order)."""
        phy2log = phy2log.long()
        if phy2log.dim() != 2:
            raise ValueError(f"phy2log must be [layers, slots], got shape {tuple(phy2log.shape)}")
        if phy2log.numel() and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_experts):
            raise ValueError(f"phy2log holds an expert id outside [0, {num_experts})")
        num_layers, num_slots = phy2log.shape
        logcnt = torch.zeros(num_layers, num_experts, dtype=torch.long, device=phy2log.device)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        max_cnt = max(int(logcnt.max()) if logcnt.numel() else 0, 1)
        sorted_experts, slots = torch.sort(phy2log, dim=1, stable=True)
        starts = torch.cumsum(logcnt, dim=1) - logcnt
        replica = torch.arange(num_slots, device=phy2log.device) - starts.gather(1, sorted_experts)
        log2phy = torch.full((num_layers, num_experts * max_cnt), -1, dtype=torch.long, device=phy2log.device)
        log2phy.scatter_(1, sorted_experts * max_cnt + replica, slots)
        return cls(phy2log, log2phy.view(num_layers, num_experts, max_cnt), logcnt)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.logcnt.shape[1]

    def slots_per_rank(self, num_ranks: int) -> int:
        if num_ranks <= 0 or self.num_slots % num_ranks:
            raise ValueError(f"{self.num_slots} slots do not split evenly over {num_ranks} ranks")
        return self.num_slots // num_ranks

    def rank_of_slot(self, num_ranks: int) -> Tensor:
        """LongTensor[S]: the rank owning each slot."""
        return torch.arange(self.num_slots, device=self.phy2log.device) // self.slots_per_rank(num_ranks)

    def experts_on_rank(self, layer: int, rank: int, num_ranks: int) -> Tensor:
        """LongTensor[S / W]: the logical experts in rank ``rank``'s slots, in slot order."""
        per = self.slots_per_rank(num_ranks)
        return self.phy2log[layer, rank * per : (rank + 1) * per]

    def validate(self, num_ranks: int) -> None:
        """Raises ValueError unless the three maps agree and every expert has a replica."""
        self.slots_per_rank(num_ranks)
        rebuilt = Placement.from_phy2log(self.phy2log, self.num_experts)
        if not torch.equal(rebuilt.logcnt, self.logcnt):
            raise ValueError("logcnt does not count phy2log's replicas")
        if int(self.logcnt.min()) < 1:
            raise ValueError("an expert has no replica")
        width = self.log2phy.shape[-1]
        filled = torch.arange(width, device=self.logcnt.device) < self.logcnt.unsqueeze(-1)
        if width < rebuilt.log2phy.shape[-1] or not torch.equal(self.log2phy >= 0, filled):
            raise ValueError("log2phy must list logcnt slots per expert first, then -1")
        # The listed slots must be exactly the expert's slots (in any order).
        holds = self.phy2log.gather(1, self.log2phy.clamp(min=0).flatten(1)).view_as(self.log2phy)
        experts = torch.arange(self.num_experts, device=holds.device).view(1, -1, 1)
        if not bool((holds == experts)[filled].all()):
            raise ValueError("log2phy points at slots that hold another expert")


def identity_placement(num_layers: int, num_experts: int, num_ranks: int, num_slots: int | None = None) -> Placement:
    """The load-blind layout: slot i holds expert ``i % E`` (the identity when S == E), the
    same for every layer."""
    num_slots = num_experts if num_slots is None else num_slots
    if num_slots < num_experts or num_slots % num_ranks:
        raise ValueError(f"need S >= E and S % W == 0, got S={num_slots}, E={num_experts}, W={num_ranks}")
    row = torch.arange(num_slots) % num_experts
    return Placement.from_phy2log(row.expand(num_layers, num_slots).clone(), num_experts)


# ---------------------------------------------------------------------------------------------
# The placement search


def replicate(load: Tensor, num_slots: int, max_per_expert: int | None = None) -> Tensor:
    """LongTensor[X, n]: replicas per expert for each row of ``load`` [X, n], summing to ``num_slots``.

    Every expert starts with one replica; each further slot goes to the expert with the highest
    load per replica (first index on ties) that is below ``max_per_expert``. This greedy
    minimises the largest load per replica.
    """
    rows, n = load.shape
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    if max_per_expert is not None and n * max_per_expert < num_slots:
        max_per_expert = None  # the cap cannot be kept: fill the slots anyway
    load = load.double()
    counts = torch.ones(rows, n, dtype=torch.long)
    row_ids = torch.arange(rows)
    for _ in range(num_slots - n):
        score = load / counts
        if max_per_expert is not None:
            score = score.masked_fill(counts >= max_per_expert, float("-inf"))
        best = score.argmax(dim=1)
        counts[row_ids, best] += 1
    return counts


def pack(item_loads: list[float], item_keys: list[int], num_packs: int) -> list[list[int]]:
    """Packs items into ``num_packs`` packs of exactly ``len(items) / num_packs`` each, as even in
    total load as the greedy gets; returns each pack's item keys.

    Heaviest item first (ties: lower key first), each into the lightest pack with room that
    does not hold the same key yet (ties: lower pack index). When every pack with room already
    holds the key, one item is swapped out of a full pack that lacks it (such a swap exists
    whenever the key has at most ``num_packs`` items), so a key lands twice in one pack only
    when it has more items than there are packs. Items sharing a key are replicas of one
    expert and must weigh the same.
    """
    n = len(item_loads)
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    contents: list[list[int]] = [[] for _ in range(num_packs)]
    loads = [0.0] * num_packs
    item_load_of_key: dict[int, float] = {}
    open_heap = [(0.0, p) for p in range(num_packs)]  # (load, pack) of packs with room
    full: list[int] = []
    order = sorted(range(n), key=lambda i: (-item_loads[i], item_keys[i]))
    for i in order:
        w, key = item_loads[i], item_keys[i]
        if item_load_of_key.setdefault(key, w) != w:
            raise ValueError(f"items with key {key} weigh differently ({item_load_of_key[key]} and {w})")
        skipped = []
        target = None
        while open_heap:
            entry = heapq.heappop(open_heap)
            if key in contents[entry[1]]:
                skipped.append(entry)
            else:
                target = entry[1]
                break
        if target is None:  # every pack with room holds `key`: try to swap it into a full pack
            target = skipped.pop(0)[1]
            swap = _best_swap(target, key, w, contents, loads, full, item_load_of_key)
            if swap is not None:
                q, pos = swap
                moved = contents[q][pos]
                contents[q][pos] = key
                loads[q] += w - item_load_of_key[moved]
                key, w = moved, item_load_of_key[moved]  # `moved` now goes into `target`
        for entry in skipped:
            heapq.heappush(open_heap, entry)
        contents[target].append(key)
        loads[target] += w
        if len(contents[target]) < per_pack:
            heapq.heappush(open_heap, (loads[target], target))
        else:
            full.append(target)
    _improve(contents, loads, item_load_of_key, max_swaps=4 * n)
    return contents


def _improve(contents: list[list[int]], loads: list[float], item_load_of_key: dict[int, float], max_swaps: int) -> None:
    """Local search after the greedy: while swapping an item of the heaviest pack with a lighter
    item of another pack lowers the heaviest pack (and keeps keys unique per pack), do the swap
    that leaves the pair most even, trying the lightest packs first."""
    for _ in range(max_swaps):
        h = max(range(len(loads)), key=lambda p: (loads[p], -p))
        best = None
        for q in sorted(range(len(loads)), key=lambda p: (loads[p], p)):
            if loads[q] >= loads[h]:
                break
            gap = loads[h] - loads[q]
            for ia, a in enumerate(contents[h]):
                wa = item_load_of_key[a]
                if a in contents[q]:
                    continue
                for ib, b in enumerate(contents[q]):
                    delta = wa - item_load_of_key[b]
                    if 0 < delta < gap and b not in contents[h]:
                        new_max = max(loads[h] - delta, loads[q] + delta)
                        if best is None or new_max < best[0]:
                            best = (new_max, q, ia, ib, delta)
            if best is not None:
                break
        if best is None or best[0] >= loads[h] * (1 - 1e-12):
            return
        _, q, ia, ib, delta = best
        contents[h][ia], contents[q][ib] = contents[q][ib], contents[h][ia]
        loads[h] -= delta
        loads[q] += delta


def _best_swap(
    target: int, key: int, w: float, contents: list[list[int]], loads: list[float], full: list[int],
    item_load_of_key: dict[int, float],
) -> tuple[int, int] | None:
    """(full pack, position) whose item should move to ``target`` so ``key`` can take its place,
    choosing the swap with the smallest resulting max of the two packs; None when none exists."""
    best, best_cost = None, float("inf")
    for q in full:
        if key in contents[q]:
            continue
        for pos, other in enumerate(contents[q]):
            if other in contents[target]:
                continue
            wo = item_load_of_key[other]
            cost = max(loads[target] + wo, loads[q] - wo + w)
            if cost < best_cost:
                best, best_cost = (q, pos), cost
    return best


def _check_shape(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} < num_experts={num_experts}: every expert needs a slot")
    if num_gpus <= 0 or num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}")
    if num_nodes <= 0 or num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    if num_groups <= 0 or num_experts % num_groups:
        raise ValueError(f"num_experts={num_experts} must be a multiple of num_groups={num_groups}")


def rebalance_experts(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> Placement:
    """The placement for loads ``weight`` [L, E] on ``num_gpus`` ranks with ``num_replicas`` slots.

    Hierarchical when ``num_groups % num_nodes == 0`` (DeepSeek's rule: suits prefill, smaller
    EP): the ``num_groups`` contiguous expert groups are packed onto nodes (whole groups, equal
    numbers per node), then each node replicates its experts into ``S / N`` slots and packs them
    onto its ``W / N`` ranks. Otherwise global (suits decode, larger EP): one node, one group.
    Node ``k`` owns ranks ``[k * W / N, (k + 1) * W / N)``.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(weight.shape)}")
    if num_nodes <= 0 or num_groups <= 0:
        raise ValueError(f"num_nodes={num_nodes} and num_groups={num_groups} must be positive")
    if num_groups % num_nodes:
        num_groups = num_nodes = 1
    num_layers, num_experts = weight.shape
    _check_shape(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if num_replicas % num_nodes or num_experts % num_nodes:
        raise ValueError(f"slots and experts must split evenly over num_nodes={num_nodes}")
    load = weight.detach().double().cpu()
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes

    # Step 1: whole groups onto nodes, balancing the groups' summed load.
    group_load = load.view(num_layers, num_groups, group_size).sum(-1)
    node_experts = torch.empty(num_layers, num_nodes, experts_per_node, dtype=torch.long)
    for layer in range(num_layers):
        groups_by_node = pack(group_load[layer].tolist(), list(range(num_groups)), num_nodes)
        for node, groups in enumerate(groups_by_node):
            experts = [g * group_size + j for g in sorted(groups) for j in range(group_size)]
            node_experts[layer, node] = torch.tensor(experts)

    # Step 2: replicas inside each node; at most one per rank of the node while that can hold.
    local_load = load.gather(1, node_experts.view(num_layers, -1)).view(num_layers * num_nodes, experts_per_node)
    counts = replicate(local_load, slots_per_node, max_per_expert=gpus_per_node)

    # Step 3: replicas onto the node's ranks; ranks are node-major, slots rank-major.
    phy2log = torch.empty(num_layers, num_replicas, dtype=torch.long)
    for row in range(num_layers * num_nodes):
        layer, node = divmod(row, num_nodes)
        experts = node_experts[layer, node].tolist()
        cnt = counts[row].tolist()
        per_replica = (local_load[row] / counts[row]).tolist()
        item_loads = [per_replica[j] for j in range(experts_per_node) for _ in range(cnt[j])]
        item_keys = [experts[j] for j in range(experts_per_node) for _ in range(cnt[j])]
        ranks = pack(item_loads, item_keys, gpus_per_node)
        start = node * slots_per_node
        phy2log[layer, start : start + slots_per_node] = torch.tensor([e for r in ranks for e in sorted(r)])
    if num_nodes == 1:
        phy2log = _keep_better_than_load_blind(load, phy2log, num_experts, num_gpus)
    return Placement.from_phy2log(phy2log.to(weight.device), num_experts)


def _keep_better_than_load_blind(load: Tensor, phy2log: Tensor, num_experts: int, num_ranks: int) -> Tensor:
    """Per layer, the greedy's layout unless the load-blind one (slot i -> expert i % E) has a
    lighter heaviest rank: the heuristics can lose to it on small, odd shapes (about 1% of random
    cases), and a balancer should never make a layer worse than having none."""
    num_layers, num_slots = phy2log.shape
    blind = identity_placement(num_layers, num_experts, num_ranks, num_slots)
    ours = Placement.from_phy2log(phy2log, num_experts)
    peak_ours = rank_loads(load, ours, num_ranks).max(-1).values
    peak_blind = rank_loads(load, blind, num_ranks).max(-1).values
    use_blind = (peak_blind < peak_ours * (1 - 1e-9)).unsqueeze(1)
    return torch.where(use_blind, blind.phy2log, phy2log)


# ---------------------------------------------------------------------------------------------
# Routing tokens to replicas


def bucket_counts(ids: Tensor, buckets: int) -> Tensor:
    """``torch.bincount(ids, minlength=buckets)`` for ids in ``[0, buckets)``, on the ids' device
    without a host read: bincount sizes its output from ``ids.max()``, one device-to-host sync per
    call on CUDA, once per MoE layer here; a scatter-add into a fixed-size tensor needs none."""
    return torch.zeros(buckets, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def replica_choice(topk_ids: Tensor, placement: Placement, layer_idx: int, offset: int = 0) -> Tensor:
    """LongTensor like ``topk_ids`` [T, k]: the physical slot serving each (token, expert) pair.

    The i-th pair routed to expert e (in row-major order of ``topk_ids``) goes to replica
    ``(i + offset) % logcnt[e]``, so an expert's tokens split over its replicas with counts that
    differ by at most one, deterministically. Pass a different ``offset`` per rank or per step
    (e.g. the rank) so the remainders do not always land on replica 0. Ids < 0 (padding) map to -1.
    """
    flat = topk_ids.reshape(-1).long()
    num_experts = placement.num_experts
    logcnt = placement.logcnt[layer_idx].to(flat.device)
    log2phy = placement.log2phy[layer_idx].to(flat.device)
    valid = flat >= 0
    keyed = torch.where(valid, flat, num_experts)  # padding sorts last, into its own bucket
    sorted_ids, order = torch.sort(keyed, stable=True)
    per_expert = bucket_counts(keyed, num_experts + 1)
    starts = torch.cumsum(per_expert, 0) - per_expert
    nth_sorted = torch.arange(flat.numel(), device=flat.device) - starts[sorted_ids]
    nth = torch.empty_like(nth_sorted).scatter_(0, order, nth_sorted)
    expert = torch.where(valid, flat, 0)
    replica = (nth + offset) % logcnt[expert].clamp(min=1)
    slots = log2phy[expert, replica]
    return torch.where(valid, slots, -1).view(topk_ids.shape)


# ---------------------------------------------------------------------------------------------
# Live load statistics


class ExpertLoadWindow:
    """Tokens routed to each (layer, expert) over the last ``window_steps`` steps.

    ``observe(layer_idx, topk_ids)`` has the ``model.routing_observers`` signature. A step is
    one forward pass: a call whose ``layer_idx`` is not above the previous call's starts a new
    step (layers run in increasing order), or call :meth:`end_step` explicitly. The open step
    counts as one of the ``window_steps``. Counts stay on the device the ids come from (no
    host sync per layer). Rows are model layer indices, so ``num_layers`` is the model's layer
    count; dense layers just stay zero.
    """

    def __init__(self, num_layers: int, num_experts: int, window_steps: int = 1000):
        if window_steps < 1:
            raise ValueError("window_steps must be >= 1")
        self.num_layers, self.num_experts, self.window_steps = num_layers, num_experts, window_steps
        self._steps: deque[Tensor] = deque()
        self._total: Tensor | None = None
        self._last_layer: int | None = None
        self._step_open = False

    def observe(self, layer_idx: int, topk_ids: Tensor) -> None:
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx {layer_idx} outside [0, {self.num_layers})")
        if not self._step_open or (self._last_layer is not None and layer_idx <= self._last_layer):
            self._open_step(topk_ids.device)
        ids = topk_ids.reshape(-1).long()
        ids = torch.where(ids >= 0, ids, self.num_experts)  # -1 marks padding: its own bucket, dropped
        counts = bucket_counts(ids, self.num_experts + 1)[: self.num_experts]
        self._steps[-1][layer_idx] += counts
        self._total[layer_idx] += counts
        self._last_layer = layer_idx

    __call__ = observe

    def end_step(self) -> None:
        """Closes the open step; the next observation opens a new one."""
        self._step_open = False
        self._last_layer = None

    def _open_step(self, device: torch.device) -> None:
        if self._total is None:
            self._total = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long, device=device)
        if len(self._steps) == self.window_steps:
            self._total -= self._steps.popleft()
        self._steps.append(torch.zeros_like(self._total))
        self._step_open = True
        self._last_layer = None

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def load(self) -> Tensor:
        """LongTensor[L, E]: tokens per (layer, expert) summed over the window."""
        if self._total is None:
            return torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        return self._total.clone()

    def trace(self) -> Tensor:
        """LongTensor[steps, L, E]: the window's steps, oldest first (the simulator's ``--trace``)."""
        if not self._steps:
            return torch.zeros(0, self.num_layers, self.num_experts, dtype=torch.long)
        return torch.stack(list(self._steps)).cpu()

    def save(self, path: str) -> None:
        """Saves :meth:`trace` as a ``.pt`` (torch) or ``.npy`` (numpy) file."""
        trace = self.trace()
        if str(path).endswith(".npy"):
            import numpy as np

            np.save(path, trace.numpy())
        else:
            torch.save(trace, path)


# ---------------------------------------------------------------------------------------------
# Metrics


def rank_loads(load: Tensor, placement: Placement, num_ranks: int) -> Tensor:
    """FloatTensor[L, W]: load per rank, each expert's load split evenly over its replicas."""
    phy2log = placement.phy2log.to(load.device)
    per_slot = load.double().gather(1, phy2log) / placement.logcnt.to(load.device).gather(1, phy2log)
    return per_slot.view(load.shape[0], num_ranks, placement.slots_per_rank(num_ranks)).sum(-1)


def balancedness(rank_load: Tensor) -> Tensor:
    """FloatTensor[L]: mean / max rank load per layer (1 = perfectly even; 1 for an idle layer)."""
    peak = rank_load.max(dim=-1).values
    mean = rank_load.mean(dim=-1)
    return torch.where(peak > 0, mean / peak.clamp(min=1e-30), torch.ones_like(mean))


def balance_report(load: Tensor, before: Placement, after: Placement, num_ranks: int) -> dict[str, Any]:
    """Per-layer balancedness before and after a rebalance, for logs and the cost metrics.
    Layers with no load are left out of the means."""
    b = balancedness(rank_loads(load, before, num_ranks))
    a = balancedness(rank_loads(load, after, num_ranks))
    active = load.sum(-1) > 0
    mean = lambda t: float(t[active].mean()) if bool(active.any()) else 1.0  # noqa: E731
    return {
        "balancedness_before": b.tolist(),
        "balancedness_after": a.tolist(),
        "mean_balancedness_before": mean(b),
        "mean_balancedness_after": mean(a),
    }


def expert_load_records(load: Tensor, placement: Placement | None = None) -> list[dict[str, int]]:
    """The expert-load heatmap as rows ``{layer, expert, tokens, replicas}`` (one per cell), ready
    for a Parquet table; ``replicas`` is 1 everywhere without a placement."""
    load = load.cpu()
    counts = placement.logcnt.cpu() if placement is not None else torch.ones_like(load, dtype=torch.long)
    rows = []
    for layer in range(load.shape[0]):
        for expert in range(load.shape[1]):
            rows.append({
                "layer": layer, "expert": expert,
                "tokens": int(load[layer, expert]), "replicas": int(counts[layer, expert]),
            })
    return rows
