"""Fused dot-product attention (FlashAttention-style): MHA/GQA/MQA with causal, local
window, logit softcap and segment-id masks; forward and backward.

Kernels: ffi/attention/ (targets jaxgpu_attention_{fwd,bwd}; the FFI contract is in
attention_handlers.h, the layouts and the mask in attention_params.h). Reference:
jaxgpu/reference/attention.py. Tests: tests/test_attention.py. Benchmarks:
benchmarks/bench_attention.py.

How the op maps onto the kernels. q (B, T, N, H) is reshaped to (B, T, K, R, H), R = N // K
(free: the heads of one kv group are adjacent), so that the kernels see each kv head with
its R query heads and dk/dv are reduced over them inside the kernel (GQA without repeating
k and v). For the kernel implementations ('cuda', 'cpu') a head dim that is not a multiple
of 8 is zero-padded to one (the CUDA kernels load 16-byte rows; zero features change
neither q.k nor the kept output columns), the outputs and gradients are sliced back, and
the default scale stays 1/sqrt(H) of the ORIGINAL H. Inner FFI calls:
  fwd  q, k, v[, q_seg, kv_seg]          -> o (B, T, K, R, H), lse float32 (B, K, R, T)
  bwd  q, k, v, o, lse, do[, segs, uniform] -> dq, dk, dv, delta float32 (B, K, R, T)
                                                (workspace)
Both take the attribute path (int32; ffi/attention/attention_path.h): 0 lets the CUDA kernels
choose their main loop, and `_force_path` forces one (tests run both in one process).
Absent segment ids go to the kernels as int32 zeros((0,)) with has_segments=False. The
backward also takes `uniform` int32 (B,), 1 where a batch row's q and kv ids are all one
segment (`_segment_uniform`, a small XLA reduction in the per-shard body; empty with a
causal mask or window): the Hopper kernels run those rows without the mask.

Memory. Forward: o (the shape and dtype of q) and lse (float32, B*N*T: 4 bytes per query
row and head); both are kept for the backward pass with q, k, v and the segment ids, which
are the inputs themselves (no copies). Backward: dq, dk, dv (the shapes and dtypes of q, k,
v; dk and dv already reduced over the R query heads of each kv head) and delta, a float32
workspace of B*N*T; with segment ids and no causal mask or window, the per-row flag
`uniform` (4 bytes per batch row). No T x S array exists in either pass. With H % 8 != 0
(kernels only), zero-padded copies of q, k and v are made (and kept as the residuals instead of the
inputs), and o, dq, dk, dv are sliced copies of padded results (do is padded too). Under
vmap, an unbatched operand next to batched ones is broadcast to the batch (a copy), as its
results are per example anyway.

Sharding (jit with sharded inputs, shard_map, pmap). The group axis of the transform stack
(jaxgpu/_kernel_op.py) is B. Factors: q, o, do, dq "g t k r h"; k, v, dk, dv "g s k h";
lse, delta "g k r t"; q_segment_ids "g t", kv_segment_ids "g s". Replicated (gathered when
sharded): h and s always, and t when is_causal or a window is set (the kernels compare
global query and key positions; passing each shard its offset would need the partitioned
body to know its shard index).
  * B and the heads, when each head shard holds whole kv groups (the heads' mesh-axis
    sizes multiply to a divisor of K): no collective, forward or backward.
  * T without is_causal / window: forward no collective; backward one all-reduce (psum) of
    dk and dv over T's mesh axes (each T shard holds a partial sum).
  * Heads sharded more finely than K, where mesh axes multiplying to exactly K come first
    and the rest divide R (MQA, K = 1: any head sharding): the extra axes fall on R; k and
    v are replicated over them, and the backward pass all-reduces dk and dv over them
    (every R shard contributes to the same kv heads).
  * S, H, and T with is_causal / window: gathered (an all-gather, then local compute).
  * Explicit mesh (jax.set_mesh with AxisType.Explicit): the same layouts, outputs and
    gradients sharded as the inputs. A head sharding whose mesh axis would have to be split
    between K and R (e.g. a size-4 axis over K = 2 kv heads, R = 4) is not expressible as a
    sharding of (K, R): `_split_heads` then relays q out (an all-to-all onto R when the axes
    divide R, else a gather of the heads), and the output is relaid back.
  * Auto mesh, that same head sharding: the partitioner propagates the split as sub-axes
    of the mesh axis, which custom_partitioning cannot express (jax 0.10/0.11: an
    IndivisibleError when XLA partitions); shard the heads over axes of whole kv groups
    (or use an Explicit mesh).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxgpu import _checks, _ffi, _implementation
from jaxgpu._family import Family, Op
from jaxgpu._kernel_op import (Layout, explicit_spec, grouped_call, in_explicit_mode,
                               match_primal_types, primal_types)
from jaxgpu.reference import attention as reference

# The op keeps jax.nn's name; its targets are named for the family.
DOT_PRODUCT_ATTENTION = Op("dot_product_attention",
                           {"fwd": "jaxgpu_attention_fwd", "bwd": "jaxgpu_attention_bwd"})
FAMILY = Family("attention", (DOT_PRODUCT_ATTENTION,))

MAX_HEAD_DIM = 256
# The CUDA kernels load rows of 16 bytes (8 bf16/f16 features): H is padded to a multiple.
_HEAD_DIM_ALIGN = 8
# The dtypes the CUDA kernels take (float32 runs on the CPU kernel or the reference).
_CUDA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# The CUDA kernels' main loops (ffi/attention/attention_path.h, the FFI attribute `path`).
_PATHS = {"auto": 0, "mma_sync": 1, "wgmma": 2}
_forced_path = contextvars.ContextVar("jaxgpu_attention_path", default="auto")


@contextlib.contextmanager
def _force_path(path: str):
  """Testing hook: the CUDA kernels of every call traced in the block run main loop `path`.

  'auto' (the default) lets the kernels choose: 'wgmma' (Hopper) on a compute capability 9.0
  device for head dims padded to 64, 128 or 256, else 'mma_sync' (any GPU the kernels run
  on). Forcing one lets tests run both in one process. Read when a call is traced, like
  `implementation`: a function traced outside the block keeps the path it was traced with.
  A forced path that cannot run a call (wgmma at H = 96, on another GPU, or in a build
  without sm_90a code) fails that call with an error that says why; the CPU kernels take
  'auto' only; the 'xla' implementation has no main loop to force and ignores it.
  """
  if path not in _PATHS:
    raise ValueError(f"_force_path: expected one of {tuple(_PATHS)}, got {path!r}")
  token = _forced_path.set(path)
  try:
    yield
  finally:
    _forced_path.reset(token)


_Q = "g t k r h"
_KV = "g s k h"
_STAT = "g k r t"
_Q_SEG = "g t"
_KV_SEG = "g s"


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  softcap: float               # 0: none
  causal: bool
  window: tuple[int, int]      # (left, right); -1: unbounded side
  has_segments: bool
  implementation: str | None   # 'cpu', 'cuda', or None (platform-generic)
  primal_types: tuple = (None, None, None)  # of q (5-d), k, v (see _kernel_op)
  path: int = 0                # the CUDA main loop (_PATHS); 0: the kernels choose

  def target(self, pass_: str) -> str:
    return DOT_PRODUCT_ATTENTION.target(pass_, self.implementation)

  def attrs(self) -> dict:
    # Typed as the handlers bind them (attention_handlers.h): a Python float would arrive
    # as f64 and an int as i64.
    return dict(scale=np.float32(self.scale), softcap=np.float32(self.softcap),
                causal=self.causal, window_left=np.int64(self.window[0]),
                window_right=np.int64(self.window[1]), has_segments=self.has_segments,
                path=np.int32(self.path))

  @property
  def positional(self) -> bool:
    """Whether keys are masked by position (causal mask or window)."""
    return self.causal or self.window != (-1, -1)

  def replicated(self) -> frozenset:
    return frozenset({"h", "s", "t"} if self.positional else {"h", "s"})


def _segments(cfg: _Config, segs):
  """The two segment-id operands of an FFI call (int32 zeros((0,)) when absent)."""
  if cfg.has_segments:
    return segs
  empty = jnp.zeros((0,), jnp.int32)
  return empty, empty


def _segment_uniform(q_seg, kv_seg):
  """int32 (B,): 1 where row b's q and kv segment ids all hold one value (nothing masked)."""
  lo = q_seg.min(axis=1)
  same = (q_seg.max(axis=1) == lo) & (kv_seg.min(axis=1) == lo) & (kv_seg.max(axis=1) == lo)
  return same.astype(jnp.int32)


