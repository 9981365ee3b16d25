"""Tool calling in the model's own format: which format a chat template speaks, the llguidance
grammar that constrains a row with ``tools`` to it, and the generated text parsed back into calls.
Torch-free and io-free: the request reader (:mod:`kvbatch.io.tools`) builds the spec, the
tokenizing step checks the template and writes its format into the spec, the engine compiles the
grammar, the output writer parses.

A row's tools travel as one string, the **tools spec** (the engine's
``SamplingParams.response_format``, so the response cache's key holds it): compact JSON whose first
key is ``"type": "tools"``, then ``tools`` (the OpenAI tools list as the row gave it, in its order:
the template renders it, so key order is kept, not sorted), ``tool_choice`` (``"auto"``,
``"required"``, ``"none"`` or ``{"type": "function", "function": {"name": ...}}``),
``parallel_tool_calls``, ``format`` when it is not Hermes, and ``control_token`` when the format's
marker (``[TOOL_CALLS]``, ``<|python_tag|>``) is a control token of the model's vocabulary (its id:
the grammar names it). The request reader knows no model, so its spec has neither; the tokenizing
step, which knows the template and the vocabulary, rewrites it with :func:`with_format` (a Hermes
spec stays the same string, so its cache keys do not change).

The formats known, each as its templates render an assistant turn's ``tool_calls``:

- **Hermes** (Qwen2.5, Qwen3, Hermes 2/3 and many fine-tunes):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls separated by ``\\n``,
  after the turn's content;
- **Llama 3 JSON** (Llama 3.1, 3.2, 3.3): the turn is one bare ``{"name": "f", "parameters": {...}}``
  (the tools are JSON in the system or first user turn). Their templates refuse a turn of several
  calls, so an answer has at most one, whatever ``parallel_tool_calls`` says. The call may follow
  the ``<|python_tag|>`` control token where the vocabulary has it (decoding drops it);
- **Mistral** (v3 templates: Mistral 7B v0.3, Mixtral 8x22B, Nemo):
  ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``, one list of calls. ``[TOOL_CALLS]`` is
  the control token where the vocabulary has it (what the model was trained to write; decoding drops
  it, so the parser then finds the calls as the list that ends the text), or else its text.

A template is recognised by rendering a probe conversation (:func:`probe`), not by reading its
source: the rendering must hold the probe call in exactly one of those shapes, and the tools list
(:func:`format_of_rendering`). The tokenizing step refuses a row with tools for a template with none.

What each ``tool_choice`` constrains (:func:`grammar_of_tools`):

- ``required``: one or more calls and nothing else; each call's ``name`` is one of the tools and
  its arguments follow that tool's ``parameters`` schema (``strict`` as in ``response_format``:
  unimplemented keywords refused, or ignored when not strict);
- a named function: calls of that function only;
- ``auto``: free text, or calls as above. Hermes and Mistral: text that never spells the call
  marker (``<tool_call>``, ``[TOOL_CALLS]``), or text (possibly empty) followed by calls; the text
  before the first call is the answer's ``content``. Llama: text that does not start with ``{``, or
  one call and nothing else;
- ``none``: the tools are rendered into the prompt and nothing is constrained (the tokenizing step
  gives the engine no grammar);
- ``parallel_tool_calls: false``: at most one call.

Arguments are generated with the template's own separators (``", "`` and ``": "``, what ``tojson``
writes in the rendered history), without other whitespace.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)
TOOLS_TYPE = "tools"
_SPEC_PREFIX = '{"type":"tools"'
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
# The text each format's answer may start its calls with: a control token in the real vocabularies.
MARKERS = {LLAMA3_JSON: PYTHON_TAG, MISTRAL: MISTRAL_MARK}
# The key each format writes a call's arguments under.
_ARGS_KEY = {HERMES: "arguments", LLAMA3_JSON: "parameters", MISTRAL: "arguments"}
# The separators the templates render arguments with (jinja tojson = json.dumps defaults).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_PROBE_NAME = "kvbatch_probe_fn"
_PROBE_TOOL_NAME = "kvbatch_probe_tool_zq"
# Mistral's templates refuse a call id that is not 9 letters or digits; the probe's is one.
_PROBE_ID = "kvbprobe0"


def tools_spec(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool,
               format: str = HERMES, control_token: int | None = None) -> str:
    """The canonical tools spec (see the module docstring); equal requests give equal strings."""
    d: dict[str, Any] = {"type": TOOLS_TYPE, "tools": tools, "tool_choice": tool_choice,
                         "parallel_tool_calls": parallel}
    if format != HERMES:  # absent means Hermes: the specs written before other formats keep their keys
        if format not in FORMATS:
            raise ValueError(f"unknown tool-call format {format!r}")
        d["format"] = format
        if control_token is not None:
            d["control_token"] = control_token
    return json.dumps(d, separators=(",", ":"), ensure_ascii=False)


def is_tools_spec(response_format: str | None) -> bool:
    """Whether a ``response_format`` string is a tools spec (a prefix test: no JSON parse per row)."""
    return response_format is not None and response_format.startswith(_SPEC_PREFIX)


def with_format(spec: str, format: str, control_token: int | None = None) -> str:
    """The tools spec answered in ``format`` (the template's, found by the tokenizing step);
    ``control_token``: the id of the format's marker (:data:`MARKERS`) where it is a control token."""
    ts = ToolsSpec.parse(spec)
    if (ts.format, ts.control_token) == (format, control_token):
        return spec
    return tools_spec(ts.tools, ts.tool_choice, ts.parallel, format, control_token)


@dataclass(frozen=True)
class ToolsSpec:
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel: bool
    format: str = HERMES
    control_token: int | None = None

    @classmethod
    def parse(cls, spec: str) -> ToolsSpec:
        d = json.loads(spec)
        return cls(d["tools"], d["tool_choice"], d["parallel_tool_calls"], d.get("format", HERMES),
                   d.get("control_token"))

    @property
    def choice(self) -> str:
        """``auto``, ``required``, ``none``, or ``named`` (see :attr:`named`)."""
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"

    @property
    def named(self) -> str | None:
        return None if isinstance(self.tool_choice, str) else self.tool_choice["function"]["name"]

    @property
    def several(self) -> bool:
        """Whether an answer may hold more than one call (Llama's templates render only one)."""
        return self.parallel and self.format != LLAMA3_JSON

    def functions(self) -> list[dict[str, Any]]:
        """The ``function`` objects a call may name (only the named one under a named choice)."""
        fns = [t["function"] for t in self.tools]
        return [f for f in fns if f["name"] == self.named] if self.named is not None else fns


# ---------------------------------------------------------------------------- format detection


def probe() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) of the probe conversation a template is rendered with to detect its format."""
    messages = [{"role": "user", "content": "probe"},
                {"role": "assistant", "tool_calls": [{"id": _PROBE_ID, "type": "function", "function": {
                    "name": _PROBE_NAME, "arguments": {"a": 1, "b": "x"}}}]}]
    tools = [{"type": "function", "function": {"name": _PROBE_TOOL_NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    return messages, tools


def format_of_rendering(rendered: str) -> str | None:
    """The tool-call format of a template, given its rendering of :func:`probe` (no generation
    prompt), or None: the probe call must be there in one format's exact shape, and the tools list too."""
    if _PROBE_TOOL_NAME not in rendered:
        return None
    args = '{"a": 1, "b": "x"}'
    if f'{OPEN}\n{{"name": "{_PROBE_NAME}", "arguments": {args}}}\n{CLOSE}' in rendered:
        return HERMES
    # Mistral's templates write the call's id after its arguments: the shape is matched up to them.
    if f'{MISTRAL_MARK} [{{"name": "{_PROBE_NAME}", "arguments": {args}' in rendered:
        return MISTRAL
    if f'{{"name": "{_PROBE_NAME}", "parameters": {args}}}' in rendered:
        return LLAMA3_JSON
    return None


