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

Semantics that change because the update happens inside backward:
- a second backward over fused parameters before ``opt.step()`` (gradient accumulation) raises;
- ``clip_grad_norm_``, GradScaler unscaling and DDP gradient hooks never see fused gradients.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
import re
import threading
import weakref

import torch
import torch.fx as fx
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _compat
from .dump import dump_dir as _dump_dir, write_dump
from .graph_printer import format_graph
from .kernels import wgrad_update as _register_fused_op  # noqa: F401  (registers forge::wgrad_update_)
from .optim.translate import hparam_values, plan_optimizer, prepare_states
from .passes.wgrad_update_pattern import _VIEW_OPS, rewrite_wgrad_updates
from .report import FusionReport

log = logging.getLogger(__name__)
aten = torch.ops.aten

__all__ = ["forge_backend", "last_report", "last_reports", "clear_reports"]

_NOTE_SEMANTICS = (
    "fused weights are updated inside loss.backward(): their .grad stays None, so clip_grad_norm_, "
    "GradScaler unscaling, gradient logging and DDP gradient hooks do not see them, and a second "
    "backward before optimizer.step() (gradient accumulation) raises"
)

_REPORTS: list = []
_REPORTS_LOCK = threading.Lock()
_MAX_REPORTS = 64


def _record(report: FusionReport) -> None:
    with _REPORTS_LOCK:
        _REPORTS.append(report)
        del _REPORTS[:-_MAX_REPORTS]


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


# -- "updated in backward since the last optimizer.step()" ---------------------------------------------

class _StepTracker:
    """Per optimizer: the parameters a compiled backward updated since the last ``step()``."""

    def __init__(self):
        self.updated: set = set()          # ids of parameters (the optimizer holds them alive)


_TRACKERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _after_any_step(opt, args, kwargs):
    t = _TRACKERS.get(opt)
    if t is not None:
        t.updated.clear()


# A global hook (not opt.register_step_post_hook): it does not show up in the optimizer's own hooks,
# which the translation warns about because the fused update cannot run them.
_STEP_HOOK = register_optimizer_step_post_hook(_after_any_step)


def _tracker(opt) -> _StepTracker:
    t = _TRACKERS.get(opt)
    if t is None:
        t = _TRACKERS[opt] = _StepTracker()
    return t


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
    out = next(n for n in gm.graph.nodes if n.op == "output")
    views = {}
    for o in torch.utils._pytree.tree_leaves(out.args[0]):
        if not isinstance(o, fx.Node):
            continue
        base, chain = _view_chain(o)
        if base is None:
            continue
        views[o.name] = (index[base], [(v.target, tuple(v.args[1:]), dict(v.kwargs)) for v in chain])
    return _ForwardInfo(len(placeholders), views, format_graph(gm))


class _Extras:
    """What the runtime appends to the backward's inputs, per fused parameter."""

    def __init__(self, opt, entries):
        self.opt = opt
        self.entries = entries        # [(ParamPlan, with_states)]

    def tensors(self):
        out = []
        for pl, with_states in self.entries:
            out.append(pl.param.detach())
            if with_states:
                out.extend(prepare_states(self.opt, pl))
                out.extend(torch.tensor(v, dtype=torch.float64) for v in hparam_values(self.opt, pl))
        return out


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


def _fake(fake_mode, t):
    return fake_mode.from_tensor(t, static_shapes=True)


def _functionalize_fused(gm: fx.GraphModule, fake_mode) -> None:
    """Rewrite each raw ``forge::wgrad_update_`` into ``auto_functionalized`` + ``copy_`` into its
    inputs at the end of the graph (what Inductor expects after functionalization)."""
    graph = gm.graph
    op = torch.ops.forge.wgrad_update_.default
    af_op = _compat.auto_functionalized()
    out_node = next(n for n in graph.nodes if n.op == "output")
    copies = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not op:
            continue
        weight, dy_t, x, states, hparams, rule = n.args
        kwargs = dict(weight=weight, dy_t=dy_t, x=x, states=list(states), hparams=list(hparams), rule=rule)
        val_kwargs = torch.utils._pytree.tree_map_only(fx.Node, lambda a: a.meta["val"], kwargs)
        with fake_mode:
            val = af_op(op, **val_kwargs)
        with graph.inserting_before(n):
            af = graph.call_function(af_op, (op,), kwargs)
            af.meta["val"] = val
            af.meta["forge"] = "wgrad_update"
            new_w = graph.call_function(operator.getitem, (af, 1))
            new_w.meta["val"] = val[1]
            copies.append((weight, new_w))
            if states:
                lst = graph.call_function(operator.getitem, (af, 2))
                lst.meta["val"] = val[2]
                for i, s in enumerate(states):
                    g = graph.call_function(operator.getitem, (lst, i))
                    g.meta["val"] = val[2][i]
                    copies.append((s, g))
        graph.erase_node(n)
    with graph.inserting_before(out_node):
        for dst, src in copies:
            c = graph.call_function(aten.copy_.default, (dst, src))
            c.meta["val"] = dst.meta["val"]
    graph.lint()
    gm.recompile()


