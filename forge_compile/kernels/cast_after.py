"""forge::cast_after: a dtype cast that runs no earlier than another tensor exists, opaque to Inductor.

Why: remat_for_backward moves a weight's low-precision copy (the autocast cast the forward's matmul reads) to
its backward use, so that the copy is not kept across the forward/backward boundary
(``compile_train_step(recompute_weight_copies=True)``). As a plain cast node Inductor's scheduler fuses it
horizontally with the forward's cast of the same weight (same input buffer, no dependency between them) and
computes both in the forward: the copy is kept again, plus one buffer (measured on the H100 in stop 21: the
peak rose by one copy). As this op -- an extern call Inductor never fuses -- taking a backward value as an
ordering-only input, the cast runs where the pass put it. The values are torch's own cast (round to nearest
even): bitwise the copy the forward made.
"""
from __future__ import annotations

import torch

__all__ = ["cast_after"]

_LIB = torch.library.Library("forge", "FRAGMENT")
_LIB.define("cast_after(Tensor x, Tensor after, ScalarType dtype) -> Tensor")


def cast_after(x, after, dtype):
    """``x.to(dtype)`` as a new tensor; ``after`` is read by nothing (it only orders the call)."""
    return x.to(dtype, copy=True)


_LIB.impl("cast_after", cast_after, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::cast_after", lib=_LIB)
def _(x, after, dtype):
    return torch.empty_like(x, dtype=dtype)
