"""The transform stack every kernel-backed op shares: batching and partitioning rules.

Order, from the outside in (docs/design.md section 3; custom_partitioning has no batching or
JVP rule, and custom_vmap does not compose with reverse-mode AD):

  1. jax.custom_vjp            on the public function (in jaxgpu/ops/<family>.py); its fwd
                               and bwd rules call `grouped_call` below.
  2. custom_vmap               here: one rule for every op (see "groups").
  3. custom_partitioning       here: one rule for every op (see "layouts").
  4. jax.ffi.ffi_call          inside the op's `local_fn`.

Groups. Every array an inner op takes or returns has a leading *group* axis G. Row-shaped
arrays are (G, ...rows, ...) and parameters (a norm weight, say) are (G, ...) or (1, ...)
when shared by all groups; an output that reduces over rows (a weight gradient) has one
row per group. vmap then never needs a loop: the vmapped axis is folded into G
(`(B, G, ...) -> (B*G, ...)`, a free reshape). vmap over rows, over a weight, and vmap of
grad (one weight gradient per batch element) all become one launch of the same kernel.

Layouts. An op declares, for each input and output, a string of factor names:
``"g ... d"`` for a row-shaped array, ``"[g] d"`` for a parameter whose group axis may be
1 (broadcast), ``"g d"`` for a per-group reduction result. ``...`` stands for any number
of leading row dims. Factors listed in `replicated` (``d``, the normalized feature axis)
are gathered if the caller sharded them; the others keep their sharding, so row and group
sharding run with no collective. An output that lacks a factor that is sharded in the
inputs is a partial sum over that factor and is all-reduced (psum) inside the partitioned
body: the only collective a row-sharded weight gradient needs.

A move to jax.experimental.hijax (recommended from jax 0.11) would touch only this file.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

LocalFn = Callable[..., tuple[jax.Array, ...]]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Factor strings of an inner op's inputs and outputs (see the module docstring)."""

  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  replicated: frozenset[str] = frozenset({"d"})


def grouped_call(local_fn: LocalFn, layout: Layout, *args: jax.Array) -> tuple[jax.Array, ...]:
  """Calls `local_fn(*args)` with the shared vmap and sharding rules.

  `local_fn` takes arrays of the shapes `layout` describes, with ANY group size and any
  number of leading row dims (it is called on shards and on vmap-folded arrays), and
  returns a tuple of arrays. It is the only per-op code: usually reshapes around one
  jax.ffi.ffi_call.
  """
  if len(args) != len(layout.inputs):
    raise ValueError(f"expected {len(layout.inputs)} arrays, got {len(args)}")
  op = _batchable(local_fn, layout)
  explicit = [_explicit_spec(a) for a in args]
  if not any(any(ax is not None for ax in spec) for spec in explicit):
    return _match_varying(op(*args), args)
  # Explicit-sharding mode: custom_partitioning knows no sharding types, so the op runs
  # with the mesh axes switched to Auto, and its outputs get the sharding their factors
  # have in the inputs (a gathered feature axis is split again, as jnp ops keep it).
  plan = _plan(local_fn, layout, args)
  factor_axes = plan.factor_axes(explicit, include_replicated=True)
  out_specs = tuple(PartitionSpec(*(factor_axes.get(f) for f in fs)) for fs in plan.out_factors)
  return jax.sharding.auto_axes(op, out_sharding=out_specs)(*args)


