"""The lean small-op path of a decode step (issue 18): the same bits as the per-tensor ops it
replaces, in fewer ops, and never on the batch-invariant path.

The counts asserted here are what docs/perf-log/2026-12-01.md ("Fewer small ops per decode layer") states: the
top-level aten ops one layer of a batch-1 decode step runs outside its projections and its
attention (those two are wrapped in a profiler range here, so their own ops are not counted).

Every test here runs the PyTorch kernels (``KVBATCH_KERNELS=reference``): the native CPU kernels
that replace them on fp32 CPU tensors compute in another order and are pinned by
``tests/test_cpu_native.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.bench_small_ops import top_level_ops
from kvbatch.engine.models import llama as llama_module
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.model_runner import WorkItem
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch
from kvbatch.kernels import reference as R
from kvbatch.kernels.cpu.linear import LinearFormat
from tests.logit_capture import full_head
from tests.tiny_models import VOCAB, build_tiny, build_tiny_moe

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Top-level ops per layer of a batch-1 decode step outside the projections and the attention
# (docs/perf-log/2026-12-01.md): the per-tensor path (KVBATCH_LEAN_OPS=0) and the lean one.
OPS_PER_LAYER_BEFORE = 67
OPS_PER_LAYER_AFTER = 18


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


# ------------------------------------------------------------------------- the kernels, bit for bit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(0, 576), (1, 576), (3, 576), (2, 64), (5, 100), (1, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_is_rms_norm_bit_for_bit_and_hands_x_over(dtype, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = _randn(gen, rows, hidden, dtype=dtype) * 3
    weight = _randn(gen, hidden, dtype=dtype)
    residual = _randn(gen, rows, hidden, dtype=dtype) if with_residual else None
    expected = R.rms_norm(x.clone(), weight, 1e-5, residual)
    normed, new_residual = R.add_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(normed, expected[0]) and torch.equal(new_residual, expected[1])
    assert new_residual is x  # the sum went into x's memory: no new tensor


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 4])
@pytest.mark.parametrize("Hkv,group,D", [(3, 3, 64), (2, 2, 8), (1, 4, 32)])
def test_rotate_qk_is_apply_rotary_bit_for_bit_in_place(dtype, T, Hkv, group, D):
    gen = torch.Generator().manual_seed(T * 7 + D)
    Hq = group * Hkv
    qkv = _randn(gen, T, (Hq + 2 * Hkv) * D, dtype=dtype)
    positions = torch.randint(0, 300, (T,), generator=gen)
    angles = torch.rand(300, D // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    expected_q, expected_k = R.apply_rotary(q, k, positions, cos_sin)
    fresh = qkv.clone()  # for the dispatch call below
    v_before = qkv[:, (Hq + Hkv) * D:].clone()
    qk = qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D)  # a strided view when T > 1
    assert R.rotate_qk(qk, R.rotary_table(positions, cos_sin)) is qk
    assert torch.equal(qk[:, :Hq], expected_q) and torch.equal(qk[:, Hq:], expected_k)
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], v_before)  # V untouched
    # Through dispatch, without a table (it builds one).
    qk2 = fresh[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D)
    dispatch.rotate_qk(qk2, Hq, positions, cos_sin, None)
    assert torch.equal(qk2, qk)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
@pytest.mark.parametrize("T", [0, 1, 5])
def test_store_kv_layer_is_store_kv_bit_for_bit(dtypes, T):
    src_dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(T)
    layer = _randn(gen, 2, 4, 3, 2, 8, dtype=cache_dtype)  # [K/V, blocks, block_size, Hkv, D]
    slots = torch.randperm(12, generator=gen)[:T]
    qkv = _randn(gen, T, (4 + 2 * 2) * 8, dtype=src_dtype)
    kv = qkv[:, 4 * 8:].view(T, 2, 2, 8)  # a strided view of the fused output, as the model has it
    expected = layer.clone()
    R.store_kv(kv[:, 0], kv[:, 1], expected[0], expected[1], slots)
    R.store_kv_layer(kv, layer, slots)
    assert torch.equal(layer, expected)
    held = R.slot_major(layer)
    again = _randn(gen, T, 2, 2, 8, dtype=src_dtype)
    R.store_kv(again[:, 0], again[:, 1], expected[0], expected[1], slots)
    dispatch.store_kv_layer(again, layer, slots, held)
    assert torch.equal(layer, expected)


def test_silu_and_mul_keeps_its_bits():
    gen = torch.Generator().manual_seed(3)
    x = _randn(gen, 3, 2 * 96)
    assert torch.equal(R.silu_and_mul(x), torch.nn.functional.silu(x[:, :96]) * x[:, 96:])


# ------------------------------------------------------------------------- the engine


def _llm(folder: Path, lean: str, monkeypatch: pytest.MonkeyPatch, **config: object) -> LLM:
    monkeypatch.setenv("KVBATCH_LEAN_OPS", lean)
    return LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=128, **config))


def _tokens_and_logits(llm: LLM, n: int = 3) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of ``n`` requests decoded together (prefill chunks and decode rows in one
    step, then batched decode), and every step's logits (the full head's: :func:`full_head`)."""
    full_head(llm)
    seen: list[torch.Tensor] = []
    execute = llm.runner.execute

    def spy(step):
        logits, sampled = execute(step)
        seen.append(logits.clone())
        return logits, sampled

    llm.runner.execute = spy
    prompts = [torch.randint(3, VOCAB, (5 + 7 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(n)]
    reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                              prompt_token_ids=p) for i, p in enumerate(prompts)]
    return [r.output_token_ids for r in llm.generate(reqs)], seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_lean_path_gives_the_same_logits_bit_for_bit(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")
    (build_tiny_moe if arch == "qwen3_moe" else build_tiny)(arch, tmp_path / arch)
    for n in (1, 3):  # batch 1 (one-row steps), and prefill and decode rows mixed then batched
        lean = _tokens_and_logits(_llm(tmp_path / arch, "1", monkeypatch), n)
        legacy = _tokens_and_logits(_llm(tmp_path / arch, "0", monkeypatch), n)
        assert lean[0] == legacy[0]
        assert len(lean[1]) == len(legacy[1]) > 1
        assert all(torch.equal(a, b) for a, b in zip(lean[1], legacy[1]))


def test_batch_invariant_mode_never_takes_the_lean_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")
    build_tiny("llama", tmp_path / "m")
    llm = _llm(tmp_path / "m", "1", monkeypatch, batch_invariant=True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the batch-invariant path called a lean kernel")

    for name in ("add_rms_norm", "rotary_table", "rotate_qk", "store_kv_layer", "rotate_and_store", "decode_layers"):
        monkeypatch.setattr(dispatch, name, refuse)
    tokens, logits = _tokens_and_logits(llm)
    assert all(len(t) == 6 for t in tokens) and logits


def test_the_switch_reads_0_and_1_and_refuses_the_rest(monkeypatch):
    monkeypatch.setenv("KVBATCH_LEAN_OPS", "0")
    assert not llama_module.lean_ops_enabled()
    monkeypatch.delenv("KVBATCH_LEAN_OPS")
    assert llama_module.lean_ops_enabled()
    monkeypatch.setenv("KVBATCH_LEAN_OPS", "fast")
    with pytest.raises(ValueError, match="KVBATCH_LEAN_OPS"):
        llama_module.lean_ops_enabled()


@contextlib.contextmanager
def _uncounted_projections_and_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The projections' and the attention's own ops under a profiler range, so that
    :func:`top_level_ops` counts only what lies around them."""
    from torch.profiler import record_function

    def hidden(fn, label):
        def run(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(LinearFormat, "__call__", hidden(LinearFormat.__call__, "projection"))
    monkeypatch.setattr(dispatch, "paged_decode_attention", hidden(dispatch.paged_decode_attention, "attention"))
    monkeypatch.setattr(dispatch, "plan_decode", hidden(dispatch.plan_decode, "attention plan"))
    yield


def _ops_per_layer(llm: LLM) -> int:
    """Top-level ops of one more layer in a batch-1 decode step (forward over 2 layers minus 1)."""
    runner = llm.runner
    table = [1, 2, 3]
    with torch.inference_mode():
        runner.run([WorkItem(list(range(3, 10)), 0, table, 1)])
        ids, batch, _ = runner.build([WorkItem([5], 7, table, 1)])

        def count(layers: int) -> int:
            return sum(top_level_ops(lambda: runner.model.forward(ids, batch, runner.kv_cache, layers)).values())

        return count(2) - count(1)


def test_a_decode_layer_runs_fewer_small_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")
    build_tiny("llama", tmp_path / "m")
    before = _llm(tmp_path / "m", "0", monkeypatch)
    after = _llm(tmp_path / "m", "1", monkeypatch)
    with _uncounted_projections_and_attention(monkeypatch):
        assert _ops_per_layer(before) == OPS_PER_LAYER_BEFORE
        assert _ops_per_layer(after) == OPS_PER_LAYER_AFTER
