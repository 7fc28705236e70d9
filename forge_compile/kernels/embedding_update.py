"""``forge::embedding_update_``: an embedding weight's optimizer update from the embedding's backward input, without
the dense gradient.

Semantics (``reference_embedding_update`` below is the spec in plain torch):
    dW = aten.embedding_dense_backward(grad_output, indices, V, padding_idx, False)   # [V, K]
    weight, *states = rule.fn(weight, dW.float(), *states, *hparams)                   # in place
autograd writes dW as a dense [V, K] tensor (zeros, then the rows of the tokens seen added in) and the optimizer
reads it back: 8 bytes per parameter of traffic and 4 of memory (a 128k x 4096 vocabulary: 2.1 GB) for a gradient
whose rows are mostly zero at fine-tuning batch sizes. Here the rows that are not zero are computed compactly --
``compact_rows``: torch's own ``embedding_dense_backward`` on the indices renumbered 0..U-1 in order (the same sort,
the same summation order per row, so each row is bitwise the dense one's) into an [M, K] buffer, plus a [V] map from
row to its compact row (-1: no token, or the padding row) -- and the update kernel reads W/states in full, the
gradient row through the map (zero where -1). Shapes are static (M tokens, V rows): no host sync, capturable in a
CUDA graph.

A bf16 embedding under compile_train_step(stochastic_rounding=...) (``forge::embedding_update_rounded_``, round key
and salt after the padding index): the rule on fp32 values of W, the gradient row and the states (bf16 or fp32), W
stored rounded stochastically with the bits of its element offsets (kernels/stochastic_round.py), the states rounded
to nearest -- ``reference_embedding_update(..., ekey=)`` is that spec.

Read top to bottom: compaction, kernel templates, launcher (CUDA / Triton's interpreter), CPU impl, op registration
(``forge::embedding_update_`` with host hyper-parameters, ``forge::embedding_update_table_`` reading a scalar table
row, as the fused linear ops; ``forge::embedding_update_rounded_``).
"""
from __future__ import annotations

import functools
import logging

import torch

from .. import _compat
from ..optim.rule import Rule, get_rule
from .epilogue_codegen import TRITON_RULE_HEAD
from .rule_update import elementwise_kernel, render_elementwise_source, render_rounded_elementwise_source
from .stochastic_round import TABLE_KEY, element_key, table_row
from .wgrad_update import triton_on_cpu

log = logging.getLogger(__name__)

__all__ = ["embedding_update", "embedding_update_table", "reference_embedding_update", "compact_rows",
           "compact_rows_by_id", "check_embedding_args", "render_embedding_update_source"]

aten = torch.ops.aten


def reference_embedding_update(weight, grad_output, indices, states, hparams, rule: str, padding_idx: int = -1,
                               ekey=None):
    """Plain-torch spec: the dense gradient, the rule applied in place (``ekey``: a bf16 weight's, rounded
    stochastically, as wgrad_update.reference_update); returns the gradient (tests only)."""
    grad = aten.embedding_dense_backward(grad_output, indices, weight.shape[0], padding_idx, False).float()
    with torch.no_grad():
        if ekey is None:
            get_rule(rule).apply(weight, grad, list(states), list(hparams))
        else:
            get_rule(rule).apply_rounded(weight, grad, states, hparams, ekey)
    return grad


def _renumber(indices):
    """(sorted indices, each sorted position's compact row, each token's compact row): the distinct indices
    numbered 0..U-1 in increasing order."""
    flat = indices.reshape(-1)
    srt, perm = torch.sort(flat, stable=True)
    new = torch.ones_like(srt, dtype=torch.bool)
    new[1:] = srt[1:] != srt[:-1]
    seg_sorted = torch.cumsum(new, 0) - 1
    seg = torch.empty_like(seg_sorted)
    seg[perm] = seg_sorted
    return srt, seg_sorted, seg.view(indices.shape)


def _rows(grad_output, seg):
    # the dense kernel itself on the renumbered indices: its per-row summation order depends only on which
    # indices are equal and in what order, which renumbering in order keeps
    rows = aten.embedding_dense_backward(grad_output, seg, max(1, seg.numel()), -1, False)
    return rows.reshape(-1, grad_output.shape[-1])


