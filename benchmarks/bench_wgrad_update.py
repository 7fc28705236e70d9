"""Fused wgrad+update (Triton) vs unfused (cuBLAS wgrad + torch's optimizer kernel), on one GPU.

  python benchmarks/bench_wgrad_update.py [--out DIR] [--cases final|sweep|all|gluon|rings|vec|smem|overlap|v12|v12b|
                                                           splitovl|hoist|math|tf32|e2e|cast|l2pf|splittune|
                                                           concurrent|group|pdl|coop] [--plot PNG]

Cases ("final"): AdamW with bf16 activations on 4096x4096, 14336x4096, 4096x14336 at M = 256..8192;
SGD-momentum, Lion and AdamW with fp32 activations on 4096x4096; AdamW on the 128256x4096 lm_head at
M <= 4096. "sweep" times every GPU config of CONFIGS (or --configs) on 4096x4096 AdamW bf16 and a shortlist
elsewhere. "gluon": AdamW bf16 on 4096x4096 and 14336x4096, SGD-momentum and Lion bf16 on 4096x4096, M = 256..8192.
"e2e": AdamW bf16 on bench_train_step's full-preset linear shapes (E2E_SHAPES) at M = 1024, 2048, 4096.
"cast": the same shapes and 4096x4096, fused step without / with the new W's bf16 copy (cast_out) vs the separate
cast kernel it replaces (cast_sweep).
"rings" (NOTES_kernel.md v9), "vec" (v10: the vector-load epilogue vs the default) and "smem" (v11: dW through smem,
deep vector lookahead, vs the default) time Gluon configs in one process, one line per case, bench_rings.txt /
bench_vec.txt / bench_smem.txt. "overlap" (overlap_sweep): AdamW 4096x4096 M=64..8192 and 14336x4096 M=2048, the
default kernel vs its GEMM schedule alone (GConfig.epi="gemm") vs its epilogue alone (M=64) vs cuBLAS / torch's
fused AdamW, bench_overlap.txt. "v12"/"v12b": v12 split configs; "splitovl" (split_overlap_sweep): where the split
kernel's time goes; "hoist" (hoist_sweep): split with per-tile chunk bases (GConfig.hoist) vs split; "math"
(math_sweep): AdamW vs a rule with AdamW's arrays and three multiply-adds (does the exact math limit the stream?);
"tf32" (tf32_sweep): AdamW 4096x4096 with fp32 activations, TF32 off (torch's default) and on; "coop" (coop_sweep):
the coop split kernel (128x256 tiles, two MMA warpgroups) vs split at M >= 2048; "l2pf" (l2pf_sweep):
the split kernel with its next tile's W/states prefetched into L2 (GConfig.l2pf) vs without; "splittune"
(splittune_sweep): the split kernel's hoist / tile-order group / load eviction hint; "concurrent"
(concurrent_sweep): the fused kernel on a side stream beside a dX GEMM vs the two in sequence
(set_float32_matmul_precision("high")): the fused dot follows torch's setting as cuBLAS does. "group" (group_sweep): G
weights in G launches vs the same rows as one stacked weight in one launch (the most a grouped launch could gain).
"pdl" (pdl_sweep): a backward-like chain (dX GEMM, then the fused update, per layer) with the fused launches plain or
as programmatic dependent launches (GConfig.pdl), launched and CUDA-graphed.

Every case with bf16/fp16 activations also times the Gluon kernel (sm_90, wgrad_update_gluon; "gluon" column,
its ratios to unfused and to the Triton default config), checked first like the Triton configs.

Baselines (unfused): torch.mm(dy_t, x, out_dtype=torch.float32) for bf16 (cuBLAS, bf16 in, fp32 out), plain
fp32 torch.mm for fp32 activations (IEEE: TF32 off, as torch's default), then torch._fused_adamw_ /
torch._fused_sgd_; Lion has no fused torch kernel: its baseline is mm + the rule's eager ops ("eager"), and
"mm+ideal" adds to the measured mm the time of one fused optimizer pass at copy bandwidth (20 B/element).
Fused: "kernel" = the kernel launch alone (host part done once), "launch" = the full launch_wgrad_update with
the host part memoized (the step is reset to the same value before each call, as for the 2nd..100th linear
of a model in one step), "miss" = the full launch with the step advancing every call (host graph runs).
Floor = max(bytes / 4.27e12, 2 N K M / 686e12 (bf16) or / 67e12 (fp32 activations)), bytes = (8 + 8 * tensor states) N K + act_bytes M (N + K).
Correctness before timing, at every case and config timed: the dW the kernel stores (grad_out) vs fp64
(rel err), W/states bit-exact vs the eager rule applied to that dW, W vs the unfused baseline relative to the
update.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from forge_compile.kernels import wgrad_update_autotune as at  # noqa: E402
from forge_compile.kernels import wgrad_update_gluon as wg  # noqa: E402
from forge_compile.kernels import wgrad_update_group as grp  # noqa: E402
from forge_compile.kernels import wgrad_update_triton as wt  # noqa: E402
from forge_compile.optim import rules as R  # noqa: E402
from gpu_power import REASONS_HELP, PowerSampler  # noqa: E402  (benchmarks/: the script's own folder)

BW, FLOPS = 4.27e12, 686e12
FLOPS_FP32 = 67e12   # fp32 FMA (IEEE, no tensor cores): the H200 datasheet figure, not measured here
HP = {"adamw": (1e-3, 0.9, 0.999, 1e-8, 0.01), "sgdm": (1e-3, 0.9, 0.0), "lion": (1e-4, 0.9, 0.99, 0.01),
      "adamw_lite": (1e-3, 0.9, 0.999, 1e-8, 0.01)}
SHAPES3 = [(4096, 4096), (14336, 4096), (4096, 14336)]
MS = [256, 1024, 2048, 4096, 8192]


def _adamw_lite(p, g, m, v, step, lr, beta1, beta2, eps, wd):
    # AdamW's arrays, states and scalars but not its math: three multiply-adds per element instead of AdamW's
    # correctly rounded division and square root (the "math or streaming" diagnostic, --cases math)
    step = step + 1
    m = m * beta1 + g
    v = v * beta2 + g
    p = p * (1 - lr * wd) - lr * m
    return p, m, v, step


def rule_of(kind):
    if kind == "adamw_lite":
        from forge_compile.optim.rule import Rule, register_rule

        return register_rule(Rule("bench_adamw_lite", _adamw_lite, states=("exp_avg", "exp_avg_sq", "step"),
                                  scalar_states=("step",), hparams=("lr", "beta1", "beta2", "eps", "wd")))
    return {"adamw": R.adamw_rule, "sgdm": lambda: R.sgd_rule(momentum=True), "lion": R.lion_rule}[kind]()


def make_inputs(kind, act, n, k, m, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g)
    rule = rule_of(kind)
    st = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            st.append(torch.tensor(10.0))
        elif name == "exp_avg_sq":
            st.append(torch.rand(n, k, device="cuda", generator=g) * 1e-4)
        else:
            st.append(torch.randn(n, k, device="cuda", generator=g) * 1e-3)
    dy = torch.randn(m, n, device="cuda", generator=g, dtype=act)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=act)
    hp = [torch.tensor(v, dtype=torch.float64) for v in HP[kind]]
    return rule, w, dy.t(), x, st, hp


def floor_ms(rule, n, k, m, upcast=False):
    """The roofline floor of a fused step: W and the tensor states read and written once, dY/X read once, at BW --
    or the GEMM at FLOPS (FLOPS_FP32 with fp32 activations), whichever is longer."""
    n_tensor_states = sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i))
    nbytes = (8 + 8 * n_tensor_states) * n * k + (4 if upcast else 2) * m * (n + k)
    return max(nbytes / BW, 2 * n * k * m / (FLOPS_FP32 if upcast else FLOPS)) * 1e3


def wgrad_mm(dy_t, x):
    if dy_t.dtype == torch.float32:
        return torch.mm(dy_t, x)
    return torch.mm(dy_t, x, out_dtype=torch.float32)


def make_unfused(kind, rule, w, dy_t, x, st, hp):
    """(fn, one_step) on private copies of W/states; one_step(w0, st0) runs one step from that state."""
    wb = w.clone()
    sb = [s.clone() for s in st]
    h = [float(v) for v in HP[kind]]
    if kind == "adamw":
        stepb = torch.tensor(10.0, device="cuda")

        def fn():
            gr = wgrad_mm(dy_t, x)
            torch._fused_adamw_([wb], [gr], [sb[1]], [sb[2]], [], [stepb], lr=h[0], beta1=h[1], beta2=h[2],
                                weight_decay=h[4], eps=h[3], amsgrad=False, maximize=False)

        def reset(w0, st0):
            wb.copy_(w0); sb[1].copy_(st0[1]); sb[2].copy_(st0[2]); stepb.fill_(float(st0[0]) + 1)  # noqa: E702
    elif kind == "sgdm":
        def fn():
            gr = wgrad_mm(dy_t, x)
            torch._fused_sgd_([wb], [gr], [sb[0]], weight_decay=0.0, momentum=h[1], lr=h[0], dampening=h[2],
                              nesterov=False, maximize=False, is_first_step=False)

        def reset(w0, st0):
            wb.copy_(w0); sb[0].copy_(st0[0])  # noqa: E702
    else:
        def fn():
            gr = wgrad_mm(dy_t, x)
            with torch.no_grad():
                rule.apply(wb, gr, sb, hp)

        def reset(w0, st0):
            wb.copy_(w0)
            for a, b in zip(sb, st0):
                a.copy_(b)

    def one_step(w0, st0):
        reset(w0, st0)
        fn()
        return wb
    return fn, one_step


def check_config(rule, w, dy_t, x, st, hp, config, launch=None, tol=1e-5):
    """dW rel err vs fp64 (< ``tol``), W/states bit-exact vs eager on the stored dW; leaves the inputs untouched.
    ``launch`` (same arguments as launch_wgrad_update, no config) checks another kernel, e.g. the Gluon one."""
    w1, st1 = w.clone(), [s.clone() for s in st]
    grad = torch.full_like(w, float("nan"))
    if launch is None:
        wt.launch_wgrad_update(w1, dy_t, x, st1, hp, rule, side_out=grad, config=config)
    else:
        launch(w1, dy_t, x, st1, hp, rule, side_out=grad)
    ref = dy_t.double() @ x.double()
    rel = ((grad.double() - ref).norm() / ref.norm()).item()
    if rel >= tol:
        # a fixed 1e-5 is ~sqrt(M) * 2^-24 from what any fp32-accumulating GEMM reaches at M >= 16384 (stop 31: the
        # coop case failed it there with the update bit-exact): then judged against cuBLAS's error on these inputs
        rel_mm = ((wgrad_mm(dy_t, x).double() - ref).norm() / ref.norm()).item()
        print(f"dW rel err {rel:.2e} >= {tol:.0e} (M={x.shape[0]}); cuBLAS's: {rel_mm:.2e}")
        tol = max(tol, 2 * rel_mm)
    del ref
    we, ste = w.clone(), [s.clone() for s in st]
    with torch.no_grad():
        rule.apply(we, grad, ste, hp)
    exact = torch.equal(w1, we) and all(torch.equal(a, b) for a, b in zip(st1, ste))
    ok = rel < tol and not grad.isnan().any().item() and exact
    return ok, rel, exact, w1


def _log_table(log, rows, label, label_w, w):
    """A sweep's closing table: ``rows`` of (first cell, {column: ms or ratio}), the columns of the first row."""
    if not rows:
        return
    keys = list(rows[0][1])
    log("\n" + f"{label:>{label_w}} " + " ".join(f"{key:>{w}}" for key in keys))
    for first, t in rows:
        log(f"{first:>{label_w}} " + " ".join(f"{t[key]:>{w}.4f}" for key in keys))


