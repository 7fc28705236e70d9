"""Eager optimizers with 8-bit block-wise states (kernels/q8_state.py's format): ``Rule8bitOptimizer`` for any
element-wise forge Rule, ``AdamW8bit`` and ``Lion8bit``.

Each parameter of at least ``min_8bit_size`` elements keeps its rule's tensor states (AdamW's ``exp_avg`` and
``exp_avg_sq``) as e4m3 codes with one fp32 scale per 128 elements of a row (1.03 bytes per element and state,
against 4 in fp32), rounded stochastically at every step so that the states stay unbiased (q8_state.py says why
round-to-nearest freezes Adam's v). The update is the spec's (q8_state.reference_q8_update with the rule, bitwise):
on CUDA the Triton kernel's stored-gradient update (kernels/wgrad_update_q8.py, one launch per parameter), on CPU
its blocked CPU path.
Smaller parameters (biases, norms) keep full-precision states in the parameter's dtype, updated by the rule as
forge's RuleOptimizer does (AdamW's: torch.optim.AdamW's function up to its CPU kernels' FMA contractions,
tests/test_optim_rules.py).

Why a class of its own, not a state option of torch.optim.AdamW: the states are not torch's (a checkpoint of this
optimizer holds codes and scales), and a user chooses them as with bitsandbytes' AdamW8bit. ``compile_train_step``
fuses it (optim/translate.py plans it through ``q8_layout``/``forge_states``; the capture emits
``forge::apply_rule_q8_`` per 8-bit parameter with the key computed in the graph from its count, and the pattern pass
turns it and its weight gradient's matmul into ``forge::wgrad_update_q8_``): the compiled step is this eager step,
bitwise on the 8-bit parameters. The Dynamo route (backend.py) fuses it too, each parameter's key computed on the
host from its count at every backward.

Rounding bits: the key of a parameter's update is ``round_key(seed, count)`` with its own update count (the rule's
``step`` state where it has one, else the state ``q8_count``; saved with the state, so a resumed run rounds as the
uninterrupted one), salted by the parameter's index in the optimizer. A bf16
parameter is stored stochastically rounded with the same bits as forge's rounded update (stochastic_round.py).

Tensor parallelism (DTensor parameters, ``parallelize_module``): each rank keeps the 8-bit states of its own shard
(plain local tensors: codes and scales of the local rows, blocks of 128 within the local rows) and updates its shard
from its gradient in the parameter's placements (a Partial one reduced first, as torch.optim's DTensor arithmetic
would); the rounding salt of a shard is tensor_parallel.round_salt's (the parameter's index + 2^20 x the shard's
index), so shards draw different bits and replicas equal ones. Whether a parameter's states are 8-bit is decided on
its global size, the same on every rank. Small parameters' full-precision states are DTensors, as torch.optim's.
In a state dict the 8-bit codes and scales of a DTensor parameter are DTensors over the ranks' shards
(tensor_parallel.q8_global), so torch.distributed.checkpoint saves and loads every rank's own; loading into another
sharding is refused (the blocks lie within each shard's rows).

State dict: codes (uint8, viewed as float8_e4m3fn by the kernels) and scales (fp32) as they are; torch.optim's
load_state_dict casts every state but ``step`` to its parameter's dtype (a bf16 parameter's scales would be rounded),
so ``load_state_dict`` puts the 8-bit states back from the dict afterwards.
"""
from __future__ import annotations

import itertools

import torch

from .. import _compat, tensor_parallel
from ..tensor_parallel import local as _local
from ..kernels import q8_state
from ..kernels.stochastic_round import element_key, round_key
from ..kernels.wgrad_update_q8 import update_from_grad
from .lion import Lion
from .rule import Rule
from .rules import adamw_rule, lion_rule

__all__ = ["Rule8bitOptimizer", "AdamW8bit", "Lion8bit"]


