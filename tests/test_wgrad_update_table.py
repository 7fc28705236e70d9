"""Launches that read the rule's scalars from a device table row (``launch_wgrad_update(table=...)``).

The spec: such a launch updates W and the tensor states bitwise as the launch that takes the same scalars as host
arguments (``rule_scalars`` computes them as that launch does), and it touches no scalar state. Nothing of it
depends on the step on the host, so a CUDA graph that captured it replays with whatever the row holds: checked
against eager host-scalar launches over steps whose lr and step change.
"""
from __future__ import annotations

import ast

import pytest
import torch

pytest.importorskip("triton")

from interpreter import run_child  # noqa: E402

from forge_compile.kernels import wgrad_update_gluon as wg  # noqa: E402
from forge_compile.kernels.epilogue_codegen import compile_epilogue  # noqa: E402
from forge_compile.kernels.wgrad_update_triton import (CONFIGS, check_table, launch_wgrad_update,  # noqa: E402
                                                       render_kernel_source, rule_scalars, split_states)
from forge_compile.optim import rules as R  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
RULES = [R.adamw_rule(), R.adam_rule(amsgrad=True, weight_decay=True), R.sgd_rule(momentum=True, nesterov=True,
         weight_decay=True), R.sgd_rule(), R.lion_rule(), R.rmsprop_rule(centered=True, momentum=True),
         R.adagrad_rule(weight_decay=True)]
_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9,
       "dampening": 0.1, "alpha": 0.99, "lr_decay": 0.01}


