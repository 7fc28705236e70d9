"""Gluon (Hopper, sm_90) implementation of ``forge::wgrad_update_``: warp-specialized, persistent, ping-pong.

Read top to bottom: the kernel template (from the v4 prototype, benchmarks/NOTES_kernel.md), its render step (the
rule's epilogue from epilogue_codegen, tl.* spellings turned into gl.*), the launcher, then ``use_gluon``: whether a
launch can take this path. Anything it cannot do exactly goes to the Triton kernel (wgrad_update_triton).

Design (NOTES_kernel.md v4/v5): persistent grid (<= one CTA per SM), [128, 128] tiles of dW in grouped order.
Partitions: two consumer warpgroups take the CTA's even / odd tiles (wgmma over all of M, accumulator in registers,
then the tile's epilogue), so one's HBM-bound epilogue overlaps the other's MMAs; a 1-warp GEMM loader fills a
STAGES-deep TMA ring with dY [64 tokens, 128] (the contiguous dY, permuted in smem into the MN-major A operand) and
X [64, 128]; a 1-warp epilogue loader fills an ES-deep ring with chunks [EPI_M, EPI_N] of W and every tensor state
(default [64, 32]: 128 contiguous bytes per row; v7 measured [128, 16] 2-5 % slower), so those reads are in flight
during the MMAs (GConfig.nring=2: one ring and loader per consumer, no epi turn; measured slower). Per chunk, the
consumer reads W/states from smem straight into the accumulator chunk's register layout, runs the rule, writes the
results (and dW when STORE_GRAD) back into the slot and TMA-stores them; TMA zero-fills loads past N/K/M and clips
stores, so ragged shapes need no masks. Selectable, not picked (NOTES_kernel.md v8): band chunks (GConfig.epi_m=8:
rows 16 w + i of the wgmma layout, 256 B per row and box pair). Refused: the out ring (GConfig.eout), which raced.
Where the time goes (v9): with no GEMM work (M=64) the epilogue streams W/states at ~3.3 TB/s whatever the ring
depth (3-8 slots) or ring count, against 3.7 TB/s for torch's fused AdamW and 4.27 TB/s for a copy.

v10, selectable and NOT picked (GConfig(epi="vec"), ``vec_config()``; prepared on CPU, not yet measured): no
epilogue ring and no epilogue loader (partitions: the two consumers + the GEMM loader; all smem to GEMM stages, 6
by default). Per [32, 32] chunk of dW (the accumulator split register-only: rows 16 w + 8 h + i of a 64-row band),
the consumer gl.load-s W/states of the NEXT chunk (16-byte vectors, a BlockedLayout of 8 threads per 128 B row,
masks row < N, col < K; int64 offsets when N * K nears 2^31), converts its dW chunk into that layout
(gl.convert_layout, within each warp), runs the same _rule and gl.store-s the results (and dW). No epi turn: the two
consumers' epilogues overlap. [32, 32] because the rolled loop keeps the accumulator's 128 registers live: [64, 32]
chunks spilled. The module is rendered from the same pieces (_HEAD: _rule, _tile_coords, _gemm_loader, _tile_mma;
_SPLITS) as the tma kernel's.

v11, picked for 3-array rules (AdamW) at M <= 512 (GConfig(epi="smem"), ``smem_config()``; v10 measured slower
than the TMA ring at M <= 256, latency-bound with one [32, 32] chunk of loads in flight): each
consumer stores its accumulator into its own [128, 128] fp32 smem tile (2 x 64 KB; 2-3 GEMM stages), which frees
the accumulator's registers for the whole epilogue; the epilogue walks [R, 128] row chunks (R 8 or 16) in a
16-byte-vector blocked layout, W/states loaded ``ahead`` (1-2) chunks before their math, the lookahead carried into
the consumer's next tile; same _rule, masks, int64 offsets and K % 8 hint as v10.

v12, picked for 3-array rules above M=512 and 2-array rules above M=1024 (GConfig(epi="split"), ``split_config()``):
the roles split. One MMA warpgroup runs every tile's GEMM back to back and parks dW in one [128, 128] fp32 smem
tile; two epilogue warpgroups stream W/states for half the tile's rows each with v11's chunk code; a "full" /
"empty" mbarrier pair hands the tile over. In the ping-pong kernels only one consumer streams while the other runs
its GEMM (Nsight Compute: DRAM 35-57 % idle), here both epilogue warpgroups stream all the time. 160 KB of GEMM
stages beside the dW tile; 16 warps (triton pads the loader's warp to a warpgroup) launched at maxnreg 128 and
rebalanced by setmaxnreg (epilogue 152, MMA 184). ``stream=False`` is an overlap diagnostic (never picked).

Overlap diagnostic, selectable and NOT picked (GConfig(epi="gemm"), ``gemm_config()``; measured, NOTES_kernel.md):
the tma kernel's GEMM schedule (same loader, _tile_mma, mma turn, tile order, stages) with no epilogue
traffic at all -- each tile's 128 row sums of dW are stored to a small fp32 array (``gemm_sums_shape``) so every
wgmma stays live -- to tell how much of the fused kernel's time its GEMM schedule alone takes (NOTES_kernel.md).

Exactness: the rule's math is epilogue_codegen's generated code for the "cuda" target, i.e. the same per-op
formulas (spelled-out FMAs, div_rn/sqrt_rn, libdevice, host reciprocals) the Triton kernel uses, compiled with
``enable_fp_fusion=False``: W/states are bit-identical to eager ``rule.fn`` on the dW the kernel computed.

triton.experimental.gluon is imported only by the rendered module, on the first launch that can use it: CI and the
CPU machine (triton 3.9 / the interpreter) never import it. Written against triton 3.6's Gluon API.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import threading
from collections import Counter

import torch

from ..optim.rule import Rule
from .epilogue_codegen import Epilogue, EpilogueUnsupported, compile_epilogue, key_load, load_kernel_module, scalar_fields
from .stochastic_round import GLUON_SROUND, TABLE_KEY
from .wgrad_update_triton import SIDE_CAST, SIDE_GRAD, check_side_out, fp32_dot_precision, side_mode, split_states

log = logging.getLogger(__name__)
# launches prepared as programmatic dependents ("pdl_prepared"; a remembered launch is prepared once)
counters: Counter = Counter()

__all__ = ["use_gluon", "gluon_reason", "try_launch", "launch", "bound_launch", "render_gluon_source",
           "GluonUnsupported", "GConfig", "pick_gconfig", "gconfig_smem", "chunk_bytes", "ring_budget", "ENV",
           "AUTO_GLUON", "vec_config", "VEC_STAGES", "smem_config", "SMEM_STAGES",
           "smem_ahead", "SMEM_AHEAD_REGS", "gemm_config", "gemm_sums_shape", "split_config",
           "SPLIT_STAGES", "pick_for", "POINTER_EPIS", "EXTRA_ENV", "SR_ROW_VEC", "takes_rounded"]

ENV = "FORGE_WGRAD_KERNEL"   # auto | gluon | triton
# What "auto" picks on sm_90 when the Gluon path can take the launch (H200, benchmarks/NOTES_kernel.md v5-v6):
# Gluon, measured against the Triton kernel at M = 256..8192: SGD-momentum 1.07-1.25x, Lion 1.10-1.27x, and exact
# AdamW (rolled chunk loop, v6) 0.99x at 4096x4096 M=256 and 1.02-1.22x at the 9 other points on 4096x4096 and
# 14336x4096. Rules calling libdevice (exp/log/pow) were never timed through Gluon: they stay on Triton.
AUTO_GLUON = True
# Epilogues with these long correctly-rounded sequences run their chunk loop rolled (v6: unrolled, AdamW's kernel
# overflowed the instruction cache).
_ROLL_OPS = ("div_rn", "sqrt_rn", "libdevice")
_AUTO_TRITON_OPS = ("libdevice",)


class GluonUnsupported(Exception):
    """The rule's generated epilogue uses something the Gluon render step has no spelling for."""


# The kernel modules are rendered from pieces: _HEAD (imports, the rule, tile order, GEMM loader, a tile's GEMM) and
# _SPLITS (register-only chunk splits of the accumulator) are shared; _TMA_LOADERS + _TMA_KERNEL are the TMA-ring
# epilogue (GConfig.epi="tma"), _VEC_KERNEL the vector-load epilogue (epi="vec", v10); after _HEAD and _SMEM_EPI
# (row-chunk streaming of W/states with dW read from smem) _SMEM_KERNEL is dW through smem (epi="smem", v11) and
# _SPLIT_KERNEL one MMA + two epilogue warpgroups (epi="split", v12); _GEMM_KERNEL (after _HEAD alone) the GEMM
# schedule with no epilogue traffic (epi="gemm", the overlap diagnostic). _TEMPLATE is the
# tma kernel's module in its historical order; the only change to its text in v10 is _tile_mma factored out of
# _consumer, and its sm_90 SASS is instruction-for-instruction the same as before (every catalogue rule, NOTES v10).
_HEAD = '''\
# Generated by forge_compile.kernels.wgrad_update_gluon for rule {rule!r}. Do not edit.
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

PROPAGATE_ALL = gl.constexpr(tl.PropagateNan.ALL)
# rolled epilogue chunk loop: for rules with correctly rounded div/sqrt or libdevice (long per-element code)
ROLL_EPILOGUE = gl.constexpr({roll})


@gluon.jit
def _rule(p, g, {state_vars}{scalar_params}):
{body}
    return {outputs}


@gluon.jit
def _tile_coords(t, num_n, num_k, GROUP: gl.constexpr):
    # grouped order: GROUP row-tiles of dW share their dY panels while sweeping the columns
    in_group = GROUP * num_k
    first_n = (t // in_group) * GROUP
    gs = gl.minimum(num_n - first_n, GROUP)
    pid_n = first_n + (t % in_group) % gs
    pid_k = (t % in_group) // gs
    return pid_n, pid_k


@gluon.jit
def _gdc_wait():
    # programmatic dependent launch (GConfig.pdl): wait until the kernel before this one has completed and its
    # writes are visible (PTX griddepcontrol.wait; a no-op in a plain launch)
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _gemm_loader(dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k,
                 GROUP: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr = 0, KMAJOR: gl.constexpr = False):
    if KMAJOR:
        # fp32 activations under TF32 (_prepare): the descriptors are over dY^T [N, M] and X^T [K, M] copies,
        # tokens contiguous -- tf32 wgmma takes only K-major operands, and TMA cannot transpose 4-byte elements
        BMT: gl.constexpr = dy_desc.block_type.shape[1]
        BN: gl.constexpr = dy_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[0]
    else:
        BMT: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
    if PDL > 0:
        # launched as a programmatic dependent of the kernel before it (GConfig.pdl): dY and X may be its output,
        # so the loader waits for it to complete (with PDL=2 the epilogue warpgroups' first W/state loads go ahead
        # meanwhile)
        _gdc_wait()
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    it = 0
    for t in range(pid, num_tiles, nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        for ks in range(ksteps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
            if KMAJOR:
                tma.async_copy_global_to_shared(dy_desc, [pid_n * BN, ks * BMT], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(x_desc, [pid_k * BK, ks * BMT], bar, b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(dy_desc, [ks * BMT, pid_n * BN], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(x_desc, [ks * BMT, pid_k * BK], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _tile_mma(a_bufs, b_bufs, ready, empty, mma_turn, turn_ph, it0, ksteps, CID: gl.constexpr,
              STAGES: gl.constexpr, acc_layout: gl.constexpr, TURN: gl.constexpr = True,
              KMAJOR: gl.constexpr = False):
    # one tile's GEMM over all of M (ring entries it0 ..): wait for this consumer's mma turn, wgmma each stage and
    # free the previous one, hand the turn over, drain; returns the [BN, BK] fp32 accumulator. TURN=False: the
    # only warpgroup issuing MMAs (epi="split"), no turn. KMAJOR: stages [BN, BMT] / [BK, BMT] (tokens contiguous;
    # _gemm_loader), the tf32 MMA on fp32 operands
    if KMAJOR:
        BN: gl.constexpr = a_bufs.type.shape[1]
        BK: gl.constexpr = b_bufs.type.shape[1]
    else:
        BN: gl.constexpr = a_bufs.type.shape[2]
        BK: gl.constexpr = b_bufs.type.shape[2]
    if TURN:
        mbarrier.wait(mma_turn.index(CID), turn_ph)
    acc = gl.zeros([BN, BK], gl.float32, acc_layout)
    for ks in range(ksteps):
        it = it0 + ks
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if KMAJOR:
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=ks > 0)
    if TURN:
        mbarrier.arrive(mma_turn.index(1 - CID))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((it0 + ksteps - 1) % STAGES))
    return acc


@gluon.jit
def _gemm_ring(dy_desc, x_desc, STAGES: gl.constexpr):
    # the GEMM operand ring of the kernels without an epilogue ring (vec, smem, gemm): dY / X stages, their
    # ready / empty barriers, and the mma turn the two consumers pass each other
    # stages shaped as the descriptors' blocks: [BMT, BN] / [BMT, BK], or [BN, BMT] / [BK, BMT] (KMAJOR)
    A0: gl.constexpr = dy_desc.block_type.shape[0]
    A1: gl.constexpr = dy_desc.block_type.shape[1]
    B0: gl.constexpr = x_desc.block_type.shape[0]
    B1: gl.constexpr = x_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, A0, A1], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, B0, B1], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mma_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(mma_turn.index(i), count=1)
    return a_bufs, b_bufs, ready, empty, mma_turn


@gluon.jit
def _offs_mask(rows, cols, t, num_tiles, N, K, BIG: gl.constexpr):
    # element offsets of rows x cols of a row-major [N, K] array (int64 when BIG: N * K may pass 2^31) and their
    # mask: inside the array, and tile t a real one (the loads ahead past a consumer's last tile are masked off)
    msk = ((rows < N) & (t < num_tiles))[:, None] & (cols < K)[None, :]
    if BIG:
        offs = rows.to(gl.int64)[:, None] * K + cols[None, :]
    else:
        offs = rows[:, None] * K + cols[None, :]
    return offs, msk


'''

_TMA_LOADERS = '''\
@gluon.jit
def _chunk_row(c, NCC: gl.constexpr, EPI_M: gl.constexpr, NB: gl.constexpr):
    # first row of chunk c in its tile; band chunks (NB > 1): band b = c // NCC holds rows b // 2 * 64 + b % 2 * 8
    # + 16 w + i (w < 4, i < 8)
    if NB > 1:
        b = c // NCC
        r = (b // 2) * 64 + (b % 2) * 8
    else:
        r = (c // NCC) * EPI_M
    return r


@gluon.jit
def _tma_in(desc, rc, cc, bar, buf, NB: gl.constexpr):
    # NB == 1: the chunk is one TMA box. NB > 1 (band chunks [32, EPI_N]): NB boxes [8, 32], i.e. per warp of the
    # wgmma layout (rows 16 w ..) NB / 4 boxes side by side: 128 B each, the 128 B swizzle's width (triton 3.6
    # splits wider boxes into such messages for loads but not for stores, so the split is spelled out here)
    if NB > 1:
        BOX_N: gl.constexpr = desc.block_type.shape[1]
        for w in gl.static_range(4):
            for h in gl.static_range(NB // 4):
                tma.async_copy_global_to_shared(desc, [rc + 16 * w, cc + h * BOX_N], bar,
                                                buf.slice(8 * w, 8).slice(h * BOX_N, BOX_N, dim=1))
    else:
        tma.async_copy_global_to_shared(desc, [rc, cc], bar, buf)


@gluon.jit
def _tma_out(desc, rc, cc, buf, NB: gl.constexpr):
    if NB > 1:
        BOX_N: gl.constexpr = desc.block_type.shape[1]
        for w in gl.static_range(4):
            for h in gl.static_range(NB // 4):
                tma.async_copy_shared_to_global(desc, [rc + 16 * w, cc + h * BOX_N],
                                                buf.slice(8 * w, 8).slice(h * BOX_N, BOX_N, dim=1))
    else:
        tma.async_copy_shared_to_global(desc, [rc, cc], buf)


@gluon.jit
def _epi_loader(w_desc, {state_descs}w_bufs, {state_bufs}e_ready, e_empty, num_tiles, num_n, num_k,
                BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, ES: gl.constexpr, NLOAD: gl.constexpr,
                CID: gl.constexpr, NRING: gl.constexpr, NB: gl.constexpr):
    # NRING == 2: the loader of consumer CID's own ring (slots CID * ES ..), walking only that consumer's tiles;
    # NRING == 1: one ring for both consumers, every tile of the CTA in order (v6)
    EPI_M: gl.constexpr = 32 if NB > 1 else w_desc.block_type.shape[0]   # chunk rows / cols (NB: see _tma_in)
    EPI_N: gl.constexpr = w_desc.block_type.shape[1] * (NB // 4) if NB > 1 else w_desc.block_type.shape[1]
    NCC: gl.constexpr = BK // EPI_N
    NCH: gl.constexpr = (BN // EPI_M) * NCC
    BASE: gl.constexpr = CID * ES
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    e = 0
    for t in range(pid + CID * nprog, num_tiles, NRING * nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        row0 = pid_n * BN
        col0 = pid_k * BK
        for c in range(NCH):
            s = BASE + e % ES
            mbarrier.wait(e_empty.index(s), ((e // ES) & 1) ^ 1)
            bar = e_ready.index(s)
            # TMA counts whole boxes, zero-filled past N/K, also for boxes entirely outside
            mbarrier.expect(bar, NLOAD * NB * w_desc.block_type.nbytes)
            rc = row0 + _chunk_row(c, NCC, EPI_M, NB)
            cc = col0 + (c % NCC) * EPI_N
            _tma_in(w_desc, rc, cc, bar, w_bufs.index(s), NB)
{epi_loads}
            e += 1


'''

