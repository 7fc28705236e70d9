"""The CPU impl's in-place fast paths (kernels/wgrad_update_cpu.py) against the functional rules they stand for.

The spec is ``rule.fn`` on the same dW, bit for bit (sign of zero included): every comparison here runs the rule
itself, never the fast path, on the dW the kernel consumed (``grad_out``) or, with inputs whose products sum
exactly in any order, on ``reference_wgrad_update``'s whole-matrix dW.
"""
import itertools
import logging

import pytest
import torch

from forge_compile.kernels import wgrad_update_cpu as cpu
from forge_compile.kernels.wgrad_update import reference_wgrad_update, wgrad_update
from forge_compile.optim import rules
from forge_compile.optim.rule import Rule, register_rule


def _catalogue():
    out = []
    for a, m, w, d in itertools.product((False, True), repeat=4):
        out.append(rules.adam_rule(amsgrad=a, maximize=m, weight_decay=w, decoupled=d))
    for mo, ne, w, m in itertools.product((False, True), repeat=4):
        if ne and not mo:
            continue
        out.append(rules.sgd_rule(momentum=mo, nesterov=ne, weight_decay=w, maximize=m))
    out += [rules.lion_rule(maximize=m) for m in (False, True)]
    out += [rules.adagrad_rule(weight_decay=w, maximize=m) for w, m in itertools.product((False, True), repeat=2)]
    for c, mo, w, m in itertools.product((False, True), repeat=4):
        out.append(rules.rmsprop_rule(centered=c, momentum=mo, weight_decay=w, maximize=m))
    return list({r.name: r for r in out}.values())


CATALOGUE = _catalogue()
# torch.optim-like values, and a second set off the usual range (beta1 < 0.5 is where torch's lerp switches form)
HPARAMS = [
    dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, momentum=0.9, dampening=0.1,
         lr_decay=0.01, alpha=0.99),
    dict(lr=0.3, beta1=0.3, beta2=0.7, eps=1e-3, weight_decay=0.5, momentum=0.4, dampening=0.0,
         lr_decay=0.5, alpha=0.6),
]
POSITIVE_STATES = ("exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg")


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _assert_bit_equal(got, want, what):
    assert got.shape == want.shape, what
    diff = _bits(got) != _bits(want)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} elements differ"


def _args(rule, n, k, hp, gen):
    w = torch.randn(n, k, generator=gen)
    states = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            states.append(torch.tensor(3.0))
        else:
            s = torch.randn(n, k, generator=gen) * 0.01
            states.append(s.abs() if name in POSITIVE_STATES else s)
    hparams = [torch.tensor(hp[name], dtype=torch.float64) for name in rule.hparams]
    return w, states, hparams


@pytest.fixture
def tiled(monkeypatch):
    """Ragged 2-D tiling: 16-row blocks split into 12-column pieces at 45 columns, 67 rows."""
    monkeypatch.setattr(cpu, "_CPU_BLOCK_BYTES", 4 * 200)
    monkeypatch.setattr(cpu, "_CPU_BLOCK_MIN_ROWS", 16)
    assert cpu.cpu_block_shape(67, 45) == (16, 12)


def _run_and_compare(rule, dtype, hp, steps=3, shape=(67, 45, 31), seed=0):
    """``steps`` kernel updates; after each, W and every state vs the functional rule on the dW it consumed."""
    n, k, m = shape
    gen = torch.Generator().manual_seed(seed)
    w, states, hparams = _args(rule, n, k, hp, gen)
    w_ref, states_ref = w.clone(), [s.clone() for s in states]
    for step in range(steps):
        dy_t = torch.randn(m, n, generator=gen).to(dtype).t()
        x = torch.randn(m, k, generator=gen).to(dtype)
        if step == 0:
            dy_t[:3] = 0      # dW rows of exact zeros: the sign-of-zero paths (maximize's -g, ...)
        grad = torch.full((n, k), float("nan"))
        wgrad_update(w, dy_t, x, states, hparams, rule.name, grad_out=grad)
        assert not grad.isnan().any()
        with torch.no_grad():
            rule.apply(w_ref, grad, states_ref, hparams)
        _assert_bit_equal(w, w_ref, f"{rule.name} step {step}: weight")
        for name, a, b in zip(rule.states, states, states_ref):
            _assert_bit_equal(a, b, f"{rule.name} step {step}: {name}")


