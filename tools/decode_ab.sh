#!/usr/bin/env bash
# A/B of paged attention's kernels by build-time defines, in one GPU call (no JAX): builds
# tools/decode_check.cu twice, A with the defines in DEFS_A and B with DEFS_B, runs B's
# float64 checks (at page size 16, and at the copy engine's other box shapes: 8, 24, 64 and
# 128 slots), then the speed table of each build, ROUNDS times, the builds interleaved
# (clock and thermal drift hit both alike). Run on the GPU machine:
#   OUT=/tmp/out bash tools/decode_ab.sh          # default B: the counted ring
#   DEFS_B="-DJAXGPU_DECODE_H256_SLICES=2" ROUNDS=3 bash tools/decode_ab.sh
#   TIME_ARGS="--case 32,8,128,8,32768,1" bash tools/decode_ab.sh
# Writes $OUT/check_b.log, $OUT/time_a.log and $OUT/time_b.log (the rounds appended).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NVCC=${NVCC:-nvcc}
DEFS_A=${DEFS_A:-}
DEFS_B=${DEFS_B:--DJAXGPU_DECODE_COUNTED_RING=1}
ROUNDS=${ROUNDS:-2}
FLAGS="-O3 -std=c++17 -Iffi -DJAXGPU_HAS_SM90A=1 -arch=sm_90a"
SOURCES="tools/decode_check.cu ffi/decode/decode_kernels.cu ffi/decode/decode_tc_kernels.cu
  ffi/decode/decode_update_kernels.cu"

build() {  # name defines
  local dir=/tmp/decode_ab_$1
  mkdir -p "$dir"
  for f in $SOURCES; do
    # shellcheck disable=SC2086
    $NVCC $FLAGS $2 -c "$f" -o "$dir/$(basename "$f").o" &
  done
  wait
  $NVCC -arch=sm_90a -o "$dir/dc" "$dir"/*.o
}
echo "== $(date +%H:%M:%S) build A ($DEFS_A) and B ($DEFS_B)"
build a "$DEFS_A" > "$OUT/build_a.log" 2>&1 &
pid_a=$!
build b "$DEFS_B" > "$OUT/build_b.log" 2>&1 || { cat "$OUT/build_b.log"; exit 1; }
wait $pid_a || { cat "$OUT/build_a.log"; exit 1; }

status=0
echo "== $(date +%H:%M:%S) B's checks"
: > "$OUT/check_b.log"
for s in 16 8 24 64 128; do
  echo "-- page size $s" | tee -a "$OUT/check_b.log"
  /tmp/decode_ab_b/dc --no-time --page-size "$s" >> "$OUT/check_b.log" 2>&1 || status=1
  tail -n 1 "$OUT/check_b.log"
done
: > "$OUT/time_a.log"
: > "$OUT/time_b.log"
for round in $(seq "$ROUNDS"); do
  for ab in a b; do
    echo "== $(date +%H:%M:%S) round $round: $ab's speed"
    # shellcheck disable=SC2086
    /tmp/decode_ab_$ab/dc --no-check ${TIME_ARGS:-} >> "$OUT/time_$ab.log" 2>&1 || status=1
  done
done
paste -d '\n' <(grep " us " "$OUT/time_a.log" | sed 's/^/A /') \
  <(grep " us " "$OUT/time_b.log" | sed 's/^/B /')
exit $status