_SPLITS = '''\
@gluon.jit
def _split_chunks(x, NROW: gl.constexpr, NSPLIT: gl.constexpr):
    # [R, C] -> NROW row bands x NSPLIT column chunks [R / NROW, C / NSPLIT], row-band major; register-only in the
    # wgmma layout (the row split takes the M-repetition bit: rows r and r + 64 are in the same thread)
    LOG: gl.constexpr = NSPLIT.bit_length() - 1
    xs = (x, )
    if NROW == 2:
        xs = x.reshape([2, x.shape[0] // 2, x.shape[1]]).permute(1, 2, 0).split()
    for _ in gl.static_range(LOG):
        nxt = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            nxt += y.reshape([y.shape[0], 2, y.shape[1] // 2]).permute(0, 2, 1).split()
        xs = nxt
    return xs


@gluon.jit
def _split_bands(x, NCC: gl.constexpr):
    # [128, 128] -> 4 * NCC band chunks [32, 128 / NCC], chunk (2 m + h) * NCC + j = rows m * 64 + h * 8 + 16 w + i
    # (row 8 w + i of the chunk; w < 4, i < 8), columns from j * 128 / NCC. In the wgmma layout m is the
    # M-repetition bit and h the row + 8 register bit, w the warp and i the lane's row: register-only, and each
    # warp's part is one [8, 128 / NCC] box.
    if NCC == 2:
        y = x.reshape([2, 4, 2, 8, 2, x.shape[1] // 2]).permute(1, 3, 5, 4, 2, 0)
    else:
        y = x.reshape([2, 4, 2, 8, x.shape[1]]).permute(1, 3, 4, 2, 0)
    LOG: gl.constexpr = 2 + (NCC == 2)
    xs = (y, )
    for _ in gl.static_range(LOG):
        nxt = ()
        for j in gl.static_range(len(xs)):
            nxt += xs[j].split()
        xs = nxt
    out = ()
    for j in gl.static_range(len(xs)):
        out += (xs[j].reshape([32, xs[j].shape[2]]), )
    return out


@gluon.jit
def _pick(xs, c, N: gl.constexpr):
    # xs[c] for a runtime c < N (N a power of 2): a tree of log2(N) selects per register
    LOG: gl.constexpr = N.bit_length() - 1
    ys = xs
    for lvl in gl.static_range(LOG):
        bit = ((c >> lvl) & 1) != 0
        nxt = ()
        for i in gl.static_range(len(ys) // 2):
            nxt += (gl.where(bit, ys[2 * i + 1], ys[2 * i]), )
        ys = nxt
    return ys[0]


'''

_TMA_KERNEL = '''\
@gluon.jit
def _epi_chunk(gch, c, e, base, obase, row0, col0, w_desc, {state_descs}g_desc, w_bufs, {state_bufs}g_bufs,
               wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, {scalar_params}BK: gl.constexpr, ES: gl.constexpr,
               NST: gl.constexpr, STORE_GRAD: gl.constexpr, NB: gl.constexpr, EOUT: gl.constexpr):
    # chunk c (ring entry e) of a tile's epilogue: W/states from the slot, the rule, TMA stores of the results.
    # EOUT == 0: results go back into the slot, and the previous chunk's slot returns to the epilogue loader once
    # its stores have read it. EOUT > 0: the slot returns as soon as its values are in registers, results leave
    # through an EOUT-deep out ring, so the loader's reads do not wait for this chunk's math and stores.
    EPI_M: gl.constexpr = 32 if NB > 1 else w_desc.block_type.shape[0]   # chunk rows / cols (NB: see _tma_in)
    EPI_N: gl.constexpr = w_desc.block_type.shape[1] * (NB // 4) if NB > 1 else w_desc.block_type.shape[1]
    NCC: gl.constexpr = BK // EPI_N
    rc = row0 + _chunk_row(c, NCC, EPI_M, NB)
    cc = col0 + (c % NCC) * EPI_N
    s = base + e % ES
    mbarrier.wait(e_ready.index(s), (e // ES) & 1)
    p = w_bufs.index(s).load(gch.type.layout)
{chunk_loads}
    if EOUT > 0:
        mbarrier.arrive(e_empty.index(s))
        o = obase + e % EOUT
        # out slot o's stores (EOUT chunks back, NST * NB bulk groups per chunk) have read it
        tma.store_wait((EOUT - 1) * NST * NB)
        w_out = wo_bufs.index(o)
{chunk_out_slots}
        g_out = go_bufs.index(o)
        if STORE_GRAD:
            # before the math: stored after it, the sm_90 compile spilled 36-52 B with dW
            g_out.store(gch)
    {new_vars} = _rule(p, gch, {state_vars}{scalar_params})
    if EOUT == 0:
        w_out = w_bufs.index(s)
{chunk_in_slots}
        g_out = g_bufs.index(s)
    w_out.store({new_p})
{chunk_stores}
    if STORE_GRAD and EOUT == 0:
        g_out.store(gch)
    fence_async_shared()
    _tma_out(w_desc, rc, cc, w_out, NB)
{chunk_tma_stores}
    if STORE_GRAD:
        _tma_out(g_desc, rc, cc, g_out, NB)
    if EOUT == 0:
        # the previous chunk's stores have read their slot: hand it back (at c == 0 only this chunk's stores are
        # in flight, the wait returns at once)
        tma.store_wait(NST * NB)
        mbarrier.arrive(e_empty.index(base + (e + ES - 1) % ES), pred=c > 0)


@gluon.jit
def _consumer(dy_desc, x_desc, w_desc, {state_descs}g_desc, a_bufs, b_bufs, ready, empty,
              w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, mma_turn, epi_turn,
              {scalar_params}M, num_tiles, num_n, num_k,
              CID: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, ES: gl.constexpr,
              NST: gl.constexpr, STORE_GRAD: gl.constexpr, NRING: gl.constexpr, NB: gl.constexpr,
              EOUT: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    EPI_M: gl.constexpr = 32 if NB > 1 else w_desc.block_type.shape[0]   # chunk rows / cols (NB: see _tma_in)
    EPI_N: gl.constexpr = w_desc.block_type.shape[1] * (NB // 4) if NB > 1 else w_desc.block_type.shape[1]
    NCH: gl.constexpr = (BN // EPI_M) * (BK // EPI_N)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BK, 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    j = CID   # index of the tile in the CTA's list (this consumer: every other one)
    r = 0     # this consumer's round
    obase = CID * EOUT if NRING == 2 else 0
    # Turn barriers (CUTLASS's order barrier): a consumer waits on a shared ring only after the other consumer
    # finished waiting on it for the previous tile. mbarrier waits compare phase parity only: without the turns
    # consumer 1 waits for a ring phase two phases ahead, which reads as complete at once (prototype run 1).
    # The GEMM ring is always shared (mma_turn); with NRING == 2 each consumer has its own epilogue ring and
    # loader, so the epilogues need no turn and overlap (v7: slower than one deeper shared ring, NOTES_kernel.md).
    for t in range(pid + CID * nprog, num_tiles, 2 * nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        row0 = pid_n * BN
        col0 = pid_k * BK
        turn_ph = (r & 1) ^ (1 - CID)
        it0 = j * ksteps
        acc = _tile_mma(a_bufs, b_bufs, ready, empty, mma_turn, turn_ph, it0, ksteps, CID, STAGES, acc_layout)
        if NRING == 1:
            mbarrier.wait(epi_turn.index(CID), turn_ph)
            e0 = j * NCH    # ring entries: every tile of the CTA
            base = 0
        else:
            e0 = r * NCH    # this consumer's tiles only
            base = CID * ES

        if NB > 1:
            gs = _split_bands(acc, BK // EPI_N)
        else:
            gs = _split_chunks(acc, BN // EPI_M, BK // EPI_N)
        if ROLL_EPILOGUE or NB > 1:
            # a rolled loop (runtime c, the chunk picked by selects): unrolled, each consumer held NCH copies of
            # the rule's code, 221 KB of SASS for AdamW (div.rn/sqrt.rn ~15 instructions + a slow-path branch
            # each), more than the instruction cache holds (NOTES_kernel.md v6); band chunks (NB TMA messages per
            # array per chunk) unrolled: Lion 154-156 KB, SGD-momentum 103-129 KB
            for c in range(NCH):
                _epi_chunk(_pick(gs, c, NCH), c, e0 + c, base, obase, row0, col0, w_desc, {state_descs}g_desc,
                           w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty,
                           {scalar_params}BK, ES, NST, STORE_GRAD, NB, EOUT)
        else:
            for c in gl.static_range(NCH):
                _epi_chunk(gs[c], c, e0 + c, base, obase, row0, col0, w_desc, {state_descs}g_desc,
                           w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty,
                           {scalar_params}BK, ES, NST, STORE_GRAD, NB, EOUT)
        if EOUT == 0:
            if NRING == 1:
                mbarrier.arrive(epi_turn.index(1 - CID))
            tma.store_wait(0)
            mbarrier.arrive(e_empty.index(base + (e0 + NCH - 1) % ES))
        else:
            # every slot is back already; with one ring the out ring is shared too, so its stores must have read
            # it before the other consumer gets the turn and writes into it
            tma.store_wait(0)
            if NRING == 1:
                mbarrier.arrive(epi_turn.index(1 - CID))
        j += 2
        r += 1


@gluon.jit
def _consumer1(dy_desc, x_desc, w_desc, {state_descs}g_desc, a_bufs, b_bufs, ready, empty,
               w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, mma_turn, epi_turn,
               {scalar_params}M, num_tiles, num_n, num_k,
               GROUP: gl.constexpr, STAGES: gl.constexpr, ES: gl.constexpr,
               NST: gl.constexpr, STORE_GRAD: gl.constexpr, NRING: gl.constexpr, NB: gl.constexpr,
               EOUT: gl.constexpr):
    _consumer(dy_desc, x_desc, w_desc, {state_descs}g_desc, a_bufs, b_bufs, ready, empty,
              w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, mma_turn, epi_turn,
              {scalar_params}M, num_tiles, num_n, num_k, 1, GROUP, STAGES, ES, NST, STORE_GRAD, NRING, NB, EOUT)


@gluon.jit
def wgrad_update_gluon_kernel(dy_desc, x_desc, w_desc, {state_descs}g_desc,
                              {kernel_scalar_params}M, N, K,
                              GROUP: gl.constexpr, STAGES: gl.constexpr, ES: gl.constexpr,
                              NLOAD: gl.constexpr, NST: gl.constexpr, STORE_GRAD: gl.constexpr,
                              NRING: gl.constexpr, NB: gl.constexpr, EOUT: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    gl.static_assert(num_warps == 4)
{scalar_loads}    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BMT, BN], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BMT, BK], x_desc.layout)
    NSLOT: gl.constexpr = NRING * ES
    # slots of one array: [NSLOT, EPI_M, EPI_N] (band chunks: [NSLOT, 32, EPI_N], see _tma_in)
    EPI_M: gl.constexpr = 32 if NB > 1 else w_desc.block_type.shape[0]
    EPI_N: gl.constexpr = w_desc.block_type.shape[1] * (NB // 4) if NB > 1 else w_desc.block_type.shape[1]
    SLOT: gl.constexpr = [NSLOT, EPI_M, EPI_N]
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, SLOT, w_desc.layout)
{alloc_states}
    if STORE_GRAD and EOUT == 0:
        g_bufs = gl.allocate_shared_memory(g_desc.dtype, SLOT, g_desc.layout)
    else:
        g_bufs = w_bufs   # never touched: no smem spent on it
    if EOUT > 0:
        OSLOT: gl.constexpr = [NRING * EOUT, EPI_M, EPI_N]
        wo_bufs = gl.allocate_shared_memory(w_desc.dtype, OSLOT, w_desc.layout)
{alloc_out_states}
        if STORE_GRAD:
            go_bufs = gl.allocate_shared_memory(g_desc.dtype, OSLOT, g_desc.layout)
        else:
            go_bufs = wo_bufs
    else:
        # never touched (EOUT == 0: results go back into the input slots)
        wo_bufs = w_bufs
{alias_out_states}
        go_bufs = w_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    e_ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    e_empty = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(NSLOT):
        mbarrier.init(e_ready.index(i), count=1)
        mbarrier.init(e_empty.index(i), count=1)
    mma_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(mma_turn.index(i), count=1)
        mbarrier.init(epi_turn.index(i), count=1)

    # Two spelled-out partition lists: the Gluon frontend takes the list only as a literal (a tuple of partitions
    # bound to a name fails: 'cannot convert JITFunction to tensor'); two rings add consumer 1's epilogue loader.
    if NRING == 1:
        gl.warp_specialize([
            (_consumer, (dy_desc, x_desc, w_desc, {state_descs}g_desc, a_bufs, b_bufs, ready, empty,
                         w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, mma_turn,
                         epi_turn, {scalar_params}M, num_tiles, num_n, num_k, 0, GROUP, STAGES, ES, NST, STORE_GRAD,
                         NRING, NB, EOUT)),
            (_consumer1, (dy_desc, x_desc, w_desc, {state_descs}g_desc, a_bufs, b_bufs, ready, empty,
                          w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, mma_turn,
                          epi_turn, {scalar_params}M, num_tiles, num_n, num_k, GROUP, STAGES, ES, NST, STORE_GRAD,
                          NRING, NB, EOUT)),
            (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                            STAGES)),
            (_epi_loader, (w_desc, {state_descs}w_bufs, {state_bufs}e_ready, e_empty, num_tiles, num_n, num_k,
                           BN, BK, GROUP, ES, NLOAD, 0, NRING, NB)),
        ], [4, 1, 1], [CONSUMER_REGS, 24, 24])
    else:
        gl.warp_specialize([
            (_consumer, (dy_desc, x_desc, w_desc, {state_descs}g_desc, a_bufs, b_bufs, ready, empty,
                         w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, mma_turn,
                         epi_turn, {scalar_params}M, num_tiles, num_n, num_k, 0, GROUP, STAGES, ES, NST, STORE_GRAD,
                         NRING, NB, EOUT)),
            (_consumer1, (dy_desc, x_desc, w_desc, {state_descs}g_desc, a_bufs, b_bufs, ready, empty,
                          w_bufs, {state_bufs}g_bufs, wo_bufs, {state_obufs}go_bufs, e_ready, e_empty, mma_turn,
                          epi_turn, {scalar_params}M, num_tiles, num_n, num_k, GROUP, STAGES, ES, NST, STORE_GRAD,
                          NRING, NB, EOUT)),
            (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                            STAGES)),
            (_epi_loader, (w_desc, {state_descs}w_bufs, {state_bufs}e_ready, e_empty, num_tiles, num_n, num_k,
                           BN, BK, GROUP, ES, NLOAD, 0, NRING, NB)),
            (_epi_loader, (w_desc, {state_descs}w_bufs, {state_bufs}e_ready, e_empty, num_tiles, num_n, num_k,
                           BN, BK, GROUP, ES, NLOAD, 1, NRING, NB)),
        ], [4, 1, 1, 1], [CONSUMER_REGS, 24, 24, 24])
'''

_TEMPLATE = _HEAD + _TMA_LOADERS + _SPLITS + _TMA_KERNEL

# v10 (GConfig.epi="vec"): no epilogue ring. Each consumer loads W/states straight from global memory with 16-byte
# vectors (a BlockedLayout of 4 contiguous fp32 per thread, 8 threads per 128 B row), one chunk ahead of the math,
# converts its dW chunk out of the wgmma layout into that layout, runs the same _rule and stores the results with
# the same masks. Partitions: the two consumers + the GEMM loader; no epi turn (the epilogues overlap).
_VEC_KERNEL = '''\
@gluon.jit
def _vec_split(acc, NCC: gl.constexpr):
    # [128, 128] -> 8 * NCC chunks [32, 128 / NCC], register-only: _split_chunks' [64, W] chunk q (row band rb =
    # q // NCC) split again on the row + 8 register bit h; chunk 2 q + h holds the tile rows rb * 64 + 16 w + 8 h + i
    # (chunk row 8 w + i; w the warp, i < 8), so each warp keeps the rows it holds in the accumulator
    gs = _split_chunks(acc, 2, NCC)
    out = ()
    for q in gl.static_range(len(gs)):
        y = gs[q]
        out += y.reshape([4, 2, 8, y.shape[1]]).permute(0, 2, 3, 1).reshape([32, y.shape[1], 2]).split()
    return out


@gluon.jit
def _vec_chunk(t, c, num_tiles, num_n, num_k, N, K, BN: gl.constexpr, BK: gl.constexpr, EPI_N: gl.constexpr,
               GROUP: gl.constexpr, L: gl.constexpr, BIG: gl.constexpr):
    # element offsets and mask of chunk c (_vec_split's numbering) of tile t in layout L; tiles past the end
    # (the prefetch after a consumer's last tile) are masked off
    NCC: gl.constexpr = BK // EPI_N
    pid_n, pid_k = _tile_coords(gl.minimum(t, num_tiles - 1), num_n, num_k, GROUP)
    ri = gl.arange(0, 32, layout=gl.SliceLayout(1, L))
    ci = gl.arange(0, EPI_N, layout=gl.SliceLayout(0, L))
    q = c // 2
    rows = pid_n * BN + (q // NCC) * 64 + (c % 2) * 8 + (ri // 8) * 16 + ri % 8
    cols = pid_k * BK + (q % NCC) * EPI_N + ci
    return _offs_mask(rows, cols, t, num_tiles, N, K, BIG)


@gluon.jit
def _vec_step(gch, t, c, {carry}, w_ptr, {state_ptrs}g_ptr, {scalar_params}nprog, num_tiles, num_n, num_k, N, K,
              BN: gl.constexpr, BK: gl.constexpr, EPI_N: gl.constexpr, GROUP: gl.constexpr, L: gl.constexpr,
              BIG: gl.constexpr, STORE_GRAD: gl.constexpr):
    # chunk c of tile t: W/states arrived (loaded one chunk earlier); first the next chunk's loads (chunk c + 1, or
    # chunk 0 of this consumer's next tile), then the rule and the stores. Returns the next chunk's W/states.
    NCH: gl.constexpr = (BN // 32) * (BK // EPI_N)
    offs_n, msk_n = _vec_chunk(t + ((c + 1) // NCH) * 2 * nprog, (c + 1) % NCH, num_tiles, num_n, num_k, N, K,
                               BN, BK, EPI_N, GROUP, L, BIG)
    p_nx = gl.load(w_ptr + offs_n, mask=msk_n)
{vec_next_loads}
    g = gl.convert_layout(gch, L)
    {new_vars} = _rule(p, g, {state_vars}{scalar_params})
    offs, msk = _vec_chunk(t, c, num_tiles, num_n, num_k, N, K, BN, BK, EPI_N, GROUP, L, BIG)
    gl.store(w_ptr + offs, {new_p}, mask=msk)
{vec_stores}
    if STORE_GRAD == 1:
        gl.store(g_ptr + offs, g, mask=msk)
    if STORE_GRAD == 2:
        gl.store(g_ptr + offs, {new_p}.to(g_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=msk)
    return {carry_nx}


@gluon.jit
def _vec_consumer(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn,
                  {scalar_params}M, N, K, num_tiles, num_n, num_k,
                  CID: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, STORE_GRAD: gl.constexpr,
                  EPI_N: gl.constexpr, BIG: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    NCH: gl.constexpr = (BN // 32) * (BK // EPI_N)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BK, 16])
    # 16-byte vectors, 8 threads per 128 B row (2 rows per thread); per warp the 8 rows its accumulator chunk holds
    # (the conversion is within each warp, through the compiler's smem scratch)
    L: gl.constexpr = gl.BlockedLayout([2, 4], [4, 8], [4, 1], [1, 0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    j = CID   # index of the tile in the CTA's list (this consumer: every other one)
    r = 0     # this consumer's round
    # chunk 0 of the first tile: loaded before its GEMM
    offs, msk = _vec_chunk(pid + CID * nprog, 0, num_tiles, num_n, num_k, N, K, BN, BK, EPI_N, GROUP, L, BIG)
    p = gl.load(w_ptr + offs, mask=msk)
{vec_first_loads}
    for t in range(pid + CID * nprog, num_tiles, 2 * nprog):
        # the GEMM ring is shared: mma turn as in the tma kernel's _consumer
        turn_ph = (r & 1) ^ (1 - CID)
        it0 = j * ksteps
        acc = _tile_mma(a_bufs, b_bufs, ready, empty, mma_turn, turn_ph, it0, ksteps, CID, STAGES, acc_layout)
        gs = _vec_split(acc, BK // EPI_N)
        if ROLL_EPILOGUE:
            for c in range(NCH):
                {carry} = _vec_step(_pick(gs, c, NCH), t, c, {carry}, w_ptr, {state_ptrs}g_ptr, {scalar_params}nprog,
                                    num_tiles, num_n, num_k, N, K, BN, BK, EPI_N, GROUP, L, BIG, STORE_GRAD)
        else:
            for c in gl.static_range(NCH):
                {carry} = _vec_step(gs[c], t, c, {carry}, w_ptr, {state_ptrs}g_ptr, {scalar_params}nprog,
                                    num_tiles, num_n, num_k, N, K, BN, BK, EPI_N, GROUP, L, BIG, STORE_GRAD)
        j += 2
        r += 1


@gluon.jit
def _vec_consumer1(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn,
                   {scalar_params}M, N, K, num_tiles, num_n, num_k,
                   GROUP: gl.constexpr, STAGES: gl.constexpr, STORE_GRAD: gl.constexpr,
                   EPI_N: gl.constexpr, BIG: gl.constexpr):
    _vec_consumer(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn,
                  {scalar_params}M, N, K, num_tiles, num_n, num_k, 1, GROUP, STAGES, STORE_GRAD, EPI_N, BIG)


@gluon.jit
def wgrad_update_gluon_kernel(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr,
                              {kernel_scalar_params}M, N, K,
                              GROUP: gl.constexpr, STAGES: gl.constexpr, STORE_GRAD: gl.constexpr,
                              EPI_N: gl.constexpr, BIG: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    gl.static_assert(num_warps == 4)
{scalar_loads}    # 16-byte vectors need 16-byte aligned rows: K % 8 == 0 (gluon_reason; the TMA descriptors need it too)
    K = gl.multiple_of(K, 8)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs, b_bufs, ready, empty, mma_turn = _gemm_ring(dy_desc, x_desc, STAGES)

    gl.warp_specialize([
        (_vec_consumer, (dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn,
                         {scalar_params}M, N, K, num_tiles, num_n, num_k, 0, GROUP, STAGES, STORE_GRAD, EPI_N,
                         BIG)),
        (_vec_consumer1, (dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn,
                          {scalar_params}M, N, K, num_tiles, num_n, num_k, GROUP, STAGES, STORE_GRAD, EPI_N, BIG)),
        (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                        STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])
'''


