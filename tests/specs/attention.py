"""dot_product_attention: the float64 oracle, the low-precision reference, cases, argument
makers, the gradients' residual atol, and the op's contract spec.

Oracles, written here independently of jaxgpu.reference:
  * `np_attention`: float64 numpy forward AND backward (the analytic gradients), fed the
    exact values the low-precision inputs hold;
  * `jnp_attention`: the same attention in jnp at the op's precision (float32 logits and
    softmax, probabilities rounded to the value dtype before P.V, float32 accumulation),
    differentiated by jax.grad; in float64 under oracle.x64() it is the contract's oracle.
    Its error against float64 sets the budget: FlashAttention's rule, a result may be at
    most 2x as far from float64 as this reference, plus a rounding atol.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import contract as C
import oracle

# Gradients sum S (dq) or T x R (dk, dv) terms: a few more ulps of rounding noise.
GRAD_ULPS = 8.0

# ---- options and cases ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Opts:
  """The op's static options (hashable: one compilation of each reference per Opts)."""
  causal: bool = False
  window: tuple | int | None = None
  softcap: float | None = None
  segments: bool = False
  scale: float | None = None

  def kw(self) -> dict:
    return dict(scale=self.scale, is_causal=self.causal, local_window_size=self.window,
                logit_softcap=self.softcap)

  def window_pair(self):
    if self.window is None:
      return None
    return (self.window, self.window) if isinstance(self.window, int) else tuple(self.window)

  def id(self) -> str:
    parts = []
    if self.causal:
      parts.append("causal")
    if self.window is not None:
      parts.append("win" + "_".join(map(str, self.window_pair())))
    if self.softcap is not None:
      parts.append(f"cap{self.softcap:g}")
    if self.segments:
      parts.append("seg")
    if self.scale is not None:
      parts.append(f"scale{self.scale:g}")
    return "-".join(parts) or "plain"


@dataclasses.dataclass(frozen=True)
class Case:
  b: int
  t: int
  s: int
  n: int
  k: int
  h: int
  dtype: object = jnp.bfloat16
  opts: Opts = Opts()

  @property
  def q_shape(self):
    return (self.b, self.t, self.n, self.h)

  @property
  def kv_shape(self):
    return (self.b, self.s, self.k, self.h)

  def id(self) -> str:
    return (f"{jnp.dtype(self.dtype).name}-b{self.b}t{self.t}s{self.s}n{self.n}k{self.k}"
            f"h{self.h}-{self.opts.id()}")


# ---- float64 numpy oracle -------------------------------------------------------------------


def np_keep(case: Case, q_seg=None, kv_seg=None) -> np.ndarray:
  """(B or 1, 1, T, S) bool: key j visible to query i."""
  i = np.arange(case.t)[:, None]
  j = np.arange(case.s)[None, :]
  keep = np.ones((case.t, case.s), bool)
  if case.opts.causal:
    keep &= j <= i
  w = case.opts.window_pair()
  if w is not None:
    keep &= (j >= i - w[0]) & (j <= i + w[1])
  keep = keep[None, None]
  if q_seg is not None:
    keep = keep & (np.asarray(q_seg)[:, None, :, None] == np.asarray(kv_seg)[:, None, None, :])
  return keep


