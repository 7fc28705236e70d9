"""kernels/wgrad_update_q8_gluon.py, the 8-bit update on the Gluon split kernel, against its spec
(wgrad_update_q8.reference_wgrad_update_q8): bitwise on an sm_90 GPU, with exact dW (test_wgrad_update_q8's cases:
small-integer activations, so the kernel's GEMM and torch's matmul give the same fp32 dW and everything after it --
dequantization, the rule, the stochastic quantization, the weight's rounding -- must match bit for bit).

On CPU (CI): the module renders for every catalogue rule, the dispatch never takes it off sm_90, and the report's
dW accounting follows the dispatch. The kernel runs only on the GPU (Gluon has no interpreter)."""
import ast

import pytest
import torch

from interpreter import run_child
from test_wgrad_update_q8 import _assert_bitwise, _case, _to
from forge_compile.kernels import wgrad_update_q8 as wq
from forge_compile.kernels import wgrad_update_q8_gluon as qg
from forge_compile.kernels.epilogue_codegen import compile_epilogue
from forge_compile.kernels.stochastic_round import round_key
from forge_compile.kernels.wgrad_update_q8 import reference_wgrad_update_q8
from forge_compile.optim import rules


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


SM90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (H100/H200)")
# ragged on purpose: N not a multiple of the 128-row tile, K = 4 blocks + 8 columns (a short last block), M not a
# multiple of the 64-token GEMM stage (TMA zero-fills it)
SHAPE = (200, 520, 300)


RULES = {"adamw": rules.adamw_rule, "adam_amsgrad": lambda: rules.adam_rule(amsgrad=True),
         "sgd_momentum": lambda: rules.sgd_rule(momentum=True), "lion": rules.lion_rule, "adagrad": rules.adagrad_rule,
         "rmsprop_centered": lambda: rules.rmsprop_rule(centered=True, momentum=True)}


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("table", [False, True])
def test_the_module_renders_for_catalogue_rules(name, table):
    # the text Gluon compiles: valid Python, one (codes, scales) pointer pair and one key per tensor state, the rule
    # called on the dequantized states, the fp32 split kernel's MMA partition unchanged
    from forge_compile.kernels.wgrad_update_gluon import _SPLIT_MMA

    rule = RULES[name]()
    ep = compile_epilogue(rule, "cuda")
    src = qg.render_q8_gluon_source(ep, table)
    ast.parse(src)
    states = ep.tensor_inputs[2:]
    for s in states:
        assert f"{s.upper()}_c, {s.upper()}_s, " in src and f"QKEY_{s.upper()}" in src
        assert f"{s} = {s}_c.to(gl.float32) * {s}_s[:, None]" in src
    assert src.endswith(_SPLIT_MMA)
    # the keys (host) and the row pointer (table) are never specialized: new keys / rows must not compile again
    assert ('do_not_specialize=["scal_ptr"]' in src) == table and ('do_not_specialize=["EKEY"' in src) != table
    if table:   # the keys from the row, after the rule's scalars
        assert f"EKEY = gl.load(scal_ptr + {ep.n_kernel_scalars})" in src


def test_off_sm90_nothing_takes_it(monkeypatch):
    # CPU tensors (and any non-sm_90 device): q8_gluon_reason says why, the dispatch keeps its other paths even
    # when forced, and the compile-time report expects a dW block where the blocked path runs
    monkeypatch.setenv("FORGE_Q8_PATH", "gluon")
    rule, w, dy_t, x, states, hp = _case("adamw", *SHAPE, torch.float32, torch.bfloat16, "cpu")
    pairs = wq.check_q8_states(w, rule, states)[0]
    assert qg.q8_gluon_reason(w, dy_t, x, pairs, rule) == "not an sm_90 CUDA device"
    assert not wq.take_gluon(w, dy_t, x, states, rule)
    assert not qg.expects_gluon("cpu", 4096, 4096, torch.bfloat16, rule)
    with pytest.raises(ValueError, match="Gluon 8-bit kernel cannot take this launch: not an sm_90"):
        wq.launch_wgrad_update_q8(w, dy_t, x, _to(states, "cpu"), hp, rule, key=1, salt=2, gluon=True)
    assert wq.dw_block_bytes(4096, 4096, rule, 2048, "cuda") == 2048 * 4096 * 4
    assert wq.dw_block_bytes(4096, 4096, rule, 2048, "cuda", gluon=True) == 0


def test_interpreter_tests_in_subprocess():
    pytest.importorskip("triton")
    run_child(__file__)


