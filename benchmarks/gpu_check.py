"""The one prepared GPU check: the engine on CUDA, its kernels, and its speed, in one command.

    python benchmarks/gpu_check.py --out DIR            # on a CUDA machine (at most ~8 minutes on an H200)
    python benchmarks/gpu_check.py --out DIR --smoke    # every stage on the CPU: tiny shapes, Triton interpreter

Stages, each in its own subprocess with its own time limit; ``DIR/gpu_check.json`` and
``DIR/gpu_check.md`` are rewritten after every stage (a stage that dies or runs out of time is
recorded as such, with what it had written so far, and the next one starts):

1. ``env``: versions, device, free memory.
2. ``kernels``: every Triton kernel against its PyTorch twin (``benchmarks/gpu_kernels.py``'s cases
   and checks), and paged decode on the issue's grid (head dim 64 with GQA 9:3, 128 with 32:8;
   block 16; contexts 1/15/16/17/4096/32768; batch 1/7/64): max error, µs, GB/s, % of 4.8 TB/s.
3. ``engine``: the engine on the device against the same engine on the CPU (tiny dense and MoE
   models, fp32, IEEE matmuls): greedy tokens identical, graph replay equal to eager bit for bit,
   device-to-host syncs per step (``torch.cuda.set_sync_debug_mode``).
4. ``throughput``: random weights of SmolLM2-135M and Llama-3.1-8B shapes (bf16), batch 1/64/256,
   128 prompt and 256 output tokens, against transformers ``generate`` on the same GPU in the same
   run: tok/s, ms per step, % of HBM bandwidth (weights + KV read per step), graphs against eager.
5. ``kv_staging``: KV-store loads and saves through the pinned staging pool on a side stream
   against the direct copies (SmolLM2 and Llama-3.1-8B cache shapes, bf16): GB/s, bytes equal;
   then blocks written by the engine on the GPU decoded by the engine on the CPU, and back.

``--smoke`` runs the same stages on the CPU (Triton interpreter, the CUDA weight layout, tiny
shapes) so the first GPU run cannot die of a typo. Runs from a plain checkout (no ``pip install``:
the repository is mapped to ``kvbatch``) with only torch, triton, transformers, numpy,
safetensors, tokenizers, fsspec and jinja2 installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HBM_BYTES_PER_S = 4.8e12
STAGES = ("env", "kernels", "engine", "throughput", "kv_staging")
# Seconds per stage on an H200 (total under 8 minutes, start-up included) and in --smoke on a CPU.
LIMITS_S = {"env": 30, "kernels": 110, "engine": 80, "throughput": 200, "kv_staging": 50}
SMOKE_LIMITS_S = {"env": 40, "kernels": 60, "engine": 80, "throughput": 60, "kv_staging": 90}


class _ImportBlocker:
    """A meta-path finder refusing some top-level packages, so a CPU run imports what the H200
    image can (``--block-imports``). ``kvbatch`` blocks only the installed package: the checkout
    is then mapped in its place, as on a machine where it is not installed."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        top = name.split(".")[0]
        if top in self.names and (top != "kvbatch" or name == "kvbatch"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by --block-imports)")


def _block_imports() -> None:
    names = [n for n in os.environ.get("KVBATCH_GPU_CHECK_BLOCK", "").split(",") if n]
    if names:
        sys.meta_path.insert(0, _ImportBlocker(names))  # type: ignore[arg-type]


def _map_repo() -> None:
    """``import kvbatch.<folder>`` from a plain checkout: the repository root is the package path."""
    try:
        import kvbatch.engine  # noqa: F401
    except ModuleNotFoundError:
        pkg = types.ModuleType("kvbatch")
        pkg.__path__ = [str(REPO)]
        sys.modules["kvbatch"] = pkg
    sys.path.insert(0, str(REPO / "benchmarks"))


# ---------------------------------------------------------------------------------------------
# the parent: stages in subprocesses, results after each


def stage_file(out: Path, stage: str) -> Path:
    return out / f"stage_{stage}.json"


