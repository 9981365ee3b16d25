"""weights="gguf": the native Q4_0/Q4_1/Q8_0 kernel against a dequantize-then-multiply reference,
the blocks found for the engine's fused projections, the fp32 fallback, and the build cache.

The kernel is built once per session into the test cache dir (conftest sets KVBATCH_CACHE_DIR);
tests that need it skip where this machine has no C compiler, and the fallback is tested by
hiding the compiler, which works everywhere.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import subprocess
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.models import factory
from kvbatch.engine.models.weights import load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch
from kvbatch.kernels.cpu import gguf_kernels, native_build
from kvbatch.kernels.cpu import native as native_kernels
from kvbatch.kernels.cpu.gguf_blocks import GGUFBlocks, dequantize, quantize
from kvbatch.kernels.cpu.gguf_kernels import BlockIndex, GGUFWeight, gguf_linear, to_torch
from kvbatch.kernels.cpu.kernel_choice import choose_kernels
from kvbatch.kernels.cpu.linear import GGUF, GGUF_NATIVE
from kvbatch.kernels.cpu.machine import cpu_identity
from tests.logit_capture import capture_logits
from tests.test_weights import _random_hf_tensors, _write_gguf

REPO = Path(__file__).resolve().parents[1]
needs_kernel = pytest.mark.skipif(not gguf_kernels.available(),
                                  reason=f"no native GGUF kernel here: {gguf_kernels.unavailable_reason()}")


def _reference(x: np.ndarray, blocks: GGUFBlocks) -> np.ndarray:
    """Dequantize (gguf-py, the loader's own path), then multiply in float64."""
    return x.astype(np.float64) @ dequantize(blocks).astype(np.float64).T


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), rows=st.integers(1, 11), n=st.integers(1, 45),
       blocks=st.integers(1, 12), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_kernel_matches_dequantize_then_matmul(qtype: str, rows: int, n: int, blocks: int, threads: int,
                                               seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3), qtype)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = gguf_linear(torch.from_numpy(x), to_torch(w)).numpy()
    finally:
        torch.set_num_threads(before)
    ref = _reference(x, w)
    # Only the summation order differs. The kernel sums d * q * x and m * x terms (Q4_x: the block
    # minimum m <= max|w|), so its fp32 rounding is relative to sum_j (|w_j| + max|w|) |x_j|;
    # 1e-5 of that is ~100x the rounding measured and ~1/20 of what int8-rounded weights give.
    wd = np.abs(dequantize(w))
    bound = 1e-5 * (np.abs(x) @ (wd + wd.max()).T) + 1e-6
    assert y.shape == (rows, n)
    assert np.all(np.abs(y - ref) <= bound), float(np.abs(y - ref).max())


@needs_kernel
def test_kernel_refuses_a_row_length_blocks_cannot_hold() -> None:
    w = gguf_kernels.QuantizedBlocks("Q8_0", 4, 48, torch.zeros(4, 51, dtype=torch.uint8))  # 48 is no multiple of 32
    with pytest.raises(ValueError, match="refused"):
        gguf_linear(torch.zeros(1, 48), w)


def test_block_index_finds_concatenated_parts_and_nothing_else() -> None:
    rng = np.random.default_rng(0)
    parts = {f"p{i}": quantize(rng.standard_normal((rows, 64)).astype(np.float32), "Q4_1")
             for i, rows in enumerate((8, 3, 5))}
    tensors = {name: torch.from_numpy(dequantize(b)) for name, b in parts.items()}
    index = BlockIndex(tensors, parts)
    fused = torch.cat([tensors["p0"], tensors["p1"], tensors["p2"]])
    found = index.lookup(fused)
    assert found is not None and (found.out_features, found.in_features, found.qtype) == (16, 64, "Q4_1")
    assert torch.equal(found.data, torch.from_numpy(np.concatenate([parts[p].data for p in ("p0", "p1", "p2")])))
    changed = fused.clone()
    changed[9, 3] += 1.0  # one value off inside the second part: no blocks stand for this weight
    assert index.lookup(changed) is None
    assert index.lookup(torch.randn(4, 64)) is None


def _tiny_gguf(tmp_path: Path, f32: tuple[str, ...] = ()) -> Path:
    """A tiny Llama GGUF: Q4_1 projections (one Q4_0), a Q8_0 tied head, the tensors named in
    ``f32`` left in F32."""
    tensors = _random_hf_tensors(seed=5, arch="llama")
    qtypes = {name: Q.Q4_1 for name in tensors if name.endswith("proj.weight") and name not in f32}
    qtypes["model.embed_tokens.weight"] = Q.Q8_0  # the tied LM head runs on Q8_0 blocks
    qtypes["model.layers.1.mlp.down_proj.weight"] = Q.Q4_0
    _write_gguf(tmp_path / "tiny.gguf", "llama", tensors, qtypes)
    return tmp_path / "tiny.gguf"


_PROMPTS = [[1, 5, 9, 33, 4, 17, 60], [1, 2, 3], [1] + list(range(10, 40))]


