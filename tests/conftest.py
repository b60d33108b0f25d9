"""Shared test setup: 8 fake CPU devices, the `gpu` and `slow` markers, the one test base.

* XLA_FLAGS gets --xla_force_host_platform_device_count=8 before jax is imported, so the
  sharding tests have 8 CPU devices on every machine (on the GPU machine too: they build
  their meshes from jax.devices('cpu') explicitly).
* `implementation` parametrizes a test over every implementation that runs on the default
  device here: ('cpu', 'xla') on a CPU-only machine, ('cuda', 'xla') when JAX has a CUDA
  backend. The 'cuda' case carries the `gpu` marker, so `pytest -m gpu` on the GPU machine
  runs exactly the CUDA-kernel tests; tests marked `gpu` are skipped without a CUDA backend.
* `host_implementation` parametrizes over what runs on the 8 CPU devices: ('cpu', 'xla').
* `rng`: a fresh numpy Generator per test. Its seed is printed (shown on failure) and can be
  pinned with JAXGPU_TEST_SEED=<seed> to reproduce a failure.
* `slow` tests (the full combinatorial matrix) run only with --run-slow.
* `--shard=I/N` keeps every N-th collected test starting at the I-th (in node-id order, so
  every xdist worker keeps the same ones): the GPU test run of the attention file takes
  ~800 s on the H100 machine, more than one 10-minute device call, and N calls with I =
  0..N-1 cover it exactly once.
* Without a CUDA plugin installed (a CPU-only machine, CI), XLA_FLAGS also gets
  --xla_backend_optimization_level=0: the suite's time is mostly XLA compiling small CPU
  programs, and LLVM's optimizations are most of that (the rms_norm contract cases: 34 s ->
  17 s on this 2-core machine). Float semantics are unchanged: XLA's CPU fast-math is off,
  so the emitted IR fixes every rounding before LLVM optimizes it. A GPU machine keeps the
  default (the flag would also reach the GPU backend's code generation).
No global x64: float64 oracles are numpy, or jax inside tests/oracle.x64().
"""

from __future__ import annotations

import importlib.metadata
import os
import time
import zlib

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
# (The flag is read when the CPU backend starts; `cpu_devices` checks it took effect.)
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags = (_flags + " " + _DEVICE_FLAG).strip()


def _cuda_plugin_installed() -> bool:
  """Whether a jax CUDA PJRT plugin (jax-cuda12-plugin, jax-cuda13-plugin) is installed."""
  for dist in importlib.metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name.startswith("jax-cuda") and name.endswith("-plugin"):
      return True
  return False


_FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in _flags and not _cuda_plugin_installed():
  _flags = (_flags + " " + _FAST_COMPILE_FLAG).strip()
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jaxgpu  # noqa: E402
from jaxgpu import _ffi  # noqa: E402

HAS_CUDA = _ffi.has_cuda_backend()


def kernel_implementations() -> list:
  """Implementations to test on the default device, the 'cuda' one marked gpu."""
  if HAS_CUDA:
    # 'cuda' even when the CUDA module was not built: on a GPU machine that must fail
    # loudly (the test then says why), not vanish from the run.
    return [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"), "xla"]
  return [i for i in jaxgpu.available_implementations() if i != "cuda"]


def host_implementations() -> list:
  """Implementations that run on the (8 fake) CPU devices."""
  return [i for i in jaxgpu.available_implementations() if i in ("cpu", "xla")]


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="also run tests marked slow (the full combinatorial matrix)")
  parser.addoption("--shard", default=None, metavar="I/N",
                   help="run only the I-th of N disjoint shards of the collected tests")


def parse_shard(text: str) -> tuple:
  """'I/N' -> (I, N), with 0 <= I < N."""
  try:
    index, count = (int(x) for x in text.split("/"))
  except ValueError:
    raise pytest.UsageError(f"--shard: expected I/N with integers, got {text!r}") from None
  if not 0 <= index < count:
    raise pytest.UsageError(f"--shard: need 0 <= I < N, got {text!r}")
  return index, count


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped cleanly without one)")
  config.addinivalue_line("markers", "slow: long-running cases (run with --run-slow)")


def slow_enabled(config) -> bool:
  return bool(config.getoption("--run-slow"))


def pytest_collection_modifyitems(config, items):
  shard = config.getoption("--shard")
  if shard:
    index, count = parse_shard(shard)
    keep = {it.nodeid for it in sorted(items, key=lambda it: it.nodeid)[index::count]}
    config.hook.pytest_deselected(items=[it for it in items if it.nodeid not in keep])
    items[:] = [it for it in items if it.nodeid in keep]
  no_gpu = pytest.mark.skip(reason="JAX has no CUDA backend here")
  no_slow = pytest.mark.skip(reason="slow: run with --run-slow")
  for item in items:
    if "gpu" in item.keywords and not HAS_CUDA:
      item.add_marker(no_gpu)
    if "slow" in item.keywords and not slow_enabled(config):
      item.add_marker(no_slow)


def pytest_generate_tests(metafunc):
  if "implementation" in metafunc.fixturenames:
    metafunc.parametrize("implementation", kernel_implementations())
  if "host_implementation" in metafunc.fixturenames:
    metafunc.parametrize("host_implementation", host_implementations())


@pytest.fixture
def rng(request):
  pinned = os.environ.get("JAXGPU_TEST_SEED")
  if pinned:
    seed = int(pinned)
  else:
    seed = (zlib.crc32(request.node.nodeid.encode()) ^ time.time_ns()) & 0xFFFFFFFF
  request.node._jaxgpu_seed = seed
  print(f"seed={seed} (reproduce with JAXGPU_TEST_SEED={seed})")
  return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  seed = getattr(item, "_jaxgpu_seed", None)
  if seed is not None and report.failed:
    report.sections.append(("random seed", f"JAXGPU_TEST_SEED={seed}"))


@pytest.fixture(scope="session")
def cpu_devices():
  devices = jax.devices("cpu")
  assert len(devices) >= 8, (f"expected 8 fake CPU devices (XLA_FLAGS={_DEVICE_FLAG}), got "
                             f"{len(devices)}: was the CPU backend started before conftest?")
  return devices[:8]
