"""wgrad_update_autotune: keyed choices, timing on scratch copies, persistence; on the GPU, tuned launches exact."""
from __future__ import annotations

import json

import pytest
import torch

from forge_compile.kernels import launch_memo
from forge_compile.kernels import wgrad_update_autotune as at
from forge_compile.kernels.wgrad_update import wgrad_update
from forge_compile.optim import rules as R
from forge_compile.optim.rule import register_rule


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    monkeypatch.setenv(at.ENV, "1")
    monkeypatch.setenv("FORGE_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    at.clear(memory_only=True)
    launch_memo.clear()
    yield tmp_path / "autotune.json"
    at.clear(memory_only=True)
    launch_memo.clear()


def _layer(n=256, k=128, m=100, device="cpu"):
    rule = register_rule(R.adamw_rule())
    w = torch.randn(n, k, device=device)
    states = [torch.tensor(2.0), torch.rand(n, k, device=device) * 0.1, torch.rand(n, k, device=device) * 0.1]
    hp = [torch.tensor(v, dtype=torch.float64) for v in (1e-3, 0.9, 0.999, 1e-8, 0.01)]
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    return rule, w, dy.t(), x, states, hp


def test_m_bucket():
    assert [at.m_bucket(m) for m in (1, 64, 65, 300, 512, 513, 8192)] == [64, 64, 128, 512, 512, 1024, 8192]


def test_key_shares_a_bucket_and_nothing_else():
    rule, w, dy_t, x, st, hp = _layer(m=300)
    key = at.tune_key(rule, w, dy_t, x, st, None)
    _, _, dy2, x2, _, _ = _layer(m=500)
    assert at.tune_key(rule, w, dy2, x2, st, None) == key               # same bucket (512)
    _, _, dy3, x3, _, _ = _layer(m=600)
    assert at.tune_key(rule, w, dy3, x3, st, None) != key               # next bucket
    assert at.tune_key(rule, w, dy_t, x, st, torch.empty_like(w)) != key  # stored dW: another kernel variant
    assert at.tune_key(rule, w, dy_t.float(), x.float(), st, None) != key


def test_disabled_by_default(monkeypatch):
    monkeypatch.delenv(at.ENV, raising=False)
    rule, w, dy_t, x, st, hp = _layer()
    assert at.choose(w, dy_t, x, st, hp, rule) is None


def test_choose_times_on_scratch_keeps_fastest_and_persists(tuner, monkeypatch):
    rule, w, dy_t, x, st, hp = _layer()
    w0, st0 = w.clone(), [s.clone() for s in st]
    cands = [at.Choice("triton", "a"), at.Choice("triton", "b"), at.Choice("triton", "c")]
    speed = {"a": 3.0, "b": 1.0, "c": 2.0}
    seen = []

    def fake_launch(choice, weight, dy_t_, x_, states, hparams, rule_, grad_out, table=None):
        seen.append((choice.config, weight.data_ptr(), [s.data_ptr() for s in states if s.dim()]))
        weight.add_(1.0)          # a real launch mutates: it must be the scratch copy
        states[0].add_(1.0)       # the step counter too (restored between runs)

    def fake_time(fn, reps=5):
        fn()
        return speed[seen[-1][0]]

    monkeypatch.setattr(at, "_device_ok", lambda w: True)
    monkeypatch.setattr(at, "candidates", lambda *a: cands)
    monkeypatch.setattr(at, "_bind_choice", lambda c, *a, **kw: (lambda: fake_launch(c, *a, **kw)))
    monkeypatch.setattr(at, "_time_ms", fake_time)
    choice = at.choose(w, dy_t, x, st, hp, rule)
    assert choice.config == "b" and choice.ms == 1.0
    real = {w.data_ptr(), *(s.data_ptr() for s in st if s.dim())}
    assert all(p not in real and not (set(sp) & real) for _, p, sp in seen)
    assert torch.equal(w, w0) and all(torch.equal(a, b) for a, b in zip(st, st0))
    # a hit: no timing; then a new process (memory table dropped) reads the file
    n_seen = len(seen)
    assert at.choose(w, dy_t, x, st, hp, rule).config == "b" and len(seen) == n_seen
    assert json.load(open(tuner))[at.tune_key(rule, w, dy_t, x, st, None)]["config"] == "b"
    at.clear(memory_only=True)
    assert at.choose(w, dy_t, x, st, hp, rule).config == "b" and len(seen) == n_seen


@pytest.mark.parametrize("other_ms, want", [(0.98, "default"), (0.96, "other"), (1.5, "default")])
def test_default_kept_unless_clearly_beaten(tuner, monkeypatch, other_ms, want):
    # timings move by 1-3 % between runs: a candidate must beat the default (the first) by more than KEEP_DEFAULT
    rule, w, dy_t, x, st, hp = _layer()
    speed = {"default": 1.0, "other": other_ms}
    seen = []
    monkeypatch.setattr(at, "_device_ok", lambda w: True)
    monkeypatch.setattr(at, "candidates", lambda *a: [at.Choice("triton", "default"), at.Choice("triton", "other")])
    monkeypatch.setattr(at, "_bind_choice", lambda c, *a, **kw: (lambda: seen.append(c.config)))
    monkeypatch.setattr(at, "_time_ms", lambda fn: (fn(), speed[seen[-1]])[1])
    choice = at.choose(w, dy_t, x, st, hp, rule)
    assert choice.config == want and choice.ms == speed[want]
    assert at.counters["kept_default"] == (want == "default")


def test_candidates_are_timed_on_the_kernel_alone(monkeypatch):
    # _bind_choice hands out the bound launch (host part done once), not the Python launch whose host cost would
    # decide between configs at small shapes
    from forge_compile.kernels import wgrad_update_gluon as wg
    from forge_compile.kernels import wgrad_update_triton as wt

    rule, w, dy_t, x, st, hp = _layer()
    calls = []
    for mod, fam in ((wt, "triton"), (wg, "gluon")):
        monkeypatch.setattr(mod, "bound_launch", lambda *a, _f=fam, **kw: calls.append((_f, kw["config"])) or "fn")
    assert at._bind_choice(at.Choice("triton", "t64"), w, dy_t, x, st, hp, rule, None) == "fn"
    assert at._bind_choice(at.Choice("gluon", "g"), w, dy_t, x, st, hp, rule, None) == "fn"
    assert calls == [("triton", "t64"), ("gluon", "g")]


def test_failing_candidate_skipped(tuner, monkeypatch):
    rule, w, dy_t, x, st, hp = _layer()

    def fake_time(fn, reps=5):
        fn()
        return 1.0

    def fake_launch(choice, *a, **kw):
        if choice.config == "bad":
            raise RuntimeError("out of shared memory")

    monkeypatch.setattr(at, "_device_ok", lambda w: True)
    monkeypatch.setattr(at, "candidates", lambda *a: [at.Choice("triton", "bad"), at.Choice("triton", "ok")])
    monkeypatch.setattr(at, "_bind_choice", lambda c, *a, **kw: (lambda: fake_launch(c, *a, **kw)))
    monkeypatch.setattr(at, "_time_ms", fake_time)
    assert at.choose(w, dy_t, x, st, hp, rule).config == "ok"
    assert at.counters["candidate_failed"] == 1


def test_table_launch_shares_the_host_launch_key():
    # a launch reading a scalar table (tensor states only) is the same kernel choice as the host-scalar launch
    rule, w, dy_t, x, st, hp = _layer()
    tensor_states = [s for i, s in enumerate(st) if not rule.is_scalar_state(i)]
    table = torch.zeros(8)
    assert at.tune_key(rule, w, dy_t, x, tensor_states, None, table) == at.tune_key(rule, w, dy_t, x, st, None)
    assert at._n_arrays(rule, tensor_states, None, table) == at._n_arrays(rule, st, None) == 3


def test_table_launch_tunes_on_scratch_tensor_states(tuner, monkeypatch):
    rule, w, dy_t, x, st, hp = _layer()
    tensor_states = [s for i, s in enumerate(st) if not rule.is_scalar_state(i)]
    table = torch.zeros(8)
    seen = []

    def fake_launch(choice, weight, dy_t_, x_, states, hparams, rule_, grad_out, table=None):
        seen.append((len(states), all(s.shape == weight.shape for s in states), hparams, table))

    monkeypatch.setattr(at, "_device_ok", lambda w: True)
    monkeypatch.setattr(at, "candidates", lambda *a: [at.Choice("triton", "a"), at.Choice("triton", "b")])
    monkeypatch.setattr(at, "_bind_choice", lambda c, *a, **kw: (lambda: fake_launch(c, *a, **kw)))
    monkeypatch.setattr(at, "_time_ms", lambda fn: (fn(), 1.0)[1])
    assert at.choose(w, dy_t, x, tensor_states, [], rule, None, table).config == "a"
    assert seen and all(n == 2 and same and hp == [] and t is table for n, same, hp, t in seen)


def test_scratch_rows_capped(monkeypatch):
    rule, w, dy_t, x, st, hp = _layer(n=4096, k=1024)
    assert at._scratch_rows(rule, w, st, None) == 4096               # 48 MiB: whole weight
    monkeypatch.setenv("FORGE_AUTOTUNE_MIB", "6")                      # 6 MiB / (3 arrays x 4 KiB per row) = 512
    assert at._scratch_rows(rule, w, st, None) == 512


def test_gluon_choice_roundtrip():
    pytest.importorskip("triton")
    from forge_compile.kernels.wgrad_update_gluon import pick_gconfig

    c = at.Choice("gluon", pick_gconfig(1024, 3), 0.5)
    assert at.Choice.from_json(json.loads(json.dumps(c.to_json()))) == c


# ---- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_tuned_launch_exact_and_parameter_untouched_by_tuning(tuner, act):
    rule, w, dy_t, x, st, hp = _layer(1000, 776, 333, device="cuda")
    dy_t, x = dy_t.to(act), x.to(act)
    for step in range(3):   # tuning at the first launch, then the table (and the launch memo) at the next ones
        w_ref, st_ref = w.clone(), [s.clone() for s in st]
        grad = torch.full_like(w, float("nan"))
        wgrad_update(w, dy_t, x, st, hp, rule.name, grad_out=grad)
        torch.cuda.synchronize()
        assert not grad.isnan().any()
        with torch.no_grad():
            rule.apply(w_ref, grad, st_ref, hp)
        assert torch.equal(w, w_ref), f"launch {step}: W differs (tuning touched the parameter?)"
        for a, b in zip(st, st_ref):
            assert torch.equal(a.cpu(), b.cpu())
    assert at.counters["tuned"] == (1 if len(at.candidates(rule, w, dy_t, x, st, grad)) > 1 else 0)
    assert json.load(open(tuner)), "choice not persisted"


def test_gluon_candidates_fit_and_start_with_the_default():
    pytest.importorskip("triton")
    from forge_compile.kernels import wgrad_update_gluon as wg

    for m in (64, 512, 513, 8192):
        for n_arrays in (1, 3, 5):
            cands = wg.gconfig_candidates(m, n_arrays)
            assert cands[0] == wg.pick_gconfig(m, n_arrays)
            # the split kernel's pick brings its three variants (hoist toggled, evict_first loads, group 4)
            assert len(set(cands)) == len(cands) == (5 if cands[0].epi == "split" else 2)
            assert all(wg.gconfig_smem(c, n_arrays) <= wg._RING_SMEM for c in cands)


def test_forget_sends_the_key_back_to_the_default(tuner, monkeypatch):
    rule, w, dy_t, x, st, hp = _layer()
    monkeypatch.setattr(at, "_device_ok", lambda w: True)
    monkeypatch.setattr(at, "candidates", lambda *a: [at.Choice("triton", "a"), at.Choice("triton", "b")])
    monkeypatch.setattr(at, "_bind_choice", lambda *a: (lambda: None))
    monkeypatch.setattr(at, "_time_ms", lambda fn, reps=5: 1.0)
    assert at.choose(w, dy_t, x, st, hp, rule) is not None
    at.forget(w, dy_t, x, st, rule, why=RuntimeError("does not build"))
    assert at.choose(w, dy_t, x, st, hp, rule) is None                 # not re-tuned in this process
    assert at.tune_key(rule, w, dy_t, x, st, None) not in json.load(open(tuner))