def _split_pick(rule, m):
    """The Gluon config a bf16 launch of ``rule`` picks at M = ``m`` without a side output (what a training step
    runs): _prepare's pick for W and the rule's tensor states."""
    return wg.pick_for(m, 1 + sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i)), 2, 0)


def _check_gluon_configs(kind, n, k, m, rule, w, dy_t, x, st, hp, cfgs):
    """Every Gluon config of ``cfgs`` checked (check_config: dW vs fp64, W/states bit-exact vs eager on the stored
    dW); a failure is printed with which config and which part. True when all passed."""
    ok = True
    for name, c in cfgs.items():
        ok_c, rel, exact, _ = check_config(rule, w, dy_t, x, st, hp, None,
                                           launch=lambda *a, _c=c, **kw: wg.launch(*a, **kw, config=_c))
        if not ok_c:   # which config, and whether dW's error or the update failed
            print(f"check failed: {kind} {n}x{k} M={m} {name}: dW rel err {rel:.2e}, update bit-exact {exact}")
        ok &= ok_c
    return ok


def gluon_why(rule, w, dy_t, x, st):
    """None when the Gluon kernel can take this case (judged as under FORGE_WGRAD_KERNEL=gluon), else why not."""
    old = os.environ.get(wg.ENV)
    os.environ[wg.ENV] = "gluon"
    try:
        return wg.gluon_reason(w, dy_t, x, st, rule, side_out=w)   # grad_out: judged by shape/layout only
    finally:
        if old is None:
            del os.environ[wg.ENV]
        else:
            os.environ[wg.ENV] = old


def tuned_case(rule, w, dy_t, x, st, hp):
    """(choice, check ok, bound launch, tuning seconds) of FORGE_AUTOTUNE for this case, or None (one candidate
    or none). The choice is checked like every timed config before it is timed."""
    old = os.environ.get(at.ENV)
    os.environ[at.ENV] = "1"
    t0 = time.time()
    try:
        ch = at.choose(w, dy_t, x, st, hp, rule)
    finally:
        os.environ[at.ENV] = old or "0"
    secs = time.time() - t0
    if ch is None:
        return None
    if ch.family == "gluon":
        ok = check_config(rule, w, dy_t, x, st, hp, None,
                          launch=lambda *a, **k: wg.launch(*a, **k, config=ch.config))[0]
        fn = wg.bound_launch(w, dy_t, x, st, hp, rule, config=ch.config)
    else:
        ok = check_config(rule, w, dy_t, x, st, hp, ch.config)[0]
        fn = wt.bound_launch(w, dy_t, x, st, hp, rule, config=ch.config)
    return ch, ok, fn, secs


# ---- parallel precompilation (the Triton disk cache is shared; the timed process then only loads) ----


def _precompile(job):
    kind, act, config, n, k, m = job
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        rule, w, dy_t, x, st, hp = make_inputs(kind, getattr(torch, act), n, k, m)
        t0 = time.time()
        for store_grad in (False, True):
            gout = torch.empty_like(w) if store_grad else None
            if config == "gluon":
                kernel, grid, args, opts, _, _ = wg._prepare(w, dy_t, x, st, hp, rule, gout)
            else:
                kernel, grid, args, opts, _, _ = wt._prepare(w, dy_t, x, st, hp, rule, gout, config)
            kernel.warmup(*args, grid=grid, **opts)
        return f"precompiled {kind} {act} {config} {n}x{k} M={m} in {time.time() - t0:.1f}s"
    except Exception as e:  # reported, and the timed process will report it again
        return f"precompile FAILED {kind} {act} {config} {n}x{k} M={m}: {type(e).__name__}: {str(e)[:200]}"


def _small(n):
    # same Triton specialization (divisibility by 16, by every tile size) with less memory
    return n if n <= 1024 else 1024


# ---- cases ------------------------------------------------------------------------------------------


def final_cases():
    cases = [("adamw", "bfloat16", n, k, m) for n, k in SHAPES3 for m in MS]
    cases += [(kind, "bfloat16", 4096, 4096, m) for kind in ("sgdm", "lion") for m in MS]
    cases += [("adamw", "float32", 4096, 4096, m) for m in MS]
    cases += [("adamw", "bfloat16", 128256, 4096, m) for m in (256, 1024, 2048, 4096)]
    return cases


# bench_train_step's full preset (d_model 2048, d_ff 5632, vocab 32000): per layer four 2048x2048 attention
# weights, gate/up 5632x2048, down 2048x5632; the lm_head 32000x2048. Which of them keep the e2e step from 1.2x.
E2E_SHAPES = [(2048, 2048), (5632, 2048), (2048, 5632), (32000, 2048)]


def e2e_cases():
    return [("adamw", "bfloat16", n, k, m) for n, k in E2E_SHAPES for m in (1024, 2048, 4096)]


def gluon_cases():
    cases = [("adamw", "bfloat16", n, k, m) for n, k in SHAPES3[:2] for m in MS]
    cases += [(kind, "bfloat16", 4096, 4096, m) for kind in ("sgdm", "lion") for m in MS]
    cases += [("adamw", "bfloat16", 4096, 14336, m) for m in (256, 2048, 8192)]
    cases += [("adamw", "bfloat16", 128256, 4096, m) for m in (1024, 4096)]   # a Llama-3 lm_head
    return cases


# ---- ring sweep: GEMM stage size/depth vs epilogue slots (NOTES_kernel.md v9), one process ----------------

RING_CASES = [("adamw", 4096, 4096, (64, 256, 1024, 2048, 4096, 8192)), ("adamw", 14336, 4096, (256, 2048)),
              ("sgdm", 4096, 4096, (256, 1024, 4096)), ("lion", 4096, 4096, (256, 2048))]
RING_SMEM = (208 * 1024, 224 * 1024)   # pick_gconfig's ring budget, and closer to the 227 KB an SM has


def ring_configs(m, n_arrays):
    """{name: GConfig}: pick_gconfig's ("pick"), then (tokens per GEMM stage, GEMM stages) pairs with as many
    [64, 32] epilogue slots as fit (2..8) in each smem budget of RING_SMEM."""
    base = wg.pick_gconfig(m, n_arrays)
    out = {"pick": base}
    slot = n_arrays * base.epi_m * base.epi_n * 4
    for budget in RING_SMEM:
        for bmt, stages in ((64, 2), (64, 3), (64, 4), (32, 2), (32, 3), (32, 4), (32, 6)):
            es = min(8, (budget - stages * bmt * (base.bn + base.bk) * 2) // slot)
            cfg = dataclasses.replace(base, bmt=bmt, stages=stages, es=es)
            if es >= 2 and cfg not in out.values():
                out[f"b{bmt}s{stages}e{es}"] = cfg
        # two rings (a loader and ring per consumer, the epilogues overlap): v7 measured them with 2 slots each,
        # i.e. with no slot loading ahead (a consumer holds 2); here with as many as fit
        for bmt, stages in ((32, 2), (64, 2), (32, 4)):
            es = min(8, (budget - stages * bmt * (base.bn + base.bk) * 2) // (2 * slot))
            cfg = dataclasses.replace(base, bmt=bmt, stages=stages, es=es, nring=2)
            if es >= 3 and cfg not in out.values():
                out[f"r2b{bmt}s{stages}e{es}"] = cfg
    return out


def ring_sweep(args, log):
    """Every ring_configs layout per case, medians of do_bench, with the unfused step and (AdamW) its two parts
    alone in the same process. Exactness first: each layout's W/states bit-identical to pick's (same wgmma order
    over the tokens, so the same dW); pick itself bit-exact vs eager on its stored dW. False when a check failed."""
    from triton.testing import do_bench

    def run(cfg, rule, w, dy_t, x, st, hp):
        w1, st1 = w.clone(), [s.clone() for s in st]
        wg.launch(w1, dy_t, x, st1, hp, rule, config=cfg)
        return w1, st1

    all_ok = True
    cases = RING_CASES if not args.short else [(kind, n, k, [m for m in ms if m <= 1024])
                                                for kind, n, k, ms in RING_CASES if kind != "lion"]
    for kind, n, k, ms in cases:
        for m in ms:
            rule, w, dy_t, x, st, hp = make_inputs(kind, torch.bfloat16, n, k, m, seed=m)
            na = 1 + sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i))
            cfgs = ring_configs(m, na)
            ok0 = check_config(rule, w, dy_t, x, st, hp, None, launch=wg.launch)[0]
            ref_w, ref_st = run(cfgs["pick"], rule, w, dy_t, x, st, hp)
            ok = {}
            for name, cfg in cfgs.items():
                w1, st1 = run(cfg, rule, w, dy_t, x, st, hp)
                ok[name] = ok0 and torch.equal(w1, ref_w) and all(map(torch.equal, st1, ref_st))
                all_ok &= ok[name]
            fn, _ = make_unfused(kind, rule, w, dy_t, x, st, hp)
            cells = [f"unfused {do_bench(fn, warmup=10, rep=args.rep, return_mode='median'):.4f}"]
            if kind == "adamw":
                gr = wgrad_mm(dy_t, x)
                cells.append(f"mm {do_bench(lambda: wgrad_mm(dy_t, x), warmup=10, rep=args.rep, return_mode='median'):.4f}")
                wb, mb, vb, sb = w.clone(), st[1].clone(), st[2].clone(), torch.tensor(10.0, device="cuda")
                t = do_bench(lambda: torch._fused_adamw_([wb], [gr], [mb], [vb], [], [sb], lr=1e-3, beta1=0.9,
                                                         beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                                                         maximize=False), warmup=10, rep=args.rep,
                             return_mode="median")
                cells.append(f"adamw_alone {t:.4f}")
                del gr, wb, mb, vb
            for name, cfg in cfgs.items():   # timing updates w/st in place: after every check
                t = do_bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=cfg), warmup=10, rep=args.rep,
                             return_mode="median")
                cells.append(f"{name} {t:.4f}{'' if ok[name] else ' CHECK FAILED'}"
                             + (f" (b{cfg.bmt}s{cfg.stages}e{cfg.es})" if name == "pick" else ""))
            log(f"{kind} {n}x{k} M={m}: " + " | ".join(cells))
            del w, dy_t, x, st, ref_w, ref_st
            torch.cuda.empty_cache()
    return all_ok


# ---- v10: the vector-load epilogue (GConfig.epi="vec") vs the default TMA-ring epilogue, one process ----------

VEC_CASES = [("adamw", 4096, 4096, (64, 256, 1024, 2048, 8192)), ("adamw", 14336, 4096, (256, 2048)),
             ("sgdm", 4096, 4096, (256, 2048)), ("lion", 4096, 4096, (256, 2048))]


def vec_configs():
    """{name: GConfig}: the vec epilogue with VEC_STAGES (6) GEMM stages, and 4 / 3 stages (at M <= 512 the
    default runs 3 stages, above 4: the same GEMM ring depths as the default, with no epilogue ring)."""
    return {f"vec_s{s}": wg.vec_config(stages=s) for s in (wg.VEC_STAGES, 4, 3)}