# v11 (GConfig.epi="smem"): the dW tile leaves the registers through shared memory. Each consumer stores its
# accumulator into its own [128, 128] fp32 smem buffer right after the GEMM, so the 128 accumulator registers are
# dead for the whole epilogue (v10 kept them live: only one [32, 32] chunk of W/states loads fitted in flight, and
# it measured slower than the TMA ring at M <= 256, latency-bound). The epilogue then walks row chunks [R, 128]
# (R = epi_m: 8 or 16) in a 16-byte-vector blocked layout (a warp reads/writes whole 512 B rows), with the W/states
# loads of AHEAD chunks (1 or 2) in flight ahead of the math, carried into the consumer's next tile (so the first
# chunks of a tile arrive during its GEMM). Partitions as for "vec": the two consumers + the GEMM loader.
_SMEM_EPI = '''\
# 16-byte vectors, a warp per 512 B row (R / 4 rows per thread): the probe's fastest streaming layout
ROWS_L = gl.constexpr(gl.BlockedLayout([1, {row_vec}], [{row_tpr}, {row_tpc}], [4, 1], [1, 0]))
# The fp32 dW tiles. Swizzle: 32 B units (8 fp32) XOR-permuted by row mod 4 within each 128 B. The accumulator's store
# (st.shared.v2: a half-warp writes 4 rows x 32 B of one column block) then hits 4 different 32 B bank groups, and
# the chunk loads (ld.shared.v4, a warp reads one whole 512 B row) stay contiguous per 16 B: both conflict-free
# (gl.bank_conflicts: 0 and 0; unswizzled rows 512 B apart put the 8 rows of a store on the same banks, 3 excess
# wavefronts; a 16 B-unit swizzle by row mod 8 still 1). As the swizzle depends only on the row mod 4, a tile can be
# viewed as [BN / R, R, BK] row chunks (R % 4 == 0) or tiles stacked as [n, BN, BK]: the same bytes.
DW_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 4, [1, 0])){extra_fn}{round_fn}


@gluon.jit
def _smem_chunk(t, c, num_tiles, num_n, num_k, N, K, BN: gl.constexpr, BK: gl.constexpr, R: gl.constexpr,
                GROUP: gl.constexpr, L: gl.constexpr, BIG: gl.constexpr):
    # element offsets and mask of rows c * R .. c * R + R - 1 of tile t in layout L ([R, BK]); tiles past the end
    # (the lookahead after a consumer's last tile) are masked off
    pid_n, pid_k = _tile_coords(gl.minimum(t, num_tiles - 1), num_n, num_k, GROUP)
    rows = pid_n * BN + c * R + gl.arange(0, R, layout=gl.SliceLayout(1, L))
    cols = pid_k * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, L))
    return _offs_mask(rows, cols, t, num_tiles, N, K, BIG)


@gluon.jit
def _smem_load_at(offs, msk, w_ptr, {state_ptrs}LD_EV: gl.constexpr):
    # W and the tensor states at offs (16-byte vectors), as one tuple
    return (gl.load(w_ptr + offs, mask=msk, eviction_policy=LD_EV), {smem_state_loads})


@gluon.jit
def _smem_load(t, c, w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN: gl.constexpr, BK: gl.constexpr,
               R: gl.constexpr, GROUP: gl.constexpr, L: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr):
    # W and the tensor states of chunk c of tile t
    offs, msk = _smem_chunk(t, c, num_tiles, num_n, num_k, N, K, BN, BK, R, GROUP, L, BIG)
    return _smem_load_at(offs, msk, w_ptr, {state_ptrs}LD_EV)


@gluon.jit
def _smem_store_at(offs, msk, {new_vars}, g, w_ptr, {state_ptrs}g_ptr, {ekey_param}STORE_GRAD: gl.constexpr,
                   ST_EV: gl.constexpr, ST_CM: gl.constexpr):
    # the updated W and tensor states (and the side output: dW, or the new W's low-precision copy) at offs
    gl.store(w_ptr + offs, {w_store}, mask=msk, cache_modifier=ST_CM, eviction_policy=ST_EV)
{smem_stores}
    if STORE_GRAD == 1:
        gl.store(g_ptr + offs, g, mask=msk, cache_modifier=ST_CM, eviction_policy=ST_EV)
    if STORE_GRAD == 2:
        gl.store(g_ptr + offs, {new_p}.to(g_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=msk,
                 cache_modifier=ST_CM, eviction_policy=ST_EV)


@gluon.jit
def _smem_ahead0(t0, C0: gl.constexpr, w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN: gl.constexpr,
                 BK: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr, GROUP: gl.constexpr, BIG: gl.constexpr,
                 LD_EV: gl.constexpr):
    # the lookahead's start: chunks C0 .. C0 + AHEAD - 1 of tile t0, loaded before its GEMM ends
    ahead = ()
    for d in gl.static_range(AHEAD):
        ahead += (_smem_load(t0, C0 + d, w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN, BK, R, GROUP,
                             ROWS_L, BIG, LD_EV), )
    return ahead


@gluon.jit
def _smem_step(dw, t, c, ahead, w_ptr, {state_ptrs}g_ptr, {scalar_params}tstep, dbase, num_tiles, num_n, num_k,
               N, K, BN: gl.constexpr, BK: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr, GROUP: gl.constexpr,
               L: gl.constexpr, BIG: gl.constexpr, STORE_GRAD: gl.constexpr, LD_EV: gl.constexpr,
               ST_EV: gl.constexpr, ST_CM: gl.constexpr, C0: gl.constexpr, CNT: gl.constexpr):
    # chunk C0 + c of tile t, its dW read from chunk dbase + C0 + c of dw; the calling warpgroup walks chunks
    # C0 .. C0 + CNT - 1 of every tile it takes, tstep tiles apart. ahead[0] holds this chunk's W/states (loaded
    # AHEAD chunks earlier), ahead[1:] the following chunks'. First the loads of the chunk AHEAD on (in this tile
    # or in the warpgroup's next one), then dW from smem, the rule and the stores. Returns the lookahead shifted by
    # one chunk.
    nxt = _smem_load(t + ((c + AHEAD) // CNT) * tstep, C0 + (c + AHEAD) % CNT, w_ptr, {state_ptrs}num_tiles,
                     num_n, num_k, N, K, BN, BK, R, GROUP, L, BIG, LD_EV)
    {carry} = ahead[0]{carry_cvt}
    g = dw.index(dbase + C0 + c).load(L){extra_add}
    {new_vars} = _rule(p, g, {state_vars}{scalar_params})
    offs, msk = _smem_chunk(t, C0 + c, num_tiles, num_n, num_k, N, K, BN, BK, R, GROUP, L, BIG)
    _smem_store_at(offs, msk, {new_vars}, g, w_ptr, {state_ptrs}g_ptr, {ekey_param}STORE_GRAD, ST_EV, ST_CM)
    return ahead[1:] + (nxt, )


@gluon.jit
def _tile_base(t, num_tiles, num_n, num_k, BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr):
    # first row and column of tile t (clamped to the last tile: _chunk_at masks tiles past the end by t)
    pid_n, pid_k = _tile_coords(gl.minimum(t, num_tiles - 1), num_n, num_k, GROUP)
    return pid_n * BN, pid_k * BK


@gluon.jit
def _chunk_at(row0, col0, t, c, num_tiles, N, K, BK: gl.constexpr, R: gl.constexpr, L: gl.constexpr,
              BIG: gl.constexpr):
    # _smem_chunk from the tile's first row/column (_tile_base) instead of its index: no tile-order div/mod
    rows = row0 + c * R + gl.arange(0, R, layout=gl.SliceLayout(1, L))
    cols = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, L))
    return _offs_mask(rows, cols, t, num_tiles, N, K, BIG)


@gluon.jit
def _l2_pf(ptrs, nbytes, ok):
    # cp.async.bulk.prefetch.L2: nbytes (a multiple of 16, 16-byte aligned) from ptrs into L2, fire and forget --
    # no register or smem holds the data, so the bytes in flight are not bounded by the epilogue's lookahead
    return gl.inline_asm_elementwise(
        "{{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }}",
        "=r,l,r,r", [ptrs, nbytes, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _l2_prefetch(t, r0, w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN: gl.constexpr, BK: gl.constexpr,
                 GROUP: gl.constexpr, PF: gl.constexpr, BIG: gl.constexpr):
    # GConfig.l2pf: rows r0 .. r0 + PF - 1 of tile t of W and the tensor states into L2, one 16 B-aligned piece
    # of a row per thread of the warpgroup (PF * P = 128 pieces of BK * 4 / P bytes), clipped at K, none past N or
    # past the last tile. Issued one tile ahead, while that tile's GEMM runs: the DRAM, otherwise idle during a
    # GEMM, fills L2 for the epilogue's loads (NOTES_kernel.md "Stop 24")
    P: gl.constexpr = 128 // PF
    L: gl.constexpr = gl.BlockedLayout([1, 1], [32 // P, P], [4, 1], [1, 0])
    row0, col0 = _tile_base(t, num_tiles, num_n, num_k, BN, BK, GROUP)
    rows = row0 + r0 + gl.arange(0, PF, layout=gl.SliceLayout(1, L))
    cols = col0 + gl.arange(0, P, layout=gl.SliceLayout(0, L)) * (BK // P)
    nb = gl.minimum(gl.maximum(K - cols, 0), BK // P) * 4
    ok = ((rows < N) & (t < num_tiles))[:, None] & (nb > 0)[None, :]
    if BIG:
        offs = rows.to(gl.int64)[:, None] * K + cols[None, :]
    else:
        offs = rows[:, None] * K + cols[None, :]
    nbs = gl.zeros([PF, P], gl.int32, L) + nb[None, :]
    _l2_pf(w_ptr + offs, nbs, ok)
{pf_states}


@gluon.jit
def _smem_step_at(dw, t, c, ahead, base, base_nx, w_ptr, {state_ptrs}g_ptr, {scalar_params}tstep, dbase,
                  num_tiles, N, K, BK: gl.constexpr, R: gl.constexpr, AHEAD: gl.constexpr, L: gl.constexpr,
                  BIG: gl.constexpr, STORE_GRAD: gl.constexpr, LD_EV: gl.constexpr, ST_EV: gl.constexpr,
                  ST_CM: gl.constexpr, C0: gl.constexpr, CNT: gl.constexpr):
    # _smem_step with the chunk addresses from the first row/column of tile t (base) and of the warpgroup's next
    # tile (base_nx), computed once per tile by the caller (GConfig.hoist): _smem_step derives both chunks' tile
    # coordinates -- four integer divisions/remainders each -- at every chunk. Same addresses, same data, same math.
    nx = (c + AHEAD) // CNT            # 0: the chunk AHEAD on is in tile t, 1: in the next tile
    offs, msk = _chunk_at(base[0] + nx * (base_nx[0] - base[0]), base[1] + nx * (base_nx[1] - base[1]),
                          t + nx * tstep, C0 + (c + AHEAD) % CNT, num_tiles, N, K, BK, R, L, BIG)
    nxt = _smem_load_at(offs, msk, w_ptr, {state_ptrs}LD_EV)
    {carry} = ahead[0]{carry_cvt}
    g = dw.index(dbase + C0 + c).load(L){extra_add_at}
    {new_vars} = _rule(p, g, {state_vars}{scalar_params})
    offs, msk = _chunk_at(base[0], base[1], t, C0 + c, num_tiles, N, K, BK, R, L, BIG)
    _smem_store_at(offs, msk, {new_vars}, g, w_ptr, {state_ptrs}g_ptr, {ekey_param}STORE_GRAD, ST_EV, ST_CM)
    return ahead[1:] + (nxt, )


'''

_SMEM_KERNEL = '''\
@gluon.jit
def _smem_consumer(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn, dw,
                   {scalar_params}M, N, K, num_tiles, num_n, num_k,
                   CID: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, STORE_GRAD: gl.constexpr,
                   R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr,
                   ST_EV: gl.constexpr, ST_CM: gl.constexpr, HOIST: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    NCH: gl.constexpr = BN // R
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BK, 16])
    L: gl.constexpr = ROWS_L
    # dw, this consumer's [BN, BK] dW tile (the accumulator's store), viewed as [NCH, R, BK] row chunks for the
    # loop's runtime chunk index (DW_LAYOUT; a [NCH, R, BK] allocation reshaped to [BN, BK] aborted triton 3.6's
    # compiler; _reinterpret is Gluon's private spelling of a memdesc view with another shape)
    dw_chunks = dw._reinterpret(gl.float32, [NCH, R, BK], dw.type.layout)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    j = CID   # index of the tile in the CTA's list (this consumer: every other one)
    r = 0     # this consumer's round
    t0 = pid + CID * nprog
    ahead = _smem_ahead0(t0, 0, w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN, BK, R, AHEAD, GROUP, BIG,
                         LD_EV)
    if HOIST:
        base = _tile_base(t0, num_tiles, num_n, num_k, BN, BK, GROUP)
    for t in range(t0, num_tiles, 2 * nprog):
        # the GEMM ring is shared: mma turn as in the tma kernel's _consumer
        turn_ph = (r & 1) ^ (1 - CID)
        it0 = j * ksteps
        acc = _tile_mma(a_bufs, b_bufs, ready, empty, mma_turn, turn_ph, it0, ksteps, CID, STAGES, acc_layout)
        # Only this warpgroup touches dw, so warpgroup barriers suffice (in a partition, bar.sync on its named
        # barrier, 128 threads). Before the store, the compiler's shared-memory barrier analysis puts one (the
        # previous tile's chunk loads, WAR). After it, this explicit one (RAW): left to the analysis, the barrier
        # lands inside the chunk loop, one per chunk, as the loop's entry carries the pending store.
        dw.store(acc)
        gl.thread_barrier()
        # a rolled loop for every rule: the chunk is addressed at run time (smem index, offsets), no selects
        # needed (v10's _pick); unrolled, Lion with dW spilled 48 B at [16, 128] x 2 and its SASS was 2.5x larger
        if HOIST:   # GConfig.hoist: chunk addresses from the tile's and the next tile's first row/column
            base_nx = _tile_base(t + 2 * nprog, num_tiles, num_n, num_k, BN, BK, GROUP)
            for c in range(NCH):
                ahead = _smem_step_at(dw_chunks, t, c, ahead, base, base_nx, w_ptr, {state_ptrs}g_ptr,
                                      {scalar_params}2 * nprog, 0, num_tiles, N, K, BK, R, AHEAD, L, BIG, STORE_GRAD,
                                      LD_EV, ST_EV, ST_CM, 0, NCH)
            base = base_nx
        else:
            for c in range(NCH):
                ahead = _smem_step(dw_chunks, t, c, ahead, w_ptr, {state_ptrs}g_ptr, {scalar_params}2 * nprog, 0,
                                   num_tiles, num_n, num_k, N, K, BN, BK, R, AHEAD, GROUP, L, BIG, STORE_GRAD, LD_EV,
                                   ST_EV, ST_CM, 0, NCH)
        j += 2
        r += 1


@gluon.jit
def _smem_consumer1(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn, dw,
                    {scalar_params}M, N, K, num_tiles, num_n, num_k,
                    GROUP: gl.constexpr, STAGES: gl.constexpr, STORE_GRAD: gl.constexpr,
                    R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr,
                    ST_EV: gl.constexpr, ST_CM: gl.constexpr, HOIST: gl.constexpr):
    _smem_consumer(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn, dw,
                   {scalar_params}M, N, K, num_tiles, num_n, num_k, 1, GROUP, STAGES, STORE_GRAD, R, AHEAD, BIG,
                   LD_EV, ST_EV, ST_CM, HOIST)


@gluon.jit
def wgrad_update_gluon_kernel(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr,
                              {kernel_scalar_params}M, N, K,
                              GROUP: gl.constexpr, STAGES: gl.constexpr, STORE_GRAD: gl.constexpr,
                              R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr,
                              ST_EV: gl.constexpr, ST_CM: gl.constexpr, HOIST: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    gl.static_assert(num_warps == 4)
{scalar_loads}    gl.static_assert(BN % R == 0 and R % 4 == 0)
    # 16-byte vectors need 16-byte aligned rows: K % 8 == 0 (gluon_reason; the TMA descriptors need it too)
    K = gl.multiple_of(K, 8)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs, b_bufs, ready, empty, mma_turn = _gemm_ring(dy_desc, x_desc, STAGES)
    # the consumers' dW tiles (2 x 64 KB)
    dw0 = gl.allocate_shared_memory(gl.float32, [BN, BK], DW_LAYOUT)
    dw1 = gl.allocate_shared_memory(gl.float32, [BN, BK], DW_LAYOUT)

    gl.warp_specialize([
        (_smem_consumer, (dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn, dw0,
                          {scalar_params}M, N, K, num_tiles, num_n, num_k, 0, GROUP, STAGES, STORE_GRAD, R, AHEAD,
                          BIG, LD_EV, ST_EV, ST_CM, HOIST)),
        (_smem_consumer1, (dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr, a_bufs, b_bufs, ready, empty, mma_turn,
                           dw1, {scalar_params}M, N, K, num_tiles, num_n, num_k, GROUP, STAGES, STORE_GRAD, R,
                           AHEAD, BIG, LD_EV, ST_EV, ST_CM, HOIST)),
        (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                        STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])
'''


