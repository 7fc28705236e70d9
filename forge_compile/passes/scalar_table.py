"""Make a whole-step graph replayable as a CUDA graph: every update reads its host scalars from one device table.

Why: a captured CUDA graph replays the kernel arguments of the capture. The step's updates take values that change
at every step -- the step counter, lr from a scheduler, SGD's first-step dampening -- as host scalars (the fused
op's launch arguments; the decomposed rules' 0-dim CPU tensors, which Inductor passes to its kernels as values).
Here each update instead reads the rule's kernel scalars (``rule_scalars``: bitwise what the host computes for a
normal launch) from a row of one fp32 table on the device, which the step's runtime rewrites before every replay:
- ``forge::wgrad_update_(w, dy_t, x, states, hparams, rule)`` -> ``forge::wgrad_update_table_(w, dy_t, x,
  tensor_states, table[row], rule)``;
- ``forge::embedding_update_(w, grad_output, indices, states, hparams, rule, padding_idx)`` ->
  ``forge::embedding_update_table_(w, grad_output, indices, tensor_states, table[row], rule, padding_idx)``;
- ``forge::apply_rule_(p, g, states, hparams, rule)`` (left unfused) -> ``forge::rule_update_(p, g,
  tensor_states, table[row], rule)``: the rule's generated epilogue on the materialized gradient, bitwise eager
  ``rule.fn`` (kernels/rule_update.py) -- not the decomposed rule Inductor would compile.
The updates of parameters with 8-bit states (a Rule8bitOptimizer's: ``forge::wgrad_update_q8_``,
``forge::apply_rule_q8_``, ``forge::embedding_update_q8_``) become ``forge::*_q8_table_`` ops whose row holds, after
the rule's scalars, the weight's element key and each tensor state's rounding key (wgrad_update_q8's row layout):
their keys are round_key(the group's seed, the parameter's count), computed in the traced graph from CPU counts,
which a replay would not recompute -- the rewrite drops those computations and the ``q8_count`` advances
(``counts``), and the runtime writes the keys and advances the counts (``fill_table``'s key words).
The stochastically rounded updates of bf16 parameters (``forge::wgrad_update_rounded_``,
``forge::embedding_update_rounded_``, ``forge::apply_rule_`` with a round key) become the same table ops on their
bf16 parameter, which round with the element key their row holds after the rule's scalars
(stochastic_round.table_row): the key changes at every step as the scalars do, and reaches the kernels the same
way, so a replay rounds with new bits. The row's salt (the parameter's index in the step) is returned with the
table's plans; the runtime writes ``element_key(round_key(seed, call), salt)`` there.
Row ``i`` belongs to optimizer plan ``i`` (the capture's plan order); the scalar states are then advanced by the
runtime (``fill_table``, before each call), not the graph. ``graph_replay_blocker`` says why a graph cannot be replayed (nothing is rewritten then).
"""
from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Optional

import torch
import torch.fx as fx

from .. import kernels as _kernels  # noqa: F401  (registers forge::wgrad_update_table_ and forge::rule_update_)
from .._compat import OpOverload, op_schema
from ..optim.rule import get_rule
from ..kernels.stochastic_round import element_key
from ..kernels.wgrad_update_q8 import row_keys
from ..kernels.wgrad_update_triton import rule_scalars, split_states
from .remat_for_backward import view_root, written_args
from .wgrad_update_pattern import round_args

log = logging.getLogger(__name__)
aten = torch.ops.aten

__all__ = ["graph_replay_blocker", "use_scalar_table", "table_width", "fill_table", "row_key_words",
           "grad_scale_column"]

counters: Counter = Counter()

_APPLY = torch.ops.forge.apply_rule_.default
_FUSED = torch.ops.forge.wgrad_update_.default
_EMBEDDING = torch.ops.forge.embedding_update_.default
_FUSED_R = torch.ops.forge.wgrad_update_rounded_.default
_EMBEDDING_R = torch.ops.forge.embedding_update_rounded_.default
_HOST_SCALAR = torch.ops.forge.host_scalar.default
_Q8 = torch.ops.forge.wgrad_update_q8_.default
_APPLY_Q8 = torch.ops.forge.apply_rule_q8_.default
_EMBEDDING_Q8 = torch.ops.forge.embedding_update_q8_.default
_Q8_OPS = (_Q8, _APPLY_Q8, _EMBEDDING_Q8)
# random numbers: Inductor draws seeds on the host at each call, a replayed graph would repeat the captured ones.
# Ops tagged nondeterministic_seeded draw them, except attention with dropout_p == 0 (SDPA's flash / efficient /
# cuDNN kernels are tagged for their dropout and touch no generator without it); a few more by name.
_RANDOM = {"inductor_seeds", "inductor_random", "philox_rand"}


