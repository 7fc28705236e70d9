"""Inductor's C++ wrapper (Inductor option ``cpp_wrapper``): the host code of a compiled graph in C++ instead of
Python, much cheaper per kernel launch -- the forge routes are host-bound at fine-tuning sizes on the H200
(benchmarks/RESULTS.md, e2e run 9). Asked for through each route's Inductor options
(``compile_train_step(options=...)``, ``torch.compile(backend="forge", options={"optimizer": ..., "cpp_wrapper":
True})``). The wrapper calls ``forge::wgrad_update_`` through the dispatcher; both routes must fuse the same weights
and end bit-identical to the Python wrapper (same generated kernels, same fused op), and the fused path must really
have run."""
import pytest
import torch
import torch.nn as nn

import forge_compile as forge
import forge_compile.backend as fb
from models import mse_route_step


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
    step = mse_route_step(route, model, opt, {"cpp_wrapper": True} if cpp else {})
    fused_before = fb.counters["fused_backward"]
    losses = [step(x, y).item() for x, y in _batches(device)]
    rep = step.last_report if route == "step" else fb.last_report()
    fused = sorted(r.name.split(".", 1)[-1] for r in rep.fused)
    if route == "backend":   # every step's backward took the fused variant
        assert fb.counters["fused_backward"] - fused_before == 3
    return losses, [p.detach().clone() for p in model.parameters()], fused


def _calls(src, op):
    """The wrapper calls forge::<op> through the dispatcher (torch 2.13: "forge::<op>") or, for a schema the
    dispatcher bridge cannot take (Tensor[] arguments), through Python (torch 2.11: its Python name)."""
    return f'"forge::{op}"' in src or f'"torch.ops.forge.{op}.default"' in src


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["step", "backend"])
def test_cpp_wrapper_matches_python_wrapper(route, device, tmp_path, monkeypatch):
    losses_py, params_py, fused_py = _train(route, False, device)
    # a cache of its own: the C++ wrapper's source lands there, and must call the fused op
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    losses_cpp, params_cpp, fused_cpp = _train(route, True, device)
    sources = [f.read_text(errors="replace") for f in tmp_path.rglob("*.cpp")]
    assert any(_calls(src, "wgrad_update_") for src in sources), f"{len(sources)} C++ sources, no forge call"
    assert fused_cpp == fused_py and len(fused_py) == 3, (fused_py, fused_cpp)
    assert losses_cpp == losses_py
    for a, b in zip(params_py, params_cpp):
        assert torch.equal(a, b)
    # and the weights did move: three AdamW steps from the same start
    assert not torch.equal(params_py[0], _model(device)[0].weight.detach())


def test_unknown_options_are_refused_before_compiling():
    # forge's own options plus Inductor's; anything else is a clear error, at construction for compile_train_step
    # and at the first call for the backend (Dynamo calls it then)
    with pytest.raises(TypeError, match="unknown Inductor options"):
        forge.compile_train_step(lambda: None, options={"cpp_wraper": True})
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch._dynamo.reset()
    cm = torch.compile(model, backend="forge", options={"optimizer": opt, "max_autotun": True})
    with pytest.raises(Exception, match="unknown options"):
        cm(torch.randn(2, 32))
    assert all(p.grad is None for p in model.parameters())


def _train_cast(cpp, device):
    # compile_train_step(cast_weights_in_update=True) under bf16 autocast: the fused op's optional mutated argument
    # (cast_out) through the C++ wrapper's proxy call
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def body(x, y):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad(); return loss
    step = forge.compile_train_step(body, options={"cpp_wrapper": True} if cpp else {}, cast_weights_in_update=True)
    losses = [step(x, y).item() for x, y in _batches(device)]
    assert any("3 fused weights' low-precision copies" in n for n in step.last_report.notes), step.last_report.notes
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_wrapper_with_weight_casts_in_the_update(device, tmp_path, monkeypatch):
    losses_py, params_py = _train_cast(False, device)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    losses_cpp, params_cpp = _train_cast(True, device)
    sources = [f.read_text(errors="replace") for f in tmp_path.rglob("*.cpp")]
    assert any(_calls(src, "wgrad_update_") for src in sources), f"{len(sources)} C++ sources, no forge call"
    assert losses_cpp == losses_py
    for a, b in zip(params_py, params_cpp):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_wrapper_with_embedding_update(device, tmp_path, monkeypatch):
    # forge::embedding_update_ (an int argument, the padding index) through the C++ wrapper's proxy call
    from models import TinyLM

    def run(cpp):
        torch.manual_seed(0)
        m = TinyLM().to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def body(x, y):
            loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward(); opt.step(); opt.zero_grad(); return loss
        step = forge.compile_train_step(body, options={"cpp_wrapper": True} if cpp else {})
        g = torch.Generator().manual_seed(1)
        losses = [step(torch.randint(0, 40, (2, 8), generator=g).to(device),
                       torch.randint(0, 40, (2, 8), generator=g).to(device)).item() for _ in range(3)]
        assert step.last_report.row("m.emb.weight").fused
        return losses, [p.detach().clone() for p in m.parameters()]
    losses_py, params_py = run(False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    losses_cpp, params_cpp = run(True)
    sources = [f.read_text(errors="replace") for f in tmp_path.rglob("*.cpp")]
    assert any(_calls(src, "embedding_update_") for src in sources), f"{len(sources)} C++ sources, no forge call"
    assert losses_cpp == losses_py
    assert all(torch.equal(a, b) for a, b in zip(params_py, params_cpp))


def test_lazily_compiled_backward_gets_the_cpp_wrapper_settings(monkeypatch):
    # compile_fx applies the C++ wrapper's Triton settings (store_cubin, ...) only while it runs; the backend route's
    # backward compiles at its first call, after it returned. torch 2.11 then compiled it without them and the GPU
    # compile failed ("CudaKernelParamCache not populated", H200, stop 22); forge's compile_fx_inner applies them
    # (torch 2.13's does too, but only inside): the backward's compile must start with them in place
    import torch._inductor.compile_fx as cfx
    import torch._inductor.config as inductor_config

    seen = []
    real = cfx.compile_fx_inner

    def spy(gm, inputs, **kw):
        if kw.get("is_backward"):
            seen.append(inductor_config.triton.store_cubin)
        return real(gm, inputs, **kw)
    monkeypatch.setattr(cfx, "compile_fx_inner", spy)
    _train("backend", True, "cpu")
    assert seen and all(seen), seen
