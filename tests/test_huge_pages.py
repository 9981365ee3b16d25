"""Weights and the KV cache in transparent huge pages (kernels/cpu/huge_pages.py): the arena's copies
are the tensors they were, aligned and apart; Linux backs them with 2 MiB pages where it offers
them; a model built with the switch on holds its projections and KV cache there and decodes the
same tokens as with it off."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels.cpu import huge_pages as HP
from tests.tiny_models import VOCAB, build_tiny

needs_thp = pytest.mark.skipif(HP.unavailable_reason() is not None, reason=str(HP.unavailable_reason()))


@needs_thp
def test_placed_tensors_are_copies_aligned_and_apart():
    arena = HP.HugePageArena(chunk_bytes=4 << 20)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(300, 7, generator=g), torch.randn(5, generator=g).bfloat16(),
               torch.randint(-128, 127, (1000,), dtype=torch.int8, generator=g),
               torch.randn(3 << 20, generator=g)]  # 12 MiB: larger than a chunk, a chunk of its own
    placed = [arena.place(t) for t in sources]
    spans = []
    for src, out in zip(sources, placed):
        assert out.dtype == src.dtype and out.shape == src.shape and torch.equal(out, src)
        assert out.data_ptr() % 64 == 0 and out.data_ptr() != src.data_ptr()
        spans.append((out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no two share a byte
    assert placed[0].data_ptr() % HP.HUGE_PAGE == 0 and placed[3].data_ptr() % HP.HUGE_PAGE == 0
    assert arena.bytes_placed == sum(t.numel() * t.element_size() for t in sources)
    zeros = arena.zeros((4, 1000), torch.float32)
    assert zeros.shape == (4, 1000) and not zeros.any()
    with pytest.raises(ValueError, match="CPU tensors, got one on meta"):
        arena.place(torch.empty(4, device="meta"))


@needs_thp
def test_linux_backs_the_arena_with_huge_pages():
    arena = HP.HugePageArena()
    big = arena.place(torch.ones(4 << 20))  # 16 MiB
    assert HP.huge_page_bytes(big) >= HP.HUGE_PAGE
    if "[madvise]" in HP._THP.read_text():  # then torch's own allocation, which asks for none, gets none
        assert HP.huge_page_bytes(torch.ones(1 << 20)) == 0


def test_the_reason_names_a_thp_setting_of_never(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(HP, "_THP", setting)
    assert "transparent huge pages are off" in HP.unavailable_reason()
    monkeypatch.setattr(HP, "_THP", tmp_path / "missing")
    assert "cannot read" in HP.unavailable_reason()
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(HP, "_THP", setting)
    assert HP.unavailable_reason() is None


@needs_thp
def test_every_kind_of_prepared_weight_moves_its_streamed_tensors():
    from kvbatch.kernels.cpu import native as native_kernels
    from kvbatch.kernels.cpu.gguf_kernels import GGUFWeight, random_blocks
    from kvbatch.kernels.cpu.linear import MixedWeight, place_in_huge_pages
    from kvbatch.kernels.cpu.quant import GEMV, quantize_int8

    arena = HP.HugePageArena()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    inside = lambda t: arena._chunk.data_ptr() <= t.data_ptr() < arena._chunk.data_ptr() + arena._chunk.numel()

    plain = w.t().contiguous()
    mixed = place_in_huge_pages(arena, MixedWeight({"blas": plain, "native": plain}))
    assert mixed.layouts["blas"] is mixed.layouts["native"] and inside(mixed.layouts["blas"])  # one copy
    assert torch.equal(mixed.layouts["blas"], plain)
    if native_kernels.available():
        bf16 = place_in_huge_pages(arena, native_kernels.bf16_blocks(w.bfloat16()))
        assert inside(bf16.q) and torch.equal(bf16.q, native_kernels.bf16_blocks(w.bfloat16()).q)
        int8 = quantize_int8(w, (GEMV,))
        moved = place_in_huge_pages(arena, int8)
        assert inside(moved.blocks.q) and torch.equal(moved.blocks.q, int8.blocks.q)
        assert torch.equal(moved.scale, int8.scale)
    blocks = random_blocks("Q8_0", 32, 64, g)
    gguf = place_in_huge_pages(arena, GGUFWeight(blocks, {"blas": plain}))
    assert inside(gguf.blocks.data) and torch.equal(gguf.blocks.data, blocks.data) and inside(gguf.layouts["blas"])
    packed = w.to_mkldnn()  # oneDNN's own layout: its memory is oneDNN's, kept where it is
    assert place_in_huge_pages(arena, packed) is packed
    from kvbatch.kernels.cpu import mkl_packed
    from kvbatch.kernels.cpu.linear import MKL, LinearFormat

    if mkl_packed.available():  # MKL's buffers cannot move: packed in the arena from the start
        mkl = LinearFormat(MKL, torch.float32).prepare(w, arena)
        assert inside(mkl._buffer)
        x = torch.randn(3, 64, generator=g)
        torch.testing.assert_close(mkl_packed.linear(x, mkl), x @ w.T)


def _tokens(folder, monkeypatch, switch: str) -> tuple[list[list[int]], LLM]:
    monkeypatch.setenv("KVBATCH_HUGE_PAGES", switch)
    llm = LLM(str(folder), engine_config=EngineConfig(block_size=4, num_blocks=64))
    prompts = [torch.randint(3, VOCAB, (7 + 4 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(3)]
    results = llm.generate([GenerationRequest(f"r{i}", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                              prompt_token_ids=p) for i, p in enumerate(prompts)])
    return [r.output_token_ids for r in results], llm


@needs_thp
def test_a_model_holds_its_projections_and_kv_cache_in_huge_pages(tmp_path, monkeypatch):
    build_tiny("llama", tmp_path)
    plain, off = _tokens(tmp_path, monkeypatch, "0")
    huge, on = _tokens(tmp_path, monkeypatch, "1")
    assert huge == plain
    assert off.runner.model.arena is None and on.runner.model.arena is not None
    arena = on.runner.model.arena
    # the projections were copied in (layer 0's checked), the head's screen, then the KV cache
    lw = on.runner.model.layers[0]
    weights = [on.runner.model.linear.fused_weight(w) for w in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]
    assert all(w is not None for w in weights)
    start, end = arena._chunk.data_ptr(), arena._chunk.data_ptr() + arena._chunk.numel()
    screen = on.runner.model.greedy_head.screen.q  # the greedy head's int8 screen, streamed every greedy step
    for t in [*(w if isinstance(w, torch.Tensor) else w.q for w in weights), screen, on.runner.kv_cache]:
        assert start <= t.data_ptr() < end
    assert HP.huge_page_bytes(on.runner.kv_cache) >= HP.HUGE_PAGE
    assert not (start <= off.runner.kv_cache.data_ptr() < end)