def run_stages(out: Path, smoke: bool, stages: tuple[str, ...], block: str = "") -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    limits = SMOKE_LIMITS_S if smoke else LIMITS_S
    report: dict[str, Any] = {"smoke": smoke, "blocked_imports": block, "stages": {}}
    for stage in stages:
        path = stage_file(out, stage)
        path.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--out", str(out)]
        if smoke:
            cmd.append("--smoke")
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limits[stage],
                                  env={**_stage_env(smoke), "KVBATCH_GPU_CHECK_BLOCK": block}, check=False)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            status = f"timeout after {limits[stage]} s"
            tail = ((exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace"))[-3000:]
        result = json.loads(path.read_text()) if path.exists() else {}
        report["stages"][stage] = {"status": status, "wall_s": round(time.perf_counter() - started, 1),
                                   "result": result, **({"log_tail": tail} if status != "ok" else {})}
        write_report(out, report)
        print(f"gpu_check: {stage}: {status} ({report['stages'][stage]['wall_s']} s)", flush=True)
    return report


def _stage_env(smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    if smoke:  # before triton is imported in the child
        env.update(TRITON_INTERPRET="1", KVBATCH_KERNELS="triton", KVBATCH_LINEAR="cublas")
    return env


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def _table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")
    return lines


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "/")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check{' (smoke, CPU)' if report['smoke'] else ''}", ""]
    for stage, entry in report["stages"].items():
        lines += [f"## {stage}: {entry['status']} ({entry['wall_s']} s)", ""]
        result = entry["result"]
        for key, value in result.items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                lines += [f"### {key}", "", *_table(value), ""]
            else:
                lines.append(f"- {key}: {_cell(value)}")
        if "log_tail" in entry:
            lines += ["", "```", entry["log_tail"], "```"]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the stages (each in a child process; ``save`` rewrites the stage's JSON as results come)


class Stage:
    def __init__(self, out: Path, name: str, smoke: bool) -> None:
        import torch

        self.path = stage_file(out, name)
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.result: dict[str, Any] = {}

    def save(self, **items: Any) -> None:
        self.result.update(items)
        self.path.write_text(json.dumps(self.result, indent=1, default=str))

    def append(self, key: str, row: dict[str, Any]) -> None:
        self.result.setdefault(key, []).append(row)
        self.save()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()


def stage_env(st: Stage) -> None:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine()}
    for name in ("triton", "transformers", "numpy", "safetensors"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = "missing"
    for name in ("pydantic", "polars", "dagster"):  # the engine's GPU path must not need them
        info[f"{name}_present"] = _importable(name)
    if st.device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        info.update(device=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                    free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))
    else:
        info.update(device="cpu (smoke)", threads=torch.get_num_threads())
    from kvbatch.engine.runtime.llm import LLM  # noqa: F401 - the engine imports without pydantic & co
    from kvbatch.kernels import dispatch

    info["dispatch"] = dispatch.backend(torch.empty(1, device=st.device))
    st.save(**info)


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _time_us(st: Stage, fn: Any, iters: int) -> float:
    import statistics

    import torch

    fn()
    if st.device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def stage_kernels(st: Stage) -> None:
    import gpu_kernels as G
    import torch

    G.DEVICE = str(st.device)
    K = G.import_kernels()
    bf16 = torch.bfloat16
    if st.smoke:
        grid = [(64, 9, 3)]
        contexts, batches, dtype = [1, 15, 16, 17], [1, 3], torch.float32
    else:
        grid = [(64, 9, 3), (128, 32, 8)]
        contexts, batches, dtype = [1, 15, 16, 17, 4096, 32768], [1, 7, 64], bf16
    for D, Hq, Hkv in grid:
        for ctx in contexts:
            for B in batches:
                run, ref, check, nbytes, _ = G.decode_case(K, B, ctx, Hq, Hkv, D, dtype, block_size=16)
                ok, err = check()
                us = _time_us(st, run, 1 if st.smoke else 20)
                st.append("decode", {"D": D, "GQA": f"{Hq}:{Hkv}", "ctx": ctx, "batch": B, "ok": ok, "max_err": err,
                                     "us": round(us, 1), "GB/s": round(nbytes / us / 1e3, 1),
                                     "%HBM": round(100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S, 1)})
                del run, ref, check
    if st.smoke:  # each kernel once, on small shapes
        f32 = torch.float32
        cases = {"prefill": G.prefill_case(K, [20, 5], [9, 5], 9, 3, 64, f32),
                 "rms_norm": G.rms_norm_case(K, 7, 64, f32), "rotary": G.rotary_case(K, 5, 9, 3, 64, f32),
                 "store_kv": G.store_kv_case(K, 9, 3, 64, f32), "fused_moe": G.moe_case(K, 5, 32, 16, 4, 2, f32),
                 "mla_decode": G.mla_case(K, [1, 17], 4, 32, 16, f32), "spec_verify": G.verify_case(K, 4, 2, 50),
                 "silu_and_mul": G.silu_and_mul_case(K, 5, 40, f32),
                 "mla_prefill": G.mla_prefill_case(K, [9, 5], [4, 5], 2, 16, 8, f32, block_size=4)}
        for name, (_, _, check, *_) in cases.items():
            ok, err = check()
            st.append("checks", {"check": name, "ok": ok, "max_err": err})
    else:
        for name, ok, err in G.check_suite(K):
            st.append("checks", {"check": name, "ok": ok, "max_err": err})
    rows = st.result.get("decode", []) + st.result.get("checks", [])
    st.save(failed=sum(not r["ok"] for r in rows))


# -- models with random weights, built on the device --------------------------------------------

SHAPES = {
    "tiny-llama": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 97},
    "tiny-mixtral": {"hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 97, "num_local_experts": 4, "num_experts_per_tok": 2},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "rope_theta": 500000.0},
}


def hf_config(shape: str, max_positions: int) -> dict[str, Any]:
    moe = "num_local_experts" in SHAPES[shape]
    return {"architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
            "model_type": "mixtral" if moe else "llama", "rms_norm_eps": 1e-5, "max_position_embeddings": max_positions,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            **SHAPES[shape]}


def hf_model(shape: str, max_positions: int, device: Any, dtype: Any, std: float) -> Any:
    """A transformers model of ``shape`` with seeded random weights, built on ``device``."""
    import torch
    import transformers as tf

    raw = hf_config(shape, max_positions)
    cls, cfg_cls = ((tf.MixtralForCausalLM, tf.MixtralConfig) if raw["model_type"] == "mixtral"
                    else (tf.LlamaForCausalLM, tf.LlamaConfig))
    cfg = cfg_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    cfg.initializer_range = std
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg).to(dtype).eval()
    return model


def checkpoint_of(model: Any, shape: str, max_positions: int) -> Any:
    """The engine's Checkpoint over the transformers model's own tensors (shared, not copied)."""
    import torch

    from kvbatch.engine.models.weights import Checkpoint, TokenizerSource, _fuse_experts, _normalize_hf_config

    dtype = next(model.parameters()).dtype
    config = _normalize_hf_config(hf_config(shape, max_positions), shape, dtype)
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    tensors = _fuse_experts(tensors, shape)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    return Checkpoint(config=config, tensors=tensors, source=f"random:{shape}", fingerprint=f"random-{shape}-seed0",
                      tokenizer_source=TokenizerSource(kind="hf", source=shape))


def _engine(ckpt: Any, device: str, dtype: str, **cfg: Any) -> Any:
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM

    return LLM(ckpt, dtype=dtype, engine_config=EngineConfig(device=device, **cfg))


def _greedy(n: int, tokens: int) -> Any:
    from kvbatch.engine.runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)


