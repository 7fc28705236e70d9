"""optim/optimizer8bit.py: optimizers with 8-bit block-wise states (AdamW8bit, Lion8bit, Rule8bitOptimizer). Their
8-bit parameters' updates are the spec (q8_state.reference_q8_update with the rule, bitwise; on CPU the blocked CPU
path, under the interpreter and on CUDA the Triton kernel), AdamW8bit's small parameters torch.optim.AdamW's, a
checkpoint resumes bitwise and AdamW8bit follows fp32 AdamW on a regression. compile_train_step with them:
tests/test_train_step_8bit.py."""
import contextlib
import copy
import os

import pytest
import torch

from interpreter import run_child
from models import CorrectlyRoundedSqrt
import forge_compile as forge
from forge_compile.kernels import q8_state as q8
from forge_compile.kernels.stochastic_round import round_key
from forge_compile.optim import AdamW8bit, Lion8bit, Rule8bitOptimizer, adamw_rule, lion_rule, sgd_rule

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    # 300 x 200 (8-bit: 60000 elements, K = 200 a ragged last block), 6 x 300 (1800 < 4096: torch's states), biases
    return torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.Tanh(), torch.nn.Linear(300, 6)).to(device, dtype)


def _batches(n, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 200, generator=g).to(device, dtype), torch.randn(32, 6, generator=g).to(device, dtype))
            for _ in range(n)]


def _train(model, opt, batches):
    for x, y in batches:
        loss = ((model(x).float() - y.float()) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


def _reference_steps(model, batches, seed=0, rule=None, hp=None):
    """The spec, parameter by parameter: reference_q8_update for the 8-bit ones, the rule for the others; the key's
    counter the rule's step, or the optimizer's own count (q8_count) for a rule without one."""
    rule = rule or adamw_rule()
    hp = [torch.tensor(v, dtype=torch.float64) for v in (hp or (HP["lr"], *HP["betas"], HP["eps"], HP["weight_decay"]))]
    states, counts = {}, {}
    for x, y in batches:
        loss = ((model(x).float() - y.float()) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for salt, p in enumerate(model.parameters()):
                big = p.numel() >= 4096
                if p not in states:
                    z = torch.zeros(p.shape[0], p.shape[-1] if p.dim() > 1 else 1, device=p.device)
                    states[p] = [torch.tensor(0.0) if rule.is_scalar_state(i) else
                                 list(q8.quantize(z, 0)) if big else torch.zeros_like(p)
                                 for i in range(len(rule.states))]
                    counts[p] = 0
                st = states[p]
                counter = int(st[rule.states.index("step")]) if "step" in rule.states else counts[p]
                key = round_key(seed, counter)
                if big:
                    q8.reference_q8_update(rule, p.view(p.shape[0], -1), p.grad.float(), st, hp, key, salt)
                else:
                    rule.apply(p, p.grad, st, hp)
                counts[p] += 1
                p.grad = None
    return states


def test_the_8bit_and_the_small_parameters_follow_their_spec_bitwise():
    model, ref = _model(), _model()
    opt = AdamW8bit(model.parameters(), **HP)
    batches = _batches(3)
    # torch's CPU fp32 sqrt is not correctly rounded; the same mode on both sides (models.CorrectlyRoundedSqrt)
    with CorrectlyRoundedSqrt():
        _train(model, opt, batches)
        states = _reference_steps(ref, batches)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, r), name
        st = opt.dequantized_state(p)
        want = states[r]
        if p.numel() >= 4096:
            assert torch.equal(st["exp_avg"], q8.dequantize(*want[1])), name
            assert torch.equal(st["exp_avg_sq"], q8.dequantize(*want[2])), name
        else:
            assert torch.equal(st["exp_avg"], want[1]) and torch.equal(st["exp_avg_sq"], want[2]), name
        assert float(st["step"]) == 3.0


@pytest.mark.parametrize("which", ["lion", "sgd_momentum"])
def test_lion8bit_and_a_rule_without_a_step_follow_the_spec_bitwise(which):
    # Lion8bit (one 8-bit state, the rule's step counts), and Rule8bitOptimizer with SGD-momentum's rule, which has no
    # step: the optimizer's own count (q8_count) keys the bits
    model, ref = _model(), _model()
    if which == "lion":
        opt, rule, hp = Lion8bit(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), lion_rule(), \
            (1e-3, 0.9, 0.99, 0.1)
    else:
        rule, hp = sgd_rule(momentum=True), (1e-2, 0.9, 0.0)
        opt = Rule8bitOptimizer(model.parameters(), rule, lr=1e-2, momentum=0.9, dampening=0.0)
    batches = _batches(3)
    _train(model, opt, batches)
    states = _reference_steps(ref, batches, rule=rule, hp=hp)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, r), name
    w = model[0].weight
    name = [n for i, n in enumerate(rule.states) if not rule.is_scalar_state(i)][0]
    assert torch.equal(opt.dequantized_state(w)[name], q8.dequantize(*states[ref[0].weight][rule.states.index(name)]))
    assert ("q8_count" in opt.state[w]) == (which == "sgd_momentum")
    # forge's plan of it (compile_train_step, tests/test_train_step_8bit.py): the 8-bit weight's codes and scales by
    # name, the count where the rule has none
    plans = forge.optim.plan_optimizer(opt)
    assert [pl.q8 for pl in plans] == [True, False, False, False]
    tensor_state = [n for i, n in enumerate(rule.states) if not rule.is_scalar_state(i)][0]
    assert f"{tensor_state}_codes" in plans[0].state_names and f"{tensor_state}_scales" in plans[0].state_names
    assert ("q8_count" in plans[0].state_names) == (which == "sgd_momentum")