def np_attention(case: Case, q, k, v, q_seg=None, kv_seg=None, do=None, o_residual=None,
                 bias=None, keep=None):
  """float64 attention o; with `do`, (o, (dq, dk, dv)): the analytic gradients of <o, do>.

  bias: None or an array broadcastable to (B, N, T, S) added after the softcap; then the
  gradients end with dbias (dS summed over its broadcast dims, in its shape). keep: None or
  a bool array broadcastable to (B, N, T, S), anded with the case's masks (a mask, the
  sequence lengths: `np_extra_keep`).

  With `o_residual` also a third item, the residual atols (dq, dk, dv): the backward
  kernels form delta = rowsum(do * o) from o ROUNDED to the op's dtype (the residual they
  keep), where the exact delta is rowsum(p * dp) (and the reference's autodiff uses its
  unrounded float32 o): a systematic difference of every FlashAttention backward, not an
  error of the kernel. It is measured exactly, as the change of the float64 gradients when
  delta comes from `o_residual` (dv does not depend on delta)."""
  q, k, v = (oracle.as_f64(a) for a in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  r = n // kh
  scale = 1 / math.sqrt(h) if case.opts.scale is None else case.opts.scale
  qh = q.transpose(0, 2, 1, 3)                              # (B, N, T, H)
  kr = np.repeat(k, r, axis=2).transpose(0, 2, 1, 3)        # query head n -> kv head n // R
  vr = np.repeat(v, r, axis=2).transpose(0, 2, 1, 3)
  raw = scale * (qh @ kr.swapaxes(-1, -2))                  # (B, N, T, S)
  cap = case.opts.softcap
  if cap is not None:
    th = np.tanh(raw / cap)
    logits = cap * th
  else:
    logits = raw
  if bias is not None:
    logits = logits + oracle.as_f64(bias)
  base = np_keep(case, q_seg, kv_seg)
  keep = np.broadcast_to(base if keep is None else base & np.asarray(keep), logits.shape)
  masked = np.where(keep, logits, -np.inf)
  m = masked.max(-1, keepdims=True) if s else np.zeros(masked.shape[:-1] + (1,))
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(keep, np.exp(masked - m), 0.0)
  den = e.sum(-1, keepdims=True)
  p = e / np.where(den == 0, 1.0, den)
  o = (p @ vr).transpose(0, 2, 1, 3)
  if do is None:
    return o

  def per_kv_head(a):  # (B, N, S, H) -> (B, S, K, H), summed over each group's R heads
    return a.reshape(b, kh, r, s, h).sum(2).transpose(0, 2, 1, 3)

  def dq_dk(ds):  # d logits (before the softcap's tanh') -> dq, dk
    if cap is not None:
      ds = ds * (1 - th * th)
    return ((scale * (ds @ kr)).transpose(0, 2, 1, 3),
            per_kv_head(scale * (ds.swapaxes(-1, -2) @ qh)))

  def reduce_to_bias(a):  # (B, N, T, S) summed over the bias's broadcast dims
    shape = np.shape(bias)
    full = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(d for d in range(4) if full[d] == 1 and a.shape[d] != 1)
    return a.sum(axis=axes, keepdims=True).reshape(shape)

  doh = oracle.as_f64(do).transpose(0, 2, 1, 3)
  dp = doh @ vr.swapaxes(-1, -2)
  delta = (p * dp).sum(-1, keepdims=True)
  dq, dk = dq_dk(p * (dp - delta))
  grads = (dq, dk, per_kv_head(p.swapaxes(-1, -2) @ doh))
  if bias is not None:
    grads += (reduce_to_bias(p * (dp - delta)),)
  if o_residual is None:
    return o, grads
  delta_res = (doh * oracle.as_f64(o_residual).transpose(0, 2, 1, 3)).sum(-1)[..., None]
  shift = dq_dk(-p * (delta_res - delta))
  # dp - delta cancels where p is one-hot (S = 1, say): there the kernels' two float32
  # sums of H products (dp by the MMA, delta in its own order) differ by their rounding,
  # up to ~2 H u32 (|do| . |v|), where the exact gradient is 0.
  u32 = float(np.finfo(np.float32).eps) / 2
  sums = 2 * h * u32 * (np.abs(doh) @ np.abs(vr).swapaxes(-1, -2)) * p
  sums_dq = scale * (sums @ np.abs(kr)).transpose(0, 2, 1, 3)
  sums_dk = per_kv_head(scale * (sums.swapaxes(-1, -2) @ np.abs(qh)))
  extra = (float(np.abs(shift[0]).max(initial=0.0) + sums_dq.max(initial=0.0)),
           float(np.abs(shift[1]).max(initial=0.0) + sums_dk.max(initial=0.0)), 0.0)
  if bias is not None:
    extra += (float(np.abs(reduce_to_bias(-p * (delta_res - delta))).max(initial=0.0)
                    + reduce_to_bias(sums).max(initial=0.0)),)
  return o, grads, extra


def np_extra_keep(t: int, s: int, mask=None, q_lengths=None, kv_lengths=None):
  """The bool (B or 1, N or 1, T, S) array that a mask and sequence lengths keep, or None."""
  keep = None
  if mask is not None:
    keep = np.asarray(mask)
    keep = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
  for lengths, axis, n in ((q_lengths, 2, t), (kv_lengths, 3, s)):
    if lengths is None:
      continue
    shape = [1, 1, 1, 1]
    shape[axis] = n
    lens = np.asarray(lengths).reshape(-1, 1, 1, 1)
    rows = np.arange(n).reshape(shape) < lens
    keep = rows if keep is None else keep & rows
  return keep


# ---- the low-precision jnp reference --------------------------------------------------------


def jnp_attention(opts: Opts, q, k, v, q_seg=None, kv_seg=None, bias=None, extra_keep=None):
  """Attention at the op's precision (see the module docstring), by a (K, R) split of
  the query heads rather than jaxgpu.reference's repeat of the kv heads. bias and keep:
  as np_attention's (broadcastable to (B, N, T, S))."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  r = n // kh
  scale = 1 / math.sqrt(h) if opts.scale is None else opts.scale
  acc = jnp.promote_types(q.dtype, jnp.float32)
  logits = jnp.einsum("btkrh,bskh->bkrts", q.reshape(b, t, kh, r, h), k,
                      preferred_element_type=acc) * scale
  if opts.softcap is not None:
    logits = opts.softcap * jnp.tanh(logits / opts.softcap)

  def split_heads(a):  # (.., N or 1, T or 1, S or 1) -> (B or 1, K or 1, R or 1, ...)
    a = a.reshape((1,) * (4 - a.ndim) + a.shape)
    bb, nb, tb, sb = a.shape
    return a.reshape((bb, kh, r, tb, sb) if nb == n else (bb, 1, 1, tb, sb))

  if bias is not None:
    logits = logits + split_heads(bias).astype(acc)
  i = jnp.arange(t)[:, None]
  j = jnp.arange(s)[None, :]
  keep = jnp.ones((t, s), bool)
  if opts.causal:
    keep = keep & (j <= i)
  w = opts.window_pair()
  if w is not None:
    keep = keep & (j >= i - w[0]) & (j <= i + w[1])
  keep = keep[None, None, None]
  if q_seg is not None:
    keep = keep & (q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :])
  if extra_keep is not None:
    keep = keep & split_heads(jnp.asarray(extra_keep))
  logits = jnp.where(keep, logits, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True, initial=-jnp.inf))
  e = jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m))
  den = jnp.sum(e, -1, keepdims=True)
  p = (e / jnp.where(den == 0, 1.0, den)).astype(v.dtype)
  o = jnp.einsum("bkrts,bskh->btkrh", p, v, preferred_element_type=acc)
  return o.reshape(b, t, n, h).astype(q.dtype)


# ---- inputs ---------------------------------------------------------------------------------


def make_qkv(rng, case: Case, q_shape=None, kv_shape=None):
  """q scaled so that logits spread over a few units (the softmax is neither flat nor
  one-hot, and a softcap of 3 bends them)."""
  q = oracle.randn(rng, case.q_shape if q_shape is None else q_shape, case.dtype, 2.0)
  k = oracle.randn(rng, case.kv_shape if kv_shape is None else kv_shape, case.dtype)
  v = oracle.randn(rng, case.kv_shape if kv_shape is None else kv_shape, case.dtype)
  return q, k, v


def make_segments(rng, case: Case, b=None):
  """Packed sequences: sorted ids per row. Query ids go one higher than key ids, so some
  queries (those with the top id) see no key at all."""
  if not case.opts.segments:
    return ()
  b = case.b if b is None else b
  q_seg = np.sort(rng.integers(0, 4, (b, case.t)), axis=-1).astype(np.int32)
  kv_seg = np.sort(rng.integers(0, 3, (b, case.s)), axis=-1).astype(np.int32)
  return jnp.asarray(q_seg), jnp.asarray(kv_seg)



def make(rng, case: Case) -> C.Inputs:
  q, k, v = make_qkv(rng, case)
  arrays = {"query": q, "key": k, "value": v}
  segs = make_segments(rng, case)
  if segs:
    arrays["q_segment_ids"], arrays["kv_segment_ids"] = segs
  return C.Inputs(arrays, case.opts.kw())


def _opts(static: dict) -> Opts:
  return Opts(causal=static["is_causal"], window=static["local_window_size"],
              softcap=static["logit_softcap"], scale=static["scale"])


def _segs(arrays) -> tuple:
  return (arrays["q_segment_ids"], arrays["kv_segment_ids"]) if "q_segment_ids" in arrays else ()


def _oracle(arrays, static, dtype):
  return (jnp_attention(_opts(static), arrays["query"], arrays["key"], arrays["value"],
                        *_segs(arrays)),)


def _case_of(arrays, static) -> Case:
  (b, t, n, h), (s, kh) = arrays["query"].shape, arrays["key"].shape[1:3]
  return Case(b, t, s, n, kh, h, arrays["query"].dtype, _opts(static))


def _np_oracle(arrays, static, cots):
  args = (_case_of(arrays, static), arrays["query"], arrays["key"], arrays["value"],
          *_segs(arrays))
  if cots is None:
    return (np_attention(*args),), None
  o, grads = np_attention(*args, do=cots[0])
  return (o,), dict(zip(("query", "key", "value"), grads))


def _atol(arrays, static, cots, outs):
  """The backward kernels' residual term (np_attention's o_residual), from the op's own o."""
  if cots is None:
    return {}, {}
  _, _, extra = np_attention(_case_of(arrays, static), arrays["query"], arrays["key"],
                             arrays["value"], *_segs(arrays), do=cots[0], o_residual=outs[0])
  return {}, dict(zip(("query", "key", "value"), extra))


