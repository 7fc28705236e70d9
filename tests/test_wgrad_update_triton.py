"""The Triton wgrad+update kernel: interpreted on CPU (always), and on CUDA when there is a GPU.

Tolerances: the kernel's GEMM sums in a different order than torch.mm (tiles of BLOCK_M tokens), so
against ``reference_wgrad_update`` W and the states agree to a few fp32 ulps of the update, not bitwise:
we use rtol=atol=5e-5 on W/states (the ~1e-6 relative reordering error of dW is amplified by rules that
divide by small second moments, e.g. RMSprop's momentum of g/avg: 3.5e-5 seen), and 2e-4 for bf16
activations on CUDA (both sides accumulate exact bf16 products in fp32; only the order differs). Bit-identity
is asserted where it is provable: the rule applied eagerly to the dW the kernel stored (grad_out).
"""
from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

pytest.importorskip("triton")

from interpreter import run_child  # noqa: E402
from matmul_precision import tf32 as _tf32  # noqa: E402
from models import CorrectlyRoundedSqrt  # noqa: E402
from forge_compile.kernels.epilogue_codegen import EpilogueUnsupported, compile_epilogue  # noqa: E402
from forge_compile.kernels.wgrad_update import reference_wgrad_update, wgrad_update  # noqa: E402
from forge_compile.optim.rule import Rule, grad_scaled_rule, register_rule  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


# ---- rules of the test's own (independent of the built-in catalogue) -------------------------------

def _adamw(p, g, m, v, step, lr, beta1, beta2, eps, wd):
    # torch.optim.AdamW's single-tensor math, written functionally with tensor hparams
    step = step + 1
    p = p * (1 - lr * wd)
    m = torch.lerp(m, g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    denom = v.sqrt() / bc2.sqrt() + eps
    p = torch.addcdiv(p, (lr / bc1) * m, denom, value=-1.0)
    return p, m, v, step


def _sgd_mom(p, g, buf, lr, momentum, dampening, wd, clip):
    g = torch.add(g, p, alpha=0.01) + wd * p
    buf = torch.addcmul(buf * momentum, g, g.abs().clamp_max(1.0), value=0.5) + (1 - dampening) * g
    upd = torch.where(buf.abs() > clip, buf.sign() * clip, buf)
    upd = torch.maximum(torch.minimum(upd, torch.full_like(upd, 3.0)), -upd.pow(2) - 1)
    p = torch.sub(p, upd, alpha=0.5) - lr * upd / (1 + p.pow(2)).sqrt()
    return p, buf


ADAMW = register_rule(Rule("test_kernel_adamw", _adamw, states=("exp_avg", "exp_avg_sq", "step"),
                           scalar_states=("step",), hparams=("lr", "beta1", "beta2", "eps", "wd")))
SGDM = register_rule(Rule("test_kernel_sgdm", _sgd_mom, states=("momentum_buffer",),
                          hparams=("lr", "momentum", "dampening", "wd", "clip")))
HP = {
    ADAMW.name: (1e-2, 0.9, 0.999, 1e-8, 0.01),
    SGDM.name: (1e-2, 0.9, 0.1, 1e-4, 0.5),
}


_CAT_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9,
           "dampening": 0.1, "alpha": 0.99, "lr_decay": 0.01}


def _catalogue_rules():
    if importlib.util.find_spec("forge_compile.optim.rules") is None:
        return []
    try:
        from forge_compile.optim import rules as cat

        rs = [cat.adamw_rule(), cat.adam_rule(amsgrad=True, weight_decay=True),
              cat.sgd_rule(momentum=True, nesterov=True, weight_decay=True), cat.lion_rule(),
              cat.rmsprop_rule(centered=True, momentum=True), cat.adagrad_rule(weight_decay=True),
              grad_scaled_rule(cat.adamw_rule())]
    except Exception:  # the catalogue is written in parallel; test it once it imports
        return []
    for r in rs:
        HP.setdefault(r.name, tuple(_CAT_HP.get(h, 0.37 if h == "grad_scale" else 0.01) for h in r.hparams))
    return rs


# clip_grad_norm_'s coefficient applied in the epilogue (a 0.37 clip)
SCALED = grad_scaled_rule(ADAMW)
HP[SCALED.name] = HP[ADAMW.name] + (0.37,)
RULES = [ADAMW, SGDM, SCALED] + _catalogue_rules()