def q8_shapes(p: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of an 8-bit state of ``p``: codes [rows, k] (``as_rows``: the first dimension by the rest) and
    scales [rows, ceil(k / 128)]."""
    p = _local(p)
    rows = p.shape[0] if p.dim() >= 2 else 1
    k = p.numel() // max(rows, 1)
    return (rows, k), (rows, -(-k // q8_state.BLOCK))


class Rule8bitOptimizer(torch.optim.Optimizer):
    """Applies ``rule`` (a forge Rule) to every parameter with a gradient, with 8-bit tensor states for the parameters
    of at least ``min_8bit_size`` elements. ``defaults`` give the rule's hyper-parameters by name (param groups may
    override them); ``seed`` and ``min_8bit_size`` are group options too. Subclasses map their own hyper-parameter
    names in ``group_hparams`` (as RuleOptimizer's)."""

    def __init__(self, params, rule: Rule, *, seed: int = 0, min_8bit_size: int = 4096, **defaults):
        if not isinstance(rule, Rule):
            raise TypeError(f"{type(self).__name__} needs a forge Rule, got {type(rule).__name__}")
        self.rule = rule
        super().__init__(params, dict(defaults, seed=int(seed), min_8bit_size=int(min_8bit_size)))
        for group in self.param_groups:
            try:
                self.group_hparams(group)
            except KeyError as e:
                raise ValueError(f"{type(self).__name__}: rule {rule.name!r} needs hyper-parameter {e.args[0]!r} "
                                 f"(it takes {list(rule.hparams)})") from None
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"{type(self).__name__}: parameters must be fp32 or bf16 (bf16 ones are "
                                     f"rounded stochastically), got {p.dtype}")

    def group_rule(self, group: dict) -> Rule:
        return self.rule

    def group_hparams(self, group: dict) -> list[float]:
        """The rule's hyper-parameters for ``group``, in ``rule.hparams`` order."""
        return [float(group[n]) for n in self.group_rule(group).hparams]

    def is_8bit(self, p: torch.Tensor, group: dict) -> bool:
        """Whether ``p`` keeps 8-bit states: large enough (a DTensor: its global size, so that every rank decides
        alike), and contiguous (its rows are the blocks' rows)."""
        return p.numel() >= group["min_8bit_size"] and _local(p).is_contiguous() and p.dim() >= 1

    def state_bytes(self) -> int:
        """Bytes of every state tensor (the number the 8-bit format is for)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))

    def q8_layout(self, p: torch.Tensor, group: dict) -> tuple[bool, tuple[str, ...]]:
        """(8-bit?, the names in ``state[p]`` of the states ``forge_states`` returns): the rule's states in order, a
        tensor state of an 8-bit parameter as its ``<name>_codes`` and ``<name>_scales``, then ``q8_count`` where
        the rule has no ``step``. Decided by the existing state (a checkpoint's), else by ``is_8bit``."""
        state = self.state.get(p)
        rule = self.group_rule(group)
        big = any(k.endswith("_codes") for k in state) if state else self.is_8bit(p, group)
        names = []
        for i, name in enumerate(rule.states):
            names += [f"{name}_codes", f"{name}_scales"] if big and not rule.is_scalar_state(i) else [name]
        if self.count_name(rule) == "q8_count":
            names.append("q8_count")
        return big, tuple(names)

    @staticmethod
    def count_name(rule: Rule) -> str:
        """The state counting a parameter's updates, whose value keys its rounding bits: the rule's ``step``, else
        the optimizer's own ``q8_count``."""
        return "step" if "step" in rule.scalar_states else "q8_count"

    def forge_states(self, p: torch.Tensor, group: dict) -> list:
        """``p``'s states (created as the first ``step`` would) in ``q8_layout`` order: what compile_train_step's
        update of ``p`` reads and writes (optim/translate.py)."""
        rule = self.group_rule(group)
        if not self.state.get(p):
            self._init_state(p, group, rule)
        return [self.state[p][n] for n in self.q8_layout(p, group)[1]]

    def _init_state(self, p, group, rule):
        state = self.state[p]
        big = self.is_8bit(p, group)
        (n, k), (_, nb) = q8_shapes(p)
        for i, name in enumerate(rule.states):
            if rule.is_scalar_state(i):
                state[name] = torch.tensor(0.0)
            elif big:
                dev = _local(p).device
                state[f"{name}_codes"] = torch.zeros(n, k, dtype=torch.uint8, device=dev)
                state[f"{name}_scales"] = torch.zeros(n, nb, dtype=torch.float32, device=dev)
            else:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if self.count_name(rule) == "q8_count":
            state["q8_count"] = torch.tensor(0.0)

    def _states(self, state, rule, big):
        out = []
        for i, name in enumerate(rule.states):
            if rule.is_scalar_state(i) or not big:
                out.append(state[name])
            else:
                out.append([state[f"{name}_codes"].view(torch.float8_e4m3fn), state[f"{name}_scales"]])
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        salt = -1
        for group in self.param_groups:
            rule = self.group_rule(group)
            hp = [torch.tensor(v, dtype=torch.float64) for v in self.group_hparams(group)]
            for p in group["params"]:
                salt += 1       # the parameter's index in the optimizer, with or without a gradient
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, group, rule)
                counter = state[self.count_name(rule)]
                key = round_key(group["seed"], int(counter))
                big = any(k.endswith("_codes") for k in state)
                states = self._states(state, rule, big)
                # a DTensor: this rank's shard, from its gradient in the parameter's placements, with the shard's salt
                param, grad, psalt = tensor_parallel.shard_inputs(p, salt)
                if param is not p:
                    states = [[_local(t) for t in s] if isinstance(s, list) else _local(s) for s in states]
                if big:
                    update_from_grad(param, grad, states, hp, rule.name, key=key, salt=psalt)
                elif p.dtype == torch.bfloat16:
                    rule.apply_rounded(param, grad, states, hp, element_key(key, psalt))
                else:
                    rule.apply(param, grad, states, hp)
                if "q8_count" in state:
                    state["q8_count"] += 1
        return loss

    def dequantized_state(self, p: torch.Tensor) -> dict:
        """``p``'s states as full-precision tensors shaped like ``p`` under the rule's names (torch.optim's for AdamW):
        for inspection and for moving a run to another optimizer."""
        state = self.state[p]
        out = {}
        for k, v in state.items():
            if k.endswith("_codes"):
                name = k[: -len("_codes")]
                # (a DTensor parameter's: its local shard's)
                out[name] = q8_state.dequantize(v.view(torch.float8_e4m3fn), state[f"{name}_scales"]).view_as(
                    _local(p))
            elif not k.endswith("_scales"):
                out[k] = v
        return out

    def state_dict(self) -> dict:
        """torch.optim's state dict; a DTensor parameter's 8-bit codes and scales as DTensors over this rank's shard
        (tensor_parallel.q8_global): torch.distributed.checkpoint then saves each rank's own (as plain tensors of one
        name, it kept one rank's for every rank), and load_state_dict takes either form."""
        sd = super().state_dict()
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        for i, st in list(sd["state"].items()):
            p = params[i]
            if not _compat.is_dtensor(p) or not any(k.endswith("_codes") for k in st):
                continue
            st = sd["state"][i] = dict(st)   # torch.optim's dict is the live state: never write into it
            for name in [k[: -len("_codes")] for k in st if k.endswith("_codes")]:
                st[f"{name}_codes"], st[f"{name}_scales"] = tensor_parallel.q8_global(
                    st[f"{name}_codes"], st[f"{name}_scales"], p, q8_state.BLOCK)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        saved = {i: {k: _local(v) for k, v in st.items() if k.endswith(("_codes", "_scales"))}
                 for i, st in state_dict["state"].items()}
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = dict(zip(ids, itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
        # this rank's shards must be the ones saved (another sharding splits the blocks elsewhere): checked before
        # anything changes
        for i, q in saved.items():
            (n, k), (_, nb) = q8_shapes(params[i])
            for key, v in q.items():
                want = (n, k) if key.endswith("_codes") else (n, nb)
                if tuple(v.shape) != want:
                    raise ValueError(f"forge: {type(self).__name__}.load_state_dict: state {key!r} of parameter {i} "
                                     f"is {list(v.shape)} on this rank, its shard's 8-bit state is {list(want)} (a "
                                     "checkpoint of another sharding or shape)")
        super().load_state_dict(state_dict)
        # undo torch.optim's cast of these to the parameter's dtype: the 8-bit states as they were saved
        for i, q in saved.items():
            p = params[i]
            for k, v in q.items():
                self.state[p][k] = v.to(_local(p).device, copy=True)


class AdamW8bit(Rule8bitOptimizer):
    """torch.optim.AdamW (lr, betas, eps, weight_decay) with 8-bit moments."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, seed: int = 0, min_8bit_size: int = 4096):
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, adamw_rule(), seed=seed, min_8bit_size=min_8bit_size, lr=lr, betas=tuple(betas),
                         eps=eps, weight_decay=weight_decay)

    def group_hparams(self, group: dict) -> list[float]:
        b1, b2 = group["betas"]
        return [float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"])]


class Lion8bit(Rule8bitOptimizer):
    """forge.optim.Lion (lr, betas, weight_decay) with an 8-bit momentum: 1.03 bytes per parameter of state."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 *, seed: int = 0, min_8bit_size: int = 4096):
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, lion_rule(), seed=seed, min_8bit_size=min_8bit_size, lr=lr, betas=tuple(betas),
                         weight_decay=weight_decay)

    group_hparams = Lion.group_hparams      # the same group options as forge's Lion
