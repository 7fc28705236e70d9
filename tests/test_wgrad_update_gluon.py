"""The Gluon (sm_90) wgrad+update kernel: selection logic and rendering on CPU, exactness on an H200.

Exactness standard (as for the Triton kernel): W/states bit-identical to eager ``rule.fn`` applied to the dW the
kernel stored (grad_out), that dW within 1e-5 of the fp64 product. Anything the Gluon path does not take must go
to the Triton kernel, never fail.
"""
from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import torch

pytest.importorskip("triton")

from forge_compile.kernels import wgrad_update_gluon as wg  # noqa: E402
from forge_compile.kernels.epilogue_codegen import compile_epilogue  # noqa: E402
from forge_compile.kernels.wgrad_update import reference_wgrad_update, wgrad_update  # noqa: E402
from forge_compile.optim import rules as R  # noqa: E402
from forge_compile.optim.rule import Rule, grad_scaled_rule, register_rule  # noqa: E402


def _adamw_fma(p, g, m, v, step, lr, beta1, beta2, eps, wd):
    # lerp / addcdiv / add-with-alpha: the generated epilogue spells out FMAs (gl.fma)
    step = step + 1
    p = p * (1 - lr * wd)
    m = torch.lerp(m, g, 1 - beta1)
    v = torch.add(v * beta2, g * g, alpha=1 - 0.999)
    denom = v.sqrt() / (1 - beta2 ** step).sqrt() + eps
    p = torch.addcdiv(p, (lr / (1 - beta1 ** step)) * m, denom, value=-1.0)
    return p, m, v, step


def _clampy(p, g, buf, lr, clip):
    # maximum/minimum (NaN-propagating), where, full_like, sign
    buf = torch.where(g.abs() > clip, g.sign() * clip, buf * 0.9 + g)
    upd = torch.maximum(torch.minimum(buf, torch.full_like(buf, 3.0)), -buf.pow(2) - 1)
    return p - lr * upd, buf


ADAMW_FMA = register_rule(Rule("test_gluon_adamw_fma", _adamw_fma, states=("exp_avg", "exp_avg_sq", "step"),
                               scalar_states=("step",), hparams=("lr", "beta1", "beta2", "eps", "wd")))
CLAMPY = register_rule(Rule("test_gluon_clampy", _clampy, states=("momentum_buffer",), hparams=("lr", "clip")))
EXPY = register_rule(Rule("test_gluon_expy", lambda p, g, lr: (p - lr * torch.exp(g),), hparams=("lr",)))

_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "wd": 0.01, "momentum": 0.9,
       "dampening": 0.1, "alpha": 0.99, "lr_decay": 0.01, "clip": 0.5, "grad_scale": 0.37}

RULES = {
    "adamw": R.adamw_rule(),
    "sgdm": R.sgd_rule(momentum=True),
    "lion": R.lion_rule(),
    "rmsprop_cm": R.rmsprop_rule(centered=True, momentum=True),   # 3 tensor states: 5 arrays per slot with dW
    "adamw_fma": ADAMW_FMA,
    "clampy": CLAMPY,
    "adamw_clip": grad_scaled_rule(R.adamw_rule()),   # clip_grad_norm_'s coefficient applied in the epilogue
}
CATALOGUE = [R.adamw_rule(), R.adam_rule(amsgrad=True, weight_decay=True), R.sgd_rule(),
             R.sgd_rule(momentum=True, nesterov=True, weight_decay=True), R.lion_rule(),
             R.rmsprop_rule(centered=True, momentum=True), R.adagrad_rule(weight_decay=True), ADAMW_FMA, CLAMPY,
             grad_scaled_rule(R.sgd_rule(momentum=True))]