def test_interpreter_a_failed_gluon_launch_falls_back_and_stays_the_spec(interpret, monkeypatch):
    # the dispatch tries the Gluon kernel: a launch it refuses (here: off sm_90) runs on the other paths and marks
    # nothing; a kernel that fails to build marks its rule, and the update still runs -- nothing was written before
    # the failure, so every result is the spec's -- and the next update does not try again
    from models import CorrectlyRoundedSqrt

    monkeypatch.setattr(qg, "_WHY_NOT", {})
    monkeypatch.setattr(wq, "gluon_wanted", lambda w: True)
    qg.counters.clear()
    rule, w, dy_t, x, states, hp = _case("adamw", 40, 200, 50, torch.float32, torch.float32, "cpu")
    w_ref, st_ref = w.clone(), _to(states, "cpu")
    w_k, st_k = w.clone(), _to(states, "cpu")

    def step(i):
        key = round_key(3, i)
        wq.wgrad_update_q8(w_k, dy_t, x, st_k, hp, rule.name, key=key, salt=5)
        # the spec with a correctly rounded sqrt, as the kernels' (torch's CPU sqrt is not)
        with CorrectlyRoundedSqrt():
            reference_wgrad_update_q8(w_ref, dy_t, x, st_ref, hp, rule.name, key, salt=5)

    step(0)
    assert not qg.counters["broken"] and not qg.counters["taken"] and not qg._WHY_NOT, dict(qg.counters)

    def build_fails(*a, **k):
        raise RuntimeError("no Gluon here")

    monkeypatch.setattr(qg, "q8_gluon_reason", lambda *a, **k: qg._why_not(rule))
    monkeypatch.setattr(qg, "prepare", build_fails)
    step(1)
    step(2)
    _assert_bitwise(rule, w_k, st_k, w_ref, st_ref, 3)
    assert qg.counters["broken"] == 1 and not qg.counters["taken"], dict(qg.counters)
    assert "Gluon 8-bit kernel failed: RuntimeError: no Gluon here" in qg._WHY_NOT[rule.name]


def _check_gluon_is_the_spec(kind, wdtype, steps=2, shape=SHAPE, config=None, max_ctas=None, table=False):
    rule, w, dy_t, x, states, hp = _case(kind, *shape, wdtype, torch.bfloat16, "cuda")
    w_ref, st_ref = w.clone(), _to(states, "cuda")
    w_k, st_k = w.clone(), _to(states, "cuda")
    for step in range(steps):
        key = round_key(3, step)
        if table:
            scalars = [s for s in st_k if not isinstance(s, list)]
            row = wq.table_row(rule, scalars, hp, key, 5, wdtype == torch.bfloat16).cuda()
            wq.launch_wgrad_update_q8(w_k, dy_t, x, [s for s in st_k if isinstance(s, list)], [], rule, table=row,
                                      gluon=True, config=config, max_ctas=max_ctas)
            for s in scalars:   # the row's filler advances the scalar states (as scalar_table does)
                s += 1
        else:
            wq.launch_wgrad_update_q8(w_k, dy_t, x, st_k, hp, rule, key=key, salt=5, gluon=True, config=config,
                                      max_ctas=max_ctas)
        reference_wgrad_update_q8(w_ref, dy_t, x, st_ref, hp, rule.name, key, salt=5)
    torch.cuda.synchronize()
    _assert_bitwise(rule, w_k, st_k, w_ref, st_ref, steps)


@SM90
@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_gluon_q8_is_the_spec(kind, wdtype):
    _check_gluon_is_the_spec(kind, wdtype)


@SM90
@pytest.mark.parametrize("ahead", [2, 3, 4])
def test_cuda_gluon_q8_is_the_spec_with_several_tiles_per_cta(ahead):
    # 3 CTAs for 2 x 5 tiles: the lookahead crosses from a tile into the CTA's next one, the dW tile is handed over
    # several times
    _check_gluon_is_the_spec("adamw", torch.float32, config=qg.q8_config(ahead=ahead), max_ctas=3)


@SM90
@pytest.mark.parametrize("kind", ["adamw", "lion"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_gluon_q8_table_launch_is_the_spec(kind, wdtype):
    # the scalar-table variant (what a CUDA graph captures): scalars and keys read from the row
    _check_gluon_is_the_spec(kind, wdtype, steps=3, table=True)


@SM90
def test_cuda_gluon_q8_is_the_spec_on_a_model_shape():
    # 1024 x 2048 at 512 tokens: whole tiles, every SM busy, rows of 16 blocks
    _check_gluon_is_the_spec("adamw", torch.float32, shape=(1024, 2048, 512))


@SM90
@pytest.mark.parametrize("kind", ["adamw", "lion"])
def test_cuda_the_dispatch_takes_it_through_the_launch_memo_and_stays_the_spec(monkeypatch, kind):
    # FORGE_Q8_PATH=gluon: wgrad_update_q8 (what the ops call) takes the Gluon kernel; from the third step on the
    # launch goes through launch_memo with the step's keys spliced in, bitwise the spec every step
    from forge_compile.kernels import launch_memo as lm

    monkeypatch.setenv("FORGE_Q8_PATH", "gluon")
    monkeypatch.setattr(lm, "ENABLED", [True])
    lm.clear()
    qg.counters.clear()
    rule, w, dy_t, x, states, hp = _case(kind, *SHAPE, torch.float32, torch.bfloat16, "cuda")
    w_ref, st_ref = w.clone(), _to(states, "cuda")
    w_k, st_k = w.clone(), _to(states, "cuda")
    steps = 5
    for step in range(steps):
        key = round_key(3, step)
        wq.wgrad_update_q8(w_k, dy_t, x, st_k, hp, rule.name, key=key, salt=5)
        reference_wgrad_update_q8(w_ref, dy_t, x, st_ref, hp, rule.name, key, salt=5)
        torch.cuda.synchronize()
        _assert_bitwise(rule, w_k, st_k, w_ref, st_ref, step + 1)
    assert qg.counters["taken"] == steps and not qg.counters["broken"], dict(qg.counters)
    assert lm.counters["built"] == 1 and lm.counters["hit"] == steps - 2, (dict(lm.counters), lm.LAST_ERROR[0])
    lm.clear()
