"""Mixture-of-experts models: routing, the grouped expert GEMMs and whole models against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvbatch.engine.models.config import ModelConfig, MoEConfig
from kvbatch.engine.models.moe import (
    LocalExperts,
    MoELayerWeights,
    load_moe_layer,
    moe_forward,
    route,
)
from kvbatch.engine.models.weights import ModelLoadError, load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import dispatch, reference
from tests.logit_capture import assert_logits_match, capture_logits
from tests.tiny_models import HOT_EXPERTS, MOE_ARCHS, NUM_EXPERTS, VOCAB, build_tiny_moe, edit_weights

torch.set_num_threads(1)


def _prompts(seed: int = 1) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=g).tolist() for i, n in enumerate([5, 17, 9])}


def _greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------- whole models


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("budget", [4096, 7])  # 7: prompts are prefilled in several chunks
def test_logits_match_transformers(tmp_path, arch, budget):
    ref = build_tiny_moe(arch, tmp_path)
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=budget))
    seen = capture_logits(llm)
    prompts = _prompts()
    reqs = [GenerationRequest(rid, _greedy(), prompt_token_ids=p) for rid, p in prompts.items()]
    results = {r.request_id: r for r in llm.generate(reqs)}
    for rid, prompt in prompts.items():
        with torch.no_grad():
            hf_tokens = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                     pad_token_id=0)[0, len(prompt):].tolist()
        assert results[rid].output_token_ids == hf_tokens, f"{arch}: greedy tokens differ for {rid}"
        assert len(hf_tokens) == 6
        assert_logits_match(ref, seen, rid, prompt, results[rid].output_token_ids, arch)


def _fused_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's per-expert tensors rewritten as transformers 5 keeps them in memory."""
    out, experts = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            layer = ".".join(parts[:3])
            kind = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(parts[i + 2], "down")
            experts.setdefault(layer, {}).setdefault(kind, {})[int(parts[i + 1])] = t
        else:
            out[name.replace("block_sparse_moe.", "mlp.")] = t
    for layer, kinds in experts.items():
        n = len(kinds["gate"])
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate"][j], kinds["up"][j]]) for j in range(n)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([kinds["down"][j] for j in range(n)])
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_hub_and_fused_layouts_load_the_same(tmp_path, arch):
    """save_pretrained writes the hub's per-expert names (Mixtral's w1/w2/w3 under
    block_sparse_moe); a checkpoint with the fused [E, 2I, H] tensors loads to the same weights,
    fingerprint and tokens."""
    hub, fused = tmp_path / "hub", tmp_path / "fused"
    build_tiny_moe(arch, hub)
    saved = load_file(hub / "model.safetensors")
    expert_name = ("model.layers.0.block_sparse_moe.experts.3.w1.weight" if arch == "mixtral"
                   else "model.layers.0.mlp.experts.3.gate_proj.weight")
    assert expert_name in saved
    fused.mkdir()
    save_file(_fused_state(saved), fused / "model.safetensors", metadata={"format": "pt"})
    (fused / "config.json").write_text((hub / "config.json").read_text())
    a, b = load_checkpoint(str(hub)), load_checkpoint(str(fused))
    assert a.tensors.keys() == b.tensors.keys()
    assert a.fingerprint == b.fingerprint
    reqs = [GenerationRequest(rid, _greedy(), prompt_token_ids=p) for rid, p in _prompts().items()]
    out_a = [r.output_token_ids for r in LLM(a).generate(reqs)]
    out_b = [r.output_token_ids for r in LLM(b).generate(reqs)]
    assert out_a == out_b


def test_missing_expert_is_a_load_error(tmp_path):
    build_tiny_moe("qwen2_moe", tmp_path)
    edit_weights(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelLoadError, match="layers.2 has 8 experts but not every one has a up matrix"):
        load_checkpoint(str(tmp_path))


def test_missing_router_is_a_load_error(tmp_path):
    build_tiny_moe("mixtral", tmp_path)
    edit_weights(tmp_path, lambda t: t.pop("model.layers.1.block_sparse_moe.gate.weight"))
    with pytest.raises(ModelLoadError, match="missing 1 weight"):
        load_checkpoint(str(tmp_path))