# -- the backend -------------------------------------------------------------------------------------

class _Compilation:
    """State shared by the forward and backward compiles of one Dynamo graph."""

    def __init__(self, dynamo_gm, example_inputs, optimizer, fuse, dump_dir):
        self.optimizer = optimizer
        self.fuse = fuse
        self.dump_dir = dump_dir
        # ids only: holding the example inputs would keep the first batch alive with the compiled code
        self.input_ids = [id(e) for e in example_inputs]
        placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
        self.names = [(_param_name(placeholders[i], f"input{i}") if i < len(placeholders) else f"input{i}")
                      for i in range(len(self.input_ids))]
        self.plans = {}
        if optimizer is not None:
            for pl in plan_optimizer(optimizer):      # raises UnsupportedOptimizerError up front
                self.plans[id(pl.param)] = pl
        self.forward: _ForwardInfo | None = None

    def inner_compile(self, gm, example_inputs, **kwargs):
        compile_fx_inner = _compat.compile_fx_inner
        if not kwargs.get("is_backward", False):
            if not kwargs.get("is_inference", False):
                self.forward = _analyze_forward(gm)
            return compile_fx_inner(gm, example_inputs, **kwargs)
        return self._compile_backward(gm, example_inputs, compile_fx_inner, **kwargs)

    def _compile_backward(self, gm, example_inputs, compile_fx_inner, **kwargs):
        captured = format_graph(gm)
        fw = self.forward
        notes = []
        if self.optimizer is None:
            notes.append("nothing fused: no optimizer was given (options={'optimizer': opt})")
        elif not self.fuse:
            notes.append("fusion disabled (fuse=False)")
        elif fw is None or fw.n_primals != len(self.input_ids):
            notes.append("nothing fused: the forward's inputs do not map 1:1 to the Dynamo graph's "
                         "inputs (duplicated or tensor-subclass inputs)")
        if notes:
            report = FusionReport([], graph="backward", notes=notes)
            return self._finish(gm, example_inputs, compile_fx_inner, kwargs, captured, report, None)

        fake_mode = _compat.detect_fake_mode(example_inputs)
        graph = gm.graph
        out_node = next(n for n in graph.nodes if n.op == "output")
        outs = list(out_node.args[0])
        if len(outs) != fw.n_primals:
            report = FusionReport([], graph="backward", notes=[
                f"nothing fused: the backward returns {len(outs)} gradients for {fw.n_primals} inputs"])
            return self._finish(gm, example_inputs, compile_fx_inner, kwargs, captured, report, None)

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

        ph_of, names = {}, {}
        for i, pl in cands:
            states, hps = _peek_states(self.optimizer, pl)
            w = add_placeholder(f"forge_param_{i}", pl.param.detach())
            s_nodes = [add_placeholder(f"forge_state_{i}_{k}", s) for k, s in enumerate(states)]
            h_nodes = [add_placeholder(f"forge_hparam_{i}_{k}", h) for k, h in enumerate(hps)]
            ph_of[i] = (w, s_nodes, h_nodes)
            names[w] = self.names[i]

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
                a = graph.call_function(torch.ops.forge.apply_rule_.default,
                                        (w, outs[i], s_nodes, h_nodes, pl.rule.name))
                applies[a] = i
        new_outs = list(outs)
        for i, _ in cands:
            new_outs[i] = None
        out_node.args = (tuple(new_outs),)
        graph.lint()

        decisions = rewrite_wgrad_updates(gm, names, fuse=True)

        # Unfused parameters: drop the update and give the gradient back to opt.step(); their states
        # and hyper-parameters are not passed; W stays an input only if a rerouted view reads it.
        unfused = set()
        for a in [n for n in graph.nodes if n.op == "call_function"
                  and n.target is torch.ops.forge.apply_rule_.default]:
            i = applies[a]
            unfused.add(i)
            new_outs[i] = a.args[1]
            graph.erase_node(a)
        out_node.args = (tuple(new_outs),)
        passed = []           # (plan, with_states)
        for i, pl in cands:
            w, s_nodes, h_nodes = ph_of[i]
            if i in unfused:
                for n in s_nodes + h_nodes:
                    graph.erase_node(n)
                if w.users:
                    passed.append((pl, False, w))
                else:
                    graph.erase_node(w)
            else:
                passed.append((pl, True, w))
        _functionalize_fused(gm, fake_mode)
        graph.eliminate_dead_code()
        gm.recompile()

        extra_fakes = [n.meta["val"] for n in graph.nodes if n.op == "placeholder"][len(placeholders):]
        extras = _Extras(self.optimizer, [(pl, with_states) for pl, with_states, _ in passed])
        fused_plans = [pl for i, pl in cands if i not in unfused]

        report = FusionReport(decisions, graph="backward")
        if fused_plans:
            report.notes.append(_NOTE_SEMANTICS)
        elif decisions:
            report.notes.append("no weight gradient could be fused; see the reasons above")
        return self._finish(gm, list(example_inputs) + extra_fakes, compile_fx_inner, kwargs, captured,
                            report, (extras, fused_plans))

    def _finish(self, gm, example_inputs, compile_fx_inner, kwargs, captured, report, runtime):
        directory = _dump_dir(self.dump_dir)
        if directory and self.forward is not None:
            write_dump(directory, "forward", self.forward.code, self.forward.code,
                       FusionReport([], graph="forward", notes=["the forward graph is not rewritten"]))
        write_dump(directory, "backward", captured, format_graph(gm), report)
        _record(report)
        log.info("forge: compiled backward\n%s", report)
        _compat.reset_reinplace_counters()
        with _compat.inductor_config_for_forge():
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        missed = _compat.reinplace_missed_bytes()
        if missed:
            log.warning("forge: Inductor could not update %d bytes in place (a tensor was cloned)", missed)
            report.notes.append(f"Inductor cloned {missed} bytes it could not update in place")
        if runtime is None:
            return compiled
        extras, fused_plans = runtime
        return _wrap_backward(compiled, extras, fused_plans, self.optimizer)


