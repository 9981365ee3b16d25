"""What one rank of the worker entry point (:mod:`kvbatch.ops.decode.worker`) does for each command,
in a group already joined (:func:`kvbatch.ops.decode.group.joined_group`), on the engine
:func:`kvbatch.ops.decode.group.rank_engine` builds.

- :func:`run_rank` (``generate`` with ``input``, ``decode`` with ``manifests``; JSONL out, what
  ``kvbatch generate|decode --workers W`` runs): rank ``r`` takes input rows ``r, r + W, r + 2W,
  ...``, less those an earlier, killed run of the same command committed
  (:mod:`kvbatch.ops.decode.group_resume`); it commits its answers as part files as it goes
  (:class:`~kvbatch.ops.decode.group_outputs.RankPartSink`) and sends rank 0 its counts only; rank 0
  merges the parts into the output and writes the metrics
  (:func:`~kvbatch.ops.decode.group_outputs.write_outputs`). Returns the exit status.
- :func:`run_shard` (``shard``: one pipeline shard's manifests to its results Parquet): request
  ``i`` goes to rank ``i mod W``; each rank decodes its part from the stored KV and commits its own
  part files every ``checkpoint_rows`` results (a re-run resumes from them:
  :mod:`kvbatch.ops.decode.checkpoint`); rank 0 gathers the ranks' stats only, then streams the
  parts into one results table and commits it and one stats file, so the output is the same
  whatever the world size. Returns the merged stats on rank 0, None on the others.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvbatch.ops.decode.group import gather_to_rank0, on_rank0_then_share, rank_engine

DEFAULT_PART_ROWS = 256  # output rows per part file a rank commits: its memory holds at most this many


# ------------------------------------------------------------------------------------------------
# generate / decode: JSONL in, JSONL out


def _until_broken(items: Iterable[Any], broken: list[Any]) -> Iterator[Any]:
    """The rows of a request stream up to where it breaks; the :class:`InputStreamError` is kept
    in ``broken`` instead of raised, so this rank answers its rows read before the break and rank 0
    writes the one marker line of the group (every rank would otherwise end its share with one)."""
    from kvbatch.io.batch_requests import InputStreamError

    try:
        yield from items
    except InputStreamError as exc:
        broken.append(exc)


def _rank_jobs(llm: Any, spec: dict[str, Any], rank: int, world: int, done: Any, skipped: list[int],
               broken: list[Any]) -> Iterator[Any]:
    """This rank's jobs, less the rows in ``done`` (committed by an earlier run of the same
    command), each numbered by its place in the rank's share."""
    from kvbatch.io.batch_requests import read_requests
    from kvbatch.ops.decode.group_resume import unanswered, with_indexes
    from kvbatch.ops.jobs import tokenize_requests
    from kvbatch.ops.prefill.manifests import manifest_jobs, read_manifests

    so = spec.get("storage_options") or {}
    if spec["command"] == "generate":
        rows = read_requests(spec["input"], storage_options=so, strict=bool(spec.get("strict", False)))
        pairs = unanswered(_until_broken(rows, broken), rank, world, done, skipped)
        return with_indexes(lambda items: tokenize_requests(llm, items), pairs)
    if spec["command"] == "decode":
        pairs = unanswered(read_manifests(spec["manifests"], so), rank, world, done, skipped)
        return with_indexes(lambda items: manifest_jobs(llm, items), pairs)
    raise ValueError(f"unknown worker command {spec['command']!r} (generate or decode)")


def run_rank(spec: dict[str, Any], rank: int, world: int,
             on_progress: Callable[[int, int], None] | None = None) -> int:
    """Run this rank's share, committing its output rows as part files as it goes; rank 0 then
    merges the parts into the output and writes the metrics. Returns the exit status."""
    from kvbatch.io.urls import redact_text
    from kvbatch.ops.decode.generate import run_jobs
    from kvbatch.ops.decode.checkpoint import done_index_array, remove_parts
    from kvbatch.ops.decode.group_outputs import RankPartSink, group_parts_url, write_outputs
    from kvbatch.ops.decode.launch import EXIT_OK

    if rank != 0:
        # Every rank reads the whole input: the reader's warnings (an unknown field, once per
        # name) are the same on each, so rank 0's say them once for the group.
        logging.getLogger("kvbatch.io.batch_requests").setLevel(logging.ERROR)
    engine, llm, ep, balancer = rank_engine(spec, world)
    so = spec.get("storage_options") or {}
    parts_url = group_parts_url(spec)
    attempt, key = on_rank0_then_share(lambda: _start_parts(spec, llm), rank, world)  # parts of another run gone
    done = done_index_array(parts_url, so, rank, world)  # this rank's rows an earlier run committed
    sink = RankPartSink(parts_url, rank, world, attempt, int(spec.get("checkpoint_rows") or DEFAULT_PART_ROWS),
                        so, key)
    broken: list[Any] = []
    skipped = [0]
    jobs = _rank_jobs(llm, spec, rank, world, done, skipped, broken)
    with rank_response_cache(spec, llm) as cache:
        report = run_jobs(engine, jobs, sink, model_name=spec.get("model_name", "kvbatch"),
                          on_progress=on_progress if rank == 0 else None, response_cache=cache,
                          on_answered=sink.note)
    # What travels to rank 0 is this rank's counts and timings, never its rows (those are in its parts).
    mine = {"attempt": attempt, "rows": sink.rows, "resumed": skipped[0], "wall_s": report.wall_s,
            "draft_s": report.draft_s, "step_s_total": report.step_s,
            "spec_enabled": report.spec_enabled, "ep": ep.stats.to_json() if ep else None,
            "balancer": balancer.to_json() if balancer else None,
            "step_s": getattr(engine, "step_s", []) if rank == 0 else [],
            "response_cache": report.response_cache,
            "broken": {"lines_read": broken[0].lines_read, "reason": redact_text(broken[0].reason, broken[0].url),
                       "message": str(broken[0])} if broken else None}
    ranks = gather_to_rank0(mine, rank, world)
    if ranks is None:
        return EXIT_OK
    code = write_outputs(spec, ranks, world, parts_url)
    remove_parts(parts_url, so)  # only once the output is committed: a failed merge keeps them for a re-run
    return code


