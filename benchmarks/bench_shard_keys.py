"""What a wide shard range costs the Dagster UI: GraphQL response times of the queries the asset
page of a (date, shard) asset makes, on a running ``dagster-webserver``, for a shard range of
``--widths`` keys (default the old 8 and the new 1024), in the same run.

    python -m benchmarks.bench_shard_keys                          # widths 8 and 1024, start 2026-01-01
    python -m benchmarks.bench_shard_keys --days-done 30 --shards-done 100

For each width: a fresh ``DAGSTER_HOME`` with ``--days-done`` x ``--shards-done`` materializations
of ``decode_results`` reported (runless events: what nights leave in the event log, scaled
down) and a webserver on the code location with ``KVBATCH_MAX_SHARDS`` = width, all running at
once; then each query is timed ``--repeat`` times on each server in turn (interleaved, so the
widths share the machine's load alike), the best and the median printed. The partition keys that exist
are dates since ``KVBATCH_START_DATE`` times the width. Prints the CPU (lscpu) and the load
average next to the figures: the machine may be shared.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.bench_pipeline_scale import cpu, load

REPO = Path(__file__).resolve().parents[1]
WEBSERVER = str(Path(sys.executable).with_name("dagster-webserver"))

QUERIES = {
    "partition keys by dimension": """{ assetNodeOrError(assetKey: {path: ["decode_results"]}) {
        ... on AssetNode { partitionKeysByDimension { name partitionKeys } } } }""",
    "partition statuses": """{ assetNodeOrError(assetKey: {path: ["decode_results"]}) {
        ... on AssetNode { assetPartitionStatuses { __typename
          ... on MultiPartitionStatuses { primaryDimensionName ranges { primaryDimStartKey primaryDimEndKey
            secondaryDim { __typename ... on DefaultPartitionStatuses { materializedPartitions } } } } } } } }""",
    "partition stats": """{ assetNodeOrError(assetKey: {path: ["decode_results"]}) {
        ... on AssetNode { partitionStats { numMaterialized numPartitions numFailed } } } }""",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, query: str) -> tuple[float, dict]:
    req = urllib.request.Request(url + "/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        body = json.load(resp)
    took = time.perf_counter() - start
    if body.get("errors"):
        raise RuntimeError(body["errors"])
    return took, body["data"]


def _report_done(home: Path, env: dict, days: int, shards: int, start: str) -> None:
    """Materializations of decode_results for the first ``days`` x ``shards`` keys, in a child with
    the same environment (the partitions are read at import)."""
    code = f"""
import datetime as dt, dagster as dg
inst = dg.DagsterInstance.from_config({str(home)!r})
first = dt.date.fromisoformat({start!r})
for d in range({days}):
    date = (first + dt.timedelta(days=d)).isoformat()
    for s in range({shards}):
        inst.report_runless_asset_event(dg.AssetMaterialization("decode_results", partition=f"{{date}}|{{s:04d}}"))
"""
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=REPO)


class Server:
    """A fresh DAGSTER_HOME with the reported materializations and a webserver over it, for one width."""

    def __init__(self, width: int, args: argparse.Namespace, tmp: Path):
        self.width = width
        home = tmp / f"home-{width}"
        home.mkdir()
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBATCH_", "DAGSTER_"))}
        env.update(DAGSTER_HOME=str(home), KVBATCH_ROOT=str(tmp / f"data-{width}"), KVBATCH_MAX_SHARDS=str(width),
                   KVBATCH_START_DATE=args.start, KVBATCH_TIMEZONE="UTC", PYTHONPATH=str(REPO),
                   DAGSTER_DISABLE_TELEMETRY="1")
        self.done = args.days_done * min(args.shards_done, width)
        t0 = time.perf_counter()
        _report_done(home, env, args.days_done, min(args.shards_done, width), args.start)
        self.report_s = time.perf_counter() - t0
        self.log_path = tmp / f"webserver-{width}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        port = _free_port()
        self.proc = subprocess.Popen([WEBSERVER, "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
                                     cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text()[-3000:])
            try:
                _, data = _post(self.url, '{ assetNodeOrError(assetKey: {path: ["decode_results"]}) { __typename } }')
                if data["assetNodeOrError"]["__typename"] == "AssetNode":
                    return
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"webserver not up after {timeout_s} s")
            time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def measure(args: argparse.Namespace) -> list[dict]:
    """Every query on every width's webserver, interleaved: each repetition asks each server in turn."""
    with tempfile.TemporaryDirectory(prefix="kvbatch-keys-") as tmp:
        servers = [Server(w, args, Path(tmp)) for w in args.widths]
        try:
            for server in servers:
                server.wait_ready()
            times: dict[tuple[int, str], list[float]] = {}
            out = {s.width: {"width": s.width, "reported_materializations": s.done, "report_s": round(s.report_s, 1)}
                   for s in servers}
            for name, query in QUERIES.items():
                for _ in range(args.repeat):
                    for server in servers:
                        took, data = _post(server.url, query)
                        times.setdefault((server.width, name), []).append(took)
                        if name == "partition stats":
                            stats = data["assetNodeOrError"]["partitionStats"]
                            out[server.width]["keys"] = stats["numPartitions"]
                            out[server.width]["materialized"] = stats["numMaterialized"]
            for (width, name), ts in times.items():
                out[width][name] = {"best_s": round(min(ts), 3), "median_s": round(statistics.median(ts), 3)}
            return list(out.values())
        finally:
            for server in servers:
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[8, 1024])
    parser.add_argument("--start", default="2026-01-01", help="KVBATCH_START_DATE (the dates that exist)")
    parser.add_argument("--days-done", type=int, default=30)
    parser.add_argument("--shards-done", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(cpu())
    print(f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {load()}", flush=True)
    for row in measure(args):
        print(json.dumps(row), flush=True)
    print(load(), flush=True)


if __name__ == "__main__":
    main()
