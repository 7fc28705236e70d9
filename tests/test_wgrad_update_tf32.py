"""fp32 activations under TF32 on the Gluon split kernel (K-major copies of dY and X): selection and launch set-up on
CPU, exactness on an sm_90 GPU.

Exactness standard (as for every fused kernel): W/states bit-identical to eager ``rule.apply`` on the dW the kernel
stored; that dW within TF32's error of the fp64 product (10-bit mantissa inputs: ~1e-3 relative, asserted < 5e-3)
and farther than an IEEE dot's ~1e-6 (asserted > 1e-5: TF32 really ran, as torch.mm under "high" precision).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from matmul_precision import tf32 as _tf32  # noqa: E402
from forge_compile.kernels import launch_memo  # noqa: E402
from forge_compile.kernels import wgrad_update_gluon as wg  # noqa: E402
from forge_compile.kernels import wgrad_update_group as gr  # noqa: E402
from forge_compile.kernels.wgrad_update import reference_wgrad_update  # noqa: E402
from forge_compile.optim import rules as R  # noqa: E402

RULES = {"adamw": R.adamw_rule(), "sgdm": R.sgd_rule(momentum=True), "lion": R.lion_rule()}
_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9,
       "dampening": 0.1}


def _make(rule, n, k, m, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    states = [torch.tensor(4.0) if rule.is_scalar_state(i) else torch.rand(n, k, generator=gen) * 0.1 + 0.05
              for i in range(len(rule.states))]
    dy = torch.randn(m, n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    states = [s if s.dim() == 0 else s.to(device) for s in states]
    return w.to(device), dy.to(device).t(), x.to(device), states, hp   # dy_t: transposed view, as in autograd


@pytest.fixture
def fake_sm90(monkeypatch):
    """CPU tensors judged as if on an sm_90 GPU with gluon present (selection logic only)."""
    monkeypatch.setattr(wg, "_device_ok", lambda dev: True)
    monkeypatch.setattr(wg, "gluon_available", lambda: True)
    monkeypatch.setenv(wg.ENV, "gluon")
    monkeypatch.delenv(wg.TF32_ENV, raising=False)


# ---- CPU: selection and set-up ------------------------------------------------------------------------------


def test_tf32_selection(fake_sm90, monkeypatch):
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 256, 128, 96)
    with _tf32(False):   # IEEE fp32 (torch's default): the Triton kernel's FMA dot, as cuBLAS's SGEMM
        assert "without TF32" in wg.gluon_reason(w, dy_t, x, st, rule)
    with _tf32(True):
        assert wg.gluon_reason(w, dy_t, x, st, rule) is None
        # any layout: the path copies both operands K-major anyway
        assert wg.gluon_reason(w, dy_t.contiguous(), x.t().contiguous().t(), st, rule) is None
        # M not a multiple of 4: the copies' rows would not be 16-byte aligned
        w2, dy2, x2, st2, _ = _make(rule, 256, 128, 94)
        assert "multiple of 4" in wg.gluon_reason(w2, dy2, x2, st2, rule)
        # N, K multiples of 8 as for 2-byte activations (the epilogue's 16-byte vectors)
        w3, dy3, x3, st3, _ = _make(rule, 256, 132, 96)
        assert wg.gluon_reason(w3, dy3, x3, st3, rule) is not None
        # mixed fp32/bf16 operands are not this path
        assert wg.gluon_reason(w, dy_t, x.bfloat16(), st, rule) is not None
        # a tied embedding's rows: not built for fp32
        assert "tied" in wg.gluon_reason(w, dy_t, x, st, rule, extra=(torch.zeros(4, 128), torch.zeros(256)))
        monkeypatch.setenv(wg.TF32_ENV, "0")
        assert wg.TF32_ENV in wg.gluon_reason(w, dy_t, x, st, rule)


@pytest.mark.parametrize("m", [8, 256, 2048, 8192])
def test_tf32_config_is_the_split_kernel_within_smem(m):
    cfg = wg.pick_gconfig(m, 3, 4)
    assert cfg == wg.tf32_config(m) and cfg.epi == "split" and cfg.bmt == 32
    assert cfg.hoist == (m <= wg._SPLIT_HOIST_M)
    # 32 fp32 tokens per stage = the 64 bf16 tokens' 32 KB: the bf16 split kernel's ring and dW tile, 224 KB
    assert wg.gconfig_smem(cfg, 3, 4) == wg.gconfig_smem(wg.split_config(), 3, 2) <= wg._RING_SMEM
    cands = wg.gconfig_candidates(m, 3, 4)
    assert cands[0] == cfg and all(c.epi == "split" and c.bmt == 32 for c in cands)


def test_tf32_prepare_copies_k_major(fake_sm90):
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    rule = RULES["sgdm"]
    n, k, m = 256, 128, 96
    w, dy_t, x, st, hp = _make(rule, n, k, m)
    cfg = wg.tf32_config(m)
    kernel, grid, args, opts = wg._prepare(w, dy_t, x, st, hp, rule, config=cfg, max_ctas=4)[:4]
    dyd, xd = args[0], args[1]
    assert opts["KMAJOR"] is True
    # descriptors over dY^T [N, M] and X^T [K, M], tokens contiguous, [BN | BK, BMT] boxes
    assert list(dyd.shape) == [n, m] and list(dyd.strides) == [m, 1] and list(dyd.block_shape) == [cfg.bn, cfg.bmt]
    assert list(xd.shape) == [k, m] and list(xd.strides) == [m, 1] and list(xd.block_shape) == [cfg.bk, cfg.bmt]
    assert torch.equal(dyd.base, dy_t) and torch.equal(xd.base, x.t())
    assert dyd.base.is_contiguous() and xd.base.is_contiguous()
    # the bf16 launch of the same kernel family: no copies, KMAJOR off
    b_args, b_opts = wg._prepare(w, dy_t.bfloat16(), x.bfloat16(), st, hp, rule, config=wg.split_config(),
                                 max_ctas=4)[2:4]
    assert b_opts["KMAJOR"] is False and list(b_args[0].shape) == [m, n]
    # only the split kernel has the K-major loader
    with pytest.raises(ValueError, match="split"):
        wg._prepare(w, dy_t, x, st, hp, rule, config=wg.smem_config(), max_ctas=4)


def test_tf32_render_has_the_k_major_branch():
    src = wg._epi_source(RULES["adamw"], "split")
    assert "KMAJOR" in src and "instr_shape=[16, INK, 8]" in src   # INK: BK, or 128 for the coop tiles


def test_grouped_launch_refuses_fp32():
    rule = RULES["sgdm"]
    a, b = _make(rule, 256, 128, 96), _make(rule, 256, 128, 96, seed=2)
    why = gr.group_reason([a[0], b[0]], [a[1], b[1]], a[2], [a[3], b[3]], [a[4], b[4]], rule, check_device=False)
    assert why is not None and "fp32" in why


def test_launch_memo_kind_has_the_tf32_switch(monkeypatch):
    # FORGE_GLUON_TF32 flips between two kernels for the same tensors: it must be part of the memo's key
    monkeypatch.setattr(launch_memo, "ENABLED", [True])
    from forge_compile.kernels import wgrad_update_triton as wt

    keys = []

    def spy(key, states, hparams):
        keys.append(key)
        return True   # "hit": nothing launches

    monkeypatch.setattr(launch_memo, "lookup", spy)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    rule = RULES["sgdm"]
    w, dy_t, x, st, hp = _make(rule, 64, 64, 32)
    # the K-major copies are made before the lookup (their own launches memoized too): no copy runs here
    monkeypatch.setattr(wg, "kmajor_copies", lambda dy_t, x: (torch.empty(dy_t.shape), torch.empty(x.t().shape)))
    with _tf32(True):
        for v in ("1", "0"):
            monkeypatch.setenv(wg.TF32_ENV, v)
            wt.launch_wgrad_update(w, dy_t, x, st, hp, rule)
    assert len(keys) == 2 and keys[0] != keys[1]
    # with the switch on, the key has the copies' addresses (a remembered launch's descriptors address them)
    assert len(keys[0]) == 3 and keys[0][0][0][-1] is True and keys[1][0][-1] is False


# ---- sm_90 GPU ----------------------------------------------------------------------------------------------


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and wg.gluon_available()


sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU with triton.experimental.gluon")


def _check(rule, n, k, m, config=None, max_ctas=None, seed=1):
    w, dy_t, x, st, hp = _make(rule, n, k, m, "cuda", seed)
    grad = torch.full((n, k), float("nan"), device="cuda")   # poisoned: every element must be written
    with _tf32(True):
        assert wg.gluon_reason(w, dy_t, x, st, rule, grad) is None
        w_e, st_e = w.clone(), [s.clone() for s in st]
        wg.launch(w, dy_t, x, st, hp, rule, side_out=grad, max_ctas=max_ctas, config=config)
    torch.cuda.synchronize()
    assert not grad.isnan().any()
    ref = dy_t.double() @ x.double()
    rel = ((grad.double() - ref).norm() / ref.norm()).item()
    assert 1e-5 < rel < 5e-3, f"dW rel err {rel:.1e} (TF32: ~1e-3; <= 1e-5 would be an IEEE dot)"
    with torch.no_grad():
        rule.apply(w_e, grad, st_e, hp)
    assert torch.equal(w, w_e), f"W differs in {(w != w_e).sum().item()} of {w.numel()} elements"
    for s, e in zip(st, st_e):
        assert torch.equal(s, e), f"state differs in {(s != e).sum().item()} elements"


@sm90
@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("shape", [(1000, 776, 332), (512, 384, 1024), (256, 256, 8), (384, 512, 2052)],
                         ids=lambda s: "x".join(map(str, s)))
def test_tf32_exact(name, shape):
    # ragged N/K (tiles past the edge), M not a multiple of the 32-token stage (TMA zero-fills the last one), M = 8
    _check(RULES[name], *shape)


@sm90
@pytest.mark.parametrize("hoist", [False, True])
@pytest.mark.parametrize("max_ctas", [3, None])
def test_tf32_exact_many_tiles_per_cta(hoist, max_ctas):
    cfg = dataclasses.replace(wg.tf32_config(1024), hoist=hoist)
    _check(RULES["adamw"], 1024, 640, 1024, config=cfg, max_ctas=max_ctas)


@sm90
@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("shape", [(1000, 776, 332), (384, 512, 2052)], ids=lambda s: "x".join(map(str, s)))
def test_tf32_coop_exact(name, shape):
    # the coop split kernel (128x256 tiles, two MMA warpgroups; stop 30, prepared on CPU) on K-major fp32 copies:
    # 16-token stages; ragged N/K, M not a multiple of the stage
    _check(RULES[name], *shape, config=wg.coop_config(bmt=16), max_ctas=5)


@sm90
def test_tf32_op_path_takes_gluon_and_matches_reference(monkeypatch):
    # the op (what the compiled step calls) sends fp32 under TF32 to the Gluon kernel; IEEE stays on Triton
    monkeypatch.delenv(wg.TF32_ENV, raising=False)
    monkeypatch.setenv(wg.ENV, "auto")
    rule = RULES["adamw"]
    calls = []
    real = wg.launch
    monkeypatch.setattr(wg, "launch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    w, dy_t, x, st, hp = _make(rule, 1024, 512, 512, "cuda")
    for on, expect in ((True, 1), (False, 0)):
        calls.clear()
        w1, st1 = w.clone(), [s.clone() for s in st]
        w2, st2 = w.clone(), [s.clone() for s in st]
        with _tf32(on):
            torch.ops.forge.wgrad_update_(w1, dy_t, x, st1, hp, rule.name)
            reference_wgrad_update(w2, dy_t, x, st2, hp, rule.name)
        torch.cuda.synchronize()
        assert len(calls) == expect, on
        # the reference's dW is torch.mm's (cuBLAS TF32 under "high"): not the kernel's summation order, so the
        # two differ by TF32 rounding of dW (~1e-3 relative) times lr -- far below one AdamW step (lr = 1e-2)
        torch.testing.assert_close(w1, w2, rtol=0, atol=2e-4 if on else 2e-5)


@sm90
@pytest.mark.parametrize("junk", [False, True])
def test_tf32_launches_through_the_memo(monkeypatch, junk):
    # the K-major copies are made before the memo lookup and their addresses are part of the key: step after step
    # (new dY / X values in the same buffers, as a compiled step's) the copies land where they did and the
    # remembered launch runs; with other tensors taking the freed copies' blocks (junk) the copies land elsewhere,
    # the key differs and the full path runs -- right either way
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update

    monkeypatch.setattr(launch_memo, "ENABLED", [True])
    launch_memo.clear()
    rule = RULES["sgdm"]
    w, dy_t, x, st, hp = _make(rule, 512, 512, 256, "cuda", seed=3)
    w_e, st_e = w.clone(), [s.clone() for s in st]
    grad = torch.empty_like(w)
    keep = []
    with _tf32(True):
        for i in range(5):
            dy_t.copy_(torch.randn_like(dy_t))
            x.copy_(torch.randn_like(x))
            grad.fill_(float("nan"))   # poisoned: the launch must write every element of this step's dW
            launch_wgrad_update(w, dy_t, x, st, hp, rule, side_out=grad)
            if junk:
                keep.append(torch.randn(512 * 256 * 2, device="cuda"))   # takes the freed copies' blocks
            with torch.no_grad():
                rule.apply(w_e, grad, st_e, hp)
            ref = dy_t.double() @ x.double()
            assert ((grad.double() - ref).norm() / ref.norm()).item() < 5e-3, i
    torch.cuda.synchronize()
    assert torch.equal(w, w_e) and all(torch.equal(a, b) for a, b in zip(st, st_e))
    if not junk:   # two full launches (the entry is built at the second sighting), then hits
        assert launch_memo.counters["hit"] >= 3, dict(launch_memo.counters)


@sm90
def test_tf32_unused_copies_are_not_made_again(monkeypatch):
    # Gluon refuses the launch (here: forced) after the copies were made for it: the Triton kernel runs, and the
    # key is marked so that the next launches skip the copies
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update

    monkeypatch.setattr(launch_memo, "ENABLED", [True])
    launch_memo.clear()
    monkeypatch.setattr(wg, "gluon_reason", lambda *a, **k: "forced by the test")
    made = []
    real = wg.kmajor_copies
    monkeypatch.setattr(wg, "kmajor_copies", lambda *a: (made.append(1), real(*a))[1])
    rule = RULES["adamw"]
    w, dy_t, x, st, hp = _make(rule, 256, 256, 128, "cuda", seed=4)
    w_e, st_e = w.clone(), [s.clone() for s in st]
    grad = torch.empty_like(w)
    with _tf32(True):
        for _ in range(3):
            grad.fill_(float("nan"))
            launch_wgrad_update(w, dy_t, x, st, hp, rule, side_out=grad)
            with torch.no_grad():
                rule.apply(w_e, grad, st_e, hp)
    torch.cuda.synchronize()
    assert len(made) == 1
    assert torch.equal(w, w_e) and all(torch.equal(a, b) for a, b in zip(st, st_e))


def test_kcopies_wanted():
    # launch_wgrad_update makes the K-major copies before the memo lookup only where the Gluon TF32 path will read
    # them: both operands fp32, M % 4 == 0, one launch (an update in row slabs copies per slab)
    w, x = torch.empty(4096, 64, device="meta"), torch.empty(2048, 64, device="meta")
    dy_t = torch.empty(2048, 4096, device="meta").t()
    assert wg.kcopies_wanted(w, dy_t, x)
    assert not wg.kcopies_wanted(w, dy_t, torch.empty(2046, 64, device="meta"))
    assert not wg.kcopies_wanted(w, dy_t.bfloat16(), x.bfloat16())
    # a 128256-row lm_head: 1.05 GB of dY^T at 2048 tokens (one launch, under 1 GiB), 2.1 GB at 4096 (slabs)
    assert wg.kcopies_wanted(torch.empty(128256, 64, device="meta"), torch.empty(2048, 128256, device="meta").t(), x)
    assert not wg.kcopies_wanted(torch.empty(128256, 64, device="meta"),
                                 torch.empty(4096, 128256, device="meta").t(), torch.empty(4096, 64, device="meta"))


# ---- row slabs: the dY^T copy bounded (TF32_SLAB_BYTES) ------------------------------------------------------


def test_tf32_slabs_cover_the_rows(monkeypatch):
    monkeypatch.setattr(wg, "TF32_SLAB_BYTES", 128 * 32 * 4)
    x = torch.zeros(32, 64)
    assert wg.tf32_slabs(128, x) is None                     # one tile of rows fits: one launch
    assert wg.tf32_slabs(300, x) == [(0, 128), (128, 256), (256, 300)]
    monkeypatch.undo()
    # the 128256x4096 lm_head at 8192 tokens: 4.2 GB of dY^T, in 4 slabs of 32768 rows (1 GiB each)
    slabs = wg.tf32_slabs(128256, torch.empty(8192, 1, device="meta"))
    assert slabs[0] == (0, 32768) and slabs[-1] == (98304, 128256) and len(slabs) == 4
    assert wg.tf32_slabs(4096, torch.empty(8192, 1, device="meta")) is None   # 128 MB: one launch
    assert wg.tf32_slabs(32000, torch.empty(2048, 1, device="meta")) is None  # e2e preset's lm_head, 262 MB


@pytest.mark.parametrize("name", ["adamw", "sgdm"])
def test_tf32_slab_launches_update_every_row_once(fake_sm90, monkeypatch, name):
    # the slab loop's bookkeeping on CPU: the kernel launch replaced by the rule applied to the slab it was given
    # (dW from integer-valued operands: exact in fp32 whatever the summation order), so the whole update must equal
    # one update of the whole weight -- every row once, scalar states (AdamW's step) advanced once
    monkeypatch.setattr(wg, "TF32_SLAB_BYTES", 128 * 32 * 4)
    rule = RULES[name]
    gen = torch.Generator().manual_seed(0)
    w, _, _, st, hp = _make(rule, 300, 64, 32)
    dy_t = torch.randint(-3, 4, (32, 300), generator=gen).float().t()
    x = torch.randint(-3, 4, (32, 64), generator=gen).float()
    w_ref, st_ref = w.clone(), [s.clone() for s in st]
    with torch.no_grad():
        rule.apply(w_ref, dy_t @ x, st_ref, hp)
    real_prepare, seen = wg._prepare, []

    def fake_prepare(weight, dy_s, x_, states, hparams, rule_, side_out=None, **kw):
        kw["max_ctas"] = kw.get("max_ctas") or 4   # no GPU to count SMs on
        out = real_prepare(weight, dy_s, x_, states, hparams, rule_, side_out, **kw)
        assert kw.get("xk") is not None and torch.equal(out[2][1].base, x_.t())   # X^T made once, shared
        seen.append(weight.shape[0])

        class _K:
            def __getitem__(self, grid):
                def run(*a, **k):
                    full = [s.clone() if s.dim() == 0 else s for s in states]   # the kernel never advances them
                    with torch.no_grad():
                        rule_.apply(weight, dy_s @ x_, full, hparams)
                return run
        return (_K(),) + tuple(out[1:])

    monkeypatch.setattr(wg, "_prepare", fake_prepare)
    with _tf32(True):
        wg.launch(w, dy_t, x, st, hp, rule)
    assert seen == [128, 128, 44]
    assert torch.equal(w, w_ref)
    for a, b in zip(st, st_ref):
        assert torch.equal(a, b)


@sm90
@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_tf32_slabs_exact(monkeypatch, name):
    # several slabs on the GPU (a small slab budget): as exact as one launch, every row written
    monkeypatch.setattr(wg, "TF32_SLAB_BYTES", 256 * 1024 * 4)
    assert len(wg.tf32_slabs(1000, torch.empty(1024, 1))) == 4
    _check(RULES[name], 1000, 776, 1024)


@sm90
def test_tf32_compiled_step_memo_on_equals_off(monkeypatch):
    # a compiled train step (fp32 activations under TF32, every linear on the Gluon kernel) over several steps: with
    # the launch memo (copies made before the lookup, remembered launches from the second step on) bitwise the
    # same parameters as with the memo off (every launch on the full path)
    import copy

    import forge_compile as forge

    torch.manual_seed(0)
    model0 = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.GELU(),
                                 torch.nn.Linear(512, 256, bias=False)).cuda()
    data = [(torch.randn(4, 64, 256, device="cuda"), torch.randn(4, 64, 256, device="cuda")) for _ in range(5)]
    results = []
    for memo in (True, False):
        monkeypatch.setattr(launch_memo, "ENABLED", [memo])
        launch_memo.clear()
        model = copy.deepcopy(model0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        @forge.compile_train_step
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            return loss

        with _tf32(True):
            for x, y in data:
                step(x, y)
        torch.cuda.synchronize()
        assert len(step.last_report.fused) == 2
        if memo:
            assert launch_memo.counters["hit"] >= 2, dict(launch_memo.counters)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