# ---- the contract tables ---------------------------------------------------------------------

VMAP_CASE = Case(2, 17, 24, 4, 2, 59, jnp.bfloat16, Opts(causal=True, segments=True))
# (id, q axis, k axis, v axis, segment-id axis or None (unbatched)): forward and vmap(grad).
VMAP_AXES = [
    ("all0", 0, 0, 0, 0),
    ("all1-seg-shared", 1, 1, 1, None),
    ("q-only", 2, None, None, None),
    ("kv-only", None, 0, -1, None),
    ("seg-only", None, None, None, 1),
]


def _vmap_table() -> tuple:
  out = []
  for name, qa, ka, va, sa in VMAP_AXES:
    axes = {k: v for k, v in (("query", qa), ("key", ka), ("value", va), ("q_segment_ids", sa),
                              ("kv_segment_ids", sa)) if v is not None}
    out.append(C.VmapCase(name, VMAP_CASE, (axes,)))
  # grad through vmap: the gradient of shared k, v sums over the vmapped axis.
  out.append(C.VmapCase("q0-kv-shared", dataclasses.replace(
      VMAP_CASE, opts=Opts(window=(3, 3), softcap=3.0)), ({"query": 0},),
      frozenset({"grad_of"})))
  return tuple(out)


SHARD_CASE = Case(8, 16, 16, 4, 2, 59, jnp.bfloat16, Opts(segments=True))
BT = P("a", "b")


