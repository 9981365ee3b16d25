"""gpt-oss (``GptOssForCausalLM``) against transformers on tiny seeded checkpoints made here: attention
sinks, sliding (window 4) and full layers under prompts of 10-29 tokens, yarn rope, MoE with a
biased router and biased, clamped SwiGLU experts, and MXFP4 experts as published."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import save_file

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.expert_loading import load_expert_share
from kvbatch.engine.models.family import FAMILIES
from kvbatch.engine.models.llama import LlamaModel
from kvbatch.engine.models.mxfp4 import FP4_VALUES, dequantize_mxfp4
from kvbatch.engine.models.weights import ModelLoadError, load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.kernels import reference
from kvbatch.kernels.cpu import native
from tests.family_checks import check_speculation_keeps_reference, check_store_round_trip_and_prefix_hit, family_prompts
from tests.family_checks import greedy as _greedy
from tests.logit_capture import capture_logits
from tests.tiny_models import VOCAB, edit_weights

torch.set_num_threads(1)

WINDOW = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
# yarn stretching a 16-position original context by 4, ramp ends not rounded (gpt-oss's truncate: false)
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}


def gpt_oss_config(vocab: int = VOCAB, window: int = WINDOW, **extra):
    """A tiny gpt-oss config: 4 experts (top 2), swiglu_limit 1.5 so the clamp bites, head_dim 16; hidden
    and intermediate sizes multiples of 32 (MXFP4 groups)."""
    import transformers as tf

    return tf.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=window, layer_types=LAYER_TYPES, max_position_embeddings=256, rms_norm_eps=1e-5,
        swiglu_limit=1.5, rope_parameters=dict(YARN), bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)


def build_tiny_gpt_oss(folder: Path, seed: int = 0, vocab: int = VOCAB, **config):
    """Save a random gpt-oss model into ``folder``; returns the transformers model (eval, fp32). Every
    weight is drawn wide enough that routing, the clamp and the sinks decide the output."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(gpt_oss_config(vocab, **config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 1.5)
            elif "bias" in name:
                p.copy_(torch.randn_like(p) * 0.2)
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None  # the engine runs ignore_eos: transformers too, past token 2
    return model


def _prompts(seed: int = 1) -> dict[str, list[int]]:
    return family_prompts(VOCAB, seed)


def _engine_outputs(model, budget: int = 4096) -> tuple[dict[str, list[int]], list]:
    llm = LLM(model, engine_config=EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=budget))
    seen = capture_logits(llm)
    results = llm.generate([GenerationRequest(rid, _greedy(), prompt_token_ids=p) for rid, p in _prompts().items()])
    return {r.request_id: r.output_token_ids for r in results}, seen


def _assert_parity(ref, outputs: dict[str, list[int]], seen: list, label: str) -> float:
    """Greedy tokens equal transformers' generate, and every logits row its forward within 1e-4;
    returns the largest logit error."""
    worst = 0.0
    for rid, prompt in _prompts().items():
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
            logits = ref(torch.tensor([prompt + outputs[rid]])).logits[0]
        assert outputs[rid] == want, f"{label}: greedy tokens differ for {rid}"
        got = [row for r, row in seen if r == rid]
        assert len(got) == len(want)
        for i, row in enumerate(got):
            worst = max(worst, float((row - logits[len(prompt) - 1 + i]).abs().max()))
    assert worst < 1e-4, f"{label}: logits differ by {worst}"
    return worst


# 7: prompts are prefilled in several chunks; "reference": every attention through the PyTorch
# reference (decode rows of sliding layers as chunks of one token), "auto": decode through the
# native C kernel's sinks where it is built
@pytest.mark.parametrize("budget, kernels", [(4096, "auto"), (7, "auto"), (4096, "reference")])
def test_logits_match_transformers(tmp_path, monkeypatch, budget, kernels):
    monkeypatch.setenv("KVBATCH_KERNELS", kernels)
    ref = build_tiny_gpt_oss(tmp_path)
    outputs, seen = _engine_outputs(str(tmp_path), budget)
    worst = _assert_parity(ref, outputs, seen, f"gpt_oss budget {budget} {kernels}")
    print(f"gpt-oss max logit error (budget {budget}, {kernels}): {worst:.2e}")


