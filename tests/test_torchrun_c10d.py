"""A decode group across "nodes": two torchrun processes of one rank each meet through torchrun's
c10d rendezvous on loopback (gloo, a tiny model), each commits its own parts, rank 0 the table."""

from __future__ import annotations

import datetime
import json
import os
import subprocess

import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

from kvbatch.ops.decode.shard import decode_shard
from kvbatch.resources.decode_cluster import DecodeClusterResource
from tests.test_decode_resume import _engine_spec, _llm, _manifests, tiny  # noqa: F401 - the fixture


def _store_on_a_free_port(timeout_s: float = 300) -> dist.TCPStore:
    """A TCPStore server this process holds, on a port the OS picks: no port is found free, released
    and bound again (where another test could take it meanwhile), and no MASTER_PORT is set."""
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


@pytest.mark.slow
def test_two_nodes_under_c10d_rendezvous_decode_the_shard_once(tiny, tmp_path):  # noqa: F811
    n = 9
    manifests = _manifests(_llm(tiny), tmp_path / "m.jsonl", n, max_tokens=4)
    one = tmp_path / "one" / "part.parquet"
    decode_shard(_llm(tiny), manifests, str(one))

    results, parts = tmp_path / "two" / "part.parquet", tmp_path / "parts"
    spec = {"command": "shard", "engine_spec": _engine_spec(tiny), "manifests_url": manifests,
            "results_url": str(results), "parts_url": str(parts), "stats_url": str(tmp_path / "stats.json"),
            "checkpoint_rows": 2, "rows": n}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    # The rendezvous store is this test's, on a port the OS picked: each torchrun agent tries to host
    # it (the endpoint is this machine), finds the port taken and joins it, as the second agent on
    # one machine always does (torch's c10d backend); rank 0's agent then hosts the workers' store
    # on a port the OS picks for it (torch's default TCPStore sharing).
    rendezvous = _store_on_a_free_port()
    cluster = DecodeClusterResource(launcher="torchrun", rendezvous="c10d", world_size=2, nnodes=2,
                                    master_addr="127.0.0.1", master_port=rendezvous.port, backend="gloo")
    cmd = cluster.command(target=["-m", "kvbatch.ops.decode.worker", "--spec", str(tmp_path / "spec.json")])
    assert cmd[3:8] == ["--nproc-per-node=1", "--nnodes=2", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{cluster.master_port}", "--rdzv-id=kvbatch-decode"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **cluster.worker_env()}
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # the same command on both "machines": the store numbers the ranks
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["world_size"] == 2 and stats["succeeded"] == n
    assert [r["rank"] for r in stats["by_rank"]] == [0, 1]
    assert [r["requests"] for r in stats["by_rank"]] == [5, 4]  # request i went to rank i mod 2
    got = pq.read_table(results).to_pylist()
    want = {r["custom_id"]: r["output_token_ids"] for r in pq.read_table(one).to_pylist()}
    assert [r["custom_id"] for r in got] == [f"id-{i}" for i in range(n)]  # once each, in shard order
    assert {r["custom_id"]: r["output_token_ids"] for r in got} == want
    assert not parts.exists()


def test_the_decode_group_engine_rebalances_live_when_eplb_interval_is_set(tmp_path):
    """The spec's eplb_interval / redundant_experts reach a rank's expert-parallel engine (the one
    every worker command builds): a LiveBalancer observes routing and runs after each group step
    (a gloo group of one here)."""
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.ops.decode import group as worker_group
    from tests.tiny_models import build_tiny_moe

    build_tiny_moe("mixtral", tmp_path / "moe")
    model = tmp_path / "moe"
    dist.init_process_group("gloo", store=_store_on_a_free_port(60), rank=0, world_size=1)
    try:
        spec = {"engine_spec": EngineSpec(model=str(model), dtype="fp32", max_batch=4).to_json()}
        rank = worker_group.expert_parallel(worker_group.build_llm(spec),
                                            {**spec, "eplb_interval": 2, "redundant_experts": 0}, 1)
        engine, llm, ep, balancer = rank
        assert ep is not None and engine.on_step is not None and engine.on_step == balancer.on_step
        assert balancer.interval == 2 and llm.model.routing_observers
        plain = worker_group.expert_parallel(worker_group.build_llm(spec), spec, 1)
        assert plain.engine.on_step is None and plain.balancer is None  # no interval: no balancer
        dense = worker_group.rank_engine(spec, 1)  # a world of one: no expert parallelism
        assert dense.engine is dense.llm and dense.ep is None
    finally:
        dist.destroy_process_group()
