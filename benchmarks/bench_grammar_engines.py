"""Structured outputs' grammar engines side by side: llguidance (kvbatch's) and xgrammar, replaying one batch's tokens.

    .venv/bin/pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi   # the bench-xgrammar extra's pins;
                                                                      # --no-deps: torch etc. stay as pinned
    python benchmarks/bench_grammar_engines.py                # SmolLM2-135M, batch 64, 64 replayed steps
    python benchmarks/bench_grammar_engines.py --rows 16 --steps 32 --threads 2

First a real run: one engine answers ``--rows`` greedy chat requests whose ``response_format``
cycles through bench_grammar_mask's three JSON schemas and ``json_object`` (at most
``--max-tokens`` tokens each), with llguidance's masks as the engine applies them. Their output
ids are then replayed through both engines over the same tokenizer (SmolLM2's ``tokenizer.json``;
xgrammar's ``TokenizerInfo`` is built from a ``PreTrainedTokenizerFast`` of that text, no hub
download), so both walk the same grammar states. The replay keeps ``--rows`` slots busy for
``--steps`` steps: a slot whose sequence has ended takes another recorded sequence with a fresh
matcher (as continuous batching refills the batch), so every step fills ``--rows`` masks.

Printed: the tokenizer build; each format's first compile (schema to a matcher) and the cached path
(a new matcher of an already compiled schema: llguidance's ``deep_copy``, xgrammar's cache hit plus
``GrammarMatcher``); per step (median) the mask fill (llguidance: its executor's parallel fill, the
call ``fill_draft_bitmask`` makes, and that whole function; xgrammar: ``BatchGrammarMatcher``'s
``batch_fill_next_token_bitmask`` with the same thread count, and ``fill_next_token_bitmask`` row by
row) and the advance (``consume_token`` per row; ``batch_accept_token``); the replayed rows and
steps whose allowed token sets differ, with examples; ratio lines (xgrammar / llguidance). Both
engines compile JSON the way kvbatch asks llguidance to: no insignificant whitespace, separators
``,`` and ``:``, unknown properties allowed unless the schema says otherwise (xgrammar's
``strict_mode=False``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_grammar_mask import SCHEMAS
from benchmarks.bench_kv_scale import cpu_line
from kvbatch.engine.runtime import grammar_mask
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.text.structured import GrammarCompiler
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.io.batch_requests import parse_response_format

FORMATS = [{"type": "json_schema", "json_schema": {"name": "s", "schema": s, "strict": True}} for s in SCHEMAS] + [
    {"type": "json_object"}]


def record(model: str, rows: int, max_tokens: int) -> tuple[ChatTokenizer, list[tuple[int, list[int]]]]:
    """(the engine's tokenizer, [(format index, output ids)] of a real constrained greedy run)."""
    llm = LLM(model, engine_config=EngineConfig(max_num_seqs=rows, device="cpu"))
    formats = [parse_response_format(f) for f in FORMATS]
    reqs = [GenerationRequest(f"r{i}", SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      response_format=formats[i % len(formats)]),
                              messages=[{"role": "user", "content": f"Review {i}: the food was good, the service "
                                                                    "slow. Answer in JSON."}])
              for i in range(rows)]
    results = sorted(llm.generate(reqs), key=lambda r: int(r.request_id[1:]))
    bad = [r.request_id for r in results if r.error is not None]
    if bad:
        raise SystemExit(f"rows in error in the recorded run: {bad}")
    return llm.tokenizer, [(i % len(formats), list(r.output_token_ids)) for i, r in enumerate(results)]


