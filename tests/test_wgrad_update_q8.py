"""kernels/wgrad_update_q8.py, the fused update with 8-bit block-wise states, against its spec
(reference_wgrad_update_q8 = q8_state.reference_q8_update on dW): bitwise, on the Triton interpreter and on CUDA.

dW is made exact (small integers times powers of two in the activations, so every product and partial sum is exact
in fp32 whatever the summation order): the kernel's GEMM and torch's matmul then give the same dW, and everything
after it -- dequantization, the rule, the stochastic quantization, the weight's rounding -- must match bit for bit.
The spec itself against torch.optim: tests/test_q8_state.py."""
import contextlib

import pytest
import torch

from interpreter import run_child
from models import CorrectlyRoundedSqrt
from forge_compile.kernels import q8_state as q8
from forge_compile.kernels.stochastic_round import round_key
from forge_compile.optim import rules

HP = {"adamw": (1e-3, 0.9, 0.999, 1e-8, 0.01), "sgdm": (1e-3, 0.9, 0.0), "lion": (1e-4, 0.9, 0.99, 0.01)}


def _rule(kind):
    return {"adamw": rules.adamw_rule, "sgdm": lambda: rules.sgd_rule(momentum=True), "lion": rules.lion_rule}[kind]()


def _exact_act(shape, gen, dtype, device):
    # integers in [-4, 4] times 2^-3: exact in bf16, every dot product of up to 2^16 of them exact in fp32
    return (torch.randint(-4, 5, shape, generator=gen).float() / 8).to(dtype).to(device)


def _case(kind, n, k, m, wdtype, act, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rule = _rule(kind)
    w = torch.randn(n, k, generator=gen).to(wdtype)
    states = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            states.append(torch.tensor(10.0))
        else:
            # states spanning octaves (v's blocks hold values far below their absmax) and a block of zeros
            v = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-12, -2, (n, k), generator=gen).float())
            if name == "exp_avg_sq":
                v = v.abs()
            v[0, :min(k, 128)] = 0.0
            states.append(list(q8.quantize(v, i + 100)))
    dy = _exact_act((m, n), gen, act, device)
    x = _exact_act((m, k), gen, act, device)
    hp = [torch.tensor(v, dtype=torch.float64) for v in HP[kind]]
    return rule, w.to(device), dy.t(), x, states, hp


def _to(states, device):
    # copies: tensor states as [codes, scales] lists (the spec replaces their items), scalar states as tensors
    return [[st[0].to(device, copy=True), st[1].to(device, copy=True)] if isinstance(st, list) else st.clone()
            for st in states]


def _check_kernel_is_the_spec(kind, n, k, m, wdtype, act, device, config=None, from_grad=False, steps=2, cpu_path=False,
                              blocked=False):
    from forge_compile.kernels.wgrad_update_q8 import launch_wgrad_update_q8, reference_wgrad_update_q8
    from forge_compile.kernels.wgrad_update_q8 import wgrad_update_q8_blocked, wgrad_update_q8_cpu

    rule, w, dy_t, x, states, hp = _case(kind, n, k, m, wdtype, act, "cpu")
    # the spec runs on the kernel's device: the CUDA epilogue is CUDA eager's arithmetic (epilogue_codegen), and
    # on CPU torch's fp32 sqrt is not correctly rounded while the kernels' is (models.CorrectlyRoundedSqrt)
    dy_t, x = dy_t.to(device), x.to(device)
    w_ref, st_ref = w.to(device, copy=True), _to(states, device)
    w_k, st_k = w.to(device, copy=True), _to(states, device)
    for step in range(steps):
        key = round_key(3, step)
        with CorrectlyRoundedSqrt() if device == "cpu" else contextlib.nullcontext():
            g = reference_wgrad_update_q8(w_ref, dy_t, x, st_ref, hp, rule.name, key, salt=5)
            if cpu_path:
                wgrad_update_q8_cpu(w_k, dy_t, x, st_k, hp, rule, key=key, salt=5, grad=g if from_grad else None)
        if blocked:
            wgrad_update_q8_blocked(w_k, dy_t, x, st_k, hp, rule, key=key, salt=5)
        elif not cpu_path:
            launch_wgrad_update_q8(w_k, dy_t, x, st_k, hp, rule, key=key, salt=5, grad=g if from_grad else None,
                                   config=config)
    _assert_bitwise(rule, w_k, st_k, w_ref, st_ref, steps)


