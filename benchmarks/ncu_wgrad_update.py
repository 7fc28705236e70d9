"""Hardware counters of the fused kernel vs its parts (NOTES_kernel.md, v12 diagnosis), for Nsight Compute.

  ncu --clock-control none -k regex:'wgrad_update_gluon_kernel|nvjet|sm90|gemm|adam' --section SpeedOfLight \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
      python3 benchmarks/ncu_wgrad_update.py --cases 2048:default,2048:gemm,64:default

Launches each case's kernel ONCE (ncu replays it with caches flushed, state restored): AdamW, bf16 activations,
4096x4096 fp32 W/m/v (--n/--k). Case "M:what", what = default (pick_gconfig), gemm (GEMM schedule alone, the
default's stages/bmt), smem[_b32s6][_first|_cs] (smem_config(), 6 x 32-token stages, L2 hints), split / split_off
(v12, and its stream=False diagnostic), tma (the tma ring's M=2048 pick), mm (cuBLAS bf16->fp32 wgrad),
adamw (torch._fused_adamw_ on an fp32 grad). The launch order is the case order; ncu's report lists kernels in
that order. No timing and no checks here: bench_wgrad_update.py --cases overlap does both.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_wgrad_update import make_inputs, wgrad_mm  # noqa: E402
from forge_compile.kernels import wgrad_update_gluon as wg  # noqa: E402


def config_of(what: str, m: int):
    pick = wg.pick_gconfig(m, 3)
    if what == "default":
        return pick
    if what == "gemm":
        return wg.gemm_config(stages=pick.stages, bmt=pick.bmt)
    if what.startswith("smem"):    # smem[_b32s6][_first|_cs]
        parts = what.split("_")[1:]
        kw = dict(stages=6, bmt=32) if "b32s6" in parts else {}
        ev = [p for p in parts if p in ("first", "cs")]
        return wg.smem_config(evict=ev[0] if ev else "", **kw)
    if what == "split":
        return wg.split_config()
    if what == "split_off":     # the MMA warpgroup's GEMMs and hand-offs, no W/state traffic
        return wg.split_config(stream=False)
    if what == "tma":
        return wg.pick_gconfig(2048, 3)
    raise ValueError(what)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="2048:default,2048:gemm,64:tma,2048:mm,2048:adamw")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    args = p.parse_args()
    for case in args.cases.split(","):
        m, what = case.split(":")
        m = int(m)
        rule, w, dy_t, x, st, hp = make_inputs("adamw", torch.bfloat16, args.n, args.k, m, seed=m)
        if what == "mm":
            wgrad_mm(dy_t, x)
        elif what == "adamw":
            g = wgrad_mm(dy_t, x)
            torch._fused_adamw_([w], [g], [st[1]], [st[2]], [], [torch.tensor(10.0, device="cuda")], lr=1e-3,
                                beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        else:
            cfg = config_of(what, m)
            out = None
            if cfg.epi == "gemm":
                out = torch.zeros(wg.gemm_sums_shape(args.n, args.k, cfg), device="cuda")
            wg.bound_launch(w, dy_t, x, st, hp, rule, out, config=cfg)()
        torch.cuda.synchronize()
        print(case, "launched", flush=True)


if __name__ == "__main__":
    main()
