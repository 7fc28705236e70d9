"""benchmarks/plot_results.py on synthetic results of both benchmarks (the PNGs are written and non-trivial)."""
import os
import sys

import pytest

pytest.importorskip("matplotlib")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import plot_results  # noqa: E402


def _row(m, unfused, gluon, triton, floor, kind="adamw", n=4096, k=4096):
    return dict(kind=kind, act="bfloat16", n=n, k=k, m=m, unfused_ms=unfused, gluon_ms=gluon, default_ms=triton,
                floor_ms=floor)


def test_kernel_plot(tmp_path):
    rows = [_row(256, 0.155, 0.120, 0.131, 0.095), _row(1024, 0.183, 0.137, 0.150, 0.098),
            _row(8192, 0.496, 0.439, float("nan"), 0.401), _row(1024, 0.12, 0.08, 0.09, 0.07, kind="sgdm")]
    path = plot_results.plot_kernel(dict(rows=rows, meta=dict(gpu="H200", torch="2.11", triton="3.6")),
                                    str(tmp_path / "k.png"))
    assert os.path.getsize(path) > 10_000


def test_kernel_series_take_the_faster_fused_path():
    # the speedup plotted for a point is unfused / min(gluon, triton); NaN (not measured) is skipped
    got = {}

    class Ax:
        def plot(self, xs, ys, fmt, **kw):
            got.setdefault(kw.get("label"), (xs, ys))

        def __getattr__(self, name):
            return lambda *a, **k: None

    class Fig:
        def tight_layout(self):
            pass

        def savefig(self, *a, **k):
            pass

    class Plt:
        def subplots(self, **kw):
            return Fig(), Ax()

        def close(self, fig):
            pass

    real = plot_results._plt
    plot_results._plt = lambda: Plt()
    try:
        plot_results.plot_kernel(dict(rows=[_row(256, 0.2, 0.1, 0.05, 0.04), _row(512, 0.2, 0.1, float("nan"), 0.04)]),
                                 "unused.png")
    finally:
        plot_results._plt = real
    xs, ys = got["adamw bflo 4096x4096"]
    assert xs == [256, 512] and ys == [pytest.approx(4.0), pytest.approx(2.0)]


def test_e2e_plot(tmp_path):
    rows = [dict(route="baseline", mb=2, status="ok", tokens_per_s=120e3, speedup=1.0),
            dict(route="step_graphs", mb=2, status="ok", tokens_per_s=143e3, speedup=1.19),
            dict(route="step", mb=2, status="failed"),
            dict(route="baseline", mb=8, status="ok", tokens_per_s=300e3, speedup=1.0)]
    res = dict(config=dict(d_model=2048, layers=8, seq_len=1024, device="cuda"),
               routes=["baseline", "step", "step_graphs"], analysis=dict(rows=rows))
    path = plot_results.plot_e2e(res, str(tmp_path / "e.png"))
    assert os.path.getsize(path) > 10_000
