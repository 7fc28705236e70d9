import os

# Tests compare two compilations of one step bitwise (replayed vs not, C++ vs Python wrapper, an option on vs off).
# Inductor picks some reduction configs by timing them on the device, and the pick sets the summation order; its
# deterministic mode picks without timing. Why here: under the GPU suite's 12 processes on the H200 (stop 22) one
# fp32 replay-vs-eager comparison ended 1 ulp apart, a different parametrization in each of two runs, while the
# same comparison run alone matched 3 of 3 -- timing noise is the likely cause (not yet confirmed with this set).
# Read when Inductor's config is first imported, hence before torch.
os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_runtest_logreport(report):
    # the GPU session (benchmarks/gpu_session.sh) sets FORGE_RESULTS: each test's phase, outcome and seconds are
    # appended as they end, so a run cut by the call's time limit still says what took the time and what failed
    # (under xdist the controller receives every worker's reports too: it alone writes)
    out = os.environ.get("FORGE_RESULTS")
    if out and "PYTEST_XDIST_WORKER" not in os.environ and (report.when == "call" or report.outcome != "passed"):
        with open(os.path.join(out, "durations.txt"), "a") as f:
            f.write(f"{report.duration:.2f} {report.when} {report.outcome} {report.nodeid}\n")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _touches_cuda(item) -> bool:
    # marked gpu, named or parametrized for CUDA, or skipped without one
    if "gpu" in item.keywords or "cuda" in item.nodeid.lower():
        return True
    return any(m.name == "skipif" and any(w in str(m.kwargs.get("reason", "")) for w in ("GPU", "CUDA", "cuda"))
               for m in item.iter_markers())


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FORGE_GPU_ONLY") == "1":
        # the GPU session's option (gpu_session.sh CPU_TESTS=0): CPU tests are CI's, and on the device machine
        # Inductor's C++ compiles under 12 processes made some take 60-130 s (stop 38) -- device time better spent
        cpu_only = pytest.mark.skip(reason="CPU test (FORGE_GPU_ONLY=1): CI runs it")
        for item in items:
            if not _touches_cuda(item):
                item.add_marker(cpu_only)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU tests run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpret(monkeypatch):
    """For tests named *interpreter*: they run only in the interpreter child (tests/interpreter.py)."""
    from interpreter import INTERPRETING

    if not INTERPRETING:
        pytest.skip("runs in the interpreter child (test_interpreter_tests_in_subprocess)")
    monkeypatch.setenv("FORGE_TRITON_CPU", "1")


@pytest.fixture
def count_slow_reads(monkeypatch):
    """Counts translate.prepare_states/hparam_values calls: the slow reads of optim/state_cache.py, which
    both forge routes go through (the cache looks them up in translate at each call)."""
    import forge_compile.optim.translate as tr
    calls = {"states": 0, "hparams": 0}
    real_s, real_h = tr.prepare_states, tr.hparam_values

    def states(o, pl):
        calls["states"] += 1
        return real_s(o, pl)

    def hparams(o, pl):
        calls["hparams"] += 1
        return real_h(o, pl)
    monkeypatch.setattr(tr, "prepare_states", states)
    monkeypatch.setattr(tr, "hparam_values", hparams)
    return calls


@pytest.fixture
def fused_adamw_via_mirror(monkeypatch):
    """A factory of AdamW(fused=True) optimizers whose ``step`` forge reads through a CPU mirror, as it
    does on CUDA (translate._step_for_forge), forced here on CPU; skips where fused AdamW is missing."""
    import torch.nn as nn
    import forge_compile.optim.translate as tr
    monkeypatch.setattr(tr, "_uses_mirror", lambda group, p: tr._device_step_group(group))
    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True)
    try:
        tr.plan_optimizer(make([nn.Parameter(torch.zeros(2, 2))]))
    except Exception:
        pytest.skip("AdamW(fused=True) not available here")
    return make
