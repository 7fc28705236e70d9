"""compile_train_step under DistributedDataParallel: the step's graph does what DDP's reducer does (each gradient
times 1/world, summed over the ranks; buffers broadcast from rank 0 before the forward), and a fused weight's mean
gradient is never made -- its update reads every rank's dY and X, all-gathered over tokens. Checked against eager
DDP + torch.optim in the same processes, each rank on its own batch (only the synchronisation agrees them):
parameters close to eager DDP's, replicas bitwise equal. Two CPU processes over gloo; on a host with 2 GPUs the same
over NCCL (tests/test_gpu_ddp_train_step.py)."""
import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from models import MLP, TinyLM, collective_checks, free_port

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class BNMLP(nn.Module):
    """A buffer the forward writes differently on each rank (BatchNorm's running statistics): DDP broadcasts rank
    0's before every forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.bn(self.fc1(x))))


def spread(params) -> float:
    """The largest difference of any parameter between the ranks (0.0: the replicas are equal)."""
    out = 0.0
    for p in params:
        every = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(every, p.detach().contiguous())
        out = max(out, max((e - every[0]).abs().max().item() for e in every))
    return out


def max_diff(m1, m2) -> dict:
    return {n: (a - b).abs().max().item() for (n, a), b in zip(m1.named_parameters(), m2.parameters())}


def ddp_pair(base, device, make_opt, clip=None, autocast=None, **options):
    """(forge step, eager step, forge DDP model, eager DDP model): the same step -- forward and backward per
    micro-batch of the list it takes, optionally clip_grad_norm_, opt.step(), zero_grad() -- on two DDP-wrapped
    copies of ``base``, one compiled by compile_train_step (``options``)."""
    import forge_compile as forge

    ids = [device.index] if device.type == "cuda" else None
    fm = nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(device), device_ids=ids)
    em = nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(device), device_ids=ids)

    def make(model, opt):
        def step(xs, ys):
            total = 0.0
            for x, y in zip(xs, ys):
                with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                    out = model(x)
                loss = (F.cross_entropy(out.flatten(0, 1).float(), y.flatten()) if y.dtype == torch.long
                        else F.mse_loss(out.float(), y))
                loss.backward()
                total = total + loss.detach()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            return total
        return step
    return (forge.compile_train_step(make(fm, make_opt(fm.parameters())), **options),
            make(em, make_opt(em.parameters())), fm, em)


def scenarios(rank, device, cuda_graphs=False):
    """Each scenario's results on this rank (JSON-able)."""
    import forge_compile as forge

    res = {}
    gen = torch.Generator().manual_seed(100 + rank)     # each rank its own batches

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    from forge_compile import step_graph

    def run(name, base, make_opt, batches, steps=3, **kw):
        before = dict(step_graph.counters)
        torch.manual_seed(0)
        fstep, estep, fm, em = ddp_pair(base, device, make_opt, **kw)
        for i in range(steps):
            xs, ys = batches(i)
            fstep(xs, ys)
            estep(xs, ys)
        rep = fstep.last_report
        res[name] = dict(diff=max_diff(fm, em), spread=spread(fm.parameters()),
                         fused={d.name: d.reason for d in rep.fused},
                         unfused={d.name: d.reason for d in rep.unfused},
                         notes=rep.notes,
                         graph={k: v - before.get(k, 0) for k, v in step_graph.counters.items()},
                         buffers={n: (a - b).abs().max().item() for (n, a), b in
                                  zip(fm.named_buffers(), em.buffers()) if a.is_floating_point()})
        return fm, em

    graphs = dict(cuda_graphs=True) if cuda_graphs else {}
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    # 4 tokens per rank: both ranks' gathered dY and X (2 x 4 x (16 + 64) fp32) fit the rule (<= the fp32 dW)
    run("mlp_sgd", MLP(16, 64, 32), sgd, lambda i: ([rnd(4, 16)], [rnd(4, 32)]), **graphs)
    # 64 tokens per rank: the gathered operands outweigh dW, so the weights are all-reduced as DDP does
    run("mlp_sgd_large", MLP(16, 64, 32), sgd, lambda i: ([rnd(64, 16)], [rnd(64, 32)]), **graphs)
    # an LM with an embedding (all-reduced, unfused), AdamW, clip_grad_norm_ and 2 accumulated micro-batches
    vocab = 40

    def lm_batches(i):
        idx = [torch.randint(0, vocab, (1, 2), generator=gen).to(device) for _ in range(2)]
        tgt = [torch.randint(0, vocab, (1, 2), generator=gen).to(device) for _ in range(2)]
        return idx, tgt
    run("lm_adamw_clip_accum", TinyLM(vocab, 32), adamw, lm_batches, clip=0.5, **graphs)
    # a tied embedding / output weight: all-reduced, unfused
    run("lm_tied", TinyLM(vocab, 32, tied=True), sgd, lambda i: tuple(x[:1] for x in lm_batches(i)))
    # uneven batches (rank 1 one token more): the ranks' graphs must issue the same collectives, so the call whose
    # shapes differ all-reduces (unfused) on both ranks -- gathers of unequal sizes would hang or read garbage
    run("mlp_uneven", MLP(16, 64, 32), sgd, lambda i: ([rnd(3 + rank, 16)], [rnd(3 + rank, 32)]))
    # BatchNorm's running statistics: rank 0's broadcast before each forward
    run("bn_buffers", BNMLP(), sgd, lambda i: ([rnd(4, 16)], [rnd(4, 8)]))
    # 8-bit states (forge.optim.AdamW8bit; both weights 8-bit): fused with the gathered operands, every rank
    # rounding with the same keys
    from forge_compile.optim import AdamW8bit

    run("mlp_adamw8bit", MLP(16, 64, 32), lambda ps: AdamW8bit(ps, lr=1e-2, min_8bit_size=1000),
        lambda i: ([rnd(4, 16)], [rnd(4, 32)]))
    # bf16 weights rounded stochastically: every rank draws the same bits (eager DDP rounds to nearest: not compared)
    run("mlp_bf16_sr", MLP(16, 64, 32).to(torch.bfloat16), sgd,
        lambda i: ([rnd(4, 16).to(torch.bfloat16)], [rnd(4, 32)]), stochastic_rounding=True)

    # no_sync(): the first call accumulates locally (no all-reduce, gradients outlive it), the second synchronises
    torch.manual_seed(0)
    fstep, estep, fm, em = ddp_pair(MLP(16, 64, 32), device, sgd)
    for _ in range(2):
        xs, ys = [rnd(4, 16)], [rnd(4, 32)]
        with fm.no_sync(), em.no_sync():
            # no opt.step() under no_sync: the ordinary accumulation over calls
            fm(xs[0]).pow(2).mean().backward()
            em(xs[0]).pow(2).mean().backward()
        fstep(xs, ys)
        estep(xs, ys)
    res["no_sync"] = dict(diff=max_diff(fm, em), spread=spread(fm.parameters()),
                          unfused={d.name: d.reason for d in fstep.last_report.unfused})

    # a communication hook: refused before anything changed
    torch.manual_seed(0)
    m = nn.parallel.DistributedDataParallel(
        MLP().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    m.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w0 = [p.detach().clone() for p in m.parameters()]

    def hooked(x):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    try:
        forge.compile_train_step(hooked)(rnd(4, 16))
    except forge.ForgeCaptureError as e:
        res["hook_error"] = str(e)
    res["hook_unchanged"] = all(torch.equal(a, b) for a, b in zip(m.parameters(), w0))
    # the step graphs' collectives recognised in their generated wrappers (collective_reads_before_wait's check ran)
    res.update(collective_checks())
    return res


def worker(rank, world, port, out_dir, device_type, cuda_graphs=False):
    if device_type == "cuda":
        # a GPU per rank over NCCL (two ranks sharing one GPU over gloo crashed with SIGSEGV on an H100, torch 2.11)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.backends.cuda.matmul.allow_tf32 = False     # IEEE fp32 on both sides: the comparison is tight
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        res = scenarios(rank, device, cuda_graphs)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def run_ranks(tmp_path, device_type="cpu", world=2, cuda_graphs=False) -> list:
    mp.spawn(worker, args=(world, free_port(), str(tmp_path), device_type, cuda_graphs), nprocs=world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def check(results, graphs=False):
    """``results``: each rank's. One rank (a single GPU over NCCL): the same graphs and kernels, collectives of one;
    the scenarios that need ranks to differ are not judged."""
    world = len(results)
    for res in results:
        for name in ("mlp_sgd", "mlp_sgd_large", "lm_adamw_clip_accum", "lm_tied", "bn_buffers"):
            r = res[name]
            # the ranks trained on different batches: only a synchronisation that is right keeps them equal
            assert r["spread"] == 0.0, (name, r)
        r = res["mlp_sgd"]
        assert set(r["fused"]) == {"model.module.fc1.weight", "model.module.fc2.weight"}, r
        assert all(f"data parallel: the mean over {world} ranks" in why for why in r["fused"].values()), r
        # eager DDP sums the ranks' dW in fp32, the fused GEMM sums all tokens at once: summation order only
        assert max(r["diff"].values()) <= 1e-6, r
        r = res["mlp_sgd_large"]
        assert not r["fused"], r
        assert f"data parallel over {world} ranks" in r["unfused"]["model.module.fc1.weight"], r
        assert max(r["diff"].values()) <= 1e-6, r
        r = res["lm_adamw_clip_accum"]
        assert "model.module.emb.weight" in r["fused"], r
        fused = r["fused"]
        assert "model.module.head.weight" in fused and "model.module.block.up.weight" in fused, r
        assert all("accumulated" in why and "clip_grad_norm_" in why for why in fused.values()), r
        # Adam divides by sqrt(v): where a gradient element nearly cancels, the summation order moves the update by
        # up to ~1e-5 (the compiled step without fusion differs from eager as much; test_grad_accumulation.py)
        assert max(r["diff"].values()) <= 5e-5, r
        r = res["mlp_uneven"]
        assert r["spread"] == 0.0 and max(r["diff"].values()) <= 1e-6, r
        if world > 1:
            assert not r["fused"] and "different argument shapes" in r["unfused"]["model.module.fc1.weight"], r
        r = res["lm_tied"]
        # on CUDA Inductor's kernels (attention softmax, LayerNorm, the loss) sum in another order than eager's: every
        # parameter, fused or not, ended up to 1.8e-6 from eager DDP (H100, one rank, 3 SGD-momentum steps)
        assert "tied" in r["unfused"]["model.module.emb.weight"] and max(r["diff"].values()) <= 1e-5, r
        r = res["bn_buffers"]
        assert max(r["buffers"].values()) <= 1e-6 and max(r["diff"].values()) <= 1e-6, r
        r = res["mlp_bf16_sr"]
        assert r["spread"] == 0.0, r
        assert set(r["fused"]) == {"model.module.fc1.weight", "model.module.fc2.weight"}, r
        assert any("stochastic_rounding: 4 bf16 parameters" in n for n in r["notes"]), r
        assert 0 < max(r["diff"].values()) < 0.1, r      # it trained, near eager DDP's round-to-nearest training
        r = res["mlp_adamw8bit"]
        assert r["spread"] == 0.0, r
        assert set(r["fused"]) == {"model.module.fc1.weight", "model.module.fc2.weight"}, r
        assert all("8-bit states" in why and f"the mean over {world} ranks" in why for why in r["fused"].values()), r
        # the mean gradient summed in another order than eager DDP's: an 8-bit state code may round the other way,
        # moving that element's AdamW step (lr 1e-2) by a fraction of it
        assert max(r["diff"].values()) <= 5e-3, r
        r = res["no_sync"]
        assert r["spread"] == 0.0 and max(r["diff"].values()) <= 1e-6, r
        assert "accumulates into the .grad" in r["unfused"]["model.module.fc1.weight"], r
        assert "communication hook" in res.get("hook_error", ""), res
        assert res["hook_unchanged"], res
        assert res["collectives_checked"] > 0 and res["collectives_unchecked"] == 0, res
        if graphs:
            for name in ("mlp_sgd", "mlp_sgd_large", "lm_adamw_clip_accum"):
                r = res[name]
                assert any("replayed as one CUDA graph" in n for n in r["notes"]), (name, r)
                # the collectives captured with the step: step 3 of 3 ran as the captured graph
                assert r["graph"].get("captures") == 1 and not r["graph"].get("capture_failed"), (name, r)


def test_ddp_step_matches_eager_ddp_and_fuses_with_gathered_operands(tmp_path):
    check(run_ranks(tmp_path))


def test_ddp_communication_hooks_are_named_before_anything_changed():
    # one gloo rank in this process: registering a hook needs a process group, not a second rank
    import forge_compile as forge
    from forge_compile import _compat
    from models import one_rank_group
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with one_rank_group():
        plain = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        assert _compat.ddp_unsupported(plain) is None
        builtin = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        # a built-in hook lives in the C++ reducer only; DDP's logging data names it
        builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        assert "FP16_COMPRESS" in _compat.ddp_unsupported(builtin)
        python = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        python.register_comm_hook(None, default_hooks.allreduce_hook)
        assert "register_comm_hook" in _compat.ddp_unsupported(python)
        opt = torch.optim.SGD(builtin.parameters(), lr=0.1)
        w0 = [p.detach().clone() for p in builtin.parameters()]

        def step(x):
            builtin(x).sum().backward(); opt.step(); opt.zero_grad()
        with pytest.raises(forge.ForgeCaptureError, match="FP16_COMPRESS"):
            forge.compile_train_step(step)(torch.randn(2, 4))
        assert all(torch.equal(a, b) for a, b in zip(builtin.parameters(), w0))
