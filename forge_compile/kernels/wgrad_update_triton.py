"""Triton implementation of ``forge::wgrad_update_``: dW tile = dy_t_tile @ x_tile, rule applied in registers.

Read top to bottom: the kernel template (one program per [BLOCK_N, BLOCK_K] tile of dW, grouped tile order,
fp32 accumulation over the token dim M, then the generated optimizer epilogue on W and its states), then the
launcher (host part of the rule, cached per scalar values; config choice; launch).

The template is text because the epilogue is generated per rule (epilogue_codegen); the rendered module is
written to the kernel cache dir and imported, since triton.jit needs a real source file.

Knobs of the template (constexpr, chosen per config, see CONFIGS and benchmarks/NOTES_kernel.md):
- EPI_SPLIT: the epilogue runs on 1, 2 or 4 column chunks of the accumulator, one after the other, so that
  W/states/temporaries of only one chunk are live at a time (big GEMM tiles without register spills);
- PREFETCH: W and the tensor states of the whole tile are loaded before the token loop (measured slower at
  every point on the H200: registers held through the GEMM; kept as a tested knob, used by no default);
- PIPE (pointer path, EPI_SPLIT > 1): chunk c+1's W/states are loaded before chunk c's math (1), and chunk 0's
  before the token loop (2): the HBM latency of one chunk overlaps the previous chunk's work;
- TMA: W/states/GOUT through host TensorDescriptors: loads land in the accumulator's own layout (no register
  layout conversions, fewer registers), bounds handled by the copy engine;
- STORE_GRAD: what the side output GOUT receives (``side_mode``): nothing (0), dW (1), the new W cast to GOUT's
  dtype (2);
- EXTRA: dW gains rows gathered from EROWS through EPOS (a tied embedding's gradient, ``extra=``) before the rule;
- EVEN_NK: N and K are multiples of the tile: the epilogue's loads/stores go unmasked.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading

import torch

from ..optim.rule import Rule
from .epilogue_codegen import Epilogue, compile_epilogue, key_load, load_kernel_module, triton_fields, TRITON_RULE_HEAD
from .stochastic_round import TABLE_KEY, TRITON_SROUND

log = logging.getLogger(__name__)

__all__ = ["launch_wgrad_update", "rule_scalars", "pick_config", "render_kernel_source", "CONFIGS", "Config",
           "TRITON_DW_TILE",
           "side_mode", "check_side_out", "SIDE_NONE", "SIDE_GRAD", "SIDE_CAST"]

# The weight-gradient tile of a program, for this module's template and wgrad_update_q8's: the grouped program order,
# the dW tile accumulated in fp32 over the token dim, and the split of a tile into column halves (the epilogue chunks).
TRITON_DW_TILE = '''

@triton.jit
def _tile_origin(N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
    # Grouped order: GROUP_N row-tiles of dW share their dy_t rows while sweeping K, so consecutive
    # programs reuse dy_t and x panels from L2.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    in_group = GROUP_N * num_k
    first_n = (pid // in_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + ((pid % in_group) % group_size)
    pid_k = (pid % in_group) // group_size
    return pid_n * BLOCK_N, pid_k * BLOCK_K


@triton.jit
def _dw_tile(DYT, X, row0, col0, N, K, M, stride_dn, stride_dm, stride_xm, stride_xk,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
             EVEN_NK: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    rn = row0 + tl.arange(0, BLOCK_N)
    rk = col0 + tl.arange(0, BLOCK_K)
    # Wrap out-of-range rows/cols instead of masking them: the loop loads stay unmasked in N and K and
    # the garbage rows/cols are never stored.
    if EVEN_NK:
        rn_l = rn
        rk_l = rk
    else:
        rn_l = rn % N
        rk_l = rk % K
    rm = tl.arange(0, BLOCK_M)
    a_ptrs = DYT + rn_l[:, None] * stride_dn + rm[None, :] * stride_dm
    b_ptrs = X + rm[:, None] * stride_xm + rk_l[None, :] * stride_xk

    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        if EVEN_M:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(m0 + rm)[None, :] < M, other=0.0)
            b = tl.load(b_ptrs, mask=(m0 + rm)[:, None] < M, other=0.0)
        if UPCAST:
            # fp32 inputs, or the interpreter (its bf16 dot multiplies bit patterns): an fp32 dot in the
            # precision torch.mm takes for fp32 (fp32_dot_precision: IEEE, or TF32 where torch allows it)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PREC)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_M * stride_dm
        b_ptrs += BLOCK_M * stride_xm
    return acc


@triton.jit
def _halves(t, BN: tl.constexpr, BK: tl.constexpr):
    # columns [0, BK/2) and [BK/2, BK) of a [BN, BK] tile
    return tl.split(tl.permute(tl.reshape(t, [BN, 2, BK // 2]), [0, 2, 1]))
'''

_TEMPLATE = TRITON_RULE_HEAD + TRITON_SROUND + TRITON_DW_TILE + '''

@triton.jit
def _ld(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _st(ptrs, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, val)
    else:
        tl.store(ptrs, val, mask=mask)


@triton.jit
def _cast_to(x, dtype: tl.constexpr):
    # torch's cast: round to nearest, ties to even
{cast_body}


@triton.jit
def _st_as(ptrs, val, mask, EVEN: tl.constexpr):
    # a bf16/fp16 optimizer state: round to nearest even, as Tensor.to
    if ptrs.dtype.element_ty == tl.float32:
        _st(ptrs, val, mask, EVEN)
    else:
        _st(ptrs, _cast_to(val, ptrs.dtype.element_ty), mask, EVEN)


@triton.jit
def _st_w(ptrs, val, off, EKEY, mask, EVEN: tl.constexpr):
    # a bf16 weight: stochastic rounding with the bits of its elements' offsets and EKEY (stochastic_round.py)
    if ptrs.dtype.element_ty == tl.bfloat16:
        _st(ptrs, _cast_to(_sround_bits(val, off, EKEY), tl.bfloat16), mask, EVEN)
    else:
        _st(ptrs, val, mask, EVEN)


@triton.jit
def _apply(g, p, {state_vars}W, {state_ptrs}GOUT, {scalar_params}EKEY, off, mask,
           BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, STORE_GRAD: tl.constexpr):
    {new_vars} = _rule(p, g, {state_vars}{scalar_params}BN, BK)
    _st_w(W + off, {new_p}, off, EKEY, mask, EVEN)
{state_stores}
    if STORE_GRAD == 1:
        _st(GOUT + off, g, mask, EVEN)
    if STORE_GRAD == 2:
        # the new W's low-precision copy (side_mode): round to nearest even, as torch's cast
        _st(GOUT + off, _cast_to({new_p}, GOUT.dtype.element_ty), mask, EVEN)


@triton.jit
def _chunk(g, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0,
           BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, STORE_GRAD: tl.constexpr):
    # W and the tensor states of one [BN, BK] chunk are read only now (register pressure).
    p, {state_vars}off, mask = _load_chunk(W, {state_ptrs}N, K, row0, col0, BN, BK, EVEN)
    _apply(g, p, {state_vars}W, {state_ptrs}GOUT, {scalar_params}EKEY, off, mask, BN, BK, EVEN, STORE_GRAD)


@triton.jit
def _load_chunk(W, {state_ptrs}N, K, row0, col0, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    # int64 base of the chunk (N*K may exceed 2**31 for embedding-sized weights), int32 offsets inside it.
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    off = row0.to(tl.int64) * K + col0 + (rn[:, None] * K + rk[None, :])
    mask = ((row0 + rn) < N)[:, None] & ((col0 + rk) < K)[None, :]
    # bf16 weights/states are updated in fp32 (a no-op conversion for fp32 ones)
    p = _ld(W + off, mask, EVEN).to(tl.float32)
{state_loads}
    return p, {state_vars}off, mask


@triton.jit
def _chunk_tma(g, W, {state_ptrs}GOUT, {scalar_params}row0, col0,
               BN: tl.constexpr, BK: tl.constexpr, STORE_GRAD: tl.constexpr):
    # W/states/GOUT are host TensorDescriptors with block [BN, BK]: bulk async copies through shared
    # memory, read straight into the accumulator's layout (no register layout conversions), bounds handled
    # by the copy engine (zero fill on load, clipped store).
    p = W.load([row0, col0])
{tma_loads}
    {new_vars} = _rule(p, g, {state_vars}{scalar_params}BN, BK)
    W.store([row0, col0], {new_p})
{tma_stores}
    if STORE_GRAD:   # 1 only: launch_spec takes the pointer path for the cast copy (2)
        GOUT.store([row0, col0], g)


@triton.jit
def _epilogue(g, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0,
              BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, STORE_GRAD: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        _chunk_tma(g, W, {state_ptrs}GOUT, {scalar_params}row0, col0, BN, BK, STORE_GRAD)
    else:
        _chunk(g, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0, BN, BK, EVEN, STORE_GRAD)


# EKEY never specialized: a key of 1 would become a constexpr
@triton.jit(do_not_specialize=["EKEY"])
def wgrad_update_kernel(
    W, DYT, X, {state_ptrs}GOUT, EROWS, EPOS, EKEY,
    {kernel_scalar_params}N, K, M,
    stride_dn, stride_dm, stride_xm, stride_xk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_NK: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    STORE_GRAD: tl.constexpr, EPI_SPLIT: tl.constexpr, PREFETCH: tl.constexpr, TMA: tl.constexpr, PIPE: tl.constexpr,
    EXTRA: tl.constexpr = False, TKEY: tl.constexpr = False,
):
{scalar_loads}{key_load}    row0, col0 = _tile_origin(N, K, BLOCK_N, BLOCK_K, GROUP_N)

    if PREFETCH:
        # issued before the token loop: the HBM reads of W/states overlap the GEMM
        if TMA:
            p = W.load([row0, col0])
{prefetch_loads_tma}
        else:
            prn = tl.arange(0, BLOCK_N)
            prk = tl.arange(0, BLOCK_K)
            poff = row0.to(tl.int64) * K + col0 + (prn[:, None] * K + prk[None, :])
            pmask = ((row0 + prn) < N)[:, None] & ((col0 + prk) < K)[None, :]
            p = _ld(W + poff, pmask, EVEN_NK).to(tl.float32)
{prefetch_loads}

    if PIPE == 2:
        # the first epilogue chunk's W/states, issued before the token loop (latency hidden by the GEMM)
{pipe_load0}

    rn = row0 + tl.arange(0, BLOCK_N)
    rk = col0 + tl.arange(0, BLOCK_K)
    acc = _dw_tile(DYT, X, row0, col0, N, K, M, stride_dn, stride_dm, stride_xm, stride_xk,
                   BLOCK_N, BLOCK_K, BLOCK_M, EVEN_M, EVEN_NK, UPCAST, DOT_PREC)

    if EXTRA:
        # a tied embedding's gradient rows (embedding_update.compact_rows): row r of dW gains EROWS[EPOS[r]]
        epos = tl.load(EPOS + rn, mask=rn < N, other=-1)
        acc += tl.load(EROWS + epos.to(tl.int64)[:, None] * K + rk[None, :],
                       mask=(epos >= 0)[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)

    if PREFETCH:
        if TMA:
            {new_vars} = _rule(p, acc, {prefetch_vars}{scalar_params}BLOCK_N, BLOCK_K)
            W.store([row0, col0], {new_p})
{tma_pf_stores}
            if STORE_GRAD:
                GOUT.store([row0, col0], acc)
        else:
            _apply(acc, p, {prefetch_vars}W, {state_ptrs}GOUT, {scalar_params}EKEY, poff, pmask,
                   BLOCK_N, BLOCK_K, EVEN_NK, STORE_GRAD)
    elif PIPE:
        # software-pipelined split epilogue (pointer path): chunk c+1's loads are issued before chunk c's
        # math and stores, so one chunk's HBM latency overlaps the previous chunk's work
        tl.static_assert(EPI_SPLIT > 1)
        if PIPE == 1:
{pipe_load0_late}
        if EPI_SPLIT == 2:
            q0, q1 = _halves(acc, BLOCK_N, BLOCK_K)
{pipe_body2}
        else:
            h0, h1 = _halves(acc, BLOCK_N, BLOCK_K)
            q0, q1 = _halves(h0, BLOCK_N, BLOCK_K // 2)
            q2, q3 = _halves(h1, BLOCK_N, BLOCK_K // 2)
{pipe_body4}
    elif EPI_SPLIT == 1:
        _epilogue(acc, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0, BLOCK_N, BLOCK_K, EVEN_NK, STORE_GRAD, TMA)
    elif EPI_SPLIT == 2:
        g0, g1 = _halves(acc, BLOCK_N, BLOCK_K)
        _epilogue(g0, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0, BLOCK_N, BLOCK_K // 2, EVEN_NK, STORE_GRAD, TMA)
        _epilogue(g1, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0 + BLOCK_K // 2, BLOCK_N, BLOCK_K // 2,
               EVEN_NK, STORE_GRAD, TMA)
    else:
        tl.static_assert(EPI_SPLIT == 4)
        g0, g1 = _halves(acc, BLOCK_N, BLOCK_K)
        g00, g01 = _halves(g0, BLOCK_N, BLOCK_K // 2)
        _epilogue(g00, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0, BLOCK_N, BLOCK_K // 4, EVEN_NK, STORE_GRAD, TMA)
        _epilogue(g01, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0 + BLOCK_K // 4, BLOCK_N, BLOCK_K // 4,
               EVEN_NK, STORE_GRAD, TMA)
        g10, g11 = _halves(g1, BLOCK_N, BLOCK_K // 2)
        _epilogue(g10, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0 + BLOCK_K // 2, BLOCK_N, BLOCK_K // 4,
               EVEN_NK, STORE_GRAD, TMA)
        _epilogue(g11, W, {state_ptrs}GOUT, {scalar_params}EKEY, N, K, row0, col0 + 3 * (BLOCK_K // 4), BLOCK_N,
               BLOCK_K // 4, EVEN_NK, STORE_GRAD, TMA)
'''


def _pipe_vars(c, states):
    return [f"lp{c}", *(f"l{s}{c}" for s in states), f"loff{c}", f"lmask{c}"]


def _pipe_load(c, states, ptrs, indent):
    col = "col0" if c == 0 else f"col0 + {c} * (BLOCK_K // EPI_SPLIT)"
    return (" " * indent + ", ".join(_pipe_vars(c, states)) + f" = _load_chunk(W, {''.join(p + ', ' for p in ptrs)}"
            f"N, K, row0, {col}, BLOCK_N, BLOCK_K // EPI_SPLIT, EVEN_NK)")


def _pipe_body(n_split, states, ptrs, n_scalars):
    scal = "".join(f"c{i}, " for i in range(n_scalars))
    lines = []
    for c in range(n_split):
        if c + 1 < n_split:
            lines.append(_pipe_load(c + 1, states, ptrs, 12))
        p, *st, off, mask = _pipe_vars(c, states)
        lines.append(f"            _apply(q{c}, {p}, {''.join(v + ', ' for v in st)}W, {''.join(q + ', ' for q in ptrs)}GOUT, "
                     f"{scal}EKEY, {off}, {mask}, BLOCK_N, BLOCK_K // EPI_SPLIT, EVEN_NK, STORE_GRAD)")
    return "\n".join(lines)


def render_kernel_source(ep: Epilogue, table: bool = False) -> str:
    """The kernel module for one rule's epilogue; ``table``: the rule scalars are read from a device pointer
    ``SCAL`` (epilogue_codegen.scalar_fields) instead of taken as arguments."""
    states = ep.tensor_inputs[2:]
    ptrs = [s.upper() for s in states]
    new_vars = [f"new_{v}" for v in ("p", *states)]
    return _TEMPLATE.format(
        **triton_fields(ep, table, "SCAL"), module="wgrad_update_triton",
        # TKEY (a rounded weight's launch with a table, ekey=TABLE_KEY): the key from the row, after the scalars
        key_load=("    if TKEY:\n" + key_load("SCAL", ep.n_kernel_scalars, "tl", " " * 8)) if table else "",
        state_stores="\n".join(f"    _st_as({p} + off, {v}, mask, EVEN)" for p, v in zip(ptrs, new_vars[1:])),
        state_loads="\n".join(f"    {s} = _ld({p} + off, mask, EVEN).to(tl.float32)" for s, p in zip(states, ptrs)),
        prefetch_loads="\n".join(f"            pf_{s} = _ld({p} + poff, pmask, EVEN_NK).to(tl.float32)" for s, p in zip(states, ptrs)),
        prefetch_vars="".join(f"pf_{s}, " for s in states),
        pipe_load0=_pipe_load(0, states, ptrs, 8),
        pipe_load0_late=_pipe_load(0, states, ptrs, 12),
        pipe_body2=_pipe_body(2, states, ptrs, ep.n_kernel_scalars),
        pipe_body4=_pipe_body(4, states, ptrs, ep.n_kernel_scalars),
        prefetch_loads_tma="\n".join(f"            pf_{s} = {p}.load([row0, col0])" for s, p in zip(states, ptrs)),
        tma_loads="\n".join(f"    {s} = {p}.load([row0, col0])" for s, p in zip(states, ptrs)),
        tma_stores="\n".join(f"    {p}.store([row0, col0], {v})" for p, v in zip(ptrs, new_vars[1:])),
        tma_pf_stores="\n".join(f"            {p}.store([row0, col0], {v})" for p, v in zip(ptrs, new_vars[1:])),
        cast_body=_CAST_BODY[ep.target],
    )


_CAST_BODY = {
    "cuda": '    return x.to(dtype, fp_downcast_rounding="rtne")',
    # the interpreter truncates fp32 -> bf16 (and its "rtne" rounds ties away from zero): the rounding on the
    # bits, NaN kept; fp32 -> fp16 is numpy's cast there, which rounds to nearest even
    "interpret": """\
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        y = tl.where(x != x, x.to(tl.bfloat16), (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))
    else:
        y = x.to(dtype)
    return y""",
}


_KERNELS: dict[tuple[str, str, bool], tuple[Epilogue, object]] = {}
_KLOCK = threading.Lock()


def _kernel_for(rule: Rule, target: str, table: bool = False):
    # cached: rendering + hashing the source costs tens of microseconds, every launch would pay it
    key = (rule.name, target, table)
    hit = _KERNELS.get(key)
    if hit is None:
        ep = compile_epilogue(rule, target)
        mod = load_kernel_module(render_kernel_source(ep, table), ep.source_key + ("_table" if table else ""))
        hit = (ep, mod.wgrad_update_kernel)
        with _KLOCK:
            _KERNELS.setdefault(key, hit)
    return hit


# ----------------------------------------------------------------------------------------------------
# host part of the rule, cached


_HOST_CACHE_SIZE = 1024
_HOST_CACHE: dict[str, collections.OrderedDict] = {}
_HLOCK = threading.Lock()


def _values_key(ins) -> tuple:
    # one call per fused launch, so kept to plain .item() values (was float.hex per value: ~2x the host time);
    # -0.0 == 0.0 with equal hashes, so where a zero occurs the signs join the key (the update is bitwise)
    vals = tuple([t.item() for t in ins])
    key = (vals, tuple([t.dtype for t in ins]))
    if 0 in vals:
        key += (tuple([math.copysign(1.0, v) for v in vals]),)
    return key


def host_scalars(ep: Epilogue, scalar_states, hparams):
    """``ep.run_host`` memoized on the VALUES of the scalar states and hparams: (kernel scalars as Python
    floats, new scalar-state values as Python numbers).

    The fx host graph is ~15 0-dim torch ops (tens of microseconds); a model with many linears sharing one
    step counter and one set of hparams pays it once per step this way. The new scalar states are kept as
    numbers, never as tensors: the host graph may return an input tensor itself (an unchanged state), which
    the caller mutates afterwards. Only CPU 0-dim tensors are memoized (``.item()`` of a CUDA tensor syncs).
    """
    ins = (*scalar_states, *hparams)
    if not all(isinstance(t, torch.Tensor) and t.is_cpu and t.dim() == 0 for t in ins):
        ks, new = ep.run_host(scalar_states, hparams)
        return ks, [n.item() if isinstance(n, torch.Tensor) else n for n in new]
    key = _values_key(ins)
    cache = _HOST_CACHE.get(ep.source_key)
    if cache is None:
        with _HLOCK:
            cache = _HOST_CACHE.setdefault(ep.source_key, collections.OrderedDict())
    hit = cache.get(key)
    if hit is not None:
        return hit
    ks, new = ep.run_host(scalar_states, hparams)
    hit = (ks, [n.item() if isinstance(n, torch.Tensor) else n for n in new])
    with _HLOCK:
        cache[key] = hit
        if len(cache) > _HOST_CACHE_SIZE:
            cache.popitem(last=False)
    return hit


# ----------------------------------------------------------------------------------------------------
# launcher


@dataclasses.dataclass(frozen=True)
class Config:
    bn: int                 # BLOCK_N (rows of dW per program)
    bk: int                 # BLOCK_K (cols of dW per program)
    bm: int                 # BLOCK_M (tokens per loop step)
    group: int              # GROUP_N
    warps: int
    stages: int
    split: int = 1          # EPI_SPLIT
    prefetch: bool = False  # PREFETCH
    tma: bool = False       # W/states through TMA descriptors (where strides/alignment allow)
    pipe: int = 0           # PIPE (pointer path, split > 1): 1 = chunk c+1 loaded before chunk c's math,
                            # 2 = and chunk 0 loaded before the token loop
    maxnreg: int | None = None
    fp32_dot: str = "tf32"  # fp32 activations where torch allows TF32: "tf32", or "bf16x3" (each fp32 operand as two
                            # bf16 halves, three bf16 MMAs: ~16 mantissa bits, also within torch's "high")


CONFIGS: dict[str, Config] = {
    "interp": Config(32, 32, 32, 8, 4, 1),
    # interpreter variants of the knobs (tests)
    "interp_e2": Config(32, 32, 32, 8, 4, 1, split=2),
    "interp_e4": Config(32, 64, 32, 8, 4, 1, split=4),
    "interp_pf": Config(32, 32, 32, 8, 4, 1, prefetch=True),
    "interp_tma": Config(32, 32, 32, 8, 4, 1, tma=True),
    "interp_tma_e2": Config(32, 64, 32, 8, 4, 1, split=2, tma=True),
    "interp_tma_pf": Config(32, 32, 32, 8, 4, 1, prefetch=True, tma=True),
    "interp_p1e2": Config(32, 64, 32, 8, 4, 1, split=2, pipe=1),
    "interp_p2e4": Config(32, 64, 32, 8, 4, 1, split=4, pipe=2),
    # v1 defaults (RESULTS.md runs 1-3), kept for comparison
    "s64m128": Config(64, 64, 128, 8, 4, 3),
    "l64x256": Config(64, 256, 64, 8, 8, 4),
    # v2 (H200 runs 4-5 of RESULTS.md; the losers of those sweeps are listed in NOTES_kernel.md, not here)
    "t64w8s2": Config(64, 64, 64, 8, 8, 2, tma=True),
    "t64m128": Config(64, 64, 128, 8, 4, 3, tma=True),
    "t64x128": Config(64, 128, 64, 8, 4, 4, tma=True),
    "m128e4": Config(128, 128, 64, 8, 8, 3, split=4),
    "l64x256e4": Config(64, 256, 64, 8, 8, 4, split=4),
    "t128e4": Config(128, 128, 64, 8, 8, 3, split=4, tma=True),
    "t128x256e4": Config(128, 256, 64, 8, 8, 3, split=4, tma=True),
    "tf64m32": Config(64, 64, 32, 8, 4, 3, tma=True),       # fp32 activations (IEEE FMA dot)
    # fp32 activations with TF32 allowed (tensor-core dot on fp32 operands: twice the smem per stage of bf16,
    # hence 32-token stages). H200: the tf32 dots are no faster than IEEE FMA (MN-major fp32 operands), the
    # bf16x3 ones 1.1-2x faster (bx3_128 picked); all slower than cuBLAS TF32 + fused AdamW (RESULTS.md)
    "tf32_128": Config(128, 128, 32, 8, 8, 3, split=4, tma=True),
    "tf32_64x256": Config(64, 256, 32, 8, 8, 3, split=4),
    "tf32_64x128": Config(64, 128, 32, 8, 4, 4, tma=True),
    "bx3_128": Config(128, 128, 32, 8, 8, 3, split=4, tma=True, fp32_dot="bf16x3"),
    "bx3_64x256": Config(64, 256, 32, 8, 8, 3, split=4, fp32_dot="bf16x3"),
    # fp32 activations, IEEE: larger FMA tiles than tf64m32 (more outputs per thread per operand load), candidates
    # for the next H200 sweep (bench --cases tf32), not picked
    "f128x128": Config(128, 128, 16, 8, 8, 4, split=4, tma=True),
    "f64x128": Config(64, 128, 32, 8, 8, 3, tma=True),
    # v3: software-pipelined split epilogue (pointer path)
    "l64x256e4p1": Config(64, 256, 64, 8, 8, 4, split=4, pipe=1),
    "l64x256e4p2": Config(64, 256, 64, 8, 8, 4, split=4, pipe=2),
}


def pick_config(n: int, k: int, m: int, interpret: bool, upcast: bool = False, tf32: bool = False) -> str:
    """Config by shape bucket; M only enters as a bucket, so a new batch size never retunes.

    Table from the H200 sweeps in benchmarks/RESULTS.md (fp32 states; bf16 or fp32 activations). ``tf32``: fp32
    activations whose dot runs in TF32 (``fp32_dot_precision``).
    """
    if interpret:
        return "interp"
    if upcast:
        # H200 (RESULTS.md "fp32 activations under TF32"): the bf16x3 dot 1.1-2x faster than the TF32 one
        return "bx3_128" if tf32 else "tf64m32"
    # H200 run 5 (RESULTS.md): 64x256 tiles with the epilogue in four 64x64 chunks (few L2 re-reads of dY/X,
    # no spills), software-pipelined (next chunk's W/states loaded before this chunk's math; chunk 0 before
    # the token loop) up to M=1024, plain chunks at M=2048; 128x128 TMA tiles (2 programs per SM) above.
    if m <= 1024:
        return "l64x256e4p2"
    if m <= 2048:
        return "l64x256e4"
    return "t128e4"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fp32_dot_precision(dy_t, x) -> str:
    """The precision of the GEMM on fp32 (or mixed, upcast) activations on the GPU: the one torch.mm takes for an
    fp32 matmul there, so the fused step is the unfused step's function -- "tf32" (tensor cores, 10-bit
    mantissa inputs) where torch allows TF32 for fp32 matmuls (``torch.backends.cuda.matmul.allow_tf32``, which
    ``torch.set_float32_matmul_precision("high")`` sets), else "ieee". "" where the dot takes the activations as
    they are (one non-fp32 dtype: bf16/fp16), i.e. no upcast -- so ``!= ""`` is the launch's upcast test. Read at
    every launch (it is part of the launch memo's and autotune's keys), as cuBLAS reads it."""
    if not (dy_t.dtype == torch.float32 or x.dtype == torch.float32 or dy_t.dtype != x.dtype):
        return ""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


_TF32_WARNED: list[bool] = []


def _warn_tf32_once() -> None:
    # the fused step is exact but SLOW in this regime; users choosing TF32 chose speed, so say it once
    if not _TF32_WARNED:
        _TF32_WARNED.append(True)
        log.warning("forge: fp32 activations with TF32 allowed, on the Triton kernel (the Gluon TF32 path needs "
                    "sm_90, M a multiple of 4 and FORGE_GLUON_TF32 not 0): its GEMM runs at TF32-or-better "
                    "precision (bf16x3) as torch's 'high' allows, but measured 0.40-0.58x of cuBLAS TF32 + "
                    "torch's fused AdamW on the H200 (4096x4096, benchmarks/RESULTS.md); bf16 autocast is the "
                    "regime where fusion is faster")


# The kernels' optional side output ``side_out``, an [N, K] contiguous tensor on the weight's device: fp32 receives
# the dW the update consumed (tests and exactness checks), bf16/fp16 the updated weight cast to that dtype -- the
# low-precision copy the next forward's matmuls read under autocast (compile_train_step(cast_weights_in_update=True))
# written from the registers that hold the new W anyway, instead of a separate cast kernel reading W again.
SIDE_NONE, SIDE_GRAD, SIDE_CAST = 0, 1, 2
_CAST_DTYPES = (torch.bfloat16, torch.float16)


def side_mode(side_out) -> int:
    if side_out is None:
        return SIDE_NONE
    return SIDE_CAST if side_out.dtype in _CAST_DTYPES else SIDE_GRAD


def check_side_out(side_out, weight) -> None:
    if side_out is None:
        return
    if (side_out.dtype not in (torch.float32, *_CAST_DTYPES) or not side_out.is_contiguous()
            or side_out.shape != weight.shape or side_out.device != weight.device):
        raise ValueError("forge: side_out must be a contiguous [N, K] tensor on the weight's device: fp32 (dW) or "
                         "bf16/fp16 (the updated weight's copy)")


def split_states(rule: Rule, states, table=None):
    """(tensor states, scalar states) of a launch: ``states`` in the rule's order, or -- a launch reading its
    scalars from a ``table`` row -- the tensor states alone (the caller keeps the scalar states)."""
    if table is not None:
        n_tensor = sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i))
        if len(states) != n_tensor:
            raise ValueError(f"forge: rule {rule.name!r} with a scalar table takes its {n_tensor} tensor states, "
                             f"got {len(states)}")
        return list(states), []
    return ([s for i, s in enumerate(states) if not rule.is_scalar_state(i)],
            [s for i, s in enumerate(states) if rule.is_scalar_state(i)])


def check_table(ep: Epilogue, table: torch.Tensor, weight: torch.Tensor, key: bool = False) -> None:
    """A scalar-table row must hold the rule's kernel scalars as fp32 on the weight's device (first in the row: a
    table shared by several rules is as wide as the widest); ``key``: and a rounded weight's element key after
    them (stochastic_round.table_row)."""
    n = ep.n_kernel_scalars + bool(key)
    if (not isinstance(table, torch.Tensor) or table.dtype != torch.float32 or table.dim() != 1
            or table.numel() < n or table.stride(0) != 1 or table.device != weight.device):
        got = (f"{table.dtype} {list(table.shape)} on {table.device}" if isinstance(table, torch.Tensor)
               else type(table).__name__)
        raise ValueError(f"forge: rule {ep.rule_name!r} reads {ep.n_kernel_scalars} fp32 scalars"
                         f"{' and the round key' if key else ''} from a contiguous 1-D tensor on {weight.device} "
                         f"(rule_scalars(), stochastic_round.table_row), got {got}")


def _prepare(weight, dy_t, x, states, hparams, rule: Rule, side_out, config, table=None, extra=None, ekey=None):
    """Checks, host scalars, config: everything of a launch except the launch and the scalar-state update.
    ``table``: the rule's scalars are read from this device row (``states`` = the tensor states; no scalar
    states to advance). ``ekey``: a bf16 weight's stochastic-rounding key (check_low_precision)."""
    n, k = weight.shape
    m = x.shape[0]
    interpret = not weight.is_cuda
    if interpret and not _interpreting():
        raise RuntimeError("forge: the Triton kernel runs on CPU tensors only with TRITON_INTERPRET=1")
    target = "interpret" if interpret else "cuda"
    ep, kernel = _kernel_for(rule, target, table is not None)

    tensor_states, scalar_states = split_states(rule, states, table)
    check_low_precision(weight, tensor_states, side_out, ekey)
    check_side_out(side_out, weight)
    if table is None:
        scalars, new_scalar_states = host_scalars(ep, scalar_states, hparams)
    else:
        check_table(ep, table, weight, ekey is TABLE_KEY)
        scalars, new_scalar_states = [table], []
    if ekey is TABLE_KEY and table is None:
        raise ValueError("forge: ekey=TABLE_KEY reads the round key from a scalar table row: pass table=")

    if m == 0:
        # the GEMM is empty: dW = 0, the rule still runs (weight decay, moment decay)
        dy_t = torch.zeros((n, 1), dtype=dy_t.dtype, device=dy_t.device)
        x = torch.zeros((1, k), dtype=x.dtype, device=x.device)
        m = 1

    prec = fp32_dot_precision(dy_t, x)
    upcast = interpret or prec != ""
    # the interpreter's dot is numpy's fp32 matmul whatever the precision: IEEE is what it computes
    tf32 = not interpret and prec == "tf32"
    if tf32:
        _warn_tf32_once()
    cfg = CONFIGS[config or pick_config(n, k, m, interpret, upcast, tf32)]
    grid, args, opts = launch_spec(cfg, weight, dy_t, x, tensor_states, side_out, scalars, upcast, interpret, tf32,
                                   extra, ekey)
    return kernel, grid, args, opts, scalar_states, new_scalar_states