def _make(rule, n, k, m, device, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    states = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            states.append(torch.tensor(3.0 + seed))
        else:
            scale = 0.01 if name == "grad_avg" else 0.1      # centered RMSprop: square_avg - grad_avg**2 > 0
            states.append((torch.rand(n, k, generator=gen) * scale + 0.05 * (scale == 0.1)).to(device))
    dy = torch.randn(m, n, generator=gen).to(dtype).to(device)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    return w.to(device), dy.t(), x, states, hp       # dy_t: a transposed view, as autograd gives it


def _row(rule, states, hp, device, target):
    values, new = rule_scalars(rule, split_states(rule, states)[1], hp, target)
    return torch.tensor(values, dtype=torch.float32, device=device), new


def _same_as_host_launch(rule, device, target, config=None, shape=(67, 45, 31), launch=launch_wgrad_update,
                         **kw):
    w, dy_t, x, states, hp = _make(rule, *shape, device)
    w_t, st_t = w.clone(), [s.clone() for s in states]
    tensor_t, scalar_t = split_states(rule, st_t)
    table, new = _row(rule, st_t, hp, device, target)
    scalar_before = [s.item() for s in scalar_t]
    launch(w, dy_t, x, states, hp, rule, config=config, **kw)           # host scalars, states advanced
    launch(w_t, dy_t, x, tensor_t, [], rule, config=config, table=table, **kw)
    assert torch.equal(w, w_t), f"W differs in {(w != w_t).sum().item()} of {w.numel()} elements"
    for a, b in zip(split_states(rule, states)[0], tensor_t):
        assert torch.equal(a, b), f"state differs in {(a != b).sum().item()} elements"
    # the table launch leaves the scalar states to its caller; rule_scalars says where they go
    assert [s.item() for s in scalar_t] == scalar_before
    assert [s.item() for s in split_states(rule, states)[1]] == [float(v) for v in new]


# ---- CPU: rendering, argument checks -----------------------------------------------------------------------

@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_triton_table_source_differs_only_in_how_scalars_arrive(rule):
    ep = compile_epilogue(rule, "cuda")
    plain, table = render_kernel_source(ep), render_kernel_source(ep, table=True)
    n = ep.n_kernel_scalars
    params = "".join(f"c{i}, " for i in range(n))
    sig = f"W, DYT, X, {''.join(s.upper() + ', ' for s in ep.tensor_inputs[2:])}GOUT, EROWS, EPOS, EKEY,\n    "
    assert plain.count(sig + params + "N, K, M,") == 1
    loads = "".join(f"    c{i} = tl.load(SCAL + {i})\n" for i in range(n))
    # and a bf16 weight's round key, the row's word after the scalars, where the launch says so (TKEY: TABLE_KEY)
    key = f"    if TKEY:\n        EKEY = tl.load(SCAL + {n}).to(tl.int32, bitcast=True)\n"
    expect = plain.replace(sig + params + "N, K, M,", sig + "SCAL, N, K, M,").replace(
        "):\n    row0, col0 = _tile_origin", "):\n" + loads + key + "    row0, col0 = _tile_origin")
    assert table == expect
    ast.parse(table)


@pytest.mark.parametrize("epi", ["tma", "vec", "smem", "split"])
@pytest.mark.parametrize("rule", [R.adamw_rule(), R.sgd_rule(momentum=True), R.lion_rule()], ids=lambda r: r.name)
def test_gluon_table_source(rule, epi):
    ep = compile_epilogue(rule, "cuda")
    plain, table = wg.render_gluon_source(ep, epi), wg.render_gluon_source(ep, epi, table=True)
    assert "scal_ptr" not in plain
    ast.parse(table)
    # the kernel's signature takes the pointer in place of c0..c{n-1}; the partitions keep taking the values
    assert table.count("scal_ptr, M, N, K,") == 1
    for i in range(ep.n_kernel_scalars):
        assert table.count(f"    c{i} = gl.load(scal_ptr + {i})\n") == 1
    # everything else is the plain module's text
    stripped = table.replace("scal_ptr, M, N, K,", "".join(f"c{i}, " for i in range(ep.n_kernel_scalars))
                             + "M, N, K,")
    for i in range(ep.n_kernel_scalars):
        stripped = stripped.replace(f"    c{i} = gl.load(scal_ptr + {i})\n", "")
    assert stripped == plain


def test_split_states_and_table_checks():
    rule = R.adamw_rule()
    w, dy_t, x, states, hp = _make(rule, 16, 8, 4, "cpu")
    tensor_states, scalar_states = split_states(rule, states)
    assert len(tensor_states) == 2 and len(scalar_states) == 1 and scalar_states[0].dim() == 0
    assert split_states(rule, tensor_states, table=torch.zeros(1)) == (tensor_states, [])
    with pytest.raises(ValueError, match="tensor states"):
        split_states(rule, states, table=torch.zeros(1))         # the scalar state too: refused
    ep = compile_epilogue(rule, "cuda")
    good = torch.zeros(ep.n_kernel_scalars)
    check_table(ep, good, w)
    check_table(ep, torch.zeros(ep.n_kernel_scalars + 2), w)      # a row of a wider table: extra columns unread
    for bad in (good.double(), torch.zeros(ep.n_kernel_scalars - 1), torch.zeros(2 * ep.n_kernel_scalars)[::2],
                good.view(1, -1), [0.0] * ep.n_kernel_scalars):
        with pytest.raises(ValueError, match="fp32 scalars"):
            check_table(ep, bad, w)


def test_table_launch_refuses_hparams_before_touching_anything():
    rule = R.adamw_rule()
    w, dy_t, x, states, hp = _make(rule, 16, 8, 4, "cpu")
    w0 = w.clone()
    with pytest.raises(ValueError, match="no hyper-parameters"):
        launch_wgrad_update(w, dy_t, x, split_states(rule, states)[0], hp, rule, table=torch.zeros(5))
    assert torch.equal(w, w0)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_scalars_are_the_host_launch_scalars(rule):
    from forge_compile.kernels.wgrad_update_triton import host_scalars

    _, _, _, states, hp = _make(rule, 8, 8, 4, "cpu")
    scalar_states = split_states(rule, states)[1]
    assert rule_scalars(rule, scalar_states, hp) == host_scalars(compile_epilogue(rule, "cuda"), scalar_states, hp)


# ---- interpreter (child process with TRITON_INTERPRET=1, as in test_wgrad_update_triton) --------------------

def test_interpreter_tests_in_subprocess():
    run_child(__file__)




@pytest.mark.parametrize("config", ["interp", "interp_tma_e2", "interp_p2e4"])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_interpreter_table_same_as_host_scalars(interpret, rule, config):
    _same_as_host_launch(rule, "cpu", "interpret", config=config)


def test_interpreter_table_rewritten_between_launches(interpret):
    # one row object, values rewritten in place before each launch (what a graph replay sees), lr changing
    rule = R.adamw_rule()
    w, dy_t, x, states, hp = _make(rule, 40, 24, 16, "cpu")
    w_t, st_t = w.clone(), [s.clone() for s in states]
    tensor_t, scalar_t = split_states(rule, st_t)
    row = torch.empty(compile_epilogue(rule, "interpret").n_kernel_scalars)
    for lr in (1e-2, 3e-3, 1e-3):
        hp[0] = torch.tensor(lr, dtype=torch.float64)
        values, new = rule_scalars(rule, scalar_t, hp, "interpret")
        row.copy_(torch.tensor(values))
        launch_wgrad_update(w_t, dy_t, x, tensor_t, [], rule, config="interp", table=row)
        for s, v in zip(scalar_t, new):
            s.fill_(v)
        launch_wgrad_update(w, dy_t, x, states, hp, rule, config="interp")
    assert torch.equal(w, w_t)
    for a, b in zip(states, st_t):
        assert torch.equal(a, b)


# ---- CUDA ----------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
sm90 = pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0) and wg.gluon_available()),
                          reason="needs an sm_90 GPU with triton.experimental.gluon")