def _assert_bitwise(rule, w_k, st_k, w_ref, st_ref, steps):
    bits = torch.int16 if w_k.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(w_k.view(bits), w_ref.view(bits)), f"W differs in {(w_k != w_ref).sum().item()} elements"
    for i, (a, b) in enumerate(zip(st_k, st_ref)):
        if rule.is_scalar_state(i):
            assert float(a) == float(b) == 10.0 + steps
            continue
        assert torch.equal(a[1], b[1]), f"scales of {rule.states[i]}"
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)), f"codes of {rule.states[i]}"


def test_interpreter_tests_in_subprocess():
    pytest.importorskip("triton")
    run_child(__file__)


# ragged shapes on purpose: N not a multiple of the tile's rows, K not of 128 (a short last block), M not of BLOCK_M
@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
def test_interpreter_fused_q8_is_the_spec(interpret, kind):
    _check_kernel_is_the_spec(kind, 40, 200, 50, torch.float32, torch.float32, "cpu")


def test_interpreter_fused_q8_split_epilogue_and_bf16_weight(interpret):
    _check_kernel_is_the_spec("adamw", 24, 384, 32, torch.bfloat16, torch.float32, "cpu", config="interp_e2")


def test_interpreter_q8_update_of_a_stored_grad(interpret):
    _check_kernel_is_the_spec("adamw", 33, 256, 16, torch.float32, torch.float32, "cpu", from_grad=True)


