"""Eager optimizers defined by a rule: ``RuleOptimizer`` for a user's own element-wise rule, and ``Lion``.

Their ``step`` and forge's fused path call the same three methods (``group_rule``, ``group_hparams``,
``state_tensors``), so the eager and the fused update cannot drift apart.
"""
from __future__ import annotations

import torch

from .rule import Rule
from .rules import lion_rule

__all__ = ["RuleOptimizer", "Lion"]


def _as_float(v) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


class RuleOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer that applies ``rule`` to every parameter with a gradient.

    ``defaults`` must give every hyper-parameter of the rule (param groups may override them); the
    states are created like the parameter, zero-filled (scalar states as ``torch.tensor(0.0)``).
    """

    def __init__(self, params, rule: Rule, **defaults):
        if not isinstance(rule, Rule):
            raise TypeError(f"RuleOptimizer needs a forge Rule, got {type(rule).__name__}")
        self.rule = rule
        try:
            self.group_hparams(defaults)
        except KeyError as e:
            raise ValueError(f"RuleOptimizer: rule {rule.name!r} needs hyper-parameter {e.args[0]!r} "
                             f"in the defaults (it takes {list(rule.hparams)})") from None
        super().__init__(params, defaults)

    # -- what forge's translation reads too ---------------------------------------------------------
    def group_rule(self, group: dict) -> Rule:
        return self.rule

    def group_hparams(self, group: dict) -> list[float]:
        """The rule's hyper-parameters for ``group``, in ``rule.hparams`` order."""
        return [_as_float(group[n]) for n in self.group_rule(group).hparams]

    def state_tensors(self, p: torch.Tensor, group: dict) -> list[torch.Tensor]:
        """``self.state[p]``'s tensors in ``rule.states`` order, creating the missing ones."""
        rule = self.group_rule(group)
        state = self.state[p]
        for name in rule.states:
            if name not in state:
                state[name] = (torch.tensor(0.0) if name in rule.scalar_states
                               else torch.zeros_like(p, memory_format=torch.preserve_format))
        return [state[n] for n in rule.states]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rule = self.group_rule(group)
            hparams = [torch.tensor(v, dtype=torch.float64) for v in self.group_hparams(group)]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                rule.apply(p, p.grad, self.state_tensors(p, group), hparams)
        return loss


class Lion(RuleOptimizer):
    """Lion (Chen et al., 2023) with decoupled weight decay; state ``exp_avg`` and ``step``."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False):
        if not 0.0 <= _as_float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= betas[0] <= 1.0 or not 0.0 <= betas[1] <= 1.0:
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, lion_rule(maximize=maximize), lr=lr, betas=tuple(betas),
                         weight_decay=weight_decay, maximize=maximize)

    def group_rule(self, group: dict) -> Rule:
        return lion_rule(maximize=bool(group.get("maximize", False)))

    def group_hparams(self, group: dict) -> list[float]:
        b1, b2 = group["betas"]
        return [_as_float(group["lr"]), _as_float(b1), _as_float(b2), _as_float(group["weight_decay"])]
