"""Data, tensor and fully sharded data parallelism for the Gemma model on a Mesh with axes
("data", "model").

Parameters (Megatron-style tensor parallelism on "model"; on "data" only with fsdp=True):
  * q (D, N, H) and o (N, H, D): the heads N on "model" when the model axis divides N.
  * k, v (D, K, H): the kv heads on "model" when the model axis also divides K. Otherwise
    (e.g. gemma3_1b's single kv head) they are replicated, and the model repeats each kv head
    (`kv_repeat`) after the projection to lcm(K, model) heads, so that every model shard
    holds whole kv groups and attention runs head-sharded with no collective.
  * gate, up (D, F) on F and down (F, D) on F: the MLP's hidden axis on "model".
  * norms: replicated (they are D- or H-sized; the norm ops gather a sharded feature axis).
  * embed (V, D): replicated. It is also the output projection, and its logits (B, T, V)
    go to jaxgpu.cross_entropy, which needs whole vocabulary rows: with V on "model" the
    logits would be all-gathered (B*T*V values per step, 2 GB per 4096-token bf16 sequence
    of gemma2_2b), and with D on "model" they would be all-reduced (as large). Replicated,
    every model shard computes its batch rows' logits itself: no collective, at the cost
    of repeating the (B*T, D) x (D, V) product on each model shard. A vocabulary-parallel
    fused linear + cross-entropy (issue 27) is what would let it be sharded.
With fsdp=True (fully sharded data parallelism, ZeRO-3), every matrix is also split over
"data" along its largest axis that "model" leaves whole and "data" divides (q, k, v, gate,
up: D; o, down: D; embed: V), and the AdamW moments with it. Each use of a layer's weights
gathers them first (`gather_layer`: a constraint to the tensor-parallel specs, which XLA
turns into an all-gather over "data" right before the layer, repeated in the backward pass
under remat), and the gradients leave the step split again (a reduce-scatter over "data"
where plain data parallelism all-reduces). Parameters, gradients and optimizer state then
take 1/data of their data-parallel memory per device; the cost is one all-gather of the
weights per pass.
Activations: the batch on "data"; q, k, v and attention outputs on "model" by head; the
MLP's hidden activations on "model". So a training step needs: the all-reduce of the
gradients over "data", and the tensor-parallel all-reduces over "model" (after o and down
in the forward pass, after the column-parallel products' input gradients in the backward).

The model's sharding is stated with Auto mesh axes (XLA's partitioner propagates it from
the constraints placed here): a mesh with Explicit axes (jax.make_mesh's default since
jax 0.9) is used as its Auto twin (`auto_mesh`) by every helper, so arrays placed by
shard_params / shard_batch and the constraints inside the jitted step agree. Without a mesh
(None) every helper here is a no-op and every spec replicated.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgpu.models.gemma.config import Config
from jaxgpu.models.gemma.params import NORMS, layer_shapes

DATA = "data"
MODEL = "model"


def auto_mesh(mesh):
  """`mesh` with every axis Auto (the same devices and axis names); None stays None."""
  if mesh is None:
    return None
  auto = jax.sharding.AxisType.Auto
  types = tuple(getattr(mesh, "axis_types", None) or ())
  if types and all(t == auto for t in types):
    return mesh
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(auto,) * len(mesh.axis_names))


def axis_size(mesh, name: str) -> int:
  """The size of mesh axis `name` (1 without a mesh or without that axis)."""
  if mesh is None or name not in mesh.axis_names:
    return 1
  return dict(mesh.shape)[name]


def batch_axis(mesh):
  """The mesh axis the batch is split over ("data"), or None."""
  return DATA if axis_size(mesh, DATA) > 1 else None


def heads_sharded(config: Config, mesh) -> bool:
  m = axis_size(mesh, MODEL)
  return m > 1 and config.n_heads % m == 0


def kv_sharded(config: Config, mesh) -> bool:
  return heads_sharded(config, mesh) and config.n_kv_heads % axis_size(mesh, MODEL) == 0


def kv_repeat(config: Config, mesh) -> int:
  """How many times the model repeats each kv head before attention: 1, or, when the heads
  are sharded but the model axis does not divide the kv heads, lcm(K, model) / K (which
  divides the group size N / K, since the model axis divides N)."""
  if not heads_sharded(config, mesh) or kv_sharded(config, mesh):
    return 1
  k = config.n_kv_heads
  return math.lcm(k, axis_size(mesh, MODEL)) // k


def ffn_sharded(config: Config, mesh) -> bool:
  m = axis_size(mesh, MODEL)
  return m > 1 and config.ffn_dim % m == 0


def _fully_sharded(spec: P, shape: tuple, mesh) -> P:
  """spec with "data" on the largest axis of `shape` that spec leaves whole and the data
  axis divides (the spec itself for vectors, or when no axis qualifies)."""
  data = axis_size(mesh, DATA)
  axes = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  if data == 1 or len(shape) < 2:
    return spec
  free = [i for i, a in enumerate(axes) if a is None and shape[i] % data == 0]
  if not free:
    return spec
  i = max(free, key=lambda j: shape[j])
  return P(*(DATA if j == i else a for j, a in enumerate(axes)))


def layer_specs(config: Config, mesh, fsdp: bool = False) -> dict:
  """PartitionSpecs of one decoder layer's parameters (module docstring)."""
  heads = MODEL if heads_sharded(config, mesh) else None
  kv = MODEL if kv_sharded(config, mesh) else None
  ffn = MODEL if ffn_sharded(config, mesh) else None
  specs = {name: P(None) for name in NORMS}
  specs.update(q=P(None, heads, None), k=P(None, kv, None), v=P(None, kv, None),
               o=P(heads, None, None), gate=P(None, ffn), up=P(None, ffn), down=P(ffn, None))
  if config.qk_norm:
    specs.update(q_norm=P(None), k_norm=P(None))
  if fsdp:
    shapes = layer_shapes(config)
    specs = {k: _fully_sharded(s, shapes[k], mesh) for k, s in specs.items()}
  return specs


