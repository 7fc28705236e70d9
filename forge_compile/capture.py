"""``forge.compile_train_step``: capture forward + backward + optimizer step as ONE graph, rewrite
each linear weight's (dW, update) pair into the fused op, compile the rest with Inductor.

How the user's ordinary step is honoured while tracing (make_fx, fake tensors, nothing real touched):
- the modules it uses get their parameters/buffers swapped for graph inputs; ``loss.backward()`` then
  traces autograd and fills ``.grad`` on those inputs, so ``clip_grad_norm_``/grad logging trace too;
- each optimizer's ``step``/``zero_grad`` are replaced for the trace by forge's functional versions:
  one opaque ``forge::apply_rule_`` per parameter, states and hyper-parameters as graph inputs.
State stays in ``optimizer.state[p]`` in torch.optim's format; hyper-parameters are 0-dim tensors that
follow ``param_groups`` at every call, so schedulers never retrace.

Every call re-derives what the step touches (modules, parameters, optimizer plans, training flags,
tensor metas: the cache key), because a user may change any of it between steps and nothing cheap
would tell; the optimizer's states and hyper-parameters come from a cache that checks, per parameter,
that they are still what ``opt.state``/``param_groups`` hold (optim/state_cache.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import traceback
import types
from collections import Counter

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from . import _compat, data_parallel, tensor_parallel
from .dump import dump_dir as _dump_dir, write_dump
from .graph_printer import format_graph
from .optim.rule import decompose_apply_rule, grad_scaled_rule
from .optim.state_cache import StateCache
from .optim.translate import (HparamTensors, discard_step_mirrors, flush_step_mirrors, hparam_values,
                              is_8bit_optimizer, plan_and_structure_key, prepare_states)
from .passes.remat_for_backward import remat_for_backward, weight_copies_kept, written_args
from .passes.scalar_table import fill_table, graph_replay_blocker, row_key_words, use_scalar_table
from .passes.weight_cast_in_update import cast_weights_in_update
from .passes.wgrad_update_group import group_note, group_updates_enabled, group_wgrad_updates
from .kernels.stochastic_round import round_key, round_key_t
from .passes.wgrad_update_pattern import fp32_activation_note, rewrite_wgrad_updates, stochastic_rounding_note
from .report import FusionReport
from .step_graph import GRAPH_DEVICE, StepGraph

log = logging.getLogger(__name__)

__all__ = ["compile_train_step", "CompiledTrainStep", "explain", "counters", "ForgeCaptureError"]

counters: Counter = Counter()


class ForgeCaptureError(RuntimeError):
    pass


def _code_names(code: types.CodeType) -> set:
    names = set(code.co_names) | set(code.co_freevars)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def discover(fn):
    """The modules and optimizers ``fn`` refers to (closure cells and globals it names)."""
    found = _referenced(fn)
    modules = {n: o for n, o in found.items() if isinstance(o, nn.Module)}
    optimizers = [o for o in found.values() if isinstance(o, torch.optim.Optimizer)]
    return _top_level(modules), optimizers


def _referenced(fn) -> dict:
    """The objects ``fn`` names: its closure cells, the globals its code reads, and ``self`` of a bound method --
    a module itself, else the modules, optimizers and grad scalers among the attributes its code (or the code of a
    method of the same object that it names) reads, as "self.NAME"."""
    fn = inspect.unwrap(fn)
    found = {}
    if fn.__closure__:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            try:
                found[name] = cell.cell_contents
            except ValueError:
                pass
    g = getattr(fn, "__globals__", {})
    for name in _code_names(fn.__code__):
        if name in g and name not in found:
            found[name] = g[name]
    owner = _method_owner(fn)
    if isinstance(owner, nn.Module):
        found["self"] = owner
    elif owner is not None:
        attrs = vars(owner)
        for name in _method_names(owner, fn.__func__)[0]:
            if isinstance(attrs.get(name), (nn.Module, torch.optim.Optimizer, torch.amp.GradScaler)):
                found.setdefault(f"self.{name}", attrs[name])
    return found


def _method_owner(fn):
    """``self`` of a bound method whose attributes a step can read by name (it has a ``__dict__``), else None."""
    owner = getattr(fn, "__self__", None)
    if owner is None or not inspect.ismethod(fn) or inspect.ismodule(owner) or isinstance(owner, type):
        return None
    return owner if isinstance(owner, nn.Module) or hasattr(owner, "__dict__") else None


def _method_names(owner, func) -> tuple[set, list]:
    """The names ``func``'s code reads (attributes among them), with those of the methods of ``owner``'s class it
    names, recursively (a step calling ``self.compute_loss(...)``); and those methods' functions."""
    names, todo, funcs = set(), [func], []
    while todo and len(funcs) < 32:
        f = todo.pop()
        if any(f is g for g in funcs):
            continue
        funcs.append(f)
        for name in _code_names(f.__code__):
            names.add(name)
            attr = inspect.getattr_static(type(owner), name, None)
            if inspect.isfunction(attr):
                todo.append(attr)
    return names, funcs[1:]


# the kwargs entry under which the tensors the step reads from its closure and globals travel as its inputs
_LIFTED = "__forge_closure_tensors__"


def _tensor_holders(fn, own_ids) -> tuple[list, list, list]:
    """Where ``fn`` -- or a function it names, recursively -- reads a tensor by name from its closure or globals, as
    ``(lifted, own, refused)``: ``lifted`` and ``own`` are lists of holders, a holder ``(cell, None, name)`` or
    ``(globals dict, name, name)``; ``own`` hold a parameter or buffer of the step's modules (``own_ids``: the trace
    reads their stand-ins there too), ``lifted`` any other tensor that does not require grad (it becomes an input of
    the step, read at every call). A tensor that requires grad is left where it is and named in ``refused`` ("name",
    or "function: name" inside a function the step names): the trace fails on it and says which (a leaf the step
    would train without an optimizer, whose .grad is eager autograd's). A bound method's object (not a module: its
    tensors are parameters and buffers) holds tensors by name too: ``(its __dict__, name, "self.name")``, for the
    attributes its code and the methods it names read."""
    lifted, own, refused, seen, held = [], [], [], set(), set()
    fn = inspect.unwrap(fn)
    owner = _method_owner(fn)
    todo = [("", fn)]
    if owner is not None and not isinstance(owner, nn.Module):
        attrs = vars(owner)
        names, methods = _method_names(owner, fn.__func__)
        for name in sorted(names):
            if isinstance(attrs.get(name), torch.Tensor):
                _sort_holder((attrs, name, f"self.{name}"), own_ids, lifted, own, refused, held, "")
        todo += [(f"{m.__name__}: ", m) for m in methods]     # their closures and globals
    while todo:
        prefix, f = todo.pop()
        f = getattr(f, "__func__", f)     # a bound method's function: its closure and globals
        if id(f) in seen or not inspect.isfunction(f) or (f.__module__ or "").split(".")[0] in ("torch",
                                                                                                "forge_compile"):
            continue      # (the libraries' own module-level tensors are constants of theirs, not the step's)
        seen.add(id(f))
        cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
        g = f.__globals__
        for name in sorted(_code_names(f.__code__)):
            if name in cells:
                holder = (cells[name], None, name)
            elif name in g:
                holder = (g, name, name)
            else:
                continue
            obj = _read_holder(holder)
            if isinstance(obj, torch.Tensor):
                _sort_holder(holder, own_ids, lifted, own, refused, held, prefix)
            elif inspect.isfunction(obj) and len(seen) < 32:
                todo.append((f"{obj.__name__}: ", obj))
    return lifted, own, refused


def _sort_holder(holder, own_ids, lifted, own, refused, held, prefix) -> None:
    # (_tensor_holders) a holder of a tensor into its list, each holder once
    if (id(holder[0]), holder[2]) in held:
        return
    held.add((id(holder[0]), holder[2]))
    obj = _read_holder(holder)
    if id(obj) in own_ids:
        own.append(holder)
    elif not obj.requires_grad:
        lifted.append(holder)
    else:
        refused.append(prefix + holder[2])


def _read_holder(holder):
    cell_or_dict, name, _ = holder
    if name is None:
        try:
            return cell_or_dict.cell_contents
        except ValueError:
            return None
    return cell_or_dict.get(name)


def _write_holder(holder, value) -> None:
    cell_or_dict, name, _ = holder
    if name is None:
        cell_or_dict.cell_contents = value
    else:
        cell_or_dict[name] = value


