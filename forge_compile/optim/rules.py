"""Built-in rules: torch.optim's single-tensor (``foreach=False``) updates of torch 2.11-2.13, written
with the element-wise ops a rule may use.

The formulas follow torch's op order; the only differences are roundings torch's CPU kernels fold into
one FMA (``add(alpha=)``, ``addcmul``, ``lerp``), which a rule cannot spell, so results agree to about
an ulp per step. ``lerp`` is always written in its small-weight form ``a + w * (b - a)`` (torch
switches form at ``w >= 0.5``, i.e. beta1 <= 0.5 for Adam): the same value, rounded differently.

Everything that changes the formula (``maximize``, ``nesterov``, ``weight_decay != 0``, ...) is a
structural flag baked into the rule's name; values are hyper-parameters, so a scheduler never retraces.
Expressions of only ``step`` and hyper-parameters (bias corrections, step + 1) are 0-dim: the code
generator runs them on the host.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from .rule import Rule, register_rule

__all__ = ["sgd_rule", "adam_rule", "adamw_rule", "adagrad_rule", "rmsprop_rule", "lion_rule"]

_CACHE: dict[str, Rule] = {}
_LOCK = threading.Lock()


def _name(kind: str, **flags: bool) -> str:
    return kind + "[" + ",".join(f"{k}={bool(v)}" for k, v in flags.items()) + "]"


def _rule(name: str, states: tuple, scalar_states: tuple, hparams: tuple,
          body: Callable[[torch.Tensor, torch.Tensor, dict, dict], tuple]) -> Rule:
    """One Rule object per name: the registry refuses a second, different function under a name."""
    with _LOCK:
        rule = _CACHE.get(name)
        if rule is None:
            n_s = len(states)

            def fn(param, grad, *xs):
                s = dict(zip(states, xs[:n_s]))
                h = dict(zip(hparams, xs[n_s:]))
                out = body(param, grad, s, h)
                return (out[0],) + tuple(out[1][k] for k in states)

            fn.__name__ = fn.__qualname__ = name
            rule = register_rule(Rule(name, fn, tuple(states), tuple(scalar_states), tuple(hparams)))
            _CACHE[name] = rule
        return rule


def sgd_rule(*, momentum: bool = False, nesterov: bool = False, weight_decay: bool = False,
             maximize: bool = False) -> Rule:
    """torch.optim.SGD. ``dampening`` is a hyper-parameter so that the caller can pass 0 on the first
    step with a zero buffer: ``0 * m + (1 - 0) * g == g`` is torch's ``buf = clone(grad)`` exactly
    (up to the sign of a zero)."""
    if nesterov and not momentum:
        raise ValueError("nesterov needs momentum")
    name = _name("sgd", momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                 maximize=maximize)
    states = ("momentum_buffer",) if momentum else ()
    hparams = ("lr",) + (("weight_decay",) if weight_decay else ()) + (
        ("momentum", "dampening") if momentum else ())

    def body(p, g, s, h):
        if maximize:
            g = -g
        if weight_decay:
            g = g + h["weight_decay"] * p
        new = {}
        if momentum:
            buf = s["momentum_buffer"] * h["momentum"] + (1 - h["dampening"]) * g
            new["momentum_buffer"] = buf
            g = g + h["momentum"] * buf if nesterov else buf
        return p + (-h["lr"]) * g, new

    return _rule(name, states, (), hparams, body)


def adam_rule(*, amsgrad: bool = False, maximize: bool = False, weight_decay: bool = False,
              decoupled: bool = False) -> Rule:
    """torch.optim.Adam (``decoupled=True``: AdamW / ``decoupled_weight_decay=True``)."""
    decoupled = bool(decoupled and weight_decay)   # without weight decay the two are one rule
    name = _name("adamw" if decoupled else "adam", amsgrad=amsgrad, maximize=maximize,
                 weight_decay=weight_decay)
    states = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    hparams = ("lr", "beta1", "beta2", "eps") + (("weight_decay",) if weight_decay else ())

    def body(p, g, s, h):
        lr, beta1, beta2 = h["lr"], h["beta1"], h["beta2"]
        step = s["step"] + 1
        if maximize:
            g = -g
        if weight_decay:
            if decoupled:
                p = p * (1 - lr * h["weight_decay"])
            else:
                g = g + h["weight_decay"] * p
        m = s["exp_avg"] + (1 - beta1) * (g - s["exp_avg"])
        v = s["exp_avg_sq"] * beta2 + ((1 - beta2) * g) * g
        new = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = torch.sqrt(1 - beta2 ** step)
        if amsgrad:
            v = torch.maximum(s["max_exp_avg_sq"], v)
            new["max_exp_avg_sq"] = v
        denom = torch.sqrt(v) / bias_correction2_sqrt + h["eps"]
        return p + ((-step_size) * m) / denom, new

    return _rule(name, states, ("step",), hparams, body)


def adamw_rule(*, amsgrad: bool = False, maximize: bool = False, weight_decay: bool = True) -> Rule:
    """torch.optim.AdamW."""
    return adam_rule(amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay, decoupled=True)


def adagrad_rule(*, weight_decay: bool = False, maximize: bool = False) -> Rule:
    """torch.optim.Adagrad (dense gradients). ``initial_accumulator_value`` only fills ``sum`` once,
    so it is no hyper-parameter of the rule."""
    name = _name("adagrad", weight_decay=weight_decay, maximize=maximize)
    states = ("step", "sum")
    hparams = ("lr", "lr_decay", "eps") + (("weight_decay",) if weight_decay else ())

    def body(p, g, s, h):
        step = s["step"] + 1
        if maximize:
            g = -g
        if weight_decay:
            g = g + h["weight_decay"] * p
        clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        acc = s["sum"] + g * g
        std = torch.sqrt(acc) + h["eps"]
        return p + ((-clr) * g) / std, {"step": step, "sum": acc}

    return _rule(name, states, ("step",), hparams, body)


def rmsprop_rule(*, centered: bool = False, momentum: bool = False, weight_decay: bool = False,
                 maximize: bool = False) -> Rule:
    """torch.optim.RMSprop; ``momentum`` is ``group["momentum"] > 0``."""
    name = _name("rmsprop", centered=centered, momentum=momentum, weight_decay=weight_decay,
                 maximize=maximize)
    states = (("step", "square_avg") + (("momentum_buffer",) if momentum else ())
              + (("grad_avg",) if centered else ()))
    hparams = (("lr", "alpha", "eps") + (("weight_decay",) if weight_decay else ())
               + (("momentum",) if momentum else ()))

    def body(p, g, s, h):
        alpha = h["alpha"]
        new = {"step": s["step"] + 1}
        if maximize:
            g = -g
        if weight_decay:
            g = g + h["weight_decay"] * p
        sq = s["square_avg"] * alpha + ((1 - alpha) * g) * g
        new["square_avg"] = sq
        if centered:
            ga = s["grad_avg"] + (1 - alpha) * (g - s["grad_avg"])
            new["grad_avg"] = ga
            avg = torch.sqrt(sq + (-ga) * ga)
        else:
            avg = torch.sqrt(sq)
        avg = avg + h["eps"]
        if momentum:
            buf = s["momentum_buffer"] * h["momentum"] + g / avg
            new["momentum_buffer"] = buf
            return p + (-h["lr"]) * buf, new
        return p + ((-h["lr"]) * g) / avg, new

    return _rule(name, states, ("step",), hparams, body)


def lion_rule(*, maximize: bool = False) -> Rule:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled weight decay:
    ``p <- p * (1 - lr * wd) - lr * sign(b1 * m + (1 - b1) * g)``, then ``m <- b2 * m + (1 - b2) * g``.
    ``step`` is only counted, as the other optimizers' state carries it."""
    name = _name("lion", maximize=maximize)

    def body(p, g, s, h):
        lr, beta1, beta2 = h["lr"], h["beta1"], h["beta2"]
        if maximize:
            g = -g
        m = s["exp_avg"]
        update = torch.sign(beta1 * m + (1 - beta1) * g)
        p = p * (1 - lr * h["weight_decay"]) + (-lr) * update
        return p, {"step": s["step"] + 1, "exp_avg": beta2 * m + (1 - beta2) * g}

    return _rule(name, ("step", "exp_avg"), ("step",), ("lr", "beta1", "beta2", "weight_decay"), body)
