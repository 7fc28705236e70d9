"""The Dynamo route: ``torch.compile(model, backend="forge", options={"optimizer": opt})``.

``loss.backward()`` then updates every fused linear weight inside the compiled backward (their
``.grad`` stays None, dW never exists) and ``opt.step()`` updates the rest (torch.optim skips
parameters whose gradient is None).

How (AOTAutograd + Inductor, ``compile_fx`` with our own ``inner_compile``):
- forward graph: remember which saved outputs are views of a parameter (e.g. ``permute(primals_4)``,
  or the primal itself), before Inductor touches the graph;
- backward graph: backward output ``i`` is the gradient of forward input ``i``. For each output that
  is the gradient of an optimizer-owned parameter, add placeholders for the parameter, its states and
  its hyper-parameters, route every saved view of W through the W placeholder (otherwise Inductor sees
  two unrelated inputs and may read W after updating it), insert ``forge::apply_rule_`` and make the
  gradient output None, then run the FORGE pass (``rewrite_wgrad_updates``). Unfused parameters get
  their gradient output back. Each fused op is finally written functionally
  (``auto_functionalized`` + ``copy_`` back into the inputs at the end), the form Inductor expects
  after functionalization; its reinplace pass turns it back into the in-place op;
- runtime: the compiled backward is wrapped (boxed convention) to append the current parameters,
  their ``optimizer.state`` tensors (torch.optim format) and fresh 0-dim hyper-parameter tensors read
  from ``param_groups`` (schedulers work without recompiling).

Semantics that change because the update happens inside backward, and what the runtime does:
- a fused backward is only correct when it sees the parameter's WHOLE gradient for the step. Each
  compiled training forward counts as pending until its backward runs; a backward whose fused
  parameters can still get another contribution before ``opt.step()`` (the model called twice in one
  step, a graph whose forward ran again, another pending graph sharing the weight, an earlier unfused
  backward this step, a ``.grad`` already set) runs the UNFUSED variant of its backward instead (the
  original graph through plain Inductor, compiled on first need): gradients go to ``.grad`` and
  ``opt.step()`` updates them, exactly as eager. ``opt.step()`` clears every count (a forward whose
  backward never ran, e.g. evaluation with grad enabled, costs at most one unfused step);
- a second backward over fused parameters that an earlier backward already updated in place, before
  ``opt.step()`` (gradient accumulation), raises before touching them;
- ``clip_grad_norm_`` / ``clip_grad_value_`` / GradScaler unscaling over a weight already updated this step
  raise (``_guard_gradient_readers``), after its update; gradient hooks on a fused weight make its backward run
  unfused; under a data-parallel wrapper (DDP, FSDP) nothing is fused, as its hooks must all-reduce every
  gradient before the update; cannot be detected: gradient logging from ``.grad`` never sees fused gradients
  (``.grad`` is None).
"""
from __future__ import annotations

import contextlib
import collections
import dataclasses
import functools
import logging
import operator
import re
import threading
import weakref

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import _compat
from .dump import dump_dir as _dump_dir, write_dump
from .graph_printer import format_graph
from .kernels.stochastic_round import element_key, round_key
from .kernels.wgrad_update import triton_on_cpu
from .passes.scalar_table import fill_table, row_key_words, use_scalar_table
from .optim.state_cache import ParamStates, StateCache
from .optim.translate import (flush_step_mirrors, hparam_values, is_8bit_optimizer, plan_optimizer,
                              prepare_states)
from .passes.wgrad_update_group import group_note, group_updates_enabled, group_wgrad_updates
from .passes.wgrad_update_pattern import _VIEW_OPS, fp32_activation_note, rewrite_wgrad_updates
from .report import FusionReport

log = logging.getLogger(__name__)
aten = torch.ops.aten

__all__ = ["forge_backend", "last_report", "last_reports", "clear_reports", "last_graphs", "counters",
           "set_round_calls"]

_NOTE_SEMANTICS = (
    "fused weights are updated inside loss.backward(): their .grad stays None, so clip_grad_norm_ and "
    "GradScaler unscaling over them raise (after their update), gradient logging from .grad does not see them "
    "(nothing is fused under DDP/FSDP), and a second backward before optimizer.step() (gradient accumulation) "
    "raises; a backward that may not see a weight's whole gradient (model called twice per step, a gradient hook "
    "on it) runs unfused"
)

# fused_backward / unfused_backward: backward calls by variant; unfused_compiles: lazy compiles of the
# unfused variant; eager_fallback: unfused variants that Inductor could not compile (run eagerly).
counters: "collections.Counter" = collections.Counter()

_REPORTS: list = []
_REPORTS_LOCK = threading.Lock()
_MAX_REPORTS = 64


_GRAPHS: list = []


@dataclasses.dataclass(frozen=True)
class BackwardGraphs:
    """The printed backward graph of one compile: as AOTAutograd produced it, as handed to Inductor,
    and ``roles``: only what forge did, with inputs named by role (version-stable; tests snapshot it)."""
    captured: str
    rewritten: str
    roles: str


def _record(report: FusionReport, graphs: BackwardGraphs) -> None:
    with _REPORTS_LOCK:
        _REPORTS.append(report)
        del _REPORTS[:-_MAX_REPORTS]
        _GRAPHS.append(graphs)
        del _GRAPHS[:-_MAX_REPORTS]


def last_graphs() -> list:
    """``BackwardGraphs`` of the backward graphs compiled by the forge backend, oldest first."""
    with _REPORTS_LOCK:
        return list(_GRAPHS)


def last_reports() -> list:
    """The FusionReports of the backward graphs compiled by the forge backend, oldest first."""
    with _REPORTS_LOCK:
        return list(_REPORTS)


def last_report():
    """The most recent backward graph's FusionReport (None before any compile)."""
    with _REPORTS_LOCK:
        return _REPORTS[-1] if _REPORTS else None


def clear_reports() -> None:
    with _REPORTS_LOCK:
        _REPORTS.clear()
        _GRAPHS.clear()


# -- what happened since the last optimizer.step() ---------------------------------------------------

class _StepTracker:
    """Per optimizer, reset by every ``step()``:
    - ``updated``: parameters a fused backward updated in place (id -> name);
    - ``deferred``: parameters whose gradient an unfused backward left in ``.grad`` (every later
      backward over them must leave its contribution there too, for ``step()`` to see the sum);
    - ``comps``: the compiled graphs, each with ``pending`` = forwards whose backward has not run."""

    def __init__(self):
        self.updated: dict = {}
        self.deferred: set = set()
        self.comps: "weakref.WeakSet" = weakref.WeakSet()
        self.hooked = WeakIdKeyDictionary()     # fused parameters with the late-gradient check
        # optimizer.step() calls seen: the stochastic-rounding key's counter (round_key(seed, steps)), so every
        # backward of one step rounds with the same key, salted per parameter, and the next step with a new one
        self.steps = 0


def _late_gradient_hook(tracker: _StepTracker, name: str):
    """``.grad`` of a weight that a fused backward already updated this step gets a contribution
    (eager code reading the weight outside the compiled graph, a graph forge did not see pending):
    the update used a partial gradient and opt.step() would apply the rest separately. Too late to
    undo; raise so that it is not silent."""
    def hook(p):
        # AccumulateGrad also runs (and calls this) when the gradient it got is None
        if p.grad is not None and id(p) in tracker.updated:
            raise RuntimeError(
                f"forge: {name} received a gradient in .grad after forge had already updated it inside "
                "this step's backward with the gradient of the compiled graph alone (the weight is also "
                "used outside the compiled model, e.g. an eager regularizer or a tied weight). This "
                "step's update of it is wrong. Compute every use of a fused weight inside the compiled "
                "model, or compile without options={'optimizer': ...}.")
    hook._forge_internal = True     # not a user's gradient hook (_compat.gradient_hooks)
    return hook


_TRACKERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _after_any_step(opt, args, kwargs):
    t = _TRACKERS.get(opt)
    if t is not None:
        t.steps += 1
        t.updated.clear()
        t.deferred.clear()
        for c in t.comps:
            c.pending = 0


# A global hook (not opt.register_step_post_hook): it does not show up in the optimizer's own hooks, which the
# translation warns about; marked so that compile_train_step, which refuses a user's step hooks, skips it.
_after_any_step._forge_internal = True
_STEP_HOOK = register_optimizer_step_post_hook(_after_any_step)


# -- stochastic rounding of the bf16 parameters no fused update took --------------------------------------------
# Under options stochastic_rounding, opt.step() would update every bf16 parameter left with a .grad (norms, biases,
# embeddings, and fused weights whose backward ran unfused) in torch.optim's bf16 arithmetic, round to nearest: an
# update below half a bf16 ulp lost. A global pre-step hook updates them first as compile_train_step does -- the
# rule on fp32 copies, the parameter stored rounded stochastically with the step's key and its salt -- and clears
# their .grad, so torch.optim skips them. Compiled by torch.compile (an eager decomposition of AdamW over a
# 32000x2048 embedding is ~25 full passes; compiled, one), shapes dynamic after the first recompile.
_SR_OPTIMIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # optimizer -> (seed, [(plan, salt)])
_ROUNDED_UPDATE = []


def _rounded_update(param, grad, states, hparams, ekey, rule: str):
    from .optim.rule import get_rule

    get_rule(rule).apply_rounded(param, grad, states, hparams, ekey)


def _round_before_step(opt, args, kwargs):
    entry = _SR_OPTIMIZERS.get(opt)
    if entry is None:
        return
    seed, plans = entry
    todo = [(pl, salt) for pl, salt in plans if pl.param.grad is not None and pl.param.grad.layout == torch.strided]
    sparse = [salt for pl, salt in plans if pl.param.grad is not None and pl.param.grad.layout != torch.strided]
    if sparse:
        # the spec rounds a dense update; a sparse one stays torch.optim's (round to nearest): said, not silent
        counters["round_sparse_left"] += len(sparse)
        if new := [s for s in sparse if (id(opt), s) not in _SPARSE_WARNED]:
            _SPARSE_WARNED.update((id(opt), s) for s in new)
            log.warning("forge: stochastic_rounding: the bf16 parameter(s) %s of the optimizer (index in its "
                        "param_groups) got a sparse gradient; torch.optim updates them with round-to-nearest", new)
    if not todo:
        return
    if not _ROUNDED_UPDATE:
        _ROUNDED_UPDATE.append(torch.compile(_rounded_update, fullgraph=True))
    key = round_key(seed, _tracker(opt).steps)
    with torch.no_grad():
        for pl, salt in todo:
            p = pl.param
            states = prepare_states(opt, pl)
            hps = [torch.tensor(v, dtype=torch.float64) for v in hparam_values(opt, pl)]
            ekey = torch.tensor(element_key(key, salt), dtype=torch.int64)
            _ROUNDED_UPDATE[0](p, p.grad, states, hps, ekey, pl.rule.name)
            p.grad = None     # torch.optim skips a parameter without a gradient
    flush_step_mirrors()
    counters["rounded_before_step"] += len(todo)


_round_before_step._forge_internal = True
_SPARSE_WARNED: set = set()
_PRE_STEP_HOOK = register_optimizer_step_pre_hook(_round_before_step)


def set_round_calls(optimizer, calls: int) -> None:
    """stochastic_rounding: the count of ``optimizer.step()`` calls the next step's key is made from (it counts from
    0 in each process): a run resumed at step ``calls`` sets it to draw the bits the uninterrupted run would have
    (compile_train_step's ``round_calls`` attribute, for this route)."""
    _tracker(optimizer).steps = int(calls)


def _tracker(opt) -> _StepTracker:
    t = _TRACKERS.get(opt)
    if t is None:
        t = _TRACKERS[opt] = _StepTracker()
        _guard_gradient_readers()
    return t


# -- gradient readers outside the graph: clip_grad_norm_, clip_grad_value_, GradScaler.unscale_ --------------
# They read .grad, which a fused weight never gets: clipping and unscaling skipped those weights silently, after
# their update had used the raw (unclipped, still scaled) gradient. Once this route is in use, the public entry
# points are wrapped to raise when handed a weight forge has already updated in this step -- after the damage (the
# update ran inside backward), but not silent. Code that bound the function before (``from torch.nn.utils import
# clip_grad_norm_`` ahead of the first forge compile) keeps the unwrapped one.
_GUARDED = False


def _updated_in_step(params) -> list:
    names = []
    for t in list(_TRACKERS.values()):
        if t.updated:
            names += [t.updated[id(p)] for p in params if id(p) in t.updated]
    return names


def _refuse_after_fused_update(what: str, params) -> None:
    names = _updated_in_step(params)
    if names:
        raise RuntimeError(
            f"forge: {what} reads the gradients of {len(names)} weight(s) ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}) whose update the forge backend already applied inside "
            "loss.backward() with the raw gradient (it never makes their .grad): that update is not what "
            f"{what} asks for. Compile without options={{'optimizer': ...}} (plain Inductor), or use "
            "forge.compile_train_step, which keeps the step exact (the weights it clips or unscales unfused).")


def _guard_gradient_readers() -> None:
    global _GUARDED
    if _GUARDED:
        return
    _GUARDED = True
    import torch.nn.utils as nn_utils
    from torch.nn.utils import clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        orig = getattr(clip_grad, name)

        @functools.wraps(orig)
        def guarded(parameters, *args, _orig=orig, _name=name, **kwargs):
            if _any_updates():
                parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                _refuse_after_fused_update(f"torch.nn.utils.{_name}", parameters)
            return _orig(parameters, *args, **kwargs)

        guarded._forge_guarded = orig
        setattr(clip_grad, name, guarded)
        if getattr(nn_utils, name, None) is orig:
            setattr(nn_utils, name, guarded)
    scaler = torch.amp.GradScaler
    orig_unscale = scaler.unscale_

    @functools.wraps(orig_unscale)
    def unscale_(self, optimizer):
        if _any_updates():
            _refuse_after_fused_update("GradScaler.unscale_ (GradScaler.step)",
                                       [p for g in optimizer.param_groups for p in g["params"]])
        return orig_unscale(self, optimizer)

    unscale_._forge_guarded = orig_unscale
    scaler.unscale_ = unscale_


def _any_updates() -> bool:
    return any(t.updated for t in list(_TRACKERS.values()))


# -- helpers -----------------------------------------------------------------------------------------

def _param_name(node: fx.Node, fallback: str) -> str:
    """``L['self']._modules['fc1']._parameters['weight']`` -> ``fc1.weight``."""
    src = None
    ga = node.meta.get("grapharg") if node is not None else None
    if ga is not None and getattr(ga, "source", None) is not None:
        try:
            src = ga.source.name() if callable(ga.source.name) else ga.source.name
        except Exception:  # pragma: no cover - defensive
            src = None
    if not src:
        return fallback
    parts = re.findall(r"\['([^']+)'\]|\.([A-Za-z_][A-Za-z0-9_]*)", src)
    names = [a or b for a, b in parts]
    if any(n in ("_modules", "_parameters", "_buffers") for n in names) and len(names) > 1:
        names = names[1:]          # the root module's local name (self / fn)
    names = [n for n in names if n not in ("_modules", "_parameters", "_buffers")]
    return ".".join(names) or fallback


