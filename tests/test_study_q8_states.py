"""benchmarks/study_q8_states.py (roadmap study, CPU): its codes and quantizers are what its docstring says, and
both modes run."""
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import study_q8_states as st  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "study_q8_states.py")


def test_dynamic_maps():
    s, u = st.dynamic_map(True), st.dynamic_map(False)
    assert s.numel() == u.numel() == 256
    assert torch.equal(s, s.sort().values) and s[0] < 0 and s[-1] == 1 and (s == 0).sum() == 1
    assert u.min() == 0 and u.max() == 1
    assert torch.equal(s[(s > 0) & (s < 1)], -s[s < 0].flip(0))   # symmetric apart from the code 1.0


def test_roundtrips():
    torch.manual_seed(0)
    x = torch.randn(3, 300) * torch.logspace(-4, 0, 300)
    e = st.Quant("e4m3").roundtrip(x, True, False)
    # per [1, 128] block: x / absmax * 448 through torch's e4m3 conversion
    blk = x[:, :128]
    amax = blk.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(e[:, :128], (blk / amax * 448).to(torch.float8_e4m3fn).float() / 448 * amax,
                               rtol=0, atol=0)
    d = st.Quant("dyn8").roundtrip(x, True, False)
    assert ((d - x).abs() <= x.abs().amax() * 0.02).all()
    v = x.abs() + 1e-3
    assert (st.Quant("e4m3_sqrtv").roundtrip(v, False, True) > 0).all()
    assert torch.equal(st.Quant("fp32").roundtrip(x, True, False), x)


def test_script_runs():
    r = subprocess.run([sys.executable, SCRIPT, "--steps", "50", "--probe", "--kinds", "fp32,e4m3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "step   50 e4m3" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, SCRIPT, "--steps", "2", "--seeds", "0", "--kinds", "fp32,dyn8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "| dyn8 |" in r.stdout, r.stdout + r.stderr


def test_e4m3_stochastic_is_unbiased_between_neighbours():
    torch.manual_seed(0)
    x = torch.full((100000,), 1.03) * torch.tensor([1.0, -1.0]).repeat(50000)
    q = st._e4m3_stochastic(x)
    # 1.03 lies between the e4m3 values 1.0 and 1.125: only those, in the proportion that keeps the mean
    assert set(q.abs().unique().tolist()) == {1.0, 1.125}
    assert abs(q[::2].mean().item() - 1.03) < 2e-3 and abs(q[1::2].mean().item() + 1.03) < 2e-3
    assert torch.equal(st._e4m3_stochastic(torch.tensor([448.0, 0.0, 1.0])), torch.tensor([448.0, 0.0, 1.0]))
