"""The scalar-table variant of the 8-bit-state update (kernels/wgrad_update_q8.py: forge::wgrad_update_q8_table_,
forge::apply_rule_q8_table_, forge::embedding_update_q8_table_), against the host-scalar ops.

The spec is the host op: given a row built by ``table_row`` from the SAME pre-update scalar states, hyper-parameters,
step key and salt the host op takes, the table op writes the weight, the codes and the scales bitwise as the host op
does -- on the fused kernel and on the blocked path, from a GEMM, from a stored gradient and from an embedding's
backward input -- and touches no scalar state (it has none: whoever fills the row advances them, as fill_table
does). A wrong row is refused before anything is written. On CUDA a captured graph replays the table op with new
rows and stays the host op's update, step after step. The host ops against their own spec: test_wgrad_update_q8.py.
"""
import pytest
import torch

from interpreter import run_child
from test_wgrad_update_q8 import _case, _to
from forge_compile.kernels import wgrad_update_q8 as wq
from forge_compile.kernels.epilogue_codegen import compile_epilogue
from forge_compile.kernels.stochastic_round import element_key, round_key
from forge_compile.kernels.wgrad_update_triton import rule_scalars
from forge_compile.optim import rules

SALT = 5
# the interpreter's shapes: ragged on purpose (40 rows: not a multiple of the 32-row tile; 300 columns: a short last
# 128-block), few programs per launch
SMALL = (40, 300, 64)
CUDA_SHAPE = (200, 520, 300)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _split(st):
    # _to()'s states: tensor states as [codes, scales] lists, scalar states as tensors
    pairs = [s for s in st if isinstance(s, list)]
    return [p[0] for p in pairs], [p[1] for p in pairs], [s for s in st if not isinstance(s, list)]


def _target(device) -> str:
    return "cuda" if device == "cuda" else "interpret"


