"""Loads the compiled handler modules and registers every FFI target, once.

Two extension modules:
  _jaxgpu_cpu   always built; its handlers are registered for platform "cpu".
  _jaxgpu_cuda  built when a CUDA compiler was found; imported only when JAX has a CUDA
                backend, so a CPU-only install never needs libcudart at import.

Each handler is registered under two names: the plain target name ``jaxgpu_<op>_<pass>``,
registered for both platforms so that one traced program runs wherever XLA places it
(``implementation=None``), and ``jaxgpu_<op>_<pass>_<platform>`` for one platform only,
used when a caller asks for an implementation explicitly: lowering it for the other
platform fails in XLA rather than silently running the other kernel.
"""

from __future__ import annotations

import functools
import importlib

import jax

# jax's platform names for register_ffi_target: exactly "cpu" and "CUDA" (a lowercase
# "cuda" registers but is never found at run time).
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}


@functools.cache
def _module(kind: str):
  """The compiled module for 'cpu' or 'cuda', or None when it was not built."""
  try:
    return importlib.import_module(f"jaxgpu._jaxgpu_{kind}")
  except ImportError:
    return None


def cpu_module():
  return _module("cpu")


def cuda_module():
  return _module("cuda")


@functools.cache
def has_cuda_backend() -> bool:
  """True when JAX can run computations on a CUDA GPU."""
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:
    return False


def cuda_compiled() -> bool:
  """True when the CUDA handlers were built (importing them only if a GPU is present)."""
  return has_cuda_backend() and cuda_module() is not None


def _register(kind: str) -> frozenset[str]:
  module = _module(kind)
  if module is None:
    return frozenset()
  platform = _XLA_PLATFORM[kind]
  names = []
  for name, capsule in module.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform=platform)
    jax.ffi.register_ffi_target(f"{name}_{kind}", capsule, platform=platform)
    names.append(name)
  return frozenset(names)


@functools.cache
def registered_targets() -> dict[str, frozenset[str]]:
  """Registers every handler (once) and returns {implementation: target names}."""
  targets = {"cpu": _register("cpu")}
  if has_cuda_backend():
    targets["cuda"] = _register("cuda")
  return targets


def target_name(base: str, implementation: str | None) -> str:
  """FFI target for `base` ('jaxgpu_rms_norm_fwd'): platform-generic for None."""
  registered_targets()
  return base if implementation is None else f"{base}_{implementation}"
