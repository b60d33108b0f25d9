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
inputs is a partial result over that factor, combined across shards inside the partitioned
body as `Layout.combine` says:

  * SUM (the default): all-reduced (psum), the only collective a row-sharded weight
    gradient needs.
  * LSE: each shard's log-sum-exp over its slice (-inf for a shard that saw nothing),
    combined as logsumexp over shards (a vocabulary-parallel LM head's normalizer).
  * LseWeighted(j): a value each shard normalized over its own slice with log-normalizer
    output j (an LSE output), combined as o = sum_i exp(lse_i - lse) o_i (sequence-sharded
    decode attention). Output j's factors must be a subset of this output's.

The LSE outputs are all-gathered (they are small: one float per row) and combined locally,
identically on every shard; a weighted value then needs one psum of w_i * o_i. That is one
collective per LSE output and one per value, where pmax + psum of exp-shifted values would
be two all-reduces for the normalizer alone, each as latency-bound as the one all-gather.

Blocked factors. A factor listed in `Layout.blocked` may have different sizes in different
arrays, each an integer multiple of a common block count (the gcd of the sizes): a
weight's K rows, its packed int4 bytes (K/2 rows, two values a byte) and its per-group
scales (K/group rows). A sharding splits all of them block-wise and consistently (shard i
holds the same logical rows of each); a mesh axis that does not divide the block count is
dropped (the factor is gathered over it). Shardy is told with compound factors: "(k k_x2)"
for an array with twice the block count's rows, k being the major part.

Sources. An output computed from some inputs only (a linear's bias gradient reads dz, not
x) is partial only over the sharded factors of those: `Layout.sources` {output index:
input indices} says so (unlisted outputs read every input).

Aliases. `Layout.aliases` {input index: output index} marks an output written in place of
an input (a KV-cache update). Both have the same factor string, so the output keeps the
input's shape and sharding through vmap folding and partitioning (the aliased input's
sharding wins over other inputs'), and donating the input under jax.jit aliases the
buffer end to end. The local_fn passes the pair to its jax.ffi.ffi_call as
`input_output_aliases` (in its own operand order).

Partial bodies. An output combined by SUM across shards must not have a nonlinear epilogue
applied per shard (a row-parallel linear's bias and activation come after the all-reduce).
An op with such an epilogue passes `partial=PartialBody(partial_fn, finish_fn)`: when the
partitioner shards a factor that some output lacks, the per-shard body runs
`partial_fn(*xs)` (the outputs before the epilogue), combines them, and returns
`finish_fn(combined, *xs)`; otherwise `local_fn` runs as usual.

For the ops' own code: `explicit_spec` and `in_explicit_mode` read an array's Explicit-mesh
sharding (to reshape it without a relayout), `primal_types` and `match_primal_types` give
cotangents their primals' types in a custom_vjp backward rule.

Derivatives. The inner ops have no differentiation rule: forward mode and second
derivatives run each op's reference instead (jaxgpu/_autodiff.py, applied by the ops). An
inner op is wrapped in a jax.custom_jvp whose rule raises an error naming the op, for the
cases the ops cannot see coming (a function traced into a jaxpr, then differentiated again).

A move to jax.experimental.hijax (recommended from jax 0.11) would touch only this file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxgpu import _autodiff

LocalFn = Callable[..., tuple[jax.Array, ...]]

# How an output that lacks a sharded input factor is combined across shards.
SUM = "sum"
LSE = "lse"


@dataclasses.dataclass(frozen=True)
class LseWeighted:
  """Combine kind of a value output that each shard normalized over its own slice, with
  log-normalizer output `lse` (whose kind is LSE): o = sum_i exp(lse_i - lse) o_i."""

  lse: int


@dataclasses.dataclass(frozen=True)
class Layout:
  """Factor strings of an inner op's inputs and outputs (see the module docstring).

  combine: {output index: SUM, LSE or LseWeighted(lse output index)}; unlisted outputs
    are SUM.
  blocked: factors whose arrays may hold them at different sizes (split block-wise).
  aliases: {input index: output index}, outputs written in place of inputs.
  sources: {output index: input indices it is computed from} (unlisted: every input).
  The mappings are stored as sorted tuples of pairs, so a Layout stays hashable.
  """

  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  replicated: frozenset[str] = frozenset({"d"})
  combine: Mapping[int, str | LseWeighted] | tuple = ()
  blocked: frozenset[str] = frozenset()
  aliases: Mapping[int, int] | tuple = ()
  sources: Mapping[int, tuple[int, ...]] | tuple = ()

  def __post_init__(self):
    object.__setattr__(self, "combine", tuple(sorted(dict(self.combine).items())))
    object.__setattr__(self, "aliases", tuple(sorted(dict(self.aliases).items())))
    object.__setattr__(self, "sources", tuple(sorted(
        (o, tuple(ins)) for o, ins in dict(self.sources).items())))
    for o, ins in self.sources:
      if not 0 <= o < len(self.outputs) or not all(0 <= i < len(self.inputs) for i in ins):
        raise ValueError(f"sources: output {o} or inputs {ins} out of range")
    kinds = dict(self.combine)
    for o, kind in kinds.items():
      if not 0 <= o < len(self.outputs):
        raise ValueError(f"combine: there is no output {o} (outputs {self.outputs})")
      if isinstance(kind, LseWeighted):
        if kind.lse == o or kinds.get(kind.lse) != LSE:
          raise ValueError(f"combine: output {o} is weighted by output {kind.lse}, whose "
                           f"kind must be {LSE!r}")
      elif kind not in (SUM, LSE):
        raise ValueError(f"combine: output {o}: expected {SUM!r}, {LSE!r} or LseWeighted, "
                         f"got {kind!r}")
    targets = [o for _, o in self.aliases]
    if len(set(targets)) != len(targets):
      raise ValueError(f"aliases: an output aliases two inputs: {dict(self.aliases)}")
    every_input_factor = {t.strip("[]") for dims in self.inputs for t in dims.split()}
    for i, o in self.aliases:
      if not (0 <= i < len(self.inputs) and 0 <= o < len(self.outputs)):
        raise ValueError(f"aliases: no input {i} or no output {o}")
      if self.inputs[i] != self.outputs[o] or "[g]" in self.inputs[i].split():
        raise ValueError(f"aliases: input {i} ({self.inputs[i]!r}) and output {o} "
                         f"({self.outputs[o]!r}) need one factor string, without '[g]'")
      partial = every_input_factor - set(self.outputs[o].split()) - self.replicated
      if partial:
        # Sharded, such a factor would make the output a partial result to combine: an
        # in-place buffer summed over shards would be counted once per shard.
        raise ValueError(f"aliases: output {o} lacks the input factors {sorted(partial)}; "
                         "list them in replicated")

  def combine_kind(self, output: int) -> str | LseWeighted:
    return dict(self.combine).get(output, SUM)

  def output_sources(self, output: int) -> tuple[int, ...]:
    return dict(self.sources).get(output, tuple(range(len(self.inputs))))


@dataclasses.dataclass(frozen=True)
class PartialBody:
  """What a partitioned body runs when an output is partial across shards (see the module
  docstring): partial_fn(*xs) -> outputs before the epilogue; finish_fn(outputs, *xs) ->
  the outputs, from the combined ones."""

  partial_fn: LocalFn
  finish_fn: Callable[..., tuple[jax.Array, ...]]


def grouped_call(local_fn: LocalFn, layout: Layout, *args: jax.Array,
                 partial: PartialBody | None = None) -> tuple[jax.Array, ...]:
  """Calls `local_fn(*args)` with the shared vmap and sharding rules.

  `local_fn` takes arrays of the shapes `layout` describes, with ANY group size and any
  number of leading row dims (it is called on shards and on vmap-folded arrays), and
  returns a tuple of arrays. It is the only per-op code: usually reshapes around one
  jax.ffi.ffi_call. On a shard, an output combined across shards (see `Layout.combine`)
  is the shard's partial result: its sum, its log-sum-exp (-inf when the shard saw
  nothing), or its value normalized over the shard's slice. An output in
  `layout.aliases` has its input's shape and dtype.
  """
  if len(args) != len(layout.inputs):
    raise ValueError(f"expected {len(layout.inputs)} arrays, got {len(args)}")
  op = _batchable(local_fn, layout, partial)
  explicit = [explicit_spec(a) for a in args]
  if not any(any(ax is not None for ax in spec) for spec in explicit):
    return _match_varying(op(*args), args)
  # Explicit-sharding mode: custom_partitioning knows no sharding types, so the op runs
  # with the mesh axes switched to Auto, and its outputs get the sharding their factors
  # have in the inputs (a gathered feature axis is split again, as jnp ops keep it).
  plan = _plan(local_fn, layout, args)
  mesh = next(jax.typeof(a).sharding.mesh for a, spec in zip(args, explicit)
              if any(ax is not None for ax in spec))
  factor_axes = plan.factor_axes(explicit, dict(mesh.shape), include_replicated=True)
  out_specs = tuple(PartitionSpec(*(factor_axes.get(f) for f in fs)) for fs in plan.out_factors)
  return jax.sharding.auto_axes(op, out_sharding=out_specs)(*args)


def explicit_spec(a) -> tuple:
  """The PartitionSpec entries in `a`'s type (Explicit mesh axes), padded to its rank;
  all None off an Explicit mesh."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (a.ndim - len(spec))


def in_explicit_mode(a) -> bool:
  """Whether `a`'s type carries a mesh with an Explicit axis (jax.sharding.AxisType), so
  that a reshape or an op's output must name its sharding."""
  mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", ()) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


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


def primal_types(*arrays) -> tuple:
  """Hashable record of what custom_vjp checks a cotangent against: each array's
  Explicit-mesh sharding (None off an Explicit mesh) and the manual axes it varies over
  inside shard_map. For `match_primal_types` in the bwd rule (None for absent arrays)."""
  return tuple(None if a is None else
               (PartitionSpec(*explicit_spec(a)) if in_explicit_mode(a) else None,
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


def _batchable(local_fn: LocalFn, layout: Layout, partial: PartialBody | None = None):
  @jax.custom_batching.custom_vmap
  def op(*args):
    return _partitioned(local_fn, layout, args, partial)

  @op.def_vmap
  def _vmap_rule(axis_size, in_batched, *args):
    folded = _fold_batch_into_groups(axis_size, in_batched, args, layout)
    outs = grouped_call(local_fn, layout, *folded, partial=partial)
    if any(o.shape[0] % axis_size for o in outs):
      # A "[g]" output of a shared, unbatched (1, ...) parameter (the gradient of a bias
      # that broadcasts over the groups) sums over every folded group, where each example
      # needs its own: one call per example instead.
      def one(batched):
        it = iter(batched)
        return grouped_call(local_fn, layout, *(next(it) if b else a
                                                for a, b in zip(args, in_batched)),
                            partial=partial)
      outs = jax.lax.map(one, [a for a, b in zip(args, in_batched) if b])
      return tuple(outs), tuple(True for _ in outs)
    outs = tuple(o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:]) for o in outs)
    return outs, tuple(True for _ in outs)

  # The custom_vjp rules around this call it on values no derivative traces; one that does
  # (a function traced into a jaxpr, then differentiated again) would fail inside jax's
  # custom_partitioning with a message that names no op. Name it (jaxgpu/_autodiff.py).
  @jax.custom_jvp
  def differentiable(*args):
    return op(*args)

  @differentiable.defjvp
  def _jvp_rule(primals, tangents):
    _autodiff.refuse_differentiation(local_fn, primals)

  return differentiable


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


def _block_counts(blocked, factors, shapes) -> dict[str, int]:
  """Block count of each blocked factor: the gcd of its sizes in all arrays (K, K/2 and
  K/group rows give K/group when group is even), so that every array holds a whole
  number of rows per block."""
  sizes: dict[str, set[int]] = {f: set() for f in blocked}
  for fs, shape in zip(factors, shapes):
    for f, n in zip(fs, shape):
      if f in sizes:
        sizes[f].add(n)
  counts = {}
  for f, ns in sizes.items():
    if 0 in ns and len(ns) > 1:
      raise ValueError(f"blocked factor {f!r}: sizes {sorted(ns)} are empty in some arrays "
                       "only")
    counts[f] = math.gcd(*ns) if ns else 0
  return counts


def _axes_tuple(ax) -> tuple[str, ...]:
  return tuple(ax) if isinstance(ax, tuple) else (ax,)


@dataclasses.dataclass(frozen=True)
class _Plan:
  in_factors: tuple[tuple[str, ...], ...]
  out_factors: tuple[tuple[str, ...], ...]
  in_shapes: tuple[tuple[int, ...], ...]
  out_shapes: tuple[tuple[int, ...], ...]
  replicated: frozenset[str]
  blocks: tuple[tuple[str, int], ...]        # (blocked factor, block count)
  combine: tuple[str | LseWeighted, ...]     # per output
  aliased: tuple[int, ...]                   # inputs that an output aliases
  sources: tuple[tuple[int, ...], ...]       # per output: the inputs it is computed from

  @property
  def order(self) -> tuple[int, ...]:
    """Inputs by sharding priority: aliased ones first."""
    return self.aliased + tuple(i for i in range(len(self.in_factors)) if i not in self.aliased)

  def rule(self) -> tuple[str, dict[str, int]]:
    """The Shardy rule string and the sizes of its factors used only inside compound
    factors.

    An array with r times a blocked factor's block count b rows maps that dim to
    "(k k_xr)", k of size b the major part, so a sharding of any of them is block-wise.
    The factors of an aliased input are named apart in the other inputs ("g_i1"): Shardy
    then gives the outputs the aliased input's sharding even where another input's
    conflicts (it would otherwise settle on neither, and the donated buffer could not be
    reused); `decide` moves the other inputs to it."""
    blocks = dict(self.blocks)
    owned = {f for i in self.aliased for f in self.in_factors[i]}
    sizes: dict[str, int] = {}
    whole, majors = set(), {}

    def dim(f, n, index):
      name = f"{f}_i{index}" if index is not None and f in owned else f
      if f in blocks and blocks[f] <= 1 and n > 1:
        # One block: the factor is never split, and its sizes differ across arrays; a
        # compound with a unit major factor is invalid in Shardy, so name each size apart.
        whole.add(f"{name}_n{n}")
        return f"{name}_n{n}"
      if f not in blocks or n == blocks[f]:
        whole.add(name)
        return name
      majors[name] = blocks[f]
      minor = f"{name}_x{n // blocks[f]}"
      sizes[minor] = n // blocks[f]
      return f"({name} {minor})"

    def arrays(factors, shapes, inputs):
      return ", ".join(
          " ".join(dim(f, n, i if inputs and i not in self.aliased else None)
                   for f, n in zip(fs, shape))
          for i, (fs, shape) in enumerate(zip(factors, shapes)))

    text = (f"{arrays(self.in_factors, self.in_shapes, True)} -> "
            f"{arrays(self.out_factors, self.out_shapes, False)}")
    sizes.update({name: b for name, b in majors.items() if name not in whole})
    return text, sizes

  def factor_axes(self, in_specs, axis_sizes, include_replicated=False) -> dict[str, object]:
    """Mesh axes each factor keeps: an aliased input's sharding decides its factors (even
    where it has none), then the first input's sharding wins, replicated factors (unless
    asked for) and size-1 group axes get none, no mesh axis is used twice, and a blocked
    factor keeps only axes that divide its block count."""
    blocks = dict(self.blocks)
    factor_axes: dict[str, object] = {}
    claimed = {f for i in self.aliased for f in self.in_factors[i]}
    used: set[str] = set()
    for i in self.order:
      for f, ax in zip(self.in_factors[i], in_specs[i]):
        if (ax is None or (f in self.replicated and not include_replicated)
            or f.startswith("one") or f in factor_axes
            or (f in claimed and i not in self.aliased)):
          continue
        axes = set(_axes_tuple(ax))
        if axes & used:
          continue
        if f in blocks and blocks[f] % math.prod(axis_sizes[a] for a in axes):
          continue
        factor_axes[f] = ax
        used |= axes
    return factor_axes

  def decide(self, mesh, arg_shapes):
    """Shardings to run with, and the mesh axes each output is combined over."""
    factor_axes = self.factor_axes(
        [_spec_of(shape, len(f)) for f, shape in zip(self.in_factors, arg_shapes)],
        dict(mesh.shape))

    def sharding(factors):
      return NamedSharding(mesh, PartitionSpec(*(factor_axes.get(f) for f in factors)))

    arg_shardings = tuple(sharding(f) for f in self.in_factors)
    out_shardings = tuple(sharding(f) for f in self.out_factors)
    reduce_axes = []
    for factors, sources in zip(self.out_factors, self.sources):
      in_factor_set = {f for i in sources for f in self.in_factors[i]}
      axes: list[str] = []
      for f in sorted(in_factor_set - set(factors)):
        if f in factor_axes:
          axes.extend(_axes_tuple(factor_axes[f]))
      reduce_axes.append(tuple(axes))
    for o, kind in enumerate(self.combine):
      if isinstance(kind, LseWeighted) and reduce_axes[o] != reduce_axes[kind.lse]:
        raise ValueError(f"output {o} and its lse output {kind.lse} are partial over "
                         f"different mesh axes: {reduce_axes[o]} vs {reduce_axes[kind.lse]}")
    return arg_shardings, out_shardings, tuple(reduce_axes)


def _spec_of(shape, rank):
  sharding = getattr(shape, "sharding", None)
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return spec + (None,) * (rank - len(spec))


def _plan(local_fn: LocalFn, layout: Layout, args) -> _Plan:
  # Shapes only: traced on Explicit-mesh types, a local_fn of jnp ops could be refused (a
  # contraction over a sharded dim asks for an out_sharding), as its shards never are.
  out_shapes = jax.eval_shape(local_fn, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
  group = _group_size(args)
  in_factors = tuple(tuple(_expand_factors(d, a.shape, group, f"i{i}"))
                     for i, (d, a) in enumerate(zip(layout.inputs, args)))
  out_factors = tuple(tuple(_expand_factors(d, o.shape, group, f"o{i}"))
                      for i, (d, o) in enumerate(zip(layout.outputs, out_shapes)))
  for i, o in layout.aliases:
    if (out_shapes[o].shape, out_shapes[o].dtype) != (args[i].shape, args[i].dtype):
      raise ValueError(f"output {o} aliases input {i} but is {out_shapes[o].dtype}"
                       f"{list(out_shapes[o].shape)}, not {args[i].dtype}{list(args[i].shape)}")
  combine = tuple(layout.combine_kind(o) for o in range(len(out_factors)))
  for o, kind in enumerate(combine):
    if isinstance(kind, LseWeighted) and not set(out_factors[kind.lse]) <= set(out_factors[o]):
      raise ValueError(f"output {o} is weighted by output {kind.lse}, whose factors "
                       f"{out_factors[kind.lse]} are not all among its own {out_factors[o]}")
  in_shapes = tuple(tuple(a.shape) for a in args)
  out_shape_tuple = tuple(tuple(o.shape) for o in out_shapes)
  return _Plan(
      in_factors=in_factors,
      out_factors=out_factors,
      in_shapes=in_shapes,
      out_shapes=out_shape_tuple,
      replicated=layout.replicated,
      blocks=tuple(sorted(_block_counts(layout.blocked, in_factors + out_factors,
                                        in_shapes + out_shape_tuple).items())),
      combine=combine,
      aliased=tuple(i for i, _ in layout.aliases),
      sources=tuple(layout.output_sources(o) for o in range(len(out_factors))),
  )


# ---- combining partial results across shards ------------------------------------------------


def _lse_over_shards(lse, axes):
  """logsumexp over the shards of `axes` of each shard's log-sum-exp, in float32 (or wider):
  -inf where every shard saw nothing, never NaN (the shift by the max is skipped when the
  max is not finite)."""
  acc = jnp.promote_types(lse.dtype, jnp.float32)
  parts = jax.lax.all_gather(lse.astype(acc), axes)
  top = jnp.max(parts, axis=0)
  top = jnp.where(jnp.isfinite(top), top, 0)
  return top + jnp.log(jnp.sum(jnp.exp(parts - top), axis=0))


def _align(a, factors, to_factors):
  """`a` (dims named by `factors`, a subset of `to_factors`) transposed and reshaped to
  broadcast against an array whose dims are `to_factors`."""
  perm = sorted(range(len(factors)), key=lambda d: to_factors.index(factors[d]))
  a = jnp.transpose(a, perm)
  size = {factors[d]: a.shape[k] for k, d in enumerate(perm)}
  return a.reshape(tuple(size.get(f, 1) for f in to_factors))


def _weighted_over_shards(value, lse, total, lse_factors, value_factors, axes):
  """sum_i exp(lse_i - total) value_i over the shards of `axes`, accumulated in float32
  (one rounding to value's dtype at the end, as the kernels' own accumulators). A shard
  that saw nothing (weight 0) adds exactly 0, whatever its value holds."""
  acc = jnp.promote_types(value.dtype, jnp.float32)
  w = jnp.exp(lse.astype(acc) - jnp.where(jnp.isfinite(total), total, 0).astype(acc))
  w = _align(w, lse_factors, value_factors)
  term = jnp.where(w > 0, w * value.astype(acc), 0)
  return jax.lax.psum(term, axes).astype(value.dtype)


def _combine(plan: _Plan, outs, reduce_axes):
  """Each output's partial results combined over the mesh axes it is partial over."""
  totals: dict[int, jax.Array] = {}

  def total(j):
    if j not in totals:
      totals[j] = _lse_over_shards(outs[j], reduce_axes[j])
    return totals[j]

  combined = []
  for o, (out, axes, kind) in enumerate(zip(outs, reduce_axes, plan.combine)):
    if not axes:
      combined.append(out)
    elif kind == SUM:
      combined.append(jax.lax.psum(out, axes))
    elif kind == LSE:
      combined.append(total(o).astype(out.dtype))
    else:
      combined.append(_weighted_over_shards(out, outs[kind.lse], total(kind.lse),
                                            plan.out_factors[kind.lse], plan.out_factors[o],
                                            axes))
  return tuple(combined)


def _partitioned(local_fn: LocalFn, layout: Layout, args, partial: PartialBody | None = None):
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

    summed = any(axes and kind == SUM for axes, kind in zip(reduce_axes, plan.combine))

    def lower_fn(*xs):
      with jax.sharding.use_abstract_mesh(auto):
        if partial is not None and summed:
          outs = _combine(plan, tuple(partial.partial_fn(*xs)), reduce_axes)
          return tuple(partial.finish_fn(outs, *xs))
        return _combine(plan, tuple(local_fn(*xs)), reduce_axes)

    return mesh, lower_fn, out_shardings, arg_shardings

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    return plan.decide(mesh, arg_shapes)[1]

  rule, factor_sizes = plan.rule()
  op.def_partition(
      partition=partition,
      infer_sharding_from_operands=infer_sharding_from_operands,
      sharding_rule=rule,
      **factor_sizes,
  )
  return tuple(op(*args))
