"""Where a train step's time goes (issue 5: is the small-batch forge step host-bound?).

  python benchmarks/profile_train_step.py --out DIR [--routes baseline,step,backend] [--mb 2] [--layers 2]
  python benchmarks/profile_train_step.py --diff DIR/kernels_baseline.tsv DIR/kernels_step.tsv

Builds the model and routes of bench_train_step.py (same code), runs warm-up steps, then profiles N steps with
torch.profiler. Per route it writes DIR/profile_<route>.txt: wall ms per step (perf_counter around N steps,
synchronized), GPU busy ms per step (sum of device kernel time; kernels overlap little in one stream), the
host time per step spent outside the compiled graphs, and the top operators by self CPU time and by device
time. Host-bound: wall >> GPU busy. On CUDA also the timeline of the profiled steps (``timeline_stats``): the
union of kernel intervals (GPU busy without double counting), the GPU's idle gaps, the launch API calls (a launch
that blocks for tens of us means the launch queue is full: the GPU, not the host, sets the pace) and the
synchronizing API calls (the host waits for the GPU inside the step).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train_step as B  # noqa: E402


# runtime API calls that launch work / make the host wait for the device
_LAUNCH_API = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
_SYNC_API = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
             "cudaStreamWaitEvent")
_BLOCKED_US = 20.0    # a launch call this long waited (a free one takes a few us)


def timeline_stats(events, n_steps):
    """Per step, from torch.profiler events (name, device_type, time_range in us): GPU busy ms (union of device
    kernel intervals), the number and ms of idle gaps between them longer than 5 us, launch calls (count, ms, how
    many took >= _BLOCKED_US, their ms) and synchronizing calls (count, ms; cudaMemcpy counts only when not Async)."""
    from torch.autograd import DeviceType
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    busy, gaps, gap_us, cur = 0.0, 0, 0.0, None
    for a, b in kernels:
        if cur is None:
            cur = [a, b]
        elif a <= cur[1]:
            cur[1] = max(cur[1], b)
        else:
            busy += cur[1] - cur[0]
            if a - cur[1] > 5.0:
                gaps += 1
                gap_us += a - cur[1]
            cur = [a, b]
    if cur is not None:
        busy += cur[1] - cur[0]
    launch = [e.time_range.end - e.time_range.start for e in events
              if e.device_type == DeviceType.CPU and e.name in _LAUNCH_API]
    sync = [e.time_range.end - e.time_range.start for e in events
            if e.device_type == DeviceType.CPU and e.name in _SYNC_API]
    blocked = [d for d in launch if d >= _BLOCKED_US]
    n = max(1, n_steps)
    return dict(gpu_busy_ms=busy / 1e3 / n, gpu_gaps=gaps / n, gpu_gap_ms=gap_us / 1e3 / n,
                launches=len(launch) / n, launch_ms=sum(launch) / 1e3 / n, blocked_launches=len(blocked) / n,
                blocked_launch_ms=sum(blocked) / 1e3 / n, syncs=len(sync) / n, sync_ms=sum(sync) / 1e3 / n)


# kernel name -> group, first match wins (Inductor names its kernels after the ops it fused: a kernel that only
# casts is triton_poi_fused__to_copy_<n>, possibly with views/transposes in the name)
KERNEL_GROUPS = [
    ("forge fused wgrad+update", ("wgrad_update",)),
    ("forge rule update", ("rule_update",)),
    ("torch fused optimizer", ("fused_adam", "FusedAdam", "multi_tensor_apply", "fused_sgd")),
    ("GEMM (cuBLAS/CUTLASS)", ("nvjet", "gemm", "xmma", "cutlass", "sm90_", "ampere_", "mm_")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("casts only (Inductor)", ("triton_poi_fused__to_copy_",)),
    ("Inductor pointwise", ("triton_poi",)),
    ("Inductor reductions", ("triton_red", "triton_per")),
    ("copies/fills (torch)", ("elementwise_kernel", "vectorized_elementwise", "memcpy", "memset", "fill")),
]


def kernel_group(name: str) -> str:
    for group, keys in KERNEL_GROUPS:
        if any(k in name for k in keys):
            if group == "casts only (Inductor)" and not all(
                    part in ("to", "copy", "t", "view", "transpose", "permute", "") or part.isdigit()
                    for part in name[len("triton_poi_fused_"):].split("_")):
                continue
            return group
    return "other"


def kernel_totals(events) -> dict:
    """kernel name -> (device us, launches) over the profiled steps."""
    from torch.autograd import DeviceType
    per = {}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            us, k = per.get(e.name, (0.0, 0))
            per[e.name] = (us + e.time_range.end - e.time_range.start, k + 1)
    return per


def group_totals(per_name: dict) -> dict:
    """kernel_totals (or a read kernel table) summed by kernel_group."""
    out = {}
    for name, (us, k) in per_name.items():
        gus, gk = out.get(kernel_group(name), (0.0, 0))
        out[kernel_group(name)] = (gus + us, gk + k)
    return out


def kernel_groups(events, n_steps) -> list:
    """(group, device us per step, launches per step), largest first."""
    n = max(1, n_steps)
    return sorted(((g, us / n, k / n) for g, (us, k) in group_totals(kernel_totals(events)).items()),
                  key=lambda r: -r[1])


def write_kernel_table(events, n_steps, path):
    n = max(1, n_steps)
    with open(path, "w") as f:
        f.write("us_per_step\tcalls_per_step\tname\n")
        for name, (us, k) in sorted(kernel_totals(events).items(), key=lambda kv: -kv[1][0]):
            f.write(f"{us / n:.1f}\t{k / n:g}\t{name[:200]}\n")


def read_kernel_table(path) -> dict:
    out = {}
    with open(path) as f:
        for line in f.read().splitlines()[1:]:
            us, k, name = line.split("\t", 2)
            out[name] = (float(us), float(k))
    return out


def diff_kernel_tables(path_a, path_b, rows: int = 40) -> list:
    """Lines: total device us per step of A and B, then the kernels whose us per step differ most (B - A), and the
    same by kernel group."""
    a, b = read_kernel_table(path_a), read_kernel_table(path_b)
    lines = [f"A {path_a}: {sum(v[0] for v in a.values()):.1f} us/step; B {path_b}: "
             f"{sum(v[0] for v in b.values()):.1f} us/step", "", "by group: B - A us/step (A, B)"]
    ga = {g: us for g, (us, _) in group_totals(a).items()}
    gb = {g: us for g, (us, _) in group_totals(b).items()}
    for grp in sorted(set(ga) | set(gb), key=lambda x: -abs(gb.get(x, 0) - ga.get(x, 0))):
        lines.append(f"{gb.get(grp, 0) - ga.get(grp, 0):+9.1f}  ({ga.get(grp, 0):8.1f}, {gb.get(grp, 0):8.1f})  {grp}")
    lines += ["", "by kernel: B - A us/step (A us, launches; B us, launches)"]
    for name in sorted(set(a) | set(b), key=lambda x: -abs(b.get(x, (0, 0))[0] - a.get(x, (0, 0))[0]))[:rows]:
        (ua, ka), (ub, kb) = a.get(name, (0.0, 0)), b.get(name, (0.0, 0))
        lines.append(f"{ub - ua:+9.1f}  ({ua:8.1f}, {ka:g}; {ub:8.1f}, {kb:g})  {name[:110]}")
    return lines


def profile_route(route, args, out):
    device = torch.device(args.device)
    Llama = B.load_llama()
    with torch.device(device):
        torch.manual_seed(0)
        model = Llama(args.d_model, args.layers, args.heads, args.d_ff, args.seq_len, args.vocab,
                      checkpoint=args.checkpoint)
    wl = B.WithLoss(model, args.vocab)
    opt, fused, note = B.build_optimizer(model, route, 1e-3)
    cuda = device.type == "cuda"
    bf16 = cuda and not args.tf32
    if args.tf32:   # fp32 activations, TF32 matmuls (bench_train_step --fp32 --tf32)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = ((lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)) if bf16
                else contextlib.nullcontext)
    step, _ = B.make_step(route, wl, opt, autocast)
    batches = [B.random_batch(args.mb, args.seq_len, args.vocab, device) for _ in range(args.steps)]
    for x, y in batches[:3]:
        step(x, y)
    B.sync(device)
    t0 = time.perf_counter()
    for x, y in batches:
        step(x, y)
    B.sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / len(batches)
    # Host time of one step when the device is never waited on: enqueue only (no sync inside the step).
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for x, y in batches:
            step(x, y)
        B.sync(device)
    if args.cprofile:   # Python-level host cost of the steps (who spends the host's time when host-bound)
        B.profile_steps(step, batches, device, os.path.join(out, f"profile_{route}_host.txt"),
                        f" of route {route}")
    ka = prof.key_averages()
    dev_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in ka)
    lines = [f"route {route} mb {args.mb} seq {args.seq_len} d_model {args.d_model} layers {args.layers} "
             f"adamw_fused {fused} {note}",
             f"wall ms/step (no profiler): {wall_ms:.3f}",
             f"device busy ms/step (profiler, sum of self device time): {dev_us / 1e3 / len(batches):.3f}"]
    if cuda:
        # the last synchronize is outside the steps' work but inside the profile: it counts as one sync
        t = timeline_stats(prof.events(), len(batches))
        lines.append("timeline per step (profiler): " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
        lines += ["", "== device time per step by kernel group (us, launches) =="]
        lines += [f"{g:<28} {us:9.1f} {k:6g}" for g, us, k in kernel_groups(prof.events(), len(batches))]
    lines += ["", "== top by self CPU time ==",
             ka.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=70)]
    if cuda:
        lines += ["", "== top by device time ==",
                  ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)]
    text = "\n".join(lines)
    with open(os.path.join(out, f"profile_{route}.txt"), "w") as f:
        f.write(text)
    if cuda:
        # every kernel name with its launches and device us per step: diff two routes' files to see which kernels
        # one of them adds or slows (kernels replayed from a CUDA graph are listed like launched ones)
        write_kernel_table(prof.events(), len(batches), os.path.join(out, f"kernels_{route}.tsv"))
    print("\n".join(lines[:4 if cuda else 3]), flush=True)
    if cuda:
        print("\n".join(lines[5:lines.index("== top by self CPU time ==") - 1]), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "profile_out"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--routes", default="baseline,step,backend")
    p.add_argument("--mb", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing per decoder layer")
    p.add_argument("--tf32", action="store_true", help="fp32 activations with TF32 matmuls instead of bf16 autocast")
    p.add_argument("--cprofile", action="store_true", help="also cProfile the steps: DIR/profile_<route>_host.txt")
    for k, v in B.PRESETS["quick"].items():
        if k in ("d_model", "layers", "heads", "d_ff", "vocab", "seq_len"):
            p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--diff", nargs=2, metavar=("A_TSV", "B_TSV"),
                   help="no profiling: compare two kernels_<route>.tsv files of earlier runs")
    args = p.parse_args()
    if args.diff:
        print("\n".join(diff_kernel_tables(*args.diff)))
        return
    os.makedirs(args.out, exist_ok=True)
    for route in args.routes.split(","):
        try:
            profile_route(route, args, args.out)
        except Exception as e:  # noqa: BLE001  one route failing must not hide the others
            print(f"{route}: {type(e).__name__}: {e}", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
