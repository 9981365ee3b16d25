"""``/v1/responses`` and ``/v1/completions`` rows: read (every field, every bad input a 400 naming
it), tokenized (a completions prompt is raw: no chat template), answered in their endpoint's shape
by ``kvbatch generate``, the pipeline's stages and ``kvbatch serve`` (the official ``openai``
client), and held to docs/batch-api.md's field tables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvbatch.io.batch_output import TokenLogprob, result_line, usage_counts
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, parse_request_line, parse_response_format
from kvbatch.io.endpoints import (
    COMPLETIONS_IGNORED,
    COMPLETIONS_REFUSED,
    RESPONSES_IGNORED,
    RESPONSES_REFUSED,
    _CompletionsBody,
    _ResponsesBody,
)

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["good", "bad"]},
                                           "score": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["label", "score"], "additionalProperties": False}


def line(url: str, body: dict[str, Any], cid: str = "r1", **envelope: Any) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body, **envelope}).encode()


def responses(body: dict[str, Any], **kw: Any) -> ChatRequest | RejectedRow:
    return parse_request_line(line("/v1/responses", body), 4, **kw)


def completions(body: dict[str, Any], **kw: Any) -> ChatRequest | RejectedRow:
    return parse_request_line(line("/v1/completions", body), 4, **kw)


# ---------------------------------------------------------------- /v1/responses: reading


def test_responses_string_input_is_one_user_message_and_fields_map_to_sampling() -> None:
    got = responses({"model": "gpt-4.1", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7,
                     "temperature": 0.5, "top_p": 0.9})
    assert isinstance(got, ChatRequest) and got.endpoint == "/v1/responses" and got.prompt is None
    assert got.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    s = got.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.response_format) == (7, 0.5, 0.9, None)
    assert got.model == "gpt-4.1" and got.line_no == 4 and got.custom_id == "r1"
    assert responses({"input": "Hi"}, default_max_tokens=33).sampling.max_tokens == 33  # the reader's default


def test_responses_message_list_with_text_parts_reads_like_chat() -> None:
    got = responses({"input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"role": "user", "content": "d"}]})
    chat = parse_request_line(line("/v1/chat/completions", {"messages": [
        {"role": "developer", "content": "Rules."}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                               {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]}), 4)
    assert isinstance(got, ChatRequest) and isinstance(chat, ChatRequest)
    assert got.messages == chat.messages  # developer -> system, parts joined with "\n"


@pytest.mark.parametrize("fmt, expect", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "out", "schema": SCHEMA, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}),
    ({"type": "json_schema", "name": "out", "schema": SCHEMA},
     {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA}}),
])
def test_text_format_is_chats_response_format(fmt: dict, expect: dict | None) -> None:
    """``text.format`` keeps name/schema/strict in ``format`` itself; it becomes the canonical format
    chat's nested ``response_format`` does, so one schema is one grammar whichever endpoint asks."""
    got = responses({"input": "x", "text": {"format": fmt}})
    assert isinstance(got, ChatRequest)
    assert got.sampling.response_format == (None if expect is None else parse_response_format(expect))


RESPONSES_BAD = [
    ({}, "body.input", "required field is missing"),
    ({"input": 3}, "body.input", "must be a string or a non-empty list of messages"),
    ({"input": []}, "body.input", "non-empty list"),
    ({"input": ["hi"]}, "body.input.0", "must be a message object"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "body.input.0.type",
     "only message, function_call and function_call_output items are supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "body.input.0.role", "must be one of"),
    ({"input": [{"role": "user"}]}, "body.input.0.content", "required field is missing"),
    ({"input": [{"role": "user", "content": 5}]}, "body.input.0.content", "must be a string or a list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "body.input.0.content.0.type", "only input_text parts are supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "body.input.0.content.0.text", "must be a string"),
    ({"input": "x", "instructions": 3}, "body.instructions", "valid string"),
    ({"input": "x", "max_output_tokens": 0}, "body.max_output_tokens", "greater than or equal to 1"),
    ({"input": "x", "max_output_tokens": True}, "body.max_output_tokens", "valid integer"),
    ({"input": "x", "temperature": 2.5}, "body.temperature", "less than or equal to 2"),
    ({"input": "x", "top_p": 0}, "body.top_p", "greater than 0"),
    ({"input": "x", "text": "json"}, "body.text", "must be an object"),
    ({"input": "x", "text": {"verbosity": "low"}}, "body.text.verbosity", "verbosity is not supported"),
    ({"input": "x", "text": {"format": "json"}}, "body.text.format", "must be an object"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "body.text.format.type", "must be one of"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "o"}}}, "body.text.format.schema",
     "required field is missing"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": [1]}}}, "body.text.format.schema",
     "must be an object"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}, "strict": "yes"}}},
     "body.text.format.strict", "must be a boolean"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}, "name": 1}}},
     "body.text.format.name", "must be a string"),
]


