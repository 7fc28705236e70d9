"""benchmarks/profile_train_step.py: the timeline statistics on hand-made profiler events (no GPU needed)."""
import os
import sys
from types import SimpleNamespace as NS

import pytest
from torch.autograd import DeviceType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import profile_train_step as P  # noqa: E402


def _ev(name, dev, a, b):
    return NS(name=name, device_type=dev, time_range=NS(start=a, end=b))


def test_timeline_stats_union_gaps_launches_syncs():
    gpu, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [
        # kernels (us): [0, 100] and [50, 120] overlap -> one interval of 120; a 3 us gap (not counted) to
        # [123, 200]; a 300 us gap to [500, 600]: busy 120 + 77 + 100 = 297 us, 1 gap of 300 us
        _ev("k1", gpu, 0, 100), _ev("k2", gpu, 50, 120), _ev("k3", gpu, 123, 200), _ev("k4", gpu, 500, 600),
        _ev("cudaLaunchKernel", cpu, 0, 4), _ev("cuLaunchKernel", cpu, 10, 45), _ev("cuLaunchKernelEx", cpu, 50, 53),
        _ev("cudaStreamSynchronize", cpu, 60, 160), _ev("cudaMemcpyAsync", cpu, 170, 175),
        _ev("aten::mm", cpu, 0, 1000),
    ]
    t = P.timeline_stats(events, 2)      # per step: everything halved
    assert t["gpu_busy_ms"] == pytest.approx(297 / 1e3 / 2)
    assert t["gpu_gaps"] == 0.5 and t["gpu_gap_ms"] == pytest.approx(300 / 1e3 / 2)
    assert t["launches"] == 1.5 and t["launch_ms"] == pytest.approx(42 / 1e3 / 2)
    assert t["blocked_launches"] == 0.5 and t["blocked_launch_ms"] == pytest.approx(35 / 1e3 / 2)
    # only the synchronizing call; cudaMemcpyAsync does not wait
    assert t["syncs"] == 0.5 and t["sync_ms"] == pytest.approx(100 / 1e3 / 2)


def test_timeline_stats_without_events():
    t = P.timeline_stats([], 5)
    assert t["gpu_busy_ms"] == 0 and t["launches"] == 0 and t["syncs"] == 0