def vec_sweep(args, log, cfgs=None, cases=None):
    """Per case (``cases``, default VEC_CASES): the default (pick_gconfig) checked bit-exact vs eager on its stored
    dW; each vec config (or each of ``cfgs``: a dict, or a function of (M, arrays) giving one) checked the same way,
    and (timed without dW) its W/states bit-identical to the default's (same wgmma order over the tokens, so the
    same dW); then every config timed (do_bench median, kernel alone), the unfused step too. One line per case as
    it finishes. False when a check failed."""
    from triton.testing import do_bench

    def run(cfg, rule, w, dy_t, x, st, hp):
        w1, st1 = w.clone(), [s.clone() for s in st]
        wg.launch(w1, dy_t, x, st1, hp, rule, config=cfg)
        return w1, st1

    all_ok = True
    cfgs_of = cfgs if callable(cfgs) else (lambda m, na, _c=cfgs or vec_configs(): _c)
    for kind, n, k, ms in cases or VEC_CASES:
        for m in ms:
            t0 = time.time()
            rule, w, dy_t, x, st, hp = make_inputs(kind, torch.bfloat16, n, k, m, seed=m)
            na = 1 + sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i))
            pick = wg.pick_gconfig(m, na)
            cfgs = cfgs_of(m, na)
            ok0 = check_config(rule, w, dy_t, x, st, hp, None, launch=wg.launch)[0]
            ref_w, ref_st = run(None, rule, w, dy_t, x, st, hp)
            ok = {"default": ok0}
            for name, cfg in cfgs.items():
                okc = check_config(rule, w, dy_t, x, st, hp, None,
                                   launch=lambda *a, _c=cfg, **kw: wg.launch(*a, **kw, config=_c))[0]
                w1, st1 = run(cfg, rule, w, dy_t, x, st, hp)
                ok[name] = okc and torch.equal(w1, ref_w) and all(map(torch.equal, st1, ref_st))
                all_ok &= ok[name]
            all_ok &= ok0
            fn, _ = make_unfused(kind, rule, w, dy_t, x, st, hp)
            cells = [f"unfused {do_bench(fn, warmup=10, rep=args.rep, return_mode='median'):.4f}"]
            times = {}
            for name, cfg in (("default", None), *cfgs.items()):   # timing updates w/st in place: after the checks
                times[name] = do_bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=cfg), warmup=10,
                                       rep=args.rep, return_mode="median")
                cells.append(f"{name} {times[name]:.4f}{'' if ok[name] else ' CHECK FAILED'}"
                             + (f" ({pick.epi} b{pick.bmt}s{pick.stages}e{pick.es})" if name == "default" else ""))
            best = min(cfgs, key=times.get)
            cells.append(f"default/{best} {times['default'] / times[best]:.3f}  [{time.time() - t0:.0f} s]")
            log(f"{kind} {n}x{k} M={m}: " + " | ".join(cells))
            del w, dy_t, x, st, ref_w, ref_st
            torch.cuda.empty_cache()
    return all_ok


# ---- v11: dW through smem, deep vector lookahead (GConfig.epi="smem") vs the default, one process --------------

def smem_configs():
    """{name: GConfig}: r{rows per chunk}a{chunks ahead}s{GEMM stages}. [16, 128] x 2 ahead with 3 stages (the
    default smem_config, 96 registers of AdamW lookahead), half the lookahead two ways ([8, 128] x 2, [16, 128] x 1),
    and 2 GEMM stages (the GEMM ring the dW tiles leave room for is shallower than the default's 3-4)."""
    return {f"smem_r{r}a{a}s{s}": wg.smem_config(rows=r, ahead=a, stages=s)
            for r, a, s in ((16, 2, 3), (8, 2, 3), (16, 1, 3), (16, 2, 2))}


def smem_sweep(args, log):
    """vec_sweep's cases and checks with the smem configs (v11). False when a check failed."""
    return vec_sweep(args, log, smem_configs())


# ---- v12: L2 eviction hints on the smem epilogue's W/state stream; tile-group size of the GEMM ------------------

V12_CASES = [("adamw", 4096, 4096, (256, 1024, 2048, 4096, 8192)), ("adamw", 14336, 4096, (2048,)),
             ("sgdm", 4096, 4096, (256, 2048)), ("lion", 4096, 4096, (2048,))]


def v12_configs(m, n_arrays):
    """{name: GConfig} at M: v12's split kernel (one MMA warpgroup, two epilogue warpgroups; NOTES_kernel.md v12)
    with [8, 128] x 4 and [16, 128] x 2 chunks of lookahead, 5 x 64-token or 10 x 32-token GEMM stages, fewer
    epilogue registers (136, 3 chunks ahead), L2 evict_first hints; and the smem kernel with and without hints
    (Nsight Compute: the hints cut the DRAM reads of the smem kernel at M=2048 from 308 to 282 MB, time unchanged)."""
    return {"smem_b64s3": wg.smem_config(), "smem_first": wg.smem_config(evict="first"),
            "split_r8a4": wg.split_config(), "split_r16a2": wg.split_config(rows=16, ahead=2),
            "split_r8a4_b32s10": wg.split_config(stages=10, bmt=32),
            "split_r8a3_e136": wg.split_config(ahead=3, eregs=136),
            "split_r8a4_first": wg.split_config(evict="first")}


def v12_sweep(args, log):
    """vec_sweep's checks over V12_CASES with v12_configs. False when a check failed."""
    return vec_sweep(args, log, v12_configs, V12_CASES)


# the second v12 sweep: the split kernel's lookahead and tile order, at the points the first one did not time
V12B_CASES = [("sgdm", 4096, 4096, (256, 1024, 4096, 8192)), ("lion", 4096, 4096, (256, 1024, 8192)),
              ("adamw", 4096, 4096, (512, 1024, 2048)), ("adamw", 14336, 4096, (256, 1024, 8192)),
              ("adamw", 4096, 14336, (1024, 2048, 8192)), ("adamw", 128256, 4096, (1024, 4096))]


def v12b_configs(m, n_arrays):
    """{name: GConfig}: split_config() and its lookahead halved / raised (2 / 6 chunks of [8, 128]; smem_ahead caps
    AdamW at 4), its tile groups of 4 and 16 rows of tiles (default 8)."""
    return {"split_r8a4": wg.split_config(), "split_r8a2": wg.split_config(ahead=2),
            "split_r8a6": dataclasses.replace(wg.split_config(), ahead=6),
            "split_g4": dataclasses.replace(wg.split_config(), group=4),
            "split_g16": dataclasses.replace(wg.split_config(), group=16)}


def v12b_sweep(args, log):
    """vec_sweep's checks over V12B_CASES with v12b_configs. False when a check failed."""
    return vec_sweep(args, log, v12b_configs, V12B_CASES)


# ---- v12 follow-up: where the split kernel's time goes (hand-offs vs contention) ----------------------------------

SPLIT_OVERLAP_MS = (64, 256, 1024, 2048, 4096, 8192)


def split_overlap_sweep(args, log):
    """AdamW bf16 4096x4096 at SPLIT_OVERLAP_MS, one process: unfused, cuBLAS mm, split_config() (checked bit-exact
    vs eager on its stored dW), the same kernel with stream=False (the MMA warpgroup's GEMMs and dW hand-offs, no
    W/state traffic; checked to leave W/states untouched) and the tma kernel's GEMM schedule alone with the split
    kernel's 5 stages (gemm_config(5): ping-pong consumers, no hand-off), and split with two dW tiles and 3 stages
    (split_d2s3, checked bit-exact: its MMA warpgroup never waits for the tile before). Printed per M: handoff = stream_off -
    gemm5 (what the one-dW-tile hand-off costs the MMA warpgroup), contention = split - max(stream_off, split at
    M=64) (what running both costs beyond the longer part). False when a check failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    all_ok, rows, epi64 = True, [], None
    split, off, g5 = wg.split_config(), wg.split_config(stream=False), wg.gemm_config(5)
    split2 = wg.split_config(dw_tiles=2, stages=3)
    for m in SPLIT_OVERLAP_MS:
        rule, w, dy_t, x, st, hp = make_inputs("adamw", torch.bfloat16, 4096, 4096, m, seed=m)
        ok = all(check_config(rule, w, dy_t, x, st, hp, None,
                              launch=lambda *a, _c=c, **kw: wg.launch(*a, **kw, config=_c))[0]
                 for c in (split, split2))
        w1, st1 = w.clone(), [s.clone() for s in st]
        wg.bound_launch(w1, dy_t, x, st1, hp, rule, config=off)()
        ok &= torch.equal(w1, w) and all(torch.equal(a, b) for a, b in zip(st1, st) if a.dim())
        ok_g, _ = check_gemm_sums(w, dy_t, x, st, hp, rule, g5)
        all_ok &= ok and ok_g
        fn, _ = make_unfused("adamw", rule, w, dy_t, x, st, hp)
        t = {"unfused": bench(fn), "mm": bench(lambda: wgrad_mm(dy_t, x)),
             "split": bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=split)),
             "stream_off": bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=off))}
        sums = torch.empty(wg.gemm_sums_shape(4096, 4096, g5), device="cuda")
        t["gemm5"] = bench(wg.bound_launch(w, dy_t, x, st, hp, rule, sums, config=g5))
        t["split_d2s3"] = bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=split2))
        epi64 = t["split"] if m == SPLIT_OVERLAP_MS[0] else epi64
        t["handoff"] = t["stream_off"] - t["gemm5"]
        t["contention"] = t["split"] - max(t["stream_off"], epi64)
        rows.append((m, t))
        log(f"adamw 4096x4096 M={m}: " + " | ".join(f"{k} {v:.4f}" for k, v in t.items())
            + ("" if ok and ok_g else " | CHECK FAILED"))
        del w, dy_t, x, st
        torch.cuda.empty_cache()
    _log_table(log, rows, "M", 6, 10)
    return all_ok


# ---- the coop split kernel (GConfig.mma_warps=8: 128x256 tiles, two MMA warpgroups) vs split, at large M -------------

COOP_CASES = [("adamw", 4096, 4096, (2048, 4096, 8192, 16384)), ("adamw", 4096, 14336, (4096, 8192)),
              ("adamw", 14336, 4096, (4096, 8192)), ("sgdm", 4096, 4096, (4096, 8192))]


def coop_sweep(args, log):
    """bf16, one process, per case: unfused, cuBLAS mm, the pick (split), split with stream=False (its GEMM and
    hand-offs alone), the coop kernel (coop_config: [128, 256] tiles, two MMA warpgroups, one epilogue warpgroup)
    as built and with hoist, and coop with stream=False -- every fused config checked bit-exact vs eager on its
    stored dW first, the stream=False ones checked to leave W/states untouched. The question (stop 30): does the
    [128, 256] tile bring the GEMM schedule to cuBLAS speed at M >= 8192 (coop_off vs mm), and is the one epilogue
    warpgroup hidden there (coop vs coop_off)? Printed: x = unfused / time, vs_mm = time / mm. False when a check
    failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    offs = {"split_off": wg.split_config(stream=False), "coop_off": wg.coop_config(stream=False)}
    all_ok, rows = True, []
    for kind, n, k, ms in COOP_CASES:
        for m in ms:
            cfgs = {"split": _split_pick(rule_of(kind), m), "coop": wg.coop_config(),
                    "coop_h": wg.coop_config(hoist=True), "coop_b64": wg.coop_config(bmt=64, stages=2)}
            ok, t, _ = _time_gluon_configs(kind, n, k, m, cfgs, bench, untouched=offs, mm=True)
            all_ok &= ok
            if not ok:
                log(f"CHECK FAILED: {kind} {n}x{k} M={m}")
                continue
            for c in ("split", "coop", "coop_h", "coop_b64"):
                t[f"x_{c}"] = t["unfused"] / t[c]
            for c in ("split_off", "coop_off", "coop"):
                t[f"{c}/mm"] = t[c] / t["mm"]
            rows.append((f"{kind} {n}x{k} {m}", t))
            log(f"{kind} {n}x{k} M={m}: " + " | ".join(f"{key} {v:.4f}" for key, v in t.items()))
    _log_table(log, rows, "case", 22, 12)
    return all_ok


