"""The fused weight-gradient + optimizer-update op: ``forge::wgrad_update_``.

Semantics (the spec; ``reference_wgrad_update`` below is it in plain torch):
    dW = (dy_t.float() @ x.float())          # [N, M] @ [M, K] -> [N, K], fp32 accumulation
    weight, *states = rule.fn(weight, dW, *states, *hparams)   # written in place
dW never exists as a whole tensor: the CPU impl (kernels/wgrad_update_cpu.py) builds one block of it at a
time, the CUDA impl keeps each dW tile in registers and applies the rule in the GEMM epilogue
(kernels/wgrad_update_triton.py).

Arguments:
- weight [N, K] fp32, contiguous (the parameter, updated in place);
- dy_t [N, M] and x [M, K]: fp32/bf16/fp16, any strides (dy_t is usually a transposed view of dY);
- states: the rule's states in ``rule.states`` order; tensor states are [N, K] fp32 contiguous, scalar
  states (e.g. ``step``) 0-dim float32 CPU tensors; all updated in place;
- hparams: 0-dim float64 CPU tensors in ``rule.hparams`` order;
- rule: the name of a registered ``Rule``;
- cast_out (optional) [N, K] bf16/fp16 contiguous: receives the updated weight cast to its dtype (round to nearest
  even, exactly ``weight.to(cast_out.dtype)`` after the update), written by the epilogue from the registers that hold
  the new W -- the low-precision copy the next forward reads under autocast
  (compile_train_step(cast_weights_in_update=True));
- emb (optional) (grad_output, indices, padding_idx): a tied embedding's contribution -- dW gains
  ``aten.embedding_dense_backward(grad_output, indices, N, padding_idx, False)``, read row by row from compact rows
  (kernels/embedding_update.compact_rows), never dense; the op's arguments emb_grad_output / emb_indices /
  emb_padding_idx;
``forge::wgrad_update_rounded_`` takes, after ``rule``, round_key (0-dim int64 CPU tensor) and round_salt (int), and no
cast_out: stochastic rounding of a bf16 weight
  (compile_train_step(stochastic_rounding=...)): the weight (bf16) and its tensor states (bf16 or fp32) are read
  into fp32, the rule runs there on the fp32 dW, the new weight is stored rounded stochastically with the bits of
  ``stochastic_round.element_key(round_key, round_salt)`` (kernels/stochastic_round.py), bf16 states round to
  nearest even:
      p, *s = rule.fn(weight.float(), dW, *[s.float() for s in states], *hparams)
      weight <- stochastic_round_bf16(p, ekey); states <- s (Tensor.copy_)
"""
from __future__ import annotations

import logging

import torch

from .. import _compat
from ..optim.rule import get_rule
from .stochastic_round import TABLE_KEY, element_key
from .wgrad_update_cpu import cpu_block_shape, wgrad_update_cpu

log = logging.getLogger(__name__)

__all__ = ["wgrad_update", "wgrad_update_table", "reference_wgrad_update", "reference_update", "cpu_block_shape",
           "triton_on_cpu"]


def reference_wgrad_update(weight, dy_t, x, states, hparams, rule: str, cast_out=None, emb=None, ekey=None
                           ) -> torch.Tensor:
    """Plain-torch spec: materializes dW, applies the rule in place, casts the new W into ``cast_out``, returns dW
    (tests only). ``ekey``: a bf16 weight's stochastic rounding (``element_key``; the module docstring)."""
    grad = dy_t.float() @ x.float()
    if emb is not None:
        grad = grad + torch.ops.aten.embedding_dense_backward(emb[0], emb[1], weight.shape[0], emb[2], False).float()
    reference_update(weight, grad, states, hparams, rule, ekey)
    if cast_out is not None:
        cast_out.copy_(weight)
    return grad


def reference_update(weight, grad, states, hparams, rule: str, ekey=None) -> None:
    """The update part of the spec on a given dW (fp32): the rule in place, or -- ``ekey`` given, a bf16 weight --
    the rule on fp32 copies, the weight stochastically rounded, the states copied back (tests only)."""
    with torch.no_grad():
        if ekey is None:
            get_rule(rule).apply(weight, grad, list(states), list(hparams))
        else:
            get_rule(rule).apply_rounded(weight, grad, states, hparams, ekey)


