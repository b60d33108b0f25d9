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
  fwd  q, k, v[, q_seg, kv_seg][, bias, mask, q_len, kv_len]
                                        -> o (B, T, K, R, H), lse float32 (B, K, R, T),
                                           tile_counter int32 (1,) (workspace, or empty)
  bwd  q, k, v, o, lse, do[, segs, uniform][, bias, mask, q_len, kv_len]
                                        -> dq, dk, dv, delta float32 (B, K, R, T)
                                           (workspace)[, dbias float32 (bias's shape)],
                                           dq_accum float32 (q's shape), dq_semaphores
                                           int32 (B, K, R, T) (workspaces, or empty)
The bias and mask go to the kernels as (Bb, Kb, Rb, Tb, Sb), a free reshape of their
(Bb, Nb, Tb, Sb) (Nb = N splits into (K, R), Nb = 1 into (1, 1)), each dim 1 or full: the
kernels read them with stride 0 on the broadcast dims. Both lengths go together (a missing
side is its full length, an int32 (B,) array). Absent ones are empty arrays with the
attributes has_bias / has_mask / has_lengths false; dbias is computed only when the bias is
differentiated (custom_vjp's symbolic zeros tell; has_dbias).
Both take the attribute path (int32; ffi/attention/attention_path.h): 0 lets the CUDA kernels
choose their main loop, and `_force_path` forces one (tests run both in one process).
Absent segment ids go to the kernels as int32 zeros((0,)) with has_segments=False. The
backward also takes `uniform` int32 (B,), 1 where a batch row's q and kv ids are all one
segment (`_segment_uniform`, a small XLA reduction in the per-shard body; empty with a
causal mask or window): the Hopper kernels run those rows without the mask.

Memory. Forward: o (the shape and dtype of q) and lse (float32, B*N*T: 4 bytes per query row
and head); both are kept for the backward pass with q, k, v, the segment ids, bias, mask and
lengths, which are the inputs themselves (no copies; a bias neither float32 nor q's dtype is
cast to float32). With a differentiated bias the backward pass also allocates dbias, float32
in the bias's shape (the kernels' accumulator, cast to the bias's dtype after). Backward:
dq, dk, dv (the shapes and dtypes of q, k, v; dk and dv already reduced over the R query
heads of each kv head) and delta, a float32 workspace of B*N*T; with segment ids and no
causal mask or window, the per-row flag `uniform` (4 bytes per batch row). On Hopper (the
fused backward, `_warp_specialized`: no bias, mask or lengths; segment ids are taken), a
float32 dQ accumulator of q's shape (twice q's bytes in bf16: the kernel adds each key
tile's dQ into it) and an int32 semaphore per query row and head (the adds' fixed order;
none with deterministic=False); elsewhere both are empty. The forward there gets a 4-byte
workspace too: the counter its persistent grid draws causal and windowed tiles from.
No T x S array exists in either pass. With H % 8 != 0 (kernels only), zero-padded copies of q, k
and v are made (and kept as the residuals instead of the inputs), and o, dq, dk, dv are
sliced copies of padded results (do is padded too). Under vmap, an unbatched operand next to
batched ones is broadcast to the batch (a copy), as its results are per example anyway; so
is a batched bias or mask that broadcasts over B. The gradient of an unbatched bias shared
by the batch (a (1, ...) bias) under vmap is per example: those backward calls run one
example at a time (lax.map).

Sharding (jit with sharded inputs, shard_map, pmap). The group axis of the transform stack
(jaxgpu/_kernel_op.py) is B. Factors: q, o, do, dq "g t k r h"; k, v, dk, dv "g s k h";
lse, delta "g k r t"; q_segment_ids "g t", kv_segment_ids "g s"; bias, dbias and mask
"[g] k r t s" with each broadcast dim named apart ("onebk", ...: never sharded, and the
gradient of a bias broadcast over a sharded factor is all-reduced over it); lengths "g".
Replicated (gathered when sharded): h and s always, and t when is_causal, a window or
sequence lengths are set (the kernels compare global query and key positions; passing each
shard its offset would need the partitioned body to know its shard index).
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
from jax.custom_derivatives import SymbolicZero
from jax.sharding import NamedSharding, PartitionSpec

from jaxgpu import _autodiff, _checks, _ffi, _implementation
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
  device for head dims padded to 64, 128 or 256 and calls without a bias or mask, else
  'mma_sync' (any GPU the kernels run on). Forcing one lets tests run both in one process.
  Read when a call is traced, like `implementation`: a function traced outside the block
  keeps the path it was traced with. A forced path that cannot run a call (wgmma at H = 96,
  with a bias or mask, on another GPU, or in a build without sm_90a code) fails that call
  with an error that says why; the CPU kernels take 'auto' only; the 'xla' implementation
  has no main loop to force and ignores it.
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
_LEN = "g"


def _broadcast_factors(prefix: str, shape, full) -> str:
  """The factor string of a bias or mask (Bb, Kb, Rb, Tb, Sb): "[g] k r t s", with each dim
  that is broadcast (size 1 where the full size is not) named apart ("one<prefix>k"), so that
  it is never sharded and the others keep q's and k's sharding."""
  names = []
  for name, n, m in zip("krts", shape[1:], full[1:]):
    names.append(name if n == m else f"one{prefix}{name}")
  return "[g] " + " ".join(names)


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  softcap: float               # 0: none
  causal: bool
  window: tuple[int, int]      # (left, right); -1: unbounded side
  has_segments: bool
  implementation: str | None   # 'cpu', 'cuda', or None (platform-generic)
  primal_types: tuple = (None, None, None, None)  # of q (5-d), k, v, bias (see _kernel_op)
  path: int = 0                # the CUDA main loop (_PATHS); 0: the kernels choose
  bias: str | None = None      # the bias's factor string (_broadcast_factors), None: none
  mask: str | None = None      # the mask's
  has_lengths: bool = False
  deterministic: bool = True   # the backward's attribute (dQ's adds in a fixed order)

  def target(self, pass_: str) -> str:
    return DOT_PRODUCT_ATTENTION.target(pass_, self.implementation)

  def attrs(self) -> dict:
    # Typed as the handlers bind them (attention_handlers.h): a Python float would arrive
    # as f64 and an int as i64.
    return dict(scale=np.float32(self.scale), softcap=np.float32(self.softcap),
                causal=self.causal, window_left=np.int64(self.window[0]),
                window_right=np.int64(self.window[1]), has_segments=self.has_segments,
                path=np.int32(self.path), has_bias=self.bias is not None,
                has_mask=self.mask is not None, has_lengths=self.has_lengths)

  @property
  def positional(self) -> bool:
    """Whether keys are masked by global position (causal mask, window, or lengths: a
    T shard would compare its local query positions with them)."""
    return self.causal or self.window != (-1, -1) or self.has_lengths

  def extra_layouts(self) -> tuple:
    return tuple(f for f in (self.bias, self.mask) if f is not None) + (
        (_LEN, _LEN) if self.has_lengths else ())

  def replicated(self) -> frozenset:
    return frozenset({"h", "s", "t"} if self.positional else {"h", "s"})


def _segments(cfg: _Config, segs):
  """The two segment-id operands of an FFI call (int32 zeros((0,)) when absent)."""
  if cfg.has_segments:
    return segs
  empty = jnp.zeros((0,), jnp.int32)
  return empty, empty


def _extras(cfg: _Config, extras):
  """The bias, mask and lengths operands of an FFI call (empty arrays where absent)."""
  it = iter(extras)
  empty = jnp.zeros((0,), jnp.int32)
  bias = next(it) if cfg.bias is not None else jnp.zeros((0,), jnp.float32)
  mask = next(it) if cfg.mask is not None else jnp.zeros((0,), jnp.bool_)
  lens = (next(it), next(it)) if cfg.has_lengths else (empty, empty)
  return (bias, mask) + lens


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


def _fwd_call(cfg: _Config, q, k, v, segs, extras):
  """q (B, T, K, R, H), k and v (B, S, K, H), segs () or (q_seg, kv_seg), extras: the bias
  and mask (5-d) and the lengths that are present: (o, lse)."""
  seg_layout = (_Q_SEG, _KV_SEG) if cfg.has_segments else ()
  layout = Layout(inputs=(_Q, _KV, _KV) + seg_layout + cfg.extra_layouts(),
                  outputs=(_Q, _STAT), replicated=cfg.replicated())
  n_seg = len(seg_layout)

  def local_fn(q, k, v, *rest):
    b, t, kh, r, _ = q.shape
    ws = _warp_specialized(cfg, q.shape[-1], q.dtype)
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype),
           jax.ShapeDtypeStruct((b, kh, r, t), jnp.float32),
           jax.ShapeDtypeStruct((1,) if ws else (0,), jnp.int32))
    o, lse, _ = jax.ffi.ffi_call(cfg.target("fwd"), out)(
        q, k, v, *_segments(cfg, rest[:n_seg]), *_extras(cfg, rest[n_seg:]), **cfg.attrs())
    return o, lse  # the workspace dropped

  return grouped_call(local_fn, layout, q, k, v, *segs, *extras)


# Whether JAX sees a compute capability 9.0 GPU (the fused backward's kernels); a module
# name of its own so that tests can stand in for the GPU.
_hopper_present = _implementation.hopper_present


def _warp_specialized(cfg: _Config, h: int, dtype) -> bool:
  """Whether the calls get the warp-specialized Hopper kernels' workspaces: the forward's
  tile counter (ffi/attention/sm90/fwd_ws_sm90.h) and the fused backward's dQ accumulator
  and semaphores (bwd_ws_sm90.h). Both kernels take segment ids, but no bias, mask or
  lengths; head dims padded to 64, 128 or 256; a 16-bit dtype. The handlers decide in the
  end: without the workspaces the forward runs its masked calls on the wgmma kernel of part 1
  and the backward runs the dQ and dK/dV kernels, and with them where the kernels cannot run
  (another GPU) too."""
  if cfg.implementation == "cpu" or cfg.path == _PATHS["mma_sync"]:
    return False
  if cfg.bias is not None or cfg.mask is not None or cfg.has_lengths:
    return False
  if jnp.dtype(dtype) not in _CUDA_DTYPES or not (33 <= h <= 64 or 97 <= h <= 256):
    return False
  return _hopper_present()


def _bwd_call(cfg: _Config, q, k, v, o, lse, do, segs, extras, want_dbias: bool):
  """(dq, dk, dv, dbias or None); the delta workspace is dropped. dk and dv lack t and r:
  an all-reduce over those factors' mesh axes when they are sharded (the layout mechanism
  adds it); dbias lacks the factors its bias broadcasts over, the same way."""
  seg_layout = (_Q_SEG, _KV_SEG) if cfg.has_segments else ()
  dbias_layout = (cfg.bias,) if want_dbias else ()
  layout = Layout(inputs=(_Q, _KV, _KV, _Q, _STAT, _Q) + seg_layout + cfg.extra_layouts(),
                  outputs=(_Q, _KV, _KV, _STAT) + dbias_layout, replicated=cfg.replicated())
  n_seg = len(seg_layout)

  def local_fn(q, k, v, o, lse, do, *rest):
    extras = _extras(cfg, rest[n_seg:])
    dbias = (extras[0].shape if want_dbias else (0,))
    fused = _warp_specialized(cfg, q.shape[-1], q.dtype)
    out = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
           jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32),
           jax.ShapeDtypeStruct(dbias, jnp.float32),
           jax.ShapeDtypeStruct(q.shape if fused else (0,), jnp.float32),
           jax.ShapeDtypeStruct(lse.shape if fused and cfg.deterministic else (0,), jnp.int32))
    outs = jax.ffi.ffi_call(cfg.target("bwd"), out)(
        q, k, v, o, lse, do, *_bwd_segments(cfg, rest[:n_seg]), *extras, **cfg.attrs(),
        has_dbias=want_dbias, deterministic=cfg.deterministic)
    return tuple(outs[:5]) if want_dbias else tuple(outs[:4])  # the workspaces dropped

  outs = grouped_call(local_fn, layout, q, k, v, o, lse, do, *segs, *extras)
  dbias = outs[4] if want_dbias else None
  if dbias is not None and dbias.shape[0] != extras[0].shape[0]:
    # Under vmap a batched bias that broadcasts over B is expanded to B by the group fold
    # (jaxgpu/_kernel_op.py), and so is its gradient: summed back here.
    dbias = dbias.sum(axis=0, keepdims=True)
  return outs[0], outs[1], outs[2], dbias


