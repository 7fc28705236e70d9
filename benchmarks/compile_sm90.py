"""Compile forge's Gluon (and, with --triton, Triton) wgrad+update kernels for sm_90 on a machine without a GPU: smem, registers, spills, SASS.

Why: device time is scarce and the CPU sessions change kernels. This answers, before any GPU run, whether a change
compiles, what it costs in registers/spills/smem, and -- by a hash of the SASS with addresses stripped -- whether a
shipped kernel's machine code changed at all (a change that leaves it identical needs no new measurement).

Needs the GPU machine's triton (3.6) first on the path, e.g.
    pip install --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python benchmarks/compile_sm90.py --save /tmp/before.json
    ... change the kernel module ...
    PYTHONPATH=/tmp/t36 python benchmarks/compile_sm90.py --compare /tmp/before.json
A stub driver reports an sm_90 target; launches are prepared on CPU tensors (TensorDescriptors are host objects) and
compiled with ``warmup``; the bundled ptxas gives registers/spills, cuobjdump the SASS.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def stub_driver():
    """Make triton target sm_90 without a GPU (compiles only; nothing can launch)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Stub:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(_Stub())


def _specs(args):
    from forge_compile.kernels import wgrad_update_gluon as wg
    from forge_compile.optim import rules as R

    rules = {"adamw": R.adamw_rule(), "sgdm": R.sgd_rule(momentum=True), "lion": R.lion_rule()}
    layouts = {"tma": wg.GConfig(), "smem": wg.smem_config(), "split": wg.split_config(),
               "smem_h": wg.smem_config(hoist=True), "split_h": wg.split_config(hoist=True), "vec": wg.vec_config(),
               **{f"split_pf{r}": wg.split_config(l2pf=r) for r in (16, 32, 64)},
               "split_h_a6": wg.split_config(hoist=True, ahead=6), "split_h_a8": wg.split_config(hoist=True, ahead=8),
               "split_h_ld": wg.split_config(hoist=True, evict="ld"),
               # fp32 activations under TF32: the split kernel on K-major copies (compiled with fp32 dY / X)
               "tf32": wg.tf32_config(4096), "tf32_h": wg.tf32_config(1024),
               # the coop split kernel: 128x256 tiles, two MMA warpgroups, one epilogue warpgroup (stop 30)
               "coop": wg.coop_config(), "coop_h": wg.coop_config(hoist=True), "coop_r8": wg.coop_config(rows=8, ahead=2),
               "coop_b64": wg.coop_config(bmt=64, stages=2), "coop_nostream": wg.coop_config(stream=False),
               "tf32_coop": wg.coop_config(bmt=16), "tf32_coop_b32": wg.coop_config(bmt=32, stages=2)}
    for rname in args.rules.split(","):
        for q8 in filter(None, args.q8.split(",")):   # the 8-bit Gluon kernel (kernels/wgrad_update_q8_gluon.py)
            for table in ((False, True) if args.table == "both" else (args.table == "on",)):
                yield f"{rname}/q8:{q8}{'/table' if table else ''}", rules[rname], q8, ("q8", table), None
        for cname in filter(None, args.triton.split(",")):
            for side in [None] + (["cast"] if args.cast_out else []) + (["tied"] if args.tied else []):
                yield f"{rname}/triton:{cname}{'/' + args.act if args.act != 'bfloat16' else ''}" \
                      f"{'/tf32' if args.tf32 else ''}{'/' + side if side else ''}", rules[rname], cname, "triton", side
        for lname in filter(lambda v: v != "none", args.layouts.split(",")):
            if lname == "group":   # several weights in one launch (wgrad_update_group)
                for table in ((False, True) if args.table == "both" else (args.table == "on",)):
                    for side in [None] + (["cast"] if args.cast_out else []):
                        yield (f"{rname}/group{'/table' if table else ''}{'/' + side if side else ''}", rules[rname],
                               None, ("group", table), side)
                continue
            for table in ((False, True) if args.table == "both" else (args.table == "on",)):
                sides = ([None] + (["dw"] if args.grad_out else []) + (["cast"] if args.cast_out else [])
                         + (["tied"] if args.tied else []) + (["sr", "sr_f32", "sr_dw"] if args.sr else []))
                for side in sides:
                    if side and side.startswith("sr") and layouts[lname].epi not in ("smem", "split"):
                        continue    # stochastic rounding: the smem and split kernels (with a table: the key too)
                    if side == "cast" and layouts[lname].epi not in wg.POINTER_EPIS:
                        continue    # the TMA ring does not write the cast copy
                    if side == "tied" and layouts[lname].epi not in ("smem", "split"):
                        continue    # only these add a tied embedding's rows
                    yield f"{rname}/{lname}{'/table' if table else ''}{'/' + side if side else ''}", rules[rname], \
                        layouts[lname], table, side


