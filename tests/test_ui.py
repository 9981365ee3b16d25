"""What the Dagster UI shows, read from a running ``dagster-webserver`` (one start, shared by the
tests here): the metadata keys and their types as its GraphQL API reports them, the descriptions,
kinds and owners of the assets, checks, schedule and sensors; and, where Debian's Chromium is
installed, ``scripts/ui_check.py`` rendering the pages in a headless browser after a day run
through the named jobs on a tiny model (slow)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest

from kvbatch.pipelines.default import cost_metrics, cost_rollup
from kvbatch.pipelines.partitions import date_shard_key, register_day_shards
from kvbatch.pipelines.scorecard_metadata import PLOTTED
from tests.test_rollup import DATE, SHARDS, _resources, _write_shard

REPO = Path(__file__).resolve().parents[1]
WEBSERVER = str(Path(sys.executable).with_name("dagster-webserver"))
DAGSTER = str(Path(sys.executable).with_name("dagster"))
CHROMIUM = "/usr/bin/chromium"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _graphql(url: str, query: str) -> dict:
    req = urllib.request.Request(url + "/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = json.load(resp)
    assert "errors" not in body, body
    return body["data"]


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """A DAGSTER_HOME holding the two shards' cost_metrics and the day's cost_rollup (made from
    hand-written shard inputs: no model), and a webserver on the kvbatch code location over it."""
    base = tmp_path_factory.mktemp("ui")
    home, root = base / "dagster_home", base / "data"
    (home / ".nux").mkdir(parents=True)
    (home / ".nux" / "nux.yaml").write_text("seen: 1\n")  # no first-visit modal over the pages
    # Runs launched into the instance start at once (no daemon), as in `make demo`.
    (home / "dagster.yaml").write_text("run_coordinator:\n  module: dagster._core.run_coordinator\n"
                                       "  class: DefaultRunCoordinator\ntelemetry:\n  enabled: false\n")
    from kvbatch.pipelines.layout import DayLayout

    # The kvbatch pipeline's tables are under <root>/kvbatch; the day's shard keys are what its
    # prompt_shards would have added.
    day, resources = DayLayout(str(root / "kvbatch"), DATE), _resources(root)
    instance = dg.DagsterInstance.from_config(str(home))
    register_day_shards(instance, "kvbatch", DATE, len(SHARDS))
    for shard, n in zip(SHARDS, (3, 4)):
        _write_shard(day, shard, n=n, ttft_s=0.05, wall_s=2.0)
        assert dg.materialize([cost_metrics], resources=resources, partition_key=date_shard_key(DATE, shard),
                              instance=instance).success
    assert dg.materialize([cost_rollup], resources=resources, partition_key=DATE, instance=instance).success

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBATCH_", "DAGSTER_"))}
    env.update(DAGSTER_HOME=str(home), KVBATCH_ROOT=str(root), KVBATCH_TIMEZONE="UTC", PYTHONPATH=str(REPO),
               KVBATCH_START_DATE="2026-11-23")
    log = open(base / "webserver.log", "wb")  # noqa: SIM115 - closed in the teardown below
    proc = subprocess.Popen([WEBSERVER, "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (base / "webserver.log").read_text()[-3000:]
            try:
                data = _graphql(url, '{ workspaceOrError { ... on Workspace { locationEntries { name '
                                     'locationOrLoadError { __typename } } } } }')
                entries = data["workspaceOrError"]["locationEntries"]
                if entries and entries[0]["locationOrLoadError"] and \
                        entries[0]["locationOrLoadError"]["__typename"] == "RepositoryLocation":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the webserver did not load the kvbatch code location"
            time.sleep(1)
        yield {"url": url, "home": home, "root": root, "instance": instance, "env": env}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _latest_metadata(url: str, asset: str) -> dict[str, str]:
    query = '{ assetNodes(assetKeys: [{path: ["kvbatch", "ASSET"]}]) { assetMaterializations(limit: 1) ' \
            '{ metadataEntries { label __typename } } } }'
    data = _graphql(url, query.replace("ASSET", asset))
    [node] = data["assetNodes"]
    return {e["label"]: e["__typename"] for e in node["assetMaterializations"][0]["metadataEntries"]}


SHARD_KEYS = {
    "summary": "MarkdownMetadataEntry", "requests": "IntMetadataEntry", "prompt_tokens": "IntMetadataEntry",
    "output_tokens": "IntMetadataEntry", "billable_tokens": "IntMetadataEntry", "cost_usd": "FloatMetadataEntry",
    "usd_per_mtok_prefill_computed": "FloatMetadataEntry", "usd_per_mtok_store_object": "FloatMetadataEntry",
    "usd_per_mtok_decode_computed": "FloatMetadataEntry", "usd_per_mtok_output": "FloatMetadataEntry",
    "usd_per_mtok_blended": "FloatMetadataEntry", "device_s_prefill": "FloatMetadataEntry",
    "device_s_decode": "FloatMetadataEntry", "kv_written_mib": "FloatMetadataEntry",
    "kv_read_mib": "FloatMetadataEntry", "kv_hit_rate_object_pct": "FloatMetadataEntry",
    **{f"{n}_p{p}": "FloatMetadataEntry" for n in ("ttft_s", "tpot_s") for p in (50, 95, 99)},
}
NOT_APPLICABLE = ("spec_acceptance_pct", "expert_load_balancedness_pct", "usd_per_mtok_store_disk",
                  "usd_per_mtok_prefix_cache", "savings_usd")


# The day's page (pipelines/scorecard_metadata.py): the scorecard first, only the curated figures
# as numbers (each one is plotted night by night), the rest typed tables.
ROLLUP_KEYS = {"scorecard": "MarkdownMetadataEntry", **{k: "FloatMetadataEntry" for k in PLOTTED},
               "slo": "TableMetadataEntry", "shards_needing_a_look": "TableMetadataEntry",
               "shard_figures": "TableMetadataEntry"}


def test_metadata_keys_and_types_as_the_webserver_reports_them(ui):
    assert set(PLOTTED) == {"cost_usd", "tokens_per_s", "kv_hit_rate_pct", "ttft_s_p95", "tpot_s_p95"}
    for asset, want, first in (("cost_metrics", SHARD_KEYS, "summary"), ("cost_rollup", ROLLUP_KEYS, "scorecard")):
        got = _latest_metadata(ui["url"], asset)
        assert {k: got.get(k) for k in want} == want, asset
        assert not set(NOT_APPLICABLE) & set(got), asset  # nothing recorded for what did not happen
        assert next(iter(got)) == first  # shown first, with units in its values
        assert all(t != "JsonMetadataEntry" for t in got.values())  # tables, not JSON blobs
    # Only the curated figures are numbers on the day's page: nothing else is plotted.
    rollup = _latest_metadata(ui["url"], "cost_rollup")
    assert {k for k, t in rollup.items() if t in ("FloatMetadataEntry", "IntMetadataEntry")} == set(PLOTTED)


def test_assets_checks_schedule_and_sensors_have_descriptions_kinds_and_owners(ui):
    data = _graphql(ui["url"], '{ assetNodes { assetKey { path } description kinds '
                               'owners { ... on TeamAssetOwner { team } } '
                               'assetChecksOrError { ... on AssetChecks { checks { name description } } } } }')
    nodes = {n["assetKey"]["path"][-1]: n for n in data["assetNodes"]}
    for name in ("prompts", "prompt_shards", "prefill_kv", "decode_results", "cost_metrics", "cost_rollup"):
        node = nodes[name]
        assert node["description"] and node["kinds"] and node["owners"] == [{"team": "kvbatch"}], name
        for check in node["assetChecksOrError"]["checks"]:
            assert check["description"], (name, check["name"])
    assert {c["name"] for c in nodes["cost_rollup"]["assetChecksOrError"]["checks"]} == {"latency_p95_within_slo"}
    repo = _graphql(ui["url"], '{ repositoriesOrError { ... on RepositoryConnection { nodes { '
                               'schedules { name description } sensors { name description } } } } }')
    [node] = repo["repositoriesOrError"]["nodes"]
    automations = {a["name"]: a["description"] for a in node["schedules"] + node["sensors"]}
    assert set(automations) >= {"kvbatch_nightly_ingest", "kvbatch_shards_after_ingest", "kvbatch_rollup_after_shard",
                                "kvbatch_rollup_after_failed_shard", "kvbatch_new_dataset_files"}
    assert all(automations.values()), automations


@pytest.mark.slow
def test_ui_check_script_reads_the_pages_in_headless_chromium(ui, tmp_path):
    """A day run as ``make demo`` runs it, on a tiny model: ``kvbatch_ingest``, ``kvbatch_shard``
    for the largest shard and ``kvbatch_rollup``, each launched into the workspace's code location
    (``dagster job launch -w workspace.yaml``) and waited for; then scripts/ui_check.py against the
    webserver: every page passes."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium): the page check needs a browser")
    pytest.importorskip("playwright", reason="Playwright is the ui extra: pip install -e '.[ui]'")
    import uuid

    import pyarrow.parquet as pq

    from kvbatch.pipelines.automation import wait_for_run
    from kvbatch.pipelines.layout import DayLayout
    from kvbatch.ops.shards.routing import shard_keys
    from tests.test_pipeline import _rows
    from tests.tiny_models import build_tiny_chat_model

    date = "2026-11-28"
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(_rows()) + "\n")
    env = dict(ui["env"], KVBATCH_MODEL=str(build_tiny_chat_model(tmp_path / "tiny", max_positions=512)))

    def launch(job: str, partition: str, *extra: str) -> None:
        run_id = str(uuid.uuid4())
        subprocess.run([DAGSTER, "job", "launch", "-w", "workspace.yaml", "-l", "kvbatch", "-j", job, "--run-id",
                        run_id, "--tags", json.dumps({"dagster/partition": partition}), *extra], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300, check=True)
        run = wait_for_run(run_id, ui["instance"], poll_s=1.0, timeout_s=600)
        assert run.status == dg.DagsterRunStatus.SUCCESS, (job, partition, run.status)

    # The 14 valid rows at 5 rows per shard: a day of 3 shards.
    launch("kvbatch_ingest", date, "--config-json",
           json.dumps({"ops": {"kvbatch__prompts": {"config": {"url": str(data), "max_reject_rate": 0.5}},
                               "kvbatch__prompt_shards": {"config": {"max_rows_per_shard": 5}}}}))
    day = DayLayout(str(ui["root"] / "kvbatch"), date)
    shard = max(shard_keys(3), key=lambda k: pq.read_table(day.shard("shards", k)).num_rows)
    launch("kvbatch_shard", f"{date}|{shard}")
    launch("kvbatch_rollup", date)
    shots = tmp_path / "shots"
    check = subprocess.run([sys.executable, str(REPO / "scripts" / "ui_check.py"), "--url", ui["url"], "--out",
                            str(shots)], capture_output=True, text=True, timeout=600, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("PASS") == 11 and "FAIL" not in check.stdout
    assert len(list(shots.glob("*.png"))) == 11
