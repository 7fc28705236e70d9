"""Accuracy of the Gram ("ghost norm") identity ||dY^T X||_F^2 = sum((X X^T) * (dY dY^T)) in fp32, against the
fp64 truth and against what torch's clip_grad_norm_ sees today (the norm of the fp32 dW from a bf16 mm).

For the roadmap design "global-norm clipping without dW" (benchmarks/NOTES_kernel.md): CPU only, no GPU needed.
  python benchmarks/study_ghost_norm_accuracy.py [--shapes 2048x4096x4096,512x4096x4096]
"""
import argparse
import time

import torch

torch.manual_seed(0)


def scenarios(M, n_in, n_out):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    yield "gaussian", r(M, n_in), r(M, n_out) * 1e-3
    # tokens of one sequence share a component (correlated rows), a few outlier channels in X
    x = 0.7 * r(1, n_in) + 0.3 * r(M, n_in)
    x[:, :8] *= 30
    yield "correlated+outliers", x, (0.5 * r(1, n_out) + r(M, n_out)) * 1e-3
    # gradients that nearly cancel over tokens (dW small against the per-token terms)
    d = r(M, n_out)
    yield "cancelling dY", r(M, n_in), (d - d.mean(0, keepdim=True)) * 1e-3
    # both cancel: X centred over tokens, dY centred -> dW = sum of mostly cancelling outer products
    x = r(M, n_in); x = x - x.mean(0, keepdim=True) + 1e-3 * r(1, n_in)
    yield "both centred", x, (d - d.mean(0, keepdim=True)) * 1e-3
    # adversarial: near-identical token rows and gradients that cancel over tokens -> dW small, per-token big
    yield "near-identical X", r(1, n_in) + 1e-2 * r(M, n_in), (d - d.mean(0, keepdim=True)) * 1e-3


p = argparse.ArgumentParser()
p.add_argument("--shapes", default="2048x4096x4096,512x4096x4096,2048x1024x4096", help="M x in x out, comma-separated")
shapes = [tuple(int(v) for v in s.split("x")) for s in p.parse_args().shapes.split(",")]
for M, n_in, n_out in shapes:
    for name, x, dy in scenarios(M, n_in, n_out):
        xb, db = x.bfloat16(), dy.bfloat16()           # what autocast saves / passes back
        x64, d64 = xb.double(), db.double()
        truth = (d64.t() @ x64).pow(2).sum().item()
        t0 = time.perf_counter()
        dw32 = (db.t().float() @ xb.float())            # fp32 accumulation of the bf16 operands
        direct = dw32.pow(2).sum().item()
        t1 = time.perf_counter()
        gx, gy = xb.float() @ xb.float().t(), db.float() @ db.float().t()
        gram = (gx * gy).sum().item()
        t2 = time.perf_counter()
        absum = (gx.double().abs() * gy.double().abs()).sum().item()
        print(f"M={M} W {n_out}x{n_in} {name:20s} rel.err direct {abs(direct - truth) / truth:.1e}  "
              f"gram {abs(gram - truth) / truth:.1e}  (sum|Gx||Gy|/s = {absum / truth:.1e}; "
              f"cpu s direct {t1 - t0:.2f} gram {t2 - t1:.2f})", flush=True)
