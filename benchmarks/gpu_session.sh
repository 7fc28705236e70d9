#!/usr/bin/env bash
# One device-tool call (the H200 is lent for <= 10 min per call and each call restarts it): tests, then the
# benchmarks, each stage under its own timeout, everything written under $OUT.
#   TESTS=...          pytest targets (default: whole suite with .whl carried -- the expecttest wheel --, else the
#                      kernel test files); TEST_TIMEOUT, TEST_PROCS, TEST_ARGS; TEST_SHARD=i/n runs the i-th (1-based)
#                      of n interleaved parts of the default suite's files (the whole suite no longer fits one
#                      call: stop 38 cut it at 71 % after 420 s on an H100); CPU_TESTS=0 skips the tests that
#                      touch no CUDA (tests/conftest.py FORGE_GPU_ONLY) -- CI runs them, but only here do they run on
#                      torch 2.11, so not every session; the GPU-only suite fits one call (stop 41, H100: 796 tests,
#                      397 s on 12 processes, TEST_TIMEOUT=430)
#   LAUNCH=1           bench_launch_overhead.py (host us per fused launch)
#   BENCH_ARGS=...     bench_wgrad_update.py arguments (default "--cases final"); BENCH=0 skips it; BENCH_TIMEOUT;
#                      BENCH_ARGS2=... a second bench_wgrad_update.py run in the same call (e.g. another --cases)
#   E2E_ARGS=...       bench_train_step.py arguments (stage skipped when unset); E2E_TIMEOUT
#   PROFILE_ARGS=...   profile_train_step.py arguments (stage skipped when unset); PROFILE_TIMEOUT
#   EXTRA=...          one more command, run after the tests (e.g. "python3 benchmarks/bench_embedding_update.py
#                      --out $OUT"); EXTRA_TIMEOUT
# Usage (device tool, carry [".whl"]): TESTS="tests/test_x.py" LAUNCH=1 bash benchmarks/gpu_session.sh
set -u
DEFAULT_TESTS="tests/test_wgrad_update_triton.py tests/test_wgrad_update.py"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
  DEFAULT_TESTS=tests WHOLE=1
  if [ -n "${TEST_SHARD:-}" ]; then
    DEFAULT_TESTS=$(ls tests/test_*.py | awk -v i="${TEST_SHARD%/*}" -v n="${TEST_SHARD#*/}" '(NR - 1) % n == i - 1' | tr '\n' ' ')
  fi
fi
# only ~8 files come back from $OUT: the tests' small JSON results go to a folder that is tarred into one at the end
export PYTHONUNBUFFERED=1 FORGE_RESULTS=/tmp/forge_results TRITON_CACHE_DIR=/tmp/triton_cache \
  FORGE_KERNEL_CACHE=/tmp/forge_kernels
mkdir -p /tmp/forge_results
[ "${CPU_TESTS:-1}" = "0" ] && export FORGE_GPU_ONLY=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
if [ "${TESTS:-x}" != "0" ]; then
  # the whole suite did not finish in 330 s on 12 processes (stop 15): 420 s by default for it; --durations names
  # the tests that take the time
  [ -z "${TESTS:-}" ] && [ -n "${WHOLE:-}" ] && : ${TEST_TIMEOUT:=420}
  # -v (and no -q, which cancels it): each test's outcome is logged as it ends, so a run cut by the timeout (no summary) still names its failures
  # SIGINT first: pytest (xdist too) stops and still prints its failures' tracebacks and the durations
  timeout -s INT -k 30 ${TEST_TIMEOUT:-200} python3 -m pytest -v -p no:cacheprovider -n ${TEST_PROCS:-12} --durations=15 \
    ${TESTS:-$DEFAULT_TESTS} ${TEST_ARGS:-} > $OUT/pytest.log 2>&1
  stamp "pytest rc=$?"; grep -E "^[0-9.]+s (call|setup)" $OUT/pytest.log | head -8; tail -3 $OUT/pytest.log
  # the slowest tests as they ended (tests/conftest.py), kept with a cut run too
  sort -rn /tmp/forge_results/durations.txt 2>/dev/null | head -12
  echo "passed: $(grep -cE '^\[gw[0-9]+\].* PASSED ' $OUT/pytest.log)"
  grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) |^(FAILED|ERROR) " $OUT/pytest.log | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' \
    | sort -u | head -30
fi
if [ -n "${EXTRA:-}" ]; then
  timeout ${EXTRA_TIMEOUT:-200} bash -c "$EXTRA" > $OUT/extra.log 2>&1
  stamp "extra rc=$?"; tail -15 $OUT/extra.log
fi
if [ "${LAUNCH:-0}" = "1" ]; then
  timeout 120 python3 benchmarks/bench_launch_overhead.py --out $OUT > $OUT/launch.log 2>&1
  stamp "launch rc=$?"; cat $OUT/launch.log | tail -12
fi
if [ "${BENCH:-1}" = "1" ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_wgrad_update.py --out $OUT ${BENCH_ARGS:---cases final} > $OUT/bench.log 2>&1
  stamp "bench rc=$?"; grep -E "FAILED|failed|Error" $OUT/bench.log | head -20; sed -n '/^ rule/,$p' $OUT/bench.log
fi
if [ -n "${BENCH_ARGS2:-}" ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_wgrad_update.py --out $OUT ${BENCH_ARGS2} > $OUT/bench2.log 2>&1
  stamp "bench2 rc=$?"; grep -E "FAILED|failed|Error" $OUT/bench2.log | head -20; tail -12 $OUT/bench2.log
fi
if [ -n "${E2E_ARGS:-}" ]; then
  timeout ${E2E_TIMEOUT:-300} python3 benchmarks/bench_train_step.py --out /tmp/e2e ${E2E_ARGS} > $OUT/e2e.log 2>&1
  stamp "e2e rc=$?"; cp /tmp/e2e/results.md /tmp/e2e/results.json /tmp/e2e/*.png $OUT/ 2>/dev/null
  sed -n '/^| route  *| mb | tokens/,$p' /tmp/e2e/results.md
fi
if [ -n "${PROFILE_ARGS:-}" ]; then
  # per route a text and a kernel table: one tarball, since only ~8 files come back
  timeout ${PROFILE_TIMEOUT:-120} python3 benchmarks/profile_train_step.py --out /tmp/profile ${PROFILE_ARGS} > $OUT/profile.log 2>&1
  stamp "profile rc=$?"; cat $OUT/profile.log | tail -12; tar czf $OUT/profile.tgz -C /tmp profile
fi
if [ -n "$(ls -A /tmp/forge_results 2>/dev/null)" ]; then
  tar czf $OUT/test_results.tgz -C /tmp forge_results && stamp "test results: $OUT/test_results.tgz"
fi
