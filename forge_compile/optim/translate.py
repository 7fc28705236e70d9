"""torch.optim optimizers -> forge rules, per parameter, with the state kept in torch.optim's format.

``plan_optimizer`` only reads: it decides everything (and refuses what forge cannot reproduce) before
any state exists, so a refusal leaves the optimizer as it was. ``prepare_states`` then creates the
state exactly as the optimizer's own first ``step`` would, so ``state_dict()`` keeps loading into a
plain torch.optim optimizer, which continues the same training.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import operator
import weakref
from typing import Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _compat
from .lion import Lion, RuleOptimizer, _as_float
from .rule import Rule
from .rules import adagrad_rule, adam_rule, rmsprop_rule, sgd_rule

__all__ = ["ParamPlan", "UnsupportedOptimizerError", "plan_optimizer", "prepare_states", "flush_step_mirrors",
           "discard_step_mirrors", "HparamTensors", "has_fresh_state", "cacheable_reads", "step_for_forge",
           "hparam_values", "structure_key", "plan_and_structure_key", "is_8bit_optimizer"]

log = logging.getLogger(__name__)


class UnsupportedOptimizerError(TypeError):
    pass


class _Refuse(Exception):
    """Why a group cannot be translated; turned into UnsupportedOptimizerError with the class name."""


@dataclasses.dataclass(frozen=True, eq=False)
class ParamPlan:
    param: torch.nn.Parameter
    group_index: int
    rule: Rule
    # a Rule8bitOptimizer's parameter: whether its tensor states are 8-bit (codes + scales), and the names in
    # ``optimizer.state[param]`` of the states ``prepare_states`` returns (None: the rule's states)
    q8: bool = False
    names: Optional[tuple] = None

    @property
    def state_names(self) -> tuple:
        return self.rule.states if self.names is None else self.names

    def q8_inputs(self, states) -> tuple:
        """A Rule8bitOptimizer plan's ``states`` (``prepare_states``' list, or graph nodes in its order) as the 8-bit
        ops take them -- (codes, scales, scalar states) for an 8-bit parameter, the rule's states otherwise -- and its
        update count (whose value keys the rounding bits)."""
        from .optimizer8bit import Rule8bitOptimizer

        names = self.state_names
        count = states[names.index(Rule8bitOptimizer.count_name(self.rule))]
        if not self.q8:
            return tuple(states[:len(self.rule.states)]), count
        pick = lambda f: [s for n, s in zip(names, states) if f(n)]   # noqa: E731
        return (pick(lambda n: n.endswith("_codes")), pick(lambda n: n.endswith("_scales")),
                pick(lambda n: n in self.rule.scalar_states)), count

    def own_round_key(self, optimizer, states) -> int:
        """A Rule8bitOptimizer parameter's rounding key for its next update: round_key(its group's seed, its count),
        the count read before it advances -- its eager step's key."""
        from ..kernels.stochastic_round import round_key

        return round_key(int(optimizer.param_groups[self.group_index]["seed"]), int(self.q8_inputs(states)[1]))

    def rule_scalar_states(self, states) -> list:
        """``states`` (``prepare_states``' list) as the rule's states in order with None for each tensor state: what
        a scalar-table row is filled from (passes/scalar_table.fill_table), whatever the layout (a Rule8bitOptimizer
        parameter's codes, scales and q8_count differ from the rule's)."""
        if self.names is None:
            return [s if self.rule.is_scalar_state(i) else None for i, s in enumerate(states)]
        scalars = iter([s for n, s in zip(self.names, states) if n in self.rule.scalar_states])
        return [next(scalars) if self.rule.is_scalar_state(i) else None for i in range(len(self.rule.states))]

    def table_tensor_states(self, states) -> list:
        """The tensor states a scalar-table update takes, in the graph's order: the rule's, or an 8-bit parameter's
        codes and scales (``<name>_codes``, ``<name>_scales`` per tensor state)."""
        if self.names is None:
            from ..kernels.wgrad_update_triton import split_states

            return split_states(self.rule, states)[0]
        if self.q8:
            return [s for n, s in zip(self.names, states) if n.endswith(("_codes", "_scales"))]
        return [s for n, s in zip(self.names, states) if n in self.rule.states and n not in self.rule.scalar_states]



# -- per optimizer: the group's rule, its state, its hyper-parameters ----------------------------------

