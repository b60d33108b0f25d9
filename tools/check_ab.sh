#!/usr/bin/env bash
# A/B of a family's CUDA kernels by build-time defines, in one GPU call and without JAX:
# builds the family's standalone checker twice (A with the defines in DEFS_A, B with
# DEFS_B), runs B's float64 checks once per argument set in CHECK_RUNS, then each build's
# speed table ROUNDS times, the builds interleaved (clock and thermal drift hit both alike).
# Run on the GPU machine:
#   bash tools/check_ab.sh decode      # A: every instance on the barrier ring; B: as shipped
#   DEFS_B="-DJAXGPU_QLINEAR_GEMV_KS8=4 -DJAXGPU_QLINEAR_GEMV_DEPTH8=1" \
#     bash tools/check_ab.sh qlinear
#   TIME_ARGS="--case 32,8,128,8,32768,1" ROUNDS=3 bash tools/check_ab.sh decode
# Writes $OUT/build_{a,b}.log, check_b.log, time_a.log and time_b.log (rounds appended).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
family=${1:-decode}
case "$family" in
  decode)
    sources="tools/decode_check.cu ffi/decode/decode_kernels.cu ffi/decode/decode_tc_kernels.cu
      ffi/decode/decode_update_kernels.cu"
    default_a="-DJAXGPU_DECODE_COUNTED_RING=0"
    default_b=""
    # The copy engine's three box rules: page size 16 (a box a page), 24 (8-slot boxes), 128
    # (64-slot boxes, two a page).
    default_checks="--no-time --page-size 16;--no-time --page-size 24;--no-time --page-size 128"
    default_time="--no-check" ;;
  qlinear)
    sources="tools/qlinear_check.cu ffi/matmul/qlinear_kernels.cu ffi/matmul/qlinear_wgmma_sm90.cu"
    default_a=""
    default_b=""
    default_checks="--no-time;--no-time --gemv;--no-time --wgmma"
    default_time="--time-only --gemv" ;;
  *) echo "family: decode or qlinear" >&2; exit 2 ;;
esac
NVCC=${NVCC:-nvcc}
DEFS_A=${DEFS_A-$default_a}  # set but empty: no defines
DEFS_B=${DEFS_B-$default_b}
CHECK_RUNS=${CHECK_RUNS:-$default_checks}
TIME_ARGS=${TIME_ARGS:-$default_time}
ROUNDS=${ROUNDS:-2}
FLAGS="-O3 -std=c++17 -Iffi -DJAXGPU_HAS_SM90A=1 -arch=sm_90a"

build() {  # name defines
  local dir=/tmp/check_ab_$1
  rm -rf "$dir"
  mkdir -p "$dir"
  for f in $sources; do
    # shellcheck disable=SC2086
    $NVCC $FLAGS $2 -c "$f" -o "$dir/$(basename "$f").o" &
  done
  wait
  $NVCC -arch=sm_90a -o "$dir/check" "$dir"/*.o
}
echo "== $(date +%H:%M:%S) $family: build A ($DEFS_A) and B ($DEFS_B)"
build a "$DEFS_A" > "$OUT/build_a.log" 2>&1 &
pid_a=$!
build b "$DEFS_B" > "$OUT/build_b.log" 2>&1 &
pid_b=$!
wait $pid_a || { cat "$OUT/build_a.log"; exit 1; }
wait $pid_b || { cat "$OUT/build_b.log"; exit 1; }

status=0
: > "$OUT/check_b.log"
IFS=';' read -ra runs <<< "$CHECK_RUNS"
for args in "${runs[@]}"; do
  echo "== $(date +%H:%M:%S) B's checks: $args" | tee -a "$OUT/check_b.log"
  # shellcheck disable=SC2086
  /tmp/check_ab_b/check $args >> "$OUT/check_b.log" 2>&1 || status=1
  tail -n 1 "$OUT/check_b.log"
done
: > "$OUT/time_a.log"
: > "$OUT/time_b.log"
for round in $(seq "$ROUNDS"); do
  for ab in a b; do
    echo "== $(date +%H:%M:%S) round $round: $ab's speed"
    # shellcheck disable=SC2086
    /tmp/check_ab_$ab/check $TIME_ARGS >> "$OUT/time_$ab.log" 2>&1 || status=1
  done
done
echo "== A then B, line by line"
paste -d '\n' <(grep " us" "$OUT/time_a.log" | sed 's/^/A /') \
  <(grep " us" "$OUT/time_b.log" | sed 's/^/B /')
exit $status
