"""Rotary position embedding (RoPE), forward and backward.

Kernels: ffi/rope/ (targets jaxgpu_rope_{fwd,bwd}). Reference: jaxgpu/reference/rope.py.
Tests: tests/test_rope.py. Benchmarks: benchmarks/bench_rope.py.

Memory. The forward pass allocates only its output (the shape and dtype of x) and keeps
nothing but `positions` for the backward pass; the backward pass allocates only dx. No
cos/sin tables exist anywhere: the kernels compute each angle from its position, in
double precision, once per (token, frequency), and reuse it for every head.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpu import _autodiff, _checks, _implementation
from jaxgpu._family import Family, Op
from jaxgpu._kernel_op import Layout, grouped_call, match_primal_types, primal_types
from jaxgpu.reference import rope as reference

ROPE = Op("rope", {"fwd": "jaxgpu_rope_fwd", "bwd": "jaxgpu_rope_bwd"})
FAMILY = Family("rope", (ROPE,))


LAYOUTS = reference.LAYOUTS

# Factor strings (jaxgpu/_kernel_op.py): rows (the leading dims), the sequence t and the
# heads n keep any sharding, the head dim d is gathered. positions share x's row and t
# factors, so a (B, T) positions array is split exactly like x; a shared (T,) one is its
# own "[g] t" parameter (size-1 group, split only along t).
_X = "g ... t n d"
_POS_PER_TOKEN = "g ... t"
_POS_SHARED = "[g] t"

@dataclasses.dataclass(frozen=True)
class _Config:
  theta: float
  interleaved: bool
  rotary_dim: int
  shared_positions: bool      # positions (T,) rather than x.shape[:-2]
  implementation: str | None  # 'cpu', 'cuda', or None (platform-generic)
  primal_types: tuple = (None,)  # of x (see _kernel_op)

  def target(self, pass_: str) -> str:
    return ROPE.target(pass_, self.implementation)


def _rotate(cfg: _Config, x, positions, inverse: bool):
  """x (G, ..., T, N, H) and positions (G, ..., T) or (G or 1, T): rotated x."""
  layout = Layout(inputs=(_X, _POS_SHARED if cfg.shared_positions else _POS_PER_TOKEN),
                  outputs=(_X,))

  def local_fn(x, positions):
    seq, heads, dim = x.shape[-3:]
    rows = math.prod(x.shape[:-3])
    y = jax.ffi.ffi_call(
        cfg.target("bwd" if inverse else "fwd"),
        jax.ShapeDtypeStruct((rows, seq, heads, dim), x.dtype),
    )(x.reshape(rows, seq, heads, dim), positions.reshape(-1, seq),
      theta=np.float64(cfg.theta), rotary_dim=np.int32(cfg.rotary_dim),
      interleaved=cfg.interleaved)
    return (y.reshape(x.shape),)

  (y,) = grouped_call(local_fn, layout, x, positions)
  return y


# ---- the differentiable op ------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope(cfg: _Config, x, positions):
  return _rotate(cfg, x[None], positions[None], inverse=False)[0]


def _rope_fwd(cfg: _Config, x, positions):
  return _rotate(cfg, x[None], positions[None], inverse=False)[0], positions


def _rope_bwd(cfg: _Config, positions, dy):
  # A rotation's transpose is the rotation by -angle: dx = rope(dy, -positions), as one
  # kernel (negating the angle, not the positions: -(-2^31) does not fit an int32).
  dx = _rotate(cfg, dy[None], positions[None], inverse=True)[0]
  (dx,) = match_primal_types((dx,), cfg.primal_types)
  return dx, None  # integer positions have no cotangent


_rope.defvjp(_rope_fwd, _rope_bwd)


# ---- public API ---------------------------------------------------------------------------


def _check(op, x, positions, theta, layout, rotary_dim):
  x = _checks.float_array(op, "x", x)
  if x.ndim < 3:
    raise ValueError(f"{op}: x must have shape (..., T, N, H) (rank >= 3), got shape "
                     f"{tuple(x.shape)}")
  seq, dim = x.shape[-3], x.shape[-1]
  positions = _checks.as_array(op, "positions", positions)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"{op}: positions must have an integer dtype (int32), got {positions.dtype}")
  per_token, shared = tuple(x.shape[:-2]), (seq,)
  if tuple(positions.shape) not in (per_token, shared):
    raise ValueError(f"{op}: positions must have shape {per_token} (x.shape[:-2]: one per "
                     f"token) or {shared} (shared by the batch), got {tuple(positions.shape)}")
  theta = _checks.positive_finite(op, "theta", theta)
  if not isinstance(layout, str) or layout not in LAYOUTS:
    raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
  if dim % 2:
    raise ValueError(f"{op}: x's last dim (H = {dim}) must be even (it holds pairs; the "
                     f"kernels need whole pairs per head row)")
  if rotary_dim is None:
    r = dim
  else:
    r = _checks.static_int(op, "rotary_dim", rotary_dim)
    if r <= 0 or r % 2 or r > dim:
      raise ValueError(f"{op}: rotary_dim must be even and in [2, H = {dim}], got {r}")
  return x, positions, theta, r, tuple(positions.shape) == shared and per_token != shared


def rope(x, positions, *, theta=10000.0, layout="half", rotary_dim=None,
         implementation=None):
  """Rotary position embedding: rotates feature pairs of x by position-dependent angles.

  Args:
    x: (..., T, N, H) float32, bfloat16 or float16 (batch dims, sequence, heads, head
      dim); usually (B, T, N, H). H must be even.
    positions: integer (int32) positions, x.shape[:-2] (one per token, e.g. (B, T)) or
      (T,) (shared by the batch). Any int32 value works, negative included; other integer
      dtypes are converted to int32.
    theta: the base of the frequencies, inv_freq_i = theta^(-2i/r) for i < r/2; positive,
      finite, static.
    layout: 'half' rotates pairs (i, i + r/2) (Llama, Gemma, Hugging Face);
      'interleaved' rotates adjacent pairs (2i, 2i + 1) (GPT-J, Meta's original Llama).
    rotary_dim: r, even, 2 <= r <= H (default H): only the first r features are rotated,
      the others pass through unchanged (GPT-NeoX partial rotary).
    implementation: None (the FFI kernel of the platform the computation runs on),
      'cuda', 'cpu', or 'xla' (the pure-JAX reference).

  Returns:
    (..., T, N, H) in x.dtype: pair (a, b) at angle = position * inv_freq_i becomes
    (a cos - b sin, b cos + a sin), computed in float32.

  Angles keep float32 accuracy at long context, where a float32 position * inv_freq is
  off by up to ~0.1 rad at 10^6: the kernels form the product in double precision and
  reduce it modulo pi/2 before a float32 sin/cos (angle error < 2e-9 rad up to 2^24,
  ~1e-6 rad at worst near 2^31, from double's rounding of inv_freq); the reference uses
  exact integer arithmetic (~1e-7 rad at any int32 position, jaxgpu/reference/rope.py).

  Equivalent pure JAX (exact only for small positions, see above)::

    inv_freq = theta ** (-jnp.arange(0, r, 2) / r)                   # (r/2,)
    angle = positions[..., None].astype(jnp.float32) * inv_freq      # (..., T, r/2)
    cos, sin = jnp.cos(angle)[..., None, :], jnp.sin(angle)[..., None, :]
    xf = x[..., :r].astype(jnp.float32)
    a, b = xf[..., :r // 2], xf[..., r // 2:]            # 'interleaved': xf[..., 0::2], 1::2
    y = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)  # (interleave back)
    y = jnp.concatenate([y.astype(x.dtype), x[..., r:]], -1)

  The gradient of x is the inverse rotation of the cotangent (one kernel); positions get
  none. Works under jit, grad, vmap, shard_map and pmap. Under jit with sharded inputs the
  batch, sequence and head dims keep their sharding with no collective (positions split
  with x's batch and sequence dims); a sharded H is gathered. Forward mode (jax.jvp)
  and second derivatives run the reference.
  """
  op = "rope"
  x, positions, theta, r, shared = _check(op, x, positions, theta, layout, rotary_dim)
  impl = _autodiff.route(_implementation.resolve(implementation), x)
  if impl == "xla" or x.size == 0:
    return reference.rope(x, positions, theta=theta, layout=layout, rotary_dim=r)
  positions = positions.astype(jnp.int32)
  cfg = _Config(theta, layout == "interleaved", r, shared, impl, primal_types(x))
  return _rope(cfg, x, positions)
