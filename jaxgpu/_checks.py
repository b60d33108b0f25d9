"""Trace-time argument checks shared by every op: errors name the argument and say what
was expected. Kernels are never launched on input these reject; the FFI handlers check
again (a last line of defence that returns an error instead of crashing)."""

from __future__ import annotations

import math
import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _describe(dtypes) -> str:
  return ", ".join(str(d) for d in dtypes)


def as_array(op: str, name: str, value) -> jax.Array:
  """`value` as something with .shape and .dtype (tracers pass through)."""
  if isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "aval"):
    return value
  if isinstance(value, (bool, int, float, complex, list, tuple)):
    return jnp.asarray(value)
  raise TypeError(f"{op}: {name} must be an array, got {type(value).__name__}")


def float_array(op: str, name: str, value, dtypes=FLOAT_DTYPES) -> jax.Array:
  x = as_array(op, name, value)
  if jnp.dtype(x.dtype) not in dtypes:
    raise TypeError(f"{op}: {name} must have dtype in ({_describe(dtypes)}), got {x.dtype}")
  return x


def min_rank(op: str, name: str, x, rank: int) -> None:
  if x.ndim < rank:
    raise ValueError(f"{op}: {name} must have rank >= {rank}, got shape {tuple(x.shape)}")


def same_dtype(op: str, name: str, x, ref_name: str, ref) -> None:
  if x.dtype != ref.dtype:
    raise TypeError(f"{op}: {name} must have the dtype of {ref_name} ({ref.dtype}), got {x.dtype}")


def shape_is(op: str, name: str, x, shape: tuple[int, ...], what: str) -> None:
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{op}: {name} must have shape {tuple(shape)} ({what}), "
                     f"got {tuple(x.shape)}")


def _static(op: str, name: str, value, kind: str) -> None:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{op}: {name} must be a static Python {kind}, not a traced value")


def static_bool(op: str, name: str, value) -> bool:
  _static(op, name, value, "bool")
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")
  return bool(value)


def static_int(op: str, name: str, value) -> int:
  """A Python/numpy integer (not a bool, not a float)."""
  _static(op, name, value, "int")
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op}: {name} must be an int, got bool")
  try:
    return operator.index(value)
  except TypeError:
    raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}") from None


def static_number(op: str, name: str, value) -> float:
  """A real Python/numpy number (not a bool, not a string)."""
  _static(op, name, value, "number")
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"{op}: {name} must be a number, got {type(value).__name__}")
  return float(value)


def positive_finite(op: str, name: str, value) -> float:
  v = static_number(op, name, value)
  if not (v > 0 and math.isfinite(v)):
    raise ValueError(f"{op}: {name} must be positive and finite, got {value!r}")
  return v


def finite(op: str, name: str, value) -> float:
  v = static_number(op, name, value)
  if not math.isfinite(v):
    raise ValueError(f"{op}: {name} must be finite, got {value!r}")
  return v
