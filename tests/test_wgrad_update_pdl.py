"""Programmatic dependent launch of the split kernels (GConfig.pdl / FORGE_PDL=1 or 2): the selection on CPU, exactness
on an sm_90 GPU.

The spec of a PDL launch is the same launch without PDL: the kernel starts while the kernel before it still runs,
its epilogue warpgroups load W/states early, and its GEMM loader waits (griddepcontrol.wait) before reading dY and
X. The GPU tests make the kernel right before each launch WRITE that launch's X (a GEMM into a NaN-filled buffer):
a missing or misplaced wait reads NaN or stale rows, and W then differs from the plain launch's (or holds NaN).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from forge_compile.kernels import wgrad_update_gluon as wg  # noqa: E402
from forge_compile.kernels import wgrad_update_group as gr  # noqa: E402
from forge_compile.optim import rules as R  # noqa: E402
from models import assert_same_training  # noqa: E402

_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9,
       "dampening": 0.1}


def test_use_pdl_selection(monkeypatch):
    monkeypatch.delenv(wg.PDL_ENV, raising=False)
    split = wg.split_config(hoist=True)
    assert wg.use_pdl(split) == 0
    assert wg.use_pdl(dataclasses.replace(split, pdl=2)) == 2
    assert wg.use_pdl(dataclasses.replace(wg.smem_config(), pdl=1)) == 0   # only the split kernels wait
    for env, mode in (("1", 1), ("2", 2), ("yes", 0), ("3", 0)):
        monkeypatch.setenv(wg.PDL_ENV, env)
        assert wg.use_pdl(split) == mode and wg.use_pdl(wg.smem_config()) == 0, env


@pytest.mark.parametrize("mode", ["0", "2"])
def test_split_launch_gives_every_kernel_parameter(monkeypatch, mode):
    # launch_memo builds its fast entry only when the launch's opts name every kernel parameter past the positional
    # ones: a constexpr with a default left out (PDL) would silently send every launch down the slow path
    if not wg.gluon_available():
        pytest.skip("needs triton.experimental.gluon")
    monkeypatch.setenv(wg.PDL_ENV, mode)
    rule = R.adamw_rule()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=gen)
    st = [torch.tensor(4.0) if rule.is_scalar_state(i) else torch.rand(256, 256, generator=gen)
          for i in range(len(rule.states))]
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    dy_t = torch.randn(1024, 256, generator=gen).bfloat16().t()
    x = torch.randn(1024, 256, generator=gen).bfloat16()
    kernel, _, args, opts, _, _ = wg._prepare(w, dy_t, x, st, hp, rule, config=wg.split_config(hoist=True),
                                              max_ctas=4)
    assert [n for n in kernel.arg_names[len(args):] if n not in opts] == []
    assert opts["PDL"] == int(mode) and opts.get("launch_pdl", False) == (mode != "0")
    assert wg.counters["pdl_prepared"] >= (mode != "0")


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and wg.gluon_available()


sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU with triton.experimental.gluon")
RULES = {"adamw": R.adamw_rule(), "sgdm": R.sgd_rule(momentum=True)}


def _weight(rule, n, k, gen):
    w = torch.randn(n, k, device="cuda", generator=gen)
    states = [torch.tensor(4.0) if rule.is_scalar_state(i) else
              torch.rand(n, k, device="cuda", generator=gen) * (1e-3 if name == "exp_avg_sq" else 0.1)
              for i, name in enumerate(rule.states)]
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    return w, states, hp


def _x_writer(m, k, gen):
    """A GEMM that writes X [m, k]: long enough (K-dim 4096) that a dependent launch overlaps it."""
    a = torch.randn(m, 4096, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    b = torch.randn(4096, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    return a, b


def _run(launches, writers, xs, graphed):
    def body():
        for (a, b), x, f in zip(writers, xs, launches):
            x.fill_(float("nan"))
            torch.mm(a, b, out=x)
            f()
    body()   # graphed: also the warm-up (kernels compile and load outside the capture); the replay updates again
    if graphed:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        g.replay()
    torch.cuda.synchronize()


@sm90
@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("m", [1024, 2048])
@pytest.mark.parametrize("graphed", [False, True], ids=["launched", "graphed"])
@pytest.mark.parametrize("mode", [1, 2])
def test_pdl_launch_is_the_plain_launch(name, m, graphed, mode):
    # three weights in a row (the second launch's predecessor is the first's X writer, etc.), every update bitwise
    # the plain launch's; a CUDA graph keeps the programmatic edges
    rule = RULES[name]
    gen = torch.Generator(device="cuda").manual_seed(m)
    shapes = [(512, 768), (1024, 512), (384, 1024)]
    weights = [_weight(rule, n, k, gen) for n, k in shapes]
    dys = [torch.randn(m, n, device="cuda", generator=gen, dtype=torch.bfloat16).t() for n, _ in shapes]
    writers = [_x_writer(m, k, gen) for _, k in shapes]
    xs = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes]
    cfg = wg.split_config(hoist=True)
    results = []
    for c in (cfg, dataclasses.replace(cfg, pdl=mode)):
        ws = [(w.clone(), [s.clone() for s in st]) for w, st, _ in weights]
        launches = [wg.bound_launch(w, dy, x, st, hp, rule, config=c)
                    for (w, st), dy, x, (_, _, hp) in zip(ws, dys, xs, weights)]
        _run(launches, writers, xs, graphed)
        results.append(ws)
    for i, ((w0, s0), (w1, s1)) in enumerate(zip(*results)):
        assert not w1.isnan().any(), f"weight {i}: the PDL launch read X before its writer finished"
        assert torch.equal(w0, w1), f"weight {i}: W differs in {(w0 != w1).sum().item()} of {w0.numel()} elements"
        assert all(torch.equal(a, b) for a, b in zip(s0, s1)), f"weight {i}: a state differs"


@sm90
@pytest.mark.parametrize("graphed", [False, True], ids=["launched", "graphed"])
@pytest.mark.parametrize("mode", [1, 2])
def test_pdl_grouped_launch_is_the_plain_one(graphed, mode):
    # the grouped kernel's loader waits too: two groups in a row, each X written right before its launch
    rule = RULES["adamw"]
    m, k = 1024, 512
    gen = torch.Generator(device="cuda").manual_seed(7)
    groups = []
    for ns in ([256, 128, 200], [384, 256]):
        members = [_weight(rule, n, k, gen) for n in ns]
        dys = [torch.randn(m, n, device="cuda", generator=gen, dtype=torch.bfloat16).t() for n in ns]
        groups.append((members, dys))
    writers = [_x_writer(m, k, gen) for _ in groups]
    xs = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _ in groups]
    cfg = gr.group_config()
    results = []
    for c in (cfg, dataclasses.replace(cfg, pdl=mode)):
        copies = [[(w.clone(), [s.clone() for s in st]) for w, st, _ in members] for members, _ in groups]
        launches = [gr.bound_launch_group([w for w, _ in cp], dys, x, [st for _, st in cp],
                                          [hp for _, _, hp in members], rule, config=c)
                    for cp, (members, dys), x in zip(copies, groups, xs)]
        _run(launches, writers, xs, graphed)
        results.append(copies)
    for g, (a, b) in enumerate(zip(*results)):
        for i, ((w0, s0), (w1, s1)) in enumerate(zip(a, b)):
            assert not w1.isnan().any(), f"group {g} member {i}: read X before its writer finished"
            assert torch.equal(w0, w1) and all(torch.equal(p, q) for p, q in zip(s0, s1)), f"group {g} member {i}"


def _train(mode, cuda_graphs, monkeypatch, steps=3):
    import forge_compile as forge
    from forge_compile.kernels import launch_memo

    monkeypatch.setenv(wg.PDL_ENV, str(mode))
    launch_memo.clear()      # a remembered launch keeps the launch options it was first prepared with
    gr._MEMO.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    @forge.compile_train_step(cuda_graphs=cuda_graphs)
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    gen = torch.Generator(device="cuda").manual_seed(1)
    # 2048 tokens: the fused updates take the split kernel (pick_gconfig), the one PDL applies to
    batches = [(torch.randn(2048, 512, device="cuda", generator=gen), torch.randn(2048, 256, device="cuda",
                                                                                   generator=gen))
               for _ in range(steps)]
    losses = [step(x, y).item() for x, y in batches]
    return model, opt, losses


@sm90
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["launches", "graphed"])
@pytest.mark.parametrize("mode", [1, 2])
def test_pdl_train_step_is_the_plain_step(monkeypatch, cuda_graphs, mode):
    # the whole compiled step (Inductor's kernels before each fused launch) with FORGE_PDL: bitwise the plain step --
    # the same kernels, only the launch mode differs. Mode 2 lets the epilogue read W/states before the kernel
    # before has finished: this is where an Inductor copy into them right before a fused launch would show
    m0, o0, l0 = _train(0, cuda_graphs, monkeypatch)
    wg.counters.clear()
    m1, o1, l1 = _train(mode, cuda_graphs, monkeypatch)
    torch.cuda.synchronize()
    assert wg.counters["pdl_prepared"] >= 3, dict(wg.counters)    # the three linears' updates went as PDL
    assert l0 == l1
    assert_same_training(m0, m1, o0, o1)
