"""Host fast path for repeated launches of the fused wgrad+update kernels.

Why: a training step calls ``forge::wgrad_update_`` once per linear layer, and at fine-tuning batch sizes the
forge routes were host-bound (benchmarks/RESULTS.md, end to end): every launch re-checked its arguments, built up
to five TMA descriptors and went through Triton's JIT dispatch (argument binding and specialization, ~37 us per
launch on the H200 host before any of our own checks). Step after step the same layer launches with the same
weight and states, and -- in a compiled graph whose allocations repeat -- the same activation buffers. A launch
whose arguments match an earlier one exactly (data pointer, shape, strides and dtype of every tensor, the rule,
the kernel selection mode) is determined by them: the kernel, grid and argument list are the same, only the host
scalars (bias corrections, lr, ... from the step counter and hyper-parameters) change. Such a launch reuses the
compiled kernel's launcher with that argument list.

What is kept: integers (data pointers) in place of tensors, never the tensors themselves -- holding activations
would keep their memory alive -- and copies of the TMA descriptors whose ``base`` is a pointer holder (the
launcher reads only ``base.data_ptr()``, shape and strides from a descriptor). A key is remembered on its second
sighting, so launches whose buffers never repeat pay one dict lookup and no extra preparation.

Triton API used (public or documented-by-use, not private names): ``JITFunction.warmup`` (compile without
launching), ``JITFunction.arg_names``, ``CompiledKernel[grid](*args)`` (the launcher; it takes every parameter,
constexprs included, as ``JITFunction.run`` passes them). On triton 3.6 a hit goes one layer lower: straight into
the launcher's C function with the tensor descriptors encoded once (``_compat.TritonDirectLaunch``, the only place
that knows triton's launcher layout; any other layout keeps ``CompiledKernel[grid]``). Any failure building an
entry leaves that key on the full path; a failure of a remembered launch disables the fast path for the process
(logged) before anything ran.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import logging
import os
import threading
from typing import Any, Callable

import torch

from .. import _compat

log = logging.getLogger(__name__)

__all__ = ["launch_key", "lookup", "launch_remembered", "remember", "unused", "mark_unused", "counters", "clear",
           "ENABLED", "DIRECT", "LAST_ERROR"]

# On unless FORGE_LAUNCH_MEMO=0; also switched off by an unexpected launcher failure. Tests/benchmarks flip it.
ENABLED = [os.environ.get("FORGE_LAUNCH_MEMO", "1").strip() not in ("0", "false", "off", "no")]
# The C launcher entered straight on a hit (_compat.TritonDirectLaunch) unless FORGE_LAUNCH_DIRECT=0.
DIRECT = [os.environ.get("FORGE_LAUNCH_DIRECT", "1").strip() not in ("0", "false", "off", "no")]
LAST_ERROR: list = [None]   # the exception that switched the fast path off (tests, diagnostics)
_CAPACITY = 512
_LOCK = threading.Lock()
_ENTRIES: "collections.OrderedDict[tuple, _Entry]" = collections.OrderedDict()
_SEEN: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()
# keys whose launch did not use what its caller prepared before the lookup (launch_wgrad_update's K-major copies
# of fp32 activations, when the Gluon kernel refused the launch): the caller skips that preparation for them
_UNUSED: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()
counters: collections.Counter = collections.Counter()


class _Ptr:
    """Stands in for a tensor in a remembered argument list: the launcher calls ``data_ptr()`` only."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


@dataclasses.dataclass
class _Entry:
    run: Callable[..., Any]      # CompiledKernel[grid]
    head: tuple                  # arguments before the scalars
    tail: tuple                  # arguments after them
    ep: Any                      # the rule's Epilogue (host_scalars needs it); None: the kernel reads its
    #                              scalars from a device table row (one of the tensors in the key)
    scalar_idx: tuple[int, ...]  # positions of the scalar states in ``states``
    rule: Any                    # kept so that id(rule) in the key is never reused while the entry lives
    direct: Any = None           # _compat.TritonDirectLaunch: the C launcher entered straight (None: ``run``)
    dhead: tuple = ()            # ``head`` / ``tail`` as ``direct`` takes them (descriptors encoded once)
    dtail: tuple = ()
    nvar: int = 0                # arguments right after the scalars that the caller passes at every launch (the
    #                              stochastic-rounding key: new at every step)


def _tkey(t: torch.Tensor | None):
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def launch_key(kind, rule, weight, dy_t, x, states, side_out) -> tuple:
    """Everything a launch's kernel, grid and non-scalar arguments depend on (``kind`` names the kernel choice,
    e.g. the selection mode, so that changing FORGE_WGRAD_KERNEL never reuses another kernel's entry)."""
    return (kind, id(rule), weight.device.index, _tkey(weight), _tkey(dy_t), _tkey(x),
            tuple(_tkey(s) if s.dim() else None for s in states), _tkey(side_out))


def lookup(key: tuple, states, hparams, var: tuple = ()) -> bool:
    """Launch through a remembered entry and advance its scalar states; False (nothing done) when there is none.
    ``var``: the values of the entry's per-launch arguments after the scalars (``remember(nvar=...)``)."""
    done = launch_remembered(key, states, hparams, var)
    if done is None:
        return False
    # no_grad costs more than the fill itself; inside a backward (where the forge routes launch) grad is off
    with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
        for s, new in zip(*done):
            s.fill_(new)
    return True