# ---- sustained clocks and power: is the fused kernel's gap to cuBLAS at M >= 4096 a power limit? ------------------

CLOCK_CASES = [("adamw", 4096, 4096, (256, 1024, 2048, 4096, 8192)), ("sgdm", 4096, 4096, (8192,))]


def parse_clock_cases(spec):
    """--clock-cases "adamw:14336x4096:2048,8192;lion:4096x4096:2048" -> CLOCK_CASES' form."""
    cases = []
    for part in spec.split(";"):
        kind, shape, ms = part.split(":")
        n, k = (int(d) for d in shape.split("x"))
        cases.append((kind, n, k, tuple(int(m) for m in ms.split(","))))
    return cases


def _sustained(fn, seconds):
    """fn run back to back for ~seconds beside gpu_power's sampler: (ms per call, its summary of the samples taken
    while fn ran, the first 0.3 s left out)."""
    with PowerSampler(skip_s=0.3) as ps:
        fn(); torch.cuda.synchronize()   # noqa: E702
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ps.mark_start()
        start.record()
        calls = 0
        while time.time() - ps.t_start < seconds:
            for _ in range(20):
                fn()
            calls += 20
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / calls, ps.summary()


def clocks_sweep(args, log):
    """bf16, AdamW / SGD-momentum 4096x4096: cuBLAS's mm alone, the unfused step, the pick (split) and split with
    stream=False (its GEMM schedule alone), each run back to back for 2 s while nvidia-smi samples the SM clock,
    memory clock, power and throttle reasons (benchmarks/gpu_power.py); mJ = ms x W. The question (stop 31): the split kernel's GEMM schedule is at
    cuBLAS speed (split_off/mm 0.98-1.04 at M=4096-8192, H100) but the full kernel is 14-24 % slower than mm there
    -- does the W/state stream next to the GEMM pull the SM clock down (power), or is the time lost at equal
    clocks (contention)? Checked like --cases coop (bit-exact vs eager on the stored dW) before it runs."""
    all_ok, rows = True, []
    _, idle = _sustained(lambda: None, 1.0)
    if idle is None:
        log("no nvidia-smi samples: --cases clocks needs nvidia-smi")
        return False
    log(f"idle: sm {idle['sm_MHz']:.0f} MHz, power {idle['W']:.0f} W")
    for kind, n, k, ms in (parse_clock_cases(args.clock_cases) if args.clock_cases else CLOCK_CASES):
        for m in ms:
            rule, w, dy_t, x, st, hp = make_inputs(kind, torch.bfloat16, n, k, m, seed=m)
            # split_a2 / split_a1: fewer W/state chunks in flight per epilogue warpgroup (4 in the pick) -- the
            # stream's burst rate lowered; faster at M >= 4096 would say that pacing the stream is a lever
            cfgs = {"split": _split_pick(rule, m), "split_a2": wg.split_config(ahead=2),
                    "split_a1": wg.split_config(ahead=1)}
            ok = _check_gluon_configs(kind, n, k, m, rule, w, dy_t, x, st, hp, cfgs)
            all_ok &= ok
            if not ok:
                log(f"CHECK FAILED: {kind} {n}x{k} M={m}")
                continue
            fns = {"mm": lambda: wgrad_mm(dy_t, x), "unfused": make_unfused(kind, rule, w, dy_t, x, st, hp)[0],
                   **{name: wg.bound_launch(w, dy_t, x, st, hp, rule, config=c) for name, c in cfgs.items()},
                   "split_off": wg.bound_launch(w.clone(), dy_t, x, [s.clone() for s in st], hp, rule,
                                                config=wg.split_config(stream=False))}
            for name, fn in fns.items():
                t, smp = _sustained(fn, 2.0)
                smp = smp or {}   # nvidia-smi gone mid-run: the time alone
                row = {"case": f"{kind} {n}x{k} {m}", "fn": name, "ms": t, **smp,
                       "mJ": t * smp.get("W", float("nan"))}
                rows.append(row)
                log(" | ".join(f"{key} {val:.4g}" if isinstance(val, float) else f"{key} {val}"
                               for key, val in row.items()))
            del w, dy_t, x, st, fns
            torch.cuda.empty_cache()
    keys = ["case", "fn", "ms", "sm_MHz", "min_sm_MHz", "mem_MHz", "W", "mJ", "C", "reasons", "capped", "samples"]
    log("\n" + " ".join(f"{key:>18}" for key in keys))
    for r in rows:
        vals = [r.get(key, float("nan")) for key in keys]
        log(" ".join(f"{v:>18.4g}" if isinstance(v, float) else f"{v:>18}" for v in vals))
    log("reasons: " + REASONS_HELP + "; capped: the fraction of samples with the sw power cap")
    return all_ok


# ---- split with per-tile chunk bases (GConfig.hoist) vs split, side by side ------------------------------------------

HOIST_CASES = [("adamw", (64, 256, 1024, 2048, 4096, 8192)), ("sgdm", (256, 2048, 8192)), ("lion", (256, 2048))]


def _time_gluon_configs(kind, n, k, m, cfgs, bench, untouched=None, mm=False):
    """bf16 inputs for one case, every Gluon config of ``cfgs`` checked bit-exact vs eager on its stored dW, then
    timed beside the unfused step: (all checks passed, {"unfused": ms, name: ms ...}, the rule). ``untouched``:
    stream=False diagnostics, checked to leave W/states as they were, timed too; ``mm``: also cuBLAS's wgrad
    alone ("mm")."""
    rule, w, dy_t, x, st, hp = make_inputs(kind, torch.bfloat16, n, k, m, seed=m)
    ok = _check_gluon_configs(kind, n, k, m, rule, w, dy_t, x, st, hp, cfgs)
    untouched = untouched or {}
    for c in untouched.values():
        w1, st1 = w.clone(), [s.clone() for s in st]
        wg.bound_launch(w1, dy_t, x, st1, hp, rule, config=c)()
        ok &= torch.equal(w1, w) and all(torch.equal(a, b) for a, b in zip(st1, st) if a.dim())
    fn, _ = make_unfused(kind, rule, w, dy_t, x, st, hp)
    t = {"unfused": bench(fn)}
    if mm:
        t["mm"] = bench(lambda: wgrad_mm(dy_t, x))
    t.update((name, bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=c)))
             for name, c in {**cfgs, **untouched}.items())
    del w, dy_t, x, st
    torch.cuda.empty_cache()
    return ok, t, rule


def hoist_sweep(args, log):
    """bf16 4096x4096, one process: unfused, split_config() / smem_config() and the same with hoist=True (all checked
    bit-exact vs eager on their stored dW), the hoisted kernels' gains. auto picks split above M=512 (3 arrays) /
    1024 (2), smem for 3 arrays at M <= 512; the small-M rows say whether the epilogue warps' streaming is
    instruction-bound (there both kernels run at the epilogue's rate). False when a check failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    all_ok, rows = True, []
    cfgs = {"split": wg.split_config(), "split_h": wg.split_config(hoist=True),
            "smem": wg.smem_config(), "smem_h": wg.smem_config(hoist=True)}
    for kind, ms in HOIST_CASES:
        for m in ms:
            ok, t, _ = _time_gluon_configs(kind, 4096, 4096, m, cfgs, bench)
            all_ok &= ok
            t["split/h"] = t["split"] / t["split_h"]
            t["smem/h"] = t["smem"] / t["smem_h"]
            rows.append((kind, m, t))
            log(f"{kind} 4096x4096 M={m}: " + " | ".join(f"{k} {v:.4f}" for k, v in t.items())
                + ("" if ok else " | CHECK FAILED"))
    keys = list(rows[0][2])
    log("\n" + f"{'rule':>6} {'M':>6} " + " ".join(f"{k:>9}" for k in keys))
    for kind, m, t in rows:
        log(f"{kind:>6} {m:>6} " + " ".join(f"{t[k]:>9.4f}" for k in keys))
    return all_ok


# (rule, N, K, Ms): where the split kernel is picked (AdamW above M=512, 2-array rules above 1024)
L2PF_CASES = ([("adamw", 4096, 4096, (1024, 2048, 4096, 8192))]
              + [("adamw", n, k, (1024, 2048, 4096)) for n, k in E2E_SHAPES] + [("sgdm", 4096, 4096, (2048, 4096))])


def l2pf_sweep(args, log):
    """bf16, one process (L2PF_CASES): unfused, the split kernel as picked, with GConfig.l2pf = 16 / 32 / 64 rows of
    each half tile prefetched into L2 one tile ahead, and with hoist=True (all checked bit-exact vs eager on their
    stored dW). split/best > 1: a variant gains. False when a check failed."""
    cfgs = {"split": wg.split_config(), **{f"pf{r}": wg.split_config(l2pf=r) for r in (16, 32, 64)},
            "split_h": wg.split_config(hoist=True), "pf32_h": wg.split_config(l2pf=32, hoist=True)}
    return _split_variant_sweep(args, log, L2PF_CASES, cfgs)


def splittune_sweep(args, log):
    """As l2pf_sweep, for the split kernel's knobs besides the prefetch (stop 24): per-tile chunk bases (hoist), the
    tile order's group (GROUP rows of tiles share their dY panels; 4 / 8 / 16) and evict_first on the W/state loads
    only ("ld"; "first"/"cs" were 3-6 % slower in v12), and the L2 prefetch of the first tile only (h_pf64f: the
    fill of grids with ~2 tiles per SM; the prefetch of every next tile lost, l2pf_sweep)."""
    h = wg.split_config(hoist=True)
    cfgs = {"split": wg.split_config(), "split_h": h, "h_g4": dataclasses.replace(h, group=4),
            "h_g16": dataclasses.replace(h, group=16), "h_ld": wg.split_config(hoist=True, evict="ld"),
            "g16": dataclasses.replace(wg.split_config(), group=16),
            "h_pf64f": wg.split_config(hoist=True, l2pf=64, l2pf_first=True)}
    return _split_variant_sweep(args, log, L2PF_CASES, cfgs)


def _split_variant_sweep(args, log, cases, cfgs):
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    all_ok, rows = True, []
    for kind, n, k, ms in cases:
        for m in ms:
            ok, t, rule = _time_gluon_configs(kind, n, k, m, cfgs, bench)
            all_ok &= ok
            t["floor"] = floor_ms(rule, n, k, m)
            best = min(cfgs, key=t.get)
            t["unf/best"] = t["unfused"] / t[best]
            t["split/best"] = t["split"] / t[best]
            rows.append((kind, n, k, m, t, best))
            log(f"{kind} {n}x{k} M={m}: " + " | ".join(f"{a} {v:.4f}" for a, v in t.items())
                + f" | best {best}" + ("" if ok else " | CHECK FAILED"))
    keys = list(rows[0][4])
    log("\n" + f"{'rule':>6} {'shape':>11} {'M':>5} " + " ".join(f"{a:>10}" for a in keys) + "  best")
    for kind, n, k, m, t, best in rows:
        log(f"{kind:>6} {f'{n}x{k}':>11} {m:>5} " + " ".join(f"{t[a]:>10.4f}" for a in keys) + f"  {best}")
    return all_ok


# (N, K, M): the e2e model's shapes at its 2048 tokens, and 4096x4096
CONCURRENT_CASES = [(2048, 2048, 2048), (5632, 2048, 2048), (2048, 5632, 2048), (4096, 4096, 2048)]


def concurrent_sweep(args, log):
    """Could the fused updates hide behind the backward's dX GEMMs (prepared in stop 24, NOT measured)? In a step
    the fused wgrad+update of layer L only has to finish before the step ends, while the dX GEMM of the layer below
    (compute-bound; the fused kernel leaves the tensor cores idle while it streams and DRAM 35-57 % idle while it
    multiplies) runs on the same GPU right after it. Per case, AdamW bf16: the fused kernel (the default pick) alone,
    a dX GEMM alone (dY [M, N] @ W' [N, K] in bf16, W' another layer's weight copy), both in sequence (what a step
    runs today), and both concurrently -- the fused kernel on a side stream with its persistent grid capped at C
    CTAs (132: all SMs, 96, 66), the GEMM on the current stream, joined. Checked first: W and the states after one
    concurrent call are bitwise those after one sequential call from the same start. gain = seq / conc: > 1.1 at
    some C says a side-stream schedule of the fused ops (events + record_stream, inside the CUDA graph) is worth
    building; ~1.0 says the two contend for the same resources. False when a check failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    side = torch.cuda.Stream()
    all_ok, rows = True, []
    for n, k, m in CONCURRENT_CASES:
        rule, w, dy_t, x, st, hp = make_inputs("adamw", torch.bfloat16, n, k, m, seed=m)
        w_other = torch.randn(n, k, device="cuda").bfloat16()
        dy = dy_t.t()
        dx = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = wg.pick_gconfig(m, 3, 2)

        def fused_fn(ctas, w=w, st=st):
            kernel, grid, kargs, opts = wg._prepare(w, dy_t, x, st, hp, rule, None, config=cfg, max_ctas=ctas)[:4]
            return lambda: kernel[grid](*kargs, **opts)

        def dgrad():
            torch.mm(dy, w_other, out=dx)

        def conc_fn(fused):
            def run():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fused()
                dgrad()
                torch.cuda.current_stream().wait_stream(side)
            return run

        # exactness: one concurrent call (66 CTAs) vs one sequential call, from the same W/states
        w0, st0 = w.clone(), [s.clone() for s in st]
        fused_fn(132)()
        dgrad()
        torch.cuda.synchronize()
        w_seq, st_seq = w.clone(), [s.clone() for s in st]
        w.copy_(w0)
        for s, s0 in zip(st, st0):
            s.copy_(s0)
        conc_fn(fused_fn(66))()
        torch.cuda.synchronize()
        ok = torch.equal(w, w_seq) and all(torch.equal(a, b) for a, b in zip(st, st_seq))
        all_ok &= ok
        full = fused_fn(132)
        t = {"fused": bench(full), "dgrad": bench(dgrad)}
        t["seq"] = bench(lambda: (full(), dgrad()))
        for c in (132, 96, 66):
            t[f"conc{c}"] = bench(conc_fn(fused_fn(c)))
        best = min((f"conc{c}" for c in (132, 96, 66)), key=t.get)
        t["seq/best"] = t["seq"] / t[best]
        t["ideal"] = max(t["fused"], t["dgrad"])
        rows.append((n, k, m, t, best))
        log(f"adamw {n}x{k} M={m} ({cfg.epi}): " + " | ".join(f"{a} {v:.4f}" for a, v in t.items())
            + f" | best {best}" + ("" if ok else " | CHECK FAILED"))
        del w, dy_t, x, st, w_other, dx
        torch.cuda.empty_cache()
    keys = list(rows[0][3])
    log("\n" + f"{'shape':>11} {'M':>5} " + " ".join(f"{a:>9}" for a in keys) + "  best")
    for n, k, m, t, best in rows:
        log(f"{f'{n}x{k}':>11} {m:>5} " + " ".join(f"{t[a]:>9.4f}" for a in keys) + f"  {best}")
    return all_ok