def test_with_no_8bit_parameter_it_is_torch_adamw():
    # every parameter under min_8bit_size: torch's states and forge's AdamW rule, torch.optim.AdamW's function up to
    # its kernels' FMA contractions -- the tolerance of tests/test_optim_rules.py (why: its docstring)
    batches = _batches(3)
    model, tmodel = _model(), _model()
    opt = AdamW8bit(model.parameters(), **HP, min_8bit_size=10 ** 9)
    topt = torch.optim.AdamW(tmodel.parameters(), foreach=False, **HP)
    _train(model, opt, batches)
    _train(tmodel, topt, batches)
    for (name, p), t in zip(model.named_parameters(), tmodel.parameters()):
        for a, b in ((p, t), (opt.state[p]["exp_avg"], topt.state[t]["exp_avg"]),
                     (opt.state[p]["exp_avg_sq"], topt.state[t]["exp_avg_sq"])):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6 * float(b.abs().max()),
                                       msg=lambda m: f"{name}: {m}")


def test_state_bytes_are_the_8bit_format():
    model = _model()
    opt = AdamW8bit(model.parameters(), **HP)
    _train(model, opt, _batches(1))
    w = model[0].weight
    # codes: 1 byte per element, scales: 4 bytes per 128 elements of a row, twice; the step 4 bytes
    assert sum(t.numel() * t.element_size() for t in opt.state[w].values()) == 2 * (300 * 200 + 4 * 300 * 2) + 4
    small = sum(p.numel() for p in model.parameters() if p.numel() < 4096)
    assert opt.state_bytes() == 2 * (300 * 200 + 4 * 300 * 2) + 4 + 8 * small + 4 * 3
    fp32_adamw = 8 * sum(p.numel() for p in model.parameters()) + 4 * 4
    assert opt.state_bytes() < 0.3 * fp32_adamw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_checkpoint_resumes_bitwise(tmp_path, dtype):
    batches = _batches(5, dtype=dtype)
    model = _model(dtype)
    opt = AdamW8bit(model.parameters(), **HP, seed=3)
    _train(model, opt, batches[:3])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    _train(model, opt, batches[3:])

    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed = _model(dtype)
    resumed.load_state_dict(ckpt["model"])
    ropt = AdamW8bit(resumed.parameters(), **HP, seed=3)
    ropt.load_state_dict(ckpt["opt"])
    w = resumed[0].weight
    # torch.optim casts floating-point states to the parameter's dtype on load: codes and scales are not floating
    assert ropt.state[w]["exp_avg_codes"].dtype == torch.uint8
    assert ropt.state[w]["exp_avg_scales"].dtype == torch.float32
    _train(resumed, ropt, batches[3:])
    for (name, p), r in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, r), name


