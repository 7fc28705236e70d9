"""Recompute cheap forward values at their backward uses in the whole-step graph (compile_train_step).

Why: ``torch.compile`` of a module partitions forward and backward and its min-cut partitioner recomputes
cheap ops (dtype casts, element-wise ops) in the backward instead of saving them. compile_train_step hands
Inductor one graph with forward, backward and update, so nothing is partitioned and every forward value
the backward reads stays alive across the forward/backward boundary, where the peak usually is. The
largest case: under bf16 autocast each linear's bf16 copy of W (made in the forward, read again by the
backward's dX = dY @ W) -- 2 bytes per parameter, 2.6 GiB above the torch.compile baseline at 1B parameters
(measured on the H200, RESULTS.md). Such a copy can only be recomputed where its weight is not yet updated:
autograd computes most linears' dW before their dX, so it is recomputed only when the fused updates are placed
after the dX matmul (``compile_train_step(recompute_weight_copies=True)``); otherwise the forward's copy is
kept, as torch.compile keeps it. Also the MLP's ``silu(gate) * up`` and norms' normalized outputs, which the
fused op reads as X.

What: a node is copied to just before its first backward use when it is cheap (a view, a dtype cast, or a
deterministic element-wise op) and every input of the copy is available there without extending any
lifetime: a graph input, a value the original graph keeps alive until then anyway, or itself such a copy.
Backward users then read the copy, so the original dies with its last forward use. A copy is only made
when nothing in between writes to what it reads (it would otherwise see the updated weight).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

import torch
import torch.fx as fx

from .._compat import OpOverload, op_schema
from ..kernels import cast_after as _cast_after  # noqa: F401  (registers forge::cast_after)

log = logging.getLogger(__name__)
aten = torch.ops.aten

__all__ = ["remat_for_backward", "backward_start", "written_args", "view_root", "weight_copies_kept"]

counters: Counter = Counter()

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
          aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor, aten.select.int,
          aten.alias.default, aten.detach.default}
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
_PASS_THROUGH = {aten.detach.default, aten.alias.default}
_MAX_DEPTH = 8


def _is_cheap(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    t = node.target
    if t in _VIEWS:
        return True
    if t in _CASTS:
        # a pure dtype change on the same device; anything else (device moves, layouts) is left alone
        return set(node.kwargs) <= {"dtype"} and len(node.args) <= 2
    if op_schema(t).is_mutable or torch.Tag.nondeterministic_seeded in t.tags:
        return False
    return torch.Tag.pointwise in t.tags


def written_args(node: fx.Node) -> list:
    """The nodes a mutating op writes to (schema alias annotations), empty for functional ops."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, OpOverload) or not op_schema(t).is_mutable:
        return []
    out = []
    for i, a in enumerate(op_schema(t).arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        out += [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, fx.Node)]
    return out


def view_root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEWS | {aten.as_strided.default} and node.args:
        node = node.args[0]
    return node