def _inputs(op, kind, wdtype, device, shape):
    """The case's rule, weight, states, hparams and the op's own inputs: (dy_t, x) for a GEMM, the gradient (of a
    3-D parameter: its states' rows are as_rows') for a stored one, (grad_output, indices) for an embedding."""
    n, k, m = shape
    act = torch.bfloat16 if device == "cuda" else torch.float32
    rule, w, dy_t, x, states, hp = _case(kind, n, k, m, wdtype, act, device)
    gen = torch.Generator().manual_seed(7)
    if op == "stored_grad":
        w = w.view(n, 4, k // 4)
        extra = (torch.randn(w.shape, generator=gen).to(device) * 1e-2,)
    elif op == "embedding":
        indices = torch.randint(0, n, (m,), generator=gen).to(device)
        extra = (torch.randn(m, k, generator=gen).to(act).to(device), indices)
    elif op == "grad_kwarg":
        extra = (dy_t, x, torch.randn(n, k, generator=gen).to(device) * 1e-2)
    else:
        extra = (dy_t, x)
    return rule, w, states, hp, extra


def _host_op(op, rule, w, extra, codes, scales, scalars, hp, key):
    f = torch.ops.forge
    rk = torch.tensor(key)
    if op == "stored_grad":
        f.apply_rule_q8_(w, extra[0], codes, scales, scalars, hp, rule.name, rk, SALT)
    elif op == "embedding":
        f.embedding_update_q8_(w, *extra, codes, scales, scalars, hp, rule.name, rk, SALT, 3)
    elif op == "grad_kwarg":
        f.wgrad_update_q8_(w, *extra[:2], codes, scales, scalars, hp, rule.name, rk, SALT, grad=extra[2])
    else:
        f.wgrad_update_q8_(w, *extra, codes, scales, scalars, hp, rule.name, rk, SALT)


def _table_op(op, rule, w, extra, codes, scales, row, f=torch.ops.forge):
    if op == "stored_grad":
        # codes as the optimizer state's uint8 (optim/optimizer8bit.py): viewed as e4m3 by the op
        f.apply_rule_q8_table_(w, extra[0], [c.view(torch.uint8) for c in codes], scales, row, rule.name)
    elif op == "embedding":
        f.embedding_update_q8_table_(w, *extra, codes, scales, row, rule.name, 3)
    elif op == "grad_kwarg":
        f.wgrad_update_q8_table_(w, *extra[:2], codes, scales, row, rule.name, grad=extra[2])
    else:
        f.wgrad_update_q8_table_(w, *extra, codes, scales, row, rule.name)


def _assert_same(w_t, codes_t, scales_t, w_h, codes_h, scales_h, what):
    bits = torch.int16 if w_t.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(w_t.view(bits), w_h.view(bits)), f"{what}: W differs in {(w_t != w_h).sum().item()} elements"
    for i, (a, b) in enumerate(zip(codes_t, codes_h)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: codes of tensor state {i}"
    for i, (a, b) in enumerate(zip(scales_t, scales_h)):
        assert torch.equal(a, b), f"{what}: scales of tensor state {i}"


def _check_table_op_is_the_host_op(op, kind, wdtype, device, shape=SMALL, steps=2, width=0):
    rule, w, states, hp, extra = _inputs(op, kind, wdtype, device, shape)
    target = _target(device)
    w_h, st_h = w.clone(), _to(states, device)
    w_t, st_t = w.clone(), _to(states, device)
    codes_h, scales_h, scalars_h = _split(st_h)
    codes_t, scales_t, scalars_t = _split(st_t)
    for step in range(steps):
        key = round_key(3, step)
        row = wq.table_row(rule, scalars_t, hp, key, SALT, wdtype == torch.bfloat16, target, width).to(device)
        before = [float(s) for s in scalars_t]
        _host_op(op, rule, w_h, extra, codes_h, scales_h, scalars_h, hp, key)
        _table_op(op, rule, w_t, extra, codes_t, scales_t, row)
        # the table op has no scalar states: the row's filler advances them (fill_table), rule_scalars says where
        assert [float(s) for s in scalars_t] == before
        for s, v in zip(scalars_t, rule_scalars(rule, scalars_t, hp, target)[1]):
            s.fill_(v)
        assert [float(s) for s in scalars_t] == [float(s) for s in scalars_h]
        _assert_same(w_t, codes_t, scales_t, w_h, codes_h, scales_h, f"step {step}")
    assert not torch.equal(w_t, w), "the update changed nothing: the comparison proves nothing"


def _few_rows(monkeypatch, shape):
    # blocks of 7 rows (a short last one): the blocked path launches once per block with the block's OFF0
    monkeypatch.setattr(wq, "BLOCK_BYTES", 7 * shape[1] * 4)


# ---- CPU: the row, the source, the checks that need no launch -----------------------------------------------------

def test_row_layout():
    # scalars, then the weight's element key (0 for an fp32 weight), then each tensor state's key, as int32 bit
    # patterns; zeros up to the width asked for; the scalar states not advanced
    from forge_compile.kernels.q8_state import state_element_key

    rule = rules.adamw_rule()
    hp = [torch.tensor(v, dtype=torch.float64) for v in (1e-3, 0.9, 0.999, 1e-8, 0.01)]
    step = torch.tensor(10.0)
    key = round_key(3, 1)
    for target in ("cuda", "interpret"):
        n = compile_epilogue(rule, target).n_kernel_scalars
        assert wq.table_width(rule, target) == n + 1 + 2
        values = rule_scalars(rule, [step], hp, target)[0]
        for rounded in (False, True):
            row = wq.table_row(rule, [step], hp, key, SALT, rounded, target, width=n + 6)
            assert row.dtype == torch.float32 and row.shape == (n + 6,) and float(step) == 10.0
            assert row[:n].tolist() == [float(torch.tensor(v, dtype=torch.float32)) for v in values]
            keys = [element_key(key, SALT) if rounded else 0, state_element_key(key, SALT, 1),
                    state_element_key(key, SALT, 2)]
            assert row.view(torch.int32)[n:n + 3].tolist() == keys == wq.row_keys(rule, key, SALT, rounded)
            assert row[n + 3:].tolist() == [0.0] * 3
        assert wq.table_row(rule, [step], hp, key, SALT, False, target).numel() == wq.table_width(rule, target)
    with pytest.raises(TypeError, match="round key"):
        wq.row_keys(rule, None, SALT, False)


@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
def test_table_source_differs_only_in_how_per_step_values_arrive(kind):
    from test_wgrad_update_q8 import _rule

    ep = compile_epilogue(_rule(kind), "cuda")
    n, states = ep.n_kernel_scalars, [s.upper() for s in ep.tensor_inputs[2:]]
    plain, table = wq.render_kernel_source(ep), wq.render_kernel_source(ep, table=True)
    ptrs = "".join(f"{s}_C, {s}_S, " for s in states)
    scal = "".join(f"c{i}, " for i in range(n))
    keys = "EKEY, " + "".join(f"QKEY_{s}, " for s in states)
    assert f"W, DYT, X, G, {ptrs}{scal}{keys}N, K, M, NB, OFF0," in plain
    assert f"W, DYT, X, G, {ptrs}SCAL, N, K, M, NB, OFF0," in table
    assert "tl.load(SCAL" not in plain and 'do_not_specialize=["OFF0", "SCAL"]' in table
    loads = [f"    c{i} = tl.load(SCAL + {i})" for i in range(n)]
    loads += [f"    EKEY = tl.load(SCAL + {n}).to(tl.int32, bitcast=True)"]
    loads += [f"    QKEY_{s} = tl.load(SCAL + {n + 1 + j}).to(tl.int32, bitcast=True)" for j, s in enumerate(states)]
    assert "\n".join(loads) + "\n    tl.static_assert(" in table
    # everything after the kernel's argument loads is the same text
    tail = lambda src: src[src.index("    tl.static_assert((BLOCK_K"):]  # noqa: E731
    assert tail(plain) == tail(table)


def test_table_ops_are_not_cudagraph_unsafe():
    from forge_compile import _compat

    unsafe = set(_compat.cudagraph_unsafe_tags())
    for name in ("wgrad_update_q8_table_", "apply_rule_q8_table_", "embedding_update_q8_table_"):
        assert not unsafe & set(getattr(torch.ops.forge, name).default.tags), name
    if unsafe:
        assert unsafe <= set(torch.ops.forge.wgrad_update_q8_.default.tags)


def test_table_ops_refuse_cpu_tensors_off_triton(monkeypatch):
    monkeypatch.delenv("FORGE_TRITON_CPU", raising=False)
    rule, w, states, hp, (dy_t, x) = _inputs("gemm", "adamw", torch.float32, "cpu", (8, 128, 4))
    codes, scales, scalars = _split(_to(states, "cpu"))
    row = wq.table_row(rule, scalars, hp, 1, SALT, False, "interpret")
    with pytest.raises(RuntimeError, match="wgrad_update_q8_table_ runs on CUDA tensors"):
        torch.ops.forge.wgrad_update_q8_table_(w, dy_t, x, codes, scales, row, rule.name)
    with pytest.raises(RuntimeError, match="scalar table runs on CUDA tensors"):
        wq.wgrad_update_q8(w, dy_t, x, list(zip(codes, scales)), [], rule.name, table=row)


def test_table_ops_check_the_state_counts(monkeypatch):
    # refused before the row is read or anything launched (no interpreter needed to get there)
    monkeypatch.setenv("FORGE_TRITON_CPU", "1")
    rule, w, states, hp, (dy_t, x) = _inputs("gemm", "adamw", torch.float32, "cpu", (8, 128, 4))
    codes, scales, _ = _split(_to(states, "cpu"))
    row = torch.zeros(16)
    with pytest.raises(ValueError, match=r"takes 2 \(codes, scales\) pairs .*got 1 codes and 2 scales"):
        torch.ops.forge.wgrad_update_q8_table_(w, dy_t, x, codes[:1], scales, row, rule.name)
    with pytest.raises(ValueError, match="takes 2 .codes, scales. pairs"):
        torch.ops.forge.apply_rule_q8_table_(w, w.clone(), codes, scales[:1], row, rule.name)
    with pytest.raises(ValueError, match="with a scalar table takes its 2 tensor states"):
        wq.launch_wgrad_update_q8(w, dy_t, x, states, [], rule, table=row)


# ---- the interpreter ----------------------------------------------------------------------------------------------

def test_interpreter_tests_in_subprocess():
    pytest.importorskip("triton")
    run_child(__file__)


@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["fused", "blocked"])
def test_interpreter_gemm_table_op_is_the_host_op(interpret, monkeypatch, kind, wdtype, path):
    monkeypatch.setenv("FORGE_Q8_PATH", path)
    _few_rows(monkeypatch, SMALL)
    _check_table_op_is_the_host_op("gemm", kind, wdtype, "cpu")


@pytest.mark.parametrize("kind,wdtype", [("adamw", torch.bfloat16), ("sgdm", torch.float32),
                                         ("lion", torch.float32)], ids=["adamw-bf16", "sgdm-fp32", "lion-fp32"])
def test_interpreter_stored_grad_table_op_is_the_host_op(interpret, kind, wdtype):
    # forge::apply_rule_q8_table_ on a 3-D parameter (its states' rows are as_rows'): the FROM_GRAD kernel
    _check_table_op_is_the_host_op("stored_grad", kind, wdtype, "cpu")


def test_interpreter_gemm_table_op_with_a_stored_grad(interpret):
    # forge::wgrad_update_q8_table_(grad=...): the FROM_GRAD kernel, dy_t and x unused
    _check_table_op_is_the_host_op("grad_kwarg", "sgdm", torch.bfloat16, "cpu")


@pytest.mark.parametrize("kind,wdtype", [("adamw", torch.bfloat16), ("lion", torch.float32)],
                         ids=["adamw-bf16", "lion-fp32"])
def test_interpreter_embedding_table_op_is_the_host_op(interpret, monkeypatch, kind, wdtype):
    _few_rows(monkeypatch, SMALL)
    _check_table_op_is_the_host_op("embedding", kind, wdtype, "cpu")


@pytest.mark.parametrize("path", ["fused", "blocked"])
def test_interpreter_a_wider_row_works(interpret, monkeypatch, path):
    # a table shared by several rules is as wide as the widest: the words after this rule's are not read
    monkeypatch.setenv("FORGE_Q8_PATH", path)
    _few_rows(monkeypatch, SMALL)
    _check_table_op_is_the_host_op("gemm", "adamw", torch.bfloat16, "cpu", steps=1, width=40)


def _check_bad_rows_are_refused(device, other_device, monkeypatch):
    shape = SMALL if device == "cpu" else CUDA_SHAPE
    _few_rows(monkeypatch, shape)
    for op, path in (("gemm", "fused"), ("gemm", "blocked"), ("stored_grad", "fused"), ("embedding", "blocked")):
        monkeypatch.setenv("FORGE_Q8_PATH", path)
        rule, w, states, hp, extra = _inputs(op, "adamw", torch.bfloat16, device, shape)
        codes, scales, scalars = _split(_to(states, device))
        w0, codes0, scales0 = w.clone(), [c.clone() for c in codes], [s.clone() for s in scales]
        good = wq.table_row(rule, scalars, hp, 1, SALT, True, _target(device)).to(device)
        bad = {"fp64": good.double(), "short": good[:-1], "2-D": good.view(1, -1),
               "strided": torch.stack([good, good], 1).view(-1)[::2], "device": good.to(other_device)}
        for why, row in bad.items():
            # a meta row would send the op to its fake impl (the dispatcher picks the meta kernel): the impl itself
            f = wq if row.device.type == "meta" else torch.ops.forge
            try:
                _table_op(op, rule, w, extra, codes, scales, row, f)
            except ValueError as e:
                assert "fp32 scalars, the weight's key and 2 state keys" in str(e), (op, path, why, e)
            else:
                pytest.fail(f"{op} ({path}) took a {why} row")
            _assert_same(w, codes, scales, w0, codes0, scales0, f"{op} ({path}) with a {why} row")


def test_interpreter_bad_rows_are_refused_before_anything_is_written(interpret, monkeypatch):
    _check_bad_rows_are_refused("cpu", "meta", monkeypatch)


# ---- CUDA twins ---------------------------------------------------------------------------------------------------

@CUDA
@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["fused", "blocked", "gluon"])
def test_cuda_gemm_table_op_is_the_host_op(monkeypatch, kind, wdtype, path):
    monkeypatch.setenv("FORGE_Q8_PATH", path)
    monkeypatch.setattr(wq, "BLOCK_BYTES", 64 * CUDA_SHAPE[1] * 4)
    _check_table_op_is_the_host_op("gemm", kind, wdtype, "cuda", CUDA_SHAPE, steps=3)


