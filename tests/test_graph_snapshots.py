"""expecttest snapshots of rewritten pre-Inductor graphs (version-stable printer).
Regenerate with EXPECTTEST_ACCEPT=1 after an intended change, and read the diff."""
import re

import torch
import torch.nn.functional as F
from expecttest import TestCase

import forge_compile as forge
from forge_compile.graph_printer import format_graph
from models import MLP, TinyLM, one_rank_group


def _rewritten(step, *args, cuda_graphs=False, **options):
    """Capture + rewrite, return the printed rewritten graph and the report."""
    cts = forge.compile_train_step(step, cuda_graphs=cuda_graphs, **options)
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


def _ddp_mlp_rewritten(opt_factory, cuda_graphs=False):
    """``_rewritten`` of an MLP step under DistributedDataParallel over one gloo rank in this process (1 token: the
    gathered operands fit the rule); with ``cuda_graphs`` judged for a CPU "graph device"."""
    with one_rank_group():
        model = torch.nn.parallel.DistributedDataParallel(MLP(8, 16, 4))
        opt = opt_factory(model.parameters())

        def step(x, y):
            loss = F.mse_loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
        return _rewritten_on_cpu_graphs(step, torch.randn(1, 8), torch.randn(1, 4)) if cuda_graphs else \
            _rewritten(step, torch.randn(1, 8), torch.randn(1, 4))


def _rewritten_on_cpu_graphs(step, *args):
    """``_rewritten`` with cuda_graphs, the replay judged for a CPU "graph device"."""
    from forge_compile import step_graph as sg

    sg.GRAPH_DEVICE[0] = "cpu"
    try:
        return _rewritten(step, *args, cuda_graphs=True)
    finally:
        sg.GRAPH_DEVICE[0] = "cuda"


def _fused_lines(g):
    return "\n".join(l for l in g.splitlines() if "forge." in l or l.startswith("return"))


def _two_linear_autocast_step():
    """Two bias-free linears on 3-D activations, SGD, bf16 CPU autocast: the step of the weight-copy snapshots."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False), torch.nn.Linear(6, 3, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward(); opt.step(); opt.zero_grad(); return loss
    return step


class TestSnapshots(TestCase):
    def test_mlp_adamw(self):
        step, args = _mlp_step(lambda p: torch.optim.AdamW(p, lr=1e-3))
        g, _ = _rewritten(step, *args)
        self.assertExpectedInline(g, """\