# v12 (GConfig.epi="split"): the roles split. The ping-pong kernels (tma, vec, smem) give each consumer
# warpgroup a tile's GEMM AND its epilogue, so while one streams W/states the other is in its GEMM: one warpgroup's
# loads in flight per SM. Nsight Compute on the H200 (NOTES_kernel.md v12): at M=2048 the tma kernel moves 480 MB
# of DRAM traffic at 2.6 TB/s (55 % of peak; the epilogue alone at M=64 2.75 TB/s, with both consumers streaming),
# so the limit is bytes in flight, not DRAM bandwidth or the GEMM (whose schedule alone is at cuBLAS speed). Here
# one warpgroup does every tile's GEMM back to back (no mma turn) and parks dW in one [128, 128] fp32 smem tile;
# two epilogue warpgroups take half of its rows each and stream W/states with the smem kernel's chunk code
# (_smem_step: 16-byte vectors, AHEAD chunks of lookahead carried across tiles), so both stream all the time,
# beside the MMAs. Hand-off per dW tile b (NDW = GConfig.dw_tiles, 1 picked): dw_bar[b] "full" (the MMA warpgroup
# arrives after its store), dw_bar[NDW + b] "empty" (count 2: each epilogue warpgroup after its last read of the
# tile). One dW tile leaves 160 KB for the GEMM ring (5 stages), two leave 96 KB (3). STREAM=False is the overlap
# diagnostic (tiles handed back untouched).
_SPLIT_MMA = '''\
@gluon.jit
def _split_mma(dy_desc, x_desc, a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar, M, num_tiles,
               STAGES: gl.constexpr, NDW: gl.constexpr, KMAJOR: gl.constexpr = False, MMA_WARPS: gl.constexpr = 4):
    if KMAJOR:   # fp32 under TF32: [BN, BMT] / [BK, BMT] stages (_gemm_loader), tf32 wgmma's K of 8
        BMT: gl.constexpr = dy_desc.block_type.shape[1]
        BN: gl.constexpr = dy_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[0]
    else:
        BMT: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
    # MMA_WARPS 8 (coop): two warpgroups, 64 rows of the tile each, as n128 instructions -- an n256 one needs its
    # 128 accumulator registers at once and ptxas wants >= 154 at the launch's cap of 128 (16 warps)
    INK: gl.constexpr = 128 if BK > 128 else BK
    if KMAJOR:   # tf32 wgmma's K of 8
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                             instr_shape=[16, INK, 8])
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                             instr_shape=[16, INK, 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    # the NDW dW tiles as [NDW, BN, BK] (DW_LAYOUT: the same bytes)
    dw_tiles = dw._reinterpret(gl.float32, [NDW, BN, BK], dw.type.layout)
    r = 0
    for t in range(pid, num_tiles, nprog):
        acc = _tile_mma(a_bufs, b_bufs, ready, empty, mma_turn, 0, r * ksteps, ksteps, 0, STAGES, acc_layout,
                        False, KMAJOR)
        # the epilogue warpgroups have read the tile NDW tiles back (phase trick: passes at once the first time)
        b = r % NDW
        mbarrier.wait(dw_bar.index(NDW + b), ((r // NDW) & 1) ^ 1)
        dw_tiles.index(b).store(acc)
        # every thread's part of the tile is in smem before the (single-thread) arrive releases it
        gl.thread_barrier()
        mbarrier.arrive(dw_bar.index(b))
        r += 1




@gluon.jit
def _split_smem1(dy_desc, x_desc, STAGES: gl.constexpr, DW_L: gl.constexpr):
    # the split kernels with one dW tile (the grouped and 8-bit kernels): the GEMM ring, the [BN, BK] fp32 tile in
    # layout DW_L, its barriers -- dw_bar[0] "full" (the MMA warpgroup), dw_bar[1] "empty" (both epilogue
    # warpgroups)
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    a_bufs, b_bufs, ready, empty, mma_turn = _gemm_ring(dy_desc, x_desc, STAGES)
    dw = gl.allocate_shared_memory(gl.float32, [BN, BK], DW_L)
    dw_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(dw_bar.index(0), count=1)
    mbarrier.init(dw_bar.index(1), count=2)
    return a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar


'''
# the rest of the split kernel (its epilogue warpgroups and the kernel), after _SPLIT_MMA
_SPLIT_KERNEL = _SPLIT_MMA + '''\
@gluon.jit
def _split_epi(w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {scalar_params}N, K, num_tiles, num_n, num_k,
               H: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, STORE_GRAD: gl.constexpr,
               R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr, ST_EV: gl.constexpr,
               ST_CM: gl.constexpr, STREAM: gl.constexpr, NDW: gl.constexpr, HOIST: gl.constexpr,
               PF: gl.constexpr, PF_NEXT: gl.constexpr, PDL: gl.constexpr = 0, NEPI: gl.constexpr = 2):
    # rows H * BN / NEPI .. of every tile of the CTA: chunks H * CNT .. H * CNT + CNT - 1 of [R, BK] (NEPI = 1, the
    # coop kernel: the one epilogue warpgroup walks the whole tile)
    CNT: gl.constexpr = BN // NEPI // R
    if PDL == 1:   # W/states may be the kernel before's output too (an Inductor copy into them): wait for it
        _gdc_wait()
    gl.static_assert(AHEAD <= CNT)
    L: gl.constexpr = ROWS_L
    dw_chunks = dw._reinterpret(gl.float32, [NDW * BN // R, R, BK], dw.type.layout)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ahead = _smem_ahead0(pid, H * CNT, w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN, BK, R, AHEAD, GROUP, BIG,
                         LD_EV)
    if PF > 0:
        _l2_prefetch(pid, H * (BN // 2), w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN, BK, GROUP, PF, BIG)
    r = 0
    if HOIST:
        base = _tile_base(pid, num_tiles, num_n, num_k, BN, BK, GROUP)
    for t in range(pid, num_tiles, nprog):
        b = r % NDW
        mbarrier.wait(dw_bar.index(b), (r // NDW) & 1)
        # the MMA warpgroup now runs the next tile's GEMM: its W/states go to L2 meanwhile (PF_NEXT=False: only the
        # first tile's, before the loop -- the fill of a grid with few tiles per SM)
        if PF > 0 and PF_NEXT:
            _l2_prefetch(t + nprog, H * (BN // 2), w_ptr, {state_ptrs}num_tiles, num_n, num_k, N, K, BN, BK, GROUP,
                         PF, BIG)
        # STREAM=False (overlap diagnostic): the tile is handed back untouched, so the MMA warpgroup's time with
        # its hand-offs but without the W/state traffic shows
        if STREAM:
            if HOIST:
                base_nx = _tile_base(t + nprog, num_tiles, num_n, num_k, BN, BK, GROUP)
                for c in range(CNT):
                    ahead = _smem_step_at(dw_chunks, t, c, ahead, base, base_nx, w_ptr, {state_ptrs}g_ptr,
                                          {scalar_params}nprog, b * (BN // R), num_tiles, N, K, BK, R, AHEAD, L,
                                          BIG, STORE_GRAD, LD_EV, ST_EV, ST_CM, H * CNT, CNT)
                base = base_nx
            else:
                for c in range(CNT):
                    ahead = _smem_step(dw_chunks, t, c, ahead, w_ptr, {state_ptrs}g_ptr, {scalar_params}nprog,
                                       b * (BN // R), num_tiles, num_n, num_k, N, K, BN, BK, R, AHEAD, GROUP, L,
                                       BIG, STORE_GRAD, LD_EV, ST_EV, ST_CM, H * CNT, CNT)
        # all four warps' reads of the tile are done before the (single-thread) arrive frees it
        gl.thread_barrier()
        mbarrier.arrive(dw_bar.index(NDW + b))
        r += 1


@gluon.jit
def _split_epi1(w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {scalar_params}N, K, num_tiles, num_n, num_k,
                BN: gl.constexpr, BK: gl.constexpr, GROUP: gl.constexpr, STORE_GRAD: gl.constexpr,
                R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr, ST_EV: gl.constexpr,
                ST_CM: gl.constexpr, STREAM: gl.constexpr, NDW: gl.constexpr, HOIST: gl.constexpr,
                PF: gl.constexpr, PF_NEXT: gl.constexpr, PDL: gl.constexpr = 0):
    _split_epi(w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {scalar_params}N, K, num_tiles, num_n, num_k, 1, BN, BK,
               GROUP, STORE_GRAD, R, AHEAD, BIG, LD_EV, ST_EV, ST_CM, STREAM, NDW, HOIST, PF, PF_NEXT, PDL)


@gluon.jit
def wgrad_update_gluon_kernel(dy_desc, x_desc, w_ptr, {state_ptrs}g_ptr,
                              {kernel_scalar_params}M, N, K,
                              GROUP: gl.constexpr, STAGES: gl.constexpr, STORE_GRAD: gl.constexpr,
                              R: gl.constexpr, AHEAD: gl.constexpr, BIG: gl.constexpr, LD_EV: gl.constexpr,
                              ST_EV: gl.constexpr, ST_CM: gl.constexpr, STREAM: gl.constexpr, NDW: gl.constexpr,
                              HOIST: gl.constexpr, PF: gl.constexpr, PF_NEXT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              num_warps: gl.constexpr, PDL: gl.constexpr = 0, KMAJOR: gl.constexpr = False,
                              NEPI: gl.constexpr = 2):
    if KMAJOR:   # descriptors over dY^T [N, M] / X^T [K, M] (fp32 under TF32; _gemm_loader)
        BN: gl.constexpr = dy_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
    # 4 MMA warps and two epilogue warpgroups, or (coop) 8 MMA warps and one epilogue warpgroup: 16 warps either way
    gl.static_assert((num_warps == 4 and NEPI == 2) or (num_warps == 8 and NEPI == 1))
{scalar_loads}    gl.static_assert((BN // NEPI) % R == 0 and R % 4 == 0)
    K = gl.multiple_of(K, 8)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs, b_bufs, ready, empty, mma_turn = _gemm_ring(dy_desc, x_desc, STAGES)
    dw = gl.allocate_shared_memory(gl.float32, [NDW * BN, BK], DW_LAYOUT)
    # per dW tile b: dw_bar[b] "full" (the MMA warpgroup), dw_bar[NDW + b] "empty" (both epilogue warpgroups)
    dw_bar = gl.allocate_shared_memory(gl.int64, [2 * NDW, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NDW):
        mbarrier.init(dw_bar.index(b), count=1)
        mbarrier.init(dw_bar.index(NDW + b), count=NEPI)

    if NEPI == 1:
        gl.warp_specialize([
            (_split_mma, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar, M, num_tiles, STAGES,
                          NDW, KMAJOR, num_warps)),
            (_split_epi, (w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {scalar_params}N, K, num_tiles, num_n, num_k, 0, BN,
                          BK, GROUP, STORE_GRAD, R, AHEAD, BIG, LD_EV, ST_EV, ST_CM, STREAM, NDW, HOIST, PF, PF_NEXT,
                          PDL, 1)),
            (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                            STAGES, PDL, KMAJOR)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([
            (_split_mma, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, mma_turn, dw, dw_bar, M, num_tiles, STAGES,
                          NDW, KMAJOR)),
            (_split_epi, (w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {scalar_params}N, K, num_tiles, num_n, num_k, 0, BN, BK,
                          GROUP, STORE_GRAD, R, AHEAD, BIG, LD_EV, ST_EV, ST_CM, STREAM, NDW, HOIST, PF, PF_NEXT, PDL)),
            (_split_epi1, (w_ptr, {state_ptrs}g_ptr, dw, dw_bar, {scalar_params}N, K, num_tiles, num_n, num_k, BN, BK,
                           GROUP, STORE_GRAD, R, AHEAD, BIG, LD_EV, ST_EV, ST_CM, STREAM, NDW, HOIST, PF, PF_NEXT,
                           PDL)),
            (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                            STAGES, PDL, KMAJOR)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
'''


# Overlap diagnostic (GConfig.epi="gemm"; selectable through config=, never picked): the default kernel's GEMM
# schedule with no epilogue traffic. Same _gemm_loader, _tile_mma, mma turn (the two consumers' GEMMs strictly
# alternate on the shared ring), tile order and GEMM stages as the tma kernel; no epilogue ring, no epilogue
# loader, no epi turn (smem holds only the GEMM stages). Per tile the consumer reduces its accumulator to its 128
# row sums (gl.sum over the columns: in the wgmma layout a row lives in one quad of threads, so this is register
# adds + 2 shuffles, no smem, no barrier; ~0.2 us per tile vs 13 us of MMA at M=2048) and stores them: every
# wgmma stays live and the result is checkable against torch. W/states are never touched. Partitions: the two
# consumers + the GEMM loader.
_GEMM_KERNEL = '''\
@gluon.jit
def _gemm_consumer(dy_desc, x_desc, sums_ptr, a_bufs, b_bufs, ready, empty, mma_turn, M, num_tiles, num_n, num_k,
                   CID: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BK, 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    j = CID   # index of the tile in the CTA's list (this consumer: every other one)
    r = 0     # this consumer's round
    for t in range(pid + CID * nprog, num_tiles, 2 * nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        # the GEMM ring is shared: mma turn as in the tma kernel's _consumer
        turn_ph = (r & 1) ^ (1 - CID)
        it0 = j * ksteps
        acc = _tile_mma(a_bufs, b_bufs, ready, empty, mma_turn, turn_ph, it0, ksteps, CID, STAGES, acc_layout)
        # sums[row, pid_k] = the sum of dW[row, pid_k * BK .. + BK) (rows past N: 0, TMA zero-fills dY there)
        s = gl.sum(acc, axis=1)
        rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
        gl.store(sums_ptr + rows * num_k + pid_k, s)
        j += 2
        r += 1


@gluon.jit
def _gemm_consumer1(dy_desc, x_desc, sums_ptr, a_bufs, b_bufs, ready, empty, mma_turn, M, num_tiles, num_n, num_k,
                    GROUP: gl.constexpr, STAGES: gl.constexpr):
    _gemm_consumer(dy_desc, x_desc, sums_ptr, a_bufs, b_bufs, ready, empty, mma_turn, M, num_tiles, num_n, num_k,
                   1, GROUP, STAGES)


@gluon.jit
def wgrad_update_gluon_kernel(dy_desc, x_desc, sums_ptr, M, N, K,
                              GROUP: gl.constexpr, STAGES: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    gl.static_assert(num_warps == 4)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs, b_bufs, ready, empty, mma_turn = _gemm_ring(dy_desc, x_desc, STAGES)

    gl.warp_specialize([
        (_gemm_consumer, (dy_desc, x_desc, sums_ptr, a_bufs, b_bufs, ready, empty, mma_turn, M, num_tiles, num_n,
                          num_k, 0, GROUP, STAGES)),
        (_gemm_consumer1, (dy_desc, x_desc, sums_ptr, a_bufs, b_bufs, ready, empty, mma_turn, M, num_tiles, num_n,
                           num_k, GROUP, STAGES)),
        (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP,
                        STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])
'''


# tl.* spellings of epilogue_codegen ("cuda" target) -> gl.*; gl's elementwise math is the same builtins
# (triton.language.math / core), so the lowering, and the rounding, is identical.
_GL_SUBS = [
    (re.compile(r"tl\.full\(\[BLOCK_N, BLOCK_K\], ([^,()]+(?:\([^()]*\))?), tl\.float32\)"), r"gl.full_like(p, \1)"),
    (re.compile(r"tl\.zeros\(\[BLOCK_N, BLOCK_K\], tl\.float32\)"), "gl.zeros_like(p)"),
    (re.compile(r"propagate_nan=tl\.PropagateNan\.ALL"), "propagate_nan=PROPAGATE_ALL"),
    (re.compile(r"\btl\.math\.(div_rn|sqrt_rn|rsqrt)\("), r"gl.\1("),
    (re.compile(r"\btl\.(fma|where|abs|maximum|minimum)\("), r"gl.\1("),
    (re.compile(r"\btl\.float32\b"), "gl.float32"),
]
_LEFTOVER = re.compile(r"\btl\.|\bBLOCK_[NK]\b")


def _to_gluon(code: str) -> str:
    for pat, rep in _GL_SUBS:
        code = pat.sub(rep, code)
    bad = _LEFTOVER.search(code)
    if bad:
        raise GluonUnsupported(f"no Gluon spelling for {code[bad.start():bad.start() + 40]!r}")
    return code