def check_low_precision(weight, tensor_states, side_out, ekey) -> None:
    """fp32 weights with fp32 states, or -- stochastic rounding, ``ekey`` given (stochastic_round.element_key) -- a
    bf16 weight with bf16 or fp32 states: loaded into fp32, updated there, the weight stored stochastically rounded,
    bf16 states rounded to nearest even. All contiguous [N, K]."""
    sr = weight.dtype == torch.bfloat16
    if sr != (ekey is not None):
        raise ValueError("forge: a bf16 weight is updated with stochastic rounding and needs its key (ekey=); an "
                         f"fp32 weight takes none (got a {weight.dtype} weight, ekey={ekey!r})")
    ok = (torch.bfloat16, torch.float32) if sr else (torch.float32,)
    for s in (weight, *tensor_states):
        if s.dtype not in ok or not s.is_contiguous() or s.shape != weight.shape:
            raise ValueError("forge: weight and tensor states must be contiguous [N, K] tensors, fp32 -- or a bf16 "
                             "weight (stochastic rounding) with bf16/fp32 states")
    if sr and side_out is not None and side_out.dtype != torch.float32:
        raise ValueError("forge: a bf16 weight has no low-precision copy to write (side_out must be fp32 dW)")


def launch_spec(cfg: Config, weight, dy_t, x, tensor_states, side_out, scalars, upcast: bool, interpret: bool,
                tf32: bool = False, extra=None, ekey=None):
    """grid, positional args and keyword options of one kernel launch (``tf32``: the upcast dot in TF32; ``extra``:
    (rows, pos) added to dW, see launch_wgrad_update)."""
    n, k = weight.shape
    m = x.shape[0]
    grid = (triton_cdiv(n, cfg.bn) * triton_cdiv(k, cfg.bk),)
    gout = side_out if side_out is not None else weight
    epi = [weight, *tensor_states, gout]
    mode = side_mode(side_out)
    # TMA: 16-byte aligned bases and row strides (k % 4 for fp32); otherwise the pointer epilogue, which also
    # writes the cast copy (its store converts in registers; a TMA store would need a second smem tile)
    # bf16 weights/states (stochastic rounding) take the pointer epilogue too: its loads convert to fp32 and its
    # stores round, in registers
    tma = (cfg.tma and mode != SIDE_CAST and k % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in epi)
           and all(t.dtype == torch.float32 for t in epi))
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        block = [cfg.bn, cfg.bk // (1 if cfg.prefetch else cfg.split)]
        epi = [TensorDescriptor(t, [n, k], [k, 1], block) for t in epi]
    erows, epos = extra if extra is not None else (weight, weight)
    tkey = ekey is TABLE_KEY
    args = (epi[0], dy_t, x, *epi[1:-1], epi[-1], erows, epos, 0 if ekey is None or tkey else ekey,
            *scalars, n, k, m, dy_t.stride(0), dy_t.stride(1), x.stride(0), x.stride(1))
    opts = dict(
        BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, BLOCK_M=cfg.bm, GROUP_N=cfg.group,
        EVEN_M=(m % cfg.bm == 0), EVEN_NK=(n % cfg.bn == 0 and k % cfg.bk == 0), UPCAST=upcast,
        DOT_PREC=cfg.fp32_dot if tf32 else "ieee", STORE_GRAD=mode, EPI_SPLIT=cfg.split, PREFETCH=cfg.prefetch, TMA=tma,
        PIPE=0 if tma else cfg.pipe, EXTRA=extra is not None, TKEY=tkey,
        num_warps=cfg.warps, num_stages=cfg.stages,
        # no FMA contraction: the epilogue spells out the FMAs that eager torch's kernels contain
        enable_fp_fusion=False,
    )
    if cfg.maxnreg is not None and not interpret:
        opts["maxnreg"] = cfg.maxnreg
    return grid, args, opts


def bound_launch(weight, dy_t, x, states, hparams, rule: Rule, side_out=None, *, config: str | None = None,
                 table=None, ekey=None):
    """(benchmarks) A zero-argument callable that launches the kernel alone, host part done once; it
    returns the CompiledKernel (``.n_regs``, ``.n_spills``). Scalar states are NOT advanced by it."""
    kernel, grid, args, opts, _, _ = _prepare(weight, dy_t, x, states, hparams, rule, side_out, config, table,
                                              ekey=ekey)
    return lambda: kernel[grid](*args, **opts)


# Whether a stochastically rounded Gluon launch goes through launch_memo (the round key a per-launch argument,
# launch_memo.remember(nvar=1)): GPU-run in stop 37 (H100: the memo test bitwise the spec over four keys; host 46-50 us
# per call in bench_stochastic_round vs 128-274 us on the full path). A list, as launch_memo.ENABLED: tests flip it.
SR_MEMO = [True]


def launch_wgrad_update(weight, dy_t, x, states, hparams, rule: Rule, side_out=None, *, config: str | None = None,
                        table=None, extra=None, ekey=None):
    """weight [N, K] fp32 contiguous; dy_t [N, M], x [M, K] any strides; updates weight/states in place.

    On sm_90 the launch may go to the Gluon kernel (wgrad_update_gluon.use_gluon; FORGE_WGRAD_KERNEL=auto|gluon|
    triton); a ``config`` names a Triton config and keeps it on this kernel. With FORGE_AUTOTUNE=1 the kernel and
    its config are the tuned choice for the shape and token-count bucket (wgrad_update_autotune). A launch whose
    tensors (pointers, shapes, strides, dtypes) repeat an earlier one's reuses its prepared launch (launch_memo).

    ``table``: the kernel reads the rule's scalars from this fp32 row on the weight's device (``rule_scalars``
    gives its values) instead of computing them from scalar states and hyper-parameters on the host; ``states``
    are then the tensor states alone and ``hparams`` is empty. Nothing of such a launch depends on the step, so it
    can be captured in a CUDA graph and replayed with new values in the row. FORGE_AUTOTUNE applies to it as to
    the host-scalar launch of the same shape (one key, one choice), except that nothing is tuned during a
    capture (a key first seen there takes the untuned choice).

    ``extra``: (rows, pos) -- row r of dW gains ``rows[pos[r]]`` where pos[r] >= 0 (a tied embedding's gradient,
    embedding_update.compact_rows; rows [*, K] float, pos [N] int32). Such a launch takes this kernel with its table
    config -- or, with FORGE_GLUON_EXTRA=1, the Gluon smem/split kernel -- and is neither tuned nor memoized (rows
    and pos are new tensors at every step).

    ``ekey``: a bf16 weight, updated in fp32 and stored stochastically rounded with this key
    (stochastic_round.element_key; bf16 or fp32 states) -- or, with a ``table``, ``stochastic_round.TABLE_KEY``:
    the key is the row's word after the scalars (stochastic_round.table_row), so a CUDA graph can capture the
    launch. On sm_90 such a launch takes the Gluon smem/split kernel where gluon_reason allows it (bf16
    activations, no tied rows; without a table and with SR_MEMO remembered by launch_memo, the key passed at every
    launch), else this kernel's pointer epilogue with its table config, not memoized; never tuned."""
    if table is not None and len(hparams):
        raise ValueError("forge: a launch with a scalar table takes no hyper-parameters (they are in the table)")
    memo_key = None
    if ekey is not None or weight.dtype != torch.float32:
        if ekey is not None and config is None and weight.is_cuda:
            from . import launch_memo
            from . import wgrad_update_gluon as wg

            # SR_MEMO: the Gluon launch remembered like an fp32 one, the key passed at every launch after the
            # scalars (host: ~130-270 us per full Gluon launch on an H100 host, stop 36); the Triton SR kernel takes
            # the key before its scalars and is not remembered
            if SR_MEMO[0] and launch_memo.ENABLED[0] and x.shape[0] > 0 and table is None and extra is None:
                kind = ("rounded", wg._mode(), wg.AUTO_GLUON, wg._broken_key(rule, True) in wg._BROKEN)
                memo_key = launch_memo.launch_key(kind, rule, weight, dy_t, x, states, side_out)
                if launch_memo.lookup(memo_key, states, hparams, (int(ekey),)):
                    return
            if wg.try_launch(weight, dy_t, x, states, hparams, rule, side_out, table=table, extra=extra, ekey=ekey):
                if memo_key is not None:
                    launch_memo.remember(memo_key, rule, lambda: wg._prepare(weight, dy_t, x, states, hparams, rule,
                                                                             side_out, ekey=ekey),
                                         wg._source_for(rule)[0], states, hparams, _scalar_idx(rule, states), nvar=1)
                return
        kernel, grid, args, opts, scalar_states, new_scalar_states = _prepare(
            weight, dy_t, x, states, hparams, rule, side_out, config, table, extra, ekey)
        kernel[grid](*args, **opts)
        with torch.no_grad():
            for s, new in zip(scalar_states, new_scalar_states):
                s.fill_(new)
        return
    if extra is not None and config is None and weight.is_cuda:
        from . import wgrad_update_gluon as wg

        if wg.try_launch(weight, dy_t, x, states, hparams, rule, side_out, table=table, extra=extra):
            return
    if config is None and weight.is_cuda and extra is None:
        # imported here: the Gluon module is only needed (and gluon only imported) on a CUDA launch
        from . import launch_memo
        from . import wgrad_update_autotune as autotune
        from . import wgrad_update_gluon as wg

        tuned = autotune.enabled()
        kcopies = base_key = None
        if launch_memo.ENABLED[0] and x.shape[0] > 0:   # M == 0 launches on temporaries (see _prepare)
            # the kind: everything of the kernel choice that is not in the tensors' properties
            kind = (wg._mode(), wg.AUTO_GLUON, rule.name in wg._BROKEN, tuned, table is not None,
                    fp32_dot_precision(dy_t, x), x.dtype == torch.float32 and wg.tf32_enabled())
            memo_states = states if table is None else (*states, table)
            memo_key = launch_memo.launch_key(kind, rule, weight, dy_t, x, memo_states, side_out)
            if (kind[-1] and kind[-2] == "tf32" and not launch_memo.unused(memo_key)
                    and wg.kcopies_wanted(weight, dy_t, x)):
                # fp32 under TF32 (the Gluon kernel on K-major copies): the copies are made here, before the
                # lookup, and their addresses join the key -- a remembered launch's descriptors address them.
                # Without this every such launch took the full path (host-bound end to end: 0.69x, 2026-12-06)
                kcopies = wg.kmajor_copies(dy_t, x)
                base_key, memo_key = memo_key, (memo_key, kcopies[0].data_ptr(), kcopies[1].data_ptr())
            if launch_memo.lookup(memo_key, states, hparams):
                return
        choice = autotune.choose(weight, dy_t, x, states, hparams, rule, side_out, table) if tuned else None
        gcfg = None
        if choice is not None and choice.family == "gluon":
            gcfg = choice.config
            try:
                wg.launch(weight, dy_t, x, states, hparams, rule, side_out, config=gcfg, table=table,
                          kcopies=kcopies)
                ran_gluon = True
            except Exception as e:  # a choice from the cache file that does not build here: the untuned path
                autotune.forget(weight, dy_t, x, states, rule, side_out, why=e, table=table)
                gcfg = None
                ran_gluon = wg.try_launch(weight, dy_t, x, states, hparams, rule, side_out, table=table,
                                          kcopies=kcopies)
        elif choice is not None:
            ran_gluon, config = False, choice.config
        else:
            ran_gluon = wg.try_launch(weight, dy_t, x, states, hparams, rule, side_out, table=table,
                                      kcopies=kcopies)
        if ran_gluon:
            # an fp32 (TF32) launch is remembered only with the copies it read (its key has their addresses)
            if memo_key is not None and (x.dtype != torch.float32 or kcopies is not None):
                dyk, xk = kcopies if kcopies is not None else (None, None)
                _remember(memo_key, rule, lambda: wg._prepare(weight, dy_t, x, states, hparams, rule, side_out,
                                                              config=gcfg, table=table, xk=xk, dyk=dyk),
                          wg._source_for(rule)[0], states, hparams, table)
            return
        if kcopies is not None:
            # the copies were made for nothing (Gluon refused the launch, or the tuned choice is Triton): not again
            # for this key; the Triton launch below is remembered under the key without copy addresses
            launch_memo.mark_unused(base_key)
            memo_key = base_key
    kernel, grid, args, opts, scalar_states, new_scalar_states = _prepare(
        weight, dy_t, x, states, hparams, rule, side_out, config, table, extra)
    kernel[grid](*args, **opts)
    # the scalar states advance once per launch, after the kernel consumed their old values
    with torch.no_grad():
        for s, new in zip(scalar_states, new_scalar_states):
            s.fill_(new)
    if memo_key is not None:
        _remember(memo_key, rule, lambda: _prepare(weight, dy_t, x, states, hparams, rule, side_out, config, table),
                  _kernel_for(rule, "cuda")[0], states, hparams, table)


def rule_scalars(rule: Rule, scalar_states, hparams, target: str = "cuda"):
    """The values a scalar-table row holds for one launch of ``rule`` (``launch_wgrad_update(table=...)``), as
    the host computes them for a launch without a table -- bitwise the same kernel arguments -- and the scalar
    states' values after that launch: ``(list of floats, list of numbers)``. Advancing the scalar states is
    the caller's part then."""
    return host_scalars(compile_epilogue(rule, target), list(scalar_states), list(hparams))


def _remember(memo_key, rule: Rule, prepare, ep: Epilogue, states, hparams, table) -> None:
    from . import launch_memo

    if table is not None:   # launch_memo computes host scalars from ``ep`` at every hit; a table launch has none
        launch_memo.remember(memo_key, rule, prepare, None, states, hparams, [])
    else:
        launch_memo.remember(memo_key, rule, prepare, ep, states, hparams, _scalar_idx(rule, states))


def tune_candidates(n: int, k: int, m: int, upcast: bool, tf32: bool = False) -> list[str]:
    """Configs worth timing for a launch (wgrad_update_autotune): the table's pick first, then the other winners
    of the H200 sweeps (benchmarks/RESULTS.md runs 4-5; the losers of those sweeps are not worth compiling)."""
    if upcast and tf32:
        return ["bx3_128", "bx3_64x256", "tf32_128"]
    if upcast:
        return ["tf64m32"]
    names = [pick_config(n, k, m, False), "l64x256e4p2", "l64x256e4", "t128e4", "t64x128"]
    return list(dict.fromkeys(names))


def _scalar_idx(rule: Rule, states) -> list[int]:
    return [i for i in range(len(states)) if rule.is_scalar_state(i)]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
