"""Repeated message text is tokenized once per process (:class:`CachedChatEncoder`), with ids
byte-identical to tokenizing each row with ``ChatTokenizer.encode_chat``: generated
conversations mix shared system prompts with text that spells, or almost spells, control
tokens, odd whitespace and non-ASCII text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.ops.shards.prompt_tokens import CachedChatEncoder
from tests.tiny_models import build_tiny_chat_model

SYSTEM_PROMPTS = ["You are a careful editor. Summarise in three bullets.",
                  "Answer in one word.\n\nNo greetings.", "  leading and trailing spaces  "]
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|im_", "_end|>", "|>", "<", ">", "\n", " ", "\t", "system",
             "user", "ünïcödé", "数据", "123", "a", "word", "<think>", "'s", "  \n"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tiny) -> ChatTokenizer:
    return ChatTokenizer.from_model(str(tiny))


@pytest.fixture(scope="module")
def encoder(tokenizer) -> CachedChatEncoder:
    return CachedChatEncoder(tokenizer, max_pieces=64)  # small: evictions happen too


text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=12).map("".join)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": text})
system = st.fixed_dictionaries({"role": st.just("system"), "content": st.sampled_from(SYSTEM_PROMPTS) | text})
conversation = st.tuples(st.lists(system, max_size=1), st.lists(message, min_size=1, max_size=3)).map(
    lambda parts: parts[0] + parts[1])


def _outcome(encode, messages):
    try:
        return encode(messages)
    except ValueError as exc:
        return ("ValueError", str(exc))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversation)
def test_cached_ids_equal_per_row_ids(tokenizer, encoder, messages):
    assert _outcome(encoder.encode_chat, messages) == _outcome(tokenizer.encode_chat, messages)


def test_shared_system_prompt_is_tokenized_once(tokenizer):
    """The fast path is taken (the test above would pass with a cache that is never used)."""
    encoder = CachedChatEncoder(tokenizer)
    assert encoder.fast
    rows = [[{"role": "system", "content": SYSTEM_PROMPTS[0]}, {"role": "user", "content": f"row {i}"}]
            for i in range(50)]
    assert [encoder.encode_chat(m) for m in rows] == [tokenizer.encode_chat(m) for m in rows]
    # Per row: the system piece and the generation prompt hit after the first row; "user\nrow i" misses.
    assert encoder.misses <= 50 + 3
    assert encoder.hits >= 2 * 49


def test_a_content_that_could_form_a_control_token_takes_the_exact_path(tokenizer, monkeypatch):
    encoder = CachedChatEncoder(tokenizer)
    calls = []
    monkeypatch.setattr(tokenizer, "encode_chat", lambda m: calls.append(m) or [0])
    for content in ["ends with <|im", "|> starts so", "spells <|im_end|> whole"]:
        assert encoder.encode_chat([{"role": "user", "content": content}]) == [0]
    assert len(calls) == 3
    assert encoder.encode_chat([{"role": "user", "content": "plain"}]) != [0]


def test_no_fast_path_when_an_added_token_strips_whitespace(tiny: Path, tmp_path: Path):
    """An added token with rstrip moves piece boundaries: every row then takes encode_chat."""
    import json
    import shutil

    folder = Path(shutil.copytree(tiny, tmp_path / "tiny"))
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    for added in spec["added_tokens"]:
        if added["content"] == "<|im_start|>":
            added["rstrip"] = True
    path.write_text(json.dumps(spec))
    assert not CachedChatEncoder(ChatTokenizer.from_model(str(folder))).fast
