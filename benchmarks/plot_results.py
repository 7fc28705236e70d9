"""Plots of the two benchmarks' JSON results (the issue's "optional plot"); matplotlib, no display needed.

  python benchmarks/plot_results.py kernel OUT/bench.json kernel.png     # bench_wgrad_update.py --out OUT
  python benchmarks/plot_results.py e2e OUT/results.json e2e.png         # bench_train_step.py --out OUT
(both benchmarks also take --plot PATH and call this after writing their JSON).

kernel: per case (rule, activations, shape) the speedup of the fused step over the unfused one (cuBLAS wgrad +
torch's fused optimizer) against M, the fused path being the faster of forge's Triton and Gluon kernels, and
dashed the roofline ceiling (unfused / floor): how far each point is from what the memory traffic allows.
e2e: tokens/s per route and micro-batch, the speedup over the baseline on each bar.
"""
from __future__ import annotations

import json
import math
import sys


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_kernel(bench: dict, path: str) -> str:
    plt = _plt()
    series = {}
    for r in bench["rows"]:
        fused = min(v for v in (r.get("gluon_ms"), r.get("default_ms")) if v is not None and not math.isnan(v))
        key = f"{r['kind']} {r['act'][:4]} {r['n']}x{r['k']}"
        series.setdefault(key, []).append((r["m"], r["unfused_ms"] / fused, r["unfused_ms"] / r["floor_ms"]))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (key, pts) in enumerate(sorted(series.items())):
        pts.sort()
        color = f"C{i % 10}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=key)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=color, alpha=0.5)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speedup over cuBLAS wgrad + torch fused optimizer")
    meta = bench.get("meta", {})
    ax.set_title("fused wgrad + update (dashed: roofline ceiling)"
                 + (f"\n{meta.get('gpu', '')}, torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, "
                    f"{meta.get('date', '')}" if meta else ""), fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_e2e(results: dict, path: str) -> str:
    plt = _plt()
    rows = [r for r in results["analysis"]["rows"] if r.get("status") == "ok" and r.get("tokens_per_s")]
    routes = [r for r in results.get("routes", []) if any(x["route"] == r for x in rows)]
    mbs = sorted({r["mb"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.6 * len(mbs) * max(1, len(routes)) / 2), 5))
    width = 0.8 / max(1, len(routes))
    for j, route in enumerate(routes):
        for i, mb in enumerate(mbs):
            r = next((x for x in rows if x["route"] == route and x["mb"] == mb), None)
            if r is None:
                continue
            x = i + (j - (len(routes) - 1) / 2) * width
            ax.bar(x, r["tokens_per_s"], width, color=f"C{j}", label=route if i == 0 else None)
            if r.get("speedup") is not None:
                ax.text(x, r["tokens_per_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(mbs)))
    ax.set_xticklabels([f"mb {mb}\n{mb * results['config'].get('seq_len', 0)} tokens" for mb in mbs])
    ax.set_ylabel("tokens/s")
    cfg = results.get("config", {})
    ax.set_title(f"train step, d_model {cfg.get('d_model')}, {cfg.get('layers')} layers "
                 f"({cfg.get('device', '')})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in ("kernel", "e2e"):
        raise SystemExit(__doc__)
    with open(argv[1]) as f:
        data = json.load(f)
    print((plot_kernel if argv[0] == "kernel" else plot_e2e)(data, argv[2]))


if __name__ == "__main__":
    main()
