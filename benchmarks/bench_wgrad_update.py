"""Fused wgrad+AdamW (Triton) vs unfused cuBLAS wgrad + torch._fused_adamw_, on one GPU.

  python benchmarks/bench_wgrad_update.py [--out DIR] [--shapes 4096x4096,14336x4096] [--ms 256,1024]

Baseline: torch.mm(dy_t, x, out_dtype=torch.float32) (cuBLAS, bf16 in, fp32 out; falls back to a bf16 mm
followed by .float() where mm.dtype is missing, which the output says) + torch._fused_adamw_ on fp32
W/m/v. Fused: the catalogue's AdamW rule through the generated kernel, each config of CONFIGS, timed as the
kernel launch alone (host part precomputed) and as the full launch_wgrad_update (host part included).
Floor = max(bytes / 4.27e12, flops / 686e12), bytes = 24 N K (W, m, v read + write) + 2 M (N + K).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from forge_compile.kernels.wgrad_update_triton import CONFIGS, _kernel_for, launch_wgrad_update, pick_config  # noqa: E402
from forge_compile.optim.rules import adamw_rule  # noqa: E402

BW, FLOPS = 4.27e12, 686e12
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


def wgrad_mm(dy_t, x):
    try:
        return torch.mm(dy_t, x, out_dtype=torch.float32), "mm(out_dtype=fp32)"
    except (TypeError, RuntimeError):
        return torch.mm(dy_t, x).float(), "bf16 mm + .float()"


def probe_eager_semantics(log):
    """Which formula each eager CUDA element-wise kernel computes (the epilogue codegen copies them)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 1 << 20
    a, b, c = (torch.randn(n, device="cuda", generator=g) for _ in range(3))
    c = c.abs() + 0.1
    s = 0.3719
    sf = torch.tensor(s, dtype=torch.float32).item()

    def fma(x, y, z):
        return (x.double() * y.double() + z.double()).float()

    def cmp(name, t, cands):
        res = {k: int((t != v).sum()) for k, v in cands.items()}
        log(f"probe {name}: mismatches {res}")
        return res

    st = torch.tensor(s, dtype=torch.float64)
    out = {}
    out["add_alpha"] = cmp("add alpha", torch.add(a, b, alpha=s), {"plain": a + sf * b, "fma": fma(torch.full_like(b, sf), b, a)})
    out["addcmul"] = cmp("addcmul", torch.addcmul(a, b, c, value=s), {"plain": a + sf * (b * c), "fma(v,b*c,a)": fma(torch.full_like(b, sf), b * c, a), "fma(v*b,c,a)": fma(sf * b, c, a)})
    out["addcdiv"] = cmp("addcdiv", torch.addcdiv(a, b, c, value=s), {"plain": a + sf * (b / c), "fma(v,b/c,a)": fma(torch.full_like(b, sf), b / c, a), "a+(v*b)/c": a + (sf * b) / c})
    w = torch.tensor(0.1, dtype=torch.float64)
    wf = torch.tensor(0.1, dtype=torch.float32).item()
    out["lerp_small"] = cmp("lerp w=0.1", torch.lerp(a, b, w), {"plain": a + wf * (b - a), "fma": fma(torch.full_like(a, wf), b - a, a)})
    w9 = torch.tensor(0.9, dtype=torch.float32).item()
    one_m = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(0.9, dtype=torch.float32)
    out["lerp_big"] = cmp("lerp w=0.9", torch.lerp(a, b, torch.tensor(0.9, dtype=torch.float64)), {"plain": b - (b - a) * one_m.item(), "fma": fma(-(b - a), torch.full_like(a, one_m.item()), b)})
    recip = (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32)).item()
    out["div_scalar"] = cmp("tensor / cpu scalar", a / st, {"div": (a.double() / sf).float(), "mul recip": a * recip})
    out["sqrt"] = cmp("sqrt", c.sqrt(), {"ieee": c.double().sqrt().float()})
    out["div"] = cmp("tensor / tensor", a / c, {"ieee": (a.double() / c.double()).float()})
    return out


def run_tests_of_kernel(log):
    """Correctness of every config before timing: dW stored vs torch fp32 mm, W/states vs eager rule."""
    rule = adamw_rule()
    ok = True
    for shape in [(4096, 4096, 1024), (1000, 777, 333)]:
        n, k, m = shape
        for name in CONFIGS:
            if name == "interp":
                continue
            w, dy_t, x, st, hp = make_inputs(n, k, m, seed=7)
            w_e, st_e = w.clone(), [s.clone() for s in st]
            grad = torch.full((n, k), float("nan"), device="cuda")
            launch_wgrad_update(w, dy_t, x, st, hp, rule, grad_out=grad, config=name)
            ref = dy_t.double() @ x.double()
            rel = ((grad.double() - ref).norm() / ref.norm()).item()
            with torch.no_grad():
                rule.apply(w_e, grad, st_e, hp)
            exact = torch.equal(w, w_e) and all(torch.equal(a, b) for a, b in zip(st, st_e))
            good = rel < 1e-5 and not grad.isnan().any().item() and exact
            ok &= good
            log(f"check {n}x{k}x{m} config {name}: dW rel err {rel:.2e}, W/states bit-exact vs eager: {exact} {'OK' if good else 'FAIL'}")
    return ok


