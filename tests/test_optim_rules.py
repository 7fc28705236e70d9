"""forge's optimizer rules and translation against torch.optim (foreach=False).

Tolerance: torch's CPU kernels fold ``add(alpha=)``, ``addcmul`` and ``lerp`` into one FMA (checked in
``test_torch_cpu_kernels_fuse_multiply_add``); a rule spells them as a multiply and an add, so each of
those ops may differ by one rounding -- about one ulp of its operands. Host scalars (float64 0-dim
tensors vs Python floats) add nothing: both are cast to the tensor's dtype the same way. Over 6 steps
that stays within a few ulps of each tensor's magnitude, so we compare with ``rtol = 1e-6`` and an
``atol`` of ``1e-6 * max|expected|``: an element that cancels to near zero (``b*m + (1-b)*g``) keeps
its operands' absolute error, which relative to its own tiny value is large. A formula error (a wrong
bias correction, a missed weight decay) is orders of magnitude above this. In float64 the same
roundings are ~1e-16, so a float64 run checks the formulas much more tightly.
"""
import copy
import math

import pytest
import torch

from forge_compile.optim import (
    Lion,
    Rule,
    RuleOptimizer,
    UnsupportedOptimizerError,
    hparam_values,
    lion_rule,
    plan_optimizer,
    prepare_states,
    register_rule,
    sgd_rule,
    structure_key,
)

SHAPES = [(4, 3), (5,), (2, 2, 2)]
STEPS = 6
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def _data(dtype=torch.float32, steps=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=dtype) for s in SHAPES] for _ in range(steps)]
    return params, grads


def _params(values):
    return [torch.nn.Parameter(v.clone()) for v in values]


def _forge_step(opt, plans):
    """What forge's compiled step does per parameter, eagerly."""
    for pl in plans:
        states = prepare_states(opt, pl)
        hparams = [torch.tensor(v, dtype=torch.float64) for v in hparam_values(opt, pl)]
        if pl.param.grad is None:
            continue
        with torch.no_grad():
            pl.rule.apply(pl.param, pl.param.grad, states, hparams)


def _train(opt, params, grads, forge, between=None):
    plans = plan_optimizer(opt) if forge else None
    for i, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = None if g is None else g.clone()
        if forge:
            _forge_step(opt, plans)
        else:
            opt.step()
        if between is not None:
            between(opt, i)


def _close(actual, expected, rtol, what):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def _assert_same(opt_a, params_a, opt_b, params_b, rtol):
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        _close(pb.detach(), pa.detach(), rtol, f"param {i}")
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert list(sa) == list(sb), f"param {i}: state keys {list(sb)} != torch's {list(sa)}"
        for k in sa:
            a, b = sa[k], sb[k]
            assert (b.dtype, b.device, b.shape) == (a.dtype, a.device, a.shape), f"param {i} {k}"
            if k == "step":
                assert torch.equal(a, b), f"param {i} step {b} != {a}"
            else:
                _close(b, a, rtol, f"param {i} state {k}")


