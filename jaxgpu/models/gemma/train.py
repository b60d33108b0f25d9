"""AdamW and a jitted training step for the Gemma model, data and tensor parallel on a Mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxgpu.models.gemma import sharding
from jaxgpu.models.gemma.config import Config
from jaxgpu.models.gemma.model import loss as model_loss

BATCH_KEYS = ("tokens", "targets", "mask", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class AdamW:
  """AdamW hyperparameters (decoupled weight decay, Loshchilov & Hutter; the update of
  torch.optim.AdamW and optax.adamw).

    mu = b1 mu + (1 - b1) g;  nu = b2 nu + (1 - b2) g^2;  t = step + 1
    p -= lr * (mu / (1 - b1^t) / (sqrt(nu / (1 - b2^t)) + eps) + weight_decay * p)

  Weight decay applies to the matrices and the embedding, not to the norm weights (vectors;
  Gemma's norms scale by 1 + w, so decaying w would pull every scale toward 1). With
  clip_norm, the gradients are first scaled by min(1, clip_norm / global L2 norm).
  learning_rate is a float or a schedule: a function of the int32 step (0 for the first
  update) returning a float32 scalar. Hashable (a static argument of train_step).
  """

  learning_rate: float | Callable = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  clip_norm: float | None = None

  def lr(self, step):
    if callable(self.learning_rate):
      return jnp.asarray(self.learning_rate(step), jnp.float32)
    return jnp.float32(self.learning_rate)


def init_opt_state(params) -> dict:
  """{"step": int32 0, "mu": float32 zeros like params, "nu": the same}. Each moment
  takes its parameter's sharding (zeros_like keeps it)."""
  zeros = lambda p: jnp.zeros_like(p, dtype=jnp.float32)
  return {"step": jnp.zeros((), jnp.int32), "mu": jax.tree.map(zeros, params),
          "nu": jax.tree.map(zeros, params)}


def opt_state_specs(config: Config, mesh, fsdp: bool = False) -> dict:
  """PartitionSpecs of the optimizer state: the moments as their parameters."""
  specs = sharding.param_specs(config, mesh, fsdp)
  return {"step": P(), "mu": specs, "nu": specs}


def global_norm(tree):
  """The L2 norm of every leaf together, float32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree)))


def adamw_update(params, grads, opt_state, optimizer: AdamW):
  """One AdamW step: (new params in their dtype, new opt_state, {"grad_norm", "lr"}).
  The moments and the update are float32 whatever the parameters' dtype."""
  step = opt_state["step"]
  norm = global_norm(grads)
  scale = jnp.float32(1.0)
  if optimizer.clip_norm is not None:
    scale = jnp.minimum(1.0, optimizer.clip_norm / jnp.maximum(norm, 1e-30))
  lr = optimizer.lr(step)
  t = (step + 1).astype(jnp.float32)
  c1 = 1.0 - optimizer.b1 ** t
  c2 = 1.0 - optimizer.b2 ** t

  def leaf(p, g, mu, nu):
    g = g.astype(jnp.float32) * scale
    mu = optimizer.b1 * mu + (1.0 - optimizer.b1) * g
    nu = optimizer.b2 * nu + (1.0 - optimizer.b2) * g * g
    update = (mu / c1) / (jnp.sqrt(nu / c2) + optimizer.eps)
    pf = p.astype(jnp.float32)
    if optimizer.weight_decay and p.ndim >= 2:
      update = update + optimizer.weight_decay * pf
    return (pf - lr * update).astype(p.dtype), mu, nu

  out = jax.tree.map(leaf, params, grads, opt_state["mu"], opt_state["nu"])
  is_triple = lambda x: isinstance(x, tuple) and len(x) == 3
  new_params = jax.tree.map(lambda x: x[0], out, is_leaf=is_triple)
  mu = jax.tree.map(lambda x: x[1], out, is_leaf=is_triple)
  nu = jax.tree.map(lambda x: x[2], out, is_leaf=is_triple)
  return new_params, {"step": step + 1, "mu": mu, "nu": nu}, {"grad_norm": norm, "lr": lr}


def compute_params(params, compute_dtype=None):
  """The parameters as the forward and backward passes use them.

  compute_dtype None: as they are. Otherwise (float32 master parameters, bfloat16 compute):
  every matrix and the embedding cast to compute_dtype at use, and the norm weights (the
  vectors) left as they are: jaxgpu's norms take float32 scales beside 16-bit activations,
  so their gradients are summed and returned in float32, never rounded to 16 bits. The
  activations take the embedding's dtype, compute_dtype. Gradients flow back through the
  casts into the parameters' dtype.
  """
  if compute_dtype is None:
    return params
  dtype = jnp.dtype(compute_dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"compute_dtype: expected a float dtype, got {dtype}")
  return jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 else p, params)


