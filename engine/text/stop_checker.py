"""Stop strings: detokenize a sequence's output as it grows and cut it at the first stop string."""

from __future__ import annotations

from kvbatch.engine.text.tokenizer import ChatTokenizer, IncrementalDetokenizer


class StopChecker:
    """Tracks one sequence's text while any stop string is configured (otherwise does nothing,
    so requests without stop strings pay no detokenization per step)."""

    def __init__(self, tokenizer: ChatTokenizer | None, stops: tuple[str, ...]):
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.stops = stops
        self.detok = IncrementalDetokenizer(tokenizer) if stops else None
        self.text = ""
        self.matched: str | None = None

    def add(self, token_id: int) -> bool:
        """Feed one generated token; True when a stop string has appeared (text is then cut
        just before it, as OpenAI's API does)."""
        if self.detok is None:
            return False
        new = self.detok.feed([token_id])
        if not new:
            return False
        # A stop string may straddle the previous text and the new piece.
        search_from = max(0, len(self.text) - max(len(s) for s in self.stops) + 1)
        self.text += new
        best = None
        for s in self.stops:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.matched = best[1]
        return True
