#!/usr/bin/env bash
# One device-tool call: tests on the H200 (pytest-xdist, on the image, runs them in TEST_PROCS processes), then
# the kernel benchmark (its own correctness checks first). With .whl carried (expecttest wheel) the default is
# the whole suite, without it the two kernel test files; TESTS=... overrides.
# Usage (device tool): bash benchmarks/gpu_session.sh   [BENCH_ARGS="--cases all --short a,b"]
set -u
DEFAULT_TESTS="tests/test_wgrad_update_triton.py tests/test_wgrad_update.py"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
  DEFAULT_TESTS=tests
fi
export PYTHONUNBUFFERED=1 FORGE_RESULTS=$OUT TRITON_CACHE_DIR=/tmp/triton_cache FORGE_KERNEL_CACHE=/tmp/forge_kernels
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider -n ${TEST_PROCS:-12} \
  ${TESTS:-$DEFAULT_TESTS} ${TEST_ARGS:-} > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -5 $OUT/pytest.log; grep -E "FAILED|Error" $OUT/pytest.log | head -20
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_wgrad_update.py --out $OUT ${BENCH_ARGS:-} > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -E "FAILED|failed|Error" $OUT/bench.log | head -20; sed -n '/^ rule/,$p' $OUT/bench.log
