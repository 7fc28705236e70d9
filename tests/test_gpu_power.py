"""benchmarks/gpu_power.py: nvidia-smi samples summarized; no nvidia-smi -> no summary (CPU machines, CI)."""
import os
import stat
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import gpu_power  # noqa: E402


def test_summarize_medians_lowest_clock_and_capped_share():
    rows = [["1980", "2619", "120.5", "45", "0x0000000000000000"],
            ["1440", "2619", "690.0", "58", "0x0000000000000004"],
            ["1410", "2619", "692.0", "59", "0x0000000000000004"],
            ["[N/A]", "2619", "1.0", "1", "0x0"],          # a field nvidia-smi could not read: row skipped
            ["1395", "26"]]                               # a line cut when the sampler stopped: skipped
    s = gpu_power.summarize(rows)
    assert s["samples"] == 3
    assert s["sm_MHz"] == 1440.0 and s["min_sm_MHz"] == 1410.0 and s["W"] == 690.0 and s["C"] == 58.0
    assert s["reasons"] == "0x0/0x4"
    assert abs(s["capped"] - 2 / 3) < 1e-12
    assert gpu_power.summarize([]) is None and gpu_power.summarize([["x"]]) is None


def test_no_nvidia_smi_gives_no_summary(monkeypatch):
    monkeypatch.setattr(gpu_power.shutil, "which", lambda name: None)
    with gpu_power.PowerSampler() as ps:
        ps.mark_start()
    assert ps.samples() == [] and ps.summary() is None


def test_samples_before_mark_start_are_left_out(tmp_path, monkeypatch):
    # a stand-in nvidia-smi: one "idle" line at once, then "busy" lines every 20 ms -- only what arrives after
    # mark_start (plus skip_s) may count
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '345, 2619, 70.0, 40, 0x1'\nsleep 0.6\n"
                    "while true; do echo '1500, 2619, 690.0, 55, 0x4'; sleep 0.02; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(gpu_power.shutil, "which", lambda name: str(fake))
    with gpu_power.PowerSampler(skip_s=0.2) as ps:   # __enter__ waits 0.5 s: the idle line comes before
        ps.mark_start()
        time.sleep(0.6)
    s = ps.summary()
    assert s is not None and s["samples"] >= 3
    assert s["sm_MHz"] == 1500.0 and s["capped"] == 1.0 and s["reasons"] == "0x4"