def _explicit_spec(a) -> tuple:
  """The PartitionSpec in `a`'s type (Explicit mesh axes), padded to its rank."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (a.ndim - len(spec))


def _match_varying(outs, args):
  """Inside shard_map, FFI results are typed invariant across the manual axes; a result
  computed from varying inputs is varying (else out_specs=P() would silently return one
  shard, and custom_vjp would reject cotangents whose type differs from the primal's)."""
  vma = frozenset().union(*(_varying_axes(a) for a in args))
  if not vma:
    return outs
  fixed = []
  for o in outs:
    missing = tuple(sorted(vma - _varying_axes(o)))
    fixed.append(jax.lax.pcast(o, missing, to="varying") if missing else o)
  return tuple(fixed)


def _varying_axes(a) -> frozenset:
  """Manual mesh axes `a` varies over inside shard_map (jax 0.10: manual_axis_type.varying;
  older spelling: vma)."""
  aval = jax.typeof(a)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def _in_explicit_mode(a) -> bool:
  mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", ()) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def primal_types(*arrays) -> tuple:
  """Hashable record of what custom_vjp checks a cotangent against: each array's
  Explicit-mesh sharding (None off an Explicit mesh) and the manual axes it varies over
  inside shard_map. For `match_primal_types` in the bwd rule (None for absent arrays)."""
  return tuple(None if a is None else
               (PartitionSpec(*_explicit_spec(a)) if _in_explicit_mode(a) else None,
                _varying_axes(a))
               for a in arrays)


def match_primal_types(values, types):
  """Gives each cotangent its primal's type. A kernel's outputs follow the kernel's own
  sharding rule (reshard to the primal's Explicit sharding), and a per-shard weight
  gradient inside shard_map varies over axes its weight does not: it is summed over them,
  as JAX's own transpose of the weight's broadcast would."""
  out = []
  for v, t in zip(values, types):
    if v is not None and t is not None:
      spec, varying = t
      extra = tuple(sorted(_varying_axes(v) - varying))
      if extra:
        v = jax.lax.psum(v, extra)
      if spec is not None:
        v = jax.sharding.reshard(v, spec)
    out.append(v)
  return tuple(out)


def _batchable(local_fn: LocalFn, layout: Layout):
  @jax.custom_batching.custom_vmap
  def op(*args):
    return _partitioned(local_fn, layout, args)

  @op.def_vmap
  def _vmap_rule(axis_size, in_batched, *args):
    folded = _fold_batch_into_groups(axis_size, in_batched, args, layout)
    outs = grouped_call(local_fn, layout, *folded)
    outs = tuple(o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:]) for o in outs)
    return outs, tuple(True for _ in outs)

  return op


def _group_size(args: Sequence[jax.Array], batched=None) -> int:
  return max(a.shape[1 if (batched is not None and batched[i]) else 0]
             for i, a in enumerate(args))


def _fold_batch_into_groups(axis_size, in_batched, args, layout: Layout):
  """(B, G, ...) -> (B*G, ...) for every input; unbatched inputs are broadcast.

  A parameter ("[g]") that is unbatched and shared (group axis 1) stays (1, ...): the
  kernel broadcasts it, no copy. Anything else that is unbatched is repeated B times,
  which only happens when its output is B times larger anyway (x unbatched, weight
  batched).
  """
  g = _group_size(args, in_batched)
  folded = []
  for a, batched, dims in zip(args, in_batched, layout.inputs):
    broadcastable = dims.split()[0] == "[g]"
    if batched:
      if a.shape[1] != g:
        a = jnp.broadcast_to(a, (a.shape[0], g) + a.shape[2:])
      folded.append(a.reshape((axis_size * g,) + a.shape[2:]))
    elif broadcastable and a.shape[0] == 1:
      folded.append(a)
    else:
      if a.shape[0] != g:
        a = jnp.broadcast_to(a, (g,) + a.shape[1:])
      a = jnp.broadcast_to(a[None], (axis_size,) + a.shape)
      folded.append(a.reshape((axis_size * g,) + a.shape[2:]))
  return folded


# ---- partitioning -------------------------------------------------------------------------


def _expand_factors(dims: str, shape: tuple[int, ...], group: int, index: str) -> list[str]:
  """Factor names of one array: '...' becomes r0, r1, ...; a size-1 '[g]' its own factor."""
  tokens = dims.split()
  n_lead = len(shape) - (len(tokens) - (1 if "..." in tokens else 0))
  names = []
  for t in tokens:
    if t == "...":
      names.extend(f"r{k}" for k in range(n_lead))
    elif t == "[g]":
      names.append("g" if shape[len(names)] == group else f"one{index}")
    else:
      names.append(t)
  if len(names) != len(shape):
    raise ValueError(f"layout {dims!r} does not match shape {shape}")
  return names