def _make(rule, n, k, m, dtype=torch.bfloat16, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    states = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            states.append(torch.tensor(4.0))
        else:
            scale = 0.01 if name == "grad_avg" else 0.1
            states.append(torch.rand(n, k, generator=gen) * scale + 0.05 * (scale == 0.1))
    dy = torch.randn(m, n, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    states = [s if s.dim() == 0 else s.to(device) for s in states]
    return w.to(device), dy.to(device).t(), x.to(device), states, hp   # dy_t: transposed view, as in autograd


# ---- CPU: rendering and selection ---------------------------------------------------------------------


@pytest.mark.parametrize("rule", CATALOGUE, ids=lambda r: r.name)
def test_render_every_rule(rule):
    ep = compile_epilogue(rule, "cuda")
    src = wg.render_gluon_source(ep)
    ast.parse(src)
    body = src.split("def _rule", 1)[1].split("@gluon.jit", 1)[0]
    assert "tl." not in body and "BLOCK_" not in body
    if rule is ADAMW_FMA:
        assert "gl.fma(" in body and "gl.div_rn(" in body and "gl.sqrt_rn(" in body
    if rule is CLAMPY:
        assert "propagate_nan=PROPAGATE_ALL" in body and "gl.full_like(p, 3.0)" in body


def test_render_refuses_unknown_spelling():
    with pytest.raises(wg.GluonUnsupported):
        wg._to_gluon("    t0 = tl.erf(g)")
    with pytest.raises(wg.GluonUnsupported):
        wg._to_gluon("    t0 = tl.full([BLOCK_N, BLOCK_K], c0 + c1, tl.int32)")


def test_pick_gconfig_fits_smem():
    for n_arrays in range(1, 6):
        for m in (64, 512, 513, 8192):
            for act_bytes in (2, 4):
                cfg = wg.pick_gconfig(m, n_arrays, act_bytes)
                if cfg.epi in ("smem", "split"):   # v11/v12, where measured faster (test_vector_picks_where_measured)
                    assert wg.gconfig_smem(cfg, n_arrays, act_bytes) <= wg._RING_SMEM
                    continue
                assert cfg is not None and cfg.stages >= 2 and cfg.nring in (1, 2), (m, n_arrays)
                assert cfg.es >= (3 if cfg.nring == 2 else 2)
                assert cfg.bk % cfg.epi_n == 0 and (cfg.bk // cfg.epi_n) & (cfg.bk // cfg.epi_n - 1) == 0
                smem = wg.gconfig_smem(cfg, n_arrays, act_bytes)
                assert cfg.epi_m in (64, 128) and cfg.bn % cfg.epi_m == 0
                assert smem == (cfg.stages * cfg.bmt * (cfg.bn + cfg.bk) * act_bytes
                                + cfg.nring * cfg.es * n_arrays * cfg.epi_m * cfg.epi_n * 4)
                assert smem <= wg._RING_SMEM
    assert wg.pick_gconfig(256, 40) is None


def test_pick_gconfig_layouts():
    # AdamW (W, exp_avg, exp_avg_sq), bf16: fewer GEMM stages (more slots) at small M; one shared epilogue ring of
    # [64, 32] chunks (H200, NOTES_kernel.md v7: faster than [128, 16] chunks and than one ring per consumer)
    assert wg._pick_tma(256, 3).stages < wg._pick_tma(1024, 3).stages
    for m in (256, 1024, 8192):
        cfg = wg._pick_tma(m, 3)
        assert cfg.es >= 3 and cfg.nring == 1 and (cfg.epi_m, cfg.epi_n) == (64, 32)


def test_v8_variants_not_default():
    # v8 (NOTES_kernel.md): band chunks are selectable, never picked; the out ring raced on the H200 and is refused
    # before anything launches
    for n_arrays in range(1, 6):
        for m in (256, 1024, 8192):
            cfg = wg._pick_tma(m, n_arrays)
            assert cfg.eout == 0 and cfg.epi_m == 64 and cfg.epi_n == 32
            assert wg.pick_gconfig(m, n_arrays).eout == 0
    band = wg.GConfig(stages=3, es=4, epi_m=8, epi_n=64)
    wg._check_gconfig(band)
    assert (wg._box(band), wg._boxes(band), wg.chunk_bytes(band)) == ([8, 32], 8, 8192)
    for eout in (1, 2):
        with pytest.raises(ValueError, match="out ring"):
            wg._check_gconfig(wg.GConfig(stages=3, es=3, eout=eout))


def test_ring_budget_by_m():
    # v9 (NOTES_kernel.md): one more epilogue slot in 224 KB at M <= 1024 (1-5 % faster there), 208 KB above
    # (the extra slot was 5-9 % slower at M = 2048-4096); AdamW (W, exp_avg, exp_avg_sq), bf16
    small, mid, large = (wg._pick_tma(m, 3) for m in (256, 1024, 2048))
    assert (small.stages, small.es) == (3, 5) and (mid.stages, mid.es) == (4, 4) and (large.stages, large.es) == (4, 3)
    assert wg.gconfig_smem(mid, 3) == 224 * 1024 and wg.gconfig_smem(large, 3) <= 208 * 1024
    assert wg._pick_tma(256, 2).es == 8 and wg._pick_tma(2048, 2).es == 5


def test_check_gconfig_refuses_unsupported():
    # boxes wider than 128 B: triton 3.6 splits their loads into 128 B messages but not their stores
    # band chunks of 128 columns: 32 elements per thread, spills
    for bad in (wg.GConfig(epi_m=64, epi_n=64), wg.GConfig(epi_m=8, epi_n=32), wg.GConfig(bn=64),
                wg.GConfig(epi_m=32, epi_n=32), wg.GConfig(epi_m=8, epi_n=128)):
        with pytest.raises(ValueError):
            wg._check_gconfig(bad)


@pytest.fixture
def fake_sm90(monkeypatch):
    """CPU tensors judged as if on an H200 with gluon present (the selection logic only)."""
    monkeypatch.setattr(wg, "_device_ok", lambda dev: True)
    monkeypatch.setattr(wg, "gluon_available", lambda: True)
    monkeypatch.setenv(wg.ENV, "gluon")


def test_use_gluon_selection(fake_sm90, monkeypatch):
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 256, 128, 96)
    assert wg.gluon_reason(w, dy_t, x, st, rule) is None
    assert wg.use_gluon(w, dy_t, x, st, rule, side_out=torch.empty_like(w))
    # forced off / auto
    monkeypatch.setenv(wg.ENV, "triton")
    assert not wg.use_gluon(w, dy_t, x, st, rule)
    monkeypatch.setenv(wg.ENV, "auto")
    monkeypatch.setattr(wg, "AUTO_GLUON", True)
    # auto: AdamW, SGD-momentum and Lion go to Gluon (H200, NOTES v5-v6); libdevice rules stay on Triton
    for name in ("adamw", "sgdm", "lion"):
        r = RULES[name]
        w2, dy2, x2, st2, _ = _make(r, 256, 128, 96)
        assert wg.use_gluon(w2, dy2, x2, st2, r), name
    assert "libdevice" in wg.gluon_reason(*_make(EXPY, 256, 128, 96)[:4], EXPY)
    monkeypatch.setattr(wg, "AUTO_GLUON", False)
    assert not wg.use_gluon(w, dy_t, x, st, rule)
    monkeypatch.setenv(wg.ENV, "bogus")   # unknown value = auto
    assert not wg.use_gluon(w, dy_t, x, st, rule)
    monkeypatch.setenv(wg.ENV, "gluon")
    # dtypes
    assert not wg.use_gluon(w, dy_t.float(), x.float(), st, rule)
    assert not wg.use_gluon(w, dy_t, x.half(), st, rule)
    assert wg.use_gluon(w, dy_t.half(), x.half(), st, rule)
    # layouts: dy_t contiguous [N, M] (not a transposed dY), x transposed
    assert not wg.use_gluon(w, dy_t.contiguous(), x, st, rule)
    assert not wg.use_gluon(w, dy_t, x.t().contiguous().t(), st, rule)
    # M == 0
    assert not wg.use_gluon(w, dy_t[:, :0], x[:0], st, rule)


def test_use_gluon_alignment_and_states(fake_sm90):
    rule = RULES["sgdm"]
    w, dy_t, x, st, hp = _make(rule, 256, 128, 96)
    # N or K not a multiple of 8 (16-byte TMA row strides)
    w2, dy2, x2, st2, _ = _make(rule, 256, 130, 96)
    assert not wg.use_gluon(w2, dy2, x2, st2, rule)
    w3, dy3, x3, st3, _ = _make(rule, 252, 128, 96)
    assert not wg.use_gluon(w3, dy3, x3, st3, rule)
    # misaligned base pointer (storage offset of one element)
    xs = torch.empty(96 * 128 + 1, dtype=x.dtype)[1:].view(96, 128).copy_(x)
    assert not wg.use_gluon(w, dy_t, xs, st, rule)
    # a non-contiguous / wrong-dtype state or side output: the Triton kernel raises its error
    assert not wg.use_gluon(w, dy_t, x, [st[0].t().contiguous().t()], rule)
    assert not wg.use_gluon(w, dy_t, x, st, rule, side_out=torch.empty_like(w, dtype=torch.float64))
    assert not wg.use_gluon(w, dy_t, x, st, rule, side_out=torch.empty_like(w).t().contiguous().t())
    # a 16-bit side output is the new W's cast copy: a pointer epilogue writes it
    assert wg.use_gluon(w, dy_t, x, st, rule, side_out=torch.empty_like(w, dtype=torch.bfloat16))
    assert wg.use_gluon(w, dy_t, x, st, rule)


def test_broken_kernel_falls_back(fake_sm90, monkeypatch):
    rule = RULES["lion"]
    w, dy_t, x, st, hp = _make(rule, 64, 64, 32)

    def boom(*a, **k):
        raise RuntimeError("no gluon here")

    monkeypatch.setattr(wg, "launch", boom)
    monkeypatch.setattr(wg, "_BROKEN", {})
    assert not wg.try_launch(w, dy_t, x, st, hp, rule)   # nothing launched: the caller takes the Triton path
    assert rule.name in wg._BROKEN and not wg.use_gluon(w, dy_t, x, st, rule)


def test_cpu_launch_never_selects_gluon(monkeypatch):
    # CPU tensors (blocked torch impl) never reach the Gluon module's checks
    monkeypatch.setenv(wg.ENV, "gluon")
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 64, 48, 40, torch.float32)
    w_ref, st_ref = w.clone(), [s.clone() for s in st]
    wgrad_update(w, dy_t, x, st, hp, rule.name)
    reference_wgrad_update(w_ref, dy_t, x, st_ref, hp, rule.name)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-5)


# ---- H200 ----------------------------------------------------------------------------------------------


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and wg.gluon_available()


sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU with triton.experimental.gluon")


