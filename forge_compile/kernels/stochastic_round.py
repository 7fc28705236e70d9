"""Stochastic rounding of fp32 values to bf16: the spec every path shares (fused kernels, CPU blocks, unfused updates).

A bf16 weight updated with round-to-nearest loses every update smaller than half its last bit (lr * update below
~2**-9 of the weight's magnitude): long fine-tuning runs in pure bf16 stall. Rounding up with probability equal to
the discarded fraction keeps the expected value of the stored weight equal to the fp32 result, so small updates
accumulate on average. Only the weight is rounded this way; optimizer states stored in bf16 round to nearest even
(as ``Tensor.to``), which is what torchao's ``bf16_stochastic_round`` does too.

The random bits are a function of (step key, parameter salt, element index) -- a counter-based hash, no generator
state -- so the fused kernel, the CPU path and the unfused path draw the same bits for the same element (tests
compare them bitwise), a CUDA graph could replay it with a new key, and every data-parallel rank rounds alike.

    bits(i) = h(h(i mod 2**32) ^ rkey),    rkey = h(key ^ h(salt)) & 0x7FFFFFFF
    sround(x) = bf16 with the fp32 bit pattern (bits(x) + (bits(i) >> 16)) & 0xFFFF0000    (NaN kept)

``h`` is Chris Wellons' "lowbias32" 32-bit integer hash (a bijection with low avalanche bias). Adding 16 random bits
below the kept 16 and truncating rounds the magnitude up with probability (discarded bits) / 2**16: unbiased, sign
symmetric; a carry into the exponent is the correct rounding up (also to inf past bf16's largest finite value).
"""
from __future__ import annotations

import torch

__all__ = ["hash32", "round_key", "round_key_t", "element_key", "element_key_t", "element_bits", "random_bits",
           "stochastic_round_bf16", "stochastic_round_bf16_at", "table_row", "TABLE_KEY", "TRITON_SROUND",
           "GLUON_SROUND"]

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B


