"""Drafts from last night (engine/speculative/suffix.py, issue 44 part 3): the suffix array and its
lookups against brute force (hypothesis), the corpus readers, and ``--spec suffix:ANSWERS`` in the
engine and on the command line: greedy answers unchanged, drafts taken from earlier answers and kept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kvbatch.cli.main import main
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.speculative.controller import SpecConfig
from kvbatch.engine.speculative.suffix import SEPARATOR, SuffixIndex, read_corpus, suffix_array
from kvbatch.engine.text.tokenizer import ChatTokenizer
from tests.test_response_cache import _row, _write
from tests.tiny_models import VOCAB, build_tiny, build_tiny_chat_model

tokens = st.lists(st.integers(0, 4), max_size=60)
documents = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=20), max_size=6)


@given(tokens)
def test_the_suffix_array_sorts_every_suffix(ts):
    sa = suffix_array(np.asarray(ts, dtype=np.int64))
    assert sa.tolist() == sorted(range(len(ts)), key=lambda i: ts[i:])


def _occurrences(docs: list[list[int]], pattern: list[int]) -> list[tuple[int, int]]:
    m = len(pattern)
    return [(d, i) for d, doc in enumerate(docs) for i in range(len(doc) - m + 1) if doc[i:i + m] == pattern]


@given(documents, st.lists(st.integers(0, 4), min_size=1, max_size=12), st.integers(1, 6))
def test_lookups_equal_brute_force(docs, context, k):
    index = SuffixIndex(docs)
    n, lo, hi = index.longest_match(context, max_pattern=8)
    # The longest suffix of the context (at most 8 tokens) that occurs inside one document.
    want = max((m for m in range(1, min(8, len(context)) + 1) if _occurrences(docs, context[-m:])), default=0)
    assert n == want
    if not n:
        return
    assert hi - lo == len(_occurrences(docs, context[-n:]))
    # The continuation: at each step the most frequent next token (lowest id on ties) among the
    # occurrences that still agree, up to the end of a document.
    expect: list[int] = []
    live = [(d, i + n) for d, i in _occurrences(docs, context[-n:])]
    for _ in range(k):
        nxt = [docs[d][j] for d, j in live if j < len(docs[d])]
        if len(nxt) < len(live):  # some occurrences end their document here: the end counts as a token
            nxt += [SEPARATOR] * (len(live) - len(nxt))
        counts = {t: nxt.count(t) for t in set(nxt)}
        best = min(counts, key=lambda t: (-counts[t], t))
        if best == SEPARATOR:
            break
        expect.append(best)
        live = [(d, j + 1) for d, j in live if j < len(docs[d]) and docs[d][j] == best]
    assert index.continuation(n, lo, hi, k) == expect


def test_spec_suffix_needs_answers_and_names_a_bad_file(tmp_path):
    with pytest.raises(ValueError, match="suffix:ANSWERS needs"):
        SpecConfig.parse("suffix:")
    assert SpecConfig.parse("suffix:s3://b/night/*.jsonl").corpus == "s3://b/night/*.jsonl"
    tok = ChatTokenizer.from_model("smollm2-135m")
    with pytest.raises(ValueError, match="no file matches"):
        read_corpus(str(tmp_path / "missing-*.jsonl"), tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"response": {"body": {}}}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2 is not an OpenAI Batch output line"):
        read_corpus(str(bad), tok)
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "r.parquet")
    with pytest.raises(ValueError, match=r"r.parquet has no 'output_token_ids' column"):
        read_corpus(str(tmp_path / "r.parquet"), tok)


def test_output_jsonl_answers_are_tokenized_and_end_their_turn(tmp_path):
    tok = ChatTokenizer.from_model("smollm2-135m")
    lines = [{"custom_id": "a", "response": {"status_code": 200, "body": {"choices": [
                 {"message": {"role": "assistant", "content": "The answer is 42."}}]}}},
             {"custom_id": "b", "response": None, "error": {"message": "bad row"}}]
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    index = read_corpus(str(tmp_path / "out.jsonl"), tok)
    assert index.documents == 1
    assert index.tokens.tolist() == tok.encode("The answer is 42.") + [tok.eos_token_ids[0], SEPARATOR]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("suffix_tiny")
    build_tiny("llama", folder, seed=0)
    return folder


def _requests(seed: int, n: int = 6) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    return [GenerationRequest(f"r{i}", SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0),
                              prompt_token_ids=torch.randint(3, VOCAB, (12,), generator=g).tolist())
            for i in range(n)]


def test_last_nights_results_draft_tonights_and_change_nothing(tiny, tmp_path):
    """Last night's results Parquet (the pipeline's decode_results: output_token_ids) drafts tonight's
    rows: greedy answers equal plain decoding's, and the corpus drafts far more of them, kept, than
    prompt lookup finds on its own."""
    reqs = _requests(0)
    ec = EngineConfig(max_num_seqs=2, batch_invariant=True)
    plain = LLM(str(tiny), engine_config=ec).generate(reqs)
    night = tmp_path / "night-1.parquet"
    pq.write_table(pa.table({"custom_id": [r.request_id for r in plain],
                             "output_token_ids": [r.output_token_ids for r in plain]}), night)

    ngram = LLM(str(tiny), engine_config=ec, speculative=SpecConfig("ngram", max_len=8))
    suffix = LLM(str(tiny), engine_config=ec, speculative=SpecConfig.parse(f"suffix:{night}", 8))
    got_ngram, got_suffix = ngram.generate(reqs), suffix.generate(reqs)
    want = [r.output_token_ids for r in plain]
    assert [r.output_token_ids for r in got_suffix] == [r.output_token_ids for r in got_ngram] == want
    s, g = suffix.stats, ngram.stats
    assert suffix.drafter.corpus_drafts > 0
    assert s["spec_accepted_tokens"] >= 0.5 * sum(len(w) for w in want), s
    assert s["spec_accepted_tokens"] >= 0.8 * s["spec_draft_tokens"], s
    assert s["spec_accepted_tokens"] > 2 * g["spec_accepted_tokens"], (s, g)
    # Other prompts than last night's: the corpus has nothing to say, and the answers are still exact.
    other = _requests(1)
    assert [r.output_token_ids for r in LLM(str(tiny), engine_config=ec,
                                             speculative=SpecConfig.parse(f"suffix:{night}", 8)).generate(other)] == [
        r.output_token_ids for r in LLM(str(tiny), engine_config=ec).generate(other)]


def test_the_command_line_takes_last_nights_output(tmp_path):
    """``kvbatch generate --spec suffix:OUT.jsonl`` reads an earlier run's output and leaves greedy answers as they were."""
    model = build_tiny_chat_model(tmp_path / "chat", max_positions=96)
    rows = [_row(f"q{i}", f"Question {i}", temperature=0, max_tokens=8) for i in range(2)]
    src = _write(tmp_path / "in.jsonl", rows)

    def run(name: str, *extra: str) -> list[str]:
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", "--model", str(model), "--input", str(src), "--output", str(out),
                     "--no-progress", *extra]) == 0
        return [json.loads(x)["response"]["body"]["choices"][0]["message"]["content"]
                for x in out.read_text().splitlines()]

    first = run("first")
    assert run("second", "--spec", f"suffix:{tmp_path / 'first.jsonl'}") == first