def compact_rows(grad_output, indices, num_rows: int, padding_idx: int = -1):
    """(rows [M, K] in grad_output's dtype, pos [num_rows] int32): row r of the dense gradient is rows[pos[r]] where
    pos[r] >= 0, else zero. M = indices.numel(); rows past the distinct indices' count are zero."""
    srt, seg_sorted, seg = _renumber(indices)
    rows = _rows(grad_output, seg)
    pos = torch.full((num_rows,), -1, dtype=torch.int32, device=srt.device)
    pos[srt] = seg_sorted.to(torch.int32)
    if padding_idx >= 0:
        # fill_, not pos[padding_idx] = -1: that copies a CPU scalar tensor, which a CUDA graph capture refuses
        pos.narrow(0, padding_idx, 1).fill_(-1)
    return rows, pos


def compact_rows_by_id(grad_output, indices):
    """(rows [M, K] as ``compact_rows``', ids [M]): compact row u holds the dense gradient's row ids[u] (the padding
    row's tokens included: the caller drops it); rows past the distinct indices' count are zero, their id is
    the largest index. Static shapes, no host sync (gradient norms under CUDA graphs)."""
    srt, seg_sorted, seg = _renumber(indices)
    # segment u starts at the first sorted position whose compact row is u (sorted: a binary search, deterministic)
    u = torch.arange(srt.numel(), device=srt.device, dtype=seg_sorted.dtype)
    start = torch.searchsorted(seg_sorted, u).clamp_(max=max(0, srt.numel() - 1))
    return _rows(grad_output, seg), srt[start]


_TEMPLATE = TRITON_RULE_HEAD + '''
{rounding_helpers}
{jit}
def {module}_kernel(P, G, POS, {state_ptrs}{kernel_scalar_params}N, K,
                            BR: tl.constexpr, BK: tl.constexpr):
{scalar_loads}    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = rows < N
    mask = rmask[:, None] & (cols < K)[None, :]
    off = rows.to(tl.int64)[:, None] * K + cols[None, :]
    # the row's gradient: its compact row, or zero (no token, the padding row, past the end)
    pos = tl.load(POS + rows, mask=rmask, other=-1)
    g = tl.load(G + pos.to(tl.int64)[:, None] * K + cols[None, :], mask=mask & (pos >= 0)[:, None],
                other=0.0).to(tl.float32)
    p = tl.load(P + off, mask=mask, other=0.0){to_f32}
{state_loads}
    {new_vars} = _rule(p, g, {state_vars}{scalar_params}BR, BK)
    tl.store(P + off, {w_store}, mask=mask)
{state_stores}
'''

# A bf16 W rounded stochastically (states bf16 or fp32; rule_update.render_rounded_elementwise_source): values in fp32,
# W stored through the spec's bits, states rounded to nearest; the element key is the scalar row's word after the
# rule's scalars (stochastic_round.table_row) -- host launches and a CUDA graph's replays alike, one kernel

# rows x columns per program: 1024 elements per 4 warps, rule_update_'s block, which measured best there (2048: 1-8 %
# slower; benchmarks/bench_rule_update.py) -- not measured for this kernel. sm_90 compile (triton 3.6): AdamW 64
# registers, SGD-momentum 32, Lion 43, no spills
BR, BK = 4, 256


def render_embedding_update_source(ep, template: str = _TEMPLATE, module: str = "embedding_update",
                                   rounded: bool = False) -> str:
    """The kernel module; ``rounded``: for a bf16 weight rounded stochastically (its key read from the row)."""
    if not rounded:     # fp32 W and states: the shared element-wise rendering, W stored as the rule left it
        plain = {"{rounding_helpers}": "", "{jit}": "@triton.jit", "{to_f32}": "",
                 "{w_store}": "{new_p}"}
        for field, text in plain.items():
            template = template.replace(field, text)
        return render_elementwise_source(ep, template, module)
    return render_rounded_elementwise_source(ep, template, module, jit="@triton.jit", to_f32=".to(tl.float32)",
                                             w_store="_cast_to(_sround_bits(new_p, off, EKEY), tl.bfloat16)")


def _kernel_for(rule: Rule, target: str, rounded: bool = False):
    if rounded:
        return elementwise_kernel(rule, target, _TEMPLATE, "embedding_update_rounded",
                                  functools.partial(render_embedding_update_source, rounded=True))
    return elementwise_kernel(rule, target, _TEMPLATE, "embedding_update", render_embedding_update_source)


# ----------------------------------------------------------------------------------------------------
# launcher


