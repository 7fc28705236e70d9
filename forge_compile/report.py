"""The fusion report: what forge fused, what it left alone, and why."""
from __future__ import annotations

import dataclasses

from .passes.wgrad_update_pattern import FusionDecision

__all__ = ["FusionReport"]


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclasses.dataclass
class FusionReport:
    rows: list[FusionDecision]
    graph: str = ""          # "train_step" or "backward"
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def fused(self) -> list[FusionDecision]:
        return [r for r in self.rows if r.fused]

    @property
    def unfused(self) -> list[FusionDecision]:
        return [r for r in self.rows if not r.fused]

    @property
    def dw_bytes_saved(self) -> int:
        return sum(r.dw_bytes_saved for r in self.rows)

    def row(self, name: str) -> FusionDecision:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        head = ("parameter", "shape", "fused", "rule", "dW never allocated", "reason")
        body = [(r.name, "x".join(map(str, r.shape)) or "()", "yes" if r.fused else "no", r.rule,
                 _fmt_bytes(r.dw_bytes_saved) if r.fused else "-", r.reason) for r in self.rows]
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body)] if body else [len(h) for h in head]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
        out = [f"forge fusion report ({self.graph or 'graph'}): {len(self.fused)} of {len(self.rows)} "
               f"parameter updates fused, {_fmt_bytes(self.dw_bytes_saved)} of weight gradients never allocated",
               line(head), line(["-" * w for w in widths])]
        out += [line(b) for b in body]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    __repr__ = __str__