def make_inputs(n, k, m, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g)
    st = [torch.tensor(10.0), torch.randn(n, k, device="cuda", generator=g) * 1e-3,
          torch.rand(n, k, device="cuda", generator=g) * 1e-4]
    dy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    hp = [torch.tensor(v, dtype=torch.float64) for v in (LR, B1, B2, EPS, WD)]
    return w, dy.t(), x, st, hp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--ms", default="256,1024,2048,4096,8192")
    ap.add_argument("--configs", default=",".join(c for c in CONFIGS if c != "interp"))
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    lines = []

    def log(s):
        lines.append(s)
        print(s, flush=True)

    log(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  GPU {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__}  triton {triton.__version__}")
    probe = probe_eager_semantics(log)
    checks_ok = run_tests_of_kernel(log)
    rule = adamw_rule()
    configs = args.configs.split(",")
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for m in map(int, args.ms.split(",")):
            w, dy_t, x, st, hp = make_inputs(n, k, m, seed=m)
            # baseline state (torch format: step on device for _fused_adamw_)
            wb, mb, vb = w.clone(), st[1].clone(), st[2].clone()
            stepb = torch.tensor(10.0, device="cuda")

            def unfused():
                gr, _ = wgrad_mm(dy_t, x)
                torch._fused_adamw_([wb], [gr], [mb], [vb], [], [stepb], lr=LR, beta1=B1, beta2=B2,
                                    weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)

            _, how = wgrad_mm(dy_t, x)
            # correctness of the pair before timing: one step each from the same state
            w1, st1 = w.clone(), [s.clone() for s in st]
            launch_wgrad_update(w1, dy_t, x, st1, hp, rule)
            wb.copy_(w); mb.copy_(st[1]); vb.copy_(st[2]); stepb.fill_(11.0)  # torch.optim increments first
            unfused()
            rel_w = ((w1 - wb).norm() / (wb - w).norm()).item()  # relative to the size of the update
            t_unf = do_bench(unfused, warmup=25, rep=100, return_mode="median")

            ep, kernel = _kernel_for(rule, "cuda")
            tstates = [st[1], st[2]]
            scalars, _ = ep.run_host([st[0]], hp)
            res = {}
            for name in configs:
                bn, bk, bm, group, warps, stages = CONFIGS[name]
                grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk),)

                def fused_kernel(bn=bn, bk=bk, bm=bm, group=group, warps=warps, stages=stages, grid=grid):
                    kernel[grid](w, dy_t, x, *tstates, w, *scalars, n, k, m,
                                 dy_t.stride(0), dy_t.stride(1), x.stride(0), x.stride(1),
                                 BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=bm, GROUP_N=group, EVEN_M=(m % bm == 0),
                                 UPCAST=False, STORE_GRAD=False, num_warps=warps, num_stages=stages,
                                 enable_fp_fusion=False)
                try:
                    res[name] = do_bench(fused_kernel, warmup=25, rep=100, return_mode="median")
                except Exception as e:  # out of shared memory / registers for this tile
                    log(f"  config {name} failed at {n}x{k} M={m}: {type(e).__name__}: {str(e)[:120]}")
            default = pick_config(n, k, m, False)

            def fused_full():
                launch_wgrad_update(w, dy_t, x, st, hp, rule)

            t_full = do_bench(fused_full, warmup=25, rep=100, return_mode="median")
            best = min(res, key=res.get)
            nbytes = 24 * n * k + 2 * m * (n + k)
            floor = max(nbytes / BW, 2 * n * k * m / FLOPS) * 1e3
            row = dict(n=n, k=k, m=m, unfused_ms=t_unf, baseline=how, best_config=best, best_ms=res[best],
                       default_config=default, default_ms=res.get(default), full_launch_ms=t_full,
                       floor_ms=floor, rel_w_vs_torch=rel_w, all_configs=res)
            rows.append(row)
            log(f"{n}x{k} M={m}: unfused {t_unf:.4f}  best {best} {res[best]:.4f} ({t_unf / res[best]:.2f}x)  "
                f"default {default} {res.get(default, float('nan')):.4f}  full-launch {t_full:.4f}  floor {floor:.4f}  "
                f"W vs torch rel {rel_w:.1e}  | " + " ".join(f"{k_}={v:.3f}" for k_, v in res.items()))

    log("")
    log(f"{'shape':>12} {'M':>5} {'unfused':>8} {'fused':>8} {'cfg':>9} {'ratio':>6} {'launch':>8} {'floor':>7} {'fl/fused':>8}")
    for r in rows:
        log(f"{r['n']}x{r['k']:>6} {r['m']:>5} {r['unfused_ms']:8.4f} {r['best_ms']:8.4f} {r['best_config']:>9} "
            f"{r['unfused_ms'] / r['best_ms']:6.2f} {r['full_launch_ms']:8.4f} {r['floor_ms']:7.4f} {r['floor_ms'] / r['best_ms']:8.2f}")
    log(f"checks {'OK' if checks_ok else 'FAILED'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(rows=rows, probe=probe, checks_ok=checks_ok), f, indent=1)
    with open(os.path.join(args.out, "bench.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
