#!/usr/bin/env bash
# The one script for the GPU machine (docs/design.md section 5): build, GPU tests, benchmarks.
#
#   bash tools/run_on_gpu.sh                 # all stages: build test bench
#   bash tools/run_on_gpu.sh build test      # any subset, in this order
#   bash tools/run_on_gpu.sh build gputest   # only the gpu-marked tests (faster)
#   PYTEST_ARGS="-k rms" bash tools/run_on_gpu.sh test
#   # the attention file's GPU tests (~800 s under xdist on an H100): one shard per call
#   PYTEST_ARGS="-n 8 -p no:cacheprovider --shard=0/2 tests/test_attention.py" \
#     bash tools/run_on_gpu.sh build gputest          # then --shard=1/2
#   BENCH_ARGS="--quick" bash tools/run_on_gpu.sh bench
#   JAXGPU_CUDA=OFF bash tools/run_on_gpu.sh build   # CPU smoke run of the build stage
#   WHEEL=dist/jaxgpu-0.1.0-cp312-abi3-linux_x86_64.whl bash tools/run_on_gpu.sh build gputest
#     # installs a wheel built elsewhere (JAXGPU_CUDA_ARCHS=90a pip wheel --no-deps . on
#     # Python >= 3.12: the abi3 wheel), so the GPU machine's time is not spent compiling
#
# Writes at most 7 files, all directly under the output folder given by OUT (default
# /tmp/out): nvidia-smi.log build.log info.log tests.log bench.log <gpu>.json RESULTS.md
# A cold CUDA build takes minutes (the attention kernels' template instances). To keep each
# call short, run `build test` and then `bench`: the second call reuses the build (build/
# stays in the checkout, and scikit-build-core rebuilds incrementally).
# Set JAXGPU_GIT_COMMIT to the commit being measured when the checkout is a copy without .git.
set -euo pipefail

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

export PYTHONUNBUFFERED=1
# Never import the source tree's jaxgpu/ (it has no compiled modules) instead of the installed
# one: with this, `python3 -m ...` and scripts do not put the cwd/script dir first on sys.path.
export PYTHONSAFEPATH=1
export PATH=/usr/local/cuda/bin:$PATH
# Only the H100/H200 (sm_90a: the wgmma kernels too); a two-architecture build takes about
# twice as long.
export JAXGPU_CUDA_ARCHS=${JAXGPU_CUDA_ARCHS:-90a}
export JAXGPU_CUDA=${JAXGPU_CUDA:-ON}  # fail the build rather than silently skip CUDA
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build test bench)
for s in "${STAGES[@]}"; do
  case "$s" in build|test|gputest|bench) ;;
    *) echo "unknown stage '$s' (build, test, gputest, bench)" >&2; exit 2 ;; esac
done
want() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

status=0
note() { echo "== $(date +%H:%M:%S) $*"; }

nvidia-smi > "$OUT/nvidia-smi.log" 2>&1 || echo "nvidia-smi failed" >> "$OUT/nvidia-smi.log"
head -n 12 "$OUT/nvidia-smi.log"

if want build; then
  if [ -n "${WHEEL:-}" ]; then
    note "install $WHEEL -> $OUT/build.log"
    what=("$WHEEL" --force-reinstall)
  else
    note "build (sm_$JAXGPU_CUDA_ARCHS) -> $OUT/build.log"
    what=(.)
  fi
  # Non-editable, no isolation (the machine has no network), no deps (all preinstalled).
  if ! python3 -m pip install --no-build-isolation --no-deps -v "${what[@]}" \
      > "$OUT/build.log" 2>&1; then
    tail -n 60 "$OUT/build.log"
    note "BUILD FAILED"
    exit 1
  fi
  grep -E "jaxgpu:|Successfully" "$OUT/build.log" || true
  note "jaxgpu info -> $OUT/info.log"
  {
    python3 -c "import jaxgpu, jax; print('jaxgpu from', jaxgpu.__file__); print(jax.devices())"
    python3 -m jaxgpu info
  } > "$OUT/info.log" 2>&1 || status=1
  cat "$OUT/info.log"
fi

# Guard against testing the source tree: the installed package must be the one imported.
where=$(python3 -c "import jaxgpu; print(jaxgpu.__file__)" 2>&1 || true)
case "$where" in
  "$REPO"/*) note "WARNING: jaxgpu imports from the source tree ($where), not the install" ;;
esac

if want test || want gputest; then
  note "tests -> $OUT/tests.log"
  # GPU tests first and stop at the first failure (fast signal), then the whole suite.
  # A test failure does not stop the benchmark stage; it makes the script exit non-zero.
  : > "$OUT/tests.log"
  run_pytest() {  # exit status 5 = nothing collected (e.g. no gpu-marked tests yet): not a failure
    local rc
    set +e
    # No preallocation of 75% of GPU memory: lets PYTEST_ARGS="-n 4" (xdist) share the GPU.
    # shellcheck disable=SC2086
    XLA_PYTHON_CLIENT_PREALLOCATE=false \
      python3 -m pytest "$@" ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/tests.log" | tail -n 40
    rc=${PIPESTATUS[0]}
    set -e
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; note "TESTS FAILED: pytest $* (rc $rc)"; fi
  }
  run_pytest -m gpu -x -q -rs
  if want test; then run_pytest -q -rs --durations=10; fi
fi

if want bench; then
  note "bench -> $OUT/bench.log"
  : > "$OUT/bench.log"
  for bench in ${BENCHES:-benchmarks/bench_*.py}; do
    # shellcheck disable=SC2086
    python3 "$bench" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" \
      || { status=1; note "BENCH FAILED: $bench"; }
  done
fi

note "done (status $status); files in $OUT:"
ls -la "$OUT"
exit $status
