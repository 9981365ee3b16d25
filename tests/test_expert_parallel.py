"""Expert parallelism over a gloo worker group: the same tokens as one process, whatever W.

The exchange itself is tested on synthetic experts in spawned ranks (bitwise against the local
``fused_moe`` on the same tokens, idle ranks, a hand-counted byte total, a weight move); the
whole path goes through the real entry point and launcher (``kvbatch generate/decode
--workers W``: subprocesses, loopback, timeouts) on tiny MoE models, including a forced
rebalance mid-run and a rank killed mid-run.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvbatch.cli.main import main
from kvbatch.engine.models.moe import MoELayerWeights
from kvbatch.engine.parallel.eplb import Placement, rebalance_experts
from kvbatch.kernels import dispatch as K
from tests import tiny_models
from tests.tiny_models import build_tiny_chat_model, build_tiny_moe

# ------------------------------------------------------------------------------------------------
# The exchange on synthetic experts, in spawned ranks

E, H, I, TOPK, LAYERS = 8, 16, 24, 2, 3
MOE_LAYERS = (1, 2)


def _synthetic_layers() -> dict[int, MoELayerWeights]:
    g = torch.Generator().manual_seed(0)
    return {li: MoELayerWeights(router=torch.randn(E, H, generator=g),
                                w_gate_up=torch.randn(E, 2 * I, H, generator=g) * 0.2,
                                w_down=torch.randn(E, H, I, generator=g) * 0.2) for li in MOE_LAYERS}


def _tokens(rank: int, n: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(n)]) if n else torch.zeros(0, TOPK).long()
    return x, ids, torch.rand(n, TOPK, generator=g)


def _spawned(fn, world: int, *args) -> None:
    # The ranks meet at a store this process opens on a port the OS picks, and holds open while
    # they run: no port is found free, released and bound again (where another test could take it),
    # and no MASTER_PORT is set in any environment.
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    mp.spawn(_rank_main, args=(world, store.port, fn, args), nprocs=world, join=True)


def _rank_main(rank: int, world: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _check_exchange(rank: int, world: int, counts: list[int]) -> None:
    """Each rank routes its own tokens (some ranks none, idle); the result is bitwise the local
    fused_moe over every rank's tokens at once, and idle ranks serve until all are done."""
    from kvbatch.engine.parallel.expert_parallel import ExpertParallelCompute

    layers = _synthetic_layers()
    ep = ExpertParallelCompute(layers, LAYERS)
    assert ep.local_experts()[1] == list(range(rank * E // world, (rank + 1) * E // world))
    everyone = [_tokens(r, counts[r]) for r in range(world)]
    x, ids, w = everyone[rank]
    X, IDS, WTS = (torch.cat([t[i] for t in everyone]) for i in range(3))
    start = sum(counts[:rank])
    for li in MOE_LAYERS:
        if counts[rank]:
            got = ep(li, x, ids, w)
            union = K.fused_moe(X, layers[li].w_gate_up, layers[li].w_down, IDS, WTS)[start:start + counts[rank]]
            assert torch.equal(got, union), f"rank {rank} layer {li}"
    idle = ep.finish_step()
    assert idle == (len(MOE_LAYERS) if counts[rank] == 0 else 0)
    # A rank that ran two forwards this step while the others ran one: the others keep serving.
    if rank == 0 and counts[0]:
        for li in MOE_LAYERS:
            ep(li, x, ids, w)
    ep.finish_step()


def _check_bytes(rank: int, world: int) -> None:
    """Two ranks, identity placement (experts 0-3 on rank 0, 4-7 on rank 1), hand-made routing."""
    from kvbatch.engine.parallel.expert_parallel import (
        ExpertParallelCompute,
        a2a_bytes_per_token_per_layer,
    )

    ep = ExpertParallelCompute(_synthetic_layers(), LAYERS)
    x = torch.randn(3, H)
    # rank 0's tokens pick experts (0,5), (6,7), (1,2): three pairs go to rank 1
    # rank 1's tokens pick experts (0,4), (1,3), (5,6): three pairs go to rank 0
    ids = torch.tensor([[0, 5], [6, 7], [1, 2]]) if rank == 0 else torch.tensor([[0, 4], [1, 3], [5, 6]])
    ep(1, x, ids, torch.full((3, 2), 0.5))
    ep.finish_step()
    s = ep.stats
    row = H * 4
    assert s.dispatch_bytes == {1: 3 * (row + 4)}  # three rows out, each tagged with an int32 slot
    assert s.combine_bytes == {1: 3 * row}  # three results back to the other rank
    assert s.tokens == {1: 3} and s.rows_computed == {1: 6}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, s.to_json())
    assert a2a_bytes_per_token_per_layer(everyone) == 2 * 3 * (2 * row + 4) / 6


def _check_rebalance(rank: int, world: int) -> None:
    """Moving the experts to a skewed placement with redundant slots changes no output."""
    from kvbatch.engine.parallel.expert_parallel import ExpertParallelCompute

    layers = _synthetic_layers()
    ep = ExpertParallelCompute(layers, LAYERS)
    x, ids, w = _tokens(rank, 6)
    before = [ep(li, x, ids, w) for li in MOE_LAYERS]
    ep.finish_step()
    load = torch.ones(LAYERS, E)
    load[:, 0] = 50
    placement = rebalance_experts(load, E + world, 1, 1, world)
    sent = ep.rebalance(placement)
    assert ep.placement is placement
    for li in MOE_LAYERS:  # the hot expert now sits on every rank
        assert 0 in ep.local_experts()[li]
        assert ep.layers[li].w_gate_up.shape[0] == (E + world) // world
    gathered: list = [None] * world
    dist.all_gather_object(gathered, sent)
    assert sum(gathered) > 0
    after = [ep(li, x, ids, w) for li in MOE_LAYERS]
    ep.finish_step()
    for a, b in zip(before, after):
        # Replicas split an expert's rows over GEMMs of other sizes: equal up to rounding.
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # And back to the identity: the weights that return are the originals, bit for bit.
    ep.rebalance(Placement.from_phy2log(torch.arange(E).expand(LAYERS, E).clone(), E))
    for li in MOE_LAYERS:
        mine = slice(rank * E // world, (rank + 1) * E // world)
        assert torch.equal(ep.layers[li].w_gate_up, layers[li].w_gate_up[mine])
        assert torch.equal(ep.layers[li].w_down, layers[li].w_down[mine])


def _check_all(rank: int, world: int, counts: list[int]) -> None:
    # One group start per W for all checks: starting ranks costs seconds, checking them none.
    _check_exchange(rank, world, counts)
    if world == 2:
        _check_bytes(rank, world)
    _check_rebalance(rank, world)


@pytest.mark.parametrize("world,counts", [(2, [5, 7]), (4, [5, 0, 7, 3])])
def test_exchange_bitwise_idle_ranks_byte_count_and_rebalance(world, counts):
    """The exchange is bitwise the local computation on the same tokens, idle ranks serve, the
    byte counter matches a hand count (W=2), and moving the weights changes no output."""
    _spawned(_check_all, world, counts)


# ------------------------------------------------------------------------------------------------
# The whole path: CLI -> launcher -> worker entry point -> engine


def build_moe_chat_model(arch: str, folder: Path, seed: int = 0, skew: float = 0.0) -> Path:
    """A tiny MoE model (tests.tiny_models.build_tiny_moe) that speaks SmolLM2's tokenizer and
    chat template, so `kvbatch generate` can run it and its outputs have text to compare."""
    from kvbatch.engine.text.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_model("smollm2-135m")
    if arch == "deepseek_v3":
        from tests.tiny_deepseek import build_tiny_deepseek

        build_tiny_deepseek(folder, "moe", seed=seed, vocab_size=tok.vocab_size)
    else:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(tiny_models, "VOCAB", tok.vocab_size)
            build_tiny_moe(arch, folder, seed=seed, skew=skew)
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}))
    return folder


