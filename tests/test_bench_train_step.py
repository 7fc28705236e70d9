"""benchmarks/bench_train_step.py: the analysis on synthetic results, and one CPU smoke run of main().

The smoke run is the --tiny preset (1 layer, d_model 64, seq 16, micro-batch 2) for 2 check steps, 1 warm-up
and 2 timed steps per route, each route in its own subprocess as on the GPU: about a minute on 2 CPU
cores, nearly all of it compilation.
"""
import json
import math
import os
import sys
import threading

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import bench_train_step as bench  # noqa: E402

GIB = 2 ** 30
CFG = dict(device="cuda", fp32=False, seq_len=1024, check_steps=3, warmup=3, iters=10)


def _run(route, mb, peak_gib, ms, losses=(10.8, 9.9, 9.0), fused=None, role="main"):
    return dict(route=route, mb=mb, role=role, status="ok", median_ms=ms, tokens_per_s=mb * 1024 / (ms / 1e3),
                peak_bytes=int(peak_gib * GIB), first_step_s=60.0, adamw_fused=True, linear_weights=10,
                fused_linear=10 if fused is None else fused, param_bytes=2 * GIB, state_bytes=4 * GIB,
                grad_bytes=2 * GIB if route == "baseline" else GIB // 8, linear_dw_bytes=int(1.8 * GIB),
                check_losses=list(losses))


def _synthetic():
    # baseline: peak = 9 + 1*mb GiB; forge routes: 2 GiB lower at every mb (7 + 1*mb).
    return [_run("baseline", 2, 11, 100), _run("step", 2, 9, 80, losses=(10.8, 9.905, 9.01)),
            _run("backend", 2, 9.1, 90, fused=9),
            _run("baseline", 16, 25, 600), _run("step", 16, 23, 590), _run("backend", 16, 23.1, 650,
                                                                             losses=(10.8, 9.5, 9.0))]


def test_repeats_give_the_median_of_run_medians():
    res = _synthetic()
    res += [dict(_run("step", 2, 9, 120), role="repeat1"), dict(_run("step", 2, 9, 70), role="repeat2"),
            dict(_run("baseline", 2, 11, 110), role="repeat1")]
    rows = {(r["route"], r["mb"]): r for r in bench.analyse(CFG, res)["rows"]}
    assert rows[("step", 2)]["median_ms"] == 80 and sorted(rows[("step", 2)]["run_medians_ms"]) == [70, 80, 120]
    assert rows[("baseline", 2)]["median_ms"] == pytest.approx(105)
    assert rows[("step", 2)]["speedup"] == pytest.approx(105 / 80)
    assert rows[("step", 2)]["tokens_per_s"] == pytest.approx(2 * 1024 / 0.080)
    text = bench.render(dict(CFG, repeat=3), bench.analyse(CFG, res), res, "header")
    assert "80.00 (70.00-120.00, 3 runs)" in text


def test_fit_and_largest_micro_batch():
    a, b = bench.fit_line([(2, 11.0), (16, 25.0)])
    assert a == pytest.approx(9.0) and b == pytest.approx(1.0)
    assert bench.largest_mb((a, b), 12.5) == 3
    assert bench.fit_line([(2, 11.0)]) is None and bench.fit_line([(2, 11.0), (2, 12.0)]) is None


def test_analyse_compares_with_the_baseline():
    an = bench.analyse(CFG, _synthetic())
    rows = {(r["route"], r["mb"]): r for r in an["rows"]}
    step2 = rows[("step", 2)]
    assert step2["speedup"] == pytest.approx(100 / 80)
    assert step2["peak_saved_frac_of_linear_dw"] == pytest.approx(2 / 1.8)
    assert step2["loss_ok"] and step2["loss_max_abs_diff"] == pytest.approx(0.01)
    assert step2["decomposition"]["activations_other"] == int(9 * GIB) - 2 * GIB - 4 * GIB - GIB // 8
    assert not rows[("backend", 2)]["all_linear_fused"]           # 9 of 10 linear weights
    assert not rows[("backend", 16)]["loss_ok"]                  # 0.4 nats off at step 2: a wrong update
    # Default budget: the baseline's fit at mb 1 + half a sequence = 10.5 GiB -> baseline 1, forge 3.
    b = an["budget"]
    assert b["budget_bytes"] == pytest.approx(10.5 * GIB)
    assert b["routes"]["baseline"]["largest_mb"] == 1 and b["routes"]["step"]["largest_mb"] == 3
    assert b["routes"]["step"]["ratio_vs_baseline"] == pytest.approx(3.0)
    v = an["verdicts"]
    assert v["step"] == dict(correct=True, peak_drop_ge_95pct_of_linear_dw=True, budget_mb_ge_2x=True,
                             speedup_ge_1_2x_at_smallest_mb=True, not_slower_at_largest_mb=True)
    assert v["backend"]["correct"] is False and v["backend"]["not_slower_at_largest_mb"] is False