def test_model_hooks(tmp_path):
    """Observers see every MoE layer's choices; a replacement expert_compute is what runs; the
    dense layer of Qwen3 (mlp_only_layers) is not a MoE layer."""
    build_tiny_moe("qwen3_moe", tmp_path)
    reqs = [GenerationRequest(rid, _greedy(4), prompt_token_ids=p) for rid, p in _prompts().items()]
    plain_llm = LLM(str(tmp_path))
    plain_logits = capture_logits(plain_llm)
    plain = [r.output_token_ids for r in plain_llm.generate(reqs)]

    llm = LLM(str(tmp_path))
    model = llm.model
    assert sorted(model.moe_layers) == [0, 2]
    seen: list[tuple[int, tuple[int, ...]]] = []
    model.routing_observers.append(lambda layer, ids: seen.append((layer, tuple(ids.shape))))
    calls: list[int] = []
    local = model.expert_compute

    def counting(layer_idx, x, ids, weights):
        calls.append(layer_idx)
        return local(layer_idx, x, ids, weights)

    model.expert_compute = counting
    assert [r.output_token_ids for r in llm.generate(reqs)] == plain
    assert {layer for layer, _ in seen} == {0, 2}
    assert [layer for layer, _ in seen] == calls
    assert all(shape[1] == 2 for _, shape in seen)
    # Every prompt token once, then one token per decode step (3 sequences, 3 steps after the first).
    assert sum(shape[0] for layer, shape in seen if layer == 0) == sum(map(len, _prompts().values())) + 3 * 3

    # An expert_compute that drops the routed experts is what runs: the logits move.
    dropped = LLM(str(tmp_path))
    dropped.model.expert_compute = lambda layer_idx, x, ids, weights: torch.zeros_like(x)
    dropped_logits = capture_logits(dropped)
    dropped.generate(reqs[:1])
    assert (dropped_logits[0][1] - plain_logits[0][1]).abs().max() > 1e-3


def test_skew_sends_tokens_to_the_hot_experts(tmp_path):
    def hot_share(skew: float) -> float:
        folder = tmp_path / f"skew{skew}"
        build_tiny_moe("mixtral", folder, skew=skew)
        llm = LLM(str(folder))
        counts = torch.zeros(NUM_EXPERTS)
        llm.model.routing_observers.append(
            lambda layer, ids: counts.add_(torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS)))
        llm.generate([GenerationRequest(rid, _greedy(4), prompt_token_ids=p) for rid, p in _prompts().items()])
        return float(counts[list(HOT_EXPERTS)].sum() / counts.sum())

    even, skewed = hot_share(0.0), hot_share(4.0)
    assert even < 0.45  # 2 of 8 experts: 25% when balanced
    assert skewed > 0.8


def test_bf16_runs_and_mostly_agrees(tmp_path):
    build_tiny_moe("qwen2_moe", tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    reqs = [GenerationRequest(rid, _greedy(4), prompt_token_ids=p) for rid, p in _prompts().items()]
    fp32 = [r.output_token_ids for r in LLM(ckpt).generate(reqs)]
    bf16 = [r.output_token_ids for r in LLM(ckpt, dtype="bf16").generate(reqs)]
    assert sum(a[0] == b[0] for a, b in zip(fp32, bf16)) >= 2
    assert all(0 <= t < VOCAB for out in bf16 for t in out)


# ---------------------------------------------------------------- routing and MoE blocks


def _hf_moe_block(family: str, seed: int, **overrides):
    """(transformers' sparse MoE block with random weights, our MoEConfig) for ``family``."""
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    common = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(cfg)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, moe_intermediate_size=16, shared_expert_intermediate_size=40,
                                num_experts=8, num_experts_per_tok=3, norm_topk_prob=overrides.get("norm", False))
        block = Qwen2MoeSparseMoeBlock(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=overrides.get("norm", True))
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        cfg = tf.DeepseekV3Config(**common, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                                  n_group=overrides.get("n_group", 4), topk_group=overrides.get("topk_group", 2),
                                  routed_scaling_factor=2.5, norm_topk_prob=overrides.get("norm", True),
                                  n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None)
        block = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        if family == "deepseek_v3":  # a bias large enough to change which experts win
            block.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.3)
    cfg_dict = cfg.to_dict()
    cfg_dict["model_type"] = family
    return block.eval(), MoEConfig.from_hf(cfg_dict)


