"""Structured outputs: a request's ``response_format`` as an llguidance grammar, compiled once
per schema and handed to each constrained sequence as its own matcher. Torch-free (the
tokenizing steps check schemas here without loading torch); the mask itself is applied in
:mod:`kvbatch.engine.runtime.grammar_mask`.

A response format travels through the engine as one canonical JSON string (sorted keys, no
spaces; :func:`kvbatch.io.batch_requests.parse_response_format` makes it), so equal schemas are equal strings and the
compiled grammars are cached by that string's SHA-256: three schemas over ten million rows
compile three times.

- ``{"type": "json_object"}``: any JSON object.
- ``{"type": "json_schema", "schema": ..., "strict": true}``: exactly the schema; a keyword
  llguidance does not implement is an error (the row is refused, naming it).
- ``strict: false``: the schema too, but unimplemented keywords are ignored (llguidance's
  ``lenient`` mode), as OpenAI's non-strict mode promises no more than best effort.

JSON is generated without insignificant whitespace (``whitespace_flexible: false``), so a model
cannot spin forever on spaces between tokens.

A row with ``tools`` carries a tools spec in the same place (:mod:`kvbatch.engine.text.tool_calls`:
its grammar is a lark grammar of the template's tool-call format with each tool's ``parameters``
inline); :func:`tools_error` checks each tool's schema alone, so a refusal names the tool.

Under speculative decoding :func:`draft_length` cuts a constrained row's drafts at the grammar's
first refusal, before they cost a verify slot (docs/speculative-decoding.md, constrained rows).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from typing import Any

import llguidance

from kvbatch.engine.text.tool_calls import ToolsSpec, function_grammar, grammar_of_tools, is_tools_spec

COMPILE_TIME_LIMIT_S = 2.0  # a schema whose grammar takes longer to build is refused, per row
# llguidance's own resource limits bound the work a hostile schema can cause (fuel, sizes).
_LIMITS = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
           "max_grammar_size": 500_000, "max_lexer_states": 250_000}
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}
CACHE_SIZE = 256  # distinct schemas kept compiled per engine


def format_key(response_format: str) -> str:
    return hashlib.sha256(response_format.encode("utf-8")).hexdigest()


def grammar_of(response_format: str) -> str:
    """The llguidance grammar of a canonical response format; ValueError names what is wrong."""
    if is_tools_spec(response_format):
        try:
            return llguidance.LLMatcher.grammar_from_lark(grammar_of_tools(response_format))
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from None
    rf = json.loads(response_format)
    if rf["type"] == "json_object":
        schema: Any = {"type": "object"}
        options = dict(_JSON_DEFAULTS)
    elif rf["type"] == "json_schema":
        schema = rf["schema"]
        options = dict(_JSON_DEFAULTS, lenient=not rf["strict"])
    else:
        raise ValueError(f"unknown response_format type {rf['type']!r}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**_LIMITS)


def _schema_problem(message: str) -> str:
    return "the JSON schema cannot be compiled: " + " ".join(message.split())[:500]


_checked: OrderedDict[str, str] = OrderedDict()  # format key -> "" (valid) or the problem
_checked_lock = threading.Lock()


def schema_error(response_format: str) -> str | None:
    """Why this response format cannot be compiled (a per-row 400's reason), or None. Needs no
    tokenizer; results are cached by the format's hash, so a file of a million rows with three
    schemas validates three times."""
    key = format_key(response_format)
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return _checked[key] or None
    t0 = time.perf_counter()
    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar_of(response_format), limits=_limits())
    except ValueError as exc:
        problem = str(exc) or "invalid schema"
    elapsed = time.perf_counter() - t0
    if not problem and elapsed > COMPILE_TIME_LIMIT_S:
        problem = f"compiling it took {elapsed:.1f}s, over the {COMPILE_TIME_LIMIT_S:g}s limit"
    reason = _schema_problem(problem) if problem else ""
    _remember(key, reason)
    return reason or None


def _remember(key: str, reason: str) -> None:
    with _checked_lock:
        _checked[key] = reason
        while len(_checked) > CACHE_SIZE * 16:
            _checked.popitem(last=False)


def tools_error(spec: str) -> tuple[int, str] | None:
    """(the index of the first tool whose ``parameters`` cannot be compiled, why) for a tools spec,
    or None. Each tool is checked alone (so the reason names it) and cached by its own hash, as
    :func:`schema_error` caches schemas; a tool that takes too long to compile is refused too."""
    for index, tool in enumerate(ToolsSpec.parse(spec).tools):
        function = tool["function"]
        grammar = function_grammar(function)
        key = format_key("tool\x1f" + grammar)
        with _checked_lock:
            cached = _checked.get(key)
        if cached is None:
            t0 = time.perf_counter()
            try:
                problem = llguidance.LLMatcher.validate_grammar(
                    llguidance.LLMatcher.grammar_from_lark(grammar), limits=_limits())
            except (ValueError, TypeError) as exc:
                problem = str(exc) or "invalid schema"
            elapsed = time.perf_counter() - t0
            if not problem and elapsed > COMPILE_TIME_LIMIT_S:
                problem = f"compiling it took {elapsed:.1f}s, over the {COMPILE_TIME_LIMIT_S:g}s limit"
            cached = " ".join(problem.split())[:500] if problem else ""
            _remember(key, cached)
        if cached:
            return index, f"tool {function['name']!r}: the JSON schema of its parameters cannot be compiled: {cached}"
    return None


class GrammarCompiler:
    """One engine's compiled grammars, by schema hash, and the llguidance tokenizer they use.

    :meth:`matcher` hands each constrained sequence a copy of the schema's compiled matcher
    (``deep_copy`` of a cached prototype: microseconds), or the reason there is none.
    ``compiles`` counts grammar constructions (tests pin the cache with it)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self.compiles = 0

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:  # ~0.2 s for a 49k vocabulary: built at the first constrained request
            self._lltok = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_ids)
        return self._lltok

    def matcher(self, response_format: str) -> tuple[llguidance.LLMatcher | None, str | None]:
        """A fresh matcher for one sequence, or (None, the reason the schema cannot be used)."""
        key = format_key(response_format)
        proto = self._cache.get(key)
        if proto is None:
            proto = self._compile(response_format)
            self._cache[key] = proto
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(proto, str):
            return None, proto
        return proto.deep_copy(), None

    def _compile(self, response_format: str) -> llguidance.LLMatcher | str:
        self.compiles += 1
        t0 = time.perf_counter()
        try:
            grammar = grammar_of(response_format)
        except ValueError as exc:
            return _schema_problem(str(exc))
        m = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=_limits())
        elapsed = time.perf_counter() - t0
        if m.is_error():
            return _schema_problem(m.get_error())
        if elapsed > COMPILE_TIME_LIMIT_S:
            return _schema_problem(f"compiling it took {elapsed:.1f}s, over the {COMPILE_TIME_LIMIT_S:g}s limit")
        return m