def _check_exact(rule, n, k, m, dtype=torch.bfloat16, max_ctas=None, seed=1, config=None, vs_cublas=False):
    # vs_cublas: dW's error may also be up to 2x cuBLAS's on the same inputs -- at M >= 16384 a fixed 1e-5 is only
    # ~sqrt(M) * 2^-24 away from what any fp32-accumulating GEMM reaches
    w, dy_t, x, st, hp = _make(rule, n, k, m, dtype, "cuda", seed)
    grad = torch.full((n, k), float("nan"), device="cuda")   # poisoned: every element must be written
    why = wg.gluon_reason(w, dy_t, x, st, rule, grad)
    assert why is None or why.startswith("auto"), why
    w_e, st_e = w.clone(), [s.clone() for s in st]
    wg.launch(w, dy_t, x, st, hp, rule, side_out=grad, max_ctas=max_ctas, config=config)
    torch.cuda.synchronize()
    assert not grad.isnan().any()
    ref = dy_t.double() @ x.double()
    rel = ((grad.double() - ref).norm() / ref.norm()).item()
    rel_mm = ((torch.mm(dy_t, x, out_dtype=torch.float32).double() - ref).norm() / ref.norm()).item() \
        if vs_cublas else 0.0
    del ref
    assert rel < max(1e-5, 2 * rel_mm), f"M={m}: dW rel err {rel:.2e}, cuBLAS {rel_mm:.2e}"
    with torch.no_grad():
        rule.apply(w_e, grad, st_e, hp)
    assert torch.equal(w, w_e), f"W differs in {(w != w_e).sum().item()} of {w.numel()} elements"
    for s, e in zip(st, st_e):
        assert torch.equal(s, e), f"state differs in {(s != e).sum().item()} elements"


@pytest.fixture
def force_gluon(monkeypatch):
    monkeypatch.setenv(wg.ENV, "gluon")


@sm90
@pytest.mark.parametrize("name", list(RULES))
def test_gluon_exact_ragged(force_gluon, name):
    # N, K not multiples of the 128 tile (TMA zero-fill / clipped stores), M not a multiple of the 64-token step
    _check_exact(RULES[name], 1000, 776, 333)


@sm90
@pytest.mark.parametrize("max_ctas", [3, 5])
def test_gluon_exact_many_tiles_per_cta(force_gluon, max_ctas):
    # 8 x 7 = 56 tiles on 3 or 5 CTAs: both consumers, many rounds, odd and even counts per CTA
    _check_exact(RULES["adamw"], 1000, 776, 333, max_ctas=max_ctas)


@sm90
@pytest.mark.parametrize("config", ["pick", "coop", "split"])
@pytest.mark.parametrize("m", [16384, 32768])
def test_gluon_exact_long_token_dim(force_gluon, config, m):
    # M = 16384 failed bench_wgrad_update's check (stop 31) and no test ran past M = 8192 before: the update must be
    # bit-exact whatever M
    cfg = {"pick": None, "coop": wg.coop_config(), "split": wg.split_config()}[config]
    _check_exact(RULES["adamw"], 4096, 4096, m, config=cfg, vs_cublas=True)


# ring layouts besides the default: v6 (one shared epilogue ring, [128, 16] chunks), two rings (v7), [64, 32] chunks;
# v8: band chunks (4 x 2 boxes [8, 32] per array: rows 16 w + i of a band, 256 B per row); v9: 32 tokens per GEMM
# stage, 8 slots, 224 KB
LAYOUTS = {"r1_128x16": wg.GConfig(nring=1, stages=3, es=3, epi_m=128, epi_n=16),
           "r2_128x16": wg.GConfig(nring=2, stages=3, es=2, epi_m=128, epi_n=16),
           "r1_64x32": wg.GConfig(nring=1, stages=3, es=3, epi_m=64, epi_n=32),
           "r2_64x32": wg.GConfig(nring=2, stages=2, es=2, epi_m=64, epi_n=32),
           "r2_128x8": wg.GConfig(nring=2, stages=3, es=3, epi_m=128, epi_n=8),
           "r1_band": wg.GConfig(nring=1, stages=3, es=3, epi_m=8, epi_n=64),
           "r1_b32_e5": wg.GConfig(nring=1, bmt=32, stages=4, es=5),
           "r2_b32_e3": wg.GConfig(nring=2, bmt=32, stages=2, es=3)}


@sm90
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["adamw", "sgdm"])
def test_gluon_exact_layouts(force_gluon, layout, name):
    # ragged N/K/M (partial row bands and column chunks; band chunks: boxes wholly past N), 5 CTAs: both consumers,
    # many rounds of every ring
    _check_exact(RULES[name], 1000, 776, 333, max_ctas=5, config=LAYOUTS[layout])


def test_layouts_fit_smem():
    # AdamW + dW (the layout test's largest case): 4 arrays, 3 loaded; 227 KB per CTA on sm_90, < 1 KB of barriers
    for name, cfg in LAYOUTS.items():
        wg._check_gconfig(cfg)
        assert wg.gconfig_smem(cfg, 4, 2, True) <= 226 * 1024, name


