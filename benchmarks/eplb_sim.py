"""Predicts MoE step time and tokens/s under expert parallelism, with and without EPLB.

    python benchmarks/eplb_sim.py                          # synthetic skewed trace, DeepSeek-V3-like shape
    python benchmarks/eplb_sim.py --skew hot               # a few hot experts instead of Zipf
    python benchmarks/eplb_sim.py --trace load.pt          # [steps, L, E] saved by ExpertLoadWindow.save (.pt/.npy)
    python benchmarks/eplb_sim.py --bench ep.json          # calibrate on bench_expert_parallel.py's JSON and
                                                           # predict each measured W from a fit on the other
    python benchmarks/eplb_sim.py --calibrate --calibration-out calib.json   # time the expert GEMM here
    python benchmarks/eplb_sim.py --calibration calib.json --measured 'W=2:41.5,W=4:44.0'
    python benchmarks/eplb_sim.py --json out.json          # also save every figure

Prints, for W = 8, 16, 32, 64, 128, 256, 320 (``--ranks``), the predicted step time, tokens/s
and max/mean rank load without EPLB and with it. Without ``--calibration`` / ``--bench`` the
constants are uncalibrated guesses for an H200-class GPU cluster (the table says so).
``--measured`` adds predicted-vs-measured rows.

The model (every assumption; change any constant with a flag or the ``--calibration`` JSON):

- W ranks, each holding ``tokens_per_rank`` tokens per step (data-parallel attention, as in
  DeepSeek's EP serving; weak scaling), or ``global_batch_tokens`` split evenly over the W
  ranks when that is > 0 (strong scaling, as bench_expert_parallel.py runs it). Every token goes
  to ``top_k`` experts. All ranks run every layer.
- Loads come from a trace of per-step, per-layer expert counts. Only each step's *shares* are
  used: expert e in layer l gets ``share[l, e] * W * tokens_per_rank * top_k`` token copies at
  scale W (expected counts, fractional). A synthetic trace draws Poisson counts around a fixed
  skewed distribution per layer (Zipf, or a few hot experts), an expert's share capped at
  1 / top_k because a token's k experts are distinct. Layers that a recorded trace never routes
  (dense layers) are dropped.
- Slots: ``S`` = the smallest multiple of W that is >= E + ``redundant_slots`` +
  ``redundant_per_rank * W`` (DeepSeek used 32 redundant experts). Without EPLB slot i holds
  expert i mod E (the identity for the first E slots; with ``static_spare_slots`` the spare slots
  copy experts 0, 1, ... whatever their load: same memory, load-blind; without it the load-blind
  run has no spare slots, S = E rounded up to W, as the bench's runs without EPLB). With EPLB the
  placement is ``rebalance_experts`` on the summed load of the first half of the trace and is
  scored on the second half (it predicts the future from the past; a one-step trace is used for
  both). Hierarchical when ``num_groups % nodes == 0`` (nodes = W / gpus_per_node), otherwise
  global, as DeepSeek's rule says.
- An expert's tokens split evenly over its replicas (``replica_choice`` does that to within one).
- Expert compute: per layer, rank r computes ``layer_fixed_s + sum over its busy slots of
  (expert_fixed_s + per_token_s * tokens on the slot)``: a grouped GEMM costs a fixed part per
  non-empty expert (launch + reading the weights) plus a part per token. The layer waits for its
  slowest rank (the all-to-all after it synchronises), so a layer costs the *max* over ranks, and
  a step the *sum* over layers (not the max of per-rank sums).
- Host work, independent of the experts: ``step_fixed_s + step_per_token_s * tokens_per_rank``
  per step (scheduler, embedding, attention, sampling: what a W = 1 step costs beyond its expert
  GEMMs), and, when W > 1, ``ep_host_s`` per MoE layer per rank, independent of tokens: the
  exchange's bookkeeping (routing to slots, packing, unpacking, the host syncs on the counts)
  and, on a busy machine, the waiting for the slowest rank that the latency probe does not see.
- Host oversubscription: when ``host_cores`` > 0 all W ranks share that many cores (one machine),
  so host work and expert compute stretch by ``max(1, W / host_cores)``. 0 (the default) gives
  every rank its own cores, as a GPU cluster does.
- Communication, when W > 1. Each MoE layer runs ``stages_per_layer`` collectives in sequence:
  3 for kvbatch's exchange (a header all_to_all with the counts, the row dispatch, the combine),
  2 for a fused implementation that sends counts with the rows. Each costs the latency of a
  small collective at W; dispatch and combine also move the busiest rank's traffic at
  ``a2a_bandwidth_bytes_per_s``: the larger of what it sends (``tokens_per_rank * top_k`` rows)
  and what it receives (the token copies its slots serve), times ``hidden_size *
  bytes_per_element * (W - 1) / W`` (the local share stays). Each step adds
  ``step_collectives`` more small collectives (kvbatch: the closing all-idle header round of
  ``finish_step`` and the ``any_rank`` all_reduce of ``LockstepLLM``).
  The latency of a small collective at W is ``stage_latency_by_ranks_s[W]`` when measured there,
  else ``a2a_latency_s * ceil(log2 W)`` (``a2a_latency_growth`` "log2": a tree or butterfly) or
  ``a2a_latency_s * (W - 1)`` ("linear": gloo's pairwise exchange, which the CPU probe matches).
  No overlap of communication with compute (DeepSeek overlaps two micro-batches; this is the
  pessimistic bound), one bandwidth for all links (no NVLink / RDMA split), no network
  contention beyond the busiest rank, EPLB's weight migration not counted (it is amortised over
  thousands of steps).
- ``step_s`` is the whole step, every collective included; tokens/s = W * tokens_per_rank /
  step_s. ``timed_step_s`` leaves out the one collective that ``LockstepLLM``'s step timer does
  not cover (its ``any_rank`` all_reduce before the step): it is what the measured
  ``step_ms_median`` of the worker group is compared with.

Calibration against the real worker group (``--bench``, from ``bench_expert_parallel.py``):
measured inputs are the expert GEMM fit (below) on the tiny model's expert shape, single-process
(W = 1) step times at each per-rank batch (giving ``step_fixed_s`` and ``step_per_token_s``
after the predicted expert compute is taken out), the latency of a small gloo all_to_all at each
W (``stage_latency_by_ranks_s``: the period of a chain of them issued back to back, as the
exchange issues them; on an oversubscribed host it includes the scheduling of all W ranks, which
the latency after a barrier misses: ``--latency-probe``), the bandwidth, the core count, and the
W = 1 routing trace.
The one free constant, ``ep_host_s``, is fitted on ONE measured W (its step time without EPLB;
the step is linear in it), then every other measured W, and EPLB at every W, is a prediction:
the table shows fit-on-2-predict-4 and fit-on-4-predict-2 with the errors. A point is never
reported as a prediction of the fit that used it.

Calibration of the expert GEMM (``--calibrate``): times one expert's grouped GEMM (SiLU(x Wg) *
(x Wu) then Wd, via ``kvbatch.kernels.dispatch.fused_moe`` when it exists, else the same math
inline) for token counts 1..512 in this process, fp32 on the CPU, on the expert shape given by
``--hidden-size`` / ``--moe-intermediate-size`` (default a tiny 128 x 256), fits ``time =
expert_fixed_s + per_token_s * n`` (Theil-Sen: robust to the odd slow sample), and uses (or
writes) the fit together with the shape it was measured on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvbatch.engine.parallel.eplb import (  # noqa: E402
    Placement,
    identity_placement,
    rebalance_experts,
)

DEFAULT_RANKS = (8, 16, 32, 64, 128, 256, 320)


@dataclass
class SimConfig:
    """The model shape, the batch and the calibration constants (seconds, bytes)."""

    num_experts: int = 256
    top_k: int = 8
    num_layers: int = 58  # MoE layers (synthetic traces only; a recorded trace brings its own)
    hidden_size: int = 7168
    moe_intermediate_size: int = 2048  # recorded for reference; the constants below already include it
    tokens_per_rank: int = 128
    bytes_per_element: float = 1.0  # fp8 dispatch, as DeepSeek; 2 for bf16
    redundant_slots: int = 32
    redundant_per_rank: int = 0  # more spare slots per rank (the bench gives EPLB 2 W)
    static_spare_slots: bool = True  # without EPLB, keep the spare slots (load-blind copies); False: S = E
    global_batch_tokens: int = 0  # > 0: this many tokens split over the W ranks instead of tokens_per_rank each
    num_groups: int = 8  # expert groups (DeepSeek-V3: 8); hierarchical when it divides the node count
    gpus_per_node: int = 8
    per_token_s: float = 0.15e-6  # one token copy through one expert (3 GEMMs, ~88 MFLOP at ~600 TFLOP/s)
    expert_fixed_s: float = 12e-6  # per non-empty expert: ~44 MB of fp8 weights at ~4 TB/s
    layer_fixed_s: float = 60e-6  # per layer and rank: attention, router, shared expert, launches
    step_fixed_s: float = 1e-3  # per step and rank, host: scheduler, sampling, launches outside the layers
    step_per_token_s: float = 0.0  # per step and rank, per token of its batch, outside the experts
    ep_host_s: float = 50e-6  # per MoE layer and rank when W > 1: the exchange's host bookkeeping and syncs
    host_cores: int = 0  # > 0: all ranks share this many host cores (one machine); 0: each rank has its own
    stages_per_layer: int = 3  # collectives per MoE layer: header, dispatch, combine (2 when fused)
    step_collectives: int = 2  # per step: finish_step's closing header round, any_rank's all_reduce
    a2a_latency_s: float = 10e-6  # small-collective latency unit: per log2(W) stage, or per peer ("linear")
    a2a_latency_growth: str = "log2"  # "log2" (tree / butterfly) or "linear" (gloo's pairwise exchange)
    stage_latency_by_ranks_s: dict[str, float] = field(default_factory=dict)  # measured at W (overrides the law)
    a2a_bandwidth_bytes_per_s: float = 40e9  # per rank (RDMA-class)

    @classmethod
    def load(cls, path: str) -> SimConfig:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"calibration"})
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})


    def tokens_per_rank_at(self, num_ranks: int) -> float:
        return self.global_batch_tokens / num_ranks if self.global_batch_tokens > 0 else float(self.tokens_per_rank)

    def host_slowdown(self, num_ranks: int) -> float:
        """How much host work stretches when W ranks share ``host_cores`` cores."""
        return max(1.0, num_ranks / self.host_cores) if self.host_cores > 0 else 1.0

    def collective_latency_s(self, num_ranks: int) -> float:
        """One small collective (a header all_to_all, an all_reduce) at W ranks."""
        if num_ranks == 1:
            return 0.0
        measured = self.stage_latency_by_ranks_s.get(str(num_ranks))
        if measured is not None:
            return float(measured)
        if self.a2a_latency_growth == "log2":
            return self.a2a_latency_s * math.ceil(math.log2(num_ranks))
        if self.a2a_latency_growth == "linear":
            return self.a2a_latency_s * (num_ranks - 1)
        raise ValueError(f"a2a_latency_growth {self.a2a_latency_growth!r}: expected 'log2' or 'linear'")


@dataclass
class Prediction:
    num_ranks: int
    num_slots: int
    step_s: float  # the whole step, every collective included
    tokens_per_s: float
    max_over_mean_rank_load: float  # mean over steps and layers of max / mean rank tokens
    compute_s: float  # per step: sum over layers of the slowest rank's expert compute (stretched)
    host_s: float  # per step: step_fixed + per-token host work + ep_host per MoE layer (stretched)
    a2a_s: float  # per step: every collective, latency and payload
    timed_step_s: float  # step_s less the any_rank all_reduce that LockstepLLM's timer leaves out
    policy: str


# ---------------------------------------------------------------------------------------------
# Traces


def cap_shares(share: torch.Tensor, top_k: int) -> torch.Tensor:
    """Caps each expert's share of token copies at 1 / top_k (a token's k experts are distinct),
    handing the excess to the uncapped experts in proportion."""
    share = share / share.sum(-1, keepdim=True)
    cap = 1.0 / top_k
    for _ in range(64):
        over = share > cap + 1e-12
        if not bool(over.any()):
            break
        excess = (share - cap).clamp(min=0).sum(-1, keepdim=True)
        free = torch.where(over, torch.zeros_like(share), share)
        share = torch.where(over, torch.full_like(share, cap), share + excess * free / free.sum(-1, keepdim=True))
    return share


def synthetic_trace(
    steps: int, num_layers: int, num_experts: int, top_k: int, *, skew: str = "zipf", zipf_s: float = 0.8,
    hot_experts: int = 4, hot_share: float = 0.4, tokens_per_step: int = 8192, seed: int = 0,
) -> torch.Tensor:
    """LongTensor[steps, L, E]: Poisson counts around a fixed skewed share per layer (which
    experts are hot differs per layer and stays put across steps)."""
    g = torch.Generator().manual_seed(seed)
    if skew == "zipf":
        base = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf_s
    elif skew == "hot":
        hot = min(hot_experts, num_experts)
        base = torch.full((num_experts,), (1 - hot_share) / max(num_experts - hot, 1), dtype=torch.float64)
        base[:hot] = hot_share / hot
    elif skew == "uniform":
        base = torch.ones(num_experts, dtype=torch.float64)
    else:
        raise ValueError(f"unknown skew {skew!r} (zipf, hot, uniform)")
    shares = torch.stack([base[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)])
    shares = cap_shares(shares, top_k)
    rate = (shares * tokens_per_step * top_k).expand(steps, num_layers, num_experts)
    return torch.poisson(rate.contiguous(), generator=g).long()


def load_trace(path: str) -> torch.Tensor:
    """A recorded [steps, L, E] (or [L, E]) count tensor from ``.pt`` or ``.npy``."""
    if path.endswith(".npy"):
        import numpy as np

        trace = torch.from_numpy(np.load(path))
    else:
        trace = torch.load(path, map_location="cpu", weights_only=True)
    if trace.dim() == 2:
        trace = trace.unsqueeze(0)
    if trace.dim() != 3:
        raise ValueError(f"{path}: expected [steps, layers, experts], got shape {tuple(trace.shape)}")
    return trace.double()


def drop_unrouted_layers(trace: torch.Tensor) -> torch.Tensor:
    """The trace without the layers nothing was routed in (dense layers keep zero rows in
    ``ExpertLoadWindow``; they have no experts to place or exchange)."""
    routed = trace.sum(dim=(0, 2)) > 0
    return trace[:, routed] if bool(routed.any()) else trace


def split_trace(trace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(history [L, E] the balancer sees, the steps it is scored on)."""
    if trace.shape[0] == 1:
        return trace[0], trace
    half = trace.shape[0] // 2
    return trace[:half].sum(0), trace[half:]


