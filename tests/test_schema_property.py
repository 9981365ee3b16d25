"""Structured outputs over schemas hypothesis makes (issue 42): whatever bounded JSON schema a row
gives, its answer parses and validates against it (``jsonschema``), greedy and sampled with a
seed, strict and not, on a tiny random model whose every valid byte is the grammar's doing.

The schemas are the kinds a batch of extraction or classification rows sends: objects of
required properties (additionalProperties false, as ``strict: true`` demands), strings with a
length bound, enums, bounded integers, booleans, arrays with item bounds, nested to depth 3.
Every leaf is bounded, so a finished answer always fits in ``MAX_TOKENS``; a row cut by the limit
would be a test failure, not a pass.
"""

from __future__ import annotations

import json

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_structured_outputs import _req, _schema_format, llm, tiny_chat  # noqa: F401 - fixtures

MAX_TOKENS = 320
NAMES = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz -", min_size=1, max_size=8)

LEAVES = st.one_of(
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda words: {"enum": words}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda lo_span: {"type": "integer", "minimum": lo_span[0], "maximum": lo_span[0] + lo_span[1]}),
    st.just({"type": "boolean"}),
)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})
    return arrays | objects


# The row's schema: an object at the top, as response_format json_schema requires.
SCHEMAS = st.dictionaries(NAMES, st.recursive(LEAVES, _containers, max_leaves=6), min_size=1, max_size=4).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1), strict=st.booleans())
def test_every_generated_schema_gives_answers_that_validate(llm, schema, seed, strict):  # noqa: F811
    jsonschema.Draft202012Validator.check_schema(schema)
    rf = _schema_format(schema, strict)
    rows = [_req("greedy", rf, max_tokens=MAX_TOKENS), _req("seeded", rf, 1.0, seed, max_tokens=MAX_TOKENS)]
    for r in llm.generate(rows):
        assert r.error is None, (r.request_id, r.error)
        assert r.finish_reason == "stop", (r.request_id, schema, r.text)
        jsonschema.validate(json.loads(r.text), schema)


def test_an_object_without_properties_is_the_empty_object(llm):  # noqa: F811
    schema = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    [r] = llm.generate([_req("empty", _schema_format(schema), max_tokens=16)])
    assert r.finish_reason == "stop" and json.loads(r.text) == {}
