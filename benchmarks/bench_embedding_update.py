"""forge::embedding_update_table_ (an embedding's AdamW update from its backward input, no dense gradient) vs the
unfused paths, on one GPU.

  python benchmarks/bench_embedding_update.py [--out DIR] [--rep N]

Unfused, as the routes run it: torch's dense embedding gradient (``embedding_dense_backward``: zeros, then the rows
of the tokens added) followed by forge::rule_update_ (the graphed step's update of an unfused parameter) or by
torch's fused AdamW (the baseline's optimizer). Fused: the compact rows (kernels/embedding_update.compact_rows) and
one pass over W/m/v. Shapes: bench_train_step's full-preset embedding (32000 x 2048) and Llama-3's (128256 x 4096)
at 2048 and 4096 tokens. Check before timing: W/states after the fused launch bitwise those of the dense gradient +
rule_update_ on the same inputs. Medians of triton.testing.do_bench. Prediction (NOTES_kernel.md, "embedding"):
the fused update saves the dense gradient's zero fill and its read, ~8 of ~32 bytes per parameter: 32000 x 2048
~0.12-0.15 ms of ~0.5 ms.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = [(32000, 2048, 2048), (32000, 2048, 4096), (128256, 4096, 2048), (128256, 4096, 4096)]
HP = (1e-3, 0.9, 0.999, 1e-8, 0.01)   # lr, beta1, beta2, eps, weight_decay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rep", type=int, default=25)
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    from forge_compile.kernels.embedding_update import embedding_update_table
    from forge_compile.kernels.rule_update import launch_rule_update
    from forge_compile.kernels.wgrad_update_triton import rule_scalars
    from forge_compile.optim.rules import adamw_rule

    aten = torch.ops.aten
    rule = adamw_rule()
    lines = [f"date {datetime.datetime.now().isoformat(timespec='seconds')}  GPU {torch.cuda.get_device_name()}  "
             f"torch {torch.__version__}  triton {triton.__version__}",
             f"{'V x K':>12} {'tokens':>7} {'dense+fused_adamw':>18} {'dense+rule_update':>18} {'fused':>8} "
             f"{'vs rule_update':>15} {'vs fused_adamw':>15} exact"]
    ok_all = True
    for v_rows, k, tokens in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        p = torch.randn(v_rows, k, device="cuda", generator=g)
        m = torch.randn(v_rows, k, device="cuda", generator=g) * 1e-3
        v = torch.rand(v_rows, k, device="cuda", generator=g) * 1e-4
        idx = torch.randint(0, v_rows, (tokens,), device="cuda", generator=g)
        go = torch.randn(tokens, k, device="cuda", generator=g)
        hp = [torch.tensor(x, dtype=torch.float64) for x in HP]
        vals, _ = rule_scalars(rule, [torch.tensor(10.0)], hp)
        table = torch.tensor(vals, dtype=torch.float32, device="cuda")

        def dense():
            return aten.embedding_dense_backward(go, idx, v_rows, -1, False)
        pe, me, ve = p.clone(), m.clone(), v.clone()
        launch_rule_update(pe, dense(), [me, ve], table, rule)
        pf, mf, vf = p.clone(), m.clone(), v.clone()
        embedding_update_table(pf, go, idx, [mf, vf], table, rule.name, -1)
        same = torch.equal(pf, pe) and torch.equal(mf, me) and torch.equal(vf, ve)
        ok_all &= same
        del pe, me, ve, pf, mf, vf
        stepf = torch.tensor(11.0, device="cuda")

        def unfused_adamw():
            torch._fused_adamw_([p], [dense()], [m], [v], [], [stepf], lr=HP[0], beta1=HP[1], beta2=HP[2],
                                weight_decay=HP[4], eps=HP[3], amsgrad=False, maximize=False)
        t_a = do_bench(unfused_adamw, warmup=10, rep=args.rep, return_mode="median")
        t_r = do_bench(lambda: launch_rule_update(p, dense(), [m, v], table, rule), warmup=10, rep=args.rep,
                       return_mode="median")
        t_f = do_bench(lambda: embedding_update_table(p, go, idx, [m, v], table, rule.name, -1), warmup=10,
                       rep=args.rep, return_mode="median")
        lines.append(f"{f'{v_rows}x{k}':>12} {tokens:>7} {t_a:18.4f} {t_r:18.4f} {t_f:8.4f} {t_r / t_f:14.2f}x "
                     f"{t_a / t_f:14.2f}x {same}")
        print(lines[-1], flush=True)
        p = m = v = None   # freed before the next case allocates its arrays
        torch.cuda.empty_cache()
    lines.append(f"checks {'OK' if ok_all else 'FAILED'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_embedding_update.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
