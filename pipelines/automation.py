"""Jobs, the nightly schedule and the sensors of one pipeline ``<name>`` (:func:`build_automation`).

- ``<name>_ingest``: prompts + prompt_shards, for one date partition.
- ``<name>_prefill``: prefill_kv; ``<name>_decode``: decode_results + cost_metrics;
  ``<name>_shard``: prefill + decode + metrics. Each for one (date, shard) key, which is what a
  failed shard re-runs.
- The whole graph of a day is ``<name>_ingest`` for the date, then ``<name>_shard`` for each of
  its n (date, shard) keys, started by ``<name>_shards_after_ingest``: n is the count that run's
  ``prompt_shards`` chose from the day's rows, read from that materialization's ``num_shards``
  metadata, so exactly the day's keys are requested. (Dagster runs one partitions definition per
  job, and ingest is per date while the rest is per (date, shard): one job cannot hold both.)
- ``<name>_rollup``: cost_rollup for one date, the sum of that day's shards; started by
  ``<name>_rollup_after_shard`` after every successful ``<name>_shard`` or ``<name>_decode`` run,
  so a re-run of one shard re-rolls its day, and by ``<name>_rollup_after_failed_shard`` after
  every failed one (a blocking decode check failed, or the step gave up), so the day's scorecard
  lists that shard among those needing a look instead of leaving the day as it was.
- ``<name>_nightly_ingest`` (the pipeline's cron in ``KVBATCH_TIMEZONE``, STOPPED until turned on)
  ingests the day that just ended from the pipeline's ``input`` (else ``KVBATCH_NIGHTLY_DATASET``),
  ``{date}`` filled in.
- ``<name>_new_dataset_files`` (STOPPED) ingests each new file matching the pipeline's ``input``
  glob (else under ``KVBATCH_INPUT_PREFIX``) into the date partition its path names
  (``.../2026-11-29.jsonl``, ``.../date=2026-11-29/x.parquet``), or the day it was last modified
  when the path names none.

The code location's own pipeline's jobs, schedule and sensors are module-level names of
``kvbatch.pipelines.default``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dagster as dg

from kvbatch.pipelines.partitions import TIMEZONE, date_partitions, date_shard_keys, split_date_shard

if TYPE_CHECKING:
    from kvbatch.pipelines.factory import PipelineParts

DATE_IN_PATH = re.compile(r"(?<!\d)(\d{4}-\d{2}-\d{2})(?!\d)")
GLOB_CHARS = ("*", "?", "[")


@dataclass(frozen=True)
class Automation:
    """One pipeline's jobs, schedules and sensors, by name."""

    jobs: dict[str, dg.UnresolvedAssetJobDefinition]
    schedules: dict[str, dg.ScheduleDefinition]
    sensors: dict[str, dg.SensorDefinition]