def history_for_format(messages: list[dict[str, Any]], format: str) -> list[dict[str, Any]]:
    """The conversation as the template of ``format`` accepts it. Mistral's templates refuse a call
    id that is not 9 letters or digits (OpenAI's are ``call_`` and 24 more), so each id becomes 9
    hex digits of its hash (a call and its result keep matching ids, as vLLM shortens them)."""
    if format != MISTRAL:
        return messages

    def short(call_id: Any) -> Any:
        if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]

    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "id": short(c.get("id"))} for c in m["tool_calls"]]}
        if "tool_call_id" in m:
            m = {**m, "tool_call_id": short(m["tool_call_id"])}
        out.append(m)
    return out


# ---------------------------------------------------------------------------- grammar


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's ``parameters`` with the JSON options of the format (absent: no arguments)."""
    schema = function.get("parameters") or _NO_PARAMETERS
    options = dict(_JSON_OPTIONS, lenient=not function.get("strict", False))
    return {**schema, "x-guidance": options}


def _lark_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _call_rule(rule: str, function: dict[str, Any], args_key: str) -> str:
    """``rule: {"name": "<name>", "<args_key>": <arguments>}`` as lark."""
    head = _lark_string('{"name": ' + json.dumps(function["name"], ensure_ascii=False) + f', "{args_key}": ')
    return f"{rule}: {head} %json {json.dumps(parameters_schema(function), ensure_ascii=False)} \"}}\""


