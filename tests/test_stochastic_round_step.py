"""compile_train_step(stochastic_rounding=...): bf16 parameters updated in fp32 and stored rounded stochastically.

Against the spec (kernels/stochastic_round.py + the rule on fp32 copies), against torch.optim where round to nearest
loses small updates, and the report / refusal paths. CPU; the kernels themselves are in test_stochastic_round.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import forge_compile as forge
from models import TinyLM, lm_loss
from forge_compile.kernels.stochastic_round import element_key, round_key
from forge_compile.kernels.wgrad_update import reference_update
from forge_compile.optim import rules


def _adamw_hparams(opt):
    g = opt.param_groups[0]
    return [torch.tensor(v, dtype=torch.float64) for v in (g["lr"], *g["betas"], g["eps"], g["weight_decay"])]


def _step(model, opt, loss_fn, max_norm=None):
    # a train step on loss_fn(fp32 output, target); ``max_norm``: clip_grad_norm_ before the update
    def step(x, y):
        loss = loss_fn(model(x).float(), y)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _linear_step(model, opt, max_norm=None):
    # loss = sum(c * y): dY = c (as bf16) exactly, so the step's fp32 dW is dY^T X computed in fp32
    return _step(model, opt, lambda y, c: (y * c).sum(), max_norm)


def _mse_step(model, opt):
    return _step(model, opt, F.mse_loss)


def _lm_step(model, opt, max_norm=None):
    return _step(model, opt, lm_loss, max_norm)


def _sgdm(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _train_lm(device, make_opt, steps, rows=4, tied=False, max_norm=None, **options):
    # TinyLM in bf16 (seed 0) trained by compile_train_step(**options) on ``steps`` token batches [rows, 8] drawn from
    # seed 1, clip_grad_norm_(max_norm) if given: (model, losses, last report)
    torch.manual_seed(0)
    model = TinyLM(tied=tied).to(device, torch.bfloat16)
    opt = make_opt(model.parameters())
    step = forge.compile_train_step(_lm_step(model, opt, max_norm), **options)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 40, (rows, 8), generator=g).to(device)
        losses.append(step(x, torch.roll(x, -1, 1)).item())
    return model, losses, step.last_report


def _same_first_loss(a: float, b: float, device: str) -> bool:
    # the loss before any update, from two compiles of the same bf16 model (fused / unfused step): equal on CPU; on
    # CUDA Inductor picks its reduction kernels' configs by timing, so two compiles may sum in different orders (H100,
    # whole suite on 12 processes: 3.84514 vs 3.84512, 4.9e-6 relative; the same test passed bitwise run alone). A
    # skipped or wrong update shows in the later losses and the weights, which the callers check
    return a == b if device == "cpu" else abs(a - b) <= 1e-4 * abs(a)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def _mismatch(a, b) -> float:
    return (a.view(torch.int16) != b.view(torch.int16)).float().mean().item()


def _steps_follow_the_spec(step, model, opt, c, device, m, k, seed, salt):
    # three steps of loss = sum(c * model(x)) against the spec on dY^T X in fp32, the key round_key(seed, call)
    n = model.weight.shape[0]
    w = model.weight.detach().clone()
    st = [torch.tensor(0.0), torch.zeros(n, k, dtype=torch.bfloat16, device=device),
          torch.zeros(n, k, dtype=torch.bfloat16, device=device)]
    rule = rules.adamw_rule().name
    for call in range(3):
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        step(x, c)
        dw = c.to(torch.bfloat16).float().t() @ x.float()
        reference_update(w, dw, st, _adamw_hparams(opt), rule, element_key(round_key(seed, call), salt))
        state = opt.state[model.weight]
        assert state["exp_avg"].dtype == torch.bfloat16 and float(state["step"]) == call + 1
        assert model.weight.grad is None      # fused: no gradient is made
        if device == "cpu":      # the CPU path's dW is torch.mm's: bitwise
            assert torch.equal(model.weight.view(torch.int16), w.view(torch.int16)), f"call {call}"
            assert torch.equal(state["exp_avg"], st[1]) and torch.equal(state["exp_avg_sq"], st[2])
        else:
            # the kernel's dW sums the tokens in another order than cuBLAS: an element whose fp32 result moves by
            # an ulp crosses a rounding boundary with probability ~2**-16 per ulp (the kernel-level test,
            # test_stochastic_round.py, is bitwise on the dW the kernel stored); the reference is reset each call
            assert _mismatch(model.weight, w) < 1e-3 and _mismatch(state["exp_avg"], st[1]) < 1e-3, f"call {call}"
            w.copy_(model.weight)
            st[1].copy_(state["exp_avg"])
            st[2].copy_(state["exp_avg_sq"])


@pytest.mark.parametrize("device", DEVICES)
def test_fused_bf16_weight_is_the_spec_on_the_fp32_dw(device):
    torch.manual_seed(0)
    n, k, m = (48, 40, 24) if device == "cpu" else (512, 384, 256)
    model = nn.Linear(k, n, bias=False).to(device, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    c = torch.randn(m, n, device=device).to(torch.bfloat16).float()
    step = forge.compile_train_step(_linear_step(model, opt), stochastic_rounding=7)
    _steps_follow_the_spec(step, model, opt, c, device, m, k, seed=7, salt=0)
    d = step.last_report.rows[0]
    assert d.fused, d.reason
    assert any("stochastic_rounding: 1 bf16 parameters" in n and "1 of them by fused" in n
               for n in step.last_report.notes)


@pytest.mark.parametrize("route", ["step", "backend"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_bf16_embedding_is_the_spec(device, route):
    # loss = sum(c * emb(idx)): the embedding's gradient is c's rows summed per index (its dense backward); the step
    # updates the bf16 table from the compact rows with the spec's rounding, the salt its index in the step
    from forge_compile.kernels.embedding_update import reference_embedding_update

    torch.manual_seed(0)
    v, k, shape = 50, 24, (3, 7)
    emb = nn.Embedding(v, k, padding_idx=2).to(device, torch.bfloat16)
    opt = torch.optim.AdamW(emb.parameters(), lr=1e-3, weight_decay=0.01)
    c = torch.randn(*shape, k, device=device).to(torch.bfloat16)

    if route == "step":
        step = forge.compile_train_step(_linear_step(emb, opt), stochastic_rounding=9)
    else:       # the Dynamo route: the embedding's backward kept whole, fused as embedding_update_rounded_
        from forge_compile import backend

        backend.clear_reports()
        step = _linear_step(_backend_compile(emb, opt, stochastic_rounding=9), opt)
    w = emb.weight.detach().clone()
    st = [torch.tensor(0.0), torch.zeros(v, k, dtype=torch.bfloat16, device=device),
          torch.zeros(v, k, dtype=torch.bfloat16, device=device)]
    for call in range(3):
        idx = torch.randint(0, 20, shape, device=device)
        step(idx, c)
        reference_embedding_update(w, c, idx, st, _adamw_hparams(opt), rules.adamw_rule().name, 2,
                                   ekey=element_key(round_key(9, call), 0))
        assert torch.equal(emb.weight.view(torch.int16), w.view(torch.int16)), f"call {call}"
        assert torch.equal(opt.state[emb.weight]["exp_avg"], st[1])
        assert emb.weight.grad is None
    rep = step.last_report if route == "step" else backend.last_report()
    assert rep.rows[0].fused, rep
    assert any(n.startswith("stochastic_rounding: 1") for n in rep.notes), rep


def _regression(route, steps=60, lr=2e-4, seed=0):
    # y = x @ A^T + 2 from a weight that starts near A: Adam's updates (~lr = 2e-4) are far below half a bf16 ulp
    # of the weight (>= 2**-8 = 3.9e-3 at magnitudes in [1, 4)), so round to nearest never moves it
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(16, 32, generator=g) * 0.3 + 2.5).clamp(1.2, 3.8)   # every |w| in [1, 4): ulp >= 2**-7
    model = nn.Linear(32, 16, bias=True)
    with torch.no_grad():
        model.weight.copy_(a + 0.05 * torch.randn(16, 32, generator=g))
        model.bias.fill_(2.0)
    if route != "fp32":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    step = _mse_step(model, opt)
    if route == "sr":
        step = forge.compile_train_step(step, stochastic_rounding=True)
    elif route == "forge_rne":
        step = forge.compile_train_step(step)
    w0 = model.weight.detach().float().clone()
    b0 = model.bias.detach().float().clone()
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        y = x @ a.t() + 2.0
        step(x.to(model.weight.dtype), y)
    return ((model.weight.detach().float() - w0).abs().mean().item(),
            (model.bias.detach().float() - b0).abs().mean().item(), step)


def test_small_updates_move_bf16_weights_only_with_stochastic_rounding():
    moved_fp32, bias_fp32, _ = _regression("fp32")
    moved_eager, bias_eager, _ = _regression("eager")
    moved_rne, bias_rne, step_rne = _regression("forge_rne")
    moved_sr, bias_sr, step_sr = _regression("sr")
    assert moved_eager == 0 and bias_eager == 0      # torch.optim on bf16: every update rounds away
    assert moved_rne == 0 and bias_rne == 0          # forge without the option: the same (unfused, eager's math)
    assert not step_rne.last_report.rows[0].fused
    assert "stochastic_rounding=True" in step_rne.last_report.rows[0].reason
    # with it the weight and the (unfused) bias travel as far as in fp32, on average
    assert 0.5 * moved_fp32 < moved_sr < 2 * moved_fp32, (moved_sr, moved_fp32)
    assert 0.5 * bias_fp32 < bias_sr < 2 * bias_fp32, (bias_sr, bias_fp32)
    by_name = {d.name: d for d in step_sr.last_report.rows}
    assert by_name["model.weight"].fused and not by_name["model.bias"].fused, by_name


def test_same_seed_same_weights_other_seed_other_weights():
    def run(seed):
        torch.manual_seed(0)
        model = TinyLM().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = forge.compile_train_step(_lm_step(model, opt), stochastic_rounding=seed)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 40, (2, 8), generator=g)
            step(x, torch.roll(x, -1, 1))
        return model, step

    m1, s1 = run(3)
    m2, _ = run(3)
    m3, _ = run(4)
    for (name, a), b, c in zip(m1.named_parameters(), m2.parameters(), m3.parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(m1.parameters(), m3.parameters()))
    fused = {d.name for d in s1.last_report.rows if d.fused}
    # every projection fused, and the embedding (forge::embedding_update_rounded_)
    assert {f"model.{n}.weight" for n in ("block.qkv", "block.proj", "block.up", "block.down", "head",
                                          "emb")} <= fused


@pytest.mark.parametrize("device", DEVICES)
def test_fused_and_unfused_rounding_agree_in_distribution(device):
    # fuse=False rounds the same spec from torch's bf16 gradient instead of the fp32 dW: close, not equal
    m1, l1, _ = _train_lm(device, _sgdm, 4, stochastic_rounding=True, fuse=True)
    m2, l2, _ = _train_lm(device, _sgdm, 4, stochastic_rounding=True, fuse=False)
    assert _same_first_loss(l1[0], l2[0], device), (l1, l2)
    assert abs(l1[-1] - l2[-1]) < 0.05 * abs(l2[0] - l2[-1]) + 1e-2, (l1, l2)
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        # a bf16 ulp or two per step apart at most (|w| < 4: ulp <= 2**-6)
        assert (a.float() - b.float()).abs().max() <= 4 * 2 ** -6, name


def test_explain_and_refusals():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).float().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randn(4, 8).to(torch.bfloat16)
    w = [p.detach().clone() for p in model.parameters()]
    from forge_compile import step_graph as sg

    sg.GRAPH_DEVICE[0] = "cpu"      # judged as if for a CPU graph device (the graphed step is CUDA's)
    try:
        rep = forge.explain(forge.compile_train_step(step, stochastic_rounding=True, cuda_graphs=True), x)
    finally:
        sg.GRAPH_DEVICE[0] = "cuda"
    assert all(torch.equal(a, b) for a, b in zip(w, model.parameters()))    # explain touched nothing
    # rounding no longer keeps a step from being replayed: the two weights and two biases read their keys from the
    # table
    assert any("replayed as one CUDA graph; 4 updates" in n for n in rep.notes), rep.notes
    assert any("4 stochastically rounded updates read their step's random key" in n for n in rep.notes), rep.notes
    assert sum(d.fused for d in rep.rows) == 2
    with pytest.raises(TypeError, match="stochastic_rounding"):
        forge.compile_train_step(step, stochastic_rounding="yes")


def test_interpreter_tests_in_subprocess():
    pytest.importorskip("triton")
    from interpreter import run_child

    run_child(__file__)


def _table_steps_follow_the_spec(device, make_step, bias=True, recorder=None):
    # a bf16 Linear whose updates read their scalars and their step's key from a scalar table (route 1's
    # cuda_graphs, route 2's scalar_table): the weight's update forge::wgrad_update_table_ on the bf16 weight, the
    # bias's (route 1) forge::rule_update_ rounded. Small integers as inputs, so dW and the bias gradient are exact
    # in fp32 whatever the summation order: the spec is bitwise. Five calls (route 1: two eager warm-ups, then the
    # capture and three replays -- the capture's call replays too), each with its own key: a replay reusing the
    # captured key would round call 4 like call 3. ``recorder``: a CPU stand-in for the CUDA graph recorder.
    from contextlib import nullcontext

    from forge_compile import step_graph as sg
    from models import CorrectlyRoundedSqrt

    torch.manual_seed(0)
    n, k, m = (24, 40, 16) if device == "cpu" else (512, 384, 256)
    model = nn.Linear(k, n, bias=bias).to(device, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if recorder is not None:
        sg.GRAPH_DEVICE[0], sg.RECORDER[0] = "cpu", recorder
    sg.counters.clear()
    try:
        step = make_step(model, opt)
        params = [(model.weight, 0)] + ([(model.bias, 1)] if bias else [])
        ref = [(p.detach().clone(), [torch.tensor(0.0)] + [torch.zeros_like(p) for _ in range(2)], salt)
               for p, salt in params]
        rule = rules.adamw_rule().name
        g = torch.Generator().manual_seed(3)
        for call in range(5):
            x = torch.randint(-2, 3, (m, k), generator=g).to(device, torch.bfloat16)
            c = torch.randint(-3, 4, (m, n), generator=g).to(device, torch.float32)
            step(x, c)
            grads = [c.t() @ x.float(), c.sum(0)]
            sqrt = CorrectlyRoundedSqrt() if device == "cpu" else nullcontext()   # the interpreter's epilogue
            for (p, _), (want, st, salt), grad in zip(params, ref, grads):
                with torch.no_grad(), sqrt:
                    reference_update(want, grad, st, _adamw_hparams(opt), rule, element_key(round_key(5, call), salt))
                state = opt.state[p]
                for name, got, exp in ((f"param {salt}", p, want), ("exp_avg", state["exp_avg"], st[1]),
                                       ("exp_avg_sq", state["exp_avg_sq"], st[2])):
                    assert torch.equal(got.view(torch.int16), exp.view(torch.int16)), \
                        f"call {call}: {name} differs in {_mismatch(got, exp):.2e} of its elements"
                assert float(state["step"]) == call + 1
        counts = dict(sg.counters)
    finally:
        sg.GRAPH_DEVICE[0], sg.RECORDER[0] = "cuda", sg.cuda_graph_recorder
    return step, counts


def _graphed_step(model, opt):
    return forge.compile_train_step(_linear_step(model, opt), stochastic_rounding=5, cuda_graphs=True)


def _check_graphed_route1(device, recorder=None):
    step, counts = _table_steps_follow_the_spec(device, _graphed_step, recorder=recorder)
    rep = step.last_report
    assert rep.rows[0].fused, rep
    assert any("2 stochastically rounded updates read their step's random key" in n for n in rep.notes), rep.notes
    assert counts.get("replays") == 3 and counts.get("eager") == 2 and counts.get("captures") == 1, counts


def test_interpreter_replayed_rounded_step_is_the_spec(interpret):
    from models import rerun_recorder

    _check_graphed_route1("cpu", rerun_recorder)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphed_rounded_step_is_the_spec():
    # a real CUDA graph: captured once, replayed with the keys written into its table
    _check_graphed_route1("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphed_lm_rounds_like_the_plain_step():
    # TinyLM in bf16 (embedding, projections, norms, head): the replayed step's rounded updates (table ops, keys from
    # the rows) against the plain step's (host keys; unfused norms through Inductor's traced spec): the same losses
    # up to rounding-boundary crossings, weights a bf16 ulp or so apart
    from forge_compile import step_graph as sg

    sg.counters.clear()
    m1, l1, rep = _train_lm("cuda", _adamw, 6, stochastic_rounding=2, cuda_graphs=True)
    assert sg.counters.get("replays", 0) >= 3, dict(sg.counters)
    assert any("stochastically rounded updates read their step's random key" in n for n in rep.notes), rep.notes
    assert rep.row("model.emb.weight").fused
    m2, l2, _ = _train_lm("cuda", _adamw, 6, stochastic_rounding=2, cuda_graphs=False)
    assert _same_first_loss(l1[0], l2[0], "cuda") and max(abs(a - b) for a, b in zip(l1, l2)) < 2e-2, (l1, l2)
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert (a.float() - b.float()).abs().max() <= 4 * 2 ** -6, name


def _check_backend_table(device, **options):
    from forge_compile import backend

    backend.clear_reports()
    _table_steps_follow_the_spec(device, lambda model, opt: _backend_step(
        model, opt, lambda y, c: (y * c).sum(), stochastic_rounding=5, **options), bias=False)
    rep = backend.last_report()
    assert rep.rows[0].fused, rep
    assert any(n.startswith("scalar_table: the fused updates read") and "1 stochastically rounded updates read "
               "their step's random key from their row" in n for n in rep.notes), rep.notes


def test_interpreter_backend_rounding_reads_its_key_from_the_table(interpret):
    # route 2 with scalar_table: the rounded fused update reads its key from the table row written before each
    # backward (what a CUDA graph of the backward needs), bitwise the spec
    _check_backend_table("cpu", scalar_table=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_backend_graphed_rounding_is_the_spec():
    # Inductor's CUDA graphs (triton.cudagraphs: scalar_table on by default) replay the rounding backward
    _check_backend_table("cuda", **{"triton.cudagraphs": True})


def _bf16_coefficients(norms, max_norm):
    # clip_grad_norm_'s coefficient from the per-parameter norms (bf16, rounded from the fp32 dW's), as the step's
    # graph may compute it: every op rounded to bf16 (eager), or -- Inductor's fused pointwise code upcasts bf16 and may
    # drop round trips to bf16 -- in fp32, from the bf16 or the fp32 norms, rounded to bf16 once or not at all
    out = set()
    stacked = torch.stack(norms)
    total = torch.linalg.vector_norm(stacked, 2.0)
    out.add(float(torch.clamp(torch.reciprocal(total + 1e-6) * max_norm, max=1.0)))
    for st in (stacked.float(), torch.stack([n.float() for n in norms])):
        for round_total in (False, True):
            t = torch.linalg.vector_norm(st, 2.0)
            t = t.bfloat16().float() if round_total else t
            coef = torch.clamp(torch.reciprocal(t + 1e-6) * max_norm, max=1.0)
            out |= {float(coef), float(coef.bfloat16())}
    return out


def test_clip_grad_norm_of_bf16_gradients_fused_with_rounding():
    # clip_grad_norm_ over rounded weights' bf16 gradients (CPU): each weight's norm from its fp32 dW (rounded to
    # bf16, the dtype torch's norm has), torch's coefficient arithmetic as traced and compiled, the update scaling the
    # fp32 dW by the coefficient. Two layers, SGD, integer inputs: the weights bitwise the spec with a coefficient
    # computed from the bf16 norms (_bf16_coefficients: which precision Inductor keeps is its business); a max_norm
    # that never clips (coefficient exactly 1) is bitwise the unclipped step
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(-2, 3, (6, 16), generator=g).to(torch.bfloat16),
                torch.randint(-3, 4, (6, 8), generator=g).float()) for _ in range(2)]

    def run(max_norm):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        step = forge.compile_train_step(_linear_step(model, opt, max_norm), stochastic_rounding=4)
        for x, c in batches:
            step(x, c)
        return model, step.last_report

    m_off, _ = run(None)
    m_big, rep_big = run(1e9)
    for a, b in zip(m_off.parameters(), m_big.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # the spec, call by call: the step's weights must be the spec's for one of the coefficient candidates
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = forge.compile_train_step(_linear_step(model, opt, 3.0), stochastic_rounding=4)
    rule = rules.sgd_rule()
    hp = [torch.tensor(0.05 if h == "lr" else 0.0, dtype=torch.float64) for h in rule.hparams]
    w = [p.detach().clone() for p in base.parameters()]
    for call, (x, c) in enumerate(batches):
        step(x, c)
        h = x @ w[0].t()                                     # the bf16 forward, as the step's matmuls
        dy = c.bfloat16()                                    # d loss / d out: exact small integers
        dh = dy @ w[1]                                       # the bf16 backward's dX
        dws = [dh.float().t() @ x.float(), dy.float().t() @ h.float()]    # the fused updates' fp32 dW
        norms = [d.pow(2).sum().sqrt().bfloat16() for d in dws]
        got = [p.detach() for p in model.parameters()]
        # (measured on CPU, torch 2.13: the fp32 chain from the bf16 norms, unrounded)
        match = None
        for coef in sorted(_bf16_coefficients(norms, 3.0)):
            assert coef < 1.0          # it clips
            cand = [p.clone() for p in w]
            for i, (p, d) in enumerate(zip(cand, dws)):
                reference_update(p, d * coef, [], hp, rule.name, element_key(round_key(4, call), i))
            if all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(cand, got)):
                match = cand
                break
        assert match is not None, f"call {call}: the step's weights are no coefficient candidate's spec"
        w = match
    for d in step.last_report.rows:
        assert d.fused and "gradient scaled in the update (clip_grad_norm_)" in d.reason, d


def test_clip_grad_norm_of_bf16_gradients_unrounded_weight_not_fused_and_said(monkeypatch):
    # the low-precision clip is taken into the update for rounded weights only; the reason names it
    from forge_compile.passes import wgrad_update_pattern as pat

    monkeypatch.setattr(pat, "_low_precision_clip_allowed", lambda apply: False)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = forge.compile_train_step(_linear_step(model, opt, 1.0), stochastic_rounding=4)
    rep = step.explain(torch.randn(4, 16).to(torch.bfloat16), torch.randn(4, 8))
    for d in rep.rows:
        assert not d.fused and "clip_grad_norm_ over bf16 gradients" in d.reason, d


def test_interpreter_replayed_clip_with_rounding(interpret):
    # the replayed step (rerun recorder, Triton's interpreter): the clipped rounded updates read the coefficient and
    # the key from their rows; against the same step without graphs: the same first loss, weights an ulp or so apart
    # (the unfused norms run rule_update_'s kernel instead of Inductor's traced rule)
    from forge_compile import step_graph as sg
    from models import rerun_recorder

    sg.GRAPH_DEVICE[0], sg.RECORDER[0] = "cpu", rerun_recorder
    sg.counters.clear()
    try:
        m1, l1, rep = _train_lm("cpu", _adamw, 5, rows=2, max_norm=0.5, stochastic_rounding=3, cuda_graphs=True)
        counts = dict(sg.counters)
    finally:
        sg.GRAPH_DEVICE[0], sg.RECORDER[0] = "cuda", sg.cuda_graph_recorder
    m2, l2, _ = _train_lm("cpu", _adamw, 5, rows=2, max_norm=0.5, stochastic_rounding=3, cuda_graphs=False)
    assert counts.get("replays") == 3, counts
    assert rep.row("model.block.qkv.weight").fused and rep.row("model.emb.weight").fused, rep
    assert any("fused updates read their gradient factor" in n for n in rep.notes), rep.notes
    assert l1[0] == l2[0] and max(abs(a - b) for a, b in zip(l1, l2)) < 1e-2, (l1, l2)
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert (a.float() - b.float()).abs().max() <= 2 * 2 ** -6, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "graphed"])
def test_cuda_clip_with_rounding(graphs):
    # the bf16 clip taken into the rounded update on CUDA (graphed: the coefficient and the key both from the table
    # row): the projections fuse and train like the same rounding step unfused (behind FORGE_SR_CLIP=1 until this
    # test's gated form passed on an H100, stop 41)
    def run(fuse):
        # SGD-momentum, not AdamW: see test_tied_lm_rounds_its_tied_weight_fused
        return _train_lm("cuda", _sgdm, 5, max_norm=0.5, stochastic_rounding=2, cuda_graphs=graphs, fuse=fuse)

    m0, l0, _ = run(False)
    m1, l1, rep1 = run(True)
    qkv = "model.block.qkv.weight"
    assert rep1.row(qkv).fused and "clip_grad_norm_" in rep1.row(qkv).reason, rep1.row(qkv)
    assert _same_first_loss(l0[0], l1[0], "cuda") and max(abs(a - b) for a, b in zip(l0, l1)) < 2e-2, (l0, l1)
    for (name, a), b in zip(m0.named_parameters(), m1.parameters()):
        assert (a.float() - b.float()).abs().max() <= 4 * 2 ** -6, name


@pytest.mark.parametrize("device", DEVICES)
def test_tied_lm_rounds_its_tied_weight_fused(device):
    # a tied embedding / output weight in bf16 (forge::wgrad_update_rounded_ with the embedding's rows): the step
    # raised before stop 39 (the rows' check wanted an fp32 weight); now fused, and close to the unfused rounding
    # SGD-momentum, as test_fused_and_unfused_rounding_agree_in_distribution: AdamW's early steps are sign-like, so an
    # element whose tiny gradient differs in sign between the fp32 dW and the bf16 gradient moves 2 lr apart
    def run(fuse):
        return _train_lm(device, _sgdm, 4, tied=True, stochastic_rounding=True, fuse=fuse)

    m1, l1, rep = run(True)
    m2, l2, _ = run(False)
    assert rep.row("model.emb.weight").fused and "tied" in rep.row("model.emb.weight").reason, rep
    assert _same_first_loss(l1[0], l2[0], device) and abs(l1[-1] - l2[-1]) < 0.05 * abs(l2[0] - l2[-1]) + 1e-2, (l1, l2)
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert (a.float() - b.float()).abs().max() <= 4 * 2 ** -6, name


def test_fp32_parameters_unaffected():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(ref.parameters())

    def make(m, o):
        def step(x):
            loss = m(x).sum()
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return step

    s1 = forge.compile_train_step(make(model, opt), stochastic_rounding=True)
    s2 = forge.compile_train_step(make(ref, ref_opt))
    for _ in range(2):
        x = torch.randn(4, 8)
        s1(x)
        s2(x)
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
    assert not any("stochastic_rounding" in n for n in s1.last_report.notes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_large_token_counts_round_unfused(monkeypatch):
    # above sr_fused_max_tokens (2048 for the Triton kernel, 8192 where the Gluon kernel takes the launch) the fused
    # bf16 update is slower than cuBLAS + the rounded update: left unfused with the reason, rounded the same way
    monkeypatch.delenv("FORGE_SR_MAX_TOKENS", raising=False)
    from forge_compile.kernels import wgrad_update_gluon as wg
    from forge_compile.passes.wgrad_update_pattern import (SR_FUSED_MAX_TOKENS, SR_GLUON_MAX_TOKENS,
                                                           sr_fused_max_tokens)

    model = nn.Linear(64, 64, bias=False).to("cuda", torch.bfloat16)
    sm90 = torch.cuda.get_device_capability() == (9, 0) and wg.gluon_available() and wg._mode() != "triton"
    limit = sr_fused_max_tokens(model.weight)
    assert limit == (SR_GLUON_MAX_TOKENS if sm90 else SR_FUSED_MAX_TOKENS)
    assert sr_fused_max_tokens(torch.empty(60, 64, device="cuda")) == SR_FUSED_MAX_TOKENS   # N % 8: Triton
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step = forge.compile_train_step(_linear_step(model, opt), stochastic_rounding=True)
    for m, fused in ((limit, True), (2 * limit, False)):
        x = torch.randn(m, 64, device="cuda").to(torch.bfloat16)
        rep = forge.explain(step, x, torch.randn(m, 64, device="cuda"))
        assert rep.rows[0].fused == fused, rep
        if not fused:
            assert f"at {m} tokens" in rep.rows[0].reason and "rounded stochastically" in rep.rows[0].reason
    # FORGE_SR_MAX_TOKENS moves the limit: the same token count fuses in a step compiled under it
    monkeypatch.setenv("FORGE_SR_MAX_TOKENS", str(2 * limit))
    step2 = forge.compile_train_step(_linear_step(model, opt), stochastic_rounding=True)
    x = torch.randn(2 * limit, 64, device="cuda").to(torch.bfloat16)
    assert forge.explain(step2, x, torch.randn(2 * limit, 64, device="cuda")).rows[0].fused


def test_sr_max_tokens_env(monkeypatch):
    # the override is read at each decision (a plain CPU tensor: no Gluon check is reached) and must be an integer
    from forge_compile.passes.wgrad_update_pattern import sr_fused_max_tokens

    monkeypatch.setenv("FORGE_SR_MAX_TOKENS", "123")
    assert sr_fused_max_tokens(torch.empty(8, 8)) == 123
    monkeypatch.setenv("FORGE_SR_MAX_TOKENS", "lots")
    with pytest.raises(ValueError, match="FORGE_SR_MAX_TOKENS"):
        sr_fused_max_tokens(torch.empty(8, 8))


def test_cpp_wrapper_rounds_the_same():
    # Inductor's C++ wrapper calls the rounded update op (forge::wgrad_update_rounded_) and the traced rounding alike
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(torch.bfloat16)
    m2 = copy.deepcopy(m1)

    def make(m, options):
        return forge.compile_train_step(_mse_step(m, torch.optim.AdamW(m.parameters(), lr=1e-3)),
                                        stochastic_rounding=True, options=options)

    s1, s2 = make(m1, {"cpp_wrapper": True}), make(m2, None)
    for _ in range(3):
        x, y = torch.randn(8, 16).to(torch.bfloat16), torch.randn(8, 8)
        s1(x, y)
        s2(x, y)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert sum(r.fused for r in s1.last_report.rows) == 2


# -- the Dynamo route: torch.compile(model, backend="forge", options={"optimizer": opt, "stochastic_rounding": ...})

def _backend_compile(model, opt, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="forge", options={"optimizer": opt, **options})


def _backend_step(model, opt, loss_fn, **options):
    return _step(_backend_compile(model, opt, **options), opt, loss_fn)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_fused_bf16_weight_is_the_spec_on_the_fp32_dw(device):
    # route 2 rounds a fused bf16 weight as route 1 does: key round_key(seed, optimizer steps), salt = the
    # parameter's index in the optimizer
    from forge_compile import backend

    torch.manual_seed(0)
    n, k, m = (48, 40, 24) if device == "cpu" else (512, 384, 256)
    model = nn.Sequential(nn.Linear(k, 8, bias=False), nn.Linear(k, n, bias=False)).to(device, torch.bfloat16)
    model = model[1]    # the optimizer's second parameter: salt 1
    other = nn.Linear(k, 8, bias=False).to(device, torch.bfloat16)
    opt = torch.optim.AdamW([other.weight, model.weight], lr=1e-3, weight_decay=0.01)
    c = torch.randn(m, n, device=device).to(torch.bfloat16).float()
    backend.clear_reports()
    step = _backend_step(model, opt, lambda y, c: (y * c).sum(), stochastic_rounding=7)
    _steps_follow_the_spec(step, model, opt, c, device, m, k, seed=7, salt=1)
    rep = backend.last_report()
    assert rep.rows[0].fused, rep
    assert any(n.startswith("stochastic_rounding: 1 of this backward's 1 bf16 parameters") for n in rep.notes), rep
    assert "wgrad_update_rounded_(" in backend.last_graphs()[-1].roles and "salt=1" in backend.last_graphs()[-1].roles


@pytest.mark.parametrize("bias", [False, True], ids=["fused_only", "with_biases"])
def test_backend_and_compile_train_step_round_alike(bias):
    # the same seed, model and batches: route 2's parameters bitwise route 1's -- the fused weights (both routes fuse
    # every weight here) and, with biases, the bf16 parameters route 2 leaves unfused, which its pre-step hook
    # rounds with the same key and salt as route 1's traced update
    from forge_compile import backend

    backend.clear_reports()
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(16, 32, bias=bias), nn.GELU(), nn.Linear(32, 8, bias=bias)).to(torch.bfloat16)
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-3)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    s1 = forge.compile_train_step(_mse_step(m1, o1), stochastic_rounding=3)
    s2 = _backend_step(m2, o2, F.mse_loss, stochastic_rounding=3)
    before = backend.counters["rounded_before_step"]
    for _ in range(4):
        x, y = torch.randn(12, 16).to(torch.bfloat16), torch.randn(12, 8)
        s1(x, y)
        s2(x, y)
    assert [d.fused for d in s1.last_report.rows if d.name.endswith("weight")] == [True, True]
    rep = backend.last_report()
    assert [d.fused for d in rep.rows if d.name.endswith("weight")] == [True, True], rep
    assert backend.counters["rounded_before_step"] - before == (8 if bias else 0)
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    if bias:
        note = next(n for n in rep.notes if n.startswith("stochastic_rounding"))
        assert "2 of this backward's 4 bf16 parameters" in note and "pre-step hook" in note, note


def test_backend_rounds_a_parameter_the_backward_left_unfused():
    # a bf16 bias whose update no backward fused: updated at opt.step() as route 1's traced spec (the rule in fp32,
    # rounded with the step's key and the parameter's salt), not torch.optim's round-to-nearest; fp32 parameters of
    # the same optimizer stay torch.optim's
    from forge_compile.kernels.stochastic_round import element_key

    torch.manual_seed(0)
    model = nn.Linear(16, 8).to(torch.bfloat16)
    extra = nn.Parameter(torch.randn(5))                # fp32, not in the model: torch.optim's own update
    opt = torch.optim.AdamW([model.weight, model.bias, extra], lr=1e-2)
    ref_extra = extra.detach().clone()
    ref_opt = torch.optim.AdamW([ref_extra.requires_grad_()], lr=1e-2)
    step = _backend_step(model, opt, F.mse_loss, stochastic_rounding=5)
    b = model.bias.detach().clone()
    st = [torch.tensor(0.0), torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)]
    for call in range(3):
        x, y = torch.randn(12, 16).to(torch.bfloat16), torch.randn(12, 8)
        (extra.sum() * 0.5 + 0 * extra[0]).backward()
        ref_extra.grad = extra.grad.clone()
        # the bias's gradient as the backward will produce it: d mse / d bias = sum over rows of dY (bf16 model)
        with torch.enable_grad():
            probe = copy.deepcopy(model)
            F.mse_loss(probe(x).float(), y).backward()
        g = probe.bias.grad
        step(x, y)
        ref_opt.step()
        ref_opt.zero_grad()
        reference_update(b, g.float(), st, _adamw_hparams(opt), rules.adamw_rule().name,
                         element_key(round_key(5, call), 1))
        assert torch.equal(model.bias.view(torch.int16), b.view(torch.int16)), f"call {call}"
        assert torch.equal(extra, ref_extra)
        assert model.bias.grad is None


def test_backend_stochastic_rounding_option_checks():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="forge", options={"optimizer": opt, "stochastic_rounding": "yes"})
    with pytest.raises(Exception, match="stochastic_rounding takes a bool or an int seed"):
        compiled(torch.randn(2, 4).to(torch.bfloat16))


def test_backend_sparse_gradient_is_said_not_rounded(caplog):
    # the pre-step hook rounds dense gradients only: a bf16 parameter with a sparse one keeps torch.optim's update
    # (round to nearest), and the user is told once, with its index in the optimizer
    import logging

    from forge_compile.backend import counters

    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True).to(torch.bfloat16)
    ref = copy.deepcopy(emb)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    compiled = _backend_compile(emb, opt, stochastic_rounding=3)
    before = counters["round_sparse_left"]
    with caplog.at_level(logging.WARNING, logger="forge_compile.backend"):
        for _ in range(2):
            idx = torch.tensor([1, 3, 3, 7])
            compiled(idx).float().sum().backward()
            ref(idx).float().sum().backward()
            assert emb.weight.grad.layout == torch.sparse_coo
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
    assert torch.equal(emb.weight, ref.weight)
    assert counters["round_sparse_left"] - before == 2
    said = [r for r in caplog.records if "sparse gradient" in r.getMessage()]
    assert len(said) == 1 and "[0]" in said[0].getMessage()