def test_follows_fp32_adamw_on_a_regression():
    # a noisy linear regression (convex: no chaotic divergence to hide a bias), 300 steps from the same start against
    # torch.optim.AdamW with fp32 moments: measured 0.4 % of the distance travelled apart (seeds 1, 2) and the final
    # losses within 1 % -- bounds 1.5 % and 5 %, far under a missing or biased update (v frozen by round-to-nearest
    # codes: 2.5 %, q8_state's study)
    g = torch.Generator().manual_seed(1)
    target = torch.randn(300, 200, generator=g) * 0.1
    xs = [torch.randn(32, 200, generator=g) for _ in range(20)]
    ys = [x @ target.t() + 0.1 * torch.randn(32, 300, generator=g) for x in xs]
    torch.manual_seed(0)
    model, tmodel = torch.nn.Linear(200, 300), torch.nn.Linear(200, 300)
    tmodel.load_state_dict(model.state_dict())
    w0 = model.weight.detach().clone()
    opt, topt = AdamW8bit(model.parameters(), **HP), torch.optim.AdamW(tmodel.parameters(), **HP)
    for _ in range(15):
        _train(model, opt, zip(xs, ys))
        _train(tmodel, topt, zip(xs, ys))
    apart = (model.weight - tmodel.weight).norm() / (tmodel.weight - w0).norm()
    assert apart <= 0.015, apart.item()
    loss, tloss = (((m(xs[0]) - ys[0]) ** 2).mean().item() for m in (model, tmodel))
    assert abs(loss / tloss - 1) <= 0.05, (loss, tloss)


def test_bad_parameters_and_arguments_are_refused():
    with pytest.raises(ValueError, match="fp32 or bf16"):
        AdamW8bit(torch.nn.Linear(4, 4).half().parameters())
    with pytest.raises(ValueError, match="betas"):
        AdamW8bit(torch.nn.Linear(4, 4).parameters(), betas=(1.0, 0.9))
    m = torch.nn.Embedding(10000, 8, sparse=True)
    opt = AdamW8bit(m.parameters())
    m(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def _kernel_path_is_the_spec(device):
    # the Triton kernel (CUDA, or the interpreter on CPU) against the spec run on the same device
    dtype = torch.float32
    batches = _batches(3, device=device)
    model, ref = _model(dtype, device), _model(dtype, device)
    opt = AdamW8bit(model.parameters(), **HP)
    # the epilogue generated before the sqrt mode (it traces the rule, and would trace the mode's fp64 sqrt)
    from forge_compile.kernels.epilogue_codegen import compile_epilogue

    compile_epilogue(adamw_rule(), "interpret" if device == "cpu" else "cuda")
    with CorrectlyRoundedSqrt() if device == "cpu" else contextlib.nullcontext():
        _train(model, opt, batches)
        _reference_steps(ref, batches)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, r), name


def test_interpreter_tests_in_subprocess():
    pytest.importorskip("triton")
    run_child(__file__)