# ---- the differentiable op ------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Config, q, k, v, segs, extras):
  return _fwd_call(cfg, q, k, v, segs, extras)[0]


def _attention_fwd(cfg: _Config, q, k, v, segs, extras):
  # symbolic_zeros: each argument arrives as a CustomVJPPrimal whose `perturbed` says
  # whether it is differentiated; dbias (atomics into a float32 accumulator where the bias
  # broadcasts) is computed only then. The flag travels as pytree structure, (()) or ().
  want_dbias = cfg.bias is not None and extras[0].perturbed
  q, k, v = q.value, k.value, v.value
  segs = tuple(a.value for a in segs)
  extras = tuple(a.value for a in extras)
  o, lse = _fwd_call(cfg, q, k, v, segs, extras)
  return o, (q, k, v, o, lse, segs, extras, ((),) if want_dbias else ())


def _attention_bwd(cfg: _Config, res, do):
  q, k, v, o, lse, segs, extras, want_dbias = res
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(do.shape, do.dtype)
  dq, dk, dv, dbias = _bwd_call(cfg, q, k, v, o, lse, do, segs, extras, bool(want_dbias))
  dq, dk, dv = match_primal_types((dq, dk, dv), cfg.primal_types[:3])
  extras_ct = [None] * len(extras)
  if dbias is not None:
    # dbias is float32 (the kernels' accumulator); the cotangent has the bias's dtype.
    extras_ct[0] = match_primal_types((dbias.astype(extras[0].dtype),),
                                      cfg.primal_types[3:])[0]
  # Integer segment ids, the bool mask and integer lengths have no cotangent (None: jax's
  # symbolic zero).
  return dq, dk, dv, tuple(None for _ in segs), tuple(extras_ct)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


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