def backward_start(gm: fx.GraphModule, n_forward_outputs: int) -> Optional[int]:
    """Index of the first node that consumes a value the step returns (its loss): where the backward
    begins. None when the step returns nothing the graph goes on to use."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = next(n for n in reversed(nodes) if n.op == "output")
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    start = None
    for o in outs[:n_forward_outputs]:
        while isinstance(o, fx.Node) and o.op == "call_function" and o.target in _PASS_THROUGH:
            o = o.args[0]
        if not isinstance(o, fx.Node):
            continue
        users = [pos[u] for u in o.users if u.op != "output" and u.target not in _PASS_THROUGH]
        if users:
            start = min(users) if start is None else min(start, min(users))
    return start


def remat_for_backward(gm: fx.GraphModule, n_forward_outputs: int) -> int:
    """Rewrite ``gm`` in place; returns how many nodes were copied into the backward."""
    start = backward_start(gm, n_forward_outputs)
    if start is None:
        return 0
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((pos[u] for u in n.users), default=pos[n]) for n in nodes}
    writes = [(pos[n], view_root(w)) for n in nodes for w in written_args(n)]

    def written_before(root: fx.Node, q: int) -> bool:
        return any(p < q and r is root for p, r in writes)

    copy_at: dict = {}          # original node -> index of the node its copy is inserted before

    def plan(node: fx.Node, q: int, trial: dict, depth: int) -> bool:
        """Can ``node`` be recomputed just before index q? Records the copies needed in ``trial``."""
        if depth > _MAX_DEPTH or not _is_cheap(node) or pos[node] >= start:
            return False
        for i in node.all_input_nodes:
            if written_before(view_root(i), q):
                return False
            if i.op in ("placeholder", "get_attr"):
                continue
            if i in copy_at or i in trial:
                continue       # its copy is (moved) before q below
            if last_use[i] >= q:
                continue       # the original keeps it alive until q anyway
            if not plan(i, q, trial, depth + 1):
                return False
        trial[node] = min(trial.get(node, q), q)
        return True

    def move_before(node: fx.Node, q: int) -> None:
        if copy_at[node] <= q:
            return
        copy_at[node] = q
        for i in node.all_input_nodes:
            if i in copy_at:
                move_before(i, q)

    for n in nodes[:start]:
        late = [pos[u] for u in n.users if u.op != "output" and pos[u] >= start]
        if not late or n.op != "call_function":
            continue
        q = min(late)
        trial: dict = {}
        if not plan(n, q, trial, 0) or all(_is_view(t) for t in trial):
            continue       # a copied view alone frees nothing: its base stays alive
        for t, tq in trial.items():
            if t in copy_at:
                move_before(t, tq)
            else:
                copy_at[t] = tq
        for t in trial:
            for i in t.all_input_nodes:
                if i in copy_at:
                    move_before(i, copy_at[t])

    if not copy_at:
        return 0
    copies: dict = {}
    for n in nodes:                # original order keeps the copies topologically sorted
        if n not in copy_at:
            continue
        # an input's copy is used only if it comes first (an input kept alive for this copy may have been
        # copied later, for a later backward use, and inserted after this one)
        with graph.inserting_before(nodes[copy_at[n]]):
            c = graph.node_copy(n, lambda a: copies[a] if a in copies and copy_at[a] <= copy_at[n] else a)
        c.meta = dict(n.meta)
        # the copy computes what n computes (no input written in between): passes/wgrad_update_group.py reads two
        # fused updates' X as the same when one is n and the other its copy
        c.meta["forge_remat_of"] = n.meta.get("forge_remat_of", n)
        copies[n] = c
    for n, c in copies.items():
        for u in list(n.users):
            if u is not c and u not in copies.values() and u.op != "output" and pos.get(u, -1) >= start:
                u.replace_input_with(n, c)
    gone = set(copies.values())     # not anchors: copies (and erased originals)
    for n in reversed(nodes):
        if n in copies and not n.users:
            graph.erase_node(n)
            gone.add(n)
    for n, c in copies.items():
        _order_cast(graph, c, nodes[start:copy_at[n]], gone)
    graph.lint()
    gm.recompile()
    saved = sum(_nbytes(n) for n in copies if not _is_view(n))
    counters["remat_nodes"] += len(copies)
    log.info("forge: recomputed %d cheap forward values in the backward (%d bytes no longer kept across "
             "the forward/backward boundary)", len(copies), saved)
    return len(copies)


def _order_cast(graph: fx.Graph, c: fx.Node, before: list, gone: set) -> None:
    """Make the copied cast ``c`` of a graph input (a weight) a forge::cast_after of the latest backward tensor
    of ``before`` (the backward's nodes up to its insertion point): as a plain cast, Inductor fuses it with the
    forward's cast of the same input and computes it in the forward (kernels/cast_after.py says why)."""
    val = c.meta.get("val")
    # a plain dtype cast (as weight_cast_in_update takes them): no layout/device/memory-format arguments
    if (c.target not in _CASTS or set(c.kwargs) - {"dtype"} or not isinstance(val, torch.Tensor)
            or view_root(c.args[0]).op != "placeholder"):
        return
    anchor = next((a for a in reversed(before) if a not in gone and a.op == "call_function"
                   and isinstance(a.meta.get("val"), torch.Tensor)), None)
    if anchor is None:
        return
    with graph.inserting_before(c):
        o = graph.call_function(torch.ops.forge.cast_after.default, (c.args[0], anchor, val.dtype))
    o.meta = dict(c.meta)
    c.replace_all_uses_with(o)
    graph.erase_node(c)
    counters["ordered_casts"] += 1


def weight_copies_kept(gm: fx.GraphModule, n_forward_outputs: int, params) -> int:
    """How many of ``params`` (placeholders) have a cast copy made in the forward and read in the backward, i.e.
    kept alive across the forward/backward boundary."""
    start = backward_start(gm, n_forward_outputs)
    if start is None:
        return 0
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    params, kept = set(params), set()
    for n in nodes[:start]:
        if not any(u.op != "output" and pos[u] >= start for u in n.users):
            continue
        r = view_root(n)
        if r.op == "call_function" and r.target in _CASTS and view_root(r.args[0]) in params:
            kept.add(view_root(r.args[0]))
    return len(kept)


def _is_view(n: fx.Node) -> bool:
    return n.target in _VIEWS


def _nbytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
