"""Expert parallelism on a tiny MoE with a skewed router: rank load and step time, with and
without EPLB, through the real worker group (the entry point ``--workers`` and torchrun run).

    OMP_NUM_THREADS=1 python benchmarks/bench_expert_parallel.py                  # W=2 and W=4
    python benchmarks/bench_expert_parallel.py --workers 4 --requests 64 --max-tokens 64 --json ep.json

For each W: a run without EPLB (identity placement, S = E: the hot experts sit on one rank) and
a run with live EPLB (``--eplb-interval`` steps, ``--redundant-experts`` extra slots). Reported,
per run: max / mean rank load (expert rows each rank computed, mean over MoE layers of
max_r / mean_r) over the whole run without EPLB, and with EPLB over the steps after the last
rebalance (``rank_load_max_over_mean_before`` there is the load-blind round-robin start with
S = E + R slots, before the first rebalance); the median step time (all steps without EPLB,
the steps after the first rebalance with it; the rebalance itself is timed apart);
all-to-all payload bytes per token per MoE layer; the weight bytes moved. W=1 runs give the
single-process step time at each per-rank batch (``requests / W`` sequences for each W), and
record the routing trace.

The JSON also carries what ``benchmarks/eplb_sim.py`` takes as measured points: ``sim_measured``
(``--measured 'W=2:..,W=4:..'``, ms per step without EPLB) and ``sim_calibration``, the input of
``eplb_sim.py --bench this.json``: this model's shape; the expert GEMM fit (``eplb_sim.calibrate``
on the tiny expert shape); the W=1 step times by batch; the time of a small gloo all_to_all at
each W (``stage_latency_by_ranks_s``: the period of 40 issued back to back, as the exchange chains
them; the probe also records the median after a barrier, the collective alone, and after 100 us
of host work, which ``eplb_sim.py --latency-probe`` can use instead) and the bandwidth at the largest W, over
loopback; the host core count (the W ranks share them); and the path of the routing trace
recorded at W=1 (``<json>.trace.pt``, written only with ``--json``).

The model: ``tests.tiny_models.build_tiny_moe("mixtral", skew=...)``: 8 experts, top-2, 3 MoE
layers, hidden 64; ``skew`` makes every router prefer experts 0 and 1. Requests are token ids
(decode manifests, no tokenizer), greedy, fixed length (``ignore_eos``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402


def write_manifests(model: Path, path: Path, requests: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    """Decode manifests of random token prompts (no tokenizer needed, no KV store)."""
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from kvbatch.ops.jobs import Job
    from kvbatch.ops.prefill.manifests import manifest_line

    llm = LLM(str(model))
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(requests):
            ids = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
            f.write(json.dumps(manifest_line(llm, Job(i, f"r{i}", i + 1, ids, sampling), "tiny-moe")) + "\n")


def run_group(workdir: Path, model: Path, manifests: Path, workers: int, *, eplb_interval: int = 0,
              redundant: int = 0, max_batch: int = 64, trace_out: Path | None = None) -> dict[str, Any]:
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.ops.decode.launch import launch_local

    tag = f"w{workers}-eplb{eplb_interval}-r{redundant}-{manifests.stem}"
    spec = {"command": "decode", "manifests": str(manifests),
            "output": str(workdir / f"{tag}.jsonl"), "report": str(workdir / f"{tag}.report.json"),
            "engine_spec": EngineSpec(model=str(model), dtype="fp32", max_batch=max_batch).to_json(),
            "eplb_interval": eplb_interval, "redundant_experts": redundant}
    spec_path = workdir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    if workers == 1:  # the plain single-process path, for the baseline step time
        return run_single(spec, trace_out)
    code = launch_local(workers, ["--spec", str(spec_path)])
    if code != 0:
        raise RuntimeError(f"worker group {tag} exited with {code}")
    return json.loads(Path(spec["report"]).read_text())


def run_single(spec: dict[str, Any], trace_out: Path | None = None) -> dict[str, Any]:
    """W=1: the engine in this process, timing each step like the group does; with ``trace_out``
    the routing of every step is saved there (``ExpertLoadWindow.save``) for the simulator."""
    from kvbatch.engine.parallel.eplb import ExpertLoadWindow
    from kvbatch.ops.decode.generate import run_jobs
    from kvbatch.ops.prefill.manifests import manifest_jobs, read_manifests
    from kvbatch.ops.decode.group import build_llm

    llm = build_llm(spec)
    step_s: list[float] = []
    original = llm.step
    window = None
    if trace_out is not None:
        experts = next(iter(llm.model.moe_layers.values())).num_experts
        window = ExpertLoadWindow(llm.model.config.num_layers, experts, window_steps=1 << 20)
        llm.model.routing_observers.append(window.observe)

    def timed_step():
        t0 = time.perf_counter()
        out = original()
        step_s.append(time.perf_counter() - t0)
        if window is not None:
            window.end_step()
        return out

    llm.step = timed_step
    report = run_jobs(llm, manifest_jobs(llm, read_manifests(spec["manifests"])), spec["output"])
    if window is not None:
        window.save(str(trace_out))
    return {**report.to_json(), "workers": 1, "step_s_median": statistics.median(step_s), "steps": len(step_s)}


def summarize(report: dict[str, Any], workers: int, eplb: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"workers": workers, "eplb": eplb, "output_tokens_per_s": report["output_tokens_per_s"],
                           "wall_s": report["wall_s"]}
    ep = report.get("expert_parallel")
    if ep is None:
        row["step_ms_median"] = round(report["step_s_median"] * 1e3, 3)
        return row
    segs = ep["rank_load_segments"]
    # "after": the last stretch under a rebalanced placement that saw any tokens (a rebalance at
    # the very last step leaves an empty one behind it).
    later = [seg for seg in segs[1:] if seg["rank_load_max_over_mean"] is not None]
    row.update({
        "steps": ep["steps"],
        "step_ms_median": round((ep.get("step_s_median_after_first_rebalance") or ep["step_s_median"]) * 1e3, 3),
        "rank_load_max_over_mean_before": segs[0]["rank_load_max_over_mean"],
        "rank_load_max_over_mean_after": later[-1]["rank_load_max_over_mean"] if eplb and later else None,
        "a2a_bytes_per_token_per_layer": ep["a2a_bytes_per_token_per_layer"],
        "rebalances": ep["rebalances"],
        "rebalance_bytes": ep["rebalance_bytes"],
    })
    if eplb:
        row["rebalance_ms_median"] = round(statistics.median(h["rebalance_s"] for h in ep["eplb_history"]) * 1e3, 3)
        row["predicted_after"] = ep["eplb_history"][-1]["predicted_max_over_mean_after"]
    return row


# ------------------------------------------------------------------------------------------------
# All-to-all probe: latency and bandwidth of gloo on loopback, for the simulator


def _probe_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    results: dict[str, float] = {}
    for per_peer in (64, 1 << 20):
        x = torch.zeros(world * per_peer, dtype=torch.uint8)
        y = torch.empty_like(x)
        times = []
        for i in range(25):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x)
            if i >= 5:
                times.append(time.perf_counter() - t0)
        results[str(per_peer)] = statistics.median(times)
    flag = torch.zeros(1, dtype=torch.int32)
    times = []
    for i in range(25):  # any_rank's all_reduce, for the record (the model uses the all_to_all figure)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flag)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    results["all_reduce"] = statistics.median(times)
    # Two more readings of the small all_to_all, as the exchange meets it (no barrier first):
    # back to back (the period of a chain of collectives), and after 100 us of host work per
    # rank (the call then also waits for the ranks the scheduler ran last).
    x = torch.zeros(world * 64, dtype=torch.uint8)
    y = torch.empty_like(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(40):
        dist.all_to_all_single(y, x)
    results["loop"] = (time.perf_counter() - t0) / 40
    times = []
    for i in range(25):
        spin_until = time.perf_counter() + 100e-6
        while time.perf_counter() < spin_until:
            pass
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x)
        if i >= 5:
            times.append(time.perf_counter() - t0)
    results["after_work"] = statistics.median(times)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def probe_a2a(world: int) -> dict[str, float]:
    """At W = ``world``: the latency of a 64-byte-per-peer all_to_all (``small_s``), of a one-int
    all_reduce (``all_reduce_s``), and the per-rank bandwidth of a 1 MiB-per-peer all_to_all."""
    import torch.multiprocessing as mp

    from kvbatch.ops.decode.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        mp.spawn(_probe_rank, args=(world, free_port(), out), nprocs=world)
        res = json.loads(Path(out).read_text())
    small, big = res["64"], res[str(1 << 20)]
    sent = (world - 1) * ((1 << 20) - 64)  # bytes each rank sends to others beyond the small probe
    return {"small_s": small, "all_reduce_s": res["all_reduce"], "loop_s": res["loop"], "after_work_s": res["after_work"],
            "bandwidth_bytes_per_s": sent / max(big - small, 1e-9)}


def host_cores() -> int:
    """Cores this process may run on (the W ranks of a local group share them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def sim_calibration(worlds: list[int], requests: int, w1_step_s: dict[int, float], trace: Path | None,
                    redundant: int | None) -> dict[str, Any]:
    """``eplb_sim.py --bench``'s input: the tiny model's shape and everything measured here."""
    from benchmarks.eplb_sim import calibrate
    from tests.tiny_models import NUM_EXPERTS

    probes = {w: probe_a2a(w) for w in worlds}
    for w, pr in probes.items():
        print(f"gloo loopback at W={w}: small all_to_all {pr['small_s'] * 1e6:.0f} us after a barrier "
              f"({pr['loop_s'] * 1e6:.0f} us back to back, {pr['after_work_s'] * 1e6:.0f} us after 100 us of work), "
              f"all_reduce {pr['all_reduce_s'] * 1e6:.0f} us, {pr['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s per rank",
              flush=True)
    gemm = calibrate(hidden=64, intermediate=96)
    # The exchange chains its collectives back to back (3 per MoE layer, 2 more per step), so the
    # latency the simulator uses is the back-to-back period; beyond the probed W it extrapolates
    # it per peer (gloo exchanges pairwise).
    per_peer = statistics.median(pr["loop_s"] / (w - 1) for w, pr in probes.items())
    return {
        "num_experts": NUM_EXPERTS, "top_k": 2, "num_layers": 3, "hidden_size": 64, "moe_intermediate_size": 96,
        "global_batch_tokens": requests, "bytes_per_element": 4.0,
        # The runs without EPLB have S = E; with it, E + redundant slots (2 W unless fixed).
        "redundant_slots": redundant or 0, "redundant_per_rank": 2 if redundant is None else 0,
        "static_spare_slots": False, "num_groups": 1,
        "gpus_per_node": max(worlds), "layer_fixed_s": 0.0,
        "expert_fixed_s": gemm["expert_fixed_s"], "per_token_s": gemm["per_token_s"],
        "host_cores": host_cores(), "stages_per_layer": 3, "step_collectives": 2,
        "a2a_latency_s": per_peer, "a2a_latency_growth": "linear",
        "stage_latency_by_ranks_s": {str(w): pr["loop_s"] for w, pr in probes.items()},
        "a2a_bandwidth_bytes_per_s": probes[max(worlds)]["bandwidth_bytes_per_s"],
        "calibration": {
            "w1_step_s_by_tokens": {str(n): s for n, s in sorted(w1_step_s.items())},
            "probes": {str(w): pr for w, pr in probes.items()},
            "gemm": gemm["calibration"],
            "trace": str(trace) if trace else None,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,4", help="W values, comma-separated")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--skew", type=float, default=4.0, help="router skew of build_tiny_moe (hot experts 0 and 1)")
    p.add_argument("--eplb-interval", type=int, default=8, help="steps between rebalances")
    p.add_argument("--redundant-experts", type=int, default=None, help="extra slots (default 2 W)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-probe", action="store_true", help="skip the all-to-all latency/bandwidth probe")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    from tests.tiny_models import NUM_EXPERTS, build_tiny_moe

    worlds = [int(w) for w in args.workers.split(",") if w.strip()]
    for w in worlds:
        if args.requests % w:
            raise SystemExit(f"--requests {args.requests} does not split evenly over W={w}")
    trace = Path(args.json).with_suffix(".trace.pt") if args.json else None
    rows = []
    w1_step_s: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ep-") as tmp:
        work = Path(tmp)
        model = work / "moe"
        build_tiny_moe("mixtral", model, seed=args.seed, skew=args.skew)
        manifests = work / "manifests.jsonl"
        write_manifests(model, manifests, args.requests, args.prompt_len, args.max_tokens, args.seed)
        rows.append(summarize(run_group(work, model, manifests, 1, trace_out=trace), 1, False))
        w1_step_s[args.requests] = rows[-1]["step_ms_median"] / 1e3
        print(f"W=1: step {rows[-1]['step_ms_median']} ms", flush=True)
        # W=1 at each W's per-rank batch: the host work per step the simulator scales by batch.
        all_lines = manifests.read_text().splitlines(keepends=True)
        for w in worlds:
            n = args.requests // w
            part = work / f"manifests-{n}.jsonl"
            part.write_text("".join(all_lines[:n]))
            w1_step_s[n] = run_group(work, model, part, 1)["step_s_median"]
            print(f"W=1 with {n} sequences (W={w}'s share): step {w1_step_s[n] * 1e3:.3f} ms", flush=True)
        for w in worlds:
            redundant = args.redundant_experts if args.redundant_experts is not None else 2 * w
            for eplb in (False, True):
                report = run_group(work, model, manifests, w, eplb_interval=args.eplb_interval if eplb else 0,
                                   redundant=redundant if eplb else 0)
                rows.append(summarize(report, w, eplb))
                r = rows[-1]
                # Without EPLB the whole run is one placement (the identity); with it, the
                # figure is the stretch after the last rebalance that saw tokens.
                load = r["rank_load_max_over_mean_after"] if eplb else r["rank_load_max_over_mean_before"]
                print(f"W={w} {'EPLB (S=%d)' % (NUM_EXPERTS + redundant) if eplb else 'no EPLB (S=8)':>13}: "
                      f"max/mean rank load {load}, step {r['step_ms_median']} ms, all-to-all "
                      f"{r['a2a_bytes_per_token_per_layer']:.0f} B/token/layer"
                      + (f", {r['rebalances']} rebalances of {r['rebalance_ms_median']} ms" if eplb else ""),
                      flush=True)
    no_eplb = {r["workers"]: r["step_ms_median"] for r in rows if r["workers"] > 1 and not r["eplb"]}
    result: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "workload": {"model": "tiny mixtral (8 experts, top-2, 3 MoE layers, H=64)", "skew": args.skew,
                     "requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "eplb_interval": args.eplb_interval},
        "runs": rows,
        "sim_measured": ",".join(f"W={w}:{ms}" for w, ms in no_eplb.items()),
    }
    if not args.no_probe and worlds:
        result["sim_calibration"] = sim_calibration(worlds, args.requests, w1_step_s, trace, args.redundant_experts)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
