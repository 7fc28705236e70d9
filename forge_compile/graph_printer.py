"""A version-stable text form of a pre-Inductor graph, for dumps and expecttest snapshots:
positional names, no ``= None`` tails, no file paths, only op names and arguments."""
from __future__ import annotations

import torch.fx as fx

__all__ = ["format_graph"]


def _op_name(target) -> str:
    s = str(target)
    if s.startswith("aten.") or s.startswith("forge."):
        parts = s.split(".")
        return ".".join(parts[:2]) if parts[-1] in ("default", "Tensor", "Scalar", "int", "dim_IntList") and len(parts) == 3 else s
    return getattr(target, "__name__", s)


def format_graph(gm: fx.GraphModule, *, hide=("aten.detach",)) -> str:
    names, lines, n_in, n_val = {}, [], 0, 0
    alias = {}

    def fmt(a):
        if isinstance(a, fx.Node):
            return names.get(alias.get(a, a), "?")
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]"
        if isinstance(a, str):
            return repr(a)
        return str(a)

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = f"in{n_in}"; n_in += 1
            continue
        if n.op == "output":
            lines.append(f"return {fmt(n.args[0])}")
            continue
        op = _op_name(n.target)
        if op in hide and n.args and isinstance(n.args[0], fx.Node):
            alias[n] = alias.get(n.args[0], n.args[0])
            continue
        args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()
                                          if k not in ("pin_memory", "layout", "device")]
        names[n] = f"v{n_val}"; n_val += 1
        lines.append(f"{names[n]} = {op}({', '.join(args)})")
    return "\n".join(lines)
