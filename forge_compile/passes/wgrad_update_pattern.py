"""The FORGE pass: ``mm -> (transposes, views, upcast) -> forge::apply_rule_`` becomes one
``forge::wgrad_update_`` that updates W and its states in place and never materializes dW.

It runs on the pre-Inductor whole-step graph (make_fx output, mutations still explicit), where
every optimizer update is one opaque ``apply_rule_`` node. A parameter is fused only when doing so is
exact; otherwise it keeps the normal path and its ``FusionDecision`` says why.

With ``embeddings=True`` (compile_train_step), ``embedding_dense_backward -> (views, upcast) -> apply_rule_``
becomes ``forge::embedding_update_`` the same way: the embedding's dense gradient is never made either
(kernels/embedding_update.py).

A parameter with 8-bit states (forge.optim.AdamW8bit and kin, compile_train_step) is updated by
``forge::apply_rule_q8_``; ``mm -> ... -> apply_rule_q8_`` becomes ``forge::wgrad_update_q8_``
(kernels/wgrad_update_q8.py) the same way (``should_fuse_wgrad_update_q8`` says which cases).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from typing import Optional

import torch
import torch.fx as fx

from .._compat import (C10D_ALL_GATHER, C10D_ALL_REDUCE, C10D_WAIT, OpOverload, group_size, op_overload_name,
                       op_schema)
from ..kernels import wgrad_norm as _wgrad_norm  # noqa: F401  (registers forge::wgrad_sqnorm, embedding_sqnorm, host_scalar)
from ..optim.rule import get_rule, grad_scaled_rule

log = logging.getLogger(__name__)
aten = torch.ops.aten

__all__ = ["FusionDecision", "rewrite_wgrad_updates", "should_fuse_wgrad_update", "should_fuse_wgrad_update_q8"]

counters: Counter = Counter()

_APPLY = torch.ops.forge.apply_rule_.default
_APPLY_Q8 = torch.ops.forge.apply_rule_q8_.default
_ROUNDED = torch.ops.forge.wgrad_update_rounded_.default
_EMB_ROUNDED = torch.ops.forge.embedding_update_rounded_.default

# Ops that only re-label the gradient on its way from the mm to the update.
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
_IDENTITIES = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
               aten.reshape.default, aten.clone.default}
# make_fx writes autocast's dW upcast as _to_copy, AOTAutograd's backward as prims.convert_element_type
_UPCASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
# Ops through which W is viewed (not read) in the forward/backward.
_VIEW_OPS = _TRANSPOSES | {aten.detach.default, aten.alias.default, aten.view.default,
                           aten._unsafe_view.default, aten.expand.default, aten.slice.Tensor,
                           aten.select.int, aten.as_strided.default, aten.unsqueeze.default,
                           aten.squeeze.dim, aten.squeeze.default}
_FUSED_DTYPES_IN = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class FusionDecision:
    name: str
    shape: tuple
    rule: str
    fused: bool
    reason: str              # unfused: why; fused: how, where it is not a plain matmul's dW (embeddings)
    dw_bytes_saved: int = 0


@dataclasses.dataclass
class _Match:
    apply: fx.Node
    mm: fx.Node          # the gradient's producer: aten.mm, or aten.embedding_dense_backward (embeddings=True)
    chain: list          # gradient-path nodes from the producer's user to the apply's grad input
    transposed: bool     # dW == mm(...)^T
    emb: Optional[fx.Node] = None    # a tied weight: the embedding backward whose gradient dW adds (mm + emb)
    scale_mul: Optional[fx.Node] = None  # gradient x a 0-dim fp32 factor (clip_grad_norm_'s mul_), on the chain
    norms: tuple = ()                # L2 norms of the (unscaled) gradient, computed again from dY and X
    # accumulation inside the step: every backward pass's (mm, transposed), in the sum's order; mm/transposed are the
    # last one's. The update then reads all passes' dY and X, concatenated over the token dimension
    passes: tuple = ()
    # data parallel (DistributedDataParallel under compile_train_step): the gradient is the mean over the ranks of
    # their local gradients, (group name, world size); the update then reads every rank's dY and X, all-gathered
    dp: Optional[tuple] = None

    @property
    def pairs(self) -> tuple:
        """(mm, transposed) of every matmul whose product dW is (one, or the passes')."""
        return self.passes or ((self.mm, self.transposed),)

    @property
    def scale(self) -> Optional[fx.Node]:
        return None if self.scale_mul is None else self.scale_mul.args[1]

    @property
    def embedding(self) -> bool:
        return self.mm.target is _EMB_BACKWARD


_EMB_BACKWARD = aten.embedding_dense_backward.default


def _meta(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_transpose(node: fx.Node) -> bool:
    if node.target is aten.t.default:
        return True
    if node.target is aten.transpose.int:
        return sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]
    if node.target is aten.permute.default:
        return list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])
    return False


def _describe_users(node: fx.Node, exclude) -> str:
    names = sorted({str(getattr(u.target, "__name__", u.target)) for u in node.users if u is not exclude})
    return ", ".join(names)


def _low_precision_clip_allowed(apply: fx.Node) -> bool:
    # clip_grad_norm_ over bf16 gradients is taken into the fused update of stochastically rounded weights only: the
    # SR spec's rule runs on the fp32 dW (scaled in the kernel), eager torch would scale the bf16 gradient
    return round_args(apply) is not None and _meta(apply.args[0]) is not None


def match_wgrad_update(apply: fx.Node, embeddings: bool = False) -> tuple[Optional[_Match], str]:
    """Walk back from the update's gradient to the matmul (with ``embeddings``: or the embedding backward, or the
    sum of one of each -- a tied embedding / output weight) producing it. A rounded weight's (stochastic_rounding)
    gradient may be bf16: its L2 norms and one 0-dim factor are then taken in bf16 too (_low_precision_clip_allowed)."""
    found = _walk(apply.args[1], apply, embeddings, True, _low_precision_clip_allowed(apply))
    if isinstance(found, str):
        return None, found
    mm, chain, transposed, emb, scale_mul, norms, passes, dp = found
    return _Match(apply, mm, chain, transposed, emb, scale_mul, tuple(norms), tuple(passes), dp), ""


def _emb_reason(node: fx.Node, transposed: bool) -> Optional[str]:
    if transposed:
        return "the embedding gradient is transposed on its way to the update"
    if len(node.args) > 4 and node.args[4]:
        return "embedding with scale_grad_by_freq=True"
    return None


def _only_returned(node: fx.Node) -> bool:
    """``node`` is a (detached) value the graph only returns: compile_train_step's ``.grad`` write-back."""
    return (node.target in _IDENTITIES and bool(node.users)
            and all(u.op == "output" for u in node.users))


def _from_weight_gradient(node) -> bool:
    """``node`` is a matmul's or an embedding backward's output or a sum (a tied weight's), up to transposes,
    same-shape views and upcasts (the report's wording only)."""
    while isinstance(node, fx.Node) and node.target in _TRANSPOSES | _IDENTITIES | _UPCASTS and node.args:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.target in (aten.mm.default, _EMB_BACKWARD, aten.add.Tensor,
                                                         aten.add_.Tensor)


def _in_place(target) -> bool:
    # an op whose name ends in "_" (aten.add_, forge.apply_rule_); Python callables in the graph (operator.getitem
    # of a multi-output backward, e.g. weight_norm's) are not ops and are never in place
    return isinstance(target, OpOverload) and op_overload_name(target)[0].endswith("_")


