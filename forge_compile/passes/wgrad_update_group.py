"""Several fused updates become one launch (opt-in): ``forge::wgrad_update_(_table)_`` x G ->
``forge::wgrad_update_group(_table)_`` (kernels/wgrad_update_group.py).

Why: a decoder layer's projections are small weights whose persistent launches are mostly pipeline fill and
drain. One launch over their stacked rows was 1.02-1.19x faster than their launches in turn, in isolation
(benchmarks/RESULTS.md "Several weights in one launch"). q/k/v (and gate/up) read the same normed hidden state X in
the backward; o reads the attention output, of the same shape: the kernel reads each member's X through its own
descriptor, so with FORGE_GROUP_UPDATES=width o joins q/k/v (or the next gate/up) too. OFF by default: in a
training step it did not pay (see ENV below).

When members are grouped (all must hold, else they stay single):
- the same rule, no tied-embedding rows (the grouped kernel does not add them), a cast copy (cast_out, the
  cast_weights_in_update option) for all members or none;
- the same X: the same node, or the same views / transposes / dtype casts of one node (or of its copy made by
  remat_for_backward); with FORGE_GROUP_UPDATES=width, any X of one shape and dtype (the same K and token count
  M), members reading the same value passing it once;
- weights fp32 2-D on a device of GROUP_DEVICES (CUDA: elsewhere the grouped op would only run the members'
  launches in turn), of at most _MAX_MEMBER_ELEMS elements; at most one member whose row count is not a multiple
  of 128, placed last;
- nothing between a member's own position and the group's (the last member's) reads or writes its weight or
  states, or writes its dY or X: the member's update moves later, and the step must not see the difference.
Up to G_MAX members per group, in graph order. The op itself checks at run time what the graph cannot know
(data pointers, equal step counts and hyperparameters, an sm_90 GPU) and otherwise runs the members one by one:
exact either way.

Runs on the rewritten step graph after ``use_scalar_table`` (so both op variants exist by then).
"""
from __future__ import annotations

import logging
import os
from collections import Counter

import torch
import torch.fx as fx

from .remat_for_backward import _CASTS, _VIEWS, view_root, written_args

log = logging.getLogger(__name__)

__all__ = ["group_wgrad_updates", "group_updates_enabled", "group_note", "GROUP_DEVICES", "ENV"]

counters: Counter = Counter()

# FORGE_GROUP_UPDATES=1: members reading the same X (q/k/v, gate/up); =width: any members whose X has one shape
# (o with q/k/v, across layers). Both off by default: neither gained end to end (H100, stop 27: the same-X groups
# left the step's GPU time unchanged, the width groups added 0.57 ms of 16.4 -- the grouped kernels took 0.4 ms
# MORE than the single launches they replaced, though 1.02-1.14x faster than them in isolation: the graphed step
# runs the scalar-table variant, which lost that gain; fixed since, not re-measured)
ENV = "FORGE_GROUP_UPDATES"
WIDTH = "width"


def group_updates_enabled() -> bool:
    return os.environ.get(ENV, "0") in ("1", WIDTH)


# devices whose fused updates are grouped (tests add "cpu": the op then runs the members' CPU paths, exactly)
GROUP_DEVICES = {"cuda"}
_TILE_ROWS = 128      # the grouped kernel's tile: every member but the last needs N % 128 == 0
# Members up to 2048 [128, 128] tiles (a 4096x8192 weight): fill and drain matter where a launch has few tiles per
# SM; a larger weight (lm_head, 14336-wide MLP) gains little from company, and its update moving later would keep
# its dY alive longer (lm_head's [tokens, vocab] logits gradient)
_MAX_MEMBER_ELEMS = 2048 * 128 * 128
# ops through which two fused updates' X are compared: views, and the dtype casts autocast puts before each
# linear separately (q, k and v each cast the same normed hidden state: three nodes, one value)
_X_OPS = _VIEWS | _CASTS


