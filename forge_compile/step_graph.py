"""Replay a compiled train step as one CUDA graph (``compile_train_step(cuda_graphs=True)``).

Why: at fine-tuning batch sizes the forge routes are host-bound (benchmarks/RESULTS.md, e2e runs 7-9: ~370 kernel
launches per step from Python, the GPU idle between them) although they need less GPU time than the baseline.
Replayed, a step costs the host one table write and one graph launch.

What makes a replay exact: the step graph reads everything that changes between steps from tensors whose
addresses do not change -- the parameters, buffers and optimizer states themselves, the batch through static
copies, and the per-step host scalars through a device table that ``passes/scalar_table.fill_table`` writes
before each replay, exactly as the host would compute them for a normal launch. If any of those tensors is
replaced (``load_state_dict``, a user's assignment), the step is captured again; outputs are cloned, since a
replay rewrites the captured ones.

``StepGraph`` runs ``warmup`` calls eagerly first (compilation, autotuning and launch-memo entries happen there,
outside any capture), then captures once and replays. A failed capture leaves it running eagerly (logged, and
the reason kept in ``disabled``), which is exact too: the table path is the same computation.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

log = logging.getLogger(__name__)

__all__ = ["StepGraph", "counters", "GRAPH_DEVICE", "RECORDER"]

counters: Counter = Counter()

# The device whose work a graph replays, and how a step is recorded. Tests of the runtime on CPU set "cpu" and a
# recorder that re-runs the step at each replay (the CUDA recorder records without running).
GRAPH_DEVICE = ["cuda"]


def cuda_graph_recorder(fn, args):
    """Capture ``fn(*args)`` into a CUDA graph: (replay, outputs); the outputs are rewritten at each replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = list(fn(*args))
    return graph.replay, outs


RECORDER = [cuda_graph_recorder]


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a ``dst`` with src's strides, dims of stride 0 (an expanded view, whose indices alias
    one element) written once: copy_ refuses a destination whose elements overlap."""
    for d, (size, stride) in enumerate(zip(dst.shape, dst.stride())):
        if stride == 0 and size > 1:
            dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src, non_blocking=True)


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a step argument with its strides, not clone()'s: a non-dense view (a batch sliced as
    tokens[:, :-1]) is cloned contiguous, and the compiled step asserts the strides it was traced with. (Later
    arguments copied in have the same strides: they are part of the compiled step's key.)"""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    _copy_into(out, t)
    return out


class StepGraph:
    """One compiled step (``fn(*flat)``, the scalar table its last input) replayed as a graph. ``arg_idx``: the
    positions of the batch tensors (copied into static buffers at each call)."""

    def __init__(self, fn, arg_idx, warmup: int = 2, recorder=None):
        self.fn = fn
        self.arg_idx = list(arg_idx)
        self._args = set(self.arg_idx)
        self.warmup = warmup
        self.recorder = recorder or RECORDER[0]
        self.calls = 0
        self.replay = None
        self.outputs = None
        self.static = None
        self.ptrs = None
        self.ptr_idx = None          # positions of the device tensors whose addresses the capture baked in
        self.disabled = None         # why this step runs eagerly for good (a failed capture)

    def _pointer_idx(self, flat) -> list:
        dev = GRAPH_DEVICE[0]
        return [i for i, t in enumerate(flat)
                if i not in self._args and isinstance(t, torch.Tensor) and t.device.type == dev]

    def _pointers(self, flat) -> tuple:
        # every call: a few hundred tensors, so only the positions found at capture are read
        return tuple([flat[i].data_ptr() for i in self.ptr_idx])

    def __call__(self, flat) -> list:
        if self.disabled is not None:
            return list(self.fn(*flat))
        if self.replay is not None:
            if self._pointers(flat) == self.ptrs:
                for i in self.arg_idx:
                    _copy_into(self.static[i], flat[i])
                self.replay()
                counters["replays"] += 1
                return [o.clone() for o in self.outputs]
            log.info("forge: a parameter, buffer or optimizer state of the graphed step was replaced; capturing again")
            counters["recaptures"] += 1
            self.replay = self.outputs = self.static = None
        self.calls += 1
        if self.calls <= self.warmup:
            counters["eager"] += 1
            return list(self.fn(*flat))
        static = list(flat)
        for i in self.arg_idx:
            static[i] = _static_copy(flat[i])
        try:
            replay, outputs = self.recorder(self.fn, static)
        except Exception as e:   # nothing ran: the step goes on eagerly (the same computation)
            self.disabled = f"CUDA graph capture failed: {type(e).__name__}: {str(e)[:300]}"
            log.warning("forge: %s; the step runs without a graph from now on", self.disabled)
            counters["capture_failed"] += 1
            return list(self.fn(*flat))
        self.ptr_idx = self._pointer_idx(flat)
        self.static, self.replay, self.outputs, self.ptrs = static, replay, outputs, self._pointers(flat)
        counters["captures"] += 1
        self.replay()
        counters["replays"] += 1
        return [o.clone() for o in self.outputs]
