"""gpt-oss's experts in the Triton fused MoE kernel (``kernels/triton_moe.py``): expert biases
(``gate_up_bias`` [E, 2I], ``down_bias`` [E, H]) and the clamped SwiGLU ``swiglu=(alpha, limit)``
(``g = gate.clamp(max=limit)``, ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)``).

They run in the Triton interpreter against ``reference.fused_moe`` with the tolerances of the plain
MoE tests (``tests/test_kernels_moe_mla_verify.py``: fp32 1e-4 / 1e-4, 16-bit 2e-2 / 2e-2; 16-bit
inputs against the twin on the same values upcast to fp32). The biases are large enough that the
clamp bites on both sides (checked, not assumed), with small limits where 16-bit outputs must stay
O(1) for those tolerances and gpt-oss's own (1.702, 7.0) in fp32.

The sm_90 compilation of the biased variants runs in a subprocess without ``TRITON_INTERPRET``:
``test_the_biased_moe_variants_compile_for_sm90``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (DTYPES, KERNELS, REPO, compiled_pairs,  # isort: skip
                                      assert_close, fresh_process_only, interpreter_only, interpreter_settings,
                                      rerun_in_fresh_interpreter, randn, use_triton)  # noqa: F401 (fixture)
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R

needs_interpreter = interpreter_only("test_moe_bias_in_a_fresh_process")

MOE_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (2e-2, 2e-2)}
GPT_OSS = (1.702, 7.0)


def inputs(gen, T, H, I, E, k, dtype, bias_scale, id_low=0, id_high=None):
    """x, weights (outputs O(1) before the biases), ids from ``id_low .. id_high - 1``, routing
    weights, and biases of ``bias_scale`` (the gate/up pre-activations are about N(0, 1 + scale^2))."""
    x = randn(gen, T, H, dtype=dtype)
    w_gate_up = (randn(gen, E, 2 * I, H) * H**-0.5).to(dtype)
    w_down = (randn(gen, E, H, I) * I**-0.5).to(dtype)
    ids = torch.randint(id_low, E if id_high is None else id_high, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    gate_up_bias = (randn(gen, E, 2 * I) * bias_scale).to(dtype)
    down_bias = randn(gen, E, H, dtype=dtype)
    return x, w_gate_up, w_down, ids, weights, gate_up_bias, down_bias


def expected(x, w_gate_up, w_down, ids, weights, *extra):
    """The twin; 16-bit inputs upcast first (the kernel computes in fp32 in the interpreter)."""
    if x.dtype == torch.float32:
        return R.fused_moe(x, w_gate_up, w_down, ids, weights, *extra)
    extra = [t.float() if isinstance(t, torch.Tensor) else t for t in extra]
    return R.fused_moe(x.float(), w_gate_up.float(), w_down.float(), ids, weights, *extra).to(x.dtype)


def clamp_bites(x, w_gate_up, ids, gate_up_bias, limit) -> bool:
    """Some routed gate above ``limit``, some up beyond ``±limit`` and some within: every branch of the clamp."""
    ok = (ids >= 0) & (ids < w_gate_up.shape[0])
    t, j = ok.nonzero(as_tuple=True)
    e = ids[t, j]
    pre = torch.einsum("ph,pnh->pn", x[t].float(), w_gate_up[e].float()) + gate_up_bias[e].float()
    gate, up = pre.chunk(2, dim=1)
    return bool((gate > limit).any() and (up.abs() > limit).any() and (up.abs() < limit).any())


def check(x, w_gate_up, w_down, ids, weights, gate_up_bias, down_bias, swiglu, **tiles):
    want = expected(x, w_gate_up, w_down, ids, weights, gate_up_bias, down_bias, swiglu)
    with pytest.MonkeyPatch.context() as mp:  # hypothesis tests cannot take the fixture
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("KVBATCH_KERNELS", "triton")
        if tiles:
            got = KERNELS.fused_moe(x, w_gate_up, w_down, ids, weights, gate_up_bias, down_bias, swiglu, **tiles)
        else:
            got = dispatch.fused_moe(x, w_gate_up, w_down, ids, weights, gate_up_bias=gate_up_bias,
                                     down_bias=down_bias, swiglu=swiglu)
    assert_close(got, want, MOE_TOL[x.dtype])
    return got


@needs_interpreter
@interpreter_settings(25)
@given(
    T=st.integers(1, 6),
    H=st.sampled_from([16, 24, 40]),
    I=st.sampled_from([8, 16, 20]),
    E=st.integers(1, 5),
    k=st.integers(1, 3),
    dtype=st.sampled_from(DTYPES),
    out_of_range=st.booleans(),
    block_m=st.sampled_from([16, 32]),
    parts=st.sampled_from(["all", "gate_up_bias", "down_bias", "swiglu"]),
    limit=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_biased_clamped_moe_matches_reference(T, H, I, E, k, dtype, out_of_range, block_m, parts, limit, seed):
    """Each of the three gpt-oss parts alone and all together; limits of 0.5-2 clamp often."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-2, E + 2) if out_of_range else (0, E)
    x, wgu, wd, ids, w, gub, db = inputs(gen, T, H, I, E, k, dtype, 1.5, lo, hi)
    gub = gub if parts in ("all", "gate_up_bias") else None
    db = db if parts in ("all", "down_bias") else None
    swiglu = (1.702, limit) if parts in ("all", "swiglu") else None
    check(x, wgu, wd, ids, w, gub, db, swiglu, block_m=block_m)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_clamp_bites_and_still_matches(use_triton, dtype):
    """Several row blocks per expert and K steps in both GEMMs (21 tokens x 2 choices over 3 experts,
    H 80, I 40), through the dispatch point, with the clamp checked to bite on every side."""
    gen = torch.Generator().manual_seed(11)
    x, wgu, wd, ids, w, gub, db = inputs(gen, 21, 80, 40, 3, 2, dtype, 2.0)
    assert clamp_bites(x, wgu, ids, gub, 1.0)
    check(x, wgu, wd, ids, w, gub, db, (1.702, 1.0))


