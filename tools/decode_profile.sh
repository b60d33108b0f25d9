#!/usr/bin/env bash
# Builds tools/decode_check.cu (no JAX) and runs it: correctness, the speed table, and
# Nsight Compute on the cases named in CASES (space-separated N,K,H,B,L,Tq,cache), each
# kernel's sections written to $OUT/ncu_<i>.txt. Run on the GPU machine:
#   OUT=/tmp/out bash tools/decode_profile.sh
# DC_BIN=<path> runs a decode_check built elsewhere (the same nvcc line, e.g. on a machine
# without a GPU) instead of building it here; NCU_DC_ARGS= adds flags to the profiled runs
# (e.g. --pages-in-order).
set -euo pipefail
OUT=${OUT:-/tmp/decode_profile}
mkdir -p "$OUT" /tmp/dc_build
NVCC=${NVCC:-nvcc}
FLAGS="-O3 -std=c++17 -Iffi -DJAXGPU_HAS_SM90A=1 -arch=sm_90a"
DC=${DC_BIN:-/tmp/dc_build/dc}
if [ -z "${DC_BIN:-}" ]; then
  for f in tools/decode_check.cu ffi/decode/decode_kernels.cu ffi/decode/decode_tc_kernels.cu \
      ffi/decode/decode_update_kernels.cu; do
    $NVCC $FLAGS -c "$f" -o "/tmp/dc_build/$(basename "$f").o" &
  done
  wait
  $NVCC -arch=sm_90a -o "$DC" /tmp/dc_build/*.o
fi
"$DC" ${DC_ARGS:-} 2>&1 | tee "$OUT/decode_check.log"
i=0
for c in ${CASES:-}; do
  i=$((i + 1))
  ncu --clock-control none -k regex:PagedAttentionTc --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section LaunchStats \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      "$DC" ${NCU_DC_ARGS:-} --case "$c" --iters 2 > "$OUT/ncu_$i.txt" 2>&1 || true
  echo "ncu case $i: $c" >> "$OUT/ncu_$i.txt"
done