# Stochastic rounding (render_fields(rounded=True)): the spec's bits (stochastic_round.GLUON_SROUND) and the
# bf16-or-fp32 state store. _as_elem's branch is on the pointer's element type, decided at compile time.
_ROUND_FN = GLUON_SROUND + """

@gluon.jit
def _as_elem(ptr, x):
    # an optimizer state's new value in its own dtype: bf16 rounds to nearest even (Tensor.to), fp32 as is
    if ptr.dtype.element_ty == gl.float32:
        return x
    else:
        return x.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne")"""


# A tied embedding / output weight (``extra``: the smem and split kernels only): row r of the dW chunk gains
# e_ptr[p_ptr[r]] where p_ptr[r] >= 0 (embedding_update.compact_rows), added where the chunk leaves smem. The module
# takes e_ptr, p_ptr right before g_ptr (appended to the state pointers, so every signature and call carries them).
_EXTRA_FN = """


@gluon.jit
def _smem_extra(g, row0, col0, c, N, K, e_ptr, p_ptr, R: gl.constexpr, BK: gl.constexpr, L: gl.constexpr):
    # the chunk's rows of a tied embedding's gradient, zero where no token (or the padding row) has one
    rows = row0 + c * R + gl.arange(0, R, layout=gl.SliceLayout(1, L))
    cols = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, L))
    pos = gl.load(p_ptr + rows, mask=rows < N, other=-1)
    msk = (pos >= 0)[:, None] & (cols < K)[None, :]
    return g + gl.load(e_ptr + pos.to(gl.int64)[:, None] * K + cols[None, :], mask=msk, other=0.0).to(gl.float32)"""
_EXTRA_ADD = """
    pid_n, pid_k = _tile_coords(gl.minimum(t, num_tiles - 1), num_n, num_k, GROUP)
    g = _smem_extra(g, pid_n * BN, pid_k * BK, C0 + c, N, K, e_ptr, p_ptr, R, BK, L)"""
_EXTRA_ADD_AT = """
    g = _smem_extra(g, base[0], base[1], C0 + c, N, K, e_ptr, p_ptr, R, BK, L)"""


def render_gluon_source(ep: Epilogue, epi: str = "tma", table: bool = False, extra: bool = False,
                        rounded: int = 0) -> str:
    """The Gluon kernel module for one rule's epilogue (raises GluonUnsupported): ``epi`` "tma" the TMA-ring
    epilogue, "vec" the vector-load one (v10), "smem" dW through smem (v11), "split" one MMA and two epilogue
    warpgroups (v12), "gemm" the overlap diagnostic (the tma kernel's GEMM schedule, per-tile row sums of dW
    instead of the update; the rule's text is in the module but never called). ``table``: the rule scalars are read
    from a device pointer ``scal_ptr`` (epilogue_codegen.scalar_fields) instead of taken as arguments. ``extra``
    (smem, split): a tied embedding's gradient rows added to dW (_EXTRA_FN). ``rounded`` (smem, split): a bf16
    weight stored stochastically rounded, 4 or 8 elements per thread (render_fields); 0 off."""
    if extra and epi not in ("smem", "split"):
        raise GluonUnsupported(f"tied embedding rows in the {epi!r} epilogue")
    if rounded not in (0, 4, 8):
        raise ValueError(f"rounded={rounded!r}: 0 (off), or 4 or 8 elements per thread")
    if rounded and (epi not in ("smem", "split") or extra):
        raise GluonUnsupported(f"stochastic rounding in the {epi!r} epilogue"
                               f"{' with tied embedding rows' if extra else ''}")
    if epi == "gemm":
        return (_HEAD + _GEMM_KERNEL).format(**_common_fields(ep, table))
    if epi in ("smem", "split"):
        src = (_HEAD + _SMEM_EPI + (_SMEM_KERNEL if epi == "smem" else _SPLIT_KERNEL)).format(
            **render_fields(ep, table, extra, rounded))
        if rounded and not table:
            # the key is new at every step: a value of 1 (or one divisible by 16) must not make another kernel
            src = src.replace("@gluon.jit\ndef wgrad_update_gluon_kernel(",
                              "@gluon.jit(do_not_specialize=[\"EKEY\"])\ndef wgrad_update_gluon_kernel(")
        return src
    common = _common_fields(ep, table)
    states = ep.tensor_inputs[2:]
    new_vars = [f"new_{v}" for v in ("p", *states)]
    i12, i8, i4 = " " * 12, " " * 8, " " * 4
    if epi == "vec":
        return (_HEAD + _SPLITS + _VEC_KERNEL).format(
            **common,
            carry=", ".join(("p", *states)),
            carry_nx=", ".join(f"{v}_nx" for v in ("p", *states)),
            state_ptrs="".join(f"{s}_ptr, " for s in states),
            vec_first_loads="\n".join(f"{i4}{s} = gl.load({s}_ptr + offs, mask=msk)" for s in states),
            vec_next_loads="\n".join(f"{i4}{s}_nx = gl.load({s}_ptr + offs_n, mask=msk_n)" for s in states),
            vec_stores="\n".join(f"{i4}gl.store({s}_ptr + offs, {v}, mask=msk)" for s, v in zip(states, new_vars[1:])),
        )
    if epi != "tma":
        raise ValueError(f"epilogue data path {epi!r}")
    return _TEMPLATE.format(
        **common,
        state_descs="".join(f"{s}_desc, " for s in states),
        state_bufs="".join(f"{s}_bufs, " for s in states),
        state_obufs="".join(f"{s}_obufs, " for s in states),
        epi_loads="\n".join(f"{i12}_tma_in({s}_desc, rc, cc, bar, {s}_bufs.index(s), NB)" for s in states),
        chunk_loads="\n".join(f"{i4}{s} = {s}_bufs.index(s).load(gch.type.layout)" for s in states),
        chunk_out_slots="\n".join(f"{i8}{s}_out = {s}_obufs.index(o)" for s in states),
        chunk_in_slots="\n".join(f"{i8}{s}_out = {s}_bufs.index(s)" for s in states),
        chunk_stores="\n".join(f"{i4}{s}_out.store({v})" for s, v in zip(states, new_vars[1:])),
        chunk_tma_stores="\n".join(f"{i4}_tma_out({s}_desc, rc, cc, {s}_out, NB)" for s in states),
        alloc_states="\n".join(f"    {s}_bufs = gl.allocate_shared_memory(w_desc.dtype, SLOT, w_desc.layout)"
                               for s in states),
        alloc_out_states="\n".join(f"{i8}{s}_obufs = gl.allocate_shared_memory(w_desc.dtype, OSLOT, w_desc.layout)"
                                   for s in states),
        alias_out_states="\n".join(f"{i8}{s}_obufs = {s}_bufs" for s in states),
    )


def _common_fields(ep: Epilogue, table: bool) -> dict:
    # the names every module's pieces (_HEAD) are formatted with
    if ep.target != "cuda":
        raise GluonUnsupported(f"epilogue target {ep.target!r}")
    states = ep.tensor_inputs[2:]
    new_vars = [f"new_{v}" for v in ("p", *states)]
    return dict(
        rule=ep.rule_name,
        roll=any(op in ep.body for op in _ROLL_OPS),
        state_vars="".join(f"{s}, " for s in states),
        scalar_params="".join(f"c{i}, " for i in range(ep.n_kernel_scalars)),
        **scalar_fields(ep, table, "scal_ptr", "gl.load"),
        body=_to_gluon(ep.body) if ep.body.strip() else "    pass",
        outputs=", ".join(_to_gluon(o) for o in ep.outputs),
        new_vars=", ".join(new_vars),
        new_p=new_vars[0],
    )


# Elements per thread of a rounded kernel's bf16 W/state loads: 8 (16-byte vectors, ROWS_L [1,8] x [2,16]) -- GPU-run
# in stop 37 (H100: tests/test_stochastic_round.py's Gluon tests bitwise the spec at 4 and 8; the sweep 0-5 % faster
# than 4 at M = 256-4096, RESULTS.md "Gluon run 2"); 4 (8-byte vectors) is stop 36's layout, still built and tested.
SR_ROW_VEC = 8


def render_fields(ep: Epilogue, table: bool = False, extra: bool = False, rounded: int = 0) -> dict:
    """The names the smem-epilogue modules (_HEAD + _SMEM_EPI + a kernel after them) are formatted with; the
    grouped kernel (wgrad_update_group) is rendered with them too.

    ``rounded``: stochastic rounding (stochastic_round.py) with 4 or 8 bf16 elements per thread (SR_ROW_VEC); 0 off.
    W is bf16, the tensor states bf16 or fp32; both are
    loaded into fp32 (the rule runs on fp32 as for fp32 tensors), the new W is stored as _sround_bits of its
    element offset and the key EKEY (an int32 argument after the rule's scalars -- with ``table`` loaded from the
    row's word after them --, threaded with them, so the rule
    takes it too and ignores it), bf16 states rounded to nearest even as Tensor.to. Off, the fields leave the
    module's text as it was."""
    states = ep.tensor_inputs[2:]
    new_vars = [f"new_{v}" for v in ("p", *states)]
    i4 = " " * 4
    common = _common_fields(ep, table)
    carry_cvt = ""
    st_cvt = dict.fromkeys(states, "")
    if rounded:
        common["scalar_params"] += "EKEY, "
        if table:    # the key from the row, after the rule's scalars (a graph-capturable launch: no key argument)
            common["scalar_loads"] += key_load("scal_ptr", ep.n_kernel_scalars, "gl")
        else:
            common["kernel_scalar_params"] += "EKEY, "
        # converted where the math starts, not at the load: the lookahead (AHEAD chunks of every array, live across
        # the tile's hand-off) then holds bf16 pairs, half the registers (converted at the load, the split kernel's
        # AdamW spilled 224 B in its sm_90 compile)
        carry_cvt = "".join(f"\n    {v} = {v}.to(gl.float32)" for v in ("p", *states))
        st_cvt = {s: f"_as_elem({s}_ptr, " for s in states}
    # rounded == 8: 8 elements per thread, 16-byte vectors of the bf16 W/states, 16 threads per 128-column row and
    # two rows per warp (SR_ROW_VEC); 4 (and fp32 always): 4 per thread, 32 per row -- 8-byte bf16 loads, half the
    # bytes in flight per instruction (H100 Gluon SR run 1: 2.2-2.5x its floor at M <= 1024)
    row_vec, row_tpr, row_tpc = (8, 2, 16) if rounded == 8 else (4, 1, 32)
    return dict(
        **common,
        ekey_param="EKEY, " if rounded else "",
        row_vec=row_vec, row_tpr=row_tpr, row_tpc=row_tpc,
        round_fn=_ROUND_FN if rounded else "",
        carry_cvt=carry_cvt,
        w_store=(f"_sround_bits({new_vars[0]}, offs, EKEY).to(gl.bfloat16, fp_downcast_rounding=\"rtne\")"
                 if rounded else new_vars[0]),
        carry="".join(f"{v}, " for v in ("p", *states)),
        state_ptrs="".join(f"{s}_ptr, " for s in states) + ("e_ptr, p_ptr, " if extra else ""),
        extra_fn=_EXTRA_FN if extra else "", extra_add=_EXTRA_ADD if extra else "",
        extra_add_at=_EXTRA_ADD_AT if extra else "",
        smem_state_loads="".join(f"gl.load({s}_ptr + offs, mask=msk, eviction_policy=LD_EV), " for s in states),
        pf_states="\n".join(f"{i4}_l2_pf({s}_ptr + offs, nbs, ok)" for s in states),
        smem_stores="\n".join(f"{i4}gl.store({s}_ptr + offs, {st_cvt[s]}{v}{')' if rounded else ''}, mask=msk, "
                               "cache_modifier=ST_CM, eviction_policy=ST_EV)" for s, v in zip(states, new_vars[1:])),
    )


# ----------------------------------------------------------------------------------------------------
# per-rule source and kernel, cached (failures too: a rule that cannot render always goes to Triton)

_SOURCES: dict[str, tuple[Epilogue | None, str | None, str | None]] = {}   # rule -> (ep, source, why not)
# (rule, epi, table, extra, rounded) -> its module for epi="vec" / "smem" / "split" / "gemm", or any epi with a scalar table
_EPI_SOURCES: dict[tuple[str, str, bool, bool, bool], str] = {}
# rule (epi "tma", no table) or (rule, epi, table, extra, rounded) -> kernel
_KERNELS: dict[str | tuple[str, str, bool, bool, bool], object] = {}
_BROKEN: dict[str, str] = {}          # rule -> why its Gluon kernel failed to build/launch (falls back)
_LOCK = threading.Lock()


def _source_for(rule: Rule):
    hit = _SOURCES.get(rule.name)
    if hit is None:
        try:
            ep = compile_epilogue(rule, "cuda")
            hit = (ep, render_gluon_source(ep), None)
        except (EpilogueUnsupported, GluonUnsupported) as e:
            hit = (None, None, f"{type(e).__name__}: {e}")
        with _LOCK:
            _SOURCES.setdefault(rule.name, hit)
    return hit


def _epi_source(rule: Rule, epi: str, table: bool = False, extra: bool = False, rounded: int = 0) -> str:
    # the epi="vec" (v10) / "smem" (v11) / "split" (v12) / "gemm" (diagnostic) module, or a module reading its
    # scalars from a table, or adding a tied embedding's rows: rendered on demand, never by gluon_reason (the rule
    # renders for "tma" first)
    ep, src, why = _source_for(rule)
    if src is None:
        raise GluonUnsupported(why)
    hit = _EPI_SOURCES.get((rule.name, epi, table, extra, rounded))
    if hit is None:
        hit = render_gluon_source(ep, epi, table, extra, rounded)
        with _LOCK:
            _EPI_SOURCES.setdefault((rule.name, epi, table, extra, rounded), hit)
    return hit


def _kernel_for(rule: Rule, epi: str = "tma", table: bool = False, extra: bool = False, rounded: int = 0):
    key = rule.name if epi == "tma" and not table else (rule.name, epi, table, extra, rounded)
    kern = _KERNELS.get(key)
    if kern is None:
        ep, src, why = _source_for(rule)
        if src is None:
            raise GluonUnsupported(why)
        if epi != "tma" or table:
            src = _epi_source(rule, epi, table, extra, rounded)
        kern = load_kernel_module(src, f"gluon_{'' if epi == 'tma' else epi + '_'}{'table_' if table else ''}"
                                       f"{'extra_' if extra else ''}{f'sr{rounded}_' if rounded else ''}{ep.source_key}")
        kern = kern.wgrad_update_gluon_kernel
        with _LOCK:
            _KERNELS.setdefault(key, kern)
    return _KERNELS[key]


# ----------------------------------------------------------------------------------------------------
# configs


@dataclasses.dataclass(frozen=True)
class GConfig:
    bmt: int = 64          # tokens per GEMM stage
    bn: int = 128          # dW tile rows
    bk: int = 128          # dW tile cols
    epi_m: int = 64        # epilogue chunk rows (128 or 64: 64 doubles the bytes per row of a TMA box of equal size;
    #                        8: band chunks [32, 64], per warp 8 rows x 256 B, as 2 boxes [8, 32] (v8: AdamW 2-11 %
    #                        slower, SGD-momentum/Lion 1-4 % faster than [64, 32]; not picked)
    epi_n: int = 32        # epilogue chunk cols
    stages: int = 4        # GEMM ring depth
    es: int = 3            # epilogue ring depth (per ring)
    nring: int = 1         # 1: one epilogue ring shared by the consumers (epi turn); 2: one ring + loader each (v7)
    eout: int = 0          # 0: results stored from the input slot; > 0: out ring depth (per ring), input slots freed
    #                        right after their smem loads (v8: races on the H200, refused by _check_gconfig)
    group: int = 8
    cregs: int = 232       # setmaxnreg of the consumer warpgroups
    maxnreg: int = 168
    epi: str = "tma"       # epilogue data path: "tma" (the ring above); "vec" (v10, not picked): W/states loaded
    #                        and stored by the consumers with 16-byte vectors, one [32, 32] chunk ahead, no
    #                        epilogue ring or loader (es, nring, eout unused; epi_m = epi_n = 32); vec_config();
    #                        "smem" (v11, not picked): dW tile stored to smem, [epi_m, 128] row chunks with 16-byte
    #                        vectors, `ahead` chunks of loads in flight; smem_config(); "gemm" (overlap
    #                        diagnostic, never picked): the tma kernel's GEMM schedule alone, per-tile row sums of
    #                        dW stored instead of any W/state traffic (es, epi_m/n, nring, eout, ahead unused);
    #                        gemm_config()
    ahead: int = 1         # epi="smem": chunks of W/states loads in flight ahead of the math (1 or 2)
    evict: str = ""        # epi="smem": L2 hints of the W/state stream, which is touched once while the GEMM
    #                        re-reads its dY/X panels from L2 ("": none; "first": loads and stores evict_first;
    #                        "cs": loads evict_first, stores .cs; "ld": loads evict_first only) -- v12, NOTES_kernel.md
    dw_tiles: int = 1      # epi="split": dW tiles the MMA warpgroup hands over in turn (2: it never waits for the
    #                        epilogue of the tile before, at the cost of GEMM stages; prepared, not measured)
    stream: bool = True    # epi="split": False = overlap diagnostic, the epilogue warpgroups hand each dW tile back
    #                        without touching W/states (never picked; NOTES_kernel.md v12)
    l2pf: int = 0          # epi="split": rows of each epilogue warpgroup's half tile prefetched into L2 (cp.async.bulk
    #                        .prefetch) one tile ahead, while that tile's GEMM runs (0: none; 16, 32 or 64; stop 24:
    #                        slower, never picked)
    l2pf_first: bool = False  # epi="split", l2pf > 0: only the first tile's rows, before the loop
    hoist: bool = False    # epi="smem"/"split": chunk addresses from per-tile row/column bases computed once per
    #                        tile (_smem_step_at) instead of the tile order's div/mod at every chunk (prepared, not
    #                        measured)
    mma_warps: int = 4     # epi="split": warps of the MMA partition. 8 ("coop", coop_config): two MMA warpgroups share a
    #                        [128, 256] tile (64 rows each; operand bytes per FLOP 3/4 of a [128, 128] tile's), one
    #                        epilogue warpgroup streams the whole tile (the registers of 16 warps allow no second one).
    #                        For M >= 8192, where the GEMM schedule is the gap (RESULTS.md v12 follow-up); prepared on
    #                        CPU (stop 30), NOT GPU-run
    pdl: int = 0           # epi="split": launched as a programmatic dependent (PDL) of the kernel before it, its
    #                        CTAs starting as that kernel's CTAs exit: 1 = every partition waits (griddepcontrol.wait)
    #                        for it before touching memory (hides the launch and prologue); 2 = only the GEMM loader
    #                        waits, the epilogue loads W/states early (valid only where the kernel before never
    #                        writes them). Also FORGE_PDL=1/2. NOT GPU-run yet (NOTES_kernel.md "Stop 27")