def test_interpreter_kernel_path_is_the_spec(interpret):
    assert os.environ.get("FORGE_TRITON_CPU") == "1"
    _kernel_path_is_the_spec("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_kernel_path_is_the_spec():
    _kernel_path_is_the_spec("cuda")


def test_conv_and_1d_parameters_keep_rows_of_their_first_dimension():
    # a conv weight [16, 8, 3, 3] is 16 rows of 72 (one scale per row, not one per 3 elements); a 1-D parameter of
    # 5000 elements one row of 40 blocks
    conv = torch.nn.Conv2d(8, 16, 3)
    vec = torch.nn.Parameter(torch.randn(5000))
    opt = AdamW8bit([*conv.parameters(), vec], **HP, min_8bit_size=1000)
    (conv(torch.randn(2, 8, 6, 6)).sum() + (vec ** 2).sum()).backward()
    w0 = conv.weight.detach().clone()
    opt.step()
    assert opt.state[conv.weight]["exp_avg_codes"].shape == (16, 72)
    assert opt.state[conv.weight]["exp_avg_scales"].shape == (16, 1)
    assert opt.state[vec]["exp_avg_scales"].shape == (1, 40)
    assert "exp_avg" in opt.state[conv.bias] and not torch.equal(conv.weight, w0)
    assert opt.dequantized_state(conv.weight)["exp_avg"].shape == conv.weight.shape


def test_dequantized_state_and_torch_names():
    model = _model()
    opt = AdamW8bit(model.parameters(), **HP)
    _train(model, opt, _batches(2))
    st = opt.dequantized_state(model[0].weight)
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["exp_avg"].shape == model[0].weight.shape
    assert (st["exp_avg_sq"] >= 0).all() and st["exp_avg"].abs().sum() > 0
    assert copy.deepcopy(opt.state_dict())["param_groups"][0]["seed"] == 0


def test_a_small_v_never_vanishes_beside_its_m():
    # a row block whose gradient spans 1e4 (v: 1e8, beyond e4m3's 2.3e5 per block): the small element's v used to
    # round to zero while its m did not, and a following step with a zero gradient there (an embedding row not in the
    # batch) moved it by lr x m / eps -- ~4700 lr here (stop 43). The smallest code floors it: every step stays within
    # a few lr
    w = torch.nn.Parameter(torch.zeros(4, 128))
    opt = AdamW8bit([w], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, min_8bit_size=1)
    g = torch.zeros(4, 128)
    g[:, 0], g[:, 1] = 1.0, 1e-4
    for grad in (g, torch.zeros_like(g), torch.zeros_like(g)):
        before = w.detach().clone()
        w.grad = grad.clone()
        opt.step()
        assert (w - before).abs().max() <= 3e-3, (w - before).abs().max()
    st = opt.dequantized_state(w)
    assert (st["exp_avg_sq"][:, 1] > 0).all() and (st["exp_avg"][:, 1] > 0).all()


def _tp_checkpoint_worker(rank, port, out_dir):
    # two gloo ranks; a column-wise Linear 300 -> 520 with its bias (Shard(0) rows; the 1-D bias: 8-bit columns) and
    # a row-wise Linear 520 -> 300 (Shard(1): 260 local columns, 3 blocks per shard -- 6 in the scales' global rows,
    # where the unsharded weight has 5)
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    try:
        mesh = init_device_mesh("cpu", (2,))

        def make(parallel=True):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(300, 520), torch.nn.Tanh(), torch.nn.Linear(520, 300, bias=False))
            if parallel:
                parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            return m, AdamW8bit(m.parameters(), **HP, min_8bit_size=256)

        gen = torch.Generator().manual_seed(1)
        batches = [torch.randn(4, 300, generator=gen) for _ in range(3)]

        def train(m, opt, xs):
            for x in xs:
                m(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

        model, opt = make()
        train(model, opt, batches[:2])
        sd = opt.state_dict()
        res["placements"] = {k: str(v.placements) for k, v in sd["state"][0].items() if hasattr(v, "placements")}
        res["scales_shape"] = list(sd["state"][2]["exp_avg_scales"].shape)
        res["bias_placements"] = str(sd["state"][1]["exp_avg_codes"].placements)
        res["live_state_plain"] = all(not hasattr(v, "placements") for v in opt.state[model[0].weight].values())
        dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=out_dir)
        resumed, ropt = make()
        resumed.load_state_dict(model.state_dict())
        target = get_optimizer_state_dict(resumed, ropt)
        dcp.load(target, checkpoint_id=out_dir)
        set_optimizer_state_dict(resumed, ropt, target)
        res["loaded_equal"] = all(torch.equal(v, ropt.state[r][k]) for p, r in zip(model.parameters(),
                                                                                 resumed.parameters())
                                  for k, v in opt.state[p].items())
        train(model, opt, batches[2:])
        train(resumed, ropt, batches[2:])
        res["resumed_equal"] = all(torch.equal(p.to_local(), r.to_local())
                                   for p, r in zip(model.parameters(), resumed.parameters()))
        # the same dict into unsharded parameters: other shapes, refused before anything changes
        plain, popt = make(parallel=False)
        try:
            popt.load_state_dict(opt.state_dict())
            res["reshard"] = "loaded"
        except ValueError as e:
            res["reshard"] = str(e)
        res["reshard_untouched"] = not popt.state
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_a_tensor_parallel_checkpoint_keeps_every_ranks_shards(tmp_path):
    # torch.distributed.checkpoint takes plain tensors of one name for replicas and kept one rank's 8-bit codes for
    # both ranks (measured before the fix: rank 0's codes loaded on rank 1); the state dict's DTensors keep each
    # rank's shard, and the resumed run continues bitwise
    import json

    import torch.multiprocessing as mp
    from models import free_port

    mp.spawn(_tp_checkpoint_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["placements"] == {k: "(Shard(dim=0),)" for k in
                                     ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")}, res
        assert res["scales_shape"] == [300, 6] and res["bias_placements"] == "(Shard(dim=1),)", res
        assert res["live_state_plain"] and res["loaded_equal"] and res["resumed_equal"], res
        assert "of another sharding or shape" in res["reshard"] and res["reshard_untouched"], res
