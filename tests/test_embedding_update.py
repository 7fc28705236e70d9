"""``forge::embedding_update_``: an embedding weight's update from its backward input, no dense gradient; and a tied
embedding / output weight: ``forge::wgrad_update_`` with the embedding's rows added to the matmul's dW (emb=).

Spec: ``reference_embedding_update`` (the dense gradient torch's autograd makes, then the rule). The compact rows are
bitwise the dense gradient's rows (torch's own kernel on renumbered indices), so every impl is held to the
reference bitwise: the CPU impl (the rule's CPU fast path or functional rule on gathered blocks), the Triton kernel
in the interpreter (whose epilogue rounds like torch's CPU kernels; eager sqrt correctly rounded as on CUDA), CUDA.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from forge_compile.kernels.embedding_update import (compact_rows, embedding_update, embedding_update_table,
                                                   reference_embedding_update)
from forge_compile.kernels.stochastic_round import element_key, round_key
from forge_compile.optim import rules as cat
from interpreter import run_child
from models import CorrectlyRoundedSqrt

aten = torch.ops.aten
ADAMW = cat.adamw_rule()
SGDM = cat.sgd_rule(momentum=True, weight_decay=True)
LION = cat.lion_rule()
RULES = [ADAMW, SGDM, LION]
_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9,
       "dampening": 0.0}


def _make(rule, v, k, shape, device="cpu", vocab_used=None, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=gen)
    states = [torch.tensor(3.0) if rule.is_scalar_state(i) else torch.rand(v, k, generator=gen) * 0.1
              for i in range(len(rule.states))]
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    idx = torch.randint(0, vocab_used or v, shape, generator=gen)
    go = (torch.randn(*shape, k, generator=gen) * 3).to(dtype)
    dev = lambda t: t.to(device)  # noqa: E731
    return dev(w), dev(go), dev(idx), [s if s.dim() == 0 else dev(s) for s in states], hp


def _check(rule, v, k, shape, padding_idx=-1, launch=None, device="cpu", exact_sqrt=False, **kw):
    w, go, idx, st, hp = _make(rule, v, k, shape, device, **kw)
    w_ref, st_ref = w.clone(), [s.clone() for s in st]
    (launch or embedding_update)(w, go, idx, st, hp, rule.name, padding_idx)
    with CorrectlyRoundedSqrt() if exact_sqrt else contextlib.nullcontext():
        reference_embedding_update(w_ref, go, idx, st_ref, hp, rule.name, padding_idx)
    assert torch.equal(w, w_ref), f"W differs in {(w != w_ref).sum().item()} of {w.numel()} elements"
    for a, b in zip(st, st_ref):
        assert torch.equal(a, b), f"a state differs in {(a != b).sum().item()} elements"


@pytest.mark.parametrize("padding_idx", [-1, 5])
@pytest.mark.parametrize("used", [None, 12], ids=["sparse", "repeated"])
def test_compact_rows_are_the_dense_rows(padding_idx, used):
    w, go, idx, _, _ = _make(ADAMW, 300, 24, (3, 41), vocab_used=used)
    dense = aten.embedding_dense_backward(go, idx, 300, padding_idx, False)
    rows, pos = compact_rows(go, idx, 300, padding_idx)
    assert rows.shape == (3 * 41, 24) and pos.shape == (300,) and pos.dtype == torch.int32
    rebuilt = torch.where((pos >= 0)[:, None], rows[pos.clamp(min=0).long()], torch.zeros(()))
    assert torch.equal(rebuilt, dense)
    if padding_idx >= 0:
        assert pos[padding_idx] == -1


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_cpu_impl_is_the_reference(rule, padding_idx, monkeypatch):
    from forge_compile.kernels import wgrad_update_cpu as cpu_impl

    # ragged 2-D blocks of the weight (16-row blocks split into 12-column pieces at 45 columns)
    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_BYTES", 4 * 200)
    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_MIN_ROWS", 16)
    _check(rule, 70, 45, (2, 9), padding_idx, vocab_used=20)
    _check(rule, 70, 45, (1, 1), padding_idx)


def test_bf16_grad_output_and_int32_indices():
    # a bf16 embedding output's gradient: the reference upcasts the dense bf16 gradient, the impl its rows
    w, go, idx, st, hp = _make(ADAMW, 50, 16, (4, 8), dtype=torch.bfloat16)
    w_ref, st_ref = w.clone(), [s.clone() for s in st]
    embedding_update(w, go, idx.int(), st, hp, ADAMW.name)
    reference_embedding_update(w_ref, go, idx, st_ref, hp, ADAMW.name)
    assert torch.equal(w, w_ref)


def test_checks_before_anything_is_written():
    w, go, idx, st, hp = _make(ADAMW, 20, 8, (2, 3))
    w0 = w.clone()
    with pytest.raises(ValueError, match="does not match"):
        embedding_update(w, go[:, :2], idx, st, hp, ADAMW.name)
    with pytest.raises(ValueError, match="indices"):
        embedding_update(w, go, idx.float(), st, hp, ADAMW.name)
    with pytest.raises(ValueError, match="states"):
        embedding_update(w, go, idx, st[:1], hp, ADAMW.name)
    assert torch.equal(w, w0)


def test_op_updates_in_place_and_bumps_versions():
    w, go, idx, st, hp = _make(ADAMW, 20, 8, (2, 3))
    w_ref, st_ref = w.clone(), [s.clone() for s in st]
    v = w._version
    torch.ops.forge.embedding_update_(w, go, idx, st, hp, ADAMW.name, -1)
    reference_embedding_update(w_ref, go, idx, st_ref, hp, ADAMW.name)
    assert w._version > v and torch.equal(w, w_ref)
    assert st[0].item() == 4.0      # the step advanced once


# ---- a tied weight: forge::wgrad_update_ with the embedding's contribution (emb=) -------------------------------

def _tied(rule, n, k, m, shape, device="cpu", seed=0, act=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w, go, idx, st, hp = _make(rule, n, k, shape, device, vocab_used=max(2, n // 3), seed=seed)
    dy_t = torch.randn(m, n, generator=gen).to(device, act).t()
    x = torch.randn(m, k, generator=gen).to(device, act)
    return w, dy_t, x, go, idx, st, hp


def _check_tied(rule, n, k, m, shape, padding_idx=-1, device="cpu", launch=None, exact_sqrt=False, dw_tol=1e-6,
                act=torch.float32, ekey=None):
    """The dW the op consumed (grad_out) is mm + the dense embedding gradient (fp32 rounding of the mm's other
    summation order), and W/states are the rule applied to that dW, bitwise. ``ekey``: a bf16 weight and bf16
    states (stochastic_rounding), the spec Rule.apply_rounded with that key."""
    from forge_compile.kernels.wgrad_update import wgrad_update

    w, dy_t, x, go, idx, st, hp = _tied(rule, n, k, m, shape, device, act=act)
    if ekey is not None:
        w = w.bfloat16()
        st = [s if rule.is_scalar_state(i) else s.bfloat16() for i, s in enumerate(st)]
    w_e, st_e = w.clone(), [s.clone() for s in st]
    grad = torch.full((n, k), float("nan"), device=device)
    kw = {} if ekey is None else {"ekey": ekey}
    (launch or (lambda *a, **kw: wgrad_update(*a, **kw)))(w, dy_t, x, st, hp, rule.name, grad_out=grad,
                                                        emb=(go, idx, padding_idx), **kw)
    ref = dy_t.double() @ x.double() + aten.embedding_dense_backward(go, idx, n, padding_idx, False).double()
    assert ((grad.double() - ref).norm() / ref.norm()).item() < dw_tol
    # the embedding's part exactly: the rows no token touched are the mm's alone
    dense = aten.embedding_dense_backward(go, idx, n, padding_idx, False)
    untouched = (dense == 0).all(1)
    # Two fp32 summation orders of M products: the difference is bounded by ~sqrt(M) * 2^-24 * (|dY|^T |X|) per
    # element (probabilistic GEMM error bound), x16 margin. A fixed 1e-4 failed at M = 2048 on the H100 (Gluon
    # kernel, stop 21: 62 of 571k elements, at most 2.0e-4 apart, where |dY|^T|X| ~ 1300) while W matched the rule
    # on the consumed dW bitwise. A misplaced embedding row adds O(1) (sums of N(0, 1) rows), >= 18x the bound.
    mm = (dy_t.float() @ x.float())[untouched]
    bound = 16 * m ** 0.5 * 2.0 ** -24 * (dy_t.abs().double() @ x.abs().double())[untouched] + 1e-6
    assert ((grad[untouched].double() - mm.double()).abs() <= bound).all(), \
        f"max |diff| {(grad[untouched] - mm).abs().max().item():.3e}, bound {bound.min().item():.3e} at least"
    with torch.no_grad(), CorrectlyRoundedSqrt() if exact_sqrt else contextlib.nullcontext():
        if ekey is None:
            rule.apply(w_e, grad, st_e, hp)
        else:
            rule.apply_rounded(w_e, grad, st_e, hp, ekey)
    assert torch.equal(w.view(torch.int16) if ekey else w, w_e.view(torch.int16) if ekey else w_e), \
        f"W differs in {(w != w_e).sum().item()} elements"
    for a, b in zip(st, st_e):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rule", [ADAMW, LION], ids=lambda r: r.name)
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_cpu_tied_update(rule, padding_idx, monkeypatch):
    from forge_compile.kernels import wgrad_update_cpu as cpu_impl

    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_BYTES", 4 * 200)
    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_MIN_ROWS", 16)
    _check_tied(rule, 67, 45, 13, (2, 9), padding_idx)


@pytest.mark.parametrize("rule", [ADAMW, LION], ids=lambda r: r.name)
def test_cpu_tied_rounded_update(rule, monkeypatch):
    # a tied bf16 embedding / output weight under stochastic_rounding (forge::wgrad_update_rounded_ with the rows):
    # the step failed on it before stop 39 ("the weight must be a contiguous float32 tensor")
    from forge_compile.kernels import wgrad_update_cpu as cpu_impl

    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_BYTES", 4 * 200)
    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_MIN_ROWS", 16)
    _check_tied(rule, 67, 45, 13, (2, 9), 3, ekey=element_key(round_key(2, 1), 4))


def test_interpreter_tied_rounded_update(interpret):
    # the Triton kernel with the rows, the key as an argument and -- a replayed step's launch -- from its table row
    from forge_compile.kernels.stochastic_round import TABLE_KEY, table_row
    from forge_compile.kernels.wgrad_update import _extra_rows
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update, rule_scalars, split_states

    ekey = element_key(round_key(2, 1), 4)
    for table in (False, True):
        def launch(w, dy_t, x, st, hp, rule_name, grad_out, emb, ekey):
            extra = _extra_rows(w, emb)
            if not table:
                launch_wgrad_update(w, dy_t, x, st, hp, ADAMW, side_out=grad_out, config="interp", extra=extra,
                                    ekey=ekey)
                return
            tensor_states, scalar_states = split_states(ADAMW, st)
            values, new = rule_scalars(ADAMW, scalar_states, hp, "interpret")
            launch_wgrad_update(w, dy_t, x, tensor_states, [], ADAMW, side_out=grad_out, config="interp",
                                extra=extra, table=table_row(values, ekey), ekey=TABLE_KEY)
            for s_, v in zip(scalar_states, new):
                s_.fill_(v)
        _check_tied(ADAMW, 67, 45, 13, (2, 9), 3, launch=launch, exact_sqrt=True, ekey=ekey)


def test_interpreter_tied_update(interpret):
    from forge_compile.kernels.wgrad_update_triton import CONFIGS, launch_wgrad_update
    from forge_compile.kernels.wgrad_update import _extra_rows

    for config in [c for c in CONFIGS if c.startswith("interp")]:
        def launch(w, dy_t, x, st, hp, rule_name, grad_out, emb):
            launch_wgrad_update(w, dy_t, x, st, hp, ADAMW, side_out=grad_out, config=config,
                                extra=_extra_rows(w, emb))
        _check_tied(ADAMW, 67, 45, 13, (2, 9), 3, launch=launch, exact_sqrt=True)


# ---- Triton kernel, interpreted ------------------------------------------------------------------------------

def test_interpreter_tests_in_subprocess():
    run_child(__file__)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_interpreter_kernel_is_the_reference(interpret, rule, padding_idx):
    # ragged in both dimensions against the kernel's [8, 256] programs; host scalars (a table row built per launch)
    _check(rule, 70, 300, (2, 9), padding_idx, vocab_used=20, exact_sqrt=True)


def test_interpreter_table_launch(interpret):
    from forge_compile.kernels.wgrad_update_triton import rule_scalars, split_states

    def launch(w, go, idx, st, hp, rule_name, padding_idx):
        tensor_states, scalar_states = split_states(ADAMW, st)
        values, new = rule_scalars(ADAMW, scalar_states, hp, "interpret")
        embedding_update_table(w, go, idx, tensor_states, torch.tensor(values), rule_name, padding_idx)
        for s, v in zip(scalar_states, new):
            s.fill_(v)
    _check(ADAMW, 70, 64, (3, 5), 2, launch=launch, exact_sqrt=True)


# ---- CUDA -----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_cuda_kernel_is_the_reference(rule):
    # the full preset's embedding shape at 2048 and 4096 tokens (torch's CUDA embedding backward takes its
    # per-feature kernel up to 3072 indices, the sort-based one above: the compact rows must be the dense rows
    # either way), and a ragged one with repeated tokens and a padding row
    _check(rule, 32000, 2048, (2, 1024), device="cuda")
    _check(rule, 32000, 2048, (4, 1024), device="cuda", vocab_used=3000)
    _check(rule, 1000, 776, (4, 333), padding_idx=7, device="cuda", vocab_used=50)


# ---- a bf16 embedding rounded stochastically (forge::embedding_update_rounded_) -------------------------------------

def _check_rounded(rule, v, k, shape, padding_idx=-1, device="cpu", state_dtype=torch.bfloat16, ekey=12345,
                   exact_sqrt=False, **kw):
    # bitwise reference_embedding_update(ekey=): the rule on fp32 values of the bf16 W and (bf16 or fp32) states and
    # the dense gradient, W rounded with the spec's bits, the states rounded to nearest
    w, go, idx, st, hp = _make(rule, v, k, shape, device, **kw)
    w = w.to(torch.bfloat16)
    st = [s if s.dim() == 0 else s.to(state_dtype) for s in st]
    w_ref, st_ref = w.clone(), [s.clone() for s in st]
    embedding_update(w, go, idx, st, hp, rule.name, padding_idx, ekey=ekey)
    with CorrectlyRoundedSqrt() if exact_sqrt else contextlib.nullcontext():
        reference_embedding_update(w_ref, go, idx, st_ref, hp, rule.name, padding_idx, ekey=ekey)
    assert torch.equal(w.view(torch.int16), w_ref.view(torch.int16)), \
        f"W differs in {(w != w_ref).sum().item()} of {w.numel()} elements"
    for a, b in zip(st, st_ref):
        assert torch.equal(a, b), f"a state differs in {(a != b).sum().item()} elements"
    return w


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16_states", "fp32_states"])
def test_cpu_rounded_impl_is_the_reference(rule, state_dtype, monkeypatch):
    from forge_compile.kernels import wgrad_update_cpu as cpu_impl

    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_BYTES", 4 * 200)     # ragged blocks: offsets must be global
    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_MIN_ROWS", 16)
    _check_rounded(rule, 70, 45, (2, 9), 3, state_dtype=state_dtype, vocab_used=20)


def test_rounded_keys_differ_and_checks():
    # another key, other bits (the spec's: this is what makes the rounding stochastic); a bf16 weight without a key
    # and an fp32 weight with one are refused before anything is written
    a = _check_rounded(ADAMW, 64, 32, (2, 9), ekey=1)
    b = _check_rounded(ADAMW, 64, 32, (2, 9), ekey=2)
    assert not torch.equal(a, b)
    w, go, idx, st, hp = _make(ADAMW, 64, 32, (2, 9))
    with pytest.raises(ValueError, match="bfloat16"):
        embedding_update(w, go, idx, st, hp, ADAMW.name, ekey=1)
    with pytest.raises(ValueError, match="float32"):
        embedding_update(w.to(torch.bfloat16), go, idx, st, hp, ADAMW.name)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16_states", "fp32_states"])
def test_interpreter_rounded_kernel_is_the_reference(interpret, rule, state_dtype):
    _check_rounded(rule, 70, 300, (2, 9), 3, state_dtype=state_dtype, vocab_used=20, exact_sqrt=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_cuda_rounded_kernel_is_the_reference(rule):
    for ekey in (0, 1, 16, 0x7FFFFFFF):     # values Triton would specialize on: the key is a run-time argument
        _check_rounded(rule, 1000, 776, (4, 333), padding_idx=7, device="cuda", vocab_used=50, ekey=ekey)
    _check_rounded(rule, 32000, 2048, (2, 1024), device="cuda")
    _check_rounded(rule, 32000, 2048, (2, 1024), device="cuda", state_dtype=torch.float32)


# ---- the step: compile_train_step fuses an embedding's update ----------------------------------------------------

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import forge_compile as forge  # noqa: E402
from models import TinyLM, rerun_recorder  # noqa: E402


class _PadLM(nn.Module):
    """An embedding with a padding row (its gradient stays zero) and SGD-momentum-friendly sizes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16, padding_idx=0)
        self.head = nn.Linear(16, 40, bias=False)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))


