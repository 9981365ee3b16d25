"""A worker group: the ranks' process group and the engine each rank runs.

Every rank of the worker entry point (:mod:`kvbatch.ops.decode.worker`, whatever its command) joins and
leaves its group here and builds its engine here:

- The group (:func:`joined_group`): RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe it
  (torchrun and a Kubernetes pod set them; :func:`kvbatch.ops.decode.launch.launch_local` sets them for
  local processes); the backend is gloo (the engine computes on the CPU) unless
  ``KVBATCH_DIST_BACKEND`` says otherwise, and with ``nccl`` each rank takes GPU ``LOCAL_RANK``. A
  collective that waits longer than ``timeout_s`` (``KVBATCH_DIST_TIMEOUT_S``, default 300 s)
  fails the group. Between ranks only small objects travel: :func:`on_rank0_then_share` (a result
  of rank 0's, on every rank) and :func:`gather_to_rank0` (every rank's counts, on rank 0).
- A rank's engine (:func:`rank_engine`): the ``LLM`` the spec's ``engine_spec`` describes, built by
  the one builder (:func:`kvbatch.ops.engine_build.build_llm`). A dense model, or any model in a
  world of one, is data parallel: each rank runs its own requests. A MoE model in a group is
  expert parallel (:func:`expert_parallel`): each rank loads and keeps only its expert slots
  (:class:`~kvbatch.engine.parallel.expert_parallel.ExpertParallelCompute`, ``redundant_experts``
  extra ones), tokens travel to their experts by all-to-all, and the ranks step in lockstep
  (:class:`LockstepLLM`: every step starts with an all_reduce of "has work", and a rank without
  work still serves the other ranks' tokens).
- Live EPLB (``eplb_interval`` > 0, :class:`LiveBalancer`): every rank counts its routing
  (:class:`~kvbatch.engine.parallel.eplb.ExpertLoadWindow`, ``eplb_window`` steps of history,
  default the interval); every ``eplb_interval`` steps the counts are summed over ranks,
  :func:`~kvbatch.engine.parallel.eplb.rebalance_experts` places ``E + redundant_experts`` slots,
  and the expert weights move (between steps, on all ranks). For tests, ``eplb_force``
  (``"rotate"``) moves every expert to the next rank at each interval instead of balancing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer than this fails the group


# ------------------------------------------------------------------------------------------------
# The process group


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set: start workers with torchrun or launch_local")
        return default
    return int(value)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) as the environment says (RANK, WORLD_SIZE; 0 and 1 when unset)."""
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)


