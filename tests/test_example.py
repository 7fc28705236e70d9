"""examples/train_lm.py: a few steps per route, save/resume equals an uninterrupted run, --compare.

Each run is the tiny preset shrunk further (1 layer, seq 32, batch 2, one eval batch) so that a test
spends its time compiling, not training; on 2 CPU cores each test stays well under a minute.
"""
import importlib.util
import json
import math
import os
import sys

import pytest
import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import train_lm  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile")

TINY = ["--size", "tiny", "--n-layers", "1", "--seq-len", "32", "--batch-size", "2", "--eval-every", "0",
        "--eval-batches", "1", "--max-data-mb", "0.25", "--device", "cpu", "--quiet"]
HAS_BACKEND = importlib.util.find_spec("forge_compile.backend") is not None


def run(*extra):
    return train_lm.main([*TINY, *extra])


@pytest.fixture(scope="module")
def step_run_4():
    """Route step, 4 steps, uninterrupted: shared by the route test and the resume test."""
    return run("--route", "step", "--steps", "4")


def _check_result(r, steps):
    assert len(r["losses"]) == steps
    assert all(math.isfinite(l) for l in r["losses"])
    assert math.isfinite(r["val_loss"]) and r["peak_memory_bytes"] > 0
    assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
    # the first steps (compilation) are left out of tokens/s, but at least one step is always timed
    assert r["untimed_steps"] == min(3, steps - 1) and r["timed_steps"] == steps - r["untimed_steps"]
    assert len(r["step_times_s"]) == steps and r["first_step_s"] == r["step_times_s"][0]
    assert 0 < r["unigram_entropy"] < math.log(256)


def test_route_step(step_run_4):
    _check_result(step_run_4, 4)
    # untrained byte model: loss starts near ln(256)
    assert abs(step_run_4["losses"][0] - math.log(256)) < 0.5
    report = step_run_4["fusion_report"]
    assert "forge fusion report" in report and "model.lm_head.weight" in report


def test_route_off_matches_step(step_run_4, tmp_path):
    out = tmp_path / "r.json"
    r = run("--route", "off", "--steps", "4", "--results-json", str(out))
    _check_result(r, 4)
    assert r["fusion_report"] is None
    assert json.loads(out.read_text())["losses"] == r["losses"]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(step_run_4["losses"]), rtol=1e-4, atol=1e-5)


def test_checkpoint_layers_trains_as_without(step_run_4):
    # --checkpoint-layers recomputes each layer in the backward: same losses (fp32 on CPU: summation order only),
    # every projection still fused
    r = run("--route", "step", "--steps", "4", "--checkpoint-layers")
    _check_result(r, 4)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(step_run_4["losses"]), rtol=1e-4, atol=1e-5)
    assert r["fusion_report"].count(" yes ") == step_run_4["fusion_report"].count(" yes ") >= 8


def test_clip_grad_norm_step_matches_off(tmp_path):
    # --clip-grad-norm: route step keeps its projections fused (norms from dY and X, the clip in the update) and
    # trains as route off (torch.compile + torch.optim) with the same clip
    step = run("--route", "step", "--steps", "3", "--clip-grad-norm", "0.5")
    off = run("--route", "off", "--steps", "3", "--clip-grad-norm", "0.5")
    _check_result(step, 3)
    torch.testing.assert_close(torch.tensor(step["losses"]), torch.tensor(off["losses"]), rtol=1e-4, atol=1e-5)
    assert step["fusion_report"].count("clip_grad_norm_") >= 8, step["fusion_report"]


