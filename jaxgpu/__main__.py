"""Command line: ``python -m jaxgpu info | demo | bench``.

  info    versions; which handler modules were compiled (CUDA architectures, FFI API);
          the devices JAX sees; which implementations each op has in this process.
  demo    a small pre-norm transformer stack built from jaxgpu ops, run with the kernels
          (implementation=None) and with the pure-JAX reference (implementation='xla'):
          forward output and parameter gradients are compared, and the jitted
          forward+backward of both is timed. Exits 1 when they disagree.
  bench   runs benchmarks/bench_<family>.py (default: norm) of a source checkout;
          further arguments go to that script: ``python -m jaxgpu bench --quick --no-write``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxgpu
from jaxgpu import _family, _ffi, _implementation

# ---- info -----------------------------------------------------------------------------------


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
  # No GPU: do not import the CUDA module (it is only loaded next to a CUDA backend);
  # finding its file is enough to say whether it was built.
  spec = importlib.util.find_spec("jaxgpu._jaxgpu_cuda")
  if spec is None or spec.origin is None:
    return ["cuda  not compiled (no CUDA compiler at build time, or JAXGPU_CUDA=OFF)"]
  return [f"cuda  compiled ({spec.origin}); not loaded: JAX has no CUDA backend, so its "
          f"architectures are not read"]


def info() -> int:
  py = platform.python_version()
  print(f"jaxgpu {jaxgpu.__version__}  ({Path(jaxgpu.__file__).parent})")
  print(f"jax {jax.__version__}, jaxlib {_dist_version('jaxlib') or '?'}, "
        f"Python {py} ({sys.platform}, {platform.machine()})")
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


# ---- demo -----------------------------------------------------------------------------------

# (batch, seq, d_model, heads, d_ff, layers). 'small': the whole demo takes about 10 s on 2 CPU
# cores; 'large' gives a GPU enough work per launch for the timing to mean something.
_SIZES = {
    "small": (4, 128, 256, 4, 704, 2),
    "large": (8, 1024, 2048, 16, 5632, 2),
}
# Relative L2 error allowed between the kernels and the reference. Both sides run the same
# matmuls and attention; only the norms differ (float32 reduction order), and in bfloat16
# each such difference is rounded again by every later layer. Measured on a CPU: worst leaf
# 1e-6 in float32, 1.1e-2 in bfloat16 at both the 'small' and the 'large' sizes. The
# tolerances leave 5x or more of margin; a wrong kernel or gradient is off by O(1).
_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def _init_params(key, d_model, d_ff, n_layers, dtype):
  def normal(k, shape, scale):
    return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

  def norm_weight(k, shape):  # near 1, not 1: a wrong weight gradient cannot hide
    return (1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

  keys = iter(jax.random.split(key, 7 * n_layers + 2))
  layers = []
  for _ in range(n_layers):
    layers.append({
        "attn_norm": norm_weight(next(keys), (d_model,)),
        "wqkv": normal(next(keys), (d_model, 3 * d_model), d_model ** -0.5),
        "wo": normal(next(keys), (d_model, d_model), d_model ** -0.5),
        "mlp_norm": norm_weight(next(keys), (d_model,)),
        "w_gate": normal(next(keys), (d_model, d_ff), d_model ** -0.5),
        "w_up": normal(next(keys), (d_model, d_ff), d_model ** -0.5),
        "w_down": normal(next(keys), (d_ff, d_model), d_ff ** -0.5),
    })
  return {
      "layers": layers,
      "final_weight": norm_weight(next(keys), (d_model,)),
      "final_bias": normal(next(keys), (d_model,), 0.1),
  }


def _attention(p, y, n_heads):
  b, t, d = y.shape
  qkv = (y @ p["wqkv"]).reshape(b, t, 3, n_heads, d // n_heads)
  o = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
  return o.reshape(b, t, d) @ p["wo"]


def _swiglu(p, y):
  return (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]


def _forward(params, delta, residual, *, n_heads, implementation):
  """Pre-norm blocks on a residual stream carried as (delta, residual): each norm forms
  h = delta + residual in the kernel and returns it as the next residual."""
  for p in params["layers"]:
    y, residual = jaxgpu.rms_norm(delta, p["attn_norm"], residual=residual,
                                  implementation=implementation)
    delta = _attention(p, y, n_heads)
    y, residual = jaxgpu.rms_norm(delta, p["mlp_norm"], residual=residual,
                                  implementation=implementation)
    delta = _swiglu(p, y)
  out, _ = jaxgpu.layer_norm(delta, params["final_weight"], params["final_bias"],
                             residual=residual, implementation=implementation)
  return out


def _make_step(n_heads, implementation):
  """jit(forward + gradient w.r.t. the parameters): returns (loss, output, grads)."""

  def step(params, delta, residual, cotangent):
    def loss_fn(params):
      out = _forward(params, delta, residual, n_heads=n_heads, implementation=implementation)
      return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, out, grads

  return jax.jit(step)


def _rel_err(a, b) -> float:
  a = np.asarray(jax.device_get(a)).astype(np.float64)
  b = np.asarray(jax.device_get(b)).astype(np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _leaf_name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _time_per_call(fn, args, repeats=5, target_s=0.1) -> tuple[float, int]:
  """Median seconds per call: N calls dispatched back to back, one block per repeat."""
  jax.block_until_ready(fn(*args))  # compile
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  single = time.perf_counter() - t0
  n = int(min(100, max(3, target_s / max(single, 1e-6))))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    # Keep only each call's loss scalar: all outputs of one execution are ready together,
    # and dropping the rest keeps N calls' gradients from piling up in device memory.
    losses = [fn(*args)[0] for _ in range(n)]
    jax.block_until_ready(losses)
    times.append((time.perf_counter() - t0) / n)
  return statistics.median(times), n


def demo(dtype: str | None, size: str | None) -> int:
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  dtype = dtype or ("bfloat16" if on_gpu else "float32")
  size = size or ("large" if on_gpu else "small")
  batch, seq, d_model, n_heads, d_ff, n_layers = _SIZES[size]
  tol = _TOLERANCE[dtype]
  device = jax.devices()[0]
  print(f"jaxgpu demo: {n_layers} pre-norm transformer blocks (fused residual + rms_norm, "
        f"causal attention, SwiGLU), final layer_norm")
  print(f"  batch {batch} x seq {seq}, d_model {d_model}, {n_heads} heads, d_ff {d_ff}, "
        f"{dtype} on {device.platform} ({device.device_kind})")
  print(f"  implementation=None runs: {_default_implementation()}; compared with "
        f"implementation='xla' (the pure-JAX reference)")

  k_params, k_delta, k_res, k_ct = jax.random.split(jax.random.key(0), 4)
  params = _init_params(k_params, d_model, d_ff, n_layers, jnp.dtype(dtype))
  shape = (batch, seq, d_model)
  delta = jax.random.normal(k_delta, shape, jnp.float32).astype(dtype)
  residual = jax.random.normal(k_res, shape, jnp.float32).astype(dtype)
  cotangent = jax.random.normal(k_ct, shape, jnp.float32)
  args = (params, delta, residual, cotangent)

  steps = {"jaxgpu": _make_step(n_heads, None), "xla": _make_step(n_heads, "xla")}
  results = {name: jax.block_until_ready(step(*args)) for name, step in steps.items()}

  # The comparison means something only if the kernels are really in the program.
  kernels = sorted(set(re.findall(r'custom_call_target="(jaxgpu_[A-Za-z0-9_]+)"',
                                  steps["jaxgpu"].lower(*args).compile().as_text() or "")))
  print(f"  jaxgpu kernels in the compiled program: {', '.join(kernels) or 'none'}")
  if not kernels and not _default_implementation().startswith("xla"):
    print("demo FAILED: the program has no jaxgpu kernel", file=sys.stderr)
    return 1

  _, out, grads = results["jaxgpu"]
  _, ref_out, ref_grads = results["xla"]
  errors = [("output", _rel_err(out, ref_out))]
  flat, _ = jax.tree_util.tree_flatten_with_path(grads)
  ref_flat = jax.tree_util.tree_leaves(ref_grads)
  errors += [(f"d {_leaf_name(path)}", _rel_err(g, r)) for (path, g), r in zip(flat, ref_flat)]
  ok = all(e <= tol for _, e in errors)  # NaN compares False: a NaN fails the check
  width = max(len(name) for name, _ in errors)
  print(f"check: relative L2 error vs the reference (tolerance {tol:g} for {dtype})")
  for name, e in errors:
    print(f"  {name:<{width}}  {e:.2e}" + ("" if e <= tol else "  <-- FAIL"))
  worst = max((e for _, e in errors), key=lambda e: math.inf if math.isnan(e) else e)
  print(f"  worst {worst:.2e}: {'OK' if ok else 'FAILED'}")

  print("timing: jit(forward + grad), median of 5 repeats of N calls dispatched back to back")
  timings = {}
  for name, step in steps.items():
    timings[name], n = _time_per_call(step, args)
    print(f"  {name:<7} {timings[name] * 1e3:9.3f} ms/step  (N={n})")
  print(f"  xla / jaxgpu time: {timings['xla'] / timings['jaxgpu']:.2f}x")
  if not on_gpu:
    print("  (on a CPU this is informational: the tuned kernels are the CUDA ones)")
  if not ok:
    print("demo FAILED: the jaxgpu kernels disagree with the pure-JAX reference", file=sys.stderr)
    return 1
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
  if family not in _family.FAMILY_NAMES:
    print(f"jaxgpu bench: no op family {family!r}; families: {', '.join(_family.FAMILY_NAMES)}",
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
  d = sub.add_parser("demo", help="a transformer block from jaxgpu ops vs the pure-JAX "
                     "reference: check and timing")
  d.add_argument("--dtype", choices=sorted(_TOLERANCE), default=None,
                 help="default: bfloat16 on a GPU, float32 on a CPU")
  d.add_argument("--size", choices=sorted(_SIZES), default=None,
                 help="default: large on a GPU, small on a CPU")
  sub.add_parser("bench", help="run benchmarks/bench_<family>.py of a source checkout "
                 "(default family: norm); further arguments go to that script")
  args = parser.parse_args(argv)
  if args.command == "info":
    return info()
  return demo(args.dtype, args.size)


if __name__ == "__main__":
  sys.exit(main())
