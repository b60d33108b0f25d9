"""Timing: back-to-back dispatch of many calls blocked once, medians over interleaved repeats."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

from benchlib.inputs import random_array



@dataclasses.dataclass
class TimingConfig:
  warmup: int = 3  # calls after the compiling one (autotuning, allocator warm-up)
  repeats: int = 7  # median is taken over these
  target_s: float = 0.05  # wall time of one repeat; sets the calls per repeat
  min_calls: int = 10
  max_calls: int = 2000

  @classmethod
  def quick(cls) -> TimingConfig:
    return cls(warmup=1, repeats=3, target_s=0.005, min_calls=2, max_calls=50)


@dataclasses.dataclass
class Timing:
  median_s: float  # seconds per call, median over repeats
  min_s: float
  max_s: float
  calls: int  # calls per repeat
  repeats: int

  @property
  def spread(self) -> float:
    """(max - min) / median over repeats: above ~0.1 the figure is noisy."""
    return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else float("nan")


def _dispatch(fn: Callable, arg_sets: Sequence[tuple], n: int, start: int = 0) -> float:
  """Dispatch n calls back to back (rotating inputs), block once; return wall seconds.

  Only the last output is kept and blocked on: XLA:GPU runs one device's executables in order
  on its compute stream, so the last one finishing means all have; dropping earlier outputs
  lets the allocator reuse their buffers instead of holding n large outputs.
  """
  import jax

  k = len(arg_sets)
  t0 = time.perf_counter()
  out = None
  for i in range(n):
    out = fn(*arg_sets[(start + i) % k])
  jax.block_until_ready(out)
  return time.perf_counter() - t0


def time_fns(fns: dict[str, Callable], arg_sets: Sequence[tuple],
             config: TimingConfig | None = None) -> dict[str, Timing]:
  """Time several implementations of one computation on the same inputs.

  Warm-up compiles every callable and touches every input set; the calls per repeat are then
  sized so a repeat lasts ~config.target_s (JAX dispatch costs tens of microseconds, so a
  single blocked call measures dispatch, not the kernel).  Repeats are interleaved across
  implementations so clock and thermal drift hits all of them alike.
  """
  import jax

  config = config or TimingConfig()
  arg_sets = list(arg_sets)
  k = len(arg_sets)
  calls: dict[str, int] = {}
  for name, fn in fns.items():
    for args in arg_sets:  # first call compiles; one per set puts every copy in HBM
      jax.block_until_ready(fn(*args))
    _dispatch(fn, arg_sets, max(config.warmup, 1))
    probe_n = max(config.min_calls // 2, k, 2)
    est = _dispatch(fn, arg_sets, probe_n) / probe_n
    n = int(min(max(config.target_s / max(est, 1e-9), config.min_calls), config.max_calls))
    calls[name] = max(k, -(-n // k) * k)  # whole rotations: every copy used equally
  samples: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(config.repeats):
    for name, fn in fns.items():
      samples[name].append(_dispatch(fn, arg_sets, calls[name]) / calls[name])
  return {name: Timing(median_s=statistics.median(s), min_s=min(s), max_s=max(s),
                       calls=calls[name], repeats=len(s))
          for name, s in samples.items()}


def time_fn(fn: Callable, arg_sets: Sequence[tuple], config: TimingConfig | None = None) -> Timing:
  return time_fns({"fn": fn}, arg_sets, config)["fn"]


def measure_copy_bandwidth(config: TimingConfig | None = None, nbytes: int = 2**30) -> float:
  """Device copy bandwidth in GB/s (read + write) of a large elementwise op, in this run.

  `x * 3` rather than `x + 0` or `x.copy()`: XLA simplifies those to no kernel at all.  One
  GiB in and one out is 40x the 50 MB L2, so no rotation is needed.
  """
  import jax
  import jax.numpy as jnp

  n = nbytes // 4
  x = random_array(jax.random.PRNGKey(1), (n,), jnp.float32)
  fn = jax.jit(lambda a: a * 3.0)
  t = time_fn(fn, [(x,)], config)
  return 2 * nbytes / t.median_s / 1e9


def measure_dispatch_floor(config: TimingConfig | None = None) -> float:
  """Seconds per call of a trivial jitted op dispatched back to back.

  A measured time within ~1.5x of this is dispatch-bound: the kernel is faster than JAX can
  launch it, and the figure says little about the kernel.
  """
  import jax
  import jax.numpy as jnp

  x = jnp.ones((8,), jnp.float32) * 1.5
  return time_fn(jax.jit(lambda a: a + 1.0), [(x,)], config).median_s
