"""The Dynamo route: torch.compile(model, backend="forge", options={"optimizer": opt}) vs eager torch.optim."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import forge_compile.backend as fb
from forge_compile.optim.lion import Lion
from models import TinyLM

# Tolerances: the fused update is the same rule function, but dW is summed in row blocks by the
# fused op and the rest of the backward by Inductor's kernels, in another order than eager torch;
# fp32 rounding differences are amplified by Adam's 1/sqrt(v) over 6 steps. 1e-5 relative is far
# below any real bug (a stale W read, a wrong hyper-parameter or a skipped step moves values by >1e-3).
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()       # every test compiles its own model; stay clear of the recompile limit
    fb.clear_reports()
    yield
    torch._dynamo.reset()


# -- models (copied from tests/models.py so that edits there do not change these tests) --------------

class DeepMLP(nn.Module):
    """Three linear layers: the backward of fc2/fc3 reads W for dX (the aliasing hazard)."""

    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "lion": lambda p: Lion(p, lr=1e-3, weight_decay=0.1),
    # dampening: torch's first step copies the gradient into the buffer, later steps damp it
    "sgd_nesterov_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.01),
}


def _assert_same(model, opt, ref, ref_opt, tag=""):
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{tag} param {n}: {m}")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        s, r = opt.state[p], ref_opt.state[q]
        assert set(s) == set(r), (n, set(s), set(r))
        for k in r:
            if isinstance(r[k], torch.Tensor):
                assert s[k].dtype == r[k].dtype and s[k].device == r[k].device, (n, k)
                torch.testing.assert_close(s[k], r[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{tag} {n}.{k}: {m}")


def _train_both(model, make_opt, batches, loss_fn, *, fused_names=None, use_optimizer=True):
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    options = {"optimizer": opt} if use_optimizer else {}
    cmodel = torch.compile(model, backend="forge", options=options) if options else \
        torch.compile(model, backend="forge")
    for step, (x, y) in enumerate(batches):
        loss = loss_fn(cmodel(x), y)
        loss.backward()
        if fused_names is not None:
            for n, p in model.named_parameters():
                if n in fused_names:
                    assert p.grad is None, f"step {step}: fused {n}.grad should stay None"
                else:
                    assert p.grad is not None, f"step {step}: unfused {n}.grad missing"
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    return opt, ref, ref_opt, cmodel


def _mlp_batches(n=6):
    return [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(n)]


def _lm_batches(n=5, t=6):
    return [(torch.randint(0, 40, (2, t)), torch.randint(0, 40, (2, t))) for _ in range(n)]


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


MLP_WEIGHTS = {"fc1.weight", "fc2.weight", "fc3.weight"}
LM_WEIGHTS = {"block.qkv.weight", "block.proj.weight", "block.up.weight", "block.down.weight", "head.weight"}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_deep_mlp_matches_torch_optim(name):
    model = DeepMLP()
    opt, ref, ref_opt, _ = _train_both(model, OPTIMIZERS[name], _mlp_batches(), F.mse_loss,
                                       fused_names=MLP_WEIGHTS)
    _assert_same(model, opt, ref, ref_opt, name)
    rep = fb.last_report()
    assert rep.graph == "backward"
    assert {r.name for r in rep.fused} == MLP_WEIGHTS, str(rep)
    assert {r.name for r in rep.unfused} == {"fc1.bias", "fc2.bias", "fc3.bias"}, str(rep)
    assert not any("cloned" in n for n in rep.notes), str(rep)   # Inductor reinplaced every update
    assert any("clip_grad_norm_" in n for n in rep.notes)


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_tiny_transformer_matches_torch_optim(name):
    model = TinyLM()
    opt, ref, ref_opt, _ = _train_both(model, OPTIMIZERS[name], _lm_batches(), _lm_loss,
                                       fused_names=LM_WEIGHTS)
    _assert_same(model, opt, ref, ref_opt, name)
    assert {r.name for r in fb.last_report().fused} == LM_WEIGHTS, str(fb.last_report())


def test_other_sequence_length_recompiles_and_matches():
    model = TinyLM()
    batches = _lm_batches(3, t=6) + _lm_batches(3, t=9)
    opt, ref, ref_opt, _ = _train_both(model, OPTIMIZERS["adamw"], batches, _lm_loss, fused_names=LM_WEIGHTS)
    _assert_same(model, opt, ref, ref_opt, "two lengths")
    reps = fb.last_reports()
    assert len(reps) >= 2 and all({r.name for r in rep.fused} == LM_WEIGHTS for rep in reps)


def test_lr_scheduler_needs_no_recompile():
    model = DeepMLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    cmodel = torch.compile(model, backend="forge", options={"optimizer": opt})
    for x, y in _mlp_batches(4):
        F.mse_loss(cmodel(x), y).backward()
        opt.step(); opt.zero_grad(); sched.step()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step(); ref_opt.zero_grad(); ref_sched.step()
    _assert_same(model, opt, ref, ref_opt, "scheduler")
    assert len(fb.last_reports()) == 1


def test_without_optimizer_is_plain_training():
    model = DeepMLP()
    opt, ref, ref_opt, _ = _train_both(model, OPTIMIZERS["adamw"], _mlp_batches(4), F.mse_loss,
                                       fused_names=set(), use_optimizer=False)
    _assert_same(model, opt, ref, ref_opt, "no optimizer")
    rep = fb.last_report()
    assert rep.rows == [] and any("no optimizer" in n for n in rep.notes), str(rep)


def test_gradient_accumulation_raises():
    model = DeepMLP()
    opt = OPTIMIZERS["adamw"](model.parameters())
    cmodel = torch.compile(model, backend="forge", options={"optimizer": opt})
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    F.mse_loss(cmodel(x), y).backward()
    w_after_first = model.fc1.weight.detach().clone()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        F.mse_loss(cmodel(x), y).backward()
    torch.testing.assert_close(model.fc1.weight.detach(), w_after_first, rtol=0, atol=0)  # not applied twice
    opt.step()
    opt.zero_grad()
    F.mse_loss(cmodel(x), y).backward()        # after step() a backward is fine again
    opt.step()
    assert not opt._optimizer_step_post_hooks    # forge tracks steps with a global hook, not the user's slots


def test_dump_dir_writes_forward_and_backward(tmp_path):
    model = DeepMLP()
    opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    cmodel = torch.compile(model, backend="forge", options={"optimizer": opt, "dump_dir": str(tmp_path)})
    F.mse_loss(cmodel(torch.randn(8, 16)), torch.randn(8, 8)).backward()
    opt.step()
    files = sorted(os.listdir(tmp_path))
    assert any(f.endswith("forward.captured.py") for f in files), files
    rewritten = [f for f in files if f.endswith("backward.rewritten.py")]
    assert rewritten, files
    text = (tmp_path / rewritten[0]).read_text()
    assert text.count("forge.wgrad_update_") == 3, text
    report = (tmp_path / rewritten[0].replace("rewritten.py", "report.txt")).read_text()
    assert "3 of 6 parameter updates fused" in report


def test_unknown_option_is_refused():
    with pytest.raises(Exception, match="unknown options"):
        torch.compile(nn.Linear(4, 4), backend="forge", options={"optimiser": None})(torch.randn(2, 4))


def test_entry_point_without_importing_forge():
    code = ("import sys, torch; m = torch.compile(torch.nn.Linear(4, 4), backend='forge'); "
            "out = m(torch.randn(2, 4)); out.sum().backward(); print(tuple(out.shape))")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/..",
                       timeout=300)
    if "Invalid backend" in r.stderr and "forge" in r.stderr:
        pytest.skip("forge_compile is not installed in this environment (pip install -e . --no-deps)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("(2, 4)")