def _check_batch(batch):
  if not isinstance(batch, dict) or "tokens" not in batch or "targets" not in batch:
    raise ValueError("batch: expected a dict with 'tokens' and 'targets' (and optionally "
                     "'mask', 'positions', 'segment_ids')")
  extra = set(batch) - set(BATCH_KEYS)
  if extra:
    raise ValueError(f"batch: unexpected keys {sorted(extra)}; expected some of {BATCH_KEYS}")


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "implementation", "mesh",
                                             "remat", "fsdp", "compute_dtype"),
                   donate_argnums=(0, 1))
def train_step(params, opt_state, batch, *, config: Config, optimizer: AdamW = AdamW(),
               implementation=None, mesh=None, remat: bool = False, fsdp: bool = False,
               compute_dtype=None):
  """One training step: loss, gradients, AdamW. Jitted; params and opt_state are donated
  (their buffers are reused for the new ones: do not use the arguments afterwards).

  Args:
    params: the parameter pytree; opt_state: from init_opt_state.
    batch: {"tokens": (B, T) int32, "targets": (B, T) int32, and optionally "mask" (B, T)
      bool, "positions" (B, T) int32, "segment_ids" (B, T) int32} (see model.loss).
    config: the model (static). optimizer: AdamW hyperparameters (static).
    implementation: None (jaxgpu kernels) or 'xla' (static).
    mesh: a Mesh with axes ("data", "model") or None (static). With a mesh, the batch is
      constrained to "data", the parameters, gradients and moments to param_specs, and the
      activations as in sharding.py: data and tensor parallelism. Place the inputs with
      shard_params / shard_batch (and init_opt_state of the placed params) to avoid a
      relayout on entry.
    remat: recompute each layer's activations in the backward pass (static).
    fsdp: fully sharded data parallelism (static): parameters, gradients and moments also
      split over "data" (sharding.py; place them with shard_params(..., fsdp=True)).
    compute_dtype: None (compute in the parameters' dtype), or e.g. jnp.bfloat16 with
      float32 parameters (static): mixed precision with float32 master weights. The
      parameters, their gradients and the AdamW moments stay float32; the forward and
      backward passes run in compute_dtype, the matrices cast at use and the norm weights
      given to the norms as float32 (compute_params).

  Returns:
    (params, opt_state, {"loss": float32 loss before the update, "grad_norm": the global
    gradient norm before clipping, "lr": the learning rate used}).
  """
  _check_batch(batch)
  specs = sharding.param_specs(config, mesh, fsdp)
  batch = {k: sharding.constrain(v, mesh, sharding.batch_axis(mesh)) for k, v in batch.items()}
  params = sharding.constrain_tree(params, specs, mesh)

  def objective(p):
    return model_loss(compute_params(p, compute_dtype), config, batch["tokens"],
                      batch["targets"], mask=batch.get("mask"), positions=batch.get("positions"),
                      segment_ids=batch.get("segment_ids"), implementation=implementation,
                      mesh=mesh, remat=remat)

  value, grads = jax.value_and_grad(objective)(params)
  grads = sharding.constrain_tree(grads, specs, mesh)
  params, opt_state, metrics = adamw_update(params, grads, opt_state, optimizer)
  params = sharding.constrain_tree(params, specs, mesh)
  opt_state = sharding.constrain_tree(opt_state, opt_state_specs(config, mesh, fsdp), mesh)
  return params, opt_state, {"loss": value, **metrics}
