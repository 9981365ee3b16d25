"""Gemma 3 text (``Gemma3ForCausalLM``) against transformers on tiny seeded checkpoints made here:
sliding and full layers mixed, a window of 4 under prompts of 10-30 tokens, so the window decides
what most tokens see."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.errors import UnsupportedModelError
from kvbatch.engine.models.family import FAMILIES
from kvbatch.engine.models.llama import LlamaModel
from kvbatch.engine.models.weights import ModelLoadError, load_checkpoint
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from tests.family_checks import check_speculation_keeps_reference, check_store_round_trip_and_prefix_hit, family_prompts
from tests.family_checks import greedy as _greedy
from tests.logit_capture import assert_logits_match, capture_logits
from tests.tiny_models import VOCAB
from tests.triton_interpreter import fresh_process_only, interpreter_only, rerun_in_fresh_interpreter

torch.set_num_threads(1)

WINDOW = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def gemma3_config(vocab: int = VOCAB, window: int = WINDOW, layer_types: list[str] | None = None, **extra):
    """A tiny Gemma 3 text config: head_dim 32 apart from hidden / heads (16), a softmax scale of
    query_pre_attn_scalar 24 (not head_dim), linear rope scaling on the full layer and another base
    on the sliding ones."""
    import transformers as tf

    types = layer_types or LAYER_TYPES
    return tf.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=len(types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=window, layer_types=types,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)


def build_tiny_gemma3(folder: Path, seed: int = 0, vocab: int = VOCAB, **config):
    """Save a random Gemma 3 text model into ``folder``; returns the transformers model (eval, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(gemma3_config(vocab, **config)).eval()
    with torch.no_grad():  # norms away from 0 (Gemma scales by 1 + w), so a dropped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


def _prompts(seed: int = 1) -> dict[str, list[int]]:
    return family_prompts(VOCAB, seed)


def _engine_outputs(folder: Path, budget: int, **engine) -> tuple[dict[str, list[int]], list]:
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=budget,
                                                      **engine))
    seen = capture_logits(llm)
    results = llm.generate([GenerationRequest(rid, _greedy(), prompt_token_ids=p) for rid, p in _prompts().items()])
    return {r.request_id: r.output_token_ids for r in results}, seen


# 7: prompts are prefilled in several chunks; "reference": decode rows through the reference's windowed
# plan as chunks of one token (where the native kernels are not built, "auto" is that too)
@pytest.mark.parametrize("budget, kernels", [(4096, "auto"), (7, "auto"), (4096, "reference")])
def test_logits_match_transformers(tmp_path, monkeypatch, budget, kernels):
    monkeypatch.setenv("KVBATCH_KERNELS", kernels)
    ref = build_tiny_gemma3(tmp_path)
    outputs, seen = _engine_outputs(tmp_path, budget)
    for rid, prompt in _prompts().items():
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert outputs[rid] == want, f"greedy tokens differ for {rid}"
        assert_logits_match(ref, seen, rid, prompt, outputs[rid], f"gemma3 budget {budget}")


def test_the_window_decides_the_output(tmp_path):
    """The same weights with the window opened past every prompt give other logits: the tests above
    would fail on an engine that ignored the window."""
    ref = build_tiny_gemma3(tmp_path / "w")
    _, seen = _engine_outputs(tmp_path / "w", 4096)
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    (tmp_path / "open").mkdir()
    (tmp_path / "open" / "model.safetensors").symlink_to(tmp_path / "w" / "model.safetensors")
    (tmp_path / "open" / "config.json").write_text(json.dumps(dict(cfg, sliding_window=256)))
    _, seen_open = _engine_outputs(tmp_path / "open", 4096)
    first = {rid: logits for rid, logits in reversed(seen)}  # each request's first row: its prompt's last token
    first_open = {rid: logits for rid, logits in reversed(seen_open)}
    prompts = _prompts()
    for rid, prompt in prompts.items():  # every prompt is longer than the window
        assert len(prompt) > WINDOW
        assert (first[rid] - first_open[rid]).abs().max() > 1e-2, rid
    with torch.no_grad():  # and it is transformers' window the engine keeps
        want = ref(torch.tensor([prompts["r1"]])).logits[0, -1]
    torch.testing.assert_close(first["r1"], want, atol=1e-4, rtol=1e-4)


