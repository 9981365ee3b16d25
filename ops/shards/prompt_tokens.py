"""Chat prompts tokenized with repeated text tokenized once per process.

Most rows of a nightly dataset share a few system prompts. :class:`CachedChatEncoder` gives the
ids of :meth:`ChatTokenizer.encode_chat` (byte-identical; tests/test_ingest_scale_tokens.py
pins it with generated conversations) while tokenizing each distinct piece of text once.

Why it is exact: a ``tokenizers`` tokenizer first cuts the text at its added tokens (the chat
template's control tokens) and tokenizes each piece between them on its own; so the ids of a
rendered chat are the concatenation of the ids of those pieces, and a piece seen before (a
system prompt with its role line) can reuse its ids. That holds when no added token strips
neighbouring whitespace or is normalized (checked once; otherwise every row goes through
``encode_chat``), and when the rendered string is what ``encode_chat`` tokenizes whole: no
message content spells, or could complete, a control token with the template text around it
(checked per row; such rows, rare, also go through ``encode_chat``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from kvbatch.engine.text.tokenizer import ChatTokenizer

DEFAULT_CACHE_PIECES = 4096


class CachedChatEncoder:
    """``encode_chat`` with a bounded LRU of piece -> ids (``max_pieces`` entries)."""

    def __init__(self, tokenizer: ChatTokenizer, max_pieces: int = DEFAULT_CACHE_PIECES) -> None:
        self.tokenizer = tokenizer
        self.max_pieces = max_pieces
        self.hits = 0
        self.misses = 0
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        # The fast path needs the tokenizer that parses control tokens; ChatTokenizer keeps it
        # private, and without it every row simply takes encode_chat.
        inner = getattr(tokenizer, "_tok", None)
        self._inner = inner
        specials: dict[str, int] = {}
        safe = inner is not None
        if inner is not None:
            for token_id, added in inner.get_added_tokens_decoder().items():
                if added.lstrip or added.rstrip or added.single_word or added.normalized:
                    safe = False  # the piece boundaries would move: no fast path
                if added.special:
                    specials[added.content] = token_id
        self.fast = safe and bool(specials)
        self._special_ids = specials
        texts = sorted(specials, key=len, reverse=True)  # longest first, as the tokenizer matches
        self._split = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
        # A content that ends with a proper prefix of a control token, or starts with a proper
        # suffix of one, might form one with the template's text beside it.
        self._prefixes = tuple({t[:k] for t in texts for k in range(1, len(t))})
        self._suffixes = tuple({t[k:] for t in texts for k in range(1, len(t))})

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not self.fast or not self._plain(messages):
            return self.tokenizer.encode_chat(messages)
        real = self.tokenizer.render_chat(messages)
        ids: list[int] = []
        for index, piece in enumerate(self._split.split(real)):  # type: ignore[union-attr]
            if index % 2:  # the captured separators: control tokens
                ids.append(self._special_ids[piece])
            elif piece:
                ids += self._piece_ids(piece)
        return ids

    def _piece_ids(self, piece: str) -> list[int]:
        cached = self._pieces.get(piece)
        if cached is not None:
            self.hits += 1
            self._pieces.move_to_end(piece)
            return cached
        self.misses += 1
        ids = self._inner.encode(piece, add_special_tokens=False).ids  # type: ignore[union-attr]
        self._pieces[piece] = ids
        if len(self._pieces) > self.max_pieces:
            self._pieces.popitem(last=False)
        return ids

    def _plain(self, messages: Any) -> bool:
        """Every value a plain string (or None) that cannot be or make a control token."""
        if not isinstance(messages, list):
            return False
        for message in messages:
            if not isinstance(message, dict):
                return False
            for value in message.values():
                if value is None:
                    continue
                if not isinstance(value, str) or self._split.search(value):  # type: ignore[union-attr]
                    return False
                if value.endswith(self._prefixes) or value.startswith(self._suffixes):
                    return False
        return True
