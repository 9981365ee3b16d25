"""Tokenizer and chat template, rebuilt from a checkpoint without transformers.

`ChatTokenizer` renders chats exactly as transformers' `apply_chat_template` does and tokenizes
them so that message text is always text: a user who types `<|im_start|>system` gets the tokens
of those characters, never the control token (see `encode_chat`). A row's `tools` reach the template
as transformers passes them (`tools=`, the OpenAI tools list), and `tool_call_format` says which
tool-call format the template speaks (:mod:`kvbatch.engine.text.tool_calls`). `IncrementalDetokenizer` turns
a growing list of ids into text for streaming, never emitting half a UTF-8 character.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvbatch.engine.models.weights import (
    ModelLoadError,
    TokenizerSource,
    load_tokenizer_source,
)
from kvbatch.engine.text import tool_calls

if TYPE_CHECKING:
    from kvbatch.engine.models.weights import Checkpoint

__all__ = ["ChatTokenizer", "IncrementalDetokenizer"]

# GGUF token_type values (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"), _byte_level(False)])


# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp). Unknown values are
# refused: a wrong split tokenizes silently differently from training.
_GGUF_PRE_TOKENIZERS = {
    "default": lambda: _byte_level(True),
    "gpt-2": lambda: _byte_level(True),
    # SmolLM's tokenizer.json: every digit alone, then GPT-2's split.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(True)]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
}

# End-of-turn markers that chat templates close a turn with; a model emits them to stop.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


class ChatTokenizer:
    """Text <-> ids for one model, plus its chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str | None],
        eos_token_ids: list[int],
        source: str = "",
    ) -> None:
        self._tok = tokenizer
        # A second copy that never parses special tokens: message content is tokenized with it.
        self._text_tok = Tokenizer.from_str(tokenizer.to_str())
        self._text_tok.encode_special_tokens = True
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.source = source
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = tokenizer.token_to_id(bos) if bos else None
        self.eos_token_ids: list[int] = eos_token_ids
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        self._special_texts = tuple(
            added.content for added in tokenizer.get_added_tokens_decoder().values() if added.special
        )
        self._tool_call_format: tuple[str | None] | None = None  # (format,) once probed

    # ------------------------------------------------------------ construction

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> ChatTokenizer:
        return cls.from_source(ckpt.tokenizer_source)

    @classmethod
    def from_model(cls, model: str) -> ChatTokenizer:
        """The tokenizer of a model path/URL/short name, without loading its weights."""
        return cls.from_source(load_tokenizer_source(model))

    @classmethod
    def from_source(cls, src: TokenizerSource) -> ChatTokenizer:
        if src.kind == "gguf":
            return _from_gguf(src)
        return _from_hf_files(src)

    # ------------------------------------------------------------ text

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (the grammar engine builds its own from it)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids; control-token spellings in `text` are tokenized as characters."""
        return self._text_tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token`` (a control token's too), or None."""
        return self._tok.token_to_id(token)

    # ------------------------------------------------------------ chat

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt string, exactly as transformers' `apply_chat_template(tokenize=False)` gives it."""
        return self._render(_normalize_messages(messages), add_generation_prompt, tools)

    @property
    def tool_call_format(self) -> str | None:
        """The template's tool-call format (``tool_calls.HERMES``), or None when it renders no tool
        calls in a known shape (or no tools): found once by rendering a probe conversation."""
        if self._tool_call_format is None:
            messages, tools = tool_calls.probe()
            try:
                rendered = self._render(messages, False, tools)
            except Exception:  # noqa: BLE001 - any template that cannot render the probe has no known format
                rendered = ""
            self._tool_call_format = (tool_calls.format_of_rendering(rendered),)
        return self._tool_call_format[0]

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered chat, with every message's text tokenized as text.

        The template is rendered twice, once as is and once with a unique sentinel in place of
        each message's content, which locates every content span in the real rendering. When no
        control token overlaps a content span, the ids are those of the whole rendered string
        (so they equal transformers' ids and prompts share prefixes). Otherwise the string is
        split at the spans: template parts are tokenized with control tokens, content parts with
        control tokens off, and the ids are concatenated.
        """
        messages = _normalize_messages(messages)
        if tools:  # tool names, descriptions and schemas are template text: no control token in them
            for text in _strings(tools, skip_content=False):
                for special in self._special_texts:
                    if special in text:
                        raise ValueError(f"tools spell control token {special!r}")
        real, pieces = self._chat_pieces(messages, add_generation_prompt, tools)
        whole = self._tok.encode(real, add_special_tokens=False)
        spans, position = [], 0
        for text, is_content in pieces:
            if is_content:
                spans.append((position, position + len(text)))
            position += len(text)
        if any(
            token_id in self.special_token_ids and any(start < e and end > s for s, e in spans)
            for token_id, (start, end) in zip(whole.ids, whole.offsets)
        ):
            return self._encode_pieces(pieces)
        return whole.ids

    def _chat_pieces(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[tuple[str, bool]]]:
        """The rendered chat, and the same string cut into [(text, is_content)] at message contents."""
        real = self._render(messages, add_generation_prompt, tools)
        marked, contents = _mark_contents(messages, real)
        self._check_no_control_text(marked)
        pieces = _split_at_contents(self._render(marked, add_generation_prompt, tools), contents, real)
        if pieces is not None:
            return real, pieces
        # The template rewrites or branches on content (e.g. `| trim`), so the spans cannot be
        # located. Safe only if no content spells a control token; then the whole string is template.
        for index, text in enumerate(contents):
            for special in self._special_texts:
                if special in text:
                    raise ValueError(
                        f"message content #{index} spells control token {special!r} and this chat template "
                        "rewrites message content, so it cannot be tokenized safely"
                    )
        return real, [(real, False)]

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Template pieces with control tokens parsed, content pieces as plain text, concatenated."""
        ids: list[int] = []
        for text, is_content in pieces:
            if text:
                tok = self._text_tok if is_content else self._tok
                ids += tok.encode(text, add_special_tokens=False).ids
        return ids

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.source or 'this model'}: has no chat template; pass plain text prompts")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def _check_no_control_text(self, marked: list[dict[str, Any]]) -> None:
        """Fields other than content (role, name, tool calls) reach the template as is: refuse control tokens there."""
        for index, message in enumerate(marked):
            for text in _strings(message):
                for special in self._special_texts:
                    if special in text:
                        raise ValueError(f"message #{index} spells control token {special!r} outside its content")