def test_decode_from_the_kv_store_equals_in_process_generate(tmp_path):
    """Batch-invariant engines through the store; then prefix caching outside that mode reuses the
    26-token system prompt (its blocks hold keys the window no longer sees)."""
    build_tiny_gemma3(tmp_path / "m")
    cfg = {"block_size": 4, "num_blocks": 128, "max_num_seqs": 8}
    check_store_round_trip_and_prefix_hit(load_checkpoint(str(tmp_path / "m")), (tmp_path / "kv").as_uri(), VOCAB,
                                          {**cfg, "batch_invariant": True}, cfg)


@pytest.mark.parametrize("spec", ["ngram", "draft:self"])
def test_speculative_verification_keeps_transformers_tokens(tmp_path, spec):
    """Drafts verified in chunks of 1 + k tokens, each over its window: greedy output unchanged."""
    check_speculation_keeps_reference(tmp_path, build_tiny_gemma3(tmp_path), VOCAB, spec)


def test_hub_config_of_gemma3_12b_builds_on_the_meta_device(monkeypatch):
    """google/gemma-3-12b-it's text config as the hub states it (rope_theta, rope_scaling,
    rope_local_base_freq, sliding_window_pattern; no layer_types), built with meta tensors."""
    hub = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
           "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
           "num_key_value_heads": 8, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
           "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 1024,
           "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
           "attn_logit_softcapping": None, "tie_word_embeddings": True, "attention_bias": False}
    c = ModelConfig.from_hf(hub)
    assert c.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(48))
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert c.attention_scale == 256 ** -0.5 and c.hidden_act == "gelu_pytorch_tanh"
    assert c.embedding_multiplier == 3840 ** 0.5 and c.qk_norm and c.sandwich_norms and c.norm_unit_offset
    H, D, Hq, Hkv, inter = 3840, 256, 16, 8, 15360
    meta = {"model.embed_tokens.weight": (262208, H), "model.norm.weight": (H,)}
    for i in range(48):
        p = f"model.layers.{i}."
        meta.update({p + "self_attn.q_proj.weight": (Hq * D, H), p + "self_attn.k_proj.weight": (Hkv * D, H),
                     p + "self_attn.v_proj.weight": (Hkv * D, H), p + "self_attn.o_proj.weight": (H, Hq * D),
                     p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                     p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                     p + "mlp.down_proj.weight": (H, inter)})
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            meta[p + n + ".weight"] = (H,)
    tensors = {name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape in meta.items()}
    monkeypatch.setenv("KVBATCH_LINEAR", "cublas")  # the GPU's plain weight layout (nothing measured on meta)
    model = LlamaModel(c, tensors, torch.bfloat16, device="meta")
    assert len(model.layers) == 48 and model.layers[5].mlp_out_norm is not None
    assert model.layers[5].post_norm.dtype == torch.float32  # 1 + w kept in fp32 in a bf16 model
    assert model.layer_cos_sin[5] is model.cos_sin and model.layer_cos_sin[0] is not model.cos_sin
    # the 8 full layers' cache, and the 40 sliding layers' own (window_blocks.py)
    assert model.kv_cache_shape(10, 16) == (8, 2, 10, 16, Hkv, D)
    assert model.window_cache_shape(10, 16) == (40, 2, 10, 16, Hkv, D)
    # one 4,096-token sequence in bf16, blocks of 16 (docs/models.md): 256 full-layer blocks of 1 MiB,
    # and its window's ceil(1023 / 16) + 3 = 67 blocks of 5 MiB, against 256 blocks of 6 MiB
    from kvbatch.engine.runtime.model_runner import ModelRunner

    mib = 1 << 20
    full, window = (ModelRunner.bytes_per_block(model, 16, torch.bfloat16),
                    ModelRunner.window_bytes_per_block(model, 16, torch.bfloat16))
    assert (full, window, -(-1023 // 16) + 3) == (mib, 5 * mib, 67)
    assert (256 * full + 67 * window, 256 * (full + window)) == (591 * mib, 1536 * mib)


def test_gemma3_declares_its_differences():
    g = FAMILIES["gemma3_text"]
    assert g.architecture == "Gemma3ForCausalLM" and g.qk_norm and g.norm_unit_offset and g.sandwich_norms
    assert g.embedding_scale and g.settings is not None


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "yarn"),
])
def test_what_gemma3_does_not_implement_is_refused(change, message):
    cfg = gemma3_config().to_dict()
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(dict(cfg, **change))


def test_a_missing_feedforward_norm_is_a_load_error(tmp_path):
    from safetensors.torch import load_file, save_file

    build_tiny_gemma3(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.pre_feedforward_layernorm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="pre_feedforward_layernorm"):
        load_checkpoint(str(tmp_path))


