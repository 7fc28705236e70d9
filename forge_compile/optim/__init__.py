from .lion import Lion, RuleOptimizer
from .optimizer8bit import AdamW8bit, Lion8bit, Rule8bitOptimizer
from .rule import Rule, get_rule, grad_scaled_rule, register_rule
from .rules import adagrad_rule, adam_rule, adamw_rule, lion_rule, rmsprop_rule, sgd_rule
from .translate import (
    ParamPlan,
    UnsupportedOptimizerError,
    hparam_values,
    plan_optimizer,
    prepare_states,
    structure_key,
)

__all__ = [
    "AdamW8bit",
    "Lion",
    "Lion8bit",
    "ParamPlan",
    "Rule",
    "Rule8bitOptimizer",
    "RuleOptimizer",
    "UnsupportedOptimizerError",
    "adagrad_rule",
    "adam_rule",
    "adamw_rule",
    "get_rule",
    "grad_scaled_rule",
    "hparam_values",
    "lion_rule",
    "plan_optimizer",
    "prepare_states",
    "register_rule",
    "rmsprop_rule",
    "sgd_rule",
    "structure_key",
]
