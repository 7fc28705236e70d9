"""A transposing copy: ``dst = src.t().contiguous()`` for a row-major 2-D ``src``, tiled through shared memory.

Why: fp32 activations under TF32 reach the Gluon split kernel as K-major copies of dY and X (tf32 wgmma takes only
K-major operands; wgrad_update_gluon._prepare), made at every launch. torch's transposing copy reads or writes
with a stride, one side uncoalesced: on an H100 it moved the two [M, 4096] fp32 copies at ~1 TB/s (0.143 ms at
M=2048, 0.559 ms at M=8192: 30-40 % of the fused launch), this tile-wise transpose (each [64, 64] tile loaded
coalesced along the source rows, transposed in registers/shared memory by Triton, stored coalesced along the
destination rows) at ~2.9 TB/s (0.053 / 0.188 ms; benchmarks/RESULTS.md "fp32 activations under TF32 on the Gluon
kernel").
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["transpose_copy", "transpose_copy_pair"]

_TILE = 64


@triton.jit
def _copy_tile(src_ptr, dst_ptr, pr, pc, row0, R, C, LD, BR: tl.constexpr, BC: tl.constexpr, BIG: tl.constexpr):
    # tile (pr, pc) of src [R, C] (row stride LD) into rows row0 + c of dst [*, R]
    rr = pr * BR + tl.arange(0, BR)
    cc = pc * BC + tl.arange(0, BC)
    if BIG:   # offsets may pass 2^31 elements
        rr = rr.to(tl.int64)
        cc = cc.to(tl.int64)
    tile = tl.load(src_ptr + rr[:, None] * LD + cc[None, :], mask=(rr[:, None] < R) & (cc[None, :] < C))
    tl.store(dst_ptr + (row0 + cc)[:, None] * R + rr[None, :], tl.trans(tile),
             mask=(cc[:, None] < C) & (rr[None, :] < R))


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, LD, BR: tl.constexpr, BC: tl.constexpr, BIG: tl.constexpr):
    _copy_tile(src_ptr, dst_ptr, tl.program_id(0), tl.program_id(1), 0, R, C, LD, BR, BC, BIG)


@triton.jit
def _transpose_pair_kernel(a_ptr, b_ptr, dst_ptr, R, CA, CB, LDA, LDB, BR: tl.constexpr, BC: tl.constexpr,
                           BIG: tl.constexpr):
    # dst [CA + CB, R]: rows [0, CA) = a^T, rows [CA, CA + CB) = b^T; column-tile programs of a, then of b
    pc = tl.program_id(1)
    na = tl.cdiv(CA, BC)
    if pc < na:
        _copy_tile(a_ptr, dst_ptr, tl.program_id(0), pc, 0, R, CA, LDA, BR, BC, BIG)
    else:
        _copy_tile(b_ptr, dst_ptr, tl.program_id(0), pc - na, CA, R, CB, LDB, BR, BC, BIG)


def _tiled(src: torch.Tensor) -> bool:
    # the layouts the tiled kernels copy: [R, C] with unit column stride, on a GPU or under the interpreter
    r, c = src.shape
    return (src.numel() > 0 and (c <= 1 or src.stride(1) == 1) and src.stride(0) >= c
            and (src.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"))


def transpose_copy_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a.t().contiguous(), b.t().contiguous())`` for ``a`` [R, CA] and ``b`` [R, CB] of one dtype and device, in
    one allocation ([CA + CB, R]; the results are its two row ranges, each contiguous) and one launch: the fp32
    (TF32) path's dY^T and X^T (wgrad_update_gluon.kmajor_copies), where a second launch and allocation cost
    ~20 us of host per fused launch. Layouts transpose_copy does not tile, or a mixed pair, take it twice."""
    (r, ca), (rb, cb) = a.shape, b.shape
    if rb != r or a.dtype != b.dtype or a.device != b.device or not (_tiled(a) and _tiled(b)):
        return transpose_copy(a), transpose_copy(b)
    buf = torch.empty((ca + cb, r), dtype=a.dtype, device=a.device)
    lda, ldb = a.stride(0), b.stride(0)
    grid = (triton.cdiv(r, _TILE), triton.cdiv(ca, _TILE) + triton.cdiv(cb, _TILE))
    big = max(grid[0] * _TILE * max(lda, ldb), (ca + cb + _TILE) * r) >= 2 ** 31
    args, opts = (a, b, buf, r, ca, cb, lda, ldb), dict(BR=_TILE, BC=_TILE, BIG=big, num_warps=4)
    _launch(_transpose_pair_kernel, grid, args, opts,
            ("transpose_copy_pair", a.device.index, a.dtype, a.data_ptr(), b.data_ptr(), buf.data_ptr(),
             r, ca, cb, lda, ldb) if a.is_cuda else None)
    return buf[:ca], buf[ca:]


def _launch(kernel, grid, args, opts, key) -> None:
    # copies run at every fp32 (TF32) fused launch, whose own launch is memoized: Triton's JIT dispatch (~30 us of
    # host per launch) would make them the host cost of a step; ``key`` pins everything the launch depends on
    # (None: the interpreter, no memo)
    if key is None:
        kernel[grid](*args, **opts)
        return
    from . import launch_memo

    if launch_memo.lookup(key, (), ()):
        return
    kernel[grid](*args, **opts)
    launch_memo.remember(key, kernel, lambda: (kernel, grid, args, opts), None, (), (), ())


def transpose_copy(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src.t()`` as a new contiguous tensor (or written into ``out``, contiguous [C, R] of src's dtype and
    device). ``src`` [R, C] with unit column stride (row-major, or a column slab of a row-major tensor) on a GPU
    (or on CPU under TRITON_INTERPRET=1); any other layout takes torch's copy, which is right for every layout,
    just slower."""
    r, c = src.shape
    if out is None:
        out = torch.empty((c, r), dtype=src.dtype, device=src.device)
    elif out.shape != (c, r) or out.dtype != src.dtype or out.device != src.device or not out.is_contiguous():
        raise ValueError(f"transpose_copy: out must be a contiguous [{c}, {r}] {src.dtype} tensor on {src.device}")
    if not _tiled(src):
        return out.copy_(src.t())
    ld = src.stride(0)
    grid = (triton.cdiv(r, _TILE), triton.cdiv(c, _TILE))
    # element offsets up to the last tile's padded end, on either side
    big = max(grid[0] * _TILE * ld, grid[1] * _TILE * r) >= 2 ** 31
    _launch(_transpose_kernel, grid, (src, out, r, c, ld), dict(BR=_TILE, BC=_TILE, BIG=big, num_warps=4),
            ("transpose_copy", src.device.index, src.dtype, src.data_ptr(), out.data_ptr(), r, c, ld)
            if src.is_cuda else None)
    return out
