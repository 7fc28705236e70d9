"""SM clock, power and throttle reasons sampled by nvidia-smi beside a timed region.

Why (stop 31, RESULTS.md "Sustained clocks and power"): on the H100 every GEMM-heavy kernel from M = 2048 tokens on
runs at the card's 700 W power cap, 1380-1605 MHz instead of 1980, and there the fused kernel's cost over its GEMM
is the energy of its W/state stream, not a lack of overlap. A timing without the clock beside it cannot tell a
capped run from an uncapped one, so bench_wgrad_update.py (--cases clocks) and bench_train_step.py (--power) record
it. Without nvidia-smi (CPU machines, CI) the sampler records nothing and ``summary`` is None.

    with PowerSampler() as ps:     # starts nvidia-smi, waits out its start-up
        ps.mark_start()            # samples before this are left out
        ... timed work ...
    ps.summary()                   # {"sm_MHz": .., "W": .., "capped": .., ...} or None
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4   # clocks_throttle_reasons.active bit: the driver holds the clock down to stay under the limit
REASONS_HELP = ("nvidia-smi clocks_throttle_reasons.active bitmask (0x1 idle, 0x4 sw power cap, 0x20 sw thermal, "
                "0x40 hw thermal, 0x80 hw power brake)")


def _median(vals):
    vals = sorted(vals)
    return vals[len(vals) // 2] if vals else float("nan")


def summarize(rows):
    """rows of [sm MHz, mem MHz, W, C, reasons] (nvidia-smi's csv fields, strings) -> a dict of medians, the lowest
    SM clock, the reasons seen and the fraction of samples with the SW power cap active; None for no rows."""
    good = []
    for r in rows:
        try:
            good.append((float(r[0]), float(r[1]), float(r[2]), float(r[3]), int(r[4], 16)))
        except (ValueError, IndexError):   # "[N/A]" fields, a line cut by the sampler's stop
            continue
    if not good:
        return None
    col = list(zip(*good))
    return {"sm_MHz": _median(col[0]), "min_sm_MHz": min(col[0]), "mem_MHz": _median(col[1]), "W": _median(col[2]),
            "C": _median(col[3]), "reasons": "/".join(f"0x{v:x}" for v in sorted(set(col[4]))),
            "capped": sum(1 for v in col[4] if v & SW_POWER_CAP) / len(good), "samples": len(good)}


class PowerSampler:
    """nvidia-smi polled every ``interval_ms`` on a reader thread; ``skip_s`` of samples after ``mark_start`` are
    left out (the clock settles); ``index``: the nvidia-smi GPU index (default: all GPUs' lines, fine on one-GPU
    machines)."""

    def __init__(self, interval_ms: int = 50, skip_s: float = 0.0, index: int | None = None):
        self.interval_ms, self.skip_s, self.index = interval_ms, skip_s, index
        self._rows, self._proc, self._thread = [], None, None
        self.t_start = self.t_end = None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        cmd = [exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)]
        if self.index is not None:
            cmd += ["-i", str(self.index)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read():
            for line in self._proc.stdout:
                self._rows.append((time.time(), [f.strip() for f in line.split(",")]))
        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()
        time.sleep(0.5)   # nvidia-smi's start-up, before the caller's timed work
        return self

    def mark_start(self):
        self.t_start = time.time()

    def __exit__(self, *exc):
        self.t_end = time.time()
        if self._proc is not None:
            self._proc.terminate()
            self._thread.join(timeout=2)
        return False

    def samples(self):
        t0 = (self.t_start or 0.0) + self.skip_s
        return [r for t, r in self._rows if t0 <= t <= (self.t_end or float("inf"))]

    def summary(self):
        return summarize(self.samples())