def _is_l2_norm(node: fx.Node, of: fx.Node, low: bool = False) -> bool:
    """``node`` is ``linalg_vector_norm(of, 2)`` over all elements (what clip_grad_norm_ and ``g.norm()`` trace to);
    ``of`` fp32, or with ``low`` bf16 (a rounded weight's gradient: the norm is then taken of its fp32 dW and
    rounded to bf16, _replace_norm)."""
    if node.op != "call_function" or node.target is not aten.linalg_vector_norm.default or node.args[0] is not of:
        return False
    ord_ = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
    rest = list(node.args[2:]) + [v for k, v in node.kwargs.items() if k != "ord"]
    v = _meta(of)
    return (ord_ == 2 and all(r in (None, False) for r in rest) and v is not None
            and v.dtype in ((torch.float32, torch.bfloat16) if low else (torch.float32,)))


def _is_grad_scale(node: fx.Node, dtypes: tuple = (torch.float32,)) -> bool:
    """``node`` = ``g * factor`` with a 0-dim factor node, g and the factor of ``dtypes`` (in place or not;
    clip_grad_norm_'s ``g.mul_(coef)``): fp32, or also bf16 for a rounded weight (the update scales its fp32 dW by
    the factor, converted to fp32 exactly)."""
    if node.op != "call_function" or node.target not in (aten.mul.Tensor, aten.mul_.Tensor) or len(node.args) != 2:
        return False
    g, f = node.args
    if not isinstance(f, fx.Node) or f is g:
        return False
    fv, gv = _meta(f), _meta(g)
    return fv is not None and gv is not None and fv.dim() == 0 and fv.dtype in dtypes and gv.dtype in dtypes


def _is_low_precision_grad_scale(node: fx.Node) -> bool:
    """``node`` = ``g * factor`` with a 0-dim factor where ``g`` or the factor is bf16/fp16: clip_grad_norm_ over the
    bf16 gradients of bf16 parameters (stochastic_rounding), whose norms and coefficient torch computes in bf16."""
    return _is_grad_scale(node, (torch.float32, torch.bfloat16, torch.float16)) and not _is_grad_scale(node)


def _walk(cur, consumer: fx.Node, embeddings: bool, allow_sum: bool, low: bool = False):
    """From ``cur`` (read by ``consumer``) back to the gradient's producer through nodes only the path reads:
    (producer, chain, transposed, embedding backward added to it or None, scale factor or None, L2-norm readers,
    accumulated passes' (mm, transposed) or (), data-parallel mean (group name, world size) or None), or the reason
    there is none. Besides the path, a node may be read
    by L2 norms (clip_grad_norm_, a logged gradient norm) when it holds the unscaled gradient; one multiplication by
    a 0-dim fp32 factor (clip_grad_norm_'s in-place ``mul_``) is taken into the update
    (``optim.rule.grad_scaled_rule``); a sum of matmuls' dW (accumulated passes, a weight used twice) becomes one
    matmul over their concatenated operands (``_accumulation``); a mean over data-parallel ranks (``_dp_mean``) becomes
    one matmul over the ranks' gathered operands."""
    chain = []
    transposed = False
    scale_mul, norms, scaled_norm, dp = None, [], False, None
    while True:
        if not isinstance(cur, fx.Node):
            return "gradient is not a graph value"
        others = [u for u in cur.users if u is not consumer]
        if others and all(_is_l2_norm(u, cur, low) for u in others):
            norms += others
            scaled_norm = scaled_norm or scale_mul is None   # read before the walk met a scale: a scaled value
            others = []
        if others and all(_only_returned(u) for u in others):
            return ("gradient outlives the step (left in .grad -- opt.zero_grad() before backward instead of after "
                    "opt.step() -- or returned); zero the gradients after the step to fuse it")
        if others:
            return (f"gradient is also read by {_describe_users(cur, consumer)} "
                    "(e.g. a gradient statistic other than its L2 norm)")
        if cur.target is aten.mm.default or (embeddings and cur.target is _EMB_BACKWARD):
            if scale_mul is not None and scaled_norm:
                return "the norm of the scaled gradient is read (after clip_grad_norm_'s scaling)"
            if cur.target is aten.mm.default:
                return cur, chain, transposed, None, scale_mul, norms, (), dp
            why = _emb_reason(cur, transposed)
            return why if why else (cur, chain, False, None, scale_mul, norms, (), dp)
        if cur.target is C10D_WAIT:
            mean = _dp_mean(cur)
            if isinstance(mean, str):
                return mean
            if dp is not None:
                return "gradient is all-reduced twice"
            dp, path = mean
            chain += path
            consumer, cur = path[-1], path[-1].args[0]
            continue
        if _is_grad_scale(cur, (torch.float32, torch.bfloat16) if low else (torch.float32,)):
            if scale_mul is not None:
                return "gradient is scaled twice before the update"
            scale_mul = cur
            chain.append(cur)
            consumer, cur = cur, cur.args[0]
            continue
        acc = _accumulation(cur, embeddings) if cur.target in (aten.add.Tensor, aten.add_.Tensor) else None
        if acc is not None:
            parts, acc_chain, acc_dp = acc
            if dp is not None and acc_dp is not None:
                return "gradient is all-reduced twice"
            passes = tuple((m, transposed != t) for m, t in parts)
            return (passes[-1][0], chain + [cur] + acc_chain, passes[-1][1], None, scale_mul, norms, passes,
                    dp or acc_dp)
        if cur.op == "call_function" and _in_place(cur.target) and cur.target not in _UPCASTS:
            if cur.target is aten.add_.Tensor and any(isinstance(a, fx.Node) and a.op == "placeholder"
                                                      for a in cur.args[:2]):
                return ("gradient accumulates into the .grad set before the step (accumulation over calls); "
                        "fusing it would need dW")
            if cur.target is aten.add_.Tensor and any(_from_weight_gradient(a) for a in cur.args[:2]):
                return ("gradient sums several backward passes (accumulation inside the step), not each a plain "
                        "matmul's dW or each an embedding's (a tied weight's passes stay unfused)")
            if _is_low_precision_grad_scale(cur):
                # the fused update would scale the fp32 dW, torch scales the bf16 gradient by a bf16 coefficient
                return ("gradient is scaled by a 0-dim factor in low precision before the update (clip_grad_norm_ "
                        "over bf16 gradients): taken into the update only for a weight rounded stochastically "
                        "(stochastic_rounding)")
            return f"gradient is modified in place by {cur.target} before the update (e.g. clip_grad_value_)"
        if cur.op == "call_function" and cur.target in _TRANSPOSES and _is_transpose(cur):
            transposed = not transposed
        elif cur.target in _IDENTITIES:
            src, dst = _meta(cur.args[0]), _meta(cur)
            if src is None or dst is None or tuple(src.shape) != tuple(dst.shape):
                return f"gradient is reshaped by {cur.target} on its way from the matmul"
        elif cur.target in _UPCASTS:
            src, dst = _meta(cur.args[0]), _meta(cur)
            if src is None or dst is None or src.device != dst.device or dst.dtype != torch.float32:
                return f"gradient passes through an unsupported conversion {cur.target}"
        elif cur.target in (aten.add.Tensor, aten.add_.Tensor):
            # a tied embedding / output weight: the output matmul's dW plus the embedding's gradient
            tied = _tied_sum(cur, embeddings and allow_sum and cur.target is aten.add.Tensor, transposed)
            if isinstance(tied, str):
                return tied
            mm, mm_chain, mm_t, emb, emb_chain = tied
            return mm, chain + [cur] + mm_chain + emb_chain, transposed != mm_t, emb, scale_mul, norms, (), dp
        elif cur.op == "placeholder":
            return "gradient is a graph input"
        else:
            return f"gradient is produced by {cur.target}, not by a matmul"
        chain.append(cur)
        consumer, cur = cur, cur.args[0]