def _make(rule, n, k, m, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    states = []
    for i in range(len(rule.states)):
        if rule.is_scalar_state(i):
            states.append(torch.tensor(float(3 + seed), dtype=torch.float32))
        else:
            # positive (second moments); grad_avg small enough that square_avg - grad_avg**2 > 0
            scale = 0.01 if rule.states[i] == "grad_avg" else 0.1
            states.append(torch.rand(n, k, generator=gen) * scale + 0.05 * (scale == 0.1))
    dy = torch.randn(m, n, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    hp = [torch.tensor(v, dtype=torch.float64) for v in HP[rule.name]]
    dev = lambda t: t.to(device)  # noqa: E731
    states = [s if s.dim() == 0 else dev(s) for s in states]
    return dev(w), dev(dy).t(), dev(x), states, hp   # dy_t is a transposed view, as in autograd


def _clone(w, states):
    return w.clone(), [s.clone() for s in states]


def _check_against_reference(rule, n, k, m, dtype, device, tol):
    w, dy_t, x, states, hp = _make(rule, n, k, m, dtype, device)
    w_ref, st_ref = _clone(w, states)
    wgrad_update(w, dy_t, x, states, hp, rule.name)
    reference_wgrad_update(w_ref, dy_t, x, st_ref, hp, rule.name)
    torch.testing.assert_close(w, w_ref, rtol=tol, atol=tol)
    for s, r in zip(states, st_ref):
        torch.testing.assert_close(s, r, rtol=tol, atol=tol)


def _check_exact(rule, n, k, m, dtype, device, config=None, dw_tol=1e-5):
    w, dy_t, x, states, hp = _make(rule, n, k, m, dtype, device, seed=1)
    w_e, st_e = _clone(w, states)
    grad = torch.full((n, k), float("nan"), device=device)  # poisoned: every element must be written
    if config is None:
        wgrad_update(w, dy_t, x, states, hp, rule.name, grad_out=grad)
    else:
        from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update

        launch_wgrad_update(w, dy_t, x, states, hp, rule, side_out=grad, config=config)
    assert not grad.isnan().any()
    ref = dy_t.double() @ x.double()
    rel = ((grad.double() - ref).norm() / ref.norm()).item()
    assert rel < dw_tol
    with torch.no_grad(), (CorrectlyRoundedSqrt() if device == "cpu" else contextlib.nullcontext()):
        rule.apply(w_e, grad, st_e, hp)
    assert torch.equal(w, w_e), f"W differs in {(w != w_e).sum().item()} of {w.numel()} elements"
    for s, e in zip(states, st_e):
        assert torch.equal(s, e), f"state differs in {(s != e).sum().item()} elements"
    return rel


# ---- interpreter on CPU ------------------------------------------------------------------------------

# the tests named *interpreter* run in a child pytest with TRITON_INTERPRET=1 (tests/interpreter.py)
def test_interpreter_tests_in_subprocess():
    run_child(__file__)




SHAPES = [(67, 45, 31), (64, 64, 128)]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpreter_matches_reference(interpret, rule, shape, dtype):
    _check_against_reference(rule, *shape, dtype, "cpu", tol=5e-5)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreter_exact_vs_eager_on_stored_grad(interpret, rule, shape):
    # The interpreter computes the epilogue in numpy with the same per-op formulas as torch's CPU
    # kernels (FMA where they use fmadd), so this is bitwise.
    _check_exact(rule, *shape, torch.bfloat16, "cpu")


def _configs(prefix_interp: bool):
    from forge_compile.kernels.wgrad_update_triton import CONFIGS

    return [c for c in CONFIGS if c.startswith("interp") == prefix_interp]


@pytest.mark.parametrize("config", _configs(True))
@pytest.mark.parametrize("rule", [ADAMW, SGDM], ids=lambda r: r.name)
@pytest.mark.parametrize("shape", [(67, 45, 31), (64, 128, 64)], ids=lambda s: "x".join(map(str, s)))
def test_interpreter_kernel_variants_exact(interpret, rule, config, shape):
    # every knob of the template (epilogue split, prefetch, TMA descriptors), ragged and even tiles
    _check_exact(rule, *shape, torch.bfloat16, "cpu", config=config)


def test_host_scalars_cached_by_value():
    from forge_compile.kernels.wgrad_update_triton import host_scalars

    ep = compile_epilogue(ADAMW, "cuda")
    step = torch.tensor(3.0)
    hp = [torch.tensor(v, dtype=torch.float64) for v in HP[ADAMW.name]]
    ks, new = host_scalars(ep, [step], hp)
    ks_ref, new_ref = ep.run_host([step], hp)
    assert ks == ks_ref and new == [t.item() for t in new_ref]
    assert host_scalars(ep, [step], hp) is host_scalars(ep, [step], hp)   # a hit
    step.fill_(4.0)                                                        # new value: recomputed
    ks4, new4 = host_scalars(ep, [step], hp)
    assert ks4 != ks and new4 == [5.0] and ks4 == ep.run_host([step], hp)[0]
    hp[0] = torch.tensor(-0.0, dtype=torch.float64)                       # -0.0 is not 0.0
    a = host_scalars(ep, [step], hp)
    hp[0] = torch.tensor(0.0, dtype=torch.float64)
    assert host_scalars(ep, [step], hp) is not a


def test_interpreter_scalar_state_advances_once(interpret):
    w, dy_t, x, states, hp = _make(ADAMW, 67, 45, 31, torch.float32, "cpu")
    wgrad_update(w, dy_t, x, states, hp, ADAMW.name)
    assert states[2].item() == 4.0 and states[2].dtype == torch.float32


def test_unsupported_op_raises():
    def fn(p, g, lr):
        return (p - lr * torch.erf(g),)

    rule = register_rule(Rule("test_kernel_erf", fn, hparams=("lr",)))
    with pytest.raises(EpilogueUnsupported, match="erf"):
        compile_epilogue(rule)
    from forge_compile.kernels import epilogue_supported

    ok, why = epilogue_supported(rule)
    assert not ok and "erf" in why


def test_host_part_holds_scalar_math():
    ep = compile_epilogue(ADAMW, "cuda")
    # bias corrections and lr*wd stay on the host; the tiles only see fp32 scalars
    assert "pow" not in ep.body and ep.n_kernel_scalars >= 5
    assert ep.n_scalar_states == 1


def test_cpu_impl_matches_reference():
    for rule in RULES:
        w, dy_t, x, states, hp = _make(rule, 67, 45, 31, torch.float32, "cpu")
        w_ref, st_ref = _clone(w, states)
        wgrad_update(w, dy_t, x, states, hp, rule.name)  # no FORGE_TRITON_CPU: the blocked torch impl
        reference_wgrad_update(w_ref, dy_t, x, st_ref, hp, rule.name)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-5)
        for s, r in zip(states, st_ref):
            torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-5)