FAMILIES = [("mixtral", {}), ("qwen2_moe", {}), ("qwen2_moe", {"norm": True}), ("qwen3_moe", {}),
            ("qwen3_moe", {"norm": False}), ("deepseek_v3", {}), ("deepseek_v3", {"norm": False}),
            ("deepseek_v3", {"n_group": 1, "topk_group": 1}), ("deepseek_v3", {"n_group": 8, "topk_group": 3})]


@pytest.mark.parametrize("family,overrides", FAMILIES)
def test_routing_matches_transformers(family, overrides):
    block, cfg = _hf_moe_block(family, seed=3, **overrides)
    layer = load_moe_layer(block.state_dict(), "", cfg, torch.float32)
    x = torch.randn(64, 32)
    with torch.no_grad():
        _, want_w, want_ids = block.gate(x)
    ids, w = route(x, layer, cfg)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (64, cfg.top_k)
    # DeepSeek's top-k is unsorted: compare per token as (id -> weight) maps.
    order, want_order = ids.argsort(dim=1), want_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(w.gather(1, order), want_w.float().gather(1, want_order), atol=1e-6, rtol=1e-5)
    if family == "deepseek_v3" and overrides.get("norm", True):
        torch.testing.assert_close(w.sum(1), torch.full((64,), 2.5))


