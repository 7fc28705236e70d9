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


def test_kernel_groups_and_table(tmp_path):
    gpu, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [
        _ev("wgrad_update_gluon_kernel", gpu, 0, 100), _ev("wgrad_update_gluon_kernel", gpu, 100, 160),
        _ev("triton_poi_fused__to_copy_t_3", gpu, 160, 170),          # a cast (and transpose) alone
        _ev("triton_poi_fused__to_copy_mul_silu_2", gpu, 170, 190),   # a cast fused with math: not a cast
        _ev("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", gpu, 190, 290),
        _ev("some_unknown_kernel", gpu, 290, 294),
        _ev("cudaLaunchKernel", cpu, 0, 4),
    ]
    groups = {g: (us, k) for g, us, k in P.kernel_groups(events, 2)}
    assert groups == {"forge fused wgrad+update": (80.0, 1.0), "GEMM (cuBLAS/CUTLASS)": (50.0, 0.5),
                      "Inductor pointwise": (10.0, 0.5), "casts only (Inductor)": (5.0, 0.5), "other": (2.0, 0.5)}
    P.write_kernel_table(events, 2, tmp_path / "k.tsv")
    rows = (tmp_path / "k.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["us_per_step", "calls_per_step", "name"]
    assert rows[1].split("\t") == ["80.0", "1", "wgrad_update_gluon_kernel"]
    assert len(rows) == 1 + 5


def test_diff_kernel_tables(tmp_path):
    gpu = DeviceType.CUDA
    P.write_kernel_table([_ev("nvjet_a", gpu, 0, 100), _ev("triton_poi_fused__to_copy_0", gpu, 100, 130)], 1,
                         tmp_path / "a.tsv")
    P.write_kernel_table([_ev("nvjet_a", gpu, 0, 60), _ev("wgrad_update_gluon_kernel", gpu, 60, 100)], 1,
                         tmp_path / "b.tsv")
    lines = P.diff_kernel_tables(tmp_path / "a.tsv", tmp_path / "b.tsv")
    assert lines[0].endswith("130.0 us/step; B " + str(tmp_path / "b.tsv") + ": 100.0 us/step")
    body = "\n".join(lines)
    assert "   +40.0  (     0.0,     40.0)  forge fused wgrad+update" in body
    assert "   -40.0  (   100.0,     60.0)  GEMM (cuBLAS/CUTLASS)" in body
    assert "   -30.0  (    30.0, 1;      0.0, 0)  triton_poi_fused__to_copy_0" in body