@cuda
@pytest.mark.parametrize("config", [c for c in CONFIGS if not c.startswith("interp")][:4] + ["t128e4", "tf64m32"])
@pytest.mark.parametrize("rule", [R.adamw_rule(), R.sgd_rule(momentum=True), R.lion_rule()], ids=lambda r: r.name)
def test_cuda_triton_table_same_as_host_scalars(rule, config, monkeypatch):
    monkeypatch.setenv(wg.ENV, "triton")
    _same_as_host_launch(rule, "cuda", "cuda", config=config, shape=(1000, 777, 333))


GLUON_LAYOUTS = {"tma": wg.GConfig(), "smem": wg.smem_config(), "split": wg.split_config(), "vec": wg.vec_config()}


@sm90
@pytest.mark.parametrize("layout", list(GLUON_LAYOUTS))
@pytest.mark.parametrize("rule", [R.adamw_rule(), R.sgd_rule(momentum=True), R.lion_rule()], ids=lambda r: r.name)
def test_gluon_table_same_as_host_scalars(rule, layout):
    # the rules and layouts test_wgrad_update_gluon's vector-epilogue tests cover
    def launch(w, dy_t, x, states, hp, rule, config=None, table=None):
        wg.launch(w, dy_t, x, states, hp, rule, config=GLUON_LAYOUTS[layout], max_ctas=5, table=table)

    _same_as_host_launch(rule, "cuda", "cuda", shape=(1000, 776, 333), launch=launch)


