"""Host time of one fused launch, layer by layer, on one GPU (issue 5: the forge routes were host-bound).

  python benchmarks/bench_launch_overhead.py [--out DIR] [--calls 3000]

A tiny shape (256x256 AdamW, 64 bf16 tokens) keeps the kernel itself at a few microseconds, so the time of
a call with no synchronization inside the loop is the host's: the CPU enqueues faster than the GPU drains
only while the host part is the slower one. Rows, each adding one layer above the previous:
  kernel  - the Triton launch alone (``bound_launch``: host part done once); kernel_gluon: the same for the
            Gluon kernel where ``launch`` picks it
  launch  - ``launch_wgrad_update``: checks, memoized host scalars, config, launch, scalar-state update; the
            same tensors every call, so after two calls launch_memo's fast path (``launch_full``: with it off)
  op      - ``torch.ops.forge.wgrad_update_`` (what Inductor's compiled backward calls): dispatcher + impl
  op_cycle - the op over --layers layers of their own tensors in turn, as a backward launches them (cold caches);
            op_cycle_no_direct: the same with launch_memo.DIRECT off (memo hits through ``CompiledKernel[grid]``)
  *_tf32  - fp32 activations under TF32 (the Gluon kernel on K-major copies): copies_tf32 = the two copies alone,
            op_tf32_full = the op with the memo off, op_tf32 / op_cycle_tf32 as op / op_cycle
  q8_*    - 8-bit states (forge.optim.AdamW8bit's format): q8_op / q8_op_full = ``forge::wgrad_update_q8_`` (the
            blocked path: cuBLAS into one row block, then the stored-dW update) with launch_memo on / off;
            q8_fused = the same op on the fused kernel (FORGE_Q8_PATH=fused); q8_apply = ``forge::apply_rule_q8_``
            (the eager AdamW8bit step's update of one stored gradient)
and, for scale, ``unfused`` = bench_wgrad_update's baseline: cuBLAS wgrad + ``torch._fused_adamw_``.
--profile-q8 profiles the 8-bit op alone (cProfile + torch.profiler); --profile-mm times the ways to get the blocked
8-bit path's fp32 dW block from bf16 operands (torch.mm(out_dtype=...) and its overloads, per BLAS library).
Results: stdout and DIR/launch_overhead.json.
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

import forge_compile  # noqa: E402,F401  (registers forge::wgrad_update_)
from forge_compile.kernels.wgrad_update import wgrad_update  # noqa: E402
from forge_compile.kernels import launch_memo  # noqa: E402
from forge_compile.kernels import wgrad_update_gluon as wg  # noqa: E402
from forge_compile.kernels import wgrad_update_triton as wt  # noqa: E402
from bench_wgrad_update import make_inputs, make_unfused  # noqa: E402  (this folder)


def per_call_us(fn, calls, reset):
    for _ in range(50):
        fn(); reset()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn(); reset()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def layer_cycle(op, rule, layers):
    """(call, reset): the op over ``layers`` (make_inputs tails) in turn, as a backward launches them; reset puts the
    next layer's step back (the same host-scalar values at every call: the memoized path)."""
    turn = [0]

    def cycle():
        lw, ldy, lx, lst, lhp = layers[turn[0]]
        turn[0] = (turn[0] + 1) % len(layers)
        op(lw, ldy, lx, lst, lhp, rule.name)

    def reset_all():
        layers[turn[0]][3][0].fill_(10.0)

    return cycle, reset_all


def tf32_rows(a, rule, n, k, m) -> dict:
    op = torch.ops.forge.wgrad_update_.default
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        _, w, dy_t, x, states, hp = make_inputs("adamw", torch.float32, n, k, m)
        if not wg.use_gluon(w, dy_t, x, states, rule):
            return {}
        step = states[0]

        def reset():
            step.fill_(10.0)

        rows = {"copies_tf32": per_call_us(lambda: wg.kmajor_copies(dy_t, x), a.calls, lambda: None)}
        launch_memo.ENABLED[0] = False
        rows["op_tf32_full"] = per_call_us(lambda: op(w, dy_t, x, states, hp, rule.name), a.calls, reset)
        launch_memo.ENABLED[0] = True
        rows["op_tf32"] = per_call_us(lambda: op(w, dy_t, x, states, hp, rule.name), a.calls, reset)
        layers = [make_inputs("adamw", torch.float32, n, k, m)[1:] for _ in range(a.layers)]
        cycle, reset_all = layer_cycle(op, rule, layers)
        rows["op_cycle_tf32"] = per_call_us(cycle, a.calls, reset_all)
        return rows
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
        launch_memo.ENABLED[0] = True


