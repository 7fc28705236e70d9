"""Small models shared by the tests."""
import contextlib
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: causal attention + MLP, 3-D activations."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=40, d=32, tied=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.block(self.emb(idx)))


class CheckpointedLM(nn.Module):
    """TinyLM's shape with two Blocks, each under torch.utils.checkpoint (recomputed in the backward)."""

    def __init__(self, reentrant=False):
        super().__init__()
        self.reentrant = reentrant
        self.emb, self.b1, self.b2 = nn.Embedding(40, 32), Block(32), Block(32)
        self.head = nn.Linear(32, 40, bias=False)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(self.b1, self.emb(x), use_reentrant=self.reentrant)
        return self.head(checkpoint(self.b2, h, use_reentrant=self.reentrant))


def mse_route_step(route, model, opt, inductor_options=None):
    """The MSE train step of ``model`` and ``opt`` through one forge route ("step": compile_train_step, "backend":
    torch.compile(backend="forge")), both compiled with ``inductor_options`` (e.g. cpp_wrapper, CUDA graphs);
    the step returns the loss. compile_train_step's object carries ``last_report``; the backend's is
    forge_compile.backend.last_report()."""
    import forge_compile as forge

    io = dict(inductor_options or {})
    if route == "step":
        @forge.compile_train_step(options=io)
        def step(x, y):
            loss = F.mse_loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
        return step
    cm = torch.compile(model, backend="forge", options={"optimizer": opt, **io})

    def step(x, y):
        loss = F.mse_loss(cm(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
    return step


def check_recomputed_weight_casts(device):
    """Two SGD steps (lr 10) of TinyLM through backend="forge" under bf16 autocast with torch's
    activation_memory_budget=0, which makes the partitioner recompute each weight's bf16 cast in the backward,
    where Inductor computes such an element-wise value at its first use -- the dX matmul. Each backward's unfused
    gradients are checked against eager's from the same (pre-step) weights: a dX read from an updated weight moves
    them by O(1) (TinyLM's bias-free head was read updated before the fused op was anchored after that use).
    Returns the last backward's fusion report."""
    import copy

    import torch._functorch.config as functorch_config

    import forge_compile.backend as fb

    torch.manual_seed(0)
    model = TinyLM().to(device)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=10.0)
    autocast = lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    with functorch_config.patch(activation_memory_budget=0.0):
        cmodel = torch.compile(model, backend="forge", options={"optimizer": opt})
        for _ in range(2):
            x, y = torch.randint(0, 40, (2, 8), device=device), torch.randint(0, 40, (2, 8), device=device)
            w_before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with autocast():
                loss = F.cross_entropy(cmodel(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            assert not torch.equal(model.head.weight, w_before["head.weight"])      # updated in backward
            ref.load_state_dict(w_before)
            ref.zero_grad(set_to_none=True)
            with autocast():
                F.cross_entropy(ref(x).float().flatten(0, 1), y.flatten()).backward()
            # Inductor's bf16 kernels vs eager autocast round differently (~1e-2 relative); the hazard is O(1)
            # (the embedding's gradient, which sees the head's dX through every layer, is fused since stop 37: the
            # first LayerNorm's, unfused, sees the same dX)
            for n in ("block.ln2.bias", "block.up.bias", "block.down.bias", "block.ln1.weight", "block.ln1.bias"):
                g, r = model.get_parameter(n).grad, ref.get_parameter(n).grad
                torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-2 * r.abs().max().item(),
                                           msg=lambda m: f"{n}.grad: {m}")
            opt.step()
            opt.zero_grad(set_to_none=True)
    return fb.last_reports()[-1]


class CorrectlyRoundedSqrt(torch.overrides.TorchFunctionMode):
    """torch's CPU fp32 sqrt is not correctly rounded on this AVX-512 build (~1 % of elements 1 ulp off
    np.sqrt, measured), while the Triton interpreter's sqrt_rn is numpy's IEEE sqrt and CUDA's (prec-sqrt) is
    IEEE too. For CPU exactness tests against the interpreted kernels, eager sqrt is computed in fp64 and rounded
    (exact for fp32)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.sqrt, torch.Tensor.sqrt) and args[0].dtype == torch.float32:
            return torch.sqrt(args[0].double()).float()
        return func(*args, **kwargs)


def rerun_recorder(fn, args):
    """A step_graph recorder for CPU tests: "replaying" re-runs the step (the CUDA recorder records without running)."""
    outs = []

    def replay():
        outs[:] = list(fn(*args))
    return replay, outs


def buffer_reuse_at_compile(monkeypatch, steps=1, **kw):
    """Inductor's allow_buffer_reuse while compile_train_step(**kw) compiles an autocast MLP step (run ``steps``
    times), one entry per compile."""
    import torch._inductor.config as inductor_config

    import forge_compile as forge
    from forge_compile import _compat

    seen = []
    real = _compat.compile_fx

    def spy(gm, inputs):
        seen.append(inductor_config.allow_buffer_reuse)
        return real(gm, inputs)

    monkeypatch.setattr(_compat, "compile_fx", spy)
    torch.manual_seed(0)
    m = MLP(16, 32, 8)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    @forge.compile_train_step(**kw)
    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(m(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad()
        return loss

    for _ in range(steps):
        step(torch.randn(4, 16), torch.randn(4, 8))
    return seen


def halve_grad(p):
    """A post-accumulate-grad hook that changes the gradient (the gradient-hook tests of both routes)."""
    p.grad.mul_(0.5)


def assert_same_training(m1, m2, o1=None, o2=None):
    """Two trainings of the same model ended bitwise equal: every parameter (named in the message) and, given both
    optimizers, every state."""
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), name
    if o1 is not None:
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            for k, v in o1.state[p1].items():
                assert torch.equal(v, o2.state[p2][k]), k


def assert_close_training(m1, m2, rtol, atol):
    """Two trainings of the same model ended close: every parameter (named in the message)."""
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"param {name}: {m}")


def forge_and_eager(model, make_opt, make_step, **options):
    """One step function, built twice by ``make_step(model, opt)``: on ``model`` compiled with compile_train_step
    (``options``), and on a deep copy, run eagerly, each with its own ``make_opt(params)``. Returns (forge step,
    eager step, the copy)."""
    import forge_compile as forge

    ref = copy.deepcopy(model)
    fstep = forge.compile_train_step(make_step(model, make_opt(model.parameters())), **options)
    return fstep, make_step(ref, make_opt(ref.parameters())), ref


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def clip_step(model, opt, max_norm, loss_fn=F.mse_loss, foreach=None):
    """A train step that clips every gradient (clip_grad_norm_) before the update; returns (loss, total norm)."""
    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=foreach)
        opt.step()
        opt.zero_grad()
        return loss, norm
    return step


def collective_checks() -> dict:
    """This process's counts of collectives the step graphs' wrapper check recognised (capture counters
    collectives_checked) and of graphs with collectives it could not read (collectives_unchecked)."""
    from forge_compile import capture
    return {k: capture.counters[k] for k in ("collectives_checked", "collectives_unchecked")}


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of this process alone (DDP needs one to be constructed), destroyed after."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
