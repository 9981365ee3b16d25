"""The batch worker of ``kvbatch serve``: reads one job per line on stdin (``batch_id``,
``input_url``, ``work_url``, ``chunk_rows``, ``endpoint``) and executes each as a run of the
``kvbatch_batch_api`` job in the Dagster instance of ``DAGSTER_HOME`` (an ephemeral one when
unset), tagged ``kvbatch/batch_id``; exits when stdin closes.

A run of the same batch that an earlier worker left STARTED (it died with its machine or its
server) is marked failed first, so the UI does not show it running forever; the new run resumes
after the batch's last committed part.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import dagster as dg

from kvbatch.pipelines.batch_api import BATCH_JOB, BATCH_TAG, batch_run_config

log = logging.getLogger("kvbatch.serve.worker")


def run_one(instance: dg.DagsterInstance, job: dict) -> bool:
    from kvbatch.pipelines.definitions import defs

    batch_id = job["batch_id"]
    stale = instance.get_runs(filters=dg.RunsFilter(tags={BATCH_TAG: batch_id},
                                                    statuses=[dg.DagsterRunStatus.STARTED]))
    for run in stale:
        instance.report_run_failed(run, message="its worker stopped; a new run resumes the batch")
    config = batch_run_config(batch_id, job["input_url"], job["work_url"], int(job["chunk_rows"]),
                              endpoint=job.get("endpoint"))
    result = defs.get_job_def(BATCH_JOB).execute_in_process(run_config=config, instance=instance,
                                                            tags={BATCH_TAG: batch_id}, raise_on_error=False)
    return result.success


def main() -> int:
    from kvbatch.engine.runtime import llm  # noqa: F401 - warm: torch and the engine load before any batch
    from kvbatch.pipelines import definitions  # noqa: F401

    instance = dg.DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else dg.DagsterInstance.ephemeral()
    for line in sys.stdin:
        if line.strip():
            job = json.loads(line)
            ok = run_one(instance, job)
            print(f"kvbatch worker: batch {job['batch_id']} run {'succeeded' if ok else 'failed'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
