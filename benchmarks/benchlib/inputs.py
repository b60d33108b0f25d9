"""Benchmark inputs: random device arrays, rotated input sets larger than the L2 cache."""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from benchlib.device import DEFAULT_L2_BYTES, ROTATE_FACTOR



def random_array(key, shape: Sequence[int], dtype, *, scale: float = 1.0, offset: float = 0.0):
  """Normal(offset, scale) array in `dtype`, generated on the device.

  Never zeros: a kernel fed zeros can hit fast paths (denormal-free math, compressible
  memory) and a bug that ignores an input goes unnoticed.
  """
  import jax
  import jax.numpy as jnp

  x = jax.random.normal(key, tuple(shape), jnp.float32) * scale + offset
  return x.astype(dtype)


def tree_nbytes(tree) -> int:
  import jax

  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))


def copies_needed(bytes_per_set: int, l2_bytes: int = DEFAULT_L2_BYTES,
                  factor: int = ROTATE_FACTOR) -> int:
  """How many distinct input sets to rotate so that together they exceed factor x L2.

  E.g. a (4096, 4096) bf16 x (32 MiB) needs 5 copies to exceed 150 MiB; a (16384, 8192) one
  (256 MiB) needs 1.  Outputs are not counted: they are fresh buffers each call.
  """
  if bytes_per_set <= 0:
    return 1
  return max(1, math.floor(factor * l2_bytes / bytes_per_set) + 1)


def make_arg_sets(make_one: Callable[[Any], tuple], key, bytes_per_set: int,
                  l2_bytes: int = DEFAULT_L2_BYTES, max_copies: int | None = None) -> list[tuple]:
  """Build `copies_needed` input tuples with `make_one(key)`, each from its own key."""
  import jax

  n = copies_needed(bytes_per_set, l2_bytes)
  if max_copies is not None:
    n = min(n, max_copies)
  keys = jax.random.split(key, n)
  sets = [tuple(make_one(k)) for k in keys]
  jax.block_until_ready(sets)
  return sets