def sass_text(cubin: bytes, cuobjdump: str | None = None) -> str:
    """cuobjdump -sass of a cubin (the cuobjdump beside triton's ptxas unless given)."""
    if cuobjdump is None:
        from triton.backends.nvidia.compiler import get_ptxas

        cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        r = subprocess.run([cuobjdump, "-sass", p], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError("cuobjdump: " + r.stderr[-800:])
    return r.stdout


def _sass_digest(cubin: bytes, cuobjdump: str):
    # instruction text only: "/*0a40*/  IMAD ... ;  /* 0x... */" -> "IMAD ... ;"
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?;)", sass_text(cubin, cuobjdump))]
    # the tensor-core instruction the GEMM compiled to (HGMMA: wgmma; HMMA: mma.sync; none: FMA)
    mma = next((op for op in ("HGMMA", "HMMA") if any(i.startswith(op) for i in ins)), "-")
    return (len(ins), hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16], sum("F2I" in i for i in ins),
            mma)


def compile_one(rule, cfg, table, side, n, k, m, act=torch.bfloat16):
    from forge_compile.kernels import wgrad_update_gluon as wg
    from forge_compile.kernels.epilogue_codegen import compile_epilogue
    from forge_compile.kernels.stochastic_round import TABLE_KEY
    from forge_compile.kernels.wgrad_update_triton import split_states

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    states = [torch.tensor(1.0) if rule.is_scalar_state(i) else torch.rand(n, k, generator=gen)
              for i in range(len(rule.states))]
    # stochastic rounding: a bf16 weight with bf16 states ("sr"), fp32 states ("sr_f32") or dW stored ("sr_dw")
    ekey = (TABLE_KEY if table else 12345) if side and side.startswith("sr") else None
    if ekey is not None:
        w = w.bfloat16()
        if side != "sr_f32":
            states = [s if s.dim() == 0 else s.bfloat16() for s in states]
    dy = torch.randn(m, n, generator=gen).to(act)
    x = torch.randn(m, k, generator=gen).to(act)
    hp = [torch.tensor(0.01, dtype=torch.float64) for _ in rule.hparams]
    # the side output: dW (fp32) or the new W's bf16 copy; or no side output and a tied embedding's rows
    grad = {None: None, "dw": torch.empty_like(w), "cast": torch.empty_like(w, dtype=torch.bfloat16),
            "tied": None, "sr": None, "sr_f32": None, "sr_dw": torch.empty_like(w, dtype=torch.float32)}[side]
    extra = (torch.randn(m, k, generator=gen), torch.zeros(n, dtype=torch.int32)) if side == "tied" else None
    tab = None
    if table:
        states = split_states(rule, states)[0]
        hp = []
        tab = torch.zeros(compile_epilogue(rule, "cuda").n_kernel_scalars + (ekey is not None))
    kernel, grid, kargs, opts = wg._prepare(w, dy.t(), x, states, hp, rule, grad, config=cfg, max_ctas=132,
                                            table=tab, extra=extra, ekey=ekey)[:4]
    ck = kernel.warmup(*kargs, grid=grid, **opts)
    return _ptxas_row(ck)