@pytest.mark.parametrize("body, field, reason", RESPONSES_BAD)
def test_each_bad_responses_field_is_a_400_naming_it(body: dict, field: str, reason: str) -> None:
    got = responses(body)
    assert isinstance(got, RejectedRow) and (got.line_no, got.custom_id, got.field) == (4, "r1", field)
    assert reason in got.reason


# A value of each refused field that would change the answer.
RESPONSES_REFUSED_SAMPLES: dict[str, Any] = {
    "reasoning": {"effort": "high"},
    "previous_response_id": "resp_1", "conversation": "conv_1", "prompt": {"id": "pmpt_1"},
    "include": ["message.output_text.logprobs"], "top_logprobs": 3, "truncation": "auto",
    "context_management": [{"type": "compaction"}], "moderation": {"model": "omni-moderation-latest"},
    "image": {"size": "1024x1024"}, "access_programs": {"type": "x"},
}
RESPONSES_NEUTRAL = {"tools": [], "tool_choice": "auto", "reasoning": {}, "include": [], "top_logprobs": 0,
                     "truncation": "disabled", "context_management": [], "previous_response_id": None,
                     "text": {"format": {"type": "text"}, "verbosity": "medium"}}
RESPONSES_IGNORED_SAMPLES = {
    "metadata": {"team": "x"}, "store": False, "stream": False, "stream_options": {"include_obfuscation": False},
    "user": "u", "safety_identifier": "s", "service_tier": "flex", "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit"},
    "max_tool_calls": 3, "background": False, "background_options": {}}


@pytest.mark.parametrize("name", sorted(RESPONSES_REFUSED_SAMPLES))
def test_each_refused_responses_field_is_a_400_naming_it(name: str) -> None:
    got = responses({"input": "x", name: RESPONSES_REFUSED_SAMPLES[name]})
    assert isinstance(got, RejectedRow) and got.field == f"body.{name}"
    assert got.reason.startswith(RESPONSES_REFUSED[name][0])


def test_neutral_and_ignored_responses_fields_change_nothing_even_strict() -> None:
    plain = responses({"input": "x"})
    for extra in (RESPONSES_NEUTRAL, RESPONSES_IGNORED_SAMPLES):
        got = responses({"input": "x", **extra}, strict=True)
        assert isinstance(got, ChatRequest) and got == plain and got.unknown_fields == ()


# ---------------------------------------------------------------- /v1/completions: reading


@pytest.mark.parametrize("prompt, expect", [
    ("Once upon", "Once upon"), (["Once upon"], "Once upon"), ([5, 6, 7], (5, 6, 7)), ([[5, 6, 7]], (5, 6, 7)),
    ("", ""),
])
def test_completions_prompt_forms(prompt: Any, expect: Any) -> None:
    got = completions({"prompt": prompt})
    assert isinstance(got, ChatRequest) and got.endpoint == "/v1/completions"
    assert got.prompt == expect and got.messages == []
    assert got.sampling.max_tokens == 16  # OpenAI's default for completions, not the reader's
    assert got.sampling.logprobs is None


def test_completions_fields_map_to_sampling() -> None:
    got = completions({"model": "gpt-3.5-turbo-instruct", "prompt": "x", "max_tokens": 9, "temperature": 0.3,
                       "top_p": 0.5, "stop": "\n", "seed": -4, "logprobs": 3, "n": 1, "best_of": 1, "echo": False,
                       "suffix": None, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
                       "user": "u", "stream": False}, strict=True)
    assert isinstance(got, ChatRequest) and got.model == "gpt-3.5-turbo-instruct"
    s = got.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed, s.logprobs) == (9, 0.3, 0.5, ("\n",), -4, 3)
    assert completions({"prompt": "x", "stop": ["a", "b"]}).sampling.stop == ("a", "b")
    assert (s.logit_bias, s.presence_penalty, s.frequency_penalty) == ((), 0.0, 0.0)  # neutral values


