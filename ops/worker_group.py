"""A decode worker group: W ranks that split the requests and share the experts.

    python -m kvbatch.ops.worker_group --spec spec.json                 (one rank; env says which)
    torchrun --nproc-per-node 4 -m kvbatch.ops.worker_group --spec spec.json
    launch_local(4, ["--spec", "spec.json"])                             (what ``--workers 4`` does)

Each rank reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun and a Kubernetes pod
set them; :func:`launch_local` sets them for local processes) and joins a ``torch.distributed``
group (gloo: the engine computes on the CPU; ``KVBATCH_DIST_BACKEND`` overrides; with ``nccl``
each rank takes GPU ``LOCAL_RANK``). A rank of an expert-parallel group loads only its experts.

- Data parallel: rank ``r`` takes input rows ``r, r + W, r + 2W, ...``; attention and dense
  layers run on each rank's own requests only.
- Expert parallel (MoE models, W > 1): each rank keeps only its expert slots
  (:class:`~kvbatch.engine.parallel.expert_parallel.ExpertParallelCompute`) and tokens travel to their
  experts by all-to-all. Ranks step in lockstep: every step starts with an all_reduce of "has
  work", and a rank without work still serves the other ranks' tokens.
- Live EPLB (``eplb_interval`` > 0): every rank counts its routing
  (:class:`~kvbatch.engine.parallel.eplb.ExpertLoadWindow`); every ``eplb_interval`` steps the counts
  are summed over ranks, :func:`~kvbatch.engine.parallel.eplb.rebalance_experts` places ``E +
  redundant_experts`` slots, and the expert weights move (between steps, on all ranks).
- Each rank commits its own output lines, with each row's figures, as part files every
  ``checkpoint_rows`` lines (:mod:`kvbatch.ops.decode_checkpoint`, as the pipeline's decode does)
  under ``parts_url``; rows never travel through the process group, only each rank's counts and
  timings do. Rank 0 then merges the parts in input order into the output (the same file a
  single process writes) and sums the metrics once, over exactly the rows written, so they equal
  one process's for any split. An input that breaks part-way ends the output as in one process:
  every row read before the break answered, then one line saying where it ended.
- A run killed mid-way (SIGKILL included) leaves its parts; a re-run of the same command keeps
  them and answers only the rows in none (:mod:`kvbatch.ops.group_resume`: the folder is keyed by
  the input and the options that change an answer; parts of another run are discarded).

The spec is the decode worker's (:mod:`kvbatch.ops.decode_worker`) plus: ``command``
(``"generate"`` with ``input``, or ``"decode"`` with ``manifests``), ``output``, ``errors``,
``metrics``, ``model_name``, ``strict`` (generate: reject rows with unknown fields, as
``--strict`` does), ``report`` (a JSON file rank 0 writes for the launcher), ``parts_url`` (the
ranks' staging folder, default a dot folder beside the output; every rank must reach it, and rank
0 deletes it once the output is committed), ``checkpoint_rows`` (lines per part, default 256),
``resume`` (default true: keep the parts an earlier run of the same command left), ``eplb_interval``,
``redundant_experts``, ``eplb_window`` (steps of load history, default the interval) and, for
tests, ``eplb_force`` (``"rotate"``: at each interval move every expert to the next rank instead
of balancing).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import pyarrow as pa

from kvbatch.io.batch_output import OrderedJsonlWriter, encode_line
from kvbatch.ops.decode_checkpoint import (
    INDEX_COLUMN,
    PartWriter,
    done_index_array,
    merged_parts,
    part_stats,
    remove_parts,
)
from kvbatch.ops.group_resume import group_key, start_group_parts, unanswered, with_indexes

EXIT_OK, EXIT_REJECTS, EXIT_FATAL = 0, 1, 2
DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer than this fails the group
DEFAULT_PART_ROWS = 256  # output rows per part file a rank commits: its memory holds at most this many

# One output row in a rank's part file: the encoded line and the figures the metrics sum (null for
# a rejected row), keyed by the row's place in the input (``manifest_index``, the part's index).
GROUP_PART_SCHEMA = pa.schema([
    ("line", pa.binary()),
    ("rejected", pa.bool_()),
    ("reject_field", pa.string()),
    *[(name, pa.int64()) for name in ("prompt_tokens", "cached_prompt_tokens", "loaded_prompt_tokens",
                                      "output_tokens", "preemptions", "spec_draft_tokens", "spec_accepted_tokens",
                                      "spec_target_steps")],
    ("ttft_s", pa.float64()),
    ("tpot_s", pa.float64()),
])


# ------------------------------------------------------------------------------------------------
# A rank's output: part files, not lines gathered to rank 0


class RowFigures:
    """An engine whose :meth:`stream` notes each result's figures (tokens by class, latencies,
    speculation) under its request id before handing it on, for :class:`RankPartSink` to store
    beside the line ``run_jobs`` writes for it; everything else is the wrapped engine's."""

    def __init__(self, engine: Any, figures: dict[str, dict[str, Any]]) -> None:
        self.engine = engine
        self.figures = figures

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def stream(self, requests: Iterable[Any], max_waiting: int | None = None) -> Iterator[Any]:
        for result in self.engine.stream(requests, max_waiting):
            self.figures[result.request_id] = {
                "prompt_tokens": len(result.prompt_token_ids), "cached_prompt_tokens": result.num_cached_tokens,
                "loaded_prompt_tokens": result.num_loaded_tokens, "output_tokens": len(result.output_token_ids),
                "preemptions": result.num_preemptions, "spec_draft_tokens": result.spec_draft_tokens,
                "spec_accepted_tokens": result.spec_accepted_tokens, "spec_target_steps": result.spec_target_steps,
                "ttft_s": result.ttft_s, "tpot_s": result.tpot_s}
            yield result