def _check_broadcast(op, name, a, full, dtypes, dtype_what):
  """A bias or mask: rank <= 4, left-padded with 1s to rank 4, each dim 1 or the full
  (B, N, T, S) size (jax.nn's rule)."""
  a = _checks.as_array(op, name, a)
  if jnp.dtype(a.dtype) not in dtypes:
    raise TypeError(f"{op}: {name} must have {dtype_what} dtype, got {a.dtype}")
  shape = tuple(a.shape)
  if a.ndim > 4 or any(d not in (1, f) for d, f in zip((1,) * (4 - a.ndim) + shape, full)):
    raise ValueError(f"{op}: {name} of shape {shape} is not broadcastable to (B, N, T, S) = "
                     f"{tuple(full)} (each dim 1 or the full size, rank <= 4)")
  return a.reshape((1,) * (4 - a.ndim) + shape) if a.ndim < 4 else a


_BIAS_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16,
                                             jnp.float64))


def _check_lengths(op, name, lengths, b, full):
  if lengths is None:
    return None
  lengths = _checks.as_array(op, name, lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype (int32), got {lengths.dtype}")
  _checks.shape_is(op, name, lengths, (b,), "(B,)")
  if not isinstance(lengths, jax.core.Tracer):
    values = np.asarray(lengths)
    if values.size and (values.min() < 0 or values.max() > full):
      raise ValueError(f"{op}: {name} must lie in [0, {full}], got values in "
                       f"[{values.min()}, {values.max()}]")
  return lengths if lengths.dtype == jnp.int32 else jnp.asarray(lengths).astype(jnp.int32)


def _check(op, query, key, value, bias, mask, scale, is_causal, local_window_size,
           logit_softcap, q_segment_ids, kv_segment_ids, query_seq_lengths,
           key_value_seq_lengths):
  arrays = {}
  for name, a in (("query", query), ("key", key), ("value", value)):
    arrays[name] = _checks.float_array(op, name, a)
  ranks = {a.ndim for a in arrays.values()}
  rank = arrays["query"].ndim
  if len(ranks) != 1 or rank not in (3, 4):
    raise ValueError(f"{op}: query, key and value must have rank 4 (B, T, N, H) / "
                     f"(B, S, K, H), or all rank 3 without the batch axis, got shapes "
                     f"{tuple(tuple(a.shape) for a in arrays.values())}")
  unbatched = rank == 3
  if unbatched:  # jax.nn's (T, N, H): a batch of one
    arrays = {k: a[None] for k, a in arrays.items()}
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
  if unbatched:
    q_segment_ids, kv_segment_ids = (None if a is None else _checks.as_array(op, name, a)[None]
                                     for name, a in (("q_segment_ids", q_segment_ids),
                                                     ("kv_segment_ids", kv_segment_ids)))
  segs = _check_segments(op, q_segment_ids, kv_segment_ids, b, t, s)
  full = (b, n, t, s)
  if bias is not None:
    bias = _check_broadcast(op, "bias", bias, full, _BIAS_DTYPES, "a floating")
  if mask is not None:
    mask = _check_broadcast(op, "mask", mask, full, (jnp.dtype(jnp.bool_),), "bool")
  lengths = (_check_lengths(op, "query_seq_lengths", query_seq_lengths, b, t),
             _check_lengths(op, "key_value_seq_lengths", key_value_seq_lengths, b, s))
  return (query, key, value, bias, mask, scale, is_causal, window, softcap, segs, lengths,
          unbatched)


def _kernel_extras(query, key, bias, mask, lengths):
  """The bias and mask as (Bb, Kb, Rb, Tb, Sb) (a free reshape of their head dim, whose
  size is N or 1) with their factor strings, and both lengths (a missing side: its full
  length), for the kernels. A bias that is neither float32 nor query's dtype is cast to
  float32 (exact)."""
  b, t, n, _ = query.shape
  s, kh = key.shape[1], key.shape[2]
  full = (b, kh, n // kh, t, s)
  out, layouts = [], {}
  for name, a in (("bias", bias), ("mask", mask)):
    if a is None:
      layouts[name] = None
      continue
    if name == "bias" and a.dtype not in (jnp.dtype(jnp.float32), query.dtype):
      a = a.astype(jnp.float32)
    bb, nb, tb, sb = a.shape
    a = a.reshape((bb, kh, n // kh, tb, sb) if nb == n else (bb, 1, 1, tb, sb))
    layouts[name] = _broadcast_factors(name[0], a.shape, full)
    out.append(a)
  has_lengths = lengths[0] is not None or lengths[1] is not None
  if has_lengths:
    out += [jnp.full((b,), t, jnp.int32) if lengths[0] is None else lengths[0],
            jnp.full((b,), s, jnp.int32) if lengths[1] is None else lengths[1]]
  return tuple(out), layouts["bias"], layouts["mask"], has_lengths


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual=False,
                          logit_softcap=None, q_segment_ids=None, kv_segment_ids=None,
                          deterministic=True):
  """Scaled dot-product attention, fused (FlashAttention-style): a drop-in for
  jax.nn.dot_product_attention (its whole signature and semantics; differences below).

  Args:
    query: (B, T, N, H) or (T, N, H) (no batch axis, as jax.nn), float32, bfloat16 or
      float16: T queries, N heads, head dim H in [1, 256] (any, e.g. 59 or 111).
    key, value: (B, S, K, H) (or (S, K, H)), the dtype of query; N must be a multiple of K
      (MHA: K = N; GQA; MQA: K = 1). Query head n reads kv head n // (N // K), as
      jax.nn.dot_product_attention. T != S is allowed.
    bias: None or a float array broadcastable to (B, N, T, S) (rank <= 4, left-padded with
      1s as jax.nn; with rank-3 inputs, to (N, T, S)), added to the logits after the scale
      and the softcap, before the masks. A dim of size 1 is read with stride 0, never
      materialized. Differentiable: its gradient (dS summed over the broadcast dims) has
      its shape and dtype. float32 or query's dtype run as is; another float dtype is cast
      to float32 for the kernels.
    mask: None or a bool array broadcastable to (B, N, T, S) (the same rule): False masks
      the logit out (jax.nn's convention).
    scale: static finite float; default 1 / sqrt(H).
    is_causal: static bool. Query i sees keys j <= i, top-left aligned as
      ``jnp.tril(ones((T, S)))`` (jax.nn's causal mask, also for T != S).
    query_seq_lengths, key_value_seq_lengths: None or integer (B,) arrays (int32; (1,) for
      rank-3 inputs): batch row b's queries i >= query_seq_lengths[b] output zeros (and get
      zero gradients), and its keys j >= key_value_seq_lengths[b] are invisible (a padded
      batch). The kernels skip the tiles past the lengths (no work), not mask them.
      Concrete lengths must lie in [0, T] / [0, S]; traced ones are clamped to it.
    local_window_size: None, an int w (= (w, w)) or a (left, right) pair of ints >= 0:
      query i sees keys i - left <= j <= i + right (jax.nn's window mask).
    implementation: None (the FFI kernel of the platform the computation runs on), 'cuda',
      'cpu', or 'xla' (the pure-JAX reference, jaxgpu.reference.attention.dot_product_attention).
      The CUDA kernels take bfloat16 and float16 only: with float32 inputs, None on a
      machine whose JAX has a CUDA backend runs the 'xla' reference instead, and 'cuda'
      raises ValueError. jax.nn's 'cudnn' is not one of them (ValueError).
    return_residual: False only (jax.nn's True, returning the log-sum-exp too, is not
      supported: ValueError).
    logit_softcap: None or a static float c > 0: logits -> c * tanh(logits / c), after the
      scale, before the bias and the masks (Gemma 2; jax.nn has no softcap).
    q_segment_ids, kv_segment_ids: (B, T) and (B, S) ((T,) and (S,) with rank-3 inputs)
      integer ids (converted to int32), both or neither: query i sees key j only when their
      ids are equal (packed sequences).
    deterministic: static bool. True (the default): the gradients are bitwise reproducible
      (every sum in a fixed order). False lets the fused Hopper backward (no bias, mask
      or lengths) add each key tile's float32 dQ partial sums in the order the tiles
      finish, without waiting for its turn (up to 27% faster backward at H 256, 9% at
      H 128 without a mask; docs/perf/attention.md section 12.2): dq may differ in its last
      bits from run to run; dk, dv and the forward are unchanged. Elsewhere it changes
      nothing.

  Returns:
    query's shape, in query's dtype. Every option combines with the others and with GQA.
    A query with no visible key (all masked: window, segments, mask, a key length of 0)
    outputs zeros and gets a zero gradient, never NaN. jax.nn differs there: its masks
    use a large negative logit rather than -inf, so such a row outputs the mean of the
    values (of all S keys); query rows past query_seq_lengths are zeros in both.

  Equivalent pure JAX (jaxgpu.reference.attention.dot_product_attention)::

    R = N // K
    k, v = jnp.repeat(key, R, axis=2), jnp.repeat(value, R, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", query, k,
                        preferred_element_type=jnp.float32) * scale
    if logit_softcap:
      logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    logits = logits + bias                                         # broadcast
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    keep = (j <= i) & (j >= i - left) & (j <= i + right)           # the parts that apply
    keep = keep & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    keep = keep & mask
    keep = keep & (i < query_seq_lengths[:, None, None, None])
    keep = keep & (j < key_value_seq_lengths[:, None, None, None])
    logits = jnp.where(keep, logits, -jnp.inf)
    m = jnp.max(logits, -1, keepdims=True)
    e = jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m))
    s = jnp.sum(e, -1, keepdims=True)
    p = e / jnp.where(s == 0, 1.0, s)                              # 0 where nothing is kept
    out = jnp.einsum("bnts,bsnh->btnh", p.astype(value.dtype), v,
                     preferred_element_type=jnp.float32).astype(query.dtype)

  Memory (see the module docstring): the forward pass allocates o and a float32 log-sum-exp
  of B*N*T (on Hopper also a 4-byte tile counter), kept for the backward pass with q, k, v,
  and the bias, mask, lengths and segment ids (the inputs themselves, no copies); the
  backward pass allocates dq, dk, dv and a float32 workspace of B*N*T (on Hopper without a
  bias, mask or lengths also a float32 dQ accumulator of q's shape and, unless
  deterministic=False, an int32 per query row and head: the fused backward's), and, when the
  bias is differentiated, a float32 dbias of the bias's own shape (the kernels' accumulator;
  where the bias broadcasts over some dim, the contributions are added into it atomically)
  cast to the bias's dtype. No T x S array and no broadcast copy of the bias or mask, in
  either pass.
  For H % 8 != 0 the kernels run on zero-padded copies of q, k, v (and do).

  Gradients for query, key and value come from one backward kernel (dk and dv already
  reduced over each kv head's query heads), and for the bias from the same pass; segment
  ids, the mask and the lengths get none. Works under jit, grad, vmap, shard_map and pmap;
  under jit with sharded inputs B and the heads keep their sharding with no collective,
  the bias and mask sharded along with them (their broadcast dims are never sharded; see
  the module docstring for T, S and H). Forward mode (jax.jvp) and second derivatives
  run the reference. The backward is deterministic except dbias where the bias broadcasts over
  some dim on the CUDA kernels (float32 atomic adds; the CPU kernel adds in a fixed order),
  and dq with deterministic=False.
  """
  op = "dot_product_attention"
  if implementation == "cudnn":
    raise ValueError(f"{op}: implementation='cudnn' is jax.nn's; jaxgpu's implementation "
                     "takes None, 'cuda', 'cpu' or 'xla' (call jax.nn.dot_product_attention "
                     "for cuDNN)")
  if return_residual is not False:
    raise ValueError(f"{op}: return_residual=True (jax.nn's log-sum-exp output) is not "
                     "supported; pass False")
  if not isinstance(deterministic, bool):
    raise TypeError(f"{op}: deterministic must be a static bool, got {deterministic!r}")
  (query, key, value, bias, mask, scale, is_causal, window, softcap, segs, lengths,
   unbatched) = _check(op, query, key, value, bias, mask, scale, is_causal, local_window_size,
                       logit_softcap, q_segment_ids, kv_segment_ids, query_seq_lengths,
                       key_value_seq_lengths)
  out = _dispatch(op, query, key, value, bias, mask, scale, is_causal, window, softcap, segs,
                  lengths, implementation, deterministic)
  return out[0] if unbatched else out


def _dispatch(op, query, key, value, bias, mask, scale, is_causal, window, softcap, segs,
              lengths, implementation, deterministic=True):
  impl = _autodiff.route(_implementation.resolve(implementation), query, key, value, bias)
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
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        local_window_size=window, logit_softcap=softcap, q_segment_ids=segs[0],
        kv_segment_ids=segs[1], query_seq_lengths=lengths[0],
        key_value_seq_lengths=lengths[1])

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
  extras, bias_layout, mask_layout, has_lengths = _kernel_extras(query, key, bias, mask,
                                                                 lengths)
  cfg = _Config(scale=scale, softcap=0.0 if softcap is None else softcap, causal=is_causal,
                window=(-1, -1) if window is None else window,
                has_segments=segs[0] is not None, implementation=impl,
                primal_types=primal_types(q5, key, value,
                                          extras[0] if bias_layout is not None else None),
                path=_PATHS[_forced_path.get()], bias=bias_layout, mask=mask_layout,
                has_lengths=has_lengths, deterministic=deterministic)
  o = _merge_heads(_attention(cfg, q5, key, value, segs if segs[0] is not None else (), extras),
                   query)
  return o[..., :h] if pad else o