# (G, N, K): weights of one decoder layer that read the same X in the backward, as the e2e model has them -- q/k/v
# (3 x 2048x2048), gate/up (2 x 5632x2048) -- and 4 x 2048x2048 (q/k/v/o: a grouped launch need not share X)
GROUP_CASES = [(3, 2048, 2048), (2, 5632, 2048), (4, 2048, 2048)]
GROUP_MS = (1024, 2048, 4096)


def group_sweep(args, log):
    """Is one persistent launch over several weights worth building (stop 24's lever "several weights in one
    launch": 2048x2048 has ~2 tiles per SM, so the split kernel is mostly pipeline fill and drain)? Its upper
    bound, without writing the grouped kernel: G weights [N, K] updated by G launches in sequence (what a step runs
    today) vs the same rows as ONE [G*N, K] weight (dY [M, G*N]) in one launch -- the same tiles and bytes with G
    times the tiles per launch. Same config for both (pick_gconfig at M), so each tile's arithmetic is the same:
    checked bitwise first (W and states of the stacked launch vs the G separate ones). gain = sep / stacked: what
    a grouped launch could save at most (it also pays a per-tile choice of pointers); ~1.0 says don't build it.
    grouped = the real thing (kernels/wgrad_update_group.launch_group over the G separate allocations), checked
    bitwise against the G separate launches; gain_grp = sep / grouped. grp_x = the grouped launch with each member
    reading its own copy of X (o grouped with q/k/v: G X panels per k-step instead of one), gain_grpx = sep / grp_x.
    sep_tab / grp_tab: the same with the rule's scalars read from a device table (each member's row), the variant a
    CUDA-graphed step runs; gain_tab = sep_tab / grp_tab.
    Unfused = G x (cuBLAS mm + torch._fused_adamw_) for the ratios. False when a check failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    all_ok, rows = True, []
    for g, n, k in GROUP_CASES:
        for m in GROUP_MS:
            rule, w, dy_t, x, st, hp = make_inputs("adamw", torch.bfloat16, g * n, k, m, seed=m)
            cfg = wg.pick_gconfig(m, 3, 2)
            dy = dy_t.t()
            parts = []
            for i in range(g):
                rows_i = slice(i * n, (i + 1) * n)
                parts.append((w[rows_i].clone(), dy[:, rows_i].contiguous().t(),
                              [s.clone() if s.dim() == 0 else s[rows_i].clone() for s in st]))
            # the grouped launch's members: their own allocations, copies of the parts before any launch
            gparts = [(wi.clone(), dyi, [s.clone() for s in sti]) for wi, dyi, sti in parts]
            xparts = [(wi.clone(), dyi, [s.clone() for s in sti]) for wi, dyi, sti in parts]
            # the table variant: tensor states only, one table row per member (the same values: one param group)
            tparts = [(wi.clone(), dyi, [s.clone() for s in sti if s.dim()]) for wi, dyi, sti in parts]
            sparts = [(wi.clone(), dyi, [s.clone() for s in sti if s.dim()]) for wi, dyi, sti in parts]
            table = torch.zeros(2 * g, 16, device=w.device)
            rows_t = [table[2 * i] for i in range(g)]
            vals = wt.rule_scalars(rule, [s for s in st if not s.dim()], hp)[0]
            for r in rows_t:
                r[:len(vals)] = torch.tensor(vals, dtype=torch.float32)
            xs = [x] + [x.clone() for _ in range(g - 1)]
            sep = [wg.bound_launch(wi, dyi, x, sti, hp, rule, config=cfg) for wi, dyi, sti in parts]
            stacked = wg.bound_launch(w, dy_t, x, st, hp, rule, config=cfg)
            gargs = ([p[0] for p in gparts], [p[1] for p in gparts], x, [p[2] for p in gparts], [hp] * g, rule)
            grouped = grp.bound_launch_group(*gargs)
            grouped_x = grp.bound_launch_group([p[0] for p in xparts], [p[1] for p in xparts], xs,
                                               [p[2] for p in xparts], [hp] * g, rule)
            sep_tab = [wg.bound_launch(wi, dyi, x, sti, [], rule, config=cfg, table=r)
                       for (wi, dyi, sti), r in zip(sparts, rows_t)]
            grp_tab = grp.bound_launch_group([p[0] for p in tparts], [p[1] for p in tparts], x,
                                             [p[2] for p in tparts], [], rule, tables=rows_t)
            stacked()
            for f in sep:
                f()
            grouped()
            grouped_x()
            grp_tab()
            for f in sep_tab:
                f()
            torch.cuda.synchronize()
            ok = all(torch.equal(w[i * n:(i + 1) * n], wi) and all(
                torch.equal(s[i * n:(i + 1) * n], si) for s, si in zip(st, sti) if s.dim())
                for i, (wi, _, sti) in enumerate(parts))
            ok_g = all(torch.equal(wg_, wi) and all(torch.equal(a, b) for a, b in zip(
                [a for a in sg if a.dim()], [b for b in sti if b.dim()]))
                for (wg_, _, sg), (wi, _, sti) in zip(gparts + xparts + tparts + sparts, parts * 4))
            all_ok &= ok and ok_g
            unf = [make_unfused("adamw", rule, wi, dyi, x, sti, hp)[0] for wi, dyi, sti in parts]
            t = {"unfused": bench(lambda: [f() for f in unf]), "sep": bench(lambda: [f() for f in sep]),
                 "stacked": bench(stacked), "grouped": bench(grouped), "grp_x": bench(grouped_x),
                 "sep_tab": bench(lambda: [f() for f in sep_tab]), "grp_tab": bench(grp_tab)}
            t["floor"] = floor_ms(rule, g * n, k, m)
            t["unf/sep"] = t["unfused"] / t["sep"]
            t["unf/grp"] = t["unfused"] / t["grouped"]
            t["gain"] = t["sep"] / t["stacked"]
            t["gain_grp"] = t["sep"] / t["grouped"]
            t["gain_grpx"] = t["sep"] / t["grp_x"]
            t["gain_tab"] = t["sep_tab"] / t["grp_tab"]
            rows.append((g, n, k, m, t))
            log(f"adamw {g}x{n}x{k} M={m} ({cfg.epi if cfg else 'triton'}): "
                + " | ".join(f"{a} {v:.4f}" for a, v in t.items()) + ("" if ok else " | STACKED CHECK FAILED")
                + ("" if ok_g else " | GROUPED CHECK FAILED"))
            del w, dy_t, dy, x, xs, st, parts, gparts, xparts, tparts, sparts, sep, unf, grouped, grouped_x, sep_tab
            del grp_tab, table, rows_t
            torch.cuda.empty_cache()
    keys = list(rows[0][4])
    log("\n" + f"{'G x N x K':>14} {'M':>5} " + " ".join(f"{a:>9}" for a in keys))
    for g, n, k, m, t in rows:
        log(f"{f'{g}x{n}x{k}':>14} {m:>5} " + " ".join(f"{t[a]:>9.4f}" for a in keys))
    return all_ok


# (N, K) of one decoder layer's weights in backward order (the e2e model: down, up, gate, o, v, k, q) and Ms
PDL_LAYER = [(2048, 5632), (5632, 2048), (5632, 2048), (2048, 2048), (2048, 2048), (2048, 2048), (2048, 2048)]
PDL_MS = (1024, 2048, 4096)


def pdl_sweep(args, log):
    """Does launching the fused kernel as a programmatic dependent (GConfig.pdl) hide its launch gap and part of its
    pipeline fill behind the kernel before it? One layer's backward as a chain: per weight (PDL_LAYER) the dX GEMM
    dY @ W_bf16 (cuBLAS, as autograd runs it right before), then the fused AdamW launch (the split kernel, the pick
    at these M; hoist as picked). plain = the fused launches as now, pdl1 / pdl2 = the same configs with GConfig.pdl
    1 (every partition waits for the kernel before: launch and prologue hidden) / 2 (only the GEMM loader waits: the
    epilogue's first W/state loads overlap the kernel before); each launched in a loop and replayed from a CUDA graph
    (what step_graphs runs). Checked first, in a chain whose kernel before each update WRITES that update's X
    (NaN-filled, then a GEMM into it): W and states of the pdl runs equal the plain run's bitwise and hold no NaN (a
    missing or misplaced wait would read X early). gain1/2 = plain / pdl1/2, graphed likewise. False when a check
    failed."""
    import dataclasses

    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    all_ok, rows = True, []
    for m in PDL_MS:
        cfg = wg.pick_gconfig(m, 3, 2)
        if cfg is None or cfg.epi != "split":
            log(f"M={m}: the pick is not the split kernel ({cfg}), skipped")
            continue
        layers = []
        for i, (n, k) in enumerate(PDL_LAYER):
            rule, w, dy_t, x, st, hp = make_inputs("adamw", torch.bfloat16, n, k, m, seed=m + i)
            layers.append((rule, w, dy_t, x, st, hp, w.to(torch.bfloat16), torch.empty(m, k, device="cuda",
                                                                                       dtype=torch.bfloat16)))
        gen = torch.Generator(device="cuda").manual_seed(m)
        makers = [(torch.randn(m, 512, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05,
                   torch.randn(512, L[3].shape[1], device="cuda", generator=gen, dtype=torch.bfloat16))
                  for L in layers]
        chains = {}
        for name, c in (("plain", cfg), ("pdl1", dataclasses.replace(cfg, pdl=1)),
                        ("pdl2", dataclasses.replace(cfg, pdl=2))):
            ws = [(L[1].clone(), [s.clone() for s in L[4]]) for L in layers]
            fused = [wg.bound_launch(wi, L[2], L[3], sti, L[5], L[0], config=c) for L, (wi, sti) in zip(layers, ws)]
            for L, (a, b), f in zip(layers, makers, fused):   # the check: X written by the kernel right before
                L[3].fill_(float("nan"))
                torch.mm(a, b, out=L[3])
                f()

            def chain(fused=fused):
                for L, f in zip(layers, fused):
                    torch.mm(L[2].t(), L[6], out=L[7])      # dX = dY @ W_bf16, the kernel before the update
                    f()
            chain()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            chains[name] = (chain, g, ws)
        ok = all(torch.equal(a[0], b[0]) and not b[0].isnan().any() and all(torch.equal(x, y)
                 for x, y in zip(a[1], b[1])) for mode in ("pdl1", "pdl2")
                 for a, b in zip(chains["plain"][2], chains[mode][2]))
        all_ok &= ok
        t = {}
        for name, (chain, g, _) in chains.items():
            t[name] = bench(chain)
            t[name + "_graph"] = bench(g.replay)
        for mode in ("1", "2"):
            t["gain" + mode] = t["plain"] / t["pdl" + mode]
            t["gain" + mode + "_graph"] = t["plain_graph"] / t["pdl" + mode + "_graph"]
        rows.append((m, t))
        log(f"layer chain M={m} ({len(PDL_LAYER)} weights): " + " | ".join(f"{a} {v:.4f}" for a, v in t.items())
            + ("" if ok else " | PDL CHECK FAILED"))
        del layers, chains
        torch.cuda.empty_cache()
    _log_table(log, rows, "M", 5, 11)
    return all_ok


# (rule, N, K, Ms): AdamW on 4096x4096 and the e2e shapes; SGD-momentum where its pick for the copy is the smem
# kernel instead of the TMA ring (M <= 1024, pick_for) and where it is the split kernel (2048)
CAST_CASES = ([("adamw", n, k, (1024, 2048, 4096)) for n, k in [(4096, 4096)] + E2E_SHAPES]
              + [("sgdm", 4096, 4096, (256, 1024, 2048))])


def cast_sweep(args, log):
    """bf16 activations, one process (CAST_CASES): the fused step without / with the new W's bf16 copy as side output
    (compile_train_step(cast_weights_in_update=True)) against the separate cast kernel the next forward runs
    without it (``w.to(bf16)`` into a buffer: 4 B read + 2 B written per parameter). gain = fused + cast - fused_cast:
    what the option saves per weight and step; the store's cost is fused_cast - fused. Checked first: the copy equals
    the new W cast by torch, and W/states are bitwise those of the launch without it. False when a check failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    def launcher(w, dy_t, x, st, hp, rule, out):
        if wg.use_gluon(w, dy_t, x, st, rule, out):
            return "gluon", wg.bound_launch(w, dy_t, x, st, hp, rule, out)
        return "triton", wt.bound_launch(w, dy_t, x, st, hp, rule, out)

    all_ok, rows = True, []
    for kind, n, k, ms in CAST_CASES:
        for m in ms:
            rule, w, dy_t, x, st, hp = make_inputs(kind, torch.bfloat16, n, k, m, seed=m)
            out = torch.empty_like(w, dtype=torch.bfloat16)
            w1, st1, w2, st2 = w.clone(), [s.clone() for s in st], w.clone(), [s.clone() for s in st]
            wt.launch_wgrad_update(w1, dy_t, x, st1, hp, rule, side_out=out)
            wt.launch_wgrad_update(w2, dy_t, x, st2, hp, rule)
            ok = (torch.equal(out, w1.to(torch.bfloat16)) and torch.equal(w1, w2)
                  and all(map(torch.equal, st1, st2)))
            all_ok &= ok
            del w1, w2, st1, st2
            path, plain = launcher(w, dy_t, x, st, hp, rule, None)
            path_c, with_cast = launcher(w, dy_t, x, st, hp, rule, out)
            t = {"fused": bench(plain), "fused_cast": bench(with_cast), "cast": bench(lambda: out.copy_(w))}
            t["gain"] = t["fused"] + t["cast"] - t["fused_cast"]
            rows.append((kind, n, k, m, t))
            log(f"{kind} {n}x{k} M={m} ({path}/{path_c}): " + " | ".join(f"{k_} {v:.4f}" for k_, v in t.items())
                + ("" if ok else " | CHECK FAILED"))
            del w, dy_t, x, st, out
            torch.cuda.empty_cache()
    keys = list(rows[0][4])
    log("\n" + f"{'rule':>6} {'N x K':>12} {'M':>6} " + " ".join(f"{k_:>10}" for k_ in keys))
    for kind, n, k, m, t in rows:
        log(f"{kind:>6} {f'{n}x{k}':>12} {m:>6} " + " ".join(f"{t[k_]:>10.4f}" for k_ in keys))
    return all_ok