class IncrementalDetokenizer:
    """Streaming text for one sequence: `feed` new ids, get the text they complete.

    Text is emitted only once it no longer ends in U+FFFD (an incomplete UTF-8 sequence), and
    each step decodes a short window that starts a few tokens back, so decoders that treat the
    first token specially (sentencepiece's leading space) still diff correctly. The concatenation
    of everything `feed` and `flush` return equals `decode(all ids)`.
    """

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted
        self._read_offset = 0  # ids before it have been emitted
        self.text = ""

    def feed(self, new_ids: Iterable[int]) -> str:
        self._ids.extend(new_ids)
        if len(self._ids) == self._read_offset:
            return ""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix) or not full.startswith(prefix):
            return ""  # wait for the rest of the character (or for any visible text)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._emit(full[len(prefix) :])

    def flush(self) -> str:
        """Whatever is held back, at the end of the sequence (replacement chars included)."""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(full[len(prefix) :])

    def _emit(self, text: str) -> str:
        self.text += text
        return text


# ---------------------------------------------------------------- building tokenizers


def _from_gguf(src: TokenizerSource) -> ChatTokenizer:
    meta = src.gguf_metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{src.source}: GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{src.source}: GGUF pre-tokenizer {pre!r} is not supported; "
            f"known: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))}"
        )
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{src.source}: GGUF file carries no tokenizer (tokenizer.ggml.tokens)")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) are special: matched whole, skipped by decode. User-defined
    # ones (<think>) are matched whole too, as llama.cpp does, but are ordinary text.
    control = [tokens[i] for i, kind in enumerate(token_types) if kind == _CONTROL]
    user_defined = [tokens[i] for i, kind in enumerate(token_types) if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in control])
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in user_defined])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    template = meta.get("tokenizer.chat_template")
    eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    return ChatTokenizer(tokenizer, template, special, _stop_ids(tokenizer, template, eos), src.source)


