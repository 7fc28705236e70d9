"""compile_train_step on CUDA (run on the H200 through the device tool; skipped elsewhere)."""
import copy
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import forge_compile as forge
from models import TinyLM

pytestmark = pytest.mark.gpu


def _lm_batch(vocab=40, b=4, t=32, device="cuda"):
    idx = torch.randint(0, vocab, (b, t + 1), device=device)
    return idx[:, :-1], idx[:, 1:]


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "lion"])
def test_cuda_fp32_matches_eager(opt_name):
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "lion": lambda p: forge.optim.Lion(p, lr=3e-4, weight_decay=0.1)}[opt_name]
    torch.backends.cuda.matmul.allow_tf32 = False
    model = TinyLM().cuda(); ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())

    @forge.compile_train_step
    def step(x, y):
        loss = _loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss

    for _ in range(5):
        x, y = _lm_batch()
        step(x, y)
        rl = _loss(ref(x), y); rl.backward(); ref_opt.step(); ref_opt.zero_grad()
    assert len(step.last_report.fused) == 6      # 5 linear weights and the embedding (forge::embedding_update_)
    # fp32 activations on CUDA: the report says this is the slow regime (the 5 GEMMs; the embedding has none)
    assert any(n.startswith("fp32 activations: 5 fused") for n in step.last_report.notes), step.last_report.notes
    # fp32 IEEE dots in the kernel vs cuBLAS: another summation order, amplified by Adam/Lion's
    # normalisation over 5 steps. Lion's sign() can flip on near-zero momentum: bounded by 2*lr.
    for a, b in zip(model.parameters(), ref.parameters()):
        tol = 2 * 3e-4 * 5 + 1e-6 if opt_name == "lion" else 1e-4
        assert (a - b).abs().max().item() <= tol


def _peak_step(route, autocast, d=2048, layers=4, tokens=512, clip=None, passes=1):
    """Peak memory of one steady-state train step above what is allocated before it, the linear dW bytes and the
    step (``clip``: clip_grad_norm_ to it before the update; ``passes``: the tokens split into that many
    micro-batches, backward() each, the gradients accumulated inside the step)."""
    torch.cuda.empty_cache()
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=(route == "baseline"))
    fwd = torch.compile(model) if route == "baseline" else model

    def body(x):
        for xi in x.chunk(passes):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = fwd(xi).float().square().mean()
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(); opt.zero_grad(); return loss

    step = forge.compile_train_step(body) if route == "forge" else body
    x = torch.randn(tokens, d, device="cuda")
    step(x); step(x)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(x); torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, layers * d * d * 4, step


def _write_peaks(name, fused, base, dw):
    out = os.environ.get("FORGE_RESULTS")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump({"forge_step_peak_bytes": fused, "baseline_step_peak_bytes": base, "dW_bytes": dw}, f)


@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_peak_memory_fused_vs_torch_compile_baseline(autocast):
    fused, dw, _ = _peak_step("forge", autocast)
    base, _, _ = _peak_step("baseline", autocast)
    _write_peaks(f"gpu_peak_memory_autocast{int(autocast)}.json", fused, base, dw)
    # The baseline (torch.compile forward/backward + AdamW(fused=True)) holds every fp32 dW when
    # opt.step() runs; the forge step never holds one. bf16 autocast adds bf16 weight copies to both.
    # Measured on the H200 (2026-12-02): fp32 forge 21.0 MB vs baseline 75.5 MB, bf16 35.7 vs 77.6 (dW 67.1 MB).
    assert base >= dw and fused < 0.6 * dw


def _recompute_run(recompute, d=2048, layers=8, tokens=512):
    """bf16-autocast forge step of a linear stack: (peak bytes above the step's start, parameters after 3 steps)."""
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def body(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward(); opt.step(); opt.zero_grad(); return loss

    step = forge.compile_train_step(body, recompute_weight_copies=recompute)
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(tokens, d, device="cuda", generator=g) for _ in range(3)]
    step(xs[0]); step(xs[1])
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(xs[2]); torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, [p.detach().clone() for p in model.parameters()]


def test_cuda_recompute_weight_copies_same_values_lower_peak():
    kept_peak, kept = _recompute_run(False)
    peak, params = _recompute_run(True)
    out = os.environ.get("FORGE_RESULTS")
    if out:
        with open(os.path.join(out, "gpu_recompute_weight_copies.json"), "w") as f:
            json.dump({"peak_bytes_kept": kept_peak, "peak_bytes_recomputed": peak}, f)
    # the backward casts the same (not yet updated) fp32 weight again: bitwise the same update
    assert all(torch.equal(a, b) for a, b in zip(kept, params))
    # Kept: the forward's bf16 copies of the 7 weights whose dX the backward computes (the first layer's input
    # needs no gradient) are alive at the boundary, 7 x 8 MiB. Recomputed: at most one copy alive at a time in the
    # forward and one in the backward (the peak may move there), so it drops by at least 7 - 2 copies; 10 % slack
    # for the allocator. Estimated from the tensors' sizes: ~6 copies (48 MiB).
    copy = 2048 * 2048 * 2
    assert peak <= kept_peak - 0.9 * 5 * copy


