"""Probe: a tf32 warpgroup MMA on token-major fp32 dY / X (the fp32-activation regime under TF32), in Gluon.

Why: with fp32 activations under TF32 the fused step is 0.40-0.58x of cuBLAS TF32 + fused AdamW (RESULTS.md "fp32
activations under TF32"): dW[n, k] = sum_m dY[m, n] X[m, k] has both operands MN-major (contiguous along n / k), and
sm_90 wgmma takes MN-major shared-memory operands only for 16-bit types; tf32 needs K-major (tokens contiguous).
This probe computes one tile C[BN, BK] = A^T B (A [M, BN], B [M, BK] fp32, tokens first) with tf32 wgmma in several
ways (MODE, below) -- the building block a fused TF32 kernel would need. Stop 28 compiled it for sm_90 on CPU
(triton 3.6): modes 0 and 3 abort in lowering ("WGMMA type or shape is not supported": 32-bit MN-major operands);
modes 1, 2, 4, 5 compile to HGMMA.64x128x8.F32.TF32, no spills (NOTES_kernel.md "Stop 28"). NOT run on a GPU yet.

  CPU (compile only; triton 3.6 first on the path):  PYTHONPATH=/tmp/t36 python benchmarks/probe_tf32_wgmma.py 1,2,4,5
  GPU (numerics vs fp64, then one CTA's time):       python3 benchmarks/probe_tf32_wgmma.py 4,5 --out $OUT
On the GPU a single CTA runs the whole M-loop: FLOP/s per SM against tf32's ~3.7 TFLOP/s per SM (H100/H200 dense
peak / 132) says whether the converter's shared-memory round trip leaves the tensor cores fed (estimate: ~50 % of
peak with both operands transposed, ~67 % with A from registers).
"""
from __future__ import annotations

import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GPU = torch.cuda.is_available()
if not GPU:
    from compile_sm90 import stub_driver

    stub_driver()
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,  # noqa: E402
                                                               warpgroup_mma)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402


# MODE 0: both operands straight from the TMA (MN-major) buffers: a.permute, b as is
# MODE 1: A from registers (DotOperandLayout, read from MN-major smem), B transposed through registers to K-major smem
# MODE 2: both transposed through registers into K-major NVMMA buffers
# MODE 3: as 0 but A from registers (B still MN-major smem)
# MODE 4: as 2, MODE 5: as 1, converter layout [4,1] per thread (4 tokens): STS.128 into the K-major copy
@gluon.jit
def kern(a_desc, b_desc, c_ptr, M, MODE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = a_desc.block_type.shape[1]
    BK: gl.constexpr = b_desc.block_type.shape[1]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BK, 8])
    # converter register layout: threads along the contiguous (MN) dim, 4 elems each (16B ld.shared)
    if MODE >= 4:   # 4 consecutive tokens per thread: scalar LDS along n (conflict-free), STS.128 into K-major rows
        cvt_l: gl.constexpr = gl.BlockedLayout([4, 1], [1, 32], [num_warps, 1], [0, 1])
    else:
        cvt_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    a_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM, BN], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BM, BK], b_desc.layout)
    # K-major copies: [BN, BM] / [BK, BM] with BM (the reduction, tokens) contiguous
    at_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    if MODE == 2 or MODE == 4:
        at_smem = gl.allocate_shared_memory(gl.float32, [BN, BM], at_l)
    bt_smem = gl.allocate_shared_memory(gl.float32, [BK, BM], at_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    ksteps = gl.cdiv(M, BM)
    for i in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(i), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [i * BM, 0], ready.index(i), a_bufs.index(i))
        tma.async_copy_global_to_shared(b_desc, [i * BM, 0], ready.index(i), b_bufs.index(i))
    acc = gl.zeros([BN, BK], gl.float32, acc_l)
    for it in range(ksteps):
        s = it % STAGES
        nx = it + STAGES - 1
        if nx < ksteps:
            sn = nx % STAGES
            mbarrier.expect(ready.index(sn), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [nx * BM, 0], ready.index(sn), a_bufs.index(sn))
            tma.async_copy_global_to_shared(b_desc, [nx * BM, 0], ready.index(sn), b_bufs.index(sn))
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a_s = a_bufs.index(s)
        b_s = b_bufs.index(s)
        if MODE == 0:
            acc = warpgroup_mma(a_s.permute((1, 0)), b_s, acc)
        elif MODE == 3:
            a_r = a_s.permute((1, 0)).load(gl.DotOperandLayout(0, acc_l, 1))
            acc = warpgroup_mma(a_r, b_s, acc)
        else:
            bt = b_s.load(cvt_l)                      # [BM, BK], MN-major rows
            bt_smem.store(gl.permute(bt, (1, 0)))     # [BK, BM], tokens contiguous (K-major)
            if MODE == 2 or MODE == 4:
                at = a_s.load(cvt_l)
                at_smem.store(gl.permute(at, (1, 0)))
            fence_async_shared()
            if MODE == 2 or MODE == 4:
                acc = warpgroup_mma(at_smem, bt_smem.permute((1, 0)), acc)
            else:
                a_r = a_s.permute((1, 0)).load(gl.DotOperandLayout(0, acc_l, 1))
                acc = warpgroup_mma(a_r, bt_smem.permute((1, 0)), acc)
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, acc_l))
    gl.store(c_ptr + rn[:, None] * BK + rk[None, :], acc)