def q8_rows(a, n, k, m) -> dict:
    from forge_compile.kernels import q8_state
    from forge_compile.kernels.wgrad_update_q8 import empty_q8_state

    rule, w, dy_t, x, states, hp = make_inputs("adamw", torch.bfloat16, n, k, m)
    step = torch.tensor(10.0)
    pairs = [empty_q8_state(w) for _ in range(2)]
    for c, sc in pairs:   # nonzero states (a zero block takes no different path, but be representative)
        c.copy_(q8_state.quantize(torch.rand(n, k, device=w.device) * 1e-3, 1)[0])
        sc.fill_(1e-5)
    codes, scales = [c for c, _ in pairs], [sc for _, sc in pairs]
    key = torch.tensor(12345)
    grad = torch.randn(n, k, device=w.device)
    op = torch.ops.forge.wgrad_update_q8_.default
    apply = torch.ops.forge.apply_rule_q8_.default

    def reset():
        step.fill_(10.0)

    def call():
        op(w, dy_t, x, codes, scales, [step], hp, rule.name, key, 3)
    rows = {}
    old = os.environ.get("FORGE_Q8_PATH")
    try:
        os.environ["FORGE_Q8_PATH"] = "blocked"
        launch_memo.ENABLED[0] = False
        rows["q8_op_full"] = per_call_us(call, a.calls, reset)
        launch_memo.ENABLED[0] = True
        rows["q8_op"] = per_call_us(call, a.calls, reset)
        os.environ["FORGE_Q8_PATH"] = "fused"
        rows["q8_fused"] = per_call_us(call, a.calls, reset)
    finally:
        launch_memo.ENABLED[0] = True
        if old is None:
            os.environ.pop("FORGE_Q8_PATH", None)
        else:
            os.environ["FORGE_Q8_PATH"] = old
    rows["q8_apply"] = per_call_us(lambda: apply(w, grad, codes, scales, [step], hp, rule.name, key, 3), a.calls,
                                   reset)
    return rows


def profile_q8(a, n, k, m) -> None:
    """cProfile (host) and torch.profiler (ops) of the 8-bit blocked op, memo on: what its host time goes to beyond
    the fused op's (stop 44: ~80 us more per call, where cuBLAS mm + torch._fused_adamw_ take 31 us together)."""
    import cProfile
    import io
    import pstats

    from forge_compile.kernels.wgrad_update_q8 import empty_q8_state

    rule, w, dy_t, x, states, hp = make_inputs("adamw", torch.bfloat16, n, k, m)
    step = torch.tensor(10.0)
    pairs = [empty_q8_state(w) for _ in range(2)]
    codes, scales = [c for c, _ in pairs], [sc for _, sc in pairs]
    key = torch.tensor(12345)
    op = torch.ops.forge.wgrad_update_q8_.default
    out = []
    for path in ("blocked", "fused"):
        os.environ["FORGE_Q8_PATH"] = path

        def call():
            op(w, dy_t, x, codes, scales, [step], hp, rule.name, key, 3)
            step.fill_(10.0)
        us = per_call_us(call, a.calls, lambda: None)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            call()
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            for _ in range(200):
                call()
            torch.cuda.synchronize()
        ops = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        out.append(f"===== {path}: {us:.1f} us/call ({a.calls} calls)\n{buf.getvalue()}\n--- ops, 200 calls\n{ops}\n")
    os.environ.pop("FORGE_Q8_PATH", None)
    text = "\n".join(out)
    with open(os.path.join(a.out, "q8_profile.txt"), "w") as f:
        f.write(text)
    print(text)


