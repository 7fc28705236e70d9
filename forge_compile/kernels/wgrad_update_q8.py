"""The fused update with 8-bit block-wise optimizer states: the weight-gradient GEMM whose epilogue reads each tensor
state as e4m3 codes times per-128-element scales (kernels/q8_state.py is the format's spec), runs the rule in fp32
and stores the new states quantized again, stochastically rounded (roadmap: "8-bit block-wise optimizer states
inside the same epilogue"). Used by forge.optim.AdamW8bit's eager step (the stored-dW update, also the op
forge::apply_rule_q8_ that compile_train_step emits for it) and by forge::wgrad_update_q8_, into which the pattern
pass fuses that op with its weight gradient's matmul.

Why: from M = 2048 tokens on, the fp32 fused step's cost is moving W, m and v -- 24 bytes per element for AdamW,
which under the H100/H200 power cap costs a constant ~0.09 ms per 4096x4096 weight whatever the schedule
(benchmarks/RESULTS.md, "Where each target of issue 5 stands"). 8-bit m and v make it 8 + 2 x (2 + 8/128) bytes
(fp32 W) or 4 + ... (bf16 W, stochastic rounding): fewer bytes is the lever a schedule is not.

Spec (``reference_wgrad_update_q8``, plain torch; tests compare the kernel to it bitwise):
    dW = dy_t.float() @ x.float()                 (or ``grad``: the unfused update of a stored dW, FROM_GRAD)
    q8_state.reference_q8_update(rule, weight, dW, states, hparams, key, salt)
i.e. each tensor state dequantized (codes x scale, one fp32 product), the rule on fp32 tiles as the unfused update
computes it (epilogue_codegen: op for op), each new tensor state quantized with the bits of
``state_element_key(key, salt, i)`` (i: its index in ``rule.states``), a bf16 weight stored stochastically rounded
with ``element_key(key, salt)`` as forge::wgrad_update_rounded_ does. ``key`` is the step's (round_key(seed,
counter)): a new one per step, else the same bits round every step the same way.

Arguments: weight [N, K] fp32 or bf16 contiguous; dy_t [N, M], x [M, K] (any strides, bf16/fp16/fp32); states in
``rule.states`` order, a tensor state as a (codes, scales) pair -- codes float8_e4m3fn [N, K] contiguous, scales fp32
[N, ceil(K / 128)] contiguous --, a scalar state (Adam's step) a 0-dim fp32 CPU tensor; hparams 0-dim float64 CPU
tensors. All updated in place.

Scalar table (``table=``, the forge::*_q8_table_ ops): the kernel reads every value that changes per step from one
fp32 row on the weight's device instead of taking it as a launch argument, so a CUDA graph that captured the launches
replays them with whatever the row holds (passes/scalar_table.py rewrites the row before each replay). The row
(``table_row``; ``table_width`` words at least -- a table shared by several rules is as wide as the widest):
    words 0 .. n-1      the rule's kernel scalars (wgrad_update_triton.rule_scalars for the kernel's target,
                        n = its epilogue's n_kernel_scalars)
    word n              the bf16 weight's element key (0, unused, for an fp32 weight)
    words n+1 .. n+t    each tensor state's key, in the rule's order of its tensor states
keys as their int32 bit patterns (``row_keys``: the host launch's keys). Such a launch is bitwise the host-scalar
launch of the same scalar states, hparams and keys; it takes the tensor states alone and advances nothing (whoever
fills the row advances the scalar states).

Tiles: BLOCK_K is a multiple of 128 (the column chunk of the epilogue, BLOCK_K / EPI_SPLIT, too) so every tile holds
whole blocks of each row and a block's new absmax is a reduction inside the program. This is the first version:
the plain Triton schedule (GEMM loop, then the epilogue), no TMA and no warp specialization. Measured (H100, stop 42,
benchmarks/RESULTS.md "8-bit block-wise states"; bench_wgrad_update_q8.py): bitwise the spec on CUDA, but the fused
AdamW step is SLOWER than the unfused 8-bit step (cuBLAS + this kernel's FROM_GRAD update, 0.50-0.75x) and than
forge's fused fp32 step (0.45-0.80x): the epilogue, serialized after the GEMM with the accumulator live, runs
register-bound. The FROM_GRAD update alone streams well (the unfused 8-bit step 1.42x the unfused fp32 step at
M = 256). The fused 8-bit step's road is the Gluon kernel's epilogue warpgroups, not this schedule.
"""
from __future__ import annotations

import dataclasses
import os
import threading

import torch

from .. import _compat
from ..optim.rule import Rule, get_rule
from . import q8_state
from .epilogue_codegen import Epilogue, compile_epilogue, key_load, load_kernel_module, triton_fields, TRITON_RULE_HEAD
from .stochastic_round import TRITON_SROUND, element_key
from .wgrad_norm import SQNORM_BLOCK_BYTES, _mm_fp32
from .wgrad_update import _check_shapes
from .wgrad_update_cpu import _CPU_BLOCK_BYTES
from .wgrad_update_triton import TRITON_DW_TILE

__all__ = ["reference_wgrad_update_q8", "wgrad_update_q8", "launch_wgrad_update_q8", "wgrad_update_q8_blocked",
           "gluon_wanted", "take_gluon", "use_blocked", "dw_block_bytes", "block_rows", "wgrad_update_q8_cpu",
           "embedding_block_grad", "as_rows", "update_from_grad",
           "empty_q8_state", "Q8Config", "CONFIGS", "pick_config", "render_kernel_source", "table_width", "row_keys",
           "table_row", "check_q8_table"]


def reference_wgrad_update_q8(weight, dy_t, x, states, hparams, rule: str, key: int, salt: int, grad=None):
    """Plain-torch spec: dW materialized (or ``grad``), q8_state.reference_q8_update in place; a tensor state is a
    mutable [codes, scales] list whose items are replaced. Returns dW (tests only)."""
    g = grad.float() if grad is not None else dy_t.float() @ x.float()
    with torch.no_grad():
        q8_state.reference_q8_update(get_rule(rule), weight, g, states, hparams, key, salt)
    return g


