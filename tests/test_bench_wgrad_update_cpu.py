"""benchmarks/bench_wgrad_update_cpu.py: its pre-timing check (forge's CPU path vs torch.optim) holds and a case runs."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_wgrad_update_cpu as bench  # noqa: E402


@pytest.mark.parametrize("kind", ["adamw", "sgdm"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_case_runs_and_matches_torch_optim(kind, act):
    r = bench.run_case(kind, act, 96, 80, 24, reps=1)
    assert r["check_rel_update"] < 1e-3
    assert r["forge"] > 0 and r["eager"] > 0


def test_check_catches_a_wrong_update(monkeypatch):
    real = torch.ops.forge.wgrad_update_

    class Wrong:
        default = None

        def __call__(self, w, *a):
            real(w, *a)
            w.add_(1.0)       # a wrong update must stop the benchmark before any timing
    monkeypatch.setattr(torch.ops.forge, "wgrad_update_", Wrong(), raising=False)
    with pytest.raises(SystemExit):
        bench.run_case("adamw", torch.float32, 32, 16, 8, reps=1)
