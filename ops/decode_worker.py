"""Decode one shard in worker processes: the entry point Dagster Pipes launches, alone or as a group.

    python -m kvbatch.ops.decode_worker --spec spec.json                   (standalone, one process)
    torchrun --nproc-per-node 2 -m kvbatch.ops.decode_worker --spec s.json  (a group of 2 ranks)
    launched by PipesSubprocessClient / PipesK8sClient                      (the spec is the Pipes extra "spec")

The spec: ``{"model", "dtype", "engine": {EngineConfig fields}, "seed", "threads", "kv_store":
{KVStoreConfig fields}, "kv_fingerprint", "manifests_url", "results_url", "stats_url",
"storage_options"}`` and optionally ``"parts_url"`` (the staging folder of the part files),
``"checkpoint_rows"``, ``"rows"``, ``"eplb_interval"``, ``"eplb_window"``, ``"redundant_experts"``.

A group follows torch.distributed conventions (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
as torchrun sets them; backend from ``KVBATCH_DIST_BACKEND``, default gloo) and is built by
:mod:`kvbatch.ops.worker_group` (the group, the engine, and for MoE models expert parallelism
with lockstep steps). The ranks split the shard's requests (request i goes to rank i mod W),
each decodes its part from the stored KV and commits its own part files every
``checkpoint_rows`` results (a re-run resumes from them: :mod:`kvbatch.ops.decode_checkpoint`);
rows never travel between ranks. Rank 0 gathers the ranks' stats only, then streams the parts
into one results table and commits it and one stats file, so the output is the same whatever
the world size. Only rank 0 opens
Dagster Pipes (and sends the spec to the other ranks); ``dagster_pipes`` is imported only when
``DAGSTER_PIPES_CONTEXT`` is set, so this module runs without Dagster installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

REPORTED = ("requests", "succeeded", "prompt_tokens", "loaded_prompt_tokens", "output_tokens", "wall_s",
            "output_tokens_per_s", "ttft_s_p50", "tpot_s_p50", "results_bytes", "world_size")


def _group_engine(spec: dict[str, Any], world_size: int) -> tuple[Any, Any, Any]:
    """(engine to stream through, the LLM under it, expert-parallel state or None) for one rank,
    built by :mod:`kvbatch.ops.worker_group`: a MoE model gets expert parallelism (each rank holds
    its expert slots, ``redundant_experts`` extra ones, all-to-all between ranks, lockstep steps,
    and with ``eplb_interval`` > 0 live EPLB); a dense model is data parallel."""
    from kvbatch.ops import worker_group

    llm = worker_group.build_llm(spec)
    if not getattr(llm.model, "moe_layers", None):
        return llm, llm, None
    from kvbatch.engine.parallel.expert_parallel import install

    placement = worker_group.initial_placement(llm.model, world_size, int(spec.get("redundant_experts", 0)))
    ep = install(llm.model, placement)
    on_step = None
    interval = int(spec.get("eplb_interval") or 0)
    if interval > 0:  # live EPLB: rebalance the expert slots every ``interval`` group steps
        balancer = worker_group.LiveBalancer(llm, ep, interval, ep.placement.num_slots, spec.get("eplb_window"),
                                             spec.get("eplb_force"))
        on_step = balancer.on_step
    return worker_group.LockstepLLM(llm, ep, on_step), llm, ep


def run(spec: dict[str, Any], rank: int = 0, world_size: int = 1,
        log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Decode this rank's part of the shard, committing its own part files as it goes; rank 0
    then commits the shard's results and merged stats and returns them, the others None.
    ``log`` gets this rank's progress (rows done, tokens/s, ETA; the spec's ``rows`` is the shard's)."""
    from kvbatch.ops.decode_checkpoint import DEFAULT_CHECKPOINT_ROWS, default_parts_url
    from kvbatch.ops.metrics import ProgressMeter
    from kvbatch.ops.results import commit_parts, decode_rank, start_decode

    if world_size > 1:
        engine, _, ep = _group_engine(spec, world_size)
    else:
        from kvbatch.ops.worker_group import build_llm

        engine = build_llm(spec)
        ep = None
    opts = spec.get("storage_options") or {}
    parts_url = spec.get("parts_url") or default_parts_url(spec["results_url"])
    key = _on_rank0_then_share(lambda: start_decode(spec["manifests_url"], parts_url, opts), rank, world_size)
    mine = -(-(int(spec.get("rows", 0)) - rank) // world_size)  # rows i with i mod world_size == rank
    progress = None if log is None else ProgressMeter(f"decode rank {rank}/{world_size}", max(mine, 0), log)
    stats = decode_rank(engine, spec["manifests_url"], parts_url, key=key,
                        attempt=spec.get("decode_attempt") or _new_attempt(world_size),
                        storage_options=opts, rank=rank, world_size=world_size,
                        checkpoint_rows=int(spec.get("checkpoint_rows") or DEFAULT_CHECKPOINT_ROWS), progress=progress)
    if ep is not None:  # expert rows this rank computed, per MoE layer: the group's load balance
        stats["expert_rows_computed"] = {str(k): int(v) for k, v in ep.stats.rows_computed.items()}
    final = [stats]
    if world_size > 1:  # every rank's stats (never its rows: those are in its parts) to rank 0
        import torch.distributed as dist

        gathered: list[Any] = [None] * world_size if rank == 0 else []
        dist.gather_object(stats, gathered if rank == 0 else None, dst=0)
        if rank != 0:
            return None
        final = gathered
    return commit_parts(final, parts_url, spec["results_url"], stats_url=spec.get("stats_url"),
                        storage_options=opts, extra={"world_size": world_size})


def _new_attempt(world_size: int) -> str:
    """A run id for a caller that did not go through :func:`_share_spec` (one rank only: the
    ranks of a group must share one)."""
    if world_size > 1:
        raise ValueError("a group's spec needs its decode_attempt (main() shares rank 0's)")
    import uuid

    return uuid.uuid4().hex[:12]


def _on_rank0_then_share(fn: Callable[[], Any], rank: int, world_size: int) -> Any:
    """``fn()`` on rank 0, before any other rank goes on; its (small) result on every rank."""
    if world_size == 1:
        return fn()
    import torch.distributed as dist

    box = [fn() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def merge_stats(per_rank: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One stats document for ranks of one run (see :func:`kvbatch.ops.results.merge_stats`),
    percentiles over ``rows``' latencies."""
    from kvbatch.ops.results import merge_stats as merge

    return merge(per_rank, [], [r["ttft_s"] for r in rows if r["ttft_s"] is not None],
                 [r["tpot_s"] for r in rows if r["tpot_s"] is not None])


def balancedness(rows_by_rank: list[dict[str, int]]) -> float | None:
    """Mean over MoE layers of mean / max expert rows computed per rank (1 is perfect balance)."""
    from kvbatch.ops.results import balancedness as ratio

    return ratio(rows_by_rank)


def _share_spec(spec: dict[str, Any] | None, world_size: int) -> dict[str, Any]:
    """Rank 0's spec, on every rank, with the id of this decode run (``decode_attempt``: the
    ranks' part files and stats say which run committed them)."""
    if spec is not None:
        import uuid

        spec = {**spec, "decode_attempt": spec.get("decode_attempt") or uuid.uuid4().hex[:12]}
    if world_size > 1:
        import torch.distributed as dist

        box = [spec]
        dist.broadcast_object_list(box, src=0)
        spec = box[0]
    assert spec is not None
    return spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbatch.ops.decode_worker")
    p.add_argument("--spec", default=None, help="spec JSON file (not needed under Dagster Pipes)")
    args = p.parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    piped = bool(os.environ.get("DAGSTER_PIPES_CONTEXT"))
    if not piped and not args.spec:
        p.error("--spec is required outside Dagster Pipes")
    if world_size > 1:
        from kvbatch.ops.worker_group import init_group

        init_group()
    try:
        if piped and rank == 0:
            from dagster_pipes import (
                open_dagster_pipes,  # lazy: only when launched by Dagster
            )

            with open_dagster_pipes() as pipes:
                spec = _share_spec(pipes.get_extra("spec"), world_size)
                pipes.log.info(f"decoding {spec['manifests_url']} with {world_size} rank(s)")
                stats = run(spec, rank, world_size, log=pipes.log.info)
                assert stats is not None
                pipes.report_asset_materialization(
                    metadata={k: (0.0 if stats.get(k) is None else stats[k]) for k in REPORTED})
            return 0
        spec = None
        if args.spec and (rank == 0 or not piped):
            with open(args.spec, encoding="utf-8") as f:
                spec = json.load(f)
        stats = run(_share_spec(spec, world_size), rank, world_size)
        if stats is not None:
            print(json.dumps(stats, default=str))
        return 0
    finally:
        if world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