@sm90
@pytest.mark.parametrize("shape", [(512, 512, 256), (512, 384, 1024), (256, 256, 8), (4096, 4096, 1024)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_exact_even_and_odd_m(force_gluon, shape):
    # even tiles; 4-stage ring (M > 512); M < one k-step; a full-size layer (1024 tiles on the whole GPU)
    _check_exact(RULES["adamw"], *shape)


@sm90
def test_gluon_exact_fp16(force_gluon):
    _check_exact(RULES["sgdm"], 512, 256, 200, dtype=torch.float16)


@sm90
def test_gluon_scalar_state_advances_once(force_gluon):
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 256, 256, 64, device="cuda")
    step = [s for i, s in enumerate(st) if rule.is_scalar_state(i)][0]
    wg.launch(w, dy_t, x, st, hp, rule)
    assert step.item() == 5.0


@sm90
def test_op_path_uses_gluon(monkeypatch):
    rule = RULES["adamw"]
    calls = []
    real = wg.launch

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(wg, "launch", spy)
    w, dy_t, x, st, hp = _make(rule, 1000, 776, 333, device="cuda")
    w_ref, st_ref = w.clone(), [s.clone() for s in st]
    for mode, expect in (("gluon", 1), ("triton", 0), ("auto", 1 if wg.AUTO_GLUON and not wg._auto_keeps_triton(rule) else 0)):
        monkeypatch.setenv(wg.ENV, mode)
        calls.clear()
        w1, st1 = w.clone(), [s.clone() for s in st]
        torch.ops.forge.wgrad_update_(w1, dy_t, x, st1, hp, rule.name)
        torch.cuda.synchronize()
        assert len(calls) == expect, mode
        w2, st2 = w_ref.clone(), [s.clone() for s in st_ref]
        reference_wgrad_update(w2, dy_t, x, st2, hp, rule.name)
        torch.testing.assert_close(w1, w2, rtol=2e-4, atol=2e-4)
        for a, b in zip(st1, st2):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


@sm90
def test_unsupported_layout_falls_back_to_triton(force_gluon, monkeypatch):
    # K % 8 != 0: no TMA descriptor; the op takes the Triton kernel and stays exact
    rule = RULES["adamw"]
    calls = []
    monkeypatch.setattr(wg, "launch", lambda *a, **k: calls.append(1))
    w, dy_t, x, st, hp = _make(rule, 1000, 777, 333, device="cuda")
    assert not wg.use_gluon(w, dy_t, x, st, rule)
    grad = torch.full_like(w, float("nan"))
    w_e, st_e = w.clone(), [s.clone() for s in st]
    wgrad_update(w, dy_t, x, st, hp, rule.name, grad_out=grad)
    assert not calls and not grad.isnan().any()
    with torch.no_grad():
        rule.apply(w_e, grad, st_e, hp)
    assert torch.equal(w, w_e)


# ---- v10: the vector-load epilogue (GConfig.epi="vec"; selectable, never picked) -----------------------------

VEC_LAYOUTS = {"vec_s6": wg.vec_config(), "vec_s4": wg.vec_config(stages=4), "vec_s2": wg.vec_config(stages=2)}


def test_vec_config_not_default_and_fits():
    for n_arrays in range(1, 6):
        for m in (64, 256, 1024, 8192):
            assert wg.pick_gconfig(m, n_arrays).epi != "vec"
            assert all(c.epi != "vec" for c in wg.gconfig_candidates(m, n_arrays))
    for name, cfg in VEC_LAYOUTS.items():
        wg._check_gconfig(cfg)
        # GEMM ring + the two consumers' convert_layout scratch; 227 KB per CTA on sm_90
        assert wg.gconfig_smem(cfg, 4, 2, True) <= 226 * 1024, name
    assert wg.gconfig_smem(wg.vec_config(), 3) == 6 * 32 * 1024 + 8 * 1024


def test_check_gconfig_refuses_vec_combinations():
    # the vec path has no epilogue ring: no band chunks, second ring or out ring; [32, 32] chunks only
    # ([64, 32] chunks spilled: refused too)
    for bad in (dict(epi_m=8, epi_n=64), dict(epi_m=32, nring=2), dict(epi_m=32, eout=1), dict(epi_m=32, epi_n=16),
                dict(epi_m=64, epi_n=32), dict(epi_m=128, epi_n=32), dict(epi_m=32, bn=64), dict(epi_m=32, stages=1)):
        with pytest.raises(ValueError):
            wg._check_gconfig(wg.GConfig(epi="vec", **bad))
    with pytest.raises(ValueError, match="data path"):
        wg._check_gconfig(wg.GConfig(epi="bogus"))
    with pytest.raises(ValueError):
        wg.vec_config(stages=1)
    assert wg.vec_config().stages == wg.VEC_STAGES and wg.vec_config().epi == "vec"


def _assert_same_pieces(a, b, helpers):
    """Modules ``a`` and ``b`` spell each of ``helpers`` (jit functions) word for word alike."""
    for helper in helpers:
        src = f"def {helper}("
        assert a.split(src, 1)[1].split("@gluon.jit", 1)[0] == b.split(src, 1)[1].split("@gluon.jit", 1)[0], helper


@pytest.mark.parametrize("rule", CATALOGUE + [RULES["adamw_fma"], RULES["clampy"]], ids=lambda r: r.name)
def test_render_vec_every_rule(rule):
    ep = compile_epilogue(rule, "cuda")
    tma, vec = wg.render_gluon_source(ep), wg.render_gluon_source(ep, "vec")
    ast.parse(vec)
    assert tma == wg.render_gluon_source(ep, "tma")
    # shared pieces: the same rule, tile order and GEMM loader in both modules; no epilogue ring in the vec one
    _assert_same_pieces(tma, vec, ("_rule", "_tile_coords", "_gemm_loader", "_tile_mma", "_split_chunks", "_pick"))
    assert "_epi_loader" not in vec and "e_ready" not in vec
    assert "async_copy_shared_to_global" not in vec and "store_wait" not in vec and "epi_turn" not in vec
    n_states = len(ep.tensor_inputs) - 2
    # W, the states, the side output: dW or the new W's cast copy
    assert vec.count("_nx = gl.load(") == n_states + 1 and vec.count("gl.store(") == n_states + 3
    with pytest.raises(ValueError):
        wg.render_gluon_source(ep, "bogus")


# ---- v11: dW through smem, deep vector lookahead (GConfig.epi="smem"; selectable, never picked) ---------------

SMEM_LAYOUTS = {"smem_r16a2s3": wg.smem_config(), "smem_r8a2s3": wg.smem_config(rows=8),
                "smem_r16a1s3": wg.smem_config(ahead=1), "smem_r16a2s2": wg.smem_config(stages=2),
                "smem_r16a2b32s6": wg.smem_config(bmt=32, stages=6),
                # L2 hints (v12): evict_first loads and stores / .cs stores
                "smem_r16a2s3_first": wg.smem_config(evict="first"), "smem_r16a2s3_cs": wg.smem_config(evict="cs"),
                # chunk addresses from per-tile bases (prepared, not measured)
                "smem_r16a2s3h": wg.smem_config(hoist=True),
                "smem_r8a1s3h": wg.smem_config(rows=8, ahead=1, hoist=True)}


def test_vector_picks_where_measured():
    # H200 (NOTES_kernel.md v11, v12), 2-byte activations: the split kernel for AdamW's 3 arrays above M=512 and
    # for the 2-array rules above M=1024 (7-13 % faster at M=2048); the smem epilogue for 3 arrays at M <= 512;
    # the TMA ring elsewhere (the 2-array rules at M <= 1024, 4+ arrays: not measured with the others); fp32
    # activations (under TF32) take the split kernel with 32-token K-major stages at every M (test_wgrad_update_tf32)
    for n_arrays in range(1, 6):
        for m in (64, 256, 512, 513, 1024, 1025, 8192):
            assert wg.pick_gconfig(m, n_arrays, 4) == wg.tf32_config(m)
            for act_bytes in (2,):
                want = "tma"
                if act_bytes == 2 and n_arrays == 3:
                    want = "smem" if m <= 512 else "split"
                elif act_bytes == 2 and n_arrays == 2 and m > 1024:
                    want = "split"
                assert wg.pick_gconfig(m, n_arrays, act_bytes).epi == want, (m, n_arrays, act_bytes)
                cands = wg.gconfig_candidates(m, n_arrays, act_bytes)
                assert cands[0] == wg.pick_gconfig(m, n_arrays, act_bytes)
                assert (cands[1] == wg._pick_tma(m, n_arrays, act_bytes)) if want != "tma" else \
                    all(c.epi == "tma" for c in cands)
    assert wg.pick_gconfig(256, 3) == wg.smem_config()
    # per-tile chunk bases up to M=2048 (stop 24, two H100 runs: 1-3 % faster there, 1-7 % slower above)
    assert wg.pick_gconfig(2048, 3) == wg.pick_gconfig(2048, 2) == wg.split_config(hoist=True)
    assert wg.pick_gconfig(1024, 3) == wg.split_config(hoist=True)
    assert wg.pick_gconfig(2049, 3) == wg.pick_gconfig(8192, 2) == wg.split_config()
    # the autotuner's split candidates: the pick, the TMA ring, then hoist toggled, hoist + evict_first loads, hoist
    # + group 4; all distinct and valid
    for m in (1024, 4096):
        cands = wg.gconfig_candidates(m, 3)
        assert cands[:2] == [wg.pick_gconfig(m, 3), wg._pick_tma(m, 3)]
        assert {c.hoist for c in cands[2:]} == ({True} if m == 4096 else {True, False})
        assert wg.split_config(hoist=True, evict="ld") in cands
        assert dataclasses.replace(wg.split_config(hoist=True), group=4) in cands
        assert len(set(cands)) == len(cands)
        for c in cands:
            wg._check_gconfig(c)
    for name, cfg in SMEM_LAYOUTS.items():
        wg._check_gconfig(cfg)
        assert cfg.epi == "smem" and cfg.epi_n == 128, name
        # GEMM ring + the two consumers' fp32 dW tiles; 227 KB per CTA on sm_90 (the compile adds < 1 KB)
        assert wg.gconfig_smem(cfg, 4, 2, True) <= 224 * 1024, name
    assert wg.gconfig_smem(wg.smem_config(), 3) == 3 * 32 * 1024 + 2 * 64 * 1024
    assert wg.smem_config().stages == wg.SMEM_STAGES


def test_check_gconfig_refuses_smem_combinations():
    # [8|16, 128] row chunks, 1-2 chunks ahead, a GEMM ring of 64-token (2-3) or 32-token (2-6) stages that fits
    # 224 KB beside the two 64 KB dW tiles, one GEMM ring and no epilogue ring
    ok = dict(epi="smem", epi_m=16, epi_n=128, stages=3, es=0, ahead=2)
    wg._check_gconfig(wg.GConfig(**ok))
    wg._check_gconfig(wg.GConfig(**{**ok, "bmt": 32, "stages": 6}))
    assert wg.gconfig_smem(wg.smem_config(bmt=32, stages=6), 3) == 6 * 16 * 1024 + 2 * 64 * 1024
    for bad in (dict(epi_m=32), dict(epi_m=4), dict(epi_m=64), dict(epi_n=32), dict(ahead=0), dict(ahead=3),
                dict(stages=1), dict(stages=4), dict(nring=2), dict(eout=1), dict(bn=64), dict(bmt=128),
                dict(bmt=32, stages=7)):
        with pytest.raises(ValueError):
            wg._check_gconfig(wg.GConfig(**{**ok, **bad}))
    for kw in (dict(rows=32), dict(ahead=3), dict(stages=4), dict(bmt=32, stages=7)):
        with pytest.raises(ValueError):
            wg.smem_config(**kw)


def test_smem_ahead_fits_the_register_budget():
    # registers of lookahead per thread (rows x ahead x arrays: rows / 4 x 4 fp32 each) capped at SMEM_AHEAD_REGS:
    # AdamW (W, m, v) keeps [16, 128] x 2 = 96 registers; 3 tensor states (4 arrays) drop to 1 chunk ahead
    cfg = wg.smem_config()
    assert wg.smem_ahead(cfg, 2) == wg.smem_ahead(cfg, 3) == 2 and wg.smem_ahead(cfg, 4) == 1
    assert wg.smem_ahead(wg.smem_config(rows=8), 4) == 2 and wg.smem_ahead(wg.smem_config(ahead=1), 1) == 1
    for rows in (8, 16):
        for ahead in (1, 2):
            for n_load in range(1, 5):
                a = wg.smem_ahead(wg.smem_config(rows=rows, ahead=ahead), n_load)
                assert 1 <= a <= ahead and (a == 1 or rows * a * n_load <= wg.SMEM_AHEAD_REGS)


@pytest.mark.parametrize("rule", CATALOGUE + [RULES["adamw_fma"], RULES["clampy"]], ids=lambda r: r.name)
def test_render_smem_every_rule(rule):
    ep = compile_epilogue(rule, "cuda")
    tma, smem = wg.render_gluon_source(ep), wg.render_gluon_source(ep, "smem")
    ast.parse(smem)
    # shared pieces: the same rule, tile order, GEMM loader and tile GEMM as the tma module
    _assert_same_pieces(tma, smem, ("_rule", "_tile_coords", "_gemm_loader", "_tile_mma"))
    assert "_epi_loader" not in smem and "e_ready" not in smem and "epi_turn" not in smem
    assert "async_copy_shared_to_global" not in smem and "convert_layout" not in smem
    n_states = len(ep.tensor_inputs) - 2
    # W + states loaded in _smem_load; W + states + dW stored in _smem_step
    assert smem.count("gl.load(") == n_states + 1 and smem.count("gl.store(") == n_states + 3


# ---- v12: one MMA warpgroup, two epilogue warpgroups (GConfig.epi="split") ----------------------------------

SPLIT_LAYOUTS = {"split_r8a4s5": wg.split_config(), "split_r16a2s5": wg.split_config(rows=16, ahead=2),
                 "split_r8a4b32s10": wg.split_config(stages=10, bmt=32),
                 # one chunk ahead and a 2-deep ring: the hand-offs with the least slack
                 "split_r8a1s2": wg.split_config(ahead=1, stages=2),
                 "split_r8a3e136": wg.split_config(ahead=3, eregs=136), "split_r8a4_cs": wg.split_config(evict="cs"),
                 # two dW tiles handed over in turn (prepared, not measured)
                 "split_r8a4d2s3": wg.split_config(dw_tiles=2, stages=3),
                 "split_r8a4d2b32s6": wg.split_config(dw_tiles=2, stages=6, bmt=32),
                 # chunk addresses from per-tile bases (prepared, not measured); one chunk ahead crosses into the
                 # next tile at every tile's last chunk, 8 ahead at every chunk
                 "split_r8a4h": wg.split_config(hoist=True),
                 "split_r16a1h": wg.split_config(rows=16, ahead=1, hoist=True),
                 "split_r8a8h": wg.split_config(ahead=8, hoist=True),
                 # the next tile's W/states prefetched into L2 (stop 24): 512 B rows in 2 / 4 / 8 pieces, clipped
                 # at the ragged K, none past N or the last tile
                 "split_r8a4pf64": wg.split_config(l2pf=64), "split_r8a4pf32h": wg.split_config(l2pf=32, hoist=True),
                 "split_r8a1pf16s2": wg.split_config(l2pf=16, ahead=1, stages=2),
                 "split_r8a4pf64fh": wg.split_config(l2pf=64, l2pf_first=True, hoist=True)}


def test_split_layouts_fit():
    for name, cfg in SPLIT_LAYOUTS.items():
        wg._check_gconfig(cfg)
        assert cfg.epi == "split" and cfg.epi_n == 128 and cfg.maxnreg == 128, name
        # GEMM ring + one or two fp32 dW tiles
        assert wg.gconfig_smem(cfg, 4, 2, True) == cfg.stages * cfg.bmt * 256 * 2 + cfg.dw_tiles * 64 * 1024 \
            <= 224 * 1024, name
    assert wg.split_config().stages == wg.SPLIT_STAGES == 5


def test_check_gconfig_refuses_split_combinations():
    # [8|16, 128] chunks, lookahead 1 .. the chunks of a half tile (64 / rows), a GEMM ring that fits 224 KB beside
    # one 64 KB dW tile; 16 warps launch with maxnreg <= 128 and the epilogue warpgroups must leave the MMA
    # warpgroup its 128 accumulator registers and more
    ok = dict(epi="split", epi_m=8, epi_n=128, stages=5, es=0, ahead=4, cregs=152, maxnreg=128)
    wg._check_gconfig(wg.GConfig(**ok))
    wg._check_gconfig(wg.GConfig(**{**ok, "ahead": 8}))
    wg._check_gconfig(wg.GConfig(**{**ok, "bmt": 32, "stages": 10}))
    wg._check_gconfig(wg.GConfig(**{**ok, "dw_tiles": 2, "stages": 3}))
    for bad in (dict(epi_m=32), dict(epi_n=64), dict(ahead=0), dict(ahead=9), dict(epi_m=16, ahead=5),
                dict(stages=1), dict(stages=6), dict(bmt=32, stages=11), dict(nring=2), dict(eout=1), dict(bn=64),
                dict(maxnreg=136), dict(cregs=176), dict(evict="last"), dict(dw_tiles=3), dict(dw_tiles=2),
                dict(dw_tiles=2, stages=4), dict(dw_tiles=0), dict(l2pf=8), dict(l2pf=128), dict(l2pf=48),
                dict(l2pf_first=True)):
        with pytest.raises(ValueError):
            wg._check_gconfig(wg.GConfig(**{**ok, **bad}))


def test_split_stream_off_is_a_split_only_diagnostic():
    # never picked; refused on the other kernels, which have no such switch
    wg._check_gconfig(wg.split_config(stream=False))
    for m in (64, 2048, 8192):
        for n_arrays in (2, 3, 4):
            assert wg.pick_gconfig(m, n_arrays).stream
    for cfg in (wg.smem_config(), wg.vec_config(), wg.gemm_config(), wg._pick_tma(256, 3)):
        for bad in (dict(stream=False), dict(dw_tiles=2), dict(l2pf=32)) + (() if cfg.epi == "smem" else
                                                                            (dict(hoist=True),)):
            with pytest.raises(ValueError):
                wg._check_gconfig(dataclasses.replace(cfg, **bad))
    # the L2 hints exist on the vector-load streams (smem, split) only
    for cfg in (wg.vec_config(), wg.gemm_config(), wg._pick_tma(256, 3)):
        with pytest.raises(ValueError):
            wg._check_gconfig(dataclasses.replace(cfg, evict="first"))


@sm90
@pytest.mark.parametrize("coop", [False, True], ids=["split", "coop"])
def test_split_stream_off_leaves_w_and_states_untouched(force_gluon, coop):
    # (and the coop split kernel's: stop 30, not GPU-run yet)
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 1000, 776, 333, device="cuda")
    w0, st0 = w.clone(), [s.clone() for s in st]
    cfg = wg.coop_config(stream=False) if coop else wg.split_config(stream=False)
    wg.bound_launch(w, dy_t, x, st, hp, rule, config=cfg)()
    torch.cuda.synchronize()
    assert torch.equal(w, w0) and all(torch.equal(a, b) for a, b in zip(st, st0))