@pytest.mark.parametrize("family,overrides", FAMILIES)
def test_moe_block_matches_transformers(family, overrides):
    """route + routed experts + shared expert (Qwen2's gated, DeepSeek's plain) == the HF block."""
    block, cfg = _hf_moe_block(family, seed=5, **overrides)
    layer = load_moe_layer(block.state_dict(), "", cfg, torch.float32)
    assert (layer.shared_gate_up is not None) == (family in ("qwen2_moe", "deepseek_v3"))
    assert (layer.shared_gate is not None) == (family == "qwen2_moe")
    x = torch.randn(1, 37, 32)
    with torch.no_grad():
        want = block(x)[0]
    got = moe_forward(x[0], layer, cfg, layer_idx=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The same through the hook object the model uses by default.
    seen = []
    via_hook = moe_forward(x[0], layer, cfg, 7, LocalExperts({7: layer}), [lambda i, ids: seen.append(i)])
    torch.testing.assert_close(via_hook, got, atol=0, rtol=0)
    assert seen == [7]


def test_deepseek_correction_bias_steers_selection_only():
    """A huge bias on one expert makes every token pick it, yet its weight is its un-biased score."""
    block, cfg = _hf_moe_block("deepseek_v3", seed=1, n_group=1, topk_group=1, norm=False)
    layer = load_moe_layer(block.state_dict(), "", cfg, torch.float32)
    layer.correction_bias = torch.zeros(16)
    layer.correction_bias[11] = 100.0
    x = torch.randn(20, 32)
    ids, w = route(x, layer, cfg)
    assert bool((ids == 11).any(dim=1).all())
    scores = torch.sigmoid(x @ layer.router.t())
    torch.testing.assert_close(w, scores.gather(1, ids) * 2.5)


def test_deepseek_group_limit():
    """With topk_group of n_group groups allowed, every choice falls inside at most topk_group groups."""
    block, cfg = _hf_moe_block("deepseek_v3", seed=2, n_group=4, topk_group=1)
    layer = load_moe_layer(block.state_dict(), "", cfg, torch.float32)
    ids, _ = route(torch.randn(50, 32), layer, cfg)
    groups = ids // (16 // 4)
    assert bool((groups == groups[:, :1]).all())


def test_moe_config_from_hub_configs():
    mixtral = MoEConfig.from_hf({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "intermediate_size": 14336})
    assert (mixtral.num_experts, mixtral.top_k, mixtral.moe_intermediate_size) == (8, 2, 14336)
    qwen3 = MoEConfig.from_hf({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
                               "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 2,
                               "mlp_only_layers": [0]})
    assert [qwen3.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    ds = MoEConfig.from_hf({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                            "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "scoring_func": "sigmoid",
                            "topk_method": "noaux_tc", "norm_topk_prob": True})
    assert (ds.scoring, ds.n_group, ds.topk_group, ds.shared_expert_intermediate_size) == ("sigmoid", 8, 4, 2048)
    assert [ds.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert MoEConfig.from_hf({"model_type": "llama"}) is None
    mc = ModelConfig.from_hf({"model_type": "qwen2_moe", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 4,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 4,
                              "shared_expert_intermediate_size": 8})
    assert mc.attention_bias and mc.moe.shared_expert_gate and not mc.qk_norm


# ---------------------------------------------------------------- fused_moe


def _naive_moe(x, w_gate_up, w_down, ids, weights):
    """Token by token, choice by choice: the definition."""
    E, two_i, _ = w_gate_up.shape
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            g = w_gate_up[e].double() @ x[t].double()
            h = F.silu(g[: two_i // 2]) * g[two_i // 2:]
            out[t] += float(weights[t, j]) * (w_down[e].double() @ h)
    return out


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 12), E=st.integers(1, 6), k=st.integers(1, 3), H=st.integers(1, 9), I=st.integers(1, 7),
       seed=st.integers(0, 2**16), invalid=st.booleans())
def test_fused_moe_matches_per_token_loop(T, E, k, H, I, seed, invalid):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g)
    w_down = torch.randn(E, H, I, generator=g)
    # Repeats allowed (the kernel must not assume distinct choices); -1 / E mark remote experts.
    ids = torch.randint(-1 if invalid else 0, E + 1 if invalid else E, (T, k), generator=g)
    weights = torch.rand(T, k, generator=g)
    want = _naive_moe(x, w_gate_up, w_down, ids, weights)
    for impl in (reference.fused_moe, dispatch.fused_moe):
        got = impl(x, w_gate_up, w_down, ids, weights)
        assert got.shape == (T, H) and got.dtype == x.dtype
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_fused_moe_runs_one_gemm_per_used_expert(monkeypatch):
    calls = []
    real = F.linear
    monkeypatch.setattr(reference.F, "linear", lambda a, w, b=None: calls.append(a.shape[0]) or real(a, w, b))
    x = torch.randn(6, 4)
    ids = torch.tensor([[0, 3], [3, 0], [0, 3], [3, 3], [0, 0], [3, 0]])
    reference.fused_moe(x, torch.randn(5, 6, 4), torch.randn(5, 4, 3), ids, torch.ones(6, 2))
    assert calls == [6, 6, 6, 6]  # experts 0 and 3: a gate/up and a down GEMM each, all their rows at once


def test_fused_moe_bf16_accumulates_in_fp32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g)
    w1, w2 = torch.randn(4, 8, 16, generator=g), torch.randn(4, 16, 4, generator=g)
    ids, w = torch.randint(0, 4, (5, 2), generator=g), torch.rand(5, 2, generator=g)
    got = reference.fused_moe(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), ids, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference.fused_moe(x, w1, w2, ids, w), atol=0.5, rtol=0.05)