def test_final_logit_softcapping_matches_transformers(tmp_path):
    """Gemma 3 leaves it unset; a config that sets it gets transformers' cap * tanh(logits / cap)."""
    ref = build_tiny_gemma3(tmp_path, final_logit_softcapping=0.5)
    outputs, seen = _engine_outputs(tmp_path, 4096)
    prompt = _prompts()["r1"]
    want = assert_logits_match(ref, seen, "r1", prompt, outputs["r1"], "gemma3 softcap")
    assert want.abs().max() <= 0.5  # the cap applied (the raw logits reach past it)


def test_fp32_norms_of_a_bf16_model_equal_transformers():
    """A bf16 model keeps 1 + w in fp32 and rounds once, as Gemma3RMSNorm does, bit for bit."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from kvbatch.kernels.reference import rms_norm_fp32

    torch.manual_seed(0)
    hf = Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64) * 0.3)
    x = torch.randn(5, 64).to(torch.bfloat16)
    got, _ = rms_norm_fp32(x, hf.weight.float() + 1.0, 1e-6)
    assert got.dtype == torch.bfloat16 and torch.equal(got, hf(x))


TRITON = interpreter_only("test_triton_tests_in_a_fresh_process")


@fresh_process_only
def test_triton_tests_in_a_fresh_process():
    """The kernels came compiled for a GPU before this file could ask for the interpreter: this
    file's Triton tests run in a fresh process instead."""
    rerun_in_fresh_interpreter(__file__)


@pytest.mark.slow
@TRITON
@pytest.mark.parametrize("budget", [4096, 7])
def test_engine_on_the_triton_kernels_keeps_the_window(tmp_path, monkeypatch, budget):
    """The CUDA code path in the Triton interpreter (plain weights, Triton attention with the
    window in its decode and prefill kernels): transformers' tokens and logits within 1e-4."""
    ref = build_tiny_gemma3(tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    monkeypatch.setenv("KVBATCH_LINEAR", "cublas")
    outputs, seen = _engine_outputs(tmp_path, budget, device="cpu")
    for rid, prompt in list(_prompts().items())[:2]:
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert outputs[rid] == want, f"greedy tokens differ for {rid}"
        assert_logits_match(ref, seen, rid, prompt, outputs[rid], f"gemma3 on triton, budget {budget}")


@TRITON
@pytest.mark.parametrize("window", [0, 5, 13])
def test_triton_attention_windows_match_the_reference(window, monkeypatch):
    """The Triton kernels' window (interpreter) against the reference's windowed plan: decode over
    split partitions, and prefill chunks over a cached prefix."""
    from kvbatch.kernels import reference, triton_attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter reads it at each launch
    g = torch.Generator().manual_seed(window)
    Hq, Hkv, D, bs, blocks = 4, 2, 32, 4, 40
    k_cache, v_cache = torch.randn(2, blocks, bs, Hkv, D, generator=g)
    tables = torch.randperm(blocks, generator=g)[:36].view(3, 12).to(torch.int32)
    lens = torch.tensor([41, 3, 30], dtype=torch.int32)
    q = torch.randn(3, Hq, D, generator=g)
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, partition_size=8,
                                                  block_n=4, window=window)
    torch.testing.assert_close(got, _windowed_reference(q, k_cache, v_cache, tables, lens, 0.2, window),
                               atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 9, 10, 27], dtype=torch.int32)  # chunks of 9, 1 and 17 new tokens
    qp = torch.randn(27, Hq, D, generator=g)
    plan = reference.plan_prefill(tables, cu, lens, bs, Hq // Hkv, window)
    want = reference.prefill_attention(qp, k_cache, v_cache, tables, cu, lens, 0.2, plan)
    got = triton_attention.prefill_attention(qp, k_cache, v_cache, tables, cu, lens, 0.2, block_m=4, block_n=4,
                                             window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# Gemma 3's chat template as its checkpoints ship it (tokenizer_config.json, google/gemma-3-*-it)
GEMMA_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")


def test_cli_generate_renders_the_checkpoints_gemma_template(tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast

    from kvbatch.cli.main import main
    from kvbatch.engine.text.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_model("smollm2-135m")
    folder = tmp_path / "m"
    build_tiny_gemma3(folder, vocab=tok.vocab_size)
    (folder / "tokenizer.json").write_text(tok._tok.to_str())
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
               "unk_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": GEMMA_TEMPLATE, **special}))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello there "}]
    rendered = ChatTokenizer.from_checkpoint(load_checkpoint(str(folder))).render_chat(chat)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=GEMMA_TEMPLATE, **special)
    assert rendered == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|><start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>\n<start_of_turn>model\n"
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 5,
                      "temperature": 0}} for i, text in enumerate(["Hello there", "What is 2+2?"])]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["generate", "--model", str(folder), "--input", str(src), "--output", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["c0", "c1"]
    assert all(a["error"] is None and a["response"]["status_code"] == 200 for a in answers)


def test_decode_steps_take_the_native_kernel_with_each_layers_window(tmp_path, monkeypatch):
    """Where the native kernels run, a decode step calls the native decode kernel once per layer,
    with the sliding layers' window (4) and the full layer's 0."""
    from kvbatch.kernels import dispatch

    if not dispatch.native(torch.zeros(1)):
        pytest.skip("the native CPU kernels are not built here")
    build_tiny_gemma3(tmp_path)
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64))
    windows: list[int] = []
    kernel = dispatch.native_kernels.paged_decode_attention

    def spy(q, k, v, tables, lens, scale, window=0):
        windows.append(window)
        return kernel(q, k, v, tables, lens, scale, window)

    monkeypatch.setattr(dispatch.native_kernels, "paged_decode_attention", spy)
    llm.generate([GenerationRequest("a", _greedy(4), prompt_token_ids=_prompts()["r1"])])
    assert windows == [WINDOW, 0, WINDOW] * 3  # three decode steps, layer by layer