def _tied_sum(add: fx.Node, allowed: bool, transposed: bool):
    """``add`` = one matmul's dW + one embedding backward (either order, nothing else on the way): their walks'
    (mm, its chain, its transposition, the embedding backward, its chain), or the reason not."""
    several = "gradient sums several contributions (shared or tied weight)"
    if not allowed or len(add.args) != 2 or add.kwargs:
        return several
    sides = [_walk(a, add, True, False) for a in add.args]
    if any(isinstance(x, str) or x[4] is not None or x[5] or x[6] or x[7] for x in sides):
        return several
    by_kind = {("emb" if x[0].target is _EMB_BACKWARD else "mm"): x for x in sides}
    if set(by_kind) != {"mm", "emb"}:
        return several + ": not one matmul plus one embedding"
    mm, mm_chain, mm_t = by_kind["mm"][:3]
    emb, emb_chain, emb_t = by_kind["emb"][:3]
    why = _emb_reason(emb, transposed != emb_t)
    if why:
        return why
    return mm, mm_chain, mm_t, emb, emb_chain


def _accumulation(add: fx.Node, embeddings: bool):
    """``add`` (in place or not) sums backward passes' weight gradients, each a plain matmul's dW -- or, with
    ``embeddings``, each the same embedding's backward -- (accumulation inside the step: ``backward()`` called per
    micro-batch, AccumulateGrad's ``add_``): ([(producer, transposed)] in the sum's order, the nodes on the way), or
    None."""
    if len(add.args) != 2 or add.kwargs or not all(isinstance(a, fx.Node) for a in add.args):
        return None
    parts, chain, dps = [], [], set()
    for side in add.args:
        found = _walk(side, add, embeddings, False)
        if isinstance(found, str):
            return None
        mm, side_chain, t, emb, scale_mul, norms, passes, dp = found
        if emb is not None or scale_mul is not None or norms:
            return None
        parts += list(passes) if passes else [(mm, t)]
        chain += side_chain
        dps.add(dp)
    if len(dps) != 1:
        return None     # some passes' contributions reduced over ranks, others not
    kinds = {m.target if m.target is aten.mm.default else (m.target, *m.args[2:]) for m, _ in parts}
    if len(kinds) != 1 or any(t for m, t in parts if m.target is _EMB_BACKWARD):
        return None    # a matmul's passes and an embedding's (a tied weight), or different embedding backwards
    return parts, chain, dps.pop()


def _dp_mean(wait: fx.Node):
    """``wait`` = ``wait_tensor(all_reduce(g * (1 / world), "sum", group))``: what compile_train_step traces for
    DistributedDataParallel's reducer (``capture._ddp_in_graph``). ((group name, world size), [wait, all_reduce,
    mul]) or the reason it is not that."""
    ar = wait.args[0]
    if not (isinstance(ar, fx.Node) and ar.target is C10D_ALL_REDUCE and ar.args[1] == "sum"
            and len(ar.users) == 1):
        return f"gradient is produced by {wait.target}, not by a matmul"
    mul = ar.args[0]
    name = ar.args[2]
    world = group_size(name)
    if not (isinstance(mul, fx.Node) and mul.target is aten.mul.Tensor and len(mul.users) == 1
            and isinstance(mul.args[1], float) and mul.args[1] == 1.0 / world):
        return "gradient is all-reduced, but not as the mean over the ranks"
    return (name, world), [wait, ar, mul]


def _aliases(node: fx.Node) -> set:
    """``node`` and every view of it (reads through a view are reads of the tensor)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.target in _VIEW_OPS and u.args and u.args[0] is n:
                todo.append(u)
    return seen


def _readers(nodes: set) -> list:
    return [u for n in nodes for u in n.users if u not in nodes]


def _is_pointwise(node: fx.Node) -> bool:
    t = node.target
    return (node.op == "call_function" and isinstance(t, OpOverload) and torch.Tag.pointwise in t.tags
            and not op_schema(t).is_mutable)


_REDUCTION = getattr(torch.Tag, "reduction", None)


def _derived(aliases: set, elementwise: bool = True) -> set:
    """Values computed from ``aliases`` (W, its states and their views) by views, same-device casts and -- with
    ``elementwise`` -- element-wise ops only (``aliases`` excluded). Without: W's cast copies and their views,
    under autocast the low-precision copy the forward's mm reads and the backward's dX = dY @ W reads again."""
    seen, todo = set(), [u for n in aliases for u in n.users if u not in aliases]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or not n.args:
            continue
        if n.target in _UPCASTS:
            src, dst = _meta(n.args[0]), _meta(n)
            if src is None or dst is None or src.device != dst.device:
                continue
        elif n.target not in _VIEW_OPS and not (elementwise and _is_pointwise(n)):
            continue
        seen.add(n)
        todo += list(n.users)
    return seen


def _computed_by(node: fx.Node, derived: set, apply: fx.Node, order: dict) -> Optional[fx.Node]:
    """Where Inductor computes the element-wise value ``node`` (derived from W): it lowers such a value lazily, at
    the first use that needs it in memory -- an extern op such as a matmul, through views of it or not; reductions
    and element-wise users read it inline at their own position. If that comes after the fused op, the value is
    computed from the UPDATED W although the graph reads W before the update (seen in the Dynamo route's backward
    when the partitioner recomputes autocast's weight cast there, e.g. under
    torch._functorch.config.activation_memory_budget < 1). Returns the last node before which the value is surely
    computed (None: only other derived values use it; their own positions cover it)."""
    uses, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or u is apply:
                continue
            seen.add(u)
            if u in derived:
                if u.target in _VIEW_OPS:
                    todo.append(u)
            else:
                uses.append(u)
    if not uses:
        return None
    externs = [u for u in uses if not _is_pointwise(u) and not (_REDUCTION is not None and isinstance(
        u.target, OpOverload) and _REDUCTION in u.target.tags)]
    # the first extern use materializes it; without one every inline use computes it again
    return min(externs, key=lambda n: order[n]) if externs else max(uses, key=lambda n: order[n])


def _embedding_unsupported(emb: fx.Node, w) -> Optional[str]:
    """Why the embedding backward ``emb`` cannot feed a fused update of the parameter ``w`` (meta), or None."""
    g, idx = _meta(emb.args[0]), _meta(emb.args[1])
    if g is None or g.dtype not in _FUSED_DTYPES_IN or idx is None or idx.dtype not in (torch.int64, torch.int32):
        return f"embedding gradient of {getattr(g, 'dtype', '?')} from {getattr(idx, 'dtype', '?')} indices"
    if emb.args[2] != w.shape[0]:
        return "the embedding gradient's row count is not the parameter's"
    return None


def should_fuse_wgrad_update(match: _Match, order: dict, after_copies: bool = False
                             ) -> tuple[bool, str, Optional[fx.Node]]:
    """Exactness and support checks; returns (fuse?, reason, node after which the fused op goes).
    ``after_copies``: the fused op also goes after every reader of W's cast copies (the backward's dX mm), so
    that ``remat_for_backward`` may recompute such a copy there instead of keeping the forward's."""
    apply = match.apply
    weight, _, states, hparams, rule_name = apply.args[:5]
    w = _meta(weight)
    rounded = round_args(apply) is not None
    if w is None or w.dim() != 2:
        return False, "parameter is not 2-D", None
    if w.dtype == torch.bfloat16 and not rounded:
        return False, ("parameter dtype torch.bfloat16: updated by torch.optim's bf16 arithmetic as in eager "
                       "(compile_train_step(stochastic_rounding=True) fuses bf16 weights)"), None
    if w.dtype not in (torch.float32, torch.bfloat16):
        return False, f"parameter dtype {w.dtype} (fused updates need fp32 master weights, or bf16 ones rounded " \
                      "stochastically)", None
    if rounded and (why := _rounding_unsupported(match, w)):
        return False, why, None
    if not w.is_contiguous():
        return False, "parameter is not contiguous", None
    if w.device.type not in ("cpu", "cuda"):
        return False, f"device {w.device.type} has no fused kernel", None
    rule = get_rule(rule_name)
    for i, s in enumerate(states):
        sv = _meta(s)
        if rule.is_scalar_state(i):
            if sv is None or sv.dim() != 0 or sv.device.type != "cpu":
                return False, f"scalar state {rule.states[i]!r} is not a 0-dim CPU tensor", None
        elif (sv is None or tuple(sv.shape) != tuple(w.shape) or not sv.is_contiguous()
              or sv.dtype not in ((torch.float32, torch.bfloat16) if rounded else (torch.float32,))):
            return False, (f"state {rule.states[i]!r} is not an fp32{' or bf16' * rounded} contiguous tensor shaped "
                           "like the parameter"), None
    a, b = _meta(match.mm.args[0]), _meta(match.mm.args[1])
    for emb in ([m for m, _ in match.pairs] if match.embedding else [match.emb] if match.emb is not None else []):
        why = _embedding_unsupported(emb, w)
        if why:
            return False, why, None
    if not match.embedding and (a.dtype not in _FUSED_DTYPES_IN or a.dtype != b.dtype):
        return False, f"matmul operands are {a.dtype}/{b.dtype}", None
    if why := _gradient_unsupported(match, w, rule, order):
        return False, why, None

    # a rounding key computed in the graph (a Rule8bitOptimizer's, from the parameter's step) must exist there too
    key = round_args(apply)[0] if rounded else None
    return _anchor(match, order, weight, states, after_copies, extra=[key] if isinstance(key, fx.Node) else [])