def _not_spelling(name: str, mark: str) -> list[str]:
    """Lark for free text that never spells ``mark`` (``name``), and for text ending at the first
    ``mark`` (``open``, lazy): a started call is then always a whole, valid one."""
    return [f"{name}: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(mark)}(.|\\n)*/",
            f"open[lazy]: /(.|\\n)*{re.escape(mark)}/"]


def grammar_of_tools(spec: str) -> str:
    """The lark grammar (llguidance) of a tools spec whose choice is not ``none``."""
    ts = ToolsSpec.parse(spec)
    if ts.choice == "none":
        raise ValueError("tool_choice 'none' constrains nothing: it has no grammar")
    fns = ts.functions()
    if not fns:
        raise ValueError(f"tool_choice names function {ts.named!r}, which is not one of the tools")
    args_key = _ARGS_KEY[ts.format]
    bodies = [_call_rule(f"fn_{i}", fn, args_key) for i, fn in enumerate(fns)]
    body = "body: " + " | ".join(f"fn_{i}" for i in range(len(fns)))
    auto = ts.choice == "auto"
    token = f"<[{ts.control_token}]>" if ts.control_token is not None else None
    if ts.format == LLAMA3_JSON:
        # The whole answer is the call (after <|python_tag|>, if the model writes it), or text that
        # cannot be mistaken for one.
        call = f"call: {token} body | body" if token else "call: body"
        start = ["start: TEXT | call", "TEXT: /([^{](.|\\n)*)?/"] if auto else ["start: call"]
        return "\n".join([*start, call, body, *bodies]) + "\n"
    more = " (SEP call_rest)*" if ts.several else ""
    if ts.format == MISTRAL:
        # [TOOL_CALLS] [call, call, ...]: the list is the turn's end. The marker is its control
        # token or its text; text before it never spells it.
        first = _lark_string(" [")
        mark = _lark_string(MISTRAL_MARK) + (f" | {token}" if token else "")
        if auto:
            start = [f"start: TEXT | open {first} calls" + (f" | TEXT {token} {first} calls" if token else ""),
                     *_not_spelling("TEXT", MISTRAL_MARK)]
        else:
            start = [f"start: mark {first} calls", f"mark: {mark}"]
        sep = " (\", \" body)*" if ts.several else ""
        return "\n".join([*start, f"calls: body{sep} \"]\"", body, *bodies]) + "\n"
    if auto:
        start = [f"start: TEXT | open call_rest{more}", *_not_spelling("TEXT", OPEN)]
    else:
        start = [f"start: {_lark_string(OPEN)} call_rest{more}"]
    rules = [*start, f"SEP: {_lark_string(chr(10) + OPEN)}",
             f"call_rest: \"\\n\" body {_lark_string(chr(10) + CLOSE)}", body, *bodies]
    return "\n".join(rules) + "\n"