def wgrad_update(weight, dy_t, x, states, hparams, rule: str, grad_out=None, cast_out=None, emb=None,
                 ekey=None) -> None:
    """Launch the fused update. ``grad_out`` (debug/exactness only) receives the dW it consumed; ``cast_out`` the
    updated weight's low-precision copy (one of the two: the kernels have one side output); ``emb``: a tied
    embedding's gradient contribution; ``ekey``: a bf16 weight's stochastic-rounding key (``element_key``); see the
    module docstring."""
    _check(weight, dy_t, x, states, rule)
    _check_cast_out(weight, grad_out, cast_out)
    _check_rounding(weight, cast_out, ekey)
    extra = _extra_rows(weight, emb)
    if weight.is_cuda or triton_on_cpu():
        from .wgrad_update_triton import launch_wgrad_update

        launch_wgrad_update(weight, dy_t, x, list(states), list(hparams), get_rule(rule),
                            side_out=cast_out if cast_out is not None else grad_out, extra=extra, ekey=ekey)
    else:
        wgrad_update_cpu(weight, dy_t, x, list(states), list(hparams), rule, grad_out=grad_out, cast_out=cast_out,
                         extra=extra, ekey=ekey)


def _check_rounding(weight, cast_out, ekey):
    if weight.dtype == torch.float32 and ekey is None:
        return
    if weight.dtype != torch.bfloat16 or ekey is None or cast_out is not None:
        raise ValueError(f"wgrad_update: a {weight.dtype} weight with round_key={'set' if ekey is not None else None}"
                         f"{' and cast_out' if cast_out is not None else ''}: fp32 weights take no key; bf16 weights "
                         "are stochastically rounded and need one (and have no cast copy)")


def _ekey(round_key, round_salt):
    return None if round_key is None else element_key(int(round_key), round_salt)


def _extra_rows(weight, emb):
    """(rows, pos) of a tied embedding's gradient (embedding_update.compact_rows), or None."""
    if emb is None:
        return None
    from .embedding_update import check_embedding_args, compact_rows

    grad_output, indices, padding_idx = emb
    # a bf16 weight is a rounded one (stochastic_rounding: _check_rounding / check_low_precision say so)
    check_embedding_args(weight, grad_output, indices, rounded=weight.dtype == torch.bfloat16)
    return compact_rows(grad_output, indices, weight.shape[0], padding_idx)


def triton_on_cpu() -> bool:
    """FORGE_TRITON_CPU=1 routes CPU tensors through the Triton kernels, which then need TRITON_INTERPRET=1
    (tests; the launchers refuse CPU tensors without the interpreter)."""
    import os

    return os.environ.get("FORGE_TRITON_CPU") == "1"


def _check(weight, dy_t, x, states, rule_name):
    rule = get_rule(rule_name)
    _check_shapes(weight, dy_t, x)
    if len(states) != len(rule.states):
        raise ValueError(f"wgrad_update: rule {rule.name!r} takes {len(rule.states)} states, got {len(states)}")


def _check_cast_out(weight, grad_out, cast_out):
    if cast_out is None:
        return
    if grad_out is not None:
        raise ValueError("wgrad_update: grad_out and cast_out cannot both be given (one side output)")
    if (cast_out.dtype not in (torch.bfloat16, torch.float16) or cast_out.shape != weight.shape
            or not cast_out.is_contiguous() or cast_out.device != weight.device):
        raise ValueError(f"wgrad_update: cast_out must be a contiguous bf16/fp16 {list(weight.shape)} tensor on the "
                         f"weight's device, got {cast_out.dtype} {list(cast_out.shape)} on {cast_out.device}")


def _check_shapes(weight, dy_t, x):
    n, k = weight.shape
    if dy_t.dim() != 2 or x.dim() != 2 or dy_t.shape[0] != n or x.shape[1] != k or dy_t.shape[1] != x.shape[0]:
        raise ValueError(
            f"wgrad_update: shapes weight {tuple(weight.shape)}, dy_t {tuple(dy_t.shape)}, x {tuple(x.shape)} do not compose"
        )


# Registered with torch.library.Library, not torch.library.custom_op: custom_op's Python autograd and
# ADInplaceOrView layers (schema default filling, two redispatches) cost ~80 us of host time per call
# on the CPU dev machine with the launch stubbed (117 us through the op vs 38 us calling wgrad_update),
# 36 us vs 22 us for this registration on the H200 host (benchmarks/bench_launch_overhead.py), and a
# backward launches one op per linear layer, so the forge routes were host-bound at fine-tuning batch
# sizes (benchmarks/RESULTS.md). Here the impl runs straight under the backend key; autograd falls
# through (the op returns nothing and runs only inside backward), and the impl bumps the version
# counters of what it mutates, as ADInplaceOrView would, so saved-tensor checks still see the update.
_LIB = torch.library.Library("forge", "FRAGMENT")
# cudagraph_unsafe: the launch passes host scalars computed from the step counter and hyper-parameters at that
# moment (bias corrections, lr), so a CUDA graph that captured it would replay step 1's values forever. Inductor's
# cudagraphs then leave the op out (graph_partition: a partition boundary; otherwise the graph is not captured).
_EMB_ARGS = "Tensor? emb_grad_output=None, Tensor? emb_indices=None, int emb_padding_idx=-1"
_LIB.define(
    "wgrad_update_(Tensor(a!) weight, Tensor dy_t, Tensor x, Tensor(b!)[] states, Tensor[] hparams, "
    f"str rule, Tensor(c!)? cast_out=None, {_EMB_ARGS}) -> ()",
    tags=_compat.cudagraph_unsafe_tags(),
)


