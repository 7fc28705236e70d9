"""The option ``triton.cudagraphs`` and the fused op, both routes.

forge's launch passes host scalars computed from the step counter and hyper-parameters at that moment; a CUDA graph
that captured it would replay step 1's bias corrections and lr forever. Backend route: with the option the fused
updates read those scalars from a device table the runtime writes before each backward (``scalar_table``), so
Inductor's CUDA graphs can take the whole backward (the host-scalar op is tagged ``cudagraph_unsafe``: a partition
boundary, where the table is off).
compile_train_step: the option means cuda_graphs=True, forge's own capture of the whole step, whose updates read
their scalars from a device table (test_step_graph.py). AdamW with the lr changed between steps: the run with CUDA
graphs must match the run without (a replayed step-1 launch would be off by the bias-correction ratio, ~3x at step
4, far outside the tolerances)."""
import pytest
import torch
import torch.nn as nn

import forge_compile.backend as fb
from models import mse_route_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Backend: the same kernels either way, so the runs should agree bit for bit; 1e-6 relative leaves room for a replay
# that picks another cuBLAS algorithm for the unfused parameters' small GEMMs, and is ~1e5x below a stale-scalar
# error. Step route: its graphed updates of the unfused biases run forge's rule_update (eager rule arithmetic), the
# ungraphed ones Inductor's decomposed rule: rounding apart, which the later steps carry through the network.
TOL = {"backend": (1e-6, 1e-7), "step": (1e-4, 1e-5)}


def _run(route, options, new_storage_at=None):
    torch._dynamo.reset()
    fb.clear_reports()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = mse_route_step(route, model, opt, options)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for i in range(5):
        x = torch.randn(32, 64, device="cuda", generator=g)
        y = torch.randn(32, 16, device="cuda", generator=g)
        if i == new_storage_at:     # p.data = t: same Parameters, new storages (the graphs hold the old addresses)
            for p in model.parameters():
                p.data = p.detach() * 0.5
        losses.append(step(x, y).item())
        opt.param_groups[0]["lr"] = 1e-2 / (i + 2)     # host scalars change every step
    torch.cuda.synchronize()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("route", ["step", "backend"])
def test_cudagraphs_match_no_cudagraphs(route):
    losses_ref, params_ref = _run(route, {})
    losses_cg, params_cg = _run(route, {"triton.cudagraphs": True})
    assert losses_cg == pytest.approx(losses_ref, rel=1e-5)
    rtol, atol = TOL[route]
    for a, b in zip(params_ref, params_cg):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


@pytest.mark.parametrize("route", ["step", "backend"])
def test_new_parameter_storage_with_cudagraphs(route):
    # a replay must not write the old storages: the graphed run follows the ungraphed one (CPU tests check that one
    # against torch.optim) after every parameter got a new storage
    losses_ref, params_ref = _run(route, {}, new_storage_at=2)
    losses_cg, params_cg = _run(route, {"triton.cudagraphs": True}, new_storage_at=2)
    assert losses_cg == pytest.approx(losses_ref, rel=1e-5)
    rtol, atol = TOL[route]
    for a, b in zip(params_ref, params_cg):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


def test_backend_backward_is_not_skipped_by_inductor_cudagraphs():
    # with triton.cudagraphs the backend's fused updates read a device table (option scalar_table, on by default
    # then) and their extra inputs are static: Inductor's CUDA graphs take every graph (no skip logged)
    from torch._dynamo.utils import counters

    counters["inductor"].clear()
    _run("backend", {"triton.cudagraphs": True})
    assert any(n.startswith("scalar_table: the fused updates read") for n in fb.last_report().notes)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_step_route_option_means_forge_graphs():
    from forge_compile import step_graph as sg

    sg.counters.clear()
    _run("step", {"triton.cudagraphs": True})
    assert sg.counters["replays"] == 3 and not sg.counters["capture_failed"], dict(sg.counters)
