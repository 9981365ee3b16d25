"""Jobs, the nightly schedule and the sensors.

- ``kvbatch_ingest``: prompts + prompt_shards, for one date partition.
- ``kvbatch_prefill``: prefill_kv; ``kvbatch_decode``: decode_results + cost_metrics;
  ``kvbatch_shard``: prefill + decode + metrics. Each for one (date, shard) partition, which is
  what a failed shard re-runs.
- The whole graph of a day is ``kvbatch_ingest`` for the date, then ``kvbatch_shard`` for each
  of its n (date, shard) partitions, started by ``shards_after_ingest``: n is the count that
  run's ``prompt_shards`` chose from the day's rows, read from that materialization's
  ``num_shards`` metadata, so shards 0..n-1 are requested and none of the range beyond. (Dagster runs one
  partitions definition per job, and ingest is per date while the rest is per (date, shard):
  one job cannot hold both. In the UI, "Materialize all" over a date range is the same thing
  as a backfill.)
- ``kvbatch_rollup``: cost_rollup for one date, the sum of that day's shards; started by
  ``rollup_after_shard`` after every successful ``kvbatch_shard`` or ``kvbatch_decode`` run, so a
  re-run of one shard re-rolls its day.
- ``nightly_ingest`` (02:00 in ``KVBATCH_TIMEZONE``, STOPPED until turned on) ingests the day
  that just ended from ``KVBATCH_NIGHTLY_DATASET`` (``{date}`` filled in).
- ``new_dataset_files`` (STOPPED) ingests each new file under ``KVBATCH_INPUT_PREFIX`` into the
  date partition its path names (``.../2026-11-29.jsonl``, ``.../date=2026-11-29/x.parquet``), or
  the day it was last modified when the path names none.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re

import dagster as dg

from kvbatch.pipelines.assets import cost_metrics, decode_results, prefill_kv, prompt_shards, prompts
from kvbatch.pipelines.partitions import TIMEZONE, date_partitions, date_shard_keys, split_date_shard
from kvbatch.pipelines.rollup import cost_rollup

ingest_job = dg.define_asset_job("kvbatch_ingest", selection=[prompts, prompt_shards],
                                 description="Validate one day's dataset and tokenize it into shards.")
prefill_job = dg.define_asset_job("kvbatch_prefill", selection=[prefill_kv],
                                  description="Prefill one (date, shard) into the KV store.")
decode_job = dg.define_asset_job("kvbatch_decode", selection=[decode_results, cost_metrics],
                                 description="Decode one (date, shard) from the stored KV and meter it.")
shard_job = dg.define_asset_job("kvbatch_shard", selection=[prefill_kv, decode_results, cost_metrics],
                                description="Prefill, decode and meter one (date, shard).")

rollup_job = dg.define_asset_job("kvbatch_rollup", selection=[cost_rollup],
                                 description="Sum one day's cost_metrics shards into its cost_rollup row.")

JOBS = [ingest_job, prefill_job, decode_job, shard_job, rollup_job]
DATE_IN_PATH = re.compile(r"(?<!\d)(\d{4}-\d{2}-\d{2})(?!\d)")


def prompts_run_config(url: str) -> dict:
    return {"ops": {"prompts": {"config": {"url": url}}}}


@dg.schedule(job=ingest_job, cron_schedule="0 2 * * *", execution_timezone=TIMEZONE,
             default_status=dg.DefaultScheduleStatus.STOPPED,
             description="02:00 nightly: ingest yesterday's KVBATCH_NIGHTLY_DATASET ({date} filled in) into its "
                         "date partition; shards_after_ingest then starts one kvbatch_shard run per shard.")
def nightly_ingest(context: dg.ScheduleEvaluationContext):
    """Every night at 02:00: ingest the day that just ended, ``KVBATCH_NIGHTLY_DATASET`` with
    ``{date}`` set to that day, into its date partition; the shards follow (``shards_after_ingest``)."""
    template = os.environ.get("KVBATCH_NIGHTLY_DATASET")
    if not template:
        return dg.SkipReason("KVBATCH_NIGHTLY_DATASET is not set")
    date = (context.scheduled_execution_time - dt.timedelta(days=1)).strftime("%Y-%m-%d")
    return dg.RunRequest(run_key=f"nightly-{date}", partition_key=date,
                         run_config=prompts_run_config(template.format(date=date)))


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, monitored_jobs=[ingest_job], request_job=shard_job,
                      default_status=dg.DefaultSensorStatus.RUNNING,
                      description="After a successful kvbatch_ingest of a date: one kvbatch_shard run per "
                                  "(date, shard) of the n shards its prompt_shards made (shards 0..n-1).")
def shards_after_ingest(context: dg.RunStatusSensorContext):
    """After a successful ingest of a date, one ``kvbatch_shard`` run per shard that ingest made."""
    run = context.dagster_run
    date = run.tags.get("dagster/partition")
    if not date:
        return dg.SkipReason(f"ingest run {run.run_id} has no date partition")
    num_shards = shard_count_of_run(context.instance, run.run_id)
    if num_shards is None:
        return dg.SkipReason(f"ingest run {run.run_id} of {date} materialized no prompt_shards: no shard to start")
    return [dg.RunRequest(run_key=f"{run.run_id}-{key}", partition_key=key, tags={"kvbatch/ingest_run": run.run_id})
            for key in date_shard_keys(date, num_shards)]


def shard_count_of_run(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """The ``num_shards`` of ``prompt_shards`` as that run materialized it, or None if it did not.

    Read from the run's own event log rather than the date's ``_shard_count.json``: the sensor
    then needs no object-store access (or credentials) in the daemon, and a later re-ingest of the
    same date, which may change the count, cannot change what this run's requests cover."""
    found = None
    conn = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
    for record in conn.records:
        mat = record.event_log_entry.asset_materialization
        if mat is not None and mat.asset_key == prompt_shards.key and "num_shards" in mat.metadata:
            found = int(mat.metadata["num_shards"].value)
    return found


