"""The engine benchmark holds each row to issue 18's target for its variant and mode
(``benchmarks/bench_engine.py`` ``row_target``), and to none where the issue sets none; its
llama.cpp peer is built with the CMake flags ``benchmarks/llama_cpp_build.py`` derives."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_engine import Row, floor_share, row_target

BASE = {"batched": 40.0, "eot-honoured": 50.0, "batch-1": 20.0}  # transformers fp32, tok/s


def _row(dtype: str, mode: str, tok_s: float, engine: str = "kvbatch", **extra: float) -> Row:
    return Row(engine, dtype, mode, [tok_s], dict(extra))


def test_batched_rows_need_5x_in_fp32_and_8x_in_bf16():
    assert row_target(_row("fp32", "batched", 200.0), BASE, None) == (">=5x", True)
    assert row_target(_row("fp32", "eot-honoured", 249.0), BASE, None) == (">=5x", False)
    assert row_target(_row("bf16", "batched", 319.0), BASE, None) == (">=8x", False)
    assert row_target(_row("bf16", "eot-honoured", 400.0), BASE, None) == (">=8x", True)


def test_batch_1_fp32_needs_the_ratio_and_the_bandwidth_floor():
    assert row_target(_row("fp32", "batch-1", 40.0, share_of_ceiling=0.7), BASE, None) == (">=2x, 70%", True)
    assert row_target(_row("fp32", "batch-1", 40.0, share_of_ceiling=0.69), BASE, None)[1] is False
    assert row_target(_row("fp32", "batch-1", 39.0, share_of_ceiling=0.9), BASE, None)[1] is False


def test_batch_1_int8_is_held_to_llama_cpp_when_it_ran():
    assert row_target(_row("fp32+int8", "batch-1", 90.0), BASE, 80.0) == ("llama.cpp", True)
    assert row_target(_row("fp32+int8", "batch-1", 70.0), BASE, 80.0) == ("llama.cpp", False)
    assert row_target(_row("fp32+int8", "batch-1", 90.0), BASE, None) == (None, None)


def test_rows_the_issue_sets_no_target_for_have_none():
    for row in (_row("bf16", "batch-1", 30.0), _row("fp32+int8", "batched", 90.0),
                _row("fp32+gguf", "batch-1", 30.0), _row("fp32", "batched", 40.0, engine="transformers")):
        assert row_target(row, BASE, 80.0) == (None, None)


def test_the_llama_cpp_build_names_the_base_simd_levels_and_leaves_the_rest_off():
    from benchmarks.llama_cpp_build import cmake_args

    xeon = "sse4_2 avx avx2 bmi2 fma f16c avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512_vnni " \
           "avx512_bf16 avx512vbmi amx_tile amx_int8 amx_bf16".split()
    on = {a.removeprefix("-D").removesuffix("=ON") for a in cmake_args(xeon) if a.endswith("=ON")}
    assert on == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C", "GGML_AVX512"}
    assert "-DGGML_NATIVE=OFF" in cmake_args(xeon) and "-DGGML_AMX_TILE=OFF" in cmake_args(xeon)
    epyc = "sse4_2 avx avx2 bmi2 fma f16c".split()  # AVX2, no AVX-512
    assert "-DGGML_AVX512=OFF" in cmake_args(epyc) and "-DGGML_AVX2=ON" in cmake_args(epyc)
    assert "-DGGML_AVX512=OFF" in cmake_args(["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"])  # no AVX2
    assert [a for a in cmake_args([]) if a.endswith("=ON")] == []


def test_each_batch_1_prompt_is_held_to_the_bandwidth_measured_beside_it():
    # 100 MB a token: 40 GB/s sets 400 tok/s, 80 GB/s 800; prompt shares 0.75, 0.5, 0.8 -> median 0.75
    got = floor_share([300.0, 400.0, 320.0], [40.0, 80.0, 40.0], 100_000_000)
    assert got["shares_of_ceiling"] == pytest.approx([0.75, 0.5, 0.8])
    assert got["share_of_ceiling"] == pytest.approx(0.75)
    assert got["bandwidth_gbs"] == 40.0 and got["floor_ms"] == pytest.approx(2.5)
    with pytest.raises(ValueError, match="one bandwidth per prompt"):
        floor_share([300.0], [40.0, 80.0], 100_000_000)


def test_the_floor_counts_the_bytes_a_greedy_step_streams(tmp_path, monkeypatch):
    # an fp32 model screens its head in int8 for greedy rows: its floor counts the int8 copy and its
    # scales; with the screen off, and for int8 weights (whose head is int8 already), the head as held
    from benchmarks.bench_engine import decode_weight_bytes
    from kvbatch.engine.runtime.engine_config import EngineConfig
    from kvbatch.engine.runtime.llm import LLM
    from kvbatch.kernels.cpu import native as native_kernels
    from tests.tiny_models import build_tiny

    if not native_kernels.available():
        pytest.skip("the native CPU kernels do not build here")
    build_tiny("llama", tmp_path)
    llm = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64))
    c = llm.model_config
    head = c.vocab_size * c.hidden_size
    assert llm.model.greedy_head is not None
    monkeypatch.setenv("KVBATCH_GREEDY_HEAD", "0")
    full = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64))
    blocks = -(-c.vocab_size // native_kernels.block_cols()) * native_kernels.block_cols()  # the screen's padded rows
    assert decode_weight_bytes(full) - decode_weight_bytes(llm) == 4 * head - blocks * (c.hidden_size + 4)
    monkeypatch.delenv("KVBATCH_GREEDY_HEAD")
    int8 = LLM(str(tmp_path), engine_config=EngineConfig(block_size=4, num_blocks=64, weights="int8"))
    assert int8.model.greedy_head is None


def test_the_report_says_where_the_weights_lie(monkeypatch):
    # huge pages, or 4 KiB pages and why: a figure measured on one is not the other's
    from benchmarks import bench_engine as B
    from kvbatch.kernels.cpu import huge_pages

    monkeypatch.setenv("KVBATCH_HUGE_PAGES", "0")
    assert B.huge_pages_status() == f"in 4 KiB pages ({huge_pages.unavailable_reason() or 'KVBATCH_HUGE_PAGES=0'})"
    monkeypatch.setenv("KVBATCH_HUGE_PAGES", "1")
    reason = huge_pages.unavailable_reason()
    assert B.huge_pages_status() == ("in transparent huge pages (2 MiB)" if reason is None else f"in 4 KiB pages ({reason})")
    monkeypatch.setattr(huge_pages, "unavailable_reason", lambda: "transparent huge pages are off (test)")
    assert B.huge_pages_status() == "in 4 KiB pages (transparent huge pages are off (test))"


def test_the_bandwidth_probe_reads_the_pages_the_engine_streams(monkeypatch):
    from benchmarks import bench_engine as B
    from kvbatch.kernels.cpu import huge_pages

    monkeypatch.setenv("KVBATCH_HUGE_PAGES", "1")
    probe = B.probe_buffer(8)
    assert probe.numel() == 8 << 18 and bool((probe == 1).all())
    if huge_pages.unavailable_reason() is None:
        assert huge_pages.huge_page_bytes(probe) >= huge_pages.HUGE_PAGE
    monkeypatch.setenv("KVBATCH_HUGE_PAGES", "0")
    if "[madvise]" in huge_pages._THP.read_text():
        assert huge_pages.huge_page_bytes(B.probe_buffer(8)) == 0


def test_the_report_says_which_head_a_batched_greedy_step_runs():
    from dataclasses import replace
    from types import SimpleNamespace

    from benchmarks import bench_engine as B
    from kvbatch.kernels.cpu import greedy_head as G

    def llm(head):
        return SimpleNamespace(model=SimpleNamespace(greedy_head=head))

    assert B.batched_head_status(llm(None)) == "the full head (no greedy screen for this model)"
    head = G.GreedyHead(torch.zeros(4, 2), None, torch.zeros(4))
    assert B.batched_head_status(llm(head)).startswith("the full head (the int8 screen lost")
    batched = G.BatchedScreen(*(torch.zeros(1),) * 5, timings_ms=(5.25, 15.5))
    assert B.batched_head_status(llm(replace(head, batched=batched))) == (
        "the int8 screen (5.2 ms against the fp32 head's 15.5 at 64 rows, measured at load)")
