"""Tool-call formats other than Hermes: Llama 3.1+'s bare JSON call and Mistral's ``[TOOL_CALLS]``
list. Each is detected by rendering the probe conversation through a template written here after
the tool sections of the published Llama 3.1 and Mistral v0.3 templates, constrained by its grammar
and parsed into ``message.tool_calls``, on the tiny random model of tests/test_tools.py (so every
valid call is the grammar's doing)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvbatch.engine import LLM
from kvbatch.engine.text import tool_calls
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.io.batch_output import result_line
from kvbatch.io.batch_requests import ChatRequest
from kvbatch.ops.jobs import Job, Rejected, tokenize_request
from tests.test_tools import (
    HISTORY,
    MESSAGES,
    NAMED,
    TOOLS,
    _accepts,
    _answers,
    _row,
    _validated_calls,
    build_qwen_tool_model,
)

# After Llama 3.1's template: the tools as indented JSON in the first user turn, a call as a bare
# {"name", "parameters"} object (one per turn), a tool result in an ipython turn.
LLAMA_TEMPLATE = r"""{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n\n" + system_message + "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON " }}
    {{- "for a function call with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- " Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) + "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# After Mistral 7B v0.3's template: the tools before the last user turn, a turn's calls as one
# [TOOL_CALLS] list (each call's function as tojson writes it, with its 9-character id appended).
MISTRAL_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}{{- '"' + key + '": "' + val + '"' }}
                    {%- else %}{{- '"' + key + '": ' + val | tojson }}{%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function | tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id | length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] | trim + eos_token }}
    {%- elif message["role"] == "tool" %}
        {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported!") }}
    {%- endif %}
{%- endfor %}
"""

TEMPLATES = {tool_calls.LLAMA3_JSON: LLAMA_TEMPLATE, tool_calls.MISTRAL: MISTRAL_TEMPLATE}
# The same calls in each format, as the model writes them.
CALL_W = {tool_calls.LLAMA3_JSON: '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
          tool_calls.MISTRAL: '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'}
CALL_T = {tool_calls.LLAMA3_JSON: '{"name": "get_time", "parameters": {"zone": "UTC"}}',
          tool_calls.MISTRAL: '{"name": "get_time", "arguments": {"zone": "UTC"}}'}
MARK = tool_calls.MISTRAL_MARK


def _with_template(source: Path, folder: Path, template: str) -> Path:
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny random model once per template (the weights are the same)."""
    base = build_qwen_tool_model(tmp_path_factory.mktemp("tiny_tool_formats"))
    return {fmt: _with_template(base, tmp_path_factory.mktemp(fmt), t) for fmt, t in TEMPLATES.items()}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def fmt_llm(request, folders) -> tuple[str, LLM]:
    return request.param, LLM(str(folders[request.param]))


def _job(llm: LLM, cid: str = "r", **body) -> Job:
    out = tokenize_request(llm.tokenizer, 4096, 0, _row({"messages": MESSAGES, "tools": TOOLS, **body}, cid))
    assert isinstance(out, Job), out
    return out


def test_each_template_is_detected_by_rendering(folders):
    for fmt, folder in folders.items():
        assert ChatTokenizer.from_model(str(folder)).tool_call_format == fmt


def test_the_spec_carries_the_templates_format(fmt_llm):
    fmt, llm = fmt_llm
    spec = tool_calls.ToolsSpec.parse(_job(llm, tool_choice="required").sampling.response_format)
    assert spec.format == fmt and spec.tools == TOOLS
    plain = tool_calls.tools_spec(TOOLS, "auto", True)
    assert tool_calls.with_format(plain, tool_calls.HERMES) == plain and '"format"' not in plain
    assert tool_calls.with_format(tool_calls.with_format(plain, fmt), tool_calls.HERMES) == plain


def test_grammar_of_each_choice(fmt_llm):
    fmt, llm = fmt_llm
    spec = {c: tool_calls.tools_spec(TOOLS, c, True, fmt) for c in ("auto", "required")}
    single = tool_calls.tools_spec(TOOLS, "required", False, fmt)
    named = tool_calls.tools_spec(TOOLS, NAMED, True, fmt)
    w, t = CALL_W[fmt], CALL_T[fmt]
    if fmt == tool_calls.MISTRAL:
        w, t, both = f"{MARK} [{w}]", f"{MARK} [{t}]", f"{MARK} [{w}, {t}]"
        assert _accepts(llm, spec["required"], both) and not _accepts(llm, single, both)
        assert _accepts(llm, spec["auto"], "Let me check. " + both)
        assert not _accepts(llm, spec["auto"], f"Let me check. {MARK} oops")
    else:  # Llama's templates render one call per turn: never two, parallel or not
        assert not _accepts(llm, spec["required"], w + "; " + t) and not _accepts(llm, spec["auto"], w + "; " + t)
        assert not _accepts(llm, spec["auto"], '{"oops": 1}')
        # a call is the whole answer: after text it is text (and parsed as text)
        assert _accepts(llm, spec["auto"], "Sure. " + w) and _parsed(fmt, "Sure. " + w)["finish_reason"] == "stop"
    for s in (spec["required"], single):
        assert _accepts(llm, s, w) and _accepts(llm, s, t)
        assert not _accepts(llm, s, w.replace('"days": 2', '"days": 9'))
        assert not _accepts(llm, s, w.replace(", ", ",", 1))  # the template's separators
        assert not _accepts(llm, s, "It is sunny.")
    assert _accepts(llm, named, t) and not _accepts(llm, named, w)
    assert _accepts(llm, spec["auto"], "It is sunny.") and _accepts(llm, spec["auto"], w)
    assert not _accepts(llm, spec["auto"], w + " and more text")


@pytest.fixture(scope="module")
def answered(fmt_llm) -> tuple[str, dict[str, dict]]:
    """The engine rows of the tests below, run in one batch per format."""
    fmt, llm = fmt_llm
    one = {"parallel_tool_calls": False, "max_tokens": 64}
    jobs = {"required-greedy": _job(llm, tool_choice="required", temperature=0.0, **one),
            "required-sampled": _job(llm, tool_choice="required", temperature=1.0, seed=5, **one),
            "named": _job(llm, tool_choice=NAMED, temperature=1.0, seed=5, **one),
            "none": _job(llm, tool_choice="none", max_tokens=4)}
    for seed in range(3):
        jobs[f"auto-{seed}"] = _job(llm, temperature=1.0, seed=seed, max_tokens=24)
    for seed in PARALLEL_SEEDS:
        jobs[f"parallel-{seed}"] = _job(llm, tool_choice="required", temperature=1.0, seed=seed, max_tokens=96)
    return fmt, _answers(llm, jobs)


PARALLEL_SEEDS = (1, 2, 4)  # seeds under which the tiny model writes several calls in a Mistral list


def test_required_and_named_choices_give_one_call_that_validates(answered):
    _, out = answered
    for key in ("required-greedy", "required-sampled", "named"):
        assert len(_validated_calls(out[key])) == 1 and out[key]["message"]["content"] is None
    assert _validated_calls(out["named"])[0][0] == "get_time"


def test_parallel_calls_validate_and_none_and_auto_behave_as_for_hermes(answered):
    fmt, out = answered
    counts = [len(_validated_calls(out[f"parallel-{seed}"])) for seed in PARALLEL_SEEDS]
    assert max(counts) >= 2 if fmt == tool_calls.MISTRAL else counts == [1] * len(counts)
    assert out["none"]["finish_reason"] in ("stop", "length") and "tool_calls" not in out["none"]["message"]
    for seed in range(3):
        choice = out[f"auto-{seed}"]
        if choice["finish_reason"] == "tool_calls":
            _validated_calls(choice)
        else:
            assert "tool_calls" not in choice["message"] and isinstance(choice["message"]["content"], str)


def _parsed(fmt: str, text: str, choice: str = "auto", finish_reason: str = "stop") -> dict:
    spec = tool_calls.tools_spec(TOOLS, choice, True, fmt)
    line = result_line("r", 1, text=text, finish_reason=finish_reason, prompt_tokens=3, completion_tokens=9,
                       model="m", response_format=spec)
    return line["response"]["body"]["choices"][0]


def test_answers_parse_into_content_and_calls():
    llama, mistral = tool_calls.LLAMA3_JSON, tool_calls.MISTRAL
    for text in (CALL_W[llama], tool_calls.PYTHON_TAG + CALL_W[llama], CALL_W[llama] + "; " + CALL_T[llama]):
        choice = _parsed(llama, text)
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert _parsed(llama, "It is sunny.")["message"] == {"role": "assistant", "content": "It is sunny."}
    assert _parsed(llama, '{"oops": 1}')["finish_reason"] == "stop"
    choice = _parsed(mistral, f"Let me check. {MARK} [{CALL_W[mistral]}, {CALL_T[mistral]}]")
    assert choice["message"]["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    cut = f"{MARK} [{CALL_W[mistral]}"[:30]
    assert _parsed(mistral, cut, "required", "length")["message"] == {"role": "assistant", "content": cut}
    # A Hermes answer read as another format is text: the spec's format decides how it is read.
    assert _parsed(mistral, "<tool_call>\n" + CALL_W[mistral] + "\n</tool_call>")["finish_reason"] == "stop"


def test_histories_render_as_transformers_does(folders):
    import transformers

    for fmt, folder in folders.items():
        ours = ChatTokenizer.from_model(str(folder))
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        req = _row({"messages": HISTORY, "tools": TOOLS})
        assert isinstance(req, ChatRequest)
        # Mistral's templates want 9-character ids: the tokenizing step shortens OpenAI's (call_1 here)
        messages = tool_calls.history_for_format(req.messages, fmt)
        if fmt == tool_calls.MISTRAL:
            short = messages[1]["tool_calls"][0]["id"]
            assert len(short) == 9 and short.isalnum() and messages[2]["tool_call_id"] == short
            with pytest.raises(ValueError, match="length 9"):
                ours.render_chat(req.messages, tools=TOOLS)
        for tools in (TOOLS, None):
            expect = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert ours.render_chat(messages, tools=tools) == expect
        call = CALL_W[fmt].replace("Oslo", "Paris").replace("2}", "3}")
        assert (call if fmt == tool_calls.LLAMA3_JSON else f"{MARK} [{call[:-1]}") in expect
        job = tokenize_request(ours, 4096, 0, req)
        assert isinstance(job, Job) and job.prompt_token_ids == ours.encode_chat(messages, tools=TOOLS)


def test_a_second_call_in_a_llama_history_is_the_templates_400(folders):
    two = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
        for i in range(2)]}, {"role": "user", "content": "thanks"}]
    ours = ChatTokenizer.from_model(str(folders[tool_calls.LLAMA3_JSON]))
    out = tokenize_request(ours, 4096, 0, _row({"messages": two, "tools": TOOLS}))
    assert isinstance(out, Rejected) and out.row.field == "body.messages" and "single tool-calls" in out.row.reason