def _start_parts(spec: dict[str, Any], llm: Any) -> tuple[str, str]:
    """Rank 0, before any rank writes: this run's key, the parts of an earlier run of the same
    command kept (``resume``, the default) and any others dropped; a new run id beside it."""
    from kvbatch.ops.decode.group_outputs import group_parts_url
    from kvbatch.ops.decode.group_resume import group_key, start_group_parts

    key = group_key(spec, llm.checkpoint.fingerprint)
    start_group_parts(group_parts_url(spec), key, spec.get("storage_options") or {},
                      resume=bool(spec.get("resume", True)))
    return _new_attempt(), key


# ------------------------------------------------------------------------------------------------
# shard: one pipeline shard's manifests to its results table


def run_shard(spec: dict[str, Any], rank: int, world: int,
              log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Decode this rank's part of the shard, committing its own part files as it goes; rank 0
    then commits the shard's results and merged stats and returns them, the others None.
    ``log`` gets this rank's progress (rows done, tokens/s, ETA; the spec's ``rows`` is the shard's)."""
    from kvbatch.ops.decode.checkpoint import DEFAULT_CHECKPOINT_ROWS, default_parts_url
    from kvbatch.ops.results.metrics import ProgressMeter
    from kvbatch.ops.decode.shard import commit_parts, decode_rank, start_decode

    engine, llm, ep, _ = rank_engine(spec, world)
    opts = spec.get("storage_options") or {}
    parts_url = spec.get("parts_url") or default_parts_url(spec["results_url"])
    # Rank 0 drops parts of other manifests and names this decode run (``decode_attempt``: the
    # ranks' part files and stats say which run committed them); every rank gets both.
    key, attempt = on_rank0_then_share(
        lambda: (start_decode(spec["manifests_url"], parts_url, opts), spec.get("decode_attempt") or _new_attempt()),
        rank, world)
    mine = -(-(int(spec.get("rows", 0)) - rank) // world)  # rows i with i mod world == rank
    progress = None if log is None else ProgressMeter(f"decode rank {rank}/{world}", max(mine, 0), log)
    with rank_response_cache(spec, llm) as cache:
        stats = decode_rank(engine, spec["manifests_url"], parts_url, key=key, attempt=attempt,
                            storage_options=opts, rank=rank, world_size=world,
                            checkpoint_rows=int(spec.get("checkpoint_rows") or DEFAULT_CHECKPOINT_ROWS),
                            progress=progress, response_cache=cache)
    if ep is not None:  # expert rows this rank computed, per MoE layer: the group's load balance
        stats["expert_rows_computed"] = {str(k): int(v) for k, v in ep.stats.rows_computed.items()}
    final = gather_to_rank0(stats, rank, world)  # every rank's stats (never its rows: those are in its parts)
    if final is None:
        return None
    return commit_parts(final, parts_url, spec["results_url"], stats_url=spec.get("stats_url"),
                        storage_options=opts, extra={"world_size": world})


@contextlib.contextmanager
def rank_response_cache(spec: dict[str, Any], llm: Any) -> Iterator[Any]:
    """The spec's ``response_cache`` (``{"url", "verify", "storage_options"}``) for this rank's
    engine, closed (its writes waited for) on leaving; None without one. Every rank opens its
    own: entries are content-addressed and written create-only, so ranks writing at once are
    harmless, and each rank's counters travel to rank 0 with its other counts."""
    options = spec.get("response_cache")
    if not options:
        yield None
        return
    from kvbatch.ops.decode.response_cache import ResponseCache

    cache = ResponseCache.for_llm(str(options["url"]), llm, verify=float(options.get("verify") or 0.0),
                                  storage_options=dict(options.get("storage_options") or {}))
    try:
        yield cache
    finally:
        cache.close()


def _new_attempt() -> str:
    """A new run id: the ranks' part files and stats say which run committed them."""
    return uuid.uuid4().hex[:12]