def compile_group(rule, n, k, m, members=3, table=False, side=None):
    """The grouped kernel (kernels/wgrad_update_group.py) for ``members`` weights [n, k] (the last one n - 56 rows
    long: a ragged member) sharing x [m, k]; ``table``: each member's scalar-table row; ``side="cast"``: each
    member's bf16 copy of its new W."""
    from forge_compile.kernels import wgrad_update_group as gr

    gen = torch.Generator().manual_seed(0)
    ns = [n] * (members - 1) + [n - 56]
    ws = [torch.randn(r, k, generator=gen) for r in ns]
    sts = [[torch.tensor(1.0) if rule.is_scalar_state(i) else torch.rand(r, k, generator=gen)
            for i in range(len(rule.states)) if not (table and rule.is_scalar_state(i))] for r in ns]
    dys = [torch.randn(m, r, generator=gen).bfloat16().t() for r in ns]
    x = torch.randn(m, k, generator=gen).bfloat16()
    hp = [torch.tensor(0.01, dtype=torch.float64) for _ in rule.hparams]
    tab = torch.zeros(members * 2, 16)
    casts = [torch.empty(r, k, dtype=torch.bfloat16) for r in ns] if side == "cast" else None
    kernel, grid, kargs, opts = gr._prepare(ws, dys, x, sts, [] if table else [hp] * members, rule, max_ctas=132,
                                            check_device=False, tables=[tab[2 * i] for i in range(members)]
                                            if table else None, side_outs=casts)[:4]
    return _ptxas_row(kernel.warmup(*kargs, grid=grid, **opts))


