"""8-bit block-wise optimizer states: the spec (roadmap; kernels/wgrad_update_q8.py is its fused kernel, no capture
option uses it yet).

Why: from M = 2048 tokens on, the fused step's cost is moving W, m and v (24 bytes per element for fp32 AdamW;
benchmarks/NOTES_kernel.md, stop 31). 8-bit m and v make it 12 + 2 x 4/128 bytes; with bf16 W (stochastic_rounding)
8 + 2 x 4/128.

Format (stop 38's study, benchmarks/study_q8_states.py): a state ``[..., K]`` is stored as float8_e4m3fn CODES of the
same shape and one fp32 SCALE per block of ``BLOCK`` = 128 consecutive elements of a row (the last block of a row may
be shorter): value = code x scale, scale = absmax(block) / 448 (e4m3's largest finite value). Blocks lie inside a row
so that an epilogue tile of [rows, 128] columns holds whole blocks: the fused kernel can take a block's new absmax
without another CTA. A block of zeros has scale 0 (codes 0).

Quantizing rounds STOCHASTICALLY: v changes by (1 - beta2) = 0.1 % of itself per step, far below half an e4m3 code step
(~3 %), so round-to-nearest puts it back on the same code -- the study counted 98-99 % of v codes unmoved per step and
a v lagging its true average (a biased effective step). Rounding up with probability equal to the discarded fraction
keeps E[dequantized] = the fp32 value. The bits are stochastic_round.py's hash (no generator state: the same for a
kernel, the CPU path and this reference) under a key of the step, the parameter's salt and the state's index
(``state_element_key``), 24 bits per element:

    scale = absmax / 448, 0 where that is below 2^-126 (a block of ~1e-36 values is stored as zeros: 1 / scale
    stays finite);  inv = 1 / scale (0 for a zero block);  y = x * inv
    e = max(exponent(|y|), -6);  ulp = 2^(e - 3)      (e4m3: 3 mantissa bits, subnormals below 2^-6)
    t = |y| / ulp;  q = (floor(t) + (u < t - floor(t))) x ulp,  u = (bits >> 8) / 2^24;  q = min(q, 448)
    q = 2^-9 where q = 0 and y != 0;  code = sign(y) x q

Each step is one IEEE operation in fp32 (the divisions tensor by tensor: torch divides a CUDA tensor by a scalar as a
multiplication by its reciprocal, which a kernel's division would not match; ulp is a power of two), so a kernel
computing the same ops gets the same codes on any device. One division per block and a multiplication per element,
not a division per element: the fused kernel's epilogue is instruction-bound (stop 42, H100). The clamp at 448 only
matters where x * inv rounds a hair above 448 (a block's absmax element). A non-finite state element makes its
block's scale non-finite (every value of the block NaN after dequantization), as it would spoil the fp32 state's next
update anyway. A zero of either sign is stored as +0.

A nonzero value is never stored as zero: below the block's smallest code (2^-9 x scale) it is stored as that code,
not rounded stochastically -- an upward bias of less than one smallest code, against a failure found in stop 43: Adam's
v spans more octaves than e4m3 (its per-block range is 448 / 2^-9 = 2.3e5, v's squares the gradient's), so a small
v rounded to zero while its m did not, and the next step with a zero gradient there (an embedding row not in the
batch) moved that weight by lr x m / eps -- thousands of lr (a 2-layer Llama on CPU, 3 steps). With the floor, v
never vanishes while m does not, and the step stays bounded by the fp32 step's scale.
"""
from __future__ import annotations

import torch

from .stochastic_round import element_bits, element_key, hash32, stochastic_round_bf16

__all__ = ["BLOCK", "E4M3_MAX", "state_element_key", "quantize", "dequantize", "reference_q8_update", "TRITON_Q8"]

BLOCK = 128
E4M3_MAX = 448.0
_MIN_CODE = 2.0 ** -9      # e4m3's smallest subnormal
_STATE_TAG = 0x51380000     # mixed into the step key per state: a state's bits differ from the weight's rounding bits
_M32 = 0xFFFFFFFF


