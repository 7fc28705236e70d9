"""``forge::rule_update_``: the rule's generated epilogue applied to an existing gradient, scalars from a table row.

Spec: bitwise what eager ``rule.apply`` does to the same parameter, gradient and states (on CUDA; on CPU through
Triton's interpreter against eager CPU torch with a correctly rounded sqrt, as for the fused kernel), the scalar
states left to the caller (``rule_scalars`` says where they go).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("triton")

from interpreter import run_child  # noqa: E402
from models import CorrectlyRoundedSqrt  # noqa: E402
from forge_compile.kernels import rule_update as ru  # noqa: E402
from forge_compile.kernels.epilogue_codegen import compile_epilogue  # noqa: E402
from forge_compile.kernels.stochastic_round import table_row  # noqa: E402
from forge_compile.kernels.wgrad_update_triton import rule_scalars, split_states  # noqa: E402
from forge_compile.optim import rules as R  # noqa: E402

RULES = [R.adamw_rule(), R.adam_rule(amsgrad=True, weight_decay=True), R.sgd_rule(),
         R.sgd_rule(momentum=True, nesterov=True, weight_decay=True), R.lion_rule(),
         R.rmsprop_rule(centered=True, momentum=True), R.adagrad_rule(weight_decay=True)]
_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9,
       "dampening": 0.1, "alpha": 0.99, "lr_decay": 0.01}
SHAPES = [(3000,), (67, 45), (2, 3, 1031)]     # 1-D with a ragged last block, 2-D, 3-D


def _make(rule, shape, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen)
    states = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            states.append(torch.tensor(3.0 + seed))
        else:
            scale = 0.01 if name == "grad_avg" else 0.1
            states.append((torch.rand(shape, generator=gen) * scale + 0.05 * (scale == 0.1)).to(device))
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    return p.to(device), g.to(device), states, hp


def _check(rule, shape, device, target):
    p, g, states, hp = _make(rule, shape, device)
    p_e, st_e = p.clone(), [s.clone() for s in states]
    tensor_states, scalar_states = split_states(rule, states)
    values, new = rule_scalars(rule, scalar_states, hp, target)
    row = torch.tensor(values, dtype=torch.float32, device=device)
    before = [s.item() for s in scalar_states]
    torch.ops.forge.rule_update_(p, g, tensor_states, row, rule.name)
    with torch.no_grad(), (CorrectlyRoundedSqrt() if device == "cpu" else contextlib.nullcontext()):
        rule.apply(p_e, g, st_e, hp)
    assert torch.equal(p, p_e), f"param differs in {(p != p_e).sum().item()} of {p.numel()} elements"
    for a, b in zip(tensor_states, split_states(rule, st_e)[0]):
        assert torch.equal(a, b), f"state differs in {(a != b).sum().item()} elements"
    assert [s.item() for s in scalar_states] == before                  # the caller's part
    assert [s.item() for s in split_states(rule, st_e)[1]] == [float(v) for v in new]


# ---- CPU --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_source_renders_and_reads_every_scalar(rule):
    import ast

    ep = compile_epilogue(rule, "cuda")
    src = ru.render_rule_update_source(ep)
    ast.parse(src)
    for i in range(ep.n_kernel_scalars):
        assert f"c{i} = tl.load(SCAL + {i})" in src


def test_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("FORGE_TRITON_CPU", raising=False)
    rule = R.sgd_rule(momentum=True)
    p, g, states, hp = _make(rule, (8,), "cpu")
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        torch.ops.forge.rule_update_(p, g, states, torch.zeros(3), rule.name)


def test_interpreter_tests_in_subprocess():
    run_child(__file__)




@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_interpreter_same_as_eager_rule(interpret, rule, shape):
    _check(rule, shape, "cpu", "interpret")


def test_interpreter_refuses_mismatched_inputs(interpret):
    rule = R.adamw_rule()
    p, g, states, hp = _make(rule, (16, 8), "cpu")
    tensor_states = split_states(rule, states)[0]
    row = torch.zeros(compile_epilogue(rule, "interpret").n_kernel_scalars)
    p0 = p.clone()
    for bad_p, bad_g, bad_st, bad_row, match in [
            (p, g.double(), tensor_states, row, "gradient"),
            (p, g[:, :4], tensor_states, row, "gradient"),
            (p, g, tensor_states[:1], row, "tensor states"),
            (p, g, tensor_states, row[:-1], "fp32 scalars")]:
        with pytest.raises(ValueError, match=match):
            ru.launch_rule_update(bad_p, bad_g, bad_st, bad_row, rule)
    assert torch.equal(p, p0)


# ---- a bf16 parameter rounded stochastically (the key the row's word after the scalars) --------------------------

def _check_rounded(rule, shape, device, target, state_dtype=torch.bfloat16, grad_dtype=torch.bfloat16,
                   ekeys=(0x7FFFFFFF, 16, 123456789)):
    # bitwise Rule.apply_rounded (the spec: the rule on fp32 values, the parameter rounded with the spec's bits, the
    # states rounded to nearest) at each key -- a key loaded from the row, not an argument: what a replay needs
    p, g, states, hp = _make(rule, shape, device)
    p, g = (p * 0.5).bfloat16(), g.to(grad_dtype)
    states = [s if rule.is_scalar_state(i) else s.to(state_dtype) for i, s in enumerate(states)]
    for ekey in ekeys:
        p0 = p.clone()
        p_e, st_e = p.clone(), [s.clone() for s in states]
        tensor_states, scalar_states = split_states(rule, states)
        values, new = rule_scalars(rule, scalar_states, hp, target)
        torch.ops.forge.rule_update_(p, g, tensor_states, table_row(values, ekey).to(device), rule.name)
        for s, v in zip(scalar_states, new):
            s.fill_(v)
        with torch.no_grad(), (CorrectlyRoundedSqrt() if device == "cpu" else contextlib.nullcontext()):
            rule.apply_rounded(p_e, g, st_e, hp, ekey)
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.view(torch.int16), p_e.view(torch.int16)), \
            f"param differs in {(p.view(torch.int16) != p_e.view(torch.int16)).sum().item()} of {p.numel()} elements"
        for a, b in zip(states, st_e):
            assert a.dtype == b.dtype and torch.equal(a, b), f"state differs in {(a != b).sum().item()} elements"
        assert (p != p0).float().mean() > 0.1


ROUNDED_RULES = [R.adamw_rule(), R.sgd_rule(momentum=True), R.lion_rule()]


@pytest.mark.parametrize("rule", ROUNDED_RULES, ids=lambda r: r.name)
def test_rounded_source_reads_the_key_from_the_row(rule):
    import ast

    ep = compile_epilogue(rule, "cuda")
    src = ru.render_rule_update_rounded_source(ep)
    ast.parse(src)
    assert f"EKEY = tl.load(SCAL + {ep.n_kernel_scalars}).to(tl.int32, bitcast=True)" in src
    assert "_sround_bits(new_p, off, EKEY)" in src and "def rule_update_rounded_kernel(P, G, " in src


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rule", ROUNDED_RULES, ids=lambda r: r.name)
def test_interpreter_rounded_same_as_spec(interpret, rule, state_dtype):
    _check_rounded(rule, (67, 45), "cpu", "interpret", state_dtype)
    _check_rounded(R.adamw_rule(), (3000,), "cpu", "interpret", state_dtype, torch.float32, ekeys=(5,))


def test_interpreter_rounded_refuses_a_row_without_the_key(interpret):
    rule = R.adamw_rule()
    p, g, states, hp = _make(rule, (16, 8), "cpu")
    p, g = p.bfloat16(), g.bfloat16()
    tensor_states = [s.bfloat16() for s in split_states(rule, states)[0]]
    p0 = p.clone()
    with pytest.raises(ValueError, match="round key"):
        ru.launch_rule_update(p, g, tensor_states, torch.zeros(compile_epilogue(rule, "interpret").n_kernel_scalars),
                              rule)
    with pytest.raises(ValueError, match="bf16"):      # an fp16 state is neither
        ru.launch_rule_update(p, g, [tensor_states[0].half(), tensor_states[1]], torch.zeros(16), rule)
    assert torch.equal(p, p0)


# ---- CUDA -------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES + [(4096, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_cuda_same_as_eager_rule(rule, shape):
    _check(rule, shape, "cuda", "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rule", ROUNDED_RULES, ids=lambda r: r.name)
def test_cuda_rounded_same_as_spec(rule, state_dtype):
    _check_rounded(rule, (1000, 776), "cuda", "cuda", state_dtype)
    _check_rounded(rule, (4096,), "cuda", "cuda", state_dtype, torch.float32, ekeys=(1,))
