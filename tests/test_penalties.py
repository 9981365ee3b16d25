"""``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` honoured end to end.

Pinned: the engine's tokens equal a plain per-row reference (transformers' logits, the bias added
and the penalties subtracted in a Python loop over the output so far, then argmax or the same
seeded draw), greedy and sampled; +100 forces a token and -100 bans it; speculative decoding
(n-gram drafts) gives the tokens plain decoding gives; a grammar's mask applies after the bias;
bad values are per-row 400s naming the field (keys, ranges, more than 300 entries, ids outside
the vocabulary); the response cache keys on them; ``kvbatch generate`` honours them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import torch

from kvbatch.cli.main import main
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampler import filter_logits, penalize_logits, penalize_rows
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.engine.speculative.verifier import penalize_positions
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, parse_request_line, parse_response_format
from kvbatch.ops.decode.response_cache import row_key
from kvbatch.ops.jobs import Job, Rejected, tokenize_request
from tests.tiny_models import VOCAB, build_tiny, build_tiny_chat_model

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("penalties_llama")
    return folder, build_tiny("llama", folder, seed=0)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("penalties_chat"), max_positions=256)


@pytest.fixture(scope="module")
def chat_llm(tiny_chat) -> LLM:
    return LLM(str(tiny_chat))


def _prompts(n: int, length: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (length + i,), generator=g).tolist() for i in range(n)]


# The rows every engine test runs: each knob alone, all together, and none (an unpenalized row
# in a penalized batch must be untouched).
KNOBS = [
    {"logit_bias": {5: 4.0, 17: -3.0}},
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"presence_penalty": -1.0, "frequency_penalty": 0.7, "logit_bias": {9: 2.5}},
    {},
]


def _reference(hf, prompt: list[int], p: SamplingParams) -> list[int]:
    """The plain specification: transformers' logits of the whole sequence, each bias added and
    each penalty subtracted by hand for the tokens of the output so far, then the argmax, or the
    engine's one fp64 uniform per token from the request's seeded generator, inverse-transformed
    over the tempered distribution."""
    gen = torch.Generator().manual_seed(p.seed) if not p.greedy else None
    out: list[int] = []
    for _ in range(p.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        x = logits.clone()
        for tok, bias in p.logit_bias:
            x[tok] += bias
        for tok in set(out):
            x[tok] -= p.presence_penalty + p.frequency_penalty * out.count(tok)
        if p.greedy:
            out.append(int(torch.argmax(x)))
            continue
        u = torch.rand(1, dtype=torch.float64, generator=gen)
        cdf = filter_logits(x, p).softmax(-1).double().cumsum(-1)
        out.append(min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), x.shape[0] - 1))
    return out


def _requests(temperature: float, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=100 + i,
                                                      ignore_eos=True, **KNOBS[i % len(KNOBS)]),
                              prompt_token_ids=p) for i, p in enumerate(prompts)]


# ----------------------------------------------------------------------------- the batched rows

def test_penalize_rows_is_the_row_specification():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g)
    params = [SamplingParams(**KNOBS[i % len(KNOBS)]) for i in range(6)]
    outputs = [torch.randint(0, 40, (i * 3,), generator=g).tolist() for i in range(6)]
    got = penalize_rows(logits, params, outputs)
    for r, (p, out) in enumerate(zip(params, outputs)):
        want = penalize_logits(logits[r], [], out, 1.0, p.presence_penalty, p.frequency_penalty, dict(p.logit_bias))
        torch.testing.assert_close(got[r], want, rtol=0, atol=1e-6)
    assert torch.equal(got[4], logits[4])  # the unpenalized row is untouched
    plain = [SamplingParams()] * 6
    assert penalize_rows(logits, plain, outputs) is logits  # nothing asked: no work, no copy


def test_each_draft_position_counts_the_drafts_before_it():
    logits = torch.zeros(4, 10)
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    got = penalize_positions(logits, [(p, [3], [3, 4]), (SamplingParams(), [3], [])])
    assert got[0, 3] == -1.5 and got[0, 4] == 0  # the output alone
    assert got[1, 3] == -2.5 and got[1, 4] == 0  # ... plus the first draft
    assert got[2, 3] == -2.5 and got[2, 4] == -1.5  # ... plus both drafts
    assert torch.equal(got[3], logits[3])  # the other entry's one row


# ----------------------------------------------------------------------------- in the engine

@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_equals_the_per_row_reference(tiny, temperature):
    folder, hf = tiny
    reqs = _requests(temperature, _prompts(5))
    results = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=256)).generate(reqs)
    for req, res in zip(reqs, results):
        assert res.output_token_ids == _reference(hf, req.prompt_token_ids, req.sampling), req.sampling
    # The penalties changed the answers (not only agreed on unchanged ones).
    plain = [GenerationRequest(r.request_id, dataclasses.replace(r.sampling, logit_bias=(), presence_penalty=0.0,
                                                                 frequency_penalty=0.0),
                               prompt_token_ids=r.prompt_token_ids) for r in reqs]
    unpenalized = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=256)).generate(plain)
    changed = [a.output_token_ids != b.output_token_ids for a, b in zip(results, unpenalized)]
    assert changed[:4] == [True] * 4 and not changed[4]


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_it(tiny):
    folder, _ = tiny
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=256))
    prompt = _prompts(1)[0]

    def run(**kw) -> list[int]:
        p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)
        return llm.generate([GenerationRequest("x", p, prompt_token_ids=prompt)])[0].output_token_ids

    free = run()
    forced = next(t for t in range(3, VOCAB) if t not in free)
    assert run(logit_bias={forced: 100}) == [forced] * MAX_TOKENS
    banned = run(logit_bias={t: -100 for t in set(free)})
    assert not set(banned) & set(free)


def _repetitive(n: int) -> list[list[int]]:
    """Prompts n-gram lookup finds drafts in: a random base repeated."""
    g = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(n):
        base = torch.randint(3, VOCAB, (8,), generator=g).tolist()
        prompts.append(base * 3 + base[:3])
    return prompts


def test_speculative_greedy_decoding_gives_the_plain_tokens(tiny):
    folder, _ = tiny
    reqs = _requests(0.0, _repetitive(5), max_tokens=16)
    ec = EngineConfig(block_size=4, num_blocks=256)
    plain = LLM(str(folder), engine_config=ec).generate(reqs)
    llm = LLM(str(folder), engine_config=ec, speculative=SpecConfig("ngram", max_len=4, adaptive=False))
    spec = llm.generate(reqs)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert sum(r.spec_draft_tokens for r in spec[:4]) > 0  # the verifier saw penalized rows with drafts
    assert sum(r.spec_accepted_tokens for r in spec[:4]) > 0
    llm.block_manager.check_invariants([])


def test_speculative_sampling_verifies_drafts_against_the_biased_target(tiny):
    """Sampled speculation is equal to plain sampling in distribution, not token for token; what
    it must never do is keep a draft the bias rules out. n-gram lookup drafts the prompt's own
    tokens, and every one of them is banned: none may appear."""
    folder, _ = tiny
    prompts = _repetitive(4)
    reqs = [GenerationRequest(f"s{i}", SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True,
                                                      logit_bias={t: -100.0 for t in set(p)}),
                              prompt_token_ids=p) for i, p in enumerate(prompts)]
    ec = EngineConfig(block_size=4, num_blocks=256)
    llm = LLM(str(folder), engine_config=ec, speculative=SpecConfig("ngram", max_len=4, adaptive=False))
    spec = llm.generate(reqs)
    assert llm.stats["spec_draft_tokens"] > 0
    for req, res in zip(reqs, spec):
        assert not set(res.output_token_ids) & set(req.prompt_token_ids)
    again = LLM(str(folder), engine_config=ec, speculative=SpecConfig("ngram", max_len=4, adaptive=False))
    assert [r.output_token_ids for r in again.generate(reqs)] == [r.output_token_ids for r in spec]


def test_the_greedy_head_skips_penalized_rows(tiny, monkeypatch):
    """The CPU greedy head returns -inf for every token its screen rules out, so no bias can lift
    one: a step with a penalized row must get the full head (``SamplingParams.argmax_only``)."""
    folder, _ = tiny
    monkeypatch.setenv("KVBATCH_GREEDY_HEAD", "1")
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=256))
    assert SamplingParams(temperature=0.0).argmax_only
    assert not SamplingParams(temperature=0.0, logit_bias={3: 1.0}).argmax_only
    assert not SamplingParams(temperature=0.0, presence_penalty=0.1).argmax_only
    if llm.model.greedy_head is None:
        pytest.skip("no greedy head on this machine (native kernels unavailable)")
    flags = []
    prepare = llm.runner.prepare

    def spy(step):
        ids, batch, sampled = prepare(step)
        flags.append(batch.greedy_only)
        return ids, batch, sampled

    llm.runner.prepare = spy
    prompt = _prompts(1)[0]
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([GenerationRequest("plain", p, prompt_token_ids=prompt)])
    assert flags and all(flags)  # the screen serves plain greedy rows
    flags.clear()
    llm.generate([GenerationRequest("biased", dataclasses.replace(p, logit_bias=((4, 1.0),)),
                                    prompt_token_ids=prompt)])
    assert flags and not any(flags)


# ----------------------------------------------------------------------------- with a grammar

LABELS = {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
          "required": ["label"], "additionalProperties": False}


def test_the_grammar_mask_applies_after_the_bias(chat_llm):
    llm = chat_llm
    rf = parse_response_format({"type": "json_schema", "json_schema": {"name": "l", "schema": LABELS, "strict": True}})
    msgs = [{"role": "user", "content": "Classify: the food was great."}]

    def run(bias: dict[int, float]) -> list[int]:
        p = SamplingParams(max_tokens=64, temperature=0.0, response_format=rf, logit_bias=bias)
        r = llm.generate([GenerationRequest("g", p, messages=msgs)])[0]
        assert r.error is None and r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), LABELS)  # whatever the bias, the grammar holds
        return r.output_token_ids

    ids = run({})
    # +100 on a token this grammar never allows: still forbidden, the answer unchanged.
    word = llm.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])[-3]
    assert word not in ids and run({word: 100.0}) == ids
    # -100 on the grammar's choice where it has one (the label's first token): another label.
    head = len('{"label":"')
    at = next(j for j in range(len(ids)) if len(llm.tokenizer.decode(ids[:j + 1])) > head)
    other = run({ids[at]: -100.0})
    assert other[:at] == ids[:at] and other[at] != ids[at]


# ----------------------------------------------------------------------------- at the edge

def _line(**body) -> bytes:
    return json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}).encode()


def test_valid_values_reach_the_sampling_params():
    got = parse_request_line(_line(logit_bias={"50": 100, "7": -2.5}, presence_penalty=0.5, frequency_penalty=-2), 1)
    assert isinstance(got, ChatRequest)
    assert got.sampling.logit_bias == ((7, -2.5), (50, 100.0))
    assert (got.sampling.presence_penalty, got.sampling.frequency_penalty) == (0.5, -2.0)
    plain = parse_request_line(json.dumps({"custom_id": "p", "messages": [{"role": "user", "content": "hi"}],
                                           "logit_bias": {"3": 1}}).encode(), 1)
    assert isinstance(plain, ChatRequest) and plain.sampling.logit_bias == ((3, 1.0),)


@pytest.mark.parametrize("body, field, reason", [
    ({"logit_bias": {"abc": 1}}, "body.logit_bias", 'key "abc" is not a token id'),
    ({"logit_bias": {"-3": 1}}, "body.logit_bias", 'key "-3" is not a token id'),
    ({"logit_bias": {"1.5": 1}}, "body.logit_bias", 'key "1.5" is not a token id'),
    ({"logit_bias": {"5": 100.5}}, "body.logit_bias", "the bias of token 5 must be a number in [-100, 100], got 100.5"),
    ({"logit_bias": {"5": -101}}, "body.logit_bias", "the bias of token 5 must be a number in [-100, 100]"),
    ({"logit_bias": {"5": True}}, "body.logit_bias", "the bias of token 5 must be a number in [-100, 100], got true"),
    ({"logit_bias": {"5": "1"}}, "body.logit_bias", "the bias of token 5 must be a number"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "body.logit_bias", "has 301 entries, at most 300"),
    ({"logit_bias": [1, 2]}, "body.logit_bias", "must be an object of token ids to biases, got array"),
    ({"presence_penalty": 2.5}, "body.presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -2.01}, "body.frequency_penalty", "greater than or equal to -2"),
    ({"frequency_penalty": "1"}, "body.frequency_penalty", "valid number"),
])
def test_bad_values_are_rejected_rows_naming_the_field(body, field, reason):
    got = parse_request_line(_line(**body), 4)
    assert isinstance(got, RejectedRow) and (got.line_no, got.custom_id, got.field) == (4, "r1", field)
    assert reason in got.reason


def test_exactly_300_entries_pass():
    assert isinstance(parse_request_line(_line(logit_bias={str(i): 1 for i in range(300)}), 1), ChatRequest)


def test_ids_outside_the_vocabulary_are_rejected_where_the_tokenizer_is(chat_llm):
    llm = chat_llm
    vocab = llm.tokenizer.vocab_size
    ok = parse_request_line(_line(logit_bias={str(vocab - 1): 1}), 1)
    bad = parse_request_line(_line(logit_bias={"3": 1, str(vocab): 1, str(vocab + 7): 2}), 2)
    assert isinstance(tokenize_request(llm.tokenizer, llm.max_model_len, 0, ok), Job)
    got = tokenize_request(llm.tokenizer, llm.max_model_len, 1, bad)
    assert isinstance(got, Rejected) and got.row.field == "body.logit_bias"
    assert got.row.reason == f"tokens {vocab}, {vocab + 7} are outside the model's vocabulary (ids 0 to {vocab - 1})"
    with pytest.raises(ValueError, match="outside the vocabulary"):  # programmatic callers of the engine
        llm.add_request(GenerationRequest("x", SamplingParams(logit_bias={llm.model_config.vocab_size: 1.0}),
                                          prompt_token_ids=[1, 2, 3]))


def test_the_engine_params_guard_programmatic_callers():
    for bad in ({"logit_bias": {-1: 1.0}}, {"logit_bias": {1: 101.0}}, {"presence_penalty": 2.5},
                {"frequency_penalty": -3.0}, {"logit_bias": {i: 1.0 for i in range(301)}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    # One bias is one value however it is spelled (a dict, pairs from a JSON round trip).
    assert SamplingParams(logit_bias={9: 1, 2: -1}) == SamplingParams(logit_bias=[[2, -1.0], [9, 1.0]])


def test_the_response_cache_keys_on_bias_and_penalties():
    base = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={5: 1.0}, presence_penalty=0.5)
    key = row_key("engine", [1, 2, 3], base)
    assert key is not None
    for changed in ({"logit_bias": {5: 2.0}}, {"logit_bias": {6: 1.0}}, {"logit_bias": {}},
                    {"presence_penalty": 0.25}, {"frequency_penalty": 0.5}):
        assert row_key("engine", [1, 2, 3], dataclasses.replace(base, **changed)) != key, changed
    same = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=[(5, 1)], presence_penalty=0.5)
    assert row_key("engine", [1, 2, 3], same) == key


# ----------------------------------------------------------------------------- kvbatch generate

def test_generate_honours_logit_bias(tiny_chat, chat_llm, tmp_path):
    llm = chat_llm
    word = llm.tokenizer.encode_chat([{"role": "user", "content": "banana"}])[-3]
    rows = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                      "temperature": 0, **body}}
            for cid, body in [("biased", {"logit_bias": {str(word): 100}}), ("free", {}),
                              ("outside", {"logit_bias": {"999999": 5}})]]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["generate", "--model", str(tiny_chat), "--input", str(src), "--output", str(out)])
    lines = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert code == 1 and len(lines) == 3  # a rejected row makes the exit status 1
    biased = lines["biased"]["response"]["body"]["choices"][0]["message"]["content"]
    assert biased == llm.tokenizer.decode([word] * 4)
    free = lines["free"]["response"]["body"]["choices"][0]["message"]["content"]
    assert free != biased
    err = lines["outside"]["error"]
    assert err["field"] == "body.logit_bias" and "token 999999 is outside the model's vocabulary" in err["message"]


def test_generate_honours_bias_and_penalties_on_completions_rows(tiny_chat, chat_llm, tmp_path):
    """A ``/v1/completions`` row takes the chat row's fields: +100 forces a token, the penalties give
    the answer of the chat row whose rendered prompt is the completions row's token ids, and an id
    outside the vocabulary is the same 400."""
    llm = chat_llm
    word = llm.tokenizer.encode_chat([{"role": "user", "content": "banana"}])[-3]
    messages = [{"role": "user", "content": "Hello"}]
    ids = llm.tokenizer.encode_chat(messages)  # the chat row's prompt, given raw to the completions rows
    penalties = {"presence_penalty": 2, "frequency_penalty": 2}
    greedy = {"max_tokens": 8, "temperature": 0}

    def row(cid: str, url: str, body: dict) -> dict:
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "tiny", **greedy, **body}}

    rows = [row("chat", "/v1/chat/completions", {"messages": messages, **penalties}),
            row("penalized", "/v1/completions", {"prompt": ids, **penalties}),
            row("free", "/v1/completions", {"prompt": ids}),
            row("biased", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "logit_bias": {str(word): 100}}),
            row("outside", "/v1/completions", {"prompt": "Hello", "logit_bias": {"999999": 5}})]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["generate", "--model", str(tiny_chat), "--input", str(src), "--output", str(out)])
    lines = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert code == 1 and len(lines) == 5  # the rejected row makes the exit status 1

    def text(cid: str) -> str:
        return lines[cid]["response"]["body"]["choices"][0]["text"]

    assert text("biased") == llm.tokenizer.decode([word] * 4)
    chat = lines["chat"]["response"]["body"]["choices"][0]["message"]["content"]
    assert text("penalized") == chat and text("penalized") != text("free")  # the penalties changed it
    err = lines["outside"]["error"]
    assert err["field"] == "body.logit_bias" and "token 999999 is outside the model's vocabulary" in err["message"]


# ----------------------------------------------------------------------------- the pipeline's stages

@pytest.mark.slow
def test_pipeline_stages_honour_bias_and_penalties(tiny_chat, chat_llm, tmp_path):
    """ingest -> shards -> prefill -> decode of the shard: the fields ride in the prompts and
    shards tables and the manifests, and each row's answer is the one ``LLM.generate`` gives."""
    import pyarrow.parquet as pq

    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
    from kvbatch.io.shard_tables import read_table, shard_url
    from kvbatch.ops.decode.shard import decode_shard
    from kvbatch.ops.ingest.prompts import ingest
    from kvbatch.ops.jobs import to_engine_sampling
    from kvbatch.ops.prefill.prefill import prefill_shard
    from kvbatch.ops.shards.build import build_shards

    word = chat_llm.tokenizer.encode_chat([{"role": "user", "content": "banana"}])[-3]
    bodies = {"biased": {"logit_bias": {str(word): 100}}, "penalized": {"presence_penalty": 2, "frequency_penalty": 2},
              "sampled": {"temperature": 1.0, "seed": 5, "logit_bias": {"7": -100}, "frequency_penalty": -1.5},
              "plain": {}}
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": f"Say {cid}"}],
                                  "max_tokens": 6, "temperature": 0, **body}}) for cid, body in bodies.items()]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    assert ingest(str(src), prompts, str(tmp_path / "rejects.parquet")).valid == len(lines)
    table = {r["custom_id"]: r for r in pq.read_table(prompts).to_pylist()}
    assert table["biased"]["logit_bias"] == [{"token": word, "bias": 100.0}] and table["plain"]["logit_bias"] is None

    ec = EngineConfig(batch_invariant=True, max_num_seqs=8)
    root = str(tmp_path / "out")
    build_shards(LLM(str(tiny_chat), engine_config=ec), prompts, root, 1, rejects_url=str(tmp_path / "sr.parquet"))
    fp = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(chat_llm.checkpoint.fingerprint)
    store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), fp)
    manifests = shard_url(root, "manifests", "0000", "manifests.jsonl")
    prefill_shard(LLM(str(tiny_chat), engine_config=ec, kv_store=store), shard_url(root, "shards", "0000"), manifests)
    results_url = shard_url(root, "results", "0000")
    assert decode_shard(LLM(str(tiny_chat), engine_config=ec, kv_store=store), manifests, results_url)["succeeded"] == 4
    results = {r["custom_id"]: r for r in read_table(results_url).to_pylist()}

    reqs = []
    for n, line in enumerate(lines, start=1):
        req = parse_request_line(line.encode(), n)
        reqs.append(GenerationRequest(req.custom_id, to_engine_sampling(req), messages=req.messages))
    bare = [GenerationRequest(f"bare-{r.request_id}", dataclasses.replace(
        r.sampling, logit_bias=(), presence_penalty=0.0, frequency_penalty=0.0), messages=r.messages) for r in reqs]
    want = {r.request_id: r for r in LLM(str(tiny_chat), engine_config=ec).generate(reqs + bare)}
    for cid in bodies:
        assert results[cid]["text"] == want[cid].text, cid
        # The fields changed these answers: a stage that dropped them would not give the same text.
        assert (want[cid].output_token_ids == want[f"bare-{cid}"].output_token_ids) == (cid == "plain"), cid
    assert want["biased"].output_token_ids == [word] * 6
