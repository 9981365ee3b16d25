"""End-to-end checks of the deployed shape of the pipeline, on a tiny model and loopback only:

- a real ``dagster-webserver`` over ``workspace.yaml`` launches ``kvbatch_ingest`` for a date
  and then ``kvbatch_shard`` per (date, shard) over GraphQL, and every valid row gets exactly
  one result, under ``results/date=D/shard=K/``;
- a decode killed (SIGKILL, whole process group) half-way leaves either the previous good commit
  or nothing at the results path, and a re-run completes with every row exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.tiny_models import build_tiny_chat_model

REPO = Path(__file__).resolve().parents[1]
WEBSERVER = str(Path(sys.executable).with_name("dagster-webserver"))
SYSTEM = "You answer questions about a small bakery. Be brief and polite. "
DATE = "2026-11-29"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_e2e"), max_positions=512)


def _requests(n: int, max_tokens: int) -> tuple[list[str], list[str]]:
    """(JSONL lines, the valid custom_ids): ``n`` good rows and one bad row (temperature "hot")."""
    lines, ids = [], []
    for i in range(n):
        cid = f"q{i:04d}"
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}],
                "max_tokens": max_tokens, "temperature": 0}
        lines.append(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}))
        ids.append(cid)
    lines.insert(min(2, n), json.dumps({"custom_id": "bad-temp", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"messages": [{"role": "user", "content": "x"}],
                                                 "temperature": "hot"}}))
    return lines, ids


def _env(tmp_path: Path, tiny: Path) -> dict:
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text(
        "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: DefaultRunCoordinator\n"
        "telemetry:\n  enabled: false\n")
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # The webserver test's 8 valid rows at 4 rows per shard: its launched ingest makes 2 shards.
    return dict(os.environ, DAGSTER_HOME=str(home), KVBATCH_ROOT=str(tmp_path / "data"), KVBATCH_MODEL=str(tiny),
                KVBATCH_MAX_ROWS_PER_SHARD="4", PYTHONPATH=pythonpath, DAGSTER_DISABLE_TELEMETRY="1")


def _results(root: Path) -> list[str]:
    ids = []
    for part in sorted((root / "results" / f"date={DATE}").glob("shard=*/part.parquet")):
        ids += pq.read_table(part).column("custom_id").to_pylist()
    return ids


def _temp_files(root: Path) -> list[str]:
    """Every temp file under ``root``, hidden or not: the atomic writers' ``.NAME.tmp-*``
    (io/batch_output.py) and the KV tiers' ``.tmp-*`` both contain ``.tmp``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name)