def embed_spec(config: Config, mesh, fsdp: bool = False) -> P:
  spec = P(None, None)
  return _fully_sharded(spec, (config.vocab_size, config.d_model), mesh) if fsdp else spec


def param_specs(config: Config, mesh, fsdp: bool = False) -> dict:
  """A PartitionSpec for every parameter, in the parameter pytree's structure (see the
  module docstring for the choices; fsdp=True also splits the matrices over "data")."""
  return {"embed": embed_spec(config, mesh, fsdp), "final_norm": P(None),
          "layers": [layer_specs(config, mesh, fsdp) for _ in range(config.n_layers)]}


def _dense(x) -> bool:
  return isinstance(x, jax.Array) or hasattr(x, "aval")


def gather_layer(p: dict, config: Config, mesh) -> dict:
  """A layer's parameters constrained to the tensor-parallel specs, where they are used:
  with fsdp-placed parameters, the all-gather over "data" of that layer's weights (and in
  the backward pass, the reduce-scatter of their gradients); otherwise a no-op. Quantized
  weights (generation) are left as they are."""
  if mesh is None:
    return p
  specs = layer_specs(config, mesh)
  return {k: constrain(v, mesh, *specs[k]) if k in specs and _dense(v) else v
          for k, v in p.items()}


def gather_embed(table, config: Config, mesh):
  """The embedding table at a use (lookup or output projection): replicated (see
  gather_layer)."""
  return constrain(table, mesh, *embed_spec(config, mesh))


def cache_spec(config: Config, mesh) -> P:
  """The KV cache's pools (P, page_size, K, H) or contiguous slots (B, S, K, H): the kv
  heads on "model" as the k and v projections split them (replicated where they do not)."""
  return P(None, None, MODEL if kv_sharded(config, mesh) else None, None)


def _is_spec(x) -> bool:
  return isinstance(x, P)


def param_shardings(config: Config, mesh, fsdp: bool = False) -> dict:
  """NamedShardings for every parameter (param_specs on `mesh`)."""
  mesh = auto_mesh(mesh)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(config, mesh, fsdp),
                      is_leaf=_is_spec)


def shard_params(params, config: Config, mesh, fsdp: bool = False):
  """params (or any pytree of the parameters' structure, e.g. AdamW moments) placed on
  `mesh` with param_specs."""
  return jax.device_put(params, param_shardings(config, mesh, fsdp))


def batch_sharding(mesh) -> NamedSharding:
  """(B, ...) arrays: the batch over "data", the rest replicated."""
  return NamedSharding(auto_mesh(mesh), P(batch_axis(mesh)))


def shard_batch(batch, mesh):
  """Every array of a batch (a pytree of (B, ...) arrays) split over "data"."""
  return jax.device_put(batch, batch_sharding(mesh))


def constrain(x, mesh, *spec):
  """x constrained to PartitionSpec(*spec) on `mesh` inside jit; x itself without a mesh."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(auto_mesh(mesh), P(*spec)))


def constrain_tree(tree, specs, mesh):
  """Every leaf of `tree` constrained to the spec at the same place in `specs`."""
  if mesh is None:
    return tree
  mesh = auto_mesh(mesh)
  return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
                      tree, specs)
