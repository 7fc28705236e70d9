"""The fused op's CPU impl vs its plain-torch spec: exactness, and dW never allocated whole."""
import os

import pytest
import torch

import forge_compile as forge
from forge_compile.kernels.wgrad_update import cpu_block_shape, reference_wgrad_update, wgrad_update


def _adamw_rule():
    return forge.optim.adamw_rule(amsgrad=False, maximize=False)


def _adamw_args(n, k, m, dtype=torch.float32):
    w = torch.randn(n, k)
    states = [torch.tensor(3.0), torch.rand(n, k) * 0.1, torch.rand(n, k) * 0.01]   # rule.states order
    hp = [torch.tensor(v, dtype=torch.float64) for v in (1e-3, 0.9, 0.999, 1e-8, 0.1)]
    dy_t = torch.randn(m, n, dtype=dtype).t()     # a transposed view, as in the graph
    x = torch.randn(m, k, dtype=dtype)
    return w, dy_t, x, states, hp


@pytest.mark.parametrize("blocks", ["whole", "tiled"])
@pytest.mark.parametrize("shape", [(67, 45, 31), (300, 70, 9), (4, 3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_impl_is_bit_identical_to_rule_on_the_gradient_it_consumed(shape, dtype, blocks, monkeypatch):
    if blocks == "tiled":   # ragged 2-D tiling of dW (16-row blocks split into 12-column pieces at 45 cols)
        from forge_compile.kernels import wgrad_update_cpu as cpu_impl
        monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_BYTES", 4 * 200)
        monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_MIN_ROWS", 16)
        assert cpu_impl.cpu_block_shape(67, 45) == (16, 12)
    rule = _adamw_rule()
    w, dy_t, x, states, hp = _adamw_args(*shape, dtype=dtype)
    w2, states2 = w.clone(), [s.clone() for s in states]
    grad = torch.full_like(w, float("nan"))       # poisoned: every element must be written
    wgrad_update(w, dy_t, x, states, hp, rule.name, grad_out=grad)
    assert not grad.isnan().any()
    rule.apply(w2, grad, states2, hp)
    assert torch.equal(w, w2)
    for a, b in zip(states, states2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_impl_matches_reference(dtype):
    rule = _adamw_rule()
    w, dy_t, x, states, hp = _adamw_args(130, 77, 50, dtype=dtype)
    w2, states2 = w.clone(), [s.clone() for s in states]
    wgrad_update(w, dy_t, x, states, hp, rule.name)
    reference_wgrad_update(w2, dy_t, x, states2, hp, rule.name)
    # Row blocks of dW vs one whole mm: same products, possibly another summation order.
    torch.testing.assert_close(w, w2, rtol=1e-6, atol=1e-7)
    for a, b in zip(states, states2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert states[0].item() == 4.0


def _peak_rss_growth(fn):
    """Peak resident-set growth of fn() in bytes. Inductor's buffers bypass the dispatcher, so the
    kernel's own high-water mark is the honest measure: clear_refs=5 resets VmHWM (Linux >= 4.0)."""
    def read(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = read("VmRSS:")
    fn()
    return read("VmHWM:") - base


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_fused_step_never_allocates_a_full_dw():
    n = k = 4096                                   # dW would be 64 MiB
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def body(x):
        loss = model(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad(); return loss

    fused, unfused = forge.compile_train_step(body), forge.compile_train_step(body, fuse=False)
    x = torch.randn(8, k)
    for _ in range(2):                             # compile and warm up outside the measured region
        fused(x); unfused(x)
    dw_bytes = n * k * 4
    # Sanity bound of the method, not of forge: peak RSS growth of the unfused step shows dW, less whatever
    # the step frees before dW is allocated (measured 0.89-0.95 x dW on 2-core CI machines), so 0.6 x dW
    # still proves the measurement sees a dW-sized tensor, well apart from the fused bound below.
    assert _peak_rss_growth(lambda: unfused(x)) >= 0.6 * dw_bytes, "the measurement must see dW when it exists"
    # The fused step's own growth: with the functional rule, its block temporaries plus glibc heap growth over
    # the blocks measured 0.05-0.37 x dW on the 2-core machines (median ~0.24, so the former 0.25 bound failed
    # about every other run); AdamW's in-place fast path (kernels/wgrad_update_cpu.py) reuses two scratch
    # blocks across calls and measured 0.0. A whole dW shows as >= 0.89 x dW (the unfused step above); 0.5
    # keeps both apart and still holds for rules on the functional path.
    assert _peak_rss_growth(lambda: fused(x)) < 0.5 * dw_bytes
    rows, cols = cpu_block_shape(n, k)
    assert rows * cols * 4 < 0.25 * dw_bytes


def test_op_is_tagged_cudagraph_unsafe():
    # its launch bakes host scalars (bias corrections, lr) of the moment: Inductor's CUDA graphs must leave it out
    # (tests/test_gpu_cudagraphs.py runs both routes with them)
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    assert tag in torch.ops.forge.wgrad_update_.default.tags
