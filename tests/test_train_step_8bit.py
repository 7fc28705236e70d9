"""compile_train_step with forge.optim's 8-bit-state optimizers (AdamW8bit, Lion8bit, Rule8bitOptimizer).

The compiled step is the optimizer's eager step: bit for bit on the 8-bit parameters (their weights, codes, scales
and counts), whether their weight gradient is fused into forge::wgrad_update_q8_ (never materialized) or updated
from the stored gradient (forge::apply_rule_q8_, fuse=False or a case the pass does not fuse, with its reason). The
bitwise comparisons use a model whose weight gradients are exact in any summation order (small-integer inputs and
a loss linear in the outputs), so that any difference is the update's. A checkpoint moves between the compiled and
the eager step; the Dynamo route (backend="forge") fuses them too; cuda_graphs=True runs the step unreplayed.
"""

import pytest
import torch

from interpreter import run_child
import forge_compile as forge
from forge_compile.optim import AdamW8bit, Lion8bit, Rule8bitOptimizer, sgd_rule
from forge_compile.passes import wgrad_update_pattern

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


class _Exact(torch.nn.Module):
    """A 300 x 200 weight (8-bit states: 60000 elements, K = 200 a ragged last block) and a 6 x 200 one with a bias
    (full-precision states), both reading x: with x and the loss's coefficients in {-1, 0, 1} over 32 tokens every
    dW element is an integer of magnitude <= 32, exact in fp32 and bf16 whatever the order of its sum."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(200, 300, bias=False)
        self.small = torch.nn.Linear(200, 6)

    def forward(self, x):
        return self.big(x), self.small(x)


def _model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return _Exact().to(device, dtype)


def _batches(n, dtype=torch.float32, device="cpu", tokens=32):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(-1, 2, shape, generator=g).to(device, dtype)
                  for shape in ((tokens, 200), (tokens, 300), (tokens, 6)))
            for _ in range(n)]


def _loss(model, x, c1, c2):
    a, b = model(x)
    return (a.float() * c1.float()).sum() + (b.float() * c2.float()).sum()


def _eager(model, opt, batches):
    for x, c1, c2 in batches:
        _loss(model, x, c1, c2).backward()
        opt.step()
        opt.zero_grad()


def _compiled(model, opt, **kwargs):
    @forge.compile_train_step(**kwargs)
    def step(x, c1, c2):
        loss = _loss(model, x, c1, c2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _make_opt(which, params):
    if which == "adamw":
        return AdamW8bit(params, **HP, seed=5)
    if which == "lion":
        return Lion8bit(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, seed=5)
    return Rule8bitOptimizer(params, sgd_rule(momentum=True), lr=1e-2, momentum=0.9, dampening=0.0, seed=5)


def _assert_8bit_param_equal(model, opt, ref, ropt, what):
    w, r = model.big.weight, ref.big.weight
    assert torch.equal(w, r), f"{what}: weight, max diff {(w.float() - r.float()).abs().max().item()}"
    st, rst = opt.state[w], ropt.state[r]
    assert set(st) == set(rst) and any(k.endswith("_codes") for k in st), (sorted(st), sorted(rst))
    for k in st:
        assert torch.equal(st[k], rst[k]), f"{what}: state {k}"


def _assert_small_params_close(model, ref, dtype):
    # full-precision states: the rule compiled by Inductor against its eager ops (FMA contractions, a bf16 weight's
    # stochastic rounding of a value that may differ in its last fp32 bit): within test_optim_rules' bounds
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2 ** -7)
    for name in ("small.weight", "small.bias"):
        a, b = dict(model.named_parameters())[name], dict(ref.named_parameters())[name]
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("which,dtype,fuse", [
    ("adamw", torch.float32, True), ("adamw", torch.float32, False), ("adamw", torch.bfloat16, True),
    ("adamw", torch.bfloat16, False), ("lion", torch.float32, True), ("sgd_momentum", torch.float32, True)])
def test_the_compiled_step_is_the_eager_step(which, dtype, fuse):
    batches = _batches(3, dtype)
    model, ref = _model(dtype), _model(dtype)
    opt, ropt = _make_opt(which, model.parameters()), _make_opt(which, ref.parameters())
    step = _compiled(model, opt, fuse=fuse)
    before = wgrad_update_pattern.counters["fused_q8"]
    for x, c1, c2 in batches:
        step(x, c1, c2)
    _eager(ref, ropt, batches)
    assert step.compile_count == 1
    _assert_8bit_param_equal(model, opt, ref, ropt, f"{which} {dtype} fuse={fuse}")
    _assert_small_params_close(model, ref, dtype)
    rows = {d.name: d for d in step.last_report.rows}
    big = rows["model.big.weight"]
    assert big.fused == fuse and (big.reason == "8-bit states" if fuse else "fuse=False" in big.reason), big
    assert wgrad_update_pattern.counters["fused_q8"] - before == int(fuse)
    # the small weight keeps full-precision states: fused by the ordinary path (a bf16 one rounded with the
    # optimizer's own key)
    assert rows["model.small.weight"].fused == fuse, rows["model.small.weight"]
    assert "q8_count" in opt.state[model.big.weight] if which == "sgd_momentum" else "step" in opt.state[model.big.weight]


def test_a_checkpoint_moves_between_the_compiled_and_the_eager_step(tmp_path):
    batches = _batches(4)
    model = _model()
    opt = AdamW8bit(model.parameters(), **HP, seed=2)
    step = _compiled(model, opt)
    for b in batches[:2]:
        step(*b)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    for b in batches[2:]:
        step(*b)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    ref = _model()
    ref.load_state_dict(ckpt["model"])
    ropt = AdamW8bit(ref.parameters(), **HP, seed=2)
    ropt.load_state_dict(ckpt["opt"])
    _eager(ref, ropt, batches[2:])
    _assert_8bit_param_equal(model, opt, ref, ropt, "resumed eagerly")
    # and back: the eager optimizer's states loaded under a compiled step of another model (a dict of its own:
    # torch.optim's load_state_dict keeps a CPU ``step`` tensor as it is, shared by optimizers loaded from one dict)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    again = _model()
    again.load_state_dict(ckpt["model"])
    aopt = AdamW8bit(again.parameters(), **HP, seed=2)
    aopt.load_state_dict(ckpt["opt"])
    astep = _compiled(again, aopt)
    for b in batches[2:]:
        astep(*b)
    _assert_8bit_param_equal(again, aopt, ref, ropt, "resumed compiled")


def test_a_changed_seed_or_lr_is_honoured():
    # the seed is traced into the step (the keys are computed in it): a new seed compiles again; lr is a graph input
    batches = _batches(2)
    model, ref = _model(), _model()
    opt, ropt = AdamW8bit(model.parameters(), **HP), AdamW8bit(ref.parameters(), **HP)
    step = _compiled(model, opt)
    step(*batches[0])
    _eager(ref, ropt, batches[:1])
    for o in (opt, ropt):
        o.param_groups[0]["seed"] = 9
        o.param_groups[0]["lr"] = 3e-3
    step(*batches[1])
    _eager(ref, ropt, batches[1:])
    assert step.compile_count == 2
    _assert_8bit_param_equal(model, opt, ref, ropt, "after the change")


def test_clip_grad_norm_is_fused_with_8bit_states():
    # clip_grad_norm_: the norm computed again from dY and X, the gradient scaled in the 8-bit update (the rule's
    # grad_scaled form)
    batches = _batches(2)
    model, ref = _model(), _model()
    opt, ropt = AdamW8bit(model.parameters(), **HP), AdamW8bit(ref.parameters(), **HP)

    @forge.compile_train_step
    def step(x, c1, c2):
        loss = _loss(model, x, c1, c2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    for b in batches:
        step(*b)
    for x, c1, c2 in batches:
        _loss(ref, x, c1, c2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        ropt.zero_grad()
    big = {d.name: d for d in step.last_report.rows}["model.big.weight"]
    assert big.fused and "8-bit states" in big.reason and "clip_grad_norm_" in big.reason, big
    # the clipping coefficient is a norm reduced in another order than eager's: the 8-bit update of a gradient
    # scaled by a factor a few ulps apart may round a state code the other way, so a tolerance (lr-sized steps)
    torch.testing.assert_close(model.big.weight, ref.big.weight, rtol=0, atol=1e-4)
    assert float(opt.state[model.big.weight]["step"]) == 2.0


def test_accumulated_passes_are_fused_with_8bit_states():
    # two backward passes per step: their dY and X concatenated over tokens feed one 8-bit update; the sum of the
    # passes' exact dW is exact too, so bitwise the eager step's. 16 tokens a pass: the passes' operands, kept until
    # the update, are then under half the dW that fusing saves (the pass's condition)
    batches = _batches(4, tokens=16)
    model, ref = _model(), _model()
    opt, ropt = AdamW8bit(model.parameters(), **HP), AdamW8bit(ref.parameters(), **HP)

    @forge.compile_train_step
    def step(a, b):
        for x, c1, c2 in (a, b):
            loss = _loss(model, x, c1, c2)
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for i in (0, 2):
        step(batches[i], batches[i + 1])
        for x, c1, c2 in batches[i:i + 2]:
            _loss(ref, x, c1, c2).backward()
        ropt.step()
        ropt.zero_grad()
    big = {d.name: d for d in step.last_report.rows}["model.big.weight"]
    assert big.fused and "concatenated over tokens" in big.reason, big
    _assert_8bit_param_equal(model, opt, ref, ropt, "accumulated")


def test_a_graphed_step_reads_the_8bit_keys_from_the_table(tmp_path):
    # cuda_graphs=True: the 8-bit updates become forge::*_q8_table_ ops whose rows hold their rounding keys; the
    # graph's key computations (round_key of the CPU counts) and q8_count advances are gone: the runtime does them
    from forge_compile import step_graph as sg

    model = _model()
    opt = _make_opt("sgd_momentum", model.parameters())      # no step: the q8_count advances
    step = _compiled(model, opt, cuda_graphs=True, dump_dir=str(tmp_path))
    sg.GRAPH_DEVICE[0] = "cpu"      # judged as if CPU work could be replayed (no GPU here); explain runs nothing
    try:
        notes = " ".join(step.explain(*_batches(1)[0]).notes)
    finally:
        sg.GRAPH_DEVICE[0] = "cuda"
    assert "replayed as one CUDA graph" in notes and "2 updates with 8-bit states" not in notes, notes
    assert "1 updates with 8-bit states read their step's rounding keys" in notes, notes
    code = next(tmp_path.glob("*rewritten.py")).read_text()
    assert "forge.wgrad_update_q8_table_(" in code and "forge.wgrad_update_q8_(" not in code, code
    assert "add_(" not in code and "bitwise_xor" not in code, code
    assert float(opt.state[model.big.weight].get("q8_count", 0.0)) == 0.0      # explain advances nothing


def test_a_graphed_cpu_step_declines_with_the_reason():
    model, ref = _model(), _model()
    opt, ropt = AdamW8bit(model.parameters(), **HP), AdamW8bit(ref.parameters(), **HP)
    step = _compiled(model, opt, cuda_graphs=True)
    batches = _batches(2)
    for b in batches:
        step(*b)
    _eager(ref, ropt, batches)
    assert any("not replayed as a CUDA graph" in n and "is on cpu" in n for n in step.last_report.notes), \
        step.last_report.notes
    _assert_8bit_param_equal(model, opt, ref, ropt, "cuda_graphs=True, not replayed")


def _replayed_step_is_the_eager_step(which, dtype, device, what, n_steps=4):
    # two warm-up calls, a capture, replays (on CPU the recorder re-runs the step), each reading a table row that
    # the runtime wrote before the call: bitwise the eager optimizer on the 8-bit weight, its counts advanced
    from forge_compile import step_graph as sg

    batches = _batches(n_steps, dtype, device)
    model, ref = _model(dtype, device), _model(dtype, device)
    opt, ropt = _make_opt(which, model.parameters()), _make_opt(which, ref.parameters())
    step = _compiled(model, opt, cuda_graphs=True)
    sg.counters.clear()
    for b in batches:
        step(*b)
    _eager(ref, ropt, batches)
    assert sg.counters.get("replays") == n_steps - 2, (dict(sg.counters), step.last_report.notes)
    assert any("updates with 8-bit states read their step's rounding keys" in n for n in step.last_report.notes)
    _assert_8bit_param_equal(model, opt, ref, ropt, what)
    _assert_small_params_close(model, ref, dtype)
    count = "q8_count" if which == "sgd_momentum" else "step"
    assert float(opt.state[model.big.weight][count]) == n_steps


@pytest.mark.parametrize("which,dtype", [("adamw", torch.float32), ("sgd_momentum", torch.bfloat16)])
def test_interpreter_replayed_8bit_step_is_the_eager_step(interpret, which, dtype):
    from forge_compile import step_graph as sg
    from models import rerun_recorder

    sg.GRAPH_DEVICE[0], sg.RECORDER[0] = "cpu", rerun_recorder
    try:
        _replayed_step_is_the_eager_step(which, dtype, "cpu", f"interpreter, replayed, {which} {dtype}")
    finally:
        sg.GRAPH_DEVICE[0], sg.RECORDER[0] = "cuda", sg.cuda_graph_recorder


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("which,dtype,path", [
    ("adamw", torch.float32, ""), ("adamw", torch.bfloat16, ""), ("adamw", torch.float32, "fused"),
    ("lion", torch.bfloat16, "blocked"), ("sgd_momentum", torch.float32, ""), ("adamw", torch.bfloat16, "gluon")])
def test_cuda_replayed_8bit_step_is_the_eager_step(monkeypatch, which, dtype, path):
    if path:
        monkeypatch.setenv("FORGE_Q8_PATH", path)
    _replayed_step_is_the_eager_step(which, dtype, "cuda", f"cuda graph, {which} {dtype} {path or 'default'}", 5)


@pytest.mark.parametrize("which", ["adamw", "lion"])
def test_the_dynamo_route_is_the_eager_step(which):
    # backend="forge": the 8-bit weight's update runs inside loss.backward() (its .grad stays None), opt.step()
    # updates the rest; the result is the eager optimizer's, bit for bit on the 8-bit weight, its count advanced
    from forge_compile import backend

    batches = _batches(3)
    model, ref = _model(), _model()
    opt, ropt = _make_opt(which, model.parameters()), _make_opt(which, ref.parameters())
    cm = torch.compile(model, backend="forge", options={"optimizer": opt})
    backend.clear_reports()
    for x, c1, c2 in batches:
        _loss(cm, x, c1, c2).backward()
        assert model.big.weight.grad is None and model.small.bias.grad is not None
        opt.step()
        opt.zero_grad()
    _eager(ref, ropt, batches)
    rows = {d.name.split(".")[-2] + "." + d.name.split(".")[-1]: d for d in backend.last_report().rows}
    assert rows["big.weight"].fused and "8-bit states" in rows["big.weight"].reason, rows
    _assert_8bit_param_equal(model, opt, ref, ropt, f"backend, {which}")
    _assert_small_params_close(model, ref, torch.float32)
    assert float(opt.state[model.big.weight]["step"]) == 3.0      # (Lion's rule counts its steps too)


def _dynamo_route_with_a_table_is_the_eager_step(which, dtype, device, options):
    # scalar_table: the 8-bit updates in the backward read their scalars and keys from the table's rows, which the
    # runtime fills before each backward from each parameter's own count (read before the count advances)
    from forge_compile import backend

    batches = _batches(3, dtype, device)
    model, ref = _model(dtype, device), _model(dtype, device)
    opt, ropt = _make_opt(which, model.parameters()), _make_opt(which, ref.parameters())
    cm = torch.compile(model, backend="forge", options={"optimizer": opt, **options})
    backend.clear_reports()
    for x, c1, c2 in batches:
        _loss(cm, x, c1, c2).backward()
        opt.step()
        opt.zero_grad()
    _eager(ref, ropt, batches)
    notes = " ".join(backend.last_report().notes)
    assert "1 updates with 8-bit states read their rounding keys from their row" in notes, notes
    _assert_8bit_param_equal(model, opt, ref, ropt, f"backend, scalar table, {which} {dtype}")
    _assert_small_params_close(model, ref, dtype)
    count = "q8_count" if which == "sgd_momentum" else "step"
    assert float(opt.state[model.big.weight][count]) == 3.0


@pytest.mark.parametrize("which,dtype", [("adamw", torch.float32), ("sgd_momentum", torch.bfloat16)])
def test_interpreter_the_dynamo_route_with_a_scalar_table_is_the_eager_step(interpret, which, dtype):
    _dynamo_route_with_a_table_is_the_eager_step(which, dtype, "cpu", {"scalar_table": True})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("which,dtype", [("adamw", torch.bfloat16), ("sgd_momentum", torch.float32)])
def test_cuda_the_dynamo_route_with_cuda_graphs_is_the_eager_step(which, dtype):
    # triton.cudagraphs turns the scalar table on: Inductor's CUDA graphs replay the backward with the 8-bit updates
    _dynamo_route_with_a_table_is_the_eager_step(which, dtype, "cuda", {"triton.cudagraphs": True})


def test_the_dynamo_route_counts_a_rule_without_a_step():
    # SGD-momentum's rule has no step: the 8-bit weight's q8_count advances once per fused backward
    batches = _batches(2)
    model, ref = _model(), _model()
    opt, ropt = _make_opt("sgd_momentum", model.parameters()), _make_opt("sgd_momentum", ref.parameters())
    cm = torch.compile(model, backend="forge", options={"optimizer": opt})
    for x, c1, c2 in batches:
        _loss(cm, x, c1, c2).backward()
        opt.step()
        opt.zero_grad()
    _eager(ref, ropt, batches)
    _assert_8bit_param_equal(model, opt, ref, ropt, "backend, sgd-momentum")
    assert float(opt.state[model.big.weight]["q8_count"]) == 2.0


def test_interpreter_tests_in_subprocess():
    pytest.importorskip("triton")
    run_child(__file__)


@pytest.mark.parametrize("path", ["fused", "blocked"])
def test_interpreter_kernel_paths_are_the_eager_step(interpret, monkeypatch, path):
    # the Triton kernels (fused GEMM + 8-bit update, or the blocked path: mm per block of rows + the stored-dW
    # update), against the eager step's stored-dW kernel
    monkeypatch.setenv("FORGE_Q8_PATH", path)
    _kernel_path_is_the_eager_step(2, torch.float32, "cpu", f"interpreter, {path}")


def _kernel_path_is_the_eager_step(n_steps, dtype, device, what, gluon=False):
    batches = _batches(n_steps, dtype, device)
    model, ref = _model(dtype, device), _model(dtype, device)
    opt, ropt = AdamW8bit(model.parameters(), **HP), AdamW8bit(ref.parameters(), **HP)
    step = _compiled(model, opt)
    for b in batches:
        step(*b)
    _eager(ref, ropt, batches)
    big = {d.name: d for d in step.last_report.rows}["model.big.weight"]
    assert big.fused and ("on the Gluon kernel" in big.reason) == gluon, big
    _assert_8bit_param_equal(model, opt, ref, ropt, what)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("path", ["", "fused", "blocked", "gluon"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_the_compiled_step_is_the_eager_step(monkeypatch, path, dtype):
    if path:
        monkeypatch.setenv("FORGE_Q8_PATH", path)
    # the Gluon kernel takes bf16 activations on sm_90 (the report says so); fp32 ones stay on the blocked path
    gluon = path == "gluon" and dtype == torch.bfloat16 and torch.cuda.get_device_capability() == (9, 0)
    _kernel_path_is_the_eager_step(3, dtype, "cuda", f"cuda {dtype} {path or 'default'}", gluon)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("which", ["adamw", "sgd_momentum"])
def test_cuda_the_dynamo_route_is_the_eager_step(which):
    # sgd_momentum: one 8-bit state at 32 tokens, the fused kernel's case by default (use_blocked); AdamW the blocked
    # path's
    batches = _batches(3, device="cuda")
    model, ref = _model(device="cuda"), _model(device="cuda")
    opt, ropt = _make_opt(which, model.parameters()), _make_opt(which, ref.parameters())
    cm = torch.compile(model, backend="forge", options={"optimizer": opt})
    for x, c1, c2 in batches:
        _loss(cm, x, c1, c2).backward()
        assert model.big.weight.grad is None
        opt.step()
        opt.zero_grad()
    _eager(ref, ropt, batches)
    _assert_8bit_param_equal(model, opt, ref, ropt, f"cuda backend {which}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_an_autocast_mlp_trains_like_the_eager_optimizer():
    # bf16 autocast, fp32 master weights, 1024-wide: dW is not exact here (cuBLAS vs the kernels' sums), so the
    # compiled and eager runs are compared within a tolerance after 5 steps: lr-sized steps, a code rounded the
    # other way moves one element by at most ~lr
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024)).cuda()
    ref.load_state_dict(model.state_dict())
    opt, ropt = AdamW8bit(model.parameters(), lr=1e-3), AdamW8bit(ref.parameters(), lr=1e-3)
    xs = [torch.randn(512, 1024, device="cuda") for _ in range(5)]

    def loss_of(m, x):
        with torch.autocast("cuda", torch.bfloat16):
            return (m(x).float() - x).pow(2).mean()

    @forge.compile_train_step
    def step(x):
        loss = loss_of(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for x in xs:
        loss = step(x)
        rl = loss_of(ref, x)
        rl.backward()
        ropt.step()
        ropt.zero_grad()
    assert all(d.fused for d in step.last_report.rows if d.name.endswith("weight")), step.last_report
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=5e-3 * 1.5, msg=lambda m: f"{name}: {m}")
    assert abs(loss.item() - rl.item()) <= 0.02 * rl.item()


def test_salts_skip_nothing_and_a_reloaded_state_is_read_again(tmp_path):
    # the rounding salt is the parameter's index in the optimizer, counting parameters without a gradient (an unused
    # 8-bit-sized one first here) as the eager step does; a load_state_dict between compiled steps replaces the state
    # objects, which the compiled step reads afresh (and a second param group with its own seed keys its own bits)
    batches = _batches(4)
    model, ref = _model(), _model()
    model.unused = torch.nn.Parameter(torch.randn(64, 128))      # held by the model, read by no forward
    ref.unused = torch.nn.Parameter(model.unused.detach().clone())
    unused, ref_unused = model.unused, ref.unused

    def groups(m, u):
        return [{"params": [u, m.big.weight]}, {"params": list(m.small.parameters()), "seed": 11}]
    opt, ropt = AdamW8bit(groups(model, unused), **HP), AdamW8bit(groups(ref, ref_unused), **HP)
    step = _compiled(model, opt)
    for b in batches[:2]:
        step(*b)
    _eager(ref, ropt, batches[:2])
    _assert_8bit_param_equal(model, opt, ref, ropt, "with an unused parameter first")
    # (forge prepares every parameter's state up front, as for torch's optimizers: the unused one's stays at step 0)
    assert torch.equal(unused, ref_unused) and float(opt.state[unused].get("step", 0)) == 0
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    for b in batches[2:]:
        step(*b)
    opt.load_state_dict(torch.load(tmp_path / "opt.pt"))      # back two steps: new state objects
    ropt.load_state_dict(torch.load(tmp_path / "opt.pt"))
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters()):
            p.copy_(r)
    for b in batches[2:]:
        step(*b)
    _eager(ref, ropt, batches[2:])
    _assert_8bit_param_equal(model, opt, ref, ropt, "after load_state_dict")
    _assert_small_params_close(model, ref, torch.float32)


def _embedding_batches(n, device="cpu"):
    # 64 tokens over 50 ids (repeats: rows summed), id 3 the padding row; coefficients in {-1, 0, 1}: exact sums
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 50, (4, 16), generator=g).to(device),
             torch.randint(-1, 2, (4, 16, 64), generator=g).float().to(device)) for _ in range(n)]


def _embedding_model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Embedding(1000, 64, padding_idx=3).to(device)      # 64000 elements: 8-bit states


def _embedding_step_is_the_eager_step(route="step", device="cpu"):
    # forge::embedding_update_q8_: the dense gradient one row block at a time from the tokens' compact rows (each
    # row bitwise autograd's), so the update is the eager step's on the dense gradient, bit for bit
    batches = _embedding_batches(4 if route == "graphs" else 3, device)
    model, ref = _embedding_model(device), _embedding_model(device)
    opt, ropt = AdamW8bit(model.parameters(), **HP), AdamW8bit(ref.parameters(), **HP)

    def loss_of(m, idx, c):
        return (m(idx) * c).sum()
    if route == "backend":
        from forge_compile import backend

        backend.clear_reports()
        cm = torch.compile(model, backend="forge", options={"optimizer": opt})
        for idx, c in batches:
            loss_of(cm, idx, c).backward()
            assert model.weight.grad is None
            opt.step()
            opt.zero_grad()
        row = backend.last_report().rows[0]
    else:
        @forge.compile_train_step(fuse=route != "step_unfused", cuda_graphs=route == "graphs")
        def step(idx, c):
            loss = loss_of(model, idx, c)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        for b in batches:
            step(*b)
        row = step.last_report.rows[0]
        if route == "graphs":
            assert any("replayed as one CUDA graph" in n for n in step.last_report.notes), step.last_report.notes
    for idx, c in batches:
        loss_of(ref, idx, c).backward()
        ropt.step()
        ropt.zero_grad()
    assert row.fused == (route != "step_unfused"), row
    if row.fused:
        assert "8-bit states, embedding: its dense gradient made a row block at a time" in row.reason, row
    assert torch.equal(model.weight, ref.weight), (model.weight - ref.weight).abs().max()
    for k in opt.state[model.weight]:
        assert torch.equal(opt.state[model.weight][k], ropt.state[ref.weight][k]), k


@pytest.mark.parametrize("route", ["step", "step_unfused", "backend"])
def test_an_embedding_with_8bit_states_is_the_eager_step(route):
    _embedding_step_is_the_eager_step(route)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_an_embedding_with_8bit_states_is_the_eager_step():
    _embedding_step_is_the_eager_step(device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_a_replayed_embedding_with_8bit_states_is_the_eager_step():
    # forge::embedding_update_q8_table_ in a CUDA graph: compact rows and row blocks of static shapes, no host sync
    _embedding_step_is_the_eager_step("graphs", device="cuda")


def test_interpreter_an_embedding_with_8bit_states_is_the_eager_step(interpret):
    # the blocked path's Triton update on the embedding's dense row blocks, against the eager step's kernel
    _embedding_step_is_the_eager_step()



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_the_blocked_paths_mm_reads_row_slices_of_a_transposed_operand():
    # the blocked path's dW block: torch.mm(out_dtype=fp32) of rows r0..r1 of dy_t = dY.t() (a transposed view, as
    # the step's graph passes it) against the same product of fp32 copies (bf16 products are exact in fp32: only the
    # summation order differs)
    from forge_compile.kernels.wgrad_norm import _mm_fp32

    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(512, 5632, device="cuda", generator=g).bfloat16()
    x = torch.randn(512, 2048, device="cuda", generator=g).bfloat16()
    dy_t = dy.t()
    for r0, r1 in ((0, 4096), (4096, 5632), (1000, 1100)):
        got = _mm_fp32(dy_t[r0:r1], x)
        want = dy_t[r0:r1].float() @ x.float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-5, (r0, r1, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("path,fuse,autocast", [("", True, True), ("fused", True, True), ("gluon", True, True),
                                                ("", False, True), ("", True, False)])
def test_cuda_one_step_of_a_wide_mlp_moves_the_states_as_eager(monkeypatch, path, fuse, autocast):
    # the end-to-end shapes (a 5632 x 2048 weight: two 32 MiB row blocks): after one step the compiled and eager
    # AdamW8bit's first moments (0.1 x dW, 8-bit) must agree up to the codes' rounding and bf16 dW rounding -- a
    # wrong or misplaced dW block is ~1.4 apart in this relative norm
    if path:
        monkeypatch.setenv("FORGE_Q8_PATH", path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 5632, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(5632, 2048, bias=False)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(2048, 5632, bias=False), torch.nn.GELU(),
                              torch.nn.Linear(5632, 2048, bias=False)).cuda()
    ref.load_state_dict(model.state_dict())
    opt, ropt = AdamW8bit(model.parameters(), lr=1e-3), AdamW8bit(ref.parameters(), lr=1e-3)
    x = torch.randn(2, 256, 2048, device="cuda")

    def loss_of(m, x):
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            return (m(x).float() - x).pow(2).mean()

    @forge.compile_train_step(fuse=fuse, models=[model])
    def step(x):
        loss = loss_of(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step(x)
    loss_of(ref, x).backward()
    ropt.step()
    ropt.zero_grad()
    assert all(d.fused == fuse for d in step.last_report.rows), step.last_report
    errs = {}
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        m, rm = opt.dequantized_state(p)["exp_avg"], ropt.dequantized_state(r)["exp_avg"]
        errs[name] = ((m - rm).norm() / rm.norm()).item()
        # AdamW's first step moves each weight by lr x sign(dW) (x ~1): a wrong sign anywhere shows here
        errs[name + " step"] = ((p - r).abs().max() / 1e-3).item()
    assert all(v < 0.2 for k, v in errs.items() if not k.endswith("step")), errs
    assert all(v < 0.5 for k, v in errs.items() if k.endswith("step")), errs


def test_a_sparse_gradient_is_refused_with_the_reason():
    # as for torch's optimizers: nn.Embedding(sparse=True) is named, before any parameter changes
    emb = torch.nn.Embedding(1000, 64, sparse=True)
    opt = AdamW8bit(emb.parameters(), **HP)
    w0 = emb.weight.detach().clone()

    @forge.compile_train_step
    def step(idx):
        loss = emb(idx).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    with pytest.raises(forge.ForgeCaptureError, match="sparse"):
        step(torch.tensor([[1, 2, 3]]))
    assert torch.equal(emb.weight, w0)