def _meta(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _x_key(node: fx.Node):
    """(root node, the view and cast ops applied to it): equal keys read equal values. A node remat_for_backward
    copied into the backward counts as its original (it computes the same values from the same inputs)."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _X_OPS:
        chain.append((node.target, tuple(a for a in node.args[1:]), tuple(sorted(node.kwargs.items()))))
        node = node.args[0]
    if isinstance(node, fx.Node):
        node = node.meta.get("forge_remat_of", node)
    return node, tuple(chain)


def _member(n: fx.Node):
    """(weight, dy_t, x, states, last, rule) of a fused update the grouped kernel can take (last: hparams or the
    table row), or None: a tied embedding's rows are not added by it; the cast copy (cast_out) is written."""
    if any(v is not None for k, v in n.kwargs.items() if k != "cast_out") or len(n.args) != 6:
        return None
    w = _meta(n.args[0])
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.float32:
        return None
    if w.device.type not in GROUP_DEVICES or w.numel() > _MAX_MEMBER_ELEMS:
        return None
    return n.args


def _movable(m: fx.Node, pos: int, nodes: list, order: dict) -> bool:
    """Nothing in (m, pos) reads or writes m's weight/states/cast copy or writes its dY / X."""
    w, dy_t, x, states = m.args[:4]
    mine = {view_root(a) for a in [w, *states, m.kwargs.get("cast_out")] if isinstance(a, fx.Node)}
    inputs = {view_root(a) for a in (dy_t, x) if isinstance(a, fx.Node)}
    for u in nodes[order[m] + 1:pos + 1]:
        if any(view_root(i) in mine for i in u.all_input_nodes):
            return False
        if any(view_root(t) in inputs for t in written_args(u)):
            return False
    return True


def group_wgrad_updates(gm: fx.GraphModule, names: dict | None = None, max_members: int | None = None) -> list:
    """Rewrite ``gm`` in place; returns the groups made, each a list of the members' weight names (``names``:
    placeholder -> parameter name)."""
    from ..kernels.wgrad_update_group import G_MAX

    plain, table = torch.ops.forge.wgrad_update_.default, torch.ops.forge.wgrad_update_table_.default
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    buckets: dict = {}
    for n in nodes:
        if n.op != "call_function" or n.target not in (plain, table) or _member(n) is None:
            continue
        w, dy_t, x, _, _, rule = n.args
        dv, xv = _meta(dy_t), _meta(x)
        cast = _meta(n.kwargs.get("cast_out"))
        # members write a cast copy all or none (one kernel), of one dtype; each reads its own X, all of one shape
        # (the kernel takes a descriptor per member)
        key = (n.target, rule, None if dv is None else dv.dtype, _meta(w).shape[1],
               None if cast is None else cast.dtype, None if xv is None else (tuple(xv.shape), xv.dtype))
        if xv is None or os.environ.get(ENV) != WIDTH:
            key += (_x_key(x),)
        buckets.setdefault(key, []).append(n)
    made = []
    cap = min(G_MAX, max_members or G_MAX)
    for (target, *_), members in buckets.items():
        full = [m for m in members if _meta(m.args[0]).shape[0] % _TILE_ROWS == 0]
        ragged = [m for m in members if m not in full]
        # stacked order: the full members in graph order, then at most one ragged member (its rows end the stack)
        groups = [full[i:i + cap] for i in range(0, len(full), cap)]
        for grp in groups:
            if ragged and len(grp) < cap:
                grp.append(ragged.pop(0))
        for grp in groups:
            while len(grp) >= 2:
                pos = max(order[m] for m in grp)
                stuck = [m for m in grp if order[m] < pos and not _movable(m, pos, nodes, order)]
                if not stuck:
                    break
                grp[:] = [m for m in grp if m not in stuck]
            if len(grp) >= 2:
                made.append(_replace(graph, grp, target is table, max(order[m] for m in grp), nodes))
    if made:
        graph.lint()
        gm.recompile()
    counters["groups"] += len(made)
    counters["grouped_weights"] += sum(len(g) for g in made)
    return [[(names or {}).get(w, w.name) for w in g] for g in made]


def group_note(groups: list):
    """The report's line for the groups ``group_wgrad_updates`` made (None when it made none)."""
    if not groups:
        return None
    shown = "; ".join(" + ".join(g) for g in groups[:3]) + ("; ..." if len(groups) > 3 else "")
    return (f"grouped launches: {len(groups)} sets of fused weights are updated by one launch each ({shown})")


def _replace(graph: fx.Graph, grp: list, tabled: bool, pos: int, nodes: list) -> list:
    anchor = nodes[pos]
    weights = [m.args[0] for m in grp]
    # one X when every member reads the same value (one TMA descriptor), else each member's own
    xs = [m.args[2] for m in grp]
    xs = xs[:1] if len({_x_key(x) for x in xs}) == 1 else xs
    args = (weights, [m.args[1] for m in grp], xs, [s for m in grp for s in m.args[3]],
            [m.args[4] for m in grp] if tabled else [h for m in grp for h in m.args[4]], grp[0].args[5])
    op = torch.ops.forge.wgrad_update_group_table_ if tabled else torch.ops.forge.wgrad_update_group_
    casts = [m.kwargs.get("cast_out") for m in grp]
    kwargs = {"cast_outs": casts} if casts[0] is not None else {}
    with graph.inserting_after(anchor):
        new = graph.call_function(op.default, args, kwargs)
    new.meta["forge"] = "wgrad_update"
    new.meta["val"] = None
    for m in grp:
        graph.erase_node(m)
    return weights
