"""``AdamW8bit``: torch.optim.AdamW with 8-bit block-wise moments (kernels/q8_state.py's format), eager.

Each parameter of at least ``min_8bit_size`` elements keeps ``exp_avg`` and ``exp_avg_sq`` as e4m3 codes with one
fp32 scale per 128 elements of a row (2.06 bytes per element for both, against 8 for fp32 moments), rounded
stochastically at every step so that the moments stay unbiased (q8_state.py says why round-to-nearest freezes v).
The update is the spec's (q8_state.reference_q8_update with AdamW's rule, bitwise): on CUDA the Triton kernel's
stored-gradient update (kernels/wgrad_update_q8.py, one launch per parameter), on CPU its blocked CPU path.
Smaller parameters (biases, norms) keep torch's AdamW states in the parameter's dtype, updated by forge's AdamW rule
(torch.optim.AdamW's function up to its CPU kernels' FMA contractions: tests/test_optim_rules.py).

Why a class of its own, not a state option of torch.optim.AdamW: the states are not torch's (a checkpoint of this
optimizer holds codes and scales), and a user chooses them as with bitsandbytes' AdamW8bit. ``compile_train_step``
does not fuse it yet: it refuses it with UnsupportedOptimizerError (forge translates only the optimizers it knows),
before any parameter is touched.

Rounding bits: the key of a parameter's update is ``round_key(seed, step)`` with its own step count (saved with the
state, so a resumed run rounds as the uninterrupted one), salted by the parameter's index in the optimizer. A bf16
parameter is stored stochastically rounded with the same bits as forge's rounded update (stochastic_round.py).

State dict: codes (uint8, viewed as float8_e4m3fn by the kernels) and scales (fp32) as they are; torch.optim's
load_state_dict casts every state but ``step`` to its parameter's dtype (a bf16 parameter's scales would be rounded),
so ``load_state_dict`` puts the 8-bit states back from the dict afterwards.
"""
from __future__ import annotations

import itertools

import torch

from ..kernels import q8_state
from ..kernels.stochastic_round import element_key, round_key
from .rules import adamw_rule

__all__ = ["AdamW8bit"]

_Q8_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    # [first dim, the rest]: 128-blocks lie inside these rows, as in a weight [N, K] (a conv weight [O, I, kh, kw] has
    # rows of I * kh * kw, not of kw, which would cost a 4-byte scale per kw elements)
    return t.view(t.shape[0], -1) if t.dim() >= 2 else t.view(1, -1)


class AdamW8bit(torch.optim.Optimizer):
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
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, seed=int(seed),
                                      min_8bit_size=int(min_8bit_size)))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"AdamW8bit: parameters must be fp32 or bf16 (bf16 ones are rounded "
                                     f"stochastically), got {p.dtype}")

    def is_8bit(self, p: torch.Tensor, group: dict) -> bool:
        """Whether ``p`` keeps 8-bit moments: large enough, and contiguous (its rows are the blocks' rows)."""
        return p.numel() >= group["min_8bit_size"] and p.is_contiguous() and p.dim() >= 1

    def state_bytes(self) -> int:
        """Bytes of every state tensor (the number the 8-bit format is for)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))

    def _init_state(self, p, group):
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if self.is_8bit(p, group):
            n, k = _as_2d(p).shape
            nb = -(-k // q8_state.BLOCK)
            for name in ("exp_avg", "exp_avg_sq"):
                state[f"{name}_codes"] = torch.zeros(n, k, dtype=torch.uint8, device=p.device)
                state[f"{name}_scales"] = torch.zeros(n, nb, dtype=torch.float32, device=p.device)
        else:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rule = adamw_rule()
        salt = -1
        for group in self.param_groups:
            b1, b2 = group["betas"]
            hp = [torch.tensor(float(v), dtype=torch.float64)
                  for v in (group["lr"], b1, b2, group["eps"], group["weight_decay"])]
            for p in group["params"]:
                salt += 1       # the parameter's index in the optimizer, with or without a gradient
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, group)
                key = round_key(group["seed"], int(state["step"]))
                if "exp_avg_codes" in state:
                    self._step_8bit(p, state, hp, rule, key, salt)
                elif p.dtype == torch.bfloat16:
                    rule.apply_rounded(p, p.grad, [state["step"], state["exp_avg"], state["exp_avg_sq"]], hp,
                                       element_key(key, salt))
                else:
                    rule.apply(p, p.grad, [state["step"], state["exp_avg"], state["exp_avg_sq"]], hp)
        return loss

    def _step_8bit(self, p, state, hp, rule, key, salt):
        from ..kernels.wgrad_update_q8 import wgrad_update_q8

        w = _as_2d(p)
        g = _as_2d(p.grad.contiguous()).float()
        states = [state["step"]] + [[state[f"{n}_codes"].view(torch.float8_e4m3fn), state[f"{n}_scales"]]
                                    for n in ("exp_avg", "exp_avg_sq")]
        wgrad_update_q8(w, None, None, states, hp, rule.name, key=key, salt=salt, grad=g)

    def dequantized_state(self, p: torch.Tensor) -> dict:
        """``p``'s moments as fp32 tensors shaped like ``p`` (torch.optim.AdamW's names): for inspection and for moving
        a run to another optimizer."""
        state = self.state[p]
        if "exp_avg_codes" not in state:
            return {k: v for k, v in state.items()}
        out = {"step": state["step"]}
        for n in ("exp_avg", "exp_avg_sq"):
            out[n] = q8_state.dequantize(state[f"{n}_codes"].view(torch.float8_e4m3fn),
                                         state[f"{n}_scales"]).view_as(p)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        saved = {i: {k: v for k, v in st.items() if k in _Q8_KEYS} for i, st in state_dict["state"].items()}
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = dict(zip(ids, itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
        super().load_state_dict(state_dict)
        # undo torch.optim's cast of these to the parameter's dtype: the 8-bit states as they were saved
        for i, q in saved.items():
            p = params[i]
            for k, v in q.items():
                self.state[p][k] = v.to(p.device, copy=True)
