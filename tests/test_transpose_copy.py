"""kernels/transpose_copy.py: the tiled transposing copy behind the fp32 (TF32) Gluon path's K-major operands.
Bitwise equal to torch's ``src.t().contiguous()`` (a copy: no arithmetic), on ragged shapes, in the interpreter
on CPU and on a GPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpreter import run_child  # noqa: E402

from forge_compile.kernels.transpose_copy import transpose_copy  # noqa: E402

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