def test_sinks_window_and_clamp_decide_the_output(tmp_path):
    """The same weights without sinks (-inf: no denominator term), with the window opened, or with
    the clamp lifted give other logits: the parity above would fail on an engine ignoring any."""
    build_tiny_gpt_oss(tmp_path / "m")
    ckpt = load_checkpoint(str(tmp_path / "m"))
    _, seen = _engine_outputs(ckpt)
    base = {rid: row for rid, row in reversed(seen)}  # each request's first row: its prompt's last token
    variants = {
        "no sinks": (dict(ckpt.config), {n: torch.full_like(t, -math.inf) if n.endswith("sinks") else t
                                         for n, t in ckpt.tensors.items()}),
        "open window": (dict(ckpt.config, sliding_window=256), ckpt.tensors),
        "no clamp": (dict(ckpt.config, swiglu_limit=1e4), ckpt.tensors),
    }
    for label, (config, tensors) in variants.items():
        (tmp_path / label).mkdir()
        (tmp_path / label / "config.json").write_text(json.dumps(config))
        save_file(_as_published(tensors), tmp_path / label / "model.safetensors")
        _, other = _engine_outputs(str(tmp_path / label))
        first = {rid: row for rid, row in reversed(other)}
        assert max(float((first[r] - base[r]).abs().max()) for r in base) > 1e-2, label


def _as_published(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's tensors back in the checkpoint's names and layouts (convert_gpt_oss undone)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            t = torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2)
        elif name.endswith("experts.gate_up_proj_bias"):
            gate, up = t.chunk(2, dim=1)
            t = torch.stack((gate, up), dim=2).flatten(1, 2)
        elif name.endswith("experts.down_proj"):
            t = t.transpose(1, 2)
        out[name.replace(".mlp.gate.", ".mlp.router.")] = t.contiguous()
    return out


def test_decode_from_the_kv_store_and_a_prefix_hit_equal_in_process_generate(tmp_path):
    build_tiny_gpt_oss(tmp_path / "m")
    cfg = {"block_size": 4, "num_blocks": 128, "max_num_seqs": 8}  # MoE: no batch-invariant mode
    check_store_round_trip_and_prefix_hit(load_checkpoint(str(tmp_path / "m")), (tmp_path / "kv").as_uri(), VOCAB,
                                          cfg, cfg)


@pytest.mark.parametrize("spec", ["ngram", "draft:self"])
def test_speculative_verification_keeps_transformers_tokens(tmp_path, spec):
    """Drafts verified in chunks of 1 + k tokens, with sinks, each over its window: greedy output unchanged."""
    check_speculation_keeps_reference(tmp_path, build_tiny_gpt_oss(tmp_path), VOCAB, spec)


def test_experts_go_through_the_expert_hook(tmp_path):
    """A rank's expert subset (select_experts) computes what the layer computes for those experts, and
    an ExpertCompute that does not declare it runs gpt-oss's experts is refused, not run as SiLU."""
    from kvbatch.engine.models.moe import moe_forward, route, run_experts

    build_tiny_gpt_oss(tmp_path)
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=32))
    model = llm.runner.model
    layer, cfg = model.moe_layers[1], model.config.moe
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    ids, weights = route(x, layer, cfg)
    full = run_experts(x, layer, ids, weights)
    rows = torch.tensor([3, 1, 0, 2])  # slot i holds expert rows[i]
    slot_of = torch.argsort(rows)
    torch.testing.assert_close(run_experts(x, layer.select_experts(rows), slot_of[ids], weights), full)
    seen = []
    model.routing_observers.append(lambda li, topk: seen.append(li))
    torch.testing.assert_close(moe_forward(x, layer, cfg, 1, model.expert_compute, model.routing_observers), full)
    assert seen == [1]

    def plain(layer_idx, x, topk_ids, topk_weights):  # an ExpertCompute that knows only SiLU experts
        return x

    with pytest.raises(UnsupportedModelError, match="clamped SwiGLU"):
        moe_forward(x, layer, cfg, 1, plain)
    from kvbatch.engine.parallel.expert_parallel import ExpertParallelCompute

    assert ExpertParallelCompute.runs_biased_experts  # docs/models.md: runs expert-parallel (the test below)
    # A rank's share (--workers): the kept experts' rows of the converted weights and biases, the
    # whole checkpoint's fingerprint (every rank agrees on the cache keys).
    _check_share(tmp_path)