def test_bf16_weights_step_rounds_stochastically_and_resumes(tmp_path):
    # --bf16-weights: bf16 parameters and states; route step fuses the projections with stochastic rounding, route off
    # is torch.optim's bf16 arithmetic: the same first loss (nothing updated yet), both train
    step = run("--route", "step", "--steps", "3", "--bf16-weights")
    off = run("--route", "off", "--steps", "3", "--bf16-weights")
    _check_result(step, 3)
    assert step["dtype"] == "bf16 weights"
    # before any update: two compilations of a bf16 forward (one whole-step graph, one torch.compile'd model) round
    # their intermediates differently (2e-6 relative seen); after it SR and round to nearest part ways
    assert step["losses"][0] == pytest.approx(off["losses"][0], rel=1e-4)
    assert "stochastic_rounding:" in step["fusion_report"], step["fusion_report"]
    assert step["fusion_report"].count("yes") >= 6, step["fusion_report"]
    # a resumed run draws the bits an uninterrupted one draws at the same steps
    ck = str(tmp_path / "ck.pt")
    run("--route", "step", "--steps", "3", "--stop-after", "1", "--save", ck, "--bf16-weights")
    resumed = run("--route", "step", "--steps", "3", "--resume", ck, "--bf16-weights")
    assert resumed["losses"] == step["losses"]


@pytest.mark.skipif(not HAS_BACKEND, reason="no forge_compile.backend")
def test_bf16_weights_backend_rounds_fused_weights_and_resumes(tmp_path):
    # --route backend --bf16-weights: the Dynamo route rounds its fused weights stochastically (options
    # stochastic_rounding=True), the norms and the embedding by forge's pre-step hook; a resumed run draws the same
    # bits (set_round_calls)
    full = run("--route", "backend", "--steps", "3", "--bf16-weights")
    _check_result(full, 3)
    assert "stochastic_rounding:" in full["fusion_report"] and "pre-step hook" in full["fusion_report"], \
        full["fusion_report"]
    ck = str(tmp_path / "ck.pt")
    run("--route", "backend", "--steps", "3", "--stop-after", "1", "--save", ck, "--bf16-weights")
    resumed = run("--route", "backend", "--steps", "3", "--resume", ck, "--bf16-weights")
    assert resumed["losses"] == full["losses"]


def test_grad_accum_step_matches_off():
    # --grad-accum 2: the batch as 2 passes, backward() each, one update; route step fuses every weight whose passes'
    # dY and X are at most half its fp32 dW (2 x 16 tokens against the 128-wide layers) and trains as route off
    short = ["--seq-len", "16", "--steps", "3", "--grad-accum", "2"]
    step = run("--route", "step", *short)
    off = run("--route", "off", *short)
    _check_result(step, 3)
    torch.testing.assert_close(torch.tensor(step["losses"]), torch.tensor(off["losses"]), rtol=1e-4, atol=1e-5)
    assert step["fusion_report"].count("sum of 2 matmuls' dW") >= 8, step["fusion_report"]
    with pytest.raises(SystemExit):
        run("--route", "step", "--steps", "1", "--grad-accum", "3")    # does not divide the batch of 2


def _torchrun(tmp_path, route, *extra):
    """The example under torchrun, 2 CPU ranks over gloo: rank 0's results.

    One retry after a hang: in stop 36's CI the baseline route (``off``: torch.compile of the DDP model, torch.optim;
    no forge code) hung once with one rank waiting in gloo for 600 s, and passed in 34 s when run again alone. A
    hung run's whole process group is killed (the ranks outlived torchrun before); a second hang, or any failure,
    fails the test. The same route once aborted at the end of the run (stop 45's CI: rank 0 "terminate called without
    an active exception" after its last step, then passed twice alone in the same venv): that route, with that
    message, is retried once too; any other failure fails the test at once."""
    import signal
    import subprocess
    out = tmp_path / f"{route}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(EXAMPLES, "train_lm.py"), *TINY, "--route", route, "--results-json", str(out), *extra]
    for attempt in range(2):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            if attempt:
                raise AssertionError(f"torchrun route {route} hung twice: {err[-3000:]}") from None
            continue
        if not (proc.returncode != 0 and route == "off" and not attempt
                and "terminate called without an active exception" in err):
            break
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.read_text())