def _meta(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _updates(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (_APPLY, _FUSED, _EMBEDDING, _FUSED_R, _EMBEDDING_R, *_Q8_OPS)]


def _q8_first(n) -> int:
    # the position of the codes list: apply_rule_q8_(param, grad, codes, ...), the others after (w, dy_t / go, x / idx)
    return 2 if n.target is _APPLY_Q8 else 3


def _states_hparams(n):
    # apply_rule_(param, grad, states, hparams, rule); wgrad_update_(weight, dy_t, x, states, hparams, rule);
    # embedding_update_(weight, grad_output, indices, states, hparams, rule, padding_idx); the 8-bit ops:
    # (..., codes, scales, scalar_states, hparams, rule, round_key, round_salt, ...) -- their states as one list
    if n.target in _Q8_OPS:
        i = _q8_first(n)
        return list(n.args[i]) + list(n.args[i + 1]) + list(n.args[i + 2]), n.args[i + 3]
    return (n.args[2], n.args[3]) if n.target is _APPLY else (n.args[3], n.args[4])


def _rule_of(n) -> str:
    if n.target in _Q8_OPS:
        return n.args[_q8_first(n) + 4]
    return n.args[4] if n.target is _APPLY else n.args[5]


def _q8_key(n):
    """(round_key node, salt) of an 8-bit op."""
    i = _q8_first(n) + 5
    return n.args[i], n.args[i + 1]


def _computed_keys(gm, updates, counts, scalar_inputs=()) -> set:
    """The nodes that compute the updates' rounding keys from optimizer counts (a Rule8bitOptimizer's
    round_key(seed, count) in the graph, also where no update reads the key: a full-precision weight's), and the
    counts' advances (``aten.add_(q8_count, 1)``): a replayed step reads its keys from the table and the runtime
    advances the counts, so the rewrite drops them."""
    out, todo = set(), []
    for n in updates:
        key = _q8_key(n)[0] if n.target in _Q8_OPS else (round_args(n) or (None,))[0]
        if isinstance(key, fx.Node) and key.op == "call_function":
            todo.append(key)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo.extend(a for a in n.all_input_nodes if a.op == "call_function")
    for ph in counts:
        out.update(u for u in ph.users if u.target in (aten.add_.Tensor, aten.add_.Scalar))
    # values computed from the optimizer's scalars that nothing reads (a key no update takes): dead, dropped too
    roots = set(counts) | set(scalar_inputs)
    derived = set()
    for n in gm.graph.nodes:
        if (n.op == "call_function" and not written_args(n) and n not in out
                and any(a in roots or a in derived for a in n.all_input_nodes)):
            derived.add(n)
    dead: set = set()
    for n in reversed(gm.graph.nodes):
        if n in derived and all(u in dead for u in n.users):
            dead.add(n)
    return out | dead


def grad_scale_column(rule) -> int:
    """The kernel-scalar column that holds ``grad_scale`` for a ``grad_scaled_rule`` (the same on every target): a
    replayed step writes clip_grad_norm_'s coefficient there on the device (``use_scalar_table``), so the fused
    kernels read it without a host copy. Found by running the rule's host part with two values; raises
    ``ValueError`` unless exactly one column holds the value itself."""
    return _grad_scale_column(rule.name)


@functools.lru_cache(maxsize=None)
def _grad_scale_column(name: str) -> int:
    # per rule name (a registered name is one function): the blocker and the rewrite ask for every clipping update
    import numpy as np

    from ..kernels.epilogue_codegen import compile_epilogue

    rule = get_rule(name)
    cols = set()
    for target in ("cuda", "interpret"):
        ep = compile_epilogue(rule, target)
        states = [torch.tensor(3.0) for _ in range(ep.n_scalar_states)]
        runs = []
        for v in (0.3712, 0.8125):
            hp = [torch.tensor(0.5, dtype=torch.float64)] * (len(rule.hparams) - 1) + [torch.tensor(v, dtype=torch.float64)]
            runs.append((v, ep.run_host([t.clone() for t in states], hp)[0]))
        (va, a), (vb, b) = runs
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) != 1 or a[diff[0]] != float(np.float32(va)) or b[diff[0]] != float(np.float32(vb)):
            raise ValueError(f"rule {rule.name!r}: grad_scale is not one kernel scalar of its own")
        cols.add(diff[0])
    if len(cols) != 1:
        raise ValueError(f"rule {rule.name!r}: grad_scale's kernel scalar differs between targets")
    return cols.pop()