def _sharded(name, q_spec, kv_spec, seg_spec, opts, heads, fwd, bwd, axis_types):
  """jit with sharded inputs; fwd / bwd: the collectives the kernels' programs contain
  (None: a gathered layout, checked for its values only), the results then keeping q's
  sharding."""
  case = dataclasses.replace(SHARD_CASE, n=heads[0], k=heads[1], opts=opts)
  kv_seg = P(seg_spec[0]) if len(seg_spec) else P()
  keeps = fwd is not None
  return C.ShardingCase(
      name, case, {"query": q_spec, "key": kv_spec, "value": kv_spec,
                   "q_segment_ids": seg_spec, "kv_segment_ids": kv_seg},
      fwd=None if fwd is None else frozenset(fwd), bwd=None if bwd is None else frozenset(bwd),
      out_specs={"o": q_spec} if keeps else None,
      grad_specs={"query": q_spec} if keeps else None, cot_specs={"o": q_spec},
      kernels_only=True, axis_types=axis_types, explicit_like=(("o", "query"),))


# Batch and heads run with no collective; T (no causal mask) all-reduces dk/dv in the
# backward pass only; T with the causal mask, and S, are gathered.
SHARDINGS = (
    _sharded("batch-heads", P("a", None, "b"), P("a", None, "b"), P("a"), SHARD_CASE.opts,
             (4, 2), (), (), ("auto", "explicit")),
    _sharded("batch-causal-window", P(("a", "b")), P(("a", "b")), P(("a", "b")),
             Opts(causal=True, window=3, softcap=3.0, segments=True), (4, 2), (), (), ("auto",)),
    _sharded("T-nocausal", BT, P("a"), BT, SHARD_CASE.opts, (4, 2), (), ("all-reduce",),
             ("auto", "explicit")),
    _sharded("mqa-heads", P("a", None, "b"), P("a"), P("a"), SHARD_CASE.opts, (4, 1), (),
             ("all-reduce",), ("auto", "explicit")),
    _sharded("T-causal", BT, P("a"), BT, Opts(causal=True, segments=True), (4, 2), None, None,
             ("auto", "explicit")),
    _sharded("S-sharded", P("a"), BT, P("a"), SHARD_CASE.opts, (4, 2), None, None, ("auto",)),
    # Heads over a size-4 axis with K = 2: no (K, R) sharding is the same layout (Explicit
    # mode relays out onto R, see _split_heads; the Auto mesh: test_attention.py's xfail).
    _sharded("heads-a4-k2", P(None, None, "a"), P(), P(), Opts(segments=True), (8, 2), None,
             None, ("explicit",)),
)


