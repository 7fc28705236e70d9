"""Fused wgrad + AdamW on a bf16 weight with stochastic rounding (bf16 W, m, v) vs what torch does for bf16
parameters, and vs the fp32-master-weight paths, on one GPU.

  python benchmarks/bench_stochastic_round.py [--out DIR] [--shapes 4096x4096,14336x4096] [--tokens 256,1024,...]

Routes (one weight of N x K, M tokens, bf16 activations; medians of triton.testing.do_bench, fresh random inputs):
- "bf16 unfused": torch.mm(dy_t, x) in bf16 (cuBLAS; dW rounded to bf16, as autograd gives a bf16 parameter) then
  torch._fused_adamw_ on bf16 W, m, v (round to nearest: AdamW(fused=True) on bf16 parameters);
- "bf16 SR fused": forge::wgrad_update_ on bf16 W, m, v with a round key -- the kernel the op launches (on sm_90
  the Gluon smem/split kernel, else the Triton kernel's pointer epilogue) alone ("kernel", host part done once),
  the Triton kernel alone ("triton"), and the whole op call ("call": host key hashing and checks);
- "fp32 unfused" / "fp32 fused": the fp32-master-weight pair of bench_wgrad_update.py (cuBLAS bf16 -> fp32 out +
  torch._fused_adamw_ on fp32 W, m, v; forge's auto kernel) for context: the memory a bf16 run saves is 10 of 16
  bytes per parameter (W, m, v 2 bytes each instead of 4, and no fp32 master).
Floor (bf16 SR): max(12 N K / 4.27e12 (W, m, v bf16 read + written), 2 N K M / 686e12).
Correctness first, every case: the SR kernel's stored fp32 dW (grad_out) vs fp64, and its W/m/v bitwise the spec
(reference_update) applied to that dW with the same key.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from forge_compile.kernels.stochastic_round import element_key, round_key  # noqa: E402
from forge_compile.kernels.wgrad_update import reference_update, wgrad_update  # noqa: E402
from forge_compile.optim import rules  # noqa: E402

BW, FLOPS = 4.27e12, 686e12
HP = (1e-4, 0.9, 0.999, 1e-8, 0.01)


def _inputs(n, k, m, wdtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(wdtype)
    mm = (torch.randn(n, k, device="cuda", generator=g) * 1e-3).to(wdtype)
    v = (torch.rand(n, k, device="cuda", generator=g) * 1e-6).to(wdtype)
    dy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    return w, mm, v, dy.t(), x


def _hp():
    return [torch.tensor(h, dtype=torch.float64) for h in HP]


def check(n, k, m):
    rule = rules.adamw_rule()
    w, mm, v, dy_t, x = _inputs(n, k, m, torch.bfloat16, seed=1)
    step = torch.tensor(3.0)
    ref_w, ref_st = w.clone(), [step.clone(), mm.clone(), v.clone()]
    ekey = element_key(round_key(0, 5), 2)
    grad = torch.full((n, k), float("nan"), device="cuda")
    wgrad_update(w, dy_t, x, [step, mm, v], _hp(), rule.name, grad_out=grad, ekey=ekey)
    ref = dy_t.double() @ x.double()
    rel = ((grad.double() - ref).norm() / ref.norm()).item()
    reference_update(ref_w, grad, ref_st, _hp(), rule.name, ekey)
    same = (torch.equal(w.view(torch.int16), ref_w.view(torch.int16)) and torch.equal(mm, ref_st[1])
            and torch.equal(v, ref_st[2]))
    return rel, same


def _path(w, dy_t, x, states, rule, ekey) -> str:
    # the kernel the op's launch takes for this case (launch_wgrad_update: Gluon where gluon_reason allows it)
    try:
        from forge_compile.kernels import wgrad_update_gluon as wg
    except ImportError:
        return "triton"
    return "gluon" if wg.gluon_reason(w, dy_t, x, states, rule, ekey=ekey) is None else "triton"


def time_case(n, k, m, rep):
    from triton.testing import do_bench
    from forge_compile.kernels.wgrad_update_triton import bound_launch

    rule = rules.adamw_rule()
    out = {}
    lr, b1, b2, eps, wd = HP
    # bf16 unfused: what torch runs for a bf16 parameter with AdamW(fused=True)
    w, mm, v, dy_t, x = _inputs(n, k, m, torch.bfloat16)
    steps = [torch.tensor(3.0, device="cuda")]

    def bf16_unfused():
        g = torch.mm(dy_t, x)
        torch._fused_adamw_([w], [g], [mm], [v], [], steps, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                            amsgrad=False, maximize=False)
    out["bf16 unfused"] = do_bench(bf16_unfused, warmup=10, rep=rep, return_mode="median")
    step = torch.tensor(3.0)
    ekey = element_key(round_key(0, 1), 0)
    fn = bound_launch(w, dy_t, x, [step, mm, v], _hp(), rule, ekey=ekey)
    out["bf16 SR triton kernel"] = do_bench(fn, warmup=10, rep=rep, return_mode="median")
    out["kernel path"] = _path(w, dy_t, x, [step, mm, v], rule, ekey)
    if out["kernel path"] == "gluon":
        from forge_compile.kernels import wgrad_update_gluon as wg

        fn = wg.bound_launch(w, dy_t, x, [step, mm, v], _hp(), rule, ekey=ekey)
        out["bf16 SR fused kernel"] = do_bench(fn, warmup=10, rep=rep, return_mode="median")
    else:
        out["bf16 SR fused kernel"] = out["bf16 SR triton kernel"]

    def call():
        step.fill_(3.0)
        wgrad_update(w, dy_t, x, [step, mm, v], _hp(), rule.name, ekey=ekey)
    out["bf16 SR fused call"] = do_bench(call, warmup=10, rep=rep, return_mode="median")
    # host time of one call (python, checks, launch), GPU idle: a fine-tuning step launches one per linear
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        call()
    out["host us/call"] = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    del w, mm, v
    # fp32 master weights, for context
    w, mm, v, dy_t, x = _inputs(n, k, m, torch.float32)

    def fp32_unfused():
        g = torch.mm(dy_t, x, out_dtype=torch.float32)
        torch._fused_adamw_([w], [g], [mm], [v], [], steps, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                            amsgrad=False, maximize=False)
    out["fp32 unfused"] = do_bench(fp32_unfused, warmup=10, rep=rep, return_mode="median")

    def fp32_fused():
        step.fill_(3.0)
        wgrad_update(w, dy_t, x, [step, mm, v], _hp(), rule.name)
    out["fp32 fused"] = do_bench(fp32_fused, warmup=10, rep=rep, return_mode="median")
    out["floor"] = max(12 * n * k / BW, 2 * n * k * m / FLOPS) * 1e3
    return out


# Gluon configs of the sweep: (name, smem/split config arguments)
GLUON_SWEEP = [("smem r16a2", "smem", dict()), ("smem r8a2", "smem", dict(rows=8)),
               ("smem r16a1", "smem", dict(ahead=1)),
               ("split r8a4", "split", dict()), ("split r8a4h", "split", dict(hoist=True)),
               ("split r8a6", "split", dict(ahead=6)), ("split r8a2", "split", dict(ahead=2)),
               ("split r16a2", "split", dict(rows=16, ahead=2)), ("split r8a4 ld", "split", dict(evict="ld")),
               ("split r16a2h", "split", dict(rows=16, ahead=2, hoist=True)), ("smem r16a1h", "smem", dict(ahead=1, hoist=True)),
               ("smem r8a1", "smem", dict(rows=8, ahead=1))]
SWEEP_CONFIGS = ["l64x256e4p2", "l64x256e4p1", "l64x256e4", "l64x256", "m128e4", "t128e4", "t128x256e4", "t64x128",
                 "t64m128", "t64w8s2", "s64m128"]


def _exact_then_time(make, w, mm, v, rule, ekey, rep):
    """One sweep cell: ``make(states, side_out)`` binds a launch; run it once storing dW and compare W, m bitwise to
    the spec on that dW, then time it without the side output. (ms, bitwise, what the first launch returned)."""
    from triton.testing import do_bench

    st = [torch.tensor(3.0), mm, v]
    ref_w, ref_st = w.clone(), [st[0].clone(), mm.clone(), v.clone()]
    grad = torch.empty(*w.shape, device="cuda")
    first = make(st, grad)()
    reference_update(ref_w, grad, ref_st, _hp(), rule.name, ekey)
    ok = torch.equal(w.view(torch.int16), ref_w.view(torch.int16)) and torch.equal(mm, ref_st[1])
    return do_bench(make(st, None), warmup=10, rep=rep, return_mode="median"), ok, first


def sweep(n, k, tokens, rep, triton_too=False, vecs=(8,)):
    """Gluon smem/split configs (GLUON_SWEEP; sm_90) -- and with ``triton_too`` every GPU config of the Triton
    template (TMA configs take the pointer epilogue here) -- on the bf16 SR update: ms, the bitwise check of each
    config (Triton: registers, spills)."""
    from forge_compile.kernels.wgrad_update_triton import bound_launch, pick_config

    rule = rules.adamw_rule()
    ekey = element_key(round_key(0, 1), 0)
    for m in tokens:
        w, mm, v, dy_t, x = _inputs(n, k, m, torch.bfloat16)
        cells = []
        if _path(w, dy_t, x, [torch.tensor(3.0), mm, v], rule, ekey) == "gluon":
            from forge_compile.kernels import wgrad_update_gluon as wg
            from forge_compile.kernels.wgrad_update_triton import SIDE_GRAD

            pick = wg.pick_for(m, 3, 2, SIDE_GRAD, rounded=True)
            vec0 = wg.SR_ROW_VEC
            for vec, (name, epi, kw) in [(v, c) for v in vecs for c in GLUON_SWEEP]:
                wg.SR_ROW_VEC = vec     # elements per thread of the bf16 loads (v4: 8-byte, v8: 16-byte vectors)
                name = f"{name} v{vec}"
                try:
                    cfg = (wg.smem_config if epi == "smem" else wg.split_config)(**kw)
                    ms, ok, _ = _exact_then_time(
                        lambda st, grad: wg.bound_launch(w, dy_t, x, st, _hp(), rule, grad, config=cfg, ekey=ekey),
                        w, mm, v, rule, ekey, rep)
                    cells.append(f"{name}{'*' if cfg == pick else ''} {ms:.3f}{'' if ok else ' WRONG'}")
                except Exception as e:  # noqa: BLE001 -- a config that does not build here
                    cells.append(f"{name} failed ({type(e).__name__}: {str(e)[:80]})")
            wg.SR_ROW_VEC = vec0
            print(f"{n}x{k} M={m} gluon (* = picked, at v{vec0}): " + "; ".join(cells), flush=True)
            cells = []
        if not triton_too:
            continue
        for c in SWEEP_CONFIGS:
            try:
                ms, ok, ck = _exact_then_time(
                    lambda st, grad: bound_launch(w, dy_t, x, st, _hp(), rule, grad, config=c, ekey=ekey),
                    w, mm, v, rule, ekey, rep)
                cells.append(f"{c} {ms:.3f}{'' if ok else ' WRONG'} r{ck.n_regs}s{ck.n_spills}")
            except Exception as e:  # noqa: BLE001 -- a config that does not build here
                cells.append(f"{c} failed ({type(e).__name__})")
        print(f"{n}x{k} M={m} (picked {pick_config(n, k, m, False)}): " + "; ".join(cells), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="4096x4096,14336x4096")
    ap.add_argument("--tokens", default="256,1024,2048,4096,8192")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--sweep", action="store_true",
                    help="the Gluon smem/split configs on each shape (sm_90), then stop")
    ap.add_argument("--sweep-triton", action="store_true", help="with --sweep: every Triton config too")
    ap.add_argument("--row-vec", type=int, choices=[4, 8], default=None,
                    help="elements per thread of the Gluon kernel's bf16 loads (wgrad_update_gluon.SR_ROW_VEC)")
    ap.add_argument("--sweep-vecs", default=None,
                    help="with --sweep: the load widths swept, e.g. 4,8 (default: SR_ROW_VEC's)")
    ap.add_argument("--memo", choices=["on", "off"], default=None,
                    help="rounded launches through launch_memo or not (wgrad_update_triton.SR_MEMO, default on) for "
                         "the call column")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.row_vec is not None:
        from forge_compile.kernels import wgrad_update_gluon as wg

        wg.SR_ROW_VEC = args.row_vec
    if args.memo is not None:
        from forge_compile.kernels import wgrad_update_triton as wt

        wt.SR_MEMO[0] = args.memo == "on"
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.sweep:
        from forge_compile.kernels import wgrad_update_gluon as wg

        vecs = [int(v) for v in args.sweep_vecs.split(",")] if args.sweep_vecs else [wg.SR_ROW_VEC]
        for n, k in shapes:
            sweep(n, k, tokens, args.rep, args.sweep_triton, vecs)
        return
    rows = []
    for n, k in shapes:
        for m in tokens:
            rel, same = check(n, k, m)
            t = time_case(n, k, m, args.rep)
            rows.append(dict(n=n, k=k, m=m, dw_rel_err=rel, bitwise_spec=same, **t))
            print(f"{n}x{k} M={m}: dW rel {rel:.1e}, spec bitwise {same}, "
                  + ", ".join(f"{a} {b:.3f}" if isinstance(b, float) else f"{a} {b}" for a, b in t.items()), flush=True)
    props = torch.cuda.get_device_properties(0)
    import triton
    from forge_compile.kernels import wgrad_update_gluon as wg
    from forge_compile.kernels import wgrad_update_triton as wt
    head = (f"{datetime.date.today()} {props.name}, torch {torch.__version__}, triton {triton.__version__}; "
            f"ms, medians; Gluon SR loads {wg.SR_ROW_VEC} per thread, launch memo {'on' if wt.SR_MEMO[0] else 'off'}")
    print("\n" + head)
    print("| shape | M | bf16 unfused | bf16 SR fused (kernel / call) | ratio | path | triton SR kernel | ratio "
          "| floor | fp32 unfused | fp32 fused | ratio | SR fused vs fp32 fused | host us/call | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']}x{r['k']} | {r['m']} | {r['bf16 unfused']:.3f} | {r['bf16 SR fused kernel']:.3f} / "
              f"{r['bf16 SR fused call']:.3f} | {r['bf16 unfused'] / r['bf16 SR fused kernel']:.2f}x | "
              f"{r['kernel path']} | {r['bf16 SR triton kernel']:.3f} | "
              f"{r['bf16 unfused'] / r['bf16 SR triton kernel']:.2f}x | "
              f"{r['floor']:.3f} | {r['fp32 unfused']:.3f} | {r['fp32 fused']:.3f} | "
              f"{r['fp32 unfused'] / r['fp32 fused']:.2f}x | {r['fp32 fused'] / r['bf16 SR fused kernel']:.2f}x | "
              f"{r['host us/call']:.0f} | dW {r['dw_rel_err']:.0e}, {'bitwise' if r['bitwise_spec'] else 'DIFFERS'} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_stochastic_round.json"), "w") as f:
            json.dump(dict(head=head, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
