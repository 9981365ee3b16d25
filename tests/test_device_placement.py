"""Device placement of the CUDA code path, proven on a machine without a GPU.

``FakeTensorMode`` fakes ``cuda`` tensors without CUDA, but it holds no values: the reference
kernels plan on the host (``int(lens.max())``, ``tolist()``) and it refuses those reads. So the
tests here run every op for real on the CPU under :class:`CudaPlacement`, a dispatch mode in which a
tensor made for CUDA (``device="cuda"``, a ``.to("cuda:0")``, or any op over such tensors) reports
``cuda:0`` while its values live on the CPU (``Tensor.to`` wants the device index, as the engine's
resolved devices have it). Whatever a real GPU refuses, it refuses:

- an op given a CUDA tensor and a CPU tensor of one or more dimensions (a 0-dim CPU tensor is a
  scalar operand, which CUDA takes too) raises :class:`PlacementError`, naming the op and the
  CPU tensor's shape; transfers (``to``, ``copy_``) are the one way across, and are counted;
- a random op on a CUDA tensor with a CPU generator raises (CUDA wants a CUDA generator);
- ``pin_memory`` works (the CPU build refuses it without an accelerator) and is remembered, so an
  upload from pageable memory can be told from one from pinned memory.

``torch.cuda``'s streams and events are replaced by host no-ops for the duration (the CPU build
has none); their ordering is tested in ``tests/test_kv_staging.py`` with a late-copy engine.

What runs under it: every reference kernel of ``kernels/reference*.py``, the sampler's on-device
path and the host readback, a model runner's prefill and decode steps and a whole engine on a
tiny seeded Llama (reference kernels), and the KV staging's loads and saves; each result must be
on the device and equal what the same call computes on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from kvbatch.engine.runtime import sampler
from kvbatch.engine.runtime.engine_config import EngineConfig
from kvbatch.engine.runtime.kv_staging import CudaCopyEngine, HostCopyEngine, KVStaging, block_shape, copy_engine_for
from kvbatch.engine.runtime.llm import LLM, GenerationRequest
from kvbatch.engine.runtime.model_runner import ModelRunner, WorkItem
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.kernels import reference as R
from kvbatch.kernels import reference_mla as RM
from kvbatch.kernels import reference_sparse_decode as RS
from kvbatch.kernels import reference_verify as RV
from tests.tiny_models import build_tiny

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
aten = torch.ops.aten


class PlacementError(RuntimeError):
    """An op that a GPU would refuse for the devices of its arguments."""


class OnCuda(torch.Tensor):
    """A tensor that reports ``cuda:0``; its values are ``elem``, a CPU tensor of the same
    sizes and strides (ops on it run only under :class:`CudaPlacement`)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnCuda:
        t = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=CUDA, requires_grad=False)
        t.elem = elem
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnCuda({self.elem!r})"

    # Reads of values: a copy to the host first (torch's own would set a CUDA device guard, which
    # the CPU build cannot; tolist has no subclass support at all).
    def tolist(self) -> Any:  # type: ignore[override]
        return self.to(CPU).tolist()

    def item(self) -> Any:  # type: ignore[override]
        return self.to(CPU).item()

    def __int__(self) -> int:
        return int(self.to(CPU))

    def __index__(self) -> int:
        return self.to(CPU).__index__()

    def __float__(self) -> float:
        return float(self.to(CPU))

    def __bool__(self) -> bool:
        return bool(self.to(CPU))

    # Other methods whose Python bindings set a CUDA device guard, done by the ops they stand for.
    def __invert__(self) -> torch.Tensor:
        return torch.bitwise_not(self)

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format,  # type: ignore[override]
                   ) -> torch.Tensor:
        return self if self.is_contiguous(memory_format=memory_format) else self.clone(memory_format=memory_format)

    def nonzero(self, *, as_tuple: bool = False) -> Any:  # type: ignore[override]
        nz = aten.nonzero.default(self)
        return nz.unbind(1) if as_tuple else nz

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:  # type: ignore[override]
        return aten.copy_.default(self, src, non_blocking)

    def new_tensor(self, data: Any, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        return torch.tensor(data, dtype=dtype or self.dtype, device=CUDA)

    # Indexing: torch's own sets a CUDA device guard too. The same indexing runs on the values
    # (a view stays a view of them), after the placement check a GPU would make: index tensors
    # and assigned values on the CPU are refused unless they are 0-dim.
    def __getitem__(self, index: Any) -> torch.Tensor:
        return OnCuda(self.elem[_unwrap_index(index, "index")])

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor) and not isinstance(value, OnCuda) and value.dim() > 0:
            raise PlacementError(f"a cuda tensor assigned a cpu tensor of shape {tuple(value.shape)}")
        self.elem[_unwrap_index(index, "index_put_")] = value.elem if isinstance(value, OnCuda) else value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        raise PlacementError(f"{func} on a cuda tensor outside CudaPlacement")