def _view_chain(node: fx.Node):
    """If ``node`` is a (chain of) view(s) of a placeholder: (placeholder, [view nodes, inner first])."""
    chain = []
    cur = node
    while cur.op != "placeholder":
        if cur.op != "call_function" or cur.target not in _VIEW_OPS or not cur.args \
                or not isinstance(cur.args[0], fx.Node):
            return None, None
        chain.append(cur)
        cur = cur.args[0]
    return cur, chain[::-1]


@dataclasses.dataclass
class _ForwardInfo:
    n_primals: int
    saved_views: dict         # forward node name -> (primal index, [(target, args[1:], kwargs)])
    code: str


def _analyze_forward(gm: fx.GraphModule) -> _ForwardInfo:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    # the primals (one per Dynamo input) come first; RNG states AOTAutograd appends for the backward's recompute
    # of checkpointed random ops are not Dynamo inputs (counting them left every such graph unfused)
    n_primals = sum(not _compat.is_rng_state_placeholder(n) for n in placeholders)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    views = {}
    for o in torch.utils._pytree.tree_leaves(out.args[0]):
        if not isinstance(o, fx.Node):
            continue
        base, chain = _view_chain(o)
        if base is None:
            continue
        views[o.name] = (index[base], [(v.target, tuple(v.args[1:]), dict(v.kwargs)) for v in chain])
    return _ForwardInfo(n_primals, views, format_graph(gm))


class _Entry(ParamStates):
    __slots__ = ("plan", "with_states", "param")

    def __init__(self, plan, with_states):
        super().__init__(plan)
        self.plan, self.with_states = plan, with_states
        self.param = plan.param.detach()      # shares storage and version counter with the parameter

    def current_param(self) -> torch.Tensor:
        """The parameter as the fused op writes it. The detached alias shares the parameter's storage as of its
        making: a new storage under the same Parameter (``p.data = t``, vector_to_parameters) would leave the
        update writing the old one while the model reads the new (silently wrong), so it is made again then. (The
        alias keeps the old storage alive until then, so a new storage cannot take its address.)"""
        if self.param.data_ptr() != self.plan.param.data_ptr():
            self.param = self.plan.param.detach()
        return self.param


class _Extras:
    """What the runtime appends to the backward's inputs, per fused parameter: the parameter, its
    ``opt.state`` tensors (torch.optim format) and its hyper-parameters as 0-dim float64 tensors.

    This runs at every backward, so it is kept cheap: the states and hyper-parameters come from a
    ``StateCache`` (optim/state_cache.py: ``prepare_states``/``hparam_values`` only in the first two
    backwards of a parameter, when its state objects changed, and once per group when a scheduler
    changed its values). Nothing reads a device tensor."""

    def __init__(self, opt, entries, table=None, seed=None, key_input=False, own_keys=False):
        self.opt = opt
        # ``own_keys``: a Rule8bitOptimizer's parameter takes its rounding key after its hyper-parameters,
        # round_key(its group's seed, its count: ``step``, else ``q8_count``, which advances after the update) --
        # with a table, in its row instead (table_q8: row -> (salt, bf16 weight) of the 8-bit updates)
        self.own_keys = own_keys
        self.table_q8 = {}
        # stochastic rounding (``seed``): with ``key_input`` a 0-dim int64 key tensor appended last, filled before
        # each backward; with a table the rounded rows hold their element keys instead (table_rounds: row -> salt)
        self.seed = seed
        self.key = torch.zeros((), dtype=torch.int64) if key_input else None
        self.table_rounds = {}
        self.entries = [_Entry(pl, with_states) for pl, with_states in entries]
        self._items = [(e.plan, e) for e in self.entries if e.with_states]
        self.cache = StateCache()
        # scalar_table: ``table`` = (the fused plans in row order, its width); the entries of those rows and the
        # table itself (fp32 on the parameters' device)
        self.table_rows = self.table = None
        if table is not None:
            plans, width, self.table_rounds, self.table_q8 = table
            by_plan = {id(e.plan): e for e in self.entries}
            self.table_rows = [by_plan[id(pl)] for pl in plans]
            self.table = torch.zeros((len(plans), width), dtype=torch.float32, device=plans[0].param.device)

    def tensors(self):
        self.cache.refresh(self.opt, self._items)
        out = []
        for e in self.entries:
            out.append(e.current_param())
            if e.with_states and self.table is not None:
                out.extend(e.plan.table_tensor_states(e.states))
            elif e.with_states:
                out.extend(e.states)
                out.extend(e.hparams.tensors)
                if self.own_keys:
                    out.append(self._own_key(e))
        if self.table is not None:
            # the scalars as a normal launch would get them; the scalar states advance here
            fill_table(self.table, self._table_items())
            out.append(self.table)
        if self.key is not None:
            self.key.fill_(round_key(self.seed, _tracker(self.opt).steps))
            out.append(self.key)
        return out


    def _own_key(self, e) -> torch.Tensor:
        return torch.tensor(e.plan.own_round_key(self.opt, e.states), dtype=torch.int64)

    def _table_items(self) -> list:
        """fill_table's rows: each fused plan's rule, scalar states (in the rule's order), hyper-parameters and round
        keys -- stochastic_rounding's step key, or a Rule8bitOptimizer parameter's own (read before its count
        advances: after the backward, ``after_update``)."""
        rounds, q8 = self.table_rounds, self.table_q8
        key = round_key(self.seed, _tracker(self.opt).steps) if rounds and not self.own_keys else None
        items = []
        for r, e in enumerate(self.table_rows):
            k = e.plan.own_round_key(self.opt, e.states) if self.own_keys and (r in q8 or r in rounds) else key
            items.append((e.rule, e.plan.rule_scalar_states(e.states), e.hparams.tensors,
                          *row_key_words(e.rule, k, r, q8, rounds)))
        return items

    def after_update(self) -> None:
        """A fused backward ran: the ``q8_count`` of each such parameter advances, as its eager step does."""
        if self.own_keys:
            for e in self.entries:
                if e.with_states and "q8_count" in e.plan.state_names:
                    e.states[e.plan.state_names.index("q8_count")] += 1


def _peek_states(opt, pl):
    """The states and hyper-parameters ``pl`` would get now, leaving ``opt.state`` as it was: an
    unfused parameter's first ``opt.step()`` must create its own state (SGD's buffer = grad)."""
    had = pl.param in opt.state
    before = dict(opt.state[pl.param]) if had else None
    try:
        states = [s.clone() for s in prepare_states(opt, pl)]
        hps = [torch.tensor(v, dtype=torch.float64) for v in hparam_values(opt, pl)]
    finally:
        if had:
            opt.state[pl.param].clear()
            opt.state[pl.param].update(before)
        else:
            opt.state.pop(pl.param, None)
    return states, hps


