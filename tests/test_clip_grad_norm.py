"""clip_grad_norm_ inside compile_train_step: fused weights keep dW unmaterialized.

The pass replaces each fused weight's gradient norm by ``sqrt(forge::wgrad_sqnorm(dY, X))`` (row blocks of dW, one at
a time; an embedding's or tied weight's by ``forge::embedding_sqnorm``, from the compact gradient rows) and folds
the in-place ``g.mul_(coef)`` into the update (``grad_scaled_rule``: the epilogue multiplies the fp32 dW tile by the
coefficient). Compared here with the same model clipped and trained eagerly.

Tolerances: the norms are sums of squares over another summation order than torch's ``vector_norm`` of a dW that was
itself summed in another order, so the clip coefficient differs by a few fp32 ulps; through Adam's 1/sqrt(v) over 4
steps that stays far below test_compile_train_step's RTOL (1e-5), which these tests reuse. A clip that is wrong by
a factor (a missed coefficient, a norm of the wrong tensor) moves the weights by > 1e-3.
"""

import pytest
import torch
import torch.nn.functional as F

import forge_compile as forge
from forge_compile.kernels.wgrad_norm import (embedding_sqnorm, reference_embedding_sqnorm, reference_wgrad_sqnorm,
                                              wgrad_sqnorm)
from forge_compile.optim import rules as R
from forge_compile.optim.rule import grad_scaled_rule
from models import MLP, TinyLM, assert_close_training, clip_step, forge_and_eager, lm_loss

RTOL, ATOL = 1e-5, 1e-6
SGD_MOMENTUM = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_bytes", [4 * 23 * 5, 4 * 23 * 64, 1 << 25], ids=["5rows", "37rows", "one"])
def test_wgrad_sqnorm_row_blocks(dtype, block_bytes):
    gen = torch.Generator().manual_seed(0)
    dy = torch.randn(50, 37, generator=gen).to(dtype)
    x = torch.randn(50, 23, generator=gen).to(dtype)
    got = wgrad_sqnorm(dy.t(), x, block_bytes=block_bytes)
    want = reference_wgrad_sqnorm(dy.t(), x)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # and torch's own norm of the materialized fp32 gradient
    dw = dy.t().float() @ x.float()
    torch.testing.assert_close(got.sqrt(), torch.linalg.vector_norm(dw), rtol=1e-6, atol=0)


def test_wgrad_sqnorm_op_and_shape_check():
    dy, x = torch.randn(8, 6), torch.randn(8, 4)
    torch.testing.assert_close(torch.ops.forge.wgrad_sqnorm(dy.t(), x), reference_wgrad_sqnorm(dy.t(), x),
                               rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="do not compose"):
        wgrad_sqnorm(dy, x.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("padding_idx", [-1, 0, 3])
@pytest.mark.parametrize("tied", [False, True], ids=["embedding", "tied"])
@pytest.mark.parametrize("block_bytes", [4 * 5 * 2, 1 << 25], ids=["2rows", "one"])
def test_embedding_sqnorm_is_the_dense_gradients(dtype, padding_idx, tied, block_bytes):
    # repeated indices, the padding row among them (its tokens' rows must not count, yet the tied matmul's
    # padding row does), index 0 (the id of the zero rows past the distinct count)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 10, (3, 7), generator=gen)
    idx[0, :3] = torch.tensor([3, 3, 0])
    go = torch.randn(3, 7, 5, generator=gen).to(dtype)
    dy_t, x = (torch.randn(21, 10, generator=gen).to(dtype).t(), torch.randn(21, 5, generator=gen).to(dtype)) \
        if tied else (None, None)
    got = embedding_sqnorm(go, idx, 10, padding_idx, dy_t, x, block_bytes=block_bytes)
    want = reference_embedding_sqnorm(go, idx, 10, padding_idx, dy_t, x)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    torch.testing.assert_close(torch.ops.forge.embedding_sqnorm(go, idx, 10, padding_idx, dy_t, x), want,
                               rtol=2e-6, atol=0)


def test_embedding_sqnorm_checks_its_arguments():
    go, idx = torch.randn(4, 5), torch.randint(0, 9, (4,))
    with pytest.raises(ValueError, match="does not match"):
        embedding_sqnorm(go, idx[:3], 9)
    with pytest.raises(ValueError, match="both be given"):
        embedding_sqnorm(go, idx, 9, -1, torch.randn(9, 4), None)
    with pytest.raises(ValueError, match="compose"):
        embedding_sqnorm(go, idx, 9, -1, torch.randn(8, 4), torch.randn(4, 5))


@pytest.mark.parametrize("base", [R.adamw_rule(), R.sgd_rule(momentum=True, nesterov=True), R.lion_rule()],
                         ids=lambda r: r.name)
def test_grad_scaled_rule_is_the_base_rule_on_the_scaled_gradient(base):
    rule = grad_scaled_rule(base)
    assert grad_scaled_rule(base) is rule and rule.hparams == base.hparams + ("grad_scale",)
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    states = [torch.tensor(3.0) if base.is_scalar_state(i) else torch.rand(5, 7, generator=gen)
              for i in range(len(base.states))]
    hp = [torch.tensor(0.1 * (i + 1), dtype=torch.float64) for i in range(len(base.hparams))]
    coef = torch.tensor(0.3712, dtype=torch.float32)
    got = rule.fn(p, g, *states, *hp, coef.double())
    want = base.fn(p, g * coef, *states, *hp)      # clip_grad_norm_'s g.mul_(coef), then the update
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _mlp_data(steps):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(12, 16, generator=gen), torch.randn(12, 8, generator=gen)) for _ in range(steps)]


