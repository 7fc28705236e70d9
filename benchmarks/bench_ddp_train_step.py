"""End to end under DistributedDataParallel: one Llama-style train step (bf16 autocast, fp32 master weights, AdamW)
on every GPU of the host, each rank its own batch, compile_train_step against torch.compile(DDP(model)) +
AdamW(fused=True) -- DDP's bucketed all-reduce of every gradient, Dynamo's DDPOptimizer splitting the graph at the
buckets -- in the same run, same model, same batches.

    python benchmarks/bench_ddp_train_step.py                    # every GPU, d_model 2048 / 4 layers, 1024 tokens per rank
    python benchmarks/bench_ddp_train_step.py --seq-len 512 --routes baseline,step_graphs

Per route, a fresh set of processes (one per GPU, NCCL): check steps (the losses of every route on the same batches
are compared to the baseline's, judged as bench_train_step.py judges them), then warm-up and timed steps (CUDA events
on rank 0 around each step, after a barrier; median). Printed last: ms per step, tokens/s over all ranks, the peak
memory of rank 0 and the fusion count. Routes: baseline, step (compile_train_step), step_graphs (cuda_graphs=True).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_step import LOSS_ATOL, WithLoss, _judged_steps, load_llama, make_optimizer  # noqa: E402

ROUTES = ("baseline", "step", "step_graphs")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, cfg, route, out_path, run=None):
    """One rank: its process group (NCCL on its own GPU; gloo for a CPU smoke run; ``cfg["pg_timeout"]`` seconds a
    collective may wait, if given), then ``run`` (default: this script's run_route); rank 0 writes the result."""
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:    # a smoke run of the script itself: gloo, tiny shapes
        device = torch.device("cpu")
    timeout = {"timeout": datetime.timedelta(seconds=cfg["pg_timeout"])} if cfg.get("pg_timeout") else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, **timeout)
    try:
        res = (run or run_route)(rank, world, device, cfg, route)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)


def route_step(model, opt, route, device):
    """The route's train step on ``model`` (bf16 autocast): torch.compile(model) with torch's eager optimizer step for
    the baseline, compile_train_step (step_graphs: replayed as a CUDA graph) for forge's routes."""
    fwd = torch.compile(model) if route == "baseline" else model

    def body(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if route != "baseline":
        import forge_compile as forge
        body = forge.compile_train_step(body, cuda_graphs=route == "step_graphs")
    return body


def run_route(rank, world, device, cfg, route) -> dict:
    Llama = load_llama()
    torch.manual_seed(0)
    model = Llama(cfg["d_model"], cfg["layers"], cfg["heads"], cfg["d_ff"], cfg["seq_len"], vocab=cfg["vocab"])
    wl = WithLoss(model, cfg["vocab"]).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(wl, device_ids=[rank] if device.type == "cuda" else None)
    opt = make_optimizer(ddp, cfg["lr"], fused=True)
    body = route_step(ddp, opt, route, device)
    report = None
    gen = torch.Generator().manual_seed(1000 + rank)

    def batch():
        idx = torch.randint(0, cfg["vocab"], (cfg["mb"], cfg["seq_len"] + 1), generator=gen).to(device)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    check = [batch() for _ in range(cfg["check_steps"])]
    losses = []
    for x, y in check:
        loss = body(x, y).detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    if route != "baseline":
        report = body.last_report
    for _ in range(cfg["warmup"]):
        body(*batch())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = timed_steps(body, [batch() for _ in range(cfg["iters"])], device)
    out = dict(route=route, losses=losses, ms=ms,
               peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0,
               fused=len(report.fused) if report else None,
               unfused=[(d.name, d.reason) for d in report.unfused if d.reason != "not a matrix (normal path)"]
               if report else None,
               notes=report.notes if report else None)
    return out


def timed_steps(body, batches, device) -> float:
    """The median ms of ``body(x, y)`` over ``batches``, each step timed after a barrier (CUDA events on a GPU), the
    slowest rank setting each step's time (the per-step maximum over the ranks)."""
    cuda = device.type == "cuda"
    times = []
    for x, y in batches:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            body(x, y)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            body(x, y)
            times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d-ff", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--world", type=int, default=0, help="processes (default: every GPU)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run over gloo")
    args = ap.parse_args(argv)
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and world > torch.cuda.device_count():
        sys.exit(f"bench_ddp_train_step: --world {world} needs as many GPUs (a GPU per rank)")
    cfg = dict(device=args.device, d_model=args.d_model, layers=args.layers, heads=args.heads, d_ff=args.d_ff, vocab=args.vocab,
               seq_len=args.seq_len, mb=args.mb, lr=args.lr, check_steps=args.check_steps, warmup=args.warmup,
               iters=args.iters)
    results = {}
    tmp = tempfile.mkdtemp()
    for route in args.routes.split(","):
        path = os.path.join(tmp, f"{route}.json")
        mp.spawn(worker, args=(world, free_port(), cfg, route, path), nprocs=world)
        with open(path) as f:
            results[route] = json.load(f)
        r = results[route]
        print(f"{route}: {r['ms']:.2f} ms/step, peak {r['peak_gib']:.2f} GiB, losses {r['losses']}", flush=True)
    base = results.get("baseline")
    tokens = world * args.mb * args.seq_len
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
    if world == 1:
        gpu += " (one rank: no communication; what the DDP machinery costs on one GPU)"
    head = (f"bench_ddp_train_step {datetime.date.today()} {gpu} x{world}, torch "
            f"{torch.__version__}, d_model {args.d_model}, {args.layers} layers, {tokens} tokens per step "
            f"({args.mb} x {args.seq_len} per rank), bf16 autocast, AdamW")
    rows = []
    for route, r in results.items():
        loss_ok = ""
        if base is not None and route != "baseline":
            k = _judged_steps(base["losses"])
            worst = max(abs(a - b) for a, b in zip(r["losses"][:k], base["losses"][:k]))
            loss_ok = f"{worst:.1e} {'ok' if worst <= LOSS_ATOL['bf16'] else 'FAIL'}"
        speed = f"{base['ms'] / r['ms']:.2f}x" if base else ""
        rows.append((route, f"{r['ms']:.2f}", f"{tokens / r['ms'] * 1e3:,.0f}", speed, f"{r['peak_gib']:.2f}",
                     "" if r["fused"] is None else str(r["fused"]), loss_ok))
    print(head)
    print("| route | ms/step | tokens/s | vs baseline | peak GiB (rank 0) | fused | loss check |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for route, r in results.items():
        for name, why in (r.get("unfused") or [])[:6]:
            print(f"  {route}: unfused {name}: {why}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=head, results=results), f, indent=1)


if __name__ == "__main__":
    main()
