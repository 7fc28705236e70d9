"""Stochastic rounding of bf16 weights: the spec (kernels/stochastic_round.py), and the fused update of a bf16 weight
(forge::wgrad_update_ with round_key) on the CPU path, in Triton's interpreter and on CUDA, each against the spec.

Bitwise where provable: the kernel stores the fp32 dW it consumed (grad_out) and the spec (reference_update) applied
to that dW with the same key must give the same bf16 weight and states -- the rule's fp32 arithmetic is bitwise
eager torch's (tests/test_wgrad_update_triton.py) and the random bits are a hash of (key, element index).
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

from interpreter import run_child
from models import CorrectlyRoundedSqrt
from forge_compile.kernels.stochastic_round import (TABLE_KEY, element_key, random_bits, round_key,
                                                   stochastic_round_bf16, table_row)
from forge_compile.kernels.wgrad_update import reference_update, reference_wgrad_update, wgrad_update
from forge_compile.optim import rules
from forge_compile.optim.rule import get_rule

HAS_CUDA = torch.cuda.is_available()


def _neighbours(x):
    # the two bf16 values around each fp32 x, as fp32 (truncation toward zero, and one bf16 ulp further out)
    b = x.view(torch.int32) & ~0xFFFF
    return b.view(torch.float32), (b + 0x10000).view(torch.float32)


# ---- the spec ------------------------------------------------------------------------------------------------

def test_rounds_to_one_of_the_two_neighbours_and_exact_values_stay():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 7
    y = stochastic_round_bf16(x, element_key(round_key(0, 1), 0)).float()
    lo, hi = _neighbours(x)
    assert ((y == lo) | (y == hi)).all()
    both = (y == lo).float().mean().item()
    assert 0.3 < both < 0.7          # not a deterministic rounding (either way about half the time at random x)
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(stochastic_round_bf16(exact, 12345).float(), exact)


def test_unbiased_where_round_to_nearest_loses_the_update():
    # 1 + 2**-10 is a quarter ulp above 1 in bf16: round to nearest gives 1 every time, SR 1 + 2**-7 a quarter of
    # the time, so the mean over many elements and keys is 1 + 2**-10 (binomial std ~6e-6 here)
    v = torch.full((65536,), 1.0 + 2 ** -10)
    assert torch.equal(v.to(torch.bfloat16).float(), torch.ones_like(v))
    mean = torch.stack([stochastic_round_bf16(v, element_key(round_key(3, c), 7)).float() for c in range(8)]).mean()
    assert abs(mean.item() - (1 + 2 ** -10)) < 4e-5
    neg = stochastic_round_bf16(-v, element_key(round_key(3, 0), 7)).float().mean()
    assert abs(neg.item() + (1 + 2 ** -10)) < 1e-4     # sign symmetric


def test_special_values_and_keys():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0e38])
    y = stochastic_round_bf16(x, element_key(round_key(0, 0), 0))
    assert y[0].isnan() and y[1] == float("inf") and y[2] == -float("inf")
    assert torch.equal(y[3:5].float().view(torch.int32), x[3:5].view(torch.int32))   # signed zeros kept
    idx = torch.arange(4096)
    a, b = random_bits(idx, element_key(round_key(0, 0), 0)), random_bits(idx, element_key(round_key(0, 1), 0))
    c = random_bits(idx, element_key(round_key(0, 0), 1))
    assert (a != b).float().mean() > 0.99 and (a != c).float().mean() > 0.99   # per step and per parameter
    assert a.min() >= 0 and a.max() < 1 << 16
    # the bits are near uniform: each of 16 buckets holds 1/16 of 4096 draws (+- 5 std)
    counts = torch.bincount(a >> 12, minlength=16).float()
    assert (counts - 256).abs().max() < 5 * 15.5


def test_round_key_is_a_function_of_seed_and_counter_only():
    assert round_key(5, 9) == round_key(5, 9)
    assert len({round_key(s, c) for s in range(4) for c in range(64)}) == 256
    assert all(0 <= element_key(round_key(0, c), s) < 2 ** 31 for c in range(16) for s in range(16))


def test_traced_and_compiled_bits_equal_eager():
    # the unfused path traces the spec into the step's graph, which Inductor compiles: same bits
    x = torch.randn(33, 65, generator=torch.Generator().manual_seed(1))
    key = torch.tensor(element_key(round_key(11, 2), 4), dtype=torch.int64)
    eager = stochastic_round_bf16(x, key)
    compiled = torch.compile(stochastic_round_bf16, backend="inductor", fullgraph=True)(x, key)
    assert torch.equal(compiled.view(torch.int16), eager.view(torch.int16))


# ---- the fused update of a bf16 weight -----------------------------------------------------------------------

def _case(rule_name, n, k, m, device, state_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.5).to(torch.bfloat16)
    rule = get_rule(rule_name)
    states = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            states.append(torch.tensor(float(2 + seed), dtype=torch.float32))
        else:
            states.append((torch.rand(n, k, generator=g) * 0.01).to(state_dtype).to(device))
    dy = torch.randn(m, n, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return w.to(device), dy.to(device).t(), x.to(device), states, rule


ADAMW = rules.adamw_rule().name
SGDM = rules.sgd_rule(momentum=True).name


def _hparams(rule):
    vals = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, momentum=0.9, dampening=0.0)
    return [torch.tensor(vals[h], dtype=torch.float64) for h in rule.hparams]


def _table_launch(w, dy_t, x, states, hp, rule, grad, ekey, config=None, gconfig=None, max_ctas=None):
    # the launch a replayed CUDA graph makes: scalars AND the key from one device row (stochastic_round.table_row),
    # ekey=TABLE_KEY; the scalar states advanced by the caller, as the step's fill_table does
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update, rule_scalars, split_states

    tensor_states, scalar_states = split_states(rule, states)
    values, new = rule_scalars(rule, scalar_states, hp, "cuda" if w.is_cuda else "interpret")
    row = table_row(values, ekey, width=len(values) + 3).to(w.device)
    if gconfig is not None:
        from forge_compile.kernels import wgrad_update_gluon as wg

        assert wg.gluon_reason(w, dy_t, x, tensor_states, rule, grad, table=row, ekey=TABLE_KEY) is None
        wg.launch(w, dy_t, x, tensor_states, [], rule, side_out=grad, config=gconfig, max_ctas=max_ctas, table=row,
                  ekey=TABLE_KEY)
    else:
        launch_wgrad_update(w, dy_t, x, tensor_states, [], rule, side_out=grad, config=config, table=row,
                            ekey=TABLE_KEY)
    for s, v in zip(scalar_states, new):
        s.fill_(v)


def _check_exact(rule_name, n, k, m, device, state_dtype, config=None, gconfig=None, max_ctas=None, ekey=None,
                 table=False):
    # config: a Triton config (launch_wgrad_update); gconfig: a Gluon config (wgrad_update_gluon.launch); table: the
    # key and scalars from a table row (_table_launch)
    w, dy_t, x, states, rule = _case(rule_name, n, k, m, device, state_dtype)
    hp = _hparams(rule)
    w0 = w.clone()
    w_e, st_e = w.clone(), [s.clone() for s in states]
    ekey = element_key(round_key(0, 3), 5) if ekey is None else ekey
    grad = torch.full((n, k), float("nan"), device=device)
    if table:
        _table_launch(w, dy_t, x, states, hp, rule, grad, ekey, config, gconfig, max_ctas)
    elif gconfig is not None:
        from forge_compile.kernels import wgrad_update_gluon as wg

        assert wg.gluon_reason(w, dy_t, x, states, rule, grad, ekey=ekey) is None
        wg.launch(w, dy_t, x, states, hp, rule, side_out=grad, config=gconfig, max_ctas=max_ctas, ekey=ekey)
    elif config is None:
        wgrad_update(w, dy_t, x, states, hp, rule.name, grad_out=grad, ekey=ekey)
    else:
        from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update

        launch_wgrad_update(w, dy_t, x, states, hp, rule, side_out=grad, config=config, ekey=ekey)
    assert not grad.isnan().any()
    ref = dy_t.double() @ x.double()
    assert ((grad.double() - ref).norm() / ref.norm()).item() < 1e-5
    with (CorrectlyRoundedSqrt() if device == "cpu" else contextlib.nullcontext()):
        reference_update(w_e, grad, st_e, hp, rule.name, ekey)
    assert w.dtype == torch.bfloat16 and all(s.dtype == e.dtype for s, e in zip(states, st_e))
    assert torch.equal(w.view(torch.int16), w_e.view(torch.int16)), \
        f"W differs in {(w.view(torch.int16) != w_e.view(torch.int16)).sum().item()} of {w.numel()} elements"
    for s, e in zip(states, st_e):
        assert torch.equal(s, e), f"state differs in {(s != e).sum().item()} elements"
    assert (w != w0).float().mean() > 0.1      # the update did something


STATE_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("rule_name", [ADAMW, SGDM], ids=["adamw", "sgdm"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(67, 45, 31), (128, 64, 96)], ids=lambda s: "x".join(map(str, s)))
def test_cpu_path_exact(rule_name, state_dtype, shape):
    _check_exact(rule_name, *shape, "cpu", state_dtype)


def test_cpu_path_blocks_use_their_element_indices():
    # a weight larger than one CPU block (kernels/wgrad_update_cpu.py): block-local indices would repeat the bits
    from forge_compile.kernels.wgrad_update_cpu import cpu_block_shape

    n, k = 1100, 1024
    assert cpu_block_shape(n, k)[0] < n
    _check_exact(SGDM, n, k, 8, "cpu", torch.bfloat16)


def test_fp32_weight_with_key_and_bf16_weight_without_refused():
    w, dy_t, x, states, rule = _case(SGDM, 8, 8, 4, "cpu", torch.float32)
    with pytest.raises(ValueError, match="stochastically rounded"):
        wgrad_update(w, dy_t, x, states, _hparams(rule), rule.name)
    with pytest.raises(ValueError, match="fp32 weights take no key"):
        wgrad_update(w.float(), dy_t, x, states, _hparams(rule), rule.name, ekey=1)


def test_reference_against_torch_optim_in_fp32_then_rounded():
    # the spec is torch.optim's update on fp32 copies of the weight and states, then the weight rounded: two
    # independent computations of the same fp32 value must round identically (same key, same element)
    w, dy_t, x, states, rule = _case(ADAMW, 40, 24, 16, "cpu", torch.float32)
    p = torch.nn.Parameter(w.float().clone())
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, foreach=False)
    p.grad = dy_t.float() @ x.float()
    opt.step()       # step 1 of torch.optim: the rule's step state starts at 0 there
    st = [torch.tensor(0.0), torch.zeros(40, 24), torch.zeros(40, 24)]
    ekey = element_key(round_key(1, 1), 0)
    with CorrectlyRoundedSqrt():
        reference_wgrad_update(w, dy_t, x, st, _hparams(rule), rule.name, ekey=ekey)
    assert torch.equal(w.view(torch.int16), stochastic_round_bf16(p.detach(), ekey).view(torch.int16))


# ---- Triton's interpreter ---------------------------------------------------------------------------------------

def test_interpreter_tests_in_subprocess():
    pytest.importorskip("triton")
    run_child(__file__)


@pytest.mark.parametrize("config", ["interp", "interp_e2", "interp_e4", "interp_pf", "interp_tma", "interp_p1e2",
                                    "interp_p2e4"])
@pytest.mark.parametrize("rule_name", [ADAMW, SGDM], ids=["adamw", "sgdm"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
def test_interpreter_kernel_exact(interpret, config, rule_name, state_dtype):
    shape = (67, 45, 31) if config in ("interp", "interp_pf", "interp_tma") else (64, 128, 64)
    _check_exact(rule_name, *shape, "cpu", state_dtype, config=config)


# ---- the key in a scalar-table row: launches a CUDA graph can capture (stochastic_round.TABLE_KEY) ---------------

def test_table_row_keeps_every_key_bit():
    # keys whose bits are NaN, infinity-adjacent or denormal patterns as fp32: the row keeps the int32 pattern
    for ekey in (0, 1, 12345, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, element_key(round_key(0, 3), 5)):
        row = table_row([0.5, 3.0, 1e-8], ekey, width=6)
        assert row.dtype == torch.float32 and row.shape == (6,)
        assert row[:3].tolist() == [0.5, 3.0, torch.tensor(1e-8).item()]
        assert row.view(torch.int32)[3].item() == ekey and row[4:].eq(0).all()
    assert table_row([2.0]).tolist() == [2.0] and table_row([], 7).view(torch.int32).tolist() == [7]


def test_fill_table_writes_each_rounded_rows_key_after_its_scalars():
    # the runtime's whole-table write (before every replay) against table_row, row by row: rules of different widths,
    # rounded rows (NaN-pattern key included) beside unrounded ones; the scalar states advanced as rule_scalars says
    from forge_compile.passes.scalar_table import fill_table, table_width
    from forge_compile.kernels.wgrad_update_triton import rule_scalars, split_states

    adamw, sgdm = get_rule(ADAMW), get_rule(SGDM)
    items, want = [], []
    for i, (rule, ekey) in enumerate([(adamw, 0x7FFFFFFF), (sgdm, None), (sgdm, 5), (adamw, None)]):
        states = [torch.tensor(float(i + 1)) if rule.is_scalar_state(j) else torch.zeros(3)
                  for j in range(len(rule.states))]
        values, new = rule_scalars(rule, [s.clone() for s in split_states(rule, states)[1]], _hparams(rule),
                                   "interpret")
        want.append((values, ekey, new, states))
        items.append((rule, states, _hparams(rule)) + (() if ekey is None and i == 3 else (ekey,)))
    width = table_width({adamw, sgdm}, {adamw, sgdm})
    table = torch.full((4, width), float("nan"))
    fill_table(table, items)
    for r, (values, ekey, new, states) in enumerate(want):
        assert torch.equal(table[r].view(torch.int32), table_row(values, ekey, width).view(torch.int32)), r
        rule = items[r][0]
        assert [s.item() for s in split_states(rule, states)[1]] == [float(v) for v in new]


def test_interpreter_table_key_refused_without_a_table(interpret):
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update

    w, dy_t, x, states, rule = _case(ADAMW, 64, 32, 16, "cpu", torch.bfloat16)
    w0 = w.clone()
    with pytest.raises(ValueError):
        launch_wgrad_update(w, dy_t, x, states, _hparams(rule), rule, ekey=TABLE_KEY)
    assert torch.equal(w, w0)


def test_triton_table_source_reads_the_key_from_the_row():
    from forge_compile.kernels.epilogue_codegen import compile_epilogue
    from forge_compile.kernels.wgrad_update_triton import render_kernel_source

    ep = compile_epilogue(get_rule(ADAMW), "cuda")
    src = render_kernel_source(ep, table=True)
    assert f"    if TKEY:\n        EKEY = tl.load(SCAL + {ep.n_kernel_scalars}).to(tl.int32, bitcast=True)\n" in src
    assert "TKEY" not in render_kernel_source(ep).split("def wgrad_update_kernel(")[1].split("):")[1]


@pytest.mark.parametrize("config", ["interp", "interp_e2", "interp_pf"])
@pytest.mark.parametrize("rule_name", [ADAMW, SGDM], ids=["adamw", "sgdm"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
def test_interpreter_table_key_exact(interpret, config, rule_name, state_dtype):
    shape = (67, 45, 31) if config != "interp_e2" else (64, 128, 64)
    for ekey in (0x7FFFFFFF, 16):
        _check_exact(rule_name, *shape, "cpu", state_dtype, config=config, ekey=ekey, table=True)


# ---- CUDA --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("rule_name", [ADAMW, SGDM], ids=["adamw", "sgdm"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(67, 45, 31), (1024, 512, 256), (4096, 4096, 1024)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_cuda_kernel_exact(rule_name, state_dtype, shape, kernel, monkeypatch):
    # auto: the Gluon smem/split kernel on sm_90 where N, K are multiples of 8 (67x45 goes to Triton either way)
    monkeypatch.setenv("FORGE_WGRAD_KERNEL", kernel)
    _check_exact(rule_name, *shape, "cuda", state_dtype)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("rule_name", [ADAMW, SGDM], ids=["adamw", "sgdm"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_cuda_table_key_exact(rule_name, state_dtype, kernel, monkeypatch):
    # the key from the row (what a replayed step's launch reads): auto takes the Gluon kernel's table variant on sm_90
    monkeypatch.setenv("FORGE_WGRAD_KERNEL", kernel)
    for shape in [(67, 45, 31), (1024, 512, 256)]:
        for ekey in (0x7FFFFFFF, 16):
            _check_exact(rule_name, *shape, "cuda", state_dtype, ekey=ekey, table=True)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_cuda_graph_replays_a_rounded_launch_with_each_key(kernel, monkeypatch):
    # one rounded launch captured once, replayed three times with a new key (and step) written into its row between
    # replays: each replay bitwise the spec with its own key -- a captured key would round every replay alike
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update, rule_scalars, split_states

    monkeypatch.setenv("FORGE_WGRAD_KERNEL", kernel)
    w, dy_t, x, states, rule = _case(ADAMW, 1024, 512, 256, "cuda", torch.bfloat16)
    hp = _hparams(rule)
    tensor_states, scalar_states = split_states(rule, states)
    grad = torch.empty(1024, 512, device="cuda")
    row = torch.zeros(16, device="cuda")

    def fill(ekey):
        values, new = rule_scalars(rule, scalar_states, hp, "cuda")
        row.copy_(table_row(values, ekey, 16).cuda())
        return new

    def launch(w_, st_, g_):
        launch_wgrad_update(w_, dy_t, x, st_, [], rule, side_out=g_, table=row, ekey=TABLE_KEY)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):       # warm-up (compiles) on copies, outside the capture
        fill(1)
        launch(w.clone(), [t.clone() for t in tensor_states], grad.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(w, tensor_states, grad)
    for step in range(3):
        ekey = element_key(round_key(1, step), 2)
        w_e, st_e = w.clone(), [t.clone() for t in states]
        new = fill(ekey)
        graph.replay()
        for t, v in zip(scalar_states, new):
            t.fill_(v)
        reference_update(w_e, grad, st_e, hp, rule.name, ekey)
        assert torch.equal(w.view(torch.int16), w_e.view(torch.int16)), \
            f"replay {step}: W differs in {(w.view(torch.int16) != w_e.view(torch.int16)).sum().item()} elements"
        assert all(torch.equal(t, e) for t, e in zip(states, st_e)), step


# ---- the Gluon kernel (sm_90): the smem and split epilogues round a bf16 weight ------------------------------------

LION = rules.lion_rule().name


def _gluon():
    from forge_compile.kernels import wgrad_update_gluon as wg

    return wg


@pytest.fixture
def fake_sm90(monkeypatch):
    """CPU tensors judged as if on an sm_90 GPU with gluon present (the selection logic only)."""
    wg = _gluon()
    monkeypatch.setattr(wg, "_device_ok", lambda dev: True)
    monkeypatch.setattr(wg, "gluon_available", lambda: True)
    monkeypatch.setenv(wg.ENV, "gluon")


@pytest.mark.parametrize("epi", ["smem", "split"])
def test_gluon_render_rounded(epi):
    import ast

    from forge_compile.kernels.epilogue_codegen import compile_epilogue

    wg = _gluon()
    ep = compile_epilogue(get_rule(ADAMW), "cuda")
    plain, rounded = wg.render_gluon_source(ep, epi), wg.render_gluon_source(ep, epi, rounded=4)
    ast.parse(rounded)
    # off, the module carries nothing of it
    assert "EKEY" not in plain and "_sround_bits" not in plain and "_as_elem" not in plain
    # the key is a kernel argument never specialized, after the rule's scalars; the W store rounds (one store
    # helper, called from both chunk steps); both states go through _as_elem; W and the states are converted
    # to fp32 where the chunk's math starts
    assert '@gluon.jit(do_not_specialize=["EKEY"])\ndef wgrad_update_gluon_kernel(' in rounded
    assert re.search(r"def wgrad_update_gluon_kernel\([^)]*\bEKEY, M, N, K,", rounded)
    assert rounded.count("_sround_bits(new_p, offs, EKEY)") == 1
    assert rounded.count("_as_elem(s1_ptr, new_s1)") == 1 and rounded.count("_as_elem(s2_ptr, new_s2)") == 1
    assert rounded.count("p = p.to(gl.float32)") == 2
    # load widths: 4 elements per thread (fp32's layout, GPU-run) or 8 (16-byte bf16 vectors); fp32 keeps 4
    assert "gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])" in plain and \
        "gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])" in rounded
    assert "gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])" in wg.render_gluon_source(ep, epi, rounded=8)
    with pytest.raises(ValueError):
        wg.render_gluon_source(ep, epi, rounded=2)
    for bad in (dict(epi="tma"), dict(epi="vec"), dict(epi=epi, extra=True)):
        with pytest.raises(wg.GluonUnsupported):
            wg.render_gluon_source(ep, rounded=4, **bad)
    # with a scalar table the key is no argument: loaded from the row's word after the rule's scalars
    tabled = wg.render_gluon_source(ep, epi, table=True, rounded=8)
    ast.parse(tabled)
    n = ep.n_kernel_scalars
    assert "do_not_specialize" not in tabled
    assert re.search(r"def wgrad_update_gluon_kernel\([^)]*\bscal_ptr, M, N, K,", tabled)
    assert tabled.count(f"EKEY = gl.load(scal_ptr + {n}).to(gl.int32, bitcast=True)") == 1
    assert tabled.count("_sround_bits(new_p, offs, EKEY)") == 1


def test_gluon_bits_spelled_as_the_triton_ones():
    # the Gluon spelling of the hash is the Triton one's with literal multipliers: same constants, same steps
    from forge_compile.kernels.stochastic_round import GLUON_SROUND, TRITON_SROUND

    for c in ("0x7FEB352D", "0x846CA68B", "0xFFFF0000", ">> 16", ">> 15"):
        assert c in GLUON_SROUND and c in TRITON_SROUND


def test_gluon_rounded_selection(fake_sm90):
    from forge_compile.kernels.wgrad_update_triton import SIDE_GRAD, SIDE_NONE

    wg = _gluon()
    rule = get_rule(ADAMW)
    w, dy_t, x, st, _ = _case(ADAMW, 256, 128, 96, "cpu", torch.bfloat16)
    ekey = element_key(7, 1)
    assert wg.gluon_reason(w, dy_t, x, st, rule, ekey=ekey) is None
    assert wg.gluon_reason(w, dy_t, x, [s.float() for s in st], rule, ekey=ekey) is None
    assert wg.gluon_reason(w, dy_t, x, st, rule, torch.empty(256, 128), ekey=ekey) is None
    # a bf16 weight without a key, an fp32 weight with one, a 16-bit side output, fp32 activations, a table, rows
    assert wg.gluon_reason(w, dy_t, x, st, rule) is not None
    assert "bf16 weight" in wg.gluon_reason(w.float(), dy_t, x, st, rule, ekey=ekey)
    assert wg.gluon_reason(w, dy_t, x, st, rule, torch.empty(256, 128, dtype=torch.bfloat16), ekey=ekey)
    assert "fp32 activations" in wg.gluon_reason(w, dy_t.float(), x.float(), st, rule, ekey=ekey)
    # a table row (a replayed step's launch): the key is the row's (TABLE_KEY), the same kernels
    assert wg.gluon_reason(w, dy_t, x, st[1:], rule, table=torch.zeros(8), ekey=TABLE_KEY) is None
    rows = (torch.zeros(96, 128), torch.full((256,), -1, dtype=torch.int32))
    assert "tied" in wg.gluon_reason(w, dy_t, x, st, rule, extra=rows, ekey=ekey)
    # the pick: the smem or split kernel at every M, rule size and side output, no L2 prefetch
    for m in (64, 256, 512, 1024, 2048, 4096, 8192):
        for n_load in (1, 2, 3):
            for mode in (SIDE_NONE, SIDE_GRAD):
                cfg = wg.pick_for(m, n_load, 2, mode, rounded=True)
                assert cfg.epi in ("smem", "split") and cfg.l2pf == 0, (m, n_load, cfg)
    # the measured picks (RESULTS.md "Gluon run 2"): smem one chunk ahead hoisted up to 1024 tokens, split hoisted to
    # 2048, split 16 rows two ahead hoisted to 4096, the plain split kernel above
    assert [(c.epi, c.ahead, c.hoist) for c in (wg.pick_for(m, 3, 2, SIDE_GRAD, rounded=True)
                                                 for m in (256, 1024, 2048, 4096, 8192))] == [
        ("smem", 1, True), ("smem", 1, True), ("split", 4, True), ("split", 2, True), ("split", 4, False)]
    # a rounded kernel that failed to build sends rounded launches alone to Triton
    wg._BROKEN[wg._broken_key(rule, True)] = "test"
    try:
        assert wg.gluon_reason(w, dy_t, x, st, rule, ekey=ekey) == "test"
        wf, dyf, xf, stf, _ = _case(ADAMW, 256, 128, 96, "cpu", torch.float32)
        assert wg.gluon_reason(wf.float(), dyf, xf, stf, rule) is None
    finally:
        wg._BROKEN.pop(wg._broken_key(rule, True))


def _sm90() -> bool:
    if not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0):
        return False
    return _gluon().gluon_available()


sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU with triton.experimental.gluon")


# both load widths of the rounded kernels (wgrad_update_gluon.SR_ROW_VEC: 8 the default, 4 stop 36's), indirect
ROW_VECS = pytest.mark.parametrize("row_vec", [4, 8], ids=["v4", "v8"], indirect=True)


@pytest.fixture
def row_vec(request, monkeypatch):
    monkeypatch.setattr(_gluon(), "SR_ROW_VEC", request.param)
    return request.param


@sm90
@pytest.mark.parametrize("layout", ["smem", "smem_a1h", "split", "split_hoist", "split_r16a2h"])
@pytest.mark.parametrize("rule_name", [ADAMW, SGDM, LION], ids=["adamw", "sgdm", "lion"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@ROW_VECS
def test_gluon_kernel_exact_ragged(layout, rule_name, state_dtype, row_vec):
    # N, K not multiples of the 128 tile, M not one of the 64-token stage; several tiles per CTA
    wg = _gluon()
    # every config _pick_rounded takes (smem_a1h, split_hoist, split_r16a2h, split) and the smem default
    cfg = {"smem": wg.smem_config(), "smem_a1h": wg.smem_config(ahead=1, hoist=True), "split": wg.split_config(),
           "split_hoist": wg.split_config(hoist=True),
           "split_r16a2h": wg.split_config(rows=16, ahead=2, hoist=True)}[layout]
    _check_exact(rule_name, 1000, 776, 333, "cuda", state_dtype, gconfig=cfg, max_ctas=5)


@sm90
@pytest.mark.parametrize("layout", ["smem_a1h", "split_hoist", "split"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=str)
@ROW_VECS
def test_gluon_table_key_exact(layout, state_dtype, row_vec):
    # the Gluon kernels' table variant: the scalars and the key from the row (scalar_fields(key=True))
    wg = _gluon()
    cfg = {"smem_a1h": wg.smem_config(ahead=1, hoist=True), "split_hoist": wg.split_config(hoist=True),
           "split": wg.split_config()}[layout]
    for ekey in (0x7FFFFFFF, 1):
        _check_exact(ADAMW, 1000, 776, 333, "cuda", state_dtype, gconfig=cfg, max_ctas=5, ekey=ekey, table=True)


@sm90
@pytest.mark.parametrize("m", [256, 2048, 4096, 8192])
@ROW_VECS
def test_gluon_kernel_exact_full_layer(m, row_vec):
    # each of _pick_rounded's four picks on a 4096x4096 layer
    from forge_compile.kernels.wgrad_update_triton import SIDE_GRAD

    cfg = _gluon().pick_for(m, 3, 2, SIDE_GRAD, rounded=True)
    _check_exact(ADAMW, 4096, 4096, m, "cuda", torch.bfloat16, gconfig=cfg)


@sm90
@pytest.mark.parametrize("ekey", [0, 1, 16, 0x7FFFFFFF])
@ROW_VECS
def test_gluon_kernel_keys_never_specialized(ekey, row_vec):
    # 1 and multiples of 16 are values triton specializes on by default: each must still be a run-time key
    _check_exact(SGDM, 512, 256, 128, "cuda", torch.bfloat16, gconfig=_gluon().split_config(), ekey=ekey)


@sm90
def test_gluon_rounded_launch_remembered_with_a_new_key_each_step(monkeypatch):
    # with SR_MEMO the op's repeated launches on the same buffers take launch_memo's fast path, the key passed at
    # each; every step bitwise the spec with its own key (a stale key would round step 3 like step 2)
    from forge_compile.kernels import launch_memo as lm
    from forge_compile.kernels import wgrad_update_triton as wt

    monkeypatch.setattr(wt, "SR_MEMO", [True])
    lm.clear()
    w, dy_t, x, states, rule = _case(ADAMW, 512, 256, 128, "cuda", torch.bfloat16)
    hp = _hparams(rule)
    grad = torch.empty(512, 256, device="cuda")
    hits = lm.counters["hit"]
    for step in range(4):
        ekey = element_key(round_key(3, step), 1)
        w_e, st_e = w.clone(), [s.clone() for s in states]
        wgrad_update(w, dy_t, x, states, hp, rule.name, grad_out=grad, ekey=ekey)
        reference_update(w_e, grad, st_e, hp, rule.name, ekey)
        assert torch.equal(w.view(torch.int16), w_e.view(torch.int16)), step
        assert all(torch.equal(s, e) for s, e in zip(states, st_e)), step
    assert lm.counters["hit"] - hits >= 2


@sm90
def test_op_path_takes_gluon_for_rounded_weights(monkeypatch):
    # wgrad_update (the op's CUDA launch) on a bf16 weight with a key reaches the Gluon kernel under auto
    wg = _gluon()
    seen = []
    real = wg.launch

    def spy(*a, **k):
        seen.append(k.get("ekey"))
        return real(*a, **k)

    monkeypatch.setattr(wg, "launch", spy)
    monkeypatch.setenv(wg.ENV, "auto")
    _check_exact(ADAMW, 1024, 512, 256, "cuda", torch.bfloat16)
    assert seen == [element_key(round_key(0, 3), 5)]