def _lm_data(steps):
    gen = torch.Generator().manual_seed(4)
    return [(torch.randint(0, 40, (2, 6), generator=gen), torch.randint(0, 40, (2, 6), generator=gen))
            for _ in range(steps)]


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "lion": lambda p: forge.optim.Lion(p, lr=1e-3, weight_decay=0.1),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("max_norm", [0.2, 1e4], ids=["clipping", "not_clipping"])
@pytest.mark.parametrize("model_name", ["mlp", "tiny_lm", "tied_lm_padded"])
def test_clipped_step_trains_like_eager(opt_name, max_norm, model_name):
    # the embedding (its norm from the compact rows) and the tied embedding / output weight (its norm from dY, X and
    # the rows) are fused under the clip too; the padding row's tokens are in the batch and must not count
    torch.manual_seed(0)
    if model_name == "mlp":
        model, data, loss_fn = MLP(), _mlp_data(4), F.mse_loss
    else:
        model, data, loss_fn = TinyLM(vocab=40, d=32, tied=model_name == "tied_lm_padded"), _lm_data(4), lm_loss
        if model_name == "tied_lm_padded":
            model.emb.padding_idx = 3
            for x, _ in data:
                x[0, :2] = 3
    fstep, rstep, ref = forge_and_eager(model, OPTIMIZERS[opt_name],
                                        lambda m, o: clip_step(m, o, max_norm, loss_fn))
    for x, y in data:
        (loss, norm), (rloss, rnorm) = fstep(x, y), rstep(x, y)
        torch.testing.assert_close(loss, rloss.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(norm, rnorm, rtol=RTOL, atol=ATOL)
        if max_norm < 1:  # coefficient <= 2/3; not so small that Adam sees gradients near its eps (there a
            # gradient element that cancels to ~0 in either summation order moves the update by ~lr x its relative error)
            assert rnorm > max_norm * 1.5, "the test must clip: the coefficient is then well below 1"
    # AdamW: atol 1e-5 (1e-3 x lr). With the clip scaling gradients down, TinyLM's down.weight[9, 15] (a GELU
    # output near 0 times dY) is a gradient a few 1e4 x eps, where Adam's update moves by ~lr x the gradient's
    # relative error; Inductor's GELU computes that tiny value ~1e-3 apart from eager's, so the compiled step
    # differs from eager by 3.3e-6 there with fusion off too (compile_train_step(fuse=False)). A missed or wrong
    # coefficient moves SGD's weights by far more than ATOL (Adam's update is nearly invariant to a gradient scale).
    assert_close_training(model, ref, RTOL, 1e-5 if opt_name == "adamw" else ATOL)
    rep = fstep.last_report
    weights = [r for r in rep.rows if r.name.endswith("weight") and len(r.shape) == 2]
    assert weights and all(r.fused and "clip_grad_norm_" in r.reason for r in weights), str(rep)
    if model_name != "mlp":
        assert ("embedding: gradient rows" if model_name == "tiny_lm" else "tied:") in rep.row(
            "model.emb.weight").reason, str(rep)


def test_logged_gradient_norm_is_computed_without_dw():
    # a gradient norm read for logging, no clipping: fused, the norm from dY and X
    torch.manual_seed(0)
    model = MLP()

    def make(m, o):
        def step(x, y):
            loss = F.mse_loss(m(x), y); loss.backward()
            gn = m.fc1.weight.grad.norm()
            o.step(); o.zero_grad()
            return loss, gn
        return step

    fstep, rstep, ref = forge_and_eager(model, lambda p: torch.optim.AdamW(p, lr=1e-2), make)
    for x, y in _mlp_data(3):
        (_, gn), (_, rgn) = fstep(x, y), rstep(x, y)
        torch.testing.assert_close(gn, rgn, rtol=RTOL, atol=ATOL)
    assert_close_training(model, ref, RTOL, ATOL)
    row = fstep.last_report.row("m.fc1.weight")
    assert row.fused and "norm computed from dY and X" in row.reason, str(fstep.last_report)


def test_clip_over_some_parameters_only():
    # clipping a subset: the clipped weights get the scaled rule, the others the plain one
    torch.manual_seed(0)
    model = MLP()

    def make(m, o):
        def step(x, y):
            loss = F.mse_loss(m(x), y); loss.backward()
            torch.nn.utils.clip_grad_norm_([m.fc2.weight, m.fc2.bias], 0.01)
            o.step(); o.zero_grad()
            return loss
        return step

    fstep, rstep, ref = forge_and_eager(model, SGD_MOMENTUM, make)
    for x, y in _mlp_data(3):
        fstep(x, y), rstep(x, y)
    assert_close_training(model, ref, RTOL, ATOL)
    rep = fstep.last_report
    assert rep.row("m.fc2.weight").fused and "clip_grad_norm_" in rep.row("m.fc2.weight").reason, str(rep)
    assert rep.row("m.fc1.weight").fused and rep.row("m.fc1.weight").reason == "", str(rep)


def test_clip_foreach_ops_are_fused_per_tensor():
    # clip_grad_norm_(foreach=True) (torchtitan's call) traces to _foreach_norm / _foreach_mul_: the capture takes
    # them apart per tensor, so every weight stays fused, as under foreach=None. On CPU foreach=True raises in torch
    # itself, so this builds the same ops by hand; eager runs them as they are (the foreach kernels)
    torch.manual_seed(0)
    model = MLP()

    def make(m, o):
        def step(x, y):
            loss = F.mse_loss(m(x), y); loss.backward()
            grads = [p.grad for p in m.parameters()]
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
            torch._foreach_mul_(grads, torch.clamp(0.05 / (total + 1e-6), max=1.0))
            o.step(); o.zero_grad()
            return loss, total
        return step

    fstep, rstep, ref = forge_and_eager(model, SGD_MOMENTUM, make)
    for x, y in _mlp_data(3):
        (_, n), (_, rn) = fstep(x, y), rstep(x, y)
        assert rn > 0.1, "the test must clip"
        torch.testing.assert_close(n, rn, rtol=RTOL, atol=ATOL)
    assert_close_training(model, ref, RTOL, ATOL)
    rep = fstep.last_report
    for name in ("m.fc1.weight", "m.fc2.weight"):
        assert rep.row(name).fused and "clip_grad_norm_" in rep.row(name).reason, str(rep)


def test_cuda_graphs_replay_a_clipping_step():
    # judged for a CPU "graph device" (as tests/test_graph_snapshots.py does): the fused updates read the coefficient
    # from their table row, where the step writes it on the device (select_scatter), no host copy left
    from forge_compile import step_graph as sg

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sg.GRAPH_DEVICE[0] = "cpu"
    try:
        rep = forge.compile_train_step(clip_step(model, opt, 0.1), cuda_graphs=True).explain(
            *_mlp_data(1)[0])
    finally:
        sg.GRAPH_DEVICE[0] = "cuda"
    assert any("replayed as one CUDA graph; 4 updates" in n for n in rep.notes), rep.notes
    assert any("2 fused updates read their gradient factor" in n for n in rep.notes), rep.notes


def test_grad_scale_column_holds_the_coefficient():
    from forge_compile.kernels.epilogue_codegen import compile_epilogue
    from forge_compile.passes.scalar_table import grad_scale_column

    for base in (R.adamw_rule(), R.sgd_rule(momentum=True), R.lion_rule()):
        rule = grad_scaled_rule(base)
        col = grad_scale_column(rule)
        ep = compile_epilogue(rule, "cuda")
        hp = [torch.tensor(0.25, dtype=torch.float64)] * len(base.hparams) + [torch.tensor(0.6, dtype=torch.float64)]
        ks = ep.run_host([torch.tensor(2.0) for _ in range(ep.n_scalar_states)], hp)[0]
        assert ks[col] == float(torch.tensor(0.6, dtype=torch.float32))
        assert ep.n_kernel_scalars == compile_epilogue(base, "cuda").n_kernel_scalars + 1
