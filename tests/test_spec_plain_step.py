"""A speculative engine's rows without drafts take the plain path, and drafting that cannot pay
is withheld: the verifier sees only the rows that drafted, greedy answers stay those of plain
decoding, and the controller prices steps that verify drafts apart from steps that do not."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, build_tiny

import kvbatch.engine.runtime.llm as llm_module
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.runtime.sequence import Sequence
from kvbatch.engine.speculative.controller import DraftOutlook, SpecConfig, SpecController, StepCostModel
from kvbatch.engine.speculative.verifier import VerifyRow, verify, verify_batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec_plain_step")
    build_tiny("llama", folder, seed=0)
    return folder


def _requests(n: int, repetitive: bool, **sampling) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        base = torch.randint(3, VOCAB, (8,), generator=g).tolist()
        prompt = base * 3 + base[:3] if repetitive else torch.randint(3, VOCAB, (20,), generator=g).tolist()
        params = SamplingParams(max_tokens=16, ignore_eos=True, **({"temperature": 0.0} | sampling))
        out.append(GenerationRequest(f"r{i}", params, prompt_token_ids=prompt))
    return out


def _count_verifier(monkeypatch) -> list[int]:
    """Rows per verify_batch call the engine makes."""
    calls: list[int] = []

    def counting(rows: list[VerifyRow]):
        calls.append(len(rows))
        return verify_batch(rows)

    monkeypatch.setattr(llm_module, "verify_batch", counting)
    return calls


def test_a_step_without_drafts_never_calls_the_verifier(tiny, monkeypatch):
    reqs = _requests(4, repetitive=False)
    ec = EngineConfig(max_num_seqs=4)
    want = [r.output_token_ids for r in LLM(str(tiny), engine_config=ec).generate(reqs)]
    llm = LLM(str(tiny), engine_config=ec, speculative=SpecConfig("ngram", max_len=4))
    monkeypatch.setattr(llm.drafter, "outlook", lambda seq, k: DraftOutlook(0, 0))  # nothing to propose, ever
    calls = _count_verifier(monkeypatch)
    got = llm.generate(reqs)
    assert calls == []
    assert [r.output_token_ids for r in got] == want
    # Each such row still counts its target passes (one per token after the first) and idles.
    assert [r.spec_target_steps for r in got] == [len(w) - 1 for w in want]
    assert llm.stats["spec_draft_tokens"] == 0


def test_only_the_rows_that_drafted_are_verified(tiny, monkeypatch):
    reqs = _requests(4, repetitive=True)
    ec = EngineConfig(max_num_seqs=4)
    want = [r.output_token_ids for r in LLM(str(tiny), engine_config=ec).generate(reqs)]
    llm = LLM(str(tiny), engine_config=ec, speculative=SpecConfig("ngram", max_len=4, adaptive=False))
    real = llm.drafter.outlook
    # Only r0 and r2 ever have something to propose.
    monkeypatch.setattr(llm.drafter, "outlook",
                        lambda seq, k: real(seq, k) if seq.request_id in ("r0", "r2") else DraftOutlook(0, 0))
    calls = _count_verifier(monkeypatch)
    got = llm.generate(reqs)
    assert [r.output_token_ids for r in got] == want
    assert calls and max(calls) <= 2
    assert got[0].spec_draft_tokens > 0 and got[1].spec_draft_tokens == 0 and got[3].spec_draft_tokens == 0


def test_sampled_rows_without_drafts_still_take_the_verifier(tiny, monkeypatch):
    """A sampled row's random stream is the verifier's: it is not moved to the plain sampler."""
    reqs = _requests(2, repetitive=False, temperature=0.8, seed=5)
    llm = LLM(str(tiny), engine_config=EngineConfig(max_num_seqs=2), speculative=SpecConfig("ngram", max_len=4))
    monkeypatch.setattr(llm.drafter, "outlook", lambda seq, k: DraftOutlook(0, 0))
    calls = _count_verifier(monkeypatch)
    llm.generate(reqs)
    assert calls and set(calls) == {2}


def test_greedy_verdicts_equal_the_specification():
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(200):
        rows = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            k = int(torch.randint(0, 5, (1,), generator=g))
            logits = torch.randn(k + 1, 9, generator=g)
            best = logits.argmax(-1).tolist()
            drafts = [best[j] if float(torch.rand(1, generator=g)) < 0.7 else int(torch.randint(0, 9, (1,), generator=g))
                      for j in range(k)]
            rows.append(VerifyRow(logits, drafts, None, greedy, None))
        verdict = verify_batch(rows)
        for n, r in enumerate(rows):
            want = verify(r.logits, r.drafts, None, greedy, None)
            kept = int(verdict.num_accepted[n])
            assert kept == want.num_accepted and verdict.tokens[n, :kept + 1].tolist() == want.tokens


def _decoding(i: int) -> Sequence:
    seq = Sequence(i, f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100))
    seq.token_ids.append(4)
    seq.num_computed_tokens = 3
    return seq


def test_steps_that_verify_drafts_are_priced_apart():
    cost = StepCostModel()
    for _ in range(5):
        cost.observe(32, 0.060, 0, 0.0)
        cost.observe(33, 0.075, 1, 0.0, verified=True)
    assert cost.step_time(32) == pytest.approx(0.060)
    assert cost.step_time(33, True) == pytest.approx(0.075)
    assert cost.step_time(32, True) > cost.step_time(32)  # extended from the drafted measurement
    fresh = StepCostModel()
    fresh.observe(32, 0.060, 0, 0.0)
    assert fresh.step_time(33, True) == fresh.step_time(33)  # none measured yet: priced as plain, then learned


def _stopped_controller(cost: StepCostModel, n: int) -> tuple[SpecController, list[Sequence]]:
    """``n`` requests whose drafts were never kept and whose probe is due."""
    ctl = SpecController(SpecConfig("ngram", max_len=4), cost=cost)
    seqs = [_decoding(i) for i in range(n)]
    for seq in seqs:
        for _ in range(200):
            ctl.observe(seq, 2, 0)
        for _ in range(ctl.config.probe_every):
            ctl.observe(seq, 0, 0)
    return ctl, seqs


@pytest.mark.parametrize("surcharge, granted", [(0.17, False), (0.021, False), (0.019, True), (0.001, True)])
def test_probes_are_withheld_where_a_drafted_step_costs_more(surcharge, granted):
    """At batch 32, a step that verifies even one draft is priced at its measurement: probes go
    ahead on their own only where it costs at most 2% more than a plain step."""
    cost = StepCostModel(per_token=1e-4)
    for tokens in range(32, 70):
        cost.table[tokens] = 0.060
        cost.drafted_table[tokens] = 0.060 * (1 + surcharge)
    ctl, seqs = _stopped_controller(cost, 32)
    ctl.plan(seqs, 1000, lambda seq, k: DraftOutlook(4, 0))
    assert [s.num_lookahead for s in seqs] == [1 if granted else 0] * 32


def test_probes_ride_along_a_step_that_drafts_anyway():
    dear = StepCostModel(per_token=1e-4)
    for tokens in range(3, 12):
        dear.table[tokens] = 0.060
        dear.drafted_table[tokens] = 0.062
    ctl, seqs = _stopped_controller(dear, 2)
    good = _decoding(99)
    for _ in range(50):
        ctl.planned[good.seq_id] = 8
        ctl.observe(good, 4, 4)
    looks = {99: DraftOutlook(4, 8)}
    ctl.plan(seqs + [good], 1000, lambda seq, k: looks.get(seq.seq_id, DraftOutlook(4, 0)))
    assert good.num_lookahead >= 2
    assert [s.num_lookahead for s in seqs] == [1, 1]


def test_a_step_where_no_draft_could_pay_looks_up_only_the_due_probes():
    """Rows whose drafts were never kept, at batch 32 where a drafted step costs 17% more: the
    drafter's lookups (a measurable share of such a step) are skipped but for a due probe."""
    cost = StepCostModel(per_token=1e-4)
    for tokens in range(32, 70):
        cost.table[tokens] = 0.060
        cost.drafted_table[tokens] = 0.070
    ctl, seqs = _stopped_controller(cost, 32)
    for seq in seqs[1:]:
        ctl.observe(seq, 2, 0)  # drafted (and lost) just now: no probe due
    asked: list[int] = []
    ctl.plan(seqs, 1000, lambda seq, k: asked.append(seq.seq_id) or DraftOutlook(4, 0))
    assert asked == [seqs[0].seq_id]
    cheap = StepCostModel(per_token=1e-4)  # drafted steps cost what plain ones do: drafts may pay
    for tokens in range(32, 70):
        cheap.table[tokens] = cheap.drafted_table[tokens] = 0.060
    fresh = SpecController(SpecConfig("ngram", max_len=4), cost=cheap)  # 2/3 of drafts assumed kept
    asked.clear()
    fresh.plan(seqs, 1000, lambda seq, k: asked.append(seq.seq_id) or DraftOutlook(4, 0))
    assert sorted(asked) == sorted(s.seq_id for s in seqs)


