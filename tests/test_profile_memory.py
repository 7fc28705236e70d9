"""benchmarks/profile_memory.py: the snapshot replay and labelling on a hand-made snapshot, and the CLI's
clean exit without CUDA."""
import json
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import profile_memory as pm  # noqa: E402

RW = os.path.join(pm.TORCH_DIR, "_functorch", "_aot_autograd", "runtime_wrappers.py")
ADAMW = os.path.join(pm.TORCH_DIR, "optim", "adamw.py")
U = 512     # the allocator's rounding unit: the replay counts requested sizes rounded up to it

INDUCTOR_SRC = """def call(args):
    primals_1, = args
    buf0 = empty_strided_cuda((4, 8), (8, 1), torch.float32)
    buf1 = torch.ops.aten._scaled_dot_product_flash_attention.default(primals_1)
    del buf0
"""


def _fake(tmp_path):
    d = tmp_path / "torchinductor_fake" / "ab"
    d.mkdir(parents=True)
    ind = str(d / "cabfake.py")
    with open(ind, "w") as f:
        f.write(INDUCTOR_SRC)

    def fr(filename, line, name):
        return dict(filename=filename, line=line, name=name)

    fwd = [fr(ind, 3, "call"), fr(RW, 100, "forward"), fr(pm.MODEL_FILE, 5, "forward")]
    bwd = [fr(ind, 4, "call"), fr(RW, 200, "backward")]
    model = [fr(os.path.join(pm.TORCH_DIR, "nn", "functional.py"), 1, "linear"), fr(pm.MODEL_FILE, 10, "forward")]
    opt = [fr(ADAMW, 50, "_fused_adamw"), fr(ADAMW, 20, "step")]
    trace = [
        dict(action="alloc", addr=0x1000, size=300 * U - 5, frames=fwd),           # 1300 * U (rounded up)
        dict(action="alloc", addr=0x2000, size=500 * U, frames=bwd),               # 1800 * U <- peak, index 1
        dict(action="free_requested", addr=0x1000, size=300 * U, frames=bwd),     # 1500 * U
        dict(action="free_completed", addr=0x1000, size=300 * U, frames=bwd),     # (no change)
        dict(action="alloc", addr=0x3000, size=200 * U - 7, frames=model),          # 1700 * U (rounded up)
        dict(action="free_requested", addr=0x2000, size=500 * U, frames=bwd),     # 1200 * U
        dict(action="free_requested", addr=0x20, size=400 * U, frames=opt),       # 800 * U: block from before
        dict(action="free_completed", addr=0x20, size=400 * U, frames=opt),
        dict(action="segment_alloc", addr=0x9000, size=2 << 30, frames=opt),
        dict(action="alloc", addr=0x4000, size=1000 * U, frames=opt),              # 1800 * U again: not the first peak
    ]
    segments = [dict(device=0, address=0, total_size=2 << 30, blocks=[
        dict(address=0x10, size=600 * U, requested_size=600 * U, state="active_allocated", frames=[]),
        dict(address=0x3000, size=200 * U, requested_size=200 * U - 7, state="active_allocated", frames=model),
        dict(address=0x4000, size=1000 * U, requested_size=1000 * U, state="active_allocated", frames=opt),
        dict(address=0x5000, size=4096, requested_size=0, state="inactive", frames=[]),
    ])]
    return dict(device_traces=[trace], segments=segments), ind