@pytest.mark.parametrize("rule", CATALOGUE + [RULES["adamw_fma"], RULES["clampy"]], ids=lambda r: r.name)
def test_render_split_every_rule(rule):
    ep = compile_epilogue(rule, "cuda")
    smem, split = wg.render_gluon_source(ep, "smem"), wg.render_gluon_source(ep, "split")
    ast.parse(split)
    # the smem kernel's chunk code and the tma module's GEMM pieces, word for word
    _assert_same_pieces(smem, split, ("_rule", "_tile_coords", "_gemm_loader", "_tile_mma", "_smem_chunk", "_smem_load",
                                      "_smem_ahead0", "_smem_step"))
    # one MMA warpgroup (no turn), two epilogue warpgroups, the loader
    # (and the coop branch: two MMA warpgroups, one epilogue warpgroup)
    kernel = split.split("def wgrad_update_gluon_kernel", 1)[1]
    assert "[4, 4, 1]" in kernel and "[4, 1]" in kernel and kernel.count("_split_epi") == 3 and "_split_mma" in kernel
    # _split_mma's GEMM takes no mma turn (TURN=False)
    mma_body = split.split("def _split_mma", 1)[1].split("@gluon", 1)[0]
    assert split.count("_tile_mma(") == 2 and re.search(r"_tile_mma\([^)]*\bFalse, KMAJOR\)", mma_body)
    n_states = len(ep.tensor_inputs) - 2
    assert split.count("gl.load(") == n_states + 1 and split.count("gl.store(") == n_states + 3