def test_shards_carry_the_templates_format_in_each_tool_rows_spec(folders, tmp_path):
    """The pipeline's shard step writes the spec the decode step's grammar and parser read: in the
    template's format, on both of its paths, with the prompt ``kvbatch generate`` renders."""
    from kvbatch.io.batch_requests import parse_request_line
    from kvbatch.io.shard_tables import read_table, shard_url
    from kvbatch.ops.ingest.prompts import ingest
    from kvbatch.ops.shards.build import build_shards

    def line(cid: str, **body) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "m", "messages": MESSAGES, "max_tokens": 8, **body}})

    lines = [line("required", tools=TOOLS, tool_choice="required"), line("history", messages=HISTORY, tools=TOOLS),
             line("plain")]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    prompts = str(tmp_path / "prompts.parquet")
    assert ingest(str(src), prompts, str(tmp_path / "rejects.parquet")).valid == len(lines)
    llm = LLM(str(folders[tool_calls.MISTRAL]))
    jobs = {}
    for text in lines:
        job = tokenize_request(llm.tokenizer, 4096, 0, parse_request_line(text.encode(), 1))
        assert isinstance(job, Job), job
        jobs[json.loads(text)["custom_id"]] = job
    for path in ("columnar", "rows"):
        root = str(tmp_path / path)
        built = build_shards(llm, prompts, root, 1, path=path, rejects_url=str(tmp_path / f"{path}-rejects.parquet"))
        assert built.tokenized == len(lines)
        rows = {r["custom_id"]: r for r in read_table(shard_url(root, "shards", "0000")).to_pylist()}
        for cid, job in jobs.items():
            assert rows[cid]["prompt_token_ids"] == job.prompt_token_ids
            assert rows[cid]["response_format"] == job.sampling.response_format
        assert tool_calls.ToolsSpec.parse(rows["required"]["response_format"]).format == tool_calls.MISTRAL
        assert rows["plain"]["response_format"] is None


