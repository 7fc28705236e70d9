"""The fused update with 8-bit block-wise states on the Gluon split kernel (Hopper, sm_90): the same function as
kernels/wgrad_update_q8.py's Triton kernel -- bitwise kernels/q8_state.py's spec -- on the schedule that made the fp32
step fast (wgrad_update_gluon v12, "split").

Why: the Triton q8 kernel runs its epilogue after the GEMM with the accumulator live -- register-bound, slower than
cuBLAS + the stored-dW update (RESULTS.md "8-bit block-wise states" v2: AdamW 4096x4096 0.190 vs 0.142 ms at M = 256,
0.962 vs 0.492 at 8192), so by default the 8-bit step runs the blocked path (cuBLAS into row blocks of dW, then the
update). In the split kernel one MMA warpgroup runs every tile's GEMM back to back and parks the fp32 dW tile in
shared memory while two epilogue warpgroups stream W and the states of the tile before: the epilogue's arithmetic
(per element and state a hash, the block's absmax, the encoding) runs beside the tensor cores instead of after them,
and AdamW moves 8 + 2 x (1 + 4/128) bytes per element instead of 24 (fp32 states).

Read top to bottom: the epilogue template (chunk addressing, loads, the quantization as the spec spells it, one
chunk's step, the epilogue partition, the kernel), its render step, ``q8_gluon_reason``: whether a launch can take
this path (anything else stays on wgrad_update_q8's paths), the launch's ``prepare`` (wgrad_update_q8 launches it).

Layout: [128, 128] tiles of dW (BK = 128 = the 8-bit format's block: a chunk row is one block, its absmax a warp's
row reduction, its scale one fp32 per row of the chunk); each epilogue warpgroup walks [R, 128] row chunks of its
half tile with 4 elements per thread (16-byte W vectors, 4-byte code vectors), AHEAD chunks of W / codes / scales in
flight ahead of the math and carried into the warpgroup's next tile. The rounding bits are the elements' indices in
the parameter, as the spec's (a fused launch covers the whole parameter). The GEMM side (_gemm_loader, _split_mma,
_tile_mma) is wgrad_update_gluon's text, unchanged.

Exactness: the rule is epilogue_codegen's "cuda" code, compiled with ``enable_fp_fusion=False`` as every forge kernel;
dequantization is one fp32 product (code x scale), quantization the spec's ops one IEEE operation at a time (divisions
``div_rn``, powers of two from their bit patterns, the sign a multiplication by -1.0: triton 3.6's unary minus is
0 - x). Written against triton 3.6's Gluon API; the module is imported only by a launch that can use it.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter

import torch

from ..optim.rule import Rule
from .epilogue_codegen import Epilogue, EpilogueUnsupported, compile_epilogue, load_kernel_module
from .q8_state import TRITON_Q8
from .stochastic_round import GLUON_SROUND

log = logging.getLogger(__name__)
# "taken": updates wgrad_update_q8's dispatch sent here; "broken": rules whose kernel failed to build (mark_broken)
counters: Counter = Counter()

__all__ = ["render_q8_gluon_source", "wanted", "q8_gluon_reason", "expects_gluon", "prepare", "q8_config",
           "pick_q8_config", "mark_broken", "GluonRefused", "counters", "AUTO_Q8_GLUON"]

# Whether the default 8-bit path (FORGE_Q8_PATH unset) takes this kernel where it can: off until it has run on a GPU
# (tests bitwise the spec, and faster than the blocked path in bench_wgrad_update_q8.py). FORGE_Q8_PATH=gluon forces it
# wherever q8_gluon_reason allows.
AUTO_Q8_GLUON = False


_Q8_EPI = '''\
# 4 fp32 per thread, a warp per 512 B row of a [R, 128] chunk: W as 16-byte vectors, codes as 4-byte ones
ROWS_L = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))
# the dW tile's swizzle (wgrad_update_gluon's DW_LAYOUT: conflict-free accumulator stores and row-chunk loads)
DW_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 4, [1, 0]))
{round_fn}{quantize_fn}


@gluon.jit
def _q8_base(t, num_tiles, num_n, num_k, BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr):
    # first row and column of tile t (clamped to the last tile: _q8_at masks tiles past the end by t)
    pid_n, pid_k = _tile_coords(gl.minimum(t, num_tiles - 1), num_n, num_k, GROUP)
    return pid_n * BN, pid_k * BK


@gluon.jit
def _q8_at(row0, col0, t, c, num_tiles, N, K, NB, BK: gl.constexpr, R: gl.constexpr, BIG: gl.constexpr):
    # rows c * R .. of the tile at (row0, col0): element offsets and mask, the rows' scale offsets (block col0 / 128
    # of each row) and mask. Offsets are the elements' indices in the parameter, the rounding bits' too
    rows = row0 + c * R + gl.arange(0, R, layout=gl.SliceLayout(1, ROWS_L))
    cols = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, ROWS_L))
    rok = (rows < N) & (t < num_tiles)
    msk = rok[:, None] & (cols < K)[None, :]
    if BIG:
        offs = rows.to(gl.int64)[:, None] * K + cols[None, :]
        soffs = rows.to(gl.int64) * NB + col0 // BK
    else:
        offs = rows[:, None] * K + cols[None, :]
        soffs = rows * NB + col0 // BK
    return offs, msk, soffs, rok


@gluon.jit
def _q8_load(offs, msk, soffs, rok, w_ptr, {q8_ptrs}):
    # W, then each tensor state's codes and its rows' scales, as one tuple (converted where the math starts: the
    # lookahead holds the narrow values)
    return (gl.load(w_ptr + offs, mask=msk), {q8_loads})


@gluon.jit
def _q8_store(c_ptr, s_ptr, x, offs, msk, soffs, rok, ekey, R: gl.constexpr):
    # elements outside the weight (a ragged tile) must not enter their block's absmax: zeros, as the spec's padding
    code, scale = _q8_quantize(gl.where(msk, x, 0.0), offs, ekey, R, 128)
    gl.store(c_ptr + offs, code.to(gl.float8e4nv), mask=msk)
    gl.store(s_ptr + soffs[:, None], scale, mask=rok[:, None])


@gluon.jit
def _q8_store_w(w_ptr, p, offs, msk, EKEY):
    if w_ptr.dtype.element_ty == gl.bfloat16:
        # stochastic rounding: the pattern's low 16 bits are zero, so the cast is exact in any rounding mode
        gl.store(w_ptr + offs, _sround_bits(p, offs, EKEY).to(gl.bfloat16, fp_downcast_rounding="rtne"), mask=msk)
    else:
        gl.store(w_ptr + offs, p, mask=msk)


@gluon.jit
def _q8_step(dw, t, c, ahead, base, base_nx, w_ptr, {q8_ptrs}{scalar_params}{key_params}tstep, num_tiles, N, K,
             NB, BK: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, C0: gl.constexpr,
             CNT: gl.constexpr):
    # chunk C0 + c of tile t (the warpgroup walks chunks C0 .. C0 + CNT - 1 of every tile it takes, tstep tiles
    # apart): first the loads of the chunk AHEAD on (in this tile, or -- nx = 1 -- in the next one, at base_nx),
    # then the math on ahead[0] and dW from smem, the stores. Returns the lookahead shifted by one chunk.
    nx = (c + AHEAD) // CNT
    offs, msk, soffs, rok = _q8_at(base[0] + nx * (base_nx[0] - base[0]), base[1] + nx * (base_nx[1] - base[1]),
                                   t + nx * tstep, C0 + (c + AHEAD) % CNT, num_tiles, N, K, NB, BK, R, BIG)
    nxt = _q8_load(offs, msk, soffs, rok, w_ptr, {q8_ptrs})
    {carry} = ahead[0]
    p = w.to(gl.float32)
{dequant}
    g = dw.index(C0 + c).load(ROWS_L)
    {new_vars} = _rule(p, g, {state_vars}{scalar_params})
    offs, msk, soffs, rok = _q8_at(base[0], base[1], t, C0 + c, num_tiles, N, K, NB, BK, R, BIG)
    _q8_store_w(w_ptr, {new_p}, offs, msk, EKEY)
{q8_stores}
    return ahead[1:] + (nxt, )


@gluon.jit
def _q8_epi(w_ptr, {q8_ptrs}dw, dw_bar, {scalar_params}{key_params}N, K, NB, num_tiles, num_n, num_k,
            H: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, R: gl.constexpr,
            AHEAD: gl.constexpr, BIG: gl.constexpr):
    # rows H * BN / 2 .. of every tile of the CTA: chunks H * CNT .. H * CNT + CNT - 1 of [R, BK]
    CNT: gl.constexpr = BN // 2 // R
    gl.static_assert(AHEAD <= CNT)
    dw_chunks = dw._reinterpret(gl.float32, [BN // R, R, BK], dw.type.layout)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    base = _q8_base(pid, num_tiles, num_n, num_k, BN, BK, GROUP)
    # the lookahead's start: the first chunks of the CTA's first tile, loaded while its GEMM runs
    ahead = ()
    for d in gl.static_range(AHEAD):
        offs, msk, soffs, rok = _q8_at(base[0], base[1], pid, H * CNT + d, num_tiles, N, K, NB, BK, R, BIG)
        ahead += (_q8_load(offs, msk, soffs, rok, w_ptr, {q8_ptrs}), )
    r = 0
    for t in range(pid, num_tiles, nprog):
        mbarrier.wait(dw_bar.index(0), r & 1)
        base_nx = _q8_base(t + nprog, num_tiles, num_n, num_k, BN, BK, GROUP)
        for c in range(CNT):
            ahead = _q8_step(dw_chunks, t, c, ahead, base, base_nx, w_ptr, {q8_ptrs}{scalar_params}{key_params}nprog,
                             num_tiles, N, K, NB, BK, R, AHEAD, BIG, H * CNT, CNT)
        base = base_nx
        # all four warps' reads of the tile are done before the (single-thread) arrive frees it
        gl.thread_barrier()
        mbarrier.arrive(dw_bar.index(1))
        r += 1


@gluon.jit
def _q8_epi1(w_ptr, {q8_ptrs}dw, dw_bar, {scalar_params}{key_params}N, K, NB, num_tiles, num_n, num_k,
             BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr,
             BIG: gl.constexpr):
    _q8_epi(w_ptr, {q8_ptrs}dw, dw_bar, {scalar_params}{key_params}N, K, NB, num_tiles, num_n, num_k, 1, BN, BK, GROUP,
            R, AHEAD, BIG)


{kernel_comment}
@gluon.jit{do_not_specialize}
def wgrad_update_q8_gluon_kernel(dy_desc, x_desc, w_ptr, {q8_ptrs}{kernel_scalar_params}{kernel_key_params}M, N, K, NB,
                                 GROUP: gl.constexpr, STAGES: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr,
                                 BIG: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    # BK is the format's block: a chunk row is one block (its absmax a row reduction)
    gl.static_assert(num_warps == 4 and BK == 128)
    gl.static_assert((BN // 2) % R == 0 and R % 4 == 0)
{scalar_loads}{key_loads}    # 16-byte W / 4-byte code vectors need aligned rows: K % 8 == 0 (q8_gluon_reason; TMA too)
    K = gl.multiple_of(K, 8)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar = _split_smem1(dy_desc, x_desc, STAGES, DW_LAYOUT)

    gl.warp_specialize([
        (_split_mma, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar, M, num_tiles, STAGES, 1)),
        (_q8_epi, (w_ptr, {q8_ptrs}dw, dw_bar, {scalar_params}{key_params}N, K, NB, num_tiles, num_n, num_k, 0, BN, BK,
                   GROUP, R, AHEAD, BIG)),
        (_q8_epi1, (w_ptr, {q8_ptrs}dw, dw_bar, {scalar_params}{key_params}N, K, NB, num_tiles, num_n, num_k, BN, BK,
                    GROUP, R, AHEAD, BIG)),
        (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                        STAGES)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
'''


def gluon_q8_quantize() -> str:
    """q8_state.TRITON_Q8 (the spec's quantization of a tile whose rows hold whole blocks) in Gluon: the same text,
    tl.* spelled gl.* -- one source for both kernels' encodings. Only its BK == 128 branch is compiled here."""
    src = TRITON_Q8.replace("@triton.jit", "@gluon.jit").replace("tl.math.div_rn(", "gl.div_rn(")
    return re.sub(r"\btl\.", "gl.", src).rstrip("\n")


_HOST_COMMENT = """\
# the keys are never specialized (a key of 1 would become a constexpr) and follow the host scalars: the per-step
# arguments are one run, as launch_memo splices them (remember(nvar=...))"""
_TABLE_COMMENT = """\
# every per-step value is a word of the row scal_ptr (wgrad_update_q8's table layout): a CUDA graph replays the
# arguments. scal_ptr not specialized: a row's alignment depends on its index, and a second compile for another
# alignment could fall inside a CUDA graph's capture"""


def render_q8_gluon_source(ep: Epilogue, table: bool = False) -> str:
    """The kernel module for one rule's epilogue: each tensor state ``s`` is a pair of pointers ``S_c`` (codes),
    ``S_s`` (scales) and a key ``QKEY_S``; ``EKEY`` is the bf16 weight's rounding key (unused for an fp32 weight).
    ``table``: the rule's scalars and the keys are loaded from the row ``scal_ptr`` (wgrad_update_q8's layout: the
    kernel scalars, the weight's key, each tensor state's key) instead of taken as arguments."""
    from .wgrad_update_gluon import _HEAD, _SPLIT_MMA, _common_fields

    states = ep.tensor_inputs[2:]
    up = [s.upper() for s in states]
    n = ep.n_kernel_scalars
    common = _common_fields(ep, table)
    key_params = "EKEY, " + "".join(f"QKEY_{u}, " for u in up)
    i4 = " " * 4
    if table:
        keys = dict(kernel_key_params="", do_not_specialize='(do_not_specialize=["scal_ptr"])',
                    kernel_comment=_TABLE_COMMENT,
                    key_loads=f"{i4}EKEY = gl.load(scal_ptr + {n}).to(gl.int32, bitcast=True)\n" + "".join(
                        f"{i4}QKEY_{u} = gl.load(scal_ptr + {n + 1 + j}).to(gl.int32, bitcast=True)\n"
                        for j, u in enumerate(up)))
    else:
        names = ", ".join(f'"{k}"' for k in key_params.rstrip(", ").split(", "))
        keys = dict(kernel_key_params=key_params, do_not_specialize=f"(do_not_specialize=[{names}])",
                    kernel_comment=_HOST_COMMENT, key_loads="")
    fields = dict(
        common, **keys,
        round_fn=GLUON_SROUND,
        quantize_fn=gluon_q8_quantize(),
        key_params=key_params,
        q8_ptrs="".join(f"{u}_c, {u}_s, " for u in up),
        q8_loads="".join(f"gl.load({u}_c + offs, mask=msk), gl.load({u}_s + soffs, mask=rok), " for u in up),
        carry=", ".join(["w", *(f"{s}_c, {s}_s" for s in states)]),
        dequant="\n".join(f"{i4}{s} = {s}_c.to(gl.float32) * {s}_s[:, None]" for s in states) or f"{i4}pass",
        q8_stores="\n".join(f"{i4}_q8_store({u}_c, {u}_s, new_{s}, offs, msk, soffs, rok, QKEY_{u}, R)"
                            for s, u in zip(states, up)),
    )
    return (_HEAD + _Q8_EPI).format(**fields) + "\n\n" + _SPLIT_MMA


# ----------------------------------------------------------------------------------------------------
# per-rule kernels, cached (a rule that cannot render, or whose kernel failed to build, stays on wgrad_update_q8's
# other paths)

_KERNELS: dict[tuple[str, bool], object] = {}
_WHY_NOT: dict[str, str] = {}      # rule -> "" (renders) or why not; a build failure (mark_broken) overwrites it
_LOCK = threading.Lock()


def _kernel_for(rule: Rule, table: bool):
    key = (rule.name, table)
    kern = _KERNELS.get(key)
    if kern is None:
        ep = compile_epilogue(rule, "cuda")
        mod = load_kernel_module(render_q8_gluon_source(ep, table), f"gluon_q8_{'table_' if table else ''}"
                                                                     f"{ep.source_key}")
        with _LOCK:
            kern = _KERNELS.setdefault(key, mod.wgrad_update_q8_gluon_kernel)
    return kern


def _why_not(rule: Rule) -> str | None:
    why = _WHY_NOT.get(rule.name)
    if why is None:
        from .wgrad_update_gluon import GluonUnsupported

        try:
            render_q8_gluon_source(compile_epilogue(rule, "cuda"))
            why = ""
        except (EpilogueUnsupported, GluonUnsupported) as e:
            why = f"{type(e).__name__}: {e}"
        with _LOCK:
            why = _WHY_NOT.setdefault(rule.name, why)
    return why or None


class GluonRefused(ValueError):
    """This launch is not one the kernel takes (q8_gluon_reason's answer): the dispatch uses the other paths."""


def mark_broken(rule: Rule, e: Exception) -> None:
    """A build/compile failure: this rule's launches stay on wgrad_update_q8's other paths from now on (logged)."""
    counters["broken"] += 1
    with _LOCK:
        _WHY_NOT[rule.name] = f"Gluon 8-bit kernel failed: {type(e).__name__}: {str(e)[:300]}"
    log.warning("forge: Gluon 8-bit kernel for rule %r failed, using the other 8-bit paths: %s: %s", rule.name,
                type(e).__name__, str(e)[:300])


# ----------------------------------------------------------------------------------------------------
# launcher


def q8_config(rows: int = 8, ahead: int = 4, stages: int = 5, bmt: int = 64, eregs: int = 152):
    """The kernel's schedule as a wgrad_update_gluon.GConfig (epi "split": [128, 128] tiles, ``stages`` GEMM stages
    of ``bmt`` tokens, [rows, 128] epilogue chunks, ``ahead`` of them in flight, ``eregs`` registers per epilogue
    warpgroup): the fp32 split kernel's picked schedule by default (RESULTS.md v12), the same smem (the dW tile and
    5 stages)."""
    from .wgrad_update_gluon import split_config

    return split_config(rows=rows, ahead=ahead, stages=stages, bmt=bmt, eregs=eregs)


def pick_q8_config(n_states: int):
    """The default schedule for a rule with ``n_states`` tensor states: the most chunks in flight that compile
    without spilling on sm_90 (benchmarks/compile_sm90.py --q8: AdamW spills 24 B at 4 ahead, none at 3; one-state
    rules none at 4)."""
    return q8_config(ahead=3 if n_states >= 2 else 4)


def wanted() -> bool:
    """Whether the 8-bit dispatch tries this kernel: FORGE_Q8_PATH=gluon, or unset while AUTO_Q8_GLUON is on."""
    forced = os.environ.get("FORGE_Q8_PATH", "")
    return forced == "gluon" or (not forced and AUTO_Q8_GLUON)


def _static_reason(device, n: int, k: int, act_dtype, rule: Rule) -> str | None:
    # what the device, the dtypes and the shape decide, before any tensor exists (expects_gluon) or at a launch
    from . import wgrad_update_gluon as wg

    if os.environ.get(wg.ENV, "auto").strip().lower() == "triton":
        return f"{wg.ENV}=triton"
    if not wg._device_ok(torch.device(device)):
        return "not an sm_90 CUDA device"
    if not wg.gluon_available():
        return "triton.experimental.gluon (Hopper) not importable"
    if act_dtype not in (torch.bfloat16, torch.float16):
        return f"activations {act_dtype} (bf16 or fp16)"
    if n % 8 or k % 8:
        return "N and K must be multiples of 8 (16-byte TMA row strides)"
    return _why_not(rule)


def q8_gluon_reason(weight, dy_t, x, pairs, rule: Rule) -> str | None:
    """None when this fused 8-bit launch can take the Gluon kernel, else why not. ``pairs``: the checked tensor
    states (wgrad_update_q8.check_q8_states: (index, codes, scales))."""
    dev = weight.device
    if dy_t.device != dev or x.device != dev:
        return "not an sm_90 CUDA device"
    if dy_t.dtype != x.dtype:
        return f"activations {dy_t.dtype}/{x.dtype} (one dtype)"
    if x.shape[0] == 0:
        return "M == 0"
    if not dy_t.t().is_contiguous() or not x.is_contiguous():
        return "dy_t must be the transpose of a row-major dY and x row-major"
    why = _static_reason(dev, *weight.shape, x.dtype, rule)
    aligned = all(t.data_ptr() % 16 == 0 for t in (dy_t, x, weight)) and all(c.data_ptr() % 4 == 0 for _, c, _ in pairs)
    if why is None and not aligned:
        return "a base pointer is not aligned (16 bytes for W and the activations, 4 for codes)"
    return why


def expects_gluon(device, n: int, k: int, act_dtype, rule: Rule) -> bool:
    """Whether an update of an [n, k] weight on ``device`` from ``act_dtype`` activations will take this kernel
    (wgrad_update_q8.take_gluon) as far as shapes and dtypes tell -- the compile-time report's question; pointer
    alignment and layouts are a launch's (q8_gluon_reason)."""
    return wanted() and _static_reason(device, n, k, act_dtype, rule) is None


def prepare(rule: Rule, weight, dy_t, x, pairs, scalars, keys, *, table: bool = False, config=None,
            max_ctas: int | None = None):
    """(kernel, grid, args, opts) of one launch: ``pairs`` the checked tensor states, ``scalars`` the rule's host
    scalars (or ``[table row]``), ``keys`` the weight's and each state's element key (none with a table). Arguments:
    the descriptors, W, each state's codes and scales, the scalars, the keys, M, N, K, NB -- scalars and keys one run
    (launch_memo splices them)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import wgrad_update_gluon as wg
    from .q8_state import BLOCK

    cfg = config or pick_q8_config(len(pairs))
    n, k = weight.shape
    m = x.shape[0]
    a_l, b_l, _ = wg._smem_layouts(cfg, x.dtype)
    dy_desc = TensorDescriptor(dy_t, [m, n], [n, 1], [cfg.bmt, cfg.bn], a_l)   # dY [M, N] row-major
    x_desc = TensorDescriptor(x, [m, k], [k, 1], [cfg.bmt, cfg.bk], b_l)
    tiles = -(-n // cfg.bn) * -(-k // cfg.bk)
    grid = (max(1, min(max_ctas or wg._num_sms(weight.device), tiles)),)
    args = (dy_desc, x_desc, weight, *[t for _, c, sc in pairs for t in (c, sc)], *scalars, *keys, m, n, k,
            -(-k // BLOCK))
    # int64 offsets when the rows the chunks address (up to the last tile's end) pass 2^31 elements
    big = -(-n // cfg.bn) * cfg.bn * k >= 2 ** 31
    opts = dict(GROUP=cfg.group, STAGES=cfg.stages, R=cfg.epi_m, AHEAD=cfg.ahead, BIG=big, CONSUMER_REGS=cfg.cregs,
                num_warps=4, maxnreg=cfg.maxnreg, enable_fp_fusion=False)
    return _kernel_for(rule, table), grid, args, opts