def _flag_off(group, *names):
    for n in names:
        if group.get(n):
            raise _Refuse(f"{n}=True is not supported (forge fuses the update itself; use {n}=False)")


def _nonzero(v) -> bool:
    return _as_float(v) != 0.0


def _zeros(p):
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _cpu_step(state):
    """``step`` as torch.optim's non-capturable optimizers keep it (a checkpoint of a fused or
    capturable optimizer leaves it on the device, an old one as a number)."""
    s = state["step"]
    if not (isinstance(s, torch.Tensor) and s.dim() == 0 and s.dtype == torch.float32
            and s.device.type == "cpu"):
        state["step"] = torch.tensor(_as_float(s), dtype=torch.float32)
    return state["step"]


def _device_step_group(group) -> bool:
    """torch.optim keeps ``step`` on the parameter's device for fused and capturable groups."""
    return bool(group.get("fused")) or bool(group.get("capturable"))


# forge's update reads ``step`` on the host (bias corrections are host scalars of the fused kernel), but
# a fused/capturable group keeps it on the device. Such a step gets a CPU mirror that forge reads and
# advances; ``flush_step_mirrors`` writes it back after each forge update, so ``opt.state`` stays in
# torch's format (a plain ``opt.step()`` or a checkpoint continues from it). The device tensor's version
# counter tells whether anything else (torch's own step, a user) changed it since: then it is re-read,
# the only device sync, and rare.
_STEP_MIRRORS = WeakIdKeyDictionary()     # device step -> [cpu mirror, device version after our write]
_PENDING_FLUSH: dict = {}                 # id(device step) -> (device step, mirror)


def _uses_mirror(group, p) -> bool:
    return _device_step_group(group) and p.device.type != "cpu"


def _step_for_forge(state, group, p):
    s = state["step"]
    if not _uses_mirror(group, p):
        return _cpu_step(state)
    if not (isinstance(s, torch.Tensor) and s.dim() == 0 and s.device == p.device):
        s = state["step"] = torch.tensor(_as_float(s), dtype=torch.float32, device=p.device)
    entry = _STEP_MIRRORS.get(s)
    if entry is None or entry[1] != s._version:
        entry = _STEP_MIRRORS[s] = [torch.tensor(float(s), dtype=torch.float32), s._version]
    _PENDING_FLUSH[id(s)] = (s, entry[0])
    return entry[0]


def step_for_forge(optimizer: torch.optim.Optimizer, plan, state) -> torch.Tensor:
    """What ``prepare_states`` puts at the ``step`` position for ``plan`` (``state`` = its
    ``optimizer.state`` dict): the step itself, or a fused/capturable group's CPU mirror with its
    write-back queued for ``flush_step_mirrors`` -- for callers that cache the other states."""
    return _step_for_forge(state, optimizer.param_groups[plan.group_index], plan.param)


def flush_step_mirrors() -> None:
    """Write the host mirrors of device ``step`` states back (after a forge update consumed them)."""
    pending = list(_PENDING_FLUSH.values())
    _PENDING_FLUSH.clear()
    # one copy per device instead of one per parameter: a backward over a model's linears has dozens of them,
    # and each host-to-device copy costs ~10 us of host time (backward was host-bound at fine-tuning sizes)
    by_device: dict = {}
    for dev, mirror in pending:
        by_device.setdefault((dev.device, dev.dtype), []).append((dev, mirror))
    for (device, dtype), pairs in by_device.items():
        values = torch.stack([m for _, m in pairs]).to(device=device, dtype=dtype, non_blocking=True)
        _compat.foreach_copy_([d for d, _ in pairs], list(values.unbind(0)))
    for dev, _ in pending:
        entry = _STEP_MIRRORS.get(dev)
        if entry is not None:
            entry[1] = dev._version


def discard_step_mirrors() -> None:
    """Forget pending write-backs (a capture that ran nothing, e.g. ``forge.explain``)."""
    _PENDING_FLUSH.clear()


# SGD's first step sets buf = clone(grad). forge starts from a zero buffer instead and passes
# dampening 0 for that step (0 * m + 1 * g == g). A buffer is "fresh" while its version counter is
# where prepare_states left it: any update (eager copy_ or a compiled graph's in-place write) bumps
# it, so asking for the hyper-parameters twice, or for a parameter that got no gradient, stays right.
_FRESH_BUFFERS = WeakIdKeyDictionary()