def _requests(prompts: list[list[int]], tokens: int) -> list[Any]:
    from kvbatch.engine.runtime.llm import GenerationRequest

    return [GenerationRequest(f"r{i}", _greedy(i, tokens), prompt_token_ids=p) for i, p in enumerate(prompts)]


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def stage_engine(st: Stage) -> None:
    import torch

    torch.set_float32_matmul_precision("highest")
    for shape in ("tiny-llama", "tiny-mixtral"):
        ref = hf_model(shape, 128, "cpu", torch.float32, std=0.2)  # peaked logits: no near-ties
        ckpt = checkpoint_of(ref, shape, 128)
        prompts = _prompts(2 if st.smoke else 3, 9, SHAPES[shape]["vocab_size"])
        tokens = 4 if st.smoke else 8
        kw = {"block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 64}
        host = _engine(ckpt, "cpu", "fp32", num_blocks=32, **kw)
        if st.smoke:  # the "device" engine: the interpreted Triton kernels and the CUDA layout, on the CPU
            os.environ["KVBATCH_KERNELS"] = "reference"
        want = [r.output_token_ids for r in host.generate(_requests(prompts, tokens))]
        if st.smoke:
            os.environ["KVBATCH_KERNELS"] = "triton"
        eager = _engine(ckpt, str(st.device), "fp32", num_blocks=32, enforce_eager=True, **kw)
        row: dict[str, Any] = {"model": shape}
        steps_before = eager.stats["steps"]
        results, syncs = _count_syncs(st, eager, prompts, tokens)
        steps = eager.stats["steps"] - steps_before
        row.update(tokens_equal_cpu=[r.output_token_ids for r in results] == want, steps=steps,
                   syncs_per_step=round(syncs / steps, 2) if syncs is not None else "n/a (CPU)")
        if st.device.type == "cuda":
            graphs = _engine(ckpt, str(st.device), "fp32", num_blocks=32, **kw)
            equal, replays = _graphs_equal_eager(graphs, eager, prompts)
            row.update(graph_replays=replays, graphs_bitwise_eager=equal)
        else:
            row.update(graph_replays="n/a (CPU)", graphs_bitwise_eager="n/a (CPU)")
        st.append("engine", row)
    st.save(all_equal=all(r["tokens_equal_cpu"] and r["graphs_bitwise_eager"] in (True, "n/a (CPU)")
                          for r in st.result["engine"]))


def _count_syncs(st: Stage, llm: Any, prompts: list[list[int]], tokens: int) -> tuple[list[Any], int | None]:
    """Generate, counting the synchronizing CUDA calls made on the way (None on the CPU)."""
    import torch

    if st.device.type != "cuda":
        return llm.generate(_requests(prompts, tokens)), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            results = llm.generate(_requests(prompts, tokens))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return results, sum("synchroniz" in str(w.message).lower() for w in caught)


def _graphs_equal_eager(graphs: Any, eager: Any, prompts: list[list[int]]) -> tuple[bool, int]:
    """The last replayed graph's logits equal an eager forward over the same static inputs, bit
    for bit, and the graph engine's greedy tokens equal the eager engine's."""
    got = [r.output_token_ids for r in graphs.generate(_requests(prompts, 8))]
    want = [r.output_token_ids for r in eager.generate(_requests(prompts, 8))]
    runner = graphs.runner.graphs
    if runner is None or runner.replays == 0:
        return False, 0
    replayed, recomputed = runner.replay_and_eager(graphs.runner)
    import torch

    return bool(torch.equal(replayed, recomputed)) and got == want, runner.replays


def stage_throughput(st: Stage) -> None:
    import torch

    if st.smoke:
        plan = [("tiny-llama", [1, 2], 4, 4)]
    else:
        plan = [("smollm2-135m", [1, 64, 256], 128, 256), ("llama-3.1-8b", [1, 64, 256], 128, 256)]
    dtype = torch.float32 if st.smoke else torch.bfloat16
    dname = "fp32" if st.smoke else "bf16"
    for shape, batches, prompt_len, out_len in plan:
        max_pos = prompt_len + out_len + 16
        ref = hf_model(shape, max_pos, st.device, dtype, std=0.02)
        ckpt = checkpoint_of(ref, shape, max_pos)
        weight_bytes = sum(t.numel() * t.element_size() for t in ckpt.tensors.values())
        for graphs in ([False] if st.smoke else [True, False]):
            max_seqs = max(batches)
            llm = _engine(ckpt, str(st.device), dname, block_size=16, max_num_seqs=max_seqs,
                          max_num_batched_tokens=max(2048, prompt_len * 8), max_model_len=max_pos,
                          enforce_eager=not graphs, **({"num_blocks": 64} if st.smoke else {}))
            for B in batches:
                prompts = _prompts(B, prompt_len, SHAPES[shape]["vocab_size"], seed=B)
                llm.generate(_requests(prompts[:1], 2))  # warm-up
                st.sync()
                t0 = time.perf_counter()
                results = llm.generate(_requests(prompts, out_len))
                st.sync()
                wall = time.perf_counter() - t0
                decode_s = sum(r.tpot_s or 0.0 for r in results) / len(results) * (out_len - 1)
                ms_step = 1e3 * decode_s / max(1, out_len - 1)
                kv_bytes = B * (prompt_len + out_len / 2) * llm.block_bytes / llm.engine_config.block_size
                st.append("throughput", {"model": shape, "engine": "kvbatch graphs" if graphs else "kvbatch eager",
                                         "batch": B, "tok/s": round(B * out_len / wall, 1), "ms/step": round(ms_step, 3),
                                         "%HBM": round(100 * (weight_bytes + kv_bytes) / (ms_step * 1e-3) / HBM_BYTES_PER_S, 1),
                                         # 0 with graphs asked for: capture failed (the warning is in the log)
                                         "graph_replays": llm.runner.graphs.replays if llm.runner.graphs else 0})
            del llm
        for B in batches:
            st.append("throughput", _hf_generate(st, ref, shape, B, prompt_len, out_len))
        del ref, ckpt
        if st.device.type == "cuda":
            torch.cuda.empty_cache()


def _hf_generate(st: Stage, model: Any, shape: str, B: int, prompt_len: int, out_len: int) -> dict[str, Any]:
    import torch

    ids = torch.tensor(_prompts(B, prompt_len, SHAPES[shape]["vocab_size"], seed=B), device=st.device)
    kw = {"do_sample": False, "min_new_tokens": out_len, "max_new_tokens": out_len, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids[:1], **{**kw, "min_new_tokens": 2, "max_new_tokens": 2})
        st.sync()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        st.sync()
    wall = time.perf_counter() - t0
    return {"model": shape, "engine": "transformers generate", "batch": B, "tok/s": round(B * out_len / wall, 1),
            "ms/step": round(1e3 * wall / out_len, 3)}


# -- the KV store's staging pool ------------------------------------------------------------------


class _DictStore:
    """Blocks in a dict, as the engine's BlockStore protocol wants them (kvbatch.io's store needs
    pydantic, which the H200 image lacks)."""

    def __init__(self) -> None:
        self.blocks: dict[str, Any] = {}

    def contains(self, keys: list[str]) -> list[bool]:
        return [k in self.blocks for k in keys]

    def lookup(self, keys: list[str]) -> list[str]:
        return ["" if k in self.blocks else "missing" for k in keys]

    def get_many(self, keys: list[str]) -> list[tuple[Any, str]]:
        return [(self.blocks[k].clone(), "memory") if k in self.blocks else (None, "missing") for k in keys]

    def put_many(self, blocks: list[tuple[str, Any]]) -> int:
        new = [(k, t.clone()) for k, t in blocks if k not in self.blocks]
        self.blocks.update(new)
        return len(new)

    def stats(self) -> dict[str, Any]:
        return {}


def _median_s(st: Stage, fn: Any, reps: int) -> float:
    import statistics

    fn()  # warm-up: first-use costs (allocator, lazy initialisation) are not the steady state
    times = []
    for _ in range(reps):
        st.sync()
        t0 = time.perf_counter()
        fn()
        st.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _staging_bandwidth(st: Stage, staging: Any, cache: Any, host: list[Any], ids: list[int]) -> dict[str, Any]:
    """GB/s of loads and saves of ``host`` blocks at ``ids``: through the pool, and as the engine
    did before it (per-block copies from pageable memory; one gather and a blocking copy out)."""
    import torch

    nbytes = len(ids) * host[0].numel() * host[0].element_size()
    keys = [f"b{i}" for i in ids]
    reps = 2 if st.smoke else 5

    def load_direct() -> None:
        for t, b in zip(host, ids):
            cache[:, :, b].copy_(t)

    def save_pool() -> list[Any]:
        staging.save(cache, keys, ids)
        return staging.collect(wait=True)

    def save_gather() -> list[Any]:
        gathered = cache.index_select(2, torch.tensor(ids, device=cache.device)).cpu()
        return [gathered[:, :, j].clone() for j in range(len(ids))]

    row: dict[str, Any] = {"MiB": round(nbytes / 2**20, 1)}
    row["load_pool_GB_s"] = round(nbytes / _median_s(st, lambda: staging.load(cache, host, ids), reps) / 1e9, 2)
    loaded = all(torch.equal(cache[:, :, b].cpu(), t) for t, b in zip(host, ids))
    row["load_direct_GB_s"] = round(nbytes / _median_s(st, load_direct, reps) / 1e9, 2)
    row["save_pool_GB_s"] = round(nbytes / _median_s(st, save_pool, reps) / 1e9, 2)
    (_, saved), = save_pool()
    row["save_gather_GB_s"] = round(nbytes / _median_s(st, save_gather, reps) / 1e9, 2)
    row["bitwise_equal"] = loaded and all(torch.equal(a, b) for a, b in zip(saved, host))
    row["pool_waits"] = staging.pool.waits
    return row


def stage_kv_staging(st: Stage) -> None:
    """Loads into and saves out of the device cache through the staging pool (pinned buffers, a
    side stream) against the direct per-block copies; then blocks written by an engine on one
    device decoded by an engine on the other."""
    import torch

    from kvbatch.engine.runtime.kv_staging import KVStaging, block_shape, copy_engine_for
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest

    shapes = ({"tiny fp32": ((2, 2, 64, 16, 2, 16), torch.float32)} if st.smoke else
              {"smollm2-135m bf16": ((30, 2, 1024, 16, 3, 64), torch.bfloat16),
               "llama-3.1-8b bf16": ((32, 2, 512, 16, 8, 128), torch.bfloat16)})
    for name, (shape, dtype) in shapes.items():
        cache = torch.zeros(shape, dtype=dtype, device=st.device)
        n = shape[2] // 2
        g = torch.Generator().manual_seed(0)
        host = [torch.randn(block_shape(cache), generator=g).to(dtype) for _ in range(n)]
        staging = KVStaging(copy_engine_for(cache.device))
        for layout, ids in (("one run", list(range(n))), ("scattered", list(range(0, 2 * n, 2)))):
            st.append("bandwidth", {"cache": name, "blocks": f"{n} ({layout})",
                                    **_staging_bandwidth(st, staging, cache, host, ids)})
        del cache

    # Stored bytes do not depend on the device: write on one, decode on the other (fp32, IEEE).
    # In --smoke both are the CPU: the reference kernels keep it short (the engine stage already
    # ran the interpreted Triton kernels through the engine).
    if st.smoke:
        os.environ["KVBATCH_KERNELS"] = "reference"
    torch.set_float32_matmul_precision("highest")
    ref = hf_model("tiny-llama", 128, "cpu", torch.float32, std=0.2)  # peaked logits: no near-ties
    ckpt = checkpoint_of(ref, "tiny-llama", 128)
    prompts = _prompts(3, 37, SHAPES["tiny-llama"]["vocab_size"])
    kw = {"block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 64, "num_blocks": 32, "enforce_eager": True}

    def engine(device: str, store: Any) -> Any:
        from kvbatch.engine.runtime.engine_config import EngineConfig

        return LLM(ckpt, dtype="fp32", engine_config=EngineConfig(device=device, **kw), kv_store=store)

    want = [r.output_token_ids for r in engine("cpu", None).generate(_requests(prompts, 4))]
    devices = [str(st.device), "cpu"]
    for writer, reader in ((devices[0], devices[1]), (devices[1], devices[0])):
        store = _DictStore()
        engine(writer, store).generate([GenerationRequest(f"p{i}", _greedy(i, 1), prompt_token_ids=p,
                                                          prefill_only=True) for i, p in enumerate(prompts)])
        decoder = engine(reader, store)
        got = [r.output_token_ids for r in decoder.generate(_requests(prompts, 4))]
        st.append("across_devices", {"written_on": writer, "decoded_on": reader, "blocks_stored": len(store.blocks),
                                     "blocks_loaded": decoder.connector.stats.blocks_loaded,
                                     "tokens_equal_cpu_generate": got == want})
    st.save(all_ok=all(r["bitwise_equal"] for r in st.result["bandwidth"])
            and all(r["tokens_equal_cpu_generate"] and r["blocks_loaded"] > 0 for r in st.result["across_devices"]))


def run_stage(stage: str, out: Path, smoke: bool) -> int:
    _block_imports()
    _map_repo()
    st = Stage(out, stage, smoke)
    try:
        {"env": stage_env, "kernels": stage_kernels, "engine": stage_engine, "throughput": stage_throughput,
         "kv_staging": stage_kv_staging}[stage](st)
    except Exception:  # noqa: BLE001 - recorded in the stage's JSON, then the exit status says it failed
        st.save(error=traceback.format_exc()[-4000:])
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json, gpu_check.md, stage files")
    parser.add_argument("--smoke", action="store_true", help="every stage on the CPU, tiny shapes, Triton interpreter")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--block-imports", default="", metavar="PKGS",
                        help="comma-separated packages the stages must run without (e.g. what the H200 image "
                             "lacks: pydantic,polars,dagster,s3fs,gguf; kvbatch: as from a plain checkout)")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.stage:
        return run_stage(args.stage, args.out, args.smoke)
    stages = tuple(s for s in args.stages.split(",") if s)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage {unknown[0]!r} (stages: {', '.join(STAGES)})")
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --smoke to check every stage on the CPU", file=sys.stderr)
            return 2
    report = run_stages(args.out, args.smoke, stages, args.block_imports)
    bad = [s for s, e in report["stages"].items() if e["status"] != "ok"]
    print(f"gpu_check: {len(stages) - len(bad)} of {len(stages)} stages ok -> {args.out / 'gpu_check.md'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