def test_peak_live_set_and_labels(tmp_path):
    snap, ind = _fake(tmp_path)
    an = pm.analyse_snapshot(snap, allocated_before=1000 * U, known={0x10: "model parameters (fp32 master)"})
    assert an["peak_bytes"] == 1800 * U
    assert an["peak_index"] == 1
    assert an["allocated_after"] == 1800 * U
    assert an["live_before_step_bytes"] == 1000 * U and an["live_allocated_in_step_bytes"] == 800 * U
    assert an["unaccounted_bytes"] == 0
    rows = {r["label"]: r for r in an["top"]}
    assert len(rows) == 4, list(rows)
    assert rows["[before step] model parameters (fp32 master)"]["bytes"] == 600 * U
    freed = [r for lbl, r in rows.items() if lbl.startswith("[before step, freed later at] torch/optim/adamw.py:50")]
    assert len(freed) == 1 and freed[0]["bytes"] == 400 * U
    b0 = rows["cabfake.py:3 buf0 = empty_strided_cuda((4, 8), (8, 1), torch.float32)"]
    assert (b0["bytes"], b0["shapes"], b0["dtype"], b0["phase"], b0["kind"]) == \
        (300 * U, [[4, 8]], "float32", "forward", "inductor")
    b1 = next(r for lbl, r in rows.items() if lbl.startswith("cabfake.py:4 buf1 = torch.ops.aten._scaled_dot"))
    assert (b1["bytes"], b1["phase"], b1["shapes"]) == (500 * U, "backward", [])
    assert an["top"][0]["bytes"] == 600 * U and an["top"][1]["bytes"] == 500 * U     # sorted by bytes
    pe = an["peak_event"]
    assert pe["index"] == 1 and pe["phase"] == "backward" and pe["size"] == 500 * U
    assert pe["stack"][0] == "cabfake.py:4 call" and pe["line"] == 4 and pe["graph_alloc_lines"] == [3, 4]
    assert an["by_phase"] == {"before step": 1000 * U, "forward": 300 * U, "backward": 500 * U}
    sites = {s["site"]: s for s in an["timeline"]}
    assert sites["cabfake.py (forward)"]["max_allocated"] == 1300 * U
    assert sites["cabfake.py (backward)"]["max_allocated"] == 1800 * U
    assert sites["optimizer (torch.optim)"]["max_allocated"] == 1800 * U
    assert sites["eager"]["first"] == 4 and sites["eager"]["alloc_bytes"] == 200 * U
    text = pm.render("backend", dict(mb=8, seq_len=1024, d_model=2048, layers=2, vocab=32000), an)
    assert "phase: **backward**" in text and "(4, 8) float32" in text and "buf0 = empty_strided_cuda" in text


def test_peak_at_the_start_keeps_only_blocks_from_before(tmp_path):
    snap, _ = _fake(tmp_path)
    trace = snap["device_traces"][0]
    # Free the old block first: nothing in the step gets back above the starting 1000 * U bytes.
    snap["device_traces"][0] = [trace[6], trace[0], trace[2], trace[4]]   # -400, +300, -300, +200 (* U): max 900 * U
    snap["segments"][0]["blocks"] = [b for b in snap["segments"][0]["blocks"] if b["address"] != 0x4000]
    an = pm.analyse_snapshot(snap, allocated_before=1000 * U, known={0x10: "params"})
    assert an["peak_bytes"] == 1000 * U and an["peak_index"] == -1 and an["peak_event"] is None
    assert {r["label"]: r["bytes"] for r in an["top"]}[("[before step] params")] == 600 * U
    assert an["live_before_step_bytes"] == 1000 * U and an["live_allocated_in_step_bytes"] == 0
    assert an["allocated_after"] == 800 * U
    assert "start of the step" in pm.render("step", dict(mb=2, seq_len=8, d_model=8, layers=1, vocab=8), an)


def test_full_ring_buffer_and_unknown_old_blocks_are_reported(tmp_path):
    snap, _ = _fake(tmp_path)
    an = pm.analyse_snapshot(snap, allocated_before=1100 * U, max_entries=len(snap["device_traces"][0]))
    assert any("ring buffer" in w for w in an["warnings"])
    rows = {r["label"]: r["bytes"] for r in an["top"]}
    assert rows["[before step] other, still alive after the step"] == 600 * U  # 0x10 without a known name
    assert an["unaccounted_bytes"] == 100 * U    # 1100 * U before, 1000 * U found