# ---------------------------------------------------------------------------------------------
# The model


def num_slots_for(cfg: SimConfig, num_ranks: int, spare: bool = True) -> int:
    need = cfg.num_experts + (cfg.redundant_slots + cfg.redundant_per_rank * num_ranks if spare else 0)
    return max(math.ceil(need / num_ranks), 1) * num_ranks


def placements_for(cfg: SimConfig, history: torch.Tensor, num_ranks: int, policy: str = "auto") -> tuple[Placement, Placement, str]:
    """(load-blind placement, EPLB placement, the EPLB policy used) at W = num_ranks.

    ``policy``: "auto" (DeepSeek's rule: hierarchical when the groups split over the nodes),
    "global" or "hierarchical" (falls back to global where the shapes do not allow it)."""
    num_layers, num_experts = history.shape
    slots = num_slots_for(cfg, num_ranks)
    static = identity_placement(num_layers, num_experts, num_ranks, num_slots_for(cfg, num_ranks, cfg.static_spare_slots))
    nodes = max(num_ranks // cfg.gpus_per_node, 1) if num_ranks % cfg.gpus_per_node == 0 else 1
    groups = cfg.num_groups if num_experts % cfg.num_groups == 0 else 1
    hierarchical = groups % nodes == 0 and nodes > 1 and slots % nodes == 0 and num_experts % nodes == 0
    hierarchical = hierarchical and policy != "global"
    if hierarchical:
        eplb = rebalance_experts(history, slots, groups, nodes, num_ranks)
        policy = f"hierarchical ({nodes} nodes)"
    else:
        eplb = rebalance_experts(history, slots, 1, 1, num_ranks)
        policy = "global"
    return static, eplb, policy


def payload_s(cfg: SimConfig, num_ranks: int, rows: torch.Tensor) -> torch.Tensor:
    """Bandwidth time of one all-to-all moving ``rows`` hidden vectors from/to the busiest rank."""
    if num_ranks == 1:
        return torch.zeros_like(rows)
    remote = (num_ranks - 1) / num_ranks
    return rows * cfg.hidden_size * cfg.bytes_per_element * remote / cfg.a2a_bandwidth_bytes_per_s


def predict(cfg: SimConfig, steps: torch.Tensor, placement: Placement, num_ranks: int, policy: str = "") -> Prediction:
    """The predicted mean step over ``steps`` [N, L, E] (counts; only their shares matter)."""
    n, num_layers, num_experts = steps.shape
    tokens_per_rank = cfg.tokens_per_rank_at(num_ranks)
    copies = num_ranks * tokens_per_rank * cfg.top_k
    totals = steps.sum(-1, keepdim=True)
    share = torch.where(totals > 0, steps / totals.clamp(min=1e-30), torch.full_like(steps, 1.0 / num_experts))
    expert_tokens = share * copies  # [N, L, E]
    phy2log = placement.phy2log.expand(n, num_layers, -1)
    per_replica = expert_tokens / placement.logcnt.double()  # [N, L, E]
    slot_tokens = per_replica.gather(-1, phy2log)  # [N, L, S]
    per_rank = slot_tokens.view(n, num_layers, num_ranks, -1)
    rank_tokens = per_rank.sum(-1)  # [N, L, W]
    busy = (per_rank > 0).sum(-1).double()
    slow = cfg.host_slowdown(num_ranks)
    compute = cfg.layer_fixed_s + cfg.expert_fixed_s * busy + cfg.per_token_s * rank_tokens
    layer_compute = slow * compute.max(-1).values  # [N, L]: the slowest rank sets the pace
    sent = torch.full_like(layer_compute, tokens_per_rank * cfg.top_k)
    rows = torch.maximum(sent, rank_tokens.max(-1).values)
    latency = cfg.collective_latency_s(num_ranks)  # 0 at W = 1: no exchange, no collectives
    distributed = num_ranks > 1
    layer_a2a = cfg.stages_per_layer * latency + 2 * payload_s(cfg, num_ranks, rows)  # dispatch + combine carry rows
    host = slow * (cfg.step_fixed_s + cfg.step_per_token_s * tokens_per_rank
                   + (num_layers * cfg.ep_host_s if distributed else 0.0))
    a2a = layer_a2a.sum(-1) + (cfg.step_collectives * latency if distributed else 0.0)  # [N]
    step = layer_compute.sum(-1) + host + a2a  # [N]
    mean_rank = rank_tokens.mean(-1).clamp(min=1e-30)
    step_s = float(step.mean())
    untimed = latency if distributed and cfg.step_collectives > 0 else 0.0
    return Prediction(
        num_ranks=num_ranks, num_slots=placement.num_slots, step_s=step_s,
        tokens_per_s=num_ranks * tokens_per_rank / step_s,
        max_over_mean_rank_load=float((rank_tokens.max(-1).values / mean_rank).mean()),
        compute_s=float(layer_compute.sum(-1).mean()), host_s=host, a2a_s=float(a2a.mean()),
        timed_step_s=step_s - untimed, policy=policy,
    )


def simulate(cfg: SimConfig, trace: torch.Tensor, ranks: list[int], policy: str = "auto") -> list[tuple[Prediction, Prediction]]:
    """(without EPLB, with EPLB) for each W in ``ranks``."""
    if trace.shape[-1] != cfg.num_experts:
        raise ValueError(f"trace has {trace.shape[-1]} experts, config says {cfg.num_experts}")
    history, scored = split_trace(trace.double())
    out = []
    for w in ranks:
        static, eplb, used = placements_for(cfg, history, w, policy)
        out.append((predict(cfg, scored, static, w, "none"), predict(cfg, scored, eplb, w, used)))
    return out


# ---------------------------------------------------------------------------------------------
# Calibration (one process, this machine)


def _expert_fn():
    """(callable(x, w_gate_up, w_down) -> y, name): the grouped-expert GEMM for one expert."""
    try:
        from kvbatch.kernels.dispatch import fused_moe
    except ImportError:
        fused_moe = None
    if fused_moe is not None:
        def run(x, w_gate_up, w_down):
            ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
            return fused_moe(x, w_gate_up, w_down, ids, torch.ones(x.shape[0], 1, dtype=x.dtype))

        return run, "kvbatch.kernels.dispatch.fused_moe"

    def inline(x, w_gate_up, w_down):
        gate, up = (x @ w_gate_up[0].T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w_down[0].T

    return inline, "inline SiLU-GLU expert (fused_moe not available)"


def theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of a line robust to outliers: the median of the pairwise slopes, then
    the median intercept (a shared machine throws the odd 10x sample)."""
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i])
    slope = slopes[len(slopes) // 2] if slopes else 0.0
    intercepts = sorted(y - slope * x for x, y in zip(xs, ys))
    return intercepts[len(intercepts) // 2], slope


def calibrate(hidden: int = 128, intermediate: int = 256, token_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
              repeats: int = 15) -> dict[str, Any]:
    """Times one expert's GEMM vs token count here and fits ``expert_fixed_s + per_token_s * n``."""
    torch.manual_seed(0)
    fn, name = _expert_fn()
    w_gate_up = torch.randn(1, 2 * intermediate, hidden) * 0.05
    w_down = torch.randn(1, hidden, intermediate) * 0.05
    inputs = {n: torch.randn(n, hidden) for n in token_counts}
    samples: dict[int, list[float]] = {n: [] for n in token_counts}
    for n in token_counts:
        fn(inputs[n], w_gate_up, w_down)  # warm-up
    for _ in range(repeats):  # interleaved, so a burst of contention hits every size alike
        for n in token_counts:
            t0 = time.perf_counter()
            fn(inputs[n], w_gate_up, w_down)
            samples[n].append(time.perf_counter() - t0)
    points = [(n, sorted(samples[n])[len(samples[n]) // 2]) for n in token_counts]
    fixed, per_token = theil_sen([float(n) for n, _ in points], [t for _, t in points])
    return {
        "hidden_size": hidden, "moe_intermediate_size": intermediate,
        "expert_fixed_s": max(fixed, 0.0), "per_token_s": max(per_token, 0.0),
        "calibration": {
            "what": name, "threads": torch.get_num_threads(), "dtype": "float32",
            "median_s_by_tokens": {str(n): t for n, t in points},
        },
    }


# ---------------------------------------------------------------------------------------------
# Calibration against the worker group (bench_expert_parallel.py's JSON)


@dataclass
class BenchCalibration:
    """What one bench run measured, turned into a config with every constant but ``ep_host_s``."""

    cfg: SimConfig
    trace: torch.Tensor  # [steps, MoE layers, E], recorded at W = 1
    measured_s: dict[int, float]  # W -> median step without EPLB (LockstepLLM's timer)
    measured_eplb_s: dict[int, float]  # W -> median step with EPLB, after the first rebalance
    source: str


def fit_host_per_step(cfg: SimConfig, trace: torch.Tensor, w1_step_s_by_tokens: dict[int, float]) -> SimConfig:
    """``step_fixed_s`` and ``step_per_token_s`` from single-process steps at several batch sizes:
    each measured step less the predicted expert compute of its batch, fitted to a line in the
    batch size (one batch size: the slope stays 0)."""
    _, scored = split_trace(trace.double())
    num_layers, num_experts = scored.shape[1:]
    local = identity_placement(num_layers, num_experts, 1)
    bare = dataclasses.replace(cfg, step_fixed_s=0.0, step_per_token_s=0.0)
    xs, ys = [], []
    for n, measured in sorted(w1_step_s_by_tokens.items()):
        expert_s = predict(dataclasses.replace(bare, global_batch_tokens=n), scored, local, 1).step_s
        xs.append(float(n))
        ys.append(measured - expert_s)
    fixed, per_token = theil_sen(xs, ys) if len(xs) > 1 else (ys[0], 0.0)
    return dataclasses.replace(cfg, step_fixed_s=fixed, step_per_token_s=per_token)


LATENCY_PROBES = ("loop", "barrier", "after_work")  # how bench_expert_parallel.py timed a small all_to_all


def load_bench(path: str, latency_probe: str = "loop") -> BenchCalibration:
    """The measured constants, trace and step times of a ``bench_expert_parallel.py --json`` file.

    ``latency_probe`` picks which reading of the small all_to_all at each W is the collective
    latency: "loop" (the period of a chain issued back to back, as the exchange issues them; the
    default), "barrier" (the median after a barrier: the collective alone), "after_work" (the
    median after 100 us of host work on every rank: includes waiting for late ranks)."""
    bench = json.loads(Path(path).read_text())
    if "sim_calibration" not in bench:
        raise ValueError(f"{path}: no sim_calibration (was the bench run with --no-probe?)")
    calib = bench["sim_calibration"]
    meta = calib.get("calibration", {})
    known = {f.name for f in dataclasses.fields(SimConfig)}
    cfg = SimConfig(**{k: v for k, v in calib.items() if k in known})
    key = {"loop": "loop_s", "barrier": "small_s", "after_work": "after_work_s"}[latency_probe]
    missing = [w for w, pr in meta["probes"].items() if key not in pr]
    if missing:
        raise ValueError(f"{path}: no {latency_probe!r} latency reading at W={missing} (an older bench file?)")
    cfg.stage_latency_by_ranks_s = {w: pr[key] for w, pr in meta["probes"].items()}
    trace_path = meta.get("trace")
    if not trace_path or not Path(trace_path).exists():
        raise ValueError(f"{path}: the routing trace {trace_path!r} it names is missing")
    trace = drop_unrouted_layers(load_trace(trace_path))
    cfg = dataclasses.replace(cfg, num_layers=trace.shape[1], num_experts=trace.shape[2])
    cfg = fit_host_per_step(cfg, trace, {int(n): s for n, s in meta["w1_step_s_by_tokens"].items()})
    runs = [r for r in bench["runs"] if r["workers"] > 1]
    return BenchCalibration(
        cfg=cfg, trace=trace, source=f"{path} (trace {trace_path}, {trace.shape[0]} steps; latency probe {latency_probe})",
        measured_s={r["workers"]: r["step_ms_median"] / 1e3 for r in runs if not r["eplb"]},
        measured_eplb_s={r["workers"]: r["step_ms_median"] / 1e3 for r in runs if r["eplb"]},
    )


def fit_ep_host_s(cfg: SimConfig, trace: torch.Tensor, num_ranks: int, measured_timed_s: float) -> float:
    """The ``ep_host_s`` that makes the predicted timed step without EPLB at ``num_ranks`` equal
    the measured one (the step is linear in it). Negative means the rest of the model already
    over-predicts that point; it is returned as is, not clipped, so the report shows it."""
    history, scored = split_trace(trace.double())
    static, _, _ = placements_for(cfg, history, num_ranks)
    at = [predict(dataclasses.replace(cfg, ep_host_s=v), scored, static, num_ranks).timed_step_s for v in (0.0, 1e-3)]
    return (measured_timed_s - at[0]) / ((at[1] - at[0]) / 1e-3)


def cross_validate(bc: BenchCalibration, policy: str = "auto") -> list[dict[str, Any]]:
    """For each measured W: fit ``ep_host_s`` there, predict every measured W with and without
    EPLB. Rows say whether the no-EPLB figure was the fitted one or a prediction (EPLB figures
    are always predictions: no fit uses them)."""
    rows = []
    ranks = sorted(bc.measured_s)
    for fit_w in ranks:
        ep_host = fit_ep_host_s(bc.cfg, bc.trace, fit_w, bc.measured_s[fit_w])
        cfg = dataclasses.replace(bc.cfg, ep_host_s=ep_host)
        for w, (none, eplb) in zip(ranks, simulate(cfg, bc.trace, ranks, policy)):
            rows.append({
                "fit_on": fit_w, "num_ranks": w, "role": "fitted" if w == fit_w else "predicted",
                "ep_host_s": ep_host, "measured_step_ms": bc.measured_s[w] * 1e3,
                "predicted_step_ms": none.timed_step_s * 1e3,
                "measured_eplb_step_ms": bc.measured_eplb_s[w] * 1e3 if w in bc.measured_eplb_s else None,
                "predicted_eplb_step_ms": eplb.timed_step_s * 1e3,
                "predicted_compute_ms": none.compute_s * 1e3, "predicted_host_ms": none.host_s * 1e3,
                "predicted_collectives_ms": none.a2a_s * 1e3, "predicted_full_step_ms": none.step_s * 1e3,
                "predicted_tokens_per_s": none.tokens_per_s,
            })
    return rows


def _err(pred: float, measured: float | None) -> str:
    return f"{(pred - measured) / measured:+7.1%}" if measured else f"{'-':>7}"


def print_cross_validation(bc: BenchCalibration, rows: list[dict[str, Any]]) -> None:
    c = bc.cfg
    lat = ", ".join(f"W={w}: {v * 1e6:.0f} us" for w, v in sorted(c.stage_latency_by_ranks_s.items(), key=lambda kv: int(kv[0])))
    print(f"calibrated on {bc.source}")
    print(f"  measured: expert GEMM {c.expert_fixed_s * 1e6:.1f} us + {c.per_token_s * 1e6:.3f} us/token; "
          f"host per step {c.step_fixed_s * 1e3:.3f} ms + {c.step_per_token_s * 1e6:.2f} us/token (W=1 steps less "
          f"their expert GEMMs); small collective {lat}; {c.a2a_bandwidth_bytes_per_s / 1e9:.2f} GB/s; "
          f"host_cores={c.host_cores}")
    print(f"  model: {c.stages_per_layer} collectives per MoE layer x {c.num_layers} layers + {c.step_collectives} per step; "
          f"global batch {c.global_batch_tokens} tokens split over W; E={c.num_experts} top_k={c.top_k} H={c.hidden_size}")
    print("  fitted: ep_host_s on ONE measured W without EPLB; every other row is a prediction")
    print(f"{'fit on':>6} {'W':>3} {'role':>9} | {'measured ms':>11} {'predicted':>9} {'error':>7} | "
          f"{'EPLB measured':>13} {'predicted':>9} {'error':>7} | ep_host_s  (compute / host / collectives ms)")
    for r in rows:
        print(f"{'W=%d' % r['fit_on']:>6} {r['num_ranks']:>3} {r['role']:>9} | {r['measured_step_ms']:11.3f} "
              f"{r['predicted_step_ms']:9.3f} {_err(r['predicted_step_ms'], r['measured_step_ms'])} | "
              f"{(r['measured_eplb_step_ms'] or float('nan')):13.3f} {r['predicted_eplb_step_ms']:9.3f} "
              f"{_err(r['predicted_eplb_step_ms'], r['measured_eplb_step_ms'])} | {r['ep_host_s'] * 1e6:7.0f} us  "
              f"({r['predicted_compute_ms']:.2f} / {r['predicted_host_ms']:.2f} / {r['predicted_collectives_ms']:.2f})")


# ---------------------------------------------------------------------------------------------
# The command


def parse_measured(text: str) -> dict[int, float]:
    """'W=2:41.5,W=4:44' -> {2: 41.5, 4: 44.0} (milliseconds per step)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            w, ms = part.split(":")
            out[int(w.strip().removeprefix("W=").removeprefix("w="))] = float(ms)
        except ValueError as exc:
            raise ValueError(f"--measured: cannot read {part!r}; expected 'W=2:41.5,W=4:44'") from exc
    return out


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="recorded [steps, L, E] counts (.pt or .npy) from ExpertLoadWindow.save")
    p.add_argument("--skew", default="zipf", choices=["zipf", "hot", "uniform"], help="synthetic trace shape")
    p.add_argument("--zipf-s", type=float, default=0.8, help="Zipf exponent of the expert shares")
    p.add_argument("--policy", default="auto", choices=["auto", "global", "hierarchical"],
                   help="EPLB form; auto = DeepSeek's rule (hierarchical when num_groups %% nodes == 0)")
    p.add_argument("--hot-experts", type=int, default=4)
    p.add_argument("--hot-share", type=float, default=0.4, help="share of token copies the hot experts take together")
    p.add_argument("--steps", type=int, default=32, help="synthetic trace steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)), help="W values, comma-separated")
    p.add_argument("--calibration", help="JSON with any SimConfig fields (e.g. from --calibration-out)")
    p.add_argument("--calibrate", action="store_true", help="measure the expert GEMM here and use the fit")
    p.add_argument("--calibration-out", help="write the config used (with the calibration) to this JSON")
    p.add_argument("--measured", help="measured step times, e.g. 'W=2:41.5,W=4:44.0' (ms)")
    p.add_argument("--json", help="write every prediction to this JSON")
    p.add_argument("--bench", help="bench_expert_parallel.py --json output: calibrate on it, fit on each measured W "
                                   "in turn and predict the others (replaces the W table)")
    p.add_argument("--latency-probe", default="loop", choices=LATENCY_PROBES,
                   help="with --bench: which probe reading is the collective latency (see load_bench)")
    for f in dataclasses.fields(SimConfig):
        if isinstance(f.default, dict) or f.default is dataclasses.MISSING:
            continue  # measured tables come from the --calibration JSON
        kind = _parse_bool if isinstance(f.default, bool) else type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None, help=f"(default {f.default})")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> tuple[SimConfig, dict[str, Any] | None]:
    cfg = SimConfig.load(args.calibration) if args.calibration else SimConfig()
    measured_here = None
    if args.calibrate:  # on the shape given by the flags, else a tiny one
        measured_here = calibrate(hidden=args.hidden_size or 128, intermediate=args.moe_intermediate_size or 256)
        cfg = dataclasses.replace(cfg, **{k: v for k, v in measured_here.items() if k != "calibration"})
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig) if getattr(args, f.name, None) is not None}
    return dataclasses.replace(cfg, **overrides), measured_here


def _row(pred: Prediction) -> str:
    return f"{pred.step_s * 1e3:9.3f} {pred.tokens_per_s:12,.0f} {pred.max_over_mean_rank_load:8.2f}"


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    args = parse_args(argv)
    if args.bench:
        return main_bench(args)
    cfg, calib = build_config(args)
    if args.trace:
        trace = drop_unrouted_layers(load_trace(args.trace))
        cfg = dataclasses.replace(cfg, num_experts=trace.shape[-1], num_layers=trace.shape[1])
        source = f"trace {args.trace} ({trace.shape[0]} steps)"
    else:
        trace = synthetic_trace(args.steps, cfg.num_layers, cfg.num_experts, cfg.top_k, skew=args.skew,
                                zipf_s=args.zipf_s, hot_experts=args.hot_experts, hot_share=args.hot_share, seed=args.seed)
        source = f"synthetic {args.skew} trace ({args.steps} steps, seed {args.seed})"
    if calib:
        c = calib["calibration"]
        print(f"calibrated here ({c['what']}, {c['threads']} thread(s), H={calib['hidden_size']}, "
              f"I={calib['moe_intermediate_size']}): expert_fixed_s={cfg.expert_fixed_s:.3e} per_token_s={cfg.per_token_s:.3e}")
    if args.calibration_out:
        data = dataclasses.asdict(cfg) | ({"calibration": calib["calibration"]} if calib else {})
        Path(args.calibration_out).write_text(json.dumps(data, indent=2) + "\n")
    if not (args.calibration or args.calibrate):
        print("constants: UNCALIBRATED guesses for an H200-class GPU cluster with RDMA (defaults), not measurements")
    print(f"{source}; E={cfg.num_experts} top_k={cfg.top_k} layers={cfg.num_layers} H={cfg.hidden_size} "
          f"tokens/rank={cfg.tokens_per_rank} redundant>={cfg.redundant_slots}; {cfg.stages_per_layer} collectives "
          f"per MoE layer + {cfg.step_collectives} per step")
    ranks = [int(w) for w in args.ranks.split(",") if w.strip()]
    results = simulate(cfg, trace, ranks, args.policy)
    print(f"{'W':>4} {'S':>5} | {'no EPLB: step ms':>16} {'tokens/s':>12} {'max/mean':>8} | "
          f"{'EPLB: step ms':>13} {'tokens/s':>12} {'max/mean':>8} | speedup  policy")
    for none, eplb in results:
        print(f"{none.num_ranks:>4} {none.num_slots:>5} | {_row(none):>38} | {_row(eplb):>35} | "
              f"{none.step_s / eplb.step_s:6.2f}x  {eplb.policy}")
    measured_rows = []
    if args.measured:
        measured = parse_measured(args.measured)
        print("\npredicted vs measured (ms per step, as LockstepLLM times it: without the any_rank all_reduce)")
        print(f"{'W':>4} {'measured':>9} {'pred no EPLB':>13} {'error':>7} {'pred EPLB':>10}")
        for (w, ms), (none, eplb) in zip(measured.items(), simulate(cfg, trace, list(measured), args.policy)):
            err = (none.timed_step_s * 1e3 - ms) / ms
            print(f"{w:>4} {ms:9.3f} {none.timed_step_s * 1e3:13.3f} {err:+7.1%} {eplb.timed_step_s * 1e3:10.3f}")
            measured_rows.append({"num_ranks": w, "measured_step_ms": ms,
                                  "predicted_no_eplb_step_ms": none.timed_step_s * 1e3,
                                  "predicted_eplb_step_ms": eplb.timed_step_s * 1e3})
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": dataclasses.asdict(cfg), "source": source,
            "predictions": [{"no_eplb": dataclasses.asdict(a), "eplb": dataclasses.asdict(b)} for a, b in results],
            "measured": measured_rows,
        }, indent=2) + "\n")
    return 0


def main_bench(args: argparse.Namespace) -> int:
    """``--bench``: calibrate on the worker group's measurements, cross-validate, print."""
    bc = load_bench(args.bench, args.latency_probe)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig) if getattr(args, f.name, None) is not None}
    bc.cfg = dataclasses.replace(bc.cfg, **overrides)
    if len(bc.measured_s) < 2:
        print("note: one measured W only: its row is a fit, there is nothing held out to predict")
    rows = cross_validate(bc, args.policy)
    print_cross_validation(bc, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": dataclasses.asdict(bc.cfg), "source": bc.source,
                                               "cross_validation": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
