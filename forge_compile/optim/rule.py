"""Element-wise optimizer rules: the one description of an update that every path uses.

A rule is a pure torch function ``fn(param, grad, *states, *hparams) -> (new_param, *new_states)``.
It is the reference (eager optimizers, unfused parameters, tests) and the source from which the fused
epilogue is generated, so the fused and unfused updates are the same function.

Conventions every rule follows so that it can be fused:
- ``param``, ``grad`` and the tensor states have the parameter's shape (fp32);
- ``scalar_states`` (e.g. ``step``) are 0-dim float32 CPU tensors, as torch.optim keeps them;
- hyper-parameters are 0-dim float64 CPU tensors (Python-float precision for lr, betas, ...), so a
  scheduler never forces a retrace and host-side arithmetic matches torch.optim's float math;
- only element-wise ops; Python control flow only on structural flags baked into the rule's name.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional, Sequence

import torch

__all__ = ["Rule", "register_rule", "get_rule", "apply_rule_", "grad_scaled_rule", "scaled_base"]


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    fn: Callable[..., Sequence[torch.Tensor]]
    states: tuple[str, ...] = ()
    scalar_states: tuple[str, ...] = ()
    hparams: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = set(self.scalar_states) - set(self.states)
        if unknown:
            raise ValueError(f"rule {self.name!r}: scalar_states {sorted(unknown)} are not in states")

    def is_scalar_state(self, i: int) -> bool:
        return self.states[i] in self.scalar_states

    def apply(self, param, grad, states, hparams):
        """Run the rule eagerly and write the results back in place (the reference update)."""
        out = self.fn(param, grad, *states, *hparams)
        if len(out) != 1 + len(states):
            raise RuntimeError(
                f"rule {self.name!r} returned {len(out)} tensors, expected {1 + len(states)}"
            )
        param.copy_(out[0])
        for s, new in zip(states, out[1:]):
            s.copy_(new)

    def apply_rounded(self, param, grad, states, hparams, ekey):
        """The rule on fp32 copies of a bf16 ``param``, ``grad`` and the tensor states; ``param`` written back
        rounded stochastically with the bits of ``ekey`` (kernels/stochastic_round.py: an int, or a 0-dim int64
        tensor in a traced graph), the states copied back (rounded to nearest)."""
        from ..kernels.stochastic_round import stochastic_round_bf16

        ins = [s if self.is_scalar_state(i) else s.float() for i, s in enumerate(states)]
        out = self.fn(param.float(), grad.float(), *ins, *hparams)
        param.copy_(stochastic_round_bf16(out[0], ekey))
        for s, new in zip(states, out[1:]):
            s.copy_(new)


_RULES: dict[str, Rule] = {}
_LOCK = threading.Lock()


def register_rule(rule: Rule) -> Rule:
    """Make ``rule`` known by name to the fused op. Re-registering the same function is a no-op."""
    with _LOCK:
        old = _RULES.get(rule.name)
        if old is not None and old != rule:
            raise ValueError(f"a different rule is already registered as {rule.name!r}")
        _RULES[rule.name] = rule
    return rule


def get_rule(name: str) -> Rule:
    try:
        return _RULES[name]
    except KeyError:
        raise KeyError(f"forge: no optimizer rule registered as {name!r}") from None


_SCALED_BASE: dict[str, Rule] = {}  # grad_scaled_rule's name -> the rule it was made from
_SCALED_LOCK = threading.Lock()     # one function per scaled name: register_rule refuses a second one


def grad_scaled_rule(base: Rule) -> Rule:
    """``base`` applied to ``grad * grad_scale``: one more hyper-parameter, ``grad_scale``, last.

    What ``clip_grad_norm_`` leaves for a fused update: it multiplies every gradient in place by one 0-dim fp32
    coefficient (``g.mul_(clip_coef_clamped)``) before the optimizer reads it. Spelled inside the rule, the fused
    kernels apply it to the fp32 dW tile in their epilogue -- one fp32 multiply per element, the value torch's
    ``mul_`` computes -- so dW still never exists. The coefficient arrives as a float64 0-dim CPU tensor like every
    hyper-parameter; it holds an fp32 value exactly, so the rule's type promotion multiplies by that fp32 value."""
    name = f"grad_scaled({base.name})"
    with _SCALED_LOCK:
        if name in _SCALED_BASE:
            return get_rule(name)

        def fn(param, grad, *xs):
            return base.fn(param, grad * xs[-1], *xs[:-1])

        fn.__name__ = fn.__qualname__ = f"grad_scaled_{base.name}"
        rule = register_rule(Rule(name, fn, base.states, base.scalar_states, base.hparams + ("grad_scale",)))
        _SCALED_BASE[name] = base
        return rule


def scaled_base(rule: Rule):
    """The rule ``rule`` was made from by ``grad_scaled_rule``, or None."""
    return _SCALED_BASE.get(rule.name)


# The per-parameter update op the capture emits. The pass matches it (with the mm feeding its grad)
# instead of the rule's decomposed element-wise ops, which differ between torch versions. Whatever the
# pass leaves unfused is decomposed back into the rule's element-wise ops before Inductor sees it.
# ``round_key`` (0-dim int64 CPU tensor) and ``round_salt``: a bf16 parameter under
# compile_train_step(stochastic_rounding=...): the rule runs on fp32 copies of the parameter, gradient and tensor
# states, the parameter is stored stochastically rounded (kernels/stochastic_round.py), the states copied back.
@torch.library.custom_op("forge::apply_rule_", mutates_args=("param", "states"))
def apply_rule_(
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    hparams: list[torch.Tensor],
    rule: str,
    round_key: Optional[torch.Tensor] = None,
    round_salt: int = 0,
) -> None:
    with torch.no_grad():
        decompose_apply_rule(param, grad, states, hparams, rule, round_key, round_salt)


@apply_rule_.register_fake
def _(param, grad, states, hparams, rule, round_key=None, round_salt=0):
    return None


def decompose_apply_rule(param, grad, states, hparams, rule, round_key=None, round_salt=0):
    """Decomposition used when re-tracing: the rule's ops plus copy_ back into param and states."""
    if round_key is None:
        get_rule(rule).apply(param, grad, list(states), list(hparams))
        return
    from ..kernels.stochastic_round import element_key_t

    get_rule(rule).apply_rounded(param, grad, states, hparams, element_key_t(round_key, round_salt))
