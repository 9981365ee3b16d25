"""Drafts from last night: a suffix index over earlier runs' answers (SuffixDecoding, arXiv 2411.04975).

A nightly batch answers much what it answered yesterday: the same templates, the same
documents, paraphrased questions. Yesterday's answers are a corpus to draft from. For a request's
latest tokens, :class:`SuffixIndex` finds the longest suffix that occurs in the corpus and follows
it with the continuation most often seen after it, token by token (at each step the most
frequent next token among the occurrences still agreeing, as a suffix tree's frequency-weighted
walk does). It is a suffix array, not a pointer tree: every occurrence of a pattern is one
contiguous range of the array, so a lookup is two binary searches, the counts of what follows
are ``np.unique`` over that range, and the index is the tokens and their suffix array, int64,
each held twice (numpy for the counts, ``array`` for the searches): 32 bytes per token, rather
than a node per substring.

:class:`~kvbatch.engine.speculative.drafters.SuffixDrafter` runs it beside prompt lookup over the
request's own prompt and output: each step, per request, the source with the longer match
proposes. The two report their match lengths as different evidence (the corpus's offset by
:data:`CORPUS_EVIDENCE`), so the adaptive controller learns each source's acceptance per match
length apart and sizes its drafts accordingly; a source that stops paying stops getting slots.
"""

from __future__ import annotations

import bisect
import json
from array import array
from collections.abc import Iterable, Sequence as Seq
from typing import Any

import fsspec
import numpy as np