def check_embedding_args(weight, grad_output, indices, rounded: bool = False):
    want = torch.bfloat16 if rounded else torch.float32
    if weight.dim() != 2 or weight.dtype != want or not weight.is_contiguous():
        raise ValueError(f"forge: embedding_update: the weight must be a contiguous {want} [V, K] tensor"
                         + (" (stochastic rounding)" if rounded else ""))
    if grad_output.shape[-1] != weight.shape[1] or grad_output.shape[:-1] != indices.shape:
        raise ValueError(f"forge: embedding_update: grad_output {list(grad_output.shape)} does not match indices "
                         f"{list(indices.shape)} and weight {list(weight.shape)}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"forge: embedding_update: indices must be int64 or int32, got {indices.dtype}")
    if not grad_output.is_floating_point() or grad_output.device != weight.device or indices.device != weight.device:
        raise ValueError("forge: embedding_update: grad_output must be floating point, and it and the indices on the "
                         "weight's device")


def _check(weight, grad_output, indices, tensor_states, rounded: bool = False):
    check_embedding_args(weight, grad_output, indices, rounded)
    ok = (torch.float32, torch.bfloat16) if rounded else (torch.float32,)
    for s in tensor_states:
        if s.dtype not in ok or not s.is_contiguous() or s.shape != weight.shape:
            raise ValueError("forge: embedding_update: tensor states must be contiguous fp32 tensors like the weight"
                             + (" (or bf16: stochastic rounding)" if rounded else ""))


def launch_embedding_update(weight, grad_output, indices, tensor_states, table, rule: Rule,
                            padding_idx: int = -1, ekey=None) -> None:
    """Triton kernel (CUDA, or CPU tensors under the interpreter): the rule's scalars from ``table`` (an fp32 row on
    the weight's device, ``wgrad_update_triton.rule_scalars``); scalar states are the caller's. ``ekey`` given
    (``stochastic_round.TABLE_KEY``): a bf16 weight rounded stochastically with the key in the row's word after the
    scalars (``stochastic_round.table_row``)."""
    from .wgrad_update_triton import _interpreting, check_table

    interpret = not weight.is_cuda
    if interpret and not _interpreting():
        raise RuntimeError("forge: the Triton kernel runs on CPU tensors only with TRITON_INTERPRET=1")
    if ekey is not None and ekey is not TABLE_KEY:
        raise ValueError("forge: embedding_update: the rounded kernel reads its key from the row (ekey=TABLE_KEY)")
    ep, kernel = _kernel_for(rule, "interpret" if interpret else "cuda", ekey is not None)
    check_table(ep, table, weight, ekey is not None)
    n, k = weight.shape
    rows, pos = compact_rows(grad_output, indices, n, padding_idx)
    grid = (-(-n // BR), -(-k // BK))
    # no FMA contraction: the epilogue spells out the FMAs that eager torch's kernels contain
    kernel[grid](weight, rows.contiguous(), pos, *tensor_states, table, n, k, BR=BR, BK=BK, num_warps=4,
                 enable_fp_fusion=False)


def _host_table(rule: Rule, states, hparams, device, ekey=None):
    """The scalar row a launch with host values reads (bitwise the fused linear kernels' host scalars; ``ekey``: a
    rounded weight's element key after them), and the scalar states' values after it."""
    from .wgrad_update_triton import rule_scalars, split_states

    tensor_states, scalar_states = split_states(rule, states)
    values, new = rule_scalars(rule, scalar_states, hparams, "cuda" if device.type == "cuda" else "interpret")
    host = table_row(values, ekey)
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    return tensor_states, scalar_states, new, table


# ----------------------------------------------------------------------------------------------------
# CPU impl: the linear op's blocked CPU update with an empty matmul (zero blocks) plus the compact rows


def embedding_update_cpu(weight, grad_output, indices, states, hparams, rule_name, padding_idx=-1,
                         ekey=None) -> None:
    from .wgrad_update_cpu import wgrad_update_cpu

    n, k = weight.shape
    extra = compact_rows(grad_output, indices, n, padding_idx)
    # the empty matmul's operands in fp32 whatever the weight's dtype (a bf16 weight: stochastic rounding)
    wgrad_update_cpu(weight, weight.new_empty((n, 0), dtype=torch.float32),
                     weight.new_empty((0, k), dtype=torch.float32), states, hparams, rule_name, extra=extra,
                     ekey=ekey)


def embedding_update(weight, grad_output, indices, states, hparams, rule: str, padding_idx: int = -1,
                     ekey=None) -> None:
    r = get_rule(rule)
    if len(states) != len(r.states):
        raise ValueError(f"embedding_update: rule {r.name!r} takes {len(r.states)} states, got {len(states)}")
    _check(weight, grad_output, indices, [s for i, s in enumerate(states) if not r.is_scalar_state(i)],
           ekey is not None)
    if weight.is_cuda or triton_on_cpu():
        tensor_states, scalar_states, new, table = _host_table(r, list(states), list(hparams), weight.device, ekey)
        launch_embedding_update(weight, grad_output, indices, tensor_states, table, r, padding_idx,
                                None if ekey is None else TABLE_KEY)
        with torch.no_grad():
            for s, v in zip(scalar_states, new):
                s.fill_(v)
    else:
        embedding_update_cpu(weight, grad_output, indices, list(states), list(hparams), rule, padding_idx, ekey)


def embedding_update_table(weight, grad_output, indices, states, scalars, rule: str, padding_idx: int = -1) -> None:
    if not weight.is_cuda and not triton_on_cpu():
        raise RuntimeError("forge::embedding_update_table_ runs on CUDA tensors (on CPU only under Triton's "
                           "interpreter, FORGE_TRITON_CPU=1 with TRITON_INTERPRET=1)")
    # a bf16 weight: the rounded update, its key the row's word after the scalars (a new key per replay)
    rounded = weight.dtype == torch.bfloat16
    _check(weight, grad_output, indices, states, rounded)
    launch_embedding_update(weight, grad_output, indices, list(states), scalars, get_rule(rule), padding_idx,
                            TABLE_KEY if rounded else None)


# ----------------------------------------------------------------------------------------------------
# op registration (as forge::wgrad_update_: torch.library.Library, impl under CompositeExplicitAutograd)

_LIB = torch.library.Library("forge", "FRAGMENT")
# cudagraph_unsafe as forge::wgrad_update_: host scalars of the step at each launch
_LIB.define("embedding_update_(Tensor(a!) weight, Tensor grad_output, Tensor indices, Tensor(b!)[] states, "
            "Tensor[] hparams, str rule, int padding_idx) -> ()", tags=_compat.cudagraph_unsafe_tags())
_LIB.define("embedding_update_table_(Tensor(a!) weight, Tensor grad_output, Tensor indices, Tensor(b!)[] states, "
            "Tensor scalars, str rule, int padding_idx) -> ()")
# a bf16 embedding rounded stochastically: round_key a 0-dim int64 CPU tensor (read on the host, as
# forge::wgrad_update_rounded_'s), round_salt the parameter's index in the step
_LIB.define("embedding_update_rounded_(Tensor(a!) weight, Tensor grad_output, Tensor indices, Tensor(b!)[] states, "
            "Tensor[] hparams, str rule, int padding_idx, Tensor round_key, int round_salt) -> ()",
            tags=_compat.cudagraph_unsafe_tags())


def embedding_update_(weight, grad_output, indices, states, hparams, rule, padding_idx):
    embedding_update(weight, grad_output, indices, states, hparams, rule, padding_idx)
    torch.autograd.graph.increment_version([weight, *states])


def embedding_update_table_(weight, grad_output, indices, states, scalars, rule, padding_idx):
    embedding_update_table(weight, grad_output, indices, states, scalars, rule, padding_idx)
    torch.autograd.graph.increment_version([weight, *states])


def embedding_update_rounded_(weight, grad_output, indices, states, hparams, rule, padding_idx, round_key,
                              round_salt):
    embedding_update(weight, grad_output, indices, states, hparams, rule, padding_idx,
                     ekey=element_key(int(round_key), round_salt))
    torch.autograd.graph.increment_version([weight, *states])


_LIB.impl("embedding_update_", embedding_update_, "CompositeExplicitAutograd")
_LIB.impl("embedding_update_rounded_", embedding_update_rounded_, "CompositeExplicitAutograd")
_LIB.impl("embedding_update_table_", embedding_update_table_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::embedding_update_", lib=_LIB)
def _(weight, grad_output, indices, states, hparams, rule, padding_idx):
    return None


@torch.library.register_fake("forge::embedding_update_table_", lib=_LIB)
def _(weight, grad_output, indices, states, scalars, rule, padding_idx):
    return None


@torch.library.register_fake("forge::embedding_update_rounded_", lib=_LIB)
def _(weight, grad_output, indices, states, hparams, rule, padding_idx, round_key, round_salt):
    return None