@contextlib.contextmanager
def _holders_set_to(holders, values):
    """The trace's stand-ins in the closure cells and globals the step reads its tensors from, the real tensors back
    after (also when the trace fails)."""
    old = [_read_holder(h) for h in holders]
    try:
        for h, v in zip(holders, values):
            _write_holder(h, v)
        yield
    finally:
        for h, v in zip(holders, old):
            _write_holder(h, v)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FORGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _failing_line(exc: BaseException) -> str:
    """' at FILE:LINE in FUNC: CODE' for the innermost frame of ``exc`` outside forge and torch's tracing
    machinery (the user's step, or the public torch code it called, e.g. an EMA update's ``bool(n_averaged ==
    0)``): the traced step's errors otherwise name only a symbolic-shape guard or a dispatcher frame."""
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        fn = os.path.abspath(f.filename)
        if fn.startswith(_FORGE_DIR) or f.filename.startswith("<"):
            continue
        if fn.startswith(_TORCH_DIR):
            parts = fn[len(_TORCH_DIR):].split(os.sep)
            if parts[0] in ("fx", "autograd", "overrides.py", "utils") and parts[-1] != "checkpoint.py" \
                    or any(p.startswith("_") for p in parts):
                continue
        return f" at {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
    return ""


def _top_level(modules: dict) -> dict:
    """Top-level modules only, each once: a submodule also named in the step is already covered by its parent, and
    a module under two names (``cm = model``), once reparametrized, showed its traced parameters to the second
    name's lookup (KeyError at capture). With one module there is nothing to drop: this runs at every step, and the
    walk is not free."""
    if len(modules) < 2:
        return modules
    subs = {id(m) for mod in modules.values() for m in list(mod.modules())[1:]}
    out, seen = {}, set(subs)
    for n, m in modules.items():
        if id(m) not in seen:
            seen.add(id(m))
            out[n] = m
    return out


def _scheduler_classes() -> list:
    """torch's LRScheduler and every subclass that defines its own ``step`` (ReduceLROnPlateau, SequentialLR, a
    user's scheduler, ...), found when asked: subclasses can be defined at any time."""
    base = torch.optim.lr_scheduler.LRScheduler
    out, todo = [base], list(base.__subclasses__())
    while todo:
        c = todo.pop()
        todo.extend(c.__subclasses__())
        if "step" in c.__dict__:
            out.append(c)
    return out


def _foreach_norm_per_tensor(tensors, ord=2, dtype=None):
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


def _foreach_mul_per_tensor_(tensors, other):
    for t in tensors:
        t.mul_(other)


# clip_grad_norm_(foreach=True) (torchtitan's) reads all gradients' norms in one _foreach_norm and scales them in one
# _foreach_mul_: traced per tensor, each gradient's norm and scaling is a node of its own, which the pattern pass
# takes into the fused update as it does for the default foreach=None (the same values: a list op per tensor)
_PER_TENSOR_FOREACH = {
    torch.ops.aten._foreach_norm.Scalar: _foreach_norm_per_tensor,
    torch.ops.aten._foreach_mul_.Tensor: _foreach_mul_per_tensor_,
}


@contextlib.contextmanager
def _no_scheduler_steps():
    """While the step is traced, an LR scheduler's ``step()`` raises. The trace runs the step's Python once, so a
    scheduler stepped inside the compiled step would advance once (at the trace), never at the calls: silently
    another learning-rate schedule. The error comes before the scheduler or any parameter changed."""
    def refuse(sched, *args, **kwargs):
        raise ForgeCaptureError(
            f"forge.compile_train_step: the step calls {type(sched).__name__}.step(); the step is traced once, so "
            "the scheduler would advance only then, not at every call. Call it after the compiled step (forge "
            "reads the learning rate from param_groups at every call).")
    patched = [(c, c.__dict__["step"]) for c in _scheduler_classes()]
    try:
        for c, _ in patched:
            c.step = refuse
        yield
    finally:
        for c, real in patched:
            c.step = real


def _hparam_write_error(what) -> ForgeCaptureError:
    return ForgeCaptureError(
        f"forge.compile_train_step: the step writes the optimizer's param_groups ({what}); the step is traced once, "
        "so the write would take effect once, not at every call. Set hyper-parameters before calling the compiled "
        "step (forge reads param_groups at every call).")


class _WatchedGroup(dict):
    """A param_group stand-in for the trace: reads as the group, refuses every write."""

    def _refuse(self, *args, **kwargs):
        raise _hparam_write_error(repr(args[0]) if args and not isinstance(args[0], dict) else "update")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = _refuse


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a is b or a == b


@contextlib.contextmanager
def _no_hparam_writes(optimizers):
    """While the step is traced, the optimizers' param_groups must not be written: the trace runs the step's
    Python once, so an lr (or any hyper-parameter) set inside the step would take effect once and stay (silently
    another schedule), while forge reads param_groups at every call. Writes through ``opt.param_groups`` raise
    (the groups are read-only stand-ins during the trace); a change made through another reference to a group is
    put back and fails the trace after it."""
    groups = [(opt, i, g, {k: v for k, v in g.items() if k != "params"})
              for opt in optimizers for i, g in enumerate(opt.param_groups)]

    def restore():
        for opt, i, g, old in groups:
            opt.param_groups[i] = g
            for k in [k for k in g if k != "params" and k not in old]:
                del g[k]
            g.update(old)
    for opt, i, g, _ in groups:
        opt.param_groups[i] = _WatchedGroup(g)
    try:
        yield
        changed = sorted({k for _, _, g, old in groups for k in (set(old) | set(g)) - {"params"}
                          if k not in old or k not in g or not _same_value(g[k], old[k])})
    finally:
        restore()       # the original group objects back (others hold them), with their values
    if changed:
        raise _hparam_write_error(", ".join(changed))


# a clipping update's grad_scale in its table row until the step writes the coefficient over it on the device
_ONE64 = torch.ones((), dtype=torch.float64)


@dataclasses.dataclass
class _Compiled:
    fn: object
    report: FusionReport
    out_spec: object
    n_user_out: int
    grad_params: list        # params whose .grad the step leaves set (outputs after the user's)
    graph: StepGraph | None = None     # cuda_graphs: the replayed step (fn's last input is ``table``)
    table: torch.Tensor | None = None  # cuda_graphs: the scalar table, row r for plan ``table_plans[r]``
    table_plans: tuple = ()
    table_scaled: frozenset = frozenset()  # rows of fused updates that clip: filled for grad_scaled_rule(rule)
    table_rounds: dict = dataclasses.field(default_factory=dict)   # row -> salt of the rounded updates' rows
    table_q8: dict = dataclasses.field(default_factory=dict)   # row -> (salt, bf16 weight) of 8-bit updates' rows
    casts: tuple = ()        # cast_weights_in_update: (parameter index, dtype) of each copy input, in input order
    grads_in: tuple = ()     # parameter indices whose incoming .grad the step reads (its last inputs)
    grads_cleared: tuple = ()    # parameter indices whose incoming .grad the step drops (zero_grad() first)
    tp_specs: tuple | None = None    # DTensor inputs: per input its spec (the graph takes local tensors)
    out_specs: tuple | None = None   # DTensor outputs: per output its spec (the graph returns local tensors)


