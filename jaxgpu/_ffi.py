"""Loads the compiled handler modules and registers every FFI target, once, at import.

Two extension modules:
  _jaxgpu_cpu   always built; its handlers are registered for platform "cpu".
  _jaxgpu_cuda  built when a CUDA compiler was found; its handlers are registered for
                platform "CUDA" whenever it loads, GPU or not (cudart is linked statically;
                a module that fails to load, say for a missing cuBLAS, counts as not built).

`import jaxgpu` registers every target (`register_all`), so that a serialized program
(jax.export) that names jaxgpu targets runs in a process that only imported jaxgpu.
Registering starts no backend: jax queues a platform's registrations until its plugin is
initialized.

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


# The per-platform targets are named `<target>_<suffix>` (see target_name).
PLATFORM_SUFFIXES = ("cpu", "cuda")


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
  """Registers every handler of every module that loads (once) and returns
  {implementation: target names}; 'cuda' is there when the CUDA module loads."""
  targets = {"cpu": _register("cpu")}
  if cuda_module() is not None:
    targets["cuda"] = _register("cuda")
  return targets


def register_all() -> None:
  """What `import jaxgpu` runs. A handler the runtime rejects (built against a newer FFI
  API than the installed jaxlib's) must not break the import of a package whose 'xla'
  implementation still works: the error is raised again, by registered_targets, when a
  kernel is first used (and `python -m jaxgpu info` reports it)."""
  try:
    registered_targets()
  except Exception:  # noqa: BLE001 (re-raised on first use; see the docstring)
    pass


def platform_target_names(base: str) -> tuple[str, ...]:
  """Every name `base` is registered under: the platform-generic one and each platform's."""
  return (base,) + tuple(f"{base}_{suffix}" for suffix in PLATFORM_SUFFIXES)


def target_name(base: str, implementation: str | None) -> str:
  """FFI target for `base` ('jaxgpu_rms_norm_fwd'): platform-generic for None."""
  registered_targets()
  return base if implementation is None else f"{base}_{implementation}"