def _windowed_reference(q, k_cache, v_cache, tables, lens, scale, window):
    """Each query against the last ``window`` keys of its context, gathered position by position."""
    bs = k_cache.shape[1]
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b].long()[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].transpose(0, 1).float()  # [Hkv, L, D]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].transpose(0, 1).float()
        qb = q[b].float().view(k.shape[0], -1, q.shape[-1])  # [Hkv, group, D]
        out.append(torch.nn.functional.scaled_dot_product_attention(qb, k, v, scale=scale).reshape(q.shape[1:]))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_windowed_decode_matches_the_window(dtype, threads):
    """Windows that start inside a block, contexts shorter than the window, and (on 2 threads) long
    windows split into parts: the kernel equals attention over exactly the window's keys."""
    from kvbatch.kernels.cpu import native

    if not native.available():
        pytest.skip("the native CPU kernels are not built here")
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, D, bs, blocks = 4, 2, 64, 16, 80
    k_cache = torch.randn(blocks, bs, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, Hkv, D, generator=g).to(dtype)
    lens = torch.tensor([300, 7, 250, 45], dtype=torch.int32)
    tables = torch.randperm(blocks, generator=g)[:4 * 19].view(4, 19).to(torch.int32)
    q = torch.randn(4, Hq, D, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (37, 200, 0):
            got = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window)
            want = _windowed_reference(q, k_cache, v_cache, tables, lens, 0.125, window)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=f"window {window}")
    finally:
        torch.set_num_threads(before)
    if threads == 2:  # the long windows were split into parts, as the kernel splits long contexts
        assert native.attention_parts(torch.tensor([200, 200]), Hkv, bs, 2) > 2
    with pytest.raises(ValueError, match="window"):
        native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, -1)


def test_the_multimodal_gemma3_checkpoint_is_refused_in_one_line(tmp_path):
    """Gemma 3 4B-27B as published (``Gemma3ForConditionalGeneration``: a vision tower, the text
    model's config under ``text_config``) is not the text model: refused, naming the one that is."""
    build_tiny_gemma3(tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "model_type": "gemma3", "text_config": text}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'Gemma3ForConditionalGeneration'.*"
                                             "Gemma3ForCausalLM") as info:
        load_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)


def test_bf16_model_follows_transformers_in_bf16(tmp_path):
    """bf16 weights and cache (native bf16 windowed decode, fp32 norms by 1 + w): every logits row
    within a few bf16 steps of transformers' bf16 model fed the same tokens."""
    ref = build_tiny_gemma3(tmp_path).to(torch.bfloat16)
    llm = LLM(str(tmp_path), dtype="bf16", engine_config=EngineConfig(block_size=4, num_blocks=96))
    seen = capture_logits(llm)
    prompts = _prompts()
    results = llm.generate([GenerationRequest(rid, _greedy(), prompt_token_ids=p) for rid, p in prompts.items()])
    for r in results:
        prompt = prompts[r.request_id]
        with torch.no_grad():
            want = ref(torch.tensor([prompt + r.output_token_ids])).logits[0].float()
        got = torch.stack([logits for rid, logits in seen if rid == r.request_id])
        torch.testing.assert_close(got, want[len(prompt) - 1:-1], atol=3e-2, rtol=0)
