"""compile_train_step(cuda_graphs=True): the step replayed as one graph, its per-step scalars from a device table.

Spec: a replayed step computes exactly what the same step computes without a graph (the table path run eagerly:
a capture that fails leaves it there), over steps whose lr, step counter and batch change, across a replaced
optimizer state (captured again); where a step cannot be replayed, it runs as without the option and the report
says why. On CPU the runtime is tested with a recorder that re-runs the step at each replay (the table ops run in
Triton's interpreter); on a GPU with real CUDA graphs.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("triton")

import forge_compile as forge  # noqa: E402
from forge_compile import step_graph as sg  # noqa: E402
from interpreter import run_child  # noqa: E402
from models import MLP, Block, TinyLM, buffer_reuse_at_compile, clip_step, lm_loss, rerun_recorder  # noqa: E402


def _train(model, opt, cuda_graphs, batches, sched=None, replace_state_at=None, autocast=None):
    """Run the compiled step over ``batches``; returns the losses (as returned, kept) and the step."""
    @forge.compile_train_step(cuda_graphs=cuda_graphs)
    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for i, (x, y) in enumerate(batches):
        if replace_state_at == i:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))     # new state tensors, same values
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            losses.append(step(x, y))
        if sched is not None:
            sched.step()
    return losses, step


def _batches(n, shape_x, shape_y, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape_x, generator=gen).to(device), torch.randn(shape_y, generator=gen).to(device))
            for _ in range(n)]


def _same_state(m1, o1, m2, o2):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), f"{n} differs in {(a != b).sum().item()} elements"
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            w = o2.state[p2][k]
            assert torch.equal(v.cpu(), w.cpu()) if isinstance(v, torch.Tensor) else v == w, k


# ---- CPU, this process: where no graph is possible the step runs as without the option ------------------------

def test_cpu_step_is_not_replayed_and_says_why():
    torch.manual_seed(0)
    m1 = MLP()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    batches = _batches(3, (8, 16), (8, 8), "cpu")
    l1, s1 = _train(m1, o1, True, batches)
    l2, _ = _train(m2, o2, False, batches)
    assert any("not replayed as a CUDA graph" in n and "is on cpu" in n for n in s1.last_report.notes), \
        s1.last_report.notes
    assert [a.item() for a in l1] == [b.item() for b in l2]
    _same_state(m1, o1, m2, o2)


def test_random_numbers_block_the_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    _, step = _train(model, opt, True, _batches(1, (8, 16), (8, 8), "cpu"))
    assert any("random numbers" in n for n in step.last_report.notes), step.last_report.notes


def _notes_judged_for_cpu(step, *args) -> str:
    """The report notes of ``step`` for these arguments, its graph judged as if CPU work could be replayed."""
    sg.GRAPH_DEVICE[0] = "cpu"
    try:
        return " ".join(step.explain(*args).notes)
    finally:
        sg.GRAPH_DEVICE[0] = "cuda"


def test_attention_without_dropout_is_replayed_with_dropout_not():
    # SDPA's kernels are tagged as drawing random numbers (their dropout); with dropout_p == 0 they draw none
    class Attn(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.qkv, self.p = nn.Linear(16, 48), p

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True).sum()

    notes = {}
    for p in (0.0, 0.1):
        model = Attn(p)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        @forge.compile_train_step(cuda_graphs=True)
        def step(x):
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        notes[p] = _notes_judged_for_cpu(step, torch.randn(2, 8, 16))
    assert "replayed as one CUDA graph" in notes[0.0], notes[0.0]
    assert "random numbers" in notes[0.1], notes[0.1]


def test_inductor_cudagraphs_option_means_forge_graphs():
    step = forge.compile_train_step(lambda x: x, options={"triton.cudagraphs": True, "cpp_wrapper": False})
    assert step._cuda_graphs and step._options == {"cpp_wrapper": False}
    step = forge.compile_train_step(lambda x: x, options={"triton.cudagraphs": False})
    assert not step._cuda_graphs and step._options == {}


def test_step_writing_its_argument_is_not_replayed():
    # a replay reads a static copy of the batch: an in-place write to an argument would not reach the caller
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    @forge.compile_train_step(cuda_graphs=True)
    def step(x, y):
        x.mul_(0.5)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    notes = _notes_judged_for_cpu(step, *_batches(1, (8, 16), (8, 8), "cpu")[0])
    assert "writes to the step's tensor argument 0" in notes, notes


def test_step_graph_runtime_order():
    """StepGraph alone: warm-up calls run the step, then one capture, then replays that read the static batch
    copies and return fresh outputs; a moved static input captures again; a failed capture runs eagerly."""
    calls = []

    def fn(w, x, table):
        calls.append("run")
        w.add_(x.sum() * table[0])
        return (w * 1.0,)

    def recorder(f, args):
        calls.append("capture")
        outs = []

        def replay():
            outs[:] = list(f(*args))
        return replay, outs

    sg.GRAPH_DEVICE[0], old = "cpu", sg.GRAPH_DEVICE[0]
    try:
        g = sg.StepGraph(fn, [1], warmup=2, recorder=recorder)
        w, table = torch.zeros(3), torch.ones(1)
        outs = [g([w, torch.full((2,), float(i)), table])[0] for i in range(5)]
        assert calls == ["run", "run", "capture", "run", "run", "run"]
        # each call saw its own batch (static copy refreshed), outputs are not the recorder's tensors
        assert [o[0].item() for o in outs] == [0.0, 2.0, 6.0, 12.0, 20.0]
        assert all(o is not p for o in outs for p in g.outputs)
        w2 = w.clone()                                       # a replaced "parameter": capture again
        g([w2, torch.ones(2), table])
        assert calls[-2:] == ["capture", "run"] and w2[0].item() == 22.0

        def broken(f, args):
            raise RuntimeError("operation not permitted when stream is capturing")
        g2 = sg.StepGraph(fn, [1], warmup=0, recorder=broken)
        g2([w, torch.ones(2), table])
        assert "capture failed" in g2.disabled
    finally:
        sg.GRAPH_DEVICE[0] = old


# ---- interpreter child: the table ops on CPU, a recorder that re-runs the step at each replay ------------------

def test_interpreter_tests_in_subprocess():
    run_child(__file__, timeout=900)


def _failing_recorder(fn, args):
    raise RuntimeError("no capture here")


@pytest.fixture
def cpu_graphs(interpret):
    sg.GRAPH_DEVICE[0] = "cpu"
    sg.counters.clear()
    yield
    sg.GRAPH_DEVICE[0] = "cuda"
    sg.RECORDER[0] = sg.cuda_graph_recorder


def _pair(make_opt, model_fn=MLP, n=6, sched=False, replace_state_at=None, shape=((8, 16), (8, 8))):
    """The same training twice: replayed (recorder re-runs) and with every capture failing (the table path run
    eagerly). Returns both (model, opt, losses)."""
    out = []
    for recorder in (rerun_recorder, _failing_recorder):
        sg.RECORDER[0] = recorder
        torch.manual_seed(0)
        model = model_fn()
        opt = make_opt(model.parameters())
        sch = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if sched else None
        losses, _ = _train(model, opt, True, _batches(n, *shape, "cpu"), sch, replace_state_at)
        out.append((model, opt, losses))
    sg.RECORDER[0] = sg.cuda_graph_recorder
    return out


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, nesterov=False),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True)], ids=["adamw", "sgdm", "adam_amsgrad"])
def test_interpreter_replayed_step_is_the_eager_table_step(cpu_graphs, make_opt):
    (m1, o1, l1), (m2, o2, l2) = _pair(make_opt, sched=True)
    assert sg.counters["replays"] == 4 and sg.counters["capture_failed"] == 1
    assert [a.item() for a in l1] == [b.item() for b in l2]
    assert len({a.item() for a in l1}) == len(l1)        # kept losses are each step's own (outputs cloned)
    _same_state(m1, o1, m2, o2)
    st = o1.state[next(m1.parameters())]
    assert st["step"].item() == 6 if "step" in st else "momentum_buffer" in st


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    # a fresh momentum buffer: torch.optim's first step copies the gradient (forge: dampening 0 that step)
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.5)], ids=["adamw", "sgd_dampening"])
def test_interpreter_replayed_step_follows_eager_torch_optim(cpu_graphs, make_opt):
    # the graphed step against plain eager training; not bitwise: the fused kernels sum dW in tiles (another
    # order than torch.mm) -- the per-update exactness is tested in test_rule_update / test_wgrad_update_table
    sg.RECORDER[0] = rerun_recorder
    torch.manual_seed(0)
    m1 = MLP()
    m2 = copy.deepcopy(m1)
    o1 = make_opt(m1.parameters())
    o2 = make_opt(m2.parameters())
    batches = _batches(5, (8, 16), (8, 8), "cpu")
    _train(m1, o1, True, batches)
    for x, y in batches:
        F.mse_loss(m2(x), y).backward()
        o2.step()
        o2.zero_grad()
    sg.RECORDER[0] = sg.cuda_graph_recorder
    assert sg.counters["replays"] == 3
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_interpreter_sliced_and_expanded_batch_is_replayed(cpu_graphs):
    # x = data[:, :16] of a [8, 17] tensor: not dense, so clone() would give the static copy other strides than
    # the traced argument's, and the compiled step's stride assert failed the capture (seen with HF's
    # tokens[:, :-1] on the H100, stop 21)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    out = []
    for recorder in (rerun_recorder, _failing_recorder):
        sg.RECORDER[0] = recorder
        sg.counters.clear()
        torch.manual_seed(0)
        model = MLP()
        opt = make(model.parameters())
        # and an expanded target (stride 0: the static copy keeps it, written once per aliased element)
        batches = [(x[:, :16], y[:, :1].expand(8, 8)) for x, y in _batches(5, (8, 17), (8, 8), "cpu")]
        assert not batches[0][0].is_contiguous() and batches[0][1].stride() == (8, 0)
        losses, _ = _train(model, opt, True, batches)
        out.append((model, opt, losses, dict(sg.counters)))
    sg.RECORDER[0] = sg.cuda_graph_recorder
    (m1, o1, l1, c1), (m2, o2, l2, _) = out
    assert c1.get("replays") == 3 and not c1.get("capture_failed"), c1
    assert [a.item() for a in l1] == [b.item() for b in l2]
    _same_state(m1, o1, m2, o2)


def test_interpreter_replayed_step_frees_buffers_at_their_last_use(cpu_graphs, monkeypatch):
    # a replayed graph pays nothing per allocation: Inductor frees each buffer at its last use instead of keeping
    # dead forward buffers for a later (backward) allocation of their size (test_remat_for_backward says why)
    sg.RECORDER[0] = rerun_recorder
    seen = buffer_reuse_at_compile(monkeypatch, steps=3, cuda_graphs=True)
    sg.RECORDER[0] = sg.cuda_graph_recorder
    assert seen == [False] and sg.counters["replays"] == 1


def test_interpreter_replaced_state_is_captured_again(cpu_graphs):
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    (m1, o1, l1), (m2, o2, l2) = _pair(make, replace_state_at=4)
    assert sg.counters["recaptures"] == 1 and sg.counters["captures"] == 2
    assert [a.item() for a in l1] == [b.item() for b in l2]
    _same_state(m1, o1, m2, o2)


def test_interpreter_block_model(cpu_graphs):
    # attention block: layer norms and biases through rule_update, four fused linears, 3-D activations
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)  # noqa: E731
    (m1, o1, l1), (m2, o2, l2) = _pair(make, model_fn=lambda: Block(32), n=4, shape=((2, 8, 32), (2, 8, 32)))
    assert sg.counters["replays"] == 2
    assert [a.item() for a in l1] == [b.item() for b in l2]
    _same_state(m1, o1, m2, o2)


def test_interpreter_clipping_frozen_parameter_and_two_groups(cpu_graphs):
    # clip_grad_value_ clamps every gradient in place (those updates stay unfused: rule_update on the clipped
    # gradient; clip_grad_norm_'s fused weights take their coefficient on the host, which blocks the replay), a
    # frozen parameter gets no update and no table row, two groups give two rules (the table is as wide as the
    # wider one); a fresh SGD momentum buffer starts with dampening 0 (a per-step scalar from the host)
    def run(recorder):
        sg.RECORDER[0] = recorder
        torch.manual_seed(0)
        model = MLP()
        model.fc2.bias.requires_grad_(False)
        opt = torch.optim.SGD([{"params": [model.fc1.weight, model.fc1.bias], "momentum": 0.9, "dampening": 0.5},
                               {"params": [model.fc2.weight, model.fc2.bias], "momentum": 0.0, "lr": 3e-2}],
                              lr=1e-2)

        @forge.compile_train_step(cuda_graphs=True)
        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            return loss

        losses = [step(x, y).item() for x, y in _batches(5, (8, 16), (8, 8), "cpu")]
        return model, opt, losses, step.last_report

    m1, o1, l1, rep = run(rerun_recorder)
    m2, o2, l2, _ = run(_failing_recorder)
    assert any("replayed as one CUDA graph; 3 updates" in n for n in rep.notes), rep.notes
    assert l1 == l2
    _same_state(m1, o1, m2, o2)


def _tied_lm_padded():
    model = TinyLM(tied=True)
    model.emb.padding_idx = 3
    return model


def _lm_batches(n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, y = torch.randint(0, 40, (2, 6), generator=gen), torch.randint(0, 40, (2, 6), generator=gen)
        x[0, :2] = 3    # the padding row's tokens: their rows must not count in the norm
        out.append((x.to(device), y.to(device)))
    return out


@pytest.mark.parametrize("model_name", ["mlp", "tied_lm_padded"])
def test_interpreter_clip_grad_norm_replayed(cpu_graphs, model_name):
    # clip_grad_norm_ keeps the weights fused and the step replayable: each fused update reads the coefficient from
    # its table row, where the step writes it on the device. Replayed == the table path run eagerly (bitwise), and
    # both train like eager torch (SGD: a missing or misplaced coefficient moves the weights by far more than 1e-5).
    # The tied embedding / output weight: its norm from dY, X and the compact rows, in the graph too
    lm = model_name != "mlp"

    def run(recorder):
        sg.RECORDER[0] = recorder
        torch.manual_seed(0)
        model = _tied_lm_padded() if lm else MLP()
        ref = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
        loss_fn = lm_loss if lm else torch.nn.functional.mse_loss
        step = forge.compile_train_step(clip_step(model, opt, 0.05, loss_fn), cuda_graphs=True)
        ref_step = clip_step(ref, ref_opt, 0.05, loss_fn)
        losses = []
        for x, y in (_lm_batches(4, "cpu") if lm else _batches(5, (8, 16), (8, 8), "cpu")):
            losses.append(step(x, y)[0].item())
            ref_step(x, y)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        return model, opt, losses, step.last_report

    m1, o1, l1, rep = run(rerun_recorder)
    m2, o2, l2, _ = run(_failing_recorder)
    n_updates = 11 if lm else 4
    assert any(f"replayed as one CUDA graph; {n_updates} updates" in n for n in rep.notes), rep.notes
    assert any(f"{5 if lm else 2} fused updates read their gradient factor" in n for n in rep.notes), rep.notes
    assert all(r.fused for r in rep.rows if len(r.shape) == 2), str(rep)
    assert l1 == l2
    _same_state(m1, o1, m2, o2)


# ---- CUDA: real graphs --------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused_opt", [False, True], ids=["adamw", "adamw_fused"])
def test_cuda_replayed_step_is_the_eager_table_step(autocast, fused_opt):
    results = []
    for recorder in (sg.cuda_graph_recorder, _failing_recorder):
        sg.RECORDER[0] = recorder
        sg.counters.clear()
        torch.manual_seed(0)
        model = Block(64).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=fused_opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
        losses, step = _train(model, opt, True, _batches(6, (4, 16, 64), (4, 16, 64), "cuda"), sched,
                              autocast=autocast)
        torch.cuda.synchronize()
        results.append((model, opt, [v.item() for v in losses], dict(sg.counters), step.last_report))
    sg.RECORDER[0] = sg.cuda_graph_recorder
    (m1, o1, l1, c1, rep), (m2, o2, l2, c2, _) = results
    assert c1.get("replays") == 4 and not c1.get("capture_failed"), (c1, rep.notes)
    assert c2.get("capture_failed") == 1
    assert l1 == l2
    _same_state(m1, o1, m2, o2)
    if fused_opt:    # the device step of a fused AdamW is written back after each step
        assert o1.state[model_param(m1)]["step"].device.type == "cuda"
        assert o1.state[model_param(m1)]["step"].item() == 6


def model_param(model):
    return next(p for p in model.parameters() if p.dim() == 2)


@cuda
def test_cuda_replayed_step_close_to_unreplayed_route():
    # against the route without cuda_graphs: fused weights read the same scalars, unfused parameters go through
    # rule_update (eager rule math) instead of Inductor's decomposed rule, so the two drift apart by rounding
    torch.manual_seed(0)
    m1 = Block(64).cuda()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-3)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    batches = _batches(5, (4, 16, 64), (4, 16, 64), "cuda")
    _train(m1, o1, True, batches)
    _train(m2, o2, False, batches)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@cuda
@pytest.mark.parametrize("model_name,foreach", [("mlp", None), ("tied_lm_padded", True)])
def test_cuda_replayed_clipping_step_trains_like_eager(model_name, foreach):
    # a real CUDA graph of a step that clips: the coefficient is computed and written into the table rows inside the
    # graph (for the tied embedding / output weight too: its norm from dY, X and the compact rows -- sort, search,
    # gather -- captured; with foreach=True, whose _foreach_norm / _foreach_mul_ the capture takes apart per tensor).
    # fp32 activations, TF32 off: against eager torch (SGD with momentum: scale-sensitive), as
    # tests/test_gpu_train_step.py's fp32 comparisons
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    lm = model_name != "mlp"
    model = (_tied_lm_padded() if lm else MLP(64, 128, 32)).cuda()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    loss_fn = lm_loss if lm else torch.nn.functional.mse_loss
    step = forge.compile_train_step(clip_step(model, opt, 0.05, loss_fn, foreach), cuda_graphs=True)
    ref_step = clip_step(ref, ref_opt, 0.05, loss_fn, foreach)
    replays = sg.counters["replays"]
    for x, y in (_lm_batches(6, "cuda") if lm else _batches(6, (32, 64), (32, 32), "cuda")):
        (_, n), (_, rn) = step(x, y), ref_step(x, y)
        assert rn > 0.1, "the test must clip"
        torch.testing.assert_close(n, rn, rtol=1e-5, atol=0)
    rep = step.last_report
    assert any("replayed as one CUDA graph" in s for s in rep.notes), rep.notes
    assert any("read their gradient factor" in s for s in rep.notes), rep.notes
    assert all(r.fused for r in rep.rows if len(r.shape) == 2), str(rep)
    assert sg.counters["replays"] > replays, dict(sg.counters)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_closure_tensor_is_replayed_like_an_argument_and_writing_it_blocks_the_graph():
    # a tensor the step reads from its closure is an input like its arguments: copied into the graph's buffers at
    # each replay, so the graph may read it -- and may not write it (the write would reach the copy only)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weight = torch.linspace(0.5, 1.5, 8)

    def make(write):
        @forge.compile_train_step(cuda_graphs=True)
        def step(x, y):
            loss = (F.mse_loss(model(x), y, reduction="none") * weight).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if write:
                weight.mul_(1.0)
            return loss
        return step

    x, y = torch.randn(8, 16), torch.randn(8, 8)
    assert "replayed as one CUDA graph" in _notes_judged_for_cpu(make(False), x, y)
    notes = _notes_judged_for_cpu(make(True), x, y)
    assert "not replayed" in notes and "writes to the tensor weight of the step's closure or globals" in notes, notes
