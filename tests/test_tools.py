"""Tool calling: ``tools`` + ``tool_choice`` decoded under llguidance in the template's own
(Hermes) tool-call format, tool-call histories rendered by the template, and the answer parsed into
``message.tool_calls``. The model is the tiny random chat model of test_structured_outputs with
Qwen2.5's chat template, so every valid call below is the grammar's doing (Qwen3's template is
detected and rendered too).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import llguidance
import pytest

from kvbatch.engine import LLM
from kvbatch.engine.text import structured, tool_calls
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.io.batch_output import result_line
from kvbatch.io.batch_requests import ChatRequest, RejectedRow, parse_request_line
from kvbatch.io.request_columns import parse_block
from kvbatch.ops.jobs import Job, Rejected, tokenize_request
from tests.tiny_models import build_tiny_chat_model

# Qwen2.5-Instruct's chat template, as published in its tokenizer_config.json.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# Qwen3's chat template (its thinking turns, and tool calls written after the content).
QWEN3_TEMPLATE = (
    '{%- if tools %}\n'
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    '    {%- endif %}\n'
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are pro'
    'vided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n'
    '        {{- "\\n" }}\n'
    '        {{- tool | tojson }}\n'
    '    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments'
    ' within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <'
    'args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    '{%- else %}\n'
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    '    {%- endif %}\n'
    '{%- endif %}\n'
    '{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n'
    '{%- for message in messages[::-1] %}\n'
    '    {%- set index = (messages|length - 1) - loop.index0 %}\n'
    '    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(messa'
    "ge.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    '        {%- set ns.multi_step_tool = false %}\n'
    '        {%- set ns.last_query_index = index %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- for message in messages %}\n'
    '    {%- if message.content is string %}\n'
    '        {%- set content = message.content %}\n'
    '    {%- else %}\n'
    "        {%- set content = '' %}\n"
    '    {%- endif %}\n'
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {%- set reasoning_content = '' %}\n"
    '        {%- if message.reasoning_content is string %}\n'
    '            {%- set reasoning_content = message.reasoning_content %}\n'
    '        {%- else %}\n'
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>"
    "')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    '            {%- endif %}\n'
    '        {%- endif %}\n'
    '        {%- if loop.index0 > ns.last_query_index %}\n'
    '            {%- if loop.last or (not loop.last and reasoning_content) %}\n'
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    '            {%- else %}\n'
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    '            {%- endif %}\n'
    '        {%- else %}\n'
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    '        {%- endif %}\n'
    '        {%- if message.tool_calls %}\n'
    '            {%- for tool_call in message.tool_calls %}\n'
    '                {%- if (loop.first and content) or (not loop.first) %}\n'
    "                    {{- '\\n' }}\n"
    '                {%- endif %}\n'
    '                {%- if tool_call.function %}\n'
    '                    {%- set tool_call = tool_call.function %}\n'
    '                {%- endif %}\n'
    '                {{- \'<tool_call>\\n{"name": "\' }}\n'
    '                {{- tool_call.name }}\n'
    '                {{- \'", "arguments": \' }}\n'
    '                {%- if tool_call.arguments is string %}\n'
    '                    {{- tool_call.arguments }}\n'
    '                {%- else %}\n'
    '                    {{- tool_call.arguments | tojson }}\n'
    '                {%- endif %}\n'
    "                {{- '}\\n</tool_call>' }}\n"
    '            {%- endfor %}\n'
    '        {%- endif %}\n'
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    '        {%- endif %}\n'
    "        {{- '\\n<tool_response>\\n' }}\n"
    '        {{- content }}\n'
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    '        {%- endif %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|im_start|>assistant\\n' }}\n"
    '    {%- if enable_thinking is defined and enable_thinking is false %}\n'
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    '    {%- endif %}\n'
    '{%- endif %}\n'
)

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
HISTORY = [*MESSAGES,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]


def build_qwen_tool_model(folder: Path, smol: Path | None = None) -> Path:
    """The tiny random chat model in ``folder`` with Qwen2.5's chat template (tests/test_tools_pipeline.py
    uses it too); ``smol``: a folder that gets its tokenizer with SmolLM2's own template."""
    build_tiny_chat_model(folder, max_positions=512)
    if smol is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(folder / name, smol / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN25_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny model with Qwen2.5's template, a tokenizer-only folder with SmolLM2's own)."""
    smol = tmp_path_factory.mktemp("tiny_smol_tools")
    return build_qwen_tool_model(tmp_path_factory.mktemp("tiny_chat_tools"), smol), smol


@pytest.fixture(scope="module")
def qwen_chat(models) -> Path:
    return models[0]


@pytest.fixture(scope="module")
def tiny_smollm(models) -> ChatTokenizer:
    return ChatTokenizer.from_model(str(models[1]))


@pytest.fixture(scope="module")
def llm(qwen_chat) -> LLM:
    return LLM(str(qwen_chat))


def _row(body: dict, cid: str = "r") -> ChatRequest | RejectedRow:
    line = json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})
    return parse_request_line(line.encode(), 1)


def _job(tokenizer: ChatTokenizer, body: dict, cid: str = "r") -> Job | Rejected:
    return tokenize_request(tokenizer, 4096, 0, _row(body, cid))


def _answers(llm: LLM, jobs: dict[str, Job]) -> dict[str, dict]:
    """Each job's answer (one engine batch: a shared machine makes every decode step count) as
    its output line's first choice, ``result_line`` given the job's response_format."""
    from kvbatch.engine import GenerationRequest

    results = llm.generate([GenerationRequest(key, job.sampling, prompt_token_ids=job.prompt_token_ids)
                            for key, job in jobs.items()])
    out = {}
    for r in results:
        assert r.error is None, r.error
        job = jobs[r.request_id]
        line = result_line(job.custom_id, job.line_no, text=r.text, finish_reason=r.finish_reason,
                           prompt_tokens=len(r.prompt_token_ids), completion_tokens=len(r.output_token_ids),
                           model="m", response_format=job.sampling.response_format)
        out[r.request_id] = line["response"]["body"]["choices"][0]
    return out


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def answered(llm) -> dict[str, dict]:
    """The engine rows of the tests below, run in one batch."""
    def job(cid: str = "r", **body) -> Job:
        out = _job(llm.tokenizer, {"messages": MESSAGES, "tools": TOOLS, **body}, cid)
        assert isinstance(out, Job), out
        return out

    one = {"parallel_tool_calls": False, "max_tokens": 64}
    jobs = {"required-greedy": job(tool_choice="required", temperature=0.0, **one),
            "required-greedy-again": job(tool_choice="required", temperature=0.0, **one),
            "required-greedy-other": job("other", tool_choice="required", temperature=0.0, **one),
            "required-sampled": job(tool_choice="required", temperature=1.0, seed=5, **one),
            "named": job(tool_choice=NAMED, temperature=1.0, seed=5, **one),
            "none": job(tool_choice="none", max_tokens=4)}
    for seed in range(3):
        jobs[f"auto-{seed}"] = job(temperature=1.0, seed=seed, max_tokens=24)
        assert tool_calls.ToolsSpec.parse(jobs[f"auto-{seed}"].sampling.response_format).choice == "auto"
    return _answers(llm, jobs)


def _validated_calls(choice: dict) -> list[tuple[str, dict]]:
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    out = []
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
        out.append((call["function"]["name"], args))
    return out


def test_template_format_is_detected_by_rendering(llm, tiny_smollm):
    assert llm.tokenizer.tool_call_format == tool_calls.HERMES
    assert tiny_smollm.tool_call_format is None  # ChatML without tools: SmolLM2's template


def test_required_and_named_choices_give_calls_that_validate(answered):
    for key in ("required-greedy", "required-sampled", "named"):
        out = answered[key]
        calls = _validated_calls(out)
        assert len(calls) == 1 and out["message"]["content"] is None
    assert _validated_calls(answered["named"])[0][0] == "get_time"


def test_call_ids_are_deterministic_per_row_and_index(answered):
    ids = [answered[k]["message"]["tool_calls"][0]["id"]
           for k in ("required-greedy", "required-greedy-again", "required-greedy-other")]
    assert ids[0] == ids[1] != ids[2]


def _matcher(llm: LLM, spec: str) -> llguidance.LLMatcher:
    return llguidance.LLMatcher(_lltok(llm), structured.grammar_of(spec), log_level=0)


_LLTOK: dict[int, llguidance.LLTokenizer] = {}


def _lltok(llm: LLM) -> llguidance.LLTokenizer:
    if id(llm) not in _LLTOK:
        tok = llm.tokenizer
        _LLTOK[id(llm)] = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
    return _LLTOK[id(llm)]


def _accepts(llm: LLM, spec: str, text: str) -> bool:
    m = _matcher(llm, spec)
    return m.consume_tokens(llm.tokenizer.encode(text)) and m.is_accepting()


CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_grammar_of_each_choice(llm):
    spec = {c: tool_calls.tools_spec(TOOLS, c, True) for c in ("auto", "required")}
    single = tool_calls.tools_spec(TOOLS, "required", False)
    named = tool_calls.tools_spec(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    # required: calls only, each valid; several unless parallel_tool_calls is false
    assert _accepts(llm, spec["required"], CALL_W) and _accepts(llm, spec["required"], CALL_W + "\n" + CALL_T)
    assert not _accepts(llm, spec["required"], "Sure. " + CALL_W)
    assert not _accepts(llm, spec["required"], CALL_W.replace('"days": 2', '"days": 9'))
    assert not _accepts(llm, spec["required"], CALL_W.replace(", ", ",", 1))  # the template's separators
    assert _accepts(llm, single, CALL_W) and not _accepts(llm, single, CALL_W + "\n" + CALL_T)
    assert _accepts(llm, named, CALL_T) and not _accepts(llm, named, CALL_W)
    # auto: free text, or text then valid calls; a started call must be a valid one
    assert _accepts(llm, spec["auto"], "It is sunny.")
    assert _accepts(llm, spec["auto"], "Let me check.\n" + CALL_W + "\n" + CALL_T)
    assert not _accepts(llm, spec["auto"], "Let me check. <tool_call> oops")
    assert not _accepts(llm, spec["auto"], CALL_W + " and more text")


def test_auto_row_is_text_or_valid_calls(answered):
    for seed in range(3):
        out = answered[f"auto-{seed}"]
        if out["finish_reason"] == "tool_calls":
            _validated_calls(out)
        else:
            assert "tool_calls" not in out["message"] and isinstance(out["message"]["content"], str)


def test_call_ids_are_unique_across_a_rows_choices():
    """A row's n choices often make the same calls: each choice's ids are its own, choice 0's are
    the ids a row of one choice gets."""
    spec = tool_calls.tools_spec(TOOLS, "required", True)

    def ids(**kw) -> list[str]:
        line = result_line("r", 1, text=CALL_W + "\n" + CALL_T, finish_reason="stop", prompt_tokens=3,
                           completion_tokens=9, model="m", response_format=spec, **kw)
        return [c["id"] for c in line["response"]["body"]["choices"][0]["message"]["tool_calls"]]

    one, first, second, third = ids(), ids(choice=0), ids(choice=1), ids(choice=2)
    assert one == first and len(set(first + second + third)) == 6
    assert second == ids(choice=1)  # a re-run gives the same ids


def test_auto_text_then_calls_parse_into_content_and_calls():
    spec = tool_calls.tools_spec(TOOLS, "auto", True)
    line = result_line("r", 1, text="Let me check.\n" + CALL_W + "\n" + CALL_T, finish_reason="stop",
                       prompt_tokens=3, completion_tokens=9, model="m", response_format=spec)
    choice = line["response"]["body"]["choices"][0]
    assert choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert choice["finish_reason"] == "tool_calls"
    cut = result_line("r", 1, text=CALL_W[:30], finish_reason="length", prompt_tokens=3, completion_tokens=9,
                      model="m", response_format=spec)["response"]["body"]["choices"][0]
    assert cut["message"] == {"role": "assistant", "content": CALL_W[:30]} and cut["finish_reason"] == "length"


def test_none_renders_tools_and_constrains_nothing(llm, answered):
    job = _job(llm.tokenizer, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4})
    plain = _job(llm.tokenizer, {"messages": MESSAGES, "max_tokens": 4})
    assert isinstance(job, Job) and isinstance(plain, Job)
    assert job.sampling.response_format is None
    assert job.prompt_token_ids == llm.tokenizer.encode_chat(MESSAGES, tools=TOOLS) != plain.prompt_token_ids
    out = answered["none"]
    assert out["finish_reason"] in ("stop", "length") and "tool_calls" not in out["message"]


def test_history_renders_as_transformers_does(qwen_chat):
    import transformers

    ours = ChatTokenizer.from_model(str(qwen_chat))
    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_chat))
    req = _row({"messages": HISTORY, "tools": TOOLS})
    assert isinstance(req, ChatRequest)
    messages = req.messages
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 3}
    for tools in (TOOLS, None):
        expect = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(messages, tools=tools) == expect
        assert ours.encode_chat(messages, tools=tools) == hf(expect, add_special_tokens=False)["input_ids"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in expect
    job = tokenize_request(ours, 4096, 0, req)
    assert isinstance(job, Job) and job.prompt_token_ids == ours.encode_chat(messages, tools=TOOLS)


def test_template_without_tool_format_is_a_row_400_naming_it(tiny_smollm):
    for body, field in (({"messages": MESSAGES, "tools": TOOLS}, "body.tools"),
                        ({"messages": HISTORY}, "body.messages")):
        out = tokenize_request(tiny_smollm, 4096, 0, _row(body))
        assert isinstance(out, Rejected) and out.row.field == field
        assert "has no tool-call format" in out.row.reason and tiny_smollm.source in out.row.reason


def test_invalid_tool_schema_is_a_row_400_naming_the_tool(llm):
    bad = [TOOLS[0], {"type": "function", "function": {"name": "broken", "parameters": {"type": "frobnicate"}}}]
    out = _job(llm.tokenizer, {"messages": MESSAGES, "tools": bad, "tool_choice": "required"})
    assert isinstance(out, Rejected) and out.row.field == "body.tools.1.function.parameters"
    assert "'broken'" in out.row.reason and "frobnicate" in out.row.reason
    assert isinstance(_job(llm.tokenizer, {"messages": MESSAGES, "tools": TOOLS}), Job)


def test_slow_tool_schema_is_refused(llm, monkeypatch):
    monkeypatch.setattr(structured, "COMPILE_TIME_LIMIT_S", 0.0)
    tools = [{"type": "function", "function": {"name": "slowpoke", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}}}]
    out = _job(llm.tokenizer, {"messages": MESSAGES, "tools": tools})
    assert isinstance(out, Rejected) and "'slowpoke'" in out.row.reason and "over the 0s limit" in out.row.reason


@pytest.mark.parametrize("body, field, words", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "body.tool_choice", "'required'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "body.tool_choice.function.name", "not one of the tools"),
    ({"tool_choice": "required"}, "body.tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "body.parallel_tool_calls", "boolean"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "body.tools.1.function.name", "names two tools"),
    ({"tools": [{"type": "retrieval"}]}, "body.tools.0.type", "only 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "body.tools.0.function.name", "letters"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "body.tools", "cannot be combined"),
])
def test_bad_tool_fields_are_rejected_naming_the_field(body, field, words):
    out = _row({"messages": MESSAGES, **body})
    assert isinstance(out, RejectedRow) and out.field == field and words in out.reason, out


def test_neutral_tool_fields_change_nothing():
    plain = _row({"messages": MESSAGES})
    for extra in ({"tools": []}, {"tool_choice": "none"}, {"parallel_tool_calls": True}):
        assert _row({"messages": MESSAGES, **extra}) == plain


def test_columnar_reader_sends_tool_rows_per_row():
    lines = [json.dumps({"custom_id": f"c{i}", "messages": m}).encode()
             for i, m in enumerate([MESSAGES, HISTORY[:2] + [{"role": "user", "content": "ok"}],
                                    [*MESSAGES, {"role": "assistant", "content": "x",
                                                 "tool_calls": HISTORY[1]["tool_calls"]}]])]
    lines.append(json.dumps({"custom_id": "t", "messages": MESSAGES, "tools": TOOLS}).encode())
    _, slow = parse_block(lines, 1)
    assert sorted(int(i) for i in slow) == [1, 2, 3]


def test_strict_tool_refuses_unimplemented_keywords_and_non_strict_ignores_them(llm):
    def tool(strict: bool) -> list[dict]:
        return [{"type": "function", "function": {"name": "fmt", "strict": strict, "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}}}]

    refused = _job(llm.tokenizer, {"messages": MESSAGES, "tools": tool(True)})
    assert isinstance(refused, Rejected) and "'fmt'" in refused.row.reason
    assert isinstance(_job(llm.tokenizer, {"messages": MESSAGES, "tools": tool(False)}), Job)
    assert structured.COMPILE_TIME_LIMIT_S == 2.0  # the limit docs/tools.md states


# ---------------------------------------------------------------------------- /v1/responses


def _responses(body: dict) -> ChatRequest | RejectedRow:
    line = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body})
    return parse_request_line(line.encode(), 1)


def _flat(tool: dict, strict: bool) -> dict:
    return {"type": "function", **tool["function"], "strict": strict}


def test_responses_tools_and_history_read_as_the_chat_row_with_the_same_tools():
    strict = [True, False]
    chat_tools = [{"type": "function", "function": {**t["function"], "strict": s}} for t, s in zip(TOOLS, strict)]
    items = [MESSAGES[0], {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                           "arguments": '{"city": "Paris", "days": 3}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"}]
    resp = _responses({"input": items, "tools": [_flat(t, s) for t, s in zip(TOOLS, strict)],
                       "tool_choice": {"type": "function", "name": "get_time"}, "parallel_tool_calls": False})
    chat = _row({"messages": HISTORY, "tools": chat_tools, "tool_choice": NAMED, "parallel_tool_calls": False})
    assert isinstance(resp, ChatRequest) and isinstance(chat, ChatRequest)
    assert resp.sampling.response_format == chat.sampling.response_format and resp.messages == chat.messages
    # a Responses function tool is strict unless it says otherwise (OpenAI's default there)
    default = _responses({"input": "x", "tools": [{k: v for k, v in _flat(TOOLS[0], True).items() if k != "strict"}]})
    assert tool_calls.ToolsSpec.parse(default.sampling.response_format).tools[0]["function"]["strict"] is True


@pytest.mark.parametrize("body, field, words", [
    ({"tools": [{"type": "web_search"}]}, "body.tools", "only 'function' tools"),
    ({"tools": [_flat(TOOLS[0], True)], "tool_choice": {"type": "function", "name": "nope"}},
     "body.tool_choice.name", "not one of the tools"),
    ({"tools": [_flat(TOOLS[0], True)], "text": {"format": {"type": "json_object"}}}, "body.tools",
     "cannot be combined"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "body.input.0",
     "arguments must be a string of a JSON object"),
])
def test_bad_responses_tool_fields_are_rejected_naming_the_field(body, field, words):
    out = _responses({"input": "x", **body})
    assert isinstance(out, RejectedRow) and out.field == field and words in out.reason, out


def test_responses_auto_without_tools_changes_nothing():
    assert _responses({"input": "x", "tool_choice": "auto"}) == _responses({"input": "x"})


def test_responses_answer_has_function_call_items_and_echoes_the_tools():
    row = _responses({"input": "x", "tools": [_flat(TOOLS[0], True)], "tool_choice": "required"})
    spec = row.sampling.response_format
    body = result_line("r", 1, text=CALL_W, finish_reason="stop", prompt_tokens=3, completion_tokens=9, model="m",
                       endpoint="/v1/responses", response_format=spec)["response"]["body"]
    (call,) = body["output"]  # no text before the call: no message item
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Oslo", "days": 2} and call["status"] == "completed"
    assert body["tools"] == [_flat(TOOLS[0], True)] and body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is True and body["status"] == "completed"
    texted = result_line("r", 1, text="Checking.\n" + CALL_W, finish_reason="stop", prompt_tokens=3,
                         completion_tokens=9, model="m", endpoint="/v1/responses",
                         response_format=spec)["response"]["body"]["output"]
    assert [o["type"] for o in texted] == ["message", "function_call"]
    assert texted[0]["content"][0]["text"] == "Checking."


def test_responses_row_renders_its_tools_and_a_bad_schema_is_named_flat(llm):
    req = _responses({"input": "Weather in Paris for 3 days?", "tools": [_flat(t, True) for t in TOOLS],
                      "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 64,
                      "temperature": 0.0})
    job = tokenize_request(llm.tokenizer, 4096, 0, req)
    assert isinstance(job, Job)
    assert job.prompt_token_ids == llm.tokenizer.encode_chat(req.messages, tools=tool_calls.ToolsSpec.parse(
        req.sampling.response_format).tools)
    broken = {"type": "function", "name": "broken", "parameters": {"type": "frobnicate"}}
    bad = _responses({"input": "x", "tools": [broken]})
    out = tokenize_request(llm.tokenizer, 4096, 0, bad)
    assert isinstance(out, Rejected) and out.row.field == "body.tools.0.parameters" and "'broken'" in out.row.reason


def test_tools_spec_is_part_of_the_response_cache_key():
    import dataclasses

    from kvbatch.engine.runtime.sampling_params import SamplingParams
    from kvbatch.ops.decode.response_cache import row_key

    required = SamplingParams(temperature=0.0, response_format=tool_calls.tools_spec(TOOLS, "required", True))
    single = dataclasses.replace(required, response_format=tool_calls.tools_spec(TOOLS, "required", False))
    assert row_key("engine", [1, 2, 3], required) != row_key("engine", [1, 2, 3], single)


def test_a_tools_grammar_that_allows_no_token_is_a_400_on_body_tools(llm, monkeypatch):
    from kvbatch.ops.decode.loop import Answered, DecodeLoop, Refused
    from kvbatch.ops.decode.report import BatchReport

    width = llm.tokenizer.encode("<")[0]  # a model vocabulary without '<': no call can start
    real = llm.runner.execute

    def narrow(step):
        logits, sampled = real(step)
        return logits[:, :width].contiguous(), sampled

    monkeypatch.setattr(llm.runner, "execute", narrow)
    jobs = [_job(llm.tokenizer, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8}),
            _job(llm.tokenizer, {"messages": MESSAGES, "max_tokens": 3, "temperature": 0.0})]
    jobs[1].index = 1
    report = BatchReport()
    out = {(o.job.index if isinstance(o, Answered) else o.index): o for o in DecodeLoop(llm, jobs, report)}
    assert isinstance(out[0], Refused) and out[0].row.field == "body.tools" and "allows no token" in out[0].row.reason
    assert isinstance(out[1], Answered)


def test_qwen3_template_is_hermes_and_renders_histories_as_transformers_does(models):
    """Qwen3's template writes calls as Qwen2.5's does (after the turn's thinking and content)."""
    import transformers

    folder = models[1].parent / "qwen3_tokenizer"
    shutil.copytree(models[1], folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_TEMPLATE}))
    ours = ChatTokenizer.from_model(str(folder))
    assert ours.tool_call_format == tool_calls.HERMES
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = _row({"messages": HISTORY}).messages
    for tools in (TOOLS, None):
        expect = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(messages, tools=tools) == expect
