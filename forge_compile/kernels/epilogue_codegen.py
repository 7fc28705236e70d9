"""Turn an element-wise optimizer ``Rule`` into a Triton GEMM epilogue.

The rule is traced once with make_fx on fake 1-D tensors. Its graph splits in two:
- the HOST part: every node that depends only on hyper-parameters, scalar states and constants (bias
  corrections, ``lr * wd``, ``step + 1``, ...). It stays an fx GraphModule and runs with torch on the CPU at
  each launch, exactly as eager torch would compute it (float64 hparams, float32 step), producing the fp32
  scalars the kernel needs and the new scalar states;
- the TILE part: every node that touches the parameter, the gradient or a tensor state. It becomes Triton
  statements on fp32 register tiles, spliced into the kernel template of ``wgrad_update_triton``.

Bit-identity with eager torch is the goal (tested: the kernel's W/states equal ``rule.fn`` applied eagerly
to the dW the kernel stored). Eager element-wise kernels are not plain IEEE formulas, and they differ by
device, so each lowering below copies what ATen's kernel for that device computes:
- division by a CPU scalar on CUDA is ``a * fp32(1 / b)`` with 1/b taken in the scalar's dtype (float64 for
  hparams; BinaryDivTrueKernel.cu's reciprocal path, behaviour pinned down on the H200); on CPU a true division;
- ``add``/``sub`` with alpha, ``addcmul``, ``addcdiv`` and ``lerp`` contain an FMA in the eager kernel
  (nvcc contracts by default; the CPU kernels call fmadd); the kernel itself is launched with
  ``enable_fp_fusion=False`` so that only these spelled-out FMAs are fused;
- division and sqrt are correctly rounded (div_rn/sqrt_rn; Triton's ``/`` and ``tl.sqrt`` are approximate);
- exp/log/pow call libdevice on CUDA, as ATen's ``::expf`` etc. do.
An op without a faithful lowering raises ``EpilogueUnsupported`` so the caller leaves that parameter unfused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from typing import Any

import numpy as np
import torch
import torch.fx

from .._compat import OpOverload, op_overload_name
from ..optim.rule import Rule

log = logging.getLogger(__name__)

__all__ = ["EpilogueUnsupported", "Epilogue", "compile_epilogue", "scalar_fields", "triton_fields",
           "TRITON_RULE_HEAD", "load_kernel_module"]

aten = torch.ops.aten


class EpilogueUnsupported(Exception):
    """The rule uses an op (named in the message) that the epilogue generator cannot express faithfully."""


@dataclasses.dataclass
class Epilogue:
    rule_name: str
    target: str                      # "cuda" or "interpret" (Triton interpreter on CPU: numpy arithmetic)
    tensor_inputs: tuple[str, ...]   # tile variable names the template loads: param, grad, tensor states
    body: str                        # statements (4-space indented) computing the outputs from the inputs
    outputs: tuple[str, ...]         # tile expressions: new param, then each new tensor state
    n_kernel_scalars: int            # kernel scalar args c0..c{n-1}
    host: torch.fx.GraphModule       # (scalar_states..., hparams...) -> (kernel scalars..., new scalar states...)
    n_scalar_states: int
    source_key: str                  # hash of everything that shapes the generated code

    def run_host(self, scalar_states, hparams):
        """Returns (fp32 python floats for the kernel, new scalar state tensors)."""
        with torch.no_grad():
            outs = self.host(*scalar_states, *hparams)
        outs = list(outs)
        ks = [float(t.float()) if isinstance(t, torch.Tensor) else float(np.float32(t)) for t in outs[: self.n_kernel_scalars]]
        return ks, outs[self.n_kernel_scalars:]


# ----------------------------------------------------------------------------------------------------
# tracing


def _trace(rule: Rule):
    n_states = len(rule.states)
    fake_args = [torch.empty(8), torch.empty(8)]
    for i in range(n_states):
        fake_args.append(torch.zeros((), dtype=torch.float32) if rule.is_scalar_state(i) else torch.empty(8))
    fake_args += [torch.zeros((), dtype=torch.float64) for _ in rule.hparams]

    def flat(*args):
        return tuple(rule.fn(*args))

    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        gm = make_fx(flat, tracing_mode="fake")(*fake_args)
    except Exception as e:  # data-dependent control flow, .item(), ...
        raise EpilogueUnsupported(f"tracing failed: {type(e).__name__}: {e}") from e
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# ----------------------------------------------------------------------------------------------------
# the tile part: one lowering per aten op


def _f32_literal(v) -> str:
    # torch casts a Python scalar to the fp32 compute type (round to nearest); emit that exact value so
    # Triton's own conversion of the literal cannot differ.
    if isinstance(v, bool):
        return "1.0" if v else "0.0"
    f = float(np.float32(v))
    if f != f:
        return "float('nan')"
    if f in (float("inf"), float("-inf")):
        return f"float('{f}')"
    return repr(f)


class _TileGen:
    """Emits Triton statements for the tensor nodes. Values: (expr, kind) with kind in
    'tile' (fp32 tile), 'mask' (bool tile), 'scalar' (fp32 kernel scalar or literal), 'bscalar' (bool)."""

    def __init__(self, target: str):
        self.target = target
        self.lines: list[str] = []
        self.n = 0

    def tmp(self, expr: str, kind: str):
        name = f"t{self.n}"
        self.n += 1
        self.lines.append(f"{name} = {expr}")
        return (name, kind)

    # -- helpers -------------------------------------------------------------------------------------
    @staticmethod
    def f(v):
        """As an fp32 operand (bool tiles/scalars promote to float, as torch's type promotion does)."""
        expr, kind = v
        if kind == "mask":
            return f"{expr}.to(tl.float32)"
        if kind == "bscalar":
            return f"(1.0 if {expr} else 0.0)" if expr in ("True", "False") else f"({expr} != 0.0).to(tl.float32)"
        return expr

    @staticmethod
    def b(v):
        expr, kind = v
        if kind == "mask" or expr in ("True", "False"):
            return expr
        return f"({expr} != 0.0)"

    def fma(self, a, b, c):
        # A true single-rounding FMA. The interpreter's tl.fma is x*y+z in fp32 (two roundings), so there
        # it is computed in fp64 and rounded once more to fp32: the product of two fp32 values is exact in
        # fp64, so only the final double rounding (fp64 sum -> fp32) can differ from a fused op, and that
        # needs the fp64 sum to land exactly on an fp32 rounding boundary (not seen in the tests).
        if self.target == "interpret":
            # (tl.cast, not .to: kernel scalars are plain Python floats in the interpreter)
            return (f"tl.cast(tl.cast({a}, tl.float64) * tl.cast({b}, tl.float64) + tl.cast({c}, tl.float64), tl.float32)")
        return f"tl.fma({a}, {b}, {c})"

    def div(self, a, b_val):
        """torch true division of fp32 operands a / b."""
        bexpr, bkind = b_val
        if bkind == "scalar" and self.target == "cuda":
            # ATen (CUDA): a tensor divided by a CPU scalar is a * (1 / b); the host graph computes 1/b
            # (see recip_of in _build).
            return f"{a} * {bexpr}"
        return f"tl.math.div_rn({a}, {self.f(b_val)})"

    def sqrt(self, a):
        return f"tl.math.sqrt_rn({a})"

    def libdevice(self, name, *args):
        if self.target == "interpret":
            # The interpreter does not patch libdevice; tl.exp/tl.log map to numpy there.
            if name in ("exp", "log"):
                return f"tl.{name}({', '.join(args)})"
            raise EpilogueUnsupported(f"{name} under the Triton interpreter")
        return f"libdevice.{name}({', '.join(args)})"


_CMP = {
    "gt": ">", "ge": ">=", "lt": "<", "le": "<=", "eq": "==", "ne": "!=",
}
_NOOP = {"_to_copy", "clone", "alias", "detach", "lift_fresh_copy", "to", "copy", "contiguous"}


def _opname(target) -> str:
    if isinstance(target, OpOverload):
        return op_overload_name(target)
    return str(getattr(target, "__name__", target)), ""


def _lower(gen: _TileGen, node, args, kwargs, recip_of):
    """Returns the (expr, kind) of one tensor node. ``args`` already hold (expr, kind) for fx nodes and raw
    Python values otherwise. ``recip_of(value)`` returns the host reciprocal scalar of a scalar value."""
    name, overload = _opname(node.target)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype not in (torch.float32, torch.bool):
        raise EpilogueUnsupported(f"{name} produces {val.dtype} (only float32/bool tiles are supported)")

    def v(x):
        """Wrap raw Python numbers as scalar literals."""
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str):
            return x
        if isinstance(x, bool):
            return (str(x), "bscalar")
        if isinstance(x, (int, float)):
            return (_f32_literal(x), "scalar")
        raise EpilogueUnsupported(f"{name}: argument {x!r}")

    F = gen.f
    if name in _NOOP:
        if name == "_to_copy" and kwargs.get("dtype") not in (None, torch.float32):
            raise EpilogueUnsupported(f"_to_copy to {kwargs.get('dtype')}")
        return v(args[0])
    if name in ("add", "sub"):
        a, b = v(args[0]), v(args[1])
        alpha = kwargs.get("alpha", 1)
        if name == "sub":
            alpha = -alpha
        if alpha == 1:
            return gen.tmp(f"{F(a)} + {F(b)}", "tile")
        if alpha == -1:
            return gen.tmp(f"{F(a)} - {F(b)}", "tile")
        # eager: a + alpha * b with the multiply-add fused (CUDA nvcc contraction, CPU fmadd)
        return gen.tmp(gen.fma(_f32_literal(alpha), F(b), F(a)), "tile")
    if name == "rsub":
        a, b = v(args[0]), v(args[1])
        alpha = kwargs.get("alpha", 1)
        if alpha == 1:
            return gen.tmp(f"{F(b)} - {F(a)}", "tile")
        return gen.tmp(gen.fma(_f32_literal(-alpha), F(a), F(b)), "tile")
    if name == "mul":
        a, b = v(args[0]), v(args[1])
        return gen.tmp(f"{F(a)} * {F(b)}", "tile")
    if name == "div":
        if kwargs.get("rounding_mode") is not None:
            raise EpilogueUnsupported(f"div with rounding_mode={kwargs['rounding_mode']!r}")
        a, b = v(args[0]), v(args[1])
        if b[1] == "scalar" and gen.target == "cuda":
            b = recip_of(args[1])
        return gen.tmp(gen.div(F(a), b), "tile")
    if name == "neg":
        return gen.tmp(f"-{F(v(args[0]))}", "tile")
    if name == "sqrt":
        return gen.tmp(gen.sqrt(F(v(args[0]))), "tile")
    if name == "rsqrt":
        return gen.tmp(f"tl.math.rsqrt({F(v(args[0]))})", "tile")
    if name == "reciprocal":
        return gen.tmp(f"tl.math.div_rn(1.0, {F(v(args[0]))})", "tile")
    if name == "abs":
        return gen.tmp(f"tl.abs({F(v(args[0]))})", "tile")
    if name in ("sign", "sgn"):
        x = F(v(args[0]))
        # ATen: (0 < x) - (x < 0); NaN -> 0
        return gen.tmp(f"({x} > 0.0).to(tl.float32) - ({x} < 0.0).to(tl.float32)", "tile")
    if name in ("exp", "log"):
        return gen.tmp(gen.libdevice(name, F(v(args[0]))), "tile")
    if name in ("maximum", "minimum", "max", "min"):
        if len(args) != 2:
            raise EpilogueUnsupported(f"{name} (reduction form)")
        fn = "tl.maximum" if name.startswith("max") else "tl.minimum"
        return gen.tmp(f"{fn}({F(v(args[0]))}, {F(v(args[1]))}, propagate_nan=tl.PropagateNan.ALL)", "tile")
    if name in ("clamp", "clamp_min", "clamp_max", "clip"):
        x = F(v(args[0]))
        if name == "clamp_min":
            lo, hi = args[1], None
        elif name == "clamp_max":
            lo, hi = None, args[1]
        else:
            lo = args[1] if len(args) > 1 else kwargs.get("min")
            hi = args[2] if len(args) > 2 else kwargs.get("max")
        # ATen clamp: min(max(x, lo), hi), NaN in x propagates
        if lo is not None:
            x = gen.tmp(f"tl.maximum({x}, {F(v(lo))}, propagate_nan=tl.PropagateNan.ALL)", "tile")[0]
        if hi is not None:
            x = gen.tmp(f"tl.minimum({x}, {F(v(hi))}, propagate_nan=tl.PropagateNan.ALL)", "tile")[0]
        return (x, "tile")
    if name in _CMP:
        return gen.tmp(f"{F(v(args[0]))} {_CMP[name]} {F(v(args[1]))}", "mask")
    if name in ("logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not"):
        if isinstance(val, torch.Tensor) and val.dtype != torch.bool:
            raise EpilogueUnsupported(f"{name} on {val.dtype}")
        if name.endswith("not"):
            return gen.tmp(f"~{gen.b(v(args[0]))}", "mask")
        op = "&" if name.endswith("and") else "|"
        return gen.tmp(f"{gen.b(v(args[0]))} {op} {gen.b(v(args[1]))}", "mask")
    if name == "where":
        c, a, b = v(args[0]), v(args[1]), v(args[2])
        if val is not None and val.dtype == torch.bool:
            return gen.tmp(f"tl.where({gen.b(c)}, {gen.b(a)}, {gen.b(b)})", "mask")
        return gen.tmp(f"tl.where({gen.b(c)}, {F(a)}, {F(b)})", "tile")
    if name == "pow":
        if overload != "Tensor_Scalar":
            raise EpilogueUnsupported(f"pow.{overload} (only a scalar exponent is supported in a tile)")
        x, e = F(v(args[0])), args[1]
        # ATen's pow_tensor_scalar special cases (CUDA and CPU): the others go to powf
        if e == 2:
            return gen.tmp(f"{x} * {x}", "tile")
        if e == 3:
            return gen.tmp(f"{x} * {x} * {x}", "tile")
        if e == 0.5:
            return gen.tmp(gen.sqrt(x), "tile")
        if e == -0.5:
            return gen.tmp(f"tl.math.rsqrt({x})", "tile")
        if e == -1:
            return gen.tmp(f"tl.math.div_rn(1.0, {x})", "tile")
        if e == -2:
            return gen.tmp(f"tl.math.div_rn(1.0, {x} * {x})", "tile")
        if e == 1:
            return (x, "tile")
        return gen.tmp(gen.libdevice("pow", x, _f32_literal(e)), "tile")
    if name == "addcmul":
        s, t1, t2 = v(args[0]), v(args[1]), v(args[2])
        value = kwargs.get("value", 1)
        if gen.target == "cuda":
            # PointwiseOpsKernel.cu: a + alpha * (b * c), contracted by nvcc
            return gen.tmp(gen.fma(_f32_literal(value), f"({F(t1)} * {F(t2)})", F(s)), "tile")
        # CPU (Vectorized): self + value * t1 * t2, compiled to fmadd(value * t1, t2, self)
        return gen.tmp(gen.fma(f"({_f32_literal(value)} * {F(t1)})", F(t2), F(s)), "tile")
    if name == "addcdiv":
        s, t1, t2 = v(args[0]), v(args[1]), v(args[2])
        value = kwargs.get("value", 1)
        if gen.target == "cuda":
            # PointwiseOpsKernel.cu: a + alpha * (b / c), contracted by nvcc
            return gen.tmp(gen.fma(_f32_literal(value), f"tl.math.div_rn({F(t1)}, {F(t2)})", F(s)), "tile")
        # CPU (Vectorized): self + (value * t1) / t2, no FMA possible
        return gen.tmp(f"{F(s)} + tl.math.div_rn({_f32_literal(value)} * {F(t1)}, {F(t2)})", "tile")
    if name == "lerp":
        s, e, w = F(v(args[0])), F(v(args[1])), F(v(args[2]))
        # ATen Lerp.h: |w| < 0.5 ? self + w * (end - self) : end - (end - self) * (1 - w), both contracted
        d = gen.tmp(f"{e} - {s}", "tile")[0]
        small = gen.fma(w, d, s)
        big = gen.fma(f"-{d}", f"(1.0 - {w})", e)
        return gen.tmp(f"tl.where(tl.abs({w}) < 0.5, {small}, {big})", "tile")
    if name in ("full_like", "zeros_like", "ones_like", "full", "zeros", "ones"):
        fill = {"zeros_like": 0.0, "ones_like": 1.0, "zeros": 0.0, "ones": 1.0}.get(name)
        if fill is None:
            fill = args[1]
        return gen.tmp(f"tl.full([BLOCK_N, BLOCK_K], {_f32_literal(fill)}, tl.float32)", "tile")
    raise EpilogueUnsupported(f"{name}.{overload}" if overload else name)