def test_inductor_file_detection_and_line_parsing(tmp_path):
    assert pm.is_inductor_file("/tmp/torchinductor_root/ab/cab.py")
    assert not pm.is_inductor_file("/tmp/torchinductor_root/ab/cab.cpp")
    assert not pm.is_inductor_file(ADAMW)
    assert pm.is_inductor_file(str(tmp_path / "cache" / "x.py"), inductor_dirs=[str(tmp_path / "cache")])
    assert pm.parse_inductor_line("buf7 = empty_strided_cuda((8192, 32000), (32000, 1), torch.bfloat16)") == \
        ("buf7", [8192, 32000], [32000, 1], "bfloat16")
    assert pm.parse_inductor_line("buf2 = empty_strided_cuda((s0, 8), (8, 1), torch.float32)")[1] is None
    assert pm.parse_inductor_line("extern_kernels.mm(a, b, out=buf3)") == (None, None, None, None)


def test_label_prefers_forge_and_optim_frames_over_torch_internals():
    forge = os.path.join(pm.B.ROOT, "forge_compile", "capture.py")
    frames = [dict(filename=os.path.join(pm.TORCH_DIR, "_tensor.py"), line=1, name="clone"),
              dict(filename=forge, line=3, name="__call__"),
              dict(filename=ADAMW, line=1, name="step")]
    lab = pm.label_frames(frames, pm.Sources())
    assert lab["label"].startswith("forge_compile/capture.py:3 __call__") and lab["kind"] == "code"
    assert pm.label_frames([], pm.Sources())["label"].startswith("<no Python frames")
    assert pm.phase_of([]) == "no Python frames"
    nested = [dict(filename="/tmp/torchinductor_u/aa/cinner.py", line=7, name="call"),
              dict(filename="/tmp/torchinductor_u/bb/couter.py", line=9, name="call")]
    assert pm.label_frames(nested, pm.Sources())["label"] == "cinner.py:7 <source not readable>"
    via = [dict(filename=os.path.join(pm.B.ROOT, "forge_compile", "kernels", "wgrad_update.py"), line=5, name="launch")]
    assert pm.label_frames(via + nested, pm.Sources())["label"] == \
        "cinner.py:7 <source not readable> [via forge_compile/kernels/wgrad_update.py:5 launch]"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_cli_without_cuda_exits_cleanly(tmp_path):
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "profile_memory.py"), "--routes", "baseline,step",
                        "--mb", "8", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "no CUDA device" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


class FakeMemory(pm.CudaMemory):
    """The worker's allocator calls on CPU: a hand-made snapshot, recording state checked."""

    def __init__(self, snap):
        self.snap, self.calls = snap, []

    def device(self):
        return torch.device("cpu")

    def name(self, device):
        return "fake"

    def sync(self):
        pass

    def reset_peak(self):
        self.calls.append("reset")

    def allocated(self):
        return 1000 * U

    def max_allocated(self):
        return 1800 * U

    def start(self, max_entries):
        self.calls.append(("start", max_entries))

    def snapshot(self):
        self.calls.append("snapshot")
        return self.snap

    def stop(self):
        self.calls.append("stop")


@pytest.mark.parametrize("route", ["baseline", "step", "backend"])
def test_worker_runs_a_route_on_cpu_with_a_fake_recorder(tmp_path, route):
    """The worker's build / warm-up / record / write path on the tiny CPU model (catches what only the
    GPU run would otherwise find)."""
    torch._dynamo.reset()
    snap, _ = _fake(tmp_path)
    mem = FakeMemory(snap)
    cfg = dict(pm.B.PRESETS["tiny"], route=route, mb=2, warmup=1, lr=1e-3, seed=0, top=25, max_entries=1000,
               forge_adamw_fused="auto", out=str(tmp_path), save_snapshot=None)
    text = pm.run_worker(cfg, mem=mem)
    assert mem.calls == ["reset", ("start", 1000), "snapshot", "stop"]
    with open(tmp_path / f"profile_memory_{route}.json") as f:
        an = json.load(f)
    assert an["peak_bytes"] == 1800 * U and an["measured_peak"] == 1800 * U and an["route"] == route
    assert an["param_bytes"] > 0 and an["state_bytes"] > 0
    with open(tmp_path / f"profile_memory_{route}.md") as f:
        assert f.read().strip() == text
    assert f"## {route}: micro-batch 2" in text and "phase: **backward**" in text