def _kill_group(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------
# 1. dagster-webserver + GraphQL launches

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _GraphQL:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def __call__(self, query: str, variables: dict | None = None) -> dict:
        req = urllib.request.Request(self.base + "/graphql", data=json.dumps(
            {"query": query, "variables": variables or {}}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.loads(resp.read())
        assert not out.get("errors"), out["errors"]
        return out["data"]

    def wait_ready(self, proc: subprocess.Popen, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"dagster-webserver exited with {proc.returncode}"
            try:
                with urllib.request.urlopen(self.base + "/server_info", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1)
        else:
            raise AssertionError(f"dagster-webserver not up after {timeout} s")
        # The code location loads in its own process: wait until the repository answers.
        while time.monotonic() < deadline:
            data = self("""{ repositoryOrError(repositorySelector: {repositoryLocationName: "kvbatch",
                              repositoryName: "__repository__"}) { __typename ... on Repository { name } } }""")
            if data["repositoryOrError"]["__typename"] == "Repository":
                return
            time.sleep(1)
        raise AssertionError(f"code location 'kvbatch' not loaded after {timeout} s: {data}")

    LAUNCH = """
    mutation Launch($p: ExecutionParams!) {
      launchRun(executionParams: $p) {
        __typename
        ... on LaunchRunSuccess { run { runId status } }
        ... on RunConfigValidationInvalid { errors { message } }
        ... on PythonError { message stack }
        ... on Error { message }
      }
    }"""

    def launch(self, job: str, run_config: dict | None = None, tags: dict | None = None) -> str:
        params = {
            "selector": {"repositoryLocationName": "kvbatch", "repositoryName": "__repository__", "jobName": job},
            "runConfigData": run_config or {},
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
        }
        res = self(self.LAUNCH, {"p": params})["launchRun"]
        assert res["__typename"] == "LaunchRunSuccess", res
        return res["run"]["runId"]

    def wait_run(self, run_id: str, timeout: float) -> str:
        q = """query Run($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status }
                                                           ... on PythonError { message } } }"""
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            res = self(q, {"id": run_id})["runOrError"]
            assert res["__typename"] == "Run", res
            status = res["status"]
            if status in ("SUCCESS", "FAILURE", "CANCELED"):
                return status
            time.sleep(1)
        raise AssertionError(f"run {run_id} still {status} after {timeout} s")

    def failure_log(self, run_id: str) -> str:
        q = """query Logs($id: ID!) { logsForRun(runId: $id) { __typename
                 ... on EventConnection { events { __typename ... on MessageEvent { message }
                   ... on ExecutionStepFailureEvent { error { message stack } } } } } }"""
        try:
            events = self(q, {"id": run_id})["logsForRun"].get("events", [])
        except Exception as e:  # the log is only for the failure message
            return f"(no logs: {e})"
        return json.dumps(events[-15:], indent=1)[-6000:]


def test_webserver_graphql_launches_ingest_then_each_shard(tiny, tmp_path):
    env = _env(tmp_path, tiny)
    lines, valid = _requests(8, max_tokens=4)
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(lines) + "\n")
    port = _free_port()
    log = (tmp_path / "webserver.log").open("wb")
    proc = subprocess.Popen([WEBSERVER, "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    gql = _GraphQL(port)
    try:
        try:
            gql.wait_ready(proc, timeout=90)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{(tmp_path / 'webserver.log').read_text()[-4000:]}") from None

        cfg = {"ops": {"kvbatch__prompts": {"config": {"url": str(data), "max_reject_rate": 0.5}}}}
        run_id = gql.launch("kvbatch_ingest", cfg, tags={"dagster/partition": DATE})
        status = gql.wait_run(run_id, timeout=120)
        assert status == "SUCCESS", gql.failure_log(run_id)
        root = tmp_path / "data" / "kvbatch"  # the kvbatch pipeline's tables under KVBATCH_ROOT
        day = root / "prompts" / f"date={DATE}"
        assert sorted(pq.read_table(day / "part.parquet").column("custom_id").to_pylist()) == valid
        rejects = pq.read_table(root / "rejects" / f"date={DATE}" / "part.parquet").to_pylist()
        assert [r["custom_id"] for r in rejects] == ["bad-temp"]

        for shard in ("0000", "0001"):  # what the UI sends for one (date, shard) key the ingest added
            run_id = gql.launch("kvbatch_shard", tags={"dagster/partition": f"{DATE}|{shard}"})
            status = gql.wait_run(run_id, timeout=120)
            assert status == "SUCCESS", gql.failure_log(run_id)

        got = _results(root)
        assert sorted(got) == valid  # every valid custom_id exactly once, the bad row in none
        assert len(list((root / "results").glob("date=*/shard=*/part.parquet"))) == 2
        for part in (root / "results").glob("date=*/shard=*/part.parquet"):
            rows = pq.read_table(part).to_pylist()
            assert all(0 < r["completion_tokens"] <= r["max_tokens"] == 4 for r in rows)
        # Every run completed: no temp file of any kind is left behind.
        assert _temp_files(root.parent) == []
    finally:
        _kill_group(proc)
        log.close()


# ---------------------------------------------------------------------------------------------
# 2. SIGKILL half-way through a decode

DECODE_SCRIPT = r"""
import sys, time
from kvbatch.io.batch_output import AtomicSink
from kvbatch.ops.decode.shard import decode_shard
from kvbatch.pipelines.assets import _kv
from kvbatch.pipelines.definitions import default_resources
from kvbatch.pipelines.layout import DayLayout

shard, stop, date = sys.argv[1], sys.argv[2], sys.argv[3]   # stop: "none", "result:<n>" or "commit"
res = default_resources()
store, model, kv = res["object_store"].under("kvbatch"), res["model"], res["kv_store"]  # the kvbatch pipeline's folder
day, opts = DayLayout(store.url, date), store.storage_options()
llm = model.load(_kv(store, model, kv))
inner = llm.stream
def stream(requests):
    for n, result in enumerate(inner(requests), 1):
        print(f"RESULT {n}", flush=True)
        if stop == f"result:{n}":  # half-way: results in memory, nothing committed; wait for the kill
            print("PAUSED", flush=True)
            time.sleep(600)
        yield result
llm.stream = stream
if stop == "commit":  # the bytes are in the temp file, the rename has not happened; wait for the kill
    real_commit = AtomicSink.commit
    def commit(self):
        if self.url.endswith("part.parquet") and "/results/" in self.url:
            self._file.flush()
            print("PAUSED", flush=True)
            time.sleep(600)
        real_commit(self)
    AtomicSink.commit = commit
decode_shard(llm, day.shard("manifests", shard, "manifests.jsonl"), day.shard("results", shard),
             stats_url=day.shard("decode_stats", shard, "stats.json"), storage_options=opts,
             parts_url=day.shard("decode_parts", shard, ""))  # as the decode_results asset does
print("DONE", flush=True)
"""


def _decode(env: dict, shard: str, cwd: Path, stop: str = "none", timeout: float = 120) -> tuple[int, str]:
    """Decode one shard in its own process group. With ``stop`` = ``result:<n>`` (after n results,
    before the commit) or ``commit`` (results written to the temp file, not renamed), the child
    pauses there and the whole group is SIGKILLed. Returns (results seen, output)."""
    proc = subprocess.Popen([sys.executable, "-c", DECODE_SCRIPT, shard, stop, DATE], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    seen, out, killed = 0, [], False
    timer = __import__("threading").Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("RESULT "):
                seen = int(line.split()[1])
            elif line.startswith("PAUSED") and stop != "none":
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
        proc.wait(timeout=30)
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        proc.stdout.close()
    text = "".join(out)
    if stop == "none":
        assert proc.returncode == 0 and "DONE" in text, text[-4000:]
    else:
        assert killed and proc.returncode == -signal.SIGKILL, (proc.returncode, text[-4000:])
        assert "DONE" not in text
    return seen, text


def _prepare(tmp_path: Path, tiny: Path, n: int) -> tuple[dict, Path, list[str], dict[str, list[str]]]:
    """Ingest and prefill in process; (subprocess env, data root, shards used, their custom_ids)."""
    import dagster as dg

    from kvbatch.pipelines.default import prefill_kv, prompt_shards, prompts
    from kvbatch.pipelines.factory import default_pipeline, pipeline_resources
    from kvbatch.pipelines.layout import DayLayout
    from kvbatch.pipelines.partitions import date_shard_key
    from kvbatch.resources import DecodeClusterResource, KVStoreResource, ModelResource, ObjectStoreResource

    env = _env(tmp_path, tiny)
    root = tmp_path / "data" / "kvbatch"  # the kvbatch pipeline's tables under KVBATCH_ROOT
    lines, valid = _requests(n, max_tokens=32)
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(lines) + "\n")
    resources = pipeline_resources(default_pipeline().spec, {
        "object_store": ObjectStoreResource(url=str(root.parent)), "model": ModelResource(model=str(tiny)),
        "kv_store": KVStoreResource(), "decode_cluster": DecodeClusterResource()})
    instance = dg.DagsterInstance.ephemeral()  # holds the day's (date, shard) partitions
    # n rows at n / 2 rows per shard: two shards (the decode subprocess takes their URLs only).
    assert dg.materialize([prompts, prompt_shards], resources=resources, partition_key=DATE, instance=instance,
                          run_config={"ops": {"kvbatch__prompts": {"config": {"url": str(data), "max_reject_rate": 0.5}},
                                              "kvbatch__prompt_shards": {"config": {"max_rows_per_shard": n // 2}}}}
                          ).success
    day = DayLayout(str(root), DATE)
    all_shards = sorted(p.name.split("=")[1] for p in (root / "shards" / f"date={DATE}").glob("shard=*"))
    every = [c for k in all_shards for c in pq.read_table(day.shard("shards", k)).column("custom_id").to_pylist()]
    assert sorted(every) == valid
    assert len(all_shards) == 2
    shards = all_shards
    for key in shards:
        assert dg.materialize([prefill_kv], resources=resources, partition_key=date_shard_key(DATE, key),
                              instance=instance).success
    expected = {k: sorted(pq.read_table(day.shard("shards", k)).column("custom_id").to_pylist()) for k in shards}
    assert all(len(v) >= 4 for v in expected.values())
    return env, root, shards, expected


def _files(root: Path, key: str) -> list[str]:
    folder = root / "results" / f"date={DATE}" / f"shard={key}"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_decode_killed_half_way_leaves_last_commit_and_reruns_whole(tiny, tmp_path):
    from kvbatch.io.shard_tables import read_shards
    from kvbatch.pipelines.layout import DayLayout

    env, root, (first, second), expected = _prepare(tmp_path, tiny, 60)
    valid = sorted(expected[first] + expected[second])

    # Second shard, never committed: killed half-way -> nothing at the results path, no temp file.
    n1 = len(expected[second])
    seen, _ = _decode(env, second, tmp_path, stop=f"result:{n1 // 2}")
    assert seen == n1 // 2
    assert _files(root, second) == []
    assert _temp_files(root.parent) == []  # killed before its write began: nothing was opened anywhere
    assert not (root / "decode_stats" / f"date={DATE}" / f"shard={second}" / "stats.json").exists()

    # First shard: a good commit first, then a killed re-run must leave that commit byte for byte.
    n0 = len(expected[first])
    _decode(env, first, tmp_path)
    part0 = Path(DayLayout(str(root), DATE).shard("results", first))
    good, mtime = part0.read_bytes(), part0.stat().st_mtime_ns
    seen, _ = _decode(env, first, tmp_path, stop=f"result:{n0 // 2}")
    assert seen == n0 // 2
    assert _files(root, first) == ["part.parquet"]
    assert _temp_files(root.parent) == []
    assert part0.read_bytes() == good and part0.stat().st_mtime_ns == mtime
    assert sorted(pq.read_table(part0).column("custom_id").to_pylist()) == expected[first]

    # Re-runs to completion: every valid custom_id exactly once, none lost or duplicated.
    for key in (first, second):
        seen, _ = _decode(env, key, tmp_path)
        assert seen == len(expected[key])
        assert _files(root, key) == ["part.parquet"]
    got = read_shards(str(root), f"results/date={DATE}").column("custom_id").to_pylist()
    assert len(got) == len(set(got)) and sorted(got) == valid
    assert sorted(pq.read_table(root / "results").column("custom_id").to_pylist()) == valid
    # Both kills came before any write began, and every later run completed: no temp file at all.
    assert _temp_files(root.parent) == []


def test_decode_killed_during_commit_leaves_nothing_a_reader_sees(tiny, tmp_path):
    """A process killed inside the write leaves its temp file behind; it is a dot-file, which
    dataset readers (pyarrow, Spark, DuckDB) skip, so it can never be read as rows."""
    from kvbatch.io.shard_tables import read_shards

    env, root, (first, _), expected = _prepare(tmp_path, tiny, 60)
    assert _temp_files(root.parent) == []  # ingest and prefill completed
    _decode(env, first, tmp_path, stop="commit")
    # Exactly one leftover: the killed writer's hidden temp file beside the results' final name.
    leftovers = _temp_files(root.parent)
    shard_dir = f"kvbatch/results/date={DATE}/shard={first}"
    assert len(leftovers) == 1 and leftovers[0].startswith(f"{shard_dir}/.part.parquet.tmp-"), leftovers
    assert _files(root, first) == [Path(leftovers[0]).name]  # and no part.parquet yet
    # Neither the project's reader nor a whole-folder dataset reader sees it as rows.
    assert read_shards(str(root), f"results/date={DATE}").num_rows == 0
    assert pq.read_table(root / "results").num_rows == 0
    _decode(env, first, tmp_path)
    assert sorted(read_shards(str(root), f"results/date={DATE}").column("custom_id").to_pylist()) == expected[first]
    # The completed re-run leaves no temp file of its own. The killed run's may remain today:
    # removing stale temp files of killed runs is a separate change to io/batch_output.py.
    assert set(_temp_files(root.parent)) <= set(leftovers), _temp_files(root.parent)
    assert [f for f in _files(root, first) if not f.startswith(".")] == ["part.parquet"], _files(root, first)
    # A whole-folder reader sees each custom_id once: the hidden leftover is never read as rows.
    assert sorted(pq.read_table(root / "results").column("custom_id").to_pylist()) == expected[first]
