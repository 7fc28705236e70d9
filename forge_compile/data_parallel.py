"""compile_train_step under DistributedDataParallel: what DDP's reducer does, traced into the step's graph.

A compiled step runs no autograd hooks, so DDP's reducer (which all-reduces gradients from hooks on the gradient
accumulators) never runs; ``ddp_in_graph`` traces its work into the step instead, where the pattern pass
(passes/wgrad_update_pattern.py, ``_dp_mean``) turns a reduced weight gradient into one fused update over every
rank's all-gathered dY and X. All-gathers need the same shapes on every rank, so a step whose graph may gather first
checks, per call, that the ranks were called with the same argument shapes (``ShapeAgreement``).
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter

import torch

from . import _compat

log = logging.getLogger(__name__)

counters: Counter = Counter()


def unsupported(ddps) -> str | None:
    """Why one of ``ddps``' synchronisation cannot be reproduced in the step's graph, or None."""
    for ddp in ddps:
        why = _compat.ddp_unsupported(ddp)
        if why:
            return why
    return None


@contextlib.contextmanager
def ddp_in_graph(ddp, traced: dict):
    """While the step is traced: ``ddp``'s forward is its module's (its reducer, which works in autograd hooks a
    compiled step never calls, stays out) and what the reducer and the forward would do is traced into the graph:
    each gradient DDP synchronises is multiplied by 1/world and summed over the ranks (``all_reduce``), as DDP's
    reducer does per backward -- on each backward's contribution, through a hook on the traced parameter, so that
    accumulation over passes sums reduced contributions (DDP reduces the accumulated gradient again; the same sum
    up to rounding, as the pattern pass can fuse it); a gradient that enters the step already set is reduced
    whole after each accumulation, as DDP does -- and the buffers are broadcast from rank 0 before the forward
    (``broadcast_buffers``). Inside ``no_sync()`` nothing is added (part of the cache key). ``traced``: id of each
    real parameter / buffer -> its traced tensor."""
    if not _compat.ddp_synced(ddp):
        yield
        return
    gname, world = _compat.ddp_group(ddp)
    ignored = _compat.ddp_ignored(ddp)
    inner = ddp.module
    params = [traced[id(p)] for n, p in inner.named_parameters() if p.requires_grad and n not in ignored]
    buffers = ([traced[id(b)] for n, b in inner.named_buffers() if n not in ignored and id(b) in traced]
               if ddp.broadcast_buffers else [])
    inv = 1.0 / world

    def reduce(g):
        # DDP's reducer: grad * (1 / world) copied into the bucket, then the bucket summed over the ranks
        return _compat.all_reduce_sum(g * inv, gname)

    def reduce_accumulated(t):
        t.grad = reduce(t.grad)

    def forward(*args, **kwargs):
        if buffers and torch.is_grad_enabled():
            with torch.no_grad():
                for b in buffers:
                    b.copy_(_compat.broadcast_from(b, 0, gname))
        return inner(*args, **kwargs)

    # a gradient that enters the step (accumulated over calls under no_sync()) is reduced with the first
    # contribution, as DDP reduces the accumulated .grad: after each accumulation (unfused: the sum needs dW)
    handles = [t.register_post_accumulate_grad_hook(reduce_accumulated) if t.grad is not None
               else t.register_hook(reduce) for t in params]
    ddp.forward = forward
    try:
        yield
    finally:
        del ddp.forward
        for h in handles:
            h.remove()


def shape_signature(tensors) -> int:
    """The argument shapes as an int64 the same in every process (a hash of ints only: not salted per process)."""
    return hash(tuple(tuple(t.shape) for t in tensors)) & ((1 << 62) - 1)


class ShapeAgreement:
    """Whether every rank of each DDP's group called the step with the same argument shapes: one all-reduce (MAX)
    of (signature, -signature) per call. Equal shapes trace equal graphs, so every rank issues the same collectives;
    with different ones (an uneven last batch, per-rank padding) a graph that all-gathers dY and X would hang or
    read garbage, so those calls run a graph whose weights are all-reduced instead (the same collectives on every
    rank whatever its shapes, as under DDP). Over gloo on the CPU where it can -- a DDP over the default group gets a
    gloo copy of it, made once, collectively, at the first call -- so that the check does not wait for the GPU's
    queue; else over DDP's own group on its device (the host then waits for the previous step's work)."""

    def __init__(self):
        self._groups: dict = {}

    def __call__(self, ddps, tensors) -> bool:
        import torch.distributed as dist

        sig = shape_signature(tensors)
        agree = True
        for ddp in ddps:
            group, device = self._group(ddp)
            t = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            agree = agree and t.tolist() == [sig, -sig]
        counters["shape_checks"] += 1
        if not agree:
            counters["shapes_differ"] += 1
        return agree

    def _group(self, ddp):
        import torch.distributed as dist

        pg = ddp.process_group
        hit = self._groups.get(id(pg))
        if hit is None:
            if "gloo" in str(dist.get_backend(pg)):
                hit = (pg, torch.device("cpu"))
            elif pg is dist.group.WORLD:
                hit = (dist.new_group(backend="gloo"), torch.device("cpu"))
            else:
                hit = (pg, next(ddp.module.parameters()).device)
            self._groups[id(pg)] = hit
        return hit