v0 = aten.t(in0)
v1 = aten.addmm(in1, in36, v0)
v2 = aten.gelu(v1)
v3 = aten.t(in2)
v4 = aten.addmm(in3, v2, v3)
v5 = aten.mse_loss(v4, in37)
v6 = aten.ones_like(v5, memory_format=torch.preserve_format)
v7 = aten.mse_loss_backward(v6, v4, in37, 1)
v8 = aten.t(v3)
v9 = aten.mm(v7, v8)
v10 = aten.t(v7)
v11 = aten.gelu(v1)
v12 = forge.wgrad_update_(in2, v10, v11, [in10, in11, in12], [in26, in27, in28, in29, in30], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v13 = aten.sum(v7, [0], True)
v14 = aten.view(v13, [3])
v15 = aten.gelu_backward(v9, v1)
v16 = aten.t(v15)
v17 = forge.wgrad_update_(in0, v16, in36, [in4, in5, in6], [in16, in17, in18, in19, in20], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v18 = aten.sum(v15, [0], True)
v19 = aten.view(v18, [6])
v20 = forge.apply_rule_(in1, v19, [in7, in8, in9], [in21, in22, in23, in24, in25], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v21 = forge.apply_rule_(in3, v14, [in13, in14, in15], [in31, in32, in33, in34, in35], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
return [v5]""")

    def test_mlp_sgd_momentum(self):
        step, args = _mlp_step(lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9))
        g, _ = _rewritten(step, *args)
        self.assertExpectedInline(_fused_lines(g), """\
v12 = forge.wgrad_update_(in2, v10, v11, [in6], [in14, in15, in16], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]')
v17 = forge.wgrad_update_(in0, v16, in20, [in4], [in8, in9, in10], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]')
v20 = forge.apply_rule_(in1, v19, [in5], [in11, in12, in13], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]')
v21 = forge.apply_rule_(in3, v14, [in7], [in17, in18, in19], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]')
return [v5]""")

    def test_transformer_block(self):
        model = TinyLM(vocab=10, d=8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()); loss.backward(); opt.step(); opt.zero_grad()
            return loss
        g, rep = _rewritten(step, torch.randint(0, 10, (2, 5)), torch.randint(0, 10, (2, 5)))
        self.assertExpectedInline(_fused_lines(g), """\
v77 = forge.wgrad_update_(in11, v74, v60, [in45, in46, in47], [in103, in104, in105, in106, in107], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v85 = forge.wgrad_update_(in9, v82, v84, [in39, in40, in41], [in93, in94, in95, in96, in97], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v94 = forge.wgrad_update_(in7, v93, v49, [in33, in34, in35], [in83, in84, in85, in86, in87], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v107 = forge.wgrad_update_(in4, v104, v41, [in24, in25, in26], [in68, in69, in70, in71, in72], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v138 = forge.wgrad_update_(in3, v135, v6, [in21, in22, in23], [in63, in64, in65, in66, in67], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v145 = forge.embedding_update_(in0, v144, in108, [in12, in13, in14], [in48, in49, in50, in51, in52], 'adamw[amsgrad=False,maximize=False,weight_decay=True]', -1)
v146 = forge.apply_rule_(in1, v142, [in15, in16, in17], [in53, in54, in55, in56, in57], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v147 = forge.apply_rule_(in2, v143, [in18, in19, in20], [in58, in59, in60, in61, in62], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v148 = forge.apply_rule_(in5, v100, [in27, in28, in29], [in73, in74, in75, in76, in77], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v149 = forge.apply_rule_(in6, v101, [in30, in31, in32], [in78, in79, in80, in81, in82], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v150 = forge.apply_rule_(in8, v96, [in36, in37, in38], [in88, in89, in90, in91, in92], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v151 = forge.apply_rule_(in10, v87, [in42, in43, in44], [in98, in99, in100, in101, in102], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
return [v67]""")

    def test_bf16_autocast(self):
        model = MLP(4, 6, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
            loss.backward(); opt.step(); opt.zero_grad(); return loss
        g, _ = _rewritten(step, torch.randn(2, 4), torch.randn(2, 3))
        self.assertExpectedInline(g, """\
v0 = aten._to_copy(in1, dtype=torch.bfloat16)
v1 = aten._to_copy(in0, dtype=torch.bfloat16)
v2 = aten._to_copy(in36, dtype=torch.bfloat16)
v3 = aten.t(v1)
v4 = aten.addmm(v0, v2, v3)
v5 = aten.gelu(v4)
v6 = aten._to_copy(in3, dtype=torch.bfloat16)
v7 = aten._to_copy(in2, dtype=torch.bfloat16)
v8 = aten.t(v7)
v9 = aten.addmm(v6, v5, v8)
v10 = aten._to_copy(v9, dtype=torch.float32)
v11 = aten.mse_loss(v10, in37)
v12 = aten.ones_like(v11, memory_format=torch.preserve_format)
v13 = aten.mse_loss_backward(v12, v10, in37, 1)
v14 = aten._to_copy(v13, dtype=torch.bfloat16)
v15 = forge.cast_after(in2, v14, torch.bfloat16)
v16 = aten.t(v15)
v17 = aten.t(v16)
v18 = aten.mm(v14, v17)
v19 = aten.t(v14)
v20 = aten.gelu(v4)
v21 = forge.wgrad_update_(in2, v19, v20, [in10, in11, in12], [in26, in27, in28, in29, in30], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v22 = aten.sum(v14, [0], True)
v23 = aten.view(v22, [3])
v24 = aten._to_copy(v23, dtype=torch.float32)
v25 = aten.gelu_backward(v18, v4)
v26 = aten.t(v25)
v27 = forge.cast_after(in36, v26, torch.bfloat16)
v28 = forge.wgrad_update_(in0, v26, v27, [in4, in5, in6], [in16, in17, in18, in19, in20], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v29 = aten.sum(v25, [0], True)
v30 = aten.view(v29, [6])
v31 = aten._to_copy(v30, dtype=torch.float32)
v32 = forge.apply_rule_(in1, v31, [in7, in8, in9], [in21, in22, in23, in24, in25], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v33 = forge.apply_rule_(in3, v24, [in13, in14, in15], [in31, in32, in33, in34, in35], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
return [v11]""")

    def test_unfused_cases_report(self):
        model = TinyLM(vocab=10, d=8, tied=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()); loss.backward()
            torch.nn.utils.clip_grad_value_([model.block.up.weight], 1.0)
            opt.step(); opt.zero_grad()
            return loss, model.block.down.weight.sum()
        g, rep = _rewritten(step, torch.randint(0, 10, (2, 5)), torch.randint(0, 10, (2, 5)))
        table = "\n".join(f"{r.name}: {'fused' if r.fused else r.reason}" for r in rep.rows)
        self.assertExpectedInline(table, """\
model.emb.weight: fused
model.block.ln1.weight: not a matrix (normal path)
model.block.ln1.bias: not a matrix (normal path)
model.block.qkv.weight: fused
model.block.proj.weight: fused
model.block.ln2.weight: not a matrix (normal path)
model.block.ln2.bias: not a matrix (normal path)
model.block.up.weight: gradient is modified in place by aten.clamp_.default before the update (e.g. clip_grad_value_)
model.block.up.bias: not a matrix (normal path)
model.block.down.weight: W is read after its update (by aten.sum.default)
model.block.down.bias: not a matrix (normal path)""")

    def test_mlp_clip_grad_norm(self):
        # clip_grad_norm_: each fused weight's norm from its dY and X (forge.wgrad_sqnorm), the coefficient copied
        # to the host once (forge.host_scalar) and applied by the scaled rule in the update; the biases keep
        # torch's norm and in-place scaling
        model = MLP(4, 6, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(x, y):
            loss = F.mse_loss(model(x), y); loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad(); return loss
        g, _ = _rewritten(step, torch.randn(2, 4), torch.randn(2, 3))
        rows = "\n".join(ln for ln in g.splitlines() if any(k in ln for k in ("forge.", "norm", "mul_", "clamp")))
        self.assertExpectedInline(rows, """\
v17 = forge.wgrad_sqnorm(v14, in36)
v19 = aten.linalg_vector_norm(v16, 2.0)
v20 = forge.wgrad_sqnorm(v10, v2)
v22 = aten.linalg_vector_norm(v12, 2.0)
v24 = aten.linalg_vector_norm(v23, 2.0)
v28 = aten.clamp(v27, None, 1.0)
v29 = forge.host_scalar(v28)
v30 = forge.wgrad_update_(in2, v10, v2, [in10, in11, in12], [in26, in27, in28, in29, in30, v29], 'grad_scaled(adamw[amsgrad=False,maximize=False,weight_decay=True])')
v31 = forge.wgrad_update_(in0, v14, in36, [in4, in5, in6], [in16, in17, in18, in19, in20, v29], 'grad_scaled(adamw[amsgrad=False,maximize=False,weight_decay=True])')
v32 = aten.mul_(v16, v28)
v33 = aten.mul_(v12, v28)
v34 = forge.apply_rule_(in1, v32, [in7, in8, in9], [in21, in22, in23, in24, in25], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v35 = forge.apply_rule_(in3, v33, [in13, in14, in15], [in31, in32, in33, in34, in35], 'adamw[amsgrad=False,maximize=False,weight_decay=True]')""")

    def test_tied_lm_clip_grad_norm(self):
        # a clipped tied embedding / output weight (padding row 3): its norm from the output matmul's operands and
        # the embedding backward's inputs (forge.embedding_sqnorm, no dense gradient), the coefficient in its one
        # fused update, which adds the embedding's rows to the matmul's dW tile (emb_* arguments)
        torch.manual_seed(0)
        model = TinyLM(vocab=10, d=8, tied=True)
        model.emb.padding_idx = 3
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()); loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad(); return loss
        g, rep = _rewritten(step, torch.randint(0, 10, (2, 3)), torch.randint(0, 10, (2, 3)))
        self.assertIn("tied: the output matmul's dW + the embedding's rows, gradient scaled in the update",
                      rep.row("model.emb.weight").reason)
        rows = "\n".join(ln for ln in g.splitlines() if "embedding" in ln or "host_scalar" in ln
                         or "forge.wgrad_update_(in0," in ln)
        self.assertExpectedInline(rows, """\
v0 = aten.embedding(in0, in55, 3)
v138 = forge.embedding_sqnorm(v137, in55, 10, 3, dy_t=v74, x=v60)
v160 = forge.host_scalar(v159)
v165 = forge.wgrad_update_(in0, v74, v60, [in11], [in22, in23, in24, v160], 'grad_scaled(sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False])', emb_grad_output=v137, emb_indices=in55, emb_padding_idx=3)""")

    def test_mlp_accumulated_passes(self):
        # backward() per micro-batch: fc1's gradient (2 passes of 1 token, 192 B of dY and X <= half its 512 B dW)
        # becomes one fused update over both passes' dY rows and X concatenated (dy_t = the rows' concatenation,
        # permuted: a view); fc2's operands (160 B) outweigh half its 256 B dW, so it stays the sum of two mms
        model = MLP(8, 16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(xs, ys):
            for x, y in zip(xs, ys):
                loss = F.mse_loss(model(x), y) / 2; loss.backward()
            opt.step(); opt.zero_grad(); return loss
        g, rep = _rewritten(step, [torch.randn(1, 8), torch.randn(1, 8)], [torch.randn(1, 4), torch.randn(1, 4)])
        self.assertIn("outweighing the fp32 dW (256 B)", rep.row("model.fc2.weight").reason)
        rows = "\n".join(ln for ln in g.splitlines() if any(k in ln for k in ("forge.", "cat", "aten.mm", "add_")))
        self.assertExpectedInline(rows, """\
v11 = aten.mm(v9, v10)
v13 = aten.mm(v12, v2)
v33 = aten.mm(v31, v32)
v36 = aten.mm(v34, v35)
v40 = aten.add_(v16, v39)
v42 = aten.add_(v17, v41)
v47 = aten.cat([v45, v46], 0)
v48 = aten.cat([in8, in9], 0)
v50 = forge.wgrad_update_(in0, v49, v48, [], [in4], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
v53 = aten.add_(v21, v52)
v54 = forge.apply_rule_(in1, v53, [], [in5], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
v55 = forge.apply_rule_(in2, v42, [], [in6], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
v56 = forge.apply_rule_(in3, v40, [], [in7], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')""")

    def test_mlp_ddp(self):
        # DistributedDataParallel (one gloo rank in this process): each gradient the mean over the ranks
        # (x 1/world, all_reduce) as DDP's reducer makes it; a fused weight's update reads every rank's dY rows and
        # X all-gathered (dy_t = the gathered rows, permuted: a view) and scales dW by 1/world in its epilogue
        # (grad_scaled rule, a CPU constant as its last hyper-parameter); the biases keep the all_reduce
        g, rep = _ddp_mlp_rewritten(lambda p: torch.optim.SGD(p, lr=0.1))
        self.assertIn("data parallel: the mean over 1 ranks", rep.row("model.module.fc1.weight").reason)
        keys = ("forge.", "all_gather", "all_reduce", "wait_tensor", "aten.full", "aten.mul(", "permute")
        # the group's name is the process's count of groups made so far: not part of what is checked
        rows = "\n".join(re.sub(r"'\d+'\)$", "'<group>')", ln) for ln in g.splitlines() if any(k in ln for k in keys))
        self.assertExpectedInline(rows, """\
v0 = aten.full([], 1.0, dtype=torch.float32)
v1 = forge.host_scalar(v0)
v13 = aten.permute(v12, [1, 0])
v14 = all_gather_into_tensor.default(v13, 1, '<group>')
v15 = wait_tensor.default(v14)
v17 = all_gather_into_tensor.default(v16, 1, '<group>')
v18 = wait_tensor.default(v17)
v19 = aten.permute(v15, [1, 0])
v20 = forge.wgrad_update_(in2, v19, v18, [], [in6, v1], 'grad_scaled(sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False])')
v23 = aten.mul(v22, 1.0)
v24 = all_reduce.default(v23, 'sum', '<group>')
v25 = wait_tensor.default(v24)
v28 = aten.permute(v27, [1, 0])
v29 = all_gather_into_tensor.default(v28, 1, '<group>')
v30 = wait_tensor.default(v29)
v31 = all_gather_into_tensor.default(in8, 1, '<group>')
v32 = wait_tensor.default(v31)
v33 = aten.permute(v30, [1, 0])
v34 = forge.wgrad_update_(in0, v33, v32, [], [in4, v1], 'grad_scaled(sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False])')
v37 = aten.mul(v36, 1.0)
v38 = all_reduce.default(v37, 'sum', '<group>')
v39 = wait_tensor.default(v38)
v40 = forge.apply_rule_(in1, v39, [], [in5], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
v41 = forge.apply_rule_(in3, v25, [], [in7], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')""")

    def test_mlp_ddp_scalar_table(self):
        # cuda_graphs under DDP: a fused update's 1/world factor goes into grad_scale's column of its table row (the
        # step writes it there, as clip_grad_norm_'s coefficient), so the replayed graph reads no host value
        g, rep = _ddp_mlp_rewritten(lambda p: torch.optim.AdamW(p, lr=1e-3), cuda_graphs=True)
        notes = " ".join(rep.notes)
        self.assertIn("replayed as one CUDA graph; 4 updates", notes)
        self.assertIn("2 fused updates read their gradient factor", notes)
        rows = "\n".join(ln for ln in g.splitlines() if "forge." in ln or "aten.select" in ln or "aten.full" in ln)
        self.assertExpectedInline(rows, """\
v0 = aten.full([], 1.0, dtype=torch.float32)
v19 = aten.select(in38, 0, 0)
v20 = aten.select_scatter(v19, v0, 0, 0)
v21 = forge.wgrad_update_table_(in2, v18, v17, [in11, in12], v20, 'grad_scaled(adamw[amsgrad=False,maximize=False,weight_decay=True])')
v35 = aten.select(in38, 0, 1)
v36 = aten.select_scatter(v35, v0, 0, 0)
v37 = forge.wgrad_update_table_(in0, v34, v33, [in5, in6], v36, 'grad_scaled(adamw[amsgrad=False,maximize=False,weight_decay=True])')
v43 = aten.select(in38, 0, 2)
v44 = forge.rule_update_(in1, v42, [in8, in9], v43, 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v45 = aten.select(in38, 0, 3)
v46 = forge.rule_update_(in3, v26, [in14, in15], v45, 'adamw[amsgrad=False,maximize=False,weight_decay=True]')""")

    def test_ddp_weights_reading_one_input_gather_it_once(self):
        # q/k/v, gate/up: two weights reading one X gather it once (3 all-gathers: X, dY_a, dY_b, not 4)
        class TwoHeads(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=False)

            def forward(self, x):
                return self.a(x) * self.b(x)
        with one_rank_group():
            model = torch.nn.parallel.DistributedDataParallel(TwoHeads())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def step(x):
                loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad(); return loss
            g, rep = _rewritten(step, torch.randn(1, 2, 8))
        self.assertEqual(len(rep.fused), 2)
        self.assertEqual(sum("all_gather" in ln for ln in g.splitlines()), 3)

    def test_mlp_adamw_scalar_table(self):
        # cuda_graphs: every update reads row r of the table (last input); judged here for a CPU "graph device"
        step, args = _mlp_step(lambda p: torch.optim.AdamW(p, lr=1e-3))
        g, rep = _rewritten_on_cpu_graphs(step, *args)
        self.assertIn("replayed as one CUDA graph; 4 updates", " ".join(rep.notes))
        rows = "\n".join(ln for ln in g.splitlines() if "forge." in ln or "aten.select" in ln)
        self.assertExpectedInline(rows, """\
v12 = aten.select(in38, 0, 0)
v13 = forge.wgrad_update_table_(in2, v10, v11, [in11, in12], v12, 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v18 = aten.select(in38, 0, 1)
v19 = forge.wgrad_update_table_(in0, v17, in36, [in5, in6], v18, 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v22 = aten.select(in38, 0, 2)
v23 = forge.rule_update_(in1, v21, [in8, in9], v22, 'adamw[amsgrad=False,maximize=False,weight_decay=True]')
v24 = aten.select(in38, 0, 3)
v25 = forge.rule_update_(in3, v15, [in14, in15], v24, 'adamw[amsgrad=False,maximize=False,weight_decay=True]')""")


    def test_cast_weights_in_update(self):
        # the model of test_recompute_weight_copies: each weight's bf16 cast is gone, the forward's and the
        # backward's mms read a copy input (between the hyper-parameters and the step's argument, now in6; in the
        # fused updates' order: in4 the second layer's, in5 the first's), and each fused update -- after every
        # reader of its copy, so after the second layer's dX mm -- writes the new weight's copy into it
        g, rep = _rewritten(_two_linear_autocast_step(), torch.randn(2, 5, 4), cast_weights_in_update=True)
        self.assertIn("2 fused weights' low-precision copies are written by their update", " ".join(rep.notes))
        self.assertExpectedInline(g, """\
v0 = aten._to_copy(in6, dtype=torch.bfloat16)
v1 = aten.t(in5)
v2 = aten.view(v0, [10, 4])
v3 = aten.mm(v2, v1)
v4 = aten._unsafe_view(v3, [2, 5, 6])
v5 = aten.t(in4)
v6 = aten.view(v4, [10, 6])
v7 = aten.mm(v6, v5)
v8 = aten._unsafe_view(v7, [2, 5, 3])
v9 = aten._to_copy(v8, dtype=torch.float32)
v10 = aten.pow.Tensor_Scalar(v9, 2)
v11 = aten.mean(v10)
v12 = aten.ones_like(v11, memory_format=torch.preserve_format)
v13 = aten.expand(v12, [2, 5, 3])
v14 = aten.div(v13, 30)
v15 = aten.pow.Tensor_Scalar(v9, 1.0)
v16 = aten.mul(v15, 2.0)
v17 = aten.mul(v14, v16)
v18 = aten._to_copy(v17, dtype=torch.bfloat16)
v19 = aten.view(v18, [10, 3])
v20 = aten.t(v19)
v21 = aten.t(v5)
v22 = aten.mm(v19, v21)
v23 = forge.wgrad_update_(in1, v20, v6, [], [in3], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]', cast_out=in4)
v24 = aten.view(v22, [2, 5, 6])
v25 = aten.view(v24, [10, 6])
v26 = aten.t(v25)
v27 = forge.cast_after(in6, v26, torch.bfloat16)
v28 = aten.view(v27, [10, 4])
v29 = forge.wgrad_update_(in0, v26, v28, [], [in2], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]', cast_out=in5)
return [v11]""")

    def test_recompute_weight_copies(self):
        # two bias-free linears on 3-D activations under bf16 autocast. Default: autograd computes the second
        # layer's dW before its dX, the fused update follows its dW mm, and dX reads the forward's bf16 copy (kept
        # across the boundary). recompute_weight_copies: the update follows the dX mm, which reads a copy cast
        # again right before it; the first layer needs no dX (its input needs no gradient), so its copy is not
        # read in the backward either way.
        step = _two_linear_autocast_step()
        x = torch.randn(2, 5, 4)
        kept, _ = _rewritten(step, x)
        g, rep = _rewritten(step, x, recompute_weight_copies=True)
        self.assertIn("no parameter's cast copy is kept", " ".join(rep.notes))
        # the two graphs agree up to the backward of the second layer; the snapshots show that part once
        lines, glines = kept.splitlines(), g.splitlines()
        n = next(i for i, (a, b) in enumerate(zip(lines, glines)) if a != b)
        self.assertExpectedInline("\n".join(lines[:n]), """\
v0 = aten._to_copy(in0, dtype=torch.bfloat16)
v1 = aten._to_copy(in4, dtype=torch.bfloat16)
v2 = aten.t(v0)
v3 = aten.view(v1, [10, 4])
v4 = aten.mm(v3, v2)
v5 = aten._unsafe_view(v4, [2, 5, 6])
v6 = aten._to_copy(in1, dtype=torch.bfloat16)
v7 = aten.t(v6)
v8 = aten.view(v5, [10, 6])
v9 = aten.mm(v8, v7)
v10 = aten._unsafe_view(v9, [2, 5, 3])
v11 = aten._to_copy(v10, dtype=torch.float32)
v12 = aten.pow.Tensor_Scalar(v11, 2)
v13 = aten.mean(v12)
v14 = aten.ones_like(v13, memory_format=torch.preserve_format)
v15 = aten.expand(v14, [2, 5, 3])
v16 = aten.div(v15, 30)
v17 = aten.pow.Tensor_Scalar(v11, 1.0)
v18 = aten.mul(v17, 2.0)
v19 = aten.mul(v16, v18)
v20 = aten._to_copy(v19, dtype=torch.bfloat16)
v21 = aten.view(v20, [10, 3])
v22 = aten.t(v21)""")
        self.assertExpectedInline("\n".join(lines[n:]), """\
v23 = forge.wgrad_update_(in1, v22, v8, [], [in3], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
v24 = aten.t(v7)
v25 = aten.mm(v21, v24)
v26 = aten.view(v25, [2, 5, 6])
v27 = aten.view(v26, [10, 6])
v28 = aten.t(v27)
v29 = forge.cast_after(in4, v28, torch.bfloat16)
v30 = aten.view(v29, [10, 4])
v31 = forge.wgrad_update_(in0, v28, v30, [], [in2], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
return [v13]""")
        self.assertExpectedInline("\n".join(glines[n:]), """\
v23 = forge.cast_after(in1, v22, torch.bfloat16)
v24 = aten.t(v23)
v25 = aten.t(v24)
v26 = aten.mm(v21, v25)
v27 = forge.wgrad_update_(in1, v22, v8, [], [in3], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
v28 = aten.view(v26, [2, 5, 6])
v29 = aten.view(v28, [10, 6])
v30 = aten.t(v29)
v31 = forge.cast_after(in4, v30, torch.bfloat16)
v32 = aten.view(v31, [10, 4])
v33 = forge.wgrad_update_(in0, v30, v32, [], [in2], 'sgd[momentum=False,nesterov=False,weight_decay=False,maximize=False]')
return [v13]""")

    def test_mlp_bf16_stochastic_rounding(self):
        # bf16 weights: the fused updates take the step's round key (a graph input after the hyper-parameters) and
        # the parameter's salt; the biases' unfused updates round with the same key
        model = MLP(4, 6, 3).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

        def step(x, y):
            loss = F.mse_loss(model(x).float(), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
        g, rep = _rewritten(step, torch.randn(2, 4).to(torch.bfloat16), torch.randn(2, 3), stochastic_rounding=True)
        self.assertExpectedInline(_fused_lines(g), """\
v14 = forge.wgrad_update_rounded_(in2, v12, v13, [in6], [in14, in15, in16], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]', in20, 2)
v19 = forge.wgrad_update_rounded_(in0, v18, in21, [in4], [in8, in9, in10], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]', in20, 0)
v22 = forge.apply_rule_(in1, v21, [in5], [in11, in12, in13], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]', in20, 1)
v23 = forge.apply_rule_(in3, v16, [in7], [in17, in18, in19], 'sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False]', in20, 3)
return [v6]""")
        self.assertExpectedInline("\n".join(n for n in rep.notes if "stochastic" in n), """stochastic_rounding: 4 bf16 parameters are updated in fp32 and stored rounded stochastically, 2 of them by fused updates (from the fp32 dW)""")

    def test_mlp_adamw8bit(self):
        # forge.optim.AdamW8bit, every parameter 8-bit: each update is forge::apply_rule_q8_ (codes, scales, the scalar
        # step, the hyper-parameters, the key computed from the step in the graph -- hoisted to the graph's start --,
        # the parameter's index); the matrices' become forge::wgrad_update_q8_ right after their matmul (v168 after
        # the mm of v165: not at the end, which would keep every dY and X alive), the vectors' stay apply_rule_q8_
        from forge_compile.optim import AdamW8bit

        step, args = _mlp_step(lambda p: AdamW8bit(p, lr=1e-3, min_8bit_size=1))
        g, rep = _rewritten(step, *args)
        self.assertExpectedInline(_fused_lines(g), """\
v168 = forge.wgrad_update_q8_(in2, v166, v167, [in15, in17], [in16, in18], [in14], [in34, in35, in36, in37, in38], 'adamw[amsgrad=False,maximize=False,weight_decay=True]', v116, 2)
v173 = forge.wgrad_update_q8_(in0, v172, in44, [in5, in7], [in6, in8], [in4], [in24, in25, in26, in27, in28], 'adamw[amsgrad=False,maximize=False,weight_decay=True]', v38, 0)
v176 = forge.apply_rule_q8_(in1, v175, [in10, in12], [in11, in13], [in9], [in29, in30, in31, in32, in33], 'adamw[amsgrad=False,maximize=False,weight_decay=True]', v77, 1)
v177 = forge.apply_rule_q8_(in3, v170, [in20, in22], [in21, in23], [in19], [in39, in40, in41, in42, in43], 'adamw[amsgrad=False,maximize=False,weight_decay=True]', v155, 3)
return [v161]""")
        self.assertExpectedInline(str(rep), """\
forge fusion report (train_step): 2 of 4 parameter updates fused, 168 B of weight gradients never allocated
parameter         shape  fused  rule                                                   dW never allocated  reason
----------------  -----  -----  -----------------------------------------------------  ------------------  --------------------------
model.fc1.weight  6x4    yes    adamw[amsgrad=False,maximize=False,weight_decay=True]  96 B                8-bit states
model.fc1.bias    6      no     adamw[amsgrad=False,maximize=False,weight_decay=True]  -                   not a matrix (normal path)
model.fc2.weight  3x6    yes    adamw[amsgrad=False,maximize=False,weight_decay=True]  72 B                8-bit states
model.fc2.bias    3      no     adamw[amsgrad=False,maximize=False,weight_decay=True]  -                   not a matrix (normal path)""")