def state_element_key(key: int, salt: int, state: int) -> int:
    """The element key of state number ``state`` (its index in the rule's states) of the parameter salted ``salt``,
    under the step key ``key`` (stochastic_round.round_key): ``element_key`` of a key mixed with the state's tag, so
    m, v and a stochastically rounded weight of one parameter draw unrelated bits."""
    return element_key(hash32((key & _M32) ^ hash32(_STATE_TAG + state)), salt)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` as ``[..., ceil(K / BLOCK), BLOCK]``, the last block zero-padded."""
    k = x.shape[-1]
    pad = -k % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, BLOCK)


def _expand(scales: torch.Tensor, k: int) -> torch.Tensor:
    return scales.repeat_interleave(BLOCK, dim=-1)[..., :k]


def _pow2(k: torch.Tensor) -> torch.Tensor:
    # 2^k (int32 k, a normal fp32 exponent) from its bit pattern, as the kernel builds it
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def quantize(x: torch.Tensor, ekey: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, contiguous, at least 1-D: element i is ``x.view(-1)[i]``) as (codes float8_e4m3fn like ``x``,
    scales fp32 ``[..., ceil(K / 128)]``), rounded stochastically with the bits of ``ekey`` (state_element_key).
    ``start``: the index of ``x``'s first element in its state (``x`` a block of whole rows of it)."""
    x = x.float()
    k = x.shape[-1]
    amax = _blocks(x).abs().amax(dim=-1)
    scales = amax / torch.full_like(amax, E4M3_MAX)
    scales = torch.where(scales < 2.0 ** -126, torch.zeros_like(scales), scales)
    inv = torch.where(scales == 0, torch.zeros_like(scales),
                      torch.ones_like(scales) / torch.where(scales == 0, torch.ones_like(scales), scales))
    y = x * _expand(inv, k)
    a = y.abs()
    # the exponent of |y| from its bit pattern (0 for zeros and subnormal fp32, which the max(-6) covers)
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 127     # int32
    ulp_exp = torch.clamp(e, min=-6) - 3
    t = a * _pow2(-ulp_exp)
    fl = torch.floor(t)
    idx = torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
    u = (element_bits(idx, ekey) >> 8).to(torch.float32) * 2.0 ** -24
    q = (fl + (u < t - fl).float()) * _pow2(ulp_exp)
    q = torch.clamp(q, max=E4M3_MAX)
    # never zero for a nonzero value (the module docstring: a zero v beside a nonzero m is an m / eps step)
    q = torch.where((q == 0) & (a > 0), torch.full_like(q, _MIN_CODE), q)
    codes = torch.where(torch.isnan(y), y, torch.where(y < 0, -q, q))
    return codes.to(torch.float8_e4m3fn), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``(codes, scales)``."""
    return codes.float() * _expand(scales, codes.shape[-1])


def reference_q8_update(rule, param: torch.Tensor, grad: torch.Tensor, states: list, hparams: list, key: int,
                        salt: int) -> None:
    """One update of ``param`` by ``rule`` (optim.rule.Rule) with 8-bit states, in place: each tensor state is a
    ``[codes, scales]`` list (replaced by the new ones), a scalar state (Adam's step) a tensor as today. Dequantize,
    the rule in fp32 op for op as the unfused update, quantize each new tensor state with its own bits. A bf16
    ``param`` is updated in fp32 and stored stochastically rounded with ``element_key(key, salt)`` (the rounded
    update's bits: stochastic_round.py), an fp32 one as computed."""
    ins = [s if rule.is_scalar_state(i) else dequantize(*s) for i, s in enumerate(states)]
    out = rule.fn(param.float(), grad.float(), *ins, *hparams)
    if param.dtype == torch.bfloat16:
        param.copy_(stochastic_round_bf16(out[0].contiguous(), element_key(key, salt)))
    else:
        param.copy_(out[0])
    for i, (s, new) in enumerate(zip(states, out[1:])):
        if rule.is_scalar_state(i):
            s.copy_(new)
        else:
            s[0], s[1] = quantize(new.contiguous(), state_element_key(key, salt, i))


# The same in Triton, for a kernel epilogue (spliced after stochastic_round.TRITON_SROUND, whose _hash32 it uses): a
# [BN, BK] fp32 tile of a state whose columns are whole blocks (BK a multiple of 128, the tile's first column one of
# 128), ``off`` the elements' int64 offsets in the state, ``ekey`` state_element_key as an int32. Returns the codes
# (fp32 values on e4m3's grid: the store's conversion to float8e4nv is exact) and the [BN, BK // 128] scales (BK = 128,
# the fused kernel's epilogue chunks: a [BN, 1] column). 2^k is
# built from its bit pattern and the divisions are correctly rounded, so every value is the torch spec's. The sign
# is a multiplication by -1: triton 3.6's unary minus is 0 - x, which makes -0.0 of a negative value rounded to zero
# +0.0 (CUDA, stop 42).
TRITON_Q8 = '''

@triton.jit
def _q8_quantize(x, off, ekey, BN: tl.constexpr, BK: tl.constexpr):
    if BK == 128:
        # one block per row: a row reduction and a [BN, 1] column, no 3-D reshapes (layout conversions)
        amax = tl.max(tl.abs(x), axis=1)[:, None]
    else:
        amax = tl.max(tl.reshape(tl.abs(x), (BN, BK // 128, 128)), axis=2)
    scale = tl.math.div_rn(amax, tl.full((), 448.0, tl.float32))
    scale = tl.where(scale < 1.1754943508222875e-38, 0.0, scale)
    inv = tl.where(scale == 0, 0.0, tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.where(scale == 0, 1.0, scale)))
    if BK == 128:
        y = x * inv
    else:
        y = x * tl.reshape(tl.broadcast_to(tl.expand_dims(inv, 2), (BN, BK // 128, 128)), (BN, BK))
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(e, -6) - 3
    t = a * ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    fl = tl.floor(t)
    r = _hash32(_hash32(off.to(tl.uint32)) ^ ekey.to(tl.uint32)) >> 8
    u = r.to(tl.float32) * 5.9604644775390625e-08
    q = (fl + tl.where(u < t - fl, 1.0, 0.0)) * ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
    q = tl.minimum(q, 448.0)
    q = tl.where((q == 0.0) & (a > 0.0), 0.001953125, q)
    code = tl.where(y != y, y, tl.where(y < 0, q * -1.0, q))
    return code, scale
'''