def _gradient_unsupported(match: _Match, w, rule, order: dict) -> Optional[str]:
    """Why the gradient's form -- accumulated passes, data parallel's mean, a scaling (clip_grad_norm_) -- or the
    rule it makes (a scaled one) keeps the fused update from taking it, or None (both should_fuse_* ask this)."""
    if match.passes and (why := _accumulation_unsupported(match, w)):
        return why
    if match.dp is not None and (why := _dp_unsupported(match, w)):
        return why
    if match.scale_mul is not None:
        if why := _scale_unsupported(match, order):
            return why
        rule = grad_scaled_rule(rule)
    if w.device.type == "cuda":
        from ..kernels import epilogue_supported

        ok, why = epilogue_supported(rule)
        if not ok:
            return why
    return None


def _scale_unsupported(match: _Match, order: dict) -> Optional[str]:
    """Why a gradient scaled on its way to the update cannot be scaled inside it instead, or None."""
    mul = match.scale_mul
    # an in-place scaling (clip_grad_norm_'s mul_) changes what a later norm of the gradient (or of a view of it)
    # reads: only norms before it are of the unscaled gradient that the norm op computes again
    if mul.target is aten.mul_.Tensor and any(order[nn] > order[mul] for nn in match.norms):
        return "a gradient norm is read after the gradient was scaled in place"
    return None


def _anchor(match: _Match, order: dict, weight: fx.Node, states, after_copies: bool, extra=()
            ) -> tuple[bool, str, Optional[fx.Node]]:
    """Where the fused op may go: after the matmul(s) and every read of the old W and states (and ``extra``:
    values it reads that the graph computes), provided nothing reads them after the update."""
    apply = match.apply
    apply_pos = order[apply]
    w_alias = _aliases(weight)
    tracked = set(w_alias)
    for s in states:
        tracked |= _aliases(s)
    after = [r for r in _readers(tracked) if r is not apply and order[r] > apply_pos]
    if after:
        return False, f"W is read after its update (by {after[0].target})", None
    # Reads of the old W (e.g. this layer's dX = dY @ W) must stay before the update, and so must the point where
    # every value computed element-wise from W or a state is surely computed (_computed_by).
    before = [r for r in _readers(tracked) if r is not apply and order[r] < apply_pos]
    derived = _derived(tracked)
    for d in derived:
        if d.target in _VIEW_OPS:
            continue
        at = _computed_by(d, derived, apply, order)
        if at is not None:
            if order[at] > apply_pos:
                return False, f"a value computed from W is first needed after its update (by {at.target})", None
            before.append(at)
    if after_copies:
        copies = _derived(w_alias, elementwise=False)
        before += [r for r in _readers(copies) if order[r] < apply_pos]
    anchor = max([m for m, _ in match.pairs] + ([match.emb] if match.emb is not None else []) + before
                 + ([match.scale] if match.scale is not None else []) + list(extra), key=lambda n: order[n])
    # The mm's operands must exist at the anchor: they do, the anchor is at or after the mm.
    return True, "", anchor


def should_fuse_wgrad_update_q8(match: _Match, order: dict, after_copies: bool = False
                                ) -> tuple[bool, str, Optional[fx.Node]]:
    """``should_fuse_wgrad_update`` for ``apply_rule_q8_`` (8-bit states): the dW of a 2-D fp32 or bf16 weight from
    one matmul or an embedding's backward, the passes of an accumulating step or the ranks of data parallel, scaled
    (clip_grad_norm_) or not; tied embeddings are not fused with 8-bit states yet (the update is then the unfused
    one: the same function from the stored gradient)."""
    apply = match.apply
    weight, _, codes, scales, scalars, hparams, rule_name, key = apply.args[:8]
    w = _meta(weight)
    if w is None or w.dim() != 2:
        return False, "parameter is not 2-D", None
    if w.dtype not in (torch.float32, torch.bfloat16):
        return False, f"parameter dtype {w.dtype} (8-bit states are fused for fp32 and bf16 weights)", None
    if not w.is_contiguous():
        return False, "parameter is not contiguous", None
    if w.device.type not in ("cpu", "cuda"):
        return False, f"device {w.device.type} has no fused kernel", None
    if match.emb is not None:
        return False, "8-bit states: a tied embedding's gradient is not fused yet (updated from the stored gradient)", \
            None
    if match.embedding:
        for emb, _ in match.pairs:
            if why := _embedding_unsupported(emb, w):
                return False, why, None
    else:
        a, b = _meta(match.mm.args[0]), _meta(match.mm.args[1])
        if a is None or b is None or a.dtype not in _FUSED_DTYPES_IN or a.dtype != b.dtype:
            return False, f"matmul operands are {getattr(a, 'dtype', None)}/{getattr(b, 'dtype', None)}", None
    if why := _gradient_unsupported(match, w, get_rule(rule_name), order):
        return False, why, None
    # the rounding key is computed in the graph (from the step count): the fused op goes after it too
    return _anchor(match, order, weight, [*codes, *scales, *scalars], after_copies,
                   extra=[key] if isinstance(key, fx.Node) else [])