@CUDA
@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ["stored_grad", "grad_kwarg", "embedding"])
def test_cuda_unfused_table_ops_are_the_host_ops(monkeypatch, kind, wdtype, op):
    monkeypatch.setattr(wq, "BLOCK_BYTES", 64 * CUDA_SHAPE[1] * 4)
    _check_table_op_is_the_host_op(op, kind, wdtype, "cuda", CUDA_SHAPE, steps=3)


@CUDA
def test_cuda_a_wider_row_works(monkeypatch):
    monkeypatch.setenv("FORGE_Q8_PATH", "blocked")
    _check_table_op_is_the_host_op("gemm", "adamw", torch.bfloat16, "cuda", CUDA_SHAPE, width=64)


@CUDA
def test_cuda_bad_rows_are_refused_before_anything_is_written(monkeypatch):
    _check_bad_rows_are_refused("cuda", "cpu", monkeypatch)


@CUDA
@pytest.mark.parametrize("op,path", [("gemm", "fused"), ("gemm", "blocked"), ("gemm", "gluon"),
                                     ("stored_grad", "fused"), ("embedding", "blocked")])
def test_cuda_graph_replays_the_table_op_with_new_rows(monkeypatch, op, path):
    # the point of the table: one capture, then every step is a replay after the row was rewritten -- bitwise the
    # host op step after step (new step counter, new keys), the scalar states advanced by the row's filler
    monkeypatch.setenv("FORGE_Q8_PATH", path)
    monkeypatch.setattr(wq, "BLOCK_BYTES", 64 * CUDA_SHAPE[1] * 4)
    rule, w, states, hp, extra = _inputs(op, "adamw", torch.bfloat16, "cuda", CUDA_SHAPE)
    w_h, st_h = w.clone(), _to(states, "cuda")
    w_t, st_t = w.clone(), _to(states, "cuda")
    codes_h, scales_h, scalars_h = _split(st_h)
    codes_t, scales_t, scalars_t = _split(st_t)
    row = torch.zeros(wq.table_width(rule, "cuda") + 3, device="cuda")
    graph = torch.cuda.CUDAGraph()
    for step in range(5):
        key = round_key(3, step)
        row.copy_(wq.table_row(rule, scalars_t, hp, key, SALT, True, "cuda", row.numel()))
        _host_op(op, rule, w_h, extra, codes_h, scales_h, scalars_h, hp, key)
        if step == 0:
            # eager: compiles the kernel (a capture cannot) and is itself a step
            _table_op(op, rule, w_t, extra, codes_t, scales_t, row)
        else:
            if step == 1:
                with torch.cuda.graph(graph):
                    _table_op(op, rule, w_t, extra, codes_t, scales_t, row)
            graph.replay()
        for s, v in zip(scalars_t, rule_scalars(rule, scalars_t, hp, "cuda")[1]):
            s.fill_(v)
        torch.cuda.synchronize()
        _assert_same(w_t, codes_t, scales_t, w_h, codes_h, scales_h, f"step {step}")
    assert [float(s) for s in scalars_t] == [float(s) for s in scalars_h] == [15.0]