OPT = torch.optim
CASES = [
    (OPT.SGD, dict(lr=0.1)),
    (OPT.SGD, dict(lr=0.1, momentum=0.9)),
    (OPT.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
    (OPT.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (OPT.SGD, dict(lr=0.1, weight_decay=0.1)),
    (OPT.SGD, dict(lr=0.1, momentum=0.8, dampening=0.1, weight_decay=0.05, maximize=True)),
    (OPT.Adam, dict(lr=1e-2)),
    (OPT.Adam, dict(lr=1e-2, amsgrad=True)),
    (OPT.Adam, dict(lr=1e-2, maximize=True, betas=(0.8, 0.95))),
    (OPT.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (OPT.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    (OPT.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    (OPT.AdamW, dict(lr=1e-2)),
    (OPT.AdamW, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (OPT.AdamW, dict(lr=1e-2, maximize=True)),
    (OPT.AdamW, dict(lr=1e-2, weight_decay=0.0)),
    (OPT.Adagrad, dict(lr=0.1)),
    (OPT.Adagrad, dict(lr=0.1, lr_decay=0.05, initial_accumulator_value=0.1)),
    (OPT.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, eps=1e-6, maximize=True)),
    (OPT.RMSprop, dict(lr=1e-2)),
    (OPT.RMSprop, dict(lr=1e-2, centered=True)),
    (OPT.RMSprop, dict(lr=1e-2, momentum=0.9)),
    (OPT.RMSprop, dict(lr=1e-2, weight_decay=0.1, alpha=0.9)),
    (OPT.RMSprop, dict(lr=1e-2, centered=True, momentum=0.9, weight_decay=0.1, maximize=True)),
]


def _id(case):
    cls, kw = case
    return cls.__name__ + "-" + ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_rule_matches_torch_optim(case, dtype):
    cls, kw = case
    values, grads = _data(dtype)
    pa, pb = _params(values), _params(values)
    oa, ob = cls(pa, foreach=False, **kw), cls(pb, foreach=False, **kw)
    _train(oa, pa, grads, forge=False)
    _train(ob, pb, grads, forge=True)
    _assert_same(oa, pa, ob, pb, RTOL[dtype])


def test_param_groups_with_different_flags():
    values, grads = _data()

    def make(ps):
        return OPT.SGD([{"params": ps[:1], "momentum": 0.9, "nesterov": True},
                        {"params": ps[1:2], "weight_decay": 0.1, "maximize": True},
                        {"params": ps[2:], "momentum": 0.5, "dampening": 0.5}], lr=0.1, foreach=False)

    pa, pb = _params(values), _params(values)
    oa, ob = make(pa), make(pb)
    plans = plan_optimizer(ob)
    assert [pl.group_index for pl in plans] == [0, 1, 2]
    assert len({pl.rule.name for pl in plans}) == 3
    _train(oa, pa, grads, forge=False)
    _train(ob, pb, grads, forge=True)
    _assert_same(oa, pa, ob, pb, RTOL[torch.float32])


def test_params_without_grad_are_skipped_like_torch():
    # dampening != 0 makes SGD's first-step clone(grad) observable; param 1 gets its first gradient
    # only at step 3, after forge already created (zero) state for it.
    values, grads = _data()
    for s in range(3):
        grads[s][1] = None
    for cls, kw in [(OPT.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5)), (OPT.Adam, dict(lr=1e-2))]:
        pa, pb = _params(values), _params(values)
        oa, ob = cls(pa, foreach=False, **kw), cls(pb, foreach=False, **kw)
        _train(oa, pa, grads, forge=False)
        _train(ob, pb, grads, forge=True)
        _assert_same(oa, pa, ob, pb, RTOL[torch.float32])


def test_sgd_first_step_dampening_is_stable_under_repeated_queries():
    p = torch.nn.Parameter(torch.randn(3))
    opt = OPT.SGD([p], lr=0.1, momentum=0.9, dampening=0.25)
    (pl,) = plan_optimizer(opt)
    assert pl.rule.hparams == ("lr", "momentum", "dampening")
    states = prepare_states(opt, pl)
    assert hparam_values(opt, pl) == hparam_values(opt, pl) == [0.1, 0.9, 0.0]
    assert prepare_states(opt, pl)[0] is states[0]
    p.grad = torch.randn(3)
    with torch.no_grad():
        pl.rule.apply(p, p.grad, states, [torch.tensor(v, dtype=torch.float64)
                                          for v in hparam_values(opt, pl)])
    assert torch.equal(opt.state[p]["momentum_buffer"], p.grad)
    assert hparam_values(opt, pl) == [0.1, 0.9, 0.25]


# -- Lion and user rules ---------------------------------------------------------------------------------

def _reference_lion(params, grads, lr, betas, wd):
    """Lion as written in the paper (Algorithm 2), independently of forge's rule."""
    b1, b2 = betas
    params = [p.clone() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    for gs in grads:
        for p, m, g in zip(params, ms, gs):
            c = m.mul(b1).add(g, alpha=1 - b1)
            p.mul_(1 - lr * wd).add_(torch.sign(c), alpha=-lr)
            m.mul_(b2).add_(g, alpha=1 - b2)
    return params, ms


@pytest.mark.parametrize("forge_path", [False, True], ids=["eager-step", "forge-path"])
def test_lion_matches_reference(forge_path):
    values, grads = _data()
    lr, betas, wd = 1e-2, (0.9, 0.99), 0.1
    ref_p, ref_m = _reference_lion(values, grads, lr, betas, wd)
    ps = _params(values)
    opt = Lion(ps, lr=lr, betas=betas, weight_decay=wd)
    _train(opt, ps, grads, forge=forge_path)
    for p, rp, rm in zip(ps, ref_p, ref_m):
        _close(p.detach(), rp, RTOL[torch.float32], "lion param")
        _close(opt.state[p]["exp_avg"], rm, RTOL[torch.float32], "lion exp_avg")
        assert opt.state[p]["step"].dtype == torch.float32 and float(opt.state[p]["step"]) == STEPS


def _signum(param, grad, momentum_buffer, step, lr, beta):
    buf = momentum_buffer * beta + (1 - beta) * grad
    return param + (-lr) * torch.sign(buf), buf, step + 1


SIGNUM = register_rule(Rule("test_signum", _signum, states=("momentum_buffer", "step"),
                            scalar_states=("step",), hparams=("lr", "beta")))


def test_rule_optimizer_user_rule():
    values, grads = _data()
    ps, pf = _params(values), _params(values)
    eager = RuleOptimizer(ps, SIGNUM, lr=1e-2, beta=0.9)
    forge = RuleOptimizer(pf, SIGNUM, lr=1e-2, beta=0.9)
    _train(eager, ps, grads, forge=False)
    _train(forge, pf, grads, forge=True)
    for p, q, v in zip(ps, pf, values):
        assert torch.equal(p, q)                       # same function, same inputs
        assert float(eager.state[p]["step"]) == STEPS
    # by hand: buf is an EMA of the gradients, each step moves by -lr * sign(buf)
    buf, p0 = torch.zeros_like(values[0]), values[0].clone()
    for gs in grads:
        buf = buf * 0.9 + 0.1 * gs[0]
        p0 = p0 - 1e-2 * torch.sign(buf)
    _close(ps[0].detach(), p0, RTOL[torch.float32], "signum")
    assert plan_optimizer(forge)[0].rule is SIGNUM


def test_rule_optimizer_needs_every_hparam():
    with pytest.raises(ValueError, match="beta"):
        RuleOptimizer([torch.nn.Parameter(torch.zeros(2))], SIGNUM, lr=0.1)


def test_rule_factories_cache_by_name():
    assert sgd_rule(momentum=True) is sgd_rule(momentum=True)
    assert lion_rule() is lion_rule(maximize=False)
    assert sgd_rule(momentum=True) is not sgd_rule(momentum=True, nesterov=True)


# -- schedulers, state_dict, structure --------------------------------------------------------------------

# The forge path never calls optimizer.step(), which the scheduler notices.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
def test_lr_change_between_steps_takes_effect(tensor_lr):
    values, grads = _data()
    lr = (lambda: torch.tensor(1e-2)) if tensor_lr else (lambda: 1e-2)   # the scheduler fills a tensor lr
    pa, pb = _params(values), _params(values)
    oa, ob = OPT.Adam(pa, lr=lr(), foreach=False), OPT.Adam(pb, lr=lr(), foreach=False)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.1)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.1)
    _train(oa, pa, grads, forge=False, between=lambda o, i: sa.step())
    _train(ob, pb, grads, forge=True, between=lambda o, i: sb.step())
    _assert_same(oa, pa, ob, pb, RTOL[torch.float32])
    assert math.isclose(float(ob.param_groups[0]["lr"]), 1e-5, rel_tol=1e-6)   # a tensor lr is fp32
    # and a run that ignored the schedule would have ended elsewhere
    pc = _params(values)
    oc = OPT.Adam(pc, lr=1e-2, foreach=False)
    _train(oc, pc, grads, forge=True)
    assert not torch.allclose(pc[0], pb[0], rtol=1e-3)


ROUND_TRIP = [
    (OPT.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
    (OPT.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (OPT.AdamW, dict(lr=1e-2)),
    (OPT.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    (OPT.RMSprop, dict(lr=1e-2, centered=True, momentum=0.9)),
]


@pytest.mark.parametrize("case", ROUND_TRIP, ids=[_id(c) for c in ROUND_TRIP])
def test_state_dict_round_trip_into_torch(case):
    cls, kw = case
    values, grads = _data()
    pa = _params(values)
    oa = cls(pa, foreach=False, **kw)
    _train(oa, pa, grads, forge=False)

    pb = _params(values)
    ob = cls(pb, foreach=False, **kw)
    _train(ob, pb, grads[:1], forge=True)            # the first step is the one that creates state
    _train(ob, pb, grads[1:3], forge=True)
    pc = [torch.nn.Parameter(p.detach().clone()) for p in pb]
    oc = cls(pc, foreach=False, **kw)
    oc.load_state_dict(copy.deepcopy(ob.state_dict()))
    _train(oc, pc, grads[3:], forge=False)
    _assert_same(oa, pa, oc, pc, RTOL[torch.float32])


def test_state_format_matches_torch_after_one_step():
    for cls, kw in CASES:
        values, grads = _data(steps=1)
        pa, pb = _params(values), _params(values)
        oa, ob = cls(pa, foreach=False, **kw), cls(pb, foreach=False, **kw)
        _train(oa, pa, grads, forge=False)
        _train(ob, pb, grads, forge=True)
        for a, b in zip(pa, pb):
            sa, sb = oa.state.get(a, {}), ob.state.get(b, {})
            assert list(sa) == list(sb), _id((cls, kw))
            for k in sa:
                assert (sb[k].dtype, sb[k].device, sb[k].shape, sb[k].stride()) == (
                    sa[k].dtype, sa[k].device, sa[k].shape, sa[k].stride()), (_id((cls, kw)), k)


def test_adagrad_respects_state_made_at_construction():
    p = torch.nn.Parameter(torch.randn(3))
    opt = OPT.Adagrad([p], lr=0.1, initial_accumulator_value=0.5)
    made = opt.state[p]["sum"]
    (pl,) = plan_optimizer(opt)
    step, acc = prepare_states(opt, pl)
    assert acc is made and torch.equal(acc, torch.full((3,), 0.5)) and float(step) == 0


def test_structure_key():
    p, q = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2))
    opt = OPT.SGD([p, q], lr=0.1, momentum=0.9)
    key = structure_key(opt)
    hash(key)
    opt.param_groups[0]["lr"] = 0.01
    assert structure_key(opt) == key                 # values are hyper-parameters, not structure
    opt.param_groups[0]["nesterov"] = True
    assert structure_key(opt) != key
    opt.param_groups[0]["nesterov"] = False
    opt.param_groups[0]["weight_decay"] = 0.1
    assert structure_key(opt) != key
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))]})
    assert structure_key(opt) != key
    assert structure_key(OPT.Adam([p])) != structure_key(OPT.AdamW([p]))


