"""kernels/transpose_copy.py: the tiled transposing copy behind the fp32 (TF32) Gluon path's K-major operands.
Bitwise equal to torch's ``src.t().contiguous()`` (a copy: no arithmetic), on ragged shapes, in the interpreter
on CPU and on a GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpreter import run_child  # noqa: E402

from forge_compile.kernels.transpose_copy import transpose_copy, transpose_copy_pair  # noqa: E402

SHAPES = [(1, 1), (64, 64), (100, 70), (3, 200), (257, 129)]


def test_interpreter_tests_in_subprocess():
    run_child(__file__)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_interpreter_transpose_copy(interpret, shape):
    src = torch.randn(*shape)
    out = transpose_copy(src)
    assert out.is_contiguous() and torch.equal(out, src.t())
    # into a given buffer (the bound benchmark launch); a non-row-major source takes torch's copy, still right
    buf = torch.full((shape[1], shape[0]), float("nan"))
    assert transpose_copy(src, buf) is buf and torch.equal(buf, src.t())
    assert torch.equal(transpose_copy(src.t().contiguous().t()), src.t())
    # a column slab of a row-major tensor (row stride > columns): the tiled path, as for a row slab of dY^T
    wide = torch.randn(shape[0], shape[1] + 37)
    assert torch.equal(transpose_copy(wide[:, 5:5 + shape[1]]), wide[:, 5:5 + shape[1]].t())


PAIRS = [(1, 1, 1), (64, 64, 64), (100, 70, 130), (257, 129, 64), (8, 200, 3)]


def _pair_check(r, ca, cb, device):
    # a as dY^T's transpose (row-major [R, CA]), b a column slab (row stride > columns)
    a = torch.randn(r, ca, device=device)
    wide = torch.randn(r, cb + 11, device=device)
    b = wide[:, 3:3 + cb]
    at, bt = transpose_copy_pair(a, b)
    assert at.is_contiguous() and bt.is_contiguous() and torch.equal(at, a.t()) and torch.equal(bt, b.t())
    assert bt.data_ptr() == at.data_ptr() + at.numel() * at.element_size()   # one allocation, b^T after a^T
    # a pair transpose_copy_pair does not tile (mixed row counts): two copies, still right
    at2, bt2 = transpose_copy_pair(a, b[:-1] if r > 1 else b)
    assert torch.equal(at2, a.t()) and torch.equal(bt2, (b[:-1] if r > 1 else b).t())


@pytest.mark.parametrize("shape", PAIRS, ids=str)
def test_interpreter_transpose_copy_pair(interpret, shape):
    _pair_check(*shape, "cpu")


def test_out_is_checked():
    with pytest.raises(ValueError, match="contiguous"):
        transpose_copy(torch.zeros(4, 8), torch.zeros(4, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shape", SHAPES + [(2052, 776)], ids=str)
def test_cuda_transpose_copy(shape):
    src = torch.randn(*shape, device="cuda")
    assert torch.equal(transpose_copy(src), src.t())
    wide = torch.randn(shape[0], shape[1] + 37, device="cuda")
    assert torch.equal(transpose_copy(wide[:, 5:5 + shape[1]]), wide[:, 5:5 + shape[1]].t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_transpose_copy_through_the_launch_memo(monkeypatch):
    # repeated copies between the same buffers (a step's, new values each time) go through launch_memo's fast path
    # from the second repeat on; a copy of another shape or into another buffer is its own key
    from forge_compile.kernels import launch_memo

    monkeypatch.setattr(launch_memo, "ENABLED", [True])
    launch_memo.clear()
    src = torch.empty(300, 200, device="cuda")
    out = torch.empty(200, 300, device="cuda")
    for _ in range(4):
        src.copy_(torch.randn_like(src))
        out.fill_(float("nan"))
        assert transpose_copy(src, out) is out and torch.equal(out, src.t())
    assert launch_memo.counters["hit"] == 2 and launch_memo.counters["built"] == 1
    assert torch.equal(transpose_copy(src, torch.empty(200, 300, device="cuda")), src.t())
    wide = torch.randn(300, 256, device="cuda")
    assert torch.equal(transpose_copy(wide[:, :200]), wide[:, :200].t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shape", PAIRS + [(2052, 1000, 776)], ids=str)
def test_cuda_transpose_copy_pair(shape):
    _pair_check(*shape, "cuda")