def _bwd_segments(cfg: _Config, segs):
  """The backward's three segment operands: both sides' ids and the rows' uniformity. The
  flag is only read where nothing masks by position, so it is left empty elsewhere (the
  causal packed-training case pays no reduction for it)."""
  empty = jnp.zeros((0,), jnp.int32)
  if cfg.has_segments and not cfg.positional:
    return (*segs, _segment_uniform(*segs))
  return (*_segments(cfg, segs), empty)


# ---- inner ops: FFI calls under the shared vmap / sharding rules ---------------------------


def _fwd_call(cfg: _Config, q, k, v, segs):
  """q (B, T, K, R, H), k and v (B, S, K, H), segs () or (q_seg, kv_seg): (o, lse)."""
  seg_layout = (_Q_SEG, _KV_SEG) if cfg.has_segments else ()
  layout = Layout(inputs=(_Q, _KV, _KV) + seg_layout, outputs=(_Q, _STAT),
                  replicated=cfg.replicated())

  def local_fn(q, k, v, *segs):
    b, t, kh, r, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype),
           jax.ShapeDtypeStruct((b, kh, r, t), jnp.float32))
    return tuple(jax.ffi.ffi_call(cfg.target("fwd"), out)(q, k, v, *_segments(cfg, segs),
                                                          **cfg.attrs()))

  return grouped_call(local_fn, layout, q, k, v, *segs)