def profile_mm(a) -> None:
    """Host us per call of the ways to get an fp32 dW block from bf16 dY and X (the blocked 8-bit path's GEMM;
    stop 45 measured torch.mm(out_dtype=float32) at ~46 us of host per call against ~8 for a bf16 mm), each checked
    bitwise against ``torch.mm(out_dtype=float32)``, then torch.profiler's CPU + CUDA-runtime table of that call."""
    torch.manual_seed(0)
    dev = "cuda"
    n, k, m = 256, 256, 64
    dy_t = torch.randn(n, m, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    buf = torch.empty(n, k, device=dev)
    ref = torch.mm(dy_t, x, out_dtype=torch.float32)
    variants = {
        "mm_bf16 (bf16 out, for scale)": lambda: torch.mm(dy_t, x),
        "mm_out_dtype": lambda: torch.mm(dy_t, x, out_dtype=torch.float32),
        "mm_out_dtype_out=": lambda: torch.mm(dy_t, x, out_dtype=torch.float32, out=buf),
        "aten.mm.dtype": lambda: torch.ops.aten.mm.dtype(dy_t, x, torch.float32),
        "aten.mm.dtype_out": lambda: torch.ops.aten.mm.dtype_out(dy_t, x, torch.float32, out=buf),
        "addmm_dtype_out beta=0": lambda: torch.addmm(buf, dy_t, x, beta=0, out_dtype=torch.float32, out=buf),
        "mm_fp32 inputs (not the same GEMM)": lambda: torch.mm(dy_t.float(), x.float()),
    }
    rows, lines = {}, []
    for lib in ("default", "cublas", "cublaslt"):
        old = torch.backends.cuda.preferred_blas_library()
        try:
            if lib != "default":
                torch.backends.cuda.preferred_blas_library(lib)
            for name, fn in variants.items():
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    same = (None if out.dtype != torch.float32 or "not the same" in name
                            else bool(torch.equal(out, ref)))
                    us = per_call_us(fn, a.calls, lambda: None)
                except Exception as e:  # an overload missing on this torch: say so, go on
                    lines.append(f"{lib:9s} {name:36s} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                rows[f"{lib}/{name}"] = us
                lines.append(f"{lib:9s} {name:36s} {us:7.1f} us/call  bitwise={same}")
        finally:
            torch.backends.cuda.preferred_blas_library(old)
    for name in ("mm_out_dtype", "mm_out_dtype_out=", "mm_bf16 (bf16 out, for scale)"):
        fn = variants[name]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as tp:
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
        lines.append(f"--- {name}, 200 calls\n" + tp.key_averages().table(sort_by="self_cpu_time_total",
                                                                          row_limit=18))
    text = "\n".join(lines)
    with open(os.path.join(a.out, "mm_profile.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "mm_profile.json"), "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "us_per_call": rows}, f,
                  indent=1)
    print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--layers", type=int, default=57, help="layers of the op_cycle rows (the full preset has 57)")
    ap.add_argument("--profile-q8", action="store_true", help="only profile the 8-bit op: DIR/q8_profile.txt")
    ap.add_argument("--profile-mm", action="store_true",
                    help="only time and profile the fp32-out GEMM variants of the blocked 8-bit path: DIR/mm_profile.*")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    n = k = 256
    m = 64
    if a.profile_q8:
        profile_q8(a, n, k, m)
        return
    if a.profile_mm:
        profile_mm(a)
        return
    # the kernel benchmark's inputs and unfused baseline (cuBLAS wgrad + torch._fused_adamw_), at a tiny shape
    rule, w, dy_t, x, states, hp = make_inputs("adamw", torch.bfloat16, n, k, m)
    step = states[0]

    def reset():
        step.fill_(10.0)   # same host-scalar values every call: the memoized path, as for most linears

    kern = wt.bound_launch(w, dy_t, x, states, hp, rule)
    op = torch.ops.forge.wgrad_update_.default
    if wg.use_gluon(w, dy_t, x, states, rule):   # what launch_wgrad_update picks here (auto on sm_90)
        rows0 = {"kernel_gluon": per_call_us(wg.bound_launch(w, dy_t, x, states, hp, rule), a.calls, lambda: None)}
    else:
        rows0 = {}
    launch_memo.ENABLED[0] = False
    full = per_call_us(lambda: wt.launch_wgrad_update(w, dy_t, x, states, hp, rule), a.calls, reset)
    launch_memo.ENABLED[0] = True
    rows = {
        "kernel": per_call_us(kern, a.calls, lambda: None),
        **rows0,
        "launch_full": full,
        "launch": per_call_us(lambda: wt.launch_wgrad_update(w, dy_t, x, states, hp, rule), a.calls, reset),
        "wgrad_update": per_call_us(lambda: wgrad_update(w, dy_t, x, states, hp, rule.name), a.calls, reset),
        "op": per_call_us(lambda: op(w, dy_t, x, states, hp, rule.name), a.calls, reset),
    }
    # a model's backward: many layers, each its own tensors and memo entry, launched in turn (the microbenchmark
    # above repeats one launch with hot caches); with and without the direct C-launcher entry on memo hits
    layers = [make_inputs("adamw", torch.bfloat16, n, k, m)[1:] for _ in range(a.layers)]
    cycle, reset_all = layer_cycle(op, rule, layers)
    rows["op_cycle"] = per_call_us(cycle, a.calls, reset_all)
    launch_memo.DIRECT[0] = False
    launch_memo.clear()
    rows["op_cycle_no_direct"] = per_call_us(cycle, a.calls, reset_all)
    launch_memo.DIRECT[0] = True
    # fp32 activations under TF32 (the Gluon kernel on K-major copies of dY and X, made before the memo lookup,
    # whose addresses join the key): the op with the same tensors, memo on and off, and the 57-layer cycle
    rows.update(tf32_rows(a, rule, n, k, m))
    rows.update(q8_rows(a, n, k, m))
    unfused, _ = make_unfused("adamw", rule, w, dy_t, x, states, hp)
    rows["unfused"] = per_call_us(unfused, a.calls, lambda: None)
    import triton
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "shape": f"{n}x{k}, M={m}, bf16 activations, AdamW", "us_per_call": rows,
            "launch_memo": dict(launch_memo.counters)}
    for name, us in rows.items():
        print(f"{name:14s} {us:8.1f} us/call")
    print(f"launch_memo counters {dict(launch_memo.counters)} enabled {launch_memo.ENABLED[0]} "
          f"error {launch_memo.LAST_ERROR[0]!r}")
    with open(os.path.join(a.out, "launch_overhead.json"), "w") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
