"""The GPU check's model stages (``benchmarks/gpu_check.py``): ``engine`` (the engine on the device
against the same engine on the CPU), ``throughput`` (random-weight SmolLM2 and Llama-3.1-8B shapes
against transformers ``generate``) and ``kv_staging`` (KV-store loads and saves through the pinned
staging pool), with the models they build on the device. ``gpu_check`` runs each in its own
process through its ``Stage``; this module holds what those stages do, apart from the runner.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_check import Stage


# -- models with random weights, built on the device --------------------------------------------

SHAPES = {
    "tiny-llama": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 97},
    "tiny-mixtral": {"hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 97, "num_local_experts": 4, "num_experts_per_tok": 2},
    # Gemma 3 text: two sliding layers (window 4: most of each context outside it, held in the window
    # cache only) around a full one
    "tiny-gemma3": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 97, "sliding_window": 4,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "query_pre_attn_scalar": 24},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "rope_theta": 500000.0},
}


def hf_config(shape: str, max_positions: int) -> dict[str, Any]:
    if "layer_types" in SHAPES[shape]:
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "rms_norm_eps": 1e-6,
                "max_position_embeddings": max_positions, "tie_word_embeddings": True, "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 0, "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
                **SHAPES[shape]}
    moe = "num_local_experts" in SHAPES[shape]
    return {"architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
            "model_type": "mixtral" if moe else "llama", "rms_norm_eps": 1e-5, "max_position_embeddings": max_positions,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            **SHAPES[shape]}


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Iterator[None]:
    """Tensors made without a dtype are ``dtype`` inside (as transformers' own ``dtype=`` loading
    does): a model built here has its parameters made in that dtype, never in fp32 first."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def hf_model(shape: str, max_positions: int, device: Any, dtype: Any, std: float) -> Any:
    """A transformers model of ``shape`` with seeded random weights, built directly in ``dtype``
    on ``device``: each parameter is allocated once, there, in ``dtype`` and initialised in place
    (the 8B in bf16 holds 16 GB, not 32 GB of fp32 and then 16 GB of its cast). Buffers that
    transformers makes in fp32 on purpose (the rotary frequencies) stay fp32."""
    import torch
    import transformers as tf

    raw = hf_config(shape, max_positions)
    cls, cfg_cls = {"mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig),
                    "gemma3_text": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig)}.get(
                        raw["model_type"], (tf.LlamaForCausalLM, tf.LlamaConfig))
    cfg = cfg_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    cfg.initializer_range = std
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        model = cls(cfg).eval()
    return model


@contextlib.contextmanager
def parameter_dtypes() -> Iterator[dict[str, int]]:
    """Counts, by dtype, the parameters modules register inside (a global registration hook):
    what a model build allocated, before any cast could hide it."""
    import torch

    seen: dict[str, int] = {}

    def hook(module: Any, name: str, param: Any) -> None:
        if param is not None:
            key = str(param.dtype).removeprefix("torch.")
            seen[key] = seen.get(key, 0) + 1

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


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
    shapes = ("tiny-llama", "tiny-mixtral", "tiny-gemma3")
    for shape in shapes:
        st.case(f"engine {shape}", lambda shape=shape: engine_against_cpu(st, shape), table="engine")
    rows = st.rows("engine")
    equal = len(rows) == len(shapes) and all(r["ok"] for r in rows)
    st.summary(ok=equal, all_equal=equal)


def engine_against_cpu(st: Stage, shape: str) -> dict[str, Any]:
    """One tiny model: greedy tokens on the device equal the CPU engine's; syncs per step; graph
    replay against eager (CUDA only)."""
    import torch

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
    row["ok"] = row["tokens_equal_cpu"] and row["graphs_bitwise_eager"] in (True, "n/a (CPU)")
    return row


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


def throughput_plan(smoke: bool) -> list[tuple[str, list[int], int, int]]:
    """(shape, batches, prompt tokens, output tokens), in the order they run: the 8B first (the
    issue's targets are measured on it)."""
    if smoke:
        return [("tiny-llama", [1, 2], 4, 4)]
    return [("llama-3.1-8b", [1, 64, 256], 128, 256), ("smollm2-135m", [1, 64, 256], 128, 256)]