def _auto_functionalize(graph: fx.Graph, n: fx.Node, kwargs: dict, mutated: list, fake_mode, af_op) -> list:
    """``n`` (a forge update op) replaced by ``auto_functionalized(op, **kwargs)``; ``mutated``: (output index,
    the input it replaces: one node or a list of them) per mutable argument. Returns the (input, new value) pairs
    to copy back at the end of the graph."""
    op = n.target
    val_kwargs = torch.utils._pytree.tree_map_only(fx.Node, lambda a: a.meta["val"], kwargs)
    with fake_mode:
        val = af_op(op, **val_kwargs)
    copies = []
    with graph.inserting_before(n):
        af = graph.call_function(af_op, (op,), kwargs)
        af.meta["val"] = val
        af.meta["forge"] = "wgrad_update"
        for idx, inputs in mutated:
            if isinstance(inputs, fx.Node):
                new = graph.call_function(operator.getitem, (af, idx))
                new.meta["val"] = val[idx]
                copies.append((inputs, new))
                continue
            if not inputs:
                continue
            lst = graph.call_function(operator.getitem, (af, idx))
            lst.meta["val"] = val[idx]
            for i, t in enumerate(inputs):
                g = graph.call_function(operator.getitem, (lst, i))
                g.meta["val"] = val[idx][i]
                copies.append((t, g))
    graph.erase_node(n)
    return copies


def _fake(fake_mode, t):
    return fake_mode.from_tensor(t, static_shapes=True)


def _functionalize_fused(gm: fx.GraphModule, fake_mode) -> None:
    """Rewrite each raw fused op (``forge::wgrad_update_`` and its table / rounded / grouped forms, an embedding's
    ``embedding_update_*``) into ``auto_functionalized`` + ``copy_`` into its inputs at the end of the graph (what
    Inductor expects after functionalization)."""
    graph = gm.graph
    af_op = _compat.auto_functionalized()
    out_node = next(n for n in graph.nodes if n.op == "output")
    copies = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _FUSED_OPS:
            continue
        # every argument by its schema name, defaults included: auto_functionalized looks every mutable argument up
        # (the cast copies, which the Dynamo route never passes: its forward is another graph, nothing there could
        # read them); a tied embedding's rows come as kwargs (emb_*)
        kwargs = {}
        for i, arg in enumerate(_compat.op_schema(n.target).arguments):
            v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name, arg.default_value)
            kwargs[arg.name] = list(v) if isinstance(v, (list, tuple)) else v
        if n.target in _Q8_OPS:
            # weight, codes, scales, scalar states: outputs 1-4 of auto_functionalized
            copies += _auto_functionalize(graph, n, kwargs, [(1, n.args[0]), (2, list(n.args[3])),
                                                             (3, list(n.args[4])), (4, list(n.args[5]))],
                                          fake_mode, af_op)
            continue
        # each op mutates its weight(s) first and its states second (outputs 1 and 2 of auto_functionalized)
        weight, states = n.args[0], list(n.args[3])
        weight = list(weight) if isinstance(weight, (list, tuple)) else weight
        copies += _auto_functionalize(graph, n, kwargs, [(1, weight), (2, states)], fake_mode, af_op)
    with graph.inserting_before(out_node):
        for dst, src in copies:
            c = graph.call_function(aten.copy_.default, (dst, src))
            c.meta["val"] = dst.meta["val"]
    graph.lint()
    gm.recompile()


_ROUNDED = torch.ops.forge.wgrad_update_rounded_.default
_Q8 = torch.ops.forge.wgrad_update_q8_.default
# the 8-bit updates: weight, codes, scales and scalar states at the same argument positions
_Q8_OPS = (_Q8, torch.ops.forge.embedding_update_q8_.default)
# an embedding's fused update: with hyper-parameters, from a scalar table, rounded stochastically
_EMBEDDING_OPS = (torch.ops.forge.embedding_update_.default, torch.ops.forge.embedding_update_table_.default,
                  torch.ops.forge.embedding_update_rounded_.default)
# every op the pass (and the table and grouping passes) may leave in a backward: functionalized alike
_FUSED_OPS = (torch.ops.forge.wgrad_update_.default, torch.ops.forge.wgrad_update_table_.default, _ROUNDED,
              torch.ops.forge.wgrad_update_group_.default, torch.ops.forge.wgrad_update_group_table_.default,
              *_EMBEDDING_OPS, *_Q8_OPS)


def _rounding_note(cands, unfused) -> str | None:
    """stochastic_rounding: which bf16 parameters of this backward round stochastically, and which do not."""
    bf16 = [(i, pl) for i, pl in cands if pl.param.dtype == torch.bfloat16]
    if not bf16:
        return None
    fused = sum(i not in unfused for i, _ in bf16)
    note = (f"stochastic_rounding: {fused} of this backward's {len(bf16)} bf16 parameters are updated by fused "
            "updates in fp32 from the fp32 dW and stored rounded stochastically")
    if fused < len(bf16):
        note += (f"; the other {len(bf16) - fused} are updated in fp32 and rounded stochastically by forge at "
                 "optimizer.step() from their .grad (a pre-step hook; torch.optim then skips them)")
    return note


# -- the backend -------------------------------------------------------------------------------------

