"""benchmarks/probe_epilogue_stream.py: its reference update, tile order and variant table on CPU; every probe
kernel bit-exact against the reference on an sm_90 GPU (skipped elsewhere)."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import probe_epilogue_stream as probe  # noqa: E402


def test_reference_is_the_op_by_op_fp32_formula():
    # the kernels compute these fp32 ops one by one (no FMA contraction); eager torch must give the same bits
    w, m, v = (torch.randn(257, 33) for _ in range(3))
    v = v.abs()
    w2, m2, v2 = probe.reference_update(w, m, v)
    f = np.float32
    wn, mn, vn = w.numpy(), m.numpy(), v.numpy()
    assert np.array_equal(w2.numpy(), wn - mn * f(0.001))
    assert np.array_equal(m2.numpy(), mn * f(0.9) + wn * f(0.1))
    assert np.array_equal(v2.numpy(), vn * f(0.999) + (wn * wn) * f(0.001))


def test_tile_order_covers_every_tile_once():
    for n, k in ((4096, 4096), (1024, 640), (384, 2048)):
        order = probe.tile_order(n, k)
        assert sorted(order) == [(i, j) for i in range(n // 128) for j in range(k // 128)]
    # grouped: the first GROUP tiles walk down one column of 8 row-tiles
    assert probe.tile_order(4096, 4096)[:9] == [(i, 0) for i in range(8)] + [(0, 1)]


def test_traffic_and_specs():
    assert probe.traffic_bytes(4096, 4096) == 402_653_184     # NOTES v9: 402 MB of W/m/v per pass
    names = [s.name for s in probe.SPECS]
    assert len(names) == len(set(names)) and 15 <= len(names) <= 24
    assert {s.kind for s in probe.SPECS} == set("ABCD")
    for s in probe.SPECS:
        # ring smem (barriers < 1 KB on top) fits the 227 KB per CTA, or half an SM's 228 KB at 2 CTAs per SM
        assert s.smem_ring() <= (112 * 1024 if s.cps == 2 else 224 * 1024), s
        if s.kind in "AB":
            assert s.box[1] * 4 <= 128, s     # triton 3.6 stores only the first 128 B of a wider TMA box
            assert (128 // s.box[0]) * (128 // s.box[1]) >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_exits_cleanly_without_cuda(capsys):
    assert probe.main(["--out", "/tmp/unused_probe_out"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("name", [s.name for s in probe.SPECS])
def test_probe_exact_on_gpu(name):
    spec = next(s for s in probe.SPECS if s.name == name)
    # 1024x640: 40 tiles over 3 CTAs (several tiles per CTA, both consumers, ragged tile counts)
    w, m, v = (torch.randn(1024, 640, device="cuda") for _ in range(3))
    ref = probe.reference_update(w, m, v)
    kern, grid, args, opts = probe.prepare(spec, w, m, v, sms=3 if spec.cps == 1 else 2)
    kern[grid](*args, **opts)
    torch.cuda.synchronize()
    for got, want in zip((w, m, v), ref):
        assert torch.equal(got, want)