def _unwrap_index(index: Any, op: str) -> Any:
    def one(i: Any) -> Any:
        if isinstance(i, OnCuda):
            return i.elem
        if isinstance(i, torch.Tensor) and i.dim() > 0:
            raise PlacementError(f"{op}: a cuda tensor indexed by a cpu tensor of shape {tuple(i.shape)}")
        return i
    return tuple(one(i) for i in index) if isinstance(index, tuple) else one(index)


# Ops that move data between devices: the one way across, never a placement error.
TRANSFERS = {aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.to.other, aten.copy_.default,
             aten._copy_from.default, aten._copy_from_and_resize.default}


def _is_cuda(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class CudaPlacement(TorchDispatchMode):
    """The dispatch mode of the module docstring. ``uploads``/``downloads`` count host-to-device
    and device-to-host transfers (a read of values, ``item``, ``int``, ``tolist``..., is a
    download), ``pageable_uploads`` the uploads from unpinned memory (each a wait for the stream on
    a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads = self.downloads = self.pageable_uploads = 0
        self._pinned: set[int] = set()  # data pointers of the host storages pinned under this mode
        # Registered as the fake-tensor mode: torch then neither initialises CUDA for a
        # device="cuda" factory nor builds torch.tensor(..., device="cuda") outside the dispatcher.
        self._mode_key = torch._C._TorchDispatchModeKey.FAKE
        self._lift: list[bool] = []

    def __enter__(self) -> CudaPlacement:
        # torch.tensor(data, device="cuda") is then made on the CPU and moved by a _to_copy this
        # mode sees (what FakeTensorMode does).
        self._lift.append(torch._C._only_lift_cpu_tensors())
        torch._C._set_only_lift_cpu_tensors(True)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch._C._set_only_lift_cpu_tensors(self._lift.pop())

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        self._pinned.add(t.untyped_storage().data_ptr())
        return t

    def _is_pinned(self, t: torch.Tensor) -> bool:
        return not isinstance(t, OnCuda) and t.untyped_storage().data_ptr() in self._pinned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        cuda_in = any(isinstance(t, OnCuda) for t in tensors)
        if func is aten.is_pinned.default:
            return self._is_pinned(args[0])
        if func is aten._pin_memory.default:
            return self._pin(args[0].clone())
        if cuda_in and func not in TRANSFERS:
            stray = [t for t in tensors if not isinstance(t, OnCuda) and t.dim() > 0]
            if stray:
                raise PlacementError(f"{func}: cuda tensors with a cpu tensor of shape {tuple(stray[0].shape)} "
                                     f"(dtype {stray[0].dtype}): it was made on the wrong device")
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type != "cuda":
                raise PlacementError(f"{func}: a cuda tensor drawn from a {gen.device.type} generator")
        device = kwargs.get("device")
        if device is not None:
            out_cuda = _is_cuda(device)
            if out_cuda:
                kwargs["device"] = CPU
        elif func is aten.copy_.default:
            out_cuda = isinstance(args[0], OnCuda)
        else:
            out_cuda = cuda_in
        pinned = bool(kwargs.pop("pin_memory", False)) and not out_cuda
        if func is aten.to.other:
            out_cuda = isinstance(args[1], OnCuda)
        elif func is aten.to.device:  # the one overload that takes the device positionally
            out_cuda = _is_cuda(args[1])
            args = (args[0], CPU, *args[2:])
        if func in TRANSFERS and out_cuda:
            src = args[1] if func is aten.copy_.default else args[0]
            if not isinstance(src, OnCuda):
                self.uploads += 1
                self.pageable_uploads += not self._is_pinned(src)
        elif func in TRANSFERS and any(isinstance(t, OnCuda) for t in tensors):
            self.downloads += 1
        inputs = {id(t.elem if isinstance(t, OnCuda) else t): t for t in tensors}
        unwrap = lambda t: t.elem if isinstance(t, OnCuda) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in inputs:
                if isinstance(inputs[id(t)], OnCuda) == out_cuda:
                    return inputs[id(t)]  # an in-place op, an out= argument, a no-op to(): the caller's own
                t = t.clone()  # a to() across devices is a copy, even where the values already lie
            if pinned:
                self._pin(t)
            return OnCuda(t) if out_cuda else t

        return tree_map(wrap, out)


class _Event:
    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class _Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = CUDA

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _stream_context(stream: Any) -> Iterator[None]:
    yield


def tokens_of(results: list) -> list[list[int]]:
    """Each result's output token ids."""
    return [r.output_token_ids for r in results]


def logprobs_of(results: list) -> list[list[tuple[int, float]]]:
    """Each result's (token id, logprob) per output token."""
    return [[(a["token_id"], a["logprob"]) for a in r.logprobs] for r in results]


def assert_logprobs_close(got: list, want: list, atol: float) -> None:
    """The same tokens, and their logprobs within ``atol``, result by result."""
    for g, w in zip(logprobs_of(got), logprobs_of(want), strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        torch.testing.assert_close(torch.tensor([p for _, p in g]), torch.tensor([p for _, p in w]), atol=atol, rtol=0)


def emulate_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda`` reports one GPU, its streams and events host no-ops (run the ops under
    :class:`CudaPlacement`)."""
    for name, value in {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                        "set_device": lambda d: None, "synchronize": lambda d=None: None, "Event": _Event,
                        "Stream": _Stream, "current_stream": lambda d=None: _Stream(), "stream": _stream_context,
                        "empty_cache": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)


@pytest.fixture
def on_cuda(monkeypatch) -> Iterator[CudaPlacement]:
    """A machine with one (emulated) GPU: ``torch.cuda`` reports it, streams and events are host
    no-ops, and every op runs under :class:`CudaPlacement`."""
    emulate_cuda(monkeypatch)
    mode = CudaPlacement()
    with mode:
        yield mode


def cuda(t: torch.Tensor) -> OnCuda:
    """``t`` on the emulated GPU (call under :class:`CudaPlacement`)."""
    return t.to(CUDA)


def host(t: Any) -> Any:
    """Results back on the CPU, after checking every tensor in them is on the GPU."""
    def back(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        assert isinstance(x, OnCuda) and x.device == CUDA, f"a result on {x.device}, not on the GPU"
        return x.elem.clone()
    return tree_map(back, t)


def both(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``fn`` on the CPU arguments, then on copies of them on the GPU: (CPU result, GPU result
    back on the host, every tensor of it checked to be on the GPU). Arguments are copied first
    so that in-place kernels start from the same values."""
    dev_args, dev_kwargs = tree_map(_to_gpu, (args, kwargs))
    cpu_args, cpu_kwargs = tree_map(_clone, (args, kwargs))
    want = fn(*cpu_args, **cpu_kwargs)
    got = host(fn(*dev_args, **dev_kwargs))
    return want, got


def _to_gpu(x: Any) -> Any:
    return cuda(x) if isinstance(x, torch.Tensor) else x


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def assert_same(want: Any, got: Any, tol: float = 0.0) -> None:
    """Equal: bit for bit by default (the same ops ran on the same values, only the claimed device
    differs); within ``tol`` for attention, where SDPA on "CUDA" tensors takes its math path
    rather than the CPU's flash kernel (fp32 rounding apart, the same attention)."""
    for w, g in zip(tree_leaves(want), tree_leaves(got), strict=True):
        if isinstance(w, torch.Tensor):
            assert w.dtype == g.dtype and w.shape == g.shape
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        else:
            assert w == g


ATTN_TOL = 1e-5


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# the emulator itself: it must refuse what a GPU refuses, or the tests below prove nothing


def test_the_emulated_gpu_refuses_what_a_gpu_refuses(on_cuda):
    x = torch.arange(6.0, device="cuda:0").view(2, 3)
    assert isinstance(x, OnCuda) and x.is_cuda and x.device == CUDA
    assert (x + 1).is_cuda and x.sum().is_cuda and x[:, 1:].is_cuda and x.new_zeros(2).is_cuda
    assert (x * torch.tensor(2.0)).is_cuda  # a 0-dim CPU tensor is a scalar operand, as on a GPU
    with pytest.raises(PlacementError, match=r"aten.add.Tensor: cuda tensors with a cpu tensor of shape \(3,\)"):
        x + torch.arange(3)
    with pytest.raises(PlacementError, match=r"aten.index_select.default: .* cpu tensor of shape \(1,\)"):
        x.index_select(0, torch.tensor([1]))
    with pytest.raises(PlacementError, match=r"index: a cuda tensor indexed by a cpu tensor of shape \(1,\)"):
        x[torch.tensor([1])]
    with pytest.raises(PlacementError, match=r"a cuda tensor assigned a cpu tensor of shape \(3,\)"):
        x[0] = torch.zeros(3)
    with pytest.raises(PlacementError, match="a cuda tensor drawn from a cpu generator"):
        torch.empty(3, device="cuda:0").exponential_(generator=_gen())
    # Transfers are the way across, counted; values are real and reads work.
    before = on_cuda.uploads
    pinned = torch.tensor([4, 5]).pin_memory()
    assert pinned.is_pinned() and not torch.tensor([1]).is_pinned()
    y = pinned.to(CUDA, non_blocking=True)
    z = torch.tensor([1, 2]).to(CUDA)
    assert (on_cuda.uploads - before, on_cuda.pageable_uploads) == (2, 1)
    assert y.tolist() == [4, 5] and int(z.max()) == 2 and x[1, 2].item() == 5.0
    assert x.cpu().device == CPU and not isinstance(x.cpu(), OnCuda)
    assert x.add_(1) is x and x.tolist() == [[1, 2, 3], [4, 5, 6]]  # in place: the same tensor
    out = torch.empty(2, 3, device="cuda:0")
    assert torch.add(x, x, out=out) is out and out[0].tolist() == [2, 4, 6]
    row = x[0]
    row.zero_()  # a view shares the values
    assert x.tolist() == [[0, 0, 0], [4, 5, 6]]


# ---------------------------------------------------------------------------------------------
# the reference kernels


def test_small_kernels_stay_on_the_device(on_cuda):
    g = _gen()
    T, Hq, Hkv, D = 5, 4, 2, 8
    x, r, w = torch.randn(T, 16, generator=g), torch.randn(T, 16, generator=g), torch.randn(16, generator=g)
    assert_same(*both(R.rms_norm, x, w, 1e-5, r))
    assert_same(*both(R.rms_norm, x, w, 1e-5))
    assert_same(*both(R.add_rms_norm, x, w, 1e-5, r))
    assert_same(*both(R.add_rms_norm, x.bfloat16(), w.bfloat16(), 1e-5, r.bfloat16()))
    assert_same(*both(R.silu_and_mul, x))
    q, k = torch.randn(T, Hq, D, generator=g), torch.randn(T, Hkv, D, generator=g)
    positions = torch.tensor([0, 3, 4, 9, 2])
    cos_sin = torch.randn(16, D, generator=g)
    assert_same(*both(R.apply_rotary, q, k, positions, cos_sin))
    assert_same(*both(lambda p, cs: (R.rotary_table(p, cs).cos, R.rotary_table(p, cs).sin), positions, cos_sin))
    qk = torch.randn(T, Hq + Hkv, D, generator=g)
    assert_same(*both(lambda qk, p, cs: R.rotate_qk(qk, R.rotary_table(p, cs)), qk, positions, cos_sin))
    # the cache writes, in place: compare the caches they wrote
    nb, bs = 6, 4
    slots = torch.tensor([0, 5, 9, 22, 13])
    kv = torch.randn(T, 2, Hkv, D, generator=g)

    def store(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, s: torch.Tensor):
        R.store_kv(k, v, kc, vc, s)
        return kc, vc

    assert_same(*both(store, kv[:, 0], kv[:, 1], torch.zeros(nb, bs, Hkv, D), torch.zeros(nb, bs, Hkv, D), slots))

    def store_layer(kv: torch.Tensor, layer: torch.Tensor, s: torch.Tensor, view: bool):
        R.store_kv_layer(kv, layer, s, R.slot_major(layer) if view else None)
        return layer

    for view in (False, True):
        assert_same(*both(store_layer, kv, torch.zeros(2, nb, bs, Hkv, D), slots, view))
    tables = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32)
    assert_same(*both(R.gather_slots, tables, 10, bs))


def test_fused_moe_stays_on_the_device(on_cuda):
    g = _gen(1)
    T, H, I, E, k = 6, 8, 12, 4, 2
    x = torch.randn(T, H, generator=g)
    w_gate_up, w_down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids = torch.tensor([[0, 2], [1, 1], [3, -1], [2, 0], [5, 3], [1, 2]])  # -1 and 5: experts living elsewhere
    weights = torch.rand(T, k, generator=g)
    assert_same(*both(R.fused_moe, x, w_gate_up, w_down, ids, weights), tol=1e-6)
    assert_same(*both(R.fused_moe, x[:0], w_gate_up, w_down, ids[:0], weights[:0]))


def _paged(seed: int, nb: int = 24, bs: int = 4, Hkv: int = 2, D: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(nb, bs, Hkv, D, generator=g), torch.randn(nb, bs, Hkv, D, generator=g)


@pytest.mark.parametrize("lens", [[9], [9, 9], [9, 5, 12], [1 + (7 * i) % 23 for i in range(20)]],
                         ids=["one", "one-length", "mixed-lengths", "groups"])
@pytest.mark.parametrize("workspace", [False, True])
def test_decode_attention_stays_on_the_device(on_cuda, lens, workspace):
    """Batch 1 (no mask), rows of one length, mixed lengths (the padded path's mask) and more rows
    than a group (sorted, grouped, scattered back); with and without the runner's workspace."""
    k_cache, v_cache = _paged(2)
    B, Hq, D, bs = len(lens), 4, k_cache.shape[-1], k_cache.shape[1]
    width = -(-max(lens) // bs)
    tables = torch.tensor([[(b * 5 + j) % k_cache.shape[0] for j in range(width)] for b in range(B)],
                          dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(B, Hq, D, generator=_gen(3))

    def attend(q, kc, vc, tables, lens, ws):
        plan = R.plan_decode(tables, lens, bs, sparse=False)  # the CPU's padded path: what CUDA runs
        return R.paged_decode_attention(q, kc, vc, tables, lens, 0.35, None, ws, plan)

    ws = (torch.zeros(B * width, *k_cache.shape[1:]), torch.zeros(B * width, *k_cache.shape[1:])) if workspace else None
    assert_same(*both(attend, q, k_cache, v_cache, tables, context_lens, ws), tol=ATTN_TOL)
    # and the plan the engine builds once per step, made on the device
    plan = R.plan_decode(cuda(tables), cuda(context_lens), bs)
    assert plan.slots is None and all(isinstance(t, OnCuda) for grp in plan.groups
                                      for t in (grp.index, grp.blocks, grp.mask) if t is not None)


def test_prefill_attention_stays_on_the_device(on_cuda):
    """One batch with every kind of chunk: a whole prompt (SDPA's is_causal), a chunk over a cached
    prefix (its own mask), and three short chunks batched together (the short group's rows, padded
    positions and mask)."""
    k_cache, v_cache = _paged(4)
    bs, Hq, D = k_cache.shape[1], 4, k_cache.shape[-1]
    n_new = [R.SHORT_CHUNK + 4, R.SHORT_CHUNK + 2, 2, 3, 1]
    n_ctx = [R.SHORT_CHUNK + 4, R.SHORT_CHUNK + 14, 6, 11, 4]
    width = -(-max(n_ctx) // bs)
    tables = torch.tensor([[(s * 4 + j) % k_cache.shape[0] for j in range(width)] for s in range(len(n_new))],
                          dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(n_new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(n_ctx, dtype=torch.int32)
    q = torch.randn(sum(n_new), Hq, D, generator=_gen(5))
    want, got = both(R.prefill_attention, q, k_cache, v_cache, tables, cu, lens, 0.3)
    assert_same(want, got, tol=ATTN_TOL)
    plan = R.plan_prefill(cuda(tables), cuda(cu), cuda(lens), bs, Hq // k_cache.shape[-2])
    assert len(plan.short) == 1 and len(plan.long) == 2 and plan.long[0].mask is None
    for t in (plan.short[0].rows, plan.short[0].pad_pos, plan.short[0].blocks, plan.short[0].mask,
              plan.long[1].slots, plan.long[1].mask):
        assert isinstance(t, OnCuda)


def test_invariant_attention_stays_on_the_device(on_cuda):
    """Decode tokens of two sequences and a prefill chunk of a third in one call (the single-token
    rows gathered together, the chunk on its own)."""
    k_cache, v_cache = _paged(6, nb=160)
    Hq, D = 4, k_cache.shape[-1]
    tables = torch.arange(3 * 50, dtype=torch.int32).view(3, 50) % k_cache.shape[0]
    seq_index = torch.tensor([0, 2, 1, 1, 1])
    positions = torch.tensor([20, 7, 2, 3, 4])
    q = torch.randn(5, Hq, D, generator=_gen(7))
    assert_same(*both(R.invariant_attention, q, k_cache, v_cache, tables, seq_index, positions, 0.3),
                tol=ATTN_TOL)


@pytest.mark.parametrize("B", [3, R.DECODE_GROUP + 2])
def test_mla_kernels_stay_on_the_device(on_cuda, B):
    """The latent cache write, decode (one group, and more rows than a group) and prefill."""
    g = _gen(8)
    nb, bs, C, Rr, Hq = 40, 4, 16, 8, 4
    cache = torch.randn(nb, bs, 1, C + Rr, generator=g)
    lens = [1 + (5 * b) % 19 for b in range(B)]
    width = -(-max(lens) // bs)
    tables = torch.tensor([[(b * 3 + j) % nb for j in range(width)] for b in range(B)], dtype=torch.int32)
    q_latent, q_pe = torch.randn(B, Hq, C, generator=g), torch.randn(B, Hq, Rr, generator=g)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    assert_same(*both(RM.mla_decode_attention, q_latent, q_pe, cache, tables, context_lens, 0.3), tol=ATTN_TOL)
    ws = torch.zeros(B * width, bs, 1, C + Rr)
    assert_same(*both(RM.mla_decode_attention, q_latent, q_pe, cache, tables, context_lens, 0.3, ws),
                tol=ATTN_TOL)

    def store(latent, kv_cache, slots):
        RM.store_mla_kv(latent, kv_cache, slots)
        return kv_cache

    assert_same(*both(store, torch.randn(3, C + Rr, generator=g), cache, torch.tensor([0, 7, 30])))
    n_new, n_ctx = [3, 1, 5], [9, 1, 5]
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    T = sum(n_new)
    assert_same(*both(RM.mla_prefill_attention, torch.randn(T, Hq, C, generator=g), torch.randn(T, Hq, Rr, generator=g),
                      cache, tables[:3], cu, torch.tensor(n_ctx, dtype=torch.int32), 0.3), tol=ATTN_TOL)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_verify_kernels_stay_on_the_device(on_cuda, k, with_draft_probs):
    g = _gen(9)
    N, V = 4, 11
    target = torch.rand(N, k + 1, V, generator=g).softmax(-1)
    draft = torch.rand(N, k, V, generator=g).softmax(-1) if with_draft_probs else None
    tokens = torch.randint(0, V, (N, k), generator=g)
    num_drafts = torch.tensor([k, max(k - 1, 0), 0, k])
    p_tok, q_tok = torch.rand(N, k, generator=g), torch.rand(N, k, generator=g)
    uniforms = torch.rand(N, k, generator=g)
    assert_same(*both(RV.spec_accept, p_tok, q_tok, uniforms, num_drafts))
    accepted = RV.spec_accept(p_tok, q_tok, uniforms, num_drafts)
    noise = torch.empty(N, V).exponential_(generator=g)
    assert_same(*both(RV.spec_residual, target, draft, tokens, accepted, num_drafts))
    assert_same(*both(RV.spec_recover, target, draft, tokens, accepted, num_drafts, noise))


def test_the_sparse_decode_path_is_the_cpus_and_its_plan_follows_its_inputs(on_cuda):
    """The in-place decode attention runs on CPU fp32 tensors only (sparse CSR products); CUDA
    tensors keep the padded path. Its plan's index arithmetic still follows the device of its
    inputs."""
    k_cache, v_cache = _paged(10)
    q = torch.randn(5, 4, k_cache.shape[-1], generator=_gen(11))
    assert RS.applies(q, k_cache, v_cache) and not RS.applies(cuda(q), cuda(k_cache), cuda(v_cache))
    tables = torch.tensor([[(b * 5 + j) % 24 for j in range(4)] for b in range(5)], dtype=torch.int32)
    lens = torch.tensor([3, 16, 9, 1, 12], dtype=torch.int32)
    assert R.plan_decode(cuda(tables), cuda(lens), k_cache.shape[1]).slots is None
    assert_same(*both(RS.sorted_slots, tables, lens, k_cache.shape[1]))


# ---------------------------------------------------------------------------------------------
# the sampler, the host readback


def _sampling_batch() -> tuple[torch.Tensor, list[SamplingParams], Any]:
    logits = torch.randn(5, 50, generator=_gen(12)) * 3
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.7, min_p=0.05, seed=3),
              SamplingParams(temperature=1.2, seed=4)]

    def generators() -> list[torch.Generator | None]:
        return [None if p.greedy else torch.Generator().manual_seed(100 + i) for i, p in enumerate(params)]

    return logits, params, generators


def test_sampling_stays_on_the_device_and_uploads_from_pinned_memory(on_cuda):
    """Greedy and sampled rows (top-k, top-p, min-p) together, then all greedy: the ids and
    logprobs on the device equal the CPU's, drawn from the same host generators; whatever goes
    up goes from pinned memory (an upload from pageable memory waits for the stream)."""
    logits, params, generators = _sampling_batch()
    on_gpu = cuda(logits)
    for rows in (params, [SamplingParams(temperature=0)] * len(params)):
        want = sampler.sample_on_device(logits, rows, generators())
        before = on_cuda.pageable_uploads, on_cuda.downloads
        got = sampler.sample_on_device(on_gpu, rows, generators())
        assert (on_cuda.pageable_uploads, on_cuda.downloads) == before  # no wait for the stream, no read
        assert_same(want, host(got))
    assert_same(sampler.logprobs_on_device(logits, want, 3), host(sampler.logprobs_on_device(on_gpu, got, 3)))


def test_penalties_are_built_and_applied_on_the_device(on_cuda):
    """Repetition, presence and frequency penalties and logit biases, built on the host in one
    upload from pinned memory, applied on the device: the logits and the sampled ids equal the
    CPU's."""
    logits, params, generators = _sampling_batch()
    prompt_ids = [[1, 2, 3], [], [4, 4, 9], [7], [0, 49]]
    output_ids = [[2, 2, 5], [6], [], [7, 7, 7], [1]]
    args = (prompt_ids, output_ids, [1.2, 1.0, 0.8, 1.5, 1.1], [0.0, 0.5, 0.1, 0.0, 0.3], [0.2, 0.0, 0.0, 0.4, 0.1],
            [{3: 2.0}, {}, {10: -5.0, 11: 1.0}, {}, {49: 0.5}], logits.shape[1])
    want = sampler.Penalties.build(*args, CPU)
    before = on_cuda.uploads, on_cuda.pageable_uploads
    got = sampler.Penalties.build(*args, CUDA)
    assert (on_cuda.uploads - before[0], on_cuda.pageable_uploads) == (1, before[1])
    on_gpu = cuda(logits)
    assert_same(sampler.apply_penalties(logits, want), host(sampler.apply_penalties(on_gpu, got)))
    assert_same(sampler.sample_on_device(logits, params, generators(), want),
                host(sampler.sample_on_device(on_gpu, params, generators(), got)))


def test_the_readback_reads_a_step_in_one_copy(on_cuda):
    logits, params, generators = _sampling_batch()
    ids = sampler.sample_on_device(cuda(logits), params, generators())
    logprobs = sampler.logprobs_on_device(cuda(logits), ids, 2)
    readback = sampler.HostReadback(CUDA)
    readback.add(ids)
    readback.add(logprobs)
    before = on_cuda.downloads
    got = readback.read()
    assert on_cuda.downloads == before + 1 and readback.syncs == 1
    want = sampler.logprobs_on_device(logits, ids.cpu(), 2)
    assert got[0] == ids.cpu().tolist() and got[1] == want.double().tolist()


# ---------------------------------------------------------------------------------------------
# a model runner's steps and a whole engine on the device (the reference kernels)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny("llama", folder)
    return folder


def _requests() -> list[GenerationRequest]:
    """Three prompts of different lengths (prefill chunks of several sizes, then decode rows of
    mixed context lengths), greedy and seeded sampling together."""
    prompts = [[3, 5, 7], [11, 13, 17, 19, 23, 29, 31], [37, 41, 43, 47, 53]]
    sampling = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                SamplingParams(temperature=0.9, top_k=30, seed=5, max_tokens=5, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)]
    return [GenerationRequest(f"r{i}", s, prompt_token_ids=p) for i, (p, s) in enumerate(zip(prompts, sampling))]


def _llm(folder: Path, device: str) -> LLM:
    return LLM(str(folder), dtype="fp32", engine_config=EngineConfig(
        device=device, block_size=4, num_blocks=24, max_num_seqs=4, enforce_eager=True))


def test_an_engine_on_the_device_generates_what_it_generates_on_the_cpu(on_cuda, tiny_llama, monkeypatch):
    """Prefill and decode steps through the scheduler, the runner (the one-copy step upload), the
    model (reference kernels), the sampler and the readback, on the device: every tensor of every
    step where it must be, and the same tokens as on the CPU."""
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    want = _llm(tiny_llama, "cpu").generate(_requests())
    llm = _llm(tiny_llama, "cuda:0")
    assert isinstance(llm.runner.kv_cache, OnCuda) and isinstance(llm.model.embed, OnCuda)
    got = llm.generate(_requests())
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert got[2].logprobs is not None and want[2].logprobs is not None
    for g, w in zip(got[2].logprobs, want[2].logprobs):
        assert g["token_id"] == w["token_id"] and g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
    assert llm.runner.uploader.copies > 0 and llm.readback.syncs > 0


def _decode_items(runner: ModelRunner, rows: int, context: int) -> list[WorkItem]:
    blocks = runner.kv_cache.shape[2]
    table = [i % blocks for i in range(-(-context // runner.block_size))]
    return [WorkItem([7], context - 1, table, num_logits=1) for _ in range(rows)]


def test_the_workspace_is_made_only_where_the_reference_gathers(on_cuda, tiny_llama, monkeypatch):
    """The reference decode attention gathers blocks into the runner's workspace, on the device and
    for one group of rows at most; the Triton kernels read the cache in place, so on their path a
    decode step allocates no workspace at all."""
    llm = _llm(tiny_llama, "cuda:0")
    runner = ModelRunner(llm.model, 12, 4, torch.float32)
    monkeypatch.setenv("KVBATCH_KERNELS", "triton")
    assert not runner.gathers()
    _, batch, _ = runner.build(_decode_items(runner, 3, 30))
    assert batch.decode_workspace is None and runner._ws is None
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    assert runner.gathers()
    rows = R.DECODE_GROUP + 4
    _, batch, _ = runner.build(_decode_items(runner, rows, 200))  # 50 blocks wide
    assert batch.decode_workspace is not None
    assert all(isinstance(w, OnCuda) and w.shape[0] == R.DECODE_GROUP * 50 for w in batch.decode_workspace)
    logits, _ = runner.run(_decode_items(runner, rows, 200)[:2])  # it serves a step, on the device
    assert isinstance(logits, OnCuda) and logits.shape[0] == 2


def test_a_released_runner_frees_its_cache_whoever_holds_views(tiny_llama, monkeypatch):
    """The model keeps per-layer views of the last cache it ran over: after a warm-up, dropping the
    scratch runner alone would leave its cache allocated while the KV cache is sized from the
    memory left. ``release`` frees it (and the workspace) all the same."""
    monkeypatch.setenv("KVBATCH_KERNELS", "reference")
    monkeypatch.setenv("KVBATCH_HUGE_PAGES", "0")  # the cache in torch's own memory, as on a GPU
    llm = _llm(tiny_llama, "cpu")
    runner = ModelRunner(llm.model, 6, 4, torch.float32)
    runner.warm_up(tokens=9, num_logits=2, decode_rows=R.DECODE_GROUP + 1, context_len=40)
    assert runner._ws is not None and runner._ws[0].shape[0] == R.DECODE_GROUP * 10  # one group of 10-block rows
    held = [runner.kv_cache[0, 0], runner._ws[0][:1]]  # views that outlive the runner's own references
    runner.release()
    assert all(v.untyped_storage().nbytes() == 0 for v in held)
    with pytest.raises(RuntimeError, match="KV cache was released"):
        runner.run(_decode_items(runner, 1, 4))
    # the engine's own runner is untouched and still generates
    assert llm.generate(_requests()[:1])[0].output_token_ids


# ---------------------------------------------------------------------------------------------
# the KV staging


@pytest.mark.parametrize("buffer_bytes", [1 << 20, 40])  # whole runs per buffer; pieces of one block's rows
def test_kv_staging_copies_between_pinned_buffers_and_the_device_cache(on_cuda, buffer_bytes):
    """Loads and saves through the CUDA copy engine (its side stream): the cache on the device gets
    the bytes the host copy engine gives a CPU cache, and every copy between them goes from or to
    a pinned buffer: one copy per piece up, one per piece down, none from pageable memory."""
    shape = (2, 2, 9, 4, 2, 3)  # [layers, K/V, blocks, block_size, heads, dim]
    g = _gen(13)
    cache = torch.randn(shape, generator=g)
    tensors = [torch.randn(block_shape(cache), generator=g) for _ in range(4)]
    ids, keys = [5, 6, 7, 1], ["a", "b", "c", "d"]

    def round_trip(engine: Any, cache: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        staging = KVStaging(engine, 2, buffer_bytes)
        staging.load(cache, tensors, ids)
        staging.save(cache, keys[:3], [1, 2, 5])
        (saved_keys, saved), = staging.collect(wait=True)
        assert saved_keys == keys[:3]
        return cache, saved, staging.copies

    want_cache, want_saved, _ = round_trip(HostCopyEngine(), cache.clone())
    engine = copy_engine_for(CUDA)
    assert isinstance(engine, CudaCopyEngine)
    on_gpu = cuda(cache)
    before = on_cuda.uploads, on_cuda.downloads, on_cuda.pageable_uploads
    got_cache, got_saved, copies = round_trip(engine, on_gpu)
    assert got_cache is on_gpu and all(not isinstance(t, OnCuda) for t in got_saved)  # saves land on the host
    assert_same((want_cache, want_saved), (host(got_cache), got_saved))
    ups, downs = on_cuda.uploads - before[0], on_cuda.downloads - before[1]
    assert ups >= 1 and downs >= 1 and ups + downs == copies and on_cuda.pageable_uploads == before[2]