def _bwd_call(cfg: _Config, q, k, v, o, lse, do, segs):
  """(dq, dk, dv); the delta workspace is dropped. dk and dv lack t and r: an all-reduce
  over those factors' mesh axes when they are sharded (the layout mechanism adds it)."""
  seg_layout = (_Q_SEG, _KV_SEG) if cfg.has_segments else ()
  layout = Layout(inputs=(_Q, _KV, _KV, _Q, _STAT, _Q) + seg_layout,
                  outputs=(_Q, _KV, _KV, _STAT), replicated=cfg.replicated())

  def local_fn(q, k, v, o, lse, do, *segs):
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
           jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32))
    return tuple(jax.ffi.ffi_call(cfg.target("bwd"), out)(
        q, k, v, o, lse, do, *_bwd_segments(cfg, segs), **cfg.attrs()))

  dq, dk, dv, _ = grouped_call(local_fn, layout, q, k, v, o, lse, do, *segs)
  return dq, dk, dv


# ---- the differentiable op ------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Config, q, k, v, segs):
  return _fwd_call(cfg, q, k, v, segs)[0]


def _attention_fwd(cfg: _Config, q, k, v, segs):
  o, lse = _fwd_call(cfg, q, k, v, segs)
  return o, (q, k, v, o, lse, segs)


def _attention_bwd(cfg: _Config, res, do):
  q, k, v, o, lse, segs = res
  dq, dk, dv = _bwd_call(cfg, q, k, v, o, lse, do, segs)
  dq, dk, dv = match_primal_types((dq, dk, dv), cfg.primal_types)
  # Integer segment ids have no cotangent (None: jax's symbolic zero).
  return dq, dk, dv, tuple(None for _ in segs)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---- the head split (B, T, N, H) <-> (B, T, K, R, H) ---------------------------------------


