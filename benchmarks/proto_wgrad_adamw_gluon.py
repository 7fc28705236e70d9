"""Prototype (v4): Hopper (sm_90) Gluon kernel for fused wgrad + AdamW, warp-specialized, persistent, ping-pong.

  python benchmarks/proto_wgrad_adamw_gluon.py [--out DIR]            # H200: correctness, then timing table
  PYTHONPATH=/tmp/t36 python benchmarks/proto_wgrad_adamw_gluon.py --compile-only   # CPU: sm_90 compile report

dW = dY^T X (dY [M, N] bf16, X [M, K] bf16, fp32 accumulation over the token dim M) is consumed in the epilogue by
AdamW on fp32 W / exp_avg / exp_avg_sq [N, K]; dW never reaches memory. Design (benchmarks/NOTES_kernel.md, v4):

- persistent grid (one CTA per SM), CTA tiles t = pid, pid + nprog, ... in grouped order, tile [BN=128, BK=128] of dW;
- 4 partitions (gl.warp_specialize):
  * consumer 0 (default partition, 4 warps = 1 warpgroup) and consumer 1 (worker, 4 warps): the CTA's even / odd
    tiles ("ping-pong"): wgmma over all of M for the tile (accumulator in registers), then the tile's AdamW epilogue,
    so one warpgroup's epilogue (HBM-bound) runs while the other warpgroup's MMAs run;
  * GEMM loader (1 warp): TMA loads of dY [BMT, BN] (from a descriptor on the contiguous dY, permuted in smem into the
    MN-major A operand) and X [BMT, BK] (B operand) into a STAGES-deep smem ring, in the CTA's tile order;
  * epilogue loader (1 warp): TMA loads of W/m/v column chunks [BN, EPI_N] (fp32) into an ES-deep smem ring, in tile
    and chunk order, as far ahead as slots free up -- these reads are in flight during the MMAs;
- the consumer's epilogue: per chunk, W/m/v from smem straight into the accumulator chunk's register layout (the
  accumulator is split into column chunks in registers, no layout conversion), AdamW math, results written back
  in place into the same smem slot and stored with TMA; the slot is released once the TMA store has read it.
The two smem rings are shared by both consumers, filled in the CTA's tile order; two pairs of "turn" mbarriers
(CUTLASS's pingpong order barrier) make the consumers take the mainloop and the epilogue in turns, so every ring
wait happens in ring order (an mbarrier wait only compares phase parity: a consumer waiting two phases ahead
passes at once -- run 1 on the H200 failed that way, "unspecified launch failure", before they were added).

Measured on the H200 (run 2; benchmarks/NOTES_kernel.md, v4): correct everywhere; 1.21-1.32x vs unfused at
M <= 2048, 1.11-1.16x at M = 4096 (4096x4096 / 14336x4096); M = 8192 not timed (check tolerance, fixed since).

Not bit-exact vs torch (approximate division/sqrt, 1/sqrt(bc2) multiply); checked vs an fp64-dW torch reference.
Restrictions of the prototype: N % 128 == 0, K % 128 == 0, bf16 activations, dY given as dy_t = dy.t() of a
contiguous [M, N] dY (as the benchmark and autograd produce it), M > 0 (any M: TMA zero-fills the last k-step).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


# ---------------------------------------------------------------------------------------------------------------
# kernel


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
def _gemm_loader(dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k,
                 GROUP: gl.constexpr, STAGES: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    g = 0
    for t in range(pid, num_tiles, nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        for ks in range(ksteps):
            s = g % STAGES
            ph = (g // STAGES) & 1
            mbarrier.wait(empty.index(s), ph ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(dy_desc, [ks * BMT, pid_n * BN], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(x_desc, [ks * BMT, pid_k * BK], bar, b_bufs.index(s))
            g += 1


@gluon.jit
def _epi_loader(w_desc, m_desc, v_desc, w_bufs, m_bufs, v_bufs, e_ready, e_empty, num_tiles, num_n, num_k,
                BK: gl.constexpr, GROUP: gl.constexpr, ES: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    EPI_N: gl.constexpr = w_desc.block_type.shape[1]
    NCH: gl.constexpr = BK // EPI_N
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    e = 0
    for t in range(pid, num_tiles, nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        row0 = pid_n * BN
        col0 = pid_k * BK
        for c in range(NCH):
            s = e % ES
            ph = (e // ES) & 1
            mbarrier.wait(e_empty.index(s), ph ^ 1)
            bar = e_ready.index(s)
            mbarrier.expect(bar, 3 * w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [row0, col0 + c * EPI_N], bar, w_bufs.index(s))
            tma.async_copy_global_to_shared(m_desc, [row0, col0 + c * EPI_N], bar, m_bufs.index(s))
            tma.async_copy_global_to_shared(v_desc, [row0, col0 + c * EPI_N], bar, v_bufs.index(s))
            e += 1


@gluon.jit
def _split_cols(x, NSPLIT: gl.constexpr):
    # [R, C] -> NSPLIT tensors [R, C / NSPLIT] (column chunks, in order); register-only in the wgmma layout
    # (a thread holds columns 8 j + 2 (lane % 4) + {0, 1} for every j)
    LOG: gl.constexpr = NSPLIT.bit_length() - 1
    xs = (x, )
    for _ in gl.static_range(LOG):
        nxt = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            nxt += y.reshape([y.shape[0], 2, y.shape[1] // 2]).permute(0, 2, 1).split()
        xs = nxt
    return xs


@gluon.jit
def _consumer(dy_desc, x_desc, w_desc, m_desc, v_desc, a_bufs, b_bufs, ready, empty,
              w_bufs, m_bufs, v_bufs, e_ready, e_empty, mma_turn, epi_turn,
              decay, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
              M, num_tiles, num_n, num_k,
              CID: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, ES: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    EPI_N: gl.constexpr = w_desc.block_type.shape[1]
    NCH: gl.constexpr = BK // EPI_N
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BK, 16])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ksteps = gl.cdiv(M, BMT)
    j = CID   # index of the tile in the CTA's list (this consumer: every other one)
    r = 0     # this consumer's round
    # Turn barriers (CUTLASS's order barrier): a consumer waits on the rings only when the other consumer has
    # finished waiting on them for the previous tile. Without them, consumer 1 waits for the parity of a ring
    # phase two phases ahead of the barrier, which reads as complete at once (mbarrier waits compare parity).
    # Consumer 0 waits for consumer 1's previous round (none at r = 0: parity 1 passes on a fresh barrier),
    # consumer 1 for consumer 0's current round.
    for t in range(pid + CID * nprog, num_tiles, 2 * nprog):
        pid_n, pid_k = _tile_coords(t, num_n, num_k, GROUP)
        row0 = pid_n * BN
        col0 = pid_k * BK
        # ---- mainloop: wgmma over all of M, one stage in flight, the previous stage released
        turn_ph = (r & 1) ^ (1 - CID)
        mbarrier.wait(mma_turn.index(CID), turn_ph)
        acc = gl.zeros([BN, BK], gl.float32, acc_layout)
        g0 = j * ksteps
        for ks in range(ksteps):
            g = g0 + ks
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=ks > 0)
        mbarrier.arrive(mma_turn.index(1 - CID))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((g0 + ksteps - 1) % STAGES))
        mbarrier.wait(epi_turn.index(CID), turn_ph)

        # ---- epilogue: AdamW per column chunk, W/m/v from the epilogue ring, results stored in place + TMA
        gs = _split_cols(acc, NCH)
        e0 = j * NCH
        for c in gl.static_range(NCH):
            e = e0 + c
            s = e % ES
            mbarrier.wait(e_ready.index(s), (e // ES) & 1)
            gch = gs[c]
            wb = w_bufs.index(s)
            mb = m_bufs.index(s)
            vb = v_bufs.index(s)
            p = wb.load(gch.type.layout)
            m = mb.load(gch.type.layout)
            v = vb.load(gch.type.layout)
            m = m + (gch - m) * omb1
            v = v * beta2 + omb2 * gch * gch
            denom = gl.sqrt(v) * inv_sqrt_bc2 + eps
            p = p * decay - step_size * (m / denom)
            wb.store(p)
            mb.store(m)
            vb.store(v)
            fence_async_shared()
            tma.async_copy_shared_to_global(w_desc, [row0, col0 + c * EPI_N], wb)
            tma.async_copy_shared_to_global(m_desc, [row0, col0 + c * EPI_N], mb)
            tma.async_copy_shared_to_global(v_desc, [row0, col0 + c * EPI_N], vb)
            if c > 0:
                # the previous chunk's stores have read their slot: hand it back to the epilogue loader
                tma.store_wait(3)
                mbarrier.arrive(e_empty.index((e + ES - 1) % ES))
            if c == NCH - 1:
                mbarrier.arrive(epi_turn.index(1 - CID))
        tma.store_wait(0)
        mbarrier.arrive(e_empty.index((e0 + NCH - 1) % ES))
        j += 2
        r += 1


@gluon.jit
def _consumer1(dy_desc, x_desc, w_desc, m_desc, v_desc, a_bufs, b_bufs, ready, empty,
               w_bufs, m_bufs, v_bufs, e_ready, e_empty, mma_turn, epi_turn,
               decay, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
               M, num_tiles, num_n, num_k,
               GROUP: gl.constexpr, STAGES: gl.constexpr, ES: gl.constexpr):
    _consumer(dy_desc, x_desc, w_desc, m_desc, v_desc, a_bufs, b_bufs, ready, empty,
              w_bufs, m_bufs, v_bufs, e_ready, e_empty, mma_turn, epi_turn,
              decay, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
              M, num_tiles, num_n, num_k, 1, GROUP, STAGES, ES)


@gluon.jit
def wgrad_adamw_ws_kernel(dy_desc, x_desc, w_desc, m_desc, v_desc,
                          decay, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                          M, N, K,
                          GROUP: gl.constexpr, STAGES: gl.constexpr, ES: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BMT: gl.constexpr = dy_desc.block_type.shape[0]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    gl.static_assert(num_warps == 4)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = num_n * num_k

    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BMT, BN], dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BMT, BK], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [ES] + w_desc.block_type.shape, w_desc.layout)
    m_bufs = gl.allocate_shared_memory(m_desc.dtype, [ES] + m_desc.block_type.shape, m_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [ES] + v_desc.block_type.shape, v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    e_ready = gl.allocate_shared_memory(gl.int64, [ES, 1], mbarrier.MBarrierLayout())
    e_empty = gl.allocate_shared_memory(gl.int64, [ES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(ES):
        mbarrier.init(e_ready.index(i), count=1)
        mbarrier.init(e_empty.index(i), count=1)
    mma_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(mma_turn.index(i), count=1)
        mbarrier.init(epi_turn.index(i), count=1)

    gl.warp_specialize([
        (_consumer, (dy_desc, x_desc, w_desc, m_desc, v_desc, a_bufs, b_bufs, ready, empty,
                     w_bufs, m_bufs, v_bufs, e_ready, e_empty, mma_turn, epi_turn,
                     decay, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                     M, num_tiles, num_n, num_k, 0, GROUP, STAGES, ES)),
        (_consumer1, (dy_desc, x_desc, w_desc, m_desc, v_desc, a_bufs, b_bufs, ready, empty,
                      w_bufs, m_bufs, v_bufs, e_ready, e_empty, mma_turn, epi_turn,
                      decay, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size,
                      M, num_tiles, num_n, num_k, GROUP, STAGES, ES)),
        (_gemm_loader, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, M, num_tiles, num_n, num_k, GROUP, STAGES)),
        (_epi_loader, (w_desc, m_desc, v_desc, w_bufs, m_bufs, v_bufs, e_ready, e_empty, num_tiles, num_n, num_k,
                       BK, GROUP, ES)),
    ], [4, 1, 1], [CONSUMER_REGS, 24, 24])


# ---------------------------------------------------------------------------------------------------------------
# launcher

CONFIGS = {
    # name: (BMT tokens per k-step, BN, BK, EPI_N, STAGES, ES, GROUP, consumer regs, maxnreg)
    "g4e3": (64, 128, 128, 16, 4, 3, 8, 232, 168),
    "g3e4": (64, 128, 128, 16, 3, 4, 8, 232, 168),
    "g2e6": (64, 128, 128, 16, 2, 6, 8, 232, 168),
}
DEFAULT = "g4e3"

_SMS = {}


def _num_sms(dev):
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    return _SMS[dev]


def adamw_scalars(lr, beta1, beta2, eps, wd, step):
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return dict(decay=1.0 - lr * wd, omb1=1.0 - beta1, beta2=beta2, omb2=1.0 - beta2,
                inv_sqrt_bc2=1.0 / math.sqrt(bc2), eps=eps, step_size=lr / bc1)


def prepare(w, dy_t, x, exp_avg, exp_avg_sq, sc, config=DEFAULT, num_sms=None):
    """(kernel, grid, args, kwargs) of one launch; w/exp_avg/exp_avg_sq fp32 [N, K] updated in place."""
    bmt, bn, bk, epi_n, stages, es, group, cregs, maxnreg = CONFIGS[config]
    n, k = w.shape
    m = x.shape[0]
    assert n % bn == 0 and k % bk == 0 and m > 0, "prototype: N, K multiples of 128"
    dy = dy_t.t()
    assert dy.is_contiguous() and x.is_contiguous(), "prototype: dY [M, N] and X [M, K] row-major"
    assert dy.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
    for t in (w, exp_avg, exp_avg_sq):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n, k)
    a_l = gl.NVMMASharedLayout.get_default_for([bmt, bn], gl.bfloat16)
    b_l = gl.NVMMASharedLayout.get_default_for([bmt, bk], gl.bfloat16)
    e_l = gl.NVMMASharedLayout.get_default_for([bn, epi_n], gl.float32)
    dy_desc = TensorDescriptor(dy, [m, n], [n, 1], [bmt, bn], a_l)
    x_desc = TensorDescriptor(x, [m, k], [k, 1], [bmt, bk], b_l)
    w_desc, m_desc, v_desc = (TensorDescriptor(t, [n, k], [k, 1], [bn, epi_n], e_l) for t in (w, exp_avg, exp_avg_sq))
    tiles = (n // bn) * (k // bk)
    grid = (min(num_sms or _num_sms(w.device), tiles), )
    args = (dy_desc, x_desc, w_desc, m_desc, v_desc,
            sc["decay"], sc["omb1"], sc["beta2"], sc["omb2"], sc["inv_sqrt_bc2"], sc["eps"], sc["step_size"],
            m, n, k)
    kw = dict(GROUP=group, STAGES=stages, ES=es, CONSUMER_REGS=cregs, num_warps=4, maxnreg=maxnreg)
    return wgrad_adamw_ws_kernel, grid, args, kw


def launch(w, dy_t, x, exp_avg, exp_avg_sq, sc, config=DEFAULT, num_sms=None):
    kern, grid, args, kw = prepare(w, dy_t, x, exp_avg, exp_avg_sq, sc, config, num_sms)
    return kern[grid](*args, **kw)


# ---------------------------------------------------------------------------------------------------------------
# CPU: compile for sm_90 with a stub driver (no GPU), report registers / spills / smem


def compile_only(configs):
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Stub:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(_Stub())
    n = k = 1024
    m = 512
    w = torch.randn(n, k)
    st = [torch.randn(n, k), torch.rand(n, k)]
    dy = torch.randn(m, n).bfloat16()
    x = torch.randn(m, k).bfloat16()
    sc = adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 11)
    out = {}
    for c in configs:
        kern, grid, args, kw = prepare(w, dy.t(), x, st[0], st[1], sc, c, num_sms=132)
        t0 = time.time()
        ck = kern.warmup(*args, grid=grid, **kw)
        ptx = ck.asm["ptx"]
        import re
        import subprocess
        import tempfile
        from triton.backends.nvidia.compiler import get_ptxas
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "k.ptx")
            open(p, "w").write(ptx)
            r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", p, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True)
        info = re.findall(r"Used (\d+) registers|(\d+) bytes spill stores|(\d+) bytes spill loads", r.stderr)
        out[c] = dict(shared=ck.metadata.shared, compile_s=round(time.time() - t0, 1),
                      setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32 (\d+)", ptx))),
                      ptxas=r.stderr.strip().splitlines()[-3:], n_info=info)
        print(c, json.dumps(out[c], indent=1), flush=True)
        with open(f"/tmp/gluon_{c}.ptx", "w") as f:
            f.write(ptx)
        with open(f"/tmp/gluon_{c}.ttgir", "w") as f:
            f.write(ck.asm["ttgir"])
    return out


# ---------------------------------------------------------------------------------------------------------------
# GPU: correctness, then timing vs unfused (cuBLAS + torch._fused_adamw_) and vs forge's current Triton kernel


def reference_fp64(w, dy_t, x, m0, v0, h, step):
    lr, b1, b2, eps, wd = h
    g = dy_t.double() @ x.double()
    p, m, v = w.double(), m0.double(), v0.double()
    p = p * (1 - lr * wd)
    m = m + (g - m) * (1 - b1)
    v = v * b2 + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2 ** step) + eps
    p = p - lr / (1 - b1 ** step) * m / denom
    return p, m, v


def smoke(cfgs, out):
    import bench_wgrad_update as B
    os.makedirs(out, exist_ok=True)
    h = B.HP["adamw"]
    sc = adamw_scalars(*h, 11.0)
    ok_all = []
    for c in cfgs:
        ok_c = True
        # (grid size forced small: many tiles per CTA, both consumers, odd and even tile counts per CTA)
        for n, k, mtok, nsm in ((256, 384, 64, None), (256, 384, 64, 2), (512, 512, 200, 3), (1024, 1024, 200, None),
                                (1024, 2048, 1024, 7), (4096, 4096, 256, None), (4096, 4096, 2048, None)):
            rule, w, dy_t, x, st, hp = B.make_inputs("adamw", torch.bfloat16, n, k, mtok, seed=mtok)
            ref = reference_fp64(w, dy_t, x, st[1], st[2], h, 11.0)
            p1, m1, v1 = w.clone(), st[1].clone(), st[2].clone()
            t0 = time.time()
            try:
                ck = launch(p1, dy_t, x, m1, v1, sc, c, nsm)
                torch.cuda.synchronize()
            except Exception as ex:
                print(f"smoke {c} {n}x{k} M={mtok} FAILED: {type(ex).__name__}: {str(ex)[:400]}", flush=True)
                ok_c = False
                break
            e = ((p1.double() - ref[0]).norm() / (ref[0] - w.double()).norm()).item()
            em = ((m1.double() - ref[1]).norm() / ref[1].norm()).item()
            ev = ((v1.double() - ref[2]).norm() / ref[2].norm()).item()
            good = e < 1e-3 and em < 1e-5 and ev < 1e-5
            print(f"smoke {c} {n}x{k} M={mtok} grid {nsm or 'SMs'}: W upd rel {e:.2e} m {em:.2e} v {ev:.2e} {'OK' if good else 'BAD'} "
                  f"({time.time() - t0:.1f}s, regs {getattr(ck, 'n_regs', None)} spills {getattr(ck, 'n_spills', None)}"
                  f" smem {ck.metadata.shared})", flush=True)
            ok_c = ok_c and good
        if ok_c:
            ok_all.append(c)
    with open(os.path.join(out, "smoke_ok.txt"), "w") as f:
        f.write(",".join(ok_all))
    print("smoke ok:", ok_all, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shapes", default="4096x4096")
    ap.add_argument("--ms", default="256,1024,2048,4096,8192")
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="small shapes only; writes the passing configs to "
                    "OUT/smoke_ok.txt (run it under `timeout`: a hang there keeps the main run away from the kernel)")
    args = ap.parse_args()
    cfgs = [c for c in args.configs.split(",") if c]
    if args.compile_only:
        compile_only(cfgs)
        return
    if args.smoke:
        smoke(cfgs, args.out)
        return

    import bench_wgrad_update as B
    from forge_compile.kernels import wgrad_update_triton as wt
    from triton.testing import do_bench

    os.makedirs(args.out, exist_ok=True)
    lines = []

    def log(s):
        lines.append(s)
        print(s, flush=True)

    log(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    h = B.HP["adamw"]
    step = 11.0   # make_inputs' step state is 10; the step being taken is the 11th
    sc = adamw_scalars(*h, step)
    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for n, k in shapes:
        for mtok in [int(v) for v in args.ms.split(",")]:
            rule, w, dy_t, x, st, hp = B.make_inputs("adamw", torch.bfloat16, n, k, mtok, seed=mtok + 7)
            step_t, m0, v0 = st
            ref = reference_fp64(w, dy_t, x, m0, v0, h, step)
            upd = (ref[0] - w.double()).norm().item()

            def errs(p, m, v):
                return ((p.double() - ref[0]).norm().item() / upd,
                        (m.double() - ref[1]).norm().item() / ref[1].norm().item(),
                        (v.double() - ref[2]).norm().item() / ref[2].norm().item())

            unfused, one_step = B.make_unfused("adamw", rule, w, dy_t, x, st, hp)
            pb = one_step(w, st)
            # torch's states after the step: make_unfused keeps them private; rerun by hand for m/v
            mb, vb = m0.clone(), v0.clone()
            pb2 = w.clone()
            gr = torch.mm(dy_t, x, out_dtype=torch.float32)
            torch._fused_adamw_([pb2], [gr], [mb], [vb], [], [torch.tensor(step, device="cuda")], lr=h[0], beta1=h[1],
                                beta2=h[2], weight_decay=h[4], eps=h[3], amsgrad=False, maximize=False)
            del gr
            e_torch = errs(pb2, mb, vb)
            res = dict(n=n, k=k, m=mtok, err_torch=e_torch, configs={})
            # correctness of each gluon config (fresh copies)
            ok_cfgs = []
            for c in cfgs:
                p1, m1, v1 = w.clone(), m0.clone(), v0.clone()
                try:
                    ck = launch(p1, dy_t, x, m1, v1, sc, c)
                    torch.cuda.synchronize()
                except Exception as ex:
                    log(f"  {c} FAILED at {n}x{k} M={mtok}: {type(ex).__name__}: {str(ex)[:300]}")
                    continue
                e = errs(p1, m1, v1)
                vs_torch = ((p1 - pb2).norm() / (pb2 - w).norm()).item()
                # tolerance: 3x torch's own error vs the same fp64 reference (its fp32 GEMM error grows with M:
                # m/v 9e-6 / 3e-5 at M=8192), with floors 1e-3 (W update) and 1e-5 (m, v). Run 2 used the bare
                # floors for m/v and so rejected M=8192 (v 1.7e-5, torch 2.9e-5) and did not time it.
                ok = (e[0] < max(1e-3, 3 * e_torch[0]) and e[1] < max(1e-5, 3 * e_torch[1])
                      and e[2] < max(1e-5, 3 * e_torch[2]) and not torch.isnan(p1).any().item())
                res["configs"][c] = dict(err=e, w_vs_torch=vs_torch, ok=ok, regs=getattr(ck, "n_regs", None),
                                         spills=getattr(ck, "n_spills", None))
                log(f"  check {c} {n}x{k} M={mtok}: W upd rel {e[0]:.2e} (torch {e_torch[0]:.2e}), m {e[1]:.2e} "
                    f"(torch {e_torch[1]:.2e}), v {e[2]:.2e} (torch {e_torch[2]:.2e}), W vs torch {vs_torch:.2e} "
                    f"-> {'OK' if ok else 'BAD'}")
                if ok:
                    ok_cfgs.append(c)
                del p1, m1, v1
            del ref

            def bench(f):
                return do_bench(f, warmup=10, rep=args.rep, return_mode="median")

            t_unf = bench(unfused)
            cur_cfg = wt.pick_config(n, k, mtok, False, False)
            cur = wt.bound_launch(w, dy_t, x, st, hp, rule, config=cur_cfg)
            t_cur = bench(cur)
            # gluon configs run on private copies (the step repeats: values drift, timing does not care)
            pw, pm, pv = w.clone(), m0.clone(), v0.clone()
            for c in ok_cfgs:
                kern, grid, a, kw = prepare(pw, dy_t, x, pm, pv, sc, c)
                res["configs"][c]["ms"] = bench(lambda: kern[grid](*a, **kw))
            t_unf = min(t_unf, bench(unfused))
            t_mm = bench(lambda: torch.mm(dy_t, x, out_dtype=torch.float32))
            floor = max(24 * n * k / B.BW, 2 * n * k * mtok / B.FLOPS) * 1e3
            res.update(unfused_ms=t_unf, cur_ms=t_cur, cur_cfg=cur_cfg, mm_ms=t_mm, floor_ms=floor)
            best = min((c for c in ok_cfgs), key=lambda c: res["configs"][c]["ms"], default=None)
            res["best"] = best
            rows.append(res)
            gtxt = "  ".join(f"{c}={res['configs'][c]['ms']:.4f}" for c in ok_cfgs)
            log(f"{n}x{k} M={mtok}: unfused {t_unf:.4f} (mm {t_mm:.4f})  current {cur_cfg} {t_cur:.4f}  gluon {gtxt}"
                f"  floor {floor:.4f}")
            del w, dy_t, x, st, unfused, one_step, pw, pm, pv, pb, pb2, mb, vb
            torch.cuda.empty_cache()

    log("")
    log(f"{'shape':>10} {'M':>5} {'unfused':>8} {'current':>8} {'gluon':>8} {'cfg':>5} {'unf/gl':>6} {'cur/gl':>6} "
        f"{'unf/cur':>7} {'floor':>7}")
    for r in rows:
        g = r["configs"][r["best"]]["ms"] if r["best"] else float("nan")
        log(f"{str(r['n']) + 'x' + str(r['k']):>10} {r['m']:>5} {r['unfused_ms']:8.4f} {r['cur_ms']:8.4f} {g:8.4f} "
            f"{str(r['best']):>5} {r['unfused_ms'] / g:6.2f} {r['cur_ms'] / g:6.2f} {r['unfused_ms'] / r['cur_ms']:7.2f} "
            f"{r['floor_ms']:7.4f}")
    with open(os.path.join(args.out, "gluon.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "gluon.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
