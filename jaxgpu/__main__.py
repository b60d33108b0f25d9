"""Command line: ``python -m jaxgpu info | demo | bench``.

  info    versions; which handler modules were compiled (CUDA architectures, FFI API);
          the devices JAX sees; which implementations each op has in this process.
  demo    trains a small Gemma (jaxgpu.models.gemma, built from jaxgpu's kernels) to sort
          digits for about a minute, then sorts held-out prompts with `generate`; on a GPU
          it also times the training step against implementation='xla'. Exits 1 when the
          model did not learn the task (jaxgpu/_demo.py).
  bench   runs benchmarks/bench_<family>.py of a source checkout (default: norm; `model`: the
          end-to-end Gemma); further arguments go to that script:
          ``python -m jaxgpu bench --quick --no-write``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax

import jaxgpu
from jaxgpu import _family, _ffi, _implementation

# ---- info -----------------------------------------------------------------------------------

# The newest jax release line jaxgpu has been tested with (CI runs Python 3.11 with jax
# 0.10.x; the GPU machine jax 0.11.2; the whole suite passed on Python 3.13 with jax
# 0.12.0.1). A newer jax may change the FFI, custom_partitioning or sharding APIs jaxgpu uses.
NEWEST_TESTED_JAX = (0, 12)


def jax_newer_than_tested(version: str) -> bool:
  """Whether jax `version` ('0.13.1', '0.12.0.dev20261201') is past NEWEST_TESTED_JAX's
  release line."""
  m = re.match(r"(\d+)\.(\d+)", version)
  return bool(m) and (int(m.group(1)), int(m.group(2))) > NEWEST_TESTED_JAX


def _dist_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def _parse_api(text: str) -> tuple[int, int] | None:
  m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
  return (int(m.group(1)), int(m.group(2))) if m else None


def _jaxlib_ffi_api() -> str | None:
  """The FFI API version of the installed jaxlib, read from the headers it ships."""
  import jaxlib

  header = Path(jaxlib.__file__).parent / "include" / "xla" / "ffi" / "api" / "c_api.h"
  try:
    text = header.read_text()
  except OSError:
    return None
  major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
  minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
  return f"{major.group(1)}.{minor.group(1)}" if major and minor else None


def _module_ffi_api(module) -> str | None:
  """The FFI API version a compiled module was built against, if it says."""
  fn = getattr(module, "ffi_api_version", None)
  return str(fn()) if callable(fn) else None


def _api_note(built: str | None, runtime: str | None) -> str:
  if built is None:
    return ""
  note = f", FFI API {built}"
  b, r = _parse_api(built), _parse_api(runtime or "")
  if b and r and b > r:
    # docs/design.md section 4: a newer handler is rejected by an older runtime.
    note += f" -- NEWER than jaxlib's {runtime}: its handlers will be rejected; rebuild"
  return note


def public_ops() -> list[str]:
  """The public kernel-backed ops, as the op families declare them (jaxgpu/_family.py)."""
  return list(_family.all_ops())


def _default_implementation() -> str:
  """What implementation=None runs on the default backend (as _implementation.resolve)."""
  forced = os.environ.get(_implementation.ENV_VAR, "").strip().lower()
  if forced:
    return f"{forced} (forced by {_implementation.ENV_VAR})"
  backend = jax.default_backend()
  if backend in ("gpu", "cuda"):
    if _ffi.cuda_compiled():
      return "cuda"
    return "xla (this GPU has no jaxgpu CUDA handlers: built without nvcc)"
  if backend == "cpu":
    return "cpu" if _ffi.cpu_module() is not None else "none: _jaxgpu_cpu is missing (reinstall)"
  return f"xla? (jaxgpu has no handlers for the '{backend}' backend)"


def _cpu_lines(runtime_api: str | None) -> list[str]:
  module = _ffi.cpu_module()
  if module is None:
    return ["cpu   NOT FOUND: jaxgpu._jaxgpu_cpu is missing (the package was not built; "
            "reinstall with pip install .)"]
  return [f"cpu   compiled{_api_note(_module_ffi_api(module), runtime_api)}  ({module.__file__})"]


def _cuda_lines(runtime_api: str | None) -> list[str]:
  if _ffi.has_cuda_backend():
    module = _ffi.cuda_module()
    if module is None:
      return ["cuda  NOT compiled, but JAX has a CUDA backend: reinstall jaxgpu with nvcc on "
              "PATH (JAXGPU_CUDA=ON makes a missing CUDA compiler a build error)"]
    archs_fn = getattr(module, "cuda_architectures", None)
    archs = archs_fn() if callable(archs_fn) else "unknown"
    return [f"cuda  compiled for architectures {archs}"
            f"{_api_note(_module_ffi_api(module), runtime_api)}  ({module.__file__})"]
  # No GPU: `import jaxgpu` loaded the CUDA module if it loads here (its targets are
  # registered for serialized programs), but there is no device to run it on.
  spec = importlib.util.find_spec("jaxgpu._jaxgpu_cuda")
  if spec is None or spec.origin is None:
    return ["cuda  not compiled (no CUDA compiler at build time, or JAXGPU_CUDA=OFF)"]
  loaded = ("loaded, targets registered" if _ffi.cuda_module() is not None
            else "does not load here")
  return [f"cuda  compiled ({spec.origin}); {loaded}; JAX has no CUDA backend"]


def info() -> int:
  py = platform.python_version()
  print(f"jaxgpu {jaxgpu.__version__}  ({Path(jaxgpu.__file__).parent})")
  print(f"jax {jax.__version__}, jaxlib {_dist_version('jaxlib') or '?'}, "
        f"Python {py} ({sys.platform}, {platform.machine()})")
  if jax_newer_than_tested(jax.__version__):
    newest = ".".join(map(str, NEWEST_TESTED_JAX))
    print(f"warning: jax {jax.__version__} is newer than the newest jax jaxgpu was tested "
          f"with ({newest}.x); if an op fails, pin jax<={newest}.* and report it")
  plugins = [f"{name} {v}" for name in ("jax-cuda13-plugin", "jax-cuda12-plugin")
             if (v := _dist_version(name))]
  print(f"JAX CUDA plugin: {', '.join(plugins) or 'none installed'}")
  runtime_api = _jaxlib_ffi_api()
  print(f"jaxlib's FFI API: {runtime_api or 'unknown (no headers in jaxlib)'}")

  print("handler modules:")
  for line in _cpu_lines(runtime_api) + _cuda_lines(runtime_api):
    print(f"  {line}")

  print(f"devices (default backend: {jax.default_backend()}):")
  for d in jax.devices():
    cc = getattr(d, "compute_capability", None)
    print(f"  {d.id}: {d.platform} {d.device_kind}" + (f" (compute capability {cc})" if cc else ""))

  forced = os.environ.get(_implementation.ENV_VAR)
  print(f"{_implementation.ENV_VAR}: {forced if forced else 'unset'}")
  print(f"implementation=None runs: {_default_implementation()}")

  available = _implementation.available_implementations()
  try:
    targets = _ffi.registered_targets()
  except Exception as e:  # a handler rejected at registration: say so, keep the rest of info
    print(f"registering the FFI targets FAILED: {type(e).__name__}: {e}")
    targets = {}
  ops = _family.all_ops()
  width = max((len(op) for op in ops), default=0)
  print("ops (family; implementations available here, fastest first):")
  for name, (family, op) in ops.items():
    impls = [impl for impl in available
             if impl == "xla" or set(op.targets.values()) <= targets.get(impl, frozenset())]
    print(f"  {name:<{width}}  ({family.name}) {', '.join(impls)}")
  return 0


# ---- bench ----------------------------------------------------------------------------------


def _benchmarks_dir() -> Path | None:
  """benchmarks/ of a source checkout: next to the package (editable install, or run from
  the checkout), or under the working directory."""
  for root in (Path(jaxgpu.__file__).resolve().parent.parent, Path.cwd()):
    candidate = root / "benchmarks"
    if (candidate / "harness.py").is_file():
      return candidate
  return None


def bench(argv: list[str]) -> int:
  family = "norm"
  if argv and not argv[0].startswith("-"):
    family, argv = argv[0], argv[1:]
  root = _benchmarks_dir()
  if root is None:
    print("jaxgpu bench: the benchmarks are not part of the installed package; they live in "
          "benchmarks/ of a jaxgpu source checkout. From the checkout's root, run\n"
          "  python -m jaxgpu bench [FAMILY] [ARGS]    (or python benchmarks/bench_norm.py --help)",
          file=sys.stderr)
    return 2
  # The op families, and the end-to-end model (benchmarks/bench_model.py).
  names = (*_family.FAMILY_NAMES, "model")
  if family not in names:
    print(f"jaxgpu bench: no benchmark {family!r}; benchmarks: {', '.join(names)}",
          file=sys.stderr)
    return 2
  script = root / f"bench_{family}.py"
  if not script.is_file():
    print(f"jaxgpu bench: {script} is missing from this checkout", file=sys.stderr)
    return 2
  cmd = [sys.executable, str(script), *argv]
  print(f"+ {shlex.join(cmd)}", flush=True)
  return subprocess.call(cmd)


# ---- entry point ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "bench":  # everything after it belongs to the benchmark script
    return bench(argv[1:])
  parser = argparse.ArgumentParser(
      prog="python -m jaxgpu", description="jaxgpu: fused CUDA kernels for JAX.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,bench}")
  sub.add_parser("info", help="versions, compiled handlers, devices, implementations per op")
  d = sub.add_parser("demo", help="train a small Gemma to sort digits, then generate; on a "
                     "GPU, its step time with jaxgpu vs implementation='xla'")
  d.add_argument("--seconds", type=float, default=None,
                 help="training time (default: 45 on a CPU, 90 on a GPU)")
  sub.add_parser("bench", help="run benchmarks/bench_<family>.py of a source checkout "
                 "(default family: norm); further arguments go to that script")
  args = parser.parse_args(argv)
  if args.command == "info":
    return info()
  from jaxgpu import _demo  # imports the model only when the demo runs

  return _demo.demo(args.seconds)


if __name__ == "__main__":
  sys.exit(main())