# Rings' share of the 227 KB of smem per SM (compiler-added smem, the barriers, was < 1 KB in every sm_90 compile):
# 224 KB and up to 8 epilogue slots at M <= 1024, 208 KB and up to 6 above. H200 (NOTES_kernel.md v9): the slot
# that the extra 16 KB buys is 1-5 % faster at M = 256-1024 (AdamW 4096x4096 M=1024 0.150 vs 0.158 ms) and 5-9 %
# slower at M = 2048-4096 (the epilogue's reads then compete with the GEMM's operand loads).
_RING_SMEM = 224 * 1024
_SMALL_M = 1024


def ring_budget(m: int) -> tuple[int, int]:
    """(smem bytes for the rings, most epilogue slots) at M tokens."""
    return (_RING_SMEM, 8) if m <= _SMALL_M else (208 * 1024, 6)


def _fit_es(base: GConfig, stages: int, m: int, n_arrays: int, act_bytes: int) -> int:
    budget, cap = ring_budget(m)
    return min(cap, (budget - stages * base.bmt * (base.bn + base.bk) * act_bytes)
               // (n_arrays * base.epi_m * base.epi_n * 4))


def chunk_bytes(cfg: GConfig) -> int:
    """Bytes of one fp32 epilogue chunk of one array (band chunks: 4 boxes)."""
    return (4 if cfg.epi_m == 8 else 1) * cfg.epi_m * cfg.epi_n * 4


def gconfig_smem(cfg: GConfig, n_arrays: int, act_bytes: int = 2, store_grad: bool = False) -> int:
    """Bytes of the GEMM ring + the epilogue ring(s) (barriers not counted). ``n_arrays``: W, tensor states and dW
    when stored (``store_grad``: whether it is among them; only the out ring holds dW when eout > 0). epi="vec":
    the GEMM ring + each consumer's convert_layout scratch (one fp32 chunk); epi="smem": the GEMM ring + each
    consumer's fp32 dW tile; epi="gemm": the GEMM ring alone."""
    if cfg.epi == "gemm":
        return cfg.stages * cfg.bmt * (cfg.bn + cfg.bk) * act_bytes
    if cfg.epi == "vec":
        return cfg.stages * cfg.bmt * (cfg.bn + cfg.bk) * act_bytes + 2 * cfg.epi_m * cfg.epi_n * 4
    if cfg.epi == "smem":
        return cfg.stages * cfg.bmt * (cfg.bn + cfg.bk) * act_bytes + 2 * cfg.bn * cfg.bk * 4
    if cfg.epi == "split":
        return cfg.stages * cfg.bmt * (cfg.bn + cfg.bk) * act_bytes + cfg.dw_tiles * cfg.bn * cfg.bk * 4
    ch = chunk_bytes(cfg)
    if cfg.eout == 0:
        epi = cfg.es * n_arrays * ch
    else:
        epi = cfg.es * (n_arrays - store_grad) * ch + cfg.eout * n_arrays * ch
    return cfg.stages * cfg.bmt * (cfg.bn + cfg.bk) * act_bytes + cfg.nring * epi


@functools.lru_cache(maxsize=1024)    # called twice per launch; dataclasses.replace alone costs microseconds
def pick_gconfig(m: int, n_arrays: int, act_bytes: int = 2) -> GConfig | None:
    """The configuration for M tokens and ``n_arrays`` fp32 arrays the epilogue streams (W, tensor states, dW
    when stored); None when nothing fits (the caller then takes the Triton kernel).

    With 2-byte activations, where the H200 measured them faster (NOTES_kernel.md v11, v12):
    - v12's split kernel (one MMA warpgroup, two epilogue warpgroups) for 3 arrays (AdamW's W, exp_avg,
      exp_avg_sq) above M=512 and for 2 arrays (SGD-momentum, Lion) above M=1024: AdamW 4096x4096 M=1024/2048/
      4096/8192 4-6/11-13/10/7 % faster than the previous picks, lm_head 128256x4096 M=1024/4096 4/10 %,
      14336x4096 M=1024/8192 4/1 % (4096x14336 M=8192 2 % slower); SGD-momentum / Lion M=2048 11/9 %, 4096 6 %,
      8192 -1/+4 %; at M <= 1024 the 2-array rules' TMA ring (8 slots) stayed 2-10 % faster; up to M=2048 with
      per-tile chunk bases (hoist, _SPLIT_HOIST_M);
    - v11's smem epilogue (dW through smem, two [16, 128] chunks of loads in flight) for 3 arrays at M <= 512:
      AdamW 4096x4096 M=64/256 0.1150/0.1206 ms vs the TMA ring's 0.1238/0.1300, the split kernel 0.1256 at 256;
    - else the TMA ring (``_pick_tma``); 4 or more arrays (dW stored, Adam-amsgrad) were not measured with the
      split kernel and stay there.
    """
    if act_bytes == 4:
        return tf32_config(m)
    cfg = None
    if m > _SPLIT_M.get(n_arrays, m):
        cfg = split_config(hoist=m <= _SPLIT_HOIST_M)
    elif n_arrays == 3:
        cfg = smem_config()
    # fp32 activations: neither fits its GEMM stages (the TMA ring's pick then runs fewer)
    if cfg is not None and gconfig_smem(cfg, n_arrays, act_bytes) <= _RING_SMEM:
        return cfg
    return _pick_tma(m, n_arrays, act_bytes)


# stochastic rounding (_pick_rounded): the largest M that takes the smem kernel; the largest that takes the split
# kernel with 16 rows two chunks ahead
_SR_SMEM_M = 1024
_SR_SPLIT16_M = 4096
# arrays streamed -> the largest M that does NOT take the split kernel (pick_gconfig)
_SPLIT_M = {3: 512, 2: 1024}
# the largest M whose split kernel takes hoist=True: two H100 runs (stop 24, RESULTS.md "L2 prefetch of the next tile
# and hoist", NOTES_kernel.md "Stop 24"): 1-3 % faster at M = 1024-2048 on 20 of 22 shape/M points (2048x2048 M=1024
# up to 12 %), 1-7 % slower at M = 4096-8192
_SPLIT_HOIST_M = 2048


def _pick_tma(m: int, n_arrays: int, act_bytes: int = 2) -> GConfig | None:
    """TMA-ring epilogue: ring depths for M and the number of fp32 [EPI_M, EPI_N] arrays per epilogue slot (W,
    tensor states, dW when stored); None when even 2 GEMM stages and 2 slots do not fit.

    H200: 3 GEMM stages at M <= 512, 4 above (v4-v7: 4 stages 2-10 % slower at M=256, 3 stages 10-25 % slower
    from M=2048 on; v9: 2 stages or 32 tokens per stage, for more slots, 1-50 % slower from M=256 on); slots as
    many as fit ``ring_budget``. One shared epilogue ring (v6) with [64, 32] chunks: 2-5 %
    faster than [128, 16] at every measured point, AdamW/SGD-momentum/Lion, M = 256..8192 (v7, NOTES_kernel.md);
    two rings (nring=2) were 1-5 % slower than one (best layouts of each) and are not picked.
    """
    base = GConfig(nring=1, epi_m=64, epi_n=32)
    for stages in ((3, 2) if m <= 512 else (4, 3, 2)):
        es = _fit_es(base, stages, m, n_arrays, act_bytes)
        if es >= 2:
            return dataclasses.replace(base, stages=stages, es=es)
    return None


def gconfig_candidates(m: int, n_arrays: int, act_bytes: int = 2) -> list[GConfig]:
    """Configurations worth timing for a launch (wgrad_update_autotune): pick_gconfig's, then the same layout with
    the other GEMM ring depth (3 or 4 stages, slots as many as fit) -- the one knob whose best value moved with M
    in every sweep (v4-v7); the chunk layouts and two rings lost everywhere and are not worth compiling. Where
    the pick is the smem epilogue (v11) or the split kernel (v12): it, then the TMA ring's pick (margins of
    -2 to 13 %); for the split kernel then its variants that won somewhere in stop 24's H100 sweep (RESULTS.md
    "split kernel knobs"): hoist toggled, hoist with evict_first loads (lm_head 32000x2048 M=1024-2048 3-7 %),
    hoist with tile-order group 4 (K=2048 shapes 1-5 %)."""
    pick = pick_gconfig(m, n_arrays, act_bytes)
    if act_bytes == 4:   # fp32 under TF32: the split kernel only (K-major stages); hoist the one knob offered
        return [pick, dataclasses.replace(pick, hoist=not pick.hoist)]
    base = _pick_tma(m, n_arrays, act_bytes)
    if pick is not None and pick.epi in ("smem", "split"):
        out = [pick] + ([base] if base is not None else [])
        if pick.epi == "split":
            h = dataclasses.replace(pick, hoist=True)
            out += [c for c in (dataclasses.replace(pick, hoist=not pick.hoist), dataclasses.replace(h, evict="ld"),
                                dataclasses.replace(h, group=4)) if c != pick]
        return out
    if base is None:
        return []
    out = [base]
    for stages in (3, 4):
        if stages != base.stages:
            es = _fit_es(base, stages, m, n_arrays, act_bytes)
            if es >= 2:
                out.append(dataclasses.replace(base, stages=stages, es=es))
    return out


# v10 (epi="vec", prepared on CPU, not measured, not picked): 6 GEMM stages (192 KB) + 8 KB of convert_layout
# scratch ([32, 32] chunks; sm_90 compile: 200.1 KB); 7 stages would need 232 KB
VEC_STAGES = 6


def vec_config(stages: int = VEC_STAGES) -> GConfig:
    """The v10 vector-load epilogue (GConfig.epi="vec", [32, 32] chunks) with ``stages`` GEMM stages, for
    benchmarks and tests (``config=``); no epilogue ring, so es/nring/eout are unused (es=0)."""
    cfg = GConfig(epi="vec", stages=stages, es=0, epi_m=32, epi_n=32)
    _check_gconfig(cfg)
    return cfg


# v11 (epi="smem", prepared on CPU, not measured, not picked): 2 x 64 KB of dW tiles leave room for 3 GEMM stages
# (96 KB; 224.1 KB in all on sm_90); [16, 128] chunks, 2 chunks of lookahead
SMEM_STAGES = 3


# Registers per consumer thread for the lookahead (rows / 4 x 4 fp32 per array and chunk): it is live across the
# next tile's GEMM, next to the accumulator's 128. sm_90 compiles (NOTES v11): 64 and 96 (AdamW [16, 128] x 2)
# never spilled; 128 (Adam-amsgrad / RMSprop-centered-momentum [16, 128] x 2) spilled 488-780 B.
SMEM_AHEAD_REGS = 96


def smem_ahead(cfg: GConfig, n_load: int, load_bytes: int | None = None) -> int:
    """Chunks of lookahead a launch uses: cfg.ahead, lowered (to 1 at the least) until the lookahead of ``n_load``
    arrays (W + tensor states) fits SMEM_AHEAD_REGS. ``load_bytes``: the arrays' element sizes summed, where they
    are not all fp32 (a stochastically rounded launch holds its bf16 lookahead as loaded: two per register)."""
    # a [R, C] chunk is R * C / 128 fp32 per thread and array (R per thread for the [R, 128] chunks)
    words = n_load if load_bytes is None else -(-load_bytes // 4)
    return max(1, min(cfg.ahead, SMEM_AHEAD_REGS // (cfg.epi_m * cfg.epi_n // 128 * words)))


# GConfig.evict -> (load eviction_policy, store eviction_policy, store cache_modifier) of the smem epilogue
_EVICT = {"": ("", "", ""), "first": ("evict_first", "evict_first", ""), "cs": ("evict_first", "", ".cs"),
          "ld": ("evict_first", "", "")}


def smem_config(rows: int = 16, ahead: int = 2, stages: int = SMEM_STAGES, bmt: int = 64,
                evict: str = "", hoist: bool = False) -> GConfig:
    """The v11 epilogue (GConfig.epi="smem"): dW through each consumer's smem tile, [rows, 128] chunks with
    ``ahead`` chunks of W/states loads in flight (at most: ``smem_ahead`` lowers it for rules with 3 tensor states),
    ``stages`` GEMM stages of ``bmt`` tokens; for benchmarks and tests (``config=``). No epilogue ring
    (es/nring/eout unused, es=0)."""
    # setmaxnreg 240 for the consumers: the lookahead stays live across the next tile's GEMM, next to the 128
    # accumulator registers (AdamW [16, 128] x 2 ahead spilled 8 B at 232, 44 B at 248, where the compiler then
    # gives the default partition only 232; 0 at 240, both consumers 240)
    cfg = GConfig(epi="smem", stages=stages, bmt=bmt, es=0, epi_m=rows, epi_n=128, ahead=ahead, cregs=240,
                  evict=evict, hoist=hoist)
    _check_gconfig(cfg)
    return cfg


# v12 (epi="split"): one dW tile (64 KB) leaves 160 KB for 5 GEMM stages of 64 tokens (two tiles: 3 stages)
SPLIT_STAGES = 5


def split_config(rows: int = 8, ahead: int = 4, stages: int = SPLIT_STAGES, bmt: int = 64, evict: str = "",
                 eregs: int = 152, stream: bool = True, dw_tiles: int = 1, hoist: bool = False,
                 l2pf: int = 0, l2pf_first: bool = False, pdl: int = 0) -> GConfig:
    """The v12 kernel (GConfig.epi="split"): one MMA warpgroup, two epilogue warpgroups streaming half a tile each
    with the smem kernel's [rows, 128] chunks and ``ahead`` chunks of lookahead (smem_ahead caps it), ``stages``
    GEMM stages of ``bmt`` tokens; for benchmarks and tests (``config=``). Registers: triton pads the loader's
    warp to a warpgroup, so 16 warps launch with the cap (maxnreg) 128 (512 threads x 128 = the 64 K registers);
    setmaxnreg then gives each epilogue warpgroup ``eregs``, the loader's 24 and the MMA warpgroup the rest:
    (65,536 - 2 x 128 x eregs - 128 x 24) / 128, rounded down to 8 (184 at eregs 152)."""
    cfg = GConfig(epi="split", stages=stages, bmt=bmt, es=0, epi_m=rows, epi_n=128, ahead=ahead, cregs=eregs,
                  maxnreg=128, evict=evict, stream=stream, dw_tiles=dw_tiles, hoist=hoist, l2pf=l2pf,
                  l2pf_first=l2pf_first, pdl=pdl)
    _check_gconfig(cfg)
    return cfg


def tf32_config(m: int, stages: int = SPLIT_STAGES) -> GConfig:
    """fp32 activations under TF32 (pick_gconfig with 4-byte activations, any number of arrays): the split kernel
    with 32-token stages of the K-major copies -- the same 32 KB per stage as 64 bf16 tokens, so the 5 stages and
    the dW tile fill the same 224 KB; hoist as for bf16 (up to _SPLIT_HOIST_M). Prepared on CPU (sm_90 compiles);
    measured: benchmarks/RESULTS.md."""
    return split_config(bmt=32, stages=stages, hoist=m <= _SPLIT_HOIST_M)


def coop_config(rows: int = 4, ahead: int = 4, stages: int = 4, bmt: int = 32, eregs: int = 152,
                stream: bool = True, hoist: bool = False, evict: str = "") -> GConfig:
    """The coop split kernel (GConfig.mma_warps=8): [128, 256] dW tiles, two MMA warpgroups (64 rows each), one
    epilogue warpgroup streaming [rows, 256] chunks, ``stages`` GEMM stages of ``bmt`` tokens beside the 128 KB dW
    tile (4 x 32 tokens x 384 x 2 B = 96 KB: 224 KB). Why: at M >= 8192 the split kernel's GEMM alone is 14 % slower
    than cuBLAS (RESULTS.md "v12 follow-up"), reading 1.5x its operand bytes; a [128, 256] tile reads 3/4 of the
    [128, 128] tile's per FLOP. The one epilogue warpgroup streams ~63 us of W/m/v per tile against ~96 us of GEMM
    at M = 8192 (AdamW; H200 rates): hidden there, not at M <= 4096. For benchmarks (``--cases coop``) and tests
    (``config=``); never picked until measured. fp32 activations (TF32, K-major copies) need stages of half the
    tokens: ``coop_config(bmt=16)`` (4 x 16 tokens x 384 x 4 B = 96 KB)."""
    cfg = GConfig(epi="split", bk=256, stages=stages, bmt=bmt, es=0, epi_m=rows, epi_n=256, ahead=ahead,
                  cregs=eregs, maxnreg=128, evict=evict, stream=stream, hoist=hoist, mma_warps=8)
    _check_gconfig(cfg)
    return cfg


def gemm_config(stages: int = 4, bmt: int = 64) -> GConfig:
    """The overlap diagnostic (GConfig.epi="gemm"): the default kernel's GEMM schedule (``stages`` GEMM stages of
    ``bmt`` tokens, same loader, tile GEMM, mma turn and tile order) with no epilogue traffic; each tile's row sums
    of dW go to ``side_out`` (shape ``gemm_sums_shape``). For benchmarks and tests (``config=``), never picked.
    No epilogue ring (es=0)."""
    cfg = GConfig(epi="gemm", stages=stages, bmt=bmt, es=0)
    _check_gconfig(cfg)
    return cfg


def gemm_sums_shape(n: int, k: int, cfg: GConfig | None = None) -> tuple[int, int]:
    """Shape of the epi="gemm" kernel's output: [ceil(N / bn) * bn, ceil(K / bk)], element [r, j] = the sum of
    dW[r, j * bk .. (j + 1) * bk) (rows past N: 0)."""
    cfg = cfg or GConfig(epi="gemm")
    return -(-n // cfg.bn) * cfg.bn, -(-k // cfg.bk)


def _box(cfg: GConfig) -> list[int]:
    # the epilogue's TMA box: the chunk, or for band chunks [8, 32] (_tma_in)
    return [8, 32] if cfg.epi_m == 8 else [cfg.epi_m, cfg.epi_n]


def _boxes(cfg: GConfig) -> int:
    return 4 * (cfg.epi_n // 32) if cfg.epi_m == 8 else 1


def _check_gconfig(cfg: GConfig):
    # shapes the template's chunk splits are written for (a [128, 128] tile in the 4-warp wgmma layout)
    if (not cfg.stream or cfg.dw_tiles != 1) and cfg.epi != "split":
        raise ValueError(f"Gluon config {cfg}: stream=False (the overlap diagnostic) and dw_tiles exist for "
                         "epi='split' only")
    if (cfg.l2pf or cfg.l2pf_first) and (cfg.epi != "split" or cfg.l2pf not in (16, 32, 64)):
        raise ValueError(f"Gluon config {cfg}: l2pf (16, 32 or 64 rows per half tile) exists for epi='split' only")
    if cfg.hoist and cfg.epi not in ("smem", "split"):
        raise ValueError(f"Gluon config {cfg}: hoist exists for the smem chunk walks (epi='smem' / 'split') only")
    if cfg.evict and cfg.epi not in ("smem", "split"):
        raise ValueError(f"Gluon config {cfg}: L2 hints (evict) exist for the vector-load streams of epi='smem' / "
                         "'split' only")
    if cfg.epi == "gemm":
        # the overlap diagnostic: [128, 128] tiles (the row sums assume the 4-warp wgmma layout of the tma kernel),
        # one GEMM ring of 32- or 64-token stages that fits the rings' smem with 2-byte activations (the only kind
        # the Gluon path takes), nothing of the epilogue's: no second ring, no out ring
        if not (cfg.bn == cfg.bk == 128 and cfg.bmt in (32, 64) and cfg.nring == 1 and cfg.eout == 0
                and cfg.stages >= 2 and gconfig_smem(cfg, 0, 2) <= _RING_SMEM):
            raise ValueError(f"unsupported Gluon config {cfg} (epi='gemm': 128x128 tiles, bmt 32/64, "
                             f">= 2 GEMM stages within {_RING_SMEM // 1024} KB, nring=1, eout=0)")
        return
    if cfg.epi == "vec":
        # _vec_split / _vec_chunk: [32, 32] chunks (8 fp32 per thread), one GEMM ring and no epilogue ring (so no
        # band chunks, second ring or out ring). [64, 32] chunks (16 per thread: the accumulator's 128 registers +
        # two chunks of W/states + dW) spilled 432 B (AdamW) / 1,188 B (AdamW with dW) in a first sm_90 compile;
        # [32, 128] chunks (the probe's best, 32 per thread) would spill more
        if not (cfg.bn == cfg.bk == 128 and cfg.epi_m == 32 and cfg.epi_n == 32 and cfg.nring == 1
                and cfg.eout == 0 and cfg.stages >= 2):
            raise ValueError(f"unsupported Gluon config {cfg} (epi='vec': [32, 32] chunks, nring=1, eout=0)")
        return
    if cfg.epi == "smem":
        # _smem_consumer: [R, 128] row chunks, R 8 or 16 (R / 4 rows x 4 fp32 per thread and array), 1-2 chunks
        # of lookahead, one GEMM ring beside 2 x 64 KB of dW tiles: 64-token stages 2-3 (3 x 32 KB + 128 KB = 224 KB
        # of 227), 32-token stages up to 6 (a deeper ring for large M). [32, 128] chunks spilled for AdamW in a
        # sm_90 compile even with one chunk ahead (404 B; 1,352 B with dW)
        if not (cfg.bn == cfg.bk == 128 and cfg.bmt in (32, 64) and cfg.epi_m in (8, 16) and cfg.epi_n == 128
                and cfg.ahead in (1, 2) and cfg.nring == 1 and cfg.eout == 0 and cfg.stages >= 2
                and cfg.evict in _EVICT and gconfig_smem(cfg, 0, 2) <= _RING_SMEM):
            raise ValueError(f"unsupported Gluon config {cfg} (epi='smem': [8|16, 128] chunks, ahead 1-2, "
                             f">= 2 GEMM stages of 32 or 64 tokens within {_RING_SMEM // 1024} KB with the dW tiles, "
                             "nring=1, eout=0)")
        return
    if cfg.epi == "split" and cfg.mma_warps == 8:
        # coop (coop_config): [128, 256] tiles, two MMA warpgroups, ONE epilogue warpgroup walking BN / R chunks of
        # [R, 256] (R 4 or 8), one dW tile (128 KB) beside the GEMM ring; 16 warps' registers: the MMA partition
        # gets (65,536 - 128 x cregs - 128 x 24) / 256 (>= 160: its 128 accumulator registers and addressing)
        if not (cfg.bn == 128 and cfg.bk == 256 and cfg.bmt in (16, 32, 64) and cfg.epi_m in (4, 8)
                and cfg.epi_n == 256 and 1 <= cfg.ahead <= cfg.bn // cfg.epi_m and cfg.nring == 1
                and cfg.eout == 0 and cfg.stages >= 2 and cfg.evict in _EVICT and cfg.dw_tiles == 1
                and not cfg.l2pf and not cfg.pdl and gconfig_smem(cfg, 0, 2) <= _RING_SMEM
                and cfg.maxnreg * 16 * 32 <= 65536 and (65536 - 128 * cfg.cregs - 128 * 24) // 256 >= 160):
            raise ValueError(f"unsupported Gluon config {cfg} (coop: 128x256 tiles, [4|8, 256] chunks, one dW tile "
                             f"and >= 2 GEMM stages of 16, 32 or 64 tokens within {_RING_SMEM // 1024} KB, no l2pf/pdl, "
                             ">= 160 registers for the MMA warpgroups)")
        return
    if cfg.epi == "split" and cfg.mma_warps != 4:
        raise ValueError(f"Gluon config {cfg}: mma_warps is 4, or 8 for the coop split kernel")
    if cfg.mma_warps != 4:
        raise ValueError(f"Gluon config {cfg}: mma_warps exists for epi='split' only")
    if cfg.epi == "split":
        # _split_epi: [R, 128] chunks, R 8 or 16, each epilogue warpgroup walks BN / 2 / R of them per tile (the
        # lookahead at most that many); one or two dW tiles beside the GEMM ring within the smem budget
        if not (cfg.bn == cfg.bk == 128 and cfg.bmt in (32, 64) and cfg.epi_m in (8, 16) and cfg.epi_n == 128
                and 1 <= cfg.ahead <= cfg.bn // 2 // cfg.epi_m and cfg.nring == 1 and cfg.eout == 0
                and cfg.stages >= 2 and cfg.evict in _EVICT and cfg.dw_tiles in (1, 2)
                and gconfig_smem(cfg, 0, 2) <= _RING_SMEM
                and cfg.maxnreg * 16 * 32 <= 65536 and 2 * 128 * cfg.cregs + 128 * 24 <= 65536 - 128 * 168):
            raise ValueError(f"unsupported Gluon config {cfg} (epi='split': [8|16, 128] chunks, lookahead <= the "
                             f"chunks per half tile, >= 2 GEMM stages of 32 or 64 tokens within "
                             f"{_RING_SMEM // 1024} KB with the dW tile, nring=1, eout=0, registers for 16 warps)")
        return
    if cfg.epi != "tma":
        raise ValueError(f"Gluon config {cfg}: unknown epilogue data path {cfg.epi!r}")
    if cfg.eout:
        # v8's out ring is not exact: on the H200 it gave wrong W/states at some shapes (bench checks at M=256 and
        # 4096; 32 of 776,000 elements of W in tests/test_wgrad_update_gluon.py), a race not found; it was at most
        # 2-5 % faster where right (NOTES_kernel.md v8 measured), so the template keeps the code, unreachable
        raise ValueError(f"Gluon config {cfg}: the out ring (eout > 0) races on the H200 and is refused")
    ok = cfg.bn == cfg.bk == 128 and cfg.nring in (1, 2) and cfg.es >= 1
    if cfg.epi_m == 8:
        # [32, 128] band chunks (512 B rows) hold 32 elements per thread: AdamW spilled 396 B (v8), not offered
        ok = ok and cfg.epi_n == 64
    else:
        # boxes wider than 128 B: triton 3.6 would store only their first 128 B columns (see _tma_in)
        ok = ok and cfg.epi_m in (64, 128) and cfg.epi_n in (8, 16, 32)
    if not ok:
        raise ValueError(f"unsupported Gluon config {cfg}")


# ----------------------------------------------------------------------------------------------------
# selection

_CAP: dict[int, tuple[int, int]] = {}
_SMS: dict[int, int] = {}
_GLUON_OK: list[bool] = []


def gluon_available() -> bool:
    """triton.experimental.gluon with the Hopper pieces this kernel uses (checked once, lazily)."""
    if not _GLUON_OK:
        try:
            from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
            from triton.experimental.gluon.language import warp_specialize  # noqa: F401
            ok = True
        except Exception as e:  # absent, or a triton whose Gluon API moved
            log.debug("forge: Gluon wgrad kernel unavailable: %s: %s", type(e).__name__, e)
            ok = False
        _GLUON_OK.append(ok)
    return _GLUON_OK[0]


def _device_ok(dev: torch.device) -> bool:
    # exactly sm_90: wgmma/setmaxnreg code; other archs (sm_100 has no wgmma) keep the Triton kernel
    if dev.type != "cuda":
        return False
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    cap = _CAP.get(idx)
    if cap is None:
        cap = _CAP[idx] = torch.cuda.get_device_capability(idx)
    return cap == (9, 0)


PDL_ENV = "FORGE_PDL"


def use_pdl(cfg: GConfig) -> int:
    """The programmatic-dependent-launch mode of a split-kernel launch with ``cfg`` (GConfig.pdl, else FORGE_PDL=1
    or 2; 0 = a plain launch): opt-in, it has not run on a GPU yet."""
    if cfg.epi != "split":
        return 0
    if cfg.pdl:
        return cfg.pdl
    env = os.environ.get(PDL_ENV, "0").strip()
    return int(env) if env in ("1", "2") else 0


def pdl_opts(cfg: GConfig, allowed: bool = True) -> dict:
    """A split-kernel launch's PDL options: the kernel's PDL constexpr always (launch_memo builds its fast entry
    only when every kernel parameter is given), and launch_pdl when it is on."""
    pdl = use_pdl(cfg) if allowed else 0
    if not pdl:
        return dict(PDL=0)
    counters["pdl_prepared"] += 1
    return dict(PDL=pdl, launch_pdl=True)


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    return mode if mode in ("auto", "gluon", "triton") else "auto"


def gluon_reason(weight, dy_t, x, states, rule: Rule, side_out=None, table=None, extra=None,
                 ekey=None) -> str | None:
    """None when this launch goes to the Gluon kernel, else why not (it then goes to the Triton kernel).
    ``table``: the launch reads its scalars from this device row; ``states`` are the tensor states alone.
    ``extra``: a tied embedding's (rows, pos) (wgrad_update_triton.launch_wgrad_update): only with
    FORGE_GLUON_EXTRA=1 -- the smem/split variant that adds them compiles for sm_90 but has not run on a GPU yet.
    ``ekey``: a bf16 weight stored stochastically rounded (wgrad_update_triton.check_low_precision): the smem or
    split kernel, bf16 activations, no tied rows, dW (fp32) the only side output; with a table the key is the
    row's (ekey=TABLE_KEY)."""
    rounded = ekey is not None
    if rounded and extra is not None:
        return "stochastic rounding with tied embedding rows: the Triton kernel"
    if extra is not None and os.environ.get(EXTRA_ENV) != "1":
        return f"tied embedding rows: the Triton kernel ({EXTRA_ENV}=1 tries the Gluon variant, not yet GPU-tested)"
    mode = _mode()
    if mode == "triton":
        return f"{ENV}=triton"
    if mode == "auto" and not AUTO_GLUON:
        return "auto picks the Triton kernel"
    if mode == "auto" and _auto_keeps_triton(rule):
        return "auto: libdevice math in the rule's epilogue, not measured through Gluon (Triton kernel)"
    if _broken_key(rule, rounded) in _BROKEN:
        return _BROKEN[_broken_key(rule, rounded)]
    dev = weight.device
    if dy_t.device != dev or x.device != dev or not _device_ok(dev):
        return "not an sm_90 CUDA device"
    if not gluon_available():
        return "triton.experimental.gluon (Hopper) not importable"
    if dy_t.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations {dy_t.dtype}/{x.dtype} (bf16, fp16 or -- under TF32 -- fp32, same dtype)"
    n, k = weight.shape
    m = x.shape[0]
    if m == 0:
        return "M == 0"
    if rounded and x.dtype == torch.float32:
        return "stochastic rounding with fp32 activations: the Triton kernel"
    if x.dtype == torch.float32:
        why = tf32_reason(dy_t, x, extra)
        if why is not None:
            return why
    # TMA: dY row-major [M, N] (dy_t its transpose, as autograd gives it), X row-major [M, K]; 16-byte aligned
    # bases and row strides (N, K multiples of 8 for 2-byte activations; fp32 [N, K] then needs K % 4 too). fp32
    # activations are copied K-major whatever their layout (_prepare)
    elif not dy_t.t().is_contiguous() or not x.is_contiguous():
        return "dy_t must be the transpose of a row-major dY and x row-major"
    if n % 8 or k % 8:
        return "N and K must be multiples of 8 (16-byte TMA row strides)"
    tensor_states = split_states(rule, states, table)[0]
    epi = [weight, *tensor_states]
    if rounded:
        # dtypes as the Triton kernel takes them: a bf16 weight, bf16/fp32 states, fp32 dW the only side output
        from .wgrad_update_triton import check_low_precision

        try:
            check_low_precision(weight, tensor_states, side_out, ekey)
        except ValueError as e:
            return f"stochastic rounding: {e}"
    for t in epi:
        if ((t.dtype != torch.float32 and not rounded) or not t.is_contiguous() or t.shape != weight.shape
                or t.device != dev):
            return "weight/states must be contiguous fp32 [N, K] on the weight's device"
    if side_out is not None:
        try:
            check_side_out(side_out, weight)
        except ValueError as e:
            return str(e)
        epi.append(side_out)
    if any(t.data_ptr() % 16 for t in (dy_t, x, *epi)):
        return "a base pointer is not 16-byte aligned"
    ep, src, why = _source_for(rule)
    if src is None:
        return why
    if pick_for(m, 1 + len(tensor_states), x.element_size(), side_mode(side_out), extra is not None,
                rounded) is None:
        return f"{len(epi)} arrays per epilogue slot do not fit in shared memory"
    return None


def _broken_key(rule: Rule, rounded: bool) -> str:
    # a rounded kernel that fails to build sends only rounded launches to Triton
    return rule.name + "/rounded" if rounded else rule.name


EXTRA_ENV = "FORGE_GLUON_EXTRA"
TF32_ENV = "FORGE_GLUON_TF32"


def tf32_enabled() -> bool:
    """fp32 activations under TF32 go to the Gluon split kernel on K-major copies unless FORGE_GLUON_TF32=0 (then
    the Triton kernel's bf16x3 dot, 0.40-0.58x of cuBLAS TF32 + fused AdamW). Part of the launch memo's kind."""
    return os.environ.get(TF32_ENV, "1").strip() not in ("0", "false", "off", "no")


def tf32_reason(dy_t, x, extra=None) -> str | None:
    """None when fp32 activations can take the Gluon kernel: TF32 allowed for fp32 matmuls (the precision torch.mm
    takes there; IEEE stays on the Triton kernel's FMA dot), M a multiple of 4 (16-byte rows of the [N, M] / [K, M]
    copies' TMA descriptors), no tied embedding's rows (not built for this path)."""
    if fp32_dot_precision(dy_t, x) != "tf32":
        return "fp32 activations without TF32: the IEEE fp32 GEMM (Triton kernel)"
    if not tf32_enabled():
        return f"fp32 activations under TF32: {TF32_ENV}=0 (Triton kernel)"
    if x.shape[0] % 4:
        return "fp32 activations under TF32: M must be a multiple of 4 (16-byte rows of the K-major copies)"
    if extra is not None:
        return "fp32 activations under TF32 with a tied embedding's rows (Triton kernel)"
    return None


# epilogues that address W/states through pointers: they store the side output's cast copy (SIDE_CAST) from
# registers; the TMA ring's stores go through fp32 smem slots and do not
POINTER_EPIS = ("smem", "split", "vec")


def pick_for(m: int, n_load: int, act_bytes: int, mode: int, extra: bool = False,
             rounded: bool = False) -> GConfig | None:
    """``pick_gconfig`` for a launch streaming ``n_load`` fp32 arrays (W, tensor states) with side output ``mode``
    (wgrad_update_triton.side_mode). The cast copy adds 2-byte stores, not a streamed array: the pick of the
    arrays read, on a pointer epilogue (the smem kernel where that pick is the TMA ring; not measured). ``extra``
    (a tied embedding's rows): the smem or split kernel, likewise. ``rounded`` (stochastic rounding): _pick_rounded."""
    if rounded:
        return _pick_rounded(m, act_bytes)
    if mode != SIDE_CAST and not extra:
        return pick_gconfig(m, n_load + (mode == SIDE_GRAD), act_bytes)
    cfg = pick_gconfig(m, n_load + (mode == SIDE_GRAD), act_bytes)
    if extra and cfg is not None and cfg.hoist:
        # the tied rows with hoist: not measured, and AdamW's sm_90 compile spills 72 B instead of 16
        cfg = dataclasses.replace(cfg, hoist=False)
    if cfg is not None and cfg.epi in (("smem", "split") if extra else POINTER_EPIS):
        return cfg
    cfg = smem_config()
    return cfg if gconfig_smem(cfg, n_load, act_bytes) <= _RING_SMEM else None


@functools.lru_cache(maxsize=1024)    # as pick_gconfig: called twice per launch
def _pick_rounded(m: int, act_bytes: int) -> GConfig | None:
    # H100 sweep at 16-byte loads (RESULTS.md "bf16 weights with stochastic rounding", Gluon run 2, AdamW 4096x4096):
    # the smem kernel with one chunk ahead and hoisted chunk bases was the fastest at M = 256 and 1024 (0.095 / 0.125
    # ms vs 0.102 / 0.133 without hoist, run 1's pick), the split kernel with hoist at 2048 (r8a4h 0.163) and, with 16
    # rows two ahead, at 4096 (r16a2h 0.244 vs r8a4 0.259); at 8192 the split kernel as the fp32 pick (run 1's sweep).
    # Neither kernel's smem depends on the arrays streamed
    if m <= _SR_SMEM_M:
        cfg = smem_config(ahead=1, hoist=True)
    elif m <= _SPLIT_HOIST_M:
        cfg = split_config(hoist=True)
    elif m <= _SR_SPLIT16_M:
        cfg = split_config(rows=16, ahead=2, hoist=True)
    else:
        cfg = split_config()
    return cfg if gconfig_smem(cfg, 0, act_bytes) <= _RING_SMEM else None


def _auto_keeps_triton(rule: Rule) -> bool:
    ep = _source_for(rule)[0]
    return ep is None or any(op in ep.body for op in _AUTO_TRITON_OPS)


def takes_rounded(device: torch.device, n: int, k: int) -> bool:
    """Whether a stochastically rounded update of an [n, k] weight on ``device`` goes to this kernel, judged before
    any tensor exists (the pattern pass: wgrad_update_pattern.sr_fused_max_tokens): sm_90 with gluon, the Gluon
    path not switched off (FORGE_WGRAD_KERNEL=triton), 16-byte rows. gluon_reason decides each launch."""
    return n % 8 == 0 and k % 8 == 0 and _mode() != "triton" and _device_ok(device) and gluon_available()


def use_gluon(weight, dy_t, x, states, rule: Rule, side_out=None, table=None) -> bool:
    return gluon_reason(weight, dy_t, x, states, rule, side_out, table) is None


# ----------------------------------------------------------------------------------------------------
# launcher


def _num_sms(dev: torch.device) -> int:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


@functools.lru_cache(maxsize=None)
def _smem_layouts(cfg: GConfig, act_dtype: torch.dtype):
    # per launch these would cost a few microseconds of host time each
    from triton.experimental.gluon import language as gl

    if act_dtype == torch.float32:   # K-major boxes of the transposed copies (_prepare)
        return (gl.NVMMASharedLayout.get_default_for([cfg.bn, cfg.bmt], gl.float32),
                gl.NVMMASharedLayout.get_default_for([cfg.bk, cfg.bmt], gl.float32),
                gl.NVMMASharedLayout.get_default_for(_box(cfg), gl.float32))
    act = gl.bfloat16 if act_dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([cfg.bmt, cfg.bn], act),
            gl.NVMMASharedLayout.get_default_for([cfg.bmt, cfg.bk], act),
            gl.NVMMASharedLayout.get_default_for(_box(cfg), gl.float32))


def _prepare(weight, dy_t, x, states, hparams, rule: Rule, side_out=None, *, config: GConfig | None = None,
             max_ctas: int | None = None, table=None, extra=None, xk=None, dyk=None, ekey=None):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .wgrad_update_triton import check_low_precision, check_table, host_scalars

    tabled = table is not None
    kernel = _kernel_for(rule, table=tabled)
    ep = _source_for(rule)[0]
    tensor_states, scalar_states = split_states(rule, states, table)
    rounded = ekey is not None
    check_low_precision(weight, tensor_states, side_out, ekey)
    if rounded and (extra is not None or x.dtype == torch.float32):
        raise ValueError("forge: the Gluon kernel rounds stochastically without tied embedding rows or fp32 "
                         "activations (gluon_reason)")
    if rounded and tabled != (ekey is TABLE_KEY):
        raise ValueError("forge: a rounded launch with a scalar table reads its key from the row (ekey=TABLE_KEY), "
                         "one without a table takes it as an argument")
    if tabled:
        check_table(ep, table, weight, rounded)
        scalars, new_scalar_states = [table], []
    else:
        scalars, new_scalar_states = host_scalars(ep, scalar_states, hparams)
    n, k = weight.shape
    m = x.shape[0]
    epi = [weight, *tensor_states] + ([side_out] if side_out is not None else [])
    mode = side_mode(side_out)
    cfg = config or pick_for(m, 1 + len(tensor_states), x.element_size(), mode, extra is not None, rounded)
    if config is not None:
        _check_gconfig(cfg)
    if rounded and (cfg.epi not in ("smem", "split") or cfg.mma_warps != 4):
        raise ValueError(f"forge: the Gluon {cfg.epi!r} epilogue{' (coop)' if cfg.mma_warps != 4 else ''} does not "
                         "round stochastically; smem and split (one MMA warpgroup) do")
    if mode == SIDE_CAST and cfg.epi not in POINTER_EPIS:
        raise ValueError(f"forge: the Gluon {cfg.epi!r} epilogue does not write a cast copy of W (side_out "
                         f"{side_out.dtype}); epilogues {POINTER_EPIS} do")
    if extra is not None and cfg.epi not in ("smem", "split"):
        raise ValueError(f"forge: the Gluon {cfg.epi!r} epilogue does not add a tied embedding's rows; smem and "
                         "split do")
    rows_args = tuple(extra) if extra is not None else ()
    a_l, b_l, e_l = _smem_layouts(cfg, x.dtype)
    kmajor = x.dtype == torch.float32
    if kmajor:
        # fp32 under TF32: tf32 wgmma takes K-major operands only and both of the wgrad's are token-major, so they
        # are copied transposed (dY^T [N, M], X^T [K, M]; M*(N+K)*4 bytes, freed after the launch; the launch memo
        # keeps a launch only under its copies' addresses, launch_wgrad_update) and the split kernel's loader
        # reads [BN, BMT] / [BK, BMT] boxes
        if cfg.epi != "split":
            raise ValueError(f"forge: fp32 activations (TF32) run the Gluon 'split' kernel only, got {cfg.epi!r}")
        from .transpose_copy import transpose_copy

        # xk: X's copy made once for several row slabs of one update (_launch_slabs), or both copies made by the
        # caller (kmajor_copies: the launch memo keys on their addresses)
        if dyk is None and xk is None:
            dyk, xk = kmajor_copies(dy_t, x)
        dyk = transpose_copy(dy_t.t()) if dyk is None else dyk
        dy_desc = TensorDescriptor(dyk, [n, m], [m, 1], [cfg.bn, cfg.bmt], a_l)
        x_desc = TensorDescriptor(xk, [k, m], [m, 1], [cfg.bk, cfg.bmt], b_l)
    else:
        dy_desc = TensorDescriptor(dy_t, [m, n], [n, 1], [cfg.bmt, cfg.bn], a_l)   # dY [M, N] row-major
        x_desc = TensorDescriptor(x, [m, k], [k, 1], [cfg.bmt, cfg.bk], b_l)
    if cfg.epi == "gemm":
        # overlap diagnostic: side_out, when given, receives the per-tile row sums (gemm_sums_shape), else a
        # scratch does; W/states are untouched and scalar states are not advanced (nothing returned to advance)
        kernel = _kernel_for(rule, "gemm")
        shape = gemm_sums_shape(n, k, cfg)
        sums = side_out if side_out is not None else torch.empty(shape, dtype=torch.float32, device=weight.device)
        if tuple(sums.shape) != shape or sums.dtype != torch.float32 or not sums.is_contiguous():
            raise ValueError(f"epi='gemm' writes row sums into a contiguous fp32 {list(shape)} side_out, got "
                             f"{sums.dtype} {list(sums.shape)}")
        tiles = -(-n // cfg.bn) * -(-k // cfg.bk)
        grid = (max(1, min(max_ctas or _num_sms(weight.device), tiles)),)
        opts = dict(GROUP=cfg.group, STAGES=cfg.stages, CONSUMER_REGS=cfg.cregs, num_warps=4, maxnreg=cfg.maxnreg)
        return kernel, grid, (dy_desc, x_desc, sums, m, n, k), opts, [], []
    if cfg.epi in ("smem", "split"):
        kernel = _kernel_for(rule, cfg.epi, tabled, extra is not None, SR_ROW_VEC if rounded else 0)
        tiles = -(-n // cfg.bn) * -(-k // cfg.bk)
        grid = (max(1, min(max_ctas or _num_sms(weight.device), tiles)),)
        args = (dy_desc, x_desc, weight, *tensor_states, *rows_args, side_out if side_out is not None else weight,
                *scalars, *((int(ekey),) if rounded and not tabled else ()), m, n, k)
        # int64 element offsets when the rows the chunks address (up to the last tile's end) pass 2^31 elements
        big = -(-n // cfg.bn) * cfg.bn * k >= 2 ** 31
        ld_ev, st_ev, st_cm = _EVICT[cfg.evict]
        opts = dict(GROUP=cfg.group, STAGES=cfg.stages, STORE_GRAD=mode, R=cfg.epi_m,
                    LD_EV=ld_ev, ST_EV=st_ev, ST_CM=st_cm,
                    AHEAD=smem_ahead(cfg, 1 + len(tensor_states),
                                     sum(t.element_size() for t in (weight, *tensor_states)) if rounded else None),
                    BIG=big, HOIST=cfg.hoist, CONSUMER_REGS=cfg.cregs,
                    num_warps=4, maxnreg=cfg.maxnreg, enable_fp_fusion=False)
        if cfg.epi == "split":
            if kmajor and gconfig_smem(cfg, 0, 4) > _RING_SMEM:
                # the check above counts 2-byte activations; fp32 stages are twice that (coop: 16-token stages)
                raise ValueError(f"forge: Gluon config {cfg}: its GEMM stages of fp32 activations (TF32) pass "
                                 f"{_RING_SMEM // 1024} KB beside the dW tile")
            # NEPI always passed: the launch memo needs every defaulted constexpr in the options
            opts.update(STREAM=cfg.stream, NDW=cfg.dw_tiles, PF=cfg.l2pf, PF_NEXT=not cfg.l2pf_first, KMAJOR=kmajor,
                        NEPI=1 if cfg.mma_warps == 8 else 2, num_warps=cfg.mma_warps)
            # not with a tied embedding's rows: the epilogue reads them, and they may be the previous kernel's output
            opts.update(pdl_opts(cfg, allowed=extra is None))
        return kernel, grid, args, opts, scalar_states, new_scalar_states
    if cfg.epi == "vec":
        kernel = _kernel_for(rule, "vec", tabled)
        tiles = -(-n // cfg.bn) * -(-k // cfg.bk)
        grid = (max(1, min(max_ctas or _num_sms(weight.device), tiles)),)
        args = (dy_desc, x_desc, weight, *tensor_states, side_out if side_out is not None else weight, *scalars,
                m, n, k)
        # int64 element offsets when the rows the chunks address (up to the last tile's end) pass 2^31 elements
        big = -(-n // cfg.bn) * cfg.bn * k >= 2 ** 31
        opts = dict(GROUP=cfg.group, STAGES=cfg.stages, STORE_GRAD=mode, EPI_N=cfg.epi_n, BIG=big,
                    CONSUMER_REGS=cfg.cregs, num_warps=4, maxnreg=cfg.maxnreg,
                    enable_fp_fusion=False)
        return kernel, grid, args, opts, scalar_states, new_scalar_states
    e_descs = [TensorDescriptor(t, [n, k], [k, 1], _box(cfg), e_l) for t in epi]
    g_desc = e_descs[-1] if side_out is not None else e_descs[0]
    tiles = -(-n // cfg.bn) * -(-k // cfg.bk)
    grid = (max(1, min(max_ctas or _num_sms(weight.device), tiles)),)
    args = (dy_desc, x_desc, e_descs[0], *e_descs[1:1 + len(tensor_states)], g_desc, *scalars, m, n, k)
    opts = dict(GROUP=cfg.group, STAGES=cfg.stages, ES=cfg.es, NLOAD=1 + len(tensor_states), NST=len(epi),
                STORE_GRAD=side_out is not None, NRING=cfg.nring, NB=_boxes(cfg), EOUT=cfg.eout,
                CONSUMER_REGS=cfg.cregs, num_warps=4,
                maxnreg=cfg.maxnreg,
                # no FMA contraction: the epilogue spells out the FMAs that eager torch's kernels contain
                enable_fp_fusion=False)
    return kernel, grid, args, opts, scalar_states, new_scalar_states


def launch(weight, dy_t, x, states, hparams, rule: Rule, side_out=None, *, config: GConfig | None = None,
           max_ctas: int | None = None, table=None, extra=None, kcopies=None, ekey=None):
    """The Gluon kernel, unconditionally (callers check ``use_gluon`` first); scalar states advanced after it.
    ``max_ctas`` caps the persistent grid (tests: several tiles per CTA on small shapes); ``table`` and ``extra`` as
    in wgrad_update_triton.launch_wgrad_update. fp32 activations (TF32) whose dY^T copy would pass TF32_SLAB_BYTES
    are updated in row slabs, one launch each (``tf32_slabs``); other fp32 launches read ``kcopies`` (the
    ``kmajor_copies`` of dy_t and x, made by the caller) or copy them here. ``ekey``: a bf16 weight stored
    stochastically rounded with this key (stochastic_round.element_key), the smem or split kernel."""
    slabs = tf32_slabs(weight.shape[0], x) if x.dtype == torch.float32 else None
    if slabs is not None and len(slabs) > 1:
        _launch_slabs(slabs, weight, dy_t, x, states, hparams, rule, side_out, config, max_ctas, table)
        return
    dyk, xk = kcopies if kcopies is not None else (None, None)
    kernel, grid, args, opts, scalar_states, new_scalar_states = _prepare(
        weight, dy_t, x, states, hparams, rule, side_out, config=config, max_ctas=max_ctas, table=table, extra=extra,
        xk=xk, dyk=dyk, ekey=ekey)
    kernel[grid](*args, **opts)
    with torch.no_grad():
        for s, new in zip(scalar_states, new_scalar_states):
            s.fill_(new)


# fp32 (TF32) launches copy dY transposed ([N, M] fp32) right when the backward's activations peak (the lm_head's
# update comes first): above this many bytes the update runs in row slabs whose copies stay under it (X^T is copied
# once and shared). 128256x4096 lm_head at 8192 tokens: 4.2 GB of dY^T otherwise. 1 GiB: only such extreme shapes
# take slabs (GPU test tests/test_wgrad_update_tf32.py::test_tf32_slabs_exact, passed on an H100 in stop 30; the
# slab launches are not memoized)
TF32_SLAB_BYTES = 1024 * 1024 * 1024


def tf32_slabs(n: int, x) -> list[tuple[int, int]] | None:
    """Row ranges [r0, r1) of an fp32 (TF32) update whose dY^T copies stay within TF32_SLAB_BYTES (multiples of
    the 128-row tile; at least one tile), or None for one launch."""
    m = x.shape[0]
    if n * m * 4 <= TF32_SLAB_BYTES:
        return None
    rows = max(128, TF32_SLAB_BYTES // (m * 4) // 128 * 128)
    return [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]


def kcopies_wanted(weight, dy_t, x) -> bool:
    """Whether a launch that takes the fp32 (TF32) Gluon path can be handed its K-major copies by the caller
    (``kmajor_copies``): both operands fp32, M a multiple of 4 (tf32_reason), one launch (no row slabs). The
    caller has checked the TF32 precision and switch (its memo kind); gluon_reason may still refuse the launch
    (the copies are then wasted once, launch_wgrad_update)."""
    return (x.dtype == torch.float32 and dy_t.dtype == torch.float32 and x.shape[0] % 4 == 0
            and tf32_slabs(weight.shape[0], x) is None)


def kmajor_copies(dy_t, x) -> tuple:
    """(dY^T [N, M], X^T [K, M]) contiguous: the operands of the fp32 (TF32) split kernel (_prepare). Made by the
    caller of ``launch`` so that the launch memo can key on their addresses: a compiled step's allocations repeat,
    so step after step the copies land where they did and the remembered launch (descriptors over those
    addresses) is valid for them -- where they land elsewhere the key differs and the full path runs."""
    from .transpose_copy import transpose_copy_pair

    return transpose_copy_pair(dy_t.t(), x)


def _launch_slabs(slabs, weight, dy_t, x, states, hparams, rule: Rule, side_out, config, max_ctas, table):
    # one launch per row slab (weight, tensor states, side output and dY rows r0:r1 are views; X^T copied once),
    # the host scalars computed once and the scalar states advanced once, after the last slab, as one launch does
    from .transpose_copy import transpose_copy

    xk = transpose_copy(x)
    # with a scalar table ``states`` are the tensor states alone (split_states)
    scalar = [table is None and rule.is_scalar_state(i) for i in range(len(states))]
    scalar_states = new_scalar_states = ()
    for r0, r1 in slabs:
        sl = [st if sc else st[r0:r1] for st, sc in zip(states, scalar)]
        kernel, grid, args, opts, scalar_states, new_scalar_states = _prepare(
            weight[r0:r1], dy_t[r0:r1], x, sl, hparams, rule, None if side_out is None else side_out[r0:r1],
            config=config, max_ctas=max_ctas, table=table, xk=xk)
        kernel[grid](*args, **opts)
    with torch.no_grad():
        for s, new in zip(scalar_states, new_scalar_states):
            s.fill_(new)


def bound_launch(weight, dy_t, x, states, hparams, rule: Rule, side_out=None, *, config: GConfig | None = None,
                 table=None, ekey=None):
    """(benchmarks) A zero-argument callable launching the kernel alone, host part done once; scalar states are
    NOT advanced by it."""
    kernel, grid, args, opts, _, _ = _prepare(weight, dy_t, x, states, hparams, rule, side_out, config=config,
                                              table=table, ekey=ekey)
    if x.dtype == torch.float32:
        # fp32 under TF32: every launch copies dY and X K-major first (_prepare), so the callable does too (into
        # the copies its descriptors address) -- timing the kernel alone would leave that traffic out
        from .transpose_copy import transpose_copy

        dyk, xk = args[0].base, args[1].base

        def run():
            transpose_copy(dy_t.t(), dyk)
            transpose_copy(x, xk)
            kernel[grid](*args, **opts)
        return run
    return lambda: kernel[grid](*args, **opts)


def try_launch(weight, dy_t, x, states, hparams, rule: Rule, side_out=None, table=None, extra=None,
               kcopies=None, ekey=None) -> bool:
    """Launch on the Gluon path if ``use_gluon`` allows it; False (nothing done) sends the caller to Triton.
    ``kcopies``, ``ekey``: as in ``launch``."""
    why = gluon_reason(weight, dy_t, x, states, rule, side_out, table, extra, ekey)
    if why is not None:
        if _mode() == "gluon":
            log.debug("forge: %s=gluon but rule %r goes to the Triton kernel: %s", ENV, rule.name, why)
        return False
    try:
        launch(weight, dy_t, x, states, hparams, rule, side_out, table=table, extra=extra, kcopies=kcopies, ekey=ekey)
    except Exception as e:  # build/compile failure (a triton whose Gluon API differs): the launch never ran
        with _LOCK:
            _BROKEN[_broken_key(rule, ekey is not None)] = f"Gluon kernel failed: {type(e).__name__}: {str(e)[:300]}"
        log.warning("forge: Gluon wgrad kernel for rule %r failed, using the Triton kernel: %s: %s",
                    rule.name, type(e).__name__, str(e)[:300])
        return False
    return True
