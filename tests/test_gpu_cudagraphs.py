"""Inductor's CUDA graphs (option ``triton.cudagraphs``, with graph partitioning as torch's default) and the fused op.

forge's launch passes host scalars computed from the step counter and hyper-parameters at that moment; a CUDA graph
that captured it would replay step 1's bias corrections and lr forever. The op is tagged ``cudagraph_unsafe``, so
Inductor leaves it out of its graphs (a partition boundary). Both routes, AdamW with the lr changed between steps:
the run with CUDA graphs must match the run without (a replayed step-1 launch would be off by the bias-correction
ratio, ~3x at step 4, far outside the tolerance)."""
import pytest
import torch
import torch.nn as nn

import forge_compile.backend as fb
from models import mse_route_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Same kernels either way, so the runs should agree bit for bit; 1e-6 relative leaves room for a replay that
# picks another cuBLAS algorithm for the unfused parameters' small GEMMs, and is ~1e5x below a stale-scalar error.
RTOL, ATOL = 1e-6, 1e-7


def _run(route, options):
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
        losses.append(step(x, y).item())
        opt.param_groups[0]["lr"] = 1e-2 / (i + 2)     # host scalars change every step
    torch.cuda.synchronize()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("route", ["step", "backend"])
def test_cudagraphs_match_no_cudagraphs(route):
    losses_ref, params_ref = _run(route, {})
    losses_cg, params_cg = _run(route, {"triton.cudagraphs": True})
    assert losses_cg == pytest.approx(losses_ref, rel=1e-5)
    for a, b in zip(params_ref, params_cg):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