def _device_scale(n) -> Optional[fx.Node]:
    """The device 0-dim factor of a fused update whose last hyper-parameter is ``forge::host_scalar(factor)``
    (clip_grad_norm_'s coefficient), or None."""
    if n.target is _APPLY:
        return None
    h = _states_hparams(n)[1]
    if not h or not isinstance(h[-1], fx.Node) or h[-1].target is not _HOST_SCALAR:
        return None
    return h[-1].args[0]


def table_width(rules, rounded_rules=(), q8_rules=()) -> int:
    """Columns of the table: the most kernel scalars any of the rules takes -- one more for a rule of a rounded
    update (its element key after the scalars), one more per tensor state too for an update with 8-bit states
    (their rounding keys) -- and at least one."""
    from ..kernels.epilogue_codegen import compile_epilogue
    from ..kernels.wgrad_update_q8 import table_width as q8_width

    return max([1] + [compile_epilogue(r, "cuda").n_kernel_scalars for r in rules]
               + [compile_epilogue(r, "cuda").n_kernel_scalars + 1 for r in rounded_rules]
               + [q8_width(r) for r in q8_rules])


def _draws_random_numbers(n: fx.Node) -> bool:
    t = n.target
    if getattr(t, "__name__", str(t)).split(".")[0] in _RANDOM:
        return True
    if not isinstance(t, OpOverload) or torch.Tag.nondeterministic_seeded not in t.tags:
        return False
    args = op_schema(t).arguments
    for i, a in enumerate(args):
        if a.name == "dropout_p":
            p = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", a.default_value)
            return p != 0
    return True


