"""launch_memo: the host fast path for repeated fused launches.

CPU: a fake Triton kernel records what the launcher would receive (argument order with the constexprs, scalars
spliced where the full path put them, tensors replaced by pointer holders that keep nothing alive). GPU: repeated
launches through the op on the same buffers, new contents each step, stay bit-exact with the unfused reference
and do take the fast path.
"""
from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from forge_compile.kernels import launch_memo as lm
from forge_compile.kernels.epilogue_codegen import compile_epilogue
from forge_compile.kernels.wgrad_update import wgrad_update
from forge_compile.kernels.wgrad_update_triton import host_scalars
from forge_compile.optim import rules as R
from forge_compile.optim.rule import register_rule


@pytest.fixture(autouse=True)
def fresh_memo():
    lm.clear()
    lm.ENABLED[0] = True
    yield
    lm.clear()
    lm.ENABLED[0] = True


@dataclasses.dataclass
class FakeDesc:   # the fields of a Triton/Gluon TensorDescriptor the launcher reads
    base: object
    shape: list
    strides: list


class FakeKernel:
    arg_names: list = []   # set per test: the rule decides how many scalar parameters there are

    def __init__(self):
        self.launched = []
        self.warmups = 0

    def warmup(self, *args, grid, **opts):
        self.warmups += 1
        kernel = self

        class Compiled:
            def __getitem__(self, g):
                # as triton's CompiledKernel.__getitem__: three grid dims indexed, no padding
                assert (g[0], g[1], g[2]) == tuple(grid) + (1,) * (3 - len(grid))
                return lambda *a: kernel.launched.append(a)

        return Compiled()


def _setup():
    rule = R.adamw_rule()
    ep = compile_epilogue(rule)
    w = torch.randn(8, 4)
    m, v = torch.zeros(8, 4), torch.zeros(8, 4)
    step = torch.tensor(3.0)
    states = [step, m, v] if rule.is_scalar_state(0) else [m, v, step]
    sidx = [i for i in range(len(states)) if rule.is_scalar_state(i)]
    assert rule.hparams == ("lr", "beta1", "beta2", "eps", "weight_decay")
    hp = [torch.tensor(x, dtype=torch.float64) for x in (1e-3, 0.9, 0.999, 1e-8, 0.01)]
    return rule, ep, w, states, sidx, hp


def _prepare_fn(kernel, w, x, ep, states, sidx, hp):
    def prepare():
        scalars = host_scalars(ep, [states[i] for i in sidx], hp)[0]
        args = (FakeDesc(w, list(w.shape), list(w.stride())), x, *scalars, x.shape[0])
        return kernel, (3,), args, dict(BLOCK=64, num_warps=4)
    return prepare


def test_fake_launch_order_scalars_and_no_references():
    rule, ep, w, states, sidx, hp = _setup()
    kernel = FakeKernel()
    x = torch.randn(5, 4)
    key = lm.launch_key("k", rule, w, x.t(), x, states, None)
    prep = _prepare_fn(kernel, w, x, ep, states, sidx, hp)
    # the fake's scalar slots: exactly as many as the rule's host scalars
    n_scalars = len(host_scalars(ep, [states[i] for i in sidx], hp)[0])
    FakeKernel.arg_names = ["w_desc", "x", *[f"s{i}" for i in range(n_scalars)], "M", "BLOCK"]

    lm.remember(key, rule, prep, ep, states, hp, sidx)          # first sighting: nothing built
    assert not lm.lookup(key, states, hp) and kernel.warmups == 0
    lm.remember(key, rule, prep, ep, states, hp, sidx)          # second: entry
    assert kernel.warmups == 1 and lm.counters["built"] == 1

    expect_scalars = host_scalars(ep, [states[i] for i in sidx], hp)[0]
    step_before = states[sidx[0]].item()
    assert lm.lookup(key, states, hp)
    (got,) = kernel.launched
    assert got[0].base.data_ptr() == w.data_ptr() and not isinstance(got[0].base, torch.Tensor)
    assert got[0].shape == list(w.shape)
    assert got[1].data_ptr() == x.data_ptr() and not isinstance(got[1], torch.Tensor)
    assert list(got[2:2 + n_scalars]) == list(expect_scalars)
    assert got[2 + n_scalars:] == (5, 64)     # then M, then the constexpr BLOCK from the options
    assert states[sidx[0]].item() == step_before + 1   # the step advanced once, after the launch

    # the next step's scalars differ (bias corrections follow the step): spliced fresh, nothing else changes
    assert lm.lookup(key, states, hp)
    assert list(kernel.launched[1][2:2 + n_scalars]) == list(host_scalars(
        ep, [torch.tensor(step_before + 1)], hp)[0])

    # the entry keeps no tensor alive (activations would otherwise never be freed)
    ref = weakref.ref(x)
    del x, prep
    gc.collect()
    assert ref() is None


