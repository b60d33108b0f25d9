#!/usr/bin/env bash
# The multi-GPU figures of benchmarks/bench_multigpu.py on one host: for each model, the
# one-GPU baseline, then every case on all the host's GPUs (one process per GPU through
# `python -m jaxgpu.launch`). Appends JSON lines to $OUT/multigpu.jsonl and logs to
# $OUT/multigpu.log; then
#   python3 benchmarks/bench_multigpu.py summarize $OUT/multigpu.jsonl
# puts the ratios into benchmarks/results/<gpu>-x<n>.json and RESULTS.md.
#
#   bash tools/run_on_gpu.sh build && bash tools/run_multigpu.sh
#   MODELS=gemma3_1b CASES=dp,tp,fsdp DECODE=0 bash tools/run_multigpu.sh
# On a real cluster, run the launcher line below on every host with --nnodes, --node-rank
# and --coordinator (python -m jaxgpu.launch --help).
set -euo pipefail

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
# Import the installed jaxgpu (with its compiled modules), never the source tree's.
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off (jaxgpu/launch.py says why)
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
MODELS=${MODELS:-gemma2_2b gemma3_1b}
CASES=${CASES:-dp,tp,fsdp}
[ "$GPUS" -ge 4 ] && CASES=${CASES},fsdp_tp
DECODE=${DECODE:-1}
extra=""
[ "$DECODE" = 1 ] && extra=",decode"
status=0
for model in $MODELS; do
  for n in 1 "$GPUS"; do
    cases=$([ "$n" = 1 ] && echo "single" || echo "$CASES")
    echo "== $(date +%H:%M:%S) $model on $n GPU(s): $cases$extra" | tee -a "$OUT/multigpu.log"
    python3 -m jaxgpu.launch --nproc "$n" -- python3 benchmarks/bench_multigpu.py run \
      --model "$model" --cases "$cases$extra" --out "$OUT/multigpu.jsonl" \
      >> "$OUT/multigpu.log" 2>&1 || { status=1; echo "FAILED: $model on $n GPUs"; }
  done
done
grep -E "^\[0\] \{|FAILED|Error" "$OUT/multigpu.log" | cut -c1-400 || true
exit $status