def _qkv(q=(2, 5, 4, 16), k=(2, 7, 2, 16), v=None, dtype=jnp.bfloat16, kdtype=None,
         vdtype=None):
  return dict(query=jnp.ones(q, dtype), key=jnp.ones(k, kdtype or dtype),
              value=jnp.ones(k if v is None else v, vdtype or dtype))


_SEG_Q = lambda: jnp.zeros((2, 5), jnp.int32)
_SEG_KV = lambda: jnp.zeros((2, 7), jnp.int32)

BAD_INPUTS = tuple(C.BadInput(*b) for b in [
    ("query-rank3", lambda: _qkv(q=(2, 5, 16)), ValueError, r"query.*rank 4"),
    ("key-rank5", lambda: _qkv(k=(2, 7, 2, 1, 16)), ValueError, r"key.*rank 4"),
    ("value-rank3", lambda: _qkv(v=(2, 7, 16)), ValueError, r"value.*rank 4"),
    ("query-int", lambda: _qkv(dtype=jnp.int32), TypeError, r"query.*dtype"),
    ("query-float64", lambda: dict(query=np.ones((2, 5, 4, 16)), key=np.ones((2, 7, 2, 16)),
                                   value=np.ones((2, 7, 2, 16))), TypeError, r"query.*dtype"),
    ("key-dtype", lambda: _qkv(kdtype=jnp.float16), TypeError, r"key.*dtype"),
    ("value-dtype", lambda: _qkv(vdtype=jnp.float32), TypeError, r"value.*dtype"),
    ("key-batch", lambda: _qkv(k=(3, 7, 2, 16)), ValueError, r"\bkey\b.*B = 2"),
    ("key-head-dim", lambda: _qkv(k=(2, 7, 2, 8)), ValueError, r"\bkey\b.*H = 16"),
    ("value-seq", lambda: _qkv(v=(2, 6, 2, 16)), ValueError, r"\bvalue\b.*shape"),
    ("value-heads", lambda: _qkv(v=(2, 7, 1, 16)), ValueError, r"\bvalue\b.*shape"),
    ("heads-not-multiple", lambda: _qkv(q=(2, 5, 3, 16)), ValueError, r"N = 3.*K = 2"),
    ("head-dim-257", lambda: _qkv(q=(1, 2, 2, 257), k=(1, 2, 2, 257)), ValueError,
     r"head dim.*256"),
    ("head-dim-0", lambda: _qkv(q=(1, 2, 2, 0), k=(1, 2, 2, 0)), ValueError, r"head dim"),
    ("scale-nan", lambda: dict(_qkv(), scale=float("nan")), ValueError, r"\bscale\b"),
    ("scale-string", lambda: dict(_qkv(), scale="big"), TypeError, r"\bscale\b"),
    ("causal-string", lambda: dict(_qkv(), is_causal="yes"), TypeError, r"is_causal"),
    ("causal-array", lambda: dict(_qkv(), is_causal=jnp.array(True)), TypeError, r"is_causal"),
    ("window-negative", lambda: dict(_qkv(), local_window_size=-1), ValueError,
     r"local_window_size"),
    ("window-pair-negative", lambda: dict(_qkv(), local_window_size=(3, -2)), ValueError,
     r"local_window_size"),
    ("window-three", lambda: dict(_qkv(), local_window_size=(1, 2, 3)), ValueError,
     r"local_window_size"),
    ("window-float", lambda: dict(_qkv(), local_window_size=2.5), TypeError,
     r"local_window_size"),
    ("window-bool", lambda: dict(_qkv(), local_window_size=True), TypeError,
     r"local_window_size"),
    ("softcap-zero", lambda: dict(_qkv(), logit_softcap=0.0), ValueError, r"logit_softcap"),
    ("softcap-negative", lambda: dict(_qkv(), logit_softcap=-5.0), ValueError,
     r"logit_softcap"),
    ("softcap-inf", lambda: dict(_qkv(), logit_softcap=float("inf")), ValueError,
     r"logit_softcap"),
    ("softcap-string", lambda: dict(_qkv(), logit_softcap="30"), TypeError, r"logit_softcap"),
    ("q-seg-alone", lambda: dict(_qkv(), q_segment_ids=_SEG_Q()), ValueError,
     r"q_segment_ids.*without kv_segment_ids"),
    ("kv-seg-alone", lambda: dict(_qkv(), kv_segment_ids=_SEG_KV()), ValueError,
     r"kv_segment_ids.*without q_segment_ids"),
    ("seg-float", lambda: dict(_qkv(), q_segment_ids=_SEG_Q().astype(jnp.float32),
                               kv_segment_ids=_SEG_KV()), TypeError, r"q_segment_ids.*integer"),
    ("q-seg-shape", lambda: dict(_qkv(), q_segment_ids=_SEG_KV(), kv_segment_ids=_SEG_KV()),
     ValueError, r"q_segment_ids.*\(2, 5\)"),
    ("kv-seg-shape", lambda: dict(_qkv(), q_segment_ids=_SEG_Q(), kv_segment_ids=_SEG_Q()),
     ValueError, r"kv_segment_ids.*\(2, 7\)"),
    ("seg-string", lambda: dict(_qkv(), q_segment_ids="a", kv_segment_ids=_SEG_KV()), TypeError,
     r"q_segment_ids"),
    ("implementation-bogus", lambda: dict(_qkv(), implementation="bogus"), ValueError,
     r"implementation"),
])

