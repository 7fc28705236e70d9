"""Under autocast, let each fused update write its weight's low-precision copy for the next step's forward
(``compile_train_step(cast_weights_in_update=True)``).

Why: every step, autocast casts each fp32 weight to bf16 before its matmuls (a separate kernel per weight: read 4
bytes, write 2 per parameter, ~2.9 GB per step on a 477 M-parameter Llama) -- in torch.compile's step and in
forge's. The fused update already holds the new W in registers; storing its bf16 copy there costs 2 bytes per
parameter of extra stores, and the next forward reads that copy instead of casting again (NOTES_kernel.md, "the
weight copies").

What, on the whole-step graph after ``rewrite_wgrad_updates(after_copies=True)`` (each fused update placed after
every reader of its weight's cast copies): for each fused weight W whose graph casts W itself to one 16-bit dtype,
a new placeholder -- the copy, ``W.to(dtype)`` as of the step's start -- replaces those casts, and the fused update
gets it as ``cast_out``, so it ends the step holding the new W's copy. Exact when the copy input is W's cast at the
step's start: the caller (capture.py) keeps one copy per weight and casts again whenever the weight's version
counter moved outside the step. Not rewritten (the reason is returned): a weight cast to two dtypes, a cast of a view
of W, a copy read after the update.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import torch
import torch.fx as fx

from .wgrad_update_pattern import _UPCASTS, _aliases, _meta, _readers

log = logging.getLogger(__name__)

__all__ = ["cast_weights_in_update", "WeightCast"]

counters: Counter = Counter()

_FUSED = torch.ops.forge.wgrad_update_.default
_LOW = (torch.bfloat16, torch.float16)


@dataclasses.dataclass
class WeightCast:
    name: str
    weight: fx.Node               # the parameter's placeholder
    dtype: torch.dtype | None     # the copy's dtype; None: not rewritten
    reason: str = ""
    placeholder: fx.Node | None = None


def _casts_of(weight: fx.Node) -> tuple[list, list]:
    """(casts of W itself to a 16-bit dtype on its device, casts of a view of W)."""
    casts = []
    for n in _aliases(weight):
        for c in n.users:
            src, dst = _meta(n), _meta(c)
            if (c.target in _UPCASTS and c.args[0] is n and src is not None and dst is not None
                    and dst.dtype in _LOW and src.device == dst.device and set(c.kwargs) <= {"dtype"}):
                casts.append(c)
    return [c for c in casts if c.args[0] is weight], [c for c in casts if c.args[0] is not weight]


def cast_weights_in_update(gm: fx.GraphModule, names: dict, before: fx.Node | None) -> list[WeightCast]:
    """Rewrite ``gm`` in place. ``names``: parameter placeholder -> name; ``before``: the placeholder before which the
    new placeholders go (the step's first tensor argument; None: after the last placeholder). Returns one
    ``WeightCast`` per fused weight with a cast, in the fused updates' order -- the rewritten ones (those with a
    ``placeholder``) in the order of their new placeholders."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    out = []
    for fused in [n for n in graph.nodes if n.op == "call_function" and n.target is _FUSED]:
        weight = fused.args[0]
        name = names.get(weight, weight.name)
        direct, of_views = _casts_of(weight)
        dtypes = {_meta(c).dtype for c in direct}
        if not direct:
            if of_views:
                out.append(WeightCast(name, weight, None, "the step casts a view of the weight"))
            continue     # no cast: nothing to write (fp32 steps)
        if len(dtypes) > 1:
            out.append(WeightCast(name, weight, None, f"the weight is cast to {sorted(map(str, dtypes))}"))
            continue
        if of_views:
            out.append(WeightCast(name, weight, None, "the step also casts a view of the weight"))
            continue
        late = [r for c in direct for r in _readers(_aliases(c)) if order[r] > order[fused]]
        if late:
            out.append(WeightCast(name, weight, None, f"its cast copy is read after the update (by {late[0].target})"))
            continue
        dtype = dtypes.pop()
        if before is not None:
            ctx = graph.inserting_before(before)
        else:
            ctx = graph.inserting_after([n for n in graph.nodes if n.op == "placeholder"][-1])
        with ctx:
            ph = graph.placeholder(f"{weight.name}_cast")
        ph.meta["val"] = _meta(direct[0])
        for c in direct:
            c.replace_all_uses_with(ph)
            graph.erase_node(c)
        fused.kwargs = {**fused.kwargs, "cast_out": ph}
        counters["rewritten"] += 1
        out.append(WeightCast(name, weight, dtype, "", ph))
    graph.lint()
    gm.recompile()
    return out