# the vector-load epilogues (v10 "vec", v11 "smem", v12 "split"): the same exactness checks
# the coop split kernel (stop 30; GConfig.mma_warps=8): [128, 256] tiles, two MMA warpgroups, one epilogue
# warpgroup walking [4, 256] chunks; prepared on CPU (sm_90 compiles: AdamW 0 B of spills, 40 B with dW), NOT GPU-run
COOP_LAYOUTS = {"coop_r4a4b32s4": wg.coop_config(), "coop_r4a4h": wg.coop_config(hoist=True),
                "coop_b64s2": wg.coop_config(bmt=64, stages=2),
                # one chunk ahead and a 2-deep ring: the hand-offs with the least slack
                "coop_r4a1s2": wg.coop_config(ahead=1, stages=2)}


def test_coop_config_fits_and_is_never_picked():
    for name, cfg in COOP_LAYOUTS.items():
        wg._check_gconfig(cfg)
        # GEMM ring + the [128, 256] fp32 dW tile
        assert wg.gconfig_smem(cfg, 4, 2, True) == cfg.stages * cfg.bmt * 384 * 2 + 128 * 1024 <= 224 * 1024, name
    ok = dict(epi="split", bk=256, epi_m=4, epi_n=256, stages=4, bmt=32, es=0, ahead=4, cregs=152, maxnreg=128,
              mma_warps=8)
    wg._check_gconfig(wg.GConfig(**ok))
    # 5 stages pass 224 KB; no second dW tile, l2pf or pdl; 128-wide tiles or chunks; an epilogue warpgroup whose
    # registers leave the two MMA warpgroups fewer than 160 each; 8 MMA warps on another kernel
    for bad in (dict(stages=5), dict(dw_tiles=2), dict(l2pf=32), dict(pdl=1), dict(bk=128), dict(epi_n=128),
                dict(epi_m=16), dict(ahead=33), dict(cregs=200), dict(mma_warps=6), dict(epi="smem")):
        with pytest.raises(ValueError):
            wg._check_gconfig(wg.GConfig(**{**ok, **bad}))
    with pytest.raises(ValueError):
        wg._check_gconfig(dataclasses.replace(wg.split_config(), mma_warps=8))   # 128x128 tiles: not coop
    for n_arrays in range(1, 6):
        for m in (64, 2048, 8192, 65536):
            for act_bytes in (2, 4):
                assert wg.pick_gconfig(m, n_arrays, act_bytes).mma_warps == 4