ARGS = ("query", "key", "value", "q_segment_ids", "kv_segment_ids")
HEADS = P("a", None, "b")

SPECS = (C.OpSpec(
    name="dot_product_attention",
    make=make,
    example=Case(1, 9, 9, 4, 2, 59, jnp.bfloat16, Opts(causal=True)),
    array_args=ARGS,
    diff_args=ARGS[:3],
    oracle=_oracle,
    np_oracle=_np_oracle,
    outputs=("o",),
    atol=_atol,
    grad_atol_ulps=GRAD_ULPS,
    vmap=_vmap_table(),
    # pmap over 4 devices, one batch entry each.
    pmap=C.VmapCase("all0", Case(1, 17, 17, 3, 1, 59, jnp.float16,
                                 Opts(window=(4, 0), segments=True)),
                    ({k: 0 for k in ARGS},), sizes=(C.PMAP_DEVICES,)),
    sharding=SHARDINGS,
    # Batch over 'a' and heads over 'b' (each shard a whole kv group).
    shard_map=C.ShardMapCase(Case(4, 17, 24, 4, 2, 32, jnp.bfloat16,
                                  Opts(causal=True, softcap=3.0, segments=True)),
                             {"query": HEADS, "key": HEADS, "value": HEADS,
                              "q_segment_ids": P("a"), "kv_segment_ids": P("a")}, (HEADS,)),
    bad_inputs=BAD_INPUTS,
    size_zero=tuple((f"b{b}t{t}s{s}", Case(b, t, s, 4, 2, 16, jnp.bfloat16, Opts(causal=True)))
                    for b, t, s in ((0, 5, 5), (2, 0, 5), (2, 5, 0))),
),)