# ---- CUDA --------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("shape", SHAPES + [(1000, 777, 333)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_reference(rule, shape, dtype):
    _check_against_reference(rule, *shape, dtype, "cuda", tol=5e-5 if dtype == torch.float32 else 2e-4)


@cuda
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("shape", SHAPES + [(1000, 777, 333), (4096, 4096, 1024)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_exact_vs_eager_on_stored_grad(rule, shape):
    _check_exact(rule, *shape, torch.bfloat16, "cuda")


@cuda
def test_cuda_4096_bf16_vs_reference():
    _check_against_reference(ADAMW, 4096, 4096, 2048, torch.bfloat16, "cuda", tol=2e-4)


@cuda
@pytest.mark.parametrize("config", _configs(False))
@pytest.mark.parametrize("rule", [ADAMW, SGDM], ids=lambda r: r.name)
@pytest.mark.parametrize("shape", [(1000, 777, 333), (512, 512, 192)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_every_config_exact(rule, config, shape):
    # every GPU config, with ragged (masked / TMA-clipped) and even tiles
    _check_exact(rule, *shape, torch.bfloat16, "cuda", config=config)


@cuda
@pytest.mark.parametrize("config", [None, "t64m128", "t128e4"])
def test_cuda_fp32_activations_exact(config):
    _check_exact(ADAMW, 1000, 777, 333, torch.float32, "cuda", config=config)


# ---- fp32 activations follow torch's fp32 matmul precision (TF32 or IEEE), as the unfused cuBLAS wgrad does ----

def test_fp32_dot_precision_follows_torch():
    from forge_compile.kernels import wgrad_update_triton as wt

    f32, b16 = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bfloat16)
    with _tf32(False):
        assert wt.fp32_dot_precision(f32, f32) == "ieee"
        assert wt.fp32_dot_precision(b16, f32) == "ieee"   # mixed: upcast to an fp32 dot
        assert wt.fp32_dot_precision(b16, b16) == ""
    with _tf32(True):
        torch.set_float32_matmul_precision("highest")   # the public switch users set, not just the flag
        try:
            assert wt.fp32_dot_precision(f32, f32) == "ieee"
            torch.set_float32_matmul_precision("high")
            assert wt.fp32_dot_precision(f32, f32) == "tf32"
            assert wt.fp32_dot_precision(b16, b16) == ""
        finally:
            torch.set_float32_matmul_precision("highest")


def test_tf32_launch_spec_and_configs():
    from forge_compile.kernels import wgrad_update_triton as wt

    assert wt.pick_config(4096, 4096, 2048, False, upcast=True) == "tf64m32"
    assert wt.pick_config(4096, 4096, 2048, False, upcast=True, tf32=True) == "bx3_128"
    assert wt.pick_config(4096, 4096, 2048, True, upcast=True, tf32=True) == "interp"
    assert wt.tune_candidates(4096, 4096, 2048, True, tf32=True)[0] == "bx3_128"
    assert wt.tune_candidates(4096, 4096, 2048, True) == ["tf64m32"]
    w, x, dy = torch.zeros(64, 64), torch.zeros(32, 64), torch.zeros(32, 64)
    states = [torch.zeros(64, 64), torch.zeros(64, 64)]
    for cfg, tf32, prec in (("tf32_128", False, "ieee"), ("tf32_128", True, "tf32"), ("bx3_128", False, "ieee"),
                            ("bx3_128", True, "bf16x3")):
        opts = wt.launch_spec(wt.CONFIGS[cfg], w, dy.t(), x, states, None, [1.0] * 5, True, False, tf32)[2]
        assert opts["DOT_PREC"] == prec and opts["UPCAST"]


def test_tf32_is_part_of_the_autotune_key():
    # an IEEE launch must never reuse a choice (or a memo entry) tuned under TF32, nor the other way round
    from forge_compile.kernels import wgrad_update_autotune as at

    w, states = torch.zeros(64, 64), [torch.zeros(64, 64), torch.zeros(64, 64), torch.tensor(1.0)]
    f32 = (torch.zeros(64, 32).t(), torch.zeros(32, 64))
    b16 = (f32[0].bfloat16(), f32[1].bfloat16())
    with _tf32(False):
        k_ieee, k_b16 = at.tune_key(ADAMW, w, *f32, states, None), at.tune_key(ADAMW, w, *b16, states, None)
    with _tf32(True):
        k_tf32, k_b16_on = at.tune_key(ADAMW, w, *f32, states, None), at.tune_key(ADAMW, w, *b16, states, None)
    assert k_ieee != k_tf32
    assert k_b16 == k_b16_on     # bf16 activations do not depend on the setting


@cuda
@pytest.mark.parametrize("config", [None, "tf32_128", "tf32_64x256", "tf32_64x128", "bx3_128", "bx3_64x256"])
def test_cuda_fp32_activations_tf32(config):
    # TF32 allowed: the dot runs in TF32 like cuBLAS's (dW within TF32's ~1e-3 of fp64, and farther than an IEEE
    # dot's ~1e-6 -- so TF32 really ran) or as three bf16 MMAs (bf16x3 configs: only the bound is asserted), the
    # update still bit-exact on the dW it stored
    from forge_compile.kernels.wgrad_update_triton import CONFIGS, pick_config

    with _tf32(True):
        rel = _check_exact(ADAMW, 1000, 777, 333, torch.float32, "cuda", config=config, dw_tol=5e-3)
    if CONFIGS[config or pick_config(1000, 777, 333, False, True, True)].fp32_dot == "tf32":
        assert rel > 1e-5, f"dW rel err {rel:.1e}: an IEEE dot, not TF32"


@cuda
def test_cuda_tf32_switch_after_a_launch():
    # the same tensors launched under TF32, then under IEEE: the launch memo must not replay the TF32 kernel
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update

    # (dW depends on dY and X only, which do not change; the GEMMs are deterministic)
    w, dy_t, x, states, hp = _make(ADAMW, 512, 512, 256, torch.float32, "cuda", seed=2)
    ref = dy_t.double() @ x.double()
    grads = []
    for on in (True, False, True):
        grad = torch.full((512, 512), float("nan"), device="cuda")
        with _tf32(on):
            launch_wgrad_update(w, dy_t, x, states, hp, ADAMW, side_out=grad)
        rel = ((grad.double() - ref).norm() / ref.norm()).item()
        assert rel < (5e-3 if on else 1e-5), (on, rel)
        grads.append(grad)
    assert not torch.equal(grads[0], grads[1]), "the TF32-mode launch ran the IEEE kernel (or the other way round)"
    assert torch.equal(grads[0], grads[2])