def _tensor_meta(t):
    # torch.Size, the stride tuple and torch.device hash and compare by value: no copies, no str(); the type tells
    # a DTensor (tensor_parallel.py) from a plain tensor of its global shape
    return ("T", type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _metas(tensors) -> tuple:
    """``_tensor_meta`` of each (less the tag), inline: a few hundred tensors at every step."""
    return tuple([(type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors])


@dataclasses.dataclass
class _Walk:
    """What a call needs of the step's module tree."""
    params: list
    pnames: list
    buffers: list
    bnames: list
    training: tuple          # ``training`` of every module the walk visits, in its order


def _walk(modules) -> _Walk:
    """Parameters and buffers as ``named_parameters``/``named_buffers(remove_duplicate=False)`` list them,
    deduplicated across both and across modules, and every module's ``training``. This runs at every
    step. Three whole-tree walks, not one walk asking each module for its own members: through public
    API, a ``named_parameters(recurse=False)`` generator per module costs more than the extra walks
    (~190 us against ~90 us for 100 modules, measured)."""
    params, pnames, buffers, bnames, training = [], [], [], [], []
    seen = set()
    for mname, mod in modules.items():
        for n, p in mod.named_parameters(prefix=mname, remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p)); params.append(p); pnames.append(n)
        for n, b in mod.named_buffers(prefix=mname, remove_duplicate=False):
            if id(b) not in seen:
                seen.add(id(b)); buffers.append(b); bnames.append(n)
        training.extend(m.training for m in mod.modules())
    return _Walk(params, pnames, buffers, bnames, tuple(training))


class _OptimizerReads:
    """A compiled step's cached state reads of one optimizer (optim/state_cache.py), with the
    (plan, entry) pairs of the last call: reused while ``plan_and_structure_key`` returns the same
    plans object, i.e. while no group's parameters or rule changed."""
    __slots__ = ("cache", "plans", "items")

    def __init__(self):
        self.cache = StateCache(keyed=True)      # see __call__: a new key re-reads every state
        self.plans = None
        self.items = []


class CompiledTrainStep:
    def __init__(self, fn, *, dump_dir=None, fuse=True, models=None, optimizers=None, options=None,
                 cuda_graphs=False, recompute_weight_copies=False, cast_weights_in_update=False,
                 stochastic_rounding=False):
        functools.update_wrapper(self, fn)
        # (__get__: a method's step compiled per object, with the same options)
        self._init_kw = dict(dump_dir=dump_dir, fuse=fuse, models=models, optimizers=optimizers, options=options,
                             cuda_graphs=cuda_graphs, recompute_weight_copies=recompute_weight_copies,
                             cast_weights_in_update=cast_weights_in_update, stochastic_rounding=stochastic_rounding)
        self._attr = None       # the class attribute this step is (__set_name__), when it decorates a method
        if isinstance(stochastic_rounding, bool) or stochastic_rounding is None:
            self._sr_seed = 0 if stochastic_rounding else None
        elif isinstance(stochastic_rounding, int):
            self._sr_seed = stochastic_rounding
        else:
            raise TypeError("compile_train_step: stochastic_rounding takes a bool or an int seed, got "
                            f"{type(stochastic_rounding).__name__}")
        # the step's stochastic-rounding key: one graph input, its value set before each call (round_key)
        self._round_key = torch.zeros((), dtype=torch.int64)
        self.round_calls = 0
        if recompute_weight_copies and cast_weights_in_update:
            raise TypeError("compile_train_step: recompute_weight_copies and cast_weights_in_update exclude each "
                            "other (the first drops the weight copies from the step, the second keeps them "
                            "between steps)")
        unknown = set(options or {}) - _compat.inductor_option_names()
        if unknown:
            raise TypeError(f"compile_train_step: unknown Inductor options {sorted(unknown)} "
                            "(torch._inductor.list_options())")
        self._options = dict(options or {})
        # Inductor's own CUDA graphs would skip this graph (its per-step host scalars are CPU inputs) or, inside
        # forge's capture, nest; asking for them means asking for the step replayed as a graph: forge's
        if self._options.pop("triton.cudagraphs", False):
            cuda_graphs = True
            log.info("forge: compile_train_step: options['triton.cudagraphs'] -> cuda_graphs=True (the whole step "
                     "is captured by forge)")
        self._fn = fn
        self._dump_dir = dump_dir
        self._holders = None    # (lifted, own, refused): _tensor_holders of the step, found at its first call
        self._fuse = fuse
        self._cuda_graphs = bool(cuda_graphs)
        self._recompute_weight_copies = bool(recompute_weight_copies)
        self._cast_weights = bool(cast_weights_in_update)
        self._explicit_models = models
        self._explicit_optimizers = optimizers
        self._cache: dict = {}
        self._reads = WeakIdKeyDictionary()     # optimizer -> _OptimizerReads
        self._checked_modules = None     # ids of the modules last found free of data-parallel wrappers / GradScaler
        self._ddps: list = []            # the DistributedDataParallel wrappers the step uses (found with the above)
        self._agreement = data_parallel.ShapeAgreement()
        self._dp_gather = True           # this call's graph may all-gather across ranks (their shapes agree)
        self.compile_count = 0
        self.last_report: FusionReport | None = None

    # -- a decorated method ------------------------------------------------------------------------
    def __set_name__(self, owner, name):
        self._attr = name

    def __get__(self, obj, objtype=None):
        """``@compile_train_step`` on a method: each object gets its own compiled step of the bound method (its
        modules and optimizers are that object's), kept in the object's ``__dict__`` under the method's name, so
        later lookups find it there (as functools.cached_property does)."""
        if obj is None:
            return self
        step = CompiledTrainStep(self._fn.__get__(obj, objtype), **self._init_kw)
        if self._attr is not None and hasattr(obj, "__dict__"):
            obj.__dict__[self._attr] = step
        else:
            raise TypeError(f"forge: compile_train_step on a method of {type(obj).__name__}, an object without a "
                            "__dict__ (slots) or a step not set as a class attribute: compile the bound method "
                            "instead, step = forge.compile_train_step(obj.method)")
        return step

    # -- what the step touches -------------------------------------------------------------------
    def _targets(self):
        if self._explicit_models is not None and self._explicit_optimizers is not None:
            modules, optimizers = {}, []     # both given: nothing of discover's answer would be used
        else:
            modules, optimizers = discover(self._fn)
        if self._explicit_models is not None:
            ms = self._explicit_models
            ms = ms if isinstance(ms, (list, tuple)) else [ms]
            modules = _top_level({f"model{i}" if len(ms) > 1 else "model": m for i, m in enumerate(ms)})
        if self._explicit_optimizers is not None:
            os_ = self._explicit_optimizers
            optimizers = list(os_) if isinstance(os_, (list, tuple)) else [os_]
        if not modules:
            raise ForgeCaptureError("forge.compile_train_step: found no nn.Module used by the step; "
                                    "pass models=... explicitly")
        return modules, optimizers

    def _inputs(self, modules, optimizers):
        walk = _walk(modules)
        seen = {id(p) for p in walk.params}
        seen.update(id(b) for b in walk.buffers)
        opt_plans, skeys = [], []
        for opt in optimizers:
            plans, skey = plan_and_structure_key(opt)       # raises before any state is touched
            for pl in plans:
                if id(pl.param) not in seen:
                    raise ForgeCaptureError(
                        f"forge: the optimizer owns a parameter of shape {tuple(pl.param.shape)} that none "
                        "of the step's modules holds; pass models=... explicitly")
            opt_plans.append((opt, plans))
            skeys.append(skey)
        return walk, opt_plans, tuple(skeys)

    def _lift(self, kwargs: dict, walk) -> dict:
        """``kwargs`` with the tensors the step reads from its closure and globals (``_tensor_holders``) under
        ``_LIFTED``, read now: they are inputs of the compiled step like its arguments (a closure or global
        rebound to another tensor is followed; a new shape, dtype or layout compiles again)."""
        if self._holders is None:
            own = {id(t) for t in (*walk.params, *walk.buffers)}
            self._holders = _tensor_holders(self._fn, own)
        if not self._holders[0]:
            return kwargs
        return {**kwargs, _LIFTED: tuple(_read_holder(h) for h in self._holders[0])}

    # -- tracing ------------------------------------------------------------------------------------
    def _rounds(self, plans) -> list:
        """The round-key input of a step that rounds bf16 parameters stochastically (after the hyper-parameters),
        or nothing."""
        if self._sr_seed is None or not any(pl.param.dtype == torch.bfloat16 for _, pl in plans):
            return []
        return [self._round_key]

    def _trace(self, modules, optimizers, params, buffers, plans, states, hparams, args, kwargs, grads_in=(),
               tp_specs=None):
        """``grads_in``: positions (in ``params``) of the parameters whose ``.grad`` is set when the step is called;
        those gradients are the traced step's last inputs, so a step that zeroes gradients before its backward
        (``opt.zero_grad()`` first, the other common idiom) or one that accumulates into them traces as it runs.
        ``tp_specs``: the inputs' DTensor specs (tensor_parallel.py): the traced step takes their local tensors and
        wraps them again (states stay local: only the rule reads them); DTensor outputs leave as local tensors."""
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        n_g = len(grads_in)
        t_idx = [i for i, l in enumerate(leaves) if isinstance(l, torch.Tensor)]
        n_p, n_b = len(params), len(buffers)
        n_s = sum(len(s) for s in states)
        n_h = sum(len(h) for h in hparams)
        n_r = len(self._rounds(plans))
        out_info = {}
        fn = self._fn
        mod_items = list(modules.items())
        ddps = list(self._ddps)
        holders = self._holders or ([], [], [])

        def step(*flat):
            if tp_specs is not None:
                flat = [x if n_p + n_b <= i < n_p + n_b + n_s + n_h + n_r else tensor_parallel.wrap(x, sp)
                        for i, (x, sp) in enumerate(zip(flat, tp_specs))]
            tp = list(flat[:n_p]); tb = list(flat[n_p:n_p + n_b])
            ts_flat = flat[n_p + n_b:n_p + n_b + n_s]; th_flat = flat[n_p + n_b + n_s:n_p + n_b + n_s + n_h]
            key_t = flat[n_p + n_b + n_s + n_h] if n_r else None
            targs = list(flat[n_p + n_b + n_s + n_h + n_r:len(flat) - n_g])
            traced = {}
            for real, t in zip(params, tp):
                if real.requires_grad:
                    t.requires_grad_()
                traced[id(real)] = t
            for i, g in zip(grads_in, flat[len(flat) - n_g:]):
                tp[i].grad = g
            for real, t in zip(buffers, tb):
                traced[id(real)] = t
            ts, th, i, j = [], [], 0, 0
            for s, h in zip(states, hparams):
                ts.append(list(ts_flat[i:i + len(s)])); i += len(s)
                th.append(list(th_flat[j:j + len(h)])); j += len(h)
            by_opt = {}
            for salt, ((opt, pl), s, h) in enumerate(zip(plans, ts, th)):
                by_opt.setdefault(id(opt), []).append((pl, s, h, salt))

            def fake_step(opt, closure=None):
                if closure is not None:
                    raise ForgeCaptureError("forge: optimizer.step(closure) is not supported")
                with torch.no_grad():
                    for own, (pl, s, h, salt) in enumerate(by_opt.get(id(opt), [])):
                        t = traced[id(pl.param)]
                        if t.grad is None:
                            continue       # torch.optim skips parameters without a gradient
                        if t.grad.layout != torch.strided:
                            # Inductor compiles dense tensors only: the step failed at run time, mid-update
                            raise ForgeCaptureError(
                                f"forge: a {t.grad.layout} gradient (e.g. nn.Embedding(sparse=True)) is not supported; "
                                "use the dense gradient (sparse=False): compile_train_step fuses an embedding's update "
                                "without ever making its dense gradient")
                        if is_8bit_optimizer(opt):
                            _update_8bit(opt, pl, t, s, h, own)
                            continue
                        # a DTensor's local shard and gradient; stochastic rounding: the parameter's index in the
                        # step salts its bits (and a DTensor shard's index: tensor_parallel.round_salt)
                        param, grad, salt = tensor_parallel.shard_inputs(t, salt)
                        if key_t is not None and t.dtype == torch.bfloat16:
                            torch.ops.forge.apply_rule_(param, grad, s, h, pl.rule.name, key_t, salt)
                        else:
                            torch.ops.forge.apply_rule_(param, grad, s, h, pl.rule.name)

            def fake_zero_grad(opt, set_to_none=True):
                for group in opt.param_groups:
                    for p in group["params"]:
                        t = traced.get(id(p))
                        if t is None or t.grad is None:
                            continue
                        # A fresh zeros tensor, not grad.zero_(): the old gradient keeps no consumer.
                        t.grad = None if set_to_none else (
                            torch.zeros_like(t) if _compat.is_dtensor(t)
                            else torch.zeros(t.shape, dtype=t.dtype, device=t.device))

            l2 = list(leaves)
            for k, i_ in enumerate(t_idx):
                l2[i_] = targs[k]
            a2, k2 = pytree.tree_unflatten(l2, in_spec)
            lifted = k2.pop(_LIFTED, ())
            with contextlib.ExitStack() as stack:
                # the closure's and globals' tensors: their stand-ins where the step reads them (a parameter's,
                # buffer's from the modules' stand-ins)
                lifted_h, own_h = holders[:2]
                stand_ins = [traced.get(id(_read_holder(h))) for h in own_h]
                stack.enter_context(_holders_set_to(lifted_h, lifted))
                stack.enter_context(_holders_set_to([h for h, t in zip(own_h, stand_ins) if t is not None],
                                                    [t for t in stand_ins if t is not None]))
                for ddp in ddps:     # first: it reads the real parameters, which the next lines swap out
                    stack.enter_context(data_parallel.ddp_in_graph(ddp, traced))
                for mname, mod in mod_items:
                    sub = {}
                    for n, p in mod.named_parameters(remove_duplicate=False):
                        sub[n] = traced[id(p)]
                    for n, b in mod.named_buffers(remove_duplicate=False):
                        sub[n] = traced[id(b)]
                    stack.enter_context(_compat.reparametrize_module(mod, sub, tie_weights=True))
                for opt in optimizers:
                    stack.enter_context(_patched(opt, fake_step, fake_zero_grad))
                out = fn(*a2, **k2)
                out_leaves, out_spec = pytree.tree_flatten(out)
                out_leaves = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
                grads = [(real, traced[id(real)].grad) for real in params
                         if traced[id(real)].grad is not None]
            bad = [type(o).__name__ for o in out_leaves if not isinstance(o, torch.Tensor)]
            if bad:
                raise ForgeCaptureError(f"forge: the step must return tensors (or a pytree of them), got {bad}")
            out_info["spec"] = out_spec
            out_info["n"] = len(out_leaves)
            out_info["grad_params"] = [r for r, _ in grads]
            # incoming gradients the step drops (zero_grad() first) and never sets again: None after it, as in eager
            out_info["grads_cleared"] = tuple(i for i in grads_in if traced[id(params[i])].grad is None)
            outs = tuple(out_leaves) + tuple(g.detach() for _, g in grads)
            out_info["out_specs"] = out_specs = tensor_parallel.specs_of(outs)
            return outs if out_specs is None else tuple(tensor_parallel.to_local(outs, out_specs))

        return step, t_idx, leaves, out_info

    def _build(self, key, modules, optimizers, params, pnames, buffers, plans, states, hparams, flat,
               args, kwargs, grads_in=()):
        tp_specs = tensor_parallel.specs_of(flat)
        if tp_specs is not None:
            why = tensor_parallel.unsupported(self._ddps, self._cast_weights)
            if why:
                raise ForgeCaptureError(f"forge: compile_train_step does not support {why} yet. Nothing was changed.")
            flat = tensor_parallel.to_local(flat, tp_specs)
        step, t_idx, leaves, out_info = self._trace(modules, optimizers, params, buffers, plans, states,
                                                    hparams, args, kwargs, grads_in, tp_specs)
        try:
            with _no_scheduler_steps(), _no_hparam_writes(optimizers), _compat.inline_compiled_functions():
                gm = _compat.make_fx(step, decomposition_table=_PER_TENSOR_FOREACH, tracing_mode="fake")(*flat)
        except ForgeCaptureError:
            raise
        except Exception as e:
            if _compat.is_real_tensor_in_fake_trace(e):
                # walked again: the step's names may have been rebound since its first call
                refused = _tensor_holders(self._fn, {id(t) for t in (*params, *buffers)})[2]
                named = f" ({', '.join(sorted(set(refused)))})" if refused else ""
                raise ForgeCaptureError(
                    f"forge: the train step reads a tensor{named} that is "
                    f"neither an argument of the step nor a parameter or buffer of its modules{_failing_line(e)}. "
                    "compile_train_step captures the step once with stand-in tensors and replays the graph with the "
                    "step's arguments, the tensors its code names in its closure and globals (not ones that require "
                    "grad) and its modules' parameters and buffers; a tensor reached another way (an attribute, a "
                    "container) cannot be followed when it changes. No parameter was changed. Pass it to the step as "
                    "an argument.") from e
            raise ForgeCaptureError(
                f"forge: could not capture the train step as one graph{_failing_line(e)} ({type(e).__name__}: {e}). "
                "The step must be traceable: no .item()/float(tensor)/data-dependent Python control flow, "
                "and no lr-scheduler.step() inside it.") from e
        # an incoming gradient the step never reads (it zeroes gradients first) is no input of the compiled step
        grad_phs = [n for n in gm.graph.nodes if n.op == "placeholder"][len(flat) - len(grads_in):]
        out_info["grads_in"] = tuple(i for i, ph in zip(grads_in, grad_phs) if ph.users)
        for ph in grad_phs:
            if not ph.users:
                gm.graph.erase_node(ph)
        gm.recompile()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = {n: pnames[i] for i, n in enumerate(placeholders[:len(params)])}
        captured_code = format_graph(gm)
        decisions = rewrite_wgrad_updates(gm, names, fuse=self._fuse, dp_gather=self._dp_gather,
                                          after_copies=self._recompute_weight_copies or self._cast_weights,
                                          embeddings=True)
        report = FusionReport(decisions, graph="train_step")
        if tp_specs is not None and (n_tp := sum(sp is not None for sp in tp_specs[:len(params)])):
            report.notes.append(f"tensor parallel: {n_tp} parameters are DTensors; the step's graph runs on each "
                                "rank's local shards (the shapes above), their updates too")
        if note := fp32_activation_note(gm):
            report.notes.append(note)
        out_info["casts"] = ()
        if self._cast_weights:
            n_pre = len(flat) - len(t_idx) - len(grads_in)    # the step's tensor arguments (and gradients) come last
            first_arg = placeholders[n_pre] if n_pre < len(placeholders) else None
            casts = cast_weights_in_update(gm, names, first_arg)
            index = {ph: i for i, ph in enumerate(placeholders[:len(params)])}
            done = [c for c in casts if c.placeholder is not None]
            out_info["casts"] = tuple((index[c.weight], c.dtype) for c in done)
            report.notes.append(
                f"cast_weights_in_update: {len(done)} fused weights' low-precision copies are written by their "
                f"update ({sum(c.weight.meta['val'].numel() for c in done) * 2 / 2**20:.1f} MiB kept between "
                "steps)")
            report.notes += [f"cast_weights_in_update: {c.name} is cast by the step as usual: {c.reason}"
                             for c in casts if c.placeholder is None]
        remat_for_backward(gm, out_info["n"])
        if self._recompute_weight_copies:
            kept = weight_copies_kept(gm, out_info["n"], placeholders[:len(params)])
            report.notes.append(f"recompute_weight_copies: {kept} parameters' cast copies are still kept from the "
                                "forward for the backward" if kept else
                                "recompute_weight_copies: no parameter's cast copy is kept from the forward for "
                                "the backward")
        if not any(d.fused for d in decisions) and self._fuse and decisions:
            report.notes.append("no weight gradient could be fused; see the reasons above")
            # the whole point of the tool is off for this step: say so where a user looks, not only in the report
            weights = [d for d in decisions if not d.reason.startswith("not a matrix")]
            if weights:
                log.warning("forge: compile_train_step fused none of the step's %d weight updates (%s: %s); "
                            "last_report has every reason", len(weights), weights[0].name, weights[0].reason)
        out_info["table"] = None
        if rounding := stochastic_rounding_note(gm, decisions):
            report.notes.append(rounding)
        if self._cuda_graphs:
            out_info["table"] = self._use_table(gm, plans, states, hparams, len(params) + len(buffers), names,
                                                report, len(out_info["casts"]), self._lifted_labels(args, kwargs))
        if group_updates_enabled() and (note := group_note(group_wgrad_updates(gm, names))):
            report.notes.append(note)
        rewritten_code = format_graph(gm)
        write_dump(_dump_dir(self._dump_dir), "train_step", captured_code, rewritten_code, report)
        return gm, report, out_info

    def _lifted_labels(self, args, kwargs) -> dict:
        """{position among the step's tensor inputs: "the tensor NAME of the step's closure or globals"} of the
        lifted tensors (``_lift``: after the arguments' tensors)."""
        lifted = kwargs.get(_LIFTED, ())
        if not lifted:
            return {}
        rest = {k: v for k, v in kwargs.items() if k != _LIFTED}
        first = sum(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args, rest)))
        out, j = {}, first
        for h, v in zip(self._holders[0], lifted):
            if isinstance(v, torch.Tensor):
                out[j] = f"the tensor {h[2]} of the step's closure or globals"
                j += 1
        return out

    def _use_table(self, gm, plans, states, hparams, first_state, names, report, n_casts=0, lifted_labels=None):
        """cuda_graphs: rewrite the graph's updates to read a scalar table (passes/scalar_table.py); returns
        ``(plans, width)`` of the table, or None (the reason goes to the report) when the step cannot be
        replayed as a graph and runs as without cuda_graphs. ``n_casts``: weight-copy placeholders between the
        hyper-parameters and the step's tensor arguments (cast_weights_in_update)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        plan_of, scalar_inputs, counts = {}, set(), set()
        pos = first_state
        for i, ((_, pl), ss) in enumerate(zip(plans, states)):
            for j in range(len(ss)):
                plan_of[placeholders[pos]] = i
                # by name: a Rule8bitOptimizer's states are its codes, scales, scalar states and q8_count
                name = pl.state_names[j]
                if name in pl.rule.scalar_states or name == "q8_count":
                    scalar_inputs.add(placeholders[pos])
                if name == "q8_count":
                    counts.add(placeholders[pos])
                pos += 1
        for i, hh in enumerate(hparams):
            for _ in hh:
                plan_of[placeholders[pos]] = i
                scalar_inputs.add(placeholders[pos])
                pos += 1
        if self._rounds(plans):
            # the round key (a CPU tensor set per call): replaced by each rounded update's key word in its row
            scalar_inputs.add(placeholders[pos])
            pos += 1
        pos += n_casts
        # the placeholders after the hyper-parameters (and weight copies) are the step's tensor arguments
        labels = dict(names)
        labels.update((ph, (lifted_labels or {}).get(j, f"the step's tensor argument {j}"))
                      for j, ph in enumerate(placeholders[pos:]))
        blocker = graph_replay_blocker(gm, scalar_inputs, GRAPH_DEVICE[0], frozenset(placeholders[pos:]), labels,
                                       frozenset(counts))
        if blocker is not None:
            report.notes.append(f"cuda_graphs: the step is not replayed as a CUDA graph: {blocker}")
            log.warning("forge: cuda_graphs: the step is not replayed as a CUDA graph: %s", blocker)
            return None
        scaled_rows: set = set()
        round_rows: dict = {}
        q8_rows: dict = {}
        table_plans, width = use_scalar_table(gm, plan_of, scaled_rows, round_rows, q8_rows, frozenset(counts))
        report.notes.append(f"cuda_graphs: replayed as one CUDA graph; {len(table_plans)} updates read their "
                            "step-dependent scalars from a device table written before each replay")
        if round_rows:
            report.notes.append(f"cuda_graphs: {len(round_rows)} stochastically rounded updates read their step's "
                                "random key from their table row (new bits at every replay)")
        if q8_rows:
            report.notes.append(f"cuda_graphs: {len(q8_rows)} updates with 8-bit states read their step's rounding "
                                "keys from their table row (round_key of their own count, advanced before each "
                                "replay)")
        if scaled_rows:
            report.notes.append(f"cuda_graphs: {len(scaled_rows)} fused updates read their gradient factor "
                                "(clip_grad_norm_'s coefficient, data parallel's 1/world) from their table row, "
                                "written there on the device by the step")
        return table_plans, width, frozenset(scaled_rows), round_rows, q8_rows

    def _prepare(self):
        modules, optimizers = self._targets()
        walk, opt_plans, skeys = self._inputs(modules, optimizers)
        key = tuple(map(id, modules.values()))
        if key != self._checked_modules:     # once per set of modules: a tree walk costs ~10 us per 100 modules
            named = _referenced(self._fn).values()
            # with models= given, a DDP wrapper the step calls may not be among them: the step's own modules too
            step_modules = [*modules.values(), *(o for o in named if isinstance(o, nn.Module))]
            wrapper = _compat.data_parallel_wrapper(step_modules, walk.params, allow_ddp=True)
            ddps = _compat.ddp_wrappers(step_modules)
            if wrapper is None and (why := data_parallel.unsupported(ddps)):
                raise ForgeCaptureError(
                    "forge: compile_train_step cannot reproduce this DistributedDataParallel's gradient "
                    f"synchronisation: {why}. Nothing was changed. Remove it, or use plain torch.compile for this "
                    "model.")
            if any(isinstance(o, torch.amp.GradScaler) for o in named):
                # its unscale_ reads the real parameters' .grad, which the traced step never sets: the trace failed
                # with "No inf checks were recorded for this optimizer"
                raise ForgeCaptureError(
                    "forge: compile_train_step does not support torch.amp.GradScaler (fp16 loss scaling): its "
                    "unscaling and inf checks are host-side decisions on the gradients. Nothing was changed. Use "
                    "bf16 autocast, which needs no scaler, or train fp16 without forge.")
            if wrapper is not None:
                raise ForgeCaptureError(
                    f"forge: compile_train_step cannot train a model under {wrapper}: its gradient synchronisation "
                    "across ranks runs in autograd hooks that a compiled step never calls (the backward is part of "
                    "the step's graph), so every rank would update its weights from its own local gradient and the "
                    "replicas would drift apart silently. Nothing was changed. Of the data-parallel wrappers only "
                    "DistributedDataParallel is supported (the step's graph all-reduces, or all-gathers the fused "
                    "weights' dY and X). Use DistributedDataParallel, or plain torch.compile under this wrapper.")
            self._checked_modules = key
            self._ddps = ddps
        # checked at every call, before anything runs: a hook registered after the step compiled counts too
        for opt in optimizers:
            if _compat.optimizer_step_hooks(opt):
                raise ForgeCaptureError(
                    f"forge: compile_train_step cannot run the step hooks of {type(opt).__name__} "
                    "(register_step_pre_hook / register_step_post_hook, or global register_optimizer_step_*_hook): "
                    "opt.step() is traced into the step's graph as its updates only, so they would be skipped "
                    "silently. Nothing was changed. Do their work in the step after opt.step() (traced), remove "
                    "them, or use torch.compile(model, backend='forge', options={'optimizer': opt}), whose "
                    "opt.step() runs them.")
        hooked = [n for p, n in zip(walk.params, walk.pnames) if p.requires_grad and _compat.gradient_hooks(p)]
        if hooked:
            raise ForgeCaptureError(
                f"forge: compile_train_step cannot run the gradient hooks registered on {len(hooked)} parameter(s) "
                f"({', '.join(hooked[:4])}{', ...' if len(hooked) > 4 else ''}; Tensor.register_hook / "
                "register_post_accumulate_grad_hook): the whole step, backward included, is one compiled graph and "
                "no autograd engine calls them, so they would be skipped silently. Nothing was changed. Do what the "
                "hook does inside the step, between loss.backward() and opt.step() (e.g. p.grad.mul_(...): traced, "
                "those parameters then stay unfused), remove the hooks, or use torch.compile(model, "
                "backend='forge', options={'optimizer': opt}), which runs them (the hooked weights unfused).")
        return modules, optimizers, walk, opt_plans, skeys

    def _key(self, walk, skeys, states, leaves, spec, grads_in=()):
        leaf_key = tuple(_tensor_meta(l) if isinstance(l, torch.Tensor) else ("V", type(l), l) for l in leaves)
        return (grads_in, _metas([walk.params[i].grad for i in grads_in]) if grads_in else (),
            str(spec), leaf_key,
            tuple([id(p) for p in walk.params]), _metas(walk.params), _metas(walk.buffers),
            skeys,
            _metas([s for ss in states for s in ss]),
            walk.training,
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_grad_enabled(), self._fuse,
            tuple([_compat.ddp_synced(d) for d in self._ddps]), self._dp_gather,
        )

    # what each component of ``_key`` is, for the recompilation warning
    _KEY_PARTS = ("the parameters with a .grad set at the call", "those gradients' layouts",
                  "the arguments' structure", "the arguments' shapes, strides or dtypes (or a non-tensor argument)",
                  "the parameter objects", "the parameters' layouts", "the buffers' layouts",
                  "the optimizers' structure", "the optimizer states' layouts", "train/eval mode",
                  "CUDA autocast", "CUDA autocast dtype", "CPU autocast", "CPU autocast dtype", "grad mode", "fuse",
                  "DistributedDataParallel's no_sync()", "the ranks' argument shapes agreeing (data parallel)")

    def _recompile_reason(self, key) -> str:
        last = next(reversed(self._cache), None)
        if last is None:
            return "first compile"
        changed = [name for name, a, b in zip(self._KEY_PARTS, key, last) if a != b]
        return ", ".join(changed) or "unknown"

    def _state_and_hparams(self, opt_plans, force=False):
        """Every plan's states and hyper-parameter tensors, in plan order, through the per-optimizer
        ``StateCache`` (the slow ``prepare_states``/``hparam_values`` only where the cache cannot vouch
        for its copy; all of them with ``force``)."""
        states, hparams = [], []
        for opt, plans in opt_plans:
            r = self._reads.get(opt)
            if r is None:
                r = self._reads[opt] = _OptimizerReads()
            if r.plans is not plans:
                r.items = [(pl, r.cache.entry(pl)) for pl in plans]
                r.plans = plans
            r.cache.refresh(opt, r.items, force=force)
            for _, e in r.items:
                states.append(e.states)
                hparams.append(e.hparams.tensors)
        return states, hparams

    def __call__(self, *args, **kwargs):
        modules, optimizers, walk, opt_plans, skeys = self._prepare()
        kwargs = self._lift(kwargs, walk)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        synced = [d for d in self._ddps if _compat.ddp_synced(d)]
        # every rank's graph must issue the same collectives: all-gathers only where all ranks' shapes agree
        self._dp_gather = not (synced and self._fuse) or self._agreement(
            synced, [l for l in leaves if isinstance(l, torch.Tensor)])
        states, hparams = self._state_and_hparams(opt_plans)
        grads_in = tuple([i for i, p in enumerate(walk.params) if p.grad is not None])
        key = self._key(walk, skeys, states, leaves, spec, grads_in)
        entry = self._cache.get(key)
        if entry is None:
            # A graph is about to be traced: read every state the slow way first. prepare_states checks
            # each state against its parameter (shape, dtype, device) and normalises a stray ``step``; a
            # cached read skips that, which is exact because a cache hit means the key -- whose tensor
            # metas of parameters and states are all that check looks at -- equals the key of a graph
            # traced right after such a full read.
            states, hparams = self._state_and_hparams(opt_plans, force=True)
            key = self._key(walk, skeys, states, leaves, spec, grads_in)
            entry = self._cache.get(key)
        plans = [(opt, pl) for opt, pls in opt_plans for pl in pls]
        arg_tensors = [l for l in leaves if isinstance(l, torch.Tensor)]
        pre = ([p.detach() for p in walk.params] + [b.detach() for b in walk.buffers]
               + [s for ss in states for s in ss] + [h for hh in hparams for h in hh] + self._rounds(plans))
        if entry is None:
            gm, report, out_info = self._build(key, modules, optimizers, walk.params, walk.pnames, walk.buffers,
                                               plans, states, hparams,
                                               pre + arg_tensors + [walk.params[i].grad for i in grads_in],
                                               args, kwargs, grads_in)
            # the step reads none of the incoming gradients (it zeroes them first): the graph is the one compiled
            # for the same call without them, if there is one -- the second step of that idiom compiles nothing
            same = (self._cache.get(self._key(walk, skeys, states, leaves, spec))
                    if grads_in and not out_info["grads_in"] else None)
            if same is not None and [id(p) for p in same.grad_params] == [id(p) for p in out_info["grad_params"]]:
                entry = dataclasses.replace(same, grads_cleared=out_info["grads_cleared"], report=report)
                self._cache[key] = entry
                counters["compiles_reused"] += 1
            else:
                entry = self._compile(key, gm, report, out_info, walk, pre, arg_tensors)
        self.last_report = entry.report
        arg_tensors = [l for l in leaves if isinstance(l, torch.Tensor)] + [walk.params[i].grad for i in entry.grads_in]
        flat = pre + (weight_casts(walk.params, entry.casts) if entry.casts else []) + arg_tensors
        if entry.tp_specs is not None:
            flat = tensor_parallel.to_local(flat, entry.tp_specs)
        key = None
        if self._sr_seed is not None:
            # a new key per call (stochastic_round.round_key): the same on every data-parallel rank
            key = round_key(self._sr_seed, self.round_calls)
            self._round_key.fill_(key)
            self.round_calls += 1
        if entry.graph is None:
            outs = entry.fn(*flat)
        else:
            fill_table(entry.table, self._table_items(entry, plans, states, hparams, key))
            outs = entry.graph(flat + [entry.table])
        flush_step_mirrors()
        if entry.casts:
            note_weight_casts_current(walk.params, entry.casts)
        outs = list(outs) if entry.out_specs is None else tensor_parallel.wrap_all(outs, entry.out_specs)
        for i in entry.grads_cleared:
            walk.params[i].grad = None
        for p, g in zip(entry.grad_params, outs[entry.n_user_out:]):
            p.grad = g
        for opt in optimizers:
            _compat.mark_optimizer_stepped(opt)
        return pytree.tree_unflatten(outs[:entry.n_user_out], entry.out_spec)

    @staticmethod
    def _table_items(entry, plans, states, hparams, key) -> list:
        """fill_table's rows for one call: each row's plan's rule, states in the rule's order, hyper-parameters and
        round keys -- the step's ``key`` for a rounded update, a Rule8bitOptimizer's parameter's own
        (round_key(its group's seed, its count), read before the count advances: its eager step's); such a
        parameter's ``q8_count`` advances here (the replayed graph no longer does)."""
        rounds, q8 = entry.table_rounds, entry.table_q8
        items, advance = [], []
        for r, i in enumerate(entry.table_plans):
            opt, pl = plans[i]
            ss, hh, k = states[i], hparams[i], key
            if is_8bit_optimizer(opt):
                k = pl.own_round_key(opt, ss)
                if "q8_count" in pl.state_names:
                    advance.append(pl.q8_inputs(ss)[1])
                ss = pl.rule_scalar_states(ss)
            item = ((grad_scaled_rule(pl.rule), ss, list(hh) + [_ONE64]) if r in entry.table_scaled
                    else (pl.rule, ss, hh))
            items.append(item + row_key_words(pl.rule, k, r, q8, rounds))
        for c in advance:
            c.add_(1)
        return items

    def _compile(self, key, gm, report, out_info, walk, pre, arg_tensors):
        """Inductor-compile a built step graph into the cache entry for ``key``."""
        if self.compile_count:
            # a whole-step compile takes a minute on a real model: a step that keeps meeting new shapes (variable
            # sequence lengths) should hear about it, as Dynamo's recompilation warnings say
            log.warning("forge: compile_train_step compiles the step again (graph %d) because %s changed; every new "
                        "combination compiles a new graph (pad batches to a few fixed shapes)",
                        self.compile_count + 1, self._recompile_reason(key))
        # the graph's inputs: the weight copies go between the hyper-parameters and the tensor arguments, the
        # incoming gradients the step reads after those
        arg_tensors = arg_tensors + [walk.params[i].grad for i in out_info["grads_in"]]
        flat = pre + weight_casts(walk.params, out_info["casts"]) + arg_tensors
        tp_specs = tensor_parallel.specs_of(flat)
        if tp_specs is not None:
            flat = tensor_parallel.to_local(flat, tp_specs)
        table = None
        if out_info["table"] is None:
            gm = _decompose_remaining_updates(gm, flat)
        else:    # every update reads the table: nothing left to decompose
            table_plans, width, scaled_rows, round_rows, q8_rows = out_info["table"]
            table = torch.zeros((len(table_plans), width), dtype=torch.float32, device=walk.params[0].device)
        _compat.reset_reinplace_counters()
        # the user's Inductor options first, forge's required settings over them; buffers freed at their last
        # use where that costs no host time (a replayed graph) or memory was asked for, unless the user chose
        free = (table is not None or self._recompute_weight_copies) and "allow_buffer_reuse" not in self._options
        options = self._options
        if options.get("cpp_wrapper") and (hazards := cpu_scalars_read_on_gpu(gm)):
            options = {k: v for k, v in options.items() if k != "cpp_wrapper"}
            report.notes.append(_CPP_WRAPPER_NOTE.format(n=len(hazards)))
            log.warning("forge: %s", report.notes[-1])
            counters["cpp_wrapper_declined"] += 1
        with _compat.inductor_config_patch(options), _compat.inductor_config_for_forge(free):
            inputs = flat if table is None else flat + [table]
            if _has_collectives(gm):
                # Inductor has scheduled a kernel that reads a collective's output before its wait (stop 40): the
                # generated wrapper is checked, so that such a step stops here instead of training on stale data
                compiled, codes = _compat.inductor_output_code(_compat.compile_fx, gm, inputs)
                seen = sum(map(_compat.count_collectives, codes))
                counters["collectives_checked"] += seen
                if not seen:
                    counters["collectives_unchecked"] += 1
                    report.notes.append(
                        "the step's collectives were not found in Inductor's generated code (cpp_wrapper, or another "
                        "torch's wrapper text): the check that no kernel reads a collective's result before its "
                        "wait did not run")
                    log.warning("forge: %s", report.notes[-1])
                if hazards := [h for code in codes for h in _compat.collective_reads_before_wait(code)]:
                    counters["collective_hazards"] += 1
                    raise ForgeCaptureError(
                        "forge: Inductor compiled this step with a kernel that reads a collective's result before "
                        f"waiting for it ({hazards[0]}; {len(hazards)} such kernels): it would train on stale data. "
                        "Nothing was changed. This Inductor scheduling bug was seen on CPU over gloo with sequence "
                        "parallelism, activation checkpointing and unfused Adam updates in one step; fusing the "
                        "weights (fuse=True) or another optimizer avoided it there.")
            else:
                compiled = _compat.compile_fx(gm, inputs)
        report.notes.extend(_clone_notes())
        entry = _Compiled(compiled, report, out_info["spec"], out_info["n"], out_info["grad_params"],
                          casts=out_info["casts"], grads_in=out_info["grads_in"],
                          grads_cleared=out_info["grads_cleared"], tp_specs=tp_specs,
                          out_specs=out_info["out_specs"])
        if table is not None:
            n_static = len(flat) - len(arg_tensors)
            entry.graph = StepGraph(compiled, range(n_static, len(flat)))
            entry.table, entry.table_plans = table, tuple(table_plans)
            entry.table_scaled = scaled_rows
            entry.table_rounds = round_rows
            entry.table_q8 = q8_rows
        self._cache[key] = entry
        self.compile_count += 1
        counters["compiles"] += 1
        log.info("forge: compiled train step\n%s", report)
        return entry

    def explain(self, *args, **kwargs) -> FusionReport:
        """Capture and rewrite the step for these inputs without running it or changing any tensor."""
        modules, optimizers, walk, opt_plans, skeys = self._prepare()
        kwargs = self._lift(kwargs, walk)
        plans = [(opt, pl) for opt, pls in opt_plans for pl in pls]
        had = [(opt, pl.param, pl.param in opt.state) for opt, pl in plans]
        try:
            # the slow reads, outside the step's caches: the states created here are removed below
            states = [prepare_states(opt, pl) for opt, pl in plans]
            hparams = [HparamTensors().update(hparam_values(opt, pl)) for opt, pl in plans]
            leaves, spec = pytree.tree_flatten((args, kwargs))
            grads_in = tuple([i for i, p in enumerate(walk.params) if p.grad is not None])
            flat = ([p.detach() for p in walk.params] + [b.detach() for b in walk.buffers]
                    + [s for ss in states for s in ss] + [h for hh in hparams for h in hh] + self._rounds(plans)
                    + [l for l in leaves if isinstance(l, torch.Tensor)] + [walk.params[i].grad for i in grads_in])
            key = self._key(walk, skeys, states, leaves, spec, grads_in)
            _, report, _ = self._build(key, modules, optimizers, walk.params, walk.pnames, walk.buffers,
                                       plans, states, hparams, flat, args, kwargs, grads_in)
        finally:
            discard_step_mirrors()
            for opt, p, existed in had:
                if not existed:
                    opt.state.pop(p, None)
        return report


# cast_weights_in_update: one low-precision copy per (parameter, dtype), shared by every compiled step, with the
# parameter's version counter and a detached alias of its storage as of the copy's last write. A step's graph reads
# the copy as W.to(dtype) at the step's start and its fused update writes the new W's copy into it; anything else that
# writes the parameter (an in-place op, load_state_dict, another optimizer) moves the version, and a new storage
# (``p.data = t``, vector_to_parameters) leaves the version but not the data pointer: either makes the next call cast
# again. (The alias keeps the old storage alive until then, so a new one cannot take its address.) An in-place write
# through ``.data`` moves neither (``.data`` has its own version counter, same storage): such code must not be mixed
# with the option.
_WEIGHT_CASTS = WeakIdKeyDictionary()


def _has_collectives(gm) -> bool:
    """The step's graph issues functional collectives (data or tensor parallelism)."""
    return any(getattr(n.target, "namespace", None) == "_c10d_functional" for n in gm.graph.nodes)


def weight_casts(params, casts) -> list:
    """The copy inputs of a step: ``casts`` = (parameter index, dtype) pairs. Copies keep their storage across calls
    (a CUDA graph replays their addresses); a stale one is cast again in place."""
    out = []
    for i, dtype in casts:
        p = params[i]
        by_dtype = _WEIGHT_CASTS.get(p)
        if by_dtype is None:
            by_dtype = _WEIGHT_CASTS[p] = {}
        hit = by_dtype.get(dtype)
        if hit is None or hit[0].shape != p.shape or hit[0].device != p.device:
            with torch.no_grad():
                hit = by_dtype[dtype] = [p.detach().to(dtype, memory_format=torch.contiguous_format), p._version,
                                         p.detach()]
            counters["weight_casts_made"] += 1
        elif hit[1] != p._version or hit[2].data_ptr() != p.data_ptr():
            with torch.no_grad():
                hit[0].copy_(p.detach())
            hit[1], hit[2] = p._version, p.detach()
            counters["weight_casts_refreshed"] += 1
        out.append(hit[0])
    return out


def note_weight_casts_current(params, casts) -> None:
    """After a step: its fused updates wrote each copy from the new W, so the copy matches the parameter's version
    now (the update moved it, or -- replayed in a CUDA graph -- no Python ran and it did not move). Its storage alias
    is current already: weight_casts made it at this call's start, and a step cannot give a parameter a new storage."""
    for i, dtype in casts:
        p = params[i]
        _WEIGHT_CASTS[p][dtype][1] = p._version


def _clone_notes():
    missed = _compat.reinplace_missed_bytes()
    if missed:
        log.warning("forge: Inductor could not update %d bytes in place (a tensor was cloned)", missed)
        return [f"Inductor cloned {missed} bytes it could not update in place"]
    return []


def _update_8bit(opt, pl, t, states, hparams, salt) -> None:
    """A Rule8bitOptimizer's update of the traced parameter ``t``, as its eager ``step`` makes it (bitwise where
    unfused): the rounding key ``round_key(the group's seed, the parameter's count)`` computed in the graph from the
    count it reads (``step``, or ``q8_count``, advanced here), the 8-bit states through ``forge::apply_rule_q8_``
    (which the pattern pass fuses with the matmul of dW), full-precision ones through ``apply_rule_`` (a bf16
    parameter rounded stochastically with the same key). ``salt``: the parameter's index in its optimizer (a DTensor
    shard's: tensor_parallel.round_salt of it)."""
    inputs, count = pl.q8_inputs(states)
    key = round_key_t(int(opt.param_groups[pl.group_index]["seed"]), count)
    # a DTensor: its local shard and gradient, the shard's salt (the eager step's); its 8-bit states are local
    # already, its full-precision ones the traced local inputs
    param, grad, salt = tensor_parallel.shard_inputs(t, salt)
    if pl.q8:
        torch.ops.forge.apply_rule_q8_(param, grad, *inputs, hparams, pl.rule.name, key, salt)
    elif t.dtype == torch.bfloat16:
        torch.ops.forge.apply_rule_(param, grad, list(inputs), hparams, pl.rule.name, key, salt)
    else:
        torch.ops.forge.apply_rule_(param, grad, list(inputs), hparams, pl.rule.name)
    if "q8_count" in pl.state_names:
        count.add_(1)


@contextlib.contextmanager
def _patched(opt, step, zero_grad):
    had_step, had_zero = "step" in opt.__dict__, "zero_grad" in opt.__dict__
    old_step, old_zero = opt.__dict__.get("step"), opt.__dict__.get("zero_grad")
    opt.step = types.MethodType(step, opt)
    opt.zero_grad = types.MethodType(zero_grad, opt)
    try:
        yield
    finally:
        if had_step:
            opt.step = old_step
        else:
            del opt.step
        if had_zero:
            opt.zero_grad = old_zero
        else:
            del opt.zero_grad


# Inductor's C++ wrapper (torch 2.11, H100/H200) handed a GPU kernel the host pointer of a 0-dim CPU tensor that the
# same graph also writes -- torch.optim's CPU step counter of a CUDA parameter, which the unfused updates' bias
# corrections read (or forge's CPU mirror of a fused/capturable optimizer's device step: the same) -- where the
# Python wrapper passes its value. The kernel read host memory while the host, running
# ahead, had already advanced the counter: bias corrections of a later step, parameters 3e-3 off from step 2 on
# (benchmarks/diag_cpp_wrapper.py; NOTES_kernel.md stop 23). Such a graph is compiled with the Python wrapper.
_CPP_WRAPPER_NOTE = ("cpp_wrapper not used for this graph: GPU kernels read {n} 0-dim CPU tensor(s) the step also "
                     "updates (step counters: torch.optim's own, or forge's host mirror of a fused/capturable "
                     "optimizer's), which Inductor's C++ wrapper passes by host pointer, racing with the update "
                     "(wrong bias corrections on the GPU, torch 2.11); compiled with the Python wrapper")


def cpu_scalars_read_on_gpu(gm) -> list[str]:
    """The placeholders of ``gm`` holding a 0-dim CPU tensor that the graph writes (``copy_`` into it, or any op
    whose schema writes it) and whose value reaches a tensor on another device, through any chain of CPU values."""
    hazards = []
    for ph in gm.graph.nodes:
        if ph.op != "placeholder":
            continue
        v = ph.meta.get("val")
        if not (isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu"):
            continue
        if not any(ph in written_args(u) for u in ph.users):
            continue
        if _reaches_another_device(ph):
            hazards.append(ph.target)
    return hazards


def _reaches_another_device(node) -> bool:
    """Some value computed from ``node`` through CPU tensors only is a tensor on another device."""
    seen, todo = {node}, [node]
    while todo:
        for u in todo.pop().users:
            vals = [x for x in pytree.tree_leaves(u.meta.get("val")) if isinstance(x, torch.Tensor)]
            if any(x.device.type != "cpu" for x in vals):
                return True
            if vals and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def _decompose_remaining_updates(gm, flat):
    """Re-trace with every unfused ``apply_rule_`` expanded into the rule's element-wise ops (+copy_),
    which Inductor fuses; fused ``wgrad_update_`` nodes stay opaque."""
    table = {torch.ops.forge.apply_rule_.default: decompose_apply_rule}
    interp = torch.fx.Interpreter(gm)
    return _compat.make_fx(lambda *a: interp.run(*a), decomposition_table=table, tracing_mode="fake")(*flat)


def compile_train_step(fn=None, *, dump_dir=None, fuse=True, models=None, optimizers=None, options=None,
                       cuda_graphs=False, recompute_weight_copies=False, cast_weights_in_update=False,
                       stochastic_rounding=False):
    """Compile an ordinary train step (forward, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``)
    into one graph whose linear weight gradients are fused with their optimizer update. ``options``: Inductor
    options, as ``torch.compile(..., options=...)`` takes them (e.g. ``{"cpp_wrapper": True}``).

    ``cuda_graphs=True`` (also what ``options={"triton.cudagraphs": True}`` asks for): after two eager steps the
    step is captured once and replayed as a CUDA graph (the host then writes one table of step-dependent scalars
    per step; step_graph.py). Every optimizer update -- fused or
    not -- then runs forge's generated update kernel (bitwise eager torch.optim's math), parameters, buffers and
    states must stay the same tensors (replacing one captures again), and the batch is copied into static
    buffers. Where a step cannot be replayed (random numbers, CPU inputs, a rule without a generated kernel) it
    runs as without the option and ``last_report`` says why.

    ``recompute_weight_copies=True`` trades time for memory under autocast: the low-precision copy of each
    weight that the forward's matmul reads is cast again in the backward for dX = dY @ W (each fused update then
    runs after that matmul) instead of being kept from the forward, as torch.compile keeps it -- 2 bytes per
    parameter less at the forward/backward boundary, where the peak usually sits, for one more cast (6 bytes of
    traffic) per parameter and step. Values are identical either way.

    ``cast_weights_in_update=True`` trades memory for time under autocast: each fused update also writes its new
    weight's low-precision copy (2 bytes per parameter of stores, from the registers holding the new W), which the
    next step's forward reads instead of casting the weight again (a separate kernel reading 4 and writing 2 bytes
    per parameter). The copies stay allocated between steps (2 bytes per parameter) and replace the copies the
    step would keep from the forward for the backward. Values are identical. A copy is cast again whenever its
    parameter's version counter moved outside the step (in-place edits, ``load_state_dict``) or its storage changed
    (``param.data = t``); in-place writes through ``param.data`` move neither and would leave the copy stale: do
    not combine them with this option.
    Excludes ``recompute_weight_copies``.

    ``stochastic_rounding=True`` (or an int seed; True is seed 0) trains bf16 parameters without fp32 master
    weights: each bf16 parameter's update runs in fp32 -- on the fp32 dW for a fused weight, which never exists in
    bf16 either -- and the new value is stored rounded stochastically (up with probability equal to the discarded
    fraction), so that updates smaller than half a bf16 ulp still move the weight on average; its optimizer states
    stay in the dtype torch.optim gave them (bf16 for bf16 parameters), rounded to nearest. The random bits are a
    hash of (seed, call count, parameter index, element index): reproducible from the seed, equal on every
    data-parallel rank, independent of torch's generators (the step's ``round_calls`` is that count: a run resumed
    from a checkpoint sets it to the step it resumes at to draw the bits the uninterrupted run would have). Without
    the option bf16 parameters are updated by
    torch.optim's arithmetic as in eager (and left unfused). fp32 and fp16 parameters are not affected. With
    ``cuda_graphs`` the step is replayed like any other: each rounded update reads its element key, new at every
    call, from its row of the scalar table the host writes before each replay."""
    kw = dict(dump_dir=dump_dir, fuse=fuse, models=models, optimizers=optimizers, options=options,
              cuda_graphs=cuda_graphs, recompute_weight_copies=recompute_weight_copies,
              cast_weights_in_update=cast_weights_in_update, stochastic_rounding=stochastic_rounding)
    if fn is None:
        return lambda f: CompiledTrainStep(f, **kw)
    return CompiledTrainStep(fn, **kw)


def explain(fn, *args, **kwargs) -> FusionReport:
    """The fusion report of ``fn`` (a compiled step or a plain step function) for these inputs."""
    step = fn if isinstance(fn, CompiledTrainStep) else CompiledTrainStep(fn)
    return step.explain(*args, **kwargs)