def has_fresh_state(states) -> bool:
    """Whether one of ``states`` (as ``prepare_states`` returned them) is a buffer still fresh, i.e.
    whether ``hparam_values`` depends on more than the param group right now (see above)."""
    return any(_FRESH_BUFFERS.get(s) == s._version for s in states)


def _sgd_rule(opt, group):
    _flag_off(group, "differentiable")
    return sgd_rule(momentum=_nonzero(group["momentum"]), nesterov=bool(group["nesterov"]),
                    weight_decay=_nonzero(group["weight_decay"]), maximize=bool(group["maximize"]))


def _sgd_states(opt, group, p, rule):
    if not rule.states:
        return []       # torch keeps no SGD state without momentum
    state = opt.state[p]
    if state.get("momentum_buffer") is None:
        buf = state["momentum_buffer"] = _zeros(p)
        _FRESH_BUFFERS[buf] = buf._version
    return [state["momentum_buffer"]]


def _sgd_hparams(opt, group, p, rule):
    h = {"lr": group["lr"], "weight_decay": group["weight_decay"], "momentum": group["momentum"],
         "dampening": group["dampening"]}
    if rule.states:
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is not None and _FRESH_BUFFERS.get(buf) == buf._version:
            h["dampening"] = 0.0
    return [_as_float(h[n]) for n in rule.hparams]


def _adam_rule(opt, group):
    _flag_off(group, "differentiable")
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
    return adam_rule(amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                     weight_decay=_nonzero(group["weight_decay"]), decoupled=decoupled)


def _new_step(group, p):
    if _device_step_group(group):
        return torch.zeros((), dtype=torch.float32, device=p.device)
    return torch.tensor(0.0, dtype=torch.float32)


def _adam_init(opt, group, p, state):
    state["step"] = _new_step(group, p)
    state["exp_avg"] = _zeros(p)
    state["exp_avg_sq"] = _zeros(p)


def _adam_hparams(opt, group, p, rule):
    b1, b2 = group["betas"]
    h = {"lr": group["lr"], "beta1": b1, "beta2": b2, "eps": group["eps"],
         "weight_decay": group["weight_decay"]}
    return [_as_float(h[n]) for n in rule.hparams]


def _adagrad_rule(opt, group):
    _flag_off(group, "differentiable")
    return adagrad_rule(weight_decay=_nonzero(group["weight_decay"]), maximize=bool(group["maximize"]))


def _adagrad_init(opt, group, p, state):
    # Adagrad fills its state at construction; a param added later is filled from the optimizer's
    # defaults, not its group's -- as torch's _init_group does.
    state["step"] = _new_step(group, p)
    state["sum"] = torch.full_like(p, opt.defaults["initial_accumulator_value"],
                                   memory_format=torch.preserve_format)


def _group_hparams(opt, group, p, rule):
    return [_as_float(group[n]) for n in rule.hparams]


def _rmsprop_rule(opt, group):
    _flag_off(group, "differentiable")
    return rmsprop_rule(centered=bool(group["centered"]), momentum=_as_float(group["momentum"]) > 0,
                        weight_decay=_nonzero(group["weight_decay"]), maximize=bool(group["maximize"]))


def _rmsprop_init(opt, group, p, state):
    state["step"] = _new_step(group, p)
    state["square_avg"] = _zeros(p)


def _torch_states(init):
    """States of a torch optimizer that creates all of them when ``len(state) == 0``; a missing
    optional one (e.g. amsgrad switched on later) starts at zero."""
    def states(opt, group, p, rule):
        state = opt.state[p]
        if len(state) == 0:
            init(opt, group, p, state)
        for name in rule.states:
            if name not in state:
                state[name] = _new_step(group, p) if name in rule.scalar_states else _zeros(p)
        states = [state[n] for n in rule.states]
        if "step" in rule.states:
            states[rule.states.index("step")] = _step_for_forge(state, group, p)
        return states
    return states


@dataclasses.dataclass(frozen=True)
class _Adapter:
    base: type
    rule: Callable           # (opt, group) -> Rule, raises _Refuse
    states: Callable         # (opt, group, p, rule) -> list[Tensor]
    hparams: Callable        # (opt, group, p, rule) -> list[float]