def _axes_tuple(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_entry(axes: tuple):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _head_split_axes(axes: tuple, sizes: tuple, kv_heads: int, group: int):
  """Mesh axes for K and R when q's head axis N = K * R is sharded over `axes` (major
  first, with `sizes`). Shard d of N holds heads [d N/P, (d + 1) N/P), P = prod(sizes):
    * K % P == 0: each shard holds whole kv groups, K takes every axis (the same layout);
    * a prefix of the axes multiplies to K exactly and the rest divides R: K takes the
      prefix, R the rest (the same layout; MQA, K = 1, puts every axis on R);
    * otherwise no (K, R) sharding is the same layout (e.g. a size-4 axis over K = 2 would
      need half an axis for each). Then R takes every axis if P divides R (a relayout, an
      all-to-all; k and v are replicated over those axes and dk/dv all-reduced), else the
      heads are gathered (replicated, an all-gather)."""
  total = math.prod(sizes)
  if kv_heads % total == 0:
    return axes, ()
  for j in range(len(axes) + 1):
    if math.prod(sizes[:j]) == kv_heads and group % math.prod(sizes[j:]) == 0:
      return axes[:j], axes[j:]
  if group % total == 0:
    return (), axes
  return (), ()


def _split_heads(q, kv_heads: int):
  """q (B, T, N, H) -> (B, T, K, R, H).

  Under an Explicit mesh a reshape must be able to state its output's sharding: jax
  refuses (ShardingTypeError "This reshape is not supported") to split a head axis sharded
  over, say, a size-4 mesh axis into K = 2 kv heads (4 shards cannot be expressed over 2
  heads times 4 groups without splitting the mesh axis). So the split always names its
  output sharding explicitly (`_head_split_axes`), through lax.reshape(out_sharding=): for
  the layouts that jax could split by itself this is the same sharding and moves nothing;
  for the others it is the relayout said there. On Auto meshes and inside shard_map the
  plain reshape is left to the partitioner.
  """
  b, t, n, h = q.shape
  shape = (b, t, kv_heads, n // kv_heads, h)
  spec = explicit_spec(q)
  if not in_explicit_mode(q) or spec[2] is None:
    return q.reshape(shape)
  mesh = jax.typeof(q).sharding.mesh
  axes = _axes_tuple(spec[2])
  k_axes, r_axes = _head_split_axes(axes, tuple(dict(mesh.shape)[a] for a in axes), kv_heads,
                                    n // kv_heads)
  out = PartitionSpec(spec[0], spec[1], _spec_entry(k_axes), _spec_entry(r_axes), spec[3])
  # A NamedSharding, not a bare spec: the caller need not have entered jax.set_mesh.
  return jax.lax.reshape(q, shape, out_sharding=NamedSharding(mesh, out))


def _merge_heads(o, like):
  """o (B, T, K, R, H) -> (B, T, N, H), sharded as `like` (the 4-d q) under an Explicit
  mesh (back to the caller's layout; a no-op unless _split_heads relaid it out)."""
  b, t, kh, r, h = o.shape
  shape = (b, t, kh * r, h)
  if not in_explicit_mode(like):
    return o.reshape(shape)
  return jax.lax.reshape(o, shape, out_sharding=NamedSharding(jax.typeof(like).sharding.mesh,
                                                              PartitionSpec(*explicit_spec(like))))


# ---- public API ---------------------------------------------------------------------------


def _check_window(op, local_window_size):
  """(left, right), ints >= 0, or None."""
  if local_window_size is None:
    return None
  w = local_window_size
  if isinstance(w, (list, tuple)):
    if len(w) != 2:
      raise ValueError(f"{op}: local_window_size must be an int or a (left, right) pair, got "
                       f"{len(w)} values")
    left = _checks.static_int(op, "local_window_size", w[0])
    right = _checks.static_int(op, "local_window_size", w[1])
  else:
    left = right = _checks.static_int(op, "local_window_size", w)
  if left < 0 or right < 0:
    raise ValueError(f"{op}: local_window_size must be >= 0 (left, right), got {w!r}")
  return (left, right)


def _check_segments(op, q_segment_ids, kv_segment_ids, b, t, s):
  if (q_segment_ids is None) != (kv_segment_ids is None):
    given, missing = (("q_segment_ids", "kv_segment_ids") if kv_segment_ids is None
                      else ("kv_segment_ids", "q_segment_ids"))
    raise ValueError(f"{op}: {given} was given without {missing}: pass both or neither")
  if q_segment_ids is None:
    return None, None
  out = []
  for name, ids, shape, what in (("q_segment_ids", q_segment_ids, (b, t), "(B, T)"),
                                 ("kv_segment_ids", kv_segment_ids, (b, s), "(B, S)")):
    ids = _checks.as_array(op, name, ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{op}: {name} must have an integer dtype (int32), got {ids.dtype}")
    _checks.shape_is(op, name, ids, shape, what)
    out.append(ids if ids.dtype == jnp.int32 else jnp.asarray(ids).astype(jnp.int32))
  return tuple(out)


def _check(op, query, key, value, scale, is_causal, local_window_size, logit_softcap,
           q_segment_ids, kv_segment_ids):
  arrays = {}
  for name, a in (("query", query), ("key", key), ("value", value)):
    a = _checks.float_array(op, name, a)
    if a.ndim != 4:
      dims = "(B, T, N, H)" if name == "query" else "(B, S, K, H)"
      raise ValueError(f"{op}: {name} must have rank 4 {dims}, got shape {tuple(a.shape)}")
    arrays[name] = a
  query, key, value = arrays["query"], arrays["key"], arrays["value"]
  _checks.same_dtype(op, "key", key, "query", query)
  _checks.same_dtype(op, "value", value, "query", query)
  b, t, n, h = query.shape
  s, kv_heads = key.shape[1], key.shape[2]
  if key.shape[0] != b or key.shape[3] != h:
    raise ValueError(f"{op}: key must have shape (B, S, K, H) with query's B = {b} and "
                     f"H = {h}, got {tuple(key.shape)}")
  _checks.shape_is(op, "value", value, key.shape, "the shape of key: (B, S, K, H)")
  if kv_heads == 0 and n != 0 or kv_heads and n % kv_heads:
    raise ValueError(f"{op}: query's number of heads N = {n} must be a multiple of key's "
                     f"number of kv heads K = {kv_heads}")
  if not 1 <= h <= MAX_HEAD_DIM:
    raise ValueError(f"{op}: the head dim H (query's last dim) must be in [1, {MAX_HEAD_DIM}], "
                     f"got {h}")
  scale = 1.0 / math.sqrt(h) if scale is None else _checks.finite(op, "scale", scale)
  is_causal = _checks.static_bool(op, "is_causal", is_causal)
  window = _check_window(op, local_window_size)
  softcap = (None if logit_softcap is None
             else _checks.positive_finite(op, "logit_softcap", logit_softcap))
  segs = _check_segments(op, q_segment_ids, kv_segment_ids, b, t, s)
  return query, key, value, scale, is_causal, window, softcap, segs


def dot_product_attention(query, key, value, *, scale=None, is_causal=False,
                          local_window_size=None, logit_softcap=None, q_segment_ids=None,
                          kv_segment_ids=None, implementation=None):
  """Scaled dot-product attention, fused (FlashAttention-style), jax.nn conventions.

  Args:
    query: (B, T, N, H) float32, bfloat16 or float16: T queries, N heads, head dim H in
      [1, 256] (any, e.g. 59 or 111).
    key, value: (B, S, K, H), the dtype of query; N must be a multiple of K (MHA: K = N;
      GQA; MQA: K = 1). Query head n reads kv head n // (N // K), as
      jax.nn.dot_product_attention. T != S is allowed.
    scale: static finite float; default 1 / sqrt(H).
    is_causal: static bool. Query i sees keys j <= i, top-left aligned as
      ``jnp.tril(ones((T, S)))`` (jax.nn's causal mask, also for T != S).
    local_window_size: None, an int w (= (w, w)) or a (left, right) pair of ints >= 0:
      query i sees keys i - left <= j <= i + right (jax.nn's window mask).
    logit_softcap: None or a static float c > 0: logits -> c * tanh(logits / c), after the
      scale and before the masks (Gemma 2).
    q_segment_ids, kv_segment_ids: (B, T) and (B, S) integer ids (converted to int32), both
      or neither: query i sees key j only when their ids are equal (packed sequences).
    implementation: None (the FFI kernel of the platform the computation runs on), 'cuda',
      'cpu', or 'xla' (the pure-JAX reference, jaxgpu.reference.attention.dot_product_attention).
      The CUDA kernels take bfloat16 and float16 only: with float32 inputs, None on a
      machine whose JAX has a CUDA backend runs the 'xla' reference instead, and 'cuda'
      raises ValueError.

  Returns:
    (B, T, N, H) in query's dtype. Every option combines with the others and with GQA.
    A query with no visible key (all masked: window, segments) outputs zeros and gets a
    zero gradient, never NaN (jax.nn would output the mean of the values).

  Equivalent pure JAX (jaxgpu.reference.attention.dot_product_attention)::

    R = N // K
    k, v = jnp.repeat(key, R, axis=2), jnp.repeat(value, R, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", query, k,
                        preferred_element_type=jnp.float32) * scale
    if logit_softcap:
      logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    keep = (j <= i) & (j >= i - left) & (j <= i + right)           # the parts that apply
    keep = keep & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    logits = jnp.where(keep, logits, -jnp.inf)
    m = jnp.max(logits, -1, keepdims=True)
    e = jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m))
    s = jnp.sum(e, -1, keepdims=True)
    p = e / jnp.where(s == 0, 1.0, s)                              # 0 where nothing is kept
    out = jnp.einsum("bnts,bsnh->btnh", p.astype(value.dtype), v,
                     preferred_element_type=jnp.float32).astype(query.dtype)

  Memory (see the module docstring): the forward pass allocates o and a float32
  log-sum-exp of B*N*T, kept for the backward pass with q, k, v (no copies); the backward
  pass allocates dq, dk, dv and a float32 workspace of B*N*T. No T x S array, in either
  pass. For H % 8 != 0 the kernels run on zero-padded copies of q, k, v (and do).

  Gradients for query, key and value come from one backward kernel (dk and dv already
  reduced over each kv head's query heads); segment ids get none. Works under jit, grad,
  vmap, shard_map and pmap; under jit with sharded inputs B and the heads keep their
  sharding with no collective (see the module docstring for T, S and H). Forward-mode AD
  (jax.jvp) is not supported (custom_vjp).
  """
  op = "dot_product_attention"
  query, key, value, scale, is_causal, window, softcap, segs = _check(
      op, query, key, value, scale, is_causal, local_window_size, logit_softcap,
      q_segment_ids, kv_segment_ids)
  impl = _implementation.resolve(implementation)
  if jnp.dtype(query.dtype) not in _CUDA_DTYPES:
    if implementation == "cuda":
      raise ValueError(f"{op}: implementation='cuda' takes bfloat16 or float16 query, key and "
                       f"value, got {query.dtype}; use implementation='xla' (or cast)")
    if impl in (None, "cuda") and _ffi.has_cuda_backend():
      # The CUDA kernels take 16-bit inputs only: float32 runs the reference (also when
      # JAXGPU_IMPLEMENTATION=cuda forces the kernels for a whole model).
      impl = "xla"
  if impl == "xla" or query.size == 0 or key.size == 0 or value.size == 0:
    return reference.dot_product_attention(
        query, key, value, scale=scale, is_causal=is_causal, local_window_size=window,
        logit_softcap=softcap, q_segment_ids=segs[0], kv_segment_ids=segs[1])

  if scale <= 0:
    # The kernels take scale > 0 and fold it into their exp2 argument (one FFMA per logit;
    # ffi/attention/attention_logits.cuh, LogitScale). The logits are unchanged: a negative
    # scale's sign moves onto q (exact), and a zero scale makes every logit 0 (q := 0, so
    # dq and dk are 0 as they must be).
    query = -query if scale < 0 else jnp.zeros_like(query)
    scale = -scale if scale < 0 else 1.0
  h = query.shape[-1]
  pad = -h % _HEAD_DIM_ALIGN
  if pad:
    widths = ((0, 0),) * 3 + ((0, pad),)
    query, key, value = (jnp.pad(a, widths) for a in (query, key, value))
  q5 = _split_heads(query, key.shape[2])
  cfg = _Config(scale=scale, softcap=0.0 if softcap is None else softcap, causal=is_causal,
                window=(-1, -1) if window is None else window,
                has_segments=segs[0] is not None, implementation=impl,
                primal_types=primal_types(q5, key, value), path=_PATHS[_forced_path.get()])
  o = _merge_heads(_attention(cfg, q5, key, value, segs if segs[0] is not None else ()),
                   query)
  return o[..., :h] if pad else o