def _generate_with_logits(llm: LLM) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Greedy tokens for _PROMPTS and every step's logits per request."""
    seen = capture_logits(llm)
    reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                              prompt_token_ids=p) for i, p in enumerate(_PROMPTS)]
    results = llm.generate(reqs)
    logits: dict[str, list[torch.Tensor]] = {}
    for rid, row in seen:
        logits.setdefault(rid, []).append(row)
    return [r.output_token_ids for r in results], {k: torch.stack(v) for k, v in logits.items()}


def test_loader_keeps_blocks_that_dequantize_to_the_fp32_tensors(tmp_path: Path) -> None:
    ckpt = load_checkpoint(str(_tiny_gguf(tmp_path)))
    assert set(ckpt.gguf_blocks) == {n for n in ckpt.tensors if n.endswith("proj.weight")} | {"model.embed_tokens.weight"}
    for name, blocks in ckpt.gguf_blocks.items():  # q/k rows un-permuted with their values
        assert np.array_equal(dequantize(blocks), ckpt.tensors[name].numpy()), name


def _native_everywhere(kind: str, rows: int, run) -> float:
    """A timer under which the native kernel wins every bucket (the float ones never do)."""
    run()
    return 1e-6 if kind == GGUF_NATIVE else 1.0


@needs_kernel
def test_engine_on_gguf_blocks_matches_the_dequantized_fp32_engine(tmp_path: Path, monkeypatch) -> None:
    ckpt = load_checkpoint(str(_tiny_gguf(tmp_path)))
    monkeypatch.setattr(factory, "choose_kernels", functools.partial(choose_kernels, timer=_native_everywhere,
                                                                     cache_dir=tmp_path / "cache"))
    runs = {}
    for weights in ("full", "gguf"):
        llm = LLM(ckpt, engine_config=EngineConfig(kv_cache_bytes=8 << 20, weights=weights))
        runs[weights] = (*_generate_with_logits(llm), llm)
    fmt = runs["gguf"][2].model.kernel_choice.fmt
    assert fmt.kind == GGUF and set(fmt.bucket_kinds) == {GGUF_NATIVE}
    model = runs["gguf"][2].model
    layer_weights = [w for lw in model.layers for w in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
    assert all(isinstance(w, GGUFWeight) and w.blocks is not None and not w.layouts for w in layer_weights)
    assert model.lm_head.blocks.qtype == "Q8_0" and model.layers[1].down.blocks.qtype == "Q4_0"
    assert runs["gguf"][0] == runs["full"][0]
    for rid, full in runs["full"][1].items():  # summation order only: far under any quantization error
        assert float((runs["gguf"][1][rid] - full).abs().max()) < 1e-3 * float(full.abs().max()), rid
    assert runs["gguf"][2].kv_root_key != runs["full"][2].kv_root_key  # their KV blocks never mix


@needs_kernel
@pytest.mark.skipif(not native_kernels.available(), reason="no native CPU kernels")
@pytest.mark.parametrize("f32_proj", [False, True])
def test_gguf_decode_runs_the_fused_layers_over_the_blocks(tmp_path: Path, monkeypatch, f32_proj: bool) -> None:
    # the native kernel won the decode buckets, so decode steps take the fused layers, each GGUF
    # projection through the kernel's own entry for a thread's outputs (the same sums per output as
    # the per-op call) and a projection the file held in F32 through its plain fp32 layout: the
    # per-op path's tokens, its logits to fp32 noise (the norms and attention sum in C there)
    held = ("model.layers.0.self_attn.o_proj.weight",) if f32_proj else ()
    ckpt = load_checkpoint(str(_tiny_gguf(tmp_path, f32=held)))
    monkeypatch.setattr(factory, "choose_kernels", functools.partial(choose_kernels, timer=_native_everywhere,
                                                                     cache_dir=tmp_path / "cache"))
    calls: list[int] = []
    real = dispatch.decode_layers
    monkeypatch.setattr(dispatch, "decode_layers", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    runs = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("KVBATCH_FUSED_DECODE", fused)
        llm = LLM(ckpt, engine_config=EngineConfig(kv_cache_bytes=8 << 20, weights="gguf"))
        runs[fused] = _generate_with_logits(llm)
        assert bool(calls) == (fused == "1") and set(calls) <= {1, 2, 3}
    o_proj = llm.model.layers[0].o_proj
    assert (o_proj.blocks is None) == f32_proj
    assert isinstance(llm.model.linear.fused_weight(o_proj), torch.Tensor if f32_proj else native_kernels.ColumnsWeight)
    assert runs["1"][0] == runs["0"][0]
    for rid, per_op in runs["0"][1].items():  # the first (prefill) logits alike; decode drifts by 2e-5 at most
        assert torch.equal(runs["1"][1][rid][0], per_op[0])
        assert float((runs["1"][1][rid] - per_op).abs().max()) < 1e-4 * float(per_op.abs().max()), rid


@needs_kernel
def test_the_fused_entry_refuses_what_it_cannot_take() -> None:
    w = gguf_kernels.random_blocks("Q4_1", 16, 64, torch.Generator().manual_seed(0))
    cols = gguf_kernels.fused_weight(w)
    assert cols is not None and cols.max_rows == 8 and (cols.in_features, cols.out_features) == (64, 16)
    long_rows = gguf_kernels.random_blocks("Q8_0", 1, 32768 + 32, torch.Generator().manual_seed(0))
    assert gguf_kernels.fused_weight(long_rows) is None  # past the entry's stack of block sums
    with pytest.raises(ValueError, match="fused decode layers only"):
        native_kernels.gemv(torch.ones(1, 64), cols)


def test_no_compiler_means_fp32_weights_and_a_warning(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVBATCH_CACHE_DIR", str(tmp_path / "cache"))  # no library built earlier to find
    gguf_kernels._library.cache_clear()
    try:
        assert not gguf_kernels.available()
        assert "no C compiler" in gguf_kernels.unavailable_reason()
        ckpt = load_checkpoint(str(_tiny_gguf(tmp_path)))
        with pytest.warns(RuntimeWarning, match="native GGUF kernel is unavailable"):
            llm = LLM(ckpt, engine_config=EngineConfig(kv_cache_bytes=8 << 20, weights="gguf"))
        assert llm.model.kernel_choice.fmt.kind != GGUF
        assert not isinstance(llm.model.layers[0].qkv, GGUFWeight)  # the fp32 layouts, no blocks
        out = llm.generate([GenerationRequest("a", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                              prompt_token_ids=[1, 2, 3])])
        assert len(out[0].output_token_ids) == 3
    finally:
        gguf_kernels._library.cache_clear()


def test_broken_source_means_unavailable_with_the_compiler_message(tmp_path: Path, monkeypatch) -> None:
    if gguf_kernels.compiler() is None:
        pytest.skip("no C compiler here")
    bad = tmp_path / "gguf_kernels.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(gguf_kernels, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="failed"):
        gguf_kernels.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left to load


@needs_kernel
def test_the_build_is_cached_by_source_and_reused(tmp_path: Path, monkeypatch) -> None:
    first = gguf_kernels.build(tmp_path)
    compiles = []
    real_run = native_build.subprocess.run

    def counting_run(cmd, *args, **kwargs):
        if "-shared" in cmd:
            compiles.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", counting_run)
    assert gguf_kernels.build(tmp_path) == first and not compiles  # same key: loaded, not rebuilt
    changed = tmp_path / "gguf_kernels.c"
    changed.write_text(gguf_kernels.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(gguf_kernels, "SOURCE", changed)
    assert gguf_kernels.build(tmp_path) != first and len(compiles) == 1


def test_gguf_weights_refuse_what_they_cannot_run() -> None:
    shapes = [(64, 64)]
    with pytest.raises(ValueError, match="fp32"):
        choose_kernels(torch.bfloat16, shapes, weights="gguf", gguf_qtype="Q4_1")
    with pytest.raises(ValueError, match="batch-invariant"):
        choose_kernels(torch.float32, shapes, weights="gguf", gguf_qtype="Q4_1", batch_invariant=True)
    with pytest.raises(ValueError, match="picks a float kernel"):
        choose_kernels(torch.float32, shapes, weights="gguf", gguf_qtype="Q4_1", linear="blas")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        choice = choose_kernels(torch.float32, shapes, weights="gguf", gguf_qtype=None)
    assert choice.fmt.kind != GGUF and "holds no" in choice.note


def test_the_c_source_ships_in_the_package() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvbatch.kernels.cpu"]
    assert gguf_kernels.SOURCE.resolve() == (REPO / "kernels" / "cpu" / "gguf_kernels.c").resolve()
    assert gguf_kernels.SOURCE.is_file()
    assert any(fnmatch.fnmatch("gguf_kernels.c", pat) for pat in patterns)


@needs_kernel
def test_the_kernel_takes_the_widest_vector_path_it_is_built_for() -> None:
    march = os.environ.get("KVBATCH_NATIVE_MARCH", "").strip()
    if march:  # an older CPU's build (tests/test_native_isa_builds.py): the set the compiler gives -march
        cc = gguf_kernels.compiler()
        assert cc is not None
        macros = subprocess.run([cc, f"-march={march}", "-dM", "-E", "-x", "c", os.devnull], check=True,
                                capture_output=True, text=True, timeout=60).stdout.split()
        flags = {f for f, macro in (("avx2", "__AVX2__"), ("fma", "__FMA__"), ("f16c", "__F16C__"),
                                    ("avx512f", "__AVX512F__")) if macro in macros}
    else:  # -march=native: this CPU's own set
        flags = set(cpu_identity()[1])
    avx2 = {"avx2", "fma", "f16c"} <= flags
    want = "avx512" if avx2 and "avx512f" in flags else "avx2" if avx2 else "c"
    assert gguf_kernels.simd() == want
    assert gguf_kernels.identity().endswith(f"-{want}")  # a measurement of another path is not reused