class _Compilation:
    """State shared by the forward and backward compiles of one Dynamo graph."""

    def __init__(self, dynamo_gm, example_inputs, optimizer, fuse, dump_dir, inductor_options=None,
                 scalar_table=False, decline=None, sr_seed=None):
        self.optimizer = optimizer
        self.sr_seed = sr_seed          # stochastic_rounding's seed, or None
        self.decline = decline          # why nothing may be fused (a data-parallel wrapper), or None
        self.scalar_table = scalar_table
        self.inductor_options = dict(inductor_options or {})   # for the unfused variant, compiled later
        self.fuse = fuse and decline is None
        self.dump_dir = dump_dir
        # ids only: holding the example inputs would keep the first batch alive with the compiled code
        self.input_ids = [id(e) for e in example_inputs]
        placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
        self.names = [(_param_name(placeholders[i], f"input{i}") if i < len(placeholders) else f"input{i}")
                      for i in range(len(self.input_ids))]
        self.plans = {}
        self.salts = {}     # stochastic rounding: a parameter's index in the optimizer salts its bits (as route 1's)
        # a Rule8bitOptimizer (AdamW8bit): each update's rounding key is round_key(its group's seed, its own count),
        # appended per parameter at every backward (_Extras) -- with a scalar table, written into its row; its bf16
        # parameters round with those keys, never with stochastic_rounding's
        self.q8 = optimizer is not None and is_8bit_optimizer(optimizer)
        if self.q8:
            if sr_seed is not None:
                log.info("forge backend: stochastic_rounding does not apply to %s: it rounds its bf16 parameters "
                         "with its own keys", type(optimizer).__name__)
            self.sr_seed = sr_seed = None
        if optimizer is not None:
            for salt, pl in enumerate(plan_optimizer(optimizer)):      # raises UnsupportedOptimizerError up front
                self.plans[id(pl.param)] = pl
                self.salts[id(pl.param)] = salt
        self.forward: _ForwardInfo | None = None
        # optimizer-owned parameters among this graph's inputs, and training forwards run whose
        # backward has not (reset by opt.step()); see _wrap_backward
        self.param_ids = frozenset(i for i in self.input_ids if i in self.plans)
        self.pending = 0
        self.under_ddp = False      # the last forward ran inside a DistributedDataParallel's forward
        self.counting = optimizer is not None and fuse and bool(self.param_ids)
        if optimizer is not None and sr_seed is not None:
            bf16 = [(pl, self.salts[id(pl.param)]) for pl in self.plans.values() if pl.param.dtype == torch.bfloat16]
            if bf16:
                _tracker(optimizer)      # the step counter the keys are made from
                _SR_OPTIMIZERS[optimizer] = (sr_seed, bf16)
        if self.counting:
            _tracker(optimizer).comps.add(self)

    def inner_compile(self, gm, example_inputs, **kwargs):
        compile_fx_inner = _compat.compile_fx_inner
        if not kwargs.get("is_backward", False):
            if kwargs.get("is_inference", False):
                return compile_fx_inner(gm, example_inputs, **kwargs)
            self.forward = _analyze_forward(gm)
            directory = _dump_dir(self.dump_dir)
            if directory:
                write_dump(directory, "forward", self.forward.code, self.forward.code,
                           FusionReport([], graph="forward", notes=["the forward graph is not rewritten"]))
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
            return _wrap_forward(compiled, self) if self.counting else compiled
        return self._compile_backward(gm, example_inputs, compile_fx_inner, **kwargs)

    def _compile_backward(self, gm, example_inputs, compile_fx_inner, **kwargs):
        captured = format_graph(gm)
        fw = self.forward
        notes = []
        if self.optimizer is None:
            notes.append("nothing fused: no optimizer was given (options={'optimizer': opt})")
        elif self.decline is not None:
            notes.append(self.decline)
        elif not self.fuse:
            notes.append("fusion disabled (fuse=False)")
        elif fw is None or fw.n_primals != len(self.input_ids):
            notes.append("nothing fused: the forward's inputs do not map 1:1 to the Dynamo graph's "
                         "inputs (duplicated or tensor-subclass inputs)")
        if notes:
            report = FusionReport([], graph="backward", notes=notes)
            return self._finish(gm, example_inputs, compile_fx_inner, kwargs, captured, report, None)

        fake_mode = _compat.detect_fake_mode(example_inputs)
        original = _compat.deepcopy_graph_module(gm)     # compiled as is if a backward must run unfused
        graph = gm.graph
        out_node = next(n for n in graph.nodes if n.op == "output")
        outs = list(out_node.args[0])
        if len(outs) != fw.n_primals:
            report = FusionReport([], graph="backward", notes=[
                f"nothing fused: the backward returns {len(outs)} gradients for {fw.n_primals} inputs"])
            return self._finish(gm, example_inputs, compile_fx_inner, kwargs, captured, report, None)

        # Real tensors from here to the extras (the optimizer's states, W, the scalar table) even when AOTAutograd
        # compiles this backward eagerly under the forward's fake mode (a dynamic-shape graph): cloning a real state
        # there raised, and the backward was compiled again at its first call; fake values are made explicitly
        with _compat.outside_fake_mode():
            cands = []     # (input index, plan)
            for i, (inp_id, g) in enumerate(zip(self.input_ids, outs)):
                pl = self.plans.get(inp_id)
                if pl is not None and isinstance(g, fx.Node):
                    cands.append((i, pl))

            placeholders = [n for n in graph.nodes if n.op == "placeholder"]
            last_ph = placeholders[-1]

            def add_placeholder(name, val):
                nonlocal last_ph
                with graph.inserting_after(last_ph):
                    last_ph = graph.placeholder(name)
                last_ph.meta["val"] = _fake(fake_mode, val)
                return last_ph

            ph_of, names, key_of = {}, {}, {}
            for i, pl in cands:
                states, hps = _peek_states(self.optimizer, pl)
                w = add_placeholder(f"forge_param_{i}", pl.param.detach())
                s_nodes = [add_placeholder(f"forge_state_{i}_{k}", s) for k, s in enumerate(states)]
                h_nodes = [add_placeholder(f"forge_hparam_{i}_{k}", h) for k, h in enumerate(hps)]
                if self.q8:      # the parameter's own rounding key (_Extras.tensors)
                    key_of[i] = add_placeholder(f"forge_key_{i}", torch.zeros((), dtype=torch.int64))
                ph_of[i] = (w, s_nodes, h_nodes)
                names[w] = self.names[i]
            # stochastic rounding: one key input for the graph's bf16 weights (_Extras fills it per step)
            key_ph = None
            if self.sr_seed is not None and any(pl.param.dtype == torch.bfloat16 for _, pl in cands):
                key_ph = add_placeholder("forge_round_key", torch.zeros((), dtype=torch.int64))

            # Route the backward's saved views of each candidate W through its W placeholder.
            for ph in placeholders:
                info = fw.saved_views.get(ph.name)
                if info is None or info[0] not in ph_of or not ph.users:
                    continue
                cur = ph_of[info[0]][0]
                first = _first_user(graph, ph)
                for target, rest, kw in info[1]:
                    with graph.inserting_before(first):
                        nxt = graph.call_function(target, (cur,) + rest, kw)
                    with fake_mode:
                        nxt.meta["val"] = target(cur.meta["val"], *rest, **kw)
                    cur = nxt
                ph.replace_all_uses_with(cur)

            applies = {}
            with graph.inserting_before(out_node):
                for i, pl in cands:
                    w, s_nodes, h_nodes = ph_of[i]
                    salt = self.salts[id(pl.param)]
                    if pl.q8:
                        a = graph.call_function(torch.ops.forge.apply_rule_q8_.default,
                                                (w, outs[i], *pl.q8_inputs(s_nodes)[0], h_nodes, pl.rule.name,
                                                 key_of[i], salt))
                    else:
                        key = key_of[i] if self.q8 else key_ph
                        rounding = (key, salt) if key is not None and pl.param.dtype == torch.bfloat16 else ()
                        # (a Rule8bitOptimizer's count, q8_count, follows the rule's states)
                        a = graph.call_function(torch.ops.forge.apply_rule_.default,
                                                (w, outs[i], s_nodes[:len(pl.rule.states)], h_nodes, pl.rule.name,
                                                 *rounding))
                    applies[a] = i
            new_outs = list(outs)
            for i, _ in cands:
                new_outs[i] = None
            out_node.args = (tuple(new_outs),)
            graph.lint()

            # embeddings too: forge::embedding_update_ from the gradient rows (no dense gradient), a tied lm_head's
            # update with the embedding's rows added (wgrad_update_'s emb_* arguments)
            decisions = rewrite_wgrad_updates(gm, names, fuse=True, embeddings=True)
            fp32_note = fp32_activation_note(gm)

            # Unfused parameters: drop the update and give the gradient back to opt.step(); their states
            # and hyper-parameters are not passed; W stays an input only if a rerouted view reads it.
            unfused = set()
            for a in [n for n in graph.nodes if n.op == "call_function" and n.target in (
                    torch.ops.forge.apply_rule_.default, torch.ops.forge.apply_rule_q8_.default)]:
                i = applies[a]
                unfused.add(i)
                new_outs[i] = a.args[1]
                graph.erase_node(a)
            out_node.args = (tuple(new_outs),)
            passed = []           # (plan, with_states)
            for i, pl in cands:
                w, s_nodes, h_nodes = ph_of[i]
                if i in unfused:
                    for n in s_nodes + h_nodes + ([key_of[i]] if i in key_of else []):
                        graph.erase_node(n)
                    if w.users:
                        passed.append((pl, False, w))
                    else:
                        graph.erase_node(w)
                else:
                    passed.append((pl, True, w))
            if key_ph is not None and not key_ph.users:
                graph.erase_node(key_ph)
                key_ph = None
            rounding_note = _rounding_note(cands, unfused) if self.sr_seed is not None else None
            table, table_note, grouped_note = None, None, None
            if self.scalar_table and any(i not in unfused for i, _ in cands):
                if all(pl.param.is_cuda for i, pl in cands if i not in unfused) or triton_on_cpu():
                    table = self._use_table(gm, cands, unfused, ph_of, key_of)
                    table_note = ("scalar_table: the fused updates read their step-dependent scalars from a device "
                                  "table written before each backward (the backward can be a CUDA graph)")
                    if table[2]:
                        table_note += (f"; {len(table[2])} stochastically rounded updates read their step's random "
                                       "key from their row")
                    if table[3]:
                        table_note += (f"; {len(table[3])} updates with 8-bit states read their rounding keys from "
                                       "their row")
                    if key_ph is not None and not key_ph.users:     # the rows hold the keys now
                        graph.erase_node(key_ph)
                        key_ph = None
                else:
                    table_note = "scalar_table: not used (the fused weights are not on a CUDA device)"
            if group_updates_enabled():
                grouped_note = group_note(group_wgrad_updates(gm, names))
            _functionalize_fused(gm, fake_mode)
            graph.eliminate_dead_code()
            gm.recompile()

            extra_fakes = [n.meta["val"] for n in graph.nodes if n.op == "placeholder"][len(placeholders):]
            extras = _Extras(self.optimizer, [(pl, with_states) for pl, with_states, _ in passed], table,
                             self.sr_seed, key_input=key_ph is not None, own_keys=self.q8)
            if table is not None:
                # the appended inputs (parameters, their states, the table) keep their addresses from call to call:
                # Inductor's CUDA graphs neither copy them nor refuse the updates' in-place writes to them
                static = set(kwargs.get("static_input_idxs", ()) or ())
                kwargs = dict(kwargs, static_input_idxs=tuple(sorted(
                    static | set(range(len(placeholders), len(placeholders) + len(extra_fakes))))))
            fused_plans = [pl for i, pl in cands if i not in unfused]

        report = FusionReport(decisions, graph="backward")
        if fused_plans:
            report.notes.append(_NOTE_SEMANTICS)
        if fused_plans and fp32_note is not None:
            report.notes.append(fp32_note)
        if rounding_note is not None:
            report.notes.append(rounding_note)
        if table_note is not None:
            report.notes.append(table_note)
        if grouped_note is not None:
            report.notes.append(grouped_note)
        if decisions and not fused_plans:
            report.notes.append("no weight gradient could be fused; see the reasons above")
        if not fused_plans:
            # nothing fused: compile the graph as AOTAutograd made it (no rerouted reads, no extra inputs)
            return self._finish(original, example_inputs, compile_fx_inner, kwargs, captured, report, None,
                                _roles_text(original, len(placeholders), {}, self.names, self.plans,
                                            self.input_ids))
        roles = _roles_text(gm, len(placeholders), ph_of, self.names, self.plans, self.input_ids, key_of)
        runtime = None
        if fused_plans:
            unfused_variant = _UnfusedVariant(original, list(example_inputs), kwargs, self.inductor_options)
            fused_names = {id(pl.param): self.names[i] for i, pl in cands if i not in unfused}
            runtime = (extras, fused_names, unfused_variant)
        return self._finish(gm, list(example_inputs) + extra_fakes, compile_fx_inner, kwargs, captured,
                            report, runtime, roles)

    def _use_table(self, gm, cands, unfused, ph_of, key_of):
        """scalar_table: the fused updates read their scalars from one table placeholder appended last; returns
        (the fused plans in row order, the table's width, row -> salt of the stochastically rounded updates, whose
        rows also hold their step's element key, row -> (salt, bf16 weight) of the updates with 8-bit states, whose
        rows hold their keys). Their scalar-state, hyper-parameter and own-key placeholders go away (``key_of``
        loses the keys)."""
        index = dict(cands)
        plan_of = {n: i for i in index if i not in unfused for n in ph_of[i][1] + ph_of[i][2]}
        round_rows: dict = {}
        q8_rows: dict = {}
        rows, width = use_scalar_table(gm, plan_of, round_rows=round_rows, q8_rows=q8_rows)
        for n in plan_of:
            if not n.users:      # the scalar states and hyper-parameters: the table replaces them
                gm.graph.erase_node(n)
        for i, n in list(key_of.items()):
            if i not in unfused and not n.users:    # a Rule8bitOptimizer parameter's own key: in its row now
                gm.graph.erase_node(n)
                del key_of[i]
        return [index[i] for i in rows], width, round_rows, q8_rows

    def _finish(self, gm, example_inputs, compile_fx_inner, kwargs, captured, report, runtime, roles=None):
        directory = _dump_dir(self.dump_dir)
        rewritten = format_graph(gm)
        write_dump(directory, "backward", captured, rewritten, report)
        _record(report, BackwardGraphs(captured, rewritten, roles if roles is not None else
                                       "nothing rewritten: " + "; ".join(report.notes)))
        log.info("forge: compiled backward\n%s", report)
        _compat.drop_stale_user_visible_outputs(gm)
        _compat.reset_reinplace_counters()
        with _compat.inductor_config_for_forge():
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        missed = _compat.reinplace_missed_bytes()
        if missed:
            log.warning("forge: Inductor could not update %d bytes in place (a tensor was cloned)", missed)
            report.notes.append(f"Inductor cloned {missed} bytes it could not update in place")
        if runtime is None:
            return _wrap_plain_backward(compiled, self, _grad_ids(gm, self)) if self.counting else compiled
        extras, fused_names, unfused_variant = runtime
        return _wrap_backward(compiled, extras, fused_names, unfused_variant, self,
                              _grad_ids(gm, self), _grad_ids(unfused_variant.gm, self))


