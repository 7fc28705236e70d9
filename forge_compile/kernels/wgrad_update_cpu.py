"""CPU impl of ``forge::wgrad_update_``: dW one ~2 MiB block at a time, the rule applied while the block is in cache.

Two ways to apply the rule to a block:
- the catalogue rules (forge_compile.optim.rules: Adam/AdamW, SGD, Lion, Adagrad, RMSprop) have in-place fast
  paths that write straight into the W/state block views, 9 element-wise passes per block for AdamW where the
  functional rule makes ~17 (temporaries, then copies back) -- that pass count is what made the CPU path ~2x
  eager at small M (benchmarks/RESULTS.md, "CPU path");
- any other rule runs its functional ``fn`` per block and the results are copied back (the generic path).

The functional rule is the spec, so a fast path must reproduce it bit for bit, which rules out the fused ops whose
CPU kernels round differently (``add(alpha=)``, ``lerp`` and ``addcmul`` with two tensor factors are contracted
into FMAs). What the fast paths use instead, each exact whatever the kernel contracts:
- ``addcmul(s, t, ONE, value=c)`` is ``s + round(c * t)``: with a factor of exactly 1 an FMA of the rounded product
  rounds like the separate add;
- ``addcmul(NEG0, a, b, value=c)`` is ``round(round(c * a) * b)``: an FMA with addend -0.0 is the rounded product,
  sign of zero included;
- ``addcdiv(s, a, b, value=c)`` is ``s + round(round(c * a) / b)`` (a division cannot be contracted);
- 0-dim hyper-parameter tensors are passed to ``mul_``/``div`` as the rule passes them, and ``value=`` gets the same
  float64 value, which the kernel casts to fp32 as the rule's type promotion does.
Expressions of only scalars (bias corrections, ``step + 1``) are evaluated once per call with the rule's own
0-dim tensor arithmetic, so their dtypes (float64 hyper-parameters, float32 ``step``) round as in the rule.
Each fast path is checked against its functional rule on a random ragged block the first time it is used in the
process; a mismatch (another torch build or CPU kernel) logs a warning and sends that rule to the generic path.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import Callable, Optional

import torch

from ..optim import rules as _rules
from ..optim.rule import Rule, get_rule, scaled_base
from .stochastic_round import stochastic_round_bf16_at

log = logging.getLogger(__name__)

__all__ = ["wgrad_update_cpu", "cpu_block_shape", "fast_path_for"]

# Bytes of dW that one CPU block may hold: small enough to stay in L2/L3 while the rule's element-wise ops
# pass over it, large enough that each block's mm is efficient. 2 MiB, not 1: with the in-place fast paths,
# 2 MiB blocks (512 x 1024 at K = 1024) took 5-25 % less time than 1 MiB ones at M = 64-512 on the 2-core dev
# machine (interleaved timings), from the mm and from fewer ops per call.
_CPU_BLOCK_BYTES = 2 << 20
# Rows of dW per block before the columns are split too: every row block's mm reads all of X (M x K), so
# thin row blocks of a wide weight re-read X N/rows times (1 MiB blocks of a K=4096 weight are 64 rows: X read
# 16 times for N=1024). 512, not 256: MKL ran the 256 x 1024 blocks' mm (M = 64) 15-50 % slower than 512 x 512
# ones of the same size on the 2-core dev machine.
_CPU_BLOCK_MIN_ROWS = 512

_ONE = torch.ones((), dtype=torch.float32)
_NEG0 = torch.full((), -0.0, dtype=torch.float32)


def cpu_block_shape(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(rows, cols) of the dW blocks the CPU impl builds one at a time (fp32, about _CPU_BLOCK_BYTES)."""
    elems = _CPU_BLOCK_BYTES // 4
    rows = max(1, min(n_rows, max(elems // max(1, n_cols), _CPU_BLOCK_MIN_ROWS)))
    cols = max(1, min(n_cols, elems // rows))
    return rows, cols


# ---------------------------------------------------------------------------------------------------------------
# Fast paths. A factory gets the rule's structural flags and returns ``plan(states, hparams) -> (block, scalars)``:
# ``block(w, g, st, tmp)`` updates the block views in place (``st``: state name -> block view; ``g`` is the block's
# dW, scratch from then on; ``tmp`` a scratch block), ``scalars``: state name -> new value of each scalar state.

def _adam(*, amsgrad, maximize, weight_decay, decoupled):
    def plan(s, h):
        lr, beta1, beta2 = h["lr"], h["beta1"], h["beta2"]
        step = s["step"] + 1
        step_size = lr / (1 - beta1 ** step)
        bc2 = torch.sqrt(1 - beta2 ** step)
        eps = h["eps"]
        c1, c2, b2, neg_ss = (1 - beta1).item(), (1 - beta2).item(), beta2.item(), (-step_size).item()
        if weight_decay:
            decay = 1 - lr * h["weight_decay"]
            wd = h["weight_decay"].item()

        def block(w, g, st, tmp):
            if maximize:
                g.neg_()
            if weight_decay:
                if decoupled:
                    w.mul_(decay)
                else:
                    g.addcmul_(w, _ONE, value=wd)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            torch.sub(g, m, out=tmp)
            m.addcmul_(tmp, _ONE, value=c1)
            torch.addcmul(_NEG0, g, g, value=c2, out=tmp)
            torch.addcmul(tmp, v, _ONE, value=b2, out=v)
            if amsgrad:
                v = torch.maximum(st["max_exp_avg_sq"], v, out=st["max_exp_avg_sq"])
            torch.sqrt(v, out=tmp)
            # not addcdiv(eps, tmp, bc2): with two broadcast scalars its kernel leaves the vectorized loop (4x slower)
            tmp.div_(bc2)
            tmp.add_(eps)
            w.addcdiv_(m, tmp, value=neg_ss)

        return block, {"step": step}

    return plan


def _sgd(*, momentum, nesterov, weight_decay, maximize):
    def plan(s, h):
        neg_lr = (-h["lr"]).item()
        if weight_decay:
            wd = h["weight_decay"].item()
        if momentum:
            mom, damp = h["momentum"].item(), (1 - h["dampening"]).item()

        def block(w, g, st, tmp):
            if maximize:
                g.neg_()
            if weight_decay:
                g.addcmul_(w, _ONE, value=wd)
            if momentum:
                buf = st["momentum_buffer"]
                buf.mul_(h["momentum"])
                buf.addcmul_(g, _ONE, value=damp)
                if nesterov:
                    g.addcmul_(buf, _ONE, value=mom)
                else:
                    g = buf
            w.addcmul_(g, _ONE, value=neg_lr)

        return block, {}

    return plan


def _lion(*, maximize):
    def plan(s, h):
        lr, beta1, beta2 = h["lr"], h["beta1"], h["beta2"]
        c1, c2 = 1 - beta1, 1 - beta2
        decay = 1 - lr * h["weight_decay"]
        b1, b2, neg_lr = beta1.item(), beta2.item(), (-lr).item()

        def block(w, g, st, tmp):
            if maximize:
                g.neg_()
            m = st["exp_avg"]
            torch.mul(g, c1, out=tmp)
            tmp.addcmul_(m, _ONE, value=b1)
            tmp.sign_()
            w.mul_(decay)
            w.addcmul_(tmp, _ONE, value=neg_lr)
            g.mul_(c2)
            torch.addcmul(g, m, _ONE, value=b2, out=m)

        return block, {"step": s["step"] + 1}

    return plan


def _adagrad(*, weight_decay, maximize):
    def plan(s, h):
        step = s["step"] + 1
        clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        neg_clr = (-clr).item()
        eps = h["eps"]
        if weight_decay:
            wd = h["weight_decay"].item()

        def block(w, g, st, tmp):
            if maximize:
                g.neg_()
            if weight_decay:
                g.addcmul_(w, _ONE, value=wd)
            acc = st["sum"]
            torch.mul(g, g, out=tmp)
            acc.add_(tmp)
            torch.sqrt(acc, out=tmp)
            tmp.add_(eps)
            w.addcdiv_(g, tmp, value=neg_clr)

        return block, {"step": step}

    return plan


def _rmsprop(*, centered, momentum, weight_decay, maximize):
    def plan(s, h):
        alpha = h["alpha"]
        a, c, neg_lr = alpha.item(), (1 - alpha).item(), (-h["lr"]).item()
        eps = h["eps"]
        if weight_decay:
            wd = h["weight_decay"].item()
        if momentum:
            mom = h["momentum"].item()

        def block(w, g, st, tmp):
            if maximize:
                g.neg_()
            if weight_decay:
                g.addcmul_(w, _ONE, value=wd)
            sq = st["square_avg"]
            torch.addcmul(_NEG0, g, g, value=c, out=tmp)
            torch.addcmul(tmp, sq, _ONE, value=a, out=sq)
            if centered:
                ga = st["grad_avg"]
                torch.sub(g, ga, out=tmp)
                ga.addcmul_(tmp, _ONE, value=c)
                torch.addcmul(_NEG0, ga, ga, value=-1.0, out=tmp)
                tmp.add_(sq)
                tmp.sqrt_()
            else:
                torch.sqrt(sq, out=tmp)
            tmp.add_(eps)
            if momentum:
                buf = st["momentum_buffer"]
                g.div_(tmp)
                torch.addcmul(g, buf, _ONE, value=mom, out=buf)
                w.addcmul_(buf, _ONE, value=neg_lr)
            else:
                w.addcdiv_(g, tmp, value=neg_lr)

        return block, {"step": s["step"] + 1}

    return plan


# kind in the rule's name -> (catalogue factory rebuilding the rule from its flags, fast-path factory)
_CATALOGUE: dict[str, tuple[Callable[..., Rule], Callable]] = {
    "adam": (lambda **f: _rules.adam_rule(**f), lambda **f: _adam(decoupled=False, **f)),
    "adamw": (lambda **f: _rules.adam_rule(decoupled=True, **f), lambda **f: _adam(decoupled=True, **f)),
    "sgd": (_rules.sgd_rule, _sgd),
    "lion": (_rules.lion_rule, _lion),
    "adagrad": (_rules.adagrad_rule, _adagrad),
    "rmsprop": (_rules.rmsprop_rule, _rmsprop),
}
_NAME = re.compile(r"^(\w+)\[(.*)\]$")

_FAST: dict[str, Optional[Callable]] = {}     # rule name -> plan, or None (generic path)
_FAST_LOCK = threading.Lock()


def _scaled(plan):
    """``plan`` for ``grad_scaled_rule(base)``: the block's gradient (the caller's scratch) is multiplied by
    grad_scale in place first -- the rule's ``grad * grad_scale``, the same fp32 multiply."""
    def scaled_plan(s, h):
        h = dict(h)
        scale = h.pop("grad_scale")
        block, scalars = plan(s, h)

        def scaled_block(w, g, views, tmp):
            g.mul_(scale)
            block(w, g, views, tmp)
        return scaled_block, scalars
    return scaled_plan


def _catalogue_plan(rule: Rule):
    base = scaled_base(rule)
    if base is not None:
        plan = _catalogue_plan(base)
        return None if plan is None else _scaled(plan)
    match = _NAME.match(rule.name)
    if match is None or match.group(1) not in _CATALOGUE:
        return None
    factory, fast = _CATALOGUE[match.group(1)]
    try:
        flags = {k: v == "True" for k, v in (kv.split("=") for kv in match.group(2).split(",") if kv)}
        # Only the catalogue's own function: a user rule registered under a catalogue-looking name keeps its fn
        # (unknown flags raise TypeError, a name taken by another function ValueError).
        if factory(**flags) is not rule:
            return None
    except (TypeError, ValueError):
        return None
    return fast(**flags)


def fast_path_for(rule: Rule, hparams=None, states=None):
    """The in-place plan for ``rule``, or None when the rule runs through its functional fn. The first request
    per rule checks the plan bit for bit against ``rule.fn`` (with ``hparams``/``states`` values when given)."""
    with _FAST_LOCK:
        if rule.name in _FAST:
            return _FAST[rule.name]
        plan = _catalogue_plan(rule)
        if plan is not None:
            mismatch = _self_check(rule, plan, hparams, states)
            if mismatch:
                log.warning("forge: the in-place CPU update of rule %r differs from the rule (%s); "
                            "using the functional rule", rule.name, mismatch)
                plan = None
        _FAST[rule.name] = plan
        return plan


def _self_check(rule: Rule, plan, hparams=None, states=None) -> str:
    """'' when ``plan`` reproduces ``rule.fn`` bit for bit on a random ragged, non-contiguous block (odd width:
    vectorized body and scalar tail both run), else what differs."""
    g = torch.Generator().manual_seed(1234)
    shape, full = (19, 45), (19, 53)
    if hparams is None:
        hparams = [torch.tensor(0.1 + 0.8 * torch.rand((), generator=g).item(), dtype=torch.float64)
                   for _ in rule.hparams]
    hparams = [h.detach().to("cpu", torch.float64) for h in hparams]

    def rand(scale=1.0, positive=False):
        t = torch.randn(full, generator=g) * scale
        return t.abs() if positive else t

    w = rand()
    grad = rand(0.1)
    grad[0, :5] = 0.0
    grad[1, :5] = -0.0
    st = []
    for i, name in enumerate(rule.states):
        if rule.is_scalar_state(i):
            st.append(states[i].detach().cpu().clone() if states is not None else torch.tensor(3.0))
        else:
            st.append(rand(0.01, positive=name in ("exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg")))
    # the fast path on column-split views, the rule on contiguous copies
    blk = (slice(None), slice(3, 3 + shape[1]))
    want = rule.fn(w[blk].clone(), grad[blk].clone(),
                   *[s if rule.is_scalar_state(i) else s[blk].clone() for i, s in enumerate(st)], *hparams)
    block, scalars = plan(dict(zip(rule.states, st)), dict(zip(rule.hparams, hparams)))
    views = {name: s[blk] for i, (name, s) in enumerate(zip(rule.states, st)) if not rule.is_scalar_state(i)}
    block(w[blk], grad[blk].clone(), views, torch.empty(shape))
    got = [w[blk]] + [scalars[n] if rule.is_scalar_state(i) else views[n] for i, n in enumerate(rule.states)]
    for name, a, b in zip(("weight",) + rule.states, got, want):
        a, b = a.detach(), b.detach()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            return f"{name}: {int((_bits(a) != _bits(b)).sum()) if a.shape == b.shape else 'shape'} elements"
    return ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns: torch.equal alone takes -0.0 for +0.0."""
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# The blocked loop.

_SCRATCH = threading.local()


def _scratch(elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Kept per thread across calls: a fresh 2 MiB block is an mmap'ed allocation whose page faults cost as much
    # as an element-wise pass over it.
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None or bufs[0].numel() < elems:
        bufs = _SCRATCH.bufs = (torch.empty(elems), torch.empty(elems))
    return bufs


def wgrad_update_cpu(weight, dy_t, x, states, hparams, rule_name, grad_out=None, cast_out=None, extra=None,
                     ekey=None) -> None:
    """``grad_out``: receives dW; ``cast_out``: receives the updated weight cast to its dtype, block by block while
    the block is in cache (forge::wgrad_update_'s cast_out); ``extra``: (rows, pos), row r of dW gains rows[pos[r]]
    where pos[r] >= 0 (a tied embedding's gradient; with an empty matmul, an embedding's: embedding_update.py);
    ``ekey``: a bf16 weight (bf16/fp32 states) updated in fp32 and stored stochastically rounded with this key
    (stochastic_round.py), through the generic path."""
    rule = get_rule(rule_name)
    plan = None if ekey is not None else fast_path_for(rule, hparams, states)
    n, k = weight.shape
    xf = x if x.dtype == torch.float32 else x.float()
    rows, cols = cpu_block_shape(n, k)
    gbuf, tbuf = _scratch(rows * cols)
    blocks = _blocks(n, k, rows, cols, dy_t, xf, gbuf, tbuf, grad_out, extra)
    with torch.no_grad():
        if plan is not None:
            block, new_scalars = _planned(rule, plan, states, hparams)
            names = [(i, name) for i, name in enumerate(rule.states) if not rule.is_scalar_state(i)]
            for blk, g, tmp in blocks:
                block(weight[blk], g, {name: states[i][blk] for i, name in names}, tmp)
                if cast_out is not None:
                    cast_out[blk].copy_(weight[blk])
            for i, name in enumerate(rule.states):
                if rule.is_scalar_state(i):
                    states[i].copy_(new_scalars[name])
        else:
            _generic(rule, weight, states, hparams, blocks, cast_out, ekey)


# (rule, hyper-parameter and scalar-state values) -> (block, new scalars): every linear layer of a step has the
# same values, and the plan's 0-dim arithmetic (~15 tiny ops) was a third of the op's host time on small layers.
_PLANS: dict = {}
_PLANS_MAX = 64


def _planned(rule: Rule, plan, states, hparams):
    scalar = [(name, states[i]) for i, name in enumerate(rule.states) if rule.is_scalar_state(i)]
    key = (plan, tuple((t.dtype, t.item()) for t in hparams), tuple((t.dtype, t.item()) for _, t in scalar))
    hit = _PLANS.get(key)
    if hit is None:
        # Clones: the block closes over some of these tensors, and a later call with other tensors of the same
        # values reuses it after these ones may have changed (an in-place LR schedule).
        hit = plan({name: t.detach().clone() for name, t in scalar},
                   {name: t.detach().clone() for name, t in zip(rule.hparams, hparams)})
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = hit
    return hit


def _blocks(n, k, rows, cols, dy_t, xf, gbuf, tbuf, grad_out, extra=None):
    """(index, dW block, scratch block) for each block of dW; the dW block is the caller's to overwrite."""
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        dy_blk = dy_t[r0:r1].float()
        if extra is not None:
            epos = extra[1][r0:r1].long()
            ehit = (epos >= 0).nonzero().squeeze(1)
        for c0 in range(0, k, cols):
            c1 = min(k, c0 + cols)
            shape = (r1 - r0, c1 - c0)
            size = shape[0] * shape[1]
            g = torch.mm(dy_blk, xf[:, c0:c1], out=gbuf[:size].view(shape))
            if extra is not None:
                g[ehit] += extra[0][epos[ehit], c0:c1].float()
            blk = (slice(r0, r1), slice(c0, c1))
            if grad_out is not None:
                grad_out[blk].copy_(g)
            yield blk, g, tbuf[:size].view(shape)


def _generic(rule, weight, states, hparams, blocks, cast_out=None, ekey=None):
    tensor_idx = [i for i in range(len(states)) if not rule.is_scalar_state(i)]
    scalar_idx = [i for i in range(len(states)) if rule.is_scalar_state(i)]
    scalar_in = [states[i].clone() for i in scalar_idx]   # every block starts from the old scalars
    new_scalars = None
    for blk, g, _ in blocks:
        blk_states = list(states)
        for i in tensor_idx:
            blk_states[i] = states[i][blk]
        for j, i in enumerate(scalar_idx):
            blk_states[i] = scalar_in[j]
        if ekey is None:
            out = rule.fn(weight[blk], g, *blk_states, *hparams)
            weight[blk].copy_(out[0])
        else:
            for i in tensor_idx:
                blk_states[i] = blk_states[i].float()
            out = rule.fn(weight[blk].float(), g, *blk_states, *hparams)
            rows, cols = blk
            k = weight.shape[1]
            idx = (torch.arange(rows.start, rows.stop)[:, None] * k + torch.arange(cols.start, cols.stop)[None, :])
            weight[blk].copy_(stochastic_round_bf16_at(out[0], idx, ekey))
        for i in tensor_idx:
            states[i][blk].copy_(out[1 + i])
        if cast_out is not None:
            cast_out[blk].copy_(weight[blk])
        if new_scalars is None:
            new_scalars = [out[1 + i] for i in scalar_idx]
    if new_scalars is not None:
        for j, i in enumerate(scalar_idx):
            states[i].copy_(new_scalars[j])