def graph_replay_blocker(gm: fx.GraphModule, scalar_inputs: set, device: str = "cuda",
                         batch_inputs: frozenset = frozenset(), labels: Optional[dict] = None,
                         counts: frozenset = frozenset()) -> Optional[str]:
    """Why this rewritten step graph cannot read all its per-step values from a table and be replayed on
    ``device``, or None. ``scalar_inputs``: the placeholders of scalar states and hyper-parameters (the table
    replaces them); ``batch_inputs``: the placeholders of the step's tensor arguments (a replay reads copies of
    them, so writing to one would not reach the caller's tensor); ``labels``: names for placeholders in the
    reason (parameter names, "argument i"); ``counts``: the ``q8_count`` placeholders among ``scalar_inputs`` (a
    Rule8bitOptimizer's update counts, advanced in the graph: by the runtime once rewritten)."""
    label = lambda ph: (labels or {}).get(ph, ph.name)  # noqa: E731
    from ..kernels.epilogue_codegen import EpilogueUnsupported, compile_epilogue

    for n in gm.graph.nodes:
        if n.op == "call_function" and _draws_random_numbers(n):
            name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
            return f"the step draws random numbers ({name}): a replay would repeat the captured ones"
    for n in _updates(gm):
        rule = get_rule(_rule_of(n))
        try:
            compile_epilogue(rule, "cuda")
        except EpilogueUnsupported as e:
            return f"rule {rule.name!r} has no generated update kernel: {e}"
        hparams = _states_hparams(n)[1]
        computed = [h for h in hparams if isinstance(h, fx.Node) and h.op != "placeholder"]
        scale = _device_scale(n)
        if scale is not None and computed == [hparams[-1]]:
            # clip_grad_norm_'s coefficient: written into the update's table row on the device
            sv = _meta(scale)
            if sv is None or sv.dim() != 0 or sv.dtype != torch.float32 or (
                    sv.device.type != device and scale.target is not aten.full.default):
                return f"a fused update's gradient scale is not a 0-dim fp32 {device} tensor"
            try:
                grad_scale_column(rule)
            except ValueError as e:   # a rule whose host part folds grad_scale into other scalars
                return str(e)
        elif computed:
            return (f"an update's hyper-parameter is computed by the step ({computed[0].target}), not an optimizer "
                    "value the table can hold")
        if n.target in _Q8_OPS:
            # 8-bit states: the kernels check the codes' and scales' layout at capture (the warm-up calls)
            p = _meta(n.args[0])
            if p is None or p.dtype not in (torch.float32, torch.bfloat16) or not p.is_contiguous():
                return "an 8-bit update of a parameter that is not a contiguous fp32 or bf16 tensor"
            continue
        # a rounded update (stochastic_rounding): a bf16 parameter, its gradient and tensor states bf16 or fp32
        rounded = round_args(n) is not None
        ok = (torch.float32, torch.bfloat16) if rounded else (torch.float32,)
        if n.target is _APPLY:
            p, g = _meta(n.args[0]), _meta(n.args[1])
            if (p is None or g is None or p.dtype != (torch.bfloat16 if rounded else torch.float32)
                    or g.dtype not in ok or p.shape != g.shape):
                return (f"an unfused update of a {getattr(p, 'dtype', '?')} parameter with a "
                        f"{getattr(g, 'dtype', '?')} gradient (the graphed update takes fp32 both, or a bf16 "
                        "parameter under stochastic rounding)")
            if not p.is_contiguous():
                return "an unfused update of a non-contiguous parameter"
        for i, s in enumerate(_states_hparams(n)[0]):
            if not rule.is_scalar_state(i):
                sv, pv = _meta(s), _meta(n.args[0])
                if (sv is None or pv is None or sv.dtype not in ok or not sv.is_contiguous()
                        or sv.shape != pv.shape):
                    return f"state {rule.states[i]!r} is not a contiguous fp32 tensor shaped like its parameter"
    for n in gm.graph.nodes:
        for w in written_args(n):
            if view_root(w) in batch_inputs:
                return (f"the step writes to {label(view_root(w))} in place ({n.target}): a replay works on a "
                        "copy of it")
    updates = set(_updates(gm)) | _computed_keys(gm, _updates(gm), counts, scalar_inputs)
    for n in gm.graph.nodes:
        if n.op != "placeholder" or n in scalar_inputs or not n.users:
            continue
        v = _meta(n)
        if isinstance(v, torch.Tensor) and v.device.type != device:
            return f"{label(n)} is on {v.device} (a CUDA graph replays {device} work only)"
    for ph in scalar_inputs:
        others = [u for u in ph.users if u not in updates]
        if others:
            return f"the step reads the optimizer value {ph.name} outside its update (by {others[0].target})"
    return None