def compile_row(ck) -> dict:
    """compile_sm90's registers / spills / smem row, plus the tensor-core instruction's full name (.TF32?) and the
    converter's shared-memory traffic (LDSM / LDS / STS) and any FMA fallback, counted in the SASS."""
    from compile_sm90 import _ptxas_row, sass_text

    sass = sass_text(ck.asm["cubin"])
    return dict(_ptxas_row(ck), mma=sorted(set(re.findall(r"(HGMMA\.\S+|HMMA\.\S+)", sass))),
                n_ldsm=len(re.findall(r"LDSM", sass)), n_lds=len(re.findall(r"\bLDS", sass)),
                n_sts=len(re.findall(r"\bSTS", sass)), n_ffma=len(re.findall(r"FFMA", sass)))


def main():
    arg = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "4,5"
    modes = [int(m) for m in arg.split(",")]
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    BM, BN, BK = int(os.environ.get("BM", 32)), int(os.environ.get("BN", 128)), int(os.environ.get("BK", 128))
    STAGES = int(os.environ.get("STAGES", 3))
    m = int(os.environ.get("M", 4096))
    dev = "cuda" if GPU else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(m, BN, device=dev, generator=gen)
    b = torch.randn(m, BK, device=dev, generator=gen)
    c = torch.empty(BN, BK, device=dev)
    ad = TensorDescriptor(a, [m, BN], [BN, 1], [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float32))
    bd = TensorDescriptor(b, [m, BK], [BK, 1], [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float32))
    rows = []
    for mode in modes:
        row = dict(mode=mode, BM=BM, BN=BN, BK=BK, STAGES=STAGES, M=m)
        try:
            if GPU:
                kern[(1,)](ad, bd, c, m, MODE=mode, STAGES=STAGES, num_warps=4)
                ref = (a.double().t() @ b.double())
                # tf32 inputs (10-bit mantissa, 2^-11 relative rounding): ~1e-4-1e-3 of the largest |C| for random
                # operands; a wrong transposition or stage is O(1)
                rel = ((c.double() - ref).abs().max() / ref.abs().max()).item()
                row.update(ok=rel < 5e-3, rel_err=rel)
                import triton.testing

                ms = triton.testing.do_bench(lambda: kern[(1,)](ad, bd, c, m, MODE=mode, STAGES=STAGES, num_warps=4))
                row.update(ms=ms, tflops_per_sm=2 * m * BN * BK / ms / 1e9)
            else:
                ck = kern.warmup(ad, bd, c, m, MODE=mode, STAGES=STAGES, num_warps=4, grid=(1,))
                row.update(ok=True, **compile_row(ck))
        except Exception as e:   # a probe: report every mode, also the ones the compiler rejects
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-400:]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        with open(os.path.join(out, "probe_tf32_wgmma.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