def _check_share(folder: Path) -> None:
    """A rank's share equals the whole load's kept experts, with its fingerprint, read one expert
    at a time (a whole load made to fail)."""
    from kvbatch.engine.models import expert_loading

    whole = load_checkpoint(str(folder))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(expert_loading, "load_checkpoint", lambda *a, **k: pytest.fail("the share read the whole checkpoint"))
        part = load_expert_share(str(folder), {i: [0, 2] for i in range(3)})
    assert part.expert_ids == {i: [0, 2] for i in range(3)} and part.fingerprint == whole.fingerprint
    assert sorted(part.tensors) == sorted(whole.tensors)
    for key, t in part.tensors.items():
        want = whole.tensors[key][[0, 2]] if ".mlp.experts." in key else whole.tensors[key]
        assert t.dtype == want.dtype and torch.equal(t, want), key


@pytest.mark.slow
def test_generate_with_two_workers_matches_one_process(tmp_path):
    """`kvbatch generate --workers 2`: each rank loads its half of the experts (with their biases)
    and the answers are one process's, token for token."""
    from kvbatch.engine.text.tokenizer import ChatTokenizer
    from tests.test_expert_parallel import _answers, _generate, _requests

    tok = ChatTokenizer.from_model("smollm2-135m")
    model = tmp_path / "model"
    build_tiny_gpt_oss(model, vocab=tok.vocab_size)
    (model / "tokenizer.json").write_text(tok._tok.to_str())
    (model / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}))
    src = _requests(tmp_path / "in.jsonl", n=4, max_tokens=5)
    assert _generate(model, src, tmp_path / "w1.jsonl", 1) == 1  # the one rejected row
    reference = _answers(tmp_path / "w1.jsonl")
    assert sum(1 for a in reference if a[1] != "error") == 4
    assert _generate(model, src, tmp_path / "w2.jsonl", 2) == 1
    assert _answers(tmp_path / "w2.jsonl") == reference


