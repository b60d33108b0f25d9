"""Benchmark linear_cross_entropy: the LM head (x @ w.T and the cross-entropy) without its logits.

    python3 benchmarks/bench_linear_cross_entropy.py                 # GPU: writes results/
    python3 benchmarks/bench_linear_cross_entropy.py --out $OUT      # also $OUT/<gpu>.json
    python3 benchmarks/bench_linear_cross_entropy.py --quick --no-write   # CPU smoke test

Implementations, each timed in the same run on the same inputs (bf16 x (N, D) and the tied
embedding w (V, D), labels uniform):
  cuda  jaxgpu.linear_cross_entropy (vocabulary chunks, no logits kept)
  xla   the anchor: what a JAX user writes, x @ w.T in bf16 then the pure-JAX cross-entropy,
        fused and differentiated by XLA (it keeps the (N, V) logits and their gradient)
  ce    x @ w.T by XLA, then jaxgpu.cross_entropy on the materialized logits
  gemm  x @ w.T alone (forward) or with its two backward products (fwd+bwd): the plain
        GEMM rate of this shape in this run, the ceiling a head that keeps the logits
        could reach
TFLOP/s counts 2 N D V forward and 6 N D V forward + backward (what the math needs; jaxgpu
also recomputes the logits, 2 N D V more, which is not counted). Each case's peak memory is
XLA's plan of its executable (temporaries, and arguments + outputs + temporaries), printed
and stored under the family's "memory" key.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from bench_cross_entropy import memory_of  # noqa: E402
from benchlib import inputs  # noqa: E402
from benchlib import record  # noqa: E402

FAMILY = "linear_cross_entropy"
ANCHOR = "xla"
DTYPE = "bfloat16"
# (tokens, D, V): Gemma 2 2B's head (D 2304, V 262144) and a Llama-3-sized one (D 3072,
# V 128256), at 8192 and 16384 tokens.
SHAPES = [(8192, 2304, 262144), (16384, 2304, 262144), (8192, 3072, 128256),
          (16384, 3072, 128256)]
QUICK_SHAPES = [(64, 32, 4097)]
TARGET_SHAPE = (8192, 2304, 262144)
TARGET_FWD_BWD_VS_XLA = 1 / 1.1   # time <= 1.1x XLA's
TARGET_TEMP_BYTES = 0.75 * 2**30  # <= 1/16 of XLA's 12 GiB


def _loss(impl: str, x, w, labels):
  import jax.numpy as jnp

  import jaxgpu

  if impl == "gemm":
    return jnp.sum(jnp.einsum("nd,vd->nv", x, w).astype(jnp.float32)[:, :1])
  if impl == "ce":
    return jaxgpu.cross_entropy(jnp.einsum("nd,vd->nv", x, w), labels)
  return jaxgpu.linear_cross_entropy(x, w, labels, implementation=impl)


def _gemm_fwd(x, w, labels):
  import jax.numpy as jnp

  return jnp.einsum("nd,vd->nv", x, w)


def _gemm_fwd_bwd(x, w, labels):
  """The head's three products: logits, and with a cotangent of the logits' shape (here the
  logits themselves, so that nothing is dead code) dx and dw."""
  import jax.numpy as jnp

  z = jnp.einsum("nd,vd->nv", x, w)
  return jnp.einsum("nv,vd->nd", z, w), jnp.einsum("nv,nd->vd", z, x)


def make_fn(impl: str, pass_: str):
  import jax

  if impl == "gemm":
    return jax.jit(_gemm_fwd if pass_ == "fwd" else _gemm_fwd_bwd)
  loss = functools.partial(_loss, impl)
  if pass_ == "fwd":
    return jax.jit(loss)
  return jax.jit(jax.value_and_grad(loss, (0, 1)))


def make_inputs(key, n: int, d: int, v: int, dtype):
  import jax
  import jax.numpy as jnp

  kx, kw, kl = jax.random.split(key, 3)
  x = inputs.random_array(kx, (n, d), dtype, scale=1.0)
  w = inputs.random_array(kw, (v, d), dtype, scale=float(d) ** -0.5 * 2)
  return x, w, jax.random.randint(kl, (n,), 0, v, jnp.int32)


def run(bench: harness.Bench) -> None:
  import jax
  import jax.numpy as jnp

  import jaxgpu  # noqa: F401

  impls = harness.default_implementations(bench.args)
  impls = tuple(impls) + ("ce", "gemm")
  dtype = jnp.dtype(DTYPE)
  shapes = harness.case_shapes(bench, SHAPES, QUICK_SHAPES)
  memory = bench.meta.setdefault("memory", [])
  key = jax.random.PRNGKey(0)
  for n, d, v in shapes:
    case = f"{n}x{d}x{v}"
    key, sub = jax.random.split(key)
    # One input set: x and w are far past L2 (w alone is 1.2 GB at 262144 x 2304).
    arg_sets = [make_inputs(sub, n, d, v, dtype)]
    for pass_ in ("fwd", "fwd+bwd"):
      flops = (2 if pass_ == "fwd" else 6) * n * d * v
      fns = {impl: make_fn(impl, pass_) for impl in impls}
      recs = bench.run_case(op="lm_head", case=case, pass_=pass_, shape=(n, d, v), dtype=dtype,
                            fns=fns, arg_sets=arg_sets,
                            anchor=ANCHOR if ANCHOR in impls else None, flops=flops)
      mems = {}
      for r in recs:
        mem = memory_of(fns[r.implementation], arg_sets[0])
        if mem is not None:
          mems[r.implementation] = mem
          memory.append({"case": case, "pass": pass_, "implementation": r.implementation,
                         **mem})
          r.notes = (f"temporaries {mem['temp_bytes'] / 2**30:.2f} GiB, peak "
                     f"{mem['total_bytes'] / 2**30:.2f} GiB")
        print(f"  lm_head {case:<18} {pass_:<8} {r.implementation:<5} {r.time_us:10.1f} us "
              f"{record.fmt(r.tflops, '6.0f')} TFLOP/s {record.fmt(r.vs_anchor, '.2f')}x  "
              f"{r.notes or ''}", flush=True)
      if (n, d, v) == TARGET_SHAPE and pass_ == "fwd+bwd":
        for r in recs:
          if r.implementation not in ("cuda", "cpu"):
            continue
          temp = mems.get(r.implementation, {}).get("temp_bytes")
          r.target = "time <= 1.1x XLA's, temporaries <= 0.75 GiB"
          r.target_met = bool(r.vs_anchor and r.vs_anchor >= TARGET_FWD_BWD_VS_XLA
                              and temp is not None and temp <= TARGET_TEMP_BYTES)
      del fns
    del arg_sets


if __name__ == "__main__":
  sys.exit(harness.main(FAMILY, run, description=__doc__.splitlines()[0]))