SEPARATOR = -1  # between answers: never matched, and a continuation stops at it
CORPUS_EVIDENCE = 100  # a corpus match of n tokens is evidence CORPUS_EVIDENCE + n
MAX_PATTERN = 32  # longest suffix looked for: longer agreements add little evidence
MAX_OCCURRENCES = 4096  # occurrences counted per continuation step (a strided sample beyond)


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The suffix array of ``tokens`` (int64): start positions in lexicographic order of their
    suffixes. Prefix doubling, every round one stable sort of (rank, rank k further on):
    O(n log^2 n) in numpy, rounds ~ log2 of the longest repeat."""
    n = int(tokens.size)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)
    k = 1
    while True:
        second = np.zeros(n, dtype=np.int64)
        if k < n:
            second[: n - k] = rank[k:] + 1  # 0: past the end, which sorts first
        key = rank * (n + 1) + second
        sa = np.argsort(key, kind="stable")
        sorted_key = key[sa]
        new = np.empty(n, dtype=np.int64)
        new[sa] = np.concatenate(([0], np.cumsum(sorted_key[1:] != sorted_key[:-1])))
        rank = new
        if int(rank[sa[-1]]) == n - 1 or k >= n:
            return sa
        k *= 2


class SuffixIndex:
    """Every suffix of a corpus of token sequences, searchable by pattern."""

    def __init__(self, documents: Iterable[Seq[int]]) -> None:
        flat: list[int] = []
        self.documents = 0
        for doc in documents:
            if len(doc):
                flat.extend(int(t) for t in doc)
                flat.append(SEPARATOR)
                self.documents += 1
        self.tokens = np.asarray(flat, dtype=np.int64)
        self.sa = suffix_array(self.tokens)
        # Plain arrays for the binary searches: a slice of an array compares lexicographically in C.
        self._tokens = array("q", self.tokens.tobytes())
        self._sa = array("q", self.sa.tobytes())

    def __len__(self) -> int:
        return int(self.tokens.size)

    def _range(self, pattern: array) -> tuple[int, int]:
        m = len(pattern)
        t = self._tokens

        def prefix(i: int) -> array:
            return t[i:i + m]

        lo = bisect.bisect_left(self._sa, pattern, key=prefix)
        hi = bisect.bisect_right(self._sa, pattern, key=prefix, lo=lo)
        return lo, hi

    def longest_match(self, context: Seq[int], max_pattern: int = MAX_PATTERN) -> tuple[int, int, int]:
        """(n, lo, hi): the longest suffix of ``context`` (at most ``max_pattern`` tokens) found in
        the corpus, and its occurrences ``sa[lo:hi]``; n = 0 when not even the last token occurs.
        Binary search over n: a suffix that occurs has every shorter one occurring too."""
        best = (0, 0, 0)
        lo_n, hi_n = 0, min(max_pattern, len(context))
        while lo_n < hi_n:
            mid = (lo_n + hi_n + 1) // 2
            lo, hi = self._range(array("q", context[-mid:]))
            if hi > lo:
                best, lo_n = (mid, lo, hi), mid
            else:
                hi_n = mid - 1
        return best

    def continuation(self, n: int, lo: int, hi: int, k: int) -> list[int]:
        """Up to ``k`` tokens following the pattern of length ``n`` found at ``sa[lo:hi]``: at each
        step the token most often next among the occurrences that agree so far (ties: the lowest
        id, so drafts are reproducible); stops at the end of an answer."""
        starts = self.sa[lo:hi]
        if starts.size > MAX_OCCURRENCES:  # the range is sorted by what follows: a stride samples it fairly
            starts = starts[:: -(-starts.size // MAX_OCCURRENCES)]
        out: list[int] = []
        size = self.tokens.size
        for depth in range(k):
            if starts.size == 1:  # one occurrence left (a long match's usual case): what follows it
                at = int(starts[0]) + n + depth
                for token in self._tokens[at:at + k - depth]:
                    if token == SEPARATOR:
                        break
                    out.append(token)
                break
            pos = starts + n + depth
            starts = starts[pos < size]
            if not starts.size:
                break
            nxt = self.tokens[starts + n + depth]
            values, counts = np.unique(nxt, return_counts=True)
            best = int(values[int(np.argmax(counts))])
            if best == SEPARATOR:
                break
            out.append(best)
            starts = starts[nxt == best]
        return out


def read_corpus(url: str, tokenizer: Any, storage_options: dict[str, Any] | None = None) -> SuffixIndex:
    """The answers of earlier runs at ``url`` (a file, a glob, any fsspec URL), as the model wrote
    them, indexed. Either the pipeline's results Parquet (``decode_results``): its
    ``output_token_ids``, the exact tokens; or OpenAI Batch output JSONL (``kvbatch generate``,
    ``decode``, ``serve``): each choice's message content, tokenized again and ended with the
    end-of-turn token so a draft can propose the end of an answer (text a model wrote tokenizes
    back to its own tokens nearly always; where it does not, drafts from it are merely rejected).
    Lines without an answer (errors, rejects) are skipped; a file of neither kind is an error
    naming it. ``storage_options``: fsspec's, for an object store."""
    files = fsspec.open_files(url, mode="rb", **(storage_options or {}))
    if not files:
        raise ValueError(f"--spec suffix: no file matches {url!r}")
    end = list(tokenizer.eos_token_ids[:1]) if getattr(tokenizer, "eos_token_ids", None) else []
    documents: list[list[int]] = []
    for f in files:
        with f as fh:
            raw = fh.read()
        if f.path.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pq.read_table(pa.BufferReader(raw))
            if "output_token_ids" not in table.column_names:
                raise ValueError(f"--spec suffix: {f.path} has no 'output_token_ids' column "
                                 f"(columns: {table.column_names})")
            documents.extend(ids for ids in table.column("output_token_ids").to_pylist() if ids)
            continue
        if tokenizer is None:
            raise ValueError(f"--spec suffix: {f.path} holds text, and this model has no tokenizer to read it "
                             "(give results Parquet with output_token_ids)")
        for number, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                body = (json.loads(line).get("response") or {}).get("body") or {}
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"--spec suffix: {f.path} line {number} is not an OpenAI Batch output line") from None
            for choice in body.get("choices") or []:
                content = (choice.get("message") or {}).get("content")
                if isinstance(content, str) and content:
                    documents.append(tokenizer.encode(content) + end)
    return SuffixIndex(documents)