def test_loss_check_stops_at_the_baselines_first_loss_increase():
    # the full preset's baseline diverges at step 3 (10.80 -> 9.83 -> 12.55); differences there are amplified
    # rounding noise (two baseline processes differed by 2e-2), so steps 1-2 are judged and step 3 only shown --
    # while a wrong first update (0.3 nats) still fails
    base = _run("baseline", 2, 11, 100, losses=(10.7984, 9.8303, 12.5593))
    res = [base, _run("step", 2, 9, 80, losses=(10.7984, 9.8266, 12.5872)),
           _run("backend", 2, 9, 80, losses=(10.7984, 10.13, 12.5593))]
    rows = {r["route"]: r for r in bench.analyse(CFG, res)["rows"]}
    assert rows["step"]["loss_judged_steps"] == 2 and rows["step"]["loss_ok"]
    assert rows["step"]["loss_max_abs_diff"] == pytest.approx(0.0037)
    assert not rows["backend"]["loss_ok"]
    # a baseline whose loss keeps falling is judged over every step
    assert bench._judged_steps([10.8, 9.9, 9.0]) == 3 and bench._judged_steps([10.8, 11.0, 9.0]) == 2
    assert bench._judged_steps([10.8]) == 1


def test_host_diagnostics_reach_the_notes():
    # per-step host timing, GC, the host-speed probe and the in-process A/B of the direct launch entry end up in
    # the row's notes (they are how a host-bound run is read)
    step = _run("step", 2, 9, 80)
    step.update(host_median_ms=19.6, wall_ms=18.5, thread_cpu_ms=18.5, host_ms=[20.1, 11.6, 19.9],
                gc={"count": [7, 0, 0], "ms": [1.4, 0.0, 0.0]}, host_probe_us=[80.0, 120.0],
                ab_direct={"off": [21.0], "on": [19.0], "pair_diff_median_ms": 1.75})
    res = [_run("baseline", 2, 11, 100), step]
    text = bench.render(CFG, bench.analyse(CFG, res), res, "header")
    line = next(ln for ln in text.splitlines() if ln.startswith("| step ") and "host probe" in ln)
    assert "slowest host step 20.1 ms" in line and "gc 7x 1.4 ms (gen2 0x)" in line
    assert "host probe 80-120 us" in line and "direct entry off/on (alternating steps) 21.00 / 19.00 ms, paired difference 1.75 ms" in line
    assert bench._cpu_list("0-3,6") == {0, 1, 2, 3, 6}


def test_power_samples_reach_the_notes():
    # --power: the SM clock, power and capped share of the timed steps are in the row's notes (a capped step and
    # an uncapped one are different regimes: RESULTS.md "Sustained clocks and power"); rows without it say nothing
    step = _run("step", 2, 9, 80)
    step["power"] = {"sm_MHz": 1440.0, "min_sm_MHz": 1305.0, "mem_MHz": 2619.0, "W": 688.4, "C": 57.0,
                     "reasons": "0x4", "capped": 0.75, "samples": 8}
    res = [_run("baseline", 2, 11, 100), step]
    text = bench.render(CFG, bench.analyse(CFG, res), res, "header")
    line = next(ln for ln in text.splitlines() if ln.startswith("| step ") and "compile step" in ln)
    assert "SM 1440 MHz (min 1305), 688 W, power-capped 75% of 8 samples" in line
    base = next(ln for ln in text.splitlines() if ln.startswith("| baseline ") and "compile step" in ln)
    assert "power-capped" not in base