@needs_interpreter
def test_gpt_oss_constants_edges_and_strided_biases(use_triton):
    """gpt-oss's (1.702, 7.0) with biases big enough to pass 7 (fp32), dropped ids and unused experts,
    bias views with non-unit strides, and zeros when every id is out of range."""
    gen = torch.Generator().manual_seed(12)
    x, wgu, wd, ids, w, gub, db = inputs(gen, 9, 24, 16, 6, 3, torch.float32, 6.0)
    assert clamp_bites(x, wgu, ids, gub, GPT_OSS[1])
    check(x, wgu, wd, ids, w, gub, db, GPT_OSS)
    ids = torch.tensor([[0, 4, -1]] * 9)  # experts 1-3, 5 idle; one choice on another rank
    check(x, wgu, wd, ids, w, gub, db, GPT_OSS)
    wide_gub, wide_db = randn(gen, 6, 4 * 16) * 6, randn(gen, 12, 24)
    check(x, wgu, wd, ids, w, wide_gub[:, ::2], wide_db[::2], GPT_OSS)
    out = check(x, wgu, wd, torch.tensor([[-1, 6, 7]] * 9), w, gub, db, GPT_OSS)
    assert torch.all(out == 0)


@needs_interpreter
def test_dispatch_routes_biased_experts(monkeypatch):
    """``KVBATCH_KERNELS=triton`` (the CUDA route) runs the Triton kernel with the biases and the
    SwiGLU passed on; the CPU's default route is the reference, bit for bit."""
    gen = torch.Generator().manual_seed(13)
    x, wgu, wd, ids, w, gub, db = inputs(gen, 4, 16, 8, 3, 2, torch.float32, 2.0)
    kernel, seen = KERNELS.fused_moe, []

    def spy(*args, **kwargs):
        seen.append(args[5:8])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(KERNELS, "fused_moe", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    got = dispatch.fused_moe(x, wgu, wd, ids, w, gate_up_bias=gub, down_bias=db, swiglu=GPT_OSS)
    assert len(seen) == 1 and seen[0][0] is gub and seen[0][1] is db and seen[0][2] == GPT_OSS
    want = R.fused_moe(x, wgu, wd, ids, w, gub, db, GPT_OSS)
    assert_close(got, want, MOE_TOL[torch.float32])
    monkeypatch.setenv("KVBATCH_KERNELS", "auto")
    assert torch.equal(dispatch.fused_moe(x, wgu, wd, ids, w, gate_up_bias=gub, down_bias=db, swiglu=GPT_OSS), want)
    assert len(seen) == 1


@needs_interpreter
def test_bias_shapes_are_checked(use_triton):
    gen = torch.Generator().manual_seed(14)
    x, wgu, wd, ids, w, gub, db = inputs(gen, 3, 16, 8, 2, 1, torch.float32, 1.0)
    with pytest.raises(ValueError, match=r"gate_up_bias \(2, 8\), expected \(2, 16\)"):
        KERNELS.fused_moe(x, wgu, wd, ids, w, gub[:, :8], db, GPT_OSS)
    with pytest.raises(ValueError, match=r"down_bias \(16,\), expected \(2, 16\)"):
        KERNELS.fused_moe(x, wgu, wd, ids, w, gub, db[0], GPT_OSS)


@needs_interpreter
def test_benchmark_case_with_gpt_oss_experts_runs_on_cpu(use_triton, monkeypatch):
    """``gpu_cases.moe_case(gpt_oss=True)`` (the GPU check's biased case) builds and checks on the CPU."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_kernels as G
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(G.gpu_cases, "DEVICE", "cpu")
    ok, err = G.moe_case(G.import_kernels(), 6, 32, 16, 4, 2, torch.float32, gpt_oss=True)[2]()
    assert ok, err


# gpt-oss-20b's biased expert variants in gpu_compile's enumeration, one tile each of the gate/up and
# down kernels in bf16, compiled for sm_90 with HAS_BIAS / SWIGLU and without, in a subprocess.
COMPILE = r"""
import dataclasses, json, tempfile, gpu_compile as g
g._worker_init(tempfile.mkdtemp())
configs = g.configurations({"gpt-oss-20b": g.MODELS["gpt-oss-20b"]}, ("bf16",))
moe = [c for c in configs if c.kernel in ("_moe_gate_up_kernel", "_moe_down_kernel")]
assert moe and all(c.constexprs["HAS_BIAS"] for c in moe), moe
assert all(c.constexprs["SWIGLU"] for c in moe if c.kernel == "_moe_gate_up_kernel"), moe
plain = [c for c in g.configurations({"Qwen3-30B-A3B": g.MODELS["Qwen3-30B-A3B"]}, ("bf16",))
         if c.kernel in ("_moe_gate_up_kernel", "_moe_down_kernel")]
assert plain and not any(c.constexprs["HAS_BIAS"] or c.constexprs.get("SWIGLU") for c in plain), plain
picked = {}
for c in moe:
    picked.setdefault(c.kernel, c)
for c in picked.values():
    off = dict(c.constexprs, HAS_BIAS=False, **({"SWIGLU": False} if "SWIGLU" in c.constexprs else {}))
    print(json.dumps([g.compile_config(c, 90), g.compile_config(dataclasses.replace(c, constexprs=off), 90)]),
          flush=True)
"""


@pytest.mark.slow
def test_the_biased_moe_variants_compile_for_sm90():
    """The enumeration holds gpt-oss's biased variants (and plain models' plain ones); each compiles
    within an SM's shared memory with registers, and spills none where the plain variant spills none."""
    pairs = compiled_pairs(COMPILE)
    assert {r["kernel"] for r, _ in pairs} == {"_moe_gate_up_kernel", "_moe_down_kernel"}
    for biased, plain in pairs:
        assert "error" not in biased and "error" not in plain, (biased, plain)
        assert biased["config"]["HAS_BIAS"] is True, biased
        assert 0 < biased["shared_bytes"] <= 232448 and biased["registers"] > 0, biased
        assert plain["spills"] > 0 or biased["spills"] == 0, (biased, plain)


@fresh_process_only
def test_moe_bias_in_a_fresh_process():
    rerun_in_fresh_interpreter(__file__)
