"""Inductor's C++ wrapper (``torch._inductor.config.cpp_wrapper``): the host code of a compiled graph in C++ instead
of Python, much cheaper per kernel launch -- the forge routes are host-bound at fine-tuning sizes on the H200
(benchmarks/RESULTS.md, e2e run 9). The wrapper calls ``forge::wgrad_update_`` through the dispatcher
(``findSchemaOrThrow("forge::wgrad_update_")``); both routes must fuse the same weights and end bit-identical to
the Python wrapper (same generated kernels, same fused op), and the fused path must really have run."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import config as inductor_config

import forge_compile as forge
import forge_compile.backend as fb


def _model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 8)).to(device)


def _batches(device):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g).to(device), torch.randn(16, 8, generator=g).to(device))
            for _ in range(3)]


def _train(route, cpp, device):
    torch._dynamo.reset()
    fb.clear_reports()
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if route == "step":
        @forge.compile_train_step
        def step(x, y):
            loss = F.mse_loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
    else:
        cm = torch.compile(model, backend="forge", options={"optimizer": opt})

        def step(x, y):
            loss = F.mse_loss(cm(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
    fused_before = fb.counters["fused_backward"]
    with inductor_config.patch(cpp_wrapper=cpp):
        losses = [step(x, y).item() for x, y in _batches(device)]
    rep = step.last_report if route == "step" else fb.last_report()
    fused = sorted(r.name.split(".", 1)[-1] for r in rep.fused)
    if route == "backend":   # every step's backward took the fused variant
        assert fb.counters["fused_backward"] - fused_before == 3
    return losses, [p.detach().clone() for p in model.parameters()], fused


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["step", "backend"])
def test_cpp_wrapper_matches_python_wrapper(route, device, tmp_path, monkeypatch):
    losses_py, params_py, fused_py = _train(route, False, device)
    # a cache of its own: the C++ wrapper's source lands there, and must call the fused op
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    losses_cpp, params_cpp, fused_cpp = _train(route, True, device)
    sources = [f.read_text(errors="replace") for f in tmp_path.rglob("*.cpp")]
    assert any('"forge::wgrad_update_"' in src for src in sources), f"{len(sources)} C++ sources, no forge call"
    assert fused_cpp == fused_py and len(fused_py) == 3, (fused_py, fused_cpp)
    assert losses_cpp == losses_py
    for a, b in zip(params_py, params_cpp):
        assert torch.equal(a, b)
    # and the weights did move: three AdamW steps from the same start
    assert not torch.equal(params_py[0], _model(device)[0].weight.detach())