MATH_MS = (64, 256, 1024, 2048)


def math_sweep(args, log):
    """bf16 4096x4096, one process: AdamW vs adamw_lite (the same three arrays and scalars, three multiply-adds per
    element instead of AdamW's division and square root) through the smem and split kernels and auto's pick, all
    checked bit-exact vs eager. Equal times: the epilogue warpgroups stream at a rate their math does not limit;
    adamw_lite clearly faster at small M (where both kernels run at the epilogue's rate): the exact div/sqrt
    sequences are what the streaming waits on (NOTES_kernel.md, open questions after v12). False when a check
    failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    all_ok, rows = True, []
    cfgs = {"auto": None, "smem": wg.smem_config(), "split": wg.split_config()}
    for m in MATH_MS:
        t = {}
        for kind in ("adamw", "adamw_lite"):
            rule, w, dy_t, x, st, hp = make_inputs(kind, torch.bfloat16, 4096, 4096, m, seed=m)
            for name, c in cfgs.items():
                ok = check_config(rule, w, dy_t, x, st, hp, None,
                                  launch=lambda *a, _c=c, **kw: wg.launch(*a, **kw, config=_c))[0]
                all_ok &= ok
                t[f"{kind}/{name}"] = bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=c))
                if not ok:
                    log(f"CHECK FAILED: {kind} {name} M={m}")
            del w, dy_t, x, st
            torch.cuda.empty_cache()
        for name in cfgs:
            t[f"ratio/{name}"] = t[f"adamw/{name}"] / t[f"adamw_lite/{name}"]
        rows.append((m, t))
        log(f"4096x4096 M={m}: " + " | ".join(f"{k} {v:.4f}" for k, v in t.items()))
    _log_table(log, rows, "M", 6, 17)
    return all_ok


TF32_MS = (256, 1024, 2048, 4096, 8192)
TF32_IEEE_CANDIDATES = ("f128x128", "f64x128")   # larger FMA tiles than the IEEE pick (tf64m32), not yet measured


def tf32_sweep(args, log):
    """AdamW 4096x4096 (--tf32-rules, --tf32-shapes: others) with fp32 activations, one process: under torch.set_float32_matmul_precision("high") (TF32
    allowed for fp32 matmuls) the unfused step's wgrad is cuBLAS in TF32, and forge's dot follows it
    (wgrad_update_triton.fp32_dot_precision); with TF32 off (torch's default) both are IEEE fp32. Times the unfused
    step and the fused kernel's pick (and the other TF32 configs) in both modes. Checks before timing: W/states
    bit-exact vs eager on the stored dW; the stored dW within 5e-3 of fp64 in TF32 (10-bit mantissa inputs:
    ~1e-3 relative) and, to show the TF32 dot really ran, farther than 1e-5 (an IEEE dot lands ~1e-6); within
    1e-5 in IEEE. False when a check failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    all_ok, rows = True, []
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for kind, n, k, m in [(r, n, k, m) for r in args.tf32_rules.split(",") for n, k in args.tf32_shapes
                              for m in TF32_MS]:
            rule, w, dy_t, x, st, hp = make_inputs(kind, torch.float32, n, k, m, seed=m)
            t = {}
            for mode in ("ieee", "tf32"):
                torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
                t[f"unfused/{mode}"] = bench(make_unfused(kind, rule, w, dy_t, x, st, hp)[0])
                pick = wt.pick_config(n, k, m, False, True, mode == "tf32")
                others = wt.tune_candidates(n, k, m, True, True) if mode == "tf32" else TF32_IEEE_CANDIDATES
                # the Triton configs other than the pick were measured (RESULTS.md, 2026-12-05): --tf32-all re-times
                names = [pick] + ([c for c in others if c != pick] if args.tf32_all else [])
                for c in names:
                    ok, rel, exact = check_config(rule, w, dy_t, x, st, hp, c,
                                                  tol=5e-3 if mode == "tf32" else 1e-5)[:3]
                    if mode == "tf32" and wt.CONFIGS[c].fp32_dot == "tf32" and rel <= 1e-5:
                        ok = False
                    if not ok:
                        all_ok = False
                        log(f"CHECK FAILED: {mode} {c} M={m}: dW rel {rel:.1e}, exact {exact}")
                        continue
                    t[f"{c}/{mode}"] = bench(wt.bound_launch(w, dy_t, x, st, hp, rule, config=c))
                if f"{pick}/{mode}" in t:
                    t[f"x/{mode}"] = t[f"unfused/{mode}"] / t[f"{pick}/{mode}"]
                if mode == "tf32" and gluon_why(rule, w, dy_t, x, st) is None:
                    # the Gluon split kernel on K-major copies (wgrad_update_gluon.tf32_config; the copies are
                    # inside the timed call, bound_launch), as picked and with hoist toggled
                    gpick = wg.tf32_config(m)
                    # and, from M = 4096 on, the coop split kernel (128x256 tiles; 16-token fp32 stages; stop 30)
                    coop = (("gl_coop", wg.coop_config(bmt=16)),) if m >= 4096 else ()
                    for gname, gc in (("gl", gpick), ("gl_h" if not gpick.hoist else "gl_noh",
                                                      dataclasses.replace(gpick, hoist=not gpick.hoist))) + coop:
                        ok, rel, exact = check_config(rule, w, dy_t, x, st, hp, None, tol=5e-3,
                                                      launch=lambda *a, gc=gc, **k: wg.launch(*a, **k, config=gc))[:3]
                        if not ok or rel <= 1e-5:
                            all_ok = False
                            log(f"CHECK FAILED: tf32 gluon {gname} M={m}: dW rel {rel:.1e}, exact {exact}")
                            continue
                        t[f"{gname}/tf32"] = bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=gc))
                    if "gl/tf32" in t:
                        t["xg/tf32"] = t["unfused/tf32"] / t["gl/tf32"]
                    # the K-major copies alone: kernels/transpose_copy.py (what _prepare runs; checked against
                    # torch's), and torch's transposing copy (stop 29's first version: 2.5-3x slower on the H100)
                    from forge_compile.kernels.transpose_copy import transpose_copy

                    pair = wg.kmajor_copies(dy_t, x)   # one launch (transpose_copy_pair), as launches make them
                    if (torch.equal(transpose_copy(dy_t.t()), dy_t) and torch.equal(transpose_copy(x), x.t())
                            and torch.equal(pair[0], dy_t) and torch.equal(pair[1], x.t())):
                        t["copies/tf32"] = bench(lambda: wg.kmajor_copies(dy_t, x))
                    else:
                        all_ok = False
                        log(f"CHECK FAILED: transpose_copy M={m}")
                    t["torch_copies/tf32"] = bench(lambda: (dy_t.contiguous(), x.t().contiguous()))
            rows.append((f"{kind} {n}x{k} {m}", t))
            log(f"{kind} {n}x{k} fp32 M={m}: " + " | ".join(f"{key} {v:.4f}" for key, v in t.items()))
            del w, dy_t, x, st
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    keys = list(dict.fromkeys(k for _, t in rows for k in t))
    log("\n" + f"{'rule shape M':>22} " + " ".join(f"{k:>18}" for k in keys))
    for m, t in rows:
        log(f"{m:>22} " + " ".join(f"{t[k]:>18.4f}" if k in t else f"{'-':>18}" for k in keys))
    return all_ok