def _lm_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 40, (2, 8), generator=g), torch.randint(0, 40, (2, 8), generator=g))
            for _ in range(n)]


def _train(make_model, make_opt, batches, fused_embedding=True, monkeypatch=None, cuda_graphs=False):
    torch.manual_seed(0)
    m = make_model()
    opt = make_opt(m.parameters())
    if not fused_embedding:   # the same step with the embedding's update left to the normal path
        from forge_compile import capture
        real = capture.rewrite_wgrad_updates
        monkeypatch.setattr(capture, "rewrite_wgrad_updates",
                            lambda *a, **k: real(*a, **{**k, "embeddings": False}))

    @forge.compile_train_step(cuda_graphs=cuda_graphs)
    def step(idx, tgt):
        loss = F.cross_entropy(m(idx).flatten(0, 1), tgt.flatten())
        loss.backward(); opt.step(); opt.zero_grad()
        return loss
    losses = [step(x, y).item() for x, y in batches]
    return m, opt, losses, step.last_report


@pytest.mark.parametrize("make_model,make_opt", [
    (TinyLM, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    (lambda: TinyLM(tied=True), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    (_PadLM, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3))],
    ids=["adamw", "adamw_tied", "sgdm_padding"])
def test_step_fuses_the_embedding_and_matches_the_unfused_step(make_model, make_opt, monkeypatch):
    batches = _lm_batches(4)
    m, opt, losses, rep = _train(make_model, make_opt, batches)
    row = rep.row("m.emb.weight")
    assert row.fused and row.dw_bytes_saved == 40 * row.shape[1] * 4, str(rep)
    # the report says how (explain()'s reason column)
    assert row.reason.startswith("tied:" if m.head.weight is m.emb.weight else "embedding:"), str(rep)
    ref, ref_opt, ref_losses, ref_rep = _train(make_model, make_opt, batches, False, monkeypatch)
    assert not ref_rep.row("m.emb.weight").fused
    # the same gradient rows (bitwise) and the rule's math; the unfused path runs the rule through Inductor's
    # compiled element-wise code, which may round a few ops differently: a few ulps over 4 steps
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=n)
    if make_model is _PadLM:     # the padding row never moves: zero gradient, no weight decay... of a zero row
        assert torch.equal(m.emb.weight[0], torch.zeros(16))
    if m.head.weight is m.emb.weight:   # tied: one fused update (the head's mm + the embedding's rows)
        assert "head.weight" not in {r.name.split(".", 1)[1] for r in rep.rows}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_interpreter_replayed_step_updates_the_embedding_from_the_table(interpret, monkeypatch, tied):
    # the graphed step's table op (forge::embedding_update_table_), replayed (the recorder re-runs the step) vs the
    # same step with every capture failing (the table path run eagerly): bitwise
    from forge_compile import step_graph as sg

    def failing(fn, args):
        raise RuntimeError("no capture here")
    sg.GRAPH_DEVICE[0] = "cpu"
    out = []
    try:
        for recorder in (rerun_recorder, failing):
            sg.RECORDER[0] = recorder
            sg.counters.clear()
            m, opt, losses, rep = _train(lambda: TinyLM(tied=tied), lambda p: torch.optim.AdamW(p, lr=1e-2),
                                         _lm_batches(4), cuda_graphs=True)
            out.append((m, losses, dict(sg.counters), rep))
    finally:
        sg.GRAPH_DEVICE[0] = "cuda"
        sg.RECORDER[0] = sg.cuda_graph_recorder
    (m1, l1, c1, rep), (m2, l2, c2, _) = out
    assert c1.get("replays") == 2 and c2.get("capture_failed") == 1, (c1, c2, rep.notes)
    assert rep.row("m.emb.weight").fused
    assert l1 == l2
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule", [ADAMW, LION], ids=lambda r: r.name)
def test_cuda_tied_update(rule):
    # the Triton kernel (a launch with embedding rows skips Gluon, tuning and the launch memo); fp32 activations:
    # its IEEE dot sums in another order than fp64, 1e-5 relative
    _check_tied(rule, 1000, 776, 333, (4, 100), padding_idx=7, device="cuda", dw_tol=1e-5)
    _check_tied(rule, 4096, 1024, 2048, (2, 1024), device="cuda", dw_tol=1e-5)
    # a tied bf16 weight rounded stochastically (bf16 activations, as a bf16 model has)
    _check_tied(rule, 1000, 776, 333, (4, 100), padding_idx=7, device="cuda", dw_tol=1e-5, act=torch.bfloat16,
                ekey=element_key(round_key(2, 1), 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rule", [ADAMW, SGDM], ids=lambda r: r.name)
@pytest.mark.parametrize("m", [256, 2048])
def test_cuda_tied_update_gluon(rule, m, monkeypatch):
    # FORGE_GLUON_EXTRA=1: the Gluon smem (AdamW at M <= 512) / split kernel adds the rows where the dW chunk leaves
    # smem (bf16 activations, as Gluon takes them); the same checks as the Triton kernel's
    from forge_compile.kernels import wgrad_update_gluon as wg

    monkeypatch.setenv(wg.EXTRA_ENV, "1")
    w, dy_t, x, go, idx, st, hp = _tied(rule, 1024, 768, m, (2, 300), "cuda", act=torch.bfloat16)
    from forge_compile.kernels.wgrad_update import _extra_rows
    assert wg.gluon_reason(w, dy_t, x, st, rule, extra=_extra_rows(w, (go, idx, -1))) is None
    _check_tied(rule, 1024, 768, m, (2, 300), padding_idx=5, device="cuda", dw_tol=1e-5, act=torch.bfloat16)
    _check_tied(rule, 1000, 776, m, (2, 300), device="cuda", dw_tol=1e-5, act=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cuda_replayed_step_with_a_padding_row(tied):
    # a real CUDA graph of a step whose embedding has a padding row (its tokens in every batch): the compaction's
    # write of the padding row is captured (it was `pos[padding_idx] = -1`, a CPU scalar copy the capture refuses,
    # so such a step ran without a graph, correct but slower, with a logged warning); replayed vs not graphed
    from forge_compile import step_graph as sg

    torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    for graphs in (True, False):
        torch.manual_seed(0)
        m = TinyLM(tied=tied).cuda()
        m.emb.padding_idx = 0
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        @forge.compile_train_step(cuda_graphs=graphs)
        def step(idx, tgt):
            loss = F.cross_entropy(m(idx).flatten(0, 1), tgt.flatten())
            loss.backward(); opt.step(); opt.zero_grad()
            return loss
        sg.counters.clear()
        for x, y in _lm_batches(5):
            x[0, :2] = 0
            step(x.cuda(), y.cuda())
        out.append((m, dict(sg.counters), step.last_report))
    (m1, c1, rep), (m2, _, _) = out
    assert c1.get("replays", 0) >= 2 and not c1.get("capture_failed"), (c1, rep.notes)
    assert rep.row("m.emb.weight").fused, str(rep)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
