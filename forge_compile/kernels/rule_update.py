"""``forge::rule_update_``: a rule applied to a gradient that exists, its scalars read from a device table row.

Why it exists: a step replayed as a CUDA graph (compile_train_step(cuda_graphs=True)) may not take host values that
change from step to step -- a graph would keep the first step's. The fused linear weights get them from a scalar
table row (``forge::wgrad_update_table_``); every other parameter's update (norms, embeddings, anything left
unfused) goes through this op, which runs the SAME generated epilogue as the fused kernel (epilogue_codegen:
bitwise what eager ``rule.fn`` computes on CUDA) on the parameter, its gradient and its tensor states, element by
element, with the scalars loaded from the row. So a graphed step updates those parameters as eager torch.optim
would, and the host writes one table per step instead of launching anything.

A bf16 parameter under stochastic rounding (compile_train_step(stochastic_rounding=...) with cuda_graphs) takes the
rounded template: parameter, gradient and tensor states (bf16 or fp32) read into fp32, the same epilogue, the
parameter stored rounded stochastically with the bits of its element offsets and the element key in the row's
word after the scalars (kernels/stochastic_round.py, ``table_row``), the states rounded to nearest -- the spec is
``Rule.apply_rounded``.

Read top to bottom: the kernel template, the launcher, the op registration. The CPU impl runs the same kernel in
Triton's interpreter (tests: FORGE_TRITON_CPU=1 with TRITON_INTERPRET=1); there is no other CPU path because a
graphed step is CUDA-only.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..optim.rule import Rule, get_rule
from .epilogue_codegen import compile_epilogue, load_kernel_module, triton_fields, TRITON_RULE_HEAD
from .stochastic_round import TRITON_SROUND
from .wgrad_update import triton_on_cpu

log = logging.getLogger(__name__)

__all__ = ["launch_rule_update", "render_rule_update_source", "render_rule_update_rounded_source",
           "render_elementwise_source", "render_rounded_elementwise_source", "elementwise_kernel", "ROUNDING_HELPERS",
           "BLOCK"]

_TEMPLATE = TRITON_RULE_HEAD + '''

@triton.jit
def rule_update_kernel(P, G, {state_ptrs}{kernel_scalar_params}NUMEL, BLOCK: tl.constexpr):
{scalar_loads}    # [1, BLOCK] tiles: the epilogue's code is written for 2-D tiles
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = off < NUMEL
    p = tl.load(P + off, mask=mask, other=0.0)
    g = tl.load(G + off, mask=mask, other=0.0)
{state_loads}
    {new_vars} = _rule(p, g, {state_vars}{scalar_params}1, BLOCK)
    tl.store(P + off, {new_p}, mask=mask)
{state_stores}
'''

# A bf16 parameter rounded stochastically (render_rounded_elementwise_source): the spec's bits and torch's cast
# (_cast_to: round to nearest even) for the states -- this kernel's and embedding_update's rounded one's helpers
ROUNDING_HELPERS = TRITON_SROUND + '''

@triton.jit
def _cast_to(x, dtype: tl.constexpr):
    # torch's cast: round to nearest, ties to even
{cast_body}

'''

# values in fp32 from the loads, the parameter stored through the spec's bits, EKEY from the row
_ROUNDED_TEMPLATE = TRITON_RULE_HEAD + '''{rounding_helpers}
@triton.jit
def rule_update_rounded_kernel(P, G, {state_ptrs}{kernel_scalar_params}NUMEL, BLOCK: tl.constexpr):
{scalar_loads}    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = off < NUMEL
    p = tl.load(P + off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
{state_loads}
    {new_vars} = _rule(p, g, {state_vars}{scalar_params}1, BLOCK)
    tl.store(P + off, _cast_to(_sround_bits({new_p}, off, EKEY), tl.bfloat16), mask=mask)
{state_stores}
'''

BLOCK = 1024


def render_elementwise_source(ep, template: str, module: str) -> str:
    """An element-wise kernel module around the rule's epilogue (this one's and embedding_update's templates): the
    tensor states loaded at ``off``/``mask`` and stored back, the scalars from a table row ``SCAL``."""
    states = ep.tensor_inputs[2:]
    ptrs = [s.upper() for s in states]
    new_vars = [f"new_{v}" for v in ("p", *states)]
    return template.format(
        **triton_fields(ep, True, "SCAL"), module=module,
        state_loads="\n".join(f"    {s} = tl.load({p} + off, mask=mask, other=0.0)" for s, p in zip(states, ptrs)),
        state_stores="\n".join(f"    tl.store({p} + off, {v}, mask=mask)" for p, v in zip(ptrs, new_vars[1:])),
    )


def render_rule_update_source(ep) -> str:
    return render_elementwise_source(ep, _TEMPLATE, "rule_update")


_KERNELS: dict = {}
_LOCK = threading.Lock()


def elementwise_kernel(rule: Rule, target: str, template: str, module: str, render=render_elementwise_source):
    """(epilogue, jitted ``<module>_kernel``) of ``render(ep, template, module)``, cached per (module, rule,
    target): rendering and hashing the source costs tens of microseconds, every launch would pay it."""
    key = (module, rule.name, target)
    hit = _KERNELS.get(key)
    if hit is None:
        ep = compile_epilogue(rule, target)
        mod = load_kernel_module(render(ep, template, module), module + "_" + ep.source_key)
        hit = (ep, getattr(mod, module + "_kernel"))
        with _LOCK:
            _KERNELS.setdefault(key, hit)
    return hit


def render_rounded_elementwise_source(ep, template: str, module: str, **fields) -> str:
    """As render_elementwise_source for a bf16 parameter rounded stochastically: ``{rounding_helpers}``
    (ROUNDING_HELPERS), the key from the row (scalar_fields(key=True)), the tensor states loaded into fp32 and stored
    through torch's cast to their dtype; ``fields``: the template's own."""
    from .wgrad_update_triton import _CAST_BODY

    states = ep.tensor_inputs[2:]
    ptrs = [s.upper() for s in states]
    new_vars = [f"new_{v}" for v in ("p", *states)]
    return template.format(
        **triton_fields(ep, True, "SCAL", key=True), module=module,
        rounding_helpers=ROUNDING_HELPERS.format(cast_body=_CAST_BODY[ep.target]),
        state_loads="\n".join(f"    {s} = tl.load({p} + off, mask=mask, other=0.0).to(tl.float32)"
                              for s, p in zip(states, ptrs)),
        state_stores="\n".join(f"    tl.store({p} + off, _cast_to({v}, {p}.dtype.element_ty), mask=mask)"
                               for p, v in zip(ptrs, new_vars[1:])),
        **fields)


def render_rule_update_rounded_source(ep, template: str = _ROUNDED_TEMPLATE, module: str = "rule_update_rounded"):
    return render_rounded_elementwise_source(ep, template, module)


def _kernel_for(rule: Rule, target: str, rounded: bool = False):
    if rounded:
        return elementwise_kernel(rule, target, _ROUNDED_TEMPLATE, "rule_update_rounded",
                                  render_rule_update_rounded_source)
    return elementwise_kernel(rule, target, _TEMPLATE, "rule_update")


# ----------------------------------------------------------------------------------------------------
# launcher


def launch_rule_update(param, grad, tensor_states, table, rule: Rule, *, block: int = 0, num_warps: int = 4) -> None:
    """param, grad and the tensor states: fp32, contiguous, one shape (any); ``table`` the rule's kernel scalars
    (``wgrad_update_triton.rule_scalars``) as an fp32 row on the parameter's device. Updates param and states in
    place; scalar states are the caller's (they are not inputs). ``block`` (default BLOCK) and ``num_warps``:
    elements per program and its warps (benchmarks/bench_rule_update.py compares them). A bf16 ``param``: the
    rounded update (module docstring), its gradient and tensor states bf16 or fp32, the row holding the element
    key after the scalars (stochastic_round.table_row)."""
    from .wgrad_update_triton import _interpreting, check_table

    interpret = not param.is_cuda
    if interpret and not _interpreting():
        raise RuntimeError("forge: the Triton kernel runs on CPU tensors only with TRITON_INTERPRET=1")
    rounded = param.dtype == torch.bfloat16
    ep, kernel = _kernel_for(rule, "interpret" if interpret else "cuda", rounded)
    if len(tensor_states) != len(ep.tensor_inputs) - 2:
        raise ValueError(f"forge: rule {rule.name!r} takes {len(ep.tensor_inputs) - 2} tensor states, got "
                         f"{len(tensor_states)}")
    ok = (torch.float32, torch.bfloat16) if rounded else (torch.float32,)
    for name, t in (("parameter", param), ("gradient", grad), *(("state", s) for s in tensor_states)):
        if t.dtype not in ok or not t.is_contiguous() or t.shape != param.shape or t.device != param.device:
            raise ValueError(f"forge: rule_update: the {name} must be a contiguous fp32 tensor (or bf16, with a "
                             f"bf16 parameter) shaped like the parameter on its device, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
    check_table(ep, table, param, rounded)
    numel = param.numel()
    if numel == 0:
        return
    block = block or BLOCK
    grid = (-(-numel // block),)
    # no FMA contraction: the epilogue spells out the FMAs that eager torch's kernels contain
    kernel[grid](param, grad, *tensor_states, table, numel, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)


# ----------------------------------------------------------------------------------------------------
# op registration (as forge::wgrad_update_: torch.library.Library, impl under CompositeExplicitAutograd)

_LIB = torch.library.Library("forge", "FRAGMENT")
_LIB.define("rule_update_(Tensor(a!) param, Tensor grad, Tensor(b!)[] states, Tensor scalars, str rule) -> ()")


def rule_update_(param, grad, states, scalars, rule):
    if not param.is_cuda and not triton_on_cpu():
        raise RuntimeError("forge::rule_update_ runs on CUDA tensors (on CPU only under Triton's interpreter, "
                           "FORGE_TRITON_CPU=1 with TRITON_INTERPRET=1)")
    launch_rule_update(param, grad.contiguous(), list(states), scalars, get_rule(rule))
    torch.autograd.graph.increment_version([param, *states])


_LIB.impl("rule_update_", rule_update_, "CompositeExplicitAutograd")


@torch.library.register_fake("forge::rule_update_", lib=_LIB)
def _(param, grad, states, scalars, rule):
    return None