class RankPartSink(OrderedJsonlWriter):
    """Where ``run_jobs`` puts one rank's output lines: each goes, with its figures, into the rank's
    part files (:class:`~kvbatch.ops.decode_checkpoint.PartWriter`, a part per ``part_rows`` lines)
    under its place in the whole input (row ``i`` of rank ``r``'s share is input row ``i * W + r``).
    Rank 0 merges the parts; no line crosses the process group."""

    def __init__(self, parts_url: str, rank: int, world: int, attempt: str, part_rows: int,
                 storage_options: dict[str, Any], key: str) -> None:
        # Not OrderedJsonlWriter.__init__: nothing is written at a URL of its own; run_jobs only
        # needs put / close / abort and the context manager.
        self.url = parts_url
        self.rank, self.world = rank, world
        self.figures: dict[str, dict[str, Any]] = {}
        self.rows = 0
        self._started = time.perf_counter()
        self._writer = PartWriter(parts_url, GROUP_PART_SCHEMA, rank, key, part_rows, storage_options, attempt)

    def _stats(self) -> dict[str, Any]:
        # in each part's footer: a re-run after a kill counts the killed run's time up to its last part
        return {"rows": self.rows, "wall_s": round(time.perf_counter() - self._started, 4)}

    def put(self, index: int, obj: Any) -> None:
        error = obj.get("error")
        figures = self.figures.pop(str(index), None) if error is None else None
        assert error is not None or figures is not None, f"no figures noted for answered row {index}"
        self._writer.add(index * self.world + self.rank, {
            "line": encode_line(obj), "rejected": error is not None,
            "reject_field": None if error is None else error.get("field"), **(figures or {})}, self._stats)
        self.rows += 1

    def close(self) -> None:
        self._writer.flush(self._stats())

    def abort(self) -> None:
        """Nothing to undo: parts already committed stay for the re-run to resume from (rank 0
        removes them once the output is committed)."""