def xgrammar_schema(response_format: str) -> str:
    """The schema of a canonical response format (its keys sorted, as llguidance gets it: properties
    are generated in that order by both engines)."""
    rf = json.loads(response_format)
    return json.dumps(rf["schema"] if rf["type"] == "json_schema" else {"type": "object"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="replayed steps, each filling --rows masks")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads; the grammar engines use min(8, CPUs) as the engine does")
    args = ap.parse_args()
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise SystemExit(f"{exc}: pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi (see the docstring)") from None
    from importlib.metadata import version

    from tokenizers import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    grammar_threads = max(1, min(8, os.cpu_count() or 1))  # grammar_mask._par_executor's count
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  cpu: {cpu_line()}  "
          f"torch threads: {torch.get_num_threads()}  grammar threads: {grammar_threads}  model: {args.model}  "
          f"rows: {args.rows}  llguidance {version('llguidance')}  xgrammar {version('xgrammar')}")
    print(f"# command: python {' '.join(sys.argv)}")

    t0 = time.perf_counter()
    tok, recorded = record(args.model, args.rows, args.max_tokens)
    lens = [len(ids) for _, ids in recorded]
    print(f"recorded run: {len(recorded)} rows, {sum(lens)} tokens in {time.perf_counter() - t0:.1f}s; "
          f"length per format (mean): " + ", ".join(
              f"{['enum', 'int+bool', 'nested', 'json_object'][f]} "
              f"{statistics.mean(len(ids) for g, ids in recorded if g == f):.1f}" for f in range(len(FORMATS))))

    vocab, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    words = (vocab + 31) // 32
    canon = [parse_response_format(f) for f in FORMATS]

    # -- tokenizers and compiles
    gc = GrammarCompiler(tok.to_json(), vocab, eos)
    t0 = time.perf_counter()
    _ = gc.lltokenizer  # built on first use: timed here
    ll_tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_json()))
    raw = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    # xgrammar finds special tokens only by their text (none here): blank kvbatch's special ids so
    # its masks never allow them (as given, it treats <|im_start|> etc. as plain text in strings).
    encoded = [""] * vocab
    for text, i in hf.get_vocab().items():
        if i < vocab and i not in tok.special_token_ids:
            encoded[i] = text
    info = xgr.TokenizerInfo(encoded, vocab_type=raw.vocab_type, vocab_size=vocab, stop_token_ids=eos,
                             add_prefix_space=raw.add_prefix_space)
    xc = xgr.GrammarCompiler(info, max_threads=grammar_threads)
    xg_tok_s = time.perf_counter() - t0
    ll_first, xg_first, compiled = [], [], []
    for rf in canon:
        t0 = time.perf_counter()
        m, problem = gc.matcher(rf)
        ll_first.append(time.perf_counter() - t0)
        assert m is not None, problem
        t0 = time.perf_counter()
        cg = xc.compile_json_schema(xgrammar_schema(rf), any_whitespace=False, separators=(",", ":"), strict_mode=False)
        xgr.GrammarMatcher(cg)
        xg_first.append(time.perf_counter() - t0)
        compiled.append(cg)

    def xg_matcher(f: int) -> object:
        cg = xc.compile_json_schema(xgrammar_schema(canon[f]), any_whitespace=False, separators=(",", ":"),
                                    strict_mode=False)  # xgrammar's own cache answers
        return xgr.GrammarMatcher(cg)

    new_ll: list[float] = []
    new_xg: list[float] = []

    def fresh(f: int) -> tuple[object, object]:
        t0 = time.perf_counter()
        lm, _ = gc.matcher(canon[f])
        t1 = time.perf_counter()
        xm = xg_matcher(f)
        new_ll.append(t1 - t0)
        new_xg.append(time.perf_counter() - t1)
        return lm, xm

    # -- the replay: --rows slots, each walking recorded sequences, refilled when one ends
    ex = grammar_mask._par_executor()
    bxm = xgr.BatchGrammarMatcher(max_threads=grammar_threads)
    slots = []  # [sequence index, position, llguidance matcher, xgrammar matcher]
    nseq = len(recorded)
    for r in range(args.rows):
        lm, xm = fresh(recorded[r % nseq][0])
        slots.append([r % nseq, 0, lm, xm])
    t = {k: [] for k in ("ll_fill", "ll_engine", "xg_fill", "xg_rows", "ll_adv", "xg_adv")}
    diff_rows = diff_steps = ll_refused = xg_refused = 0
    kinds = {"llguidance a subset": 0, "xgrammar a subset": 0, "neither": 0}
    by_format = {k: [0] * len(FORMATS) for k in kinds}
    examples: dict[str, list[str]] = {k: [] for k in kinds}
    passes = args.rows
    for step in range(args.steps):
        ll_mask = torch.full((args.rows, words), -1, dtype=torch.int32)
        xg_mask = torch.full((args.rows, words), -1, dtype=torch.int32)
        xg_rows = torch.full((args.rows, words), -1, dtype=torch.int32)
        pairs = [(s[2], r) for r, s in enumerate(slots)]
        t0 = time.perf_counter()
        ex.unsafe_compute_mask_ptr(pairs, ll_mask.data_ptr(), words * 4, args.rows)
        t["ll_fill"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine_mask, _ = grammar_mask.fill_draft_bitmask([(m, r, []) for m, r in pairs], args.rows, vocab, vocab)
        t["ll_engine"].append(time.perf_counter() - t0)
        xms = [s[3] for s in slots]
        t0 = time.perf_counter()
        bxm.batch_fill_next_token_bitmask(xms, xg_mask)
        t["xg_fill"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for r, xm in enumerate(xms):
            xm.fill_next_token_bitmask(xg_rows, r)
        t["xg_rows"].append(time.perf_counter() - t0)
        assert torch.equal(xg_mask, xg_rows) and torch.equal(ll_mask, engine_mask)
        differ = (ll_mask != xg_mask).any(1)
        if differ.any():
            diff_steps += 1
            diff_rows += int(differ.sum())
            for r in differ.nonzero().flatten().tolist():
                lbits = ((ll_mask[r].view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()
                xbits = ((xg_mask[r].view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()
                only_ll = [i for i in (lbits > xbits).nonzero().flatten().tolist() if i < vocab]
                only_xg = [i for i in (xbits > lbits).nonzero().flatten().tolist() if i < vocab]
                kind = "llguidance a subset" if not only_ll else "xgrammar a subset" if not only_xg else "neither"
                kinds[kind] += 1
                by_format[kind][recorded[slots[r][0]][0]] += 1
                if len(examples[kind]) >= 3:
                    continue
                seq, pos = slots[r][0], slots[r][1]
                prefix = tok.decode(recorded[seq][1][:pos])
                show = lambda ids: [hf.convert_ids_to_tokens(i) for i in ids[:5]]
                if any(e.startswith(f"    after {prefix!r}:") for e in examples[kind]):
                    continue
                examples[kind].append(f"    after {prefix!r}: only llguidance {len(only_ll)} {show(only_ll)}, "
                                f"only xgrammar {len(only_xg)} {show(only_xg)}")
        toks = [recorded[s[0]][1][s[1]] for s in slots]
        for r, tk in enumerate(toks):  # the replayed token must be allowed by both
            ll_refused += not (ll_mask[r, tk // 32] >> (tk % 32)) & 1
            xg_refused += not (xg_mask[r, tk // 32] >> (tk % 32)) & 1
        t0 = time.perf_counter()
        for s, tk in zip(slots, toks):
            s[2].consume_token(tk)
        t["ll_adv"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bxm.batch_accept_token(xms, toks)
        t["xg_adv"].append(time.perf_counter() - t0)
        for r, s in enumerate(slots):
            s[1] += 1
            if s[1] == len(recorded[s[0]][1]):  # ended: the slot takes the next recorded sequence
                s[0] = (s[0] + 17) % nseq if nseq > 1 else s[0]
                passes += 1
                s[1] = 0
                s[2], s[3] = fresh(recorded[s[0]][0])

    ms = lambda xs: statistics.median(xs) * 1e3
    print(f"tokenizer build: llguidance {ll_tok_s * 1e3:.0f} ms, xgrammar {xg_tok_s * 1e3:.0f} ms "
          f"(TokenizerInfo from a PreTrainedTokenizerFast + GrammarCompiler; vocab type {info.vocab_type.name}; "
          f"special ids it detects itself {len(raw.special_token_ids)}, blanked {len(tok.special_token_ids)})")
    for name, a, b in zip(["enum", "int+bool", "nested", "json_object"], ll_first, xg_first):
        print(f"  first compile {name:<12} llguidance {a * 1e3:8.2f} ms   xgrammar {b * 1e3:8.2f} ms")
    print(f"  first compile, all four     llguidance {sum(ll_first) * 1e3:8.2f} ms   xgrammar {sum(xg_first) * 1e3:8.2f} ms")
    print(f"  new matcher, cached (median of {len(new_ll)}) llguidance {ms(new_ll) * 1e3:7.1f} us   "
          f"xgrammar {ms(new_xg) * 1e3:7.1f} us")
    print(f"replay: {args.steps} steps x {args.rows} rows ({passes} sequences walked)")
    print(f"  fill  llguidance executor (par)        {ms(t['ll_fill']):7.3f} ms/step")
    print(f"  fill  llguidance fill_draft_bitmask    {ms(t['ll_engine']):7.3f} ms/step   (the engine's whole call)")
    print(f"  fill  xgrammar batch_fill (batch API)  {ms(t['xg_fill']):7.3f} ms/step")
    print(f"  fill  xgrammar fill per row            {ms(t['xg_rows']):7.3f} ms/step")
    print(f"  advance llguidance consume_token/row   {ms(t['ll_adv']):7.3f} ms/step")
    print(f"  advance xgrammar batch_accept_token    {ms(t['xg_adv']):7.3f} ms/step")
    print(f"allowed token sets: {diff_rows} of {args.steps * args.rows} row-steps differ, in {diff_steps} of "
          f"{args.steps} steps ({', '.join(f'{k}: {v}' for k, v in kinds.items())}); replayed tokens refused: "
          f"llguidance {ll_refused}, xgrammar {xg_refused}")
    for kind, lines in examples.items():
        if lines:
            print(f"  {kind} (by format: " + ", ".join(
                f"{name} {n}" for name, n in zip(["enum", "int+bool", "nested", "json_object"], by_format[kind]))
                + "), e.g.:")
            for line in lines:
                print(line)
    print(f"ratio xgrammar/llguidance: compile first {sum(xg_first) / sum(ll_first):.2f}x, "
          f"new matcher cached {ms(new_xg) / ms(new_ll):.2f}x, fill per step {ms(t['xg_fill']) / ms(t['ll_fill']):.2f}x "
          f"(batch API vs executor; per-row loop {ms(t['xg_rows']) / ms(t['ll_fill']):.2f}x), advance per step {ms(t['xg_adv']) / ms(t['ll_adv']):.2f}x")


if __name__ == "__main__":
    main()
