"""A worker group's output: the ranks' part files, merged by rank 0 into one output and its metrics.

Rows never travel through the process group; only each rank's counts and timings do.

- The JSONL commands (``generate``, ``decode``): each rank commits its own output lines, each
  with its figures (tokens by class, latencies, speculation, whether the response cache answered
  it: :meth:`RankPartSink.note`), as part files
  every ``checkpoint_rows`` lines (:class:`RankPartSink` over
  :class:`~kvbatch.ops.decode.checkpoint.PartWriter`, as the pipeline's decode does) under
  ``parts_url`` (:func:`group_parts_url`). Rank 0 then merges the parts in input order into the
  output (the same file a single process writes) and sums the metrics once, over exactly the rows
  written, so they equal one process's for any split (the response cache's counters, per run,
  summed over the ranks) (:func:`write_outputs`; the expert-parallel
  figures: :func:`group_metrics`). An input that breaks part-way ends the output as in one
  process: every row read before the break answered, then one line saying where it ended. Parts
  an earlier, killed run of the same command left are merged too (:mod:`kvbatch.ops.decode.group_resume`).
- The pipeline shard (``shard``): the ranks' stats merged into one document
  (:func:`merge_stats`, :func:`balancedness`; the table itself is merged by
  :func:`kvbatch.ops.decode.shard.commit_parts`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from kvbatch.io.batch_output import OrderedJsonlWriter, encode_line
from kvbatch.ops.decode.checkpoint import INDEX_COLUMN, PartWriter, merged_parts, part_stats
from kvbatch.ops.decode.launch import EXIT_FATAL, EXIT_OK, EXIT_REJECTS

# One output row in a rank's part file: the encoded line and the figures the metrics sum (null for
# a rejected row), keyed by the row's place in the input (``manifest_index``, the part's index).
# A ``cached`` row (every choice answered by the response cache) counts apart, as one process
# counts it (BatchReport.add_cached), and has no latencies.
GROUP_PART_SCHEMA = pa.schema([
    ("line", pa.binary()),
    ("rejected", pa.bool_()),
    ("reject_field", pa.string()),
    ("cached", pa.bool_()),
    *[(name, pa.int64()) for name in ("prompt_tokens", "cached_prompt_tokens", "loaded_prompt_tokens",
                                      "output_tokens", "preemptions", "spec_draft_tokens", "spec_accepted_tokens",
                                      "spec_target_steps")],
    ("ttft_s", pa.float64()),
    ("tpot_s", pa.float64()),
])


# ------------------------------------------------------------------------------------------------
# A rank's output: part files, not lines gathered to rank 0


class RankPartSink(OrderedJsonlWriter):
    """Where ``run_jobs`` puts one rank's output lines: each goes, with its figures, into the rank's
    part files (:class:`~kvbatch.ops.decode.checkpoint.PartWriter`, a part per ``part_rows`` lines)
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

    def note(self, answered: Any) -> None:
        """Keep an answered row's figures (:meth:`~kvbatch.ops.decode.loop.Answered.totals`: the
        prompt once, every choice's output) for its line's :meth:`put`; ``run_jobs`` calls it."""
        r = answered.totals()
        cached = answered.cached
        self.figures[str(answered.job.index)] = {
            "cached": cached, "prompt_tokens": len(r.prompt_token_ids), "cached_prompt_tokens": r.num_cached_tokens,
            "loaded_prompt_tokens": r.num_loaded_tokens, "output_tokens": len(r.output_token_ids),
            "preemptions": r.num_preemptions, "spec_draft_tokens": r.spec_draft_tokens,
            "spec_accepted_tokens": r.spec_accepted_tokens, "spec_target_steps": r.spec_target_steps,
            # a served row's latencies were not measured: left out of the percentiles, as in one process
            "ttft_s": None if cached else r.ttft_s, "tpot_s": None if cached else r.tpot_s}

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


def group_parts_url(spec: dict[str, Any]) -> str:
    """Where the ranks write their part files: the spec's ``parts_url``, else a dot folder beside
    the output (folder scans skip dot names), which outlives a killed run so that its re-run
    resumes (:mod:`kvbatch.ops.decode.group_resume`)."""
    if spec.get("parts_url"):
        return str(spec["parts_url"])
    head, _, name = str(spec["output"]).rpartition("/")
    return f"{head}/.{name}.kvbatch-parts" if head else f".{name}.kvbatch-parts"