def throughput_steps(smoke: bool) -> list[str]:
    """Per model, in order: the engine with CUDA graphs (the issue's targets), transformers
    ``generate`` (the baseline), the engine eager. On the CPU: no graphs."""
    return ["eager", "transformers"] if smoke else ["graphs", "transformers", "eager"]


def _held(held: dict[str, Any], key: str) -> Any:
    if key not in held:
        raise RuntimeError(f"{key} was not built (its case failed or was skipped)")
    return held[key]


def stage_throughput(st: Stage) -> None:
    """Per model: build it in bf16 on the device; the engine with graphs over every batch; the
    same model through transformers ``generate``; then the engine eager. Each is one case, and a
    case whose model or engine was not built fails naming it."""
    import gc

    import torch

    st.copy_per_s()
    dtype = torch.bfloat16
    for shape, batches, prompt_len, out_len in throughput_plan(st.smoke):
        max_pos = prompt_len + out_len + 16
        held: dict[str, Any] = {}

        def build(shape: str = shape, max_pos: int = max_pos, held: dict[str, Any] = held) -> dict[str, Any]:
            with parameter_dtypes() as made:
                held["ref"] = hf_model(shape, max_pos, st.device, dtype, std=0.02)
            held["ckpt"] = checkpoint_of(held["ref"], shape, max_pos)
            held["weight_bytes"] = sum(t.numel() * t.element_size() for t in held["ckpt"].tensors.values())
            # ok only if every parameter was made in bf16: no fp32 copy of the weights existed
            return {"model": shape, "parameters_made": made, "weight_bytes": held["weight_bytes"],
                    "ok": set(made) == {"bfloat16"}}

        st.case(f"build {shape} (bf16, on the device)", build, table="builds")
        for step in throughput_steps(st.smoke):
            if step == "transformers":
                for B in batches:
                    st.case(f"transformers generate {shape} batch {B}",
                            lambda B=B, shape=shape, held=held, p=prompt_len, o=out_len:
                            _hf_generate(st, _held(held, "ref"), shape, B, p, o), table="throughput")
                continue

            def engine(graphs: bool = step == "graphs", held: dict[str, Any] = held, max_pos: int = max_pos,
                       batches: list[int] = batches, prompt_len: int = prompt_len) -> dict[str, Any]:
                held["llm"] = _engine(_held(held, "ckpt"), str(st.device), "bf16", block_size=16,
                                      max_num_seqs=max(batches), max_num_batched_tokens=max(2048, prompt_len * 8),
                                      max_model_len=max_pos, enforce_eager=not graphs,
                                      **({"num_blocks": 64} if st.smoke else {}))
                return {"model": _held(held, "ckpt").source, "graphs": graphs}

            st.case(f"kvbatch {step} engine {shape}", engine, table="builds")
            for B in batches:
                st.case(f"kvbatch {step} {shape} batch {B}",
                        lambda B=B, shape=shape, held=held, p=prompt_len, o=out_len, g=step == "graphs":
                        _kvbatch_generate(st, held, shape, B, p, o, g), table="throughput")
            held.pop("llm", None)  # before the next engine or transformers' own cache needs the memory
            gc.collect()
            if st.device.type == "cuda":
                torch.cuda.empty_cache()
        held.clear()
        gc.collect()
        if st.device.type == "cuda":
            torch.cuda.empty_cache()


