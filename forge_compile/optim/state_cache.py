"""The per-step read of a parameter's optimizer states and hyper-parameters, cached.

Both forge routes hand every fused update its ``optimizer.state`` tensors (torch.optim's format) and its
hyper-parameters as 0-dim tensors at every step: the Dynamo backend at every fused backward, the
whole-step capture at every call. ``prepare_states``/``hparam_values`` walk the optimizer for that
(~15 us per parameter on the H200 host), so a few dozen parameters made a host-bound step slower.

What is cached, and why each reuse is exact:
- state tensors: reused while ``opt.state[p]`` is the same dict holding the same objects under the
  rule's names (``load_state_dict``, ``state.clear()`` or a user's assignment replaces them). The one
  state that is not the stored object, a fused/capturable group's device ``step`` read through a CPU
  mirror, is asked of ``translate.step_for_forge`` at every step (it re-reads the mirror when something
  else advanced the step and queues its write-back for ``flush_step_mirrors``). A ``step`` kept on the
  CPU is the stored object itself; ``prepare_states`` would replace one that is not a float32 CPU
  scalar, which only an in-place change of that object's dtype/shape could make it: the backend asks
  ``step_for_forge`` at every step for that, the capture (``keyed``) sees it in its compile key;
- hyper-parameters: after the first reads they depend on the param group's values only, so they are
  read again only when ``group_snapshot`` of the group changed (a scheduler), once per group and rule.
  Not before: SGD's first update passes dampening 0 while its zero buffer is fresh (translate's
  ``_FRESH_BUFFERS``), so an entry keeps the slow read while any of its states is fresh, and for at
  least ``SLOW_READS`` steps;
- an entry takes the slow read again when it missed the cache's previous refresh (the capture route
  keeps entries per parameter: one left out of the optimizer for a while did not see the group
  changes of those steps);
- a RuleOptimizer subclass whose ``group_hparams``/``state_tensors`` are not forge's own may read or
  create anything: it gets the slow read at every step (``translate.cacheable_reads``).
Nothing here reads a device tensor.
"""
from __future__ import annotations

import operator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import translate

__all__ = ["group_snapshot", "ParamStates", "StateCache"]


def group_snapshot(group):
    """The group's hyper-parameter values, comparable with ``==`` (params excluded; 1-element CPU
    tensors by value, others by identity so that reading them never syncs a device)."""
    def val(v):
        if isinstance(v, torch.Tensor):
            return v.item() if v.device.type == "cpu" and v.numel() == 1 else ("tensor", id(v), v._version)
        if isinstance(v, (tuple, list)):
            return tuple(val(x) for x in v)
        return v
    return [(k, val(v)) for k, v in group.items() if k != "params"]


class ParamStates:
    """One parameter's cached read. Holds no reference to the parameter or the optimizer (the capture
    route keys these by parameter in a weak dictionary)."""

    __slots__ = ("group_index", "rule", "names", "state", "raw", "states", "step_idx", "hparams", "reads", "settled",
                 "seen", "mirrored")

    def __init__(self, plan):
        self.group_index, self.rule, self.names = plan.group_index, plan.rule, plan.state_names
        self.state = None                     # the opt.state[p] dict the cached states came from
        # the objects in that dict: ``states`` differs from them where a fused/capturable group's device
        # ``step`` is read through its CPU mirror (translate._step_for_forge)
        self.raw = []
        self.states = []
        rs = plan.state_names
        self.step_idx = rs.index("step") if "step" in rs else None
        self.hparams = translate.HparamTensors()
        self.reads = 0                        # slow reads so far
        self.settled = False                  # the last slow read found no fresh state (see module doc)
        self.seen = -1                        # StateCache.tick of the last refresh that included it
        self.mirrored = False                 # states[step_idx] is a CPU mirror, not the stored step

    def fits(self, plan) -> bool:
        """Whether this read was made for ``plan``'s group index and rule (else it starts over)."""
        return (plan.group_index == self.group_index and plan.rule is self.rule
                and plan.state_names == self.names)