def test_per_launch_argument_after_the_scalars():
    # nvar=1 (a stochastic-rounding launch): the argument right after the scalars -- the round key -- is taken from
    # each lookup, never from the launch the entry was built from; a lookup without it does not launch
    rule, ep, w, states, sidx, hp = _setup()
    kernel = FakeKernel()
    x = torch.randn(5, 4)
    key = lm.launch_key("rounded", rule, w, x.t(), x, states, None)

    def prepare():
        scalars = host_scalars(ep, [states[i] for i in sidx], hp)[0]
        return kernel, (3,), (x, *scalars, 12345, x.shape[0]), dict(BLOCK=64)
    n_scalars = len(host_scalars(ep, [states[i] for i in sidx], hp)[0])
    FakeKernel.arg_names = ["x", *[f"s{i}" for i in range(n_scalars)], "EKEY", "M", "BLOCK"]
    lm.remember(key, rule, prepare, ep, states, hp, sidx, nvar=1)
    lm.remember(key, rule, prepare, ep, states, hp, sidx, nvar=1)
    assert lm.counters["built"] == 1
    assert not lm.lookup(key, states, hp) and not kernel.launched
    for ekey in (7, 99):
        assert lm.lookup(key, states, hp, (ekey,))
        got = kernel.launched[-1]
        assert len(got) == 1 + n_scalars + 3
        assert got[1 + n_scalars:] == (ekey, 5, 64)
    # a rule without host scalars has no position for the key: not remembered
    lm.clear()
    lm.remember(key, rule, lambda: (kernel, (3,), (x, 5, 5), {}), None, states, hp, [], nvar=1)
    lm.remember(key, rule, lambda: (kernel, (3,), (x, 5, 5), {}), None, states, hp, [], nvar=1)
    assert lm.counters["built"] == 0 and lm.counters["unsupported"] == 1


def test_launch_remembered_leaves_the_scalar_states_to_the_caller():
    # a launch on one row block of a weight (wgrad_update_q8's blocked path): the next block's scalars must come from
    # the same step value, so the caller advances the scalar states once, after the last block
    rule, ep, w, states, sidx, hp = _setup()
    kernel = FakeKernel()
    x = torch.randn(5, 4)
    key = lm.launch_key("k", rule, w, x.t(), x, states, None)
    n_scalars = len(host_scalars(ep, [states[i] for i in sidx], hp)[0])
    FakeKernel.arg_names = ["w_desc", "x", *[f"s{i}" for i in range(n_scalars)], "M", "BLOCK"]
    for _ in range(2):
        lm.remember(key, rule, _prepare_fn(kernel, w, x, ep, states, sidx, hp), ep, states, hp, sidx)
    step_before = states[sidx[0]].item()
    got = [lm.launch_remembered(key, states, hp) for _ in range(2)]
    assert states[sidx[0]].item() == step_before
    assert kernel.launched[0][2:2 + n_scalars] == kernel.launched[1][2:2 + n_scalars]
    # what the caller advances them to: the values one launch's lookup would have written
    assert got[0][0][0] is states[sidx[0]] and list(got[0][1]) == host_scalars(ep, [states[sidx[0]]], hp)[1]
    assert lm.lookup(key, states, hp) and states[sidx[0]].item() == got[0][1][0]


