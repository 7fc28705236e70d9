"""Inductor's C++ wrapper (Inductor option ``cpp_wrapper``): the host code of a compiled graph in C++ instead of
Python, much cheaper per kernel launch -- the forge routes are host-bound at fine-tuning sizes on the H200
(benchmarks/RESULTS.md, e2e run 9). Asked for through each route's Inductor options
(``compile_train_step(options=...)``, ``torch.compile(backend="forge", options={"optimizer": ..., "cpp_wrapper":
True})``). The wrapper calls ``forge::wgrad_update_`` through the dispatcher; both routes must fuse the same weights
and end bit-identical to the Python wrapper (same generated kernels, same fused op), and the fused path must really
have run.

On CUDA compile_train_step declines the C++ wrapper for a step whose GPU kernels read a step counter (on the CPU:
torch.optim's, or forge's mirror of a fused optimizer's): the C++ wrapper raced with the step's own counter update
(torch 2.11, H100/H200; the last tests). Its CUDA tests therefore train with SGD + momentum (no counter), the
backend route's with AdamW(fused=True)."""
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


def _optimizer(params, device, route="step"):
    """AdamW, except for compile_train_step on CUDA: SGD + momentum there, an optimizer without a step counter, so
    that the C++ wrapper is not declined (test_cuda_cpp_wrapper_declined_with_cpu_step_counters)."""
    if device == "cuda" and route == "step":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=device == "cuda")


def _same(a, b, device):
    """Bitwise on CPU. On CUDA the C++ wrapper tunes Inductor's Triton kernels at compile time
    (``triton.autotune_at_compile_time``) and may take another reduction config than the Python wrapper's run-time
    tuning: ulp-level differences in the reductions (bias gradients), at most 1.5e-8 after three AdamW steps on the
    H100 (stop 23) -- while the counter race this file also guards against put parameters 3e-3 off."""
    if device == "cpu":
        assert a == b if isinstance(a, list) else torch.equal(a, b)
    elif isinstance(a, list):
        assert a == pytest.approx(b, rel=1e-6)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


_LAST_REPORT = [None]


def _train(route, cpp, device, opt_kw=None):
    torch._dynamo.reset()
    fb.clear_reports()
    model = _model(device)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **opt_kw) if opt_kw is not None
           else _optimizer(model.parameters(), device, route))
    import forge_compile.capture as cap
    declined = cap.counters["cpp_wrapper_declined"]
    step = mse_route_step(route, model, opt, {"cpp_wrapper": True} if cpp else {})
    fused_before = fb.counters["fused_backward"]
    losses = [step(x, y).item() for x, y in _batches(device)]
    rep = _LAST_REPORT[0] = step.last_report if route == "step" else fb.last_report()
    fused = sorted(r.name.split(".", 1)[-1] for r in rep.fused)
    if route == "backend":   # every step's backward took the fused variant
        assert fb.counters["fused_backward"] - fused_before == 3
    if opt_kw is None:       # the C++ wrapper was not declined
        assert cap.counters["cpp_wrapper_declined"] == declined
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
    _same(losses_cpp, losses_py, device)
    for a, b in zip(params_py, params_cpp):
        _same(a, b, device)
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
    opt = _optimizer(model.parameters(), device)

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
    _same(losses_cpp, losses_py, device)
    for a, b in zip(params_py, params_cpp):
        _same(a, b, device)


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_wrapper_with_embedding_update(device, tmp_path, monkeypatch):
    # forge::embedding_update_ (an int argument, the padding index) through the C++ wrapper's proxy call
    from models import TinyLM

    def run(cpp):
        torch.manual_seed(0)
        m = TinyLM().to(device)
        opt = _optimizer(m.parameters(), device)

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
    _same(losses_cpp, losses_py, device)
    for a, b in zip(params_py, params_cpp):
        _same(a, b, device)


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


