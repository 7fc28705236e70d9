"""remat_for_backward: cheap forward values are recomputed at their backward use, never across a write."""
import torch
import torch.nn.functional as F

import forge_compile as forge
from forge_compile import _compat
from forge_compile.passes.remat_for_backward import view_root, backward_start, remat_for_backward, weight_copies_kept
from models import MLP, buffer_reuse_at_compile

aten = torch.ops.aten


def _live_across(gm, start):
    """Non-input nodes defined before the backward and read after it began (what stays alive at the
    forward/backward boundary)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    return [n for n in nodes[:start] if n.op == "call_function"
            and any(u.op != "output" and pos[u] >= start for u in n.users)]


def _captured_autocast_mlp(monkeypatch, remat):
    torch.manual_seed(0)
    m = MLP(16, 32, 8)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def fn(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(m(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad()
        return loss

    seen = []       # the step graph as capture hands it to the pass (and after it, when remat)

    def hook(gm, n_forward_outputs):
        done = remat_for_backward(gm, n_forward_outputs) if remat else 0
        seen.append((gm, n_forward_outputs))
        return done
    with monkeypatch.context() as mp:
        mp.setattr("forge_compile.capture.remat_for_backward", hook)
        forge.explain(forge.compile_train_step(fn), torch.randn(4, 16), torch.randn(4, 8))
    (gm, n_out), = seen
    return gm, {"n": n_out}


def test_autocast_weight_copies_and_activations_not_kept_across_backward(monkeypatch):
    before, info = _captured_autocast_mlp(monkeypatch, remat=False)
    after, _ = _captured_autocast_mlp(monkeypatch, remat=True)
    live_before = _live_across(before, backward_start(before, info["n"]))
    live_after = _live_across(after, backward_start(after, info["n"]))
    roots = lambda live: {view_root(n) for n in live}
    casts = lambda live: [n for n in roots(live) if n.target is aten._to_copy.default
                          and n.args[0].op == "placeholder"]
    # Without the pass the bf16 copy of fc2.weight (read again by dX = dY @ W) and the bf16 input
    # (X of fc1's fused update) stay alive across the boundary, as does gelu's output (X of fc2's).
    assert len(casts(live_before)) == 2
    assert any(n.target is aten.gelu.default for n in roots(live_before))
    assert casts(live_after) == []
    assert not any(n.target is aten.gelu.default for n in roots(live_after))
    # what may stay: fc1's pre-activation (gelu_backward needs it) and the fp32 output (mse backward)
    assert len(live_after) < len(live_before)


def _trace(fn, *args):
    return _compat.make_fx(fn, tracing_mode="fake")(*args)


def _step_with_write(w, x, write):
    c = w.to(torch.bfloat16)
    loss = (x.to(torch.bfloat16) @ c.t()).float().sum()
    y = loss * 2               # first consumer of the returned loss: the "backward" starts here
    if write:
        w.add_(1.0)            # W is updated before the late read of its copy
    z = c.float().sum() + y
    return loss, z


def test_recomputes_a_cast_read_late():
    w0, x = torch.randn(4, 3), torch.randn(2, 3)
    gm = _trace(lambda w, x: _step_with_write(w, x, False), w0, x)
    start = backward_start(gm, 1)
    assert remat_for_backward(gm, 1) == 1
    nodes = list(gm.graph.nodes)
    w = nodes[0]
    assert len([n for n in nodes if n.target is aten._to_copy.default and n.args[0] is w]) == 1
    # the backward's copy of a graph input's cast is forge::cast_after, ordered after a backward value: as a plain
    # cast, Inductor fused it with the forward's cast and computed it in the forward (H100, stop 21)
    late, = [n for n in nodes if n.target is torch.ops.forge.cast_after.default]
    assert late.args[0] is w and late.args[2] == torch.bfloat16
    assert nodes.index(late.args[1]) >= start and nodes.index(late.args[1]) < nodes.index(late)
    torch.testing.assert_close(gm(w0, x), _step_with_write(w0, x, False), rtol=0, atol=0)


def test_never_recomputes_across_a_write_to_its_input():
    w, x = torch.randn(4, 3), torch.randn(2, 3)
    gm = _trace(lambda w, x: _step_with_write(w, x, True), w, x)
    assert remat_for_backward(gm, 1) == 0
    # and the graph still computes what the function does (z reads the copy made before the write)
    w1, w2 = w.clone(), w.clone()
    ref = _step_with_write(w1, x, True)
    out = gm(w2, x)
    torch.testing.assert_close(out[1], ref[1])
    torch.testing.assert_close(w2, w1)


def test_random_ops_are_not_recomputed():
    def fn(w, x):
        d = F.dropout(x, 0.5, training=True)
        loss = (d @ w.t()).sum()
        return loss, d.sum() + loss * 2      # the dropout output is read again after the "backward" starts
    gm = _trace(fn, torch.randn(4, 3), torch.randn(2, 3))
    seeded = lambda: sum(1 for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
                         and torch.Tag.nondeterministic_seeded in n.target.tags)
    n_seeded = seeded()
    assert n_seeded >= 1
    remat_for_backward(gm, 1)
    assert seeded() == n_seeded


def _tinylm_step(monkeypatch, **options):
    """TinyLM's bf16-autocast train step through compile_train_step(**options): (step graph after the passes,
    its number of forward outputs, the weight placeholders, the parameters after three steps, the report)."""
    from models import TinyLM
    torch.manual_seed(0)
    m = TinyLM()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

    def fn(idx, tgt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(idx).float().flatten(0, 1), tgt.flatten())
        loss.backward(); opt.step(); opt.zero_grad()
        return loss

    seen = []

    def hook(gm, n_forward_outputs):
        done = remat_for_backward(gm, n_forward_outputs)
        seen.append((gm, n_forward_outputs))
        return done
    step = forge.compile_train_step(fn, **options)
    g = torch.Generator().manual_seed(1)
    with monkeypatch.context() as mp:
        mp.setattr("forge_compile.capture.remat_for_backward", hook)
        for _ in range(3):
            step(torch.randint(0, 40, (2, 8), generator=g), torch.randint(0, 40, (2, 8), generator=g))
    (gm, n_out), = seen
    n_params = len(list(m.parameters()))
    weights = [n for n in gm.graph.nodes if n.op == "placeholder"][:n_params]
    return gm, n_out, weights, [p.detach().clone() for p in m.parameters()], step.last_report


def test_recompute_weight_copies_keeps_no_weight_copy_across_the_boundary(monkeypatch):
    kept_gm, n, kept_w, kept_params, _ = _tinylm_step(monkeypatch)
    gm, n2, w, params, report = _tinylm_step(monkeypatch, recompute_weight_copies=True)
    # By default the fused updates of the 3-D linears (whose autograd computes dW before dX) sit before their dX
    # mm, so the forward's bf16 weight copies stay alive for it, as in torch.compile's partition.
    assert weight_copies_kept(kept_gm, n, kept_w) >= 2
    assert weight_copies_kept(gm, n2, w) == 0
    assert any("no parameter's cast copy is kept" in note for note in report.notes)
    roots = {view_root(x) for x in _live_across(gm, backward_start(gm, n2))}
    assert not any(r.target is aten._to_copy.default and view_root(r.args[0]) in set(w) for r in roots)
    # every fused update now follows each mm that reads a copy of its weight
    nodes = list(gm.graph.nodes)
    pos = {x: i for i, x in enumerate(nodes)}
    fused = [x for x in nodes if x.target is torch.ops.forge.wgrad_update_.default]
    assert len(fused) == 5                      # qkv, proj, up, down, head
    for f in fused:
        copies = [x for x in nodes if x.target is aten._to_copy.default and x.args[0] is f.args[0]]
        readers = [u for c in copies for u in c.users]
        assert copies and all(pos[r] < pos[f] for r in readers)
    # the same values: the recomputed copy is cast from the same, not yet updated, weight
    assert all(torch.equal(a, b) for a, b in zip(kept_params, params))


def test_recompute_weight_copies_frees_buffers_at_their_last_use(monkeypatch):
    # In the whole-step graph Inductor's buffer reuse kept dead forward buffers allocated until a backward
    # allocation of the same size took them over, i.e. across the boundary (10-22 % of the bytes alive there in a
    # 1-layer Llama's CPU output code): the memory option turns that reuse off; the default keeps Inductor's
    # setting (one allocator call per buffer costs host time), and so does a user's explicit choice.
    assert buffer_reuse_at_compile(monkeypatch) == [True]
    assert buffer_reuse_at_compile(monkeypatch, recompute_weight_copies=True) == [False]
    assert buffer_reuse_at_compile(monkeypatch, recompute_weight_copies=True,
                                    options={"allow_buffer_reuse": True}) == [True]