@dg.run_status_sensor(run_status=dg.DagsterRunStatus.SUCCESS, monitored_jobs=[shard_job, decode_job],
                      request_job=rollup_job, default_status=dg.DefaultSensorStatus.RUNNING,
                      description="After a (date, shard) is metered (kvbatch_shard or kvbatch_decode succeeded): "
                                  "re-roll that date's cost_rollup from its committed shards.")
def rollup_after_shard(context: dg.RunStatusSensorContext):
    """A finished shard run re-rolls its day (one rollup request per shard run: its run key)."""
    run = context.dagster_run
    key = run.tags.get("dagster/partition")
    if not key:
        return dg.SkipReason(f"shard run {run.run_id} has no (date, shard) partition")
    date, _ = split_date_shard(key)
    return dg.RunRequest(run_key=f"rollup-{run.run_id}", partition_key=date, tags={"kvbatch/shard_run": run.run_id})


@dg.sensor(job=ingest_job, minimum_interval_seconds=300, default_status=dg.DefaultSensorStatus.STOPPED,
           description="Ingest each new .jsonl/.jsonl.gz/.parquet file under KVBATCH_INPUT_PREFIX into the date "
                       "partition its path names (else the day it was last modified); off by default.")
def new_dataset_files(context: dg.SensorEvaluationContext):
    """Ingest each new (or changed) ``.jsonl``/``.jsonl.gz``/``.parquet`` file under
    ``KVBATCH_INPUT_PREFIX`` into its date partition. The cursor holds the files seen; the run
    key is path + version, so a re-evaluation never launches a file twice."""
    prefix = os.environ.get("KVBATCH_INPUT_PREFIX")
    if not prefix:
        return dg.SkipReason("KVBATCH_INPUT_PREFIX is not set")
    return new_file_requests(prefix, context.cursor, storage_options=_input_options(prefix))


def _input_options(prefix: str) -> dict:
    if prefix.startswith(("s3://", "s3a://")) and os.environ.get("KVBATCH_S3_ENDPOINT_URL"):
        return {"endpoint_url": os.environ["KVBATCH_S3_ENDPOINT_URL"]}
    return {}


def date_of_file(path: str, info: dict) -> str | None:
    """The date partition a landed file belongs to: the last YYYY-MM-DD in its path, else the UTC
    day it was last modified; None when that is not a date partition (before the start date, or
    not a real date)."""
    found = DATE_IN_PATH.findall(path)
    if found:
        date = found[-1]
    else:
        modified = info.get("LastModified") or info.get("mtime") or info.get("created")
        if isinstance(modified, (int, float)):
            modified = dt.datetime.fromtimestamp(modified, tz=dt.UTC)
        if not isinstance(modified, dt.datetime):
            return None
        date = modified.strftime("%Y-%m-%d")
    try:
        dt.date.fromisoformat(date)
    except ValueError:
        return None
    return date if date_partitions.has_partition_key(date) else None


def new_file_requests(prefix: str, cursor: str | None, storage_options: dict | None = None) -> dg.SensorResult:
    import fsspec

    fs, base = fsspec.core.url_to_fs(prefix, **(storage_options or {}))
    seen: dict[str, str] = json.loads(cursor) if cursor else {}
    protocol = prefix.split("://", 1)[0] + "://" if "://" in prefix else ""
    requests, skipped = [], []
    for path, info in sorted(fs.find(base, detail=True).items()):
        if not path.endswith((".jsonl", ".jsonl.gz", ".parquet")):
            continue
        version = str(info.get("ETag") or info.get("etag") or f"{info.get('mtime')}-{info.get('size')}")
        if seen.get(path) == version:
            continue
        seen[path] = version
        date = date_of_file(path, info)
        if date is None:
            skipped.append(path)
            continue
        url = protocol + path if protocol else path
        requests.append(dg.RunRequest(run_key=f"{path}@{version}", partition_key=date,
                                      run_config=prompts_run_config(url)))
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(seen, sort_keys=True),
                           skip_reason=f"no date partition for {skipped[:5]}" if skipped and not requests else None)


def wait_for_run(run_id: str, instance: dg.DagsterInstance | None = None, poll_s: float = 2.0,
                 timeout_s: float | None = None) -> dg.DagsterRun:
    """Block until a launched run has finished; the run as it ended. ``dagster job launch``
    returns once the run has started, so ``make demo`` waits with this between its runs.
    ``timeout_s``: give up (TimeoutError naming the run and its status) after that long."""
    import time

    instance = instance or dg.DagsterInstance.get()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.is_finished:
            return run
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} not finished after {timeout_s} s "
                               f"(status: {run.status.value if run else 'not in the instance'})")
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbatch.pipelines.automation RUN_ID``: wait for the run, print how it ended,
    exit 0 only when it succeeded (``$DAGSTER_HOME`` names the instance)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvbatch.pipelines.automation RUN_ID", file=sys.stderr)
        return 2
    run = wait_for_run(args[0])
    print(f"run {run.run_id}: {run.job_name} {run.tags.get('dagster/partition', '')} {run.status.value}")
    return 0 if run.status == dg.DagsterRunStatus.SUCCESS else 1


if __name__ == "__main__":
    raise SystemExit(main())
