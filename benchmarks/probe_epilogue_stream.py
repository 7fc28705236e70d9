"""Which data path streams W/m/v fastest inside a persistent sm_90 kernel? (probe for the Gluon epilogue, NOTES v9)

The fused wgrad+update kernel (forge_compile/kernels/wgrad_update_gluon.py) streams fp32 W and optimizer states
through an smem ring in its epilogue; with no GEMM work it moves only ~3.3 TB/s of W/m/v traffic on the H200,
against 3.7 TB/s for torch._fused_adamw_ and 4.27 TB/s for a copy. This self-contained micro-benchmark (it imports
nothing from forge_compile) runs the same traffic through several data paths, at equal bytes:

  every probe kernel: persistent grid (1 or 2 CTAs per SM), [128, 128] tiles of three fp32 [N, K] arrays (W, m, v)
  in the real kernel's grouped order (GROUP=8), each element read once, a cheap update, written back in place:
      w' = w - m * 1e-3;  m' = m * 0.9 + w * 0.1;  v' = v * 0.999 + (w * w) * 1e-3
  compiled with enable_fp_fusion=False, so the result is bit-identical to the same formula in eager torch (every
  op a separately rounded fp32 mul/add; constants rounded to fp32 the same way) -- the check is torch.equal.

  A  ring / TMA store: the real epilogue without the GEMM. warp_specialize: a 1-warp TMA loader fills an ES-deep
     ring of [EPI_M, EPI_N] boxes of W, m, v; 1 or 2 consumer warpgroups (2: ping-pong over the CTA's tiles with a
     turn barrier, like the real kernel) ld.shared each box into the chunk layout that the template's
     _split_chunks gives from the wgmma accumulator layout (NVMMADistributed v3, warps [4, 1], instr [16, 128, 16])
     ([32, 32] boxes: an 8 B-per-thread-per-row BlockedLayout of the same pattern), update, st.shared into the same
     slot, fence_async_shared, TMA store; the slot goes back to the loader after tma.store_wait (one chunk later).
  B  ring / st.global: TMA loads as A, results written with gl.store from registers in the same layout; the slot
     goes back to the loader right after its values are used (no smem on the write side).
  C  direct / blocked: no TMA, no smem: gl.load / gl.store with a coalesced BlockedLayout (16 B per thread, a warp
     row = 512 B), software-pipelined by one chunk (the next chunk's loads are issued before the current one's math
     and stores, across tile boundaries).
  D  direct / wgmma layout: as C, but loading/storing in the wgmma accumulator layout (8 B per thread per row), what
     the epilogue would need without a layout conversion.
  torch baselines on arrays of the same size: 3 copies (y.copy_(x) per array), one copy of a [3N, K] array, and
  torch._fused_adamw_ on W/m/v with a grad (moves 7 arrays' bytes; GB/s is given over the 6 of W/m/v and over all).

Usage:
  python3 benchmarks/probe_epilogue_stream.py --out DIR   # H200: table on stdout + DIR/probe_epilogue_stream.md
        [--n 4096 --k 4096] [--only A1,C2,...] [--rep 50]
  PYTHONPATH=/tmp/t36 python benchmarks/probe_epilogue_stream.py --compile-only [--only ...]
        # no GPU needed: compiles every variant for sm_90 with a stub driver, ptxas -v: smem / regs / spills
Without CUDA (and without --compile-only) it exits with a message. Written against triton 3.6's Gluon API.
Variants that do not compile for sm_90: none. CPU compile (triton 3.6.0, stub sm_90 driver, ptxas -v; 19/19, 0 B
spills, 0 convert_layout; ring kernels run maxnreg 168, 2 consumers setmaxnreg 232 / loader 24 like the real kernel):
  A1-A4 box 64x32 ES3/4/6/8, 2 consumers: 72 / 96 / 144 / 192 KB smem; A5 ES6 1 consumer 144 KB; A6 box 32x32 ES12
  144 KB; A7 box 128x32 ES4 192 KB; A8 box 128x16 ES8 192 KB; A9 ES4 1 consumer 2 CTAs/SM 96 KB;
  B1/B2 ES4/8 96 / 192 KB; B3 ES4 1 consumer 2 CTAs/SM 96 KB (all A/B: 16 elems per array per thread per chunk,
  ld.shared.v2 / st.shared.v2 (A) or st.global.v2 (B); A7 32, A6 8);
  C1 8 warps [32,128] 172 regs; C2 8w [16,128] 2 CTAs/SM 111 regs; C3 4w [32,128] 2 CTAs/SM 247 regs; C4 8w [32,128]
  2 CTAs/SM 124 regs (maxnreg 128) -- ld/st.global.v4;  D1 4w [64,32] 2 CTAs/SM 158 regs; D2 8w [128,32] 160 regs;
  D3 8w [128,32] 2 CTAs/SM 128 regs -- ld/st.global.v2. Every 2-CTA/SM variant fits 2 CTAs by smem and registers.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

BT_ = 128      # tile rows = cols
GROUP_ = 8     # grouped tile order, as the real kernel
LR, B1, B2 = 1e-3, 0.9, 0.999   # the cheap update's constants


def reference_update(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor):
    """The probes' update in eager torch, op by op (each a rounded fp32 op, same order as _update)."""
    w2 = w - m * LR
    m2 = m * B1 + w * 0.1            # literal constants as in _update (1 - B1 in double is 0.09999999999999998)
    v2 = v * B2 + (w * w) * 0.001
    return w2, m2, v2