def test_steps_without_slots_leave_a_slots_price_alone():
    """Hundreds of steps that offered no slot (their drafter call took a few microseconds) must
    not inflate the price of a slot: it stays what drafting steps measured."""
    cost = StepCostModel()
    for _ in range(20):
        cost.observe(32, 0.060, 8, 0.0008)  # 0.1 ms per slot
    for _ in range(500):
        cost.observe(32, 0.060, 0, 0.00001)
    assert cost.per_draft == pytest.approx(0.0001)


def test_a_stale_plain_price_is_measured_again_before_drafts_are_weighed_against_it():
    """While steps draft, the plain step's price at a size is not re-measured; once it is
    refresh_every (64) steps old the next step of that size runs plain, then drafting resumes."""
    cost = StepCostModel(per_token=1e-4)
    cost.observe(2, 0.020, 0, 0.0)
    for _ in range(cost.refresh_every - 1):
        cost.observe(5, 0.021, 3, 0.0001, verified=True)
    assert not cost.stale(2) and cost.refresh_every == 64
    cost.observe(5, 0.021, 3, 0.0001, verified=True)
    assert cost.stale(2) and cost.stale(7)  # 7: never run plain, once drafted steps were measured
    ctl = SpecController(SpecConfig("ngram", max_len=4), cost=cost)
    seqs = [_decoding(i) for i in range(2)]
    ctl.plan(seqs, 1000, lambda seq, k: DraftOutlook(4, 8))
    assert [s.num_lookahead for s in seqs] == [0, 0]  # the measuring step
    cost.observe(2, 0.020, 0, 0.0)
    ctl.plan(seqs, 1000, lambda seq, k: DraftOutlook(4, 8))
    assert all(s.num_lookahead > 0 for s in seqs)


def test_an_old_dear_drafted_price_is_tried_again_and_replaced():
    """One dear drafted pass (a verify width's first, which builds its kernels) stops drafting at
    that size only until it is refresh_every steps old: then the size is priced as plain (tried),
    and the next measurement replaces the old price instead of averaging with it."""
    cost = StepCostModel(per_token=1e-4)
    cost.observe(1, 0.020, 0, 0.0)
    cost.observe(6, 0.080, 5, 0.0001, verified=True)  # the first pass at width 6
    assert cost.step_time(6, True) == pytest.approx(0.080)
    for _ in range(cost.refresh_every):
        cost.observe(1, 0.020, 0, 0.0)
    assert cost.step_time(6, True) == pytest.approx(cost.step_time(6))  # too old: priced as plain
    cost.observe(6, 0.026, 5, 0.0001, verified=True)
    assert cost.step_time(6, True) == pytest.approx(0.026)  # replaced, not 0.8 * 0.080 + 0.2 * 0.026
    cost.observe(6, 0.030, 5, 0.0001, verified=True)
    assert cost.step_time(6, True) == pytest.approx(0.8 * 0.026 + 0.2 * 0.030)  # fresh: averaged