def test_coop_launch_options():
    # 8 warps in the MMA partition, one epilogue warpgroup (NEPI always in the options: the launch memo needs every
    # defaulted constexpr there); 128x256 tiles; fp32 activations (K-major tf32 path) refused
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 1000, 776, 333)
    kernel, grid, args, opts, _, _ = wg._prepare(w, dy_t, x, st, hp, rule, config=wg.coop_config(), max_ctas=132)
    assert opts["num_warps"] == 8 and opts["NEPI"] == 1 and grid == (min(132, 8 * 4),)
    assert args[0].block_shape == [32, 128] and args[1].block_shape == [32, 256]
    opts2 = wg._prepare(w, dy_t, x, st, hp, rule, config=wg.split_config(), max_ctas=132)[3]
    assert opts2["num_warps"] == 4 and opts2["NEPI"] == 2
    # fp32 activations (TF32, K-major copies): 32-token stages of fp32 pass the smem budget beside the 128 KB dW
    # tile; 16-token stages fit
    w, dy_t, x, st, hp = _make(rule, 1000, 776, 336)   # M % 4 == 0: the K-major copies' 16-byte rows
    with pytest.raises(ValueError, match="GEMM stages of fp32"):
        wg._prepare(w, dy_t.float(), x.float(), st, hp, rule, config=wg.coop_config(), max_ctas=132)
    opts = wg._prepare(w, dy_t.float(), x.float(), st, hp, rule, config=wg.coop_config(bmt=16), max_ctas=132)[3]
    assert opts["KMAJOR"] and opts["num_warps"] == 8


VECTOR_LAYOUTS = {**VEC_LAYOUTS, **SMEM_LAYOUTS, **SPLIT_LAYOUTS, **COOP_LAYOUTS}
VECTOR_CONFIGS = {"vec": wg.vec_config, "smem": wg.smem_config, "split": wg.split_config,
                  "split_pf32": lambda: wg.split_config(l2pf=32), "coop": wg.coop_config}


@sm90
@pytest.mark.parametrize("layout", list(VECTOR_LAYOUTS))
@pytest.mark.parametrize("name", ["adamw", "sgdm", "lion"])
def test_gluon_vector_epilogue_exact_ragged(force_gluon, layout, name):
    # ragged N/K/M (masked rows/columns of the last tiles), 5 CTAs: both consumers, many rounds, the loads ahead
    # past a consumer's last tile
    _check_exact(RULES[name], 1000, 776, 333, max_ctas=5, config=VECTOR_LAYOUTS[layout])


@sm90
@pytest.mark.parametrize("epi", list(VECTOR_CONFIGS))
@pytest.mark.parametrize("name", ["adamw", "sgdm", "lion"])
def test_gluon_vector_epilogue_exact_full_layer(force_gluon, epi, name):
    _check_exact(RULES[name], 4096, 4096, 1024, config=VECTOR_CONFIGS[epi]())


@sm90
@pytest.mark.parametrize("epi", list(VECTOR_CONFIGS))
@pytest.mark.parametrize("name", ["adamw_fma", "clampy", "rmsprop_cm"])
def test_gluon_vector_epilogue_exact_other_rules(force_gluon, epi, name):
    _check_exact(RULES[name], 1000, 776, 333, max_ctas=3, config=VECTOR_CONFIGS[epi]())


@sm90
@pytest.mark.parametrize("epi", list(VECTOR_CONFIGS))
def test_gluon_vector_epilogue_int64_offsets(force_gluon, epi):
    # BIG (int64 element offsets, chosen when N * K passes 2^31) forced on a small layer: same results
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 1000, 776, 333, device="cuda")
    grad = torch.full_like(w, float("nan"))
    w_e, st_e = w.clone(), [s.clone() for s in st]
    kernel, grid, args, opts, _, _ = wg._prepare(w, dy_t, x, st, hp, rule, grad, config=VECTOR_CONFIGS[epi](),
                                                 max_ctas=5)
    assert opts["BIG"] is False
    kernel[grid](*args, **{**opts, "BIG": True})
    torch.cuda.synchronize()
    assert not grad.isnan().any()
    with torch.no_grad():
        rule.apply(w_e, grad, [s for s in st_e], hp)
    # the scalar state (step) was not advanced by the bare kernel launch: eager applied to the same inputs
    assert torch.equal(w, w_e)
    for s, e in zip(st, st_e):
        if s.dim():
            assert torch.equal(s, e)


# ---- overlap diagnostic: the GEMM schedule alone (GConfig.epi="gemm"; selectable, never picked) ---------------

GEMM_LAYOUTS = {"gemm_s4": wg.gemm_config(), "gemm_s3": wg.gemm_config(stages=3), "gemm_b32s6": wg.gemm_config(6, 32)}


def test_gemm_config_never_picked_and_counted():
    for n_arrays in range(1, 6):
        for m in (64, 256, 1024, 1025, 8192):
            for act_bytes in (2, 4):
                assert wg.pick_gconfig(m, n_arrays, act_bytes).epi != "gemm"
                assert all(c.epi != "gemm" for c in wg.gconfig_candidates(m, n_arrays, act_bytes))
    cfg = wg.gemm_config()
    assert cfg.epi == "gemm" and cfg.stages == 4 and cfg.bmt == 64 and cfg.es == 0
    # smem: the GEMM ring only, whatever the arrays (no epilogue ring, no dW tiles, no scratch)
    for n_arrays in (0, 3, 5):
        for store_grad in (False, True):
            assert wg.gconfig_smem(cfg, n_arrays, 2, store_grad) == 4 * 64 * 256 * 2
    assert wg.gconfig_smem(wg.gemm_config(6, 32), 3) == 6 * 32 * 256 * 2
    assert wg.gconfig_smem(wg.gemm_config(7), 3) == 224 * 1024
    # selectable as a plain GConfig too (the epilogue fields are unused)
    wg._check_gconfig(wg.GConfig(epi="gemm"))
    for name, c in GEMM_LAYOUTS.items():
        wg._check_gconfig(c)
    assert wg.gemm_sums_shape(1000, 776) == (1024, 7) and wg.gemm_sums_shape(4096, 4096, cfg) == (4096, 32)


def test_check_gconfig_refuses_gemm_combinations():
    # [128, 128] tiles, 32/64-token stages, >= 2 stages within the rings' 224 KB, one ring, no out ring
    for bad in (dict(nring=2), dict(eout=1), dict(bn=64), dict(bk=64), dict(bmt=128), dict(bmt=16),
                dict(stages=1), dict(stages=8), dict(bmt=32, stages=15)):
        with pytest.raises(ValueError):
            wg._check_gconfig(wg.GConfig(**{"epi": "gemm", **bad}))
    wg._check_gconfig(wg.GConfig(epi="gemm", bmt=32, stages=14))
    for kw in (dict(stages=1), dict(stages=8), dict(bmt=128)):
        with pytest.raises(ValueError):
            wg.gemm_config(**kw)


@pytest.mark.parametrize("rule", CATALOGUE + [RULES["adamw_fma"], RULES["clampy"]], ids=lambda r: r.name)
def test_render_gemm_every_rule(rule):
    ep = compile_epilogue(rule, "cuda")
    tma, gemm = wg.render_gluon_source(ep), wg.render_gluon_source(ep, "gemm")
    ast.parse(gemm)
    assert tma == wg.render_gluon_source(ep, "tma")
    # the same tile order, GEMM loader and tile GEMM as the tma module (the same GEMM schedule)
    _assert_same_pieces(tma, gemm, ("_rule", "_tile_coords", "_gemm_loader", "_tile_mma"))
    # no epilogue: no ring, loader, turn, W/state traffic; the rule is never called; one store (the row sums)
    kernel = gemm.split("def _gemm_consumer(", 1)[1]
    assert "_rule(" not in kernel and "_epi_loader" not in gemm and "e_ready" not in gemm
    assert "epi_turn" not in gemm and "async_copy_shared_to_global" not in gemm
    assert gemm.count("gl.load(") == 0 and gemm.count("gl.store(") == 1 and "w_ptr" not in gemm
    assert kernel.count("_tile_mma(") == 1 and "mma_turn" in kernel