def _requests(path: Path, n: int = 7, max_tokens: int = 8) -> Path:
    rows = []
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"Tell me about item {i} " + "and more " * (i % 3)}],
                "max_tokens": max_tokens + i % 3, "temperature": 0, "logprobs": True}
        rows.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}))
    rows.insert(3, '{"custom_id": "bad", "body": {"messages": []}}')  # a rejected row keeps its place
    path.write_text("\n".join(rows) + "\n")
    return path


def _answers(path: Path) -> list[tuple]:
    """What must not depend on W: per line, the id and the generated tokens (as their logprob
    texts, which name every token) or the error field."""
    out = []
    for line in path.read_text().splitlines():
        o = json.loads(line)
        if o["error"]:
            out.append((o["custom_id"], "error", o["error"]["field"]))
        else:
            c = o["response"]["body"]["choices"][0]
            out.append((o["custom_id"], c["message"]["content"], c["finish_reason"],
                        tuple(t["token"] for t in c["logprobs"]["content"])))
    return out


def _generate(model: Path, src: Path, out: Path, workers: int, *extra: str) -> int:
    return main(["generate", "--model", str(model), "--input", str(src), "--output", str(out), "--no-progress",
                 "--workers", str(workers), *extra])


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_moe_chat_model(arch, root / arch) for arch in ("mixtral", "qwen2_moe", "deepseek_v3")}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_generate_with_2_and_4_workers_matches_one_process(arch, moe_models, tmp_path):
    src = _requests(tmp_path / "in.jsonl")
    assert _generate(moe_models[arch], src, tmp_path / "w1.jsonl", 1) == 1  # one rejected row
    reference = _answers(tmp_path / "w1.jsonl")
    assert sum(1 for a in reference if a[1] != "error") == 7
    for workers in (2, 4):
        metrics = tmp_path / f"m{workers}.json"
        code = _generate(moe_models[arch], src, tmp_path / f"w{workers}.jsonl", workers, "--metrics", str(metrics))
        assert code == 1
        assert _answers(tmp_path / f"w{workers}.jsonl") == reference, f"W={workers}"
        m = json.loads(metrics.read_text())
        assert m["workers"] == workers and m["succeeded"] == 7 and m["rejected"] == 1
        assert m["expert_parallel"]["a2a_bytes_per_token_per_layer"] > 0