# -- refusals ----------------------------------------------------------------------------------------------

class _OwnStep(OPT.Adam):
    def step(self, closure=None):
        return super().step(closure)


class _SameStep(OPT.Adam):
    pass


def _unsupported():
    p = lambda: [torch.nn.Parameter(torch.randn(3))]   # noqa: E731
    return [
        ("LBFGS", lambda: OPT.LBFGS(p())),
        ("SparseAdam", lambda: OPT.SparseAdam(p())),
        ("Adamax", lambda: OPT.Adamax(p())),
        ("NAdam", lambda: OPT.NAdam(p())),
        ("_OwnStep", lambda: _OwnStep(p())),
        ("Adam", lambda: OPT.Adam(p(), differentiable=True)),
        ("SGD", lambda: OPT.SGD([{"params": p()}, {"params": p(), "differentiable": True}], lr=0.1)),
        ("SGD", lambda: OPT.SGD([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))], lr=0.1)),
    ]


@pytest.mark.parametrize("name,make", _unsupported(), ids=[f"{n}-{i}" for i, (n, _) in
                                                           enumerate(_unsupported())])
def test_unsupported_optimizers_are_refused_before_state(name, make):
    opt = make()
    before = {id(k): dict(v) for k, v in opt.state.items()}
    with pytest.raises(UnsupportedOptimizerError, match=name) as info:
        plan_optimizer(opt)
    assert isinstance(info.value, TypeError)
    assert {id(k): dict(v) for k, v in opt.state.items()} == before