def _first_user(graph, node):
    order = {n: k for k, n in enumerate(graph.nodes)}
    return min(node.users, key=lambda u: order[u]) if node.users else node.next


def _wrap_forward(compiled, comp: "_Compilation"):
    def forge_forward(args):
        comp.pending += 1
        # a graph compiled before the model was wrapped in DDP (a warm-up or evaluation step first) runs under it
        # later: its backward must hand every gradient to DDP's all-reduce hooks, i.e. run unfused
        comp.under_ddp = _compat.active_ddp_module() is not None
        return compiled(args)

    forge_forward._boxed_call = True
    forge_forward._forge_compiled = compiled
    return forge_forward


class _UnfusedVariant:
    """The backward as AOTAutograd produced it (every gradient returned, nothing updated), compiled by
    plain Inductor the first time a backward must run unfused, inside the contexts the fused one was
    compiled in. If Inductor fails there, the graph runs eagerly (correct, slower, logged)."""

    def __init__(self, gm, example_inputs, kwargs, inductor_options=None):
        self.gm = gm
        self.example_inputs = example_inputs
        self.kwargs = dict(kwargs)
        self.inductor_options = dict(inductor_options or {})
        self.contexts = _compat.saved_compile_contexts()
        self.fn = None

    def get(self):
        if self.fn is None:
            counters["unfused_compiles"] += 1
            gm = _compat.deepcopy_graph_module(self.gm)      # post-grad passes edit the graph in place
            try:
                # the backward may run under autocast; the graph is already in its final dtypes
                with _compat.in_compile_contexts(self.contexts), torch.autocast("cpu", enabled=False), \
                        (torch.autocast("cuda", enabled=False) if torch.cuda.is_available()
                         else contextlib.nullcontext()), _compat.inductor_config_patch(self.inductor_options):
                    self.fn = _compat.compile_fx_inner(gm, self.example_inputs, **self.kwargs)
            except Exception:
                counters["eager_fallback"] += 1
                log.warning("forge: Inductor could not compile the unfused backward; running it eagerly",
                            exc_info=True)
                eager = self.gm

                def run_eager(args):
                    a = list(args)
                    args.clear()
                    with torch.no_grad():
                        return eager(*a)
                self.fn = run_eager
            self.example_inputs = None
            self.contexts = None
        return self.fn