@pytest.mark.slow
def test_forced_rebalances_mid_run_change_no_output(moe_models, tmp_path):
    """Every 2 steps all experts move to the next rank (and, in a second run, a load-driven
    placement with redundant slots): the tokens stay those of one process."""
    src = _requests(tmp_path / "in.jsonl")
    _generate(moe_models["mixtral"], src, tmp_path / "w1.jsonl", 1)
    reference = _answers(tmp_path / "w1.jsonl")
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.ops.decode.launch import launch_local

    for force, redundant in (("rotate", 0), (None, 4)):
        spec = {"command": "generate", "engine_spec": EngineSpec(model=str(moe_models["mixtral"]), dtype="fp32").to_json(),
                "input": str(src), "output": str(tmp_path / "w2.jsonl"), "report": str(tmp_path / "r.json"),
                "eplb_interval": 2, "eplb_force": force, "redundant_experts": redundant}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        assert launch_local(2, ["--spec", str(tmp_path / "spec.json")]) == 1
        assert _answers(tmp_path / "w2.jsonl") == reference, (force, redundant)
        ep = json.loads((tmp_path / "r.json").read_text())["expert_parallel"]
        assert ep["rebalances"] >= 3 and ep["rebalance_bytes"] > 0


@pytest.mark.slow
def test_decode_with_workers_matches_one_process(moe_models, tmp_path):
    src = _requests(tmp_path / "in.jsonl")
    store, manifests = tmp_path / "store", tmp_path / "manifests.jsonl"
    model = str(moe_models["qwen2_moe"])
    assert main(["prefill", "--model", model, "--input", str(src), "--manifests", str(manifests), "--store",
                 str(store), "--no-progress"]) == 1
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"d{workers}.jsonl"
        assert main(["decode", "--model", model, "--manifests", str(manifests), "--store", str(store),
                     "--output", str(out), "--no-progress", "--workers", str(workers),
                     "--eplb-interval", "3", "--redundant-experts", "2"]) == 1
        outs[workers] = _answers(out)
    assert outs[2] == outs[1]


@pytest.mark.slow
def test_dense_model_runs_data_parallel(tmp_path):
    model = build_tiny_chat_model(tmp_path / "dense")
    src = _requests(tmp_path / "in.jsonl", n=5)
    _generate(model, src, tmp_path / "w1.jsonl", 1)
    _generate(model, src, tmp_path / "w3.jsonl", 3)
    assert _answers(tmp_path / "w3.jsonl") == _answers(tmp_path / "w1.jsonl")


def test_bad_slot_count_is_refused_before_work(moe_models, tmp_path, capfd):
    src = _requests(tmp_path / "in.jsonl", n=2)
    code = _generate(moe_models["mixtral"], src, tmp_path / "o.jsonl", 3)  # 8 experts over 3 ranks
    assert code == 2
    err = capfd.readouterr().err  # the ranks' own lines come from their processes
    assert "choose --redundant-experts so the sum is a multiple of 3" in err
    assert "the group of 3 was stopped" in err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_a_killed_rank_fails_the_group_quickly(moe_models, tmp_path):
    """SIGKILL one worker mid-run: the launcher names the rank and stops the group, well
    within the collective timeout (set to 600 s: a group that waited for it would outlive the
    120 s the test gives it), and writes no output."""
    src = _requests(tmp_path / "in.jsonl", n=8, max_tokens=200)
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "kvbatch.cli.main", "generate", "--model", str(moe_models["mixtral"]),
           "--input", str(src), "--output", str(out), "--no-progress", "--workers", "2",
           "--max-batch", "1"]  # one request at a time: ~1600 steps, long enough to be killed mid-run
    env = {**os.environ, "KVBATCH_DIST_TIMEOUT_S": "600", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        victim = _wait_for_worker(proc.pid, rank=1, timeout_s=120)
        time.sleep(2.0)  # let it get into the decode loop
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)  # a fifth of the collective timeout: a ratio, not a timed assert
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, err
    assert "worker rank 1 was killed by signal 9" in err
    assert not out.exists()


def test_sigterm_to_the_launcher_stops_the_workers(moe_models, tmp_path):
    src = _requests(tmp_path / "in.jsonl", n=8, max_tokens=200)
    cmd = [sys.executable, "-m", "kvbatch.cli.main", "generate", "--model", str(moe_models["mixtral"]),
           "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--no-progress", "--workers", "2",
           "--max-batch", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        workers = [_wait_for_worker(proc.pid, rank=r, timeout_s=120) for r in (0, 1)]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    for pid in workers:
        assert not _alive(pid)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _wait_for_worker(launcher: int, rank: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in _children(launcher):
            try:
                with open(f"/proc/{child}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except (FileNotFoundError, PermissionError):
                continue
            if env.get(b"RANK") == str(rank).encode():
                return child
        time.sleep(0.1)
    raise AssertionError(f"no worker rank {rank} under pid {launcher}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