def use_scalar_table(gm: fx.GraphModule, plan_of: dict, scaled_rows: Optional[set] = None,
                     round_rows: Optional[dict] = None, q8_rows: Optional[dict] = None,
                     counts: frozenset = frozenset()) -> tuple:
    """Rewrite every update of ``gm`` to read its scalars from one row of a new last placeholder
    ``forge_scalar_table`` (fp32 [rows, width]). ``plan_of`` maps each scalar-state, tensor-state and
    hyper-parameter placeholder to its optimizer plan. Call only when ``graph_replay_blocker`` returned None.
    Returns ``(plans, width)``: row r of the table belongs to plan ``plans[r]`` (plans whose parameter is
    updated in this graph, in graph order). A fused update that clips (last hyper-parameter
    ``forge::host_scalar(coef)``) reads its row with the coefficient written into ``grad_scale``'s column on the
    device; its row's number goes into ``scaled_rows``, whose rows the caller fills for ``grad_scaled_rule(plan's
    rule)`` with a placeholder grad_scale. A rounded update's row maps to its salt in ``round_rows``: the caller
    writes that row's element key after its scalars (``fill_table``). An 8-bit update's row maps to (salt, whether
    its weight is bf16) in ``q8_rows``: the caller writes its keys after its scalars (wgrad_update_q8.row_keys) and
    advances the ``counts`` (the graph's advances and key computations are dropped here)."""
    graph = gm.graph
    updates = _updates(gm)
    dropped = _computed_keys(gm, updates, counts, set(plan_of))
    plan_rows: dict = {}
    for n in updates:
        states, hparams = _states_hparams(n)
        keys = [h for h in hparams if h in plan_of] + [s for s in states if s in plan_of]
        if not keys:
            raise RuntimeError(f"forge: no optimizer plan for the update of {n.args[0]}")
        plan_rows.setdefault(plan_of[keys[0]], len(plan_rows))
    width = table_width({get_rule(_rule_of(n)) for n in updates},
                        {get_rule(_rule_of(n)) for n in updates if round_args(n) is not None},
                        {get_rule(_rule_of(n)) for n in updates if n.target in _Q8_OPS})
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        table = graph.placeholder("forge_scalar_table")
    fake = next((v for v in map(_meta, placeholders) if isinstance(v, torch.Tensor)), None)
    if fake is not None:
        # the table's fake value, for passes and Inductor that read node.meta["val"]
        table.meta["val"] = fake.new_empty((len(plan_rows), width), dtype=torch.float32)
    for n in updates:
        rule = get_rule(_rule_of(n))
        states, hparams = _states_hparams(n)
        key = ([h for h in hparams if h in plan_of] + [s for s in states if s in plan_of])[0]
        row = plan_rows[plan_of[key]]
        tensor_states = split_states(rule, states)[0] if n.target not in _Q8_OPS else None
        scale = _device_scale(n)
        if (rounding := round_args(n)) is not None and round_rows is not None:
            round_rows[row] = rounding[1]
        with graph.inserting_before(n):
            sel = graph.call_function(aten.select.int, (table, 0, row))
            if fake is not None:
                sel.meta["val"] = table.meta["val"][row]
            if scale is not None:
                if scale.target is aten.full.default and _meta(scale) is not None and fake is not None \
                        and _meta(scale).device != fake.device:
                    # a constant factor (data parallel's 1/world) made on the host for unreplayed launches
                    scale = graph.call_function(aten.full.default, tuple(scale.args),
                                                dict(scale.kwargs, device=fake.device))
                sel = graph.call_function(aten.select_scatter.default, (sel, scale, 0, grad_scale_column(rule)))
                if fake is not None:
                    sel.meta["val"] = table.meta["val"][row].clone()
                if scaled_rows is not None:
                    scaled_rows.add(row)
            # the rounded ops: the table op on their bf16 weight rounds with the row's key (no key, no salt)
            if n.target in _Q8_OPS:
                new = _q8_table_op(graph, n, sel, rule)
                if q8_rows is not None:
                    p = _meta(n.args[0])
                    q8_rows[row] = (_q8_key(n)[1], p is not None and p.dtype == torch.bfloat16)
            elif n.target in (_FUSED, _FUSED_R):
                w, dy_t, x = n.args[:3]
                kw = dict(n.kwargs)
                if n.target is _FUSED_R:
                    kw.update(zip(("emb_grad_output", "emb_indices", "emb_padding_idx"), n.args[8:]))
                new = graph.call_function(torch.ops.forge.wgrad_update_table_.default,
                                          (w, dy_t, x, tensor_states, sel, rule.name), kw)
                new.meta["forge"] = "wgrad_update"
            elif n.target in (_EMBEDDING, _EMBEDDING_R):
                w, grad_output, indices = n.args[:3]
                new = graph.call_function(torch.ops.forge.embedding_update_table_.default,
                                          (w, grad_output, indices, tensor_states, sel, rule.name, n.args[6]))
                new.meta["forge"] = "embedding_update"
            else:
                p, g = n.args[:2]
                new = graph.call_function(torch.ops.forge.rule_update_.default,
                                          (p, g, tensor_states, sel, rule.name))
        new.meta["val"] = None
        counters["unfused" if n.target in (_APPLY, _APPLY_Q8) else "fused"] += 1
        counters["rounded"] += rounding is not None
        counters["q8"] += n.target in _Q8_OPS
        graph.erase_node(n)
    for n in reversed(list(graph.nodes)):    # the keys' computations and the counts' advances: the runtime's now
        if n in dropped and not n.users:
            graph.erase_node(n)
    for n in list(graph.nodes):     # the coefficients' host copies: every reader now takes the device value
        if n.target is _HOST_SCALAR and not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return list(plan_rows), width