class StateCache:
    """The reads of one optimizer's parameters. ``translate.prepare_states``/``hparam_values`` are the slow
    reads (looked up at each call: the tests count them by patching translate)."""

    SLOW_READS = 2

    def __init__(self, keyed=False):
        # keyed: the caller compiles per key that holds every state's shape/stride/dtype/device, and
        # slow-reads every state (``force``) before it compiles for a new key (capture.py): a state that
        # still is the same object then needs no check of its own at each step
        self.keyed = keyed
        self.snapshots = {}                   # group index -> group_snapshot when last compared
        self.tick = 0                         # refreshes so far
        self._by_param = WeakIdKeyDictionary()  # param -> ParamStates, for entry()

    def entry(self, plan) -> ParamStates:
        """The cached read of ``plan.param`` (a fresh one if its group index or rule changed)."""
        e = self._by_param.get(plan.param)
        if e is None or not e.fits(plan):
            e = self._by_param[plan.param] = ParamStates(plan)
        return e

    def refresh(self, opt, items, force=False) -> None:
        """Bring each ``(plan, ParamStates)`` of ``items`` up to date for the update about to run:
        afterwards ``e.states`` and ``e.hparams.tensors`` are its inputs. ``force``: slow-read them all
        (which also validates the states against their parameters)."""
        self.tick += 1
        changed = self._groups_changed(opt, {pl.group_index for pl, _ in items})
        cacheable = not force and translate.cacheable_reads(opt)
        shared = {}            # (group index, rule) -> hyper-parameter values read this step
        for pl, e in items:
            st = opt.state.get(pl.param)
            fast = (cacheable and e.settled and e.reads >= self.SLOW_READS and e.seen == self.tick - 1
                    and st is e.state
                    and (not pl.state_names if st is None       # SGD without momentum keeps no state
                         else all(map(operator.is_, map(st.get, pl.state_names), e.raw))))
            e.seen = self.tick
            if not fast:
                self._slow_read(opt, pl, e)
                continue
            if e.step_idx is not None and (e.mirrored or not self.keyed or pl.group_index in changed):
                # the mirror of a device step is re-read if something else advanced the step, and its
                # write-back after this update is queued here (flush_step_mirrors); a step kept on the
                # CPU is checked again here (step_for_forge replaces one that is not a float32 CPU
                # scalar) unless the caller's key covers that (``keyed``), or the group's flags
                # changed, which decide between the two
                e.states[e.step_idx] = translate.step_for_forge(opt, pl, st)
                e.mirrored = e.states[e.step_idx] is not e.raw[e.step_idx]
            if pl.group_index in changed:
                # settled: the values depend on the group only (a scheduler changed lr)
                key = (pl.group_index, pl.rule)
                values = shared.get(key)
                if values is None:
                    values = shared[key] = [float(v) for v in translate.hparam_values(opt, pl)]
                e.hparams.update(values)

    def _groups_changed(self, opt, indices) -> set:
        changed = set()
        for gi in indices:
            snap = group_snapshot(opt.param_groups[gi])
            try:
                same = self.snapshots.get(gi) == snap
            except Exception:       # a value without a usable ==: always read again
                same = False
            if not same:
                changed.add(gi)
                self.snapshots[gi] = snap
        return changed

    def _slow_read(self, opt, pl, e) -> None:
        e.states = list(translate.prepare_states(opt, pl))
        e.state = opt.state.get(pl.param)
        e.raw = [e.state.get(n) for n in pl.state_names] if e.state is not None else []
        e.hparams.update(translate.hparam_values(opt, pl))
        e.settled = not translate.has_fresh_state(e.states)
        # (a RuleOptimizer subclass's own state_tensors may keep nothing in opt.state: raw is empty then)
        e.mirrored = (e.step_idx is not None and len(e.raw) > e.step_idx
                      and e.states[e.step_idx] is not e.raw[e.step_idx])
        e.reads += 1