def _q8_how(match: _Match, w, rule: str, how: str) -> tuple[str, int]:
    """A fused 8-bit update's report text, and the dW bytes it holds at once: on CUDA the blocked path's row block
    (kernels/wgrad_update_q8.use_blocked; none where the Gluon kernel takes it, expects_gluon; an embedding's
    always); the CPU paths' cache-sized blocks are working memory, as the fp32 CPU path's (wgrad_update_cpu)."""
    from ..kernels.wgrad_update_q8 import block_rows, dw_block_bytes
    from ..kernels.wgrad_update_q8_gluon import expects_gluon
    from ..report import _fmt_bytes   # report imports this module

    cuda = w.device.type == "cuda"
    if match.embedding:
        n, k = w.shape
        held = block_rows(n, k) * 4 * k if cuda else 0
        # (the fp32 path's "no dense gradient" is not this one's: the dense rows exist a block at a time)
        how = how.replace("embedding: gradient rows of the tokens seen, no dense gradient",
                          "embedding: its dense gradient made a row block at a time from the tokens' rows")
        return ", ".join(["8-bit states", how] + ([f"row blocks of {_fmt_bytes(held)}"] if held else [])), held
    tokens = sum(_meta(m.args[0]).shape[1] for m, _ in match.pairs) * (match.dp[1] if match.dp is not None else 1)
    gluon = cuda and expects_gluon(w.device, *w.shape, _meta(match.pairs[0][0].args[0]).dtype, get_rule(rule))
    held = dw_block_bytes(*w.shape, get_rule(rule), tokens, "cuda", gluon) if cuda else 0
    parts = ["8-bit states"] + ([how] if how else []) + (["on the Gluon kernel (dW never in memory)"] if gluon else [])
    if held:
        parts.append(f"dW made by cuBLAS in row blocks of {_fmt_bytes(held)} (the fused 8-bit kernel is slower for "
                     "this rule; FORGE_Q8_PATH=fused makes none)")
    return ", ".join(parts), held


# Tokens (over passes and ranks) above which a bf16 weight's stochastically rounded update stays unfused on CUDA
# (sr_fused_max_tokens); unfused, cuBLAS's bf16 dW feeds the same rounded update compiled by Inductor. H100, AdamW,
# vs torch's bf16 mm + fused AdamW (benchmarks/RESULTS.md "bf16 weights with stochastic rounding"): the Triton
# kernel, whose GEMM is the slow part at large M, 0.84-0.99x at M <= 2048 and 0.43-0.52x at 4096 / 8192; on sm_90
# the Gluon smem/split kernel, 1.07-1.40x at M <= 4096, 0.89-1.07x at 8192 and 0.86-0.99x at 16384 (Gluon run 2,
# 16-byte loads, 7 shapes). Its limit is 8192 because end to end (bench_train_step --quick --bf16-weights, 8192
# tokens, H100) the step fused 0.99x the baseline at 3303 MiB and unfused 0.96x at 3553 MiB: forge's unfused rounded
# update is no faster than the fused one there and holds every dW. Above 8192 neither was measured end to end.
# FORGE_SR_MAX_TOKENS=<int> replaces both (e.g. to fuse at any token count: the memory of dW saved at some speed).
SR_FUSED_MAX_TOKENS = 2048
SR_GLUON_MAX_TOKENS = 8192
SR_MAX_TOKENS_ENV = "FORGE_SR_MAX_TOKENS"


def sr_fused_max_tokens(w) -> int:
    """The token limit of a fused rounded update of ``w`` (a CUDA weight, possibly fake): FORGE_SR_MAX_TOKENS if set,
    else SR_GLUON_MAX_TOKENS where the Gluon kernel would take it (wgrad_update_gluon.takes_rounded), else
    SR_FUSED_MAX_TOKENS."""
    from ..kernels import wgrad_update_gluon as wg

    env = os.environ.get(SR_MAX_TOKENS_ENV, "").strip()
    if env:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"forge: {SR_MAX_TOKENS_ENV}={env!r} is not an integer") from None
    return SR_GLUON_MAX_TOKENS if wg.takes_rounded(w.device, *w.shape) else SR_FUSED_MAX_TOKENS


def _rounding_unsupported(match: _Match, w) -> Optional[str]:
    """Why a bf16 weight rounded stochastically is left unfused, or None."""
    if match.embedding or w.device.type != "cuda":
        # an embedding's fused update is element-wise over W (no GEMM): no token count where unfused is faster
        return None
    a = [_meta(m.args[0]) for m, _ in match.pairs]
    if any(v is None or v.dim() != 2 for v in a):
        return None
    tokens = sum(v.shape[1] for v in a) * (match.dp[1] if match.dp is not None else 1)
    limit = sr_fused_max_tokens(w)
    if tokens > limit:
        return (f"bf16 weight at {tokens} tokens: the fused stochastically rounded update is slower than cuBLAS + "
                f"the rounded update above {limit} tokens on this GPU (benchmarks/RESULTS.md); updated unfused, "
                "rounded stochastically")
    return None


def _accumulation_unsupported(match: _Match, w) -> Optional[str]:
    """Why the passes of an accumulating gradient cannot feed one fused update, or None. The update reads every
    pass's dY and X (an embedding's: gradient rows and indices), concatenated over tokens: they stay alive until it
    runs (each pass's X would otherwise be freed after its backward) and the concatenation holds a second copy of
    them while it runs, so it fuses only where the two together are no larger than the fp32 dW that fusing never
    allocates (at that point of the backward the unfused step holds all of dW): operands <= dW / 2."""
    from ..report import _fmt_bytes   # report imports this module

    metas = [(_meta(m.args[0]), _meta(m.args[1])) for m, _ in match.pairs]
    if any(a is None or b is None for a, b in metas):
        return "an accumulated pass's operands have no shape"
    # an embedding's (grad_output, indices): the indices' dtype is not the rows'
    dtypes = {a.dtype for a, _ in metas} | (set() if match.embedding else {b.dtype for _, b in metas})
    kept = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in metas)
    if len(dtypes) != 1:
        return f"accumulated passes' operands differ in dtype ({sorted(map(str, dtypes))})"
    dw = w.numel() * 4
    if 2 * kept > dw:
        return (f"gradient is the {_sum_of(match)}: their {_operands_of(match)} ({_fmt_bytes(kept)}) would stay "
                "alive until the update and be copied once more to concatenate them, outweighing the fp32 dW "
                f"({_fmt_bytes(dw)}) fusing saves")
    return None


def _dp_unsupported(match: _Match, w) -> Optional[str]:
    """Why a data-parallel mean cannot feed one fused update, or None. The update reads every rank's dY and X,
    all-gathered over tokens (dW_mean = [dY_1; ..; dY_R]^T [X_1; ..; X_R] / R; an embedding's: every rank's gradient
    rows and indices, whose scattered sum is the sum of the ranks' dense gradients): the gathered copies are made for it,
    so it fuses only where they are no larger than the fp32 dW (and its all-reduce) that fusing never allocates --
    then it also moves fewer bytes between the ranks than the all-reduce does."""
    from ..report import _fmt_bytes   # report imports this module

    if match.emb is not None:
        return ("data parallel: a tied embedding / output weight stays unfused (its gradient, matmul plus rows, is "
                "all-reduced)")
    world = match.dp[1]
    metas = [(_meta(m.args[0]), _meta(m.args[1])) for m, _ in match.pairs]
    if any(a is None or b is None for a, b in metas):
        return "the matmul's operands have no shape"
    gathered = world * sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in metas)
    dw = w.numel() * 4
    if gathered > dw:
        return (f"data parallel over {world} ranks: their gathered {_operands_of(match)} ({_fmt_bytes(gathered)}) "
                f"would outweigh the fp32 dW ({_fmt_bytes(dw)}) fusing saves; dW is all-reduced as DDP does")
    return None


def _operands_of(match: _Match) -> str:
    return "gradient rows and indices" if match.embedding else "dY and X"


