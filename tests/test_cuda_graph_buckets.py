"""CUDA graphs per (batch, context length) bucket: the bucket choice, a pure function, and the
graph runner's use of it, checked on the CPU (replay stubbed: no CUDA needed)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.runtime import cuda_graphs
from kvbatch.engine.runtime.cuda_graphs import PAD_SLOT, CudaGraphRunner, context_widths, needed_width, pick_bucket
from kvbatch.engine.runtime.model_runner import StepUploader


@settings(max_examples=300, deadline=None)
@given(max_model_len=st.integers(1, 1 << 17), block_size=st.sampled_from([1, 4, 16, 32, 64, 256, 1024]),
       data=st.data())
def test_context_widths_cover_every_context_at_most_twice_over(max_model_len, block_size, data):
    widths = context_widths(max_model_len, block_size)
    assert widths == sorted(set(widths)) and widths[0] >= 1
    assert widths[-1] == math.ceil(max_model_len / block_size)  # the longest context still fits
    need = data.draw(st.integers(1, widths[-1]))
    got = cuda_graphs.bucket_for(need, widths)
    assert got is not None and need <= got <= max(widths[0], 2 * need - 1)


@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.integers(1, 512), min_size=1, max_size=10, unique=True),
       widths=st.lists(st.integers(1, 4096), min_size=1, max_size=10, unique=True),
       n=st.integers(1, 600), width=st.integers(1, 5000))
def test_the_picked_bucket_is_the_smallest_covering_one(batches, widths, n, width):
    batches, widths = sorted(batches), sorted(widths)
    got = pick_bucket(n, width, batches, widths)
    covering = [(b, w) for b in batches for w in widths if b >= n and w >= width]
    if not covering:
        assert got is None
        return
    assert got in covering
    # No captured pair that covers the step is smaller in either dimension.
    assert all(got[0] <= b and got[1] <= w for b, w in covering)


@settings(max_examples=200, deadline=None)
@given(starts=st.lists(st.integers(0, 10_000), min_size=1, max_size=16), block_size=st.sampled_from([1, 4, 16, 64]))
def test_the_needed_width_holds_the_longest_context_and_no_more(starts, block_size):
    w = needed_width(starts, block_size)
    assert w * block_size >= max(starts) + 1 > (w - 1) * block_size


def test_bad_context_bucket_arguments_are_refused():
    with pytest.raises(ValueError, match="max_model_len .0."):
        context_widths(0, 16)
    with pytest.raises(ValueError, match="block_size .0."):
        context_widths(4096, 0)


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _step(starts: list[int], block_size: int, reserved: int) -> list[SimpleNamespace]:
    """Decode entries at positions ``starts``, each table holding ``reserved`` blocks past its context."""
    out = []
    for i, p in enumerate(starts):
        blocks = math.ceil((p + 1) / block_size) + reserved
        seq = SimpleNamespace(num_computed_tokens=p, block_table=[100 * (i + 1) + j for j in range(blocks)],
                              token_ids=list(range(p + 1)))
        out.append(SimpleNamespace(num_new_tokens=1, num_spec=0, samples=True, seq=seq))
    return out


def test_a_short_step_replays_the_narrow_graph_over_its_own_blocks():
    """A step whose contexts need 3 blocks replays the (4 rows, 8 blocks) graph, not the widest,
    and that graph's table view holds each row's context blocks (reserved ones cut off)."""
    bs = 16
    runner = SimpleNamespace(device=torch.device("cpu"), block_size=bs, uploader=StepUploader(torch.device("cpu")))
    widths = context_widths(4096, bs, smallest=128)
    assert widths == [8, 16, 32, 64, 128, 256]
    graphs = CudaGraphRunner(runner, [1, 2, 4, 8], widths)
    for b in graphs.buckets:
        for w in graphs.widths:
            graphs.graphs[(b, w)] = (_Graph(), torch.full((b, 5), float(b * 1000 + w)))
    step = _step([40, 7, 33], bs, reserved=9)  # 41 tokens of context: 3 blocks; tables of 12
    logits, entries = graphs.try_execute(runner, step)
    assert graphs.last_bucket == (4, 8) and graphs.graphs[(4, 8)][0].replays == 1
    assert logits.shape == (3, 5) and float(logits[0, 0]) == 4 * 1000 + 8 and entries == step
    table = graphs._batch(4, 8).decode_block_tables
    assert table.shape == (4, 8) and table.is_contiguous()
    assert table[0].tolist() == [100, 101, 102] + [0] * 5
    assert table[1].tolist() == [200] + [0] * 7 and table[3].tolist() == [0] * 8  # the padded row
    assert graphs.context_lens[:4].tolist() == [41, 8, 34, 1]
    # Longer than the longest bucket: no graph, the caller runs it eagerly.
    assert graphs.try_execute(runner, _step([4096], bs, reserved=0)) is None
    assert graphs.try_execute(runner, _step([4095], bs, reserved=3)) is not None and graphs.last_bucket == (1, 256)


def test_a_sliding_models_graph_step_reads_its_window_tables():
    """With a window cache (sliding layers, window_blocks.py) each replayed row also gets its window
    table (null blocks before its window) and its slot there; padding rows write nothing."""
    bs = 16
    runner = SimpleNamespace(device=torch.device("cpu"), block_size=bs, uploader=StepUploader(torch.device("cpu")),
                             kv_window=torch.zeros(1))
    graphs = CudaGraphRunner(runner, [1, 2, 4], [8, 16])
    for b in graphs.buckets:
        for w in graphs.widths:
            graphs.graphs[(b, w)] = (_Graph(), torch.zeros((b, 5)))
    step = _step([40, 7], bs, reserved=2)
    step[0].seq.window_table = [0, 7, 9, 11, 12]  # the null block before the window
    step[1].seq.window_table = [5, 6, 8]
    graphs.try_execute(runner, step)
    assert graphs.last_bucket == (2, 8)
    window = graphs._batch(2, 8).window
    assert window.decode_block_tables.tolist() == [[0, 7, 9] + [0] * 5, [5] + [0] * 7]
    assert window.slot_mapping.tolist() == [9 * bs + 40 % bs, 5 * bs + 7]
    assert graphs._batch(2, 8).decode_block_tables.tolist()[0][:3] == [100, 101, 102]
    graphs.try_execute(runner, step[1:])
    assert graphs.window_slots[:1].tolist() == [5 * bs + 7]
    assert graphs._batch(4, 8).window.slot_mapping[2:].tolist() == [PAD_SLOT] * 2