def wgrad_update_q8(weight, dy_t, x, states, hparams, rule: str, *, key: int | None = None, salt: int | None = None,
                    grad=None, block_grad=None, table=None) -> None:
    """The update (the module docstring): on CUDA tensors (or on CPU ones under the interpreter, FORGE_TRITON_CPU=1)
    the Gluon kernel (``take_gluon``), the blocked path or the fused Triton kernel (``use_blocked``), else the CPU
    path -- the same function, bitwise, on each device's arithmetic. ``block_grad(r0, r1)``: the fp32 gradient of
    rows r0..r1 made on demand (an embedding's, from its compact rows), for the blocked paths. ``key``, ``salt``: the
    step's round key and the parameter's salt.

    ``table``: the scalar-table update (the module docstring's row): ``states`` are then the tensor states alone --
    (codes, scales) pairs in the rule's order of its tensor states --, ``hparams`` is empty, ``key`` and ``salt``
    are not used (the keys are the row's), and nothing is advanced. CUDA (or the interpreter) only: it is the update
    a CUDA graph captures, and the CPU path has no kernel to read a row."""
    from .wgrad_update import triton_on_cpu

    r = get_rule(rule)
    triton = weight.is_cuda or triton_on_cpu()
    if table is not None and not triton:
        raise RuntimeError("forge: an 8-bit update with a scalar table runs on CUDA tensors (on CPU only under "
                           "Triton's interpreter, FORGE_TRITON_CPU=1 with TRITON_INTERPRET=1)")
    if block_grad is not None:
        if triton:
            wgrad_update_q8_blocked(weight, None, None, states, hparams, r, key=key, salt=salt, block_grad=block_grad,
                                    table=table)
        else:
            wgrad_update_q8_cpu(weight, None, None, states, hparams, r, key=key, salt=salt, block_grad=block_grad)
        return
    if triton:
        if grad is None and gluon_wanted(weight) and _launch_gluon(weight, dy_t, x, states, hparams, r, key, salt,
                                                                    table):
            return
        if grad is None and use_blocked(r, x.shape[0]) and x.shape[0] > 0:
            wgrad_update_q8_blocked(weight, dy_t, x, states, hparams, r, key=key, salt=salt, table=table)
        else:
            launch_wgrad_update_q8(weight, dy_t, x, states, hparams, r, key=key, salt=salt, grad=grad, table=table)
    else:
        wgrad_update_q8_cpu(weight, dy_t, x, states, hparams, r, key=key, salt=salt, grad=grad)