def _graph(read_on_gpu=True, written=True, cuda=True):
    """A hand-made graph (fake values, so no GPU needed) of a bias correction: the counter ``step`` is advanced, its
    power divides a (CUDA) moment, and the new count is written back."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    with FakeTensorMode():
        scalar = torch.empty(())
        moment = torch.empty(4, device="cuda" if cuda else "cpu")
    g = torch.fx.Graph()

    def node(target, args, val):
        n = g.call_function(target, args)
        n.meta["val"] = val
        return n
    step, m = g.placeholder("step"), g.placeholder("m")
    step.meta["val"], m.meta["val"] = scalar, moment
    s = node(aten.add.Tensor, (step, 1), scalar)
    bc = node(aten.rsub.Scalar, (node(aten.pow.Scalar, (0.9, s), scalar), 1), scalar)
    if read_on_gpu:
        node(aten.copy_.default, (m, node(aten.div.Tensor, (m, bc), moment)), moment)
    if written == "add_":
        node(aten.add_.Tensor, (step, 1), scalar)
    elif written:
        node(aten.copy_.default, (step, s), scalar)
    g.output(None)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_cpu_counters_read_on_gpu_are_found():
    from forge_compile.capture import cpu_scalars_read_on_gpu

    assert cpu_scalars_read_on_gpu(_graph()) == ["step"]
    assert cpu_scalars_read_on_gpu(_graph(written="add_")) == ["step"]     # written in place, not by copy_
    # the C++ wrapper passes the value of an unwritten CPU scalar (Inductor unwraps it), and CPU-only graphs and
    # counters no GPU kernel reads raced with nothing
    assert cpu_scalars_read_on_gpu(_graph(written=False)) == []
    assert cpu_scalars_read_on_gpu(_graph(cuda=False)) == []
    assert cpu_scalars_read_on_gpu(_graph(read_on_gpu=False)) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opt_kw", [{"foreach": True}, {"fused": True}], ids=["cpu_counter", "device_counter"])
def test_cuda_cpp_wrapper_declined_with_cpu_step_counters(opt_kw):
    # torch.optim's default AdamW on CUDA keeps each step counter on the CPU; the unfused updates (the biases) read
    # it in GPU kernels. Under the C++ wrapper (torch 2.11, H100/H200) the kernels got the counter's host pointer and
    # read it after the host had advanced it: biases 3.4e-3 off the Python wrapper's from the second step on. The
    # step compiles with the Python wrapper instead and says so. fused=True keeps the counter on the device, but
    # forge reads and advances a CPU mirror of it (optim/translate.py), which the biases' updates read: the same
    import forge_compile.capture as cap

    losses_py, params_py, _ = _train("step", False, "cuda", opt_kw=opt_kw)
    declined = cap.counters["cpp_wrapper_declined"]
    losses_cpp, params_cpp, _ = _train("step", True, "cuda", opt_kw=opt_kw)
    assert cap.counters["cpp_wrapper_declined"] == declined + 1
    assert any(n.startswith("cpp_wrapper not used for this graph") for n in _LAST_REPORT[0].notes)
    _same(losses_cpp, losses_py, "cuda")
    for a, b in zip(params_py, params_cpp):
        _same(a, b, "cuda")


def test_declined_cpp_wrapper_compiles_with_the_python_wrapper(tmp_path, monkeypatch):
    # the fallback's wiring, on CPU: a graph found hazardous compiles without the C++ wrapper (no dispatcher call of
    # the fused op in any C++ source), with the same result, and the report says why
    import forge_compile.capture as cap

    losses_py, params_py, _ = _train("step", False, "cpu", opt_kw={})
    monkeypatch.setattr(cap, "cpu_scalars_read_on_gpu", lambda gm: ["step"])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    declined = cap.counters["cpp_wrapper_declined"]
    losses, params, fused = _train("step", True, "cpu", opt_kw={})   # opt_kw: AdamW, the decline not refused
    assert len(fused) == 3 and cap.counters["cpp_wrapper_declined"] == declined + 1
    assert not any(_calls(f.read_text(errors="replace"), "wgrad_update_") for f in tmp_path.rglob("*.cpp"))
    assert any(n.startswith("cpp_wrapper not used for this graph") for n in _LAST_REPORT[0].notes)
    assert losses == losses_py and all(torch.equal(a, b) for a, b in zip(params, params_py))
