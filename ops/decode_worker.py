"""Decode one shard in worker processes: the entry point Dagster Pipes launches, alone or as a group.

    python -m kvbatch.ops.decode_worker --spec spec.json                   (standalone, one process)
    torchrun --nproc-per-node 2 -m kvbatch.ops.decode_worker --spec s.json  (a group of 2 ranks)
    launched by PipesSubprocessClient / PipesK8sClient                      (the spec is the Pipes extra "spec")

The spec: ``{"model", "dtype", "engine": {EngineConfig fields}, "seed", "threads", "kv_store":
{KVStoreConfig fields}, "kv_fingerprint", "manifests_url", "results_url", "stats_url",
"storage_options"}``.

A group follows torch.distributed conventions (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
as torchrun sets them; backend from ``KVBATCH_DIST_BACKEND``, default gloo) and is built by
:mod:`kvbatch.ops.worker_group` (the group, the engine, and for MoE models expert parallelism
with lockstep steps). The ranks split the shard's requests (request i goes to rank i mod W),
each decodes its part from the stored KV, and rank 0 gathers the rows and commits one results
table and one stats file, so the output is the same whatever the world size. Only rank 0 opens
Dagster Pipes (and sends the spec to the other ranks); ``dagster_pipes`` is imported only when
``DAGSTER_PIPES_CONTEXT`` is set, so this module runs without Dagster installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

REPORTED = ("requests", "succeeded", "prompt_tokens", "loaded_prompt_tokens", "output_tokens", "wall_s",
            "output_tokens_per_s", "ttft_s_p50", "tpot_s_p50", "results_bytes", "world_size")


def _group_engine(spec: dict[str, Any], world_size: int) -> tuple[Any, Any, Any]:
    """(engine to stream through, the LLM under it, expert-parallel state or None) for one rank,
    built by :mod:`kvbatch.ops.worker_group`: a MoE model gets expert parallelism (each rank holds
    its expert slots, all-to-all between ranks, lockstep steps); a dense model is data parallel."""
    from kvbatch.ops import worker_group

    llm = worker_group.build_llm(spec)
    if not getattr(llm.model, "moe_layers", None):
        return llm, llm, None
    from kvbatch.engine.parallel.expert_parallel import install

    placement = worker_group.initial_placement(llm.model, world_size, int(spec.get("redundant_experts", 0)))
    ep = install(llm.model, placement)
    return worker_group.LockstepLLM(llm, ep), llm, ep


def run(spec: dict[str, Any], rank: int = 0, world_size: int = 1) -> dict[str, Any] | None:
    """Decode this rank's part of the shard. Rank 0 returns the committed stats, the others None."""
    from kvbatch.ops.results import commit_results, decode_rows, decode_stats

    if world_size > 1:
        engine, llm, ep = _group_engine(spec, world_size)
    else:
        from kvbatch.ops.worker_group import build_llm

        engine = llm = build_llm(spec)
        ep = None
    opts = spec.get("storage_options") or {}
    rows, report = decode_rows(engine, spec["manifests_url"], storage_options=opts, rank=rank,
                               world_size=world_size)
    stats = decode_stats(llm, report)
    if ep is not None:  # expert rows this rank computed, per MoE layer: the group's load balance
        stats["expert_rows_computed"] = {str(k): int(v) for k, v in ep.stats.rows_computed.items()}
    if world_size > 1:
        import torch.distributed as dist

        parts: list[Any] = [None] * world_size if rank == 0 else []
        dist.gather_object((rows, stats), parts if rank == 0 else None, dst=0)
        if rank != 0:
            return None
        rows = [r for part_rows, _ in parts for r in part_rows]
        stats = merge_stats([part_stats for _, part_stats in parts], rows)
    stats["world_size"] = world_size
    return commit_results(rows, stats, spec["results_url"], stats_url=spec.get("stats_url"), storage_options=opts)


def merge_stats(per_rank: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One stats document for the group: counters summed, wall time the slowest rank's, percentiles
    over every request; each rank's own figures kept under ``by_rank``."""
    from kvbatch.ops.batch_report import BatchReport

    merged = BatchReport()
    for s in per_rank:
        for name in ("requests", "succeeded", "rejected", "prompt_tokens", "cached_prompt_tokens",
                     "loaded_prompt_tokens", "output_tokens", "preemptions"):
            setattr(merged, name, getattr(merged, name) + int(s.get(name, 0)))
        for field_name, n in s.get("rejects_by_field", {}).items():
            merged.rejects_by_field[field_name] = merged.rejects_by_field.get(field_name, 0) + n
        merged.wall_s = max(merged.wall_s, float(s.get("wall_s", 0.0)))
    merged.ttft_s = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    merged.tpot_s = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    out = merged.to_json()
    connectors = [s["connector"] for s in per_rank if "connector" in s]
    if connectors:
        out["connector"] = _sum_numbers(connectors)
    if all("expert_rows_computed" in s for s in per_rank):
        out["expert_load_balancedness"] = balancedness([s["expert_rows_computed"] for s in per_rank])
    out["by_rank"] = per_rank
    return out


def balancedness(rows_by_rank: list[dict[str, int]]) -> float | None:
    """Mean over MoE layers of mean / max expert rows computed per rank (1 is perfect balance)."""
    ratios = []
    for layer in sorted({k for rows in rows_by_rank for k in rows}):
        loads = [rows.get(layer, 0) for rows in rows_by_rank]
        if max(loads) > 0:
            ratios.append(sum(loads) / len(loads) / max(loads))
    return round(sum(ratios) / len(ratios), 6) if ratios else None


def _sum_numbers(docs: list[Any]) -> Any:
    """Numeric leaves summed across documents of the same shape (per-rank connector counters)."""
    first = docs[0]
    if isinstance(first, dict):
        keys = {k for d in docs if isinstance(d, dict) for k in d}
        return {k: _sum_numbers([d[k] for d in docs if isinstance(d, dict) and k in d]) for k in sorted(keys)}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(d for d in docs if isinstance(d, (int, float)))
    return first


def _share_spec(spec: dict[str, Any] | None, world_size: int) -> dict[str, Any]:
    """Rank 0's spec, on every rank."""
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
                stats = run(spec, rank, world_size)
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
