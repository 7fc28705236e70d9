#!/usr/bin/env bash
# One device-tool call: the whole test suite (CPU + GPU tests) on the H200, then the kernel benchmark.
# Usage (device tool): bash benchmarks/gpu_session.sh   (carry .whl with the expecttest wheel)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 FORGE_RESULTS=$OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -x -p no:cacheprovider tests ${TEST_ARGS:-} 2>&1 | tee $OUT/pytest.log | tail -25
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_wgrad_update.py ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log | tail -30