@pytest.mark.parametrize("cls,kw", [(OPT.AdamW, dict(lr=1e-2, weight_decay=0.1)), (OPT.Adam, dict(lr=1e-2)),
                                    (OPT.SGD, dict(lr=0.1, momentum=0.9)), (OPT.Adagrad, dict(lr=0.1))],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_fused_flag_is_accepted_and_follows_the_single_tensor_math(cls, kw):
    """fused=True selects torch's own multi-tensor kernel; forge runs the update itself and reproduces
    the single-tensor (foreach=False) arithmetic, so that is the reference; the state keeps the fused
    optimizer's format, so a fused torch optimizer continues from it."""
    values, grads = _data()
    pa, pb = _params(values), _params(values)
    oa, ob = cls(pa, foreach=False, **kw), cls(pb, fused=True, **kw)
    _train(oa, pa, grads, forge=False)
    _train(ob, pb, grads, forge=True)
    _assert_same(oa, pa, ob, pb, RTOL[torch.float32])
    # torch's own fused step continues from forge's state (same format), as the unfused reference does
    more = _data(seed=1)[1][:2]
    _train(oa, pa, more, forge=False)
    _train(ob, pb, more, forge=False)
    # fused kernels round differently from the single-tensor ones (~1 ulp per op): 1e-5 over 2 steps
    _assert_same(oa, pa, ob, pb, 1e-5)


def test_lbfgs_message_and_no_state():
    opt = OPT.LBFGS([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS") as info:
        plan_optimizer(opt)
    assert "LBFGS" in str(info.value)
    assert len(opt.state) == 0


def test_subclass_without_own_step_and_scheduler_wrapper_are_accepted():
    values, grads = _data()
    pa, pb = _params(values), _params(values)
    oa, ob = OPT.Adam(pa, lr=1e-2, foreach=False), _SameStep(pb, lr=1e-2, foreach=False)
    torch.optim.lr_scheduler.LambdaLR(ob, lambda e: 1.0)   # wraps ob.step on the instance
    _train(oa, pa, grads, forge=False)
    _train(ob, pb, grads, forge=True)
    _assert_same(oa, pa, ob, pb, RTOL[torch.float32])


def test_sparse_grad_is_refused():
    p = torch.nn.Parameter(torch.randn(4, 2))
    opt = OPT.SGD([p], lr=0.1)
    p.grad = torch.randn(4, 2).to_sparse()
    with pytest.raises(UnsupportedOptimizerError, match="sparse"):
        plan_optimizer(opt)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the FMA folding is a property of torch's AVX2/AVX512 kernels")
def test_torch_cpu_kernels_fuse_multiply_add():
    """The premise of the tolerance above: torch rounds a + w*b once where a rule rounds twice."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(4096, generator=g) for _ in range(3))
    w = torch.tensor(0.1, dtype=torch.float32).double()
    fma = lambda x, y, z: (x.double() * y.double() + z.double()).float()   # noqa: E731 exact product
    assert torch.equal(a.add(b, alpha=0.1), fma(b, w, a))
    assert torch.equal(a.lerp(b, 0.1), fma(b - a, w, a))
    assert torch.equal(a.addcmul(b, c, value=0.1), fma(0.1 * b, c, a))


def test_step_hooks_are_reported_once(caplog):
    opt = OPT.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    opt.register_step_post_hook(lambda *a: None)
    with caplog.at_level("WARNING", logger="forge_compile.optim.translate"):
        plan_optimizer(opt)
        plan_optimizer(opt)
    assert sum("step hooks" in r.getMessage() for r in caplog.records) == 1


def test_flush_step_mirrors_writes_every_mirror_back():
    # fused/capturable groups keep ``step`` on the device; forge advances a CPU mirror and writes all of a
    # backward's mirrors back in one batched copy per device and dtype (here CPU stands in for the device)
    from forge_compile.optim import translate as T

    devs = [torch.tensor(float(i)) for i in range(5)] + [torch.tensor(7.0, dtype=torch.float64)]
    mirrors = [torch.tensor(float(i) + 1.0) for i in range(5)] + [torch.tensor(9.0)]
    T.discard_step_mirrors()
    for d, m in zip(devs, mirrors):
        T._PENDING_FLUSH[id(d)] = (d, m)
        T._STEP_MIRRORS[d] = [m, -1]
    T.flush_step_mirrors()
    assert not T._PENDING_FLUSH
    assert [d.item() for d in devs] == [1.0, 2.0, 3.0, 4.0, 5.0, 9.0]
    assert devs[-1].dtype == torch.float64 and devs[0].dtype == torch.float32
    # the version after forge's own write: a later change by anyone else is told apart from it
    assert all(T._STEP_MIRRORS[d][1] == d._version and d._version > 0 for d in devs)
