"""A chat row's tool fields read and checked: ``tools``, ``tool_choice``, ``parallel_tool_calls``
into the tools spec the engine decodes under (:mod:`kvbatch.engine.text.tool_calls`), and the
tool-call history in ``messages`` (an assistant turn's ``tool_calls``, a ``tool`` message's
``tool_call_id``) into the message dicts the chat template renders.

Rules, each as OpenAI states or enforces them:

- ``tools``: an array of at most 128 ``{"type": "function", "function": {...}}``; ``name`` is 1 to 64
  of ``a-z A-Z 0-9 _ -`` and unique; ``description`` a string; ``parameters`` a JSON schema object;
  ``strict`` a boolean. The tool dicts reach the template as given (other keys included), in order.
- ``tool_choice``: ``"none"``, ``"auto"`` (the default with tools), ``"required"`` or
  ``{"type": "function", "function": {"name": X}}`` naming one of the tools; without tools only
  ``"none"`` (which changes nothing) is accepted.
- ``parallel_tool_calls``: a boolean (default true); false allows at most one call.
- ``tools`` together with a ``response_format`` other than text is refused: the answer's format is
  one or the other.
- History: an assistant message may have ``content: null`` when it has ``tool_calls`` (each
  ``{"id", "type": "function", "function": {"name", "arguments"}}``, ``arguments`` a string of a
  JSON object, as OpenAI returns it). The template gets ``arguments`` as the parsed object, as
  transformers' templates expect and vLLM passes it (a Hermes template writes it with ``tojson``).
  A ``tool`` message needs ``tool_call_id`` (a string) and text content. The legacy ``function``
  role stays refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvbatch.engine.text.tool_calls import tools_spec
from kvbatch.io.request_fields import _short, json_type

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")

Problem = tuple[str, str]  # (field path below the body, reason)


def parse_tools(body: dict[str, Any]) -> str | None | Problem:
    """The row's tools spec (None: no tools, or an empty list), or (field, reason)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        return "parallel_tool_calls", f"must be a boolean, got {json_type(parallel)}"
    if tools is None or tools == []:
        if choice is None or choice == "none":
            return None
        return "tool_choice", f"needs tools: only 'none' is allowed without them, got {_short(choice)}"
    if not isinstance(tools, list):
        return "tools", f"must be an array of tools, got {json_type(tools)}"
    if len(tools) > MAX_TOOLS:
        return "tools", f"has {len(tools)} tools, at most {MAX_TOOLS}"
    names: set[str] = set()
    for i, tool in enumerate(tools):
        problem = _tool_problem(tool)
        if problem is not None:
            return f"tools.{i}{problem[0]}", problem[1]
        name = tool["function"]["name"]
        if name in names:
            return f"tools.{i}.function.name", f"{name!r} names two tools"
        names.add(name)
    choice = "auto" if choice is None else choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            return "tool_choice", f"must be 'none', 'auto', 'required' or a function, got {_short(choice)}"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return "tool_choice", f'must be {{"type": "function", "function": {{"name": ...}}}}, got {_short(choice)}'
        if fn["name"] not in names:
            return "tool_choice.function.name", f"{fn['name']!r} is not one of the tools"
        choice = {"type": "function", "function": {"name": fn["name"]}}
    else:
        return "tool_choice", f"must be a string or an object, got {json_type(choice)}"
    return tools_spec(tools, choice, True if parallel is None else parallel)


def _tool_problem(tool: Any) -> Problem | None:
    if not isinstance(tool, dict):
        return "", f"must be an object, got {json_type(tool)}"
    if tool.get("type") != "function":
        return ".type", f"only 'function' tools are supported, got {_short(tool.get('type'))}"
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return ".function", f"must be an object, got {json_type(fn)}"
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return ".function.name", f"must be 1 to 64 letters, digits, '_' or '-', got {_short(name)}"
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        return ".function.description", f"must be a string, got {json_type(fn['description'])}"
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        return ".function.parameters", f"must be a JSON schema object, got {json_type(fn['parameters'])}"
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        return ".function.strict", f"must be a boolean, got {json_type(fn['strict'])}"
    return None


# ---------------------------------------------------------------------------- history