def _expert_parallel_rank(rank: int, world: int, folder: str, out_dir: str) -> None:
    """One rank of a gloo group (tests.test_expert_parallel._spawned): its half of the prompts, greedy,
    over this rank's experts; then every expert moves to the other rank (weights and biases) and the
    same prompts run again."""
    from kvbatch.engine.parallel.eplb import Placement
    from kvbatch.engine.parallel.expert_parallel import install
    from kvbatch.ops.decode.group import LockstepLLM

    llm = LLM(folder, engine_config=EngineConfig(block_size=4, num_blocks=96, device="cpu"))
    full = {li: (lw.gate_up_bias.clone(), lw.down_bias.clone()) for li, lw in llm.model.moe_layers.items()}
    ep = install(llm.model)
    assert all(lw.gate_up_bias.shape[0] == lw.down_bias.shape[0] == 0 for lw in llm.model.moe_layers.values())
    mine = [(rid, p) for i, (rid, p) in enumerate(_prompts().items()) if i % world == rank]
    runs = []
    for _ in range(2):
        requests = [GenerationRequest(rid, _greedy(), prompt_token_ids=p) for rid, p in mine]
        runs.append({r.request_id: r.output_token_ids for r in LockstepLLM(llm, ep).stream(requests)})
        E, layers = ep.num_experts, llm.model.config.num_layers
        ep.rebalance(Placement.from_phy2log(torch.arange(E).roll(E // world).expand(layers, E).clone(), E))
        for li, (gate_up_bias, down_bias) in full.items():
            held = torch.tensor(ep.local_experts()[li])
            assert torch.equal(ep.layers[li].gate_up_bias, gate_up_bias[held])
            assert torch.equal(ep.layers[li].down_bias, down_bias[held])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(runs))


@pytest.mark.slow  # two spawned ranks start in tens of seconds on a loaded CPU
def test_expert_parallel_over_two_ranks_gives_the_single_process_tokens(tmp_path):
    """gpt-oss's biased, clamped experts run expert-parallel (2 gloo ranks, 2 of the 4 experts each):
    the greedy tokens are the single-process engine's, before and after every expert (with its biases)
    moves to the other rank."""
    from tests.test_expert_parallel import _spawned

    build_tiny_gpt_oss(tmp_path / "model")
    reference, _ = _engine_outputs(str(tmp_path / "model"))
    _spawned(_expert_parallel_rank, 2, str(tmp_path / "model"), str(tmp_path))
    for run in range(2):
        got = {}
        for rank in range(2):
            got.update(json.loads((tmp_path / f"rank{rank}.json").read_text())[run])
        assert got == reference, f"run {run}"


def test_expert_parallel_refuses_expert_biases_in_another_dtype(tmp_path):
    """rebalance moves an expert's weights and biases as one row: biases in another dtype are refused
    by name (a gloo group of one)."""
    import torch.distributed as dist

    from kvbatch.engine.models.moe import MoELayerWeights
    from kvbatch.engine.parallel.expert_parallel import ExpertParallelCompute

    E, H, I = 4, 8, 6
    layer = MoELayerWeights(router=torch.randn(E, H), w_gate_up=torch.randn(E, 2 * I, H), w_down=torch.randn(E, H, I),
                            gate_up_bias=torch.zeros(E, 2 * I), down_bias=torch.zeros(E, H, dtype=torch.bfloat16),
                            swiglu=(1.702, 7.0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="layer 1: expert tensor down_bias is torch.bfloat16"):
            ExpertParallelCompute({1: layer}, 2)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- MXFP4


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., out, in] (in a multiple of 32) as published: uint8 blocks [..., out, in / 32, 16]
    (low nibble the even element) and E8M0 scales [..., out, in / 32], each group's exponent the
    smallest that fits its largest magnitude under 6, each element the nearest FP4 value."""
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    values = torch.tensor(FP4_VALUES[:8])
    scaled = groups / torch.exp2(exp)[..., None]
    codes = (scaled.abs()[..., None] - values).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def build_mxfp4_gpt_oss(folder: Path):
    """A tiny gpt-oss whose experts are saved as MXFP4 blocks and scales (quantization_config
    mxfp4), and the transformers model holding transformers' dequantization of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = build_tiny_gpt_oss(folder)
    published: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)  # [E, in, out] in memory
                blocks, scales = quantize_mxfp4(param.transpose(1, 2))
                published[f"model.layers.{i}.mlp.experts.{proj}"] = blocks, scales
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))

    def to_mxfp4(tensors):
        for name, (blocks, scales) in published.items():
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales

    edit_weights(folder, to_mxfp4)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    return ref, published


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_mxfp4_dequantizer_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 40, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 40]
    got = dequantize_mxfp4(blocks, scales, dtype)  # [3, 40, 128], as the rows lie
    assert got.dtype == dtype and torch.equal(got.transpose(1, 2), want)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_mxfp4_checkpoint_loads_and_generates_as_transformers_on_its_dequantized_weights(tmp_path):
    ref, published = build_mxfp4_gpt_oss(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert not any(n.endswith(("_blocks", "_scales")) for n in ckpt.tensors)
    _check_share(tmp_path)  # a rank's share dequantizes its experts one by one, bit for bit the whole load's
    layer = ref.model.layers[1].mlp.experts
    gate_up = ckpt.tensors["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2 I, H]: gate rows, then up
    assert torch.equal(gate_up[:, :64], layer.gate_up_proj[:, :, 0::2].transpose(1, 2))
    assert torch.equal(gate_up[:, 64:], layer.gate_up_proj[:, :, 1::2].transpose(1, 2))
    assert torch.equal(ckpt.tensors["model.layers.1.mlp.experts.down_proj"], layer.down_proj.transpose(1, 2))
    outputs, seen = _engine_outputs(ckpt)
    worst = _assert_parity(ref, outputs, seen, "gpt_oss mxfp4")
    print(f"gpt-oss MXFP4 max logit error: {worst:.2e}")
    blocks = published["model.layers.0.mlp.experts.down_proj"][0]
    edit_weights(tmp_path, lambda t: t.pop("model.layers.0.mlp.experts.down_proj_scales"))
    with pytest.raises(ModelLoadError, match="down_proj has no _scales"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(ModelLoadError, match="down_proj has no _scales"):
        load_expert_share(str(tmp_path), {0: [1]})
    assert blocks.dtype == torch.uint8


def test_expert_tensors_of_the_wrong_layout_are_a_load_error(tmp_path):
    build_tiny_gpt_oss(tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    edit_weights(tmp_path, lambda t: t.update({name: t[name].transpose(1, 2).contiguous()}))  # [E, 2 I, H]
    with pytest.raises(ModelLoadError, match=r"gate_up_proj has shape \(4, 128, 64\), the config says \[E, 64, 128\]"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gpt_oss_checkpoint_with_another_quantization_is_refused_in_one_line(tmp_path, method):
    build_tiny_gpt_oss(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": method})))
    with pytest.raises(ModelLoadError, match=f"unsupported quantization method '{method}'; supported: fp8 .*mxfp4"
                       ) as info:
        load_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
def test_native_decode_sinks_equal_the_reference(dtype, window):
    """The native kernel's sinks, one thread and four (a context split into parts, combined with the
    sink), against the reference's attention with sinks over the same keys."""
    if not native.available():
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    g = torch.Generator().manual_seed(2)
    Hq, Hkv, D, bs, blocks = 8, 2, 64, 16, 160
    k_cache = torch.randn(blocks, bs, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, Hkv, D, generator=g).to(dtype)
    lens = torch.tensor([1, 37, 300, 600], dtype=torch.int32)
    tables = torch.randperm(blocks, generator=g)[:4 * 38].view(4, 38).to(torch.int32)
    assert native.attention_parts(lens, Hkv, bs, 4) > 4  # on four threads the long contexts come in parts
    q = torch.randn(4, Hq, D, generator=g).to(dtype)
    sinks = torch.randn(Hq, generator=g) * 3
    sinks[0] = 40.0  # a sink above every score: the maximum must include it
    want = torch.stack([_sink_attention(q[b], k_cache, v_cache, tables[b], int(lens[b]), window, sinks)
                        for b in range(4)])
    for threads in (1, 4):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window=window, sinks=sinks)
        finally:
            torch.set_num_threads(before)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    plain = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window=window)
    assert (plain.float() - want.float()).abs().max() > 1e-2  # the sinks changed the result


def _sink_attention(q, k_cache, v_cache, table, n: int, window: int, sinks):
    """One row's attention with sinks over exactly the keys it sees, through the reference."""
    keys = torch.arange(max(0, n - window) if window else 0, n)
    slots = table.long()[keys // k_cache.shape[1]] * k_cache.shape[1] + keys % k_cache.shape[1]
    k = k_cache.float().view(-1, *k_cache.shape[2:])[slots].transpose(0, 1)  # [Hkv, L, D]
    v = v_cache.float().view(-1, *v_cache.shape[2:])[slots].transpose(0, 1)
    return reference.attention_with_sinks(q.float()[:, None], k, v, None, False, 0.125, sinks.view(-1, 1, 1))[:, 0]


@pytest.mark.parametrize("fast", [True, False])
def test_reference_sinks_equal_transformers_eager_attention(fast):
    """attention_with_sinks (GQA, causal, a chunk over a prefix; the CPU flash kernel's log-sum-exp
    rescaled, and the scores written out) against transformers' eager attention."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 6, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g), torch.randn(
        1, 2, 9, 16, generator=g)
    sinks = torch.randn(4, generator=g)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 2, sinks, False
    mask = torch.ones(6, 9, dtype=torch.bool).tril(3)
    want, _ = eager_attention_forward(module, q, k, v, torch.zeros(6, 9).masked_fill(~mask, -math.inf), 0.25)
    got = reference.attention_with_sinks(q, k, v, None, True, 0.25, sinks.view(4, 1, 1), fast=fast)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=1e-6)
    whole = reference.attention_with_sinks(q, k[:, :, :6], v[:, :, :6], None, True, 0.25, sinks.view(4, 1, 1), fast)
    want, _ = eager_attention_forward(module, q, k[:, :, :6], v[:, :, :6],
                                      torch.zeros(6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(),
                                                                    -math.inf), 0.25)
    torch.testing.assert_close(whole.transpose(1, 2), want, atol=1e-6, rtol=1e-6)


def test_sinks_and_biased_experts_go_to_triton(tmp_path, monkeypatch):
    """Where Triton would run, attention calls with sinks take the Triton kernels, sinks passed on
    (they take them: tests/test_triton_sinks.py), except a prefill call with a windowed reference plan
    (gpt-oss's sliding layers, whose window only the plan holds), which the reference runs. Biased
    experts and clamped SwiGLU take the Triton MoE kernel, biases and activation passed on (it takes
    them: tests/test_triton_moe_bias.py), and a gpt-oss model's sliding layers take the Triton route
    (its kernels take the window and the sinks)."""
    from types import SimpleNamespace

    from kvbatch.engine.models.llama import ForwardBatch, sliding_plans
    from kvbatch.kernels import dispatch

    calls = []

    def attention(name):
        def kernel(*args, sinks=None, **kwargs):
            calls.append((name, sinks))
            return torch.zeros_like(args[0])
        return kernel

    def moe(x, w_gate_up, w_down, ids, weights, gate_up_bias=None, down_bias=None, swiglu=None):
        calls.append(("moe", (gate_up_bias, down_bias, swiglu)))
        return torch.zeros_like(x)

    fake = SimpleNamespace(paged_decode_attention=attention("decode"), prefill_attention=attention("prefill"),
                           fused_moe=moe)
    cpu_route = dispatch._impl
    monkeypatch.setattr(dispatch, "_impl", lambda t: fake)
    monkeypatch.setattr(dispatch, "native", lambda t, bf16=False: False)
    g = torch.Generator().manual_seed(6)
    k_cache, v_cache = torch.randn(8, 4, 2, 16, generator=g), torch.randn(8, 4, 2, 16, generator=g)
    tables, sinks = torch.arange(8, dtype=torch.int32).view(2, 4), torch.randn(4, generator=g)
    q, lens = torch.randn(2, 4, 16, generator=g), torch.tensor([7, 13], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    dispatch.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, sinks=sinks)
    dispatch.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25, sinks=sinks)
    assert [(name, s is sinks) for name, s in calls] == [("decode", True), ("prefill", True)]
    plan = reference.plan_prefill(tables, cu, lens, 4, 2, WINDOW)
    want = reference.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25, plan, sinks)
    torch.testing.assert_close(dispatch.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25, plan,
                                                          sinks=sinks), want)
    assert len(calls) == 2
    x, w_gate_up, w_down = (torch.randn(*shape, generator=g) for shape in ((3, 16), (2, 8, 16), (2, 16, 4)))
    ids, weights = torch.tensor([[0], [1], [0]]), torch.ones(3, 1)
    biased = {"gate_up_bias": torch.randn(2, 8, generator=g), "down_bias": torch.randn(2, 16, generator=g),
              "swiglu": (1.702, 7.0)}
    dispatch.fused_moe(x, w_gate_up, w_down, ids, weights, **biased)
    assert len(calls) == 3 and calls[2][0] == "moe"
    assert all(a is b for a, b in zip(calls[2][1], biased.values()))
    monkeypatch.delenv("KVBATCH_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "_impl", cpu_route)  # on the CPU: the reference, as before
    torch.testing.assert_close(dispatch.fused_moe(x, w_gate_up, w_down, ids, weights, **biased),
                               reference.fused_moe(x, w_gate_up, w_down, ids, weights, **biased))
    monkeypatch.setattr(dispatch, "_impl", lambda t: fake)
    build_tiny_gpt_oss(tmp_path)
    model = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=32)).runner.model
    monkeypatch.setattr(dispatch, "backend", lambda t: "triton")
    batch = ForwardBatch(positions=torch.arange(2), slot_mapping=torch.arange(2), num_decode=2,
                         decode_block_tables=tables, decode_context_lens=lens,
                         prefill_block_tables=tables[:0], prefill_cu_query_lens=torch.zeros(1, dtype=torch.int32),
                         prefill_context_lens=lens[:0], logits_rows=torch.arange(2))
    steps = sliding_plans(model, torch.zeros(2, 64), batch, torch.zeros(3, 2, 8, 4, 2, 16), 3)
    assert {s.route for s in steps.values()} == {"triton"} and steps[WINDOW].plan is None


# ---------------------------------------------------------------- configs


def test_gpt_oss_declares_its_differences():
    f = FAMILIES["gpt_oss"]
    assert f.architecture == "GptOssForCausalLM" and f.moe is not None and f.convert_tensors is not None
    assert "self_attn.sinks" in f.layer_tensors


GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}


def test_gpt_oss_20b_config_builds_on_the_meta_device(monkeypatch):
    """openai/gpt-oss-20b's config.json as published, built with meta tensors of its shapes; its
    yarn table equals transformers' rotary for that config."""
    import transformers as tf

    c = ModelConfig.from_hf(GPT_OSS_20B)
    yarn = {k: v for k, v in GPT_OSS_20B["rope_scaling"].items() if k != "original_max_position_embeddings"}
    with pytest.raises(UnsupportedModelError, match="yarn rope scaling without original_max_position_embeddings"):
        ModelConfig.from_hf(dict(GPT_OSS_20B, rope_scaling=yarn))
    assert c.layer_windows == (128, 0) * 12 and c.attention_sinks and c.o_proj_bias and c.attention_bias
    assert c.moe.num_experts == 32 and c.moe.top_k == 4 and c.moe.scoring == "softmax_topk"
    assert (c.moe.swiglu_alpha, c.moe.swiglu_limit) == (1.702, 7.0) and c.moe.router_bias and c.moe.expert_bias
    H, D, Hq, Hkv, E, inter = 2880, 64, 64, 8, 32, 2880
    meta = {"model.embed_tokens.weight": (201088, H), "model.norm.weight": (H,), "lm_head.weight": (201088, H)}
    for i in range(24):
        p = f"model.layers.{i}."
        meta.update({p + "self_attn.q_proj.weight": (Hq * D, H), p + "self_attn.k_proj.weight": (Hkv * D, H),
                     p + "self_attn.v_proj.weight": (Hkv * D, H), p + "self_attn.o_proj.weight": (H, Hq * D),
                     p + "self_attn.q_proj.bias": (Hq * D,), p + "self_attn.k_proj.bias": (Hkv * D,),
                     p + "self_attn.v_proj.bias": (Hkv * D,), p + "self_attn.o_proj.bias": (H,),
                     p + "self_attn.sinks": (Hq,), p + "input_layernorm.weight": (H,),
                     p + "post_attention_layernorm.weight": (H,), p + "mlp.gate.weight": (E, H), p + "mlp.gate.bias": (E,),
                     p + "mlp.experts.gate_up_proj": (E, 2 * inter, H), p + "mlp.experts.gate_up_proj_bias": (E, 2 * inter),
                     p + "mlp.experts.down_proj": (E, H, inter), p + "mlp.experts.down_proj_bias": (E, H)})
    tensors = {name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape in meta.items()}
    monkeypatch.setenv("KVBATCH_LINEAR", "cublas")  # the GPU's plain weight layout (nothing measured on meta)
    model = LlamaModel(c, tensors, torch.bfloat16, device="meta")
    assert len(model.layers) == 24 and len(model.moe_layers) == 24 and model.layers[3].sinks.shape == (Hq,)
    # 12 full layers' cache, 12 sliding layers' (128-token windows) in a cache of their own
    assert model.kv_cache_shape(10, 16) == (12, 2, 10, 16, Hkv, D)
    assert model.window_cache_shape(10, 16) == (12, 2, 10, 16, Hkv, D) and model.cache_window == 128
    hf_cfg = tf.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta")},
                             rope_parameters=dict(GPT_OSS_20B["rope_scaling"], rope_theta=150000.0))
    rotary = tf.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf_cfg)
    positions = torch.tensor([[0, 1, 4095, 4096, 100_000]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    from kvbatch.engine.models.rope import cos_sin_table

    table = cos_sin_table(D, c.rope_theta, c.rope_scaling, 100_001)[positions[0]]
    assert torch.equal(table, torch.cat((cos[0], sin[0]), dim=-1))
