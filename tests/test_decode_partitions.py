"""The paged decode kernel's split over the context: the partition size chosen by context length
(a pure function) and the early exit of partitions past a sequence's end, in the Triton
interpreter against the reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# First: it sets TRITON_INTERPRET before triton builds the kernels.
from tests.triton_interpreter import (ATTN_TOL, assert_close, fresh_process_only,  # isort: skip
                                      interpreter_only, randn, rerun_in_fresh_interpreter, use_triton)  # noqa: F401
from kvbatch.kernels import reference as R
from kvbatch.kernels import triton_attention as TA
from tests.test_kernels import make_cache

needs_interpreter = interpreter_only("test_decode_partitions_in_a_fresh_process")


def _programs(size: int, max_context: int, batch: int, heads: int) -> int:
    return batch * heads * math.ceil(max(max_context, 1) / size)


@settings(max_examples=500, deadline=None)
@given(max_context=st.integers(0, 1 << 20), batch=st.integers(1, 512), heads=st.integers(1, 64),
       target=st.integers(1, 4096))
def test_the_partition_is_the_largest_that_still_fills_the_gpu(max_context, batch, heads, target):
    size = TA.decode_partition_size(max_context, batch, heads, target)
    assert size in TA.DECODE_PARTITION_SIZES
    larger = [s for s in TA.DECODE_PARTITION_SIZES if s > size]
    # Every larger size would leave the GPU short of programs ...
    assert all(_programs(s, max_context, batch, heads) < target for s in larger)
    # ... and this one fills it, unless even the smallest cannot.
    assert size == TA.DECODE_PARTITION_SIZES[0] or _programs(size, max_context, batch, heads) >= target


@settings(max_examples=300, deadline=None)
@given(max_context=st.integers(0, 1 << 18), more=st.integers(0, 1 << 18), batch=st.integers(1, 256),
       heads=st.integers(1, 16))
def test_longer_contexts_and_larger_batches_never_get_smaller_partitions(max_context, more, batch, heads):
    size = TA.decode_partition_size(max_context, batch, heads)
    assert TA.decode_partition_size(max_context + more, batch, heads) >= size
    assert TA.decode_partition_size(max_context, batch + more, heads) >= size


def test_examples_of_the_choice():
    """An 8B (8 KV heads) on an H100 (528 programs wanted): one long sequence splits finely, a
    large batch not at all."""
    assert TA.DECODE_TARGET_PROGRAMS == 528
    assert TA.decode_partition_size(8192, 1, 8) == 256  # 32 partitions: 256 programs, the most there are
    assert TA.decode_partition_size(2048, 128, 8) == 2048  # 1024 programs at one partition each
    assert TA.decode_partition_size(2048, 64, 8) == 1024  # one partition would give only 512 programs


@pytest.mark.parametrize("args", [(-1, 1, 1), (10, 0, 1), (10, 1, 0)])
def test_bad_shapes_are_refused(args):
    with pytest.raises(ValueError, match="decode_partition_size"):
        TA.decode_partition_size(*args)


@pytest.fixture
def sentinel_partials(monkeypatch):
    """Fill the split's partial results with NaN before the kernel runs, and keep them (with the
    partition size used) for the test to read: a partition no program wrote stays NaN."""
    seen: dict = {}
    real = TA._partitions

    def partitions(out, max_context_len, partition_size, block_n, width):
        size, n, split, bufs = real(out, max_context_len, partition_size, block_n, width)
        if split:
            for t in bufs:
                t.fill_(float("nan"))
        seen.update(size=size, n=n, split=split, bufs=bufs)
        return size, n, split, bufs

    monkeypatch.setattr(TA, "_partitions", partitions)
    return seen


@needs_interpreter
def test_partitions_past_a_sequence_end_exit_and_the_merge_skips_them(use_triton, sentinel_partials):
    """Sequences of 300, 17, 0 and 601 keys under a grid for 601: the partitions past each end
    write nothing (their NaN sentinels survive), the merge never reads them (no NaN reaches the
    output), and the result is the reference's. The partition size is the default choice."""
    gen = torch.Generator().manual_seed(3)
    lens = [300, 17, 0, 601]
    k_cache, v_cache, tables = make_cache(gen, lens, 16, 1, 16, torch.float32)
    q = randn(gen, len(lens), 2, 16)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = TA.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25)
    assert_close(out, R.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25), ATTN_TOL[torch.float32])
    seen = sentinel_partials
    size = TA.decode_partition_size(tables.shape[1] * 16, len(lens), 1)
    assert size == 256 and seen["size"] == size and seen["split"] and seen["n"] == 3
    part_max = seen["bufs"][1]  # [B, Hq, partitions]
    for b, n in enumerate(lens):
        used = math.ceil(n / size)
        assert not torch.isnan(part_max[b, :, :used]).any(), b
        assert torch.isnan(part_max[b, :, used:]).all(), b  # never written: the program returned at once
    assert torch.all(out[2] == 0)  # no keys at all: zeros, like the twin


@fresh_process_only
def test_decode_partitions_in_a_fresh_process():
    rerun_in_fresh_interpreter("tests/test_decode_partitions.py")
