"""The squared Frobenius norm of a weight gradient without the whole gradient: ``forge::wgrad_sqnorm``.

Why: ``clip_grad_norm_`` reads every gradient's norm before any update may run. For a fused weight the gradient is
``dW = dy_t @ x`` and never exists; this op computes ``||dW||^2`` from the same operands, one bounded row block of
dW at a time (a block's GEMM, then its dot with itself), so what lives at once is one block (<= 32 MiB), not dW.
The fused update then applies the clip coefficient in its epilogue (``optim.rule.grad_scaled_rule``).

Spec (``reference_wgrad_sqnorm``): ``(dy_t.float() @ x.float()).square().sum()`` in fp32 -- the dW the fused update
consumes (fp32 accumulation, never rounded to the activations' dtype), so the norm is the one of the gradient the
update uses. It equals torch's ``linalg.vector_norm(dW) ** 2`` up to summation order (a few fp32 ulps).
Cost: the weight-gradient GEMM once more plus one write and read of each block: the price of clipping without dW.

``forge::embedding_sqnorm`` is the same for an embedding weight (its gradient rows of the tokens seen, from the compact
[tokens, dim] buffer ``forge::embedding_update_`` reads, padding row left out) and for a tied embedding / output weight
(dW + the embedding's rows E): ``||dW||^2 + sum over the seen rows r of (2 dW[r] + E[r]) . E[r]`` -- the output
matmul's dW restricted to the seen rows is one small GEMM (``dy_t[ids] @ x``), so neither dense gradient exists.

``forge::host_scalar`` carries a 0-dim device value (the clip coefficient) to the host as the float64 0-dim CPU
tensor every hyper-parameter is: the fused kernels take their scalars as launch arguments. One device-to-host copy
per step (the first fused update waits for the backward's norms; the rest read the copy); a CUDA graph cannot
replay it (passes/scalar_table.py says so and the step runs without one).
"""
from __future__ import annotations

import torch

from .. import _compat

__all__ = ["reference_wgrad_sqnorm", "wgrad_sqnorm", "reference_embedding_sqnorm", "embedding_sqnorm", "host_scalar",
           "SQNORM_BLOCK_BYTES"]

# fp32 bytes of dW one block may hold: 32 MiB -- 2048 rows of a 4096-wide weight, where a block's GEMM is still
# large enough to run near cuBLAS's speed; on CPU MKL's mm is as fast for blocks of this size
SQNORM_BLOCK_BYTES = 32 << 20