def function_grammar(function: dict[str, Any]) -> str:
    """One function's call alone, as a lark grammar: what a per-tool schema check compiles, so a
    bad schema is named by its tool (the format's wrapping does not change what compiles)."""
    return _call_rule("start", function, "arguments") + "\n"


# ---------------------------------------------------------------------------- output


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


def _call_of(obj: Any, args_key: str) -> ParsedCall | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(args_key), dict)):
        return None
    return ParsedCall(obj["name"], json.dumps(obj[args_key], ensure_ascii=False))


def parse_tool_calls(text: str, format: str = HERMES,
                     control_token: int | None = None) -> tuple[str | None, list[ParsedCall]] | None:
    """(content before the calls or None, the calls) of an answer in ``format``, or None when the
    text holds no complete call (plain text, or a call cut short by ``max_tokens``). ``arguments``
    is the object re-serialized with ``json.dumps`` (what vLLM's parsers return). ``control_token``:
    the spec's; a Mistral marker written as that token is not in the decoded text."""
    if format == LLAMA3_JSON:
        return _parse_llama(text)
    if format == MISTRAL:
        return _parse_mistral(text, control_token is not None)
    start = text.find(OPEN)
    if start < 0:
        return None
    calls = []
    for m in re.finditer(re.escape(OPEN) + r"\n(.*?)\n" + re.escape(CLOSE), text[start:], re.DOTALL):
        try:
            call = _call_of(json.loads(m.group(1)), "arguments")
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    if not calls:
        return None
    content = text[:start].removesuffix("\n")  # the template writes content, "\n", then the calls
    return (content or None), calls


def _parse_llama(text: str) -> tuple[str | None, list[ParsedCall]] | None:
    """A Llama answer is a call only when it is one, whole (after an optional ``<|python_tag|>``);
    several joined by ``;`` are read too, as vLLM's parser does, though the grammar writes one."""
    rest = text.removeprefix(PYTHON_TAG).strip()
    if not rest.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            obj, at = decoder.raw_decode(rest, at)
        except ValueError:
            return None
        call = _call_of(obj, "parameters") or _call_of(obj, "arguments")
        if call is None:
            return None
        calls.append(call)
        tail = rest[at:].lstrip()
        if not tail:
            return None, calls
        if not tail.startswith(";"):
            return None
        at = len(rest) - len(tail[1:].lstrip())


def _parse_mistral(text: str, marker_dropped: bool) -> tuple[str | None, list[ParsedCall]] | None:
    start = text.find(MISTRAL_MARK)
    if start >= 0:
        calls = _mistral_list(text[start + len(MISTRAL_MARK):])
        return None if calls is None else ((text[:start].strip() or None), calls)
    if not marker_dropped:
        return None
    # The marker was the control token, which decoding drops: the calls are the list of calls that
    # ends the text (the grammar writes nothing after it), the text before them the content.
    for m in re.finditer(r'\[\{"name": ', text):
        calls = _mistral_list(text[m.start():])
        if calls is not None:
            return (text[:m.start()].strip() or None), calls
    return None


def _mistral_list(text: str) -> list[ParsedCall] | None:
    try:
        objs = json.loads(text)
    except ValueError:
        return None
    if not isinstance(objs, list) or not objs:
        return None
    calls = [_call_of(obj, "arguments") for obj in objs]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]