# ---- overlap diagnostic: the kernel's GEMM schedule alone (GConfig.epi="gemm") vs the fused kernel, one process ----

OVERLAP_CASES = [(4096, 4096, (64, 256, 1024, 2048, 4096, 8192)), (14336, 4096, (64, 2048))]
OVERLAP_M0 = 64   # the epilogue-alone reference: the GEMM is ~4 % of the work there (NOTES_kernel.md v9)


def check_gemm_sums(w, dy_t, x, st, hp, rule, cfg, ref=None):
    """(ok, worst error / bound) of the epi="gemm" kernel: its per-tile row sums of dW vs the fp64 product, and
    W/states untouched. The bound is 1e-4 x the sum of |dW| over the same 128 elements, not a relative error of
    the sum itself: the kernel sums each row's 128 fp32 elements in its own (shuffle-tree) order after an fp32
    accumulation over M in wgmma order, torch in others, so the sums differ by rounding of the order of
    2^-24 * sqrt(M) * sum|dW| (~1e-6 of it here); a row sum of random values can cancel to ~0, where any relative
    tolerance fails. A skipped 64-token step or a misplaced tile moves a sum by percents of that bound's scale."""
    n, k = w.shape
    sums = torch.full(wg.gemm_sums_shape(n, k, cfg), float("nan"), device=w.device)
    w1, st1 = w.clone(), [s.clone() for s in st]
    wg.launch(w1, dy_t, x, st1, hp, rule, side_out=sums, config=cfg)
    if ref is None:
        ref = dy_t.double() @ x.double()
    rows, nk = sums.shape
    pad = torch.zeros(rows, nk * cfg.bk, dtype=torch.float64, device=w.device)
    pad[:n, :k] = ref
    pad = pad.view(rows, nk, cfg.bk)
    err = (sums.double() - pad.sum(-1)).abs()
    bound = 1e-4 * pad.abs().sum(-1)    # rows past N: 0, and the kernel must store exactly 0 there
    untouched = torch.equal(w1, w) and all(torch.equal(a, b) for a, b in zip(st1, st))
    ok = bool((err <= bound).all()) and untouched
    worst = (err / bound.clamp_min(1e-300)).max().item()
    return ok, worst