def compile_q8(rule, weight_dtype, table, n, k, m):
    """The 8-bit Gluon kernel (kernels/wgrad_update_q8_gluon.py) with an fp32 or bf16 (``weight_dtype``) weight and
    AdamW-style (codes, scales) states, the launch prepared on CPU tensors."""
    from forge_compile.kernels import wgrad_update_q8_gluon as qg
    from forge_compile.kernels.epilogue_codegen import compile_epilogue
    from forge_compile.kernels.wgrad_update_q8 import empty_q8_state

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    pairs = [(i, *empty_q8_state(w)) for i in range(len(rule.states)) if not rule.is_scalar_state(i)]
    dy = torch.randn(m, n, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    ep = compile_epilogue(rule, "cuda")
    scalars = [torch.zeros(ep.n_kernel_scalars + 1 + len(pairs))] if table else [0.5] * ep.n_kernel_scalars
    keys = [] if table else [12345] * (1 + len(pairs))
    kernel, grid, kargs, opts = qg.prepare(rule, w, dy.t(), x, pairs, scalars, keys, table=table, max_ctas=132)
    return _ptxas_row(kernel.warmup(*kargs, grid=grid, **opts))


def compile_triton(rule, name, act, tf32, side, n, k, m):
    """The Triton kernel (config ``name``) for sm_90: as compile_one, the launch prepared on CPU tensors (``side``:
    None, "cast" -- the new W's bf16 copy -- or "tied" -- a tied embedding's rows added to dW)."""
    from forge_compile.kernels import wgrad_update_triton as wt

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    tensor_states = [torch.rand(n, k, generator=gen) for i in range(len(rule.states)) if not rule.is_scalar_state(i)]
    dy = torch.randn(m, n, generator=gen).to(act)
    x = torch.randn(m, k, generator=gen).to(act)
    ep, kernel = wt._kernel_for(rule, "cuda")
    upcast = act == torch.float32
    side_out = torch.empty_like(w, dtype=torch.bfloat16) if side == "cast" else None
    extra = (torch.randn(m, k, generator=gen), torch.zeros(n, dtype=torch.int32)) if side == "tied" else None
    grid, kargs, opts = wt.launch_spec(wt.CONFIGS[name], w, dy.t(), x, tensor_states, side_out,
                                       [0.5] * ep.n_kernel_scalars, upcast, False, tf32, extra)
    ck = kernel.warmup(*kargs, grid=grid, **opts)
    return _ptxas_row(ck)


def _ptxas_row(ck):
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ck.asm["ptx"])
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", p, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError("ptxas: " + r.stderr[-1500:])
    regs = [int(v) for v in re.findall(r"Used (\d+) registers", r.stderr)]
    spills = max((int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                                          r.stderr)), default=0)
    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    n_ins, digest, f2i, mma = _sass_digest(ck.asm["cubin"], cuobjdump)
    return dict(smem_kb=round(ck.metadata.shared / 1024, 1), regs=max(regs, default=0), spills=spills,
                sass=n_ins, f2i=f2i, mma=mma, digest=digest)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", default="adamw,sgdm,lion")
    ap.add_argument("--layouts", default="tma,smem,split,vec",
                    help="Gluon layouts (and 'group': the grouped kernel of kernels/wgrad_update_group.py)")
    ap.add_argument("--table", choices=["off", "on", "both"], default="both",
                    help="kernels taking their scalars as arguments (off), from a table row (on), or both")
    ap.add_argument("--grad-out", action="store_true", help="also the variants that store dW (exactness tests)")
    ap.add_argument("--cast-out", action="store_true",
                    help="also the pointer epilogues' (and --triton configs') variants that store the new W's bf16 copy")
    ap.add_argument("--tied", action="store_true",
                    help="also the smem/split (and --triton) variants that add a tied embedding's gradient rows")
    ap.add_argument("--sr", action="store_true",
                    help="also the smem/split variants that store a bf16 weight stochastically rounded (bf16 "
                         "states, fp32 states, dW stored)")
    ap.add_argument("--shape", default="1024,1024,512", help="N,K,M of the prepared launch")
    ap.add_argument("--triton", default="", help="also (or, with --layouts none, only) these Triton kernel configs")
    ap.add_argument("--act", choices=["bfloat16", "float32"], default="bfloat16",
                    help="activation dtype of the --triton compiles")
    ap.add_argument("--tf32", action="store_true", help="--triton with float32: the TF32 dot (DOT_PREC)")
    ap.add_argument("--q8", default="", help="also the 8-bit Gluon kernel with these weight dtypes (float32,bfloat16)")
    ap.add_argument("--save", help="write the rows as JSON")
    ap.add_argument("--compare", help="a JSON from --save: report whose SASS changed")
    args = ap.parse_args(argv)
    stub_driver()
    n, k, m = (int(v) for v in args.shape.split(","))
    rows, failed = {}, []
    for name, rule, cfg, table, side in _specs(args):
        t0 = time.time()
        try:
            row = (compile_q8(rule, getattr(torch, cfg), table[1], n, k, m)
                   if isinstance(table, tuple) and table[0] == "q8" else
                   compile_triton(rule, cfg, getattr(torch, args.act), args.tf32, side, n, k, m) if table == "triton"
                   else compile_group(rule, n, k, m, table=table[1], side=side) if isinstance(table, tuple)
                   else compile_one(rule, cfg, table, side, n, k, m,
                                    torch.float32 if name.split("/")[1].startswith("tf32") else torch.bfloat16))
        except Exception as e:   # report and go on
            failed.append(name)
            print(f"{name:28s} FAILED {type(e).__name__}: {str(e)[-1200:]}", flush=True)
            continue
        rows[name] = row
        print(f"{name:28s} smem {row['smem_kb']:6.1f} KB  regs {row['regs']:3d}  spills {row['spills']:4d} B  "
              f"SASS {row['sass']:5d} (F2I {row['f2i']:2d}, {row['mma']:5s})  {row['digest']}  "
              f"{time.time() - t0:.0f}s", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(rows, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        same = [nm for nm in rows if nm in old and old[nm]["digest"] == rows[nm]["digest"]]
        changed = [nm for nm in rows if nm in old and old[nm]["digest"] != rows[nm]["digest"]]
        print(f"SASS identical: {len(same)}; changed: {len(changed)} {changed}; "
              f"not in {args.compare}: {[nm for nm in rows if nm not in old]}")
    print(f"compiled {len(rows)}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