@dataclasses.dataclass(frozen=True)
class _Plan:
  in_factors: tuple[tuple[str, ...], ...]
  out_factors: tuple[tuple[str, ...], ...]
  replicated: frozenset[str]

  def rule(self) -> str:
    ins = ", ".join(" ".join(f) for f in self.in_factors)
    outs = ", ".join(" ".join(f) for f in self.out_factors)
    return f"{ins} -> {outs}"

  def factor_axes(self, in_specs, include_replicated=False) -> dict[str, object]:
    """Mesh axes each factor keeps: the first input's sharding wins, replicated factors
    (unless asked for) and size-1 group axes get none, and no mesh axis is used twice."""
    factor_axes: dict[str, object] = {}
    used: set[str] = set()
    for factors, spec in zip(self.in_factors, in_specs):
      for f, ax in zip(factors, spec):
        if (ax is None or (f in self.replicated and not include_replicated)
            or f.startswith("one") or f in factor_axes):
          continue
        axes = set(ax) if isinstance(ax, tuple) else {ax}
        if axes & used:
          continue
        factor_axes[f] = ax
        used |= axes
    return factor_axes

  def decide(self, mesh, arg_shapes):
    """Shardings to run with, and the mesh axes each output is all-reduced over."""
    factor_axes = self.factor_axes(
        [_spec_of(shape, len(f)) for f, shape in zip(self.in_factors, arg_shapes)])

    def sharding(factors):
      return NamedSharding(mesh, PartitionSpec(*(factor_axes.get(f) for f in factors)))

    arg_shardings = tuple(sharding(f) for f in self.in_factors)
    out_shardings = tuple(sharding(f) for f in self.out_factors)
    in_factor_set = {f for fs in self.in_factors for f in fs}
    reduce_axes = []
    for factors in self.out_factors:
      axes: list[str] = []
      for f in sorted(in_factor_set - set(factors)):
        if f in factor_axes:
          ax = factor_axes[f]
          axes.extend(ax if isinstance(ax, tuple) else (ax,))
      reduce_axes.append(tuple(axes))
    return arg_shardings, out_shardings, tuple(reduce_axes)


def _spec_of(shape, rank):
  sharding = getattr(shape, "sharding", None)
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return spec + (None,) * (rank - len(spec))


def _plan(local_fn: LocalFn, layout: Layout, args) -> _Plan:
  out_shapes = jax.eval_shape(local_fn, *args)
  group = _group_size(args)
  return _Plan(
      in_factors=tuple(tuple(_expand_factors(d, a.shape, group, f"i{i}"))
                       for i, (d, a) in enumerate(zip(layout.inputs, args))),
      out_factors=tuple(tuple(_expand_factors(d, o.shape, group, f"o{i}"))
                        for i, (d, o) in enumerate(zip(layout.outputs, out_shapes))),
      replicated=layout.replicated,
  )


def _partitioned(local_fn: LocalFn, layout: Layout, args):
  plan = _plan(local_fn, layout, args)

  @custom_partitioning
  def op(*xs):
    return local_fn(*xs)

  def partition(mesh, arg_shapes, result_shape):
    arg_shardings, out_shardings, reduce_axes = plan.decide(mesh, arg_shapes)

    # The per-shard body is traced when XLA partitions, under the caller's mesh context:
    # with an Explicit mesh set (jax.set_mesh) its ops got sharding annotations that nothing
    # partitions afterwards (jax 0.11.2: "No registered implementation for untyped custom
    # call to Sharding"). Trace it with every axis Auto.
    auto = mesh.abstract_mesh.update_axis_types(
        {name: jax.sharding.AxisType.Auto for name in mesh.axis_names})

    def lower_fn(*xs):
      with jax.sharding.use_abstract_mesh(auto):
        outs = local_fn(*xs)
        return tuple(jax.lax.psum(o, axes) if axes else o for o, axes in zip(outs, reduce_axes))

    return mesh, lower_fn, out_shardings, arg_shardings

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    return plan.decide(mesh, arg_shapes)[1]

  op.def_partition(
      partition=partition,
      infer_sharding_from_operands=infer_sharding_from_operands,
      sharding_rule=plan.rule(),
  )
  return tuple(op(*args))
