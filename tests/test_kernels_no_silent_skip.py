"""The Triton kernel tests cannot pass by skipping: a kernel module that fails to import is an
error (not ``KERNELS = None`` and every kernel test skipped), and the fresh-interpreter rerun of a
kernel test file fails when it ran no test."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from kvbatch.kernels import dispatch
from tests.triton_interpreter import check_rerun, rerun_in_fresh_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (then None is the right answer)")
def test_a_broken_kernel_module_raises_instead_of_reading_as_no_triton(monkeypatch):
    import kvbatch.kernels as kernels_pkg

    assert dispatch._triton_kernels() is not None  # triton is here, and the kernels import
    monkeypatch.delattr(kernels_pkg, "triton_rotary")
    monkeypatch.setitem(sys.modules, "kvbatch.kernels.triton_rotary", None)  # its import now fails
    dispatch._triton_kernels.cache_clear()
    try:
        with pytest.raises(ImportError, match="triton_rotary"):
            dispatch._triton_kernels()
    finally:
        monkeypatch.undo()
        dispatch._triton_kernels.cache_clear()
    assert dispatch._triton_kernels() is not None


def test_no_triton_reads_as_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    dispatch._triton_kernels.cache_clear()
    try:
        assert dispatch._triton_kernels() is None
    finally:
        monkeypatch.undo()
        dispatch._triton_kernels.cache_clear()


def test_a_rerun_that_ran_no_test_fails(tmp_path):
    only_skips = tmp_path / "test_only_skips.py"
    only_skips.write_text("import pytest\n\n@pytest.mark.skip(reason='nothing here')\ndef test_x():\n    pass\n")
    with pytest.raises(AssertionError, match="ran no test"):
        rerun_in_fresh_interpreter(str(only_skips))


def test_rerun_verdicts():
    check_rerun(0, "3 passed, 1 skipped in 2.0s")
    with pytest.raises(AssertionError, match="ran no test"):
        check_rerun(0, "4 skipped in 0.5s")
    with pytest.raises(AssertionError):
        check_rerun(1, "1 failed, 3 passed in 2.0s")
    with pytest.raises(AssertionError, match="skipped interpreter tests"):
        check_rerun(0, "SKIPPED [2] t.py:10: triton missing, or its kernels were compiled before TRITON_INTERPRET=1 "
                       "was set\n1 passed, 2 skipped")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_a_real_rerun_is_accepted():
    """The check accepts what a kernel test file's fresh-interpreter run really prints (its CUDA-only
    and fresh-process tests skip there, its interpreter tests pass)."""
    rerun_in_fresh_interpreter("tests/test_kernels_fused_mla_prefill.py")
