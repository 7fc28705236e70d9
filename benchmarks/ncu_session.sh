#!/usr/bin/env bash
# One device call: Nsight Compute counters of the fused kernel and its parts (benchmarks/ncu_wgrad_update.py).
#   CASES="2048:default,2048:gemm,..."  NCU_TIMEOUT (s)   -> $OUT/ncu.txt, $OUT/ncu_metrics.txt
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache FORGE_KERNEL_CACHE=/tmp/forge_kernels
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
$NCU --query-metrics 2>&1 | grep -i -E "gmma|tensor_op|pipe_tensor" | head -40 > $OUT/ncu_metrics.txt
CASES=${CASES:-64:tma,64:smem,1024:default,1024:gemm,2048:default,2048:gemm,2048:mm,2048:adamw,8192:default,8192:gemm,8192:mm}
timeout ${NCU_TIMEOUT:-400} $NCU --clock-control none -k regex:'wgrad_update_gluon_kernel|nvjet|sm90|gemm|adam' \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section LaunchStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed \
  python3 benchmarks/ncu_wgrad_update.py --cases $CASES > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"; grep -c "wgrad_update_gluon_kernel\|nvjet\|adam" $OUT/ncu.txt; tail -5 $OUT/ncu.txt
