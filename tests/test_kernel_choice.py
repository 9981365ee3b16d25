"""The CPU projection kernel is chosen by measurement: the choice follows the timings, is cached
on disk under a key of everything it depends on, yields to a forced choice, and whichever kernel
runs, the model computes the same numbers."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest
import torch

from kvbatch.engine.models import factory
from kvbatch.engine.runtime.engine_config import LINEAR_CHOICES, EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels.cpu import kernel_choice as kc
from kvbatch.kernels.cpu.linear import (
    BLAS,
    BUCKET_BOUNDS,
    MIXED,
    ONEDNN,
    LinearFormat,
    bucket_index,
    onednn_available,
)
from tests.logit_capture import assert_logits_match, capture_logits
from tests.tiny_models import VOCAB, build_tiny

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN packed linear")
SHAPES = [(96, 64), (64, 160), (320, 64)]


def fake_timer(ms: dict[str, list[float]], calls: list | None = None):
    """A timer that reports ``ms[kind][bucket]`` (and still runs the kernel once: the measurement
    must really exercise it). A kind ``ms`` does not name (the native GEMV, where the native
    kernels build and the test is about the others) takes 1000 ms: it never wins, and ``calls``
    does not list it."""

    def timer(kind: str, rows: int, run) -> float:
        run()
        if kind not in ms:
            return 1.0
        if calls is not None:
            calls.append((kind, rows))
        return ms[kind][kc.BUCKET_ROWS.index(rows)] / 1e3

    return timer


def refusing_timer(kind, rows, run):
    raise AssertionError("measured although the choice was cached or forced")


def test_buckets_cover_every_row_count():
    assert [bucket_index(r) for r in (1, 2, 8, 9, 64, 65, 2048)] == [0, 1, 1, 2, 2, 3, 3]
    assert len(kc.BUCKET_ROWS) == len(BUCKET_BOUNDS) + 1
    assert all(bucket_index(r) == i for i, r in enumerate(kc.BUCKET_ROWS))


@needs_onednn
def test_choice_follows_the_measurement(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)
    # BLAS wins one row, oneDNN wins everything above by far more than the switch margin.
    timer = fake_timer({ONEDNN: [3.0, 3.0, 5.0, 9.0], BLAS: [2.0, 6.0, 9.0, 20.0]})
    choice = kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path, timer=timer)
    assert choice.source == "measured"
    assert choice.fmt == LinearFormat(MIXED, torch.float32, bucket_kinds=(BLAS, ONEDNN, ONEDNN, ONEDNN))
    # Swap the figures: oneDNN everywhere, a single layout (another cache dir: a fresh measurement).
    timer = fake_timer({ONEDNN: [1.0, 3.0, 5.0, 9.0], BLAS: [2.0, 6.0, 9.0, 20.0]})
    choice = kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path / "b", timer=timer)
    assert choice.fmt == LinearFormat(ONEDNN, torch.float32)


def test_a_small_gain_keeps_one_layout():
    # BLAS is 5% faster at 8 and 64 rows: not worth a second copy of every weight.
    assert kc.pick({ONEDNN: [1.0, 1.0, 1.0, 1.0], BLAS: [2.0, 0.95, 0.95, 2.0]}) == (ONEDNN,) * 4


def test_a_layout_already_held_takes_the_decode_buckets_it_is_faster_in():
    """BLAS won 8 rows by far, so its weights are held: at 64 rows its 5% lead then takes that
    bucket too (no copy left to pay for), not the prefill bucket (65+), whose small lead at 128
    rows the rule leaves alone. The Xeon 167 held to AVX2 (2026-12-05, ms): MKL measured 9% faster
    than BLAS at 64 rows after winning 2-8 rows by 2.3x; the engine's 64-row step then ran its
    projections in 95.6 ms with MKL against 121.8 with BLAS (kept before, under the 10% gain)."""
    from kvbatch.kernels.cpu.linear import MKL, NATIVE

    assert kc.pick({ONEDNN: [1.0, 1.0, 1.0, 1.0], BLAS: [2.0, 0.5, 0.95, 0.95]}) == (ONEDNN, BLAS, BLAS, ONEDNN)
    xeon_avx2 = {ONEDNN: [2.94, 4.24, 2.84, 4.59], BLAS: [1.38, 4.65, 2.35, 4.43], MKL: [1.53, 2.03, 2.13, 4.13],
                 NATIVE: [1.74, 3.02, math.inf, math.inf]}
    assert kc.pick(xeon_avx2, kc.fused_kinds(torch.float32, "full")) == (BLAS, MKL, MKL, BLAS)
    # A tie keeps the first pass's kernel; one row keeps the fused step's winner whatever is held.
    assert kc.pick({BLAS: [1.0, 2.0, 1.0, 1.0], MKL: [1.05, 1.0, 1.0, 1.0]}) == (BLAS, MKL, BLAS, BLAS)


@needs_onednn
def test_the_cache_is_reused_and_invalidated_when_the_key_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)
    calls: list = []
    timer = fake_timer({ONEDNN: [3.0, 1.0, 1.0, 1.0], BLAS: [1.0, 6.0, 9.0, 20.0]}, calls)
    first = kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path, timer=timer)
    assert first.source == "measured"
    # Two rounds where both kernels run (one sample may be a spike); BLAS lost 8 rows 6x: its 64-
    # and 65+-row buckets are not timed (a slow kernel costs load time), and oneDNN alone once.
    assert calls == [(ONEDNN, 1), (BLAS, 1)] * 2 + [(ONEDNN, 8), (BLAS, 8)] * 2 + [(ONEDNN, 64), (ONEDNN, kc.BUCKET_ROWS[3])]
    files = list(tmp_path.glob("kernels-*.json"))
    assert [str(f) for f in files] == [first.cache_path]
    stored = json.loads(files[0].read_text())
    assert stored["kinds"] == [BLAS, ONEDNN, ONEDNN, ONEDNN]
    assert stored["key"]["torch"] == torch.__version__ and stored["key"]["shapes"] == [list(s) for s in SHAPES]
    again = kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path, timer=refusing_timer)
    assert again.source == "cache" and again.fmt == first.fmt
    # Another CPU (or flags), other shapes, another torch: each is a new key, measured afresh.
    monkeypatch.setattr(kc, "cpu_identity", lambda: ("Some Other CPU", ["avx512f"]))
    other = kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path, timer=timer)
    assert other.source == "measured" and len(calls) == 20
    monkeypatch.undo()
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)
    assert kc.choose_kernels(torch.float32, SHAPES[:2], num_layers=2, cache_dir=tmp_path, timer=timer).source == "measured"
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path, timer=timer).source == "measured"
    assert len(list(tmp_path.glob("kernels-*.json"))) == 4


def test_the_measurement_settings_are_the_documented_ones():
    # docs/performance.md states these: rows per bucket, 2-5 rounds, a 1.5x lead, an 80 ms budget,
    # at most 40 timed calls for fp32's two kernels, 10% to switch, the fused step's 25% at one row,
    # a held layout taking the decode buckets (1, 2-8, 9-64 rows) it is faster in.
    assert kc.BUCKET_ROWS == (1, 8, 64, 128) and kc.CACHE_VERSION == 5
    assert (kc._SWITCH_GAIN, kc._FUSED_CREDIT, kc._HELD_BUCKETS) == (0.10, 0.25, 3)
    assert (kc._MIN_ROUNDS, kc._ROUNDS, kc._CLEAR_LEAD, kc._BUCKET_BUDGET_S) == (2, 5, 1.5, 0.08)
    assert 2 * len(kc.BUCKET_ROWS) * kc._ROUNDS == 40


@needs_onednn
def test_timed_calls_are_bounded_and_a_clear_lead_stops_early():
    bound = 2 * len(kc.BUCKET_ROWS) * kc._ROUNDS
    # A close race in every bucket, calls cheap: each bucket takes all its rounds, and no more.
    close: list = []
    kc.measure([ONEDNN, BLAS], torch.float32, SHAPES, 2, fake_timer({ONEDNN: [1.0] * 4, BLAS: [1.1] * 4}), close)
    assert len(close) == bound
    # Just as close, but each call costs 30 ms: the bucket's time budget ends it after the minimum.
    costly: list = []
    kc.measure([ONEDNN, BLAS], torch.float32, SHAPES, 2, fake_timer({ONEDNN: [30.0] * 4, BLAS: [33.0] * 4}), costly)
    assert len(costly) == 2 * kc._MIN_ROUNDS * len(kc.BUCKET_ROWS)
    # oneDNN 4x ahead in every bucket: the minimum rounds, then BLAS is dropped (and from 64 rows
    # on not timed at all: hopeless after losing 8 rows by more than 3x).
    clear: list = []
    kc.measure([ONEDNN, BLAS], torch.float32, SHAPES, 2, fake_timer({ONEDNN: [1.0] * 4, BLAS: [4.0] * 4}), clear)
    assert clear == [(ONEDNN, 1), (BLAS, 1)] * kc._MIN_ROUNDS + [(ONEDNN, 8), (BLAS, 8)] * kc._MIN_ROUNDS + [
        (ONEDNN, 64), (ONEDNN, kc.BUCKET_ROWS[3])]


@needs_onednn
def test_one_slow_sample_does_not_decide_a_bucket():
    # BLAS's first timed call at one row is a spike (another process took the core); its second is
    # its real speed, twice oneDNN's. A one-sample early stop would have dropped it.
    seen: dict = {}

    def timer(kind, rows, run):
        run()
        n = seen[kind, rows] = seen.get((kind, rows), 0) + 1
        if kind == BLAS:
            return (10.0 if n == 1 and rows == 1 else 1.0) / 1e3
        return 2.0 / 1e3

    timings = kc.measure([ONEDNN, BLAS], torch.float32, SHAPES, 2, timer)
    assert kc.pick(timings)[0] == BLAS
    assert timings[BLAS][0] == 1.0


@needs_onednn
def test_no_timed_call_is_a_kernels_first_call_at_its_row_count(monkeypatch):
    # The first call at a row count builds oneDNN primitives and touches fresh memory: timing it
    # once reported oneDNN 30x slower than it runs. Every (kernel, rows) is warmed up first.
    invoked: set = set()
    real_call = LinearFormat.__call__

    def recording_call(self, x, w, b=None, batch_invariant=False):
        invoked.add((self.kind, x.shape[0]))
        return real_call(self, x, w, b, batch_invariant)

    monkeypatch.setattr(LinearFormat, "__call__", recording_call)
    warm_before_timed = []

    def timer(kind, rows, run):
        warm_before_timed.append((kind, rows) in invoked)
        return kc.one_call(kind, rows, run)

    kc.measure([ONEDNN, BLAS], torch.float32, SHAPES, 2, timer)
    assert warm_before_timed and all(warm_before_timed)


@needs_onednn
def test_a_real_measurement_reports_its_timed_calls(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)
    choice = kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path)  # the default timer
    assert choice.source == "measured"
    # Bounded by what this CPU offers (onednn and blas everywhere oneDNN packs; mkl and native where
    # they build): at least two candidates' minimum rounds, at most every candidate's every round.
    candidates = kc.candidates_for(torch.float32, "full")
    assert 2 * kc._MIN_ROUNDS <= choice.timed_calls <= len(candidates) * len(kc.BUCKET_ROWS) * kc._ROUNDS
    stored = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    assert stored["timed_calls"] == choice.timed_calls and stored["key"]["version"] == kc.CACHE_VERSION == 5
    assert all(len(v) == len(kc.BUCKET_ROWS) for v in choice.timings_ms.values())


@needs_onednn
def test_a_corrupt_or_foreign_cache_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)
    timer = fake_timer({ONEDNN: [1.0] * 4, BLAS: [2.0] * 4})
    key = kc.cache_key(torch.float32, "full", SHAPES, 2, kc.candidates_for(torch.float32, "full"))
    path = kc.cache_file(key, tmp_path)
    path.write_text("{not json")
    assert kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path, timer=timer).source == "measured"
    data = json.loads(path.read_text())
    data["kinds"] = ["fastest", "kernel", "ever", "!"]  # not a candidate: never trusted
    path.write_text(json.dumps(data))
    choice = kc.choose_kernels(torch.float32, SHAPES, num_layers=2, cache_dir=tmp_path, timer=timer)
    assert choice.source == "measured" and choice.fmt.kind == ONEDNN


def test_a_forced_choice_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_LINEAR", "onednn" if onednn_available() else "blas")
    forced = kc.choose_kernels(torch.float32, SHAPES, linear="blas", cache_dir=tmp_path, timer=refusing_timer)
    assert (forced.source, forced.fmt) == ("forced", LinearFormat(BLAS, torch.float32))
    monkeypatch.setenv("KVBATCH_LINEAR", "blas")  # the environment override of `auto`
    env = kc.choose_kernels(torch.float32, SHAPES, cache_dir=tmp_path, timer=refusing_timer)
    assert (env.source, env.fmt.kind) == ("env", BLAS)
    monkeypatch.delenv("KVBATCH_LINEAR")
    inv = kc.choose_kernels(torch.float32, SHAPES, batch_invariant=True, cache_dir=tmp_path, timer=refusing_timer)
    assert inv.source == "static" and inv.fmt.kind in (ONEDNN, BLAS)  # one kernel, known padding rule
    assert not list(tmp_path.iterdir())


def test_bad_choices_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="linear must be one of auto, onednn, blas, mkl, not 'cudnn'"):
        kc.choose_kernels(torch.float32, SHAPES, linear="cudnn", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="--linear mkl multiplies fp32 weights, not torch.bfloat16"):
        kc.choose_kernels(torch.bfloat16, SHAPES, linear="mkl", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="weights must be one of full, int8, gguf, not 'int4'"):
        kc.choose_kernels(torch.float32, SHAPES, weights="int4", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="int8 weights choose their int8 route"):
        kc.choose_kernels(torch.float32, SHAPES, weights="int8", linear="blas", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="cannot pack torch.float16"):
        kc.choose_kernels(torch.float16, SHAPES, linear="onednn", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="linear must be one of auto, onednn, blas, mkl, got 'fast'"):
        EngineConfig(linear="fast")
    assert LINEAR_CHOICES == kc.LINEAR_CHOICES  # the config's torch-free copy
    with pytest.raises(ValueError, match="weights must be full, int8 or gguf"):
        EngineConfig(weights="q4")


def test_dense_shapes_fuse_as_the_model_does(tmp_path):
    ref = build_tiny("qwen2", tmp_path)
    from kvbatch.engine.models.weights import load_checkpoint

    cfg = ref.config
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D
    assert kc.dense_shapes(load_checkpoint(str(tmp_path)).tensors) == sorted({(qkv, H), (H, H), (2 * I, H), (H, I)})


@needs_onednn
def test_mixed_layouts_give_each_bucket_its_kernels_numbers():
    kinds = (BLAS, ONEDNN, BLAS, ONEDNN)
    mixed = LinearFormat(MIXED, torch.float32, bucket_kinds=kinds)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(160, 96, generator=g), torch.randn(160, generator=g)
    held = mixed.prepare(w)
    x = torch.randn(80, 96, generator=g)
    for rows in (1, 5, 8, 9, 64, 65, 80):
        single = LinearFormat(kinds[bucket_index(rows)], torch.float32)
        assert torch.equal(mixed(x[:rows], held, b), single(x[:rows], single.prepare(w), b)), rows
        torch.testing.assert_close(mixed(x[:rows], held, b), torch.nn.functional.linear(x[:rows], w, b),
                                   atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not batch-invariant"):
        mixed(x[:3], held, b, batch_invariant=True)
    with pytest.raises(ValueError, match="needs 4 bucket kinds"):
        LinearFormat(MIXED, torch.float32, bucket_kinds=(BLAS,))


@pytest.mark.parametrize("plan", ["mixed", "single"])
def test_the_engine_runs_the_measured_choice_and_matches_transformers(tmp_path, monkeypatch, plan):
    if plan == "mixed" and not onednn_available():
        pytest.skip("a mixed plan needs two kernels")
    monkeypatch.delenv("KVBATCH_LINEAR", raising=False)
    monkeypatch.setenv("KVBATCH_CACHE_DIR", str(tmp_path / "cache"))
    # mixed: oneDNN at 1 row and from 9 rows (prefill), BLAS at 2-8 rows (decoding both requests)
    ms = ({ONEDNN: [1.0, 9.0, 1.0, 1.0], BLAS: [2.0, 1.0, 9.0, 20.0]} if plan == "mixed"
          else {ONEDNN: [9.0] * 4, BLAS: [1.0] * 4})
    monkeypatch.setattr(factory, "choose_kernels", partial(kc.choose_kernels, timer=fake_timer(ms)))
    ref = build_tiny("qwen2", tmp_path / "model")
    llm = LLM(str(tmp_path / "model"), engine_config=EngineConfig(block_size=4, num_blocks=64))
    model = llm.runner.model
    assert model.kernel_choice.source == "measured"
    assert model.linear.kind == (MIXED if plan == "mixed" else BLAS)
    seen = capture_logits(llm)
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (11, 5)]
    out = llm.generate([GenerationRequest(f"r{i}", SamplingParams(max_tokens=6 - 3 * i, temperature=0, ignore_eos=True),
                                          prompt_token_ids=p) for i, p in enumerate(prompts)])
    # prefill (16 rows in one step), 2-row decode steps, then r0 alone at 1 row: every bucket's kernel
    for i, p in enumerate(prompts):
        assert_logits_match(ref, seen, f"r{i}", p, out[i].output_token_ids, plan)


def test_the_cli_options_reach_the_engine_config():
    from kvbatch.cli.main import _engine_spec, build_parser

    args = build_parser().parse_args(["generate", "--input", "in.jsonl", "--output", "out.parquet",
                                      "--linear", "blas", "--weights", "int8"])
    cfg = _engine_spec(args).engine_config()
    assert (cfg.linear, cfg.weights) == ("blas", "int8")
    default = _engine_spec(build_parser().parse_args(
        ["generate", "--input", "in.jsonl", "--output", "out.parquet"])).engine_config()
    assert (default.linear, default.weights) == ("auto", "full")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--input", "a", "--output", "b", "--weights", "int4"])


def test_bf16_slower_than_fp32_on_this_cpu_comes_with_a_note(tmp_path):
    # measured at a batched decode step's 64 rows, bf16's kernel against fp32 BLAS
    calls = []
    slow = fake_timer({"fp32-blas": [1.0] * 4, "bf16-blas": [4.0] * 4}, calls)
    choice = kc.choose_kernels(torch.bfloat16, SHAPES, linear="blas", cache_dir=tmp_path, timer=slow)
    assert "bf16 projections measured 4.0x slower than fp32 at 64 rows" in choice.note
    assert "--dtype fp32 is the faster setting here" in choice.note
    assert sorted(set(calls)) == [("bf16-blas", 64), ("fp32-blas", 64)] and len(calls) == 6
    fast = fake_timer({"fp32-blas": [2.0] * 4, "bf16-blas": [1.0] * 4})
    assert kc.choose_kernels(torch.bfloat16, SHAPES, linear="blas", cache_dir=tmp_path, timer=fast).note == ""
    # fp32 is not compared with anything
    assert kc.choose_kernels(torch.float32, SHAPES, linear="blas", cache_dir=tmp_path, timer=refusing_timer).note == ""


@pytest.mark.skipif(__import__("kvbatch.kernels.cpu.huge_pages", fromlist=["x"]).unavailable_reason() is not None,
                    reason="no transparent huge pages here")
def test_the_candidates_are_timed_on_the_pages_the_model_streams():
    # with huge pages wanted, each candidate's plain weights are placed as the model places them;
    # the cache key tells the two apart, so a choice made on one kind of page is not reused for the other
    from kvbatch.kernels.cpu.huge_pages import _THP, huge_page_bytes

    madvise_only = "[madvise]" in _THP.read_text()  # torch's own memory gets no huge pages then
    for huge in (False, True):
        streamed: list[int] = []

        def timer(kind, rows, run):
            run()
            if kind == BLAS:
                ws = run.__defaults__[0]  # the timed call's weights (measure's closure)
                streamed.append(huge_page_bytes(ws[0][0]))
            return 1e-3

        kc.measure([BLAS], torch.float32, [(1024, 1024)], 4, timer, huge_pages=huge)
        assert streamed and (all(b > 0 for b in streamed) if huge else not (madvise_only and any(streamed)))
    keys = [kc.cache_key(torch.float32, "full", SHAPES, 2, [BLAS], huge_pages=h) for h in (False, True)]
    assert keys[0] != keys[1] and keys[1]["huge_pages"] is True


def test_at_one_row_the_fused_steps_kernels_win_unless_another_is_clearly_faster():
    # MKL 8% faster than BLAS per projection at one row: BLAS still runs the fused decode step
    # (worth more than that: on a Xeon 167, 56.2 tok/s against MKL's 39.3 outside it); 40% faster:
    # MKL. Past one row the plain rule (another kernel 10% faster switches).
    from kvbatch.kernels.cpu.linear import MKL, NATIVE

    close = {BLAS: [1.00, 3.0, 1.7, 2.7], MKL: [0.92, 2.2, 1.4, 2.5]}
    assert kc.pick(close, kc.fused_kinds(torch.float32, "full")) == (BLAS, MKL, MKL, BLAS)
    assert kc.pick(close) == (MKL, MKL, MKL, MKL)  # without the credit, as before
    clear = {BLAS: [1.00, 3.0, 1.7, 2.7], MKL: [0.60, 2.2, 1.4, 2.5]}
    assert kc.pick(clear, kc.fused_kinds(torch.float32, "full")) == (MKL, MKL, MKL, MKL)
    assert kc.fused_kinds(torch.bfloat16, "full") == (NATIVE,) and kc.fused_kinds(torch.float32, "int8") == (kc.GEMV,)
    assert kc.fused_kinds(torch.float32, "gguf") == (kc.GGUF_NATIVE,)