def _q8_table_op(graph, n, sel, rule):
    """The ``*_q8_table_`` op of an 8-bit update ``n``, reading its scalars and keys from the row ``sel``."""
    i = _q8_first(n)
    codes, scales = n.args[i], n.args[i + 1]
    if n.target is _Q8:
        w, dy_t, x = n.args[:3]
        grad = n.args[10] if len(n.args) > 10 else n.kwargs.get("grad")
        new = graph.call_function(torch.ops.forge.wgrad_update_q8_table_.default,
                                  (w, dy_t, x, codes, scales, sel, rule.name), {"grad": grad} if grad is not None else {})
        new.meta["forge"] = "wgrad_update"
    elif n.target is _EMBEDDING_Q8:
        w, grad_output, indices = n.args[:3]
        pad = n.args[10] if len(n.args) > 10 else n.kwargs.get("padding_idx", -1)
        new = graph.call_function(torch.ops.forge.embedding_update_q8_table_.default,
                                  (w, grad_output, indices, codes, scales, sel, rule.name, pad))
        new.meta["forge"] = "embedding_update"
    else:
        p, g = n.args[:2]
        new = graph.call_function(torch.ops.forge.apply_rule_q8_table_.default, (p, g, codes, scales, sel, rule.name))
    return new


def row_key_words(rule, key: int, row: int, q8_rows: dict, round_rows: dict) -> tuple:
    """What a ``fill_table`` item of table row ``row`` carries after its hyper-parameters, from the update's round
    ``key``: an 8-bit update's key words (``q8_rows[row]`` = (salt, bf16 weight): wgrad_update_q8.row_keys), a
    rounded update's element key (``round_rows[row]`` = salt), or nothing. Both routes' table fillers."""
    if row in q8_rows:
        return (row_keys(rule, key, *q8_rows[row]),)
    if row in round_rows:
        return (element_key(key, round_rows[row]),)
    return ()


def fill_table(table: torch.Tensor, items) -> None:
    """Write one call's scalars into ``table`` (fp32 [rows, width] on the device) and advance the scalar states.
    ``items``: per row ``(rule, states, hparams)`` or ``(rule, states, hparams, ekey)``, the states in the rule's
    order (a tensor state may be None: only the scalar ones are read) -- the values are ``rule_scalars``',
    bitwise what the host passes a normal launch; the scalar states advance as a normal launch advances them;
    ``ekey`` (a rounded update's element key, or None) goes into the word after the scalars
    (stochastic_round.table_row); a list of keys (an 8-bit update's, wgrad_update_q8.row_keys) into the words
    after the scalars, in order."""
    width = table.shape[1]
    target = "cuda" if table.is_cuda else "interpret"     # the kernels' scalars differ by target (division)
    rows, keys = [], []
    for r, (rule, states, hparams, *ekey) in enumerate(items):
        scalar_states = split_states(rule, states)[1]
        values, new = rule_scalars(rule, scalar_states, hparams, target)
        rows.append(list(values) + [0.0] * (width - len(values)))
        if ekey and ekey[0] is not None:
            words = ekey[0] if isinstance(ekey[0], (list, tuple)) else [ekey[0]]
            keys += [(r, len(values) + j, int(k)) for j, k in enumerate(words)]
        for s, v in zip(scalar_states, new):
            s.fill_(v)
    # one tensor for the whole table (this runs before every replay: ~100 rows); the keys written as their int32
    # bit patterns afterwards, as stochastic_round.table_row does for one row
    host = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), width)
    if keys:
        r, c, k = zip(*keys)
        host.view(torch.int32)[list(r), list(c)] = torch.tensor(k, dtype=torch.int32)
    if table.is_cuda:
        # pinned + non_blocking: stream-ordered before the replay, no host wait; the caching host allocator keeps
        # the pinned block until the copy has run
        table.copy_(host.pin_memory(), non_blocking=True)
    else:
        table.copy_(host)