def test_data_parallel_under_torchrun_step_matches_off(tmp_path):
    # torchrun: DistributedDataParallel, each rank its own batches; route step traces DDP's averaging into the step
    # and fuses the weights whose gathered dY and X (2 ranks x 32 tokens, fp32) fit their dW, and trains as route off
    # (torch.compile of the DDP model, DDP's own all-reduce); replicas stay equal
    short = ["--batch-size", "1", "--steps", "3"]
    step = _torchrun(tmp_path, "step", *short)
    off = _torchrun(tmp_path, "off", *short)
    assert step["world_size"] == off["world_size"] == 2
    assert step["replica_spread"] == off["replica_spread"] == 0.0
    assert step["tokens_per_step"] == 2 * 32
    torch.testing.assert_close(torch.tensor(step["losses"]), torch.tensor(off["losses"]), rtol=1e-4, atol=1e-5)
    assert step["fusion_report"].count("data parallel: the mean over 2 ranks") >= 6, step["fusion_report"]


@pytest.mark.skipif(not HAS_BACKEND, reason="forge_compile.backend (the Dynamo route) does not exist yet")
def test_route_backend(step_run_4):
    r = run("--route", "backend", "--steps", "4")
    _check_result(r, 4)
    assert "forge fusion report (backward)" in r["fusion_report"] and "lm_head.weight" in r["fusion_report"]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(step_run_4["losses"]), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(HAS_BACKEND, reason="forge_compile.backend exists (test_route_backend runs it)")
def test_route_backend_missing_is_a_clear_error():
    with pytest.raises(SystemExit, match="forge_compile.backend"):
        run("--route", "backend", "--steps", "1")


def test_resume_equals_uninterrupted(step_run_4, tmp_path):
    ck = str(tmp_path / "ck.pt")
    first = run("--route", "step", "--steps", "4", "--stop-after", "2", "--save", ck)
    resumed = run("--route", "step", "--steps", "4", "--resume", ck)
    # Model, AdamW state, LR schedule and data order all continue exactly, and the losses are usually
    # bit-identical on CPU fp32. Not always: about 1 run in 4 of this file a loss differed in its last
    # bits, and the parameters can differ by an ulp after a resume with route off too (plain torch.compile
    # + torch.optim), so the noise comes from CPU kernels, not the checkpoint. Hence rel=1e-6, far below
    # what a lost optimizer state, a restarted schedule or a reshuffled batch would change (>1e-3).
    assert first["losses"] == pytest.approx(step_run_4["losses"][:2], rel=1e-6, abs=0)
    assert resumed["losses"] == pytest.approx(step_run_4["losses"], rel=1e-6, abs=0)
    assert resumed["val_loss"] == pytest.approx(step_run_4["val_loss"], rel=1e-6)


def test_compare_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = str(tmp_path / "compare.png")
    r = run("--compare", "--steps", "3", "--plot", png)
    assert os.path.getsize(png) > 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert r["agree"] is True and r["early_max_abs_diff"] <= 1e-4
    assert len(r["forge"]["losses"]) == len(r["baseline"]["losses"]) == 3


def test_data_and_schedule_are_deterministic():
    args = train_lm.parse_args(TINY + ["--steps", "10"])
    train, val, _ = train_lm.load_data(args)
    assert train.dtype == torch.uint8 and len(val) >= 0.05 * (len(train) + len(val)) - 1
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    x1, y1 = train_lm.get_batch(train, 2, 32, g1, "cpu")
    x2, y2 = train_lm.get_batch(train, 2, 32, g2, "cpu")
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    model = train_lm.build_model(args)
    opt = train_lm.make_optimizer(model, args)
    sched = train_lm.make_scheduler(opt, args)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert max(lrs) == pytest.approx(args.lr) and lrs[-1] < lrs[1]
    assert model(x1).shape == (2, 32, 256)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hf_model_builds_offline(family):
    """--hf builds the transformers model from a config (no download); training it is covered by
    tests/test_hf_models.py against eager torch.optim, so only the construction is checked here."""
    pytest.importorskip("transformers")
    assert train_lm.parse_args(TINY + ["--hf"]).hf == "llama" and train_lm.parse_args(TINY).hf is None
    args = train_lm.parse_args(TINY + ["--hf", family])
    model = train_lm.build_model(args)
    hf = model.model
    assert type(hf).__name__ == train_lm.HF_FAMILIES[family][1]
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == train_lm.HF_FAMILIES[family][2]
    assert hf.config._attn_implementation == "sdpa" and hf.config.num_hidden_layers == 1
    assert model(torch.randint(0, 256, (2, 32))).shape == (2, 32, 256)