_ADAPTERS = [   # most derived first: AdamW is an Adam
    _Adapter(torch.optim.SGD, _sgd_rule, _sgd_states, _sgd_hparams),
    _Adapter(torch.optim.AdamW, _adam_rule, _torch_states(_adam_init), _adam_hparams),
    _Adapter(torch.optim.Adam, _adam_rule, _torch_states(_adam_init), _adam_hparams),
    _Adapter(torch.optim.Adagrad, _adagrad_rule, _torch_states(_adagrad_init), _group_hparams),
    _Adapter(torch.optim.RMSprop, _rmsprop_rule, _torch_states(_rmsprop_init), _group_hparams),
    _Adapter(RuleOptimizer,
             lambda opt, group: opt.group_rule(group),
             lambda opt, group, p, rule: opt.state_tensors(p, group),
             lambda opt, group, p, rule: opt.group_hparams(group)),
]


def _rule8bit_adapter() -> _Adapter:
    # optimizer8bit imports the kernels, which import optim.rule: looked up when first asked for
    from .optimizer8bit import Rule8bitOptimizer

    return _Adapter(Rule8bitOptimizer,
                    lambda opt, group: opt.group_rule(group),
                    lambda opt, group, p, rule: opt.forge_states(p, group),
                    lambda opt, group, p, rule: opt.group_hparams(group))


def is_8bit_optimizer(opt) -> bool:
    """A Rule8bitOptimizer (AdamW8bit, Lion8bit): its plans carry ``q8`` and their own state names, its updates
    their own rounding keys (``round_key(group['seed'], the parameter's count)``)."""
    from .optimizer8bit import Rule8bitOptimizer

    return isinstance(opt, Rule8bitOptimizer)


def _raw(f):
    """The function under torch's profiling/grad-mode wrappers and an LR scheduler's step counter."""
    f = inspect.unwrap(f)
    return inspect.unwrap(getattr(f, "__func__", f))


# The adapter depends only on the class's step/_init_group and a step() set on the instance (e.g. an
# LR scheduler's wrapper): cached on those, as it is asked for every parameter at every step.
_ADAPTER_CACHE: dict = {}


def _adapter(opt) -> _Adapter:
    cls = type(opt)
    key = (cls, getattr(cls, "step", None), getattr(cls, "_init_group", None), vars(opt).get("step"))
    hit = _ADAPTER_CACHE.get(key)
    if hit is None:
        hit = _ADAPTER_CACHE[key] = _find_adapter(opt, cls)
    return hit


def _find_adapter(opt, cls) -> _Adapter:
    for a in _ADAPTERS:
        if isinstance(opt, a.base):
            # A subclass may add anything; forge reproduces only the base's update, so the update
            # itself must be the base's.
            for meth in ("step", "_init_group"):
                if hasattr(a.base, meth) and _raw(getattr(cls, meth)) is not _raw(getattr(a.base, meth)):
                    raise _Refuse(f"it overrides {meth}() of {a.base.__name__}, so forge cannot know "
                                  "its update")
            own = vars(opt).get("step")
            if own is not None and _raw(own) is not _raw(getattr(a.base, "step")):
                raise _Refuse("its step() was replaced on the instance")
            return a
    if is_8bit_optimizer(opt):
        a = _rule8bit_adapter()
        own = vars(opt).get("step")
        if own is not None and _raw(own) is not _raw(a.base.step):
            raise _Refuse("its step() was replaced on the instance")
        for meth in ("step", "_init_state", "q8_layout", "forge_states"):
            if _raw(getattr(cls, meth)) is not _raw(getattr(a.base, meth)):
                raise _Refuse(f"it overrides {meth}() of Rule8bitOptimizer, so forge cannot know its update")
        return a
    raise _Refuse("forge translates only torch.optim SGD, Adam, AdamW, Adagrad, RMSprop, forge's Lion "
                  "and RuleOptimizer (write an element-wise Rule and use RuleOptimizer for others)")


def _fail(opt, why) -> UnsupportedOptimizerError:
    return UnsupportedOptimizerError(f"forge: cannot fuse the update of {type(opt).__name__}: {why}")


def _group_rules(opt) -> tuple[_Adapter, list[Rule]]:
    try:
        a = _adapter(opt)
        rules = []
        for i, group in enumerate(opt.param_groups):
            try:
                rules.append(a.rule(opt, group))
            except KeyError as e:
                raise _Refuse(f"param group {i} lacks {e.args[0]!r}") from None
            except _Refuse as e:
                raise _Refuse(f"param group {i}: {e}") from None
    except _Refuse as e:
        raise _fail(opt, e) from None
    return a, rules