def reference_wgrad_sqnorm(dy_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    g = dy_t.float() @ x.float()
    return (g * g).sum()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dW (a block of it) in fp32 (also wgrad_update_q8's blocked path)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
        # cuBLAS accumulates in fp32 and writes fp32: the unrounded dW, as the fused kernels accumulate it
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _rhs(x: torch.Tensor) -> torch.Tensor:
    """``x`` as every block's ``_mm_fp32`` reads it: as is on cuBLAS's fp32-out path, else fp32, converted once
    rather than per block."""
    return x if x.is_cuda else x.float()


def wgrad_sqnorm(dy_t: torch.Tensor, x: torch.Tensor, block_bytes: int = SQNORM_BLOCK_BYTES) -> torch.Tensor:
    if dy_t.dim() != 2 or x.dim() != 2 or dy_t.shape[1] != x.shape[0]:
        raise ValueError(f"wgrad_sqnorm: dy_t {tuple(dy_t.shape)} and x {tuple(x.shape)} do not compose")
    n, k = dy_t.shape[0], x.shape[1]
    rows = max(1, min(n, block_bytes // 4 // max(1, k)))
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    xb = _rhs(x)
    for r0 in range(0, n, rows):
        blk = _mm_fp32(dy_t[r0:r0 + rows], xb).reshape(-1)
        total += torch.dot(blk, blk)
    return total


def reference_embedding_sqnorm(grad_output, indices, num_rows: int, padding_idx: int = -1, dy_t=None, x=None):
    """Spec: the dense embedding gradient (plus ``dy_t @ x`` for a tied weight) in fp32, its squared norm."""
    g = torch.ops.aten.embedding_dense_backward(grad_output, indices, num_rows, padding_idx, False).float()
    if dy_t is not None:
        g = g + dy_t.float() @ x.float()
    return (g * g).sum()


def embedding_sqnorm(grad_output, indices, num_rows: int, padding_idx: int = -1, dy_t=None, x=None,
                     block_bytes: int = SQNORM_BLOCK_BYTES) -> torch.Tensor:
    from .embedding_update import compact_rows_by_id

    if grad_output.shape[:-1] != indices.shape or indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"embedding_sqnorm: grad_output {list(grad_output.shape)} does not match the "
                         f"{indices.dtype} indices {list(indices.shape)}")
    if (dy_t is None) != (x is None) or (dy_t is not None and (
            dy_t.dim() != 2 or x.dim() != 2 or dy_t.shape[1] != x.shape[0]
            or (dy_t.shape[0], x.shape[1]) != (num_rows, grad_output.shape[-1]))):
        raise ValueError("embedding_sqnorm: dy_t and x must both be given and compose to the [num_rows, dim] dW")
    rows, ids = compact_rows_by_id(grad_output, indices)
    rows = rows.float()
    # the padding row's tokens are in a compact row too; the dense gradient's padding row is zero
    keep = ids != padding_idx if padding_idx >= 0 else None
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    if dy_t is not None:
        total += wgrad_sqnorm(dy_t, x, block_bytes)
        xb = _rhs(x)
    step = max(1, block_bytes // 4 // max(1, rows.shape[1]))
    for u0 in range(0, rows.shape[0], step):
        e = rows[u0:u0 + step]
        # ||A_r + E_r||^2 - ||A_r||^2 per seen row r; A = 0 for a plain embedding
        t = e if dy_t is None else 2 * _mm_fp32(dy_t.index_select(0, ids[u0:u0 + step]), xb) + e
        per_row = (t * e).sum(1)
        if keep is not None:
            per_row = torch.where(keep[u0:u0 + step], per_row, 0.0)
        total += per_row.sum()
    return total


_LIB = torch.library.Library("forge", "FRAGMENT")
_LIB.define("wgrad_sqnorm(Tensor dy_t, Tensor x) -> Tensor")
_LIB.impl("wgrad_sqnorm", lambda dy_t, x: wgrad_sqnorm(dy_t, x), "CompositeExplicitAutograd")


@torch.library.register_fake("forge::wgrad_sqnorm", lib=_LIB)
def _(dy_t, x):
    return x.new_empty((), dtype=torch.float32)


_LIB.define("embedding_sqnorm(Tensor grad_output, Tensor indices, int num_rows, int padding_idx, Tensor? dy_t=None, "
            "Tensor? x=None) -> Tensor")
_LIB.impl("embedding_sqnorm", lambda grad_output, indices, num_rows, padding_idx, dy_t=None, x=None: embedding_sqnorm(
    grad_output, indices, num_rows, padding_idx, dy_t, x), "CompositeExplicitAutograd")


@torch.library.register_fake("forge::embedding_sqnorm", lib=_LIB)
def _(grad_output, indices, num_rows, padding_idx, dy_t=None, x=None):
    return grad_output.new_empty((), dtype=torch.float32)


# cudagraph_unsafe: a device-to-host copy; Inductor's cudagraphs leave it out of a captured graph
_LIB.define("host_scalar(Tensor t) -> Tensor", tags=_compat.cudagraph_unsafe_tags())


def host_scalar(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 0:
        raise ValueError(f"host_scalar: expected a 0-dim tensor, got shape {tuple(t.shape)}")
    return t.detach().to(device="cpu", dtype=torch.float64)


_LIB.impl("host_scalar", host_scalar, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::host_scalar", lib=_LIB)
def _(t):
    return torch.empty((), dtype=torch.float64, device="cpu")