# ------------------------------------------------------------------------------------------------
# Rank 0: the merge


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
        self.cached_rows = 0  # rows the response cache answered, and their tokens (counted apart)
        self.cached_prompt_tokens = 0
        self.cached_output_tokens = 0
        self.rejects_by_field: dict[str, int] = {}
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []

    def add(self, window: Any) -> None:
        # pyarrow compute, not polars: the workers also run on GPU images that carry no polars.
        import pyarrow.compute as pc

        rejected = window.column("rejected")
        self.rows += window.num_rows
        self.succeeded += window.num_rows - int(pc.sum(rejected).as_py() or 0)
        cached = pc.fill_null(window.column("cached"), False)
        served, computed = window.filter(cached), window.filter(pc.invert(cached))
        self.cached_rows += served.num_rows
        self.cached_prompt_tokens += int(pc.sum(served.column("prompt_tokens")).as_py() or 0)
        self.cached_output_tokens += int(pc.sum(served.column("output_tokens")).as_py() or 0)
        for c in self.COUNTS:
            self.sums[c] += int(pc.sum(computed.column(c)).as_py() or 0)
        by_field = window.filter(rejected).group_by("reject_field").aggregate([("rejected", "count")])
        for field_name, n in zip(by_field.column("reject_field").to_pylist(),
                                 by_field.column("rejected_count").to_pylist(), strict=True):
            self.rejects_by_field[field_name] = self.rejects_by_field.get(field_name, 0) + int(n)
        self.ttft_s += pc.drop_null(window.column("ttft_s")).to_numpy().tolist()
        self.tpot_s += pc.drop_null(window.column("tpot_s")).to_numpy().tolist()

    def report(self, ranks: list[dict[str, Any]], earlier_wall_s: float) -> Any:
        from kvbatch.ops.decode.report import BatchReport

        report = BatchReport(requests=self.rows, succeeded=self.succeeded, rejected=self.rows - self.succeeded,
                             rejects_by_field=dict(self.rejects_by_field), ttft_s=self.ttft_s, tpot_s=self.tpot_s,
                             spec_enabled=any(r["spec_enabled"] for r in ranks),
                             # the ranks run at once: the slowest; plus killed runs' time to their last part
                             wall_s=max(r["wall_s"] for r in ranks) + earlier_wall_s,
                             draft_s=sum(r["draft_s"] for r in ranks), step_s=sum(r["step_s_total"] for r in ranks))
        for c in self.COUNTS:
            setattr(report, c, self.sums[c])
        caches = [r["response_cache"] for r in ranks if r.get("response_cache") is not None]
        if caches:  # this run's counters (hits, misses, writes, requests), summed over its ranks
            from kvbatch.ops.decode.report import sum_counters

            report.response_cache = sum_counters(caches)
            report.response_cache_rows = self.cached_rows
            report.response_cache_prompt_tokens = self.cached_prompt_tokens
            report.response_cache_output_tokens = self.cached_output_tokens
        return report


def write_outputs(spec: dict[str, Any], ranks: list[dict[str, Any]], world: int, parts_url: str) -> int:
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


# ------------------------------------------------------------------------------------------------
# The pipeline shard: the ranks' stats


def merge_stats(per_rank: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One stats document for ranks of one run (see :func:`kvbatch.ops.decode.shard.merge_stats`),
    percentiles over ``rows``' latencies."""
    from kvbatch.ops.decode.shard import merge_stats as merge

    return merge(per_rank, [], [r["ttft_s"] for r in rows if r["ttft_s"] is not None],
                 [r["tpot_s"] for r in rows if r["tpot_s"] is not None])


def balancedness(rows_by_rank: list[dict[str, int]]) -> float | None:
    """Mean over MoE layers of mean / max expert rows computed per rank (1 is perfect balance)."""
    from kvbatch.ops.decode.shard import balancedness as ratio

    return ratio(rows_by_rank)