def test_key_follows_pointer_shape_stride_dtype_and_kind():
    rule, ep, w, states, sidx, hp = _setup()
    x = torch.randn(6, 4)
    base = lm.launch_key("a", rule, w, x.t(), x, states, None)
    assert base == lm.launch_key("a", rule, w, x.t(), x, states, None)
    assert base != lm.launch_key("b", rule, w, x.t(), x, states, None)
    assert base != lm.launch_key("a", rule, w, x.t(), x.clone(), states, None)            # pointer
    assert base != lm.launch_key("a", rule, w, x[:5].t(), x[:5], states, None)            # shape
    xt = x.t().contiguous().t()
    assert base != lm.launch_key("a", rule, w, x.t(), xt, states, None)                   # strides
    assert base != lm.launch_key("a", rule, w, x.t(), x.to(torch.bfloat16), states, None)  # dtype
    assert base != lm.launch_key("a", R.adam_rule(), w, x.t(), x, states, None)           # rule


def test_unused_marks_are_bounded_and_cleared():
    # launch_wgrad_update marks keys whose K-major copies went unused (Gluon refused the fp32 launch): remembered
    # until clear(), the oldest dropped past 4 x capacity
    lm.clear()
    assert not lm.unused(("k", 1))
    lm.mark_unused(("k", 1))
    assert lm.unused(("k", 1)) and not lm.unused(("k", 2))
    for i in range(4 * lm._CAPACITY + 1):
        lm.mark_unused(("n", i))
    assert not lm.unused(("k", 1)) and lm.unused(("n", 4 * lm._CAPACITY))
    lm.clear()
    assert not lm.unused(("n", 4 * lm._CAPACITY))


def test_scalars_not_found_leaves_the_full_path():
    rule, ep, w, states, sidx, hp = _setup()
    kernel = FakeKernel()
    x = torch.randn(5, 4)

    def prepare():   # copies of the scalars, not the memoized objects: no position can be proven
        scalars = host_scalars(ep, [states[i] for i in sidx], hp)[0]
        return kernel, (1,), (x, *[torch.tensor(s, dtype=torch.float64).item() for s in scalars]), {}

    key = lm.launch_key("k", rule, w, x.t(), x, states, None)
    lm.remember(key, rule, prepare, ep, states, hp, sidx)
    lm.remember(key, rule, prepare, ep, states, hp, sidx)
    assert lm.counters["unsupported"] == 1 and not lm.lookup(key, states, hp)


def test_failing_launcher_disables_fast_path():
    rule, ep, w, states, sidx, hp = _setup()
    x = torch.randn(5, 4)
    n_scalars = len(host_scalars(ep, [states[i] for i in sidx], hp)[0])

    class Boom(FakeKernel):
        arg_names = ["w_desc", "x", *[f"s{i}" for i in range(n_scalars)], "M", "BLOCK"]

        def warmup(self, *args, grid, **opts):
            class Compiled:
                def __getitem__(self, g):
                    def run(*a):
                        raise TypeError("argument conversion")
                    return run
            return Compiled()

    kernel = Boom()
    prep = _prepare_fn(kernel, w, x, ep, states, sidx, hp)
    key = lm.launch_key("k", rule, w, x.t(), x, states, None)
    lm.remember(key, rule, prep, ep, states, hp, sidx)
    lm.remember(key, rule, prep, ep, states, hp, sidx)
    step_before = states[sidx[0]].item()
    assert not lm.lookup(key, states, hp)
    assert not lm.ENABLED[0]
    assert states[sidx[0]].item() == step_before      # nothing advanced: the caller's full path runs the step


def _triton_36():
    try:
        import triton
        return triton.__version__.startswith("3.6.")
    except ImportError:
        return False