def test_eager_route_is_a_reference_not_a_forge_route():
    # the eager route's row carries its loss drift against the baseline (the loss check's scale) but no fusion
    # column, no verdicts and no peak-drop claim
    res = _synthetic() + [_run("eager", 2, 11, 130, losses=(10.8, 9.903, 9.004), fused=0)]
    an = bench.analyse(CFG, res)
    eager = {(r["route"], r["mb"]): r for r in an["rows"]}[("eager", 2)]
    assert eager["loss_max_abs_diff"] == pytest.approx(0.004) and "fused_linear" not in eager
    assert "eager" not in an["verdicts"] and set(an["verdicts"]) == {"step", "backend"}
    text = bench.render(CFG, an, res, "header")
    line = [ln for ln in text.splitlines() if ln.startswith("| eager ") and "ms/step" not in ln and "ok" in ln]
    assert line and "FAIL" not in line[0]
    assert bench.parse_args(["--routes", "baseline,eager"]).routes == "baseline,eager"


def test_budget_verification_and_explicit_budget():
    res = _synthetic() + [_run("step", 3, 10.6, 120, role="verify")]   # measured above the fitted 10.0
    an = bench.analyse(CFG, res)
    s = an["budget"]["routes"]["step"]
    assert s["verified_mb"] == 3 and s["verified_fits"] is False
    assert an["verdicts"]["step"]["budget_mb_ge_2x"] is False
    an = bench.analyse(CFG, _synthetic(), budget_gib=13.5)
    assert an["budget"]["routes"]["baseline"]["largest_mb"] == 4 and an["budget"]["routes"]["step"]["largest_mb"] == 6


def test_failed_runs_are_rows_not_crashes():
    res = _synthetic()
    res[1] = dict(route="step", mb=2, role="main", status="timeout", error="killed after 300 s")
    an = bench.analyse(CFG, res)
    text = bench.render(CFG, an, res, "header")
    row = next(r for r in an["rows"] if (r["route"], r["mb"]) == ("step", 2))
    assert row["status"] == "timeout"
    lines = text.splitlines()
    assert lines[-1].startswith("| backend  | 16 ")                  # the main table is last
    assert any(l.startswith("| step     | 2 ") and "| timeout |" in l for l in lines[-6:])
    assert "- step mb 2 (main): timeout: killed after 300 s" in text
    assert an["verdicts"]["step"]["speedup_ge_1_2x_at_smallest_mb"] is None      # not measured, not a pass


def test_thread_cpu_diff_per_step_and_busiest_threads_note():
    before = {1: (1.00, "python"), 2: (0.50, "pt_autograd_0"), 3: (0.20, "gone")}
    after = {1: (1.10, "python"), 2: (0.90, "pt_autograd_0"), 4: (0.05, "Thread-1 (loop)")}
    rows = bench.thread_cpu_diff(before, after, 10, {1: "MainThread", 4: "Thread-1"})
    assert [(r["tid"], r["comm"], r["py_name"]) for r in rows] == [
        (2, "pt_autograd_0", None), (1, "python", "MainThread"), (4, "Thread-1 (loop)", "Thread-1")]
    # 400 ms over 10 steps; 100 ms; the new thread counts from 0; tid 3 ended inside the window: dropped
    assert [r["cpu_ms_per_step"] for r in rows] == pytest.approx([40.0, 10.0, 5.0])
    # the main thread stays in the record even when it is not among the busiest
    assert [r["tid"] for r in bench.thread_cpu_diff(before, after, 10, {1: "MainThread"}, top=1)] == [2, 1]
    assert bench._busy_threads_note(rows) == (
        "; busiest other threads pt_autograd_0 40.00, Thread-1 (loop)/Thread-1 5.00 ms/step")
    assert bench._busy_threads_note(None) == "" and bench._busy_threads_note(rows[1:2]) == ""


def test_thread_cpu_snapshot_sees_this_thread():
    snap = bench.thread_cpu_snapshot()
    if not os.path.isdir("/proc/self/task"):
        assert snap == {}
        return
    me = snap[threading.get_native_id()]
    assert me[0] >= 0 and me[1]