def _kvbatch_generate(st: Stage, held: dict[str, Any], shape: str, B: int, prompt_len: int, out_len: int,
                      graphs: bool) -> dict[str, Any]:
    llm = _held(held, "llm")
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
    return {"model": shape, "engine": "kvbatch graphs" if graphs else "kvbatch eager", "batch": B,
            "tok/s": round(B * out_len / wall, 1), "ms/step": round(ms_step, 3),
            # the weights and the mean KV read once per decode step
            **st.bandwidth(_held(held, "weight_bytes") + kv_bytes, ms_step * 1e-3),
            # 0 with graphs asked for: capture failed (the warning is in the log)
            "graph_replays": llm.runner.graphs.replays if llm.runner.graphs else 0}


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

    shapes = ({"tiny fp32": ((2, 2, 64, 16, 2, 16), torch.float32)} if st.smoke else
              {"smollm2-135m bf16": ((30, 2, 1024, 16, 3, 64), torch.bfloat16),
               "llama-3.1-8b bf16": ((32, 2, 512, 16, 8, 128), torch.bfloat16)})
    for name, (shape, dtype) in shapes.items():
        n = shape[2] // 2
        held: dict[str, Any] = {}
        for layout, ids in (("one run", list(range(n))), ("scattered", list(range(0, 2 * n, 2)))):
            st.case(f"staging {name} {layout}",
                    lambda name=name, shape=shape, dtype=dtype, held=held, n=n, layout=layout, ids=ids:
                    {"cache": name, "blocks": f"{n} ({layout})",
                     **_staging_case(st, held, shape, dtype, n, ids)}, table="bandwidth")
        held.clear()

    # Stored bytes do not depend on the device: write on one, decode on the other (fp32, IEEE).
    # In --smoke both are the CPU: the reference kernels keep it short (the engine stage already
    # ran the interpreted Triton kernels through the engine).
    if st.smoke:
        os.environ["KVBATCH_KERNELS"] = "reference"
    torch.set_float32_matmul_precision("highest")
    shared: dict[str, Any] = {}
    devices = [str(st.device), "cpu"]
    for writer, reader in ((devices[0], devices[1]), (devices[1], devices[0])):
        st.case(f"written on {writer}, decoded on {reader}",
                lambda writer=writer, reader=reader: _across_devices(shared, writer, reader), table="across_devices")
    rows = st.rows("bandwidth") + st.rows("across_devices")
    ok = len(rows) == 2 * len(shapes) + 2 and all(r["ok"] for r in rows)
    st.summary(ok=ok, all_ok=ok)


def _staging_case(st: Stage, held: dict[str, Any], shape: tuple[int, ...], dtype: Any, n: int,
                  ids: list[int]) -> dict[str, Any]:
    """One layout of block ids through the pool; the cache, host blocks and pool are made once per
    cache shape (by whichever of its cases runs first)."""
    import torch

    from kvbatch.engine.runtime.kv_staging import KVStaging, block_shape, copy_engine_for

    if "cache" not in held:
        cache = torch.zeros(shape, dtype=dtype, device=st.device)
        g = torch.Generator().manual_seed(0)
        held.update(cache=cache, host=[torch.randn(block_shape(cache), generator=g).to(dtype) for _ in range(n)],
                    staging=KVStaging(copy_engine_for(cache.device)))
    row = _staging_bandwidth(st, held["staging"], held["cache"], held["host"], ids)
    row["ok"] = row["bitwise_equal"]
    return row


def _across_devices(shared: dict[str, Any], writer: str, reader: str) -> dict[str, Any]:
    """A tiny model's prompt blocks stored by an engine on ``writer``, decoded by one on ``reader``:
    greedy tokens equal the CPU's ``generate`` (made once, by the first case that runs)."""
    import torch

    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM, GenerationRequest

    if "ckpt" not in shared:
        ref = hf_model("tiny-llama", 128, "cpu", torch.float32, std=0.2)  # peaked logits: no near-ties
        shared["ckpt"] = checkpoint_of(ref, "tiny-llama", 128)
        shared["prompts"] = _prompts(3, 37, SHAPES["tiny-llama"]["vocab_size"])
    ckpt, prompts = shared["ckpt"], shared["prompts"]
    kw = {"block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 64, "num_blocks": 32, "enforce_eager": True}

    def engine(device: str, store: Any) -> Any:
        return LLM(ckpt, dtype="fp32", engine_config=EngineConfig(device=device, **kw), kv_store=store)

    if "want" not in shared:
        shared["want"] = [r.output_token_ids for r in engine("cpu", None).generate(_requests(prompts, 4))]
    store = _DictStore()
    engine(writer, store).generate([GenerationRequest(f"p{i}", _greedy(i, 1), prompt_token_ids=p,
                                                      prefill_only=True) for i, p in enumerate(prompts)])
    decoder = engine(reader, store)
    got = [r.output_token_ids for r in decoder.generate(_requests(prompts, 4))]
    loaded = decoder.connector.stats.blocks_loaded
    return {"written_on": writer, "decoded_on": reader, "blocks_stored": len(store.blocks), "blocks_loaded": loaded,
            "tokens_equal_cpu_generate": got == shared["want"], "ok": got == shared["want"] and loaded > 0}