def draft_length(matcher: llguidance.LLMatcher, tokens: list[int], vocab_size: int, eos_token_ids: frozenset[int],
                 ignore_eos: bool, from_distribution: bool) -> int:
    """How many of a constrained request's drafted ``tokens`` go to verification: those up to the
    first the grammar refuses (checked with ``validate_tokens``: the matcher does not move), so no
    verify slot is spent on a draft the mask would reject anyway.

    The cut depends on the drafts' values, which is exact for a deterministic drafter (q one-hot:
    a refused draft is rejected for sure and the token there is drawn from the masked ``p``, what
    the cut's bonus draw does) and for greedy rows, but not for drafts *sampled* from a
    distribution (``from_distribution``): rejection sampling must draw a refused draft's
    replacement from ``max(0, p - q)``, so such a row keeps its first refused draft (the masked
    target rejects it for sure) and drops only what follows it.

    An end-of-sequence draft ends the window (nothing after it is ever emitted); with
    ``ignore_eos`` it is cut before it, as the grammar's state after it (EOS only) has no mask in the
    batch's fill, and such a row with sampled drafts does not draft at all (cutting at a sampled
    EOS would bias it). Ids outside the tokenizer's vocabulary (a padded head) count as refused:
    llguidance errors on them, so they never reach it."""
    if from_distribution and ignore_eos:
        return 0
    inside = next((j for j, t in enumerate(tokens) if not 0 <= t < vocab_size), len(tokens))
    valid = matcher.validate_tokens(tokens[:inside]) if inside else 0
    for j, t in enumerate(tokens[:valid]):
        if t in eos_token_ids:
            return j if ignore_eos else j + 1
    if from_distribution and valid < len(tokens):
        return valid + 1
    return valid