def build_automation(p: "PipelineParts", assets: dict[str, dg.AssetsDefinition],
                     executor: dg.ExecutorDefinition | None = None) -> Automation:
    """The jobs, schedule and sensors of pipeline ``p`` (module docstring), over its ``assets``
    (by name); ``executor``: its jobs' executor (None: the code location's)."""
    n = p.name
    op_of = {k: f"{n}__{k}" for k in assets}  # the run config names steps by op: ops.<name>__prompts...

    def job(suffix: str, names: list[str], description: str) -> dg.UnresolvedAssetJobDefinition:
        return dg.define_asset_job(f"{n}_{suffix}", selection=[assets[k] for k in names], description=description,
                                   executor_def=executor, tags=dict(p.spec.tags) or None)

    ingest_job = job("ingest", ["prompts", "prompt_shards"], "Validate one day's dataset and tokenize it into shards.")
    prefill_job = job("prefill", ["prefill_kv"], "Prefill one (date, shard) into the KV store.")
    decode_job = job("decode", ["decode_results", "cost_metrics"],
                     "Decode one (date, shard) from the stored KV and meter it.")
    shard_job = job("shard", ["prefill_kv", "decode_results", "cost_metrics"],
                    "Prefill, decode and meter one (date, shard).")
    rollup_job = job("rollup", ["cost_rollup"], "Sum one day's cost_metrics shards into its cost_rollup row.")
    input_url = p.spec.input
    shards_key = assets["prompt_shards"].key

    def run_config(url: str) -> dict:
        return {"ops": {op_of["prompts"]: {"config": {"url": url}}}}

    @dg.schedule(name=f"{n}_nightly_ingest", job=ingest_job, cron_schedule=p.spec.schedule,
                 execution_timezone=TIMEZONE, default_status=dg.DefaultScheduleStatus.STOPPED,
                 description=f"{p.spec.schedule} ({TIMEZONE}): ingest the day that just ended from the pipeline's "
                             f"input (else KVBATCH_NIGHTLY_DATASET), {{date}} filled in, into its date partition; "
                             f"{n}_shards_after_ingest then starts one {n}_shard run per shard.")
    def nightly_ingest(context: dg.ScheduleEvaluationContext):
        """Ingest the day that just ended, the pipeline's ``input`` (else ``KVBATCH_NIGHTLY_DATASET``)
        with ``{date}`` set to that day, into its date partition; the shards follow."""
        template = input_url or os.environ.get("KVBATCH_NIGHTLY_DATASET")
        if not template:
            return dg.SkipReason(f"{n} has no input and KVBATCH_NIGHTLY_DATASET is not set")
        if any(c in template for c in GLOB_CHARS):
            return dg.SkipReason(f"{n}'s input {template!r} is a glob: {n}_new_dataset_files ingests its files")
        date = (context.scheduled_execution_time - dt.timedelta(days=1)).strftime("%Y-%m-%d")
        return dg.RunRequest(run_key=f"nightly-{date}", partition_key=date,
                             run_config=run_config(template.replace("{date}", date)))

    @dg.run_status_sensor(name=f"{n}_shards_after_ingest", run_status=dg.DagsterRunStatus.SUCCESS,
                          monitored_jobs=[ingest_job], request_job=shard_job,
                          default_status=dg.DefaultSensorStatus.RUNNING,
                          description=f"After a successful {n}_ingest of a date: one {n}_shard run per "
                                      "(date, shard) of the n shards its prompt_shards made (shards 0..n-1).")
    def shards_after_ingest(context: dg.RunStatusSensorContext):
        """After a successful ingest of a date, one shard run per shard that ingest made."""
        run = context.dagster_run
        date = run.tags.get("dagster/partition")
        if not date:
            return dg.SkipReason(f"ingest run {run.run_id} has no date partition")
        num_shards = shard_count_of_run(context.instance, run.run_id, shards_key)
        if num_shards is None:
            return dg.SkipReason(f"ingest run {run.run_id} of {date} materialized no prompt_shards: no shard to start")
        return [dg.RunRequest(run_key=f"{run.run_id}-{key}", partition_key=key, tags={"kvbatch/ingest_run": run.run_id})
                for key in date_shard_keys(date, num_shards)]

    @dg.run_status_sensor(name=f"{n}_rollup_after_shard", run_status=dg.DagsterRunStatus.SUCCESS,
                          monitored_jobs=[shard_job, decode_job], request_job=rollup_job,
                          default_status=dg.DefaultSensorStatus.RUNNING,
                          description=f"After a (date, shard) is metered ({n}_shard or {n}_decode succeeded): "
                                      "re-roll that date's cost_rollup from its committed shards.")
    def rollup_after_shard(context: dg.RunStatusSensorContext):
        """A finished shard run re-rolls its day (one rollup request per shard run: its run key)."""
        return rollup_request(context.dagster_run)

    @dg.run_status_sensor(name=f"{n}_rollup_after_failed_shard", run_status=dg.DagsterRunStatus.FAILURE,
                          monitored_jobs=[shard_job, decode_job], request_job=rollup_job,
                          default_status=dg.DefaultSensorStatus.RUNNING,
                          description=f"After a (date, shard) run failed ({n}_shard or {n}_decode: a blocking decode "
                                      "check failed, or a step gave up): re-roll that date's cost_rollup, so its "
                                      "scorecard lists the shard among those needing a look.")
    def rollup_after_failed_shard(context: dg.RunStatusSensorContext):
        """A failed shard run re-rolls its day too: the scorecard is where the night is read."""
        return rollup_request(context.dagster_run)

    @dg.sensor(name=f"{n}_new_dataset_files", job=ingest_job, minimum_interval_seconds=300,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="Ingest each new .jsonl/.jsonl.gz/.parquet file matching the pipeline's input (a glob), "
                           "else under KVBATCH_INPUT_PREFIX, into the date partition its path names (else the day "
                           "it was last modified); off by default.")
    def new_dataset_files(context: dg.SensorEvaluationContext):
        """Ingest each new (or changed) file of the pipeline's input glob (else under
        ``KVBATCH_INPUT_PREFIX``) into its date partition. The cursor holds the files seen; the run
        key is path + version, so a re-evaluation never launches a file twice."""
        watch = input_url if input_url and any(c in input_url for c in GLOB_CHARS) else \
            os.environ.get("KVBATCH_INPUT_PREFIX")
        if not watch:
            return dg.SkipReason(f"{n}'s input is not a glob and KVBATCH_INPUT_PREFIX is not set")
        return new_file_requests(watch, context.cursor, storage_options=_input_options(watch),
                                 prompts_op=op_of["prompts"])

    return Automation(
        jobs={j.name: j for j in (ingest_job, prefill_job, decode_job, shard_job, rollup_job)},
        schedules={nightly_ingest.name: nightly_ingest},
        sensors={s.name: s for s in (shards_after_ingest, rollup_after_shard, rollup_after_failed_shard,
                                     new_dataset_files)})