def hash32(x: int) -> int:
    """lowbias32 on a Python int (host side)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    x ^= x >> 16
    return x


def round_key(seed: int, counter: int) -> int:
    """The key of one step call: a function of the user's seed and the step's call counter only, so every
    data-parallel rank draws the same bits and a run is reproducible from its seed."""
    return hash32((seed & _M32) ^ hash32(counter & _M32))


def element_key(key: int, salt: int) -> int:
    """The kernel's scalar for one parameter: the step key mixed with the parameter's salt (its index in the
    step), 31 bits so that it reaches a Triton kernel as an int32 argument."""
    return hash32((key & _M32) ^ hash32(salt & _M32)) & 0x7FFFFFFF


class _TableKey:
    """``TABLE_KEY``: passed as a launch's ``ekey`` where the key is in the launch's scalar-table row."""

    def __repr__(self):
        return "TABLE_KEY"


# The ekey of a launch whose kernel reads the element key from its scalar row (table_row), not from an argument:
# what a launch captured in a CUDA graph needs, since the key changes at every step.
TABLE_KEY = _TableKey()


def table_row(values, ekey=None, width: int = 0) -> torch.Tensor:
    """A scalar-table row (fp32, CPU): the rule's kernel scalars ``values``, then -- ``ekey`` given, a rounded
    update -- the element key's 32 bits as one fp32 word (its int32 bit pattern: the kernels load the word and
    bitcast it, ``epilogue_codegen.key_load``), zeros up to ``width``. Written through an int32 view, never as a
    Python float: most keys are NaN or denormal patterns as floats, which a float round trip would not keep."""
    n = len(values) + (ekey is not None)
    row = torch.zeros(max(n, width), dtype=torch.float32)
    row[:len(values)] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if ekey is not None:
        row.view(torch.int32)[len(values)] = int(ekey)
    return row


def round_key_t(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """``round_key`` of a counter held in a 0-dim tensor (an optimizer's ``step``, float32: its integer value), as a
    0-dim int64 tensor: computed inside a traced step, where the counter is a graph input."""
    return _hash32_t(_hash32_t(counter.to(torch.int64) & _M32) ^ (seed & _M32))


def element_key_t(key: torch.Tensor, salt: int) -> torch.Tensor:
    """``element_key`` of a 0-dim int64 tensor ``key`` (a traced graph's input), as a tensor."""
    return _hash32_t((key & _M32) ^ hash32(salt)) & 0x7FFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 on int64 tensors holding uint32 values, with no product above 2**48 (no int64 overflow)
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def element_bits(idx: torch.Tensor, ekey) -> torch.Tensor:
    """The 32-bit hash of each element index ``idx`` (int64 tensor) under ``ekey`` (``element_key``: an int or a
    0-dim int64 tensor), as int64 values in [0, 2**32): the spec's per-element bits, of which a rounding takes the
    top ones (bf16: 16, kernels/q8_state.py: 24)."""
    return _hash32_t(_hash32_t(idx & _M32) ^ ekey)


def random_bits(idx: torch.Tensor, ekey) -> torch.Tensor:
    """The 16 random bits of each element index ``idx`` under ``ekey``, as int64 values in [0, 2**16)."""
    return element_bits(idx, ekey) >> 16


def stochastic_round_bf16(x: torch.Tensor, ekey) -> torch.Tensor:
    """``x`` (fp32, contiguous: element i is ``x.view(-1)[i]``) stochastically rounded to bf16 with the bits of
    ``ekey``. Only torch element-wise ops, so it also traces into a graph that Inductor fuses."""
    idx = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
    return stochastic_round_bf16_at(x, idx, ekey)


def stochastic_round_bf16_at(x: torch.Tensor, idx: torch.Tensor, ekey) -> torch.Tensor:
    """As ``stochastic_round_bf16`` for elements whose indices in their parameter are ``idx`` (a block of it)."""
    b = x.float().view(torch.int32).to(torch.int64) & _M32
    y = (b + random_bits(idx, ekey)) & 0xFFFF0000
    y = torch.where(y >= 1 << 31, y - (1 << 32), y).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x.float(), y).to(torch.bfloat16)


# The same in Triton, for the kernel templates (spliced after TRITON_RULE_HEAD). ``off``: the elements' int64
# offsets in their parameter; ``ekey``: element_key as an int32 argument.
TRITON_SROUND = '''

@triton.jit
def _hash32(x):
    x ^= x >> 16
    x *= tl.full((), 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x *= tl.full((), 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def _sround_bits(x, off, ekey):
    # x fp32 -> the fp32 pattern whose low 16 bits are zero (stochastic_round.py); NaN kept
    r = _hash32(_hash32(off.to(tl.uint32)) ^ ekey.to(tl.uint32)) >> 16
    y = (x.to(tl.uint32, bitcast=True) + r) & tl.full((), 0xFFFF0000, tl.uint32)
    return tl.where(x != x, x, y.to(tl.float32, bitcast=True))
'''

# The Gluon spelling (wgrad_update_gluon's smem/split kernels): the same operations on the same uint32 values; the
# multipliers are literals (a Gluon gl.full needs a layout), which Triton's integer promotion makes uint32 against
# the uint32 operand, so every product is the same mod-2**32 multiply.
GLUON_SROUND = '''

@gluon.jit
def _hash32(x):
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@gluon.jit
def _sround_bits(x, off, ekey):
    # x fp32 -> the fp32 pattern whose low 16 bits are zero (stochastic_round.py); NaN kept
    r = _hash32(_hash32(off.to(gl.uint32)) ^ ekey.to(gl.uint32)) >> 16
    y = (x.to(gl.uint32, bitcast=True) + r) & 0xFFFF0000
    return gl.where(x != x, x, y.to(gl.float32, bitcast=True))
'''