# ------------------------------------------------------------------------------------------------
# Lockstep stepping


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
        work, and a rank with none joins it idle (its experts serve the others)."""
        llm = self.llm
        cap = max_waiting or 2 * llm.engine_config.max_num_seqs
        it = iter(requests)
        exhausted = False
        while True:
            exhausted = exhausted or llm.admit(it, cap)
            mine = llm.scheduler.has_work()
            if not self.ep.any_rank(mine):
                return
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


def _max_over_mean(rank_load: Any) -> float | None:
    """Mean over layers with load of max_r / mean_r ([L, W] rank loads)."""
    active = rank_load.sum(-1) > 0
    if not bool(active.any()):
        return None
    rl = rank_load[active]
    return float((rl.max(-1).values / rl.mean(-1)).mean())


# ------------------------------------------------------------------------------------------------
# One rank


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set: start workers with torchrun or launch_local")
        return default
    return int(value)


def init_group(timeout_s: float | None = None) -> tuple[int, int]:
    """Join the group described by the environment; returns (rank, world size)."""
    import torch.distributed as dist

    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if world > 1 and "MASTER_PORT" not in os.environ:
        raise RuntimeError("MASTER_PORT is not set: start workers with torchrun or launch_local")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
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


def rank_experts(spec: dict[str, Any]) -> dict[int, list[int]] | None:
    """The experts this rank holds (read from the model's config.json alone), so it loads only
    those; None in a group of one, for a dense model, or a GGUF file."""
    import torch.distributed as dist

    from kvbatch.engine.models.weights import load_tokenizer_source
    from kvbatch.engine.parallel.expert_parallel import rank_expert_ids

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    source = load_tokenizer_source(spec["model"])
    if source.kind != "hf" or "config.json" not in source.files:
        return None
    return rank_expert_ids(json.loads(source.files["config.json"]), dist.get_rank(), dist.get_world_size(),
                           int(spec.get("redundant_experts", 0)))


def build_llm(spec: dict[str, Any]) -> Any:
    """This rank's engine, as the CLI would build it from the same options."""
    from kvbatch.engine.models.weights import load_checkpoint
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM

    ckpt = load_checkpoint(spec["model"], experts=rank_experts(spec))
    engine_config = EngineConfig(**spec.get("engine", {}))
    dtype = spec.get("dtype", "fp32")
    store = None
    if spec.get("kv_store"):
        from kvbatch.io.kv_store import KVStore, KVStoreConfig
        from kvbatch.ops.shards import kv_fingerprint

        fingerprint = spec.get("kv_fingerprint") or kv_fingerprint(ckpt.fingerprint, dtype, engine_config.block_size)
        store = KVStore.from_config(KVStoreConfig(**spec["kv_store"]), fingerprint)
    speculative = None
    if spec.get("speculative"):
        from kvbatch.engine.speculative.controller import SpecConfig

        s = spec["speculative"]
        speculative = SpecConfig.parse(s["method"], s.get("max_len", SpecConfig.max_len), s.get("adaptive", True))
    return LLM(ckpt, dtype=dtype, engine_config=engine_config, kv_store=store, seed=spec.get("seed", 0),
               num_threads=spec.get("threads"), speculative=speculative)


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
    from kvbatch.ops.jobs import tokenize_requests
    from kvbatch.ops.manifests import manifest_jobs, read_manifests

    so = spec.get("storage_options") or {}
    if spec["command"] == "generate":
        rows = read_requests(spec["input"], storage_options=so, strict=bool(spec.get("strict", False)))
        pairs = unanswered(_until_broken(rows, broken), rank, world, done, skipped)
        return with_indexes(lambda items: tokenize_requests(llm, items), pairs)
    if spec["command"] == "decode":
        pairs = unanswered(read_manifests(spec["manifests"], so), rank, world, done, skipped)
        return with_indexes(lambda items: manifest_jobs(llm, items), pairs)
    raise ValueError(f"unknown worker command {spec['command']!r} (generate or decode)")


def run_rank(spec: dict[str, Any], on_progress: Callable[[int, int], None] | None = None) -> int:
    """Run this rank's share, committing its output rows as part files as it goes; rank 0 then
    merges the parts into the output and writes the metrics. Returns the exit status."""
    import torch.distributed as dist

    from kvbatch.engine.parallel.expert_parallel import install
    from kvbatch.io.urls import redact_text
    from kvbatch.ops.batch_generate import run_jobs

    rank, world = init_group(spec.get("timeout_s"))
    try:
        llm = build_llm(spec)
        engine: Any = llm
        ep = balancer = None
        if world > 1 and getattr(llm.model, "moe_layers", None):
            redundant = int(spec.get("redundant_experts", 0))
            ep = install(llm.model, initial_placement(llm.model, world, redundant))
            on_step = None
            interval = int(spec.get("eplb_interval") or 0)
            if interval > 0:
                balancer = LiveBalancer(llm, ep, interval, ep.placement.num_slots, spec.get("eplb_window"),
                                        spec.get("eplb_force"))
                on_step = balancer.on_step
            engine = LockstepLLM(llm, ep, on_step)
        so = spec.get("storage_options") or {}
        parts_url = group_parts_url(spec)
        attempt, key = _on_rank0(lambda: _start_parts(spec, llm), rank, world)  # parts of another run gone
        done = done_index_array(parts_url, so, rank, world)  # this rank's rows an earlier run committed
        sink = RankPartSink(parts_url, rank, world, attempt, int(spec.get("checkpoint_rows") or DEFAULT_PART_ROWS),
                            so, key)
        broken: list[Any] = []
        skipped = [0]
        jobs = _rank_jobs(llm, spec, rank, world, done, skipped, broken)
        report = run_jobs(RowFigures(engine, sink.figures), jobs, sink, model_name=spec.get("model_name", "kvbatch"),
                          on_progress=on_progress if rank == 0 else None)
        # What travels to rank 0 is this rank's counts and timings, never its rows (those are in its parts).
        mine = {"attempt": attempt, "rows": sink.rows, "resumed": skipped[0], "wall_s": report.wall_s,
                "draft_s": report.draft_s, "step_s_total": report.step_s,
                "spec_enabled": report.spec_enabled, "ep": ep.stats.to_json() if ep else None,
                "balancer": _balancer_json(balancer, ep), "step_s": getattr(engine, "step_s", []) if rank == 0 else [],
                "broken": {"lines_read": broken[0].lines_read, "reason": redact_text(broken[0].reason, broken[0].url),
                           "message": str(broken[0])} if broken else None}
        ranks: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(mine, ranks if rank == 0 else None, dst=0)
        if rank != 0:
            return EXIT_OK
        code = _write_outputs(spec, ranks, world, parts_url)
        remove_parts(parts_url, so)  # only once the output is committed: a failed merge keeps them for a re-run
        return code
    finally:
        dist.destroy_process_group()


def _on_rank0(fn: Callable[[], Any], rank: int, world: int) -> Any:
    """``fn()`` on rank 0 before any rank goes on; its (small) result on every rank."""
    import torch.distributed as dist

    box = [fn() if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def group_parts_url(spec: dict[str, Any]) -> str:
    """Where the ranks write their part files: the spec's ``parts_url``, else a dot folder beside
    the output (folder scans skip dot names), which outlives a killed run so that its re-run
    resumes (:mod:`kvbatch.ops.group_resume`)."""
    if spec.get("parts_url"):
        return str(spec["parts_url"])
    head, _, name = str(spec["output"]).rpartition("/")
    return f"{head}/.{name}.kvbatch-parts" if head else f".{name}.kvbatch-parts"


def _start_parts(spec: dict[str, Any], llm: Any) -> tuple[str, str]:
    """Rank 0, before any rank writes: this run's key, the parts of an earlier run of the same
    command kept (``resume``, the default) and any others dropped; a new run id beside it."""
    key = group_key(spec, llm.checkpoint.fingerprint)
    start_group_parts(group_parts_url(spec), key, spec.get("storage_options") or {},
                      resume=bool(spec.get("resume", True)))
    return uuid.uuid4().hex[:12], key


def _balancer_json(balancer: LiveBalancer | None, ep: Any) -> dict[str, Any] | None:
    if balancer is None:
        return None
    return {"history": balancer.history,
            "boundaries": [(step, rows) for step, rows in balancer.boundaries],
            "final_rows": dict(ep.stats.rows_computed)}


def rank_load_segments(parts: Sequence[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Measured max / mean rank load (expert rows computed) between rebalances: one segment per
    stretch of steps with one placement, each the mean over MoE layers of max_r / mean_r."""
    def ratio(rows_by_rank: list[dict[int, int]]) -> float | None:
        layers = sorted({li for rows in rows_by_rank for li in rows})
        ratios = []
        for li in layers:
            loads = [rows.get(li, 0) for rows in rows_by_rank]
            mean = sum(loads) / world
            if mean > 0:
                ratios.append(max(loads) / mean)
        return sum(ratios) / len(ratios) if ratios else None

    def diff(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
        return {li: a.get(li, 0) - b.get(li, 0) for li in set(a) | set(b)}

    per_rank_marks = []
    for p in parts:
        if p["balancer"] is not None:
            marks = [(s, {int(k): v for k, v in rows.items()}) for s, rows in p["balancer"]["boundaries"]]
            final = {int(k): v for k, v in p["balancer"]["final_rows"].items()}
        else:
            marks, final = [], {int(k): v for k, v in (p["ep"] or {}).get("rows_computed", {}).items()}
        per_rank_marks.append(marks + [(None, final)])
    segments = []
    prev_rows: list[dict[int, int]] = [{} for _ in parts]
    prev_step = 0
    for i in range(len(per_rank_marks[0])):
        step = per_rank_marks[0][i][0]
        rows = [marks[i][1] for marks in per_rank_marks]
        seg = [diff(rows[r], prev_rows[r]) for r in range(world)]
        segments.append({"from_step": prev_step, "to_step": step, "rank_load_max_over_mean": ratio(seg)})
        prev_rows, prev_step = rows, step
    return segments


def _broken_input(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the group's input broke: the earliest break any rank saw. Every rank reads the same
    bytes, so they break at the same line, but a read error need not, and the output must have no
    hole: rows from that line on are left out of the output and of every figure."""
    breaks = [r["broken"] for r in ranks if r.get("broken")]
    return min(breaks, key=lambda b: b["lines_read"]) if breaks else None


class _GroupTotals:
    """The group's counts, summed once over the committed output rows (a window at a time), so
    they equal one process's whatever the split, rows a rank read past an earlier break excluded."""

    COUNTS = ("prompt_tokens", "cached_prompt_tokens", "loaded_prompt_tokens", "output_tokens", "preemptions",
              "spec_draft_tokens", "spec_accepted_tokens", "spec_target_steps")

    def __init__(self) -> None:
        self.rows = 0
        self.succeeded = 0
        self.sums = dict.fromkeys(self.COUNTS, 0)
        self.rejects_by_field: dict[str, int] = {}
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []

    def add(self, window: Any) -> None:
        # pyarrow compute, not polars: the workers also run on GPU images that carry no polars.
        import pyarrow.compute as pc

        rejected = window.column("rejected")
        self.rows += window.num_rows
        self.succeeded += window.num_rows - int(pc.sum(rejected).as_py() or 0)
        for c in self.COUNTS:
            self.sums[c] += int(pc.sum(window.column(c)).as_py() or 0)
        by_field = window.filter(rejected).group_by("reject_field").aggregate([("rejected", "count")])
        for field_name, n in zip(by_field.column("reject_field").to_pylist(),
                                 by_field.column("rejected_count").to_pylist(), strict=True):
            self.rejects_by_field[field_name] = self.rejects_by_field.get(field_name, 0) + int(n)
        self.ttft_s += pc.drop_null(window.column("ttft_s")).to_numpy().tolist()
        self.tpot_s += pc.drop_null(window.column("tpot_s")).to_numpy().tolist()

    def report(self, ranks: list[dict[str, Any]], earlier_wall_s: float) -> Any:
        from kvbatch.ops.batch_report import BatchReport

        report = BatchReport(requests=self.rows, succeeded=self.succeeded, rejected=self.rows - self.succeeded,
                             rejects_by_field=dict(self.rejects_by_field), ttft_s=self.ttft_s, tpot_s=self.tpot_s,
                             spec_enabled=any(r["spec_enabled"] for r in ranks),
                             # the ranks run at once: the slowest; plus killed runs' time to their last part
                             wall_s=max(r["wall_s"] for r in ranks) + earlier_wall_s,
                             draft_s=sum(r["draft_s"] for r in ranks), step_s=sum(r["step_s_total"] for r in ranks))
        for c in self.COUNTS:
            setattr(report, c, self.sums[c])
        return report


def _write_outputs(spec: dict[str, Any], ranks: list[dict[str, Any]], world: int, parts_url: str) -> int:
    """Rank 0, once every rank committed its parts: every part in the folder (this run's and
    those an earlier, killed run of the same command left) merged in input order into the output
    (the same file a single process writes) and the errors file, the figures summed over exactly
    those rows, the metrics.

    An input that broke part-way: the rows read before the break, then one line saying where the
    input ended (as a single process writes it); the metrics and the launcher's report say so
    (``input_broken``), and the exit status is ``EXIT_FATAL`` unless a launcher (``report``)
    reports it, in one line, itself."""
    import numpy as np

    from kvbatch.io.batch_output import JsonlWriter, error_line
    from kvbatch.io.batch_requests import WHOLE_LINE, RejectedRow

    so = spec.get("storage_options") or {}
    broken = _broken_input(ranks)
    # Without a break every row a rank answered is output; with one, exactly the rows before it.
    total = sum(r["rows"] + r.get("resumed", 0) for r in ranks) if broken is None else broken["lines_read"]
    marker = None if broken is None else error_line(RejectedRow(
        broken["lines_read"] + 1, None, WHOLE_LINE, f"input ends here, unreadable: {broken['reason']}"))
    totals = _GroupTotals()
    earlier_runs, earlier_wall_s = _earlier_runs(parts_url, so, {r.get("attempt") for r in ranks})
    with JsonlWriter(spec["output"], storage_options=so) as out:
        errors = JsonlWriter(spec["errors"], storage_options=so) if spec.get("errors") else None
        try:
            for window in merged_parts(parts_url, GROUP_PART_SCHEMA, so):
                if broken is not None:
                    window = window.slice(0, int(np.searchsorted(window.column(INDEX_COLUMN).to_numpy(), total)))
                index = window.column(INDEX_COLUMN).to_numpy()
                if not np.array_equal(index, np.arange(totals.rows, totals.rows + len(index))):
                    twice = index[1:][index[1:] == index[:-1]]
                    if len(twice):  # two runs writing one output at once: refused, never written twice
                        raise RuntimeError(f"the ranks' parts hold output row {int(twice[0])} twice")
                    raise RuntimeError(f"the ranks' parts miss output row {_first_gap(index, totals.rows)}")
                # Writing bytes is per line; deciding what goes where is not.
                for line, is_error in zip(window.column("line").to_pylist(), window.column("rejected").to_pylist(),
                                          strict=True):
                    out.write_encoded(line)
                    if errors is not None and is_error:
                        errors.write_encoded(line)
                totals.add(window)
            if totals.rows != total:
                raise RuntimeError(f"the ranks' parts hold {totals.rows} output rows, expected {total}")
            if marker is not None:
                out.write(marker)
                if errors is not None:
                    errors.write(marker)
        except BaseException:
            if errors is not None:
                errors.abort()
            raise
        if errors is not None:
            errors.close()
    report = totals.report(ranks, earlier_wall_s)
    if marker is not None:  # counted as one process counts it: a rejected row
        report.requests += 1
        report.rejected += 1
        report.rejects_by_field[WHOLE_LINE] = report.rejects_by_field.get(WHOLE_LINE, 0) + 1
    metrics = report.to_json()
    metrics["workers"] = world
    metrics["resumed_rows"] = sum(r.get("resumed", 0) for r in ranks)  # answered by an earlier run's parts
    metrics["runs"] = 1 + earlier_runs
    if broken is not None:
        metrics["input_broken"] = {"lines_read": broken["lines_read"], "message": broken["message"]}
    if ranks[0]["ep"] is not None:
        metrics["expert_parallel"] = group_metrics(ranks, world)
    if spec.get("metrics"):
        with open_url(spec["metrics"], so) as f:
            json.dump(metrics, f, indent=2)
            f.write("\n")
    if spec.get("report"):
        with open(spec["report"], "w", encoding="utf-8") as f:
            json.dump(metrics, f)
    elif broken is not None:  # no launcher to say it (torchrun): this rank's one line and status
        print(f"kvbatch: error: {broken['message']}; the {broken['lines_read']} rows read before it are answered "
              f"in {spec['output']}, whose last line marks where the input ended", file=sys.stderr)
        return EXIT_FATAL
    return EXIT_REJECTS if report.rejected else EXIT_OK


def _earlier_runs(parts_url: str, storage_options: dict[str, Any], this_run: set[Any]) -> tuple[int, float]:
    """How many earlier (killed) runs left parts here, and their wall time up to their last part
    (each run's slowest rank; parts' footers only)."""
    walls: dict[str, float] = {}
    for (attempt, _rank), stats in part_stats(parts_url, storage_options).items():
        if attempt not in this_run:
            walls[attempt] = max(walls.get(attempt, 0.0), float(stats.get("wall_s", 0.0)))
    return len(walls), sum(walls.values())


def _first_gap(index: Any, start: int) -> int:
    for want, got in enumerate(index.tolist(), start):
        if want != got:
            return want
    return start + len(index)


def group_metrics(parts: Sequence[dict[str, Any]], world: int) -> dict[str, Any]:
    """The expert-parallel figures of a run, from every rank's gathered part."""
    import statistics

    eps = [p["ep"] for p in parts]
    steps = parts[0]["step_s"]
    out: dict[str, Any] = {
        "a2a_bytes_per_token_per_layer": round(a2a_bytes(eps), 3),
        "a2a_payload_bytes": sum(sum(e["dispatch_bytes"].values()) + sum(e["combine_bytes"].values()) for e in eps),
        "a2a_header_bytes": sum(e["header_bytes"] for e in eps),
        "steps": len(steps),
        "step_s_median": statistics.median(steps) if steps else None,
        "idle_rounds": sum(e["idle_rounds"] for e in eps),
        "rebalances": eps[0]["rebalances"],
        "rebalance_bytes": sum(e["rebalance_bytes"] for e in eps),
        "rank_load_segments": rank_load_segments(parts, world),
        "rows_computed_by_rank": [sum(e["rows_computed"].values()) for e in eps],
    }
    if parts[0]["balancer"] is not None:
        history = parts[0]["balancer"]["history"]
        out["eplb_history"] = history
        if history:  # step i (1-based) ran under the first rebalanced placement when i > its step
            after = steps[history[0]["step"]:]
            out["step_s_median_after_first_rebalance"] = statistics.median(after) if after else None
    return out


def a2a_bytes(eps: Sequence[dict[str, Any]]) -> float:
    from kvbatch.engine.parallel.expert_parallel import a2a_bytes_per_token_per_layer

    return a2a_bytes_per_token_per_layer(list(eps))


def open_url(url: str, storage_options: dict[str, Any]) -> Any:
    import fsspec

    return fsspec.open(url, "w", **storage_options)


# ------------------------------------------------------------------------------------------------
# The local launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child: get SIGTERM if the launcher dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_local(world_size: int, argv: Sequence[str], *, grace_s: float = 10.0,
                 env: dict[str, str] | None = None) -> int:
    """Run ``world_size`` local processes of this module's entry point with ``argv``, as
    torchrun would; returns rank 0's exit status, or ``EXIT_FATAL`` when any rank fails.

    A rank that dies takes the group down: the others are sent SIGTERM (SIGKILL after
    ``grace_s``), and the message names the rank. SIGTERM/SIGINT to the launcher go to the
    workers too; a worker also gets SIGTERM if the launcher itself is killed.
    """
    port = _free_port()
    base = {**os.environ, **(env or {})}
    # Like torchrun: one thread per worker unless told otherwise (W processes share the cores).
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    procs: list[subprocess.Popen] = []
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(world_size):
            child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                         "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen([sys.executable, "-m", "kvbatch.ops.worker_group", *argv], env=child_env,
                                          preexec_fn=_die_with_parent))
        return _supervise(procs, received, grace_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)


def _supervise(procs: list[subprocess.Popen], received: list[int], grace_s: float) -> int:
    failed: tuple[int, int] | None = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            for rank, code in enumerate(codes):
                if code is not None and code not in (EXIT_OK, EXIT_REJECTS):
                    failed = (rank, code)
                    break
        if received or failed is not None:
            break
        if all(c is not None for c in codes):
            return codes[0] if codes[0] is not None else EXIT_FATAL
        time.sleep(0.05)
    # Stop the rest: SIGTERM (already forwarded on a signal), SIGKILL after the grace period.
    for p in procs:
        if p.poll() is None and not received:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if received:
        print(f"kvbatch: error: worker group stopped by signal {received[0]}", file=sys.stderr)
        return 128 + received[0]
    assert failed is not None
    rank, code = failed
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    print(f"kvbatch: error: worker rank {rank} {how}; the group of {len(procs)} was stopped", file=sys.stderr)
    return EXIT_FATAL


# ------------------------------------------------------------------------------------------------
# Entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbatch.ops.worker_group")
    p.add_argument("--spec", required=True, help="worker group spec JSON (module docstring)")
    args = p.parse_args(argv)
    with open(args.spec, encoding="utf-8") as f:
        spec = json.load(f)
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        # Every rank reads the whole input: the reader's warnings (an unknown field, once per
        # name) are the same on each, so rank 0's say them once for the group.
        logging.getLogger("kvbatch.io.batch_requests").setLevel(logging.ERROR)
    try:
        return run_rank(spec)
    except Exception as exc:  # noqa: BLE001 - one line naming the rank; the launcher stops the group
        print(f"kvbatch: error: worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main())