def rollup_request(run: dg.DagsterRun) -> dg.RunRequest | dg.SkipReason:
    """The rollup of the day a finished (date, shard) run belongs to; its run key is the shard
    run's, so one shard run asks for one rollup however often the sensor sees it."""
    key = run.tags.get("dagster/partition")
    if not key:
        return dg.SkipReason(f"shard run {run.run_id} has no (date, shard) partition")
    date, _ = split_date_shard(key)
    return dg.RunRequest(run_key=f"rollup-{run.run_id}", partition_key=date, tags={"kvbatch/shard_run": run.run_id})


def shard_count_of_run(instance: dg.DagsterInstance, run_id: str, prompt_shards_key: dg.AssetKey) -> int | None:
    """The ``num_shards`` of ``prompt_shards`` as that run materialized it, or None if it did not.

    Read from the run's own event log rather than the date's ``_shard_count.json``: the sensor
    then needs no object-store access (or credentials) in the daemon, and a later re-ingest of the
    same date, which may change the count, cannot change what this run's requests cover."""
    found = None
    conn = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
    for record in conn.records:
        mat = record.event_log_entry.asset_materialization
        if mat is not None and mat.asset_key == prompt_shards_key and "num_shards" in mat.metadata:
            found = int(mat.metadata["num_shards"].value)
    return found


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


def new_file_requests(prefix: str, cursor: str | None, storage_options: dict | None = None,
                      prompts_op: str = "prompts") -> dg.SensorResult:
    """Run requests for the new files under ``prefix`` (a folder, or a glob of files), each into
    the date its path names; ``prompts_op``: the step whose config takes the url."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(prefix, **(storage_options or {}))
    seen: dict[str, str] = json.loads(cursor) if cursor else {}
    protocol = prefix.split("://", 1)[0] + "://" if "://" in prefix else ""
    requests, skipped = [], []
    found = fs.glob(base, detail=True) if any(c in base for c in GLOB_CHARS) else fs.find(base, detail=True)
    for path, info in sorted(found.items()):
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
                                      run_config={"ops": {prompts_op: {"config": {"url": url}}}}))
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


CHECK_FAILED = 3  # main's exit status when a run had a failed check (demo_report's too)


def failed_checks(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    """The asset checks that failed in a run, ``"<asset> <check> (<severity>)"`` each, in order."""
    recs = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION).records
    evs = [r.event_log_entry.dagster_event.event_specific_data for r in recs]
    return [f"{e.asset_key.to_user_string()} {e.check_name} ({e.severity.value})" for e in evs if not e.passed]


def main(argv: list[str] | None = None, instance: dg.DagsterInstance | None = None) -> int:
    """``python -m kvbatch.pipelines.automation RUN_ID``: wait for the run, print how it ended and
    each check that failed in it; exit 3 when a check failed (a WARN one too: the run is green but
    the night needs a look), else 1 when the run failed, else 0 (``$DAGSTER_HOME`` names the
    instance)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvbatch.pipelines.automation RUN_ID", file=sys.stderr)
        return 2
    instance = instance or dg.DagsterInstance.get()
    run = wait_for_run(args[0], instance)
    print(f"run {run.run_id}: {run.job_name} {run.tags.get('dagster/partition', '')} {run.status.value}")
    failed = failed_checks(instance, run.run_id)
    for check in failed:
        print(f"  failed check: {check}")
    if failed:
        return CHECK_FAILED
    return 0 if run.status == dg.DagsterRunStatus.SUCCESS else 1


if __name__ == "__main__":
    raise SystemExit(main())
