"""The fused update writes the new weight's low-precision copy (``cast_out``; compile_train_step(
cast_weights_in_update=True)).

Spec: after the launch, ``cast_out`` equals ``weight.to(cast_out.dtype)`` bitwise (torch's cast: round to nearest
even) and W/states are bitwise what the same launch without ``cast_out`` writes. Kernel level here: the CPU impl,
the Triton kernel (interpreted on CPU; on CUDA), the Gluon pointer epilogues (sm_90). The step level (the capture
reading these copies instead of casting W) follows in the second half.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import forge_compile as forge
from forge_compile import capture
from forge_compile.kernels.wgrad_update import wgrad_update, wgrad_update_table
from forge_compile.optim import rules as cat
from interpreter import run_child
from models import Block, CheckpointedLM, TinyLM, rerun_recorder

HAS_CUDA = torch.cuda.is_available()
ADAMW = cat.adamw_rule()
SGDM = cat.sgd_rule(momentum=True, nesterov=False, weight_decay=True)
_HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.9,
       "dampening": 0.0}


def _make(rule, n, k, m, device="cpu", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # weights of magnitude ~ 1 with many mantissa bits below bf16's: every rounding direction occurs
    w = torch.randn(n, k, generator=gen)
    states = []
    for i, name in enumerate(rule.states):
        states.append(torch.tensor(3.0) if rule.is_scalar_state(i) else torch.rand(n, k, generator=gen) * 0.1)
    hp = [torch.tensor(_HP.get(h, 0.01), dtype=torch.float64) for h in rule.hparams]
    dy = torch.randn(m, n, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    dev = lambda t: t.to(device)  # noqa: E731
    return dev(w), dev(dy).t(), dev(x), [s if s.dim() == 0 else dev(s) for s in states], hp


def _check(rule, n, k, m, device="cpu", cast_dtype=torch.bfloat16, launch=None):
    """One launch with cast_out vs the same launch without: W/states bitwise equal, cast_out == W.to(dtype)."""
    w, dy_t, x, st, hp = _make(rule, n, k, m, device)
    w2, st2 = w.clone(), [s.clone() for s in st]
    # poisoned: every element must be written
    out = torch.full((n, k), float("nan"), dtype=cast_dtype, device=device)
    launch = launch or (lambda w_, st_, c: wgrad_update(w_, dy_t, x, st_, hp, rule.name, cast_out=c))
    launch(w, st, out)
    launch(w2, st2, None)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(w, w2), f"W differs in {(w != w2).sum().item()} elements with cast_out"
    for a, b in zip(st, st2):
        assert torch.equal(a, b)
    assert not out.isnan().any()
    assert torch.equal(out, w.to(cast_dtype)), f"cast_out differs in {(out != w.to(cast_dtype)).sum().item()}"


# ---- CPU impl ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", [ADAMW, SGDM], ids=lambda r: r.name)
@pytest.mark.parametrize("cast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_impl_writes_the_cast_of_the_new_weight(rule, cast_dtype, monkeypatch):
    from forge_compile.kernels import wgrad_update_cpu as cpu_impl

    # ragged blocks: the copy is written block by block
    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_BYTES", 4 * 200)
    monkeypatch.setattr(cpu_impl, "_CPU_BLOCK_MIN_ROWS", 16)
    _check(rule, 67, 45, 31, cast_dtype=cast_dtype)


def test_cpu_impl_generic_rule_writes_the_cast():
    # a rule without a fast path (Lion) goes through _generic
    _check(cat.lion_rule(), 40, 24, 9)


def test_cast_out_is_checked_before_anything_is_written():
    w, dy_t, x, st, hp = _make(ADAMW, 8, 8, 4)
    w0 = w.clone()
    for bad in (torch.empty(8, 8), torch.empty(8, 4, dtype=torch.bfloat16),
                torch.empty(8, 8, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="cast_out"):
            wgrad_update(w, dy_t, x, st, hp, ADAMW.name, cast_out=bad)
    with pytest.raises(ValueError, match="one side output"):
        wgrad_update(w, dy_t, x, st, hp, ADAMW.name, grad_out=torch.empty(8, 8),
                     cast_out=torch.empty(8, 8, dtype=torch.bfloat16))
    assert torch.equal(w, w0)


def test_op_bumps_the_version_of_cast_out():
    # the step's runtime tells a copy written by the update from one changed behind its back by versions
    w, dy_t, x, st, hp = _make(ADAMW, 8, 8, 4)
    out = torch.empty(8, 8, dtype=torch.bfloat16)
    v = out._version
    torch.ops.forge.wgrad_update_(w, dy_t, x, st, hp, ADAMW.name, cast_out=out)
    assert out._version > v
    assert torch.equal(out, w.bfloat16())


# ---- Triton kernel, interpreted ------------------------------------------------------------------------

def test_interpreter_tests_in_subprocess():
    run_child(__file__)


def _interp_configs():
    from forge_compile.kernels.wgrad_update_triton import CONFIGS

    return [c for c in CONFIGS if c.startswith("interp")]


@pytest.mark.parametrize("config", _interp_configs())
@pytest.mark.parametrize("rule", [ADAMW, SGDM], ids=lambda r: r.name)
@pytest.mark.parametrize("shape", [(67, 45, 31), (64, 128, 64)], ids=lambda s: "x".join(map(str, s)))
def test_interpreter_triton_kernel_writes_the_cast(interpret, rule, config, shape):
    # every knob of the template (epilogue split, pipelining, prefetch; TMA configs take the pointer path)
    from forge_compile.kernels.wgrad_update_triton import launch_wgrad_update

    w, dy_t, x, st, hp = _make(rule, *shape)

    def launch(w_, st_, c):
        launch_wgrad_update(w_, dy_t, x, st_, hp, rule, side_out=c, config=config)
    _check(rule, *shape, launch=launch)


def test_interpreter_fp16_cast(interpret):
    _check(SGDM, 67, 45, 31, cast_dtype=torch.float16)


def test_interpreter_table_launch_writes_the_cast(interpret):
    from forge_compile.kernels.wgrad_update_triton import rule_scalars

    n, k, m = 67, 45, 31
    w, dy_t, x, st, hp = _make(ADAMW, n, k, m)
    tensor_states = [s for i, s in enumerate(st) if not ADAMW.is_scalar_state(i)]
    scalar_states = [s for i, s in enumerate(st) if ADAMW.is_scalar_state(i)]
    values, _ = rule_scalars(ADAMW, scalar_states, hp, "interpret")
    table = torch.tensor(values, dtype=torch.float32)

    def launch(w_, st_, c):
        wgrad_update_table(w_, dy_t, x, [s for s in st_ if s.dim()], table, ADAMW.name, cast_out=c)
    _check(ADAMW, n, k, m, launch=launch)
    assert tensor_states   # the launch above ran on the tensor states


# ---- CUDA ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rule", [ADAMW, SGDM], ids=lambda r: r.name)
@pytest.mark.parametrize("m", [64, 1000, 2048])
def test_cuda_default_launch_writes_the_cast(rule, m):
    # whatever path the launch takes here (Gluon on sm_90: the smem / split pick, or the smem kernel where the
    # pick is the TMA ring; the Triton kernel elsewhere)
    _check(rule, 1024, 768, m, device="cuda")
    _check(rule, 1000, 776, m, device="cuda")   # ragged tiles


def _sm90() -> bool:
    if not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0):
        return False
    from forge_compile.kernels import wgrad_update_gluon as wg

    return wg.gluon_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU with triton.experimental.gluon")
@pytest.mark.parametrize("epi", ["smem", "split", "vec", "split_hoist"])
@pytest.mark.parametrize("rule", [ADAMW, SGDM], ids=lambda r: r.name)
def test_cuda_gluon_pointer_epilogues_write_the_cast(rule, epi):
    import dataclasses

    from forge_compile.kernels import wgrad_update_gluon as wg

    cfg = {"smem": wg.smem_config(), "split": wg.split_config(), "vec": wg.vec_config(),
           "split_hoist": dataclasses.replace(wg.split_config(), hoist=True)}[epi]
    for n, k, m in ((1024, 768, 700), (1000, 776, 333)):
        w, dy_t, x, st, hp = _make(rule, n, k, m, "cuda")

        def launch(w_, st_, c):
            wg.launch(w_, dy_t, x, st_, hp, rule, side_out=c, config=cfg, max_ctas=5)
        _check(rule, n, k, m, device="cuda", launch=launch)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU with triton.experimental.gluon")
def test_cuda_gluon_tma_ring_refuses_the_cast():
    from forge_compile.kernels import wgrad_update_gluon as wg

    w, dy_t, x, st, hp = _make(SGDM, 256, 256, 128, "cuda")
    with pytest.raises(ValueError, match="cast copy"):
        wg.launch(w, dy_t, x, st, hp, SGDM, side_out=torch.empty_like(w, dtype=torch.bfloat16),
                  config=wg._pick_tma(128, 2))


# ---- the step: compile_train_step(cast_weights_in_update=True) ---------------------------------------------------


def _lm_batches(n, seed=1, vocab=40):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g))
            for _ in range(n)]


def _train_lm(cast, batches, edit=None, dtype=torch.bfloat16, tied=False, **options):
    """TinyLM under CPU autocast through compile_train_step; ``edit(model, opt, i)`` runs before step i."""
    torch.manual_seed(0)
    m = TinyLM(tied=tied)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    @forge.compile_train_step(cast_weights_in_update=cast, **options)
    def step(idx, tgt):
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(m(idx).float().flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for i, (x, y) in enumerate(batches):
        if edit is not None:
            edit(m, opt, i)
        losses.append(step(x, y))
    return m, opt, losses, step


def _same(run_a, run_b):
    (m1, o1, l1, _), (m2, o2, l2, _) = run_a, run_b
    assert [a.item() for a in l1] == [b.item() for b in l2]
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), f"{n} differs in {(a != b).sum().item()} elements"
        for k, s in o1.state[a].items():
            assert torch.equal(s, o2.state[b][k]), (n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_step_with_weight_casts_in_the_update_is_bitwise_the_same(dtype):
    batches = _lm_batches(4)
    capture.counters.clear()
    on = _train_lm(True, batches, dtype=dtype)
    _same(on, _train_lm(False, batches, dtype=dtype))
    m, _, _, step = on
    rep = step.last_report
    # TinyLM's five linear weights are fused (qkv, proj, up, down, head), each one's copy is the update's; the
    # embedding's update is fused too, without a copy (its forward gathers fp32 rows)
    assert len(rep.fused) == 6
    assert any("5 fused weights' low-precision copies are written by their update" in n for n in rep.notes), rep.notes
    # made once, never cast again: the updates kept them current
    assert capture.counters["weight_casts_made"] == 5 and not capture.counters["weight_casts_refreshed"]
    for name in ("block.qkv.weight", "block.proj.weight", "block.up.weight", "block.down.weight", "head.weight"):
        p = m.get_parameter(name)
        assert torch.equal(capture._WEIGHT_CASTS[p][dtype][0], p.detach().to(dtype)), name


def test_the_graph_reads_the_copies_instead_of_casting(monkeypatch):
    # the rewritten graph: no cast of a fused weight left; each fused update writes its copy (cast_out)
    from forge_compile.passes import weight_cast_in_update as wc

    seen = []
    real = wc.cast_weights_in_update

    def spy(gm, names, before):
        out = real(gm, names, before)
        seen.append((gm, out))
        return out
    monkeypatch.setattr(capture, "cast_weights_in_update", spy)
    _train_lm(True, _lm_batches(1))
    (gm, casts), = seen
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.forge.wgrad_update_.default]
    assert len(fused) == 5 and all(n.kwargs.get("cast_out") is not None for n in fused)
    weights = {n.args[0] for n in fused}
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default and n.args[0] in weights]
    assert [c.placeholder for c in casts] == [n.kwargs["cast_out"] for n in fused] or \
        {c.placeholder for c in casts} == {n.kwargs["cast_out"] for n in fused}
    # every reader of a copy (the forward's mm, the backward's dX mm) precedes its update
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for f in fused:
        ph = f.kwargs["cast_out"]
        readers = [u for u in ph.users if u is not f]
        assert readers and all(pos[r] < pos[f] for r in readers)


def test_checkpointed_step_reads_the_copies_in_the_recompute_too(monkeypatch):
    # activation checkpointing runs each block's forward -- its weight casts included -- again in the backward:
    # both reads take the update's copy (no cast of a fused weight left), and training is bitwise the same
    from forge_compile.passes import weight_cast_in_update as wc

    seen = []
    real = wc.cast_weights_in_update
    monkeypatch.setattr(capture, "cast_weights_in_update", lambda gm, *a: seen.append(gm) or real(gm, *a))

    def train(cast):
        torch.manual_seed(0)
        m = CheckpointedLM()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

        @forge.compile_train_step(cast_weights_in_update=cast)
        def step(idx, tgt):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(idx).float().flatten(0, 1), tgt.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return m, opt, [step(x, y) for x, y in _lm_batches(4)], step

    on = train(True)
    _same(on, train(False))
    assert len(on[3].last_report.fused) == 10       # 4 per block, the head, the embedding (without a copy)
    gm, = seen
    fused = [n for n in gm.graph.nodes if n.target is torch.ops.forge.wgrad_update_.default]
    assert len(fused) == 9 and all(n.kwargs.get("cast_out") is not None for n in fused)
    weights = {n.args[0] for n in fused}
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default and n.args[0] in weights]


def _edit_in_place(m, opt, i):
    if i == 2:
        with torch.no_grad():
            m.head.weight.mul_(0.5)
            m.block.up.weight.add_(0.01)


def _reload(m, opt, i):
    if i == 2:
        sd = {k: v * 0.9 for k, v in m.state_dict().items()}
        m.load_state_dict(sd)


def _new_storage(m, opt, i):
    # a new storage under the same Parameter (vector_to_parameters, swapping EMA weights in): the version counter
    # stays, the data pointer moves
    if i == 2:
        m.head.weight.data = m.head.weight.detach() * 0.5


@pytest.mark.parametrize("edit", [_edit_in_place, _reload, _new_storage], ids=["in_place", "load_state_dict",
                                                                               "new_storage"])
def test_a_weight_changed_between_steps_is_cast_again(edit):
    batches = _lm_batches(4)
    capture.counters.clear()
    on = _train_lm(True, batches, edit=edit)
    assert capture.counters["weight_casts_refreshed"] >= {_edit_in_place: 2, _reload: 5, _new_storage: 1}[edit]
    _same(on, _train_lm(False, batches, edit=edit))


def test_a_data_write_is_not_seen(request):
    # the documented hazard: ``.data`` has its own version counter, so the copy goes stale; this pins it down (if
    # torch ever shares the counter, the option may lose its warning)
    batches = _lm_batches(3)

    def edit(m, opt, i):
        if i == 2:
            m.head.weight.data.mul_(0.5)
    m, _, _, _ = _train_lm(True, batches, edit=edit)
    ref, _, _, _ = _train_lm(False, batches, edit=edit)
    assert not torch.equal(m.head.weight, ref.head.weight)


def test_fp32_step_has_nothing_to_cast():
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

    @forge.compile_train_step(cast_weights_in_update=True)
    def step(idx, tgt):
        loss = F.cross_entropy(m(idx).flatten(0, 1), tgt.flatten())
        loss.backward(); opt.step(); opt.zero_grad()
        return loss
    x, y = _lm_batches(1)[0]
    step(x, y)
    assert any("0 fused weights' low-precision copies" in n for n in step.last_report.notes)


def test_tied_weight_and_options_that_exclude_each_other():
    # a tied embedding/head weight is fused (the head's mm + the embedding's rows); the head's forward and dX read
    # its bf16 copy, the embedding gathers fp32 rows: the copy is the update's as for the other weights
    batches = _lm_batches(3)
    on = _train_lm(True, batches, tied=True)
    _same(on, _train_lm(False, batches, tied=True))
    assert any("5 fused weights' low-precision copies" in n for n in on[3].last_report.notes)
    with pytest.raises(TypeError, match="exclude each other"):
        forge.compile_train_step(lambda: None, cast_weights_in_update=True, recompute_weight_copies=True)


# ---- the step replayed as a graph (CPU: the recorder re-runs the step; the table launches interpreted) ----------

def test_interpreter_replayed_step_with_weight_casts(interpret):
    from forge_compile import step_graph as sg

    sg.GRAPH_DEVICE[0] = "cpu"
    sg.RECORDER[0] = rerun_recorder
    try:
        def run(cast):
            sg.counters.clear()
            capture.counters.clear()
            torch.manual_seed(0)
            model = Block(32)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            gen = torch.Generator().manual_seed(0)
            batches = [(torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen))
                       for _ in range(5)]

            @forge.compile_train_step(cuda_graphs=True, cast_weights_in_update=cast)
            def step(x, y):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.mse_loss(model(x).float(), y)
                loss.backward(); opt.step(); opt.zero_grad()
                return loss
            losses = []
            for i, (x, y) in enumerate(batches):
                if i == 3:   # between replays: the copy is cast again in place (same address: no recapture)
                    with torch.no_grad():
                        model.up.weight.mul_(0.5)
                losses.append(step(x, y))
            return model, opt, losses, step, dict(sg.counters), dict(capture.counters)
        on, off = run(True), run(False)
        assert on[4].get("replays") == 3 and not on[4].get("recaptures"), (on[4], on[3].last_report.notes)
        assert on[5].get("weight_casts_refreshed") == 1
        assert any("4 fused weights' low-precision copies" in n for n in on[3].last_report.notes)
        _same(on[:4], off[:4])
    finally:
        sg.GRAPH_DEVICE[0] = "cuda"
        sg.RECORDER[0] = sg.cuda_graph_recorder
