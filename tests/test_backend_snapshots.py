"""expecttest snapshots of the Dynamo route's rewritten backward graphs.

The AOT backward graph itself differs between torch versions (decompositions, saved-tensor order), so
this snapshots ``BackwardGraphs.roles``: the fused ops with their inputs named by role (the parameter,
its optimizer states and hyper-parameters, ``tangent``/``saved``/``computed`` for dY and X, ``T(...)``
for a transpose), every read of a fused weight in graph order (it must come before that weight's
update), the write-backs, and which gradients stay. Regenerate with EXPECTTEST_ACCEPT=1 and read the diff."""
import torch
import torch.nn.functional as F
from expecttest import TestCase

import forge_compile.backend as fb
from models import TinyLM
from test_backend import DeepMLP


def _roles(model, opt_factory, x, loss, autocast=False):
    torch._dynamo.reset()
    fb.clear_reports()
    opt = opt_factory(model.parameters()) if opt_factory else None
    cm = torch.compile(model, backend="forge", options={"optimizer": opt}) if opt else \
        torch.compile(model, backend="forge")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = cm(x)
    loss(out.float()).backward()
    return fb.last_graphs()[-1].roles


class TestBackendSnapshots(TestCase):
    def test_deep_mlp_adamw(self):
        g = _roles(DeepMLP(4, 6, 3), lambda p: torch.optim.AdamW(p, lr=1e-3), torch.randn(2, 4),
                   lambda o: o.square().mean())
        self.assertExpectedInline(g, """\
mm reads fc3.weight
wgrad_update_(W=fc3.weight, dy_t=T(tangent), x=saved, states=[step, exp_avg, exp_avg_sq], hparams=[lr, beta1, beta2, eps, weight_decay], rule=adamw[amsgrad=False,maximize=False,weight_decay=True])
mm reads fc2.weight
wgrad_update_(W=fc2.weight, dy_t=T(computed), x=saved, states=[step, exp_avg, exp_avg_sq], hparams=[lr, beta1, beta2, eps, weight_decay], rule=adamw[amsgrad=False,maximize=False,weight_decay=True])
wgrad_update_(W=fc1.weight, dy_t=T(computed), x=saved, states=[step, exp_avg, exp_avg_sq], hparams=[lr, beta1, beta2, eps, weight_decay], rule=adamw[amsgrad=False,maximize=False,weight_decay=True])
copy_(fc3.weight)
copy_(step)
copy_(exp_avg)
copy_(exp_avg_sq)
copy_(fc2.weight)
copy_(step)
copy_(exp_avg)
copy_(exp_avg_sq)
copy_(fc1.weight)
copy_(step)
copy_(exp_avg)
copy_(exp_avg_sq)
gradients: fc1.bias=grad, fc1.weight=None, fc2.bias=grad, fc2.weight=None, fc3.bias=grad, fc3.weight=None""")

    def test_tiny_lm_sgd_momentum_bf16_autocast(self):
        g = _roles(TinyLM(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                   torch.randint(0, 40, (2, 5)), lambda o: o.sum(), autocast=True)
        self.assertExpectedInline(g, """\
wgrad_update_(W=head.weight, dy_t=T(tangent), x=saved, states=[momentum_buffer], hparams=[lr, momentum, dampening], rule=sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False])
wgrad_update_(W=block.down.weight, dy_t=T(computed), x=saved, states=[momentum_buffer], hparams=[lr, momentum, dampening], rule=sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False])
wgrad_update_(W=block.up.weight, dy_t=T(computed), x=saved, states=[momentum_buffer], hparams=[lr, momentum, dampening], rule=sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False])
wgrad_update_(W=block.proj.weight, dy_t=T(computed), x=saved, states=[momentum_buffer], hparams=[lr, momentum, dampening], rule=sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False])
wgrad_update_(W=block.qkv.weight, dy_t=T(computed), x=saved, states=[momentum_buffer], hparams=[lr, momentum, dampening], rule=sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False])
embedding_update_(W=emb.weight, grad_output=computed, indices=saved, states=[momentum_buffer], hparams=[lr, momentum, dampening], rule=sgd[momentum=True,nesterov=False,weight_decay=False,maximize=False], padding_idx=-1)
copy_(head.weight)
copy_(momentum_buffer)
copy_(block.down.weight)
copy_(momentum_buffer)
copy_(block.up.weight)
copy_(momentum_buffer)
copy_(block.proj.weight)
copy_(momentum_buffer)
copy_(block.qkv.weight)
copy_(momentum_buffer)
copy_(emb.weight)
copy_(momentum_buffer)
gradients: block.down.bias=grad, block.down.weight=None, block.ln1.bias=grad, block.ln1.weight=grad, block.ln2.bias=grad, block.ln2.weight=grad, block.proj.weight=None, block.qkv.weight=None, block.up.bias=grad, block.up.weight=None, emb.weight=None, head.weight=None""")

    def test_no_optimizer_nothing_rewritten(self):
        g = _roles(DeepMLP(4, 6, 3), None, torch.randn(2, 4), lambda o: o.sum())
        self.assertExpectedInline(g, """nothing rewritten: nothing fused: no optimizer was given (options={'optimizer': opt})""")
