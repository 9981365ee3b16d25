"""Tool calling in the model's own format: which format a chat template speaks, the llguidance
grammar that constrains a row with ``tools`` to it, and the generated text parsed back into calls.
Torch-free and io-free: the request reader (:mod:`kvbatch.io.tools`) builds the spec, the
tokenizing step checks the template, the engine compiles the grammar, the output writer parses.

A row's tools travel as one string, the **tools spec** (the engine's
``SamplingParams.response_format``, so the response cache's key holds it): compact JSON whose first
key is ``"type": "tools"``, then ``tools`` (the OpenAI tools list as the row gave it, in its order:
the template renders it, so key order is kept, not sorted), ``tool_choice`` (``"auto"``,
``"required"``, ``"none"`` or ``{"type": "function", "function": {"name": ...}}``) and
``parallel_tool_calls``.

The one format known is **Hermes** (Qwen2.5, Qwen3, Hermes 2/3 and many fine-tunes):
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls separated by ``\\n``, as
their templates render an assistant turn's ``tool_calls``. A template is recognised by rendering a
probe conversation (:func:`probe`), not by reading its source: the rendering must hold the probe
call in exactly that shape, and the tools list (:func:`format_of_rendering`). The tokenizing step
refuses a row with tools for a template without the format, so a spec reaching the engine is
always Hermes.

What each ``tool_choice`` constrains (:func:`grammar_of_tools`):

- ``required``: one or more calls and nothing else; each call's ``name`` is one of the tools and
  its ``arguments`` follow that tool's ``parameters`` schema (``strict`` as in
  ``response_format``: unimplemented keywords refused, or ignored when not strict);
- a named function: calls of that function only;
- ``auto``: free text that never spells ``<tool_call>``, or text (possibly empty) followed by
  calls as above; the text before the first call is the answer's ``content``;
- ``none``: the tools are rendered into the prompt and nothing is constrained (the tokenizing step
  gives the engine no grammar);
- ``parallel_tool_calls: false``: at most one call.

Arguments are generated with the template's own separators (``", "`` and ``": "``, what ``tojson``
writes in the rendered history), without other whitespace.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

HERMES = "hermes"
TOOLS_TYPE = "tools"
_SPEC_PREFIX = '{"type":"tools"'
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The separators Hermes templates render arguments with (jinja tojson = json.dumps defaults).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_PROBE_NAME = "kvbatch_probe_fn"
_PROBE_TOOL_NAME = "kvbatch_probe_tool_zq"


def tools_spec(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool) -> str:
    """The canonical tools spec (see the module docstring); equal requests give equal strings."""
    return json.dumps({"type": TOOLS_TYPE, "tools": tools, "tool_choice": tool_choice,
                       "parallel_tool_calls": parallel}, separators=(",", ":"), ensure_ascii=False)


def is_tools_spec(response_format: str | None) -> bool:
    """Whether a ``response_format`` string is a tools spec (a prefix test: no JSON parse per row)."""
    return response_format is not None and response_format.startswith(_SPEC_PREFIX)


@dataclass(frozen=True)
class ToolsSpec:
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel: bool

    @classmethod
    def parse(cls, spec: str) -> ToolsSpec:
        d = json.loads(spec)
        return cls(d["tools"], d["tool_choice"], d["parallel_tool_calls"])

    @property
    def choice(self) -> str:
        """``auto``, ``required``, ``none``, or ``named`` (see :attr:`named`)."""
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"

    @property
    def named(self) -> str | None:
        return None if isinstance(self.tool_choice, str) else self.tool_choice["function"]["name"]

    def functions(self) -> list[dict[str, Any]]:
        """The ``function`` objects a call may name (only the named one under a named choice)."""
        fns = [t["function"] for t in self.tools]
        return [f for f in fns if f["name"] == self.named] if self.named is not None else fns


# ---------------------------------------------------------------------------- format detection


def probe() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) of the probe conversation a template is rendered with to detect its format."""
    messages = [{"role": "user", "content": "probe"},
                {"role": "assistant", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                    "name": _PROBE_NAME, "arguments": {"a": 1, "b": "x"}}}]}]
    tools = [{"type": "function", "function": {"name": _PROBE_TOOL_NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    return messages, tools


def format_of_rendering(rendered: str) -> str | None:
    """The tool-call format of a template, given its rendering of :func:`probe` (no generation
    prompt), or None: the probe call must be there in Hermes' exact shape, and the tools list too."""
    call = f'{OPEN}\n{{"name": "{_PROBE_NAME}", "arguments": {{"a": 1, "b": "x"}}}}\n{CLOSE}'
    if call in rendered and _PROBE_TOOL_NAME in rendered:
        return HERMES
    return None


# ---------------------------------------------------------------------------- grammar


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's ``parameters`` with the JSON options of the format (absent: no arguments)."""
    schema = function.get("parameters") or _NO_PARAMETERS
    options = dict(_JSON_OPTIONS, lenient=not function.get("strict", False))
    return {**schema, "x-guidance": options}


def _lark_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def grammar_of_tools(spec: str) -> str:
    """The lark grammar (llguidance) of a tools spec whose choice is not ``none``."""
    ts = ToolsSpec.parse(spec)
    if ts.choice == "none":
        raise ValueError("tool_choice 'none' constrains nothing: it has no grammar")
    fns = ts.functions()
    if not fns:
        raise ValueError(f"tool_choice names function {ts.named!r}, which is not one of the tools")
    bodies = []
    for i, fn in enumerate(fns):
        head = _lark_string('{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ')
        bodies.append(f"fn_{i}: {head} %json {json.dumps(parameters_schema(fn), ensure_ascii=False)} \"}}\"")
    more = " (SEP call_rest)*" if ts.parallel else ""
    if ts.choice == "auto":
        # The text before a call is lazy (it ends at the first <tool_call>); text with no call never
        # spells <tool_call>, so a started call is always a whole, valid one.
        start = [f"start: TEXT | open call_rest{more}",
                 f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(OPEN)}(.|\\n)*/",
                 f"open[lazy]: /(.|\\n)*{re.escape(OPEN)}/"]
    else:
        start = [f"start: {_lark_string(OPEN)} call_rest{more}"]
    rules = [*start, f"SEP: {_lark_string(chr(10) + OPEN)}",
             f"call_rest: \"\\n\" body {_lark_string(chr(10) + CLOSE)}",
             "body: " + " | ".join(f"fn_{i}" for i in range(len(fns))), *bodies]
    return "\n".join(rules) + "\n"


def function_grammar(function: dict[str, Any]) -> str:
    """One function's call alone, as a lark grammar: what a per-tool schema check compiles, so a
    bad schema is named by its tool."""
    head = _lark_string('{"name": ' + json.dumps(function["name"], ensure_ascii=False) + ', "arguments": ')
    return f"start: {head} %json {json.dumps(parameters_schema(function), ensure_ascii=False)} \"}}\"\n"


# ---------------------------------------------------------------------------- output


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]] | None:
    """(content before the calls or None, the calls) of a Hermes answer, or None when the text
    holds no complete call (plain text, or a call cut short by ``max_tokens``). ``arguments`` is
    the object re-serialized with ``json.dumps`` (what vLLM's Hermes parser returns)."""
    start = text.find(OPEN)
    if start < 0:
        return None
    calls = []
    for m in re.finditer(re.escape(OPEN) + r"\n(.*?)\n" + re.escape(CLOSE), text[start:], re.DOTALL):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
            return None
        calls.append(ParsedCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    if not calls:
        return None
    content = text[:start].removesuffix("\n")  # the template writes content, "\n", then the calls
    return (content or None), calls