def _emb(grad_output, indices, padding_idx):
    return None if grad_output is None else (grad_output, indices, padding_idx)


def wgrad_update_(weight, dy_t, x, states, hparams, rule, cast_out=None, emb_grad_output=None, emb_indices=None,
                  emb_padding_idx=-1):
    wgrad_update(weight, dy_t, x, states, hparams, rule, cast_out=cast_out,
                 emb=_emb(emb_grad_output, emb_indices, emb_padding_idx))
    torch.autograd.graph.increment_version([weight, *states] + ([cast_out] if cast_out is not None else []))


_LIB.impl("wgrad_update_", wgrad_update_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::wgrad_update_", lib=_LIB)
def _(weight, dy_t, x, states, hparams, rule, cast_out=None, emb_grad_output=None, emb_indices=None,
      emb_padding_idx=-1):
    return None


# A bf16 weight's stochastically rounded update: its own op, not optional arguments of wgrad_update_ (with them
# Inductor's cpp_wrapper code for wgrad_update_ crashed -- SIGSEGV in the backend route's backward, torch 2.13).
_LIB.define(
    "wgrad_update_rounded_(Tensor(a!) weight, Tensor dy_t, Tensor x, Tensor(b!)[] states, Tensor[] hparams, "
    f"str rule, Tensor round_key, int round_salt, {_EMB_ARGS}) -> ()")


def wgrad_update_rounded_(weight, dy_t, x, states, hparams, rule, round_key, round_salt, emb_grad_output=None,
                          emb_indices=None, emb_padding_idx=-1):
    wgrad_update(weight, dy_t, x, states, hparams, rule, emb=_emb(emb_grad_output, emb_indices, emb_padding_idx),
                 ekey=_ekey(round_key, round_salt))
    torch.autograd.graph.increment_version([weight, *states])


_LIB.impl("wgrad_update_rounded_", wgrad_update_rounded_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::wgrad_update_rounded_", lib=_LIB)
def _(weight, dy_t, x, states, hparams, rule, round_key, round_salt, emb_grad_output=None, emb_indices=None,
      emb_padding_idx=-1):
    return None


# The same update with the rule's scalars read from a device table row (``forge::wgrad_update_table_``): states are
# the rule's tensor states only, no hyper-parameters, no scalar state -- nothing the host changes between steps,
# so a CUDA graph may capture it (compile_train_step(cuda_graphs=True) writes the table before each replay).
# ``scalars``: ``wgrad_update_triton.rule_scalars``'s values as fp32 on the weight's device. A bf16 weight is the
# rounded update (as forge::wgrad_update_rounded_'s) whose element key is the row's word after the scalars
# (stochastic_round.table_row): a new key per replay, written with the table.
_LIB.define("wgrad_update_table_(Tensor(a!) weight, Tensor dy_t, Tensor x, Tensor(b!)[] states, Tensor scalars, "
            f"str rule, Tensor(c!)? cast_out=None, {_EMB_ARGS}) -> ()")


def wgrad_update_table(weight, dy_t, x, states, scalars, rule: str, cast_out=None, emb=None) -> None:
    if not weight.is_cuda and not triton_on_cpu():
        raise RuntimeError("forge::wgrad_update_table_ runs on CUDA tensors (on CPU only under Triton's "
                           "interpreter, FORGE_TRITON_CPU=1 with TRITON_INTERPRET=1)")
    _check_shapes(weight, dy_t, x)
    _check_cast_out(weight, None, cast_out)
    from .wgrad_update_triton import launch_wgrad_update

    launch_wgrad_update(weight, dy_t, x, list(states), [], get_rule(rule), side_out=cast_out, table=scalars,
                        extra=_extra_rows(weight, emb), ekey=TABLE_KEY if weight.dtype == torch.bfloat16 else None)


def wgrad_update_table_(weight, dy_t, x, states, scalars, rule, cast_out=None, emb_grad_output=None,
                        emb_indices=None, emb_padding_idx=-1):
    wgrad_update_table(weight, dy_t, x, states, scalars, rule, cast_out,
                       _emb(emb_grad_output, emb_indices, emb_padding_idx))
    torch.autograd.graph.increment_version([weight, *states] + ([cast_out] if cast_out is not None else []))


_LIB.impl("wgrad_update_table_", wgrad_update_table_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::wgrad_update_table_", lib=_LIB)
def _(weight, dy_t, x, states, scalars, rule, cast_out=None, emb_grad_output=None, emb_indices=None,
      emb_padding_idx=-1):
    return None