def init_group(timeout_s: float | None = None) -> tuple[int, int]:
    """Join the group described by the environment; returns (rank, world size)."""
    import torch.distributed as dist

    from kvbatch.ops.decode.launch import free_port

    rank, world = rank_and_world()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if world > 1 and "MASTER_PORT" not in os.environ:
        raise RuntimeError("MASTER_PORT is not set: start workers with torchrun or launch_local")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = os.environ.get("KVBATCH_DIST_BACKEND", "gloo")
    timeout = timedelta(seconds=timeout_s or float(os.environ.get("KVBATCH_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    device_id = None
    if backend == "nccl":  # one GPU per rank: LOCAL_RANK picks it, before any CUDA tensor exists
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("KVBATCH_DIST_BACKEND=nccl, but CUDA is not available on this machine")
        device_id = torch.device("cuda", _env_int("LOCAL_RANK", 0))
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, device_id=device_id)
    return rank, world


@contextlib.contextmanager
def joined_group(timeout_s: float | None = None, *, alone: bool = True) -> Iterator[tuple[int, int]]:
    """(rank, world size) for the block, this process joined to the group the environment
    describes (:func:`init_group`) and out of it after, error or not. ``alone=False``: a world of
    one joins no group (nothing to share: the pipeline shard's worker); with ``alone`` (the JSONL
    commands) it is a group of one, so its collectives run as a group's do."""
    rank, world = rank_and_world()
    if world == 1 and not alone:
        yield rank, world
        return
    rank, world = init_group(timeout_s)
    try:
        yield rank, world
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def on_rank0_then_share(fn: Callable[[], Any], rank: int, world: int) -> Any:
    """``fn()`` on rank 0, before any other rank goes on; its (small) result on every rank."""
    if world == 1:
        return fn()
    import torch.distributed as dist

    box = [fn() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_rank0(obj: Any, rank: int, world: int) -> list[Any] | None:
    """Every rank's (small) ``obj``, in rank order, on rank 0; None on the others. A process in
    no group (a world of one that joined none) has its own only."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(obj, gathered if rank == 0 else None, dst=0)
    return gathered if rank == 0 else None


# ------------------------------------------------------------------------------------------------
# A rank's engine


def engine_spec(spec: dict[str, Any]) -> Any:
    """The worker spec's :class:`~kvbatch.engine.spec.EngineSpec` (its ``engine_spec`` entry)."""
    from kvbatch.engine.spec import EngineSpec

    if not isinstance(spec.get("engine_spec"), dict):
        raise ValueError("the worker spec has no engine_spec (an EngineSpec as JSON)")
    return EngineSpec.from_json(spec["engine_spec"])


def rank_experts(spec: dict[str, Any]) -> dict[int, list[int]] | None:
    """The experts this rank holds (read from the model's config.json alone), so it loads only
    those; None in a group of one, for a dense model, or a GGUF file."""
    import torch.distributed as dist

    from kvbatch.engine.models.weights import load_tokenizer_source
    from kvbatch.engine.parallel.expert_parallel import rank_expert_ids

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    source = load_tokenizer_source(engine_spec(spec).model)
    if source.kind != "hf" or "config.json" not in source.files:
        return None
    return rank_expert_ids(json.loads(source.files["config.json"]), dist.get_rank(), dist.get_world_size(),
                           int(spec.get("redundant_experts", 0)))


def build_llm(spec: dict[str, Any]) -> Any:
    """This rank's engine, through the one builder (:func:`kvbatch.ops.engine_build.build_llm`),
    with only this rank's experts of a MoE model."""
    from kvbatch.io.kvstore.store import KVStoreConfig
    from kvbatch.ops import engine_build

    store = KVStoreConfig(**spec["kv_store"]) if spec.get("kv_store") else None
    return engine_build.build_llm(engine_spec(spec), store, experts=rank_experts(spec))


def initial_placement(model: Any, world: int, redundant: int) -> Any:
    """Identity when the experts split evenly and nothing is redundant; otherwise ``E + R``
    slots holding experts round-robin (``rebalance`` improves on it once loads are known)."""
    from kvbatch.engine.parallel.eplb import identity_placement

    num_experts = next(iter(model.moe_layers.values())).num_experts
    slots = num_experts + redundant
    if slots % world:
        raise ValueError(f"{num_experts} experts + {redundant} redundant = {slots} slots do not split over "
                         f"{world} workers: choose --redundant-experts so the sum is a multiple of {world}")
    return identity_placement(model.config.num_layers, num_experts, world, slots)


class RankEngine(NamedTuple):
    """What :func:`rank_engine` builds for one rank."""

    engine: Any  # what the rank streams its requests through: the LLM, or a LockstepLLM over it
    llm: Any  # the LLM itself
    ep: Any  # the expert-parallel state (a MoE model in a group), else None
    balancer: LiveBalancer | None  # live EPLB (``eplb_interval`` > 0), else None


def rank_engine(spec: dict[str, Any], world: int) -> RankEngine:
    """This rank's engine, for every command: the LLM (only this rank's experts of a MoE
    model), and for a MoE model in a group of ``world`` > 1 ranks expert parallelism with
    lockstep steps and, with ``eplb_interval`` > 0, live EPLB (:func:`expert_parallel`)."""
    llm = build_llm(spec)
    if world > 1 and getattr(llm.model, "moe_layers", None):
        return expert_parallel(llm, spec, world)
    return RankEngine(llm, llm, None, None)


def expert_parallel(llm: Any, spec: dict[str, Any], world: int) -> RankEngine:
    """``llm`` (a MoE model) made one rank of an expert-parallel group of ``world`` (the process
    group joined): its expert slots of the initial placement (``redundant_experts`` extra ones),
    a :class:`LiveBalancer` every ``eplb_interval`` steps if that is > 0, lockstep steps."""
    from kvbatch.engine.parallel.expert_parallel import install

    ep = install(llm.model, initial_placement(llm.model, world, int(spec.get("redundant_experts", 0))))
    balancer = None
    interval = int(spec.get("eplb_interval") or 0)
    if interval > 0:  # live EPLB: rebalance the expert slots every ``interval`` group steps
        balancer = LiveBalancer(llm, ep, interval, ep.placement.num_slots, spec.get("eplb_window"),
                                spec.get("eplb_force"))
    return RankEngine(LockstepLLM(llm, ep, balancer.on_step if balancer else None), llm, ep, balancer)


# ------------------------------------------------------------------------------------------------
# Lockstep stepping and live EPLB


class LockstepLLM:
    """An ``LLM`` whose :meth:`stream` keeps step with the other ranks of an expert-parallel
    group; everything else is the wrapped engine's (``run_jobs`` takes it as an ``LLM``)."""

    def __init__(self, llm: Any, ep: Any, on_step: Callable[[int], None] | None = None) -> None:
        self.llm = llm
        self.ep = ep
        self.on_step = on_step
        self.steps = 0
        self.step_s: list[float] = []  # wall time of each group step, as this rank saw it
        self.step_had_work: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)

    def stream(self, requests: Iterable[Any], max_waiting: int | None = None) -> Iterator[Any]:
        """:meth:`LLM.stream`, except that a step is a group step: it runs while any rank has
        work, and a rank with none joins it idle (its experts serve the others). A tick (a None
        among the requests) comes back as a None, as from :meth:`LLM.stream`; while no rank has
        work but some rank is still reading its requests (a run of response-cache hits), the
        group takes no step and waits for it."""
        from kvbatch.engine.runtime.llm import Admitted

        llm = self.llm
        cap = max_waiting or 2 * llm.engine_config.max_num_seqs
        it = iter(requests)
        exhausted = False
        while True:
            if not exhausted:
                admitted = llm.admit(it, cap)
                exhausted = admitted is Admitted.EXHAUSTED
                if admitted is Admitted.TICK:
                    yield None
            mine = llm.scheduler.has_work()
            work, reading = self.ep.any_ranks(mine, not exhausted)
            if not work:
                if not reading:
                    return
                continue
            started = time.perf_counter()
            finished = llm.step() if mine else []
            self.ep.finish_step()
            self.step_s.append(time.perf_counter() - started)
            self.step_had_work.append(mine)
            self.steps += 1
            if self.on_step is not None:
                self.on_step(self.steps)
            yield from finished


class LiveBalancer:
    """EPLB during the run: counts routing, and every ``interval`` steps rebalances the group.

    ``on_step`` must run on every rank after the same step (it is collective)."""

    def __init__(self, llm: Any, ep: Any, interval: int, num_slots: int, window_steps: int | None = None,
                 force: str | None = None) -> None:
        from kvbatch.engine.parallel.eplb import ExpertLoadWindow

        self.ep = ep
        self.interval = interval
        self.num_slots = num_slots
        self.force = force
        cfg = llm.model.config
        self.window = ExpertLoadWindow(cfg.num_layers, ep.num_experts, window_steps or interval)
        llm.model.routing_observers.append(self.window.observe)
        self.history: list[dict[str, Any]] = []
        # rows each rank's experts computed, per layer, at each rebalance (segment boundaries)
        self.boundaries: list[tuple[int, dict[int, int]]] = []

    def on_step(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        from kvbatch.engine.parallel.eplb import (
            Placement,
            rank_loads,
            rebalance_experts,
        )

        self.window.end_step()
        if step % self.interval:
            return
        load = self.window.load().cpu()
        dist.all_reduce(load, group=self.ep.group)
        W = self.ep.world
        if self.force == "rotate":
            old = self.ep.placement.phy2log
            per = old.shape[1] // W
            placement = Placement.from_phy2log(torch.roll(old, per, dims=1), self.ep.num_experts)
        else:
            placement = rebalance_experts(load.float(), self.num_slots, 1, 1, W)
        # Every rank computed the same placement from the same sums; rank 0's is sent anyway,
        # so a future non-deterministic search cannot split the group.
        phy2log = placement.phy2log.clone()
        dist.broadcast(phy2log, src=0, group=self.ep.group)
        placement = Placement.from_phy2log(phy2log, self.ep.num_experts)
        before = _max_over_mean(rank_loads(load, self.ep.placement, W))
        after = _max_over_mean(rank_loads(load, placement, W))
        self.boundaries.append((step, dict(self.ep.stats.rows_computed)))
        started = time.perf_counter()
        moved = self.ep.rebalance(placement)
        self.history.append({"step": step, "predicted_max_over_mean_before": before,
                             "predicted_max_over_mean_after": after, "weight_bytes_sent_by_rank": moved,
                             "rebalance_s": time.perf_counter() - started})

    def to_json(self) -> dict[str, Any]:
        """What rank 0 needs of this rank's balancer: the rebalances, and the expert rows computed
        at each (:func:`kvbatch.ops.decode.group_outputs.rank_load_segments`)."""
        return {"history": self.history,
                "boundaries": [(step, rows) for step, rows in self.boundaries],
                "final_rows": dict(self.ep.stats.rows_computed)}


def _max_over_mean(rank_load: Any) -> float | None:
    """Mean over layers with load of max_r / mean_r ([L, W] rank loads)."""
    active = rank_load.sum(-1) > 0
    if not bool(active.any()):
        return None
    rl = rank_load[active]
    return float((rl.max(-1).values / rl.mean(-1)).mean())