def check_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the template gets them (``arguments`` parsed);
    ValueError naming the first bad call."""
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"tool_calls must be a non-empty array, got {_short(calls)}")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f'tool_calls.{i} must be {{"id", "type": "function", "function": {{...}}}}, '
                             f"got {_short(call)}")
        if not isinstance(call.get("id"), str):
            raise ValueError(f"tool_calls.{i}.id must be a string, got {json_type(call.get('id'))}")
        if not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls.{i}.function.name must be a string, got {json_type(fn.get('name'))}")
        parsed = _arguments(fn.get("arguments"), f"tool_calls.{i}.function.arguments")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": parsed}})
    return out


def _arguments(args: Any, where: str) -> dict[str, Any]:
    """A call's ``arguments`` (a string of a JSON object) parsed; ValueError naming ``where``."""
    try:
        parsed = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where} must be a string of a JSON object, got {_short(args)}")
    return parsed


def history_message(role: str, content: str | None, tool_calls: Any, tool_call_id: Any) -> dict[str, Any]:
    """One message as the template renders it (``developer`` as ``system``, tool fields where
    they belong); ValueError naming what is wrong. ``tool_calls`` and ``tool_call_id`` on other
    roles are dropped, like any extra key of a message."""
    message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if role == "assistant" and tool_calls is not None:
        message["tool_calls"] = check_tool_calls(tool_calls)
    elif content is None:
        raise ValueError("content may be null only in an assistant message with tool_calls")
    if role == "tool":
        if not isinstance(tool_call_id, str):
            raise ValueError(f"a tool message needs tool_call_id (a string), got {_short(tool_call_id)}")
        message["tool_call_id"] = tool_call_id
    return message


def has_tool_history(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds tool calls or tool results (only a template with a tool-call
    format renders them; any other would drop them silently)."""
    return any(m.get("role") == "tool" or "tool_calls" in m for m in messages)


# ---------------------------------------------------------------------------- /v1/responses
# The Responses API spells the same things flat: a tool is {"type": "function", "name", "description",
# "parameters", "strict"} (strict by default), a named choice {"type": "function", "name": X}, a call in
# the history a {"type": "function_call", "call_id", "name", "arguments"} item and its result a
# {"type": "function_call_output", "call_id", "output"} item. They are read into the chat forms above,
# so one spec, one template rendering and one grammar serve both endpoints.


def parse_responses_tools(body: dict[str, Any]) -> str | None | Problem:
    """A Responses row's tools spec (None: none), or (field, reason). ``tool_choice: "auto"`` without
    tools is the Responses default and changes nothing."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools and choice == "auto":
        choice = None
    chat: dict[str, Any] = {"parallel_tool_calls": body.get("parallel_tool_calls")}
    if isinstance(tools, list):
        converted = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else tool
                return "tools", f"only 'function' tools are supported: tool {i} has type {_short(kind)}"
            fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            fn["strict"] = True if tool.get("strict") is None else tool["strict"]  # the Responses default
            converted.append({"type": "function", "function": fn})
        chat["tools"] = converted
    else:
        chat["tools"] = tools
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    got = parse_tools(chat)
    if isinstance(got, tuple) and got[0].startswith("tools.") and ".function." in got[0]:
        return got[0].replace(".function.", ".", 1), got[1]  # the flat spelling's path
    if isinstance(got, tuple) and got[0] == "tool_choice.function.name":
        return "tool_choice.name", got[1]
    return got


def add_responses_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """Append a ``function_call`` item to the conversation as a call of the assistant turn before it
    (a new turn unless the last message is an assistant's), or a ``function_call_output`` item as a
    tool message; ValueError naming what is wrong."""
    if item.get("type") == "function_call":
        for key in ("call_id", "name"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"{key} must be a string, got {_short(item.get(key))}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": _arguments(item.get("arguments"), "arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    output = item.get("output")
    if not isinstance(output, str):
        raise ValueError(f"output must be a string, got {_short(output)}")
    messages.append(history_message("tool", output, None, item.get("call_id")))


def responses_echo(spec: str | None) -> dict[str, Any]:
    """The Responses object's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` for a row's spec
    (what it asked for, in the flat spelling; a row without tools: none)."""
    if spec is None:
        return {"parallel_tool_calls": False, "tool_choice": "none", "tools": []}
    d = json.loads(spec)
    tools = [{"type": "function", **t["function"]} for t in d["tools"]]
    choice = d["tool_choice"]
    if isinstance(choice, dict):
        choice = {"type": "function", "name": choice["function"]["name"]}
    return {"parallel_tool_calls": d["parallel_tool_calls"], "tool_choice": choice, "tools": tools}