def _sum_of(match: _Match) -> str:
    n = len(match.passes)
    what = "embedding backwards" if match.embedding else "matmuls' dW"
    used = "an embedding" if match.embedding else "a weight"
    return f"sum of {n} {what} (accumulated backward passes, or {used} used {n} times)"


def rewrite_wgrad_updates(gm: fx.GraphModule, names: dict, *, fuse: bool = True, after_copies: bool = False,
                          embeddings: bool = False, dp_gather: bool = True) -> list:
    """Rewrite the graph in place. ``names`` maps placeholder nodes to parameter names; ``after_copies``: see
    ``should_fuse_wgrad_update``; ``embeddings``: embedding weights too (``forge::embedding_update_``);
    ``dp_gather=False``: a data-parallel mean is never fused (the ranks' shapes differ at this call, so all-gathers
    of their dY and X cannot be issued alike on every rank).

    Returns one FusionDecision per ``apply_rule_`` node (i.e. per updated parameter).
    """
    graph = gm.graph
    _hoist_round_keys(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    decisions = []
    rewrites = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (_APPLY, _APPLY_Q8):
            continue
        q8 = node.target is _APPLY_Q8
        weight = node.args[0]
        w = _meta(weight)
        name = names.get(weight, weight.name)
        shape = tuple(w.shape) if w is not None else ()
        rule = node.args[6] if q8 else node.args[4]
        if not fuse:
            decisions.append(FusionDecision(name, shape, rule, False, "fusion disabled (fuse=False)"))
            continue
        if w is None or w.dim() != 2:
            decisions.append(FusionDecision(name, shape, rule, False, "not a matrix (normal path)"))
            continue
        match, reason = match_wgrad_update(node, embeddings)
        if match is not None and match.dp is not None and not dp_gather:
            match, reason = None, ("data parallel: the ranks were called with different argument shapes, so their dY "
                                   "and X cannot be all-gathered alike; dW is all-reduced as DDP does")
        anchor = None
        if match is not None:
            ok, reason, anchor = (should_fuse_wgrad_update_q8 if q8 else should_fuse_wgrad_update)(
                match, order, after_copies)
            if not ok:
                match = None
        if match is None:
            counters["unfused"] += 1
            decisions.append(FusionDecision(name, shape, rule, False, reason))
            continue
        saved = w.numel() * 4
        # fused rows say how when it is not the plain matmul case
        how = ("embedding: gradient rows of the tokens seen, no dense gradient" if match.embedding else
               "tied: the output matmul's dW + the embedding's rows" if match.emb is not None else "")
        source = "the gradient rows" if match.embedding else "dY and X" if match.emb is None else "dY, X and the rows"
        how = ", ".join(
            ([how] if how else []) + (["gradient scaled in the update (clip_grad_norm_)"] if match.scale is not None
                                      else [])
            + ([f"its norm computed from {source} ({len(match.norms)} reader{'s' * (len(match.norms) > 1)})"]
               if match.norms else []))
        if match.passes:
            how = ", ".join([f"{_sum_of(match)}: their {_operands_of(match)} concatenated over tokens"]
                            + ([how] if how else []))
        if match.dp is not None:
            how = ", ".join([f"data parallel: the mean over {match.dp[1]} ranks, their {_operands_of(match)} "
                             "all-gathered"]
                            + ([how] if how else []))
        if q8:
            how, held = _q8_how(match, w, rule, how)
            saved = max(0, saved - held)
        decisions.append(FusionDecision(name, shape, rule, True, how, saved))
        rewrites.append((match, anchor))

    host_scales, dp_factors = {}, {}
    for match, anchor in rewrites:
        apply = match.apply
        q8 = apply.target is _APPLY_Q8
        hi = 5 if q8 else 3      # apply_rule_q8_'s hyper-parameters follow codes, scales and scalar states
        weight, hparams, rule = apply.args[0], apply.args[hi], apply.args[hi + 1]
        operands = None
        if match.passes or match.dp is not None:
            last_mm = max((m for m, _ in match.pairs), key=lambda n: order[n])
            operands, last = _token_operands(graph, match, last_mm)
            # the fused op must follow the operands' concatenation / gathering, which follows the last matmul
            anchor = last if order[anchor] <= order[last_mm] else anchor
        for nn in match.norms:
            _replace_norm(graph, nn, match, operands)
        scale = match.scale
        if scale is not None and _meta(scale) is not None and _meta(scale).dtype != torch.float32:
            # a bf16 coefficient (clip_grad_norm_ over a rounded weight's bf16 gradient): converted exactly; the
            # kernel scales the fp32 dW by it
            scale = _fp32_factor(graph, scale, host_scales)
        if match.dp is not None:
            scale = _dp_factor(graph, scale, match.dp[1], dp_factors)
        if scale is not None:
            if scale not in host_scales:
                host_scales[scale] = _host_scale(graph, scale, hparams)
            hs = host_scales[scale]
            # the fused op goes after the host copy of the factor; that copy sits right after the factor
            anchor = hs if anchor is match.scale or anchor is scale else anchor
            hparams, rule = list(hparams) + [hs], grad_scaled_rule(get_rule(rule)).name
            apply.args = (*apply.args[:hi], hparams, rule, *apply.args[hi + 2:])
        if q8:
            (_insert_embedding_update_q8 if match.embedding else _insert_wgrad_update_q8)(graph, match, anchor,
                                                                                        operands)
            counters["fused_q8"] += 1
        elif match.embedding:
            grad_output, indices, _, padding_idx = match.mm.args[:4]
            if operands is not None:
                grad_output, indices = operands
            rounding = round_args(apply)
            op = torch.ops.forge.embedding_update_.default if rounding is None else _EMB_ROUNDED
            states = apply.args[2]
            with graph.inserting_after(anchor):
                fused = graph.call_function(op, (weight, grad_output, indices, states, hparams, rule, padding_idx,
                                                 *(rounding or ())))
            fused.meta["forge"] = "embedding_update"
            counters["fused_embedding"] += 1
        else:
            _insert_wgrad_update(graph, match, anchor, operands)
            counters["fused"] += 1
            counters["fused_accumulated"] += bool(match.passes)
        graph.erase_node(apply)
        for n in match.chain + [m for m, _ in match.pairs] + ([match.emb] if match.emb is not None else []):
            if not n.users:
                graph.erase_node(n)
    if any(match.dp is not None for match, _ in rewrites):
        _share_gathers(graph)
    graph.lint()
    gm.recompile()
    return decisions


def _hoist_round_keys(graph: fx.Graph) -> None:
    """Move each update's rounding key computed in the graph (a Rule8bitOptimizer's: round_key_t of the parameter's
    step count, traced where opt.step() ran, after the whole backward) to the graph's start, where its inputs (graph
    inputs only) already are: the fused op goes after its key, and a key at the end would hold every layer's dY and X
    until then."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return
    last = placeholders[-1]
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (_APPLY, _APPLY_Q8):
            continue
        key = node.args[7] if node.target is _APPLY_Q8 else (round_args(node) or (None,))[0]
        if not isinstance(key, fx.Node) or key.op == "placeholder":
            continue
        chain, todo, ok = set(), [key], True
        while todo and ok:
            n = todo.pop()
            if n in chain or n.op == "placeholder":
                continue
            ok = (n.op == "call_function" and isinstance(n.target, OpOverload) and not op_schema(n.target).is_mutable
                  and torch.Tag.nondeterministic_seeded not in n.target.tags)
            chain.add(n)
            todo += n.all_input_nodes
        if not ok:
            continue
        for n in [n for n in graph.nodes if n in chain]:     # in graph order: each after the one before
            last.append(n)
            last = n


def round_args(node: fx.Node) -> Optional[tuple]:
    """(round_key node, salt) of an ``apply_rule_`` / ``wgrad_update_rounded_`` that rounds a bf16 parameter
    stochastically (compile_train_step(stochastic_rounding=...)), or None."""
    if node.target is _APPLY:
        key = node.args[5] if len(node.args) > 5 else node.kwargs.get("round_key")
        salt = node.args[6] if len(node.args) > 6 else node.kwargs.get("round_salt", 0)
    elif node.target is _ROUNDED:
        key, salt = node.args[6], node.args[7]
    elif node.target is _EMB_ROUNDED:
        key, salt = node.args[7], node.args[8]
    else:
        return None
    return None if key is None else (key, salt)


def stochastic_rounding_note(gm: fx.GraphModule, decisions) -> Optional[str]:
    """The report note of a step that rounds bf16 parameters stochastically: how many, how many of them fused."""
    fused = unfused = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (_APPLY, _ROUNDED, _EMB_ROUNDED):
            if round_args(node) is not None:
                fused += node.target is not _APPLY
                unfused += node.target is _APPLY
    if not fused + unfused:
        return None
    counters["stochastic_rounding_fused"] += fused
    return (f"stochastic_rounding: {fused + unfused} bf16 parameters are updated in fp32 and stored rounded "
            f"stochastically, {fused} of them by fused updates (from the fp32 dW)")


def fp32_activation_note(gm: fx.GraphModule) -> Optional[str]:
    """A report note when fused weight-gradient GEMMs on CUDA take fp32 operands (no autocast): exact, dW never
    allocated, but the regime where the fused step gains less than under autocast (and in IEEE fp32 at large
    token counts, or off Hopper under TF32, loses) against cuBLAS + torch's fused optimizer -- a user who picked
    forge for speed should hear it from the report, not a profiler."""
    def val(node):
        # the operands _insert_wgrad_update transposed have no meta of their own
        while isinstance(node, fx.Node) and "val" not in node.meta and node.target is aten.t.default:
            node = node.args[0]
        return _meta(node)

    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.forge.wgrad_update_.default:
            ops = [val(a) for a in node.args[1:3]]
            if any(v is not None and v.dtype == torch.float32 and v.device.type == "cuda" for v in ops):
                n += 1
    if not n:
        return None
    counters["fp32_activation_gemms"] += n
    return (f"fp32 activations: {n} fused weight-gradient GEMMs take fp32 operands -- exact, and their dW is never "
            "allocated, but bf16/fp16 autocast is the fast regime: per 4096x4096 AdamW kernel vs cuBLAS + torch's "
            "fused AdamW, IEEE fp32 (torch's default) 0.92-1.44x at 256-8192 tokens; under TF32 "
            "(set_float32_matmul_precision('high')) on Hopper 1.20-1.45x (H100), elsewhere 0.40-0.58x; end to end "
            "an fp32 TF32 step measured 1.08-1.09x, the bf16 autocast one 1.17-1.20x (benchmarks/RESULTS.md)")


def _replace_norm(graph: fx.Graph, norm: fx.Node, match: _Match, operands=None) -> None:
    """``linalg_vector_norm(dW)`` -> ``sqrt(forge::wgrad_sqnorm(mm's operands))``: the norm of the matmul's product
    (transposes and views do not change it), without the product (accumulated passes: of their concatenated
    ``operands``); an embedding's or a tied weight's through ``forge::embedding_sqnorm`` (the compact rows; for a
    tied weight plus the matmul's dW in W's orientation)."""
    new = []
    with graph.inserting_before(norm):
        if match.emb is None and not match.embedding:
            sq = graph.call_function(torch.ops.forge.wgrad_sqnorm.default,
                                     tuple(operands) if operands is not None else tuple(match.mm.args[:2]))
        else:
            emb = match.mm if match.embedding else match.emb
            grad_output, indices, num_rows, padding_idx = emb.args[:4]
            if operands is not None:
                grad_output, indices = operands
            kwargs = {}
            if match.emb is not None:
                a, b = match.mm.args[:2]
                if match.transposed:
                    a, b = graph.call_function(aten.t.default, (b,)), graph.call_function(aten.t.default, (a,))
                    new += [a, b]
                kwargs = dict(dy_t=a, x=b)
            sq = graph.call_function(torch.ops.forge.embedding_sqnorm.default,
                                     (grad_output, indices, num_rows, padding_idx), kwargs)
        root = roots = graph.call_function(aten.sqrt.default, (sq,))
        if match.dp is not None:
            # the norm of the mean over the ranks: the gathered operands' product is the sum
            root = graph.call_function(aten.mul.Tensor, (roots, 1.0 / match.dp[1]))
            new.append(roots)
        fp32 = [sq, roots, root]
        nv = norm.meta.get("val")
        if nv is not None and nv.dtype != torch.float32:
            # a rounded weight's bf16 gradient (stochastic_rounding): the norm of its fp32 dW, rounded to the dtype
            # torch's norm of the bf16 gradient has, so the clipping arithmetic after it is traced as it was
            root = graph.call_function(aten._to_copy.default, (root,), {"dtype": nv.dtype})
            new.append(root)
            root.meta["val"] = nv
    for n in set(fp32):
        if nv is not None:
            n.meta["val"] = nv if nv.dtype == torch.float32 else nv.to(torch.float32)
    for n in new + [sq, root]:
        n.meta["forge"] = "wgrad_norm"
    norm.replace_all_uses_with(root)
    graph.erase_node(norm)
    counters["norm_from_operands"] += 1


def _fp32_factor(graph: fx.Graph, scale: fx.Node, made: dict) -> fx.Node:
    """``scale`` (a 0-dim bf16 factor) as fp32, one conversion per factor (kept in ``made`` under (scale, "fp32"))."""
    key = (scale, "fp32")
    if key not in made:
        with graph.inserting_after(scale):
            made[key] = graph.call_function(aten._to_copy.default, (scale,), {"dtype": torch.float32})
        made[key].meta["val"] = _meta(scale).to(torch.float32)
        made[key].meta["forge"] = "wgrad_update"
    return made[key]


def _host_scale(graph: fx.Graph, scale: fx.Node, hparams) -> fx.Node:
    """The factor as a float64 0-dim CPU tensor (a hyper-parameter of the scaled rule), right after it."""
    with graph.inserting_after(scale):
        hs = graph.call_function(torch.ops.forge.host_scalar.default, (scale,))
    like = next((_meta(h) for h in hparams if _meta(h) is not None), None)
    if like is not None:
        hs.meta["val"] = like
    hs.meta["forge"] = "wgrad_update"
    counters["grad_scaled"] += 1
    return hs


def _token_operands(graph: fx.Graph, match: _Match, start: fx.Node) -> tuple:
    """((dy_t, x), last node), right after ``start`` (the last of the matmuls, where every operand exists), for a
    gradient whose GEMM reads more tokens than one matmul's: accumulated passes' dY rows and X rows concatenated over
    tokens, and / or, for a data-parallel mean, every rank's all-gathered -- dW = dy_t @ x is then their sum, dy_t the
    transposed view of the rows (the layout a single pass's dy_t has: no transposing copy). An embedding's:
    (grad_output rows, indices), flat over tokens. Transposes as ``permute``: Inductor lowers no ``aten.t`` in the
    Dynamo route's backward graph, which is already decomposed."""
    made = [start]

    def node(target, args):   # each after the one before: graph order = creation order
        with graph.inserting_after(made[-1]):
            made.append(graph.call_function(target, args))
        return made[-1]
    rows, xs = [], []
    for producer, transposed in match.pairs:
        a, b = producer.args[:2]
        if match.embedding:     # (grad_output, indices)
            rows.append(node(aten.view.default, (a, [-1, _meta(a).shape[-1]])))
            xs.append(node(aten.view.default, (b, [-1])))
        else:
            # transposed: mm = dW^T = x^T @ dy_t^T, so mm's operands are (x^T, dY rows)
            rows.append(b if transposed else node(aten.permute.default, (a, [1, 0])))
            xs.append(node(aten.permute.default, (a, [1, 0])) if transposed else b)
    dy_rows, x = (rows[0], xs[0]) if len(rows) == 1 else (node(aten.cat.default, (rows, 0)),
                                                           node(aten.cat.default, (xs, 0)))
    if match.dp is not None:
        name, world = match.dp
        dy_rows, x = (node(C10D_WAIT, (node(C10D_ALL_GATHER, (t, world, name)),)) for t in (dy_rows, x))
    operands = (dy_rows if match.embedding else node(aten.permute.default, (dy_rows, [1, 0])), x)
    _fake_values(made[1:])
    return operands, made[-1]


def _share_gathers(graph: fx.Graph) -> None:
    """One all-gather per gathered tensor: weights reading one X (q/k/v, gate/up) gathered it once each. The first in
    graph order serves every later user (it comes before each of them); the gathered copy then lives until the last
    of those updates."""
    first = {}
    for n in list(graph.nodes):
        if n.target is not C10D_ALL_GATHER or n.meta.get("forge") != "wgrad_update":
            continue
        key = (_view_key(n.args[0]), *n.args[1:])
        waits = [u for u in n.users if u.target is C10D_WAIT]
        if len(waits) != 1 or len(n.users) != 1:
            continue
        if key not in first:
            first[key] = waits[0]
            continue
        waits[0].replace_all_uses_with(first[key])
        graph.erase_node(waits[0])
        graph.erase_node(n)
        counters["gathers_shared"] += 1


def _view_key(node):
    """``node`` as a key that is equal for equal views of one tensor (each linear reshapes its 3-D input itself)."""
    if isinstance(node, fx.Node) and node.target in _VIEW_OPS | _IDENTITIES and node.args:
        return (node.target, _view_key(node.args[0]), repr(node.args[1:]), repr(node.kwargs))
    return node


def _dp_factor(graph: fx.Graph, scale: Optional[fx.Node], world: int, made: dict) -> fx.Node:
    """The factor a data-parallel update scales its gradient by: 1/world (a CPU constant, no device read per step),
    times clip_grad_norm_'s coefficient ``scale`` if there is one (the coefficient of the mean's norm)."""
    key = (scale, world)
    if key in made:
        return made[key]
    if scale is None:
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            f = graph.call_function(aten.full.default, ([], 1.0 / world),
                                    dict(dtype=torch.float32, device=torch.device("cpu")))
        f.meta["val"] = torch.full([], 1.0 / world, dtype=torch.float32)
    else:
        with graph.inserting_after(scale):
            f = graph.call_function(aten.mul.Tensor, (scale, 1.0 / world))
        if _meta(scale) is not None:
            f.meta["val"] = _meta(scale)
    f.meta["forge"] = "wgrad_update"
    made[key] = f
    return f


def _fake_values(made: list) -> None:
    """Fake values of new nodes for the passes after this one (shapes, dtypes), from their inputs' own."""
    for n in made:
        n.meta["forge"] = "wgrad_update"
    try:
        vals = {}

        def val(a):
            return (vals[a] if a in vals else _meta(a)) if isinstance(a, fx.Node) else a
        for n in made:
            vals[n] = n.target(*[[val(i) for i in a] if isinstance(a, list) else val(a) for a in n.args])
        for n, v in vals.items():
            n.meta["val"] = v
    except Exception as e:  # noqa: BLE001 -- a missing value is what the other rewrites leave too
        log.debug("forge: no fake value for the concatenated operands: %s", e)


def _insert_wgrad_update(graph: fx.Graph, match: _Match, anchor: fx.Node, operands=None) -> None:
    """``forge::wgrad_update_`` after ``anchor``, its dy_t / x from the matmul's operands (accumulated passes: the
    concatenated ``operands``)."""
    weight, _, states, hparams, rule = match.apply.args[:5]
    # a bf16 weight rounded stochastically: forge::wgrad_update_rounded_, its round key and salt after the rule
    rounding = round_args(match.apply)
    op = torch.ops.forge.wgrad_update_.default if rounding is None else _ROUNDED
    rounding = () if rounding is None else tuple(rounding)
    kwargs = {}
    if match.emb is not None and operands is None:
        kwargs = dict(emb_grad_output=match.emb.args[0], emb_indices=match.emb.args[1],
                      emb_padding_idx=match.emb.args[3])
    _insert_fused(graph, match, anchor, operands, op, weight, (states, hparams, rule, *rounding), kwargs)


def _insert_wgrad_update_q8(graph: fx.Graph, match: _Match, anchor: fx.Node, operands=None) -> None:
    """``forge::wgrad_update_q8_`` after ``anchor``, its dy_t / x from the matmul's operands (accumulated passes: the
    concatenated ``operands``) and the rest of ``apply_rule_q8_``'s arguments."""
    weight, _, codes, scales, scalars, hparams, rule, key, salt = match.apply.args[:9]
    _insert_fused(graph, match, anchor, operands, torch.ops.forge.wgrad_update_q8_.default, weight,
                  (codes, scales, scalars, hparams, rule, key, salt))


def _insert_fused(graph: fx.Graph, match: _Match, anchor: fx.Node, operands, op, weight, rest: tuple,
                  kwargs=None) -> None:
    """``op(weight, dy_t, x, *rest, **kwargs)`` after ``anchor``: dy_t / x the matmul's operands (transposed back
    where the matmul computed dW^T), or the concatenated ``operands`` of accumulated passes."""
    if operands is not None:
        with graph.inserting_after(anchor):
            fused = graph.call_function(op, (weight, *operands, *rest))
        fused.meta["forge"] = "wgrad_update"
        return
    a, b = match.mm.args
    with graph.inserting_after(anchor):
        if match.transposed:
            dy_t = graph.call_function(aten.t.default, (b,))
            with graph.inserting_after(dy_t):
                x = graph.call_function(aten.t.default, (a,))
        else:
            dy_t, x = a, b
        with graph.inserting_after(x if match.transposed else anchor):
            fused = graph.call_function(op, (weight, dy_t, x, *rest), kwargs or {})
    for n in (dy_t, x, fused):
        if isinstance(n, fx.Node) and n.op == "call_function" and n is not a and n is not b:
            n.meta["forge"] = "wgrad_update"


def _insert_embedding_update_q8(graph: fx.Graph, match: _Match, anchor: fx.Node, operands=None) -> None:
    """``forge::embedding_update_q8_`` after ``anchor``, from the embedding backward's gradient rows and indices
    (accumulated passes / data parallel: the concatenated ``operands``)."""
    weight, _, codes, scales, scalars, hparams, rule, key, salt = match.apply.args[:9]
    grad_output, indices, _, padding_idx = match.mm.args[:4]
    if operands is not None:
        grad_output, indices = operands
    with graph.inserting_after(anchor):
        fused = graph.call_function(torch.ops.forge.embedding_update_q8_.default,
                                    (weight, grad_output, indices, codes, scales, scalars, hparams, rule, key, salt,
                                     padding_idx))
    fused.meta["forge"] = "embedding_update"