def _from_hf_files(src: TokenizerSource) -> ChatTokenizer:
    files = src.files
    if "tokenizer.json" not in files:
        raise ModelLoadError(f"{src.source}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        tokenizer = Tokenizer.from_str(files["tokenizer.json"])
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise ModelLoadError(f"{src.source}: tokenizer.json cannot be read ({exc})") from exc
    tok_config = _json(files, "tokenizer_config.json", src.source)
    special_map = _json(files, "special_tokens_map.json", src.source)
    special = {
        name: _token_text(tok_config.get(name, special_map.get(name)))
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    template = _chat_template(files, tok_config, src.source)
    eos: list[Any] = [tokenizer.token_to_id(special["eos_token"]) if special["eos_token"] else None]
    for name in ("config.json", "generation_config.json"):
        value = _json(files, name, src.source).get("eos_token_id")
        eos += value if isinstance(value, list) else [value]
    return ChatTokenizer(tokenizer, template, special, _stop_ids(tokenizer, template, eos), src.source)


def _stop_ids(tokenizer: Tokenizer, template: str | None, candidates: list[Any]) -> list[int]:
    """EOS ids stated by the checkpoint, plus the end-of-turn token its chat template closes turns with."""
    ids = [int(c) for c in candidates if c is not None]
    for marker in _END_OF_TURN:
        token_id = tokenizer.token_to_id(marker)
        if token_id is not None and template and marker in template:
            ids.append(token_id)
    return list(dict.fromkeys(ids))


def _chat_template(files: dict[str, str], tok_config: dict[str, Any], source: str) -> str | None:
    """transformers' order: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"]
    template = _json(files, "chat_template.json", source).get("chat_template", tok_config.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _json(files: dict[str, str], name: str, source: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        value = json.loads(files[name])
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{source}: {name} is not valid JSON ({exc})") from exc
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- chat templates


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """The template in the environment transformers builds for `apply_chat_template`."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson HTML-escapes; transformers' does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template has a syntax error on line {exc.lineno}: {exc.message}") from exc


def _normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies with None-valued keys dropped, as transformers does (OpenAI sends content=None)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message #{index} is a {type(message).__name__}, not a dict")
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


_SENTINEL = "\ue000{nonce}:{index}\ue001"


def _mark_contents(messages: list[dict[str, Any]], avoid: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages with each text content (string, or text blocks of a list) replaced by a unique sentinel."""
    nonce = secrets.token_hex(8)
    while nonce in avoid:  # pragma: no cover - 64 random bits
        nonce = secrets.token_hex(8)
    contents: list[str] = []

    def mark(text: str) -> str:
        contents.append(text)
        return _SENTINEL.format(nonce=nonce, index=len(contents) - 1)

    marked = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = mark(content)
        elif isinstance(content, list):
            message["content"] = [
                {**block, "text": mark(block["text"])}
                if isinstance(block, dict) and isinstance(block.get("text"), str)
                else block
                for block in content
            ]
        marked.append(message)
    return marked, contents


# Finds the sentinels of _SENTINEL. One compiled pattern for every row: compiling one per
# render's marker cost ~25% of encode_chat.
_SENTINEL_RE = re.compile("\ue000([0-9a-f]{16}):(\\d+)\ue001")


def _split_at_contents(marked_render: str, contents: list[str], real: str) -> list[tuple[str, bool]] | None:
    """[(text, is_content)] whose concatenation is `real`, or None if the sentinels do not map back to it."""
    matches = list(_SENTINEL_RE.finditer(marked_render))
    if not matches:  # no content was rendered: all template
        return [(real, False)] if marked_render == real else None
    marker = matches[0].group(1)  # this render's marker; anything else that looks like one is text
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for m in matches:
        if m.group(1) != marker:
            continue
        pieces.append((marked_render[pos:m.start()], False))
        pieces.append((contents[int(m.group(2))], True))
        pos = m.end()
    pieces.append((marked_render[pos:], False))
    if "".join(text for text, _ in pieces) != real:
        return None
    return pieces


def _strings(value: Any, skip_content: bool = True) -> Iterable[str]:
    """Every string in a message, except its (already marked) content."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            if not (skip_content and key in ("content", "text")):
                yield from _strings(item, skip_content)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item, skip_content)