def launch_remembered(key: tuple, states, hparams, var: tuple = ()):
    """``lookup`` without advancing the scalar states: ``(scalar states, their new values)`` for the caller to
    advance, or None (no entry: nothing done). For launches on row blocks of one weight (wgrad_update_q8's blocked
    path), whose scalars all come from the step's value before the update."""
    if not ENABLED[0]:
        return None
    entry = _ENTRIES.get(key)
    if entry is None or entry.nvar != len(var):
        counters["miss"] += 1
        return None
    if entry.ep is None:     # scalars read from a device table by the kernel: nothing to compute or advance
        scalar_states, scalars, new_scalar_states = (), (), ()
    else:
        from .wgrad_update_triton import host_scalars

        scalar_states = [states[i] for i in entry.scalar_idx]
        scalars, new_scalar_states = host_scalars(entry.ep, scalar_states, hparams)
    try:
        if var:
            scalars = (*scalars, *var)
        if entry.direct is not None and DIRECT[0] and entry.direct.usable():
            entry.direct(entry.dhead, scalars, entry.dtail)
            counters["direct"] += 1
        else:
            entry.run(*entry.head, *scalars, *entry.tail)
    except Exception as e:  # the launcher raises before launching (argument conversion): full path from now on
        ENABLED[0] = False
        LAST_ERROR[0] = e
        log.warning("forge: fast launch path failed (%s: %s); using the full launch path from now on",
                    type(e).__name__, str(e)[:300])
        return None
    counters["hit"] += 1
    return scalar_states, new_scalar_states


def _strip(a):
    # tensors -> pointer holders; descriptors (dataclasses with a tensor ``base``) -> copies with a holder base
    if isinstance(a, torch.Tensor):
        return _Ptr(a.data_ptr())
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor) and dataclasses.is_dataclass(a):
        d = copy.copy(a)
        d.base = _Ptr(base.data_ptr())
        return d
    return a


def remember(key: tuple, rule, prepare: Callable[[], tuple], ep, states, hparams, scalar_idx, nvar: int = 0) -> None:
    """After a successful full launch under ``key``: on the key's second sighting build its entry.

    ``prepare()`` returns the full path's ``(kernel, grid, args, opts, ...)`` for the same arguments (it has no
    side effects); ``ep`` None: a launch with a scalar table (no host scalars). The host scalars sit in ``args``
    as one run; they are found by identity: host_scalars returns the same list object for the same scalar-state
    and hyper-parameter values, so the list computed here is the one ``prepare()`` places (not memoized -- CUDA
    scalar states -- means not found: the key stays on the full path). ``nvar``: that many arguments right after
    the scalars change at every launch (``lookup(var=...)`` passes them; a rule without host scalars then has no
    position to find them at and stays on the full path)."""
    if not ENABLED[0] or key in _ENTRIES:
        return
    if key not in _SEEN:
        with _LOCK:
            _SEEN[key] = None
            if len(_SEEN) > 4 * _CAPACITY:
                _SEEN.popitem(last=False)
        return
    from .wgrad_update_triton import host_scalars

    try:
        scalars = host_scalars(ep, [states[i] for i in scalar_idx], hparams)[0] if ep is not None else []
        kernel, grid, args, opts = prepare()[:4]
        pos = _scalar_pos(args, scalars) if scalars or not nvar else None
        if pos is None:
            counters["unsupported"] += 1
            log.debug("forge: fast launch: scalars not found in the argument list; key left on the full path")
            return
        names = list(kernel.arg_names)
        full = list(args)
        for name in names[len(args):]:
            if name not in opts:
                counters["unsupported"] += 1
                return
            full.append(opts[name])
        compiled = kernel.warmup(*args, grid=grid, **opts)
        if hasattr(compiled, "result"):   # an asynchronous compile's future
            compiled = compiled.result()
        # CompiledKernel[grid] indexes grid[0], grid[1], grid[2] (JITFunction.run pads a shorter grid itself)
        run = compiled[tuple(grid) + (1,) * (3 - len(grid))]
    except Exception as e:  # never fatal: this key keeps the full path
        counters["unsupported"] += 1
        log.debug("forge: fast launch entry not built: %s: %s", type(e).__name__, e)
        return
    stripped = [_strip(a) for a in full]
    after = pos + len(scalars) + nvar
    entry = _Entry(run=run, head=tuple(stripped[:pos]), tail=tuple(stripped[after:]),
                   ep=ep, scalar_idx=tuple(scalar_idx), rule=rule, nvar=nvar)
    if DIRECT[0]:
        direct = _compat.TritonDirectLaunch.build(compiled, grid)
        if direct is not None:
            try:
                entry.direct, entry.dhead, entry.dtail = (
                    direct, tuple(direct.expand(stripped[:pos], 0)), tuple(direct.expand(stripped[after:], after)))
            except Exception as e:  # never fatal: this entry launches through ``run``
                log.debug("forge: direct launch not prepared: %s: %s", type(e).__name__, e)
    with _LOCK:
        _ENTRIES[key] = entry
        if len(_ENTRIES) > _CAPACITY:
            _ENTRIES.popitem(last=False)
    counters["built"] += 1


def _scalar_pos(args, scalars) -> int | None:
    n = len(scalars)
    if n == 0:
        return len(args)   # a rule without host scalars: nothing to splice (tail empty after this position)
    for i in range(len(args) - n + 1):
        if all(args[i + j] is scalars[j] for j in range(n)):
            return i
    return None


def unused(key: tuple) -> bool:
    return key in _UNUSED


def mark_unused(key: tuple) -> None:
    with _LOCK:
        _UNUSED[key] = None
        if len(_UNUSED) > 4 * _CAPACITY:
            _UNUSED.popitem(last=False)


def clear() -> None:
    with _LOCK:
        _ENTRIES.clear()
        _SEEN.clear()
        _UNUSED.clear()
    counters.clear()
