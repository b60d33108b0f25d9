"""Which implementation an op call runs: 'cuda', 'cpu' (FFI kernels) or 'xla' (reference).

``implementation=None`` runs the FFI kernel of whatever platform XLA places the
computation on (one target name registered for both platforms). The environment variable
JAXGPU_IMPLEMENTATION forces a choice for every call that passes None, for A/B runs.
Asking for a kernel that cannot run here is an error, never a silent fallback.
"""

from __future__ import annotations

import os
import warnings

from jaxgpu import _ffi

IMPLEMENTATIONS = ("cuda", "cpu", "xla")
ENV_VAR = "JAXGPU_IMPLEMENTATION"

_warned_no_cuda_module = False


def available_implementations() -> tuple[str, ...]:
  """Implementations that can run in this process, fastest first."""
  out = []
  if _ffi.cuda_compiled():
    out.append("cuda")
  if _ffi.cpu_module() is not None:
    out.append("cpu")
  out.append("xla")
  return tuple(out)


def resolve(implementation: str | None) -> str | None:
  """Returns 'xla', 'cpu', 'cuda', or None for the platform-generic FFI kernel."""
  global _warned_no_cuda_module
  if implementation is None:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
      if forced not in IMPLEMENTATIONS:
        raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {IMPLEMENTATIONS}")
      implementation = forced
  if implementation is None:
    if _ffi.has_cuda_backend() and _ffi.cuda_module() is None:
      # A GPU is present but the CUDA handlers were not compiled (no nvcc at install):
      # the generic target would have no CUDA handler. Say so once and use XLA.
      if not _warned_no_cuda_module:
        warnings.warn("jaxgpu was built without CUDA handlers; using the XLA reference "
                      "implementations on the GPU (reinstall with nvcc on PATH)")
        _warned_no_cuda_module = True
      return "xla"
    if _ffi.cpu_module() is None:
      raise RuntimeError("jaxgpu's compiled module _jaxgpu_cpu is missing: reinstall jaxgpu")
    _ffi.registered_targets()
    return None
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation: expected None or one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation == "cuda" and not _ffi.cuda_compiled():
    why = ("JAX has no CUDA backend here" if not _ffi.has_cuda_backend()
           else "jaxgpu was built without CUDA handlers")
    raise ValueError(f"implementation='cuda' cannot run: {why}")
  if implementation == "cpu" and _ffi.cpu_module() is None:
    raise ValueError("implementation='cpu' cannot run: _jaxgpu_cpu is missing")
  if implementation != "xla":
    _ffi.registered_targets()
  return implementation