def test_cpu_smoke_run_of_the_8bit_routes(tmp_path, capsys):
    # forge.optim.AdamW8bit behind torch.compile (eager step) and under compile_train_step (fused): both train, their
    # states (8-bit for the 64x64-and-larger weights) smaller; the compiled step is the eager optimizer's update
    # (tests/test_train_step_8bit.py), so its losses follow the 8-bit baseline's
    out = tmp_path / "out"
    summary = bench.main(["--device", "cpu", "--tiny", "--out", str(out), "--check-steps", "2", "--warmup", "1",
                          "--iters", "2", "--time-budget", "600", "--routes",
                          "baseline,baseline_8bit,step_8bit,step_8bit_gluon"])
    capsys.readouterr()
    runs = {r["route"]: r for r in summary["runs"]}
    for route, r in runs.items():
        assert r["status"] == "ok", (route, r.get("error"), r.get("traceback"))
        assert all(math.isfinite(l) for l in r["check_losses"])
    for route in ("baseline_8bit", "step_8bit"):
        assert runs[route]["state_bytes"] < 0.5 * runs["baseline"]["state_bytes"]
        assert runs[route]["check_losses"][0] == runs["baseline"]["check_losses"][0]
    assert runs["step_8bit"]["state_bytes"] == runs["baseline_8bit"]["state_bytes"]
    assert runs["step_8bit"]["fused_linear"] == runs["step_8bit"]["linear_weights"] > 0
    # two correct executions of the same 8-bit steps (the forward/backward compiled in one graph or in two)
    assert math.isclose(runs["step_8bit"]["check_losses"][1], runs["baseline_8bit"]["check_losses"][1], rel_tol=1e-3)
    # the _gluon route: AdamW8bit too, with FORGE_Q8_PATH=gluon in its process -- on CPU the same CPU path, bitwise
    assert runs["step_8bit_gluon"]["state_bytes"] == runs["step_8bit"]["state_bytes"]
    assert runs["step_8bit_gluon"]["check_losses"] == runs["step_8bit"]["check_losses"]


def test_cpu_smoke_run_of_main(tmp_path, capsys):
    out = tmp_path / "out"
    summary = bench.main(["--device", "cpu", "--tiny", "--out", str(out), "--check-steps", "2",
                          "--warmup", "1", "--iters", "2", "--time-budget", "600", "--cprofile",
                          "--plot", str(tmp_path / "e2e.png")])
    printed = capsys.readouterr().out
    runs = {r["route"]: r for r in summary["runs"]}
    assert set(runs) == {"baseline", "step", "backend"}
    for route, r in runs.items():
        assert r["status"] == "ok", (route, r.get("error"), r.get("traceback"))
        assert len(r["check_losses"]) == 2 and all(math.isfinite(l) for l in r["check_losses"])
        assert len(r["step_ms"]) == 2 and r["median_ms"] > 0
    for route in ("step", "backend"):
        r = runs[route]
        assert r["linear_weights"] == 8 and r["fused_linear"] == 8 and r["unfused_linear"] == []
        assert not r["unmatched_rows"]
        # the norms stay unfused (their gradient is alive in the step); both routes fuse the embedding's update
        # (forge::embedding_update_; the backend route since stop 37)
        emb = 128 * 64 * 4     # the tiny preset's vocabulary x d_model, fp32
        assert r["grad_bytes"] == r["param_bytes"] - r["linear_dw_bytes"] - emb
    assert runs["baseline"]["grad_bytes"] == runs["baseline"]["param_bytes"]
    if sys.platform.startswith("linux"):
        for route, r in runs.items():
            th = r["threads_cpu_ms_per_step"]
            assert 1 <= len(th) <= 9 and any(t["py_name"] == "MainThread" for t in th), (route, th)
            assert all(t["cpu_ms_per_step"] >= 0 and t["comm"] for t in th), (route, th)
            assert all(isinstance(s["frames"], list) for s in r["thread_stacks"])
    rows = {r["route"]: r for r in summary["analysis"]["rows"]}
    assert rows["step"]["loss_ok"] and rows["backend"]["loss_ok"]
    assert (tmp_path / "e2e.png").stat().st_size > 10_000 and "plot: " in printed
    assert summary["analysis"]["verdicts"]["step"]["correct"] is True
    with open(out / "results.json") as f:
        assert json.load(f)["analysis"]["rows"]
    md = (out / "results.md").read_text()
    assert "| route" in md and "8/8" in md
    # the table is printed last, before the line naming the written files
    tail = [l for l in printed.splitlines() if l.strip()]
    assert tail[-1].startswith("written:") and tail[-3].startswith("| step ") and tail[-2].startswith("| backend ")
    assert sorted(os.listdir(out / "runs")) == sorted(
        f"{r}_mb2{ext}" for r in ("baseline", "step", "backend")
        for ext in (".json", ".config.json", ".json.cprofile.txt"))
    prof = (out / "runs" / "step_mb2.json.cprofile.txt").read_text()
    assert prof.startswith("cProfile over 2 steps") and "capture.py" in prof