def _check_gemm_sums(n, k, m, cfg, max_ctas=None, seed=1):
    # the row sums of each [128, 128] tile of dW vs the fp64 product. Bound: 1e-4 x the sum of |dW| over the same
    # 128 elements, not a relative error of the sum: the kernel sums in its own order (fp32 wgmma accumulation,
    # then a shuffle tree over the row), so it differs from any reference by rounding ~2^-24 sqrt(M) sum|dW|, and a
    # row sum of random values can cancel to ~0, where a relative tolerance fails; a token left out of the GEMM
    # moves a sum by > 1000 x the bound (checked on CPU with a fake kernel). Rows past N: exactly 0.
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, n, k, m, torch.bfloat16, "cuda", seed)
    sums = torch.full(wg.gemm_sums_shape(n, k, cfg), float("nan"), device="cuda")
    w0, st0 = w.clone(), [s.clone() for s in st]
    wg.launch(w, dy_t, x, st, hp, rule, side_out=sums, config=cfg, max_ctas=max_ctas)
    torch.cuda.synchronize()
    assert not sums.isnan().any()
    rows, nk = sums.shape
    pad = torch.zeros(rows, nk * 128, dtype=torch.float64, device="cuda")
    pad[:n, :k] = dy_t.double() @ x.double()
    pad = pad.view(rows, nk, 128)
    err = (sums.double() - pad.sum(-1)).abs()
    assert (err <= 1e-4 * pad.abs().sum(-1)).all(), f"{(err > 1e-4 * pad.abs().sum(-1)).sum().item()} sums off"
    assert (sums[n:] == 0).all()
    # nothing else written, the scalar state (step) not advanced either
    assert torch.equal(w, w0) and all(torch.equal(a, b) for a, b in zip(st, st0))


@sm90
@pytest.mark.parametrize("layout", list(GEMM_LAYOUTS))
@pytest.mark.parametrize("max_ctas", [None, 5])
def test_gluon_gemm_sums_ragged(layout, max_ctas):
    # ragged N/K/M (zero-filled rows/columns/tokens), one tile per CTA or many (5 CTAs: both consumers, many rounds)
    _check_gemm_sums(1000, 776, 333, GEMM_LAYOUTS[layout], max_ctas=max_ctas)


@sm90
@pytest.mark.parametrize("layout", ["gemm_s4", "gemm_s3"])
def test_gluon_gemm_sums_full_layer(layout):
    _check_gemm_sums(4096, 4096, 1024, GEMM_LAYOUTS[layout])


@sm90
def test_gluon_gemm_refuses_a_wrong_output():
    # the row sums go into side_out: [ceil(N / 128) * 128, ceil(K / 128)] fp32, anything else is refused
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 1000, 776, 333, device="cuda")
    for bad in (torch.empty_like(w), torch.empty(1024, 7, device="cuda", dtype=torch.float64)):
        with pytest.raises(ValueError, match="row sums"):
            wg.launch(w, dy_t, x, st, hp, rule, side_out=bad, config=wg.gemm_config())


# ---- the new W's cast copy as side output (compile_train_step(cast_weights_in_update=True)) ---------------------

def test_cast_copy_goes_to_a_pointer_epilogue():
    from forge_compile.kernels.wgrad_update_triton import SIDE_CAST, SIDE_GRAD, SIDE_NONE

    for m in (64, 256, 512, 1024, 2048, 4096, 8192):
        for n_load in (1, 2, 3):
            cast = wg.pick_for(m, n_load, 2, SIDE_CAST)
            plain = wg.pick_for(m, n_load, 2, SIDE_NONE)
            assert cast is not None and cast.epi in wg.POINTER_EPIS, (m, n_load, cast)
            # the pick of the arrays read where that is a pointer epilogue already (AdamW everywhere)
            if plain.epi in wg.POINTER_EPIS:
                assert cast == plain
            else:
                assert cast == wg.smem_config()
            # dW as side output is one more streamed array, as before
            assert wg.pick_for(m, n_load, 2, SIDE_GRAD) == wg.pick_gconfig(m, n_load + 1, 2)
    assert wg.pick_for(2048, 3, 2, SIDE_CAST).epi == "split" and wg.pick_for(256, 2, 2, SIDE_CAST).epi == "smem"


def test_autotune_candidates_for_the_cast_copy_are_pointer_epilogues(fake_sm90):
    from forge_compile.kernels import wgrad_update_autotune as at

    for name in ("adamw", "sgdm"):
        rule = RULES[name]
        for m in (256, 2048):
            w, dy_t, x, st, hp = _make(rule, 256, 128, m)
            out = torch.empty_like(w, dtype=torch.bfloat16)
            cands = at.candidates(rule, w, dy_t, x, st, out)
            gl = [c.config for c in cands if c.family == "gluon"]
            assert gl and all(c.epi in wg.POINTER_EPIS for c in gl), (name, m, gl)
            assert gl[0] == wg.pick_for(m, 1 + len([s for s in st if s.dim()]), 2, 2)
            # and the tuning key tells the cast copy from dW and from nothing
            keys = {at.tune_key(rule, w, dy_t, x, st, s) for s in (None, torch.empty_like(w), out)}
            assert len(keys) == 3


# ---- a tied embedding's rows added to dW (FORGE_GLUON_EXTRA=1; the smem and split kernels) ------------------------

@pytest.mark.parametrize("epi", ["smem", "split"])
def test_render_tied_rows(epi):
    ep = compile_epilogue(RULES["adamw"], "cuda")
    plain, tied = wg.render_gluon_source(ep, epi), wg.render_gluon_source(ep, epi, extra=True)
    ast.parse(tied)
    assert "_smem_extra" not in plain and "e_ptr" not in plain
    # the helper, one call in each chunk step (_smem_step, _smem_step_at), the pointers before g_ptr everywhere
    assert tied.count("def _smem_extra(") == 1 and tied.count("g = _smem_extra(") == 2
    assert tied.count("e_ptr, p_ptr, g_ptr") == plain.count("g_ptr") - plain.count("g_ptr +") - \
        plain.count("g_ptr.dtype")
    with pytest.raises(wg.GluonUnsupported):
        wg.render_gluon_source(ep, "tma", extra=True)


def test_tied_rows_pick_and_opt_in(fake_sm90, monkeypatch):
    from forge_compile.kernels.wgrad_update_triton import SIDE_NONE

    for m in (64, 256, 1024, 2048, 8192):
        for n_load in (1, 2, 3):
            cfg = wg.pick_for(m, n_load, 2, SIDE_NONE, extra=True)
            # the tied rows keep the measured kernels: no hoist (not measured with them; more spills)
            assert cfg.epi in ("smem", "split") and not cfg.hoist
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 256, 128, 96)
    extra = (torch.zeros(96, 128), torch.full((256,), -1, dtype=torch.int32))
    monkeypatch.delenv(wg.EXTRA_ENV, raising=False)
    assert wg.EXTRA_ENV in wg.gluon_reason(w, dy_t, x, st, rule, extra=extra)
    monkeypatch.setenv(wg.EXTRA_ENV, "1")
    assert wg.gluon_reason(w, dy_t, x, st, rule, extra=extra) is None
