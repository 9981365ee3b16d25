"""The worker entry point: one rank of a worker group, whatever started it.

    python -m kvbatch.ops.decode.worker --spec spec.json                       (one process; RANK/WORLD_SIZE say which)
    torchrun --nproc-per-node 4 -m kvbatch.ops.decode.worker --spec spec.json   (a group of 4 ranks)
    launch_local(4, ["--spec", "spec.json"])                             (``--workers 4``: kvbatch.ops.decode.launch)
    launched by PipesSubprocessClient / PipesK8sClient                   (the spec is the Pipes extra "spec")

The spec's ``command`` says what the ranks do (:mod:`kvbatch.ops.decode.worker_commands`):

- ``"generate"`` (``input``: OpenAI Batch JSONL) or ``"decode"`` (``manifests``): what ``kvbatch
  generate|decode --workers W`` runs; the output is JSONL, the same file one process writes.
  Keys: ``output``, ``errors``, ``metrics``, ``model_name``, ``strict`` (generate: reject rows with
  unknown fields, as ``--strict`` does), ``report`` (a JSON file rank 0 writes for the launcher),
  ``parts_url`` (the ranks' staging folder, default a dot folder beside the output; every rank
  must reach it, and rank 0 deletes it once the output is committed), ``checkpoint_rows`` (lines
  per part, default 256), ``resume`` (default true: keep the parts an earlier run of the same
  command left), ``response_cache`` (``{"url", "verify", "storage_options"}``: every rank opens
  the exact response cache, :func:`~kvbatch.ops.decode.worker_commands.rank_response_cache`;
  the metrics sum the ranks' counters). Exit status 0, 1 when some rows were rejected, 2 on a fatal error (one line,
  ``kvbatch: error: worker rank R: ...``; the launcher stops the group).
- ``"shard"``: one pipeline shard's manifests to its results Parquet, what the ``decode_cluster``
  resource launches (:mod:`kvbatch.resources.decode_cluster`). Keys: ``manifests_url``,
  ``results_url``, ``stats_url``, optionally ``parts_url`` (the staging folder of the part files),
  ``checkpoint_rows``, ``rows`` (the shard's, for progress), ``decode_attempt`` (this run's id;
  default a new one), ``response_cache`` (as for generate/decode). Outside Pipes rank 0 prints the merged stats as one JSON line.

Every spec has ``engine_spec`` (a :class:`~kvbatch.engine.spec.EngineSpec` as JSON, built by
:func:`kvbatch.ops.engine_build.build_llm`) and optionally ``kv_store``
(:class:`~kvbatch.io.kvstore.store.KVStoreConfig` fields), ``storage_options``, ``timeout_s`` (of
the group's collectives) and, for MoE models in a group, ``redundant_experts``, ``eplb_interval``,
``eplb_window`` and ``eplb_force`` (:mod:`kvbatch.ops.decode.group`). Rank 0's spec is the group's.

Each rank joins its group (:func:`kvbatch.ops.decode.group.joined_group`: torch.distributed
conventions, as torchrun sets them; a generate/decode of one process is a group of one, a shard of
one joins none), builds its engine, runs the command and leaves the group. Under Dagster Pipes
(``DAGSTER_PIPES_CONTEXT`` set; the ``shard`` command only) rank 0 alone opens Pipes, takes the
spec from the Pipes extra and sends it to the other ranks, logs its progress there and reports the
materialization; ``dagster_pipes`` is imported only then, so the workers run without Dagster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from kvbatch.ops.decode.launch import EXIT_FATAL, EXIT_OK
from kvbatch.ops.decode.group import joined_group, on_rank0_then_share

COMMANDS = ("generate", "decode", "shard")
JSONL_COMMANDS = ("generate", "decode")  # a group of one joins a group too: their gather at rank 0 is collective
# The shard's stats rank 0 reports as the materialization's metadata through Pipes.
REPORTED = ("requests", "succeeded", "prompt_tokens", "loaded_prompt_tokens", "output_tokens", "wall_s",
            "output_tokens_per_s", "ttft_s_p50", "tpot_s_p50", "results_bytes", "world_size")


def _command(spec: dict[str, Any]) -> str:
    command = spec.get("command")
    if command not in COMMANDS:
        raise ValueError(f"unknown worker command {command!r} (generate, decode or shard)")
    return str(command)


def run_command(spec: dict[str, Any], rank: int, world: int, log: Callable[[str], None] | None = None) -> Any:
    """``spec``'s command on this rank of a group already joined: generate/decode return the exit
    status, shard the merged stats on rank 0 (None on the others); ``log``: the shard's progress."""
    from kvbatch.ops.decode.worker_commands import run_rank, run_shard

    if _command(spec) == "shard":
        return run_shard(spec, rank, world, log)
    return run_rank(spec, rank, world)


