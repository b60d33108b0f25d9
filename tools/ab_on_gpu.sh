#!/usr/bin/env bash
# A/B of kernel changes on the GPU machine, in one call: builds the tree as it is ("base")
# and the tree with each patch applied, then times every build with attention_variants.py,
# the builds interleaved round by round (clock and thermal drift hit all of them alike).
#
#   git diff main experiment/x > /tmp/x.patch      # a kernel change as a patch
#   bash tools/ab_on_gpu.sh /tmp/x.patch /tmp/y.patch
#   ROUNDS=3 VARIANTS=opts,seg,cap PASSES=bwd bash tools/ab_on_gpu.sh /tmp/x.patch
#   NCU=1 VARIANTS=opts PASSES=bwd bash tools/ab_on_gpu.sh /tmp/x.patch  # per kernel
#   JAXGPU_CUDA=OFF AB_ARGS="--implementation cpu --t 64" bash tools/ab_on_gpu.sh  # smoke
#
# Writes under the output folder given by OUT (default /tmp/out): ab.jsonl (one line per
# figure) and ab.txt (the table); with NCU=1, ncu.txt (each kernel's median duration per
# build and variant, with --clock-control none: ncu's default locks the clocks below the
# boost clock the timings run at, which lengthens every kernel); a failed build's log.
# Budget: one build takes 80-90 s on an H100 machine of 16 cores, and each timed pass a few
# seconds (compiling, the rotated inputs, 5 repeats): ROUNDS x builds x VARIANTS x PASSES
# sets the length of a call.
set -euo pipefail

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${AB_WORK:-/tmp/jaxgpu-ab}
ROUNDS=${ROUNDS:-3}
VARIANTS=${VARIANTS:-plain,causal,cap,seg,opts,h64-causal,h256-causal}
# Any ncu metrics, e.g. the pipes' busy fractions:
#   NCU_METRICS=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
NCU_METRICS=${NCU_METRICS:-gpu__time_duration.sum}
PASSES=${PASSES:-fwd,bwd,fwd+bwd}

export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PATH=/usr/local/cuda/bin:$PATH
export JAXGPU_CUDA_ARCHS=${JAXGPU_CUDA_ARCHS:-90a} JAXGPU_CUDA=${JAXGPU_CUDA:-ON}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

names=(base)
patches=("")
for p in "$@"; do
  [ -f "$p" ] || { echo "no patch file $p" >&2; exit 2; }
  names+=("$(basename "$p" .patch)")
  patches+=("$(cd "$(dirname "$p")" && pwd)/$(basename "$p")")
done

rm -rf "$WORK"
mkdir -p "$WORK"
# The builds run side by side: one build's wall time is set by its few longest nvcc
# compiles (the attention kernels' template instances), not by the 16 cores.
build() {  # name patch
  local src="$WORK/src-$1"
  mkdir -p "$src"
  tar -C "$REPO" --exclude=./build --exclude=./.carry --exclude=./.git -cf - . | tar -C "$src" -xf -
  if [ -n "$2" ]; then (cd "$src" && patch -p1 -s < "$2"); fi
  python3 -m pip install --no-build-isolation --no-deps --target "$WORK/site-$1" "$src" \
    > "$WORK/build-$1.log" 2>&1
}
echo "== $(date +%H:%M:%S) build ${names[*]}"
pids=()
for i in "${!names[@]}"; do
  build "${names[$i]}" "${patches[$i]}" &
  pids+=($!)
done
for i in "${!names[@]}"; do
  if ! wait "${pids[$i]}"; then
    cp "$WORK/build-${names[$i]}.log" "$OUT/"
    tail -n 40 "$WORK/build-${names[$i]}.log"
    echo "BUILD FAILED: ${names[$i]}" >&2
    exit 1
  fi
done
echo "== $(date +%H:%M:%S) built"

tool="$REPO/benchmarks/attention_variants.py"
if [ -n "${NCU:-}" ]; then
  # One ncu process per (build, variant): each kernel's launches, the untimed forward that
  # makes the backward's residuals included, grouped by kernel name.
  for name in "${names[@]}"; do
    for var in ${VARIANTS//,/ }; do
      echo "== $(date +%H:%M:%S) ncu $name $var"
      csv="$WORK/ncu-$name-$var.csv"
      PYTHONPATH="$WORK/site-$name" ncu --clock-control none --csv --print-units base \
        --metrics "$NCU_METRICS" -k regex:'Sm90Kernel|DeltaKernel|DqKernel|DkvKernel|FwdKernel' \
        python3 "$tool" --profile --variants "$var" --passes "$PASSES" ${AB_ARGS:-} \
        > "$csv" 2> "$OUT/ncu.err" || { echo "ncu failed: $OUT/ncu.err"; tail -n 5 "$OUT/ncu.err"; }
      python3 - "$csv" <<'EOF2' | tee -a "$OUT/ncu.txt"
import collections, csv, re, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
kn, mn, val = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
values = collections.defaultdict(list)
for r in body:
    try:
        x = float(r[val].replace(",", ""))
    except ValueError:
        continue
    name = re.search(r"(\w+Kernel)\b", r[kn])  # the names hold "(anonymous namespace)"
    values[(name.group(1) if name else r[kn][:24], r[mn])].append(x)
print(sys.argv[1].rsplit("/", 1)[-1])
for (k, m), v in values.items():  # base units: gpu__time_duration in ns
    print(f"  {k:<24} {m:<48} {len(v):3d} launches, median {statistics.median(v):12.1f}")
EOF2
    done
  done
  exit 0
fi

for r in $(seq "$ROUNDS"); do
  for name in "${names[@]}"; do
    echo "== $(date +%H:%M:%S) round $r: $name"
    PYTHONPATH="$WORK/site-$name" python3 "$tool" --label "$name" --variants "$VARIANTS" \
      --passes "$PASSES" --seed "$r" --json "$OUT/ab.jsonl" ${AB_ARGS:-}
  done
done
python3 "$tool" --summarize "$OUT/ab.jsonl" | tee "$OUT/ab.txt"