def overlap_sweep(args, log):
    """Where the fused kernel's time goes: per case (AdamW, bf16), medians of do_bench in one process of the unfused
    step, cuBLAS's mm alone, torch._fused_adamw_ alone, the default kernel (pick_gconfig, no dW), the GEMM-only
    diagnostic with the default's GEMM layout (gemm_same: its bmt and stages) and with 4 stages (gemm_s4). At
    M=OVERLAP_M0 also the epilogue alone: every config the default picks at this shape's M, timed at M=64.
    overlap = (gemm_same + epi_alone - default) / min(gemm_same, epi_alone), epi_alone = the default's config at
    M=64: 1 = the shorter of GEMM and epilogue fully hidden, 0 = nothing overlaps (default = their sum).
    Checks first: the default bit-exact vs eager on its stored dW (check_config), each timed kernel config's W
    (timed without dW) bit-identical to that; the gemm configs' row sums vs fp64 (check_gemm_sums). One line per
    case as it finishes. False when a check failed."""
    from triton.testing import do_bench

    def bench(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    def name(cfg):
        if cfg.epi == "smem":
            return f"smem_r{cfg.epi_m}a{cfg.ahead}" + ("" if cfg.bmt == 64 else f"b{cfg.bmt}") + f"s{cfg.stages}"
        if cfg.epi == "gemm":
            return f"gemm_b{cfg.bmt}s{cfg.stages}"
        return f"{cfg.epi}_b{cfg.bmt}s{cfg.stages}e{cfg.es}"

    all_ok = True
    rows = []
    epi_alone = {}    # (n, k, cfg) -> ms at M=OVERLAP_M0
    for n, k, ms in OVERLAP_CASES:
        for m in ms:
            t0 = time.time()
            rule, w, dy_t, x, st, hp = make_inputs("adamw", torch.bfloat16, n, k, m, seed=m)
            pick = wg.pick_gconfig(m, 3)
            gcfg = {"gemm_same": wg.gemm_config(stages=pick.stages, bmt=pick.bmt), "gemm_s4": wg.gemm_config(4)}
            # the epilogue-alone references: the configs the default uses at this shape's M values, at M=64
            epis = list(dict.fromkeys(wg.pick_gconfig(mm, 3) for mm in ms)) if m == OVERLAP_M0 else []
            ok0, rel, exact, w_chk = check_config(rule, w, dy_t, x, st, hp, None, launch=wg.launch)
            ok = {}
            # the smem epilogue (W/states by 16 B vector loads, not through smem) with a 6-deep ring of 32-token
            # GEMM stages: if the TMA-ring epilogue's smem traffic is what keeps the GEMM from overlapping it at
            # M >= 1024, this overlaps better there (v11's 3 x 64-token stages starved the GEMM instead)
            xcfg = wg.smem_config(bmt=32, stages=6)
            for cfg in dict.fromkeys([pick, *epis, xcfg]):
                w1, st1 = w.clone(), [s.clone() for s in st]
                wg.launch(w1, dy_t, x, st1, hp, rule, config=cfg)
                ok[cfg] = ok0 and torch.equal(w1, w_chk)
                del w1, st1
            ref = dy_t.double() @ x.double()
            worst = {}
            for key, cfg in gcfg.items():
                ok[cfg], worst[key] = check_gemm_sums(w, dy_t, x, st, hp, rule, cfg, ref)
            del ref, w_chk
            all_ok &= all(ok.values())
            fn, _ = make_unfused("adamw", rule, w, dy_t, x, st, hp)
            t = {"unfused": bench(fn), "mm": bench(lambda: wgrad_mm(dy_t, x))}
            gr = wgrad_mm(dy_t, x)
            wb, mb, vb, sb = w.clone(), st[1].clone(), st[2].clone(), torch.tensor(10.0, device="cuda")
            t["adamw_alone"] = bench(lambda: torch._fused_adamw_([wb], [gr], [mb], [vb], [], [sb], lr=1e-3,
                                                                 beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                                                                 amsgrad=False, maximize=False))
            del gr, wb, mb, vb
            t["default"] = bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=pick))
            for key, cfg in gcfg.items():   # gemm_s4 == gemm_same where the default runs 4 stages: timed once
                same = key == "gemm_s4" and cfg == gcfg["gemm_same"]
                t[key] = t["gemm_same"] if same else bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=cfg))
            t[name(xcfg)] = t["default"] if xcfg == pick else \
                bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=xcfg))
            for cfg in epis:
                epi_alone[(n, k, cfg)] = t["default"] if cfg == pick else \
                    bench(wg.bound_launch(w, dy_t, x, st, hp, rule, config=cfg))
            g, d, e = t["gemm_same"], t["default"], epi_alone.get((n, k, pick), float("nan"))
            ov = (g + e - d) / min(g, e)
            fails = [name(c) for c, v in ok.items() if not v] + ([] if ok0 else ["default(check_config)"])
            cells = [f"{key} {v:.4f}" for key, v in t.items()]
            cells[3] += f" ({name(pick)})"
            cells[4] += f" ({name(gcfg['gemm_same'])})"
            cells += [f"epi_alone(M={OVERLAP_M0}, {name(pick)}) {e:.4f}",
                      f"overlap {ov:.2f}", f"default/gemm {d / g:.3f}", f"gemm/mm {g / t['mm']:.3f}",
                      f"default-(gemm+epi) {d - g - e:+.4f}"]
            if epis:
                cells.append("epi_alone " + ", ".join(f"{name(c)} {epi_alone[(n, k, c)]:.4f}" for c in epis))
            cells.append("sums err/bound " + " ".join(f"{v:.1e}" for v in worst.values()))
            cells.append(f"checks {'OK' if not fails else 'FAILED ' + ' '.join(fails)}  [{time.time() - t0:.0f} s]")
            log(f"adamw {n}x{k} M={m}: " + " | ".join(cells))
            rows.append((n, k, m, t, e, ov))
            del w, dy_t, x, st, fn
            torch.cuda.empty_cache()
    log("")
    log(f"{'shape':>10} {'M':>5} {'unfused':>8} {'mm':>7} {'adamw':>7} {'default':>8} {'gemm':>7} {'gemm_s4':>8} "
        f"{'epi@64':>7} {'g+e':>7} {'overlap':>7} {'def/gemm':>8} {'gemm/mm':>7} {'smem_b32s6':>10}")
    xname = name(wg.smem_config(bmt=32, stages=6))
    for n, k, m, t, e, ov in rows:
        g = t["gemm_same"]
        log(f"{f'{n}x{k}':>10} {m:5d} {t['unfused']:8.4f} {t['mm']:7.4f} {t['adamw_alone']:7.4f} "
            f"{t['default']:8.4f} {g:7.4f} {t['gemm_s4']:8.4f} {e:7.4f} {g + e:7.4f} {ov:7.2f} "
            f"{t['default'] / g:8.3f} {g / t['mm']:7.3f} {t[xname]:10.4f}")
    return all_ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tf32-shapes", default="4096x4096",
                    type=lambda v: [tuple(int(d) for d in s.split("x")) for s in v.split(",")],
                    help="--cases tf32: weight shapes NxK, comma-separated (e.g. 4096x4096,14336x4096,4096x14336)")
    ap.add_argument("--tf32-rules", default="adamw", help="--cases tf32: rules (adamw, sgdm, lion), comma-separated")
    ap.add_argument("--clock-cases", default="",
                    help='--cases clocks: "rule:NxK:M,M;..." instead of CLOCK_CASES (e.g. "adamw:14336x4096:2048,8192")')
    ap.add_argument("--tf32-all", action="store_true",
                    help="--cases tf32: also the Triton configs other than the pick (measured 2026-12-05)")
    ap.add_argument("--cases", default="final", choices=["final", "sweep", "all", "gluon", "rings", "vec",
                                                                 "smem", "overlap", "v12", "v12b", "splitovl", "hoist",
                                                                 "math", "tf32", "e2e", "cast", "l2pf",
                                                                 "splittune", "concurrent", "group", "pdl", "coop",
                                                                 "clocks"])
    ap.add_argument("--configs", default="", help="sweep configs (default: every GPU config)")
    ap.add_argument("--short", default="", help="configs also timed on every final case")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--plot", metavar="PNG", help="also plot the table (benchmarks/plot_results.py)")
    ap.add_argument("--autotune", action="store_true",
                    help="also time FORGE_AUTOTUNE's choice per case (tuned on the case's inputs; table in OUT)")
    args = ap.parse_args()
    if args.autotune:
        os.environ.setdefault("FORGE_AUTOTUNE_CACHE", os.path.join(args.out, "autotune.json"))
    import triton
    from triton.testing import do_bench

    lines = []

    def log(s):
        lines.append(s)
        print(s, flush=True)

    log(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  GPU {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__}  triton {triton.__version__}")
    if args.cases in ("rings", "vec", "smem", "overlap", "v12", "v12b", "splitovl", "hoist", "math", "tf32", "cast", "l2pf",
                      "splittune", "concurrent", "group", "pdl", "coop", "clocks"):
        ok = {"clocks": clocks_sweep, "coop": coop_sweep, "pdl": pdl_sweep, "group": group_sweep, "l2pf": l2pf_sweep, "splittune": splittune_sweep, "concurrent": concurrent_sweep, "rings": ring_sweep, "vec": vec_sweep, "smem": smem_sweep, "overlap": overlap_sweep,
              "v12": v12_sweep, "v12b": v12b_sweep, "splitovl": split_overlap_sweep,
              "hoist": hoist_sweep, "math": math_sweep, "tf32": tf32_sweep, "cast": cast_sweep}[args.cases](args, log)
        log(f"checks {'OK' if ok else 'FAILED'}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_{args.cases}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return
    gpu_cfgs = [c for c in wt.CONFIGS if not c.startswith("interp")]
    sweep_cfgs = args.configs.split(",") if args.configs else gpu_cfgs
    short = [c for c in args.short.split(",") if c]

    plan = []   # (kind, act, n, k, m, [configs to time besides the default])
    if args.cases in ("sweep", "all"):
        plan += [("adamw", "bfloat16", 4096, 4096, m, sweep_cfgs) for m in MS]
    if args.cases in ("final", "all"):
        seen = {(p[0], p[1], p[2], p[3], p[4]) for p in plan}
        plan += [(*c, short) for c in final_cases() if c not in seen]
    if args.cases == "gluon":
        plan += [(*c, short) for c in gluon_cases()]
    if args.cases == "e2e":
        plan += [(*c, short) for c in e2e_cases()]

    # precompile every (case kind, config) in parallel processes
    jobs = set()
    for kind, act, n, k, m, cfgs in plan:
        upcast = act == "float32"
        for c in set(cfgs) | {wt.pick_config(n, k, m, False, upcast)} | (set() if upcast else {"gluon"}):
            jobs.add((kind, act, c, _small(n), _small(k), m if m % 128 else 256))
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.procs) as pool:
        for msg in pool.imap_unordered(_precompile, sorted(jobs)):
            if "FAILED" in msg:
                log(msg)
    log(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f}s with {args.procs} processes")

    rows = []
    checks_ok = True
    for kind, act, n, k, m, cfgs in plan:
        rule, w, dy_t, x, st, hp = make_inputs(kind, getattr(torch, act), n, k, m, seed=m)
        upcast = act == "float32"
        default = wt.pick_config(n, k, m, False, upcast)
        timed = [default] + [c for c in cfgs if c != default]
        unfused, one_step = make_unfused(kind, rule, w, dy_t, x, st, hp)

        res, regs, fns = {}, {}, {}
        rel_w = None
        for c in timed:
            try:
                ok, rel, exact, w1 = check_config(rule, w, dy_t, x, st, hp, c)
            except Exception as e:  # out of shared memory / registers for this tile
                log(f"  config {c} failed at {kind} {act} {n}x{k} M={m}: {type(e).__name__}: {str(e)[:160]}")
                continue
            if c == default:
                wb = one_step(w, st)
                rel_w = ((w1 - wb).norm() / (wb - w).norm()).item()
            del w1
            if not ok:
                checks_ok = False
                log(f"  CHECK FAILED {kind} {act} {n}x{k} M={m} config {c}: dW rel {rel:.1e} exact {exact}")
                continue
            fns[c] = wt.bound_launch(w, dy_t, x, st, hp, rule, config=c)
            ck = fns[c]()
            regs[c] = (getattr(ck, "n_regs", None), getattr(ck, "n_spills", None))
        # the Gluon kernel (sm_90): checked like the configs, timed alone
        g_fn, g_why, g_rel_w = None, gluon_why(rule, w, dy_t, x, st), None
        if g_why is None:
            try:
                ok, rel, exact, w1 = check_config(rule, w, dy_t, x, st, hp, None, launch=wg.launch)
                wb = one_step(w, st)
                g_rel_w = ((w1 - wb).norm() / (wb - w).norm()).item()
                del w1
                if ok:
                    g_fn = wg.bound_launch(w, dy_t, x, st, hp, rule)
                else:
                    checks_ok = False
                    g_why = f"CHECK FAILED: dW rel {rel:.1e} exact {exact}"
                    log(f"  GLUON CHECK FAILED {kind} {act} {n}x{k} M={m}: dW rel {rel:.1e} exact {exact}")
            except Exception as e:
                checks_ok = False
                g_why = f"{type(e).__name__}: {str(e)[:160]}"
                log(f"  gluon failed at {kind} {act} {n}x{k} M={m}: {g_why}")
        n_tensor_states = sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i))
        step0 = float(st[0]) if rule.is_scalar_state(0) else None

        def full_hit():
            if step0 is not None:
                st[0].fill_(step0)
            wt.launch_wgrad_update(w, dy_t, x, st, hp, rule)

        def full_miss():
            wt.launch_wgrad_update(w, dy_t, x, st, hp, rule)

        def bench(f):
            return do_bench(f, warmup=10, rep=args.rep, return_mode="median")

        # unfused / default / launch back to back, unfused again after them: clocks drift over a run (the
        # same kernel measured 6-10 % slower late in run 4 at large M); the smaller unfused time is kept
        t_unf1 = bench(unfused)
        if default in fns:
            res[default] = bench(fns[default])
            t_hit = bench(full_hit)
        else:
            t_hit = float("nan")
        t_gl = bench(g_fn) if g_fn is not None else float("nan")
        t_unf = min(t_unf1, bench(unfused))
        t_miss = bench(full_miss) if default in fns else float("nan")
        t_mm = bench(lambda: wgrad_mm(dy_t, x))
        for c in fns:
            if c != default:
                res[c] = bench(fns[c])
        t_tu, tu_name, tu_s = float("nan"), "-", 0.0
        if args.autotune:
            tc = tuned_case(rule, w, dy_t, x, st, hp)
            if tc is not None:
                ch, ok, fn, tu_s = tc
                c = ch.config
                if ch.family == "gluon":   # '*': not the default Gluon config
                    star = "" if c == wg.pick_gconfig(m, 1 + n_tensor_states, x.element_size()) else "*"
                    tu_name = f"gluon:s{c.stages}e{c.es}{star}"
                else:
                    tu_name = f"triton:{c}"
                if ok:
                    t_tu = bench(fn)
                else:
                    checks_ok = False
                    log(f"  TUNED CHECK FAILED {kind} {act} {n}x{k} M={m}: {tu_name}")
        opt_bytes = (8 + 8 * n_tensor_states + 4) * n * k   # W, states read+write, dW read
        t_ideal = t_mm + opt_bytes / BW * 1e3
        floor = floor_ms(rule, n, k, m, upcast)
        best = min(res, key=res.get) if res else None
        row = dict(kind=kind, act=act, n=n, k=k, m=m, unfused_ms=t_unf, mm_ms=t_mm, mm_ideal_ms=t_ideal,
                   default_config=default, default_ms=res.get(default, float("nan")), best_config=best,
                   best_ms=res.get(best, float("nan")), launch_ms=t_hit, launch_miss_ms=t_miss, floor_ms=floor,
                   rel_w_vs_torch=rel_w, configs=res, regs=regs, gluon_ms=t_gl, gluon_why=g_why,
                   gluon_rel_w_vs_torch=g_rel_w, tuned_ms=t_tu, tuned_choice=tu_name, tuning_s=tu_s)
        rows.append(row)
        log(f"{kind} {act} {n}x{k} M={m}: unfused {t_unf:.4f} (mm {t_mm:.4f})  default {default} "
            f"{row['default_ms']:.4f} ({t_unf / row['default_ms']:.2f}x)  best {best} {row['best_ms']:.4f}  "
            f"launch {t_hit:.4f} miss {t_miss:.4f}  floor {floor:.4f}  mm+ideal {t_ideal:.4f}  W vs torch {rel_w}  "
            f"gluon {t_gl:.4f} ({t_unf / t_gl:.2f}x unfused, {row['default_ms'] / t_gl:.2f}x triton; W vs torch "
            f"{g_rel_w}{'' if g_why is None else '; ' + g_why})"
            + (f"  tuned {tu_name} {t_tu:.4f} ({t_unf / t_tu:.2f}x unfused; tuning {tu_s:.1f} s)" if args.autotune else ""))
        if len(res) > 1:
            log("   " + "  ".join(f"{c}={v:.4f}(r{regs[c][0]},s{regs[c][1]})" for c, v in sorted(res.items(), key=lambda t: t[1])))
        del w, dy_t, x, st, unfused, one_step
        torch.cuda.empty_cache()

    log("")
    log(f"{'rule':>5} {'act':>4} {'shape':>12} {'M':>5} {'unfused':>8} {'fused':>8} {'cfg':>10} {'ratio':>6} "
        f"{'best':>8} {'bestcfg':>12} {'launch':>8} {'ratio_l':>7} {'miss':>8} {'gluon':>8} {'unf/gl':>6} "
        f"{'tri/gl':>6} {'floor':>7}" + (f" {'tuned':>8} {'unf/tu':>6} choice" if args.autotune else ""))
    for r in rows:
        log(f"{r['kind']:>5} {r['act'][:4]:>4} {str(r['n']) + 'x' + str(r['k']):>12} {r['m']:>5} {r['unfused_ms']:8.4f} "
            f"{r['default_ms']:8.4f} {r['default_config']:>10} {r['unfused_ms'] / r['default_ms']:6.2f} "
            f"{r['best_ms']:8.4f} {str(r['best_config']):>12} {r['launch_ms']:8.4f} {r['unfused_ms'] / r['launch_ms']:7.2f} "
            f"{r['launch_miss_ms']:8.4f} {r['gluon_ms']:8.4f} {r['unfused_ms'] / r['gluon_ms']:6.2f} "
            f"{r['default_ms'] / r['gluon_ms']:6.2f} {r['floor_ms']:7.4f}"
            + (f" {r['tuned_ms']:8.4f} {r['unfused_ms'] / r['tuned_ms']:6.2f} {r['tuned_choice']}" if args.autotune else ""))
    log(f"checks {'OK' if checks_ok else 'FAILED'}")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(rows=rows, checks_ok=checks_ok, meta=meta), f, indent=1)
    if args.plot:
        from plot_results import plot_kernel

        path = args.plot if os.path.dirname(args.plot) else os.path.join(args.out, args.plot)   # bare name: in --out
        log(f"plot: {plot_kernel(dict(rows=rows, meta=meta), path)}")
    with open(os.path.join(args.out, "bench.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