def _first_user(graph, node):
    order = {n: k for k, n in enumerate(graph.nodes)}
    return min(node.users, key=lambda u: order[u]) if node.users else node.next


def _wrap_backward(compiled, extras: _Extras, fused_plans, optimizer):
    tracker = _tracker(optimizer)
    fused_ids = [id(pl.param) for pl in fused_plans]

    def forge_backward(args):
        again = [pl for pl in fused_plans if id(pl.param) in tracker.updated]
        if again:
            raise RuntimeError(
                "forge: a second backward over fused parameters before optimizer.step(): the forge "
                "backend updates fused weights inside loss.backward(), so gradient accumulation is not "
                f"supported ({len(again)} fused parameter(s), e.g. shape {tuple(again[0].param.shape)}). "
                "Call optimizer.step() after every backward, or compile without the optimizer option.")
        full = list(args)
        args.clear()
        full.extend(extras.tensors())
        out = compiled(full)
        tracker.updated.update(fused_ids)
        return out

    forge_backward._boxed_call = True
    forge_backward._forge_compiled = compiled
    return forge_backward


def forge_backend(gm, example_inputs, options=None, **kwargs):
    """Dynamo backend ``"forge"``. Options: ``optimizer`` (a torch.optim.Optimizer over the model's
    parameters; without it this is plain Inductor), ``fuse`` (default True), ``dump_dir``."""
    opts = dict(options or {})
    opts.update(kwargs)
    unknown = set(opts) - {"optimizer", "fuse", "dump_dir"}
    if unknown:
        raise TypeError(f"forge backend: unknown options {sorted(unknown)} "
                        "(known: optimizer, fuse, dump_dir)")
    comp = _Compilation(gm, example_inputs, opts.get("optimizer"), bool(opts.get("fuse", True)),
                        opts.get("dump_dir"))
    return _compat.compile_fx_with_inner(gm, example_inputs, comp.inner_compile)


_compat.register_dynamo_backend("forge", forge_backend)