# Two unused control tokens of the tiny vocabulary renamed to the formats' markers, as the real
# Mistral v3 and Llama 3 vocabularies have them (decoding drops them from the text).
CONTROL = {tool_calls.MISTRAL_MARK: 5, tool_calls.PYTHON_TAG: 6}


@pytest.fixture(scope="module")
def control_llms(folders, tmp_path_factory) -> dict[str, LLM]:
    out = {}
    for fmt, source in folders.items():
        folder = tmp_path_factory.mktemp(f"{fmt}_control")
        shutil.copytree(source, folder, dirs_exist_ok=True)
        tok = json.loads((folder / "tokenizer.json").read_text())
        for added in tok["added_tokens"]:
            for text, token_id in CONTROL.items():
                if added["id"] == token_id:
                    tok["model"]["vocab"][text] = tok["model"]["vocab"].pop(added["content"])
                    added["content"] = text
        (folder / "tokenizer.json").write_text(json.dumps(tok))
        out[fmt] = LLM(str(folder))
    return out


def test_a_marker_that_is_a_control_token_is_written_as_one(control_llms):
    mistral, llama = tool_calls.MISTRAL, tool_calls.LLAMA3_JSON
    jobs = {}
    for fmt, llm in control_llms.items():
        token = CONTROL[tool_calls.MARKERS[fmt]]
        spec = tool_calls.ToolsSpec.parse(_job(llm, tool_choice="required").sampling.response_format)
        assert (spec.format, spec.control_token) == (fmt, token)
        w = CALL_W[fmt] if fmt == llama else f" [{CALL_W[fmt]}, {CALL_T[fmt]}]"
        rf = _job(llm).sampling.response_format
        ids = llm.tokenizer.encode
        assert _accepts_ids(llm, rf, [token, *ids(w)]) and _accepts_ids(llm, rf, ids("It is sunny."))
        if fmt == mistral:  # the marker's text still does; text before the token is content
            assert _accepts_ids(llm, rf, ids(MARK + w)) and _accepts_ids(llm, rf, [*ids("Well."), token, *ids(w)])
        # the model picks the control token when the grammar allows it: a bias makes it
        bias = {"logit_bias": {str(token): 100}, "max_tokens": 96, "parallel_tool_calls": False}
        jobs[f"{fmt}-auto"] = _job(llm, f"{fmt}-a", temperature=1.0, seed=3, **bias)
        jobs[f"{fmt}-required"] = _job(llm, f"{fmt}-r", tool_choice="required", temperature=0.0, **bias)
        out = _answers(llm, {k: v for k, v in jobs.items() if k.startswith(fmt)})
        for key, choice in out.items():
            assert len(_validated_calls(choice)) == 1 and choice["message"]["content"] is None, key
    # A Mistral answer whose marker was the control token: the list that ends the text is the calls.
    spec = tool_calls.tools_spec(TOOLS, "auto", True, mistral, 5)
    line = result_line("r", 1, text=f"Well. [{CALL_W[mistral]}, {CALL_T[mistral]}]", finish_reason="stop",
                       prompt_tokens=3, completion_tokens=9, model="m", response_format=spec)
    message = line["response"]["body"]["choices"][0]["message"]
    assert message["content"] == "Well." and len(message["tool_calls"]) == 2
    assert tool_calls.parse_tool_calls(f"Well. [{CALL_W[mistral]}]", mistral) is None  # a text marker was due


def _accepts_ids(llm: LLM, spec: str, ids: list[int]) -> bool:
    from tests.test_tools import _matcher

    m = _matcher(llm, spec)
    return m.consume_tokens(ids) and m.is_accepting()