def _grad_ids(gm, comp) -> frozenset:
    """Ids of the optimizer's parameters whose gradient this backward graph returns (to ``.grad``)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return frozenset(i for i, g in zip(comp.input_ids, out.args[0]) if g is not None and i in comp.plans)


def _wrap_plain_backward(compiled, comp: "_Compilation", grad_ids: frozenset):
    """A backward with nothing fused, of a graph using optimizer-owned parameters: it still counts
    (its forward was pending) and its gradients go to ``.grad``, so no later backward this step may
    fuse those parameters."""
    tracker = _tracker(comp.optimizer)

    def forge_plain_backward(args):
        if comp.pending:
            comp.pending -= 1
        late = grad_ids & tracker.updated.keys()
        if late:
            raise RuntimeError(
                f"forge: a backward returns gradients for {', '.join(tracker.updated[i] for i in late)}, "
                "which an earlier backward of this step already updated in place with its own gradient "
                "alone; call optimizer.step() after every backward.")
        tracker.deferred.update(grad_ids)
        return compiled(args)

    forge_plain_backward._boxed_call = True
    forge_plain_backward._forge_compiled = compiled
    return forge_plain_backward


def _wrap_backward(compiled, extras: _Extras, fused_names: dict, unfused: _UnfusedVariant,
                   comp: "_Compilation", fused_grad_ids: frozenset, unfused_grad_ids: frozenset):
    """The runtime of a fused backward. Before touching anything it decides whether this backward
    sees the whole gradient of every fused parameter for this step and writes it nowhere else (see
    the module docstring); if not, it runs the unfused variant, whose gradients ``opt.step()`` applies."""
    tracker = _tracker(comp.optimizer)
    fused_ids = frozenset(fused_names)
    fused_params = [e.plan.param for e in extras.entries if e.with_states]
    for p in fused_params:
        if p not in tracker.hooked:
            tracker.hooked[p] = p.register_post_accumulate_grad_hook(
                _late_gradient_hook(tracker, fused_names[id(p)]))
    accs = []
    warned = set()

    def not_accumulated():
        if not accs:
            with torch.enable_grad():
                accs.extend(p.view_as(p).grad_fn.next_functions[0][0] for p in fused_params)
        return [p for p, a in zip(fused_params, accs) if not _compat.will_accumulate(a)]

    def hazard():
        if comp.under_ddp:
            return ("the forward ran under DistributedDataParallel (compiled before the wrapping), whose hooks "
                    "must all-reduce these gradients before the update")
        if comp.pending:
            return ("this graph's forward ran again before this backward (the model is called more "
                    "than once per step, or a forward's backward never ran)")
        for other in tracker.comps:
            if other is not comp and other.pending and not fused_ids.isdisjoint(other.param_ids):
                return ("another compiled graph using the same weights ran forward and its backward "
                        "is still to come")
        if not tracker.deferred.isdisjoint(fused_ids):
            return "an earlier backward since optimizer.step() left gradients of these weights in .grad"
        for p in fused_params:
            if p.grad is not None:
                return ".grad of a fused weight is already set (a gradient accumulated before this backward)"
            if _compat.gradient_hooks(p):
                # a fused update makes no gradient: the hook would get None (or never run) after the weight
                # had already changed; unfused, autograd hands it the gradient and opt.step() applies the result
                return ("a fused weight has a gradient hook (Tensor.register_hook / "
                        "register_post_accumulate_grad_hook), which must see its gradient")
        return None

    def run_unfused(args, why, to_grad):
        tracker.deferred.update(to_grad)
        counters["unfused_backward"] += 1
        if why not in warned:
            warned.add(why)
            log.warning("forge: running a backward unfused (%d weight(s): %s): %s. Their gradients "
                        "are returned as without forge.", len(fused_names),
                        ", ".join(list(fused_names.values())[:4]), why)
        return unfused.get()(args)

    def forge_backward(args):
        if comp.pending:
            comp.pending -= 1
        skipped = not_accumulated()
        if skipped:
            # autograd.grad / backward(inputs=...): a gradient nobody applies must not update weights
            kept = unfused_grad_ids - {id(p) for p in skipped}
            return run_unfused(args, "this backward does not write .grad of fused weights "
                               "(torch.autograd.grad or backward(inputs=...)), so they must not be updated",
                               kept)
        if not fused_ids.isdisjoint(tracker.updated):
            again = [fused_names[i] for i in fused_names if i in tracker.updated]
            raise RuntimeError(
                f"forge: loss.backward() ran again before optimizer.step() over {len(again)} fused "
                f"weight(s) ({', '.join(again[:4])}{', ...' if len(again) > 4 else ''}) that an earlier "
                "backward ALREADY UPDATED in place (the forge backend applies their optimizer update "
                "inside backward), so this gradient cannot be accumulated; none of them was changed by "
                "this backward. Call optimizer.step() after every backward, or for gradient "
                "accumulation compile without options={'optimizer': ...} (plain Inductor).")
        why = hazard()
        if why is not None:
            return run_unfused(args, why, unfused_grad_ids)
        full = list(args)
        args.clear()
        full.extend(extras.tensors())
        out = compiled(full)
        # a fused/capturable group's device ``step`` was advanced through its CPU mirror: write it back, so
        # opt.state (checkpoints, a later unfused opt.step()) counts the steps forge took
        flush_step_mirrors()
        extras.after_update()
        tracker.updated.update(fused_names)
        tracker.deferred.update(fused_grad_ids)
        counters["fused_backward"] += 1
        return out

    forge_backward._boxed_call = True
    forge_backward._forge_compiled = compiled
    return forge_backward


def _roles_text(gm, n_inputs, ph_of, names, plans, input_ids, key_of=None) -> str:
    """What forge did to a backward graph, with inputs named by role and everything forge did not
    touch left out: the fused ops, every read of a fused weight, the write-backs and which gradients
    remain. Stable across torch versions where the full AOT graph is not."""
    roles = {}
    for k, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if k < n_inputs:
            roles[n] = "tangent" if n.name.startswith("tangent") else "saved"
    weights = {}
    for i, (w, s_nodes, h_nodes) in ph_of.items():
        plan = plans[input_ids[i]]
        rule = plan.rule
        roles[w] = names[i]
        weights[w] = names[i]
        for k, sn in enumerate(s_nodes):
            roles[sn] = plan.state_names[k]
        if key_of and i in key_of:
            roles[key_of[i]] = "round_key"
        for k, hn in enumerate(h_nodes):
            roles[hn] = rule.hparams[k]

    def base(node):
        flips = 0
        while node.op == "call_function" and node.target in _VIEW_OPS:
            if node.target in (aten.t.default, aten.transpose.int, aten.permute.default):
                flips ^= 1
            node = node.args[0]
        return node, flips

    def describe(node):
        b, flips = base(node)
        label = roles.get(b, "computed")
        return f"T({label})" if flips else label

    op = torch.ops.forge.wgrad_update_.default
    group_op = torch.ops.forge.wgrad_update_group_.default
    af = _compat.auto_functionalized()
    fused = {n.kwargs["weight"] for n in gm.graph.nodes
             if n.op == "call_function" and n.target is af and n.args and n.args[0] in (op, _ROUNDED, *_Q8_OPS,
                                                                                          *_EMBEDDING_OPS)}
    fused |= {w for n in gm.graph.nodes
              if n.op == "call_function" and n.target is af and n.args and n.args[0] is group_op
              for w in n.kwargs["weights"]}
    weights = {w: name for w, name in weights.items() if w in fused}
    lines = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is af and n.args and n.args[0] in (op, _ROUNDED):
            kw = n.kwargs
            rounded = f", round_key, salt={kw['round_salt']}" if n.args[0] is _ROUNDED else ""
            lines.append(f"{'wgrad_update_rounded_' if rounded else 'wgrad_update_'}(W={roles[kw['weight']]}, "
                         f"dy_t={describe(kw['dy_t'])}, "
                         f"x={describe(kw['x'])}, states=[{', '.join(roles[x] for x in kw['states'])}], "
                         f"hparams=[{', '.join(roles[x] for x in kw['hparams'])}], rule={kw['rule']}{rounded}"
                         f"{', emb_rows' if kw.get('emb_grad_output') is not None else ''})")
        elif n.target is af and n.args and n.args[0] in _Q8_OPS:
            kw = n.kwargs
            inputs = (f"dy_t={describe(kw['dy_t'])}, x={describe(kw['x'])}" if n.args[0] is _Q8 else
                      f"grad_output={describe(kw['grad_output'])}, indices={describe(kw['indices'])}")
            lines.append(f"{str(n.args[0]).split('.')[1]}(W={roles[kw['weight']]}, {inputs}, "
                         f"codes=[{', '.join(roles[x] for x in kw['codes'])}], "
                         f"scales=[{', '.join(roles[x] for x in kw['scales'])}], "
                         f"scalar_states=[{', '.join(roles[x] for x in kw['scalar_states'])}], "
                         f"hparams=[{', '.join(roles[x] for x in kw['hparams'])}], rule={kw['rule']}, "
                         f"round_key={roles.get(kw['round_key'], 'computed')}, salt={kw['round_salt']})")
        elif n.target is af and n.args and n.args[0] in _EMBEDDING_OPS:
            kw = n.kwargs
            last = (f"scalars={describe(kw['scalars'])}" if "scalars" in kw else
                    f"hparams=[{', '.join(roles[x] for x in kw['hparams'])}]")
            lines.append(f"{str(n.args[0]).split('.')[1]}(W={roles[kw['weight']]}, "
                         f"grad_output={describe(kw['grad_output'])}, "
                         f"indices={describe(kw['indices'])}, states=[{', '.join(roles[x] for x in kw['states'])}], "
                         f"{last}, rule={kw['rule']}, padding_idx={kw['padding_idx']}"
                         f"{', round_key, salt=' + str(kw['round_salt']) if 'round_salt' in kw else ''})")
        elif n.target is af and n.args and n.args[0] is group_op:
            kw = n.kwargs
            lines.append(f"wgrad_update_group_(W=[{', '.join(roles[w] for w in kw['weights'])}], "
                         f"dy_t=[{', '.join(describe(d) for d in kw['dys_t'])}], "
                         f"x=[{', '.join(describe(x) for x in kw['xs'])}], "
                         f"states=[{', '.join(roles[x] for x in kw['states'])}], "
                         f"hparams=[{', '.join(roles[x] for x in kw['hparams'])}], rule={kw['rule']})")
        elif n.target is aten.copy_.default:
            lines.append(f"copy_({roles.get(n.args[0], 'computed')})")
        elif n.target not in _VIEW_OPS:
            for a in n.all_input_nodes:
                b, _ = base(a)
                if b in weights:
                    lines.append(f"{_op_short(n.target)} reads {weights[b]}")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    grads = sorted(f"{names[i]}={'grad' if g is not None else 'None'}"
                   for i, g in enumerate(out.args[0]) if input_ids[i] in plans)
    lines.append("gradients: " + ", ".join(grads))
    return "\n".join(lines)


def _op_short(target) -> str:
    return str(target).split(".")[-2] if str(target).startswith("aten.") else getattr(target, "__name__", str(target))


_FORGE_OPTIONS = ("optimizer", "fuse", "dump_dir", "scalar_table", "stochastic_rounding")


def forge_backend(gm, example_inputs, options=None, **kwargs):
    """Dynamo backend ``"forge"``. Options: ``optimizer`` (a torch.optim.Optimizer over the model's
    parameters; without it this is plain Inductor), ``fuse`` (default True), ``dump_dir``, ``scalar_table``
    (the fused updates read their step-dependent scalars from a device table the runtime writes before each
    backward, instead of host arguments: what a CUDA graph of the backward needs; default: on with Inductor's
    ``triton.cudagraphs``), ``stochastic_rounding`` (True or an int seed: fused bf16 weights are updated in fp32
    from the fp32 dW and stored rounded stochastically, as compile_train_step's option; the key of a step is
    ``round_key(seed, optimizer.step() calls seen)``, each parameter salted by its index in the optimizer; bf16
    parameters left unfused are updated the same way from their .grad by a pre-step hook, then skipped by
    torch.optim); any other option is an Inductor option, as with ``torch.compile(options=...)`` for
    Inductor (``torch._inductor.list_options()``, e.g. ``cpp_wrapper``, ``max_autotune``, ``triton.cudagraphs``),
    applied to every graph forge compiles."""
    opts = dict(options or {})
    opts.update(kwargs)
    inductor_opts = {k: v for k, v in opts.items() if k not in _FORGE_OPTIONS}
    unknown = set(inductor_opts) - _compat.inductor_option_names()
    if unknown:
        raise TypeError(f"forge backend: unknown options {sorted(unknown)} (forge's: {', '.join(_FORGE_OPTIONS)}; "
                        "any other must be an Inductor option, torch._inductor.list_options())")
    table = opts.get("scalar_table", bool(inductor_opts.get("triton.cudagraphs")))
    optimizer = opts.get("optimizer")
    decline = None
    if optimizer is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if any(map(_compat.is_dtensor, params)):
            # said up front: under FSDP2 (2-rank CPU run) the backward's report listed 0 of 0 updates, no reason
            decline = ("nothing fused: the optimizer's parameters are DTensors (FSDP2's fully_shard or tensor "
                       "parallelism), which the Dynamo route does not fuse yet (forge.compile_train_step fuses "
                       "tensor-parallel weights on their shards)")
        elif (wrapper := _compat.data_parallel_wrapper(params=params)) is not None:
            # the wrapper's hooks all-reduce (reduce-scatter) each gradient after backward computes it; a fused
            # update inside the backward would apply this rank's local gradient: unfused, training is DDP's own
            decline = (f"nothing fused: the model runs under {wrapper}, whose gradient synchronisation across "
                       "ranks a fused update would bypass (the Dynamo route does not fuse under data parallelism; "
                       "forge.compile_train_step traces DistributedDataParallel's synchronisation and fuses)")
    sr = opts.get("stochastic_rounding", False)
    if sr is None or isinstance(sr, bool):
        sr_seed = 0 if sr else None
    elif isinstance(sr, int):
        sr_seed = sr
    else:
        raise TypeError(f"forge backend: stochastic_rounding takes a bool or an int seed, got {type(sr).__name__}")
    comp = _Compilation(gm, example_inputs, optimizer, bool(opts.get("fuse", True)),
                        opts.get("dump_dir"), inductor_opts, bool(table), decline=decline, sr_seed=sr_seed)
    # the embedding's backward kept whole (Inductor decomposes it into zeros + index_put, which the pass cannot
    # take): the pass fuses it as forge::embedding_update_ from its gradient rows, as compile_train_step does
    keep = (aten.embedding_dense_backward.default,) if comp.fuse and optimizer is not None else ()
    return _compat.compile_fx_with_inner(gm, example_inputs, comp.inner_compile, inductor_opts, keep_ops=keep)


_compat.register_dynamo_backend("forge", forge_backend)