@pytest.mark.parametrize("kind", ["adamw", "sgdm"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreter_blocked_path_is_the_spec(interpret, monkeypatch, kind, wdtype):
    # dW by matmul one block of rows at a time, each block's stored-dW update with its rows' element indices (OFF0):
    # blocks of 7 rows of 40 (a short last one), the bits of every element the spec's
    from forge_compile.kernels import wgrad_update_q8 as wq

    monkeypatch.setattr(wq, "BLOCK_BYTES", 7 * 200 * 4)
    _check_kernel_is_the_spec(kind, 40, 200, 50, wdtype, torch.float32, "cpu", blocked=True)


def test_blocked_or_fused_by_rule_and_tokens(monkeypatch):
    from forge_compile.kernels.wgrad_update_q8 import use_blocked

    monkeypatch.delenv("FORGE_Q8_PATH", raising=False)
    adamw, sgdm = rules.adamw_rule(), rules.sgd_rule(momentum=True)
    assert use_blocked(adamw, 256) and use_blocked(adamw, 8192) and use_blocked(sgdm, 2048)
    assert not use_blocked(sgdm, 256)
    monkeypatch.setenv("FORGE_Q8_PATH", "fused")
    assert not use_blocked(adamw, 8192)
    monkeypatch.setenv("FORGE_Q8_PATH", "blocked")
    assert use_blocked(sgdm, 64)


def test_interpreter_empty_token_dim(interpret):
    # M = 0: dW = 0, the rule still decays the states and the weight
    _check_kernel_is_the_spec("adamw", 32, 128, 0, torch.float32, torch.float32, "cpu", steps=1)


@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("from_grad", [False, True], ids=["gemm", "stored_grad"])
def test_cpu_path_is_the_spec(monkeypatch, kind, wdtype, from_grad):
    from forge_compile.kernels import wgrad_update_q8 as wq

    # blocks of 3 rows of 200 columns: several blocks, a short last one
    monkeypatch.setattr(wq, "CPU_BLOCK_BYTES", 3 * 200 * 4)
    _check_kernel_is_the_spec(kind, 40, 200, 50, wdtype, torch.bfloat16, "cpu", from_grad=from_grad, cpu_path=True)


def test_dispatch_runs_the_cpu_path_on_cpu(monkeypatch):
    from forge_compile.kernels import wgrad_update_q8 as wq

    monkeypatch.delenv("FORGE_TRITON_CPU", raising=False)
    rule, w, dy_t, x, states, hp = _case("adamw", 8, 128, 4, torch.float32, torch.float32, "cpu")
    calls = []
    monkeypatch.setattr(wq, "wgrad_update_q8_cpu", lambda *a, **kw: calls.append(kw["key"]))
    wq.wgrad_update_q8(w, dy_t, x, states, hp, rule.name, key=7, salt=0)
    assert calls == [7]


def test_the_op_is_the_direct_call():
    # forge::wgrad_update_q8_: codes, scales and scalar states as separate lists, the step's key as a tensor; the
    # same as wgrad_update_q8 called directly (no sqrt mode here: a torch function mode is off inside an op's impl)
    from forge_compile.kernels.wgrad_update_q8 import wgrad_update_q8

    rule, w, dy_t, x, states, hp = _case("adamw", 24, 256, 16, torch.float32, torch.bfloat16, "cpu")
    w_ref, st_ref = w.clone(), _to(states, "cpu")
    st = _to(states, "cpu")
    codes = [s[0] for s in st if isinstance(s, list)]
    scales = [s[1] for s in st if isinstance(s, list)]
    scalars = [s for s in st if not isinstance(s, list)]
    wgrad_update_q8(w_ref, dy_t, x, st_ref, hp, rule.name, key=round_key(1, 2), salt=3)
    torch.ops.forge.wgrad_update_q8_(w, dy_t, x, codes, scales, scalars, hp, rule.name, torch.tensor(round_key(1, 2)),
                                     3)
    assert not torch.equal(w, _case("adamw", 24, 256, 16, torch.float32, torch.bfloat16, "cpu")[1])
    assert torch.equal(w, w_ref) and float(scalars[0]) == float(st_ref[0]) == 11.0
    for c, sc, ref in zip(codes, scales, [s for s in st_ref if isinstance(s, list)]):
        assert torch.equal(sc, ref[1]) and torch.equal(c.view(torch.uint8), ref[0].view(torch.uint8))
    with pytest.raises(ValueError, match="takes 2 .codes, scales. pairs and 1 scalar states"):
        torch.ops.forge.wgrad_update_q8_(w, dy_t, x, codes[:1], scales[:1], scalars, hp, rule.name, torch.tensor(1), 3)


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_bad_states_are_refused_before_any_launch(path):
    from forge_compile.kernels.wgrad_update_q8 import empty_q8_state, launch_wgrad_update_q8, wgrad_update_q8_cpu

    launch = launch_wgrad_update_q8 if path == "triton" else wgrad_update_q8_cpu
    rule = rules.adamw_rule()
    w = torch.zeros(8, 200)
    good = list(empty_q8_state(w))
    assert good[1].shape == (8, 2) and good[0].dtype == torch.float8_e4m3fn
    hp = [torch.tensor(v, dtype=torch.float64) for v in HP["adamw"]]
    step = torch.tensor(0.0)
    with pytest.raises(ValueError, match="8-bit state 'exp_avg_sq'"):
        launch(w, torch.zeros(8, 4), torch.zeros(4, 200), [step, good, torch.zeros(8, 200)], hp, rule, key=1,
               salt=0)
    with pytest.raises(ValueError, match="8-bit state 'exp_avg'"):
        launch(w, torch.zeros(8, 4), torch.zeros(4, 200), [step, [good[0], good[1][:, :1]], good], hp, rule,
               key=1, salt=0)
    assert float(step) == 0.0


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@CUDA
@pytest.mark.parametrize("kind", ["adamw", "sgdm", "lion"])
@pytest.mark.parametrize("config", [None, "q16x128", "q64x128", "q128x128", "q32x256e2w8", "q128x256e2"])
def test_cuda_fused_q8_is_the_spec(kind, config):
    _check_kernel_is_the_spec(kind, 200, 520, 300, torch.float32, torch.bfloat16, "cuda", config=config)


@CUDA
def test_cuda_fused_q8_bf16_weight_fp32_activations():
    _check_kernel_is_the_spec("adamw", 130, 384, 96, torch.bfloat16, torch.float32, "cuda")


@CUDA
@pytest.mark.parametrize("kind", ["adamw", "sgdm"])
def test_cuda_blocked_path_is_the_spec(monkeypatch, kind):
    # cuBLAS's bf16 GEMM into fp32 blocks of 64 rows (exact activations: the same dW as the spec's fp32 matmul)
    from forge_compile.kernels import wgrad_update_q8 as wq

    monkeypatch.setattr(wq, "BLOCK_BYTES", 64 * 520 * 4)
    _check_kernel_is_the_spec(kind, 200, 520, 300, torch.float32, torch.bfloat16, "cuda", blocked=True)


@CUDA
def test_cuda_q8_update_of_a_stored_grad():
    _check_kernel_is_the_spec("adamw", 256, 1024, 64, torch.float32, torch.bfloat16, "cuda", from_grad=True)


@CUDA
@pytest.mark.parametrize("kind", ["adamw", "lion"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_repeated_launches_take_the_launch_memo_and_stay_the_spec(monkeypatch, kind, wdtype):
    # a step launches the same layers on the same buffers: from the third step on each launch goes through
    # launch_memo -- the round keys passed per launch, the scalar states advanced once per update, not per row block
    # -- and every step stays bitwise the spec: the fused kernel on fixed activations, the blocked path on the row
    # blocks of a fixed dW buffer (block_grad, so that the blocks' addresses repeat as a step's allocations do)
    from forge_compile.kernels import launch_memo as lm
    from forge_compile.kernels import wgrad_update_q8 as wq
    from forge_compile.kernels.wgrad_update_q8 import reference_wgrad_update_q8

    monkeypatch.setattr(wq, "BLOCK_BYTES", 64 * 520 * 4)
    # ENABLED is a one-item list (monkeypatch.setitem takes mappings only): on for this test, put back after it
    monkeypatch.setattr(lm, "ENABLED", [True])
    lm.clear()
    rule, w, dy_t, x, states, hp = _case(kind, 200, 520, 300, wdtype, torch.bfloat16, "cuda")
    w_ref, st_ref = w.clone(), _to(states, "cuda")
    w_f, st_f = w.clone(), _to(states, "cuda")
    w_b, st_b = w.clone(), _to(states, "cuda")
    gbuf = torch.empty(w.shape, device="cuda")
    steps = 5
    for step in range(steps):
        key = round_key(3, step)
        gbuf.copy_(reference_wgrad_update_q8(w_ref, dy_t, x, st_ref, hp, rule.name, key, salt=5))
        wq.launch_wgrad_update_q8(w_f, dy_t, x, st_f, hp, rule, key=key, salt=5)
        wq.wgrad_update_q8_blocked(w_b, None, None, st_b, hp, rule, key=key, salt=5,
                                   block_grad=lambda r0, r1: gbuf[r0:r1])
        for w_k, st_k in ((w_f, st_f), (w_b, st_b)):
            _assert_bitwise(rule, w_k, st_k, w_ref, st_ref, step + 1)
    # one fused launch and four row blocks (200 rows by 64) per step: remembered at the second step, hits from the third
    assert lm.counters["built"] == 5 and lm.counters["hit"] == 5 * (steps - 2), (dict(lm.counters), lm.LAST_ERROR[0])
    lm.clear()
