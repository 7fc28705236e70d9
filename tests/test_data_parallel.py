"""Data parallelism in the Dynamo route and FSDP: a fused update inside the backward would apply each rank's local
gradient where DDP's hooks all-reduce it first. Before the check both routes ran under DDP with 2 ranks and the
replicas drifted apart silently (route 1: every parameter, its compiled step never calls autograd hooks; the
backend: the fused weights). Now the backend leaves the model unfused (DDP's own training), FSDP is refused by route
1 before anything changes, and route 1 traces DDP's synchronisation into its step (tests/test_ddp_train_step.py has
the details; here: it trains as eager DDP also when the step is given the inner module as models=). Two CPU processes
over gloo."""
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import forge_compile as forge
import forge_compile.backend as fb
from forge_compile import _compat
from models import free_port

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _worker(rank, port, out_dir):
    sys.path.insert(0, os.path.dirname(__file__))
    from models import MLP
    from test_ddp_train_step import spread
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    torch.manual_seed(rank + 1)
    x, y = torch.randn(8, 16), torch.randn(8, 8)     # each rank its own batch: only the all-reduce agrees them

    def run(route):
        torch.manual_seed(0)
        torch._dynamo.reset()
        if route.endswith("_wrapped_later"):
            # compiled (and fused) outside DDP by a warm-up step on the same batch on both ranks, then wrapped
            inner = MLP()
            opt = torch.optim.SGD(inner.parameters(), lr=0.1)
            fwd = torch.compile(inner, backend="forge", options={"optimizer": opt}) if route.startswith("backend") \
                else inner
            ((fwd(torch.ones(8, 16)) ** 2).mean()).backward()
            opt.step()
            opt.zero_grad()
            m = cm = nn.parallel.DistributedDataParallel(fwd)
        else:
            m = nn.parallel.DistributedDataParallel(MLP())
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            cm = torch.compile(m, backend="forge", options={"optimizer": opt}) if route == "backend" else m

        def body(x, y):
            loss = ((cm(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        if route.startswith("step"):
            # "step_models": the inner module given as models=, the step calling the wrapper
            kw = dict(models=m.module, optimizers=opt) if route == "step_models" else {}
            body = forge.compile_train_step(body, **kw)
        for _ in range(2):
            body(x, y)
        if route == "backend":
            res["backend_fused"] = len(fb.last_report().fused)
            res["backend_notes"] = fb.last_report().notes
        return [p.detach() for p in m.parameters()]

    ref, got = run("eager"), run("backend")
    ref_later, got_later = run("eager_wrapped_later"), run("backend_wrapped_later")
    steps = {route: run(route) for route in ("step", "step_models")}

    res["backend_vs_eager"] = max((a - b).abs().max().item() for a, b in zip(got, ref))
    res["backend_replica_spread"] = spread(got)
    res["later_vs_eager"] = max((a - b).abs().max().item() for a, b in zip(got_later, ref_later))
    res["later_replica_spread"] = spread(got_later)
    for route, params in steps.items():
        res[f"{route}_vs_eager"] = max((a - b).abs().max().item() for a, b in zip(params, ref))
        res[f"{route}_replica_spread"] = spread(params)
    # FSDP2: its DTensor parameters are declined by the backend with the reason, refused by route 1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    torch._dynamo.reset()
    m2 = MLP()
    fully_shard(m2, mesh=init_device_mesh("cpu", (2,)))
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    cm2 = torch.compile(m2, backend="forge", options={"optimizer": opt2})
    ((cm2(x) - y) ** 2).mean().backward()
    opt2.step()
    res["fsdp2_backend_notes"] = fb.last_report().notes
    res["fsdp2_backend_fused"] = len(fb.last_report().fused)

    def body2(x, y):
        loss = ((m2(x) - y) ** 2).mean(); loss.backward(); opt2.step(); opt2.zero_grad(); return loss
    try:
        forge.compile_train_step(body2)(x, y)
    except forge.ForgeCaptureError as e:
        res["fsdp2_step_error"] = str(e)
    # 8-bit states under FSDP2, eagerly: forge.optim.AdamW8bit on its Shard(0) DTensor parameters keeps each rank's
    # codes and scales of its rows; the Dynamo route declines the DTensors and opt.step() runs the eager update.
    # Against the unsharded model on both ranks' batches (the mean of the two means, as FSDP2 averages)
    from forge_compile.optim import AdamW8bit
    torch.manual_seed(0)
    torch._dynamo.reset()
    m3, r3 = MLP(), MLP()
    r3.load_state_dict(m3.state_dict())
    fully_shard(m3, mesh=init_device_mesh("cpu", (2,)))
    o3, ro3 = (AdamW8bit(m.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=64) for m in (m3, r3))
    cm3 = torch.compile(m3, backend="forge", options={"optimizer": o3})
    xs, ys = [torch.empty_like(x) for _ in range(2)], [torch.empty_like(y) for _ in range(2)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    for _ in range(3):
        ((cm3(x) - y) ** 2).mean().backward()
        o3.step()
        o3.zero_grad()
        ((r3(torch.cat(xs)) - torch.cat(ys)) ** 2).mean().backward()
        ro3.step()
        ro3.zero_grad()
    res["fsdp2_8bit"] = dict(
        diff=max((p.full_tensor() - q).abs().max().item() for p, q in zip(m3.parameters(), r3.parameters())),
        codes=[type(st[k]).__name__ + str(list(st[k].shape)) for st in o3.state.values() for k in st
               if k.endswith("_codes")])
    # a distributed checkpoint of those states (torch.distributed.checkpoint): each rank's rows back on that rank
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    dcp.save(get_optimizer_state_dict(m3, o3), checkpoint_id=os.path.join(out_dir, "dcp"))
    torch.manual_seed(0)
    m4 = MLP()
    fully_shard(m4, mesh=init_device_mesh("cpu", (2,)))
    o4 = AdamW8bit(m4.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=64)
    target = get_optimizer_state_dict(m4, o4)
    dcp.load(target, checkpoint_id=os.path.join(out_dir, "dcp"))
    set_optimizer_state_dict(m4, o4, target)
    res["fsdp2_8bit"]["dcp_equal"] = all(torch.equal(v, o4.state[q][k]) for p, q in zip(m3.parameters(),
                                                                                        m4.parameters())
                                         for k, v in o3.state[p].items() if k.endswith(("_codes", "_scales")))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_data_parallel_is_synchronised_by_the_step_and_left_unfused_by_the_backend(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for route in ("step", "step_models"):
            # two SGD steps as eager DDP's, up to the summation order of the mean gradient
            assert res[f"{route}_replica_spread"] == 0.0, (route, res)
            assert res[f"{route}_vs_eager"] <= 1e-6, (route, res)
        assert res["backend_fused"] == 0, res
        assert any("DistributedDataParallel" in n for n in res["backend_notes"]), res
        # unfused, the backend is Inductor + DDP: the replicas stay equal and follow eager DDP (two SGD steps,
        # summation order only)
        assert res["backend_replica_spread"] == 0.0, res
        assert res["backend_vs_eager"] <= 1e-6, res
        assert res["fsdp2_backend_fused"] == 0 and any("DTensor" in n for n in res["fsdp2_backend_notes"]), res
        assert "FSDP2" in res.get("fsdp2_step_error", ""), res
        r = res["fsdp2_8bit"]
        # each rank the codes of its half of the rows of both weights (plain tensors), and the 8-bit training
        # follows the unsharded model's up to its rounding bits (each shard draws its own): other bits alone move
        # the weights by 1.8e-3 / 2.0e-3 after these 3 steps (the unsharded model with seeds 1 and 2 against 0;
        # 2.2e-3 measured here); a shard left without its update is ~3 lr = 3e-2 off
        assert r["codes"] == ["Tensor[16, 16]", "Tensor[16, 16]", "Tensor[4, 32]", "Tensor[4, 32]"], r
        assert r["diff"] <= 5e-3, r
        assert r["dcp_equal"], r
        # compiled and fused before the wrapping: under DDP its backward runs unfused (DDP's hooks all-reduce)
        assert res["later_replica_spread"] == 0.0, res
        assert res["later_vs_eager"] <= 1e-6, res


def test_fsdp_flattened_parameters_are_recognised():
    # FSDP (FullyShardedDataParallel) marks the original parameters it flattens; FSDP's init needs a process group
    # and a device, so the mark is set by hand here, as torch.distributed.fsdp._flat_param sets it
    p = nn.Parameter(torch.randn(4, 4))
    assert _compat.data_parallel_wrapper(params=[p]) is None
    p._fsdp_flattened = True
    assert _compat.data_parallel_wrapper(params=[p]) == "FullyShardedDataParallel"