def test_completions_bias_and_penalties_are_a_chat_rows_sampling_fields() -> None:
    knobs = {"logit_bias": {"50": 100, "7": -2.5}, "presence_penalty": 0.5, "frequency_penalty": -2}
    got = completions({"prompt": "x", **knobs}, strict=True)
    chat = parse_request_line(line("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                            **knobs}), 4)
    assert isinstance(got, ChatRequest) and isinstance(chat, ChatRequest)
    assert got.sampling.logit_bias == chat.sampling.logit_bias == ((7, -2.5), (50, 100.0))
    assert (got.sampling.presence_penalty, got.sampling.frequency_penalty) == (0.5, -2.0)
    assert (chat.sampling.presence_penalty, chat.sampling.frequency_penalty) == (0.5, -2.0)


COMPLETIONS_BAD = [
    ({}, "body.prompt", "required field is missing"),
    ({"prompt": ["a", "b"]}, "body.prompt", "an array of 2 prompts is not supported: one row is one completion"),
    ({"prompt": [[1], [2]]}, "body.prompt", "one row per prompt"),
    ({"prompt": []}, "body.prompt", "must be a string, an array of token ids"),
    ({"prompt": None}, "body.prompt", "must be a string"),
    ({"prompt": 7}, "body.prompt", "must be a string"),
    ({"prompt": [1, -2]}, "body.prompt.1", "a token id must be between 0"),
    ({"prompt": [[1, "x"]]}, "body.prompt.0", "non-empty array of token ids"),
    ({"prompt": [True]}, "body.prompt.0", "must be a string or a non-empty array of token ids"),
    ({"prompt": "x", "max_tokens": 0}, "body.max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "logprobs": 6}, "body.logprobs", "less than or equal to 5"),
    ({"prompt": "x", "logprobs": True}, "body.logprobs", "valid integer"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "body.stop", "at most 4"),
    ({"prompt": "x", "stop": [""]}, "body.stop.0", "at least 1 character"),
    ({"prompt": "x", "seed": 1.5}, "body.seed", "valid integer"),
    ({"prompt": "x", "temperature": -1}, "body.temperature", "greater than or equal to 0"),
    # logit_bias and the penalties: a chat row's rules (tests/test_penalties.py), the same reasons.
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "body.logit_bias", 'key "abc" is not a token id'),
    ({"prompt": "x", "logit_bias": {"5": 100.5}}, "body.logit_bias",
     "the bias of token 5 must be a number in [-100, 100], got 100.5"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "body.logit_bias", "has 301 entries, at most 300"),
    ({"prompt": "x", "logit_bias": [1]}, "body.logit_bias", "must be an object of token ids to biases, got array"),
    ({"prompt": "x", "presence_penalty": 2.5}, "body.presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "frequency_penalty": "1"}, "body.frequency_penalty", "valid number"),
    ({"prompt": "x", "presence_penalty": False}, "body.presence_penalty", "valid number"),
]


@pytest.mark.parametrize("body, field, reason", COMPLETIONS_BAD)
def test_each_bad_completions_field_is_a_400_naming_it(body: dict, field: str, reason: str) -> None:
    got = completions(body)
    assert isinstance(got, RejectedRow) and (got.line_no, got.custom_id, got.field) == (4, "r1", field)
    assert reason in got.reason


COMPLETIONS_REFUSED_SAMPLES: dict[str, Any] = {
    "best_of": 3, "suffix": "def f():",
}


@pytest.mark.parametrize("name", sorted(COMPLETIONS_REFUSED_SAMPLES))
def test_each_refused_completions_field_is_a_400_naming_it(name: str) -> None:
    got = completions({"prompt": "x", name: COMPLETIONS_REFUSED_SAMPLES[name]})
    assert isinstance(got, RejectedRow) and got.field == f"body.{name}"
    assert got.reason.startswith(COMPLETIONS_REFUSED[name][0])


def test_a_row_wrong_in_several_ways_gives_every_reason_and_unknown_fields_follow_strict() -> None:
    got = completions({"prompt": ["a", "b"], "temperature": 9, "suffix": "x"})
    assert isinstance(got, RejectedRow) and got.field == "body.temperature"
    assert "; body.prompt: an array of 2 prompts" in got.reason and "; body.suffix: suffix (insertion)" in got.reason
    lenient = responses({"input": "x", "max_output_token": 5})
    assert isinstance(lenient, ChatRequest) and lenient.unknown_fields == ("body.max_output_token",)
    strict = responses({"input": "x", "max_output_token": 5}, strict=True)
    assert isinstance(strict, RejectedRow) and strict.field == "body.max_output_token"


def test_envelope_problems_name_the_field() -> None:
    other = parse_request_line(line("/v1/embeddings", {"input": "x"}), 2)
    assert isinstance(other, RejectedRow) and other.field == "url"
    assert "'/v1/chat/completions', '/v1/responses', '/v1/completions'" in other.reason
    get = parse_request_line(line("/v1/completions", {"prompt": "x"}, method="GET"), 2)
    assert isinstance(get, RejectedRow) and get.field == "method"
    no_body = parse_request_line(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses"}).encode(), 2)
    assert isinstance(no_body, RejectedRow) and no_body.field == "body"


# ---------------------------------------------------------------- docs/batch-api.md's tables

DOCS = Path(__file__).resolve().parents[1] / "docs" / "batch-api.md"


def field_table(heading: str) -> dict[str, str]:
    """{field: "honoured" | "refused" | "ignored"} of the docs section ``heading``."""
    section = DOCS.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \|", section, re.M)
    table = dict(rows)
    assert len(table) == len(rows), "a field is in the table twice"
    return table


def _client_fields(*models: Any) -> set[str]:
    return {name for m in models for name in m.__annotations__}


def test_responses_field_table_is_the_code_and_covers_the_openai_request() -> None:
    from openai.types.responses import response_create_params as params

    table = field_table("`/v1/responses` rows")
    assert _client_fields(params.ResponseCreateParamsBase, params.ResponseCreateParamsNonStreaming) <= set(table)
    assert {f for f, k in table.items() if k == "refused"} == set(RESPONSES_REFUSED) == set(RESPONSES_REFUSED_SAMPLES)
    assert {f for f, k in table.items() if k == "ignored"} == RESPONSES_IGNORED | {"model"}
    assert RESPONSES_IGNORED == set(RESPONSES_IGNORED_SAMPLES)
    assert {f for f, k in table.items() if k == "honoured"} == (set(_ResponsesBody.model_fields) - {"model"}) | {
        "tools", "tool_choice", "parallel_tool_calls"}


def test_completions_field_table_is_the_code_and_covers_the_openai_request() -> None:
    from openai.types import completion_create_params as params

    table = field_table("`/v1/completions` rows")
    assert _client_fields(params.CompletionCreateParamsBase, params.CompletionCreateParamsNonStreaming) <= set(table)
    refused = {f for f, k in table.items() if k == "refused"}
    assert refused == set(COMPLETIONS_REFUSED) == set(COMPLETIONS_REFUSED_SAMPLES)
    assert {f for f, k in table.items() if k == "ignored"} == COMPLETIONS_IGNORED | {"model"}
    assert {f for f, k in table.items() if k == "honoured"} == set(_CompletionsBody.model_fields) - {"model"}


# ---------------------------------------------------------------- output shapes


def test_responses_line_is_openais_response_object() -> None:
    from openai.types.responses import Response

    done = result_line("r1", 3, text='{"a":1}', finish_reason="stop", prompt_tokens=11, completion_tokens=4,
                       model="m", created=100, endpoint="/v1/responses", cached_tokens=8)
    body = done["response"]["body"]
    parsed = Response.model_validate(body)
    assert parsed.output_text == '{"a":1}' and parsed.status == "completed" and parsed.incomplete_details is None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (11, 4, 15)
    assert parsed.usage.input_tokens_details.cached_tokens == 8
    assert parsed.usage.output_tokens_details.reasoning_tokens == 0
    assert body["object"] == "response" and body["created_at"] == 100 and body["id"].startswith("resp_")
    assert usage_counts(body) == (11, 8, 4)
    cut = result_line("r1", 3, text="abc", finish_reason="length", prompt_tokens=2, completion_tokens=3,
                      model="m", endpoint="/v1/responses")["response"]["body"]
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete" and cut["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert done["id"] == result_line("r1", 3, text="", finish_reason="stop", prompt_tokens=1, completion_tokens=0,
                                     model="m")["id"]  # the batch line's id does not depend on the endpoint


def test_completions_line_is_openais_text_completion_with_legacy_logprobs() -> None:
    from openai.types import Completion

    lps = [TokenLogprob(" Hel", -0.5, ((" Hel", -0.5), (" Hi", -1.25))), TokenLogprob("lo", float("-inf"),
                                                                                        (("lo", -9999.0),))]
    body = result_line("c", 1, text=" Hello", finish_reason="length", prompt_tokens=3, completion_tokens=2,
                       model="m", logprobs=lps, endpoint="/v1/completions", cached_tokens=1)["response"]["body"]
    parsed = Completion.model_validate(body)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = parsed.choices[0]
    assert (choice.text, choice.index, choice.finish_reason) == (" Hello", 0, "length")
    assert choice.logprobs.tokens == [" Hel", "lo"] and choice.logprobs.token_logprobs == [-0.5, -9999.0]
    assert choice.logprobs.top_logprobs == [{" Hel": -0.5, " Hi": -1.25}, {"lo": -9999.0}]
    assert choice.logprobs.text_offset == [0, 4]
    assert usage_counts(body) == (3, 1, 2)
    plain = result_line("c", 1, text="x", finish_reason="stop", prompt_tokens=1, completion_tokens=1, model="m",
                        endpoint="/v1/completions")["response"]["body"]
    assert plain["choices"][0]["logprobs"] is None and "prompt_tokens_details" not in plain["usage"]
    with pytest.raises(ValueError, match="endpoint must be one of"):
        result_line("c", 1, text="x", finish_reason="stop", prompt_tokens=1, completion_tokens=1, model="m",
                    endpoint="/v1/embeddings")


# ---------------------------------------------------------------- tokenizing (the tiny model's tokenizer)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    from tests.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat_endpoints"), max_positions=256)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat):
    from kvbatch.engine.text.tokenizer import ChatTokenizer

    return ChatTokenizer.from_model(str(tiny_chat))


def test_a_completions_prompt_is_raw_text_without_the_chat_template(tokenizer, tiny_chat) -> None:
    from kvbatch.ops.jobs import Job, tokenize_request
    from kvbatch.ops.shards.prompt_tokens import CachedChatEncoder

    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # a raw prompt may spell a template
    job = tokenize_request(tokenizer, 256, 0, completions({"prompt": text}))
    assert isinstance(job, Job) and job.endpoint == "/v1/completions"
    assert job.prompt_token_ids == tokenizer._tok.encode(text, add_special_tokens=True).ids
    im_start = tokenizer._tok.token_to_id("<|im_start|>")
    assert job.prompt_token_ids.count(im_start) == 2  # control tokens in a raw prompt are control tokens
    from transformers import AutoTokenizer

    assert job.prompt_token_ids == AutoTokenizer.from_pretrained(str(tiny_chat))(text)["input_ids"]  # as HF does
    chat = tokenize_request(tokenizer, 256, 0, parse_request_line(line("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}]}), 1))
    assert job.prompt_token_ids != tokenizer.encode_chat([{"role": "user", "content": text}])
    plain = tokenize_request(tokenizer, 256, 0, completions({"prompt": "Hi"}))
    assert plain.prompt_token_ids == tokenizer.encode("Hi") != chat.prompt_token_ids  # no template around it
    ids = tokenize_request(CachedChatEncoder(tokenizer), 256, 0, completions({"prompt": [[7, 8, 9]]}))
    assert ids.prompt_token_ids == [7, 8, 9]


def test_a_responses_row_renders_like_the_chat_row_it_equals(tokenizer) -> None:
    from kvbatch.ops.jobs import tokenize_request

    resp = tokenize_request(tokenizer, 256, 0, responses({"input": "Hi", "instructions": "Be brief."}))
    chat = tokenize_request(tokenizer, 256, 0, parse_request_line(line("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}), 1))
    assert resp.prompt_token_ids == chat.prompt_token_ids and resp.endpoint == "/v1/responses"


@pytest.mark.parametrize("body, field, reason", [
    ({"prompt": [5, 10**6]}, "body.prompt", "token id 1000000 is outside the model's vocabulary"),
    ({"prompt": ""}, "body.prompt", "the prompt is empty"),
    ({"prompt": "word " * 300}, "body.prompt", "the context window is 256"),
])
def test_completions_prompts_that_cannot_run_are_400s(tokenizer, body, field, reason) -> None:
    from kvbatch.ops.jobs import Rejected, tokenize_request

    got = tokenize_request(tokenizer, 256, 0, completions(body))
    assert isinstance(got, Rejected) and got.row.field == field and reason in got.row.reason


def test_responses_prompt_and_schema_problems_name_responses_fields(tokenizer) -> None:
    from kvbatch.ops.jobs import Rejected, tokenize_request

    long = tokenize_request(tokenizer, 64, 0, responses({"input": "word " * 100}))
    assert isinstance(long, Rejected) and long.row.field == "body.input"
    bad = tokenize_request(tokenizer, 256, 0, responses({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "b", "schema": {"type": "frobnicate"}}}}))
    assert isinstance(bad, Rejected) and bad.row.field == "body.text.format.schema"
    assert "the JSON schema cannot be compiled" in bad.row.reason


def test_the_columnar_shard_tokenizer_equals_the_per_row_path_on_mixed_endpoints(tokenizer) -> None:
    """Completions rows (raw prompts) take the per-row path inside a columnar batch and join the chat
    rows' columns in row order; a too-long prompt is refused under its own endpoint's field."""
    import pyarrow as pa

    from kvbatch.io.prompt_table import PROMPTS_SCHEMA, request_record
    from kvbatch.ops.jobs import prompt_ids
    from kvbatch.ops.shards.prompt_columns import ColumnarTokenizer
    from kvbatch.ops.shards.prompt_tokens import CachedChatEncoder

    long = "word " * 80
    reqs = [parse_request_line(line(url, body, cid=f"r{i}"), i + 1) for i, (url, body) in enumerate([
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/responses", {"input": long}),
        ("/v1/responses", {"input": "Hi"}),
        ("/v1/completions", {"prompt": [3, 4, 5]}),
        ("/v1/completions", {"prompt": long}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}),
    ])]
    table = pa.Table.from_pylist([request_record(r) for r in reqs], PROMPTS_SCHEMA)
    encoder = CachedChatEncoder(tokenizer)
    out = ColumnarTokenizer(encoder, 64, "00" * 32, 16).tokenize(table)
    expect = [prompt_ids(encoder, 64, r) for r in reqs]
    assert out.ok.tolist() == [not isinstance(e, RejectedRow) for e in expect] == [1, 1, 0, 1, 1, 0, 0]
    ids, _ = out.take(out.ok.nonzero()[0])
    assert ids.to_pylist() == [e for e in expect if not isinstance(e, RejectedRow)]
    assert [(r.custom_id, r.field) for r in out.rejects] == [("r2", "body.input"), ("r5", "body.prompt"),
                                                            ("r6", "body.messages")]
    assert [(r.custom_id, r.field) for r in expect if isinstance(r, RejectedRow)] == [
        (r.custom_id, r.field) for r in out.rejects]


def test_response_cache_key_tells_a_raw_completion_from_a_chat_row(tokenizer) -> None:
    """The cache keys on the prompt's token ids: a completion of the raw text ``Hi`` and a chat row
    saying ``Hi`` are different prompts, so different keys; the shape is applied after the answer."""
    from kvbatch.ops.decode.response_cache import row_key
    from kvbatch.ops.jobs import tokenize_request

    raw = tokenize_request(tokenizer, 256, 0, completions({"prompt": "Hi", "temperature": 0, "max_tokens": 5}))
    chat = tokenize_request(tokenizer, 256, 0, parse_request_line(line("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 5}), 1))
    assert raw.sampling == chat.sampling
    k_raw, k_chat = (row_key("engine", j.prompt_token_ids, j.sampling) for j in (raw, chat))
    assert k_raw is not None and k_chat is not None and k_raw != k_chat


# ---------------------------------------------------------------- kvbatch generate, end to end


def _mixed_rows() -> list[str]:
    def row(cid: str, url: str, body: dict) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})

    return [
        row("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                                             "temperature": 0}),
        row("resp", "/v1/responses", {"input": "Hi", "max_output_tokens": 6, "temperature": 0}),
        row("resp-json", "/v1/responses", {"input": "Rate it", "max_output_tokens": 60, "temperature": 0,
                                           "text": {"format": {"type": "json_schema", "name": "rating",
                                                               "schema": SCHEMA, "strict": True}}}),
        row("cmpl", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                                        "logprobs": 2}),
        row("cmpl-ids", "/v1/completions", {"prompt": [[9, 10, 11, 12]], "temperature": 0}),
        row("cmpl-bad", "/v1/completions", {"prompt": ["a", "b"]}),
        row("resp-bad", "/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}),
    ]


@pytest.mark.slow
def test_generate_answers_each_row_in_its_endpoints_shape(tiny_chat, tmp_path) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    from kvbatch.cli.main import main
    from kvbatch.engine import LLM, GenerationRequest, SamplingParams

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(_mixed_rows()) + "\n")
    code = main(["generate", "--model", str(tiny_chat), "--input", str(src), "--output", str(out), "--no-progress",
                 "--strict"])
    got = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert code == 1 and list(got) == ["chat", "resp", "resp-json", "cmpl", "cmpl-ids", "cmpl-bad", "resp-bad"]
    body = {cid: o["response"]["body"] for cid, o in got.items()}
    chat = ChatCompletion.model_validate(body["chat"])
    resp = Response.model_validate(body["resp"])
    assert resp.output_text == chat.choices[0].message.content  # the same conversation, another shape
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    rated = Response.model_validate(body["resp-json"])
    assert rated.status == "completed"
    jsonschema.validate(json.loads(rated.output_text), SCHEMA)

    # The completions rows equal the engine run on the raw prompt's tokens, no template.
    llm = LLM(str(tiny_chat))
    tok = llm.tokenizer
    raw_ids = tok._tok.encode("Once upon a time", add_special_tokens=True).ids
    ref = {r.request_id: r for r in llm.generate([
        GenerationRequest("cmpl", SamplingParams(max_tokens=5, temperature=0, logprobs=2), prompt_token_ids=raw_ids),
        GenerationRequest("ids", SamplingParams(max_tokens=16, temperature=0), prompt_token_ids=[9, 10, 11, 12])])}
    for cid, rid in (("cmpl", "cmpl"), ("cmpl-ids", "ids")):
        c = Completion.model_validate(body[cid]).choices[0]
        assert c.text == ref[rid].text and body[cid]["object"] == "text_completion"
        assert body[cid]["usage"]["prompt_tokens"] == len(ref[rid].prompt_token_ids)
        assert body[cid]["usage"]["completion_tokens"] == len(ref[rid].output_token_ids)
    lp = Completion.model_validate(body["cmpl"]).choices[0].logprobs
    assert lp.tokens == [tok.decode([e["token_id"]], skip_special_tokens=False) for e in ref["cmpl"].logprobs]
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in ref["cmpl"].logprobs])
    assert all(len(alts) == 2 for alts in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert got["cmpl-bad"]["error"]["field"] == "body.prompt" and got["resp-bad"]["error"]["field"] == "body.tools"


def test_a_serve_run_refuses_rows_written_for_another_endpoint(tmp_path) -> None:
    from kvbatch.io.batch_requests import read_requests
    from kvbatch.pipelines.batch_api import other_endpoint

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(_mixed_rows()[:4]) + "\n")
    items = [other_endpoint(item, "/v1/responses") for item in read_requests(str(src))]
    assert [isinstance(i, ChatRequest) for i in items] == [False, True, True, False]
    assert items[0].field == "url" and "the batch's endpoint is /v1/responses" in items[0].reason


# ---------------------------------------------------------------- the pipeline's stages


def test_ingest_keeps_each_endpoint_and_names_each_endpoints_schema_field(tmp_path) -> None:
    import pyarrow.parquet as pq

    from kvbatch.ops.ingest.prompts import ingest

    bad = {"type": "frobnicate"}
    rows = [line("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "b",
                                                                     "schema": bad}}}, cid="resp-schema"),
            line("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "b", "schema": bad}}}, cid="chat-schema"),
            line("/v1/completions", {"prompt": [[1, 2]]}, cid="ids"), line("/v1/responses", {"input": "x"}, cid="r")]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    report = ingest(str(tmp_path / "in.jsonl"), str(tmp_path / "p.parquet"), str(tmp_path / "r.parquet"))
    assert report.rejects_by_field == {"body.text.format.schema": 1, "body.response_format.json_schema.schema": 1}
    kept = {r["custom_id"]: r for r in pq.read_table(tmp_path / "p.parquet").to_pylist()}
    assert {c: (r["endpoint"], r["prompt"], r["prompt_ids"]) for c, r in kept.items()} == {
        "ids": ("/v1/completions", None, [1, 2]), "r": ("/v1/responses", None, None)}


@pytest.mark.slow
def test_pipeline_stages_carry_each_rows_endpoint(tiny_chat, tmp_path) -> None:
    """Ingest keeps each row's endpoint and raw prompt in the prompts table; the shard step (columnar
    and per row alike) tokenizes a completions prompt without the template; prefill's manifests
    carry the endpoint to decode, which answers every row."""
    import pyarrow.parquet as pq

    from kvbatch.engine import LLM
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.spec import EngineSpec
    from kvbatch.io.kvstore.store import KVStore, KVStoreConfig
    from kvbatch.io.shard_tables import read_table, shard_url
    from kvbatch.ops.decode.shard import decode_shard
    from kvbatch.ops.ingest.prompts import ingest
    from kvbatch.ops.prefill.manifests import read_manifests
    from kvbatch.ops.prefill.prefill import prefill_shard
    from kvbatch.ops.shards.build import build_shards

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(_mixed_rows()) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    report = ingest(str(src), prompts, str(tmp_path / "rejects.parquet"))
    assert (report.valid, report.rejected) == (5, 2)
    assert report.rejects_by_field == {"body.prompt": 1, "body.tools": 1}
    table = {r["custom_id"]: r for r in pq.read_table(prompts).to_pylist()}
    assert {c: r["endpoint"] for c, r in table.items()} == {
        "chat": None, "resp": "/v1/responses", "resp-json": "/v1/responses", "cmpl": "/v1/completions",
        "cmpl-ids": "/v1/completions"}
    assert (table["cmpl"]["prompt"], table["cmpl"]["messages"]) == ("Once upon a time", [])
    assert table["cmpl-ids"]["prompt_ids"] == [9, 10, 11, 12] and table["cmpl-ids"]["prompt"] is None

    def llm(**kw):
        return LLM(str(tiny_chat), engine_config=EngineConfig(batch_invariant=True, max_num_seqs=8), **kw)

    engine = llm()
    ids = {}
    for path in ("columnar", "rows"):
        root = str(tmp_path / path)
        shards = build_shards(engine, prompts, root, 1, rejects_url=str(tmp_path / f"{path}-rejects.parquet"),
                              path=path)
        assert shards.tokenized == 5
        ids[path] = {r["custom_id"]: r["prompt_token_ids"] for r in read_table(shard_url(root, "shards", "0000"))
                     .to_pylist()}
    assert ids["columnar"] == ids["rows"]
    assert ids["rows"]["cmpl"] == engine.tokenizer._tok.encode("Once upon a time", add_special_tokens=True).ids
    assert ids["rows"]["cmpl-ids"] == [9, 10, 11, 12]

    root = str(tmp_path / "columnar")
    fp = EngineSpec(dtype="fp32", block_size=16).kv_fingerprint(engine.checkpoint.fingerprint)
    store = KVStore.from_config(KVStoreConfig(url=str(tmp_path / "kv"), memory_bytes=0), fp)
    manifests = shard_url(root, "manifests", "0000", "manifests.jsonl")
    prefill_shard(llm(kv_store=store), shard_url(root, "shards", "0000"), manifests)
    endpoints = {m.fields["custom_id"]: m.fields.get("endpoint") for m in read_manifests(manifests)}
    assert endpoints == {"chat": None, "resp": "/v1/responses", "resp-json": "/v1/responses",
                         "cmpl": "/v1/completions", "cmpl-ids": "/v1/completions"}
    results_url = shard_url(root, "results", "0000")
    stats = decode_shard(llm(kv_store=store), manifests, results_url)
    assert stats["succeeded"] == 5, stats
    results = {r["custom_id"]: r for r in read_table(results_url).to_pylist()}
    jsonschema.validate(json.loads(results["resp-json"]["text"]), SCHEMA)
    assert results["resp"]["text"] == results["chat"]["text"]


# ---------------------------------------------------------------- kvbatch serve, the official client


@pytest.mark.slow
def test_serve_answers_responses_and_completions_batches_through_the_official_client(tmp_path_factory) -> None:
    import openai
    from openai.types import Completion
    from openai.types.responses import Response

    from tests.test_serve import KEY_A, _done, _lines, _upload, _wait, serve_tiny_model

    base = tmp_path_factory.mktemp("serve_endpoints")
    servers = serve_tiny_model(base, KVBATCH_ROOT=str(base / "root"), KVBATCH_API_KEYS=KEY_A)
    server = next(servers)
    try:
        client: openai.OpenAI = server.client(KEY_A)
        rows = _mixed_rows()
        for endpoint, mine, bad in (("/v1/responses", ["resp", "resp-json"], "resp-bad"),
                                    ("/v1/completions", ["cmpl", "cmpl-ids"], "cmpl-bad")):
            lines = [r for r in rows if json.loads(r)["url"] == endpoint]
            batch = client.batches.create(input_file_id=_upload(client, base / "in.jsonl", lines),
                                          endpoint=endpoint, completion_window="24h")
            assert batch.endpoint == endpoint
            batch = _wait(client, batch.id, _done)
            assert batch.status == "completed", batch
            out = {o["custom_id"]: o["response"]["body"] for o in _lines(client, batch.output_file_id)}
            assert list(out) == mine
            if endpoint == "/v1/responses":
                rated = Response.model_validate(out["resp-json"])
                jsonschema.validate(json.loads(rated.output_text), SCHEMA)
                assert Response.model_validate(out["resp"]).usage.input_tokens > 0
                assert batch.usage.input_tokens == sum(b["usage"]["input_tokens"] for b in out.values())
            else:
                assert all(Completion.model_validate(b).object == "text_completion" for b in out.values())
                assert len(out["cmpl"]["choices"][0]["logprobs"]["tokens"]) == out["cmpl"]["usage"]["completion_tokens"]
                assert batch.usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in out.values())
            (err,) = _lines(client, batch.error_file_id)
            assert err["custom_id"] == bad and err["response"]["status_code"] == 400
        with pytest.raises(openai.BadRequestError, match="must be one of"):
            client.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    finally:
        servers.close()