def test_moe_layer_weights_shape_check():
    cfg = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=3)
    tensors = {"gate.weight": torch.randn(4, 5), "experts.gate_up_proj": torch.randn(4, 6, 5),
               "experts.down_proj": torch.randn(4, 5, 2)}
    with pytest.raises(ValueError, match=r"experts.down_proj has shape \(4, 5, 2\)"):
        load_moe_layer(tensors, "", cfg, torch.float32)
    tensors["experts.down_proj"] = torch.randn(4, 5, 3)
    layer = load_moe_layer(tensors, "", cfg, torch.bfloat16)
    assert isinstance(layer, MoELayerWeights) and layer.num_experts == 4
    assert layer.router.dtype == torch.float32 and layer.w_gate_up.dtype == torch.bfloat16


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_deepseek_checkpoint_loads_for_its_moe_layers(tmp_path, q_lora_rank):
    """A saved DeepSeek-V3 (per-expert hub names) loads with its experts fused; layer 0 is dense
    (first_k_dense_replace), layer 1's MoE equals transformers' on the same input."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                              topk_group=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=q_lora_rank,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)
    model = tf.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name:
                p.copy_(torch.randn_like(p) * 0.3)
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    moe = MoEConfig.from_hf(ckpt.config)
    assert [moe.is_moe_layer(i) for i in range(2)] == [False, True]
    assert "model.layers.1.mlp.experts.gate_up_proj" in ckpt.tensors
    assert not any(".experts.0." in name for name in ckpt.tensors)
    layer = load_moe_layer(ckpt.tensors, "model.layers.1.mlp.", moe, torch.float32)
    x = torch.randn(1, 11, 32)
    with torch.no_grad():
        want = model.model.layers[1].mlp(x)[0]
    torch.testing.assert_close(moe_forward(x[0], layer, moe, 1), want, atol=1e-5, rtol=1e-5)
    # A missing correction bias is caught at load, not at the first forward pass.
    edit_weights(tmp_path, lambda t: t.pop("model.layers.1.mlp.gate.e_score_correction_bias"))
    with pytest.raises(ModelLoadError, match="e_score_correction_bias"):
        load_checkpoint(str(tmp_path))


def _build_any_moe(arch: str, folder) -> None:
    if arch == "deepseek_v3":
        from tests.tiny_deepseek import build_tiny_deepseek

        build_tiny_deepseek(folder, "moe")
    else:
        build_tiny_moe(arch, folder)


@pytest.mark.parametrize("arch", [*MOE_ARCHS, "deepseek_v3"])
def test_batch_invariant_mode_is_refused_for_every_moe_architecture(tmp_path, arch):
    from kvbatch.engine.models.errors import UnsupportedModelError

    _build_any_moe(arch, tmp_path)
    with pytest.raises(UnsupportedModelError, match="batch-invariant.*mixture-of-experts"):
        LLM(str(tmp_path), engine_config=EngineConfig(batch_invariant=True, num_blocks=8))
    # The same model without the mode loads (the refusal is about the mode, not the model).
    assert LLM(str(tmp_path), engine_config=EngineConfig(num_blocks=8)).model.moe_layers


def test_batch_invariant_mode_is_accepted_for_deepseek_without_moe_layers(tmp_path):
    """A DeepSeek-V3 config whose layers are all dense (first_k_dense_replace = layers) runs
    only dense GEMMs, which the mode pads: it is accepted."""
    from tests.tiny_deepseek import build_tiny_deepseek

    build_tiny_deepseek(tmp_path, "dense")
    llm = LLM(str(tmp_path), engine_config=EngineConfig(batch_invariant=True, num_blocks=8))
    assert llm.model_config.moe is not None and not llm.model.moe_layers and llm.model.batch_invariant


def test_cli_deterministic_refuses_a_moe_model_in_one_line(tmp_path, capsys):
    import json

    from kvbatch.cli.main import main

    build_tiny_moe("qwen2_moe", tmp_path / "model")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    capsys.readouterr()  # the build's own progress output
    code = main(["generate", "--model", str(tmp_path / "model"), "--input", str(src),
                 "--output", str(tmp_path / "out.jsonl"), "--deterministic", "--no-progress"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2
    assert len(err) == 1 and "batch-invariant" in err[0] and "mixture-of-experts" in err[0], err
    assert not (tmp_path / "out.jsonl").exists()


def test_experts_of_different_shapes_are_a_load_error(tmp_path):
    build_tiny_moe("qwen3_moe", tmp_path)
    edit_weights(tmp_path, lambda t: t.update({"model.layers.0.mlp.experts.4.down_proj.weight": torch.zeros(64, 31)}))
    with pytest.raises(ModelLoadError, match="layers.0's expert matrices disagree in shape"):
        load_checkpoint(str(tmp_path))