@pytest.mark.parametrize("hp", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", CATALOGUE, ids=lambda r: r.name)
def test_fast_path_is_bit_identical_to_the_rule(rule, dtype, hp, tiled):
    assert cpu.fast_path_for(rule) is not None, "the catalogue rule must take its fast path here"
    _run_and_compare(rule, dtype, HPARAMS[hp])


@pytest.mark.parametrize("rule", [r for r in CATALOGUE if r.name.startswith(("adamw", "sgd[momentum=True"))],
                         ids=lambda r: r.name)
def test_fast_path_default_blocks(rule):
    """The real block shape: 600 x 1100 is 512 x 1024 blocks with ragged last rows and columns."""
    assert cpu.cpu_block_shape(600, 1100) == (512, 1024)
    _run_and_compare(rule, torch.float32, HPARAMS[0], steps=2, shape=(600, 1100, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", CATALOGUE, ids=lambda r: r.name)
def test_fast_path_matches_reference_wgrad_update_bit_for_bit(rule, dtype, tiled):
    """Against the op's plain-torch spec (whole-matrix dW): with small integers times a power of two every
    summation order gives the same dW, so the blocked and the whole mm agree exactly and so must the update."""
    n, k, m = 67, 45, 31
    gen = torch.Generator().manual_seed(1)
    w, states, hparams = _args(rule, n, k, HPARAMS[0], gen)
    w_ref, states_ref = w.clone(), [s.clone() for s in states]
    for _ in range(3):
        dy_t = (torch.randint(-4, 5, (m, n), generator=gen) * 2.0 ** -5).to(dtype).t()
        x = (torch.randint(-4, 5, (m, k), generator=gen) * 2.0 ** -5).to(dtype)
        wgrad_update(w, dy_t, x, states, hparams, rule.name)
        reference_wgrad_update(w_ref, dy_t, x, states_ref, hparams, rule.name)
        _assert_bit_equal(w, w_ref, f"{rule.name}: weight")
        for name, a, b in zip(rule.states, states, states_ref):
            _assert_bit_equal(a, b, f"{rule.name}: {name}")


def _lerp_adamw(**flags):
    """AdamW with the exp_avg update as torch.optim spells it (lerp_: an FMA, an ulp off the rule)."""
    real = cpu._adam(decoupled=True, **flags)

    def plan(s, h):
        block, scalars = real(s, h)
        c1 = (1 - h["beta1"]).item()

        def wrong(w, g, st, tmp):
            m_old = st["exp_avg"].clone()
            block(w, g.clone(), st, tmp)
            st["exp_avg"].copy_(m_old.lerp_(g, c1))
        return wrong, scalars
    return plan


def test_the_comparison_catches_an_ulp(monkeypatch, tiled):
    """A fast path that is an ulp off somewhere must fail the exactness check above."""
    rule = rules.adamw_rule()
    monkeypatch.setitem(cpu._CATALOGUE, "adamw", (cpu._CATALOGUE["adamw"][0], lambda **f: _lerp_adamw(**f)))
    monkeypatch.setattr(cpu, "_FAST", {})
    monkeypatch.setattr(cpu, "_self_check", lambda *a, **k: "")      # let the wrong path through
    with pytest.raises(AssertionError, match="exp_avg"):
        _run_and_compare(rule, torch.float32, HPARAMS[0])


def test_self_check_rejects_an_inexact_fast_path(monkeypatch, caplog, tiled):
    rule = rules.adamw_rule()
    monkeypatch.setitem(cpu._CATALOGUE, "adamw", (cpu._CATALOGUE["adamw"][0], lambda **f: _lerp_adamw(**f)))
    monkeypatch.setattr(cpu, "_FAST", {})
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        assert cpu.fast_path_for(rule) is None
    assert "differs from the rule" in caplog.text
    _run_and_compare(rule, torch.float32, HPARAMS[0])      # the generic path: still exact


def _halve(param, grad, momentum_buffer, step, lr):
    buf = momentum_buffer * 0.5 + grad
    return param - lr * buf, buf, step + 1


def test_user_rules_take_the_generic_path(tiled):
    rule = register_rule(Rule("test_cpu_halve", _halve, ("momentum_buffer", "step"), ("step",), ("lr",)))
    assert cpu.fast_path_for(rule) is None
    _run_and_compare(rule, torch.bfloat16, dict(lr=0.1))
    # a catalogue-looking name with flags the catalogue does not know is no catalogue rule either
    odd = register_rule(Rule("sgd[momentum=False,extra=True]", _halve, ("momentum_buffer", "step"), ("step",),
                             ("lr",)))
    assert cpu.fast_path_for(odd) is None