def traffic_bytes(n: int, k: int) -> int:
    """W/m/v traffic of one pass: 3 arrays read + 3 written, fp32."""
    return 6 * n * k * 4


def tile_order(n: int, k: int, group: int = GROUP_, bt: int = BT_):
    """(pid_n, pid_k) of tile t in the kernels' grouped order (host mirror of _tile_coords; used by the test)."""
    num_n, num_k = -(-n // bt), -(-k // bt)
    out = []
    for t in range(num_n * num_k):
        in_group = group * num_k
        first_n = (t // in_group) * group
        gs = min(num_n - first_n, group)
        out.append((first_n + (t % in_group) % gs, (t % in_group) // gs))
    return out


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    kind: str                 # A, B (TMA ring), C, D (direct)
    box: tuple = (64, 32)     # A/B: TMA box = chunk [EPI_M, EPI_N]; C/D: chunk [CH_M, CH_N]
    es: int = 4               # A/B ring depth
    ncons: int = 2            # A/B consumer warpgroups
    cps: int = 1              # CTAs per SM
    nw: int = 8               # C/D warps per CTA
    maxnreg: int | None = None

    def smem_ring(self) -> int:
        return self.es * 3 * self.box[0] * self.box[1] * 4 if self.kind in "AB" else 0

    def label(self) -> str:
        if self.kind in "AB":
            return (f"{self.kind} {'TMA store' if self.kind == 'A' else 'st.global'} box{self.box[0]}x{self.box[1]} "
                    f"ES{self.es} cons{self.ncons} {self.cps}CTA/SM")
        lay = "blocked16B" if self.kind == "C" else "wgmma8B"
        return f"{self.kind} direct {lay} chunk{self.box[0]}x{self.box[1]} {self.nw}w {self.cps}CTA/SM"


SPECS = [
    Spec("A1", "A", (64, 32), es=3), Spec("A2", "A", (64, 32), es=4), Spec("A3", "A", (64, 32), es=6),
    Spec("A4", "A", (64, 32), es=8), Spec("A5", "A", (64, 32), es=6, ncons=1),
    Spec("A6", "A", (32, 32), es=12), Spec("A7", "A", (128, 32), es=4), Spec("A8", "A", (128, 16), es=8),
    Spec("A9", "A", (64, 32), es=4, ncons=1, cps=2),
    Spec("B1", "B", (64, 32), es=4), Spec("B2", "B", (64, 32), es=8),
    Spec("B3", "B", (64, 32), es=4, ncons=1, cps=2),
    Spec("C1", "C", (32, 128), nw=8), Spec("C2", "C", (16, 128), nw=8, cps=2, maxnreg=128),
    Spec("C3", "C", (32, 128), nw=4, cps=2), Spec("C4", "C", (32, 128), nw=8, cps=2, maxnreg=128),
    Spec("D1", "D", (64, 32), nw=4, cps=2), Spec("D2", "D", (128, 32), nw=8),
    Spec("D3", "D", (128, 32), nw=8, cps=2, maxnreg=128),
]


# ------------------------------------------------------------------------------------------------------------------
# Gluon kernels (built lazily: importing this module does not need triton.experimental.gluon)

try:   # Gluon (triton >= 3.5); the kernels are defined only where it imports (CPU CI: the reference/driver logic)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    _GLUON_ERR = None
except Exception as _e:  # noqa: BLE001 -- absent triton, or one without Gluon
    gluon = gl = None
    _GLUON_ERR = f"{type(_e).__name__}: {_e}"

if gl is not None:
    BT = gl.constexpr(BT_)

    @gluon.jit
    def _tile_coords(t, num_n, num_k, GROUP: gl.constexpr):
        in_group = GROUP * num_k
        first_n = (t // in_group) * GROUP
        gs = gl.minimum(num_n - first_n, GROUP)
        pid_n = first_n + (t % in_group) % gs
        pid_k = (t % in_group) // gs
        return pid_n, pid_k

    @gluon.jit
    def _update(w, m, v):
        w2 = w - m * 0.001
        m2 = m * 0.9 + w * 0.1
        v2 = v * 0.999 + (w * w) * 0.001
        return w2, m2, v2

    @gluon.jit
    def _split_chunks(x, NROW: gl.constexpr, NSPLIT: gl.constexpr):
        # the template's split (wgrad_update_gluon.py): [R, C] -> NROW x NSPLIT chunks, register-only in the wgmma
        # layout
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
    def _loader(w_desc, m_desc, v_desc, wb, mb, vb, e_ready, e_empty, num_tiles, num_n, num_k,
                GROUP: gl.constexpr, ES: gl.constexpr):
        EPI_M: gl.constexpr = w_desc.block_type.shape[0]
        EPI_N: gl.constexpr = w_desc.block_type.shape[1]
        NCC: gl.constexpr = BT // EPI_N
        NCH: gl.constexpr = (BT // EPI_M) * NCC
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        e = 0
        for t in range(pid, num_tiles, nprog):
            pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
            for c in range(NCH):
                s = e % ES
                mbarrier.wait(e_empty.index(s), ((e // ES) & 1) ^ 1)
                bar = e_ready.index(s)
                mbarrier.expect(bar, 3 * w_desc.block_type.nbytes)
                rc = pid_n * BT + (c // NCC) * EPI_M
                cc = pid_k * BT + (c % NCC) * EPI_N
                tma.async_copy_global_to_shared(w_desc, [rc, cc], bar, wb.index(s))
                tma.async_copy_global_to_shared(m_desc, [rc, cc], bar, mb.index(s))
                tma.async_copy_global_to_shared(v_desc, [rc, cc], bar, vb.index(s))
                e += 1

    @gluon.jit
    def _consumer(w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, wb, mb, vb, e_ready, e_empty, turn,
                  num_tiles, num_n, num_k, K, CID: gl.constexpr, NCONS: gl.constexpr, GROUP: gl.constexpr,
                  ES: gl.constexpr, TMA_STORE: gl.constexpr, SPLIT: gl.constexpr, L: gl.constexpr):
        EPI_M: gl.constexpr = w_desc.block_type.shape[0]
        EPI_N: gl.constexpr = w_desc.block_type.shape[1]
        NCC: gl.constexpr = BT // EPI_N
        NCH: gl.constexpr = (BT // EPI_M) * NCC
        if SPLIT:
            # the chunk layout the real epilogue gets from the accumulator (register-only split)
            acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                 instr_shape=[16, BT, 16])
            dummy = gl.zeros([BT, BT], gl.float32, acc_layout)
            lay: gl.constexpr = _split_chunks(dummy, BT // EPI_M, NCC)[0].type.layout
        else:
            lay: gl.constexpr = L
        rows = gl.arange(0, EPI_M, layout=gl.SliceLayout(1, lay))
        cols = gl.arange(0, EPI_N, layout=gl.SliceLayout(0, lay))
        base = rows[:, None] * K + cols[None, :]
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        j = CID   # index of the tile in the CTA's list
        r = 0
        for t in range(pid + CID * nprog, num_tiles, NCONS * nprog):
            pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
            if NCONS == 2:
                # the real kernel's epi turn: a consumer waits on the shared ring only after the other finished
                mbarrier.wait(turn.index(CID), (r & 1) ^ (1 - CID))
            e0 = j * NCH
            for c in range(NCH):
                e = e0 + c
                s = e % ES
                rc = pid_n * BT + (c // NCC) * EPI_M
                cc = pid_k * BT + (c % NCC) * EPI_N
                mbarrier.wait(e_ready.index(s), (e // ES) & 1)
                w = wb.index(s).load(lay)
                m = mb.index(s).load(lay)
                v = vb.index(s).load(lay)
                w2, m2, v2 = _update(w, m, v)
                if TMA_STORE:
                    wb.index(s).store(w2)
                    mb.index(s).store(m2)
                    vb.index(s).store(v2)
                    fence_async_shared()
                    tma.async_copy_shared_to_global(w_desc, [rc, cc], wb.index(s))
                    tma.async_copy_shared_to_global(m_desc, [rc, cc], mb.index(s))
                    tma.async_copy_shared_to_global(v_desc, [rc, cc], vb.index(s))
                    # the previous chunk's stores have read their slot: hand it back
                    tma.store_wait(3)
                    mbarrier.arrive(e_empty.index((e + ES - 1) % ES), pred=c > 0)
                else:
                    # values in registers (the math used them): the slot goes back now
                    mbarrier.arrive(e_empty.index(s))
                    off = rc * K + cc + base
                    gl.store(w_ptr + off, w2)
                    gl.store(m_ptr + off, m2)
                    gl.store(v_ptr + off, v2)
            if NCONS == 2:
                mbarrier.arrive(turn.index(1 - CID))
            if TMA_STORE:
                tma.store_wait(0)
                mbarrier.arrive(e_empty.index((e0 + NCH - 1) % ES))
            j += NCONS
            r += 1

    @gluon.jit
    def _consumer1(w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, wb, mb, vb, e_ready, e_empty, turn,
                   num_tiles, num_n, num_k, K, NCONS: gl.constexpr, GROUP: gl.constexpr,
                   ES: gl.constexpr, TMA_STORE: gl.constexpr, SPLIT: gl.constexpr, L: gl.constexpr):
        _consumer(w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, wb, mb, vb, e_ready, e_empty, turn,
                  num_tiles, num_n, num_k, K, 1, NCONS, GROUP, ES, TMA_STORE, SPLIT, L)

    @gluon.jit
    def ring_kernel(w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, N, K,
                    GROUP: gl.constexpr, ES: gl.constexpr, NCONS: gl.constexpr, TMA_STORE: gl.constexpr,
                    SPLIT: gl.constexpr, L: gl.constexpr, CREGS: gl.constexpr, num_warps: gl.constexpr):
        EPI_M: gl.constexpr = w_desc.block_type.shape[0]
        EPI_N: gl.constexpr = w_desc.block_type.shape[1]
        gl.static_assert(num_warps == 4)
        num_n = gl.cdiv(N, BT)
        num_k = gl.cdiv(K, BT)
        num_tiles = num_n * num_k
        wb = gl.allocate_shared_memory(gl.float32, [ES, EPI_M, EPI_N], w_desc.layout)
        mb = gl.allocate_shared_memory(gl.float32, [ES, EPI_M, EPI_N], m_desc.layout)
        vb = gl.allocate_shared_memory(gl.float32, [ES, EPI_M, EPI_N], v_desc.layout)
        e_ready = gl.allocate_shared_memory(gl.int64, [ES, 1], mbarrier.MBarrierLayout())
        e_empty = gl.allocate_shared_memory(gl.int64, [ES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(ES):
            mbarrier.init(e_ready.index(i), count=1)
            mbarrier.init(e_empty.index(i), count=1)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        # partition lists spelled out: warp_specialize takes the list only as a literal
        if NCONS == 2:
            gl.warp_specialize([
                (_consumer, (w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, wb, mb, vb, e_ready, e_empty, turn,
                             num_tiles, num_n, num_k, K, 0, NCONS, GROUP, ES, TMA_STORE, SPLIT, L)),
                (_consumer1, (w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, wb, mb, vb, e_ready, e_empty, turn,
                              num_tiles, num_n, num_k, K, NCONS, GROUP, ES, TMA_STORE, SPLIT, L)),
                (_loader, (w_desc, m_desc, v_desc, wb, mb, vb, e_ready, e_empty, num_tiles, num_n, num_k,
                           GROUP, ES)),
            ], [4, 1], [CREGS, 24])
        else:
            gl.warp_specialize([
                (_consumer, (w_desc, m_desc, v_desc, w_ptr, m_ptr, v_ptr, wb, mb, vb, e_ready, e_empty, turn,
                             num_tiles, num_n, num_k, K, 0, NCONS, GROUP, ES, TMA_STORE, SPLIT, L)),
                (_loader, (w_desc, m_desc, v_desc, wb, mb, vb, e_ready, e_empty, num_tiles, num_n, num_k,
                           GROUP, ES)),
            ], [1], [24])

    @gluon.jit
    def _chunk_off(i, pid, nprog, num_n, num_k, K, GROUP: gl.constexpr, CH_M: gl.constexpr, CH_N: gl.constexpr):
        # element offset of the CTA's i-th chunk (tile i // NCH of the CTA's list, chunk i % NCH of the tile)
        NCC: gl.constexpr = BT // CH_N
        NCH: gl.constexpr = (BT // CH_M) * NCC
        c = i % NCH
        pid_n, pid_k = _tile_coords(pid + (i // NCH) * nprog, num_n, num_k, GROUP)
        return (pid_n * BT + (c // NCC) * CH_M) * K + pid_k * BT + (c % NCC) * CH_N

    @gluon.jit
    def direct_kernel(w_ptr, m_ptr, v_ptr, N, K, GROUP: gl.constexpr, CH_M: gl.constexpr, CH_N: gl.constexpr,
                      L: gl.constexpr):
        NCH: gl.constexpr = (BT // CH_M) * (BT // CH_N)
        num_n = gl.cdiv(N, BT)
        num_k = gl.cdiv(K, BT)
        num_tiles = num_n * num_k
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_it = ((num_tiles - pid + nprog - 1) // nprog) * NCH    # the host keeps grid <= num_tiles: n_it >= NCH
        rows = gl.arange(0, CH_M, layout=gl.SliceLayout(1, L))
        cols = gl.arange(0, CH_N, layout=gl.SliceLayout(0, L))
        base = rows[:, None] * K + cols[None, :]
        off = _chunk_off(0, pid, nprog, num_n, num_k, K, GROUP, CH_M, CH_N)
        w = gl.load(w_ptr + off + base)
        m = gl.load(m_ptr + off + base)
        v = gl.load(v_ptr + off + base)
        for it in range(n_it):
            # next chunk's loads first (the last iteration reloads its own chunk, before its stores: discarded)
            off_n = _chunk_off(gl.minimum(it + 1, n_it - 1), pid, nprog, num_n, num_k, K, GROUP, CH_M, CH_N)
            wn = gl.load(w_ptr + off_n + base)
            mn = gl.load(m_ptr + off_n + base)
            vn = gl.load(v_ptr + off_n + base)
            w2, m2, v2 = _update(w, m, v)
            gl.store(w_ptr + off + base, w2)
            gl.store(m_ptr + off + base, m2)
            gl.store(v_ptr + off + base, v2)
            w = wn
            m = mn
            v = vn
            off = off_n



def _build():
    if gl is None:
        raise RuntimeError(f"triton.experimental.gluon not importable ({_GLUON_ERR}): "
                           "the probes need triton 3.6's Gluon")
    return dict(gl=gl, ring=ring_kernel, direct=direct_kernel)


def _layout(spec: Spec):
    """(SPLIT, layout) of a spec: A/B chunk layout (SPLIT: the template's split of the wgmma accumulator), C/D
    direct layouts."""
    gl = _build()["gl"]
    bm, bn = spec.box
    if spec.kind in "AB":
        if bm in (64, 128) and bn in (8, 16, 32, 64):
            return True, gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])   # placeholder, unused (SPLIT)
        # [32, 32]: rows of 2 fp32 per thread, 8 rows x 4 threads per warp, as in the wgmma layout
        return False, gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])
    if spec.kind == "C":
        tn = min(32, bn // 4)
        return False, gl.BlockedLayout([1, 4], [32 // tn, tn], [spec.nw, 1], [1, 0])
    assert bm == 16 * spec.nw or bm == 32 * spec.nw, spec
    return False, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[spec.nw, 1], instr_shape=[16, bn, 16])


def prepare(spec: Spec, w, m, v, sms: int):
    """(kernel, grid, args, opts) for one spec on arrays w, m, v (CUDA, or CPU tensors for --compile-only)."""
    K_ = _build()
    gl = K_["gl"]
    n, k = w.shape
    assert n % BT_ == 0 and k % BT_ == 0, "N and K must be multiples of 128"
    tiles = (n // BT_) * (k // BT_)
    grid = (max(1, min(spec.cps * sms, tiles)),)
    split, lay = _layout(spec)
    if spec.kind in "AB":
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        sl = gl.NVMMASharedLayout.get_default_for(list(spec.box), gl.float32)
        descs = [TensorDescriptor(t, [n, k], [k, 1], list(spec.box), sl) for t in (w, m, v)]
        args = (*descs, w, m, v, n, k)
        opts = dict(GROUP=GROUP_, ES=spec.es, NCONS=spec.ncons, TMA_STORE=spec.kind == "A", SPLIT=split, L=lay,
                    CREGS=232, num_warps=4, maxnreg=spec.maxnreg or 168, enable_fp_fusion=False)
        return K_["ring"], grid, args, opts
    args = (w, m, v, n, k)
    opts = dict(GROUP=GROUP_, CH_M=spec.box[0], CH_N=spec.box[1], L=lay, num_warps=spec.nw,
                enable_fp_fusion=False)
    if spec.maxnreg:
        opts["maxnreg"] = spec.maxnreg
    return K_["direct"], grid, args, opts


# ------------------------------------------------------------------------------------------------------------------
# --compile-only (CPU): sm_90 compile with a stub driver, ptxas -v

def compile_only(specs, n=1024, k=1024, sms=132):
    from triton.backends.nvidia.compiler import get_ptxas

    from compile_sm90 import stub_driver

    stub_driver()
    ptxas = get_ptxas(90).path
    rows, failed = [], []
    for spec in specs:
        w, m, v = (torch.randn(n, k) for _ in range(3))
        t0 = time.time()
        try:
            kern, grid, args, opts = prepare(spec, w, m, v, sms)
            ck = kern.warmup(*args, grid=grid, **opts)
            ptx = ck.asm["ptx"]
            with tempfile.TemporaryDirectory() as d:
                p = os.path.join(d, "k.ptx")
                with open(p, "w") as f:
                    f.write(ptx)
                r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", p, "-o", os.path.join(d, "k.o")],
                                   capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError("ptxas: " + r.stderr[-1500:])
            regs = re.findall(r"Used (\d+) registers", r.stderr)
            sp = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
            spills = max((int(a) + int(b) for a, b in sp), default=0)
            ttgir = ck.asm["ttgir"]
            row = dict(name=spec.name, label=spec.label(), smem_kb=ck.metadata.shared / 1024, regs=regs[0] if regs
                       else "?", spills=spills, cvt=ttgir.count("convert_layout"),
                       vec=_vec_summary(ptx), secs=time.time() - t0)
            rows.append(row)
            print(f"{spec.name:3s} {spec.label():52s} smem={row['smem_kb']:6.1f}KB regs={row['regs']:>3s} "
                  f"spills={spills}B convert_layout={row['cvt']} {row['vec']} {row['secs']:.1f}s", flush=True)
        except Exception as e:   # report and go on: the docstring lists what does not compile
            failed.append(spec.name)
            print(f"{spec.name:3s} {spec.label():52s} FAILED {type(e).__name__}: {str(e)[-1500:]}", flush=True)
    print(f"compiled {len(rows)}/{len(specs)}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return rows, failed


def _vec_summary(ptx: str) -> str:
    ops = {}
    for op in re.findall(r"\b(ld\.global[.\w]*|st\.global[.\w]*|ld\.shared[.\w]*|st\.shared[.\w]*)", ptx):
        key = re.sub(r"\.(L1::|L2::)[\w:]+", "", op)
        ops[key] = ops.get(key, 0) + 1
    return " ".join(f"{k}:{c}" for k, c in sorted(ops.items()))


# ------------------------------------------------------------------------------------------------------------------
# GPU driver

def _fresh(n, k, dev, gen):
    return [torch.randn(n, k, device=dev, generator=gen) for _ in range(3)]


def run(args):
    import triton.testing

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n, k = args.n, args.k
    gb = traffic_bytes(n, k) / 1e9
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows = []

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    def add(name, label, ms, check, extra_bytes=0.0, note=""):
        row = dict(name=name, label=label, ms=ms, gbs=gb / (ms * 1e-3),
                   gbs_all=(gb + extra_bytes) / (ms * 1e-3), check=check, note=note)
        rows.append(row)
        print(f"{name:5s} {label:52s} {ms:8.4f} ms {row['gbs']:7.0f} GB/s  {check} {note}", flush=True)

    t_start = time.time()
    # torch baselines
    w, m, v = _fresh(n, k, dev, gen)
    outs = [torch.empty_like(w) for _ in range(3)]

    def copy3():
        for src, dst in zip((w, m, v), outs):
            dst.copy_(src)
    add("T1", "torch 3x y.copy_(x)", bench(copy3), "-")
    big = torch.randn(3 * n, k, device=dev, generator=gen)
    big_out = torch.empty_like(big)
    add("T2", "torch one copy of [3N, K]", bench(lambda: big_out.copy_(big)), "-")
    del big, big_out, outs
    g = torch.randn(n, k, device=dev, generator=gen) * 1e-3
    v.abs_()
    step = torch.tensor(1.0, device=dev)
    try:
        def adamw():
            torch._fused_adamw_([w], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                                weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        add("T3", "torch._fused_adamw_ (W, m, v + grad read)", bench(adamw), "-", extra_bytes=n * k * 4 / 1e9,
            note="(moves 7 arrays; GB/s over all: see md)")
    except Exception as e:
        print(f"T3 torch._fused_adamw_ FAILED {type(e).__name__}: {e}")
    w0, m0, v0 = _fresh(n, k, dev, gen)
    ref = reference_update(w0, m0, v0)
    add("T4", "torch eager reference update (not in place)", bench(lambda: reference_update(w, m, v)), "-",
        note="7 kernels, new outputs + temporaries: moves more than 6 arrays")
    del g, w, m, v

    specs = [s for s in SPECS if not args.only or s.name in args.only.split(",")]
    for spec in specs:
        t0 = time.time()
        try:
            w, m, v = (t.clone() for t in (w0, m0, v0))
            kern, grid, kargs, opts = prepare(spec, w, m, v, sms)
            ck = kern[grid](*kargs, **opts)
            torch.cuda.synchronize()
            md = getattr(ck, "metadata", None)
            res = f"smem {getattr(md, 'shared', 0) / 1024:.0f}KB regs {getattr(ck, 'n_regs', '?')}"
            ok = [torch.equal(a, b) for a, b in zip((w, m, v), ref)]
            if all(ok):
                check = "exact"
            else:
                diff = max(float((a - b).abs().max()) for a, b in zip((w, m, v), ref))
                bad = sum(int((a != b).sum()) for a, b in zip((w, m, v), ref))
                check = f"WRONG ({bad} elems, max|d|={diff:.3g})"
            # fresh random inputs for the timing (in place, repeated: the update is contracting, values stay finite)
            w, m, v = _fresh(n, k, dev, gen)
            kern, grid, kargs, opts = prepare(spec, w, m, v, sms)
            ms = bench(lambda: kern[grid](*kargs, **opts))
            add(spec.name, spec.label(), ms, check,
                note=f"grid {grid[0]}, {res} ({time.time() - t0:.1f}s incl. compile)")
        except Exception as e:
            print(f"{spec.name} {spec.label()} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            rows.append(dict(name=spec.name, label=spec.label(), ms=float("nan"), gbs=float("nan"),
                             gbs_all=float("nan"), check=f"FAILED {type(e).__name__}", note=str(e)[:100]))
        finally:
            w = m = v = None
    total = time.time() - t_start
    table = format_table(rows, n, k, sms, torch.cuda.get_device_name(dev), total)
    print()
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_epilogue_stream.md"), "w") as f:
            f.write(table + "\n")
    return rows


def format_table(rows, n, k, sms, device, total_s):
    lines = [f"# probe_epilogue_stream ({device}, {sms} SMs, W/m/v fp32 {n}x{k}: "
             f"{traffic_bytes(n, k) / 1e6:.0f} MB of W/m/v traffic per pass; {total_s:.0f} s incl. compiles)",
             "", "do_bench median; GB/s = W/m/v traffic (6 x N x K x 4 B) / time (T3 also reads a grad: GB/s(all) "
             "counts it); check = torch.equal against the eager reference of the same update.", "",
             "| id | variant | ms | GB/s (W/m/v) | GB/s (all) | check | notes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['label']} | {r['ms']:.4f} | {r['gbs']:.0f} | {r['gbs_all']:.0f} | "
                     f"{r['check']} | {r['note']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for probe_epilogue_stream.md")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--only", default="", help="comma-separated variant ids (A1,B2,C1,...)")
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=40, help="do_bench rep (ms)")
    ap.add_argument("--compile-only", action="store_true", help="sm_90 compile + ptxas -v of every variant (no GPU)")
    args = ap.parse_args(argv)
    if args.compile_only:
        specs = [s for s in SPECS if not args.only or s.name in args.only.split(",")]
        _, failed = compile_only(specs)
        return 1 if failed else 0
    if not torch.cuda.is_available():
        print("probe_epilogue_stream: no CUDA device; this benchmark needs an sm_90 GPU (H100/H200). "
              "For a CPU compile check: PYTHONPATH=<triton 3.6> python3 benchmarks/probe_epilogue_stream.py "
              "--compile-only", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() != (9, 0):
        print(f"probe_epilogue_stream: needs sm_90, found {torch.cuda.get_device_capability()}", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
