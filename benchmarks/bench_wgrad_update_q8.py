"""The fused update with 8-bit states (kernels/wgrad_update_q8.py) against the steps it would replace, one run:

  python benchmarks/bench_wgrad_update_q8.py [--out DIR] [--shapes 4096x4096,...] [--ms 256,1024,...]
                                             [--rules adamw,sgdm,lion] [--rep 25]

Per case (bf16 activations, fp32 W), medians of triton's do_bench (warm-up, kernel launches only, host parts done
once), all on the same inputs:
- ``unfused fp32``: cuBLAS wgrad (bf16 in, fp32 out) + torch's fused AdamW / SGD (Lion: the rule eagerly) on fp32
  states -- issue 5's baseline;
- ``fused fp32``: forge's fp32 fused step (the default kernel: Gluon on sm_90);
- ``unfused q8``: cuBLAS wgrad + the q8 update of that stored dW (the same kernel with FROM_GRAD, its best config):
  what 8-bit states cost without fusion (a bitsandbytes-like step, our kernel);
- ``blocked q8``: wgrad_update_q8_blocked, the path the op takes for two-state rules (cuBLAS into a <= 32 MiB row
  block of dW, then the stored-dW update of that block; host part included);
- ``fused q8`` per config of wgrad_update_q8.CONFIGS (the Triton kernel), and the best of them;
- ``gluon q8`` per config ``g_a<ahead>`` (kernels/wgrad_update_q8_gluon.py: the split kernel with ``ahead`` chunks in
  flight), and the best of them (sm_90 only);
- the q8 roofline floor: W read + written (8 bytes), each state's codes (2) and scales (8 / 128), dY and X once, at
  4.27 TB/s -- or the GEMM at 686 TFLOP/s.
Correctness first, in the same run: every config bitwise the spec (reference_wgrad_update_q8) on exact activations
(integers / 8: dW exact in any summation order), and per timed case the fused q8 step vs the unfused q8 step on
cuBLAS's dW (max |dW| difference and how many weights differ). A table is printed last; ``--out``: q8.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_wgrad_update as B  # noqa: E402  (the fp32 bench's inputs, baselines and constants: this folder)
from forge_compile.kernels import q8_state as q8  # noqa: E402
from forge_compile.kernels import wgrad_update_q8 as wq  # noqa: E402
from forge_compile.kernels.stochastic_round import round_key  # noqa: E402


def make_inputs(kind, n, k, m, seed=0, exact=False):
    """bench_wgrad_update's inputs (fp32 W and states, bf16 dY^T and X) and the states' 8-bit copies (quantized from
    the same values); ``exact``: activations of small integers / 8 instead, so dW is exact in any summation order."""
    rule, w, dy_t, x, st32, hp = B.make_inputs(kind, torch.bfloat16, n, k, m, seed)
    st8 = [s.clone() if rule.is_scalar_state(i) else list(q8.quantize(s, 1000 + i)) for i, s in enumerate(st32)]
    if exact:
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        dy_t = (torch.randint(-4, 5, (m, n), device="cuda", generator=g).float() / 8).bfloat16().t()
        x = (torch.randint(-4, 5, (m, k), device="cuda", generator=g).float() / 8).bfloat16()
    return rule, w, dy_t, x, st32, st8, hp


def floor_q8_ms(rule, n, k, m):
    n_tensor = sum(1 for i in range(len(rule.states)) if not rule.is_scalar_state(i))
    nbytes = (8 + n_tensor * (2 + 8 / q8.BLOCK)) * n * k + 2 * m * (n + k)
    return max(nbytes / B.BW, 2 * n * k * m / B.FLOPS) * 1e3


def copy_states(st8):
    return [[st[0].clone(), st[1].clone()] if isinstance(st, list) else st.clone() for st in st8]


def is_gluon(cfg: str) -> bool:
    return cfg.startswith("g_a")


def launch_kw(cfg: str) -> dict:
    """launch_wgrad_update_q8 / bound_launch keywords of a config name: a Triton CONFIGS name, or g_a<ahead>."""
    if is_gluon(cfg):
        from forge_compile.kernels import wgrad_update_q8_gluon as qg

        return dict(gluon=True, config=qg.q8_config(ahead=int(cfg[3:])))
    return dict(config=cfg)


def gluon_configs(configs):
    """The g_a* configs when this GPU takes the Gluon kernel (else none, said once)."""
    g = [c for c in configs if is_gluon(c)]
    if not g:
        return []
    from forge_compile.kernels import wgrad_update_q8_gluon as qg

    rule, w, dy_t, x, _, st8, _ = make_inputs("adamw", 256, 256, 64)
    why = qg.q8_gluon_reason(w, dy_t, x, wq.check_q8_states(w, rule, st8)[0], rule)
    if why is not None:
        print(f"gluon q8 configs skipped: {why}", flush=True)
        return []
    return g


def check_exact(kind, configs, n=520, k=640, m=300):
    """Every config (and the unfused q8 update) bitwise the spec over two steps, on exact activations."""
    rule, w, dy_t, x, _, st8, hp = make_inputs(kind, n, k, m, seed=3, exact=True)
    out = {}
    for cfg in [*configs, "from_grad", "blocked"]:
        w_ref, st_ref = w.clone(), copy_states(st8)
        w_k, st_k = w.clone(), copy_states(st8)
        try:
            for step in range(2):
                key = round_key(11, step)
                g = wq.reference_wgrad_update_q8(w_ref, dy_t, x, st_ref, hp, rule.name, key, salt=2)
                if cfg == "from_grad":
                    wq.launch_wgrad_update_q8(w_k, dy_t, x, st_k, hp, rule, key=key, salt=2, grad=g)
                elif cfg == "blocked":
                    wq.wgrad_update_q8_blocked(w_k, dy_t, x, st_k, hp, rule, key=key, salt=2)
                else:
                    wq.launch_wgrad_update_q8(w_k, dy_t, x, st_k, hp, rule, key=key, salt=2, **launch_kw(cfg))
        except Exception as e:  # noqa: BLE001 -- a config that does not build: not exact, said why
            print(f"check {kind} {cfg}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            out[cfg] = False
            continue
        ok = torch.equal(w_k, w_ref)
        for i, (a, b) in enumerate(zip(st_k, st_ref)):
            if not rule.is_scalar_state(i):
                ok = ok and torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
        out[cfg] = ok
    return out


def fused_fp32(rule, w, dy_t, x, st32, hp):
    wb, sb = w.clone(), [s.clone() for s in st32]
    try:
        from forge_compile.kernels import wgrad_update_gluon as wg

        return wg.bound_launch(wb, dy_t, x, sb, hp, rule), "gluon"
    except Exception as e:  # noqa: BLE001 -- no Gluon here: the Triton kernel
        from forge_compile.kernels import wgrad_update_triton as wt

        return wt.bound_launch(wb, dy_t, x, sb, hp, rule), f"triton ({type(e).__name__})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="4096x4096")
    ap.add_argument("--ms", default="256,1024,2048,4096,8192")
    ap.add_argument("--rules", default="adamw")
    ap.add_argument("--configs", default=",".join([c for c in wq.CONFIGS if not c.startswith("interp")]
                                                  + ["g_a2", "g_a3", "g_a4"]))
    ap.add_argument("--rep", type=int, default=25)
    args = ap.parse_args()
    from triton.testing import do_bench

    def t(fn):
        return do_bench(fn, warmup=10, rep=args.rep, return_mode="median")

    configs = args.configs.split(",")
    gcfgs = gluon_configs(configs)
    tcfgs = [c for c in configs if not is_gluon(c)]
    configs = tcfgs + gcfgs
    meta = dict(date=datetime.datetime.now().isoformat(timespec="minutes"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=__import__("triton").__version__)
    print(meta, flush=True)
    checks = {kind: check_exact(kind, configs) for kind in args.rules.split(",")}
    print("exactness (bitwise vs the spec, 2 steps):", checks, flush=True)
    rows = []
    for kind in args.rules.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            for m in map(int, args.ms.split(",")):
                rule, w, dy_t, x, st32, st8, hp = make_inputs(kind, n, k, m)
                key = round_key(5, 0)
                row = dict(rule=kind, n=n, k=k, m=m, floor_q8=floor_q8_ms(rule, n, k, m))
                # fused vs unfused q8 on the same start: they differ only by the GEMM's summation order
                w_a, st_a = w.clone(), copy_states(st8)
                w_b, st_b = w.clone(), copy_states(st8)
                wq.launch_wgrad_update_q8(w_a, dy_t, x, st_a, hp, rule, key=key, salt=1)
                g = B.wgrad_mm(dy_t, x)
                wq.launch_wgrad_update_q8(w_b, dy_t, x, st_b, hp, rule, key=key, salt=1, grad=g)
                row["check_max_dw"] = (w_a - w_b).abs().max().item()
                row["check_frac_w_differ"] = (w_a != w_b).float().mean().item()
                row["unfused_fp32"] = t(B.make_unfused(kind, rule, w, dy_t, x, st32, hp)[0])
                fn, row["fused_fp32_kernel"] = fused_fp32(rule, w, dy_t, x, st32, hp)
                row["fused_fp32"] = t(fn)
                # the unfused q8 step with its best config too (the update of a stored dW is its own sweep)
                unf = {}
                for cfg in tcfgs:
                    wu, su = w.clone(), copy_states(st8)
                    try:
                        upd = wq.bound_launch(wu, dy_t, x, su, hp, rule, key=key, salt=1, grad=g, config=cfg)
                        unf[cfg] = t(lambda: (B.wgrad_mm(dy_t, x), upd()))
                    except Exception:  # noqa: BLE001 -- reported with the fused configs' failures
                        pass
                row["unfused_q8_best"] = min(unf, key=unf.get)
                row["unfused_q8"] = unf[row["unfused_q8_best"]]
                # the blocked path as the op runs it (host part included: prepared at every call), dW 32 MiB at most
                wbk, sbk = w.clone(), copy_states(st8)
                row["blocked_q8"] = t(lambda: wq.wgrad_update_q8_blocked(wbk, dy_t, x, sbk, hp, rule, key=key, salt=1))
                row["mm"] = t(lambda: B.wgrad_mm(dy_t, x))
                fused = {}
                for cfg in configs:
                    wf, sf = w.clone(), copy_states(st8)
                    try:
                        fused[cfg] = t(wq.bound_launch(wf, dy_t, x, sf, hp, rule, key=key, salt=1, **launch_kw(cfg)))
                    except Exception as e:  # noqa: BLE001 -- a config that does not build (smem): reported
                        fused[cfg] = f"{type(e).__name__}: {str(e)[:120]}"
                row["fused_q8"] = fused
                times = {c: v for c, v in fused.items() if isinstance(v, float) and not is_gluon(c)}
                best = min(times, key=times.get)
                row["best"], row["fused_q8_best"] = best, times[best]
                gtimes = {c: v for c, v in fused.items() if isinstance(v, float) and is_gluon(c)}
                if gtimes:
                    gbest = min(gtimes, key=gtimes.get)
                    row["gluon_best"], row["gluon_q8"] = gbest, gtimes[gbest]
                    # the Gluon kernel vs the unfused q8 step on cuBLAS's dW (the GEMM's summation order only)
                    w_c, st_c = w.clone(), copy_states(st8)
                    wq.launch_wgrad_update_q8(w_c, dy_t, x, st_c, hp, rule, key=key, salt=1, **launch_kw(gbest))
                    row["check_gluon_max_dw"] = (w_c - w_b).abs().max().item()
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "q8.json"), "w") as f:
        json.dump(dict(meta=meta, checks=checks, rows=rows), f, indent=1)
    print(f"\n{meta}\n")
    print("| rule | shape | M | unfused fp32 | fused fp32 | unfused q8 | blocked q8 | Triton fused q8 (best) | "
          "Gluon q8 (best) | floor q8 | mm | unfused fp32 / Gluon q8 | fused fp32 / Gluon q8 | blocked q8 / Gluon q8 | "
          "Gluon q8 / mm | unfused fp32 / blocked q8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, bl, gq = r["fused_q8_best"], r["blocked_q8"], r.get("gluon_q8")
        gcols = (f"{gq:.4f} ({r['gluon_best']})", f"{r['unfused_fp32'] / gq:.2f}x", f"{r['fused_fp32'] / gq:.2f}x",
                 f"{bl / gq:.2f}x", f"{gq / r['mm']:.2f}") if gq else ("-",) * 5
        print(f"| {r['rule']} | {r['n']}x{r['k']} | {r['m']} | {r['unfused_fp32']:.4f} | {r['fused_fp32']:.4f} | "
              f"{r['unfused_q8']:.4f} | {bl:.4f} | {b:.4f} ({r['best']}) | {gcols[0]} | {r['floor_q8']:.4f} | "
              f"{r['mm']:.4f} | {' | '.join(gcols[1:])} | {r['unfused_fp32'] / bl:.2f}x |")
    print("\nper config (ms):")
    for r in rows:
        print(r["rule"], f"{r['n']}x{r['k']}", r["m"],
              " ".join(f"{c}={v:.4f}" if isinstance(v, float) else f"{c}=({v})" for c, v in r["fused_q8"].items()))
    if not all(all(v.values()) for v in checks.values()):
        print("EXACTNESS CHECK FAILED:", checks)
        sys.exit(1)


if __name__ == "__main__":
    main()