_WARNED_HOOKS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


# -- public --------------------------------------------------------------------------------------------

def plan_optimizer(optimizer: torch.optim.Optimizer) -> list[ParamPlan]:
    """One ParamPlan per parameter; raises UnsupportedOptimizerError before touching any state."""
    return list(plan_and_structure_key(optimizer)[0])


# A captured train step plans every optimizer at every call. A plan is made of the parameter, its group's
# index and the group's rule (one Rule object per name), so the plans of the last call are reused when
# the class, every group's rule object and every group's parameters (the same objects, in the same
# order) are still those: the same tuple comes back, which callers may key their own caches on. The
# per-parameter checks below run at every call all the same.
_PLAN_MEMO = WeakIdKeyDictionary()    # optimizer -> (class, rules, params per group, plans, structure key)


def plan_and_structure_key(optimizer: torch.optim.Optimizer) -> tuple[tuple[ParamPlan, ...], tuple]:
    """``plan_optimizer`` (as a tuple, the same object while nothing it depends on changed) and
    ``structure_key``, in one pass over the groups."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"forge: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _, rules = _group_rules(optimizer)
    groups = optimizer.param_groups
    for i, group in enumerate(groups):
        for p in group["params"]:
            if p.is_complex():
                raise _fail(optimizer, f"param group {i} holds a complex parameter")
            if p.grad is not None and p.grad.is_sparse:
                raise _fail(optimizer, f"param group {i} holds a parameter with a sparse gradient")
    cls = type(optimizer)
    # 8-bit states: each parameter's layout (8-bit or not, state names) and the groups' seeds are traced into the
    # step (the rounding keys are computed in it), so they are part of the plans and the structure key
    layouts = _q8_layouts(optimizer) if is_8bit_optimizer(optimizer) else None
    memo = _PLAN_MEMO.get(optimizer)
    if not (memo is not None and memo[0] is cls and len(memo[1]) == len(rules)
            and all(map(operator.is_, rules, memo[1]))
            and all(len(g["params"]) == len(ps) and all(map(operator.is_, g["params"], ps))
                    for g, ps in zip(groups, memo[2])) and memo[5] == layouts):
        if layouts is None:
            plans = tuple(ParamPlan(p, i, rule) for i, (group, rule) in enumerate(zip(groups, rules))
                          for p in group["params"])
        else:
            it = iter(layouts[1])
            plans = tuple(ParamPlan(p, i, rule, *next(it)) for i, (group, rule) in enumerate(zip(groups, rules))
                          for p in group["params"])
        memo = _PLAN_MEMO[optimizer] = (cls, tuple(rules), tuple(tuple(g["params"]) for g in groups), plans,
                                        _structure_key(optimizer, rules) + ((layouts,) if layouts else ()), layouts)
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks) and (
            optimizer not in _WARNED_HOOKS):
        _WARNED_HOOKS.add(optimizer)    # planned again at every step: say it once
        # (compile_train_step refuses step hooks before planning; this is the backend route's case)
        log.warning("forge: %s has step hooks: optimizer.step() runs them, but the fused weights were already "
                    "updated inside loss.backward() (a pre-hook sees them updated, their .grad None)",
                    type(optimizer).__name__)
    return memo[3], memo[4]


def _q8_layouts(optimizer) -> tuple:
    """(every group's seed, every parameter's ``q8_layout``) of a Rule8bitOptimizer (a DTensor parameter's states are
    its local shard's: optimizer8bit.py)."""
    return (tuple(int(g["seed"]) for g in optimizer.param_groups),
            tuple(optimizer.q8_layout(p, g) for g in optimizer.param_groups for p in g["params"]))


def _expected_state(plan: ParamPlan, name: str):
    """(shape, dtype, device) that ``prepare_states`` requires of the state ``name`` of ``plan``."""
    p, cpu = plan.param, torch.device("cpu")
    if name in plan.rule.scalar_states or name == "q8_count":
        return (), torch.float32, cpu
    if name.endswith("_codes") or name.endswith("_scales"):
        from .optimizer8bit import q8_shapes

        codes, scales = q8_shapes(p)
        return (codes, torch.uint8, p.device) if name.endswith("_codes") else (scales, torch.float32, p.device)
    return p.shape, p.dtype, p.device


def prepare_states(optimizer: torch.optim.Optimizer, plan: ParamPlan) -> list[torch.Tensor]:
    """``optimizer.state[plan.param]`` in torch.optim's format (created if missing), as the list of
    the rule's states in ``plan.rule.states`` order."""
    a = _adapter_or_fail(optimizer)
    group = optimizer.param_groups[plan.group_index]
    states = a.states(optimizer, group, plan.param, plan.rule)
    p = plan.param
    for name, s in zip(plan.state_names, states):
        want = _expected_state(plan, name)
        if (tuple(s.shape), s.dtype, s.device) != (tuple(want[0]), want[1], want[2]):
            raise ValueError(f"forge: {type(optimizer).__name__} state {name!r} of a parameter of shape "
                             f"{tuple(p.shape)} is {tuple(s.shape)} {s.dtype} on {s.device}, expected "
                             f"{tuple(want[0])} {want[1]} on {want[2]}")
    return states


def hparam_values(optimizer: torch.optim.Optimizer, plan: ParamPlan) -> list[float]:
    """The hyper-parameters for the step about to run, in ``plan.rule.hparams`` order, read from the
    param group now (so schedulers apply). Call after ``prepare_states``."""
    a = _adapter_or_fail(optimizer)
    group = optimizer.param_groups[plan.group_index]
    return a.hparams(optimizer, group, plan.param, plan.rule)


class HparamTensors:
    """A parameter's hyper-parameters as 0-dim float64 tensors (graph inputs), reused from step to step
    and refilled only where a value changed (a scheduler): creating them anew cost ~1 ms per step for a
    few dozen parameters. Refilling is safe: every consumer reads them on the host when its step is
    launched, and that launch is over before the next step asks for them."""

    __slots__ = ("values", "tensors")

    def __init__(self):
        self.values = None
        self.tensors: list = []

    def update(self, values) -> list:
        values = [float(v) for v in values]
        if len(self.tensors) != len(values):
            self.tensors = [torch.tensor(v, dtype=torch.float64) for v in values]
        elif values != self.values:
            for t, old, new in zip(self.tensors, self.values, values):
                if old != new:
                    t.fill_(new)
        self.values = values
        return self.tensors


def structure_key(optimizer: torch.optim.Optimizer) -> tuple:
    """Everything about ``optimizer`` a traced step depends on besides tensor values."""
    return plan_and_structure_key(optimizer)[1]


def _structure_key(optimizer, rules) -> tuple:
    cls = type(optimizer)
    return (f"{cls.__module__}.{cls.__qualname__}",) + tuple(
        (rule.name, tuple(id(p) for p in group["params"]))
        for group, rule in zip(optimizer.param_groups, rules))


# RuleOptimizer methods whose reads forge knows: group_hparams reads the param group only, state_tensors
# returns the tensors stored in ``state[p]`` under the rule's state names.
_OWN_GROUP_HPARAMS = (RuleOptimizer.group_hparams, Lion.group_hparams)


def cacheable_reads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``prepare_states`` returns the objects stored in ``optimizer.state[p]`` under the rule's
    state names (a device ``step`` aside) and ``hparam_values`` reads the param group and those states
    only: then a caller may reuse them while those objects and the group's values stay the same
    (``state_cache``). A RuleOptimizer subclass with its own ``group_hparams``/``state_tensors`` may read
    anything."""
    if is_8bit_optimizer(optimizer):
        # forge_states returns the stored objects (_find_adapter refuses an override); forge's own group_hparams
        # read the group only
        from .optimizer8bit import AdamW8bit, Rule8bitOptimizer

        own = (Rule8bitOptimizer.group_hparams, AdamW8bit.group_hparams, Lion.group_hparams)
        return ("group_hparams" not in vars(optimizer)
                and any(_raw(type(optimizer).group_hparams) is _raw(f) for f in own))
    if not isinstance(optimizer, RuleOptimizer):
        return True         # torch's optimizers: translate's own functions read them
    cls, own = type(optimizer), vars(optimizer)
    if "group_hparams" in own or "state_tensors" in own:
        return False
    return (any(_raw(cls.group_hparams) is _raw(f) for f in _OWN_GROUP_HPARAMS)
            and _raw(cls.state_tensors) is _raw(RuleOptimizer.state_tensors))


def _adapter_or_fail(opt) -> _Adapter:
    try:
        return _adapter(opt)
    except _Refuse as e:
        raise _fail(opt, e) from None