@cuda
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_cuda_table_through_launch_memo(kernel, monkeypatch):
    # the op path: repeated launches become launch-memo hits (no host scalars in the entry), still exact
    from forge_compile.kernels import launch_memo

    if kernel == "gluon" and not (torch.cuda.get_device_capability() == (9, 0) and wg.gluon_available()):
        pytest.skip("needs an sm_90 GPU with gluon")
    monkeypatch.setenv(wg.ENV, kernel)
    launch_memo.ENABLED[0] = True
    launch_memo.clear()
    rule = R.adamw_rule()
    w, dy_t, x, states, hp = _make(rule, 1024, 512, 256, "cuda")
    w_t, st_t = w.clone(), [s.clone() for s in states]
    tensor_t, scalar_t = split_states(rule, st_t)
    row = torch.empty(compile_epilogue(rule, "cuda").n_kernel_scalars, device="cuda")
    for lr in (1e-2, 5e-3, 2e-3, 1e-3):
        hp[0] = torch.tensor(lr, dtype=torch.float64)
        values, new = rule_scalars(rule, scalar_t, hp)
        row.copy_(torch.tensor(values))
        launch_wgrad_update(w_t, dy_t, x, tensor_t, [], rule, table=row)
        for s, v in zip(scalar_t, new):
            s.fill_(v)
        launch_wgrad_update(w, dy_t, x, states, hp, rule)
    assert launch_memo.counters["hit"] >= 4      # two launches per step, entries built on the second sighting
    assert torch.equal(w, w_t)
    for a, b in zip(states, st_t):
        assert torch.equal(a, b)


@cuda
def test_cuda_table_launch_autotuned(tmp_path, monkeypatch):
    # FORGE_AUTOTUNE: the table launch tunes (or reuses) the host launch's key and stays exact
    from forge_compile.kernels import launch_memo
    from forge_compile.kernels import wgrad_update_autotune as at

    monkeypatch.setenv(at.ENV, "1")
    monkeypatch.setenv("FORGE_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    at.clear(memory_only=True)
    launch_memo.clear()
    try:
        _same_as_host_launch(R.adamw_rule(), "cuda", "cuda", shape=(1024, 512, 256))
        assert at.counters["hit"] >= 1          # the second launch (the table's) reused the first one's choice
    finally:
        at.clear(memory_only=True)
        launch_memo.clear()


@cuda
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_cuda_graph_replays_table_launches(kernel, monkeypatch):
    """Two layers' launches captured once, replayed over 4 steps with new rows (step and lr change): the same W and
    states as eager host-scalar launches."""
    if kernel == "gluon" and not (torch.cuda.get_device_capability() == (9, 0) and wg.gluon_available()):
        pytest.skip("needs an sm_90 GPU with gluon")
    monkeypatch.setenv(wg.ENV, kernel)
    rule = R.adamw_rule()
    layers = [_make(rule, 1024, 512, 256, "cuda", seed=s) for s in (0, 1)]
    eager = [(w.clone(), [s.clone() for s in st]) for w, _, _, st, _ in layers]
    n_sc = compile_epilogue(rule, "cuda").n_kernel_scalars
    table = torch.zeros(len(layers), n_sc, device="cuda")
    scalar = [split_states(rule, st)[1] for _, _, _, st, _ in layers]
    hp = layers[0][4]

    def fill_table():
        rows = []
        for i, sc in enumerate(scalar):
            values, new = rule_scalars(rule, sc, hp)
            rows.append(values)
            for s, v in zip(sc, new):
                s.fill_(v)
        table.copy_(torch.tensor(rows))

    def launches():
        for i, (w, dy_t, x, st, _) in enumerate(layers):
            launch_wgrad_update(w, dy_t, x, split_states(rule, st)[0], [], rule, table=table[i])

    def eager_step():
        for (w, st), (_, dy_t, x, _, _) in zip(eager, layers):
            launch_wgrad_update(w, dy_t, x, st, hp, rule)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):       # warm-up (compiles, launch-memo entries) outside the capture, as a step
        for _ in range(2):
            fill_table()
            launches()
            eager_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    for lr in (1e-2, 4e-3, 4e-3, 1e-3):
        hp[0] = torch.tensor(lr, dtype=torch.float64)
        fill_table()
        graph.replay()
        eager_step()
    torch.cuda.synchronize()
    for (w, _, _, st, _), (w_e, st_e) in zip(layers, eager):
        assert torch.equal(w, w_e), f"W differs in {(w != w_e).sum().item()} elements"
        for a, b in zip(st, st_e):
            assert torch.equal(a, b)
