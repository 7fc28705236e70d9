"""expecttest snapshots of rewritten pre-Inductor graphs (version-stable printer).
Regenerate with EXPECTTEST_ACCEPT=1 after an intended change, and read the diff."""
import torch
import torch.nn.functional as F
from expecttest import TestCase

import forge_compile as forge
from forge_compile.graph_printer import format_graph
from models import MLP, TinyLM


def _rewritten(step, *args):
    """Capture + rewrite, return the printed rewritten graph and the report."""
    cts = forge.compile_train_step(step)
    captured = {}
    import forge_compile.capture as cap

    orig = cap.write_dump

    def grab(directory, tag, c, r, rep):
        captured["g"], captured["rep"] = r, rep
    cap.write_dump = grab
    try:
        cts.explain(*args)
    finally:
        cap.write_dump = orig
    return captured["g"], captured["rep"]


def _mlp_step(opt_factory):
    model = MLP(4, 6, 3)
    opt = opt_factory(model.parameters())

    def step(x, y):
        loss = F.mse_loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
    return step, (torch.randn(2, 4), torch.randn(2, 3))


def _fused_lines(g):
    return "\n".join(l for l in g.splitlines() if "forge." in l or l.startswith("return"))


class TestSnapshots(TestCase):
    def test_mlp_adamw(self):
        step, args = _mlp_step(lambda p: torch.optim.AdamW(p, lr=1e-3))
        g, _ = _rewritten(step, *args)
        self.assertExpectedInline(g, """""")

    def test_mlp_sgd_momentum(self):
        step, args = _mlp_step(lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9))
        g, _ = _rewritten(step, *args)
        self.assertExpectedInline(_fused_lines(g), """""")

    def test_transformer_block(self):
        model = TinyLM(vocab=10, d=8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()); loss.backward(); opt.step(); opt.zero_grad()
            return loss
        g, rep = _rewritten(step, torch.randint(0, 10, (2, 5)), torch.randint(0, 10, (2, 5)))
        self.assertExpectedInline(_fused_lines(g), """""")

    def test_bf16_autocast(self):
        model = MLP(4, 6, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
            loss.backward(); opt.step(); opt.zero_grad(); return loss
        g, _ = _rewritten(step, torch.randn(2, 4), torch.randn(2, 3))
        self.assertExpectedInline(g, """""")

    def test_unfused_cases_report(self):
        model = TinyLM(vocab=10, d=8, tied=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()); loss.backward()
            torch.nn.utils.clip_grad_norm_([model.block.up.weight], 1.0)
            opt.step(); opt.zero_grad()
            return loss, model.block.down.weight.sum()
        g, rep = _rewritten(step, torch.randint(0, 10, (2, 5)), torch.randint(0, 10, (2, 5)))
        table = "\n".join(f"{r.name}: {'fused' if r.fused else r.reason}" for r in rep.rows)
        self.assertExpectedInline(table, """""")
