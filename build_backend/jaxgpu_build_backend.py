"""jaxgpu's PEP 517 build backend: scikit-build-core's, plus the build requirements that
depend on the build.

A build that compiles the CUDA module (JAXGPU_CUDA=ON, or AUTO with a CUDA compiler found)
needs cuBLASLt's headers and library (ffi/common/blas/). The GPU machine's CUDA toolkit has
them; a CUDA toolkit without cuBLAS (a CPU-only CI machine with nvcc) gets them from the
nvidia-cublas wheel, which pip installs into the isolated build environment only then.
`[build-system] requires` in pyproject.toml is static and cannot say this.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import (  # noqa: F401  (the PEP 517 hooks, re-exported)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

# The cu13 layout (nvidia/cu13/{include,lib}) that CMakeLists.txt looks for.
CUBLAS_REQUIREMENT = "nvidia-cublas>=13,<14"


def _cuda_compiler() -> str | None:
  """The nvcc CMake's check_language(CUDA) would find: $CUDACXX, PATH, /usr/local/cuda."""
  for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
    if candidate and os.path.isfile(candidate):
      return candidate
  return None


def _cuda_requires() -> list[str]:
  mode = os.environ.get("JAXGPU_CUDA", "AUTO").upper()
  if mode == "OFF":
    return []
  nvcc = _cuda_compiler()
  if nvcc is None:
    return []  # AUTO builds the CPU module only; ON fails in CMake with the reason
  toolkit = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
  if os.path.isfile(os.path.join(toolkit, "include", "cublasLt.h")):
    return []
  return [CUBLAS_REQUIREMENT]


def get_requires_for_build_wheel(config_settings=None):
  return _scikit_build.get_requires_for_build_wheel(config_settings) + _cuda_requires()


def get_requires_for_build_editable(config_settings=None):
  return _scikit_build.get_requires_for_build_editable(config_settings) + _cuda_requires()
