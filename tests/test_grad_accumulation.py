"""Gradient accumulation inside one compiled step: ``backward()`` per micro-batch, then ``opt.step()``.

Each weight's gradient is then a sum of passes (AccumulateGrad's ``add_``). The pass fuses it into one update whose
GEMM reads every pass's dY and X concatenated over tokens (dW = sum_i dY_i^T X_i = [dY_1; ...]^T [X_1; ...]), an
embedding's from every pass's gradient rows and indices, so dW is never made -- where those operands are no larger
than half the fp32 dW (they stay alive until the update and the concatenation copies them); larger ones stay
unfused with the reason. Compared here with
the same accumulation run eagerly.

Tolerances: the fused GEMM sums all passes' tokens in one fp32 reduction where eager sums per pass and then adds
the passes, a few fp32 ulps apart; through AdamW over 3 steps that stays within test_compile_train_step's RTOL.
AdamW takes atol 5e-5 (5e-3 x lr): where a gradient element nearly cancels (MLP's fc1.weight[67, 25], v ~ 5e-9;
TinyLM's GELU near 0, the reason test_clip_grad_norm.py gives) Adam's update is scale-free and moves by ~lr x the
gradient's relative error, so any other summation order shows -- the compiled step with fusion off differs from
eager there too (measured 1.1e-5 fusion off, 1.7e-5 fused, at that element only). A dropped or doubled pass moves
Adam's weights by ~lr = 1e-2. SGD is the tight check: such a pass moves its weights by > 1e-3.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import forge_compile as forge
from models import MLP, Block, TinyLM, assert_close_training, forge_and_eager, lm_loss

RTOL, ATOL = 1e-5, 1e-6

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}
SGD_MOMENTUM = OPTIMIZERS["sgd_momentum"]


def accumulating_step(model, opt, loss_fn, clip=None):
    """backward() per micro-batch (the loss divided by their count), optionally clip_grad_norm_, then the update."""
    def step(xs, ys):
        for x, y in zip(xs, ys):
            loss = loss_fn(model(x), y) / len(xs)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else loss.detach()
        opt.step()
        opt.zero_grad()
        return loss, norm
    return step


def _block_loss(out, y):
    return F.mse_loss(out, y)


class _BlockModel(torch.nn.Module):
    """One transformer Block on 3-D activations: its weight gradients are mms of flattened views."""

    def __init__(self):
        super().__init__()
        self.block = Block(32)

    def forward(self, x):
        return self.block(x)


def _data(model_name, steps, passes, gen):
    """Micro-batches of unequal token counts (the concatenation takes any)."""
    out = []
    for _ in range(steps):
        if model_name == "mlp":
            sizes = [4, 3, 5][:passes]   # 12 tokens x (64 + 128) x 4 B <= half of fc1's 32 KiB dW
            xs = [torch.randn(n, 64, generator=gen) for n in sizes]
            ys = [torch.randn(n, 32, generator=gen) for n in sizes]
        elif model_name == "block":
            # 7 tokens x (32 + 32) x 4 B <= half of proj's 4 KiB dW
            xs = [torch.randn(1, 3 + i, 32, generator=gen) for i in range(passes)]
            ys = [torch.randn(1, 3 + i, 32, generator=gen) for i in range(passes)]
        else:
            xs = [torch.randint(0, 40, (1, 3 + i), generator=gen) for i in range(passes)]
            ys = [torch.randint(0, 40, (1, 3 + i), generator=gen) for i in range(passes)]
        out.append((xs, ys))
    return out


def _model(model_name):
    if model_name == "mlp":
        return MLP(64, 128, 32), F.mse_loss
    if model_name == "block":
        return _BlockModel(), _block_loss
    return TinyLM(vocab=40, d=32), lm_loss


# every optimizer x clip on the MLP; the 3-D Block and TinyLM (embedding) in two of those each (CI time)
CASES = [("mlp", 3, o, c) for o in OPTIMIZERS for c in (None, 0.05)] + [
    ("block", 2, "sgd_momentum", None), ("block", 2, "adamw", 0.05),
    ("tiny_lm", 2, "sgd_momentum", 0.05), ("tiny_lm", 2, "adamw", None)]


@pytest.mark.parametrize("model_name,passes,opt_name,clip", CASES,
                         ids=[f"{m}-{o}-{'clip' if c else 'no_clip'}" for m, _, o, c in CASES])
def test_accumulated_step_trains_like_eager(model_name, passes, opt_name, clip):
    torch.manual_seed(0)
    model, loss_fn = _model(model_name)
    fstep, rstep, ref = forge_and_eager(model, OPTIMIZERS[opt_name],
                                        lambda m, o: accumulating_step(m, o, loss_fn, clip))
    for xs, ys in _data(model_name, 3, passes, torch.Generator().manual_seed(1)):
        (loss, norm), (rloss, rnorm) = fstep(xs, ys), rstep(xs, ys)
        torch.testing.assert_close(loss, rloss.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(norm, rnorm, rtol=RTOL, atol=ATOL)
        if clip:
            assert rnorm > 2 * clip, "the test must clip"
    assert_close_training(model, ref, RTOL, 5e-5 if opt_name == "adamw" else ATOL)
    rep = fstep.last_report
    weights = [r for r in rep.rows if len(r.shape) == 2]
    assert weights and all(r.fused and f"sum of {passes} " in r.reason for r in weights), str(rep)
    if clip:
        assert all("clip_grad_norm_" in r.reason for r in weights), str(rep)
    if model_name == "tiny_lm":
        assert "gradient rows and indices concatenated" in rep.row("model.emb.weight").reason, str(rep)


def test_accumulation_larger_than_dw_stays_unfused_and_exact():
    # 3 passes x 40 tokens x (4 + 6) values > half the 6x4 dW: keeping them would cost more than dW; unfused, the
    # reason names both sizes, and the step is eager's
    torch.manual_seed(0)
    model = MLP(4, 6, 3)
    fstep, rstep, ref = forge_and_eager(model, SGD_MOMENTUM, lambda m, o: accumulating_step(m, o, F.mse_loss))
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        xs = [torch.randn(40, 4, generator=gen) for _ in range(3)]
        ys = [torch.randn(40, 3, generator=gen) for _ in range(3)]
        fstep(xs, ys), rstep(xs, ys)
    assert_close_training(model, ref, RTOL, ATOL)
    row = fstep.last_report.row("model.fc1.weight")
    assert not row.fused and "sum of 3 matmuls' dW" in row.reason and "outweighing the fp32 dW (96 B)" in row.reason, \
        str(fstep.last_report)


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("route", ["step", "backend"])
def test_weight_used_twice_is_fused_like_accumulated_passes(route):
    # one linear applied twice in the forward: its dW is the sum of two matmuls in one backward, the same sum as
    # two accumulated passes -- fused the same way (2 x 4 tokens x 64 values x 4 B = 2 KiB <= half its 4 KiB dW), in
    # the Dynamo route's backward graph too
    from forge_compile import backend

    torch.manual_seed(0)
    model = _Twice()
    ref = copy.deepcopy(model)
    opt, ref_opt = SGD_MOMENTUM(model.parameters()), SGD_MOMENTUM(ref.parameters())

    def make(m, o):
        def step(x, y):
            loss = F.mse_loss(m(x), y)
            loss.backward(); o.step(); o.zero_grad()
            return loss
        return step
    if route == "step":
        fstep = forge.compile_train_step(make(model, opt))
    else:
        fstep = make(torch.compile(model, backend="forge", options={"optimizer": opt}), opt)
    rstep = make(ref, ref_opt)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen)
        fstep(x, y), rstep(x, y)
    torch.testing.assert_close(model.lin.weight, ref.lin.weight, rtol=RTOL, atol=ATOL)
    rows = fstep.last_report.rows if route == "step" else [r for rep in backend.last_reports() for r in rep.rows]
    row = next(r for r in rows if r.name.endswith("lin.weight"))
    assert row.fused and "sum of 2 matmuls' dW" in row.reason and "a weight used 2 times" in row.reason, str(row)


def test_tied_weight_accumulation_stays_unfused_and_exact():
    # each pass adds the output matmul's dW and the embedding's rows: not one kind of pass, so unfused (said so)
    torch.manual_seed(0)
    model = TinyLM(vocab=40, d=32, tied=True)
    fstep, rstep, ref = forge_and_eager(model, SGD_MOMENTUM, lambda m, o: accumulating_step(m, o, lm_loss))
    for xs, ys in _data("tiny_lm", 2, 2, torch.Generator().manual_seed(3)):
        fstep(xs, ys), rstep(xs, ys)
    assert_close_training(model, ref, RTOL, ATOL)
    rep = fstep.last_report
    row = rep.row("model.emb.weight")
    assert not row.fused and "several backward passes" in row.reason, str(rep)
    assert rep.row("model.block.qkv.weight").fused, str(rep)


def test_interpreter_accumulated_step(interpret):
    # the Triton kernel (interpreter) reads the concatenated operands: dy_t a transposed view of the dY rows'
    # concatenation, the layout of a single pass's dy_t
    torch.manual_seed(0)
    model, loss_fn = _model("mlp")
    fstep, rstep, ref = forge_and_eager(model, SGD_MOMENTUM, lambda m, o: accumulating_step(m, o, loss_fn, 0.05))
    for xs, ys in _data("mlp", 2, 3, torch.Generator().manual_seed(1)):
        fstep(xs, ys), rstep(xs, ys)
    assert_close_training(model, ref, RTOL, ATOL)
    assert all(r.fused for r in fstep.last_report.rows if len(r.shape) == 2), str(fstep.last_report)


def test_interpreter_tests_in_subprocess():
    from interpreter import run_child

    run_child(__file__)
