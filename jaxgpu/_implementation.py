"""Which implementation an op call runs: 'cuda', 'cpu' (FFI kernels) or 'xla' (reference).

``implementation=None`` runs the FFI kernel of whatever platform XLA places the
computation on (one target name registered for both platforms). A call that passes None
takes the choice of the innermost ``with jaxgpu.implementation(...)`` block around it (a
whole model at once), else the environment variable JAXGPU_IMPLEMENTATION (for A/B runs),
else the default: the explicit argument > the innermost context > the variable > the
default. Asking for a kernel that cannot run here is an error, never a silent fallback.

The choice is made when an op is traced. A function jitted and traced inside a block keeps
that block's choice when called again outside it, and one traced outside keeps its own
inside a block: jax.jit caches traces per Python function and argument types, not per
this choice (jax.jit(f) again, or .lower, reuses f's traces). Where the choice should
differ, trace a different function object (a new lambda or functools.partial around f).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings

import jax

from jaxgpu import _ffi

IMPLEMENTATIONS = ("cuda", "cpu", "xla")
ENV_VAR = "JAXGPU_IMPLEMENTATION"

_warned_no_cuda_module = False

# A ContextVar, so each thread (and asyncio task) has its own choice; a new thread starts
# with none.
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxgpu_implementation", default=None)


def _check_name(implementation) -> None:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation: expected None or one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")


@contextlib.contextmanager
def implementation(name: str | None):
  """Chooses the implementation of every jaxgpu op traced inside the block that passes
  ``implementation=None``: 'cuda', 'cpu', 'xla', or None for the default (the environment
  variable, else the platform's kernel), which undoes an enclosing block. Blocks nest; the
  innermost wins. Usable as a decorator too::

    with jaxgpu.implementation("xla"):
      loss = jax.jit(model)(params, batch)   # traced here: every op runs the reference

  A name that is not an implementation raises ValueError at once; one that cannot run here
  ('cuda' without a GPU) raises when an op is traced, as the argument would.
  """
  _check_name(name)
  token = _scoped.set(name)
  try:
    yield
  finally:
    _scoped.reset(token)


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
    implementation = _scoped.get()
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
  _check_name(implementation)
  if implementation == "cuda" and not _ffi.cuda_compiled():
    why = ("JAX has no CUDA backend here" if not _ffi.has_cuda_backend()
           else "jaxgpu was built without CUDA handlers")
    raise ValueError(f"implementation='cuda' cannot run: {why}")
  if implementation == "cpu" and _ffi.cpu_module() is None:
    raise ValueError("implementation='cpu' cannot run: _jaxgpu_cpu is missing")
  if implementation != "xla":
    _ffi.registered_targets()
  return implementation


def runs_on_cuda(implementation: str | None) -> bool:
  """Whether a resolved implementation ('cpu', 'cuda', or None: the platform's kernel) runs
  the CUDA handler: what a scratch or workspace result is sized for."""
  if implementation is not None:
    return implementation == "cuda"
  return _ffi.has_cuda_backend()


@functools.cache
def hopper_present() -> bool:
  """Whether JAX sees a compute capability 9.0 GPU: where the sm_90a kernels (wgmma, TMA)
  can run. The handlers still check the device they run on and fall back where they must."""
  try:
    return any(getattr(d, "compute_capability", None) == "9.0" for d in jax.devices("gpu"))
  except RuntimeError:  # no GPU backend
    return False