def empty_q8_state(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero state for ``weight`` [N, K] in the kernel's format: (codes, scales), all zero (scale 0: a zero block)."""
    n, k = weight.shape
    return (torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=weight.device),
            torch.zeros(n, -(-k // q8_state.BLOCK), dtype=torch.float32, device=weight.device))


# ----------------------------------------------------------------------------------------------------
# the kernel template (epilogue_codegen's ``_rule`` at its head)

_TEMPLATE = TRITON_RULE_HEAD + TRITON_SROUND + TRITON_DW_TILE + q8_state.TRITON_Q8 + '''

@triton.jit
def _ld_state(C, S, off, soff, mask, smask, BN: tl.constexpr, BK: tl.constexpr):
    # the spec's dequantization: code x its block's scale, one fp32 product
    c = tl.load(C + off, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + soff, mask=smask, other=0.0)
    if BK == 128:
        return c * s            # s is a [BN, 1] column
    else:
        return c * tl.reshape(tl.broadcast_to(tl.expand_dims(s, 2), (BN, BK // 128, 128)), (BN, BK))


@triton.jit
def _st_state(C, S, x, off, hoff, soff, mask, smask, QKEY, BN: tl.constexpr, BK: tl.constexpr):
    # elements outside the weight (a ragged last tile) must not enter their block's absmax: zeros, as the spec's
    # padding of a short last block; the rounding bits from the elements' indices in the parameter (hoff)
    code, scale = _q8_quantize(tl.where(mask, x, 0.0), hoff, QKEY, BN, BK)
    tl.store(C + off, code.to(tl.float8e4nv), mask=mask)
    tl.store(S + soff, scale, mask=smask)


@triton.jit
def _update(g, W, {q8_ptrs}EKEY, {qkey_params}{scalar_params}N, K, NB, OFF0, row0, col0,
            BN: tl.constexpr, BK: tl.constexpr):
    # int64 bases (N*K may exceed 2**31); the elements' indices in the parameter (the spec's, for the rounding bits)
    # are their offsets plus OFF0: a launch on a block of rows (wgrad_update_q8_blocked) passes the block's first
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rb = tl.arange(0, BK // 128)
    off = row0.to(tl.int64) * K + col0 + (rn[:, None] * K + rk[None, :])
    hoff = off + OFF0
    mask = ((row0 + rn) < N)[:, None] & ((col0 + rk) < K)[None, :]
    soff = row0.to(tl.int64) * NB + col0 // 128 + (rn[:, None] * NB + rb[None, :])
    smask = ((row0 + rn) < N)[:, None] & ((col0 // 128 + rb) < NB)[None, :]
    p = tl.load(W + off, mask=mask, other=0.0).to(tl.float32)
{state_loads}
    {new_vars} = _rule(p, g, {state_vars}{scalar_params}BN, BK)
    if W.dtype.element_ty == tl.bfloat16:
        # stochastic rounding: the pattern's low 16 bits are zero, so the cast is exact in any rounding mode
        tl.store(W + off, _sround_bits({new_p}, hoff, EKEY).to(tl.bfloat16), mask=mask)
    else:
        tl.store(W + off, {new_p}, mask=mask)
{state_stores}


{kernel_comment}
@triton.jit(do_not_specialize=[{do_not_specialize}])
def wgrad_update_q8_kernel(
    W, DYT, X, G, {q8_ptrs}{kernel_scalar_params}{kernel_key_params}N, K, M, NB, OFF0,
    stride_dn, stride_dm, stride_xm, stride_xk, stride_gn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_M: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, FROM_GRAD: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
):
{scalar_loads}{key_loads}    tl.static_assert((BLOCK_K // EPI_SPLIT) % 128 == 0)
    row0, col0 = _tile_origin(N, K, BLOCK_N, BLOCK_K, GROUP_N)
    if FROM_GRAD:
        # the unfused update: dW read from G (fp32 [N, K], row stride stride_gn)
        rn = row0 + tl.arange(0, BLOCK_N)
        rk = col0 + tl.arange(0, BLOCK_K)
        acc = tl.load(G + rn.to(tl.int64)[:, None] * stride_gn + rk[None, :],
                      mask=(rn < N)[:, None] & (rk < K)[None, :], other=0.0)
    else:
        # out-of-range rows/cols always wrap (EVEN_NK off): the epilogue masks them
        acc = _dw_tile(DYT, X, row0, col0, N, K, M, stride_dn, stride_dm, stride_xm, stride_xk,
                       BLOCK_N, BLOCK_K, BLOCK_M, EVEN_M, False, UPCAST, DOT_PREC)

    if EPI_SPLIT == 1:
        _update(acc, W, {q8_ptrs}EKEY, {qkey_params}{scalar_params}N, K, NB, OFF0, row0, col0, BLOCK_N, BLOCK_K)
    else:
        # two column chunks one after the other: one chunk's W/states/temporaries live at a time
        tl.static_assert(EPI_SPLIT == 2)
        g0, g1 = _halves(acc, BLOCK_N, BLOCK_K)
        _update(g0, W, {q8_ptrs}EKEY, {qkey_params}{scalar_params}N, K, NB, OFF0, row0, col0, BLOCK_N, BLOCK_K // 2)
        _update(g1, W, {q8_ptrs}EKEY, {qkey_params}{scalar_params}N, K, NB, OFF0, row0, col0 + BLOCK_K // 2,
                BLOCK_N, BLOCK_K // 2)
'''


# the host-scalar kernel's head; the table kernel's (_TABLE_HEAD) takes none of these arguments
_HOST_HEAD = """\
# the keys never specialized: a key of 1 would become a constexpr. They follow the host scalars: the per-step
# arguments are one run, as launch_memo splices them (remember(nvar=...))"""
_TABLE_HEAD = """\
# every per-step value is a word of the row SCAL (the module docstring's layout), none an argument: a CUDA graph
# replays the arguments. OFF0 and SCAL not specialized: one compile for every row block and for every row of a table
# (a row's alignment depends on its index; its scalar loads gain nothing from it)"""


def render_kernel_source(ep: Epilogue, table: bool = False) -> str:
    """The kernel module for one rule's epilogue: each tensor state ``s`` is a pair of pointers ``S_C`` (codes),
    ``S_S`` (scales) and a key ``QKEY_S``. ``table``: the rule's scalars, ``EKEY`` and the ``QKEY_S`` are loaded from
    the row ``SCAL`` at the kernel's start (the module docstring's layout) instead of taken as arguments."""
    states = ep.tensor_inputs[2:]
    new_vars = [f"new_{v}" for v in states]
    up = [s.upper() for s in states]
    qkey_params = "".join(f"QKEY_{u}, " for u in up)
    n = ep.n_kernel_scalars
    if table:
        head = dict(kernel_comment=_TABLE_HEAD, do_not_specialize='"OFF0", "SCAL"', kernel_key_params="",
                    key_loads=key_load("SCAL", n) + "".join(
                        f"    QKEY_{u} = tl.load(SCAL + {n + 1 + j}).to(tl.int32, bitcast=True)\n"
                        for j, u in enumerate(up)))
    else:
        head = dict(kernel_comment=_HOST_HEAD,
                    do_not_specialize='"EKEY", "OFF0", ' + ", ".join(f'"QKEY_{u}"' for u in up),
                    kernel_key_params="EKEY, " + qkey_params, key_loads="")
    return _TEMPLATE.format(
        **triton_fields(ep, table, "SCAL"), module="wgrad_update_q8", **head,
        q8_ptrs="".join(f"{u}_C, {u}_S, " for u in up),
        qkey_params=qkey_params,
        state_loads="\n".join(f"    {s} = _ld_state({u}_C, {u}_S, off, soff, mask, smask, BN, BK)"
                              for s, u in zip(states, up)),
        state_stores="\n".join(f"    _st_state({u}_C, {u}_S, {v}, off, hoff, soff, mask, smask, QKEY_{u}, BN, BK)"
                               for u, v in zip(up, new_vars)),
    )


_KERNELS: dict[tuple[str, str, bool], tuple[Epilogue, object]] = {}
_KLOCK = threading.Lock()


def _kernel_for(rule: Rule, target: str, table: bool = False):
    key = (rule.name, target, table)
    hit = _KERNELS.get(key)
    if hit is None:
        ep = compile_epilogue(rule, target)
        mod = load_kernel_module(render_kernel_source(ep, table), ep.source_key + ("_q8_table" if table else "_q8"))
        hit = (ep, mod.wgrad_update_q8_kernel)
        with _KLOCK:
            _KERNELS.setdefault(key, hit)
    return hit


# ----------------------------------------------------------------------------------------------------
# launcher


@dataclasses.dataclass(frozen=True)
class Q8Config:
    bn: int                 # BLOCK_N
    bk: int                 # BLOCK_K (a multiple of 128 * split)
    bm: int                 # BLOCK_M
    group: int              # GROUP_N
    warps: int
    stages: int
    split: int = 1          # EPI_SPLIT


# Swept on an H100 (stop 42, benchmarks/RESULTS.md "8-bit block-wise states"): the epilogue is register-bound, so
# what matters is elements per thread -- 32 or fewer per tile tensor (q32x128w8, q64x128w8 with 8 warps) against 64
# (the 4-warp 64x128 tiles: ~2.7x slower for AdamW's two states, spilling), while one-state rules take bigger tiles.
CONFIGS: dict[str, Q8Config] = {
    "interp": Q8Config(32, 128, 32, 8, 4, 1),
    "interp_e2": Q8Config(16, 256, 32, 8, 4, 1, split=2),
    "q16x128": Q8Config(16, 128, 64, 8, 4, 3),
    "q32x128": Q8Config(32, 128, 64, 8, 4, 3),
    "q32x128w8": Q8Config(32, 128, 64, 8, 8, 3),
    "q32x256e2w8": Q8Config(32, 256, 64, 8, 8, 3, split=2),
    "q64x128s2": Q8Config(64, 128, 64, 8, 4, 2),
    "q64x128": Q8Config(64, 128, 64, 8, 4, 4),
    "q64x128w8": Q8Config(64, 128, 64, 8, 8, 4),
    "q128x128": Q8Config(128, 128, 64, 8, 8, 3),
    "q64x256e2": Q8Config(64, 256, 64, 8, 8, 3, split=2),
    "q128x256e2": Q8Config(128, 256, 64, 8, 8, 3, split=2),
}


def pick_config(n: int, k: int, m: int, interpret: bool, n_states: int = 2, from_grad: bool = False) -> str:
    """By token count and number of tensor states, from the stop-42 H100 sweep (RESULTS.md "8-bit block-wise
    states", v2: AdamW and SGD-m, 4096x4096; v1 picked the same on the 14336-wide shapes). The update of a stored dW
    (``from_grad``) is a plain stream: the smallest footprint per thread wins."""
    if interpret:
        return "interp"
    if from_grad:
        return "q16x128" if n_states >= 2 else "q32x128"
    if n_states >= 2:
        if m <= 256:
            return "q32x128w8"
        return "q64x128w8" if m <= 4096 else "q128x256e2"
    if m <= 256:
        return "q32x128"
    return "q64x128" if m <= 2048 else "q128x128"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _target(weight) -> str:
    return "cuda" if weight.is_cuda else "interpret"


def _tensor_idx(rule: Rule) -> list[int]:
    return [i for i in range(len(rule.states)) if not rule.is_scalar_state(i)]


def check_q8_states(weight, rule: Rule, states, table: bool = False) -> tuple[list, list]:
    """(tensor states as (index in ``rule.states``, codes, scales), scalar states), checked. ``table`` (a launch with
    a scalar table): ``states`` are the tensor states alone, in the rule's order of its tensor states."""
    if table:
        idx = _tensor_idx(rule)
        if len(states) != len(idx):
            raise ValueError(f"forge: rule {rule.name!r} with a scalar table takes its {len(idx)} tensor states "
                             f"((codes, scales) pairs, no scalar states), got {len(states)}")
        items = list(zip(idx, states))
    elif len(states) != len(rule.states):
        raise ValueError(f"forge: rule {rule.name!r} takes {len(rule.states)} states, got {len(states)}")
    else:
        items = list(enumerate(states))
    n, k = weight.shape
    nb = -(-k // q8_state.BLOCK)
    pairs, scalars = [], []
    for i, s in items:
        if rule.is_scalar_state(i):
            scalars.append(s)
            continue
        ok = isinstance(s, (tuple, list)) and len(s) == 2
        if ok:
            c, sc = s
            ok = (c.dtype == torch.float8_e4m3fn and c.shape == weight.shape and c.is_contiguous()
                  and sc.dtype == torch.float32 and tuple(sc.shape) == (n, nb) and sc.is_contiguous()
                  and c.device == weight.device == sc.device)
        if not ok:
            raise ValueError(f"forge: 8-bit state {rule.states[i]!r} of rule {rule.name!r} must be (codes "
                             f"float8_e4m3fn [{n}, {k}], scales float32 [{n}, {nb}]), contiguous, on "
                             f"{weight.device} (wgrad_update_q8.empty_q8_state)")
        pairs.append((i, c, sc))
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous():
        raise ValueError(f"forge: the weight must be a contiguous fp32 or bf16 (stochastic rounding) tensor, got "
                         f"{weight.dtype}")
    return pairs, scalars


def table_width(rule: Rule, target: str = "cuda") -> int:
    """Words of a scalar-table row of ``rule``'s 8-bit update on ``target`` ("cuda" or "interpret", whose kernel
    scalars may differ in number): the kernel scalars, the weight's element key, each tensor state's key."""
    return compile_epilogue(rule, target).n_kernel_scalars + 1 + len(_tensor_idx(rule))


def row_keys(rule: Rule, key: int, salt: int, rounded_weight: bool) -> list[int]:
    """The row's key words (after the kernel scalars) of a step ``key`` and a parameter ``salt``: the weight's
    element key (``rounded_weight``: a bf16 weight; else 0), then each tensor state's -- the host launch's keys."""
    if key is None or salt is None:
        raise TypeError("forge: an 8-bit update without a scalar table takes the step's round key and the "
                        "parameter's salt (key=, salt=)")
    return [element_key(key, salt) if rounded_weight else 0,
            *[q8_state.state_element_key(key, salt, i) for i in _tensor_idx(rule)]]


def table_row(rule: Rule, scalar_states, hparams, key: int, salt: int, rounded_weight: bool, target: str = "cuda",
              width: int = 0) -> torch.Tensor:
    """The scalar-table row (fp32, CPU, ``max(width, table_width)`` words) of one update: ``rule_scalars``' values
    for ``target`` from the scalar states (in the rule's order of its scalar states; not advanced) and hparams, then
    ``row_keys``, zeros after. Keys are written through an int32 view, never as floats: most keys are NaN or
    denormal patterns as floats, which a float round trip would not keep (stochastic_round.table_row)."""
    from .wgrad_update_triton import rule_scalars

    values, _ = rule_scalars(rule, list(scalar_states), list(hparams), target)
    keys = row_keys(rule, key, salt, rounded_weight)
    n = len(values)
    row = torch.zeros(max(width, n + len(keys)), dtype=torch.float32)
    row[:n] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    row.view(torch.int32)[n:n + len(keys)] = torch.tensor(keys, dtype=torch.int32)
    return row


def check_q8_table(ep: Epilogue, rule: Rule, table, weight) -> None:
    """A scalar-table row (the module docstring's layout) for ``rule``'s kernel of ``ep``'s target: a contiguous 1-D
    fp32 tensor on the weight's device, ``table_width`` words at least."""
    need = ep.n_kernel_scalars + 1 + len(_tensor_idx(rule))
    if (not isinstance(table, torch.Tensor) or table.dtype != torch.float32 or table.dim() != 1
            or table.numel() < need or table.stride(0) != 1 or table.device != weight.device):
        got = (f"{table.dtype} {list(table.shape)} with strides {list(table.stride())} on {table.device}"
               if isinstance(table, torch.Tensor) else type(table).__name__)
        raise ValueError(f"forge: rule {rule.name!r} with 8-bit states reads {ep.n_kernel_scalars} fp32 scalars, "
                         f"the weight's key and {need - ep.n_kernel_scalars - 1} state keys ({need} words) from a "
                         f"contiguous 1-D fp32 tensor on {weight.device} (wgrad_update_q8.table_row), got {got}")


def _prepare(weight, dy_t, x, states, hparams, rule: Rule, key: int, salt: int, grad, config, off0: int = 0,
             table=None, gluon: bool = False, max_ctas: int | None = None):
    from .wgrad_update_triton import fp32_dot_precision, host_scalars

    n, k = weight.shape
    pairs, scalar_states = check_q8_states(weight, rule, states, table is not None)
    if gluon:
        from . import wgrad_update_q8_gluon

        why = None if grad is not None or off0 else wgrad_update_q8_gluon.q8_gluon_reason(weight, dy_t, x, pairs, rule)
        if grad is not None or off0 or why is not None:
            raise wgrad_update_q8_gluon.GluonRefused(f"forge: the Gluon 8-bit kernel cannot take this launch: "
                                                     f"{why or 'a stored dW or a row block (the blocked path)'}")
        _check_shapes(weight, dy_t, x)
        ep, kernel = compile_epilogue(rule, "cuda"), None
    else:
        interpret = not weight.is_cuda
        if interpret and not _interpreting():
            raise RuntimeError("forge: the Triton kernel runs on CPU tensors only with TRITON_INTERPRET=1")
        ep, kernel = _kernel_for(rule, _target(weight), table is not None)
    if table is None:
        scalars, new_scalar_states = host_scalars(ep, scalar_states, hparams)
        keys = row_keys(rule, key, salt, weight.dtype == torch.bfloat16)
    else:
        if len(hparams):
            raise ValueError("forge: an 8-bit update with a scalar table takes no hyper-parameters (they are in "
                             "the table)")
        check_q8_table(ep, rule, table, weight)
        scalars, new_scalar_states, keys = [table], [], ()
    if gluon:
        kernel, grid, args, opts = wgrad_update_q8_gluon.prepare(rule, weight, dy_t, x, pairs, scalars, keys,
                                                                 table=table is not None, config=config,
                                                                 max_ctas=max_ctas)
        return kernel, grid, args, opts, scalar_states, new_scalar_states
    if grad is not None:
        if grad.dtype != torch.float32 or grad.shape != weight.shape or grad.stride(1) != 1:
            raise ValueError("forge: grad must be an fp32 [N, K] tensor with unit column stride")
        dy_t = x = grad
        m, upcast, prec = 1, False, "ieee"
    else:
        _check_shapes(weight, dy_t, x)
        m = x.shape[0]
        if m == 0:
            # the GEMM is empty: dW = 0, the rule still runs (weight decay, moment decay)
            dy_t = torch.zeros((n, 1), dtype=dy_t.dtype, device=dy_t.device)
            x = torch.zeros((1, k), dtype=x.dtype, device=x.device)
            m = 1
        prec = fp32_dot_precision(dy_t, x)
        upcast = interpret or prec != ""
        prec = "tf32" if (not interpret and prec == "tf32") else "ieee"
    cfg = CONFIGS[config or pick_config(n, k, m, interpret, len(pairs), grad is not None)]
    if cfg.bk % (128 * cfg.split):
        raise ValueError(f"forge: config {config!r}: BLOCK_K / EPI_SPLIT must be a multiple of 128")
    grid = (-(-n // cfg.bn) * -(-k // cfg.bk),)
    gmat = grad if grad is not None else weight
    args = (weight, dy_t, x, gmat, *[t for _, c, sc in pairs for t in (c, sc)], *scalars, *keys,
            n, k, m, -(-k // q8_state.BLOCK), off0, dy_t.stride(0), dy_t.stride(1), x.stride(0), x.stride(1),
            gmat.stride(0))
    opts = dict(BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, BLOCK_M=cfg.bm, GROUP_N=cfg.group, EVEN_M=(m % cfg.bm == 0),
                UPCAST=upcast, DOT_PREC=prec, FROM_GRAD=grad is not None, EPI_SPLIT=cfg.split,
                num_warps=cfg.warps, num_stages=cfg.stages,
                # no FMA contraction: the epilogue spells out the FMAs eager torch's kernels contain
                enable_fp_fusion=False)
    return kernel, grid, args, opts, scalar_states, new_scalar_states


def _round_keys(weight, rule: Rule, key: int, salt: int) -> tuple[int, list[int]]:
    """The launch's per-step arguments: the weight's rounding key (0 for an fp32 weight) and each tensor state's."""
    ekey, *qkeys = row_keys(rule, key, salt, weight.dtype == torch.bfloat16)
    return ekey, qkeys


def _launch(weight, dy_t, x, states, hparams, rule: Rule, key: int, salt: int, grad, config=None, off0: int = 0,
            table=None, gluon: bool = False, max_ctas: int | None = None):
    """One kernel launch; returns (the scalar states, their values after the update): advancing them is the caller's,
    once per update after its last launch (a blocked update launches once per row block). A launch with a ``table``
    has none.

    A CUDA launch whose tensors (pointers, shapes, strides, dtypes) repeat an earlier one's goes through launch_memo:
    a step launches the same layers on the same buffers, and Triton's JIT dispatch plus ``_prepare`` cost tens of us
    of host per launch -- per row block on the blocked path (the end-to-end 8-bit step was host-bound, RESULTS.md "8-bit
    states end to end"). The round keys, new at every step, are the memo's per-launch arguments after the scalars.
    A table launch is not remembered: the memo splices host scalars and keys, which it has none of, and it is the
    launch a CUDA graph captures -- replays spend no host time on it."""
    from . import launch_memo
    from .wgrad_update_triton import fp32_dot_precision

    memo_key = None
    if (table is None and weight.is_cuda and config is None and max_ctas is None and launch_memo.ENABLED[0]
            and (grad is not None or x.shape[0] > 0)):   # M == 0 launches on temporaries (see _prepare)
        flat = [t for st in states for t in (st if isinstance(st, (tuple, list)) else (st,))]
        prec = "" if grad is not None else fp32_dot_precision(dy_t, x)
        memo_key = launch_memo.launch_key(("q8", off0, prec, gluon), rule, weight, dy_t, x, flat, grad)
        ekey, qkeys = _round_keys(weight, rule, key, salt)
        done = launch_memo.launch_remembered(memo_key, states, hparams, (ekey, *qkeys))
        if done is not None:
            return done
    kernel, grid, args, opts, scalar_states, new = _prepare(weight, dy_t, x, states, hparams, rule, key, salt, grad,
                                                            config, off0, table, gluon, max_ctas)
    kernel[grid](*args, **opts)
    if memo_key is not None:
        launch_memo.remember(memo_key, rule, lambda: _prepare(weight, dy_t, x, states, hparams, rule, key, salt, grad,
                                                              None, off0, gluon=gluon),
                             compile_epilogue(rule, "cuda"), states, hparams, _scalar_idx(rule), nvar=1 + len(qkeys))
    return scalar_states, new


def _scalar_idx(rule: Rule) -> list[int]:
    return [i for i in range(len(rule.states)) if rule.is_scalar_state(i)]


def _advance(scalar_states, new) -> None:
    # after the kernel(s) consumed their old values
    with torch.no_grad():
        for s, v in zip(scalar_states, new):
            s.fill_(v)


def launch_wgrad_update_q8(weight, dy_t, x, states, hparams, rule: Rule, *, key: int | None = None,
                           salt: int | None = None, grad=None, config=None, table=None, gluon: bool = False,
                           max_ctas: int | None = None) -> None:
    """One fused update with 8-bit states (the module docstring); ``grad`` given: the update of that stored dW
    (dy_t and x unused), as the unfused baseline and for parameters whose dW is not a GEMM's. ``table``: the
    scalar-table launch (``wgrad_update_q8``'s convention: tensor states alone, no hparams, no key/salt).
    ``gluon``: the Gluon kernel (kernels/wgrad_update_q8_gluon.py; a ValueError where q8_gluon_reason refuses the
    launch), ``config`` then a wgrad_update_q8_gluon.q8_config and ``max_ctas`` a cap on its persistent grid (tests:
    several tiles per CTA on small shapes); else the Triton kernel, ``config`` a CONFIGS name."""
    _advance(*_launch(weight, dy_t, x, states, hparams, rule, key, salt, grad, config, table=table, gluon=gluon,
                      max_ctas=max_ctas))


def bound_launch(weight, dy_t, x, states, hparams, rule: Rule, *, key: int | None = None, salt: int | None = None,
                 grad=None, config=None, table=None, gluon: bool = False):
    """(benchmarks) A zero-argument callable that launches the kernel alone, host part done once; scalar states are
    NOT advanced by it."""
    kernel, grid, args, opts, _, _ = _prepare(weight, dy_t, x, states, hparams, rule, key, salt, grad, config,
                                              table=table, gluon=gluon)
    return lambda: kernel[grid](*args, **opts)


# ----------------------------------------------------------------------------------------------------
# the blocked path: cuBLAS into a bounded row block of dW, then the update of that block


# fp32 bytes of the dW row block the blocked path materializes at a time: the clip norm's dW blocks' bound (32 MiB,
# 2048 rows of a 4096-wide weight)
BLOCK_BYTES = SQNORM_BLOCK_BYTES


def wgrad_update_q8_blocked(weight, dy_t, x, states, hparams, rule: Rule, *, key: int | None = None,
                            salt: int | None = None, block_grad=None, table=None) -> None:
    """The same update (bitwise the spec, as the fused kernel) as blocks of whole rows: dW of ``BLOCK_BYTES`` at
    most by torch.mm (cuBLAS on CUDA), then the kernel's stored-dW update of those rows, the rounding bits from the
    rows' element indices in the parameter (OFF0). Why: measured on an H100 (stop 42, RESULTS.md "8-bit block-wise
    states" v2) the fused 8-bit kernel is slower than cuBLAS + the stored-dW update for two-state rules at every M
    (AdamW 4096x4096: 0.190 vs 0.142 ms at M = 256, 0.962 vs 0.492 at 8192); this keeps dW bounded (FORGE's memory
    point) at the unfused step's speed. Scalar states advance once, after the last block. ``table``: every block's
    launch reads the one row (``wgrad_update_q8``'s convention), nothing advances."""
    pairs, scalar_states = check_q8_states(weight, rule, states, table is not None)
    n, k = weight.shape
    if block_grad is None:
        _check_shapes(weight, dy_t, x)
    if table is not None:
        # before the first block's GEMM, as the single launch refuses it before writing anything
        check_q8_table(compile_epilogue(rule, _target(weight)), rule, table, weight)
    rows = block_rows(n, k)
    new = None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        if r1 - r0 == n:   # one block: the tensors themselves (a step launches per block; slicing costs host time)
            g = _mm_fp32(dy_t, x) if block_grad is None else block_grad(0, n)
            _, new_b = _launch(weight, None, None, states, hparams, rule, key, salt, g, table=table)
            new = new_b
            break
        g = _mm_fp32(dy_t[r0:r1], x) if block_grad is None else block_grad(r0, r1)
        # a tensor state is a (codes, scales) pair, a scalar state a tensor (check_q8_states)
        block_states = [(s[0][r0:r1], s[1][r0:r1]) if isinstance(s, (tuple, list)) else s for s in states]
        _, new_b = _launch(weight[r0:r1], None, None, block_states, hparams, rule, key, salt, g, off0=r0 * k,
                           table=table)
        new = new if new is not None else new_b
    _advance(scalar_states, new or [])


def gluon_wanted(weight) -> bool:
    """Whether the dispatch tries the Gluon kernel (kernels/wgrad_update_q8_gluon.py) for an update of a GEMM's dW:
    a CUDA weight and FORGE_Q8_PATH=gluon, or unset while wgrad_update_q8_gluon.AUTO_Q8_GLUON is on. Whether the
    launch can take it is q8_gluon_reason's (``take_gluon``), asked on a launch-memo miss only."""
    from . import wgrad_update_q8_gluon

    return weight.is_cuda and wgrad_update_q8_gluon.wanted()


def take_gluon(weight, dy_t, x, states, rule: Rule, table=None) -> bool:
    """Whether an update of a GEMM's dW takes the Gluon kernel: ``gluon_wanted`` and q8_gluon_reason allows the launch
    (an sm_90 GPU, bf16/fp16 activations, ...). ``states`` as ``wgrad_update_q8`` takes them."""
    from . import wgrad_update_q8_gluon

    if not gluon_wanted(weight):
        return False
    pairs = check_q8_states(weight, rule, states, table is not None)[0]
    return wgrad_update_q8_gluon.q8_gluon_reason(weight, dy_t, x, pairs, rule) is None


def _launch_gluon(weight, dy_t, x, states, hparams, rule: Rule, key, salt, table) -> bool:
    """The update on the Gluon kernel; False (nothing done) where it cannot take the launch (q8_gluon_reason) or its
    kernel failed to build -- then the rule is marked and stays on the other paths. A repeated launch goes through
    the launch memo before any check (the tensors are those of a launch that ran)."""
    from . import wgrad_update_q8_gluon as qg

    try:
        _advance(*_launch(weight, dy_t, x, states, hparams, rule, key, salt, None, table=table, gluon=True))
    except qg.GluonRefused:
        return False
    except (ValueError, TypeError):   # the arguments' own errors (states, shapes, keys): every path raises them
        raise
    except Exception as e:  # a build failure (a triton whose Gluon API differs): nothing was launched
        qg.mark_broken(rule, e)
        return False
    qg.counters["taken"] += 1
    return True


def use_blocked(rule: Rule, m: int) -> bool:
    """Whether a CUDA update takes the blocked path: FORGE_Q8_PATH=fused|blocked forces one; by default blocked except
    for one-state rules at M <= 256 (SGD-m there: fused 0.109 vs 0.120 ms; from M = 2048 the blocked path wins too)."""
    forced = os.environ.get("FORGE_Q8_PATH", "")
    if forced in ("fused", "blocked"):
        return forced == "blocked"
    n_tensor = sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i))
    return not (n_tensor <= 1 and m <= 256)


def dw_block_bytes(n: int, k: int, rule: Rule, m: int, device_type: str, gluon: bool = False) -> int:
    """Bytes of dW that the update of an [n, k] weight at ``m`` tokens holds at once: a row block of the blocked path
    (CUDA, ``use_blocked``; the fused kernels none: ``gluon``, the Gluon kernel's launch -- take_gluon --, or the
    Triton one), of the CPU path (cache-sized) on CPU."""
    if device_type == "cuda" and (gluon or not use_blocked(rule, m)):
        return 0
    return block_rows(n, k, BLOCK_BYTES if device_type == "cuda" else CPU_BLOCK_BYTES) * 4 * k


def block_rows(n: int, k: int, limit: int | None = None) -> int:
    """Rows of an [n, k] weight's fp32 dW in one block of at most ``limit`` bytes (default ``BLOCK_BYTES``, read at
    the call: tests shrink it), one row at least."""
    return max(1, min(n, (BLOCK_BYTES if limit is None else limit) // (4 * k)))


# ----------------------------------------------------------------------------------------------------
# the CPU path


# dW bytes per CPU block (whole rows: 128-blocks lie inside rows): wgrad_update_cpu's, cache-sized
CPU_BLOCK_BYTES = _CPU_BLOCK_BYTES


def wgrad_update_q8_cpu(weight, dy_t, x, states, hparams, rule: Rule, *, key: int, salt: int, grad=None,
                        block_grad=None) -> None:
    """The spec one block of whole rows at a time (dW never whole): the same torch ops on each block, each block's
    elements quantized and rounded with their indices in the parameter, so the result is the spec's bit for bit."""
    from .stochastic_round import stochastic_round_bf16_at

    pairs, scalar_states = check_q8_states(weight, rule, states)
    n, k = weight.shape
    if grad is None and block_grad is None:
        _check_shapes(weight, dy_t, x)
    rows = block_rows(n, k, CPU_BLOCK_BYTES)
    ekey, *qkeys = row_keys(rule, key, salt, weight.dtype == torch.bfloat16)
    xf = x.float() if grad is None and block_grad is None else None
    new_scalars = None
    with torch.no_grad():
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            g = (grad[r0:r1].float() if grad is not None else block_grad(r0, r1) if block_grad is not None
                 else dy_t[r0:r1].float() @ xf)
            ins, t = [], 0
            for i in range(len(rule.states)):
                if rule.is_scalar_state(i):
                    ins.append(states[i])
                else:
                    _, c, sc = pairs[t]
                    ins.append(q8_state.dequantize(c[r0:r1], sc[r0:r1]))
                    t += 1
            out = rule.fn(weight[r0:r1].float(), g, *ins, *hparams)
            if weight.dtype == torch.bfloat16:
                idx = torch.arange(r0 * k, r1 * k, dtype=torch.int64).view(r1 - r0, k)
                weight[r0:r1] = stochastic_round_bf16_at(out[0].contiguous(), idx, ekey)
            else:
                weight[r0:r1] = out[0]
            for (i, c, sc), qk in zip(pairs, qkeys):
                codes, scales = q8_state.quantize(out[1 + i].contiguous(), qk, start=r0 * k)
                c[r0:r1] = codes
                sc[r0:r1] = scales
            if new_scalars is None:
                # every block computes the same new scalar states from the old ones: advanced after the loop
                new_scalars = [out[1 + i] for i in range(len(rule.states)) if rule.is_scalar_state(i)]
        for s, v in zip(scalar_states, new_scalars or []):
            s.copy_(v)


# ----------------------------------------------------------------------------------------------------
# the op: forge::wgrad_update_q8_ (for the capture passes; registered like forge::wgrad_update_, see wgrad_update.py
# for why torch.library.Library and not custom_op). The tensor states travel as two lists -- codes and scales, in the
# rule's order of its tensor states -- and the scalar states as a third, so the schema's aliasing is per list.

_LIB = torch.library.Library("forge", "FRAGMENT")
# cudagraph_unsafe: the launch computes host scalars from the step counter (wgrad_update.py says why)
_LIB.define(
    "wgrad_update_q8_(Tensor(a!) weight, Tensor dy_t, Tensor x, Tensor(b!)[] codes, Tensor(c!)[] scales, "
    "Tensor(d!)[] scalar_states, Tensor[] hparams, str rule, Tensor round_key, int round_salt, Tensor? grad=None) -> ()",
    tags=_compat.cudagraph_unsafe_tags())


def _states(rule: Rule, codes, scales, scalar_states) -> list:
    it_t, it_s, out = iter(zip(codes, scales)), iter(scalar_states), []
    for i in range(len(rule.states)):
        out.append(next(it_s) if rule.is_scalar_state(i) else next(it_t))
    return out


def _op_states(op: str, rule: str, codes, scales, scalar_states) -> list:
    r = get_rule(rule)
    n_tensor = sum(1 for i in range(len(r.states)) if not r.is_scalar_state(i))
    if len(codes) != n_tensor or len(scales) != n_tensor or len(scalar_states) != len(r.states) - n_tensor:
        raise ValueError(f"forge::{op}: rule {rule!r} takes {n_tensor} (codes, scales) pairs and "
                         f"{len(r.states) - n_tensor} scalar states, got {len(codes)}, {len(scales)}, "
                         f"{len(scalar_states)}")
    return _states(r, _e4m3(codes), scales, scalar_states)


def _e4m3(codes) -> list:
    # codes may arrive as the optimizer state's uint8 (a checkpoint's dtype; graph inputs keep it): the kernels read
    # them as e4m3, a free view
    return [c.view(torch.float8_e4m3fn) if c.dtype == torch.uint8 else c for c in codes]


def wgrad_update_q8_(weight, dy_t, x, codes, scales, scalar_states, hparams, rule, round_key, round_salt, grad=None):
    states = _op_states("wgrad_update_q8_", rule, codes, scales, scalar_states)
    wgrad_update_q8(weight, dy_t, x, states, hparams, rule, key=int(round_key), salt=round_salt, grad=grad)
    torch.autograd.graph.increment_version([weight, *codes, *scales, *scalar_states])


_LIB.impl("wgrad_update_q8_", wgrad_update_q8_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::wgrad_update_q8_", lib=_LIB)
def _(weight, dy_t, x, codes, scales, scalar_states, hparams, rule, round_key, round_salt, grad=None):
    return None


# forge::apply_rule_q8_: the unfused update of a parameter with 8-bit states from its stored gradient -- what the
# capture emits per parameter of a Rule8bitOptimizer (as forge::apply_rule_ for full-precision states); the pattern
# pass turns it and the matmul feeding its gradient into forge::wgrad_update_q8_. Never decomposed for Inductor (as
# apply_rule_ is): its implementation is the eager optimizer's (the stored-dW kernel on CUDA, the CPU path), bitwise
# the spec, which Inductor's code for the spec's torch ops would not promise. Any parameter shape: the states' rows
# are the parameter's first dimension (as_rows).
_LIB.define(
    "apply_rule_q8_(Tensor(a!) param, Tensor grad, Tensor(b!)[] codes, Tensor(c!)[] scales, "
    "Tensor(d!)[] scalar_states, Tensor[] hparams, str rule, Tensor round_key, int round_salt) -> ()",
    tags=_compat.cudagraph_unsafe_tags())


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [first dim, the rest]: 128-blocks lie inside these rows, as in a weight [N, K] (a conv weight [O, I,
    kh, kw] has rows of I * kh * kw, not of kw, which would cost a 4-byte scale per kw elements)."""
    return t.view(t.shape[0], -1) if t.dim() >= 2 else t.view(1, -1)


def update_from_grad(param, grad, states, hparams, rule: str, *, key: int | None = None, salt: int | None = None,
                     table=None) -> None:
    """The 8-bit update of a parameter of any shape from its stored gradient: the eager optimizer's step
    (optim/optimizer8bit.py) and forge::apply_rule_q8_'s implementation (``table``: forge::apply_rule_q8_table_'s,
    ``wgrad_update_q8``'s convention)."""
    wgrad_update_q8(as_rows(param), None, None, states, hparams, rule, key=key, salt=salt,
                    grad=as_rows(grad.contiguous()).float(), table=table)


def apply_rule_q8_(param, grad, codes, scales, scalar_states, hparams, rule, round_key, round_salt):
    states = _op_states("apply_rule_q8_", rule, codes, scales, scalar_states)
    update_from_grad(param, grad, states, hparams, rule, key=int(round_key), salt=round_salt)
    torch.autograd.graph.increment_version([param, *codes, *scales, *scalar_states])


_LIB.impl("apply_rule_q8_", apply_rule_q8_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::apply_rule_q8_", lib=_LIB)
def _(param, grad, codes, scales, scalar_states, hparams, rule, round_key, round_salt):
    return None


# forge::embedding_update_q8_: an embedding weight's update with 8-bit states from the embedding's backward input. The
# dense gradient exists one row block at a time only (wgrad_update_q8_blocked's blocks on CUDA, the CPU path's): each
# block's rows come from embedding_update.compact_rows -- torch's own embedding_dense_backward on the renumbered
# indices, each row bitwise the dense gradient's -- so the update is the eager optimizer's on autograd's dense
# gradient, bit for bit, with [M, K] compact rows instead of [V, K] alive.
_LIB.define(
    "embedding_update_q8_(Tensor(a!) weight, Tensor grad_output, Tensor indices, Tensor(b!)[] codes, "
    "Tensor(c!)[] scales, Tensor(d!)[] scalar_states, Tensor[] hparams, str rule, Tensor round_key, int round_salt, "
    "int padding_idx=-1) -> ()",
    tags=_compat.cudagraph_unsafe_tags())


def embedding_block_grad(grad_output, indices, num_rows: int, padding_idx: int = -1):
    """``block_grad(r0, r1)`` of the dense embedding gradient: rows r0..r1 as fp32, from the compact rows."""
    from .embedding_update import compact_rows

    rows, pos = compact_rows(grad_output, indices, num_rows, padding_idx)
    # a zero row appended at index M stands for "no token here" (pos < 0): a block is then one gather and one cast,
    # two launches per row block instead of six (a step launches these per block; host time, RESULTS.md "8-bit states
    # end to end")
    m = rows.shape[0]
    table = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    idx = torch.where(pos >= 0, pos, m).long()

    def block(r0: int, r1: int) -> torch.Tensor:
        return table.index_select(0, idx[r0:r1]).float()
    return block


def embedding_update_q8_(weight, grad_output, indices, codes, scales, scalar_states, hparams, rule, round_key,
                         round_salt, padding_idx=-1):
    states = _op_states("embedding_update_q8_", rule, codes, scales, scalar_states)
    block = embedding_block_grad(grad_output, indices, weight.shape[0], padding_idx)
    wgrad_update_q8(weight, None, None, states, hparams, rule, key=int(round_key), salt=round_salt, block_grad=block)
    torch.autograd.graph.increment_version([weight, *codes, *scales, *scalar_states])


_LIB.impl("embedding_update_q8_", embedding_update_q8_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::embedding_update_q8_", lib=_LIB)
def _(weight, grad_output, indices, codes, scales, scalar_states, hparams, rule, round_key, round_salt,
      padding_idx=-1):
    return None


# ----------------------------------------------------------------------------------------------------
# the scalar-table ops: forge::wgrad_update_q8_table_, forge::apply_rule_q8_table_, forge::embedding_update_q8_table_
# -- the three updates above with every per-step value (the rule's scalars, the weight's and the states' round keys)
# read from a row of an fp32 device table (the module docstring's layout) instead of host scalars, so that a step
# with 8-bit states can be captured as a CUDA graph and replayed with the row rewritten (passes/scalar_table.py).
# Not cudagraph_unsafe: no launch argument depends on the step. No scalar states and no hyper-parameters: whoever
# fills the row computes the scalars from them and advances the scalar states.

_LIB.define(
    "wgrad_update_q8_table_(Tensor(a!) weight, Tensor dy_t, Tensor x, Tensor(b!)[] codes, Tensor(c!)[] scales, "
    "Tensor table, str rule, Tensor? grad=None) -> ()")
_LIB.define(
    "apply_rule_q8_table_(Tensor(a!) param, Tensor grad, Tensor(b!)[] codes, Tensor(c!)[] scales, Tensor table, "
    "str rule) -> ()")
_LIB.define(
    "embedding_update_q8_table_(Tensor(a!) weight, Tensor grad_output, Tensor indices, Tensor(b!)[] codes, "
    "Tensor(c!)[] scales, Tensor table, str rule, int padding_idx=-1) -> ()")


def _table_op_states(op: str, rule: str, weight, codes, scales) -> list:
    """The tensor states of a table op as (codes, scales) pairs, checked against the rule; refused off CUDA."""
    from .wgrad_update import triton_on_cpu

    if not weight.is_cuda and not triton_on_cpu():
        raise RuntimeError(f"forge::{op} runs on CUDA tensors (on CPU only under Triton's interpreter, "
                           "FORGE_TRITON_CPU=1 with TRITON_INTERPRET=1)")
    n_tensor = len(_tensor_idx(get_rule(rule)))
    if len(codes) != n_tensor or len(scales) != n_tensor:
        raise ValueError(f"forge::{op}: rule {rule!r} takes {n_tensor} (codes, scales) pairs (its scalar states "
                         f"are the table's), got {len(codes)} codes and {len(scales)} scales")
    return list(zip(_e4m3(codes), scales))


def wgrad_update_q8_table_(weight, dy_t, x, codes, scales, table, rule, grad=None):
    states = _table_op_states("wgrad_update_q8_table_", rule, weight, codes, scales)
    wgrad_update_q8(weight, dy_t, x, states, [], rule, grad=grad, table=table)
    torch.autograd.graph.increment_version([weight, *codes, *scales])


def apply_rule_q8_table_(param, grad, codes, scales, table, rule):
    states = _table_op_states("apply_rule_q8_table_", rule, param, codes, scales)
    update_from_grad(param, grad, states, [], rule, table=table)
    torch.autograd.graph.increment_version([param, *codes, *scales])


def embedding_update_q8_table_(weight, grad_output, indices, codes, scales, table, rule, padding_idx=-1):
    states = _table_op_states("embedding_update_q8_table_", rule, weight, codes, scales)
    block = embedding_block_grad(grad_output, indices, weight.shape[0], padding_idx)
    wgrad_update_q8(weight, None, None, states, [], rule, block_grad=block, table=table)
    torch.autograd.graph.increment_version([weight, *codes, *scales])


_LIB.impl("wgrad_update_q8_table_", wgrad_update_q8_table_, "CompositeExplicitAutograd")
_LIB.impl("apply_rule_q8_table_", apply_rule_q8_table_, "CompositeExplicitAutograd")
_LIB.impl("embedding_update_q8_table_", embedding_update_q8_table_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::wgrad_update_q8_table_", lib=_LIB)
def _(weight, dy_t, x, codes, scales, table, rule, grad=None):
    return None


@torch.library.register_fake("forge::apply_rule_q8_table_", lib=_LIB)
def _(param, grad, codes, scales, table, rule):
    return None


@torch.library.register_fake("forge::embedding_update_q8_table_", lib=_LIB)
def _(weight, grad_output, indices, codes, scales, table, rule, padding_idx=-1):
    return None
