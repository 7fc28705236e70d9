"""forge::rule_update_ (a rule's generated epilogue as an element-wise kernel, scalars from a device table row) vs
torch's fused AdamW on the same parameter, on one GPU.

  python benchmarks/bench_rule_update.py [--out DIR] [--rep N]

Why: in a step replayed as a CUDA graph (compile_train_step(cuda_graphs=True)) every parameter forge does not fuse
-- the embedding, the norms -- is updated by this kernel instead of Inductor's decomposed rule, so its rate is part
of the graphed step's GPU time (the 8-layer Llama's 32000x2048 embedding: 7 x 262 MB of traffic per step). Shapes:
that embedding, a 4096x4096 matrix, a 2048 norm weight. Check before timing: W/states bitwise vs eager rule.fn on
the same gradient. Medians of triton.testing.do_bench; GB/s counts 4 arrays read + 3 written (AdamW).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [(32000, 2048), (4096, 4096), (2048,)]
HP = (1e-3, 0.9, 0.999, 1e-8, 0.01)   # lr, beta1, beta2, eps, weight_decay
VARIANTS = [(1024, 4), (2048, 4), (4096, 8), (8192, 8)]   # (elements per program, warps); the first is the default


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rep", type=int, default=25)
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    from forge_compile.kernels.rule_update import launch_rule_update
    from forge_compile.kernels.wgrad_update_triton import rule_scalars
    from forge_compile.optim.rules import adamw_rule

    rule = adamw_rule()
    lines = [f"date {datetime.datetime.now().isoformat(timespec='seconds')}  GPU {torch.cuda.get_device_name()}  "
             f"torch {torch.__version__}  triton {triton.__version__}",
             f"{'shape':>12} {'fused_adamw ms':>15} {'rule_update ms':>15} {'ratio':>7} {'rule_update GB/s':>17} exact"]
    ok_all = True
    for shape in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        p = torch.randn(shape, device="cuda", generator=g)
        grad = torch.randn(shape, device="cuda", generator=g)
        m = torch.randn(shape, device="cuda", generator=g) * 1e-3
        v = torch.rand(shape, device="cuda", generator=g) * 1e-4
        step = torch.tensor(10.0)
        hp = [torch.tensor(x, dtype=torch.float64) for x in HP]
        # the rule's states are (step, exp_avg, exp_avg_sq); the table row holds the kernel scalars of this step
        vals, _ = rule_scalars(rule, [step], hp)
        table = torch.tensor(vals, dtype=torch.float32, device="cuda")
        pe, me, ve = p.clone(), m.clone(), v.clone()
        with torch.no_grad():
            rule.apply(pe, grad, [step.clone(), me, ve], hp)
        pk, mk, vk = p.clone(), m.clone(), v.clone()   # timed on (each variant checked on fresh copies below)
        stepf = torch.tensor(11.0, device="cuda")

        def fused():
            torch._fused_adamw_([pk], [grad], [mk], [vk], [], [stepf], lr=HP[0], beta1=HP[1], beta2=HP[2],
                                weight_decay=HP[4], eps=HP[3], amsgrad=False, maximize=False)

        t_f = do_bench(fused, warmup=10, rep=args.rep, return_mode="median")
        for block, warps in VARIANTS:
            pv, mv, vv = p.clone(), m.clone(), v.clone()
            launch_rule_update(pv, grad, [mv, vv], table, rule, block=block, num_warps=warps)
            same = torch.equal(pv, pe) and torch.equal(mv, me) and torch.equal(vv, ve)
            ok_all &= same
            t_r = do_bench(lambda: launch_rule_update(pk, grad, [mk, vk], table, rule, block=block,
                                                      num_warps=warps), warmup=10, rep=args.rep, return_mode="median")
            gbs = 7 * p.numel() * 4 / (t_r * 1e-3) / 1e9
            lines.append(f"{'x'.join(map(str, shape)):>12} {t_f:15.4f} {t_r:15.4f} {t_f / t_r:7.2f} {gbs:17.0f} "
                         f"{same}  block {block} warps {warps}")
            print(lines[-1], flush=True)
    lines.append(f"checks {'OK' if ok_all else 'FAILED'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_rule_update.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