# ----------------------------------------------------------------------------------------------------
# split + codegen


def _is_tensor_shaped(node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > 0


def _build(rule: Rule, target: str) -> Epilogue:
    gm = _trace(rule)
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    n_states = len(rule.states)
    tensor_names = ["p", "g"]
    env: dict[Any, tuple[str, str]] = {}       # tile-part values
    host_inputs = []                           # placeholders in (scalar states..., hparams...) order
    scalar_state_ph = []
    hparam_ph = placeholders[2 + n_states:]
    env[placeholders[0]] = ("p", "tile")
    env[placeholders[1]] = ("g", "tile")
    for i in range(n_states):
        ph = placeholders[2 + i]
        if rule.is_scalar_state(i):
            scalar_state_ph.append(ph)
        else:
            nm = f"s{i}"
            tensor_names.append(nm)
            env[ph] = (nm, "tile")
    host_inputs = scalar_state_ph + list(hparam_ph)

    # A node is on the tile side if it depends on a tile input or is itself tensor-shaped (full_like...).
    tile_nodes = set(env)
    for n in g.nodes:
        if n.op != "call_function":
            continue
        if _is_tensor_shaped(n) or any(isinstance(a, torch.fx.Node) and a in tile_nodes for a in n.all_input_nodes):
            tile_nodes.add(n)

    out_node = next(n for n in g.nodes if n.op == "output")
    outs = list(out_node.args[0])

    # host graph: copy every non-tile node; outputs = kernel scalars (+ reciprocals) then scalar states
    host = torch.fx.Graph()
    hmap: dict[Any, Any] = {}
    for ph in host_inputs:
        hmap[ph] = host.placeholder(ph.name)
    for n in g.nodes:
        if n.op == "call_function" and n not in tile_nodes:
            hmap[n] = host.node_copy(n, lambda a: hmap[a])

    kernel_scalars: list[Any] = []             # host graph values
    scalar_ref: dict[Any, tuple[str, str]] = {}

    def scalar_arg(key, host_val, is_bool):
        if key not in scalar_ref:
            scalar_ref[key] = (f"c{len(kernel_scalars)}", "bscalar" if is_bool else "scalar")
            kernel_scalars.append(host_val)
        return scalar_ref[key]

    def recip_of(raw):
        if isinstance(raw, torch.fx.Node):
            hv = hmap[raw]
            # 1/b in the scalar's own dtype (float64 for hparams), rounded to fp32 afterwards: this is what
            # eager CUDA computes (verified on the H200: with 1/fp32(b) instead, W differed in 1.75 % of
            # elements whenever fp32(1/b) != 1/fp32(b), e.g. Adam's bias_correction2_sqrt at step 5).
            r = host.call_function(aten.reciprocal.default, (hv,))
            return scalar_arg(("recip", raw), r, False)
        return (_f32_literal(1.0 / float(raw)), "scalar")

    gen = _TileGen(target)
    for n in g.nodes:
        if n not in tile_nodes or n.op != "call_function":
            continue

        def argval(a):
            if isinstance(a, torch.fx.Node):
                if a in env:
                    return env[a]
                val = a.meta.get("val")
                is_bool = isinstance(val, torch.Tensor) and val.dtype == torch.bool
                return scalar_arg(a, hmap[a], is_bool)
            return a

        def raw_or_val(a):
            return argval(a)

        args = tuple(raw_or_val(a) for a in n.args)
        kwargs = {k: raw_or_val(a) for k, a in n.kwargs.items()}

        # recip_of sees the original arg (node or number), not its lowered value
        def recip_for(lowered, _n=n):
            return recip_of(_n.args[1])

        env[n] = _lower(gen, n, args, kwargs, recip_for)

    # outputs
    out_exprs = []
    tensor_out_idx = [0] + [1 + i for i in range(n_states) if not rule.is_scalar_state(i)]
    for j in tensor_out_idx:
        o = outs[j]
        if not isinstance(o, torch.fx.Node):
            raise EpilogueUnsupported(f"output {j} is a constant")
        if o in env:
            e = env[o]
            out_exprs.append(gen.f(e))
        else:  # a tensor output computed only from scalars: broadcast it
            # (-0.0 would come out +0.0 here; a rule whose new param is a constant is not worth more)
            out_exprs.append(f"tl.zeros([BLOCK_N, BLOCK_K], tl.float32) + {scalar_arg(o, hmap[o], False)[0]}")
    new_scalar_states = []
    for i in range(n_states):
        if rule.is_scalar_state(i):
            o = outs[1 + i]
            if isinstance(o, torch.fx.Node) and o in tile_nodes:
                raise EpilogueUnsupported(f"scalar state {rule.states[i]!r} depends on tensors")
            new_scalar_states.append(hmap[o] if isinstance(o, torch.fx.Node) else o)
    host.output(tuple(kernel_scalars) + tuple(new_scalar_states))
    host_gm = torch.fx.GraphModule(torch.nn.Module(), host)

    body = "\n".join("    " + ln for ln in gen.lines)
    key_src = "|".join([rule.name, target, ",".join(tensor_names), body, ";".join(out_exprs), str(len(kernel_scalars))])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    return Epilogue(
        rule_name=rule.name,
        target=target,
        tensor_inputs=tuple(tensor_names),
        body=body,
        outputs=tuple(out_exprs),
        n_kernel_scalars=len(kernel_scalars),
        host=host_gm,
        n_scalar_states=len(scalar_state_ph),
        source_key=key,
    )


_CACHE: dict[tuple[str, str], Epilogue] = {}
_LOCK = threading.Lock()


def compile_epilogue(rule: Rule, target: str = "cuda") -> Epilogue:
    """The rule's epilogue for ``target`` ("cuda" or "interpret"); cached by rule name and target."""
    key = (rule.name, target)
    with _LOCK:
        ep = _CACHE.get(key)
    if ep is None:
        ep = _build(rule, target)
        with _LOCK:
            _CACHE.setdefault(key, ep)
        log.debug("forge: epilogue for rule %r (%s):\n%s", rule.name, target, ep.body)
    return ep


# The head of every Triton kernel module built around the rule: the rule as one jitted function on 2-D fp32 tiles
# (``triton_fields`` fills it; ``module`` names the generator).
TRITON_RULE_HEAD = '''\
# Generated by forge_compile.kernels.{module} for rule {rule!r} ({target}). Do not edit.
import triton
import triton.language as tl
{libdevice_import}


@triton.jit
def _rule(p, g, {state_vars}{scalar_params}BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
{body}
    return {outputs}
'''


def triton_fields(ep: Epilogue, table: bool, ptr: str, key: bool = False) -> dict:
    """Template fields every Triton kernel module built around the rule's ``_rule`` function shares: its text,
    the state variable/pointer lists (pointers: the state names upper-cased), the scalars (``scalar_fields``)."""
    states = ep.tensor_inputs[2:]
    new_vars = [f"new_{v}" for v in ("p", *states)]
    return dict(
        rule=ep.rule_name,
        target=ep.target,
        libdevice_import="from triton.language.extra import libdevice" if ep.target == "cuda" else "",
        state_vars="".join(f"{s}, " for s in states),
        state_ptrs="".join(f"{s.upper()}, " for s in states),
        scalar_params="".join(f"c{i}, " for i in range(ep.n_kernel_scalars)),
        **scalar_fields(ep, table, ptr, "tl.load", key),
        body=ep.body,
        outputs=", ".join(ep.outputs),
        new_vars=", ".join(new_vars),
        new_p=new_vars[0],
    )


def scalar_fields(ep: Epilogue, table: bool, ptr: str, load: str, key: bool = False) -> dict:
    """Template fields for how a kernel receives the rule's scalars ``c0..c{n-1}``.

    Default: one fp32 argument each, host floats at every launch. ``table``: one pointer argument ``ptr`` to the n
    fp32 values in device memory (a row of a scalar table), loaded once at the kernel's start with ``load`` (the
    language's load). Such a launch can be captured in a CUDA graph: the values change between replays, the
    argument does not. The default fields leave the kernel source as it was without the option.

    ``key`` (with ``table``): the row also holds a stochastically rounded weight's element key after the n
    scalars (stochastic_round.table_row: its 32 bits as one fp32 word), loaded into ``EKEY`` -- so the key, new at
    every step, is not a launch argument either.
    """
    n = ep.n_kernel_scalars
    if not table:
        if key:
            raise ValueError("scalar_fields: the round key is read from a scalar table only")
        return dict(kernel_scalar_params="".join(f"c{i}, " for i in range(n)), scalar_loads="")
    lang = load.split(".")[0]
    return dict(kernel_scalar_params=f"{ptr}, ",
                scalar_loads="".join(f"    c{i} = {load}({ptr} + {i})\n" for i in range(n))
                + (key_load(ptr, n, lang) if key else ""))


def key_load(ptr: str, col: int, lang: str = "tl", indent: str = "    ") -> str:
    """The kernel line that reads a rounded update's element key from word ``col`` of its scalar row ``ptr``
    (an fp32 word holding the key's int32 bit pattern: stochastic_round.table_row)."""
    return f"{indent}EKEY = {lang}.load({ptr} + {col}).to({lang}.int32, bitcast=True)\n"


# ----------------------------------------------------------------------------------------------------
# loading generated source (triton.jit reads the function's source file, so it must be a real module)

_MODULES: dict[str, Any] = {}


def kernel_cache_dir() -> str:
    d = os.environ.get("FORGE_KERNEL_CACHE") or os.path.join(tempfile.gettempdir(), "forge_compile_kernels")
    os.makedirs(d, exist_ok=True)
    return d


def load_kernel_module(source: str, key: str):
    """Write ``source`` to <cache>/<key>_<hash>.py (atomically) and import it; one import per process."""
    h = hashlib.sha256(source.encode()).hexdigest()[:16]
    modname = f"forge_kernel_{key}_{h}"
    with _LOCK:
        mod = _MODULES.get(modname)
    if mod is not None:
        return mod
    path = os.path.join(kernel_cache_dir(), modname + ".py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)  # concurrent writers write identical text
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    with _LOCK:
        _MODULES.setdefault(modname, mod)
    return _MODULES[modname]