def test_cuda_fused_adamw_keeps_device_step_format():
    """AdamW(fused=True) keeps ``step`` on the device; forge advances a host mirror and writes it back,
    so torch's own fused step (and a checkpoint) continues from forge's state."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = TinyLM().cuda(); ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)

    @forge.compile_train_step
    def step(x, y):
        loss = _loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss

    for _ in range(3):
        x, y = _lm_batch()
        step(x, y)
        rl = _loss(ref(x), y); rl.backward(); ref_opt.step(); ref_opt.zero_grad()
    assert len(step.last_report.fused) == 6      # 5 linear weights and the embedding (forge::embedding_update_)
    # fp32 activations on CUDA: the report says this is the slow regime (the 5 GEMMs; the embedding has none)
    assert any(n.startswith("fp32 activations: 5 fused") for n in step.last_report.notes), step.last_report.notes
    for p in model.parameters():
        s = opt.state[p]["step"]
        assert s.device.type == "cuda" and s.dtype == torch.float32 and float(s) == 3.0
    # same tolerance reasoning as test_cuda_fp32_matches_eager
    for a, b in zip(model.parameters(), ref.parameters()):
        assert (a - b).abs().max().item() <= 1e-4
    # a plain fused opt.step() continues from the written-back state
    x, y = _lm_batch()
    _loss(model(x), y).backward(); opt.step(); opt.zero_grad()
    _loss(ref(x), y).backward(); ref_opt.step(); ref_opt.zero_grad()
    assert all(float(opt.state[p]["step"]) == 4.0 for p in model.parameters())
    for a, b in zip(model.parameters(), ref.parameters()):
        assert (a - b).abs().max().item() <= 2e-4


def _cast_run(cast, cuda_graphs, d=1024, layers=4, tokens=512, steps=5):
    """bf16-autocast forge step of a linear stack with an in-place weight edit before step 3: (losses, parameters,
    states, report, capture counters)."""
    from forge_compile import capture

    capture.counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def body(x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward(); opt.step(); opt.zero_grad(); return loss

    step = forge.compile_train_step(body, cuda_graphs=cuda_graphs, cast_weights_in_update=cast)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for i in range(steps):
        if i == 3:
            with torch.no_grad():
                model[1].weight.mul_(0.5)
        losses.append(step(torch.randn(tokens, d, device="cuda", generator=g)).item())
    torch.cuda.synchronize()
    states = [s.clone() for p in model.parameters() for s in opt.state[p].values()]
    return losses, [p.detach().clone() for p in model.parameters()], states, step.last_report, \
        dict(capture.counters), model


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_cast_weights_in_update_is_bitwise_the_same(cuda_graphs):
    # the fused kernels (Gluon pointer epilogues on the H200) write each new weight's bf16 copy; the next forward
    # reads it instead of casting: the same values bitwise, the copies current after every step
    from forge_compile import capture

    l1, p1, s1, rep, counts, model = _cast_run(True, cuda_graphs)
    l0, p0, s0, _, _, _ = _cast_run(False, cuda_graphs)
    assert l1 == l0
    assert all(torch.equal(a, b) for a, b in zip(p1, p0))
    assert all(torch.equal(a, b) for a, b in zip(s1, s0))
    assert any("4 fused weights' low-precision copies" in n for n in rep.notes), rep.notes
    assert counts.get("weight_casts_made") == 4 and counts.get("weight_casts_refreshed") == 1, counts
    for p in model.parameters():
        assert torch.equal(capture._WEIGHT_CASTS[p][torch.bfloat16][0], p.detach().bfloat16())


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_cuda_clip_grad_norm_fused_matches_eager(opt_name):
    # clip_grad_norm_ in the step: the linear weights stay fused (norm from dY and X, the coefficient in the
    # epilogue, read on the host once per step). bf16 autocast: torch's dW is rounded to bf16 before its norm and
    # its update, forge's is not, so the two differ by about bf16's precision of the gradient; fp32 activations
    # (TF32 off) compare the fused path itself.
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}[opt_name]
    torch.backends.cuda.matmul.allow_tf32 = False
    for autocast in (False, True):
        torch.manual_seed(0)
        model = TinyLM().cuda(); ref = copy.deepcopy(model)
        opt, ref_opt = make(model.parameters()), make(ref.parameters())

        def body(m, o):
            def step(x, y):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = _loss(m(x), y)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
                o.step(); o.zero_grad()
                return loss, norm
            return step

        fstep, rstep = forge.compile_train_step(body(model, opt)), body(ref, ref_opt)
        for _ in range(4):
            x, y = _lm_batch()
            (_, n), (_, rn) = fstep(x, y), rstep(x, y)
            assert rn > 0.2, "the test must clip"
            torch.testing.assert_close(n, rn, rtol=2e-3 if autocast else 1e-5, atol=0)
        rep = fstep.last_report
        # the 5 linears and the embedding (its norm from the compact gradient rows)
        assert len(rep.fused) == 6 and all("clip_grad_norm_" in r.reason for r in rep.fused), str(rep)
        # fp32: another summation order of dW (and of the norms), amplified by Adam over 4 steps, as in
        # test_cuda_fp32_matches_eager. bf16: torch's dW is a bf16-rounded cuBLAS sum, forge's an fp32 one in another
        # order: ~4e-3 relative per element, so SGD's clipped updates (<= lr x 0.1 per element) differ by ~1e-5 per
        # step and Adam's (~lr each) by ~lr x 4e-3 -- except where a gradient element nearly cancels: there its sign
        # can differ and one Adam step moves by up to 2 x lr (measured on an H100: one qkv element 5.9e-3 after 4
        # steps, 11 of its 3072 elements above 3e-4; the embedding, unfused then, 2 of 1280). So for bf16 Adam: all but 1 %
        # (at least 4) elements within 3e-4, none beyond 2 x lr per step -- a loose check: the fp32 pass (<= 1e-4)
        # and SGD are the tight ones;
        # a missed clip moves SGD's weights (unclipped norms 2-10x the 0.1 limit) far beyond both.
        lr = opt.param_groups[0]["lr"]
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            d = (a - b).abs()
            if not autocast:
                assert d.max().item() <= 1e-4, (name, d.max().item())
            elif opt_name == "sgd":
                assert d.max().item() <= 2e-3, (name, d.max().item())
            else:
                assert (d > 3e-4).sum().item() <= max(4, d.numel() // 100) and d.max().item() <= 2 * lr * 4, (
                    name, (d > 3e-4).sum().item(), d.max().item())


def test_cuda_accumulated_step_peak_memory():
    # 2 micro-batches of 256 tokens accumulated inside the step: the baseline holds every fp32 dW from the first
    # backward on; forge keeps each pass's dY and X (2 x 256 x (2048 + 2048) bf16 = 4 MiB per layer, a quarter of
    # its dW) and concatenates them for the one fused update. Measured (H100, 2026-12-06): 61.9 vs 143.7 MB
    # (dW 67.1 MB)
    fused, dw, step = _peak_step("forge", True, passes=2)
    base, _, _ = _peak_step("baseline", True, passes=2)
    _write_peaks("gpu_peak_memory_accumulated.json", fused, base, dw)
    assert all("sum of 2 matmuls' dW" in r.reason for r in step.last_report.fused), str(step.last_report)
    assert len(step.last_report.fused) == 4
    assert base >= dw and fused < base - dw / 2, (fused, base, dw)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["plain", "graphs"])
def test_cuda_accumulated_step_matches_eager(cuda_graphs):
    # backward() per micro-batch inside the step: each weight's update reads all passes' dY and X concatenated.
    # SGD with momentum (scale-sensitive), fp32 activations with TF32 off (the fused path itself, <= 1e-5) and bf16
    # autocast (torch's per-pass dW is rounded to bf16 before it is accumulated, forge's is one fp32 sum: SGD's
    # updates differ by ~lr x 4e-3 of a gradient element per step, bounded as in the clip test)
    torch.backends.cuda.matmul.allow_tf32 = False
    for autocast in (False, True):
        torch.manual_seed(0)
        model = TinyLM().cuda(); ref = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))

        def body(m, o):
            def step(xs, ys):
                for x, y in zip(xs, ys):
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        loss = _loss(m(x), y) / len(xs)
                    loss.backward()
                o.step(); o.zero_grad()
                return loss
            return step

        from forge_compile import step_graph as sg

        sg.counters.clear()
        fstep = forge.compile_train_step(body(model, opt), cuda_graphs=cuda_graphs)
        rstep = body(ref, ref_opt)
        for _ in range(4):
            # 2 passes of 3 tokens: in fp32 6 x (32 + 32) x 4 B <= half of proj's 4 KiB dW (the smallest), so every
            # weight fuses (more tokens: unfused with the reason, tests/test_grad_accumulation.py)
            batches = [_lm_batch(b=1, t=3) for _ in range(2)]
            xs, ys = [b[0] for b in batches], [b[1] for b in batches]
            fstep(xs, ys), rstep(xs, ys)
        rep = fstep.last_report
        assert len(rep.fused) == 6 and all("sum of 2 " in r.reason for r in rep.fused), str(rep)
        if cuda_graphs:
            assert sg.counters["replays"] >= 2 and not sg.counters["capture_failed"], (dict(sg.counters), rep.notes)
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            d = (a - b).abs().max().item()
            assert d <= (2e-3 if autocast else 1e-5), (name, autocast, d)


def test_cuda_clip_grad_norm_peak_memory():
    # clipping keeps every dW off the peak too: the baseline clips its materialized fp32 dW (torch.compile forward
    # + AdamW(fused=True)), forge computes each norm from dY and X in row blocks (<= 32 MiB at a time)
    fused, dw, step = _peak_step("forge", True, clip=1e-3)
    assert len(step.last_report.fused) == 4, str(step.last_report)
    base, _, _ = _peak_step("baseline", True, clip=1e-3)
    _write_peaks("gpu_peak_memory_clip.json", fused, base, dw)
    assert base >= dw and fused < 0.6 * dw, (fused, base, dw)