def run(spec: dict[str, Any], log: Callable[[str], None] | None = None) -> Any:
    """``spec``'s command on this rank, in the group the environment describes, joined for it and
    left after, error or not; rank 0's spec is the group's. What :func:`run_command` returns."""
    alone = _command(spec) in JSONL_COMMANDS
    with joined_group(spec.get("timeout_s"), alone=alone) as (rank, world):
        return run_command(on_rank0_then_share(lambda: spec, rank, world), rank, world, log)


def _shard_spec(extra: dict[str, Any] | None, rank: int, world: int) -> dict[str, Any]:
    """Rank 0's spec (its Pipes extra) on every rank, which must be a shard's."""
    spec = on_rank0_then_share(lambda: extra, rank, world)
    if not isinstance(spec, dict) or spec.get("command") != "shard":
        raise ValueError("under Dagster Pipes the worker decodes a pipeline shard: the Pipes extra 'spec' needs "
                         f"\"command\": \"shard\", not {spec.get('command') if isinstance(spec, dict) else spec!r}")
    return spec


def _main_piped() -> int:
    """A rank launched by Dagster Pipes: rank 0 talks to Dagster, the others only to rank 0."""
    with joined_group(alone=False) as (rank, world):
        if rank != 0:
            run_command(_shard_spec(None, rank, world), rank, world)
            return EXIT_OK
        from dagster_pipes import (
            open_dagster_pipes,  # lazy: only when launched by Dagster
        )

        with open_dagster_pipes() as pipes:
            spec = _shard_spec(pipes.get_extra("spec"), rank, world)
            pipes.log.info(f"decoding {spec['manifests_url']} with {world} rank(s)")
            stats = run_command(spec, rank, world, log=pipes.log.info)
            assert stats is not None
            metadata = {k: (0.0 if stats.get(k) is None else stats[k]) for k in REPORTED}
            if "response_cache" in stats:  # the rows it served, looked up and missed, wrote: as in process
                metadata.update({f"response_cache_{k}": stats["response_cache"][k] for k in ("hits", "misses", "writes")})
            pipes.report_asset_materialization(metadata=metadata)
        return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbatch.ops.decode.worker")
    p.add_argument("--spec", default=None, help="worker spec JSON file (module docstring; not needed under "
                   "Dagster Pipes, whose extra 'spec' it is)")
    args = p.parse_args(argv)
    if os.environ.get("DAGSTER_PIPES_CONTEXT"):
        return _main_piped()
    if not args.spec:
        p.error("--spec is required outside Dagster Pipes")
    with open(args.spec, encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("command") == "shard":  # an error is a traceback and status 1, as under Pipes
        stats = run(spec)
        if stats is not None:
            print(json.dumps(stats, default=str))
        return EXIT_OK
    rank = os.environ.get("RANK", "0")
    try:
        return run(spec)
    except Exception as exc:  # noqa: BLE001 - one line naming the rank; the launcher stops the group
        print(f"kvbatch: error: worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main())