@pytest.mark.skipif(not _triton_36(), reason="the launcher layout of triton 3.6 (the GPU machine's)")
def test_direct_launch_passes_what_tritons_launcher_passes(monkeypatch):
    # triton 3.6's own CudaLauncher.__call__ + wrap_handle_tensordesc around a recording C launcher, against
    # TritonDirectLaunch over the same object: the same arguments reach the C function (pointers as integers)
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nv
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from forge_compile import _compat

    calls = []

    class CLaunch:   # stands in for the compiled C module's launch (a builtin: no __code__)
        def __call__(self, *a):
            calls.append(a)

    sig = {"a_desc": "tensordesc<fp32[16, 16]>", "x": "*fp32", "s0": "fp32", "b_desc": "tensordesc<bf16[64, 64]>",
           "M": "i32", "BLOCK": "constexpr"}
    launcher = object.__new__(nv.CudaLauncher)
    launcher.launch = nv.wrap_handle_tensordesc(CLaunch(), sig, None)
    launcher.num_ctas, launcher.global_scratch_size, launcher.profile_scratch_size = 1, 0, 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch_cooperative_grid = launcher.launch_pdl = False
    compiled = SimpleNamespace(run=launcher, function=777, packed_metadata=(4, 1, 0))
    monkeypatch.setattr(_compat, "_triton_stream_fns", lambda: ((lambda: 0), (lambda device: 4242)))
    direct = _compat.TritonDirectLaunch.build(compiled, (3,))
    assert direct is not None and direct.usable()

    lay = gl.NVMMASharedLayout(128, 32, 2)
    w, x, b = torch.randn(16, 16), torch.randn(4), torch.randn(64, 64)
    args = [lm._strip(a) for a in (TensorDescriptor(w, [16, 16], [16, 1], [16, 16], lay), x, 0.5,
                                   TensorDescriptor(b, [64, 64], [64, 1], [64, 64], lay), 7, 64)]
    launcher(3, 1, 1, 4242, 777, (4, 1, 0), None, None, None, *args)     # as CompiledKernel[grid] calls it
    direct(direct.expand(args[:2], 0), [0.5], direct.expand(args[3:], 3))
    via_triton, via_direct = calls
    assert all(type(a) is not lm._Ptr for a in via_direct)
    assert tuple(a.data_ptr() if isinstance(a, lm._Ptr) else a for a in via_triton) == via_direct
    assert via_direct[13] == w.data_ptr() and via_direct[-2:] == (7, 64)


# ---- GPU ------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("mode", ["auto", "triton"])
@pytest.mark.parametrize("name", ["adamw", "sgdm", "lion"])
def test_repeated_launches_exact(monkeypatch, mode, name):
    # one layer, five steps on the same buffers (new contents each step): the third step on takes the fast path,
    # every step bit-exact against the unfused reference from the same state
    monkeypatch.setenv("FORGE_WGRAD_KERNEL", mode)
    rule = register_rule({"adamw": R.adamw_rule, "sgdm": lambda: R.sgd_rule(momentum=True),
                          "lion": R.lion_rule}[name]())
    n, k, m = 512, 384, 200
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen)
    states = []
    for i, _ in enumerate(rule.states):
        states.append(torch.tensor(1.0) if rule.is_scalar_state(i) else torch.rand(n, k, device="cuda", generator=gen) * 0.1)
    values = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, momentum=0.9, dampening=0.0)
    hp = [torch.tensor(values[h], dtype=torch.float64) for h in rule.hparams]
    dy = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.empty(n, k, device="cuda")
    for step in range(5):
        dy.copy_(torch.randn(m, n, device="cuda", generator=gen))
        x.copy_(torch.randn(m, k, device="cuda", generator=gen))
        w_ref, st_ref = w.clone(), [s.clone() for s in states]
        grad.fill_(float("nan"))   # poisoned: the kernel writes the dW it consumed into it
        wgrad_update(w, dy.t(), x, states, hp, rule.name, grad_out=grad)
        torch.cuda.synchronize()
        with torch.no_grad():
            rule.apply(w_ref, grad, st_ref, hp)
        assert torch.equal(w, w_ref), f"step {step}: W differs in {(w != w_ref).sum().item()} elements"
        for s, e in zip(states, st_ref):
            assert torch.equal(s.cpu(), e.cpu()), f"step {step}: a state differs"
    assert lm.counters["built"] == 1 and lm.counters["hit"] == 3, (dict(lm.counters), repr(lm.LAST_ERROR[0]))
    import triton
    if triton.__version__.startswith("3.6."):   # the layout _compat.TritonDirectLaunch knows: the hits went direct
        assert lm.counters["direct"] == 3, dict(lm.counters)
