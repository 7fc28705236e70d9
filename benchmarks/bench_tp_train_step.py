"""End to end under tensor + sequence parallelism (DTensor, ``parallelize_module`` with Megatron's / torchtitan's
plan): one Llama-style train step (bf16 autocast, fp32 master weights, AdamW) on every GPU of the host, all ranks on
the same batch, compile_train_step against torch.compile(model) + AdamW(fused=True) on the same parallelised model,
in the same run, same batches.

    python benchmarks/bench_tp_train_step.py                      # every GPU, Llama-3-8B's layer shapes, 4 layers
    python benchmarks/bench_tp_train_step.py --mbs 1,2,4,8,16 --routes baseline,step_graphs
    python benchmarks/bench_tp_train_step.py --device cpu --tiny  # a smoke run of the script over gloo

The plan (torchtitan's): q, k, v, gate, up column-wise; o, down row-wise with their output sharded over the sequence;
the norms SequenceParallel; the embedding row-wise, the lm_head column-wise with replicated logits. Every parameter
is a DTensor; each rank's dW of its shard is one local mm, so forge fuses each shard's AdamW update into it
(forge_compile/tensor_parallel.py) -- the paper's "each rank's dW for its shard is complete".

Per route, one set of processes (one per GPU, NCCL): check steps at the first micro-batch (losses compared to the
baseline's as bench_train_step.py judges them), then per micro-batch, ascending, warm-up and timed steps (CUDA events
on rank 0 around each step after a barrier; the per-step maximum over the ranks; median) and rank 0's peak memory. A
micro-batch that runs out of memory ends the route (both ranks hold the same shapes, so they run out together; the
process group's timeout ends a hang). Printed last: ms per step, tokens/s, peak GiB per micro-batch and route, the
largest micro-batch each route fitted, and rank 0's bytes of parameters + optimizer states.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ddp_train_step import free_port, route_step, timed_steps, worker  # noqa: E402
from bench_train_step import LOSS_ATOL, WithLoss, _judged_steps, load_llama, make_optimizer  # noqa: E402

ROUTES = ("baseline", "step", "step_graphs")


def parallelize(model, mesh):
    """torchtitan's tensor + sequence parallel plan for examples/train_lm.py's Llama (``model`` is its WithLoss)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    llama = model.model
    for layer in llama.layers:
        parallelize_module(layer, mesh, {
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            # attention takes (x, cos, sin): only x is sharded over the sequence
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    parallelize_module(llama, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    return model


def local_bytes(ts) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in ts)


def run_route(rank, world, device, cfg, route) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    Llama = load_llama()
    torch.manual_seed(0)
    with torch.device(device):
        model = WithLoss(Llama(cfg["d_model"], cfg["layers"], cfg["heads"], cfg["d_ff"], cfg["seq_len"],
                               vocab=cfg["vocab"]), cfg["vocab"])
    parallelize(model, mesh)
    opt = make_optimizer(model, cfg["lr"], fused=device.type == "cuda")
    body = route_step(model, opt, route, device)
    gen = torch.Generator().manual_seed(1000)       # the same batches on every rank

    def batch(mb):
        idx = torch.randint(0, cfg["vocab"], (mb, cfg["seq_len"] + 1), generator=gen).to(device)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    cuda = device.type == "cuda"
    out = dict(route=route, losses=[], runs=[], report=None)
    for i, mb in enumerate(cfg["mbs"]):
        run = dict(mb=mb)
        try:
            if i == 0:
                for x, y in [batch(mb) for _ in range(cfg["check_steps"])]:
                    out["losses"].append(float(body(x, y).detach()))
                if route != "baseline":
                    rep = body.last_report
                    out["report"] = dict(
                        fused=len(rep.fused), notes=rep.notes,
                        unfused=[(d.name, d.reason) for d in rep.unfused if d.reason != "not a matrix (normal path)"])
                out["param_state_gib"] = (local_bytes(model.parameters()) + local_bytes(
                    s for st in opt.state.values() for s in st.values() if torch.is_tensor(s))) / 2 ** 30
            for _ in range(cfg["warmup"]):
                body(*batch(mb))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            run.update(ms=timed_steps(body, [batch(mb) for _ in range(cfg["iters"])], device),
                       peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0)
        except torch.OutOfMemoryError:
            run["oom"] = True
            out["runs"].append(run)
            break
        out["runs"].append(run)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--d-ff", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--mbs", default="1,2,4", help="micro-batches (sequences per step, all ranks the same), ascending")
    ap.add_argument("--tiny", action="store_true", help="smoke shapes (d_model 64, 2 layers, seq 16)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--world", type=int, default=0, help="processes (default: every GPU)")
    ap.add_argument("--pg-timeout", type=float, default=300, help="seconds a collective may wait (ends a hang)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run over gloo")
    args = ap.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads, args.d_ff, args.vocab, args.seq_len = 64, 2, 4, 96, 128, 16
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and world > torch.cuda.device_count():
        sys.exit(f"bench_tp_train_step: --world {world} needs as many GPUs (a GPU per rank)")
    if args.heads % world or args.seq_len % world:
        sys.exit(f"bench_tp_train_step: --heads and --seq-len must divide by the {world} ranks")
    cfg = dict(device=args.device, d_model=args.d_model, layers=args.layers, heads=args.heads, d_ff=args.d_ff,
               vocab=args.vocab, seq_len=args.seq_len, mbs=[int(m) for m in args.mbs.split(",")], lr=args.lr,
               check_steps=args.check_steps, warmup=args.warmup, iters=args.iters, pg_timeout=args.pg_timeout)
    results = {}
    tmp = tempfile.mkdtemp()
    for route in args.routes.split(","):
        path = os.path.join(tmp, f"{route}.json")
        mp.spawn(worker, args=(world, free_port(), cfg, route, path, run_route), nprocs=world)
        with open(path) as f:
            results[route] = json.load(f)
        r = results[route]
        print(f"{route}: " + ", ".join(f"mb {x['mb']}: " + ("OOM" if x.get("oom") else
                                                             f"{x['ms']:.2f} ms, {x['peak_gib']:.2f} GiB")
                                       for x in r["runs"]) + f"; losses {r['losses']}", flush=True)
    base = results.get("baseline")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
    head = (f"bench_tp_train_step {datetime.date.today()} {gpu} x{world} (tensor + sequence parallel), torch "
            f"{torch.__version__}, d_model {args.d_model}, d_ff {args.d_ff}, {args.layers} layers, vocab {args.vocab}, "
            f"seq {args.seq_len}, bf16 autocast, fp32 weights, AdamW")
    print(head)
    print("| route | micro-batch | tokens/step | ms/step | tokens/s | vs baseline | peak GiB (rank 0) |")
    print("|---|---|---|---|---|---|---|")
    base_ms = {x["mb"]: x["ms"] for x in base["runs"] if "ms" in x} if base else {}
    for route, r in results.items():
        for x in r["runs"]:
            tokens = x["mb"] * args.seq_len
            if x.get("oom"):
                print(f"| {route} | {x['mb']} | {tokens} | OOM | | | |")
                continue
            speed = f"{base_ms[x['mb']] / x['ms']:.2f}x" if x["mb"] in base_ms else ""
            print(f"| {route} | {x['mb']} | {tokens} | {x['ms']:.2f} | {tokens / x['ms'] * 1e3:,.0f} | {speed} | "
                  f"{x['peak_gib']:.2f} |")
    for route, r in results.items():
        fit = [x["mb"] for x in r["runs"] if "ms" in x]
        line = f"{route}: largest micro-batch run {max(fit) if fit else 'none'}"
        line += f", parameters + states {r.get('param_state_gib', 0):.2f} GiB per rank"
        if base is not None and route != "baseline":
            k = _judged_steps(base["losses"])
            worst = max(abs(a - b) for a, b in zip(r["losses"][:k], base["losses"][:k]))
            line += f", loss check {worst:.1e} {'ok' if worst <= LOSS_ATOL['bf16'] else 'FAIL'}"
        if r.get("report"):
            line += f", fused {r['report']['fused']}"
        print(line)
        for name, why in ((r.get("report") or {}).get("unfused") or [])[:6]:
            print(f"  {route}: unfused {name}: {why}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=head, results=results), f, indent=1)


if __name__ == "__main__":
    main()
