"""The CPU path of ``forge::wgrad_update_`` vs eager matmul + torch.optim on the same machine (issue 5: "the CPU
path: not slower than 1.5x of eager torch.optim AdamW + eager matmul").

  python benchmarks/bench_wgrad_update_cpu.py [--out DIR] [--quick]

Per case (rule, activation dtype, N x K, M tokens) on fp32 W and states:
  eager     p.grad = dy_t.float() @ x.float(); opt.step() -- a torch.optim optimizer over that one parameter
            with its CPU default implementation (for-loop), and for AdamW also foreach=True
  forge     torch.ops.forge.wgrad_update_ (the CPU impl, kernels/wgrad_update_cpu.py: dW built one ~2 MiB block at a
            time, the rule applied to each block while it is in cache -- in place for the catalogue rules; dW never
            whole)
Fresh random inputs (never zeros); each path starts from the same optimizer state (one step taken first), and
before timing one forge step is checked against one torch.optim step from that state (W relative to the update:
the two mm's block their sums differently). Medians of --reps timings after warm-up, the paths of a case timed in
turn within each repetition (the 2-core dev machine is shared: load bursts then hit all paths of a case alike);
"paired" is the median over repetitions of eager/forge within one repetition. Table on stdout, JSON in DIR.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import forge_compile  # noqa: E402,F401  (registers forge::wgrad_update_)
from forge_compile.optim.translate import hparam_values, plan_optimizer, prepare_states  # noqa: E402

HP = {"adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
      "sgdm": dict(lr=1e-3, momentum=0.9)}


def make_opt(kind, p, foreach=None):
    kw = {} if foreach is None else {"foreach": foreach}
    if kind == "adamw":
        return torch.optim.AdamW([p], **HP[kind], **kw)
    return torch.optim.SGD([p], **HP[kind], **kw)


def forge_args(opt):
    """The rule, states and hyper-parameters of ``opt``'s single parameter, translated as compile_train_step
    translates an optimizer (forge_compile.optim.translate)."""
    plan = plan_optimizer(opt)[0]
    states = prepare_states(opt, plan)
    return plan.rule, states, [torch.tensor(v, dtype=torch.float64) for v in hparam_values(opt, plan)]


def timings_ms(fns, reps, warmup=2):
    """ms of each repetition of each of ``fns`` (label -> callable), timed in turn within each repetition: a burst
    of load on the shared machine then slows every path of a case, not just the one being timed."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts = {label: [] for label in fns}
    for _ in range(reps):
        for label, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[label].append((time.perf_counter() - t) * 1e3)
    return ts


def run_case(kind, act, n, k, m, reps):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, k, generator=g)
    dy_t = torch.randn(m, n, generator=g).to(act).t()      # a transposed dY, as autograd hands it over
    x = torch.randn(m, k, generator=g).to(act)
    g0 = torch.randn(n, k, generator=g) * 1e-2

    def fresh(foreach=None):
        p = torch.nn.Parameter(w0.clone())
        opt = make_opt(kind, p, foreach)
        p.grad = g0.clone()
        opt.step()                 # the state exists and is not zero
        p.grad = None
        return p, opt

    # check: one step of each from the same state
    pe, oe = fresh()
    pf, of = fresh()
    before = pe.detach().clone()
    pe.grad = dy_t.float() @ x.float()
    oe.step()
    rule, states, hp = forge_args(of)
    with torch.no_grad():
        torch.ops.forge.wgrad_update_(pf.data, dy_t, x, states, hp, rule.name)
    upd = (pe.detach() - before).abs().max().item()
    err = (pf.detach() - pe.detach()).abs().max().item() / max(upd, 1e-30)
    if not err < 1e-3:
        raise SystemExit(f"{kind} {act} {n}x{k} M={m}: forge W differs from torch.optim by {err:.2e} of the update")

    fns = {}
    for label, foreach in (("eager", None), ("eager_foreach", True)):
        if foreach and kind != "adamw":
            continue
        p, opt = fresh(foreach)

        def unfused(p=p, opt=opt):
            p.grad = dy_t.float() @ x.float()
            opt.step()
        fns[label] = unfused
    p, opt = fresh()
    rule, states, hp = forge_args(opt)
    op = torch.ops.forge.wgrad_update_.default

    def fused(p=p, states=states, hp=hp, name=rule.name):
        with torch.no_grad():
            op(p.data, dy_t, x, states, hp, name)
    fns["forge"] = fused
    ts = timings_ms(fns, reps)
    rows = {label: statistics.median(v) for label, v in ts.items()}
    # eager/forge of the same repetition, then the median: robust to load bursts longer than one repetition
    paired = statistics.median(e / f for e, f in zip(ts["eager"], ts["forge"]))
    return dict(kind=kind, act=str(act).replace("torch.", ""), n=n, k=k, m=m, check_rel_update=err, **rows,
                ratio=rows["eager"] / rows["forge"], ratio_paired=paired)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="one shape, two M (CI-sized)")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    shapes = [(1024, 1024)] if a.quick else [(1024, 1024), (4096, 1024), (1024, 4096)]
    ms = [64, 512] if a.quick else [64, 512, 2048]
    cases = [(kind, act, n, k, m) for kind in ("adamw", "sgdm") for act in (torch.float32, torch.bfloat16)
             for n, k in shapes for m in ms]
    results = []
    for c in cases:
        r = run_case(*c, reps=a.reps)
        results.append(r)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
                cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    head = (f"{'rule':6s} {'act':9s} {'shape':>10s} {'M':>5s} {'eager ms':>9s} {'foreach':>8s} {'forge ms':>9s} "
            f"{'eager/forge':>11s} {'paired':>7s}")
    lines = [f"bench_wgrad_update_cpu  {meta['date']}  torch {meta['torch']}  {meta['threads']} threads", head]
    for r in results:
        fe = f"{r['eager_foreach']:8.3f}" if "eager_foreach" in r else f"{'-':>8s}"
        lines.append(f"{r['kind']:6s} {r['act']:9s} {r['n']:>5d}x{r['k']:<4d} {r['m']:>5d} {r['eager']:9.3f} {fe} "
                     f"{r['forge']:9.3f} {r['ratio']:10.2f}x {r['ratio_paired']:6.2f}x")
    worst = min(r["ratio"] for r in results)
    worst_paired = min(r["ratio_paired"] for r in results)
    lines.append(f"slowest case: forge at {1 / worst:.2f}x the eager time (medians; paired per repetition: "
                 f"{1 / worst_paired:.2f}x; target: <= 1.5x)")
    text = "\n".join(lines)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_cpu.json"), "w") as f:
        json.dump(dict(meta, results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
