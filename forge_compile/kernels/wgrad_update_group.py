"""Several weights' fused wgrad+update in ONE persistent launch (Gluon, sm_90): ``launch_group``.

Why (benchmarks/RESULTS.md "Several weights in one launch", H200): a 2048x2048 weight has 256 [128, 128] tiles,
~2 per SM, so the split kernel (v12) is mostly pipeline fill and drain -- the first tile's GEMM and the last tile's
epilogue run unhidden. Stacking the rows of the weights that read the same X in the backward (q/k/v, gate/up) into
one launch gives each SM G times the tiles: measured as one [G*N, K] weight, 1.13x (q/k/v) / 1.10x (gate/up) /
1.16-1.19x (4 x 2048x2048) faster than G launches at M = 1024-2048 tokens.

What it computes -- the spec is the G separate launches: for every member g,
    W_g, *states_g = rule(W_g, dY_gᵀ X, *states_g, *hparams)
bit for bit as ``wgrad_update_gluon.launch(..., config=config)`` on that member alone with the same config (each
[128, 128] tile's GEMM and epilogue are the same instructions on the same data; only which CTA takes which tile
differs). tests/test_wgrad_update_group.py checks that on the GPU.

How: the kernel is v12's split kernel (one MMA warpgroup, two epilogue warpgroups, the GEMM loader) over the
members' rows stacked, [sum N_g, K]: tile rows [start_g, start_g + N_g) belong to member g. Every member but the
last has N_g % 128 == 0, so no tile straddles two members. The GEMM loader reads a tile's dY and X panels through
member g's TMA descriptors (up to G_MAX of each, an if-chain on the tile's first row): members may read one X
(q/k/v) or each their own of one shape (o with q/k/v). The loader's four X descriptor addresses, computed before
the partitions fork, spill 32 B (AdamW, sm_90): read back once per CTA by the loader, outside its loop. The epilogue
addresses member g's W and states from member 0's pointers plus one element offset per array and member, computed
on the host from the data pointers: ptr_0 + (ptr_g - ptr_0) / 4 - start_g * K + row * K + col is element
(row - start_g, col) of member g's array. The offsets are passed in units of 4 elements (16 bytes), so the
compiler keeps the 16-byte vector loads it proves for the single-weight kernel. Tile bases are hoisted per tile
(GConfig.hoist), the offsets carried with them.

The rule's scalars (lr, bias corrections, ...) are taken once for the group: every member's host scalars must be
equal (same hyperparameters, same step count), else ``group_reason`` says why and the caller launches them one by
one -- or, with a scalar table, each member's own row, reloaded per tile. The new W's bf16/fp16 copy (the cast
option) is written per member like W; no dW side output and no tied-embedding rows: those stay on the
single-weight launches.

Read top to bottom: the kernel template (rendered after the split kernel's module, whose pieces it calls), the
host checks, the launcher.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

import torch

from .. import _compat
from ..optim.rule import Rule, get_rule
from . import wgrad_update_gluon as wg
from .epilogue_codegen import load_kernel_module
from .wgrad_update_triton import check_table, host_scalars, split_states

__all__ = ["G_MAX", "group_config", "group_reason", "launch_group", "try_launch_group", "bound_launch_group",
           "render_group_source"]

log = logging.getLogger(__name__)
counters: Counter = Counter()

G_MAX = 4                 # members per launch: the loader's descriptor if-chain and the offsets' argument count
_NO_START = 2 ** 31 - 1   # first row of an absent member: no tile reaches it


def group_config() -> wg.GConfig:
    """The split kernel's config with hoisted tile bases and 160 registers per epilogue warpgroup (the MMA
    warpgroup gets 168): the per-tile member offsets need ~8 more than the single-weight kernel, whose 152 spill
    72 B here (AdamW; 0 B at 160, sm_90 compile, 16-byte vector loads/stores as in the single-weight kernel)."""
    return wg.split_config(hoist=True, eregs=160)

_GROUP_KERNEL = '''

@gluon.jit
def _group_loader(dy_desc0, dy_desc1, dy_desc2, dy_desc3, x_desc0, x_desc1, x_desc2, x_desc3, a_bufs, b_bufs, ready,
                  empty, M, num_tiles, num_n, num_k, s1, s2, s3, GROUP: gl.constexpr, STAGES: gl.constexpr,
                  PDL: gl.constexpr = 0):
    # _gemm_loader over the stacked rows: a tile's dY and X panels come from its member's descriptors (dY at the
    # tile's first row minus the member's first row; members reading the same X pass the same descriptor)
    BMT: gl.constexpr = dy_desc0.block_type.shape[0]
    BN: gl.constexpr = dy_desc0.block_type.shape[1]
    BK: gl.constexpr = x_desc0.block_type.shape[1]
    if PDL > 0:   # as _gemm_loader: wait for the kernel before (it may have written dY / X)
        _gdc_wait()
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    it = 0
    for t in range(pid, num_tiles, nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        row0 = pid_n * BN
        for ks in range(ksteps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, dy_desc0.block_type.nbytes + x_desc0.block_type.nbytes)
            if row0 < s1:
                tma.async_copy_global_to_shared(dy_desc0, [ks * BMT, row0], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(x_desc0, [ks * BMT, pid_k * BK], bar, b_bufs.index(s))
            elif row0 < s2:
                tma.async_copy_global_to_shared(dy_desc1, [ks * BMT, row0 - s1], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(x_desc1, [ks * BMT, pid_k * BK], bar, b_bufs.index(s))
            elif row0 < s3:
                tma.async_copy_global_to_shared(dy_desc2, [ks * BMT, row0 - s2], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(x_desc2, [ks * BMT, pid_k * BK], bar, b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(dy_desc3, [ks * BMT, row0 - s3], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(x_desc3, [ks * BMT, pid_k * BK], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _group_base(t, num_tiles, num_n, num_k, s1, s2, s3, BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr):
    # first row/column of tile t in the stacked rows, and its member (the number of members' first rows it passed)
    row0, col0 = _tile_base(t, num_tiles, num_n, num_k, BN, BK, GROUP)
    return (row0, col0, (row0 >= s1).to(gl.int32) + (row0 >= s2).to(gl.int32) + (row0 >= s3).to(gl.int32))


@gluon.jit
def _delta(g, e1, e2, e3):
    # member g's offset: the increments of the members up to g (16-byte units for the arrays, elements for rows);
    # recomputed at each use from the arguments rather than carried in registers beside the tile bases
    return (g >= 1).to(gl.int32) * e1 + (g >= 2).to(gl.int32) * e2 + (g >= 3).to(gl.int32) * e3


@gluon.jit
def _group_ahead0(t0, C0: gl.constexpr, base, w_ptr, {state_ptrs}{gdelta_params}num_tiles, N, K, BK: gl.constexpr,
                  R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr):
    ahead = ()
    for d in gl.static_range(AHEAD):
        offs, msk = _chunk_at(base[0], base[1], t0, C0 + d, num_tiles, N, K, BK, R, ROWS_L, BIG)
        ahead += (_smem_load_at(offs, msk, {ptrs_cur}LD_EV), )
    return ahead


@gluon.jit
def _group_step(dw, t, c, ahead, base, base_nx, w_ptr, {state_ptrs}g_ptr, {scalar_params}{gdelta_params}tstep,
                num_tiles, N, K,
                BK: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr, L: gl.constexpr, BIG: gl.constexpr,
                LD_EV: gl.constexpr, ST_EV: gl.constexpr, ST_CM: gl.constexpr, C0: gl.constexpr, CNT: gl.constexpr,
                STORE: gl.constexpr):
    # _smem_step_at with each array's pointer moved to the tile's member (base[2], base_nx[2] for the chunk loaded
    # ahead when it lies in the warpgroup's next tile)
    nx = (c + AHEAD) // CNT
    gn = base[2] + nx * (base_nx[2] - base[2])
    offs, msk = _chunk_at(base[0] + nx * (base_nx[0] - base[0]), base[1] + nx * (base_nx[1] - base[1]),
                          t + nx * tstep, C0 + (c + AHEAD) % CNT, num_tiles, N, K, BK, R, L, BIG)
    nxt = _smem_load_at(offs, msk, {ptrs_nx}LD_EV)
    {carry} = ahead[0]
    g = dw.index(C0 + c).load(L)
    {new_vars} = _rule(p, g, {state_vars}{scalar_params})
    offs, msk = _chunk_at(base[0], base[1], t, C0 + c, num_tiles, N, K, BK, R, L, BIG)
    _smem_store_at(offs, msk, {new_vars}, g, {ptrs_cur}{gptr_cur}, {ekey_param}STORE, ST_EV, ST_CM)
    return ahead[1:] + (nxt, )


@gluon.jit
def _group_epi(w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {group_scalar_params}N, K, num_tiles, num_n, num_k, s1, s2, s3,
               {gdelta_params}H: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr,
               R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr, ST_EV: gl.constexpr,
               ST_CM: gl.constexpr, STORE: gl.constexpr, PDL: gl.constexpr = 0):
    # _split_epi (one dW tile, hoisted tile bases) over the stacked rows
    CNT: gl.constexpr = BN // 2 // R
    if PDL == 1:   # as _split_epi
        _gdc_wait()
    gl.static_assert(AHEAD <= CNT)
    L: gl.constexpr = ROWS_L
    dw_chunks = dw._reinterpret(gl.float32, [BN // R, R, BK], dw.type.layout)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    base = _group_base(pid, num_tiles, num_n, num_k, s1, s2, s3, BN, BK, GROUP)
    ahead = _group_ahead0(pid, H * CNT, base, w_ptr, {state_ptrs}{gdelta_params}num_tiles, N, K, BK, R, AHEAD, BIG,
                          LD_EV)
    r = 0
    for t in range(pid, num_tiles, nprog):
        mbarrier.wait(dw_bar.index(0), r & 1)
        base_nx = _group_base(t + nprog, num_tiles, num_n, num_k, s1, s2, s3, BN, BK, GROUP)
        for c in range(CNT):
{group_scalar_loads}
            ahead = _group_step(dw_chunks, t, c, ahead, base, base_nx, w_ptr, {state_ptrs}g_ptr, {scalar_params}
                                {gdelta_params}nprog, num_tiles, N, K, BK, R, AHEAD, L, BIG, LD_EV, ST_EV, ST_CM,
                                H * CNT, CNT, STORE)
        base = base_nx
        gl.thread_barrier()
        mbarrier.arrive(dw_bar.index(1))
        r += 1


@gluon.jit
def _group_epi1(w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {group_scalar_params}N, K, num_tiles, num_n, num_k, s1, s2,
                s3, {gdelta_params}BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, R: gl.constexpr,
                AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr, ST_EV: gl.constexpr, ST_CM: gl.constexpr,
                STORE: gl.constexpr, PDL: gl.constexpr = 0):
    _group_epi(w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {group_scalar_params}N, K, num_tiles, num_n, num_k, s1, s2, s3,
               {gdelta_params}1, BN, BK, GROUP, R, AHEAD, BIG, LD_EV, ST_EV, ST_CM, STORE, PDL)


@gluon.jit
def wgrad_update_group_kernel(dy_desc0, dy_desc1, dy_desc2, dy_desc3, x_desc0, x_desc1, x_desc2, x_desc3, w_ptr,
                              {state_ptrs}g_ptr, {group_scalar_params}M, N, K, s1, s2, s3, {gdelta_params}
                              GROUP: gl.constexpr, STAGES: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr,
                              BIG: gl.constexpr, LD_EV: gl.constexpr, ST_EV: gl.constexpr, ST_CM: gl.constexpr,
                              STORE: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
                              PDL: gl.constexpr = 0):
    BN: gl.constexpr = dy_desc0.block_type.shape[1]
    BK: gl.constexpr = x_desc0.block_type.shape[1]
    gl.static_assert(num_warps == 4)
    gl.static_assert((BN // 2) % R == 0 and R % 4 == 0)
    K = gl.multiple_of(K, 8)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar = _split_smem1(dy_desc0, x_desc0, STAGES, DW_LAYOUT)

    gl.warp_specialize([
        (_split_mma, (dy_desc0, x_desc0, a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar, M, num_tiles, STAGES, 1)),
        (_group_epi, (w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {group_scalar_params}N, K, num_tiles, num_n, num_k, s1,
                      s2, s3, {gdelta_params}0, BN, BK, GROUP, R, AHEAD, BIG, LD_EV, ST_EV, ST_CM, STORE, PDL)),
        (_group_epi1, (w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {group_scalar_params}N, K, num_tiles, num_n, num_k, s1,
                       s2, s3, {gdelta_params}BN, BK, GROUP, R, AHEAD, BIG, LD_EV, ST_EV, ST_CM, STORE, PDL)),
        (_group_loader, (dy_desc0, dy_desc1, dy_desc2, dy_desc3, x_desc0, x_desc1, x_desc2, x_desc3, a_bufs, b_bufs,
                         ready, empty, M, num_tiles, num_n, num_k, s1, s2, s3, GROUP, STAGES, PDL)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
'''


def render_group_source(ep, table: bool = False) -> str:
    """The grouped kernel's module for one rule's epilogue: the split kernel's module (its pieces: _rule, tile
    order, GEMM ring and MMA warpgroup, chunk loads/stores) followed by _GROUP_KERNEL. ``table``: the rule's scalars
    come from each member's row of a device table (``scal_ptr`` = member 0's row, ``sq1..sq3`` the increments to
    the next members' rows in elements), loaded per tile by the epilogue warpgroups; else one set of scalar
    arguments for the whole group."""
    fields = wg.render_fields(ep)
    n = ep.n_kernel_scalars
    if table:
        # the member's scalars are reloaded at every chunk (L1 hits: a 32-byte row kept with evict_last), not once
        # per tile: held across the tile's chunks they took 7 uniform registers and pushed the first epilogue
        # warpgroup's tile offsets to local memory, 4 LDL per chunk on its store path (sm_90 SASS, stop 28), and
        # their load latency stood right after each dW wait; the host-scalar variant likewise rereads its scalars
        # (kernel arguments) at every chunk. Per chunk ptxas issues them 130-215 instructions ahead of their use.
        scal = dict(group_scalar_params="scal_ptr, sq1, sq2, sq3, ", group_scalar_loads=(
            " " * 12 + "sro = _delta(base[2], sq1, sq2, sq3)\n"
            + "".join(f"            c{i} = gl.load(scal_ptr + sro + {i}, eviction_policy=\"evict_last\")\n"
                      for i in range(n))))
    else:
        scal = dict(group_scalar_params="".join(f"c{i}, " for i in range(n)), group_scalar_loads="")
    arrays = ["w", *ep.tensor_inputs[2:]]
    # the offsets are int32 16-byte units (group_reason: arrays within 32 GiB): two fewer registers each than an
    # int64, and the scale by 4 elements keeps the pointers' 16-byte alignment provable
    cur = [f"{a}_ptr + _delta(base[2], {a}_e1, {a}_e2, {a}_e3).to(gl.int64) * 4" for a in arrays]
    nxt = [f"{a}_ptr + _delta(gn, {a}_e1, {a}_e2, {a}_e3).to(gl.int64) * 4" for a in arrays]
    # the side output (STORE=2: the new W's bf16/fp16 copy, 8 elements per 16 bytes) has its offsets last
    group = dict(
        gdelta_params="".join(f"{a}_e{j}, " for a in arrays + ["g"] for j in (1, 2, 3)),
        ptrs_cur="".join(f"{p}, " for p in cur),
        ptrs_nx="".join(f"{p}, " for p in nxt),
        gptr_cur="g_ptr + _delta(base[2], g_e1, g_e2, g_e3).to(gl.int64) * 8",
    )
    return wg.render_gluon_source(ep, "split") + _GROUP_KERNEL.format(**fields, **group, **scal)


_KERNELS: dict[tuple[str, bool], object] = {}
_LOCK = threading.Lock()


def _kernel_for(rule: Rule, table: bool = False):
    key = (rule.name, table)
    kern = _KERNELS.get(key)
    if kern is None:
        ep, src, why = wg._source_for(rule)
        if src is None:
            raise wg.GluonUnsupported(why)
        mod = load_kernel_module(render_group_source(ep, table),
                                 f"gluon_group_{'table_' if table else ''}{ep.source_key}")
        with _LOCK:
            _KERNELS.setdefault(key, mod.wgrad_update_group_kernel)
    return _KERNELS[key]


def member_inputs(x, g: int) -> list:
    """Each member's X: ``x`` is one tensor all G members read (q/k/v, gate/up) or a list of one per member (o with
    q/k/v: same shape, different values); a list of one (the ops' ``xs``) is read by all."""
    xs = [x] if isinstance(x, torch.Tensor) else list(x)
    return xs * g if len(xs) == 1 else xs


def group_reason(weights, dys_t, x, states_list, hparams_list, rule: Rule, config: wg.GConfig | None = None,
                 check_device: bool = True, tables=None, check_scalars: bool = True, side_outs=None) -> str | None:
    """None when these G members can run as one ``launch_group``, else why not (the caller then launches them one
    by one). ``dys_t[g]`` is member g's dY transposed ([N_g, M]), ``states_list[g]`` its rule states,
    ``hparams_list[g]`` its hyperparameters -- or, with ``tables`` (member g's scalar-table row each), its tensor
    states alone and no hyperparameters. ``check_device=False`` skips what needs an sm_90 GPU (CPU tests of the
    structural checks); ``check_scalars=False`` skips comparing the members' scalars (try_launch_group compares
    them at every call: they change with the step)."""
    g = len(weights)
    if not 2 <= g <= G_MAX:
        return f"{g} members (2 to {G_MAX} per launch)"
    if tables is not None:
        hparams_list = [[]] * g if not hparams_list else hparams_list
    if not (len(dys_t) == len(states_list) == len(hparams_list) == g) or (tables is not None and len(tables) != g):
        return "weights, dys_t, states, hparams and tables differ in length"
    cfg = config or group_config()
    if cfg.epi != "split":
        return f"config {cfg.epi!r}: the grouped kernel is the split kernel"
    k = weights[0].shape[1] if weights[0].dim() == 2 else None
    if k is None or k % 8:
        return f"K = {k}: a multiple of 8 (16-byte rows)"
    xs = member_inputs(x, g)
    if len(xs) != g:
        return f"{len(xs)} inputs X for {g} members"
    if any(xi.dtype == torch.float32 for xi in xs):
        # the single kernel's fp32 (TF32) path reads K-major copies; the grouped loader reads token-major panels
        return "fp32 activations (the grouped kernel takes 2-byte activations)"
    for i, (w, dy_t, xi) in enumerate(zip(weights, dys_t, xs)):
        if w.dim() != 2 or w.shape[1] != k:
            return f"member {i}: weight {list(w.shape)}, not [N, {k}] like member 0"
        if xi.shape != xs[0].shape or xi.dtype != xs[0].dtype or xi.device != xs[0].device:
            return (f"member {i}: X {list(xi.shape)} {xi.dtype} differs from member 0's {list(xs[0].shape)} "
                    f"{xs[0].dtype}")
        if dy_t.dim() != 2 or dy_t.shape[0] != w.shape[0] or dy_t.shape[1] != xi.shape[0]:
            return f"member {i}: dy_t {list(dy_t.shape)} does not match weight {list(w.shape)} and M = {xi.shape[0]}"
        if i < g - 1 and w.shape[0] % cfg.bn:
            return f"member {i}: N = {w.shape[0]} is not a multiple of {cfg.bn} (only the last member's may be)"
        if w.device != weights[0].device:
            return f"member {i} is on {w.device}, member 0 on {weights[0].device}"
    if sum(w.shape[0] for w in weights) >= _NO_START:
        return "more than 2^31 - 1 stacked rows"
    if side_outs is not None:
        if len(side_outs) != g:
            return "one side output per member"
        for i, (w, so) in enumerate(zip(weights, side_outs)):
            if (so.dtype not in (torch.bfloat16, torch.float16) or so.dtype != side_outs[0].dtype
                    or so.shape != w.shape or not so.is_contiguous() or so.device != w.device):
                return (f"member {i}: the side output must be the weight's bf16/fp16 copy (contiguous, its shape), "
                        "one dtype for all")
    try:
        offsets = _member_offsets(weights, states_list, rule, k, tables, side_outs)
    except ValueError as e:   # states that do not match the rule
        return str(e)
    if offsets is None:
        return "arrays not 16-byte aligned, or more than 32 GiB apart (the kernel's int32 offsets)"
    ep, src, why = wg._source_for(rule)
    if src is None:
        return why
    if tables is None:
        if check_scalars and (why := _scalars_differ(ep, rule, states_list, hparams_list)):
            return why
    else:
        if _row_increments(tables) is None:
            return "table rows not in one fp32 table within int32 element offsets"
        for i, (w, tab) in enumerate(zip(weights, tables)):
            try:
                check_table(ep, tab, w)
            except ValueError as e:
                return f"member {i}: {e}"
    if check_device:
        for i, (w, dy_t, st) in enumerate(zip(weights, dys_t, states_list)):
            why = wg.gluon_reason(w, dy_t, xs[i], st, rule, None if side_outs is None else side_outs[i],
                                  table=None if tables is None else tables[i])
            if why is not None:
                return f"member {i}: {why}"
    return None


def _scalars_differ(ep, rule: Rule, states_list, hparams_list) -> str | None:
    """Why the members' host scalars (kernel scalars and new scalar states) are not all member 0's, or None: one
    launch takes one set of them."""
    first = host_scalars(ep, split_states(rule, states_list[0])[1], hparams_list[0])
    for i, (st, hp) in enumerate(zip(states_list[1:], hparams_list[1:]), 1):
        scal = host_scalars(ep, split_states(rule, st)[1], hp)
        if scal != first:
            return f"member {i}'s scalars {scal[0]} differ from member 0's {first[0]} (hyperparameters or step)"
    return None


def _increments(offs: list) -> list[int]:
    """The kernel's three increments (member g's offset minus member g-1's, g = 1..3; 0 past the last member)."""
    offs = offs + [offs[-1]] * (G_MAX - len(offs))
    return [offs[j] - offs[j - 1] for j in (1, 2, 3)]


def _row_increments(tables) -> list[int] | None:
    """sq1..sq3: element offsets from member g-1's table row to member g's (0 past the last member), or None."""
    offs = []
    for t in tables:
        d = t.data_ptr() - tables[0].data_ptr()
        if d % 4:
            return None
        offs.append(d // 4)
    incs = _increments(offs)
    return incs if all(-2 ** 31 <= v < 2 ** 31 for v in offs + incs) else None


def _member_offsets(weights, states_list, rule: Rule, k: int, tables=None, side_outs=None) -> list[int] | None:
    """Per array (W, each tensor state, then the side output: the kernel's g_ptr), member g's element offset from
    member 0's pointer minus its first row's (start_g * K), in 16-byte units, as increments from member g-1 for
    g = 1, 2, 3 (the kernel adds those its tile's row has passed; absent members add 0); the side output's are 0
    without one. None when an array is not 16-byte aligned or an offset leaves int32."""
    arrays = [[w, *split_states(rule, st, None if tables is None else tables[g])[0]]
              + ([side_outs[g]] if side_outs is not None else [])
              for g, (w, st) in enumerate(zip(weights, states_list))]
    incs, every, start = [], [], [sum(w.shape[0] for w in weights[:g]) for g in range(len(weights))]
    for a in range(len(arrays[0])):
        offs = []
        for g, arr in enumerate(arrays):
            d = arr[a].data_ptr() - arrays[0][a].data_ptr()
            if d % 16 or arr[a].data_ptr() % 16:
                return None
            size = arr[a].element_size()       # 4 (fp32 W/states), 2 (the cast copy): 16 // size per unit
            # K % 8 == 0: start_g * K is a whole number of 16-byte units for either size
            offs.append((d // size - start[g] * k) // (16 // size))
        incs += _increments(offs)
        every += offs
    if side_outs is None:
        incs += [0, 0, 0]
    if any(not -2 ** 31 <= v < 2 ** 31 for v in every + incs):
        return None
    return incs


def _prepare(weights, dys_t, x, states_list, hparams_list, rule: Rule, config: wg.GConfig | None = None,
             max_ctas: int | None = None, check_device: bool = True, tables=None, side_outs=None):
    """(kernel, grid, args, opts, scalar states, their new values): ValueError when ``group_reason`` refuses.
    check_device=False: benchmarks/compile_sm90.py prepares launches on CPU tensors to compile them."""
    why = group_reason(weights, dys_t, x, states_list, hparams_list, rule, config, check_device, tables,
                       side_outs=side_outs)
    if why is not None:
        raise ValueError(f"forge: weights cannot share one grouped launch: {why}")
    return _bind(_static(weights, dys_t, x, states_list, rule, config, max_ctas, tables, side_outs), weights, dys_t,
                 x, states_list, hparams_list, rule, tables, side_outs)


def _static(weights, dys_t, x, states_list, rule: Rule, config, max_ctas, tables, side_outs=None):
    # what depends only on the tensors' addresses and shapes: the launch memo's entry
    cfg = config or group_config()
    m, k = member_inputs(x, len(weights))[0].shape
    ns = [w.shape[0] for w in weights]
    n_tot = sum(ns)
    starts = [sum(ns[:i]) for i in range(len(ns))]
    ts0 = split_states(rule, states_list[0], None if tables is None else tables[0])[0]
    tiles = -(-n_tot // cfg.bn) * -(-k // cfg.bk)
    ld_ev, st_ev, st_cm = wg._EVICT[cfg.evict]
    opts = dict(GROUP=cfg.group, STAGES=cfg.stages, R=cfg.epi_m, AHEAD=wg.smem_ahead(cfg, 1 + len(ts0)),
                BIG=-(-n_tot // cfg.bn) * cfg.bn * k >= 2 ** 31, LD_EV=ld_ev, ST_EV=st_ev, ST_CM=st_cm,
                STORE=0 if side_outs is None else 2, CONSUMER_REGS=cfg.cregs, num_warps=4, maxnreg=cfg.maxnreg,
                enable_fp_fusion=False)
    opts.update(wg.pdl_opts(cfg))
    tail = (m, n_tot, k, *(starts[1:] + [_NO_START] * (G_MAX - len(ns))),
            *_member_offsets(weights, states_list, rule, k, tables, side_outs))
    grid = (max(1, min(max_ctas or wg._num_sms(weights[0].device), tiles)),)
    return (_kernel_for(rule, tables is not None), grid, opts, cfg, tail,
            None if tables is None else _row_increments(tables))


def _bind(static, weights, dys_t, x, states_list, hparams_list, rule: Rule, tables, side_outs=None):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    kernel, grid, opts, cfg, tail, sq = static
    xs = member_inputs(x, len(weights))
    m, k = xs[0].shape
    a_l, b_l, _ = wg._smem_layouts(cfg, xs[0].dtype)
    # descriptors per call, not memoized: they hold their tensors, and a memo would keep every dY alive
    descs = [TensorDescriptor(dy_t, [m, w.shape[0]], [w.shape[0], 1], [cfg.bmt, cfg.bn], a_l)
             for dy_t, w in zip(dys_t, weights)]
    descs += [descs[0]] * (G_MAX - len(descs))
    x_descs = []
    for i, xi in enumerate(xs):    # members reading one X share its descriptor
        same = next((j for j in range(i) if xs[j] is xi), None)
        x_descs.append(x_descs[same] if same is not None else TensorDescriptor(xi, [m, k], [k, 1], [cfg.bmt, cfg.bk],
                                                                                b_l))
    x_descs += [x_descs[0]] * (G_MAX - len(x_descs))
    w0 = weights[0]
    g0 = w0 if side_outs is None else side_outs[0]
    if tables is not None:
        ts0 = split_states(rule, states_list[0], tables[0])[0]
        args = (*descs, *x_descs, w0, *ts0, g0, tables[0], *sq, *tail)
        return kernel, grid, args, opts, [], []
    ep = wg._source_for(rule)[0]
    per = [split_states(rule, st) for st in states_list]
    scalars, new = host_scalars(ep, per[0][1], hparams_list[0])
    args = (*descs, *x_descs, w0, *per[0][0], g0, *scalars, *tail)
    return kernel, grid, args, opts, [s for _, sc in per for s in sc], list(new) * len(per)


def launch_group(weights, dys_t, x, states_list, hparams_list, rule: Rule, *, config: wg.GConfig | None = None,
                 max_ctas: int | None = None, tables=None, side_outs=None) -> None:
    """Update every member in one launch (ValueError, before anything runs, when ``group_reason`` refuses); each
    member's scalar states advance as its own launch would advance them. ``tables``: member g's scalar-table row
    each (``states_list`` then holds the tensor states alone, ``hparams_list`` is ignored). ``side_outs``: member
    g's bf16/fp16 copy of its new W each (compile_train_step(cast_weights_in_update=True))."""
    kernel, grid, args, opts, scalar_states, new = _prepare(weights, dys_t, x, states_list, hparams_list, rule,
                                                            config, max_ctas, tables=tables, side_outs=side_outs)
    kernel[grid](*args, **opts)
    with torch.no_grad():
        for s, v in zip(scalar_states, new):
            s.fill_(v)


# try_launch_group's memo: (rule, kernel mode, the tensors' addresses / shapes / strides / dtypes) -> the launch's
# static part, or why these members cannot share a launch. A step's backward repeats the same tensors every step.
_MEMO: dict = {}
_MEMO_SIZE = 4096


def _key(weights, dys_t, x, states_list, rule: Rule, tables, side_outs):
    def t(v):
        return (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype, v.device) if v.dim() else None

    return (rule.name, wg._mode(), tables is not None, tuple(map(t, member_inputs(x, len(weights)))),
            tuple(map(t, weights)), tuple(map(t, dys_t)),
            tuple(tuple(map(t, st)) for st in states_list),
            None if tables is None else tuple(map(t, tables)), None if side_outs is None else tuple(map(t, side_outs)))


def try_launch_group(weights, dys_t, x, states_list, hparams_list, rule: Rule, tables=None, side_outs=None) -> bool:
    """One grouped launch if these members can share it -- the op's path: False (nothing done) sends the caller to
    the members' own launches. The checks run once per set of tensors (memoized); the members' scalars are compared
    at every call (the step advances them)."""
    key = _key(weights, dys_t, x, states_list, rule, tables, side_outs)
    hit = _MEMO.get(key)
    if hit is None:
        why = group_reason(weights, dys_t, x, states_list, hparams_list, rule, tables=tables, check_scalars=False,
                           side_outs=side_outs)
        if why is None:
            try:
                hit = _static(weights, dys_t, x, states_list, rule, None, None, tables, side_outs)
            except Exception as e:   # the kernel module did not build (another triton's Gluon API)
                why = f"grouped kernel failed: {type(e).__name__}: {str(e)[:300]}"
        hit = why if why is not None else hit
        with _LOCK:
            if len(_MEMO) >= _MEMO_SIZE:
                _MEMO.clear()
            _MEMO[key] = hit
        if why is not None:
            log.debug("forge: grouped launch refused: %s", why)
    if isinstance(hit, str):
        return False
    if tables is None and _scalars_differ(wg._source_for(rule)[0], rule, states_list, hparams_list):
        return False
    try:
        kernel, grid, args, opts, scalar_states, new = _bind(hit, weights, dys_t, x, states_list, hparams_list, rule,
                                                             tables, side_outs)
        kernel[grid](*args, **opts)
    except Exception as e:   # a build/compile failure (another triton's Gluon API): nothing ran, never again here
        with _LOCK:
            _MEMO[key] = f"grouped kernel failed: {type(e).__name__}: {str(e)[:300]}"
        log.warning("forge: grouped wgrad kernel failed, launching the members one by one: %s: %s",
                    type(e).__name__, str(e)[:300])
        return False
    with torch.no_grad():
        for s, v in zip(scalar_states, new):
            s.fill_(v)
    return True


def bound_launch_group(weights, dys_t, x, states_list, hparams_list, rule: Rule, *,
                       config: wg.GConfig | None = None, max_ctas: int | None = None, tables=None, side_outs=None):
    """(benchmarks) A zero-argument callable launching the kernel alone, host part done once; scalar states are NOT
    advanced by it."""
    kernel, grid, args, opts, _, _ = _prepare(weights, dys_t, x, states_list, hparams_list, rule, config, max_ctas,
                                              tables=tables, side_outs=side_outs)
    return lambda: kernel[grid](*args, **opts)


# ----------------------------------------------------------------------------------------------------
# the ops: forge::wgrad_update_group_ and its scalar-table variant (passes/wgrad_update_group.py emits them)
#
# Members' states and hyperparameters are flattened (member g's at g * len(rule.states) ...), since a schema has
# no list of lists. Where the members cannot share a launch (CPU, another GPU, different scalars, a shape the
# kernel does not take), the op runs each member's own forge::wgrad_update_ path: the same result either way.
_LIB = torch.library.Library("forge", "FRAGMENT")
_LIB.define("wgrad_update_group_(Tensor(a!)[] weights, Tensor[] dys_t, Tensor[] xs, Tensor(b!)[] states, "
            "Tensor[] hparams, str rule, Tensor(c!)[]? cast_outs=None) -> ()", tags=_compat.cudagraph_unsafe_tags())
_LIB.define("wgrad_update_group_table_(Tensor(a!)[] weights, Tensor[] dys_t, Tensor[] xs, Tensor(b!)[] states, "
            "Tensor[] scalars, str rule, Tensor(c!)[]? cast_outs=None) -> ()")


def _split(flat, g: int) -> list:
    n = len(flat) // g
    return [list(flat[i * n:(i + 1) * n]) for i in range(g)]


def wgrad_update_group_(weights, dys_t, xs, states, hparams, rule, cast_outs=None):
    from .wgrad_update import wgrad_update

    r = get_rule(rule)
    g = len(weights)
    x = list(xs)
    sts, hps = _split(states, g), _split(hparams, g)
    casts = list(cast_outs) if cast_outs is not None else None
    if not (weights[0].is_cuda and try_launch_group(list(weights), list(dys_t), x, sts, hps, r, side_outs=casts)):
        counters["member_launches"] += g
        for i, (w, dy_t, xi, st, hp) in enumerate(zip(weights, dys_t, member_inputs(x, g), sts, hps)):
            wgrad_update(w, dy_t, xi, st, hp, rule, cast_out=None if casts is None else casts[i])
    else:
        counters["grouped_launches"] += 1
    torch.autograd.graph.increment_version([*weights, *states, *(casts or [])])


def wgrad_update_group_table_(weights, dys_t, xs, states, scalars, rule, cast_outs=None):
    from .wgrad_update import wgrad_update_table

    g = len(weights)
    x = list(xs)
    sts = _split(states, g)
    casts = list(cast_outs) if cast_outs is not None else None
    if not (weights[0].is_cuda and try_launch_group(list(weights), list(dys_t), x, sts, [], get_rule(rule),
                                                    tables=list(scalars), side_outs=casts)):
        counters["member_launches"] += g
        for i, (w, dy_t, xi, st, row) in enumerate(zip(weights, dys_t, member_inputs(x, g), sts, scalars)):
            wgrad_update_table(w, dy_t, xi, st, row, rule, None if casts is None else casts[i])
    else:
        counters["grouped_launches"] += 1
    torch.autograd.graph.increment_version([*weights, *states, *(casts or [])])


_LIB.impl("wgrad_update_group_", wgrad_update_group_, "CompositeExplicitAutograd")
_LIB.impl("wgrad_update_group_table_", wgrad_update_group_table_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::wgrad_update_group_", lib=_LIB)
def _(weights, dys_t, xs, states, hparams, rule, cast_outs=None):
    return None


@torch.library.register_fake("forge::wgrad_update_group_table_", lib=_LIB)
def _(weights, dys_t, xs, states, scalars, rule, cast_outs=None):
    return None
