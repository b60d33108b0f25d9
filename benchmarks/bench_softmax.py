"""Benchmark softmax: plain, causal, and with a broadcast padding mask, forward and fwd+bwd.

    python3 benchmarks/bench_softmax.py                 # GPU: cuda vs xla, writes results/
    python3 benchmarks/bench_softmax.py --out $OUT      # also writes $OUT/<gpu>.json, RESULTS.md
    python3 benchmarks/bench_softmax.py --quick --no-write   # CPU smoke test: cpu vs xla

Every case is timed for each implementation in the same run. The anchor is 'xla', the
pure-JAX reference (jaxgpu.reference.softmax.softmax, float32 statistics) fused by XLA and
differentiated by plain autodiff. 'jaxnn' is jax.nn.softmax itself on the same input (its
bf16 arithmetic and its custom_jvp backward, where= for the masks), timed alongside as the
second XLA figure users know; the issue's targets are checked against the faster of the two.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from benchlib import inputs  # noqa: E402
from benchlib import record  # noqa: E402

FAMILY = "softmax"
ANCHOR = "xla"
JAX_NN = "jaxnn"
DTYPE = "bfloat16"

# (name, x shape, is_causal, mask shape or None). (16384, 8192) is the shape (256 MiB
# of bf16 logits); (8, 16, 1024, 1024) are attention scores of 8 sequences x 16 heads, causal
# or with a per-sequence padding mask (B, 1, 1, S) that the kernel reads in place.
CASES = [
    ("softmax", (16384, 8192), False, None),
    ("softmax+causal", (8, 16, 1024, 1024), True, None),
    ("softmax+padmask", (8, 16, 1024, 1024), False, (8, 1, 1, 1024)),
]
QUICK_CASES = [
    ("softmax", (64, 512), False, None),
    ("softmax+causal", (2, 2, 64, 64), True, None),
    ("softmax+padmask", (2, 2, 64, 64), False, (2, 1, 1, 64)),
]
TARGET_CASE = "softmax"
# The targets, for (16384, 8192) bf16 on the H100 (anchor: XLA softmax 2.70 TB/s).
TARGET_FWD_VS_XLA = 1.0
TARGET_FWD_BWD_VS_XLA = 1.3


def _keep(shape, is_causal, mask):
    import jax.numpy as jnp

    keep = mask
    if is_causal:
        c = jnp.tril(jnp.ones(shape[-2:], bool))
        keep = c if keep is None else keep & c
    return keep


def _apply(impl: str, is_causal: bool, x, mask):
    import jax

    import jaxgpu

    if impl == JAX_NN:
        return jax.nn.softmax(x, axis=-1, where=_keep(x.shape, is_causal, mask))
    return jaxgpu.softmax(x, is_causal=is_causal, mask=mask, implementation=impl)


def make_fwd(impl: str, is_causal: bool):
    import jax

    return jax.jit(functools.partial(_apply, impl, is_causal))


def make_fwd_bwd(impl: str, is_causal: bool):
    """Forward + backward through jax.vjp with a random cotangent. Returns y too: a training
    step uses it, and without it XLA would drop the anchor's forward as dead code."""
    import jax

    def step(x, mask, ct):
        y, vjp = jax.vjp(lambda x_: _apply(impl, is_causal, x_, mask), x)
        (dx,) = vjp(ct)
        return y, dx

    return jax.jit(step)


def bytes_moved(x_shape, is_causal: bool, mask_shape, itemsize: int, pass_: str) -> int:
    """Bytes that must cross HBM per call, each input read once and each output written once.

    N = prod(x_shape) * itemsize (256 MiB for (16384, 8192) bf16, the same for
    (8, 16, 1024, 1024)); M = the mask's own bytes (bool: 1 byte an element; (8, 1, 1, 1024)
    is 8 KiB, since a mask broadcast over heads and queries need not be read more than once);
    K = the fraction of kept logits under the causal mask (T(T+1)/2 of T*T: 0.5005 at
    T = S = 1024), else 1: a masked-out logit need not be read, and its y is 0, so neither
    are y and dy there in the backward pass; every output element is written.
      forward:          read x (+ mask), write y                        (1 + K) N (+ M)
      backward:         read y and dy, write dx                         (1 + 2K) N
      forward+backward: their sum                                       (2 + 3K) N (+ M)
    The causal mask is computed, not read; the kernels skip the keys past each query.
    """
    import math

    n = math.prod(x_shape) * itemsize
    m = math.prod(mask_shape) if mask_shape else 0
    k = 1.0
    if is_causal:
        t, s = x_shape[-2:]
        k = sum(min(i + 1, s) for i in range(t)) / (t * s)
    fwd = (1 + k) * n + m
    return int(fwd if pass_ == "fwd" else fwd + (1 + 2 * k) * n)


def make_inputs(key, x_shape, mask_shape, dtype, pass_: str):
    """One input tuple (x, mask, [cotangent]): random, never zeros; ~10% of keys padded."""
    import jax

    kx, km, kc = jax.random.split(key, 3)
    x = inputs.random_array(kx, x_shape, dtype, scale=2.0)
    mask = None
    if mask_shape is not None:
        mask = jax.random.uniform(km, mask_shape) < 0.9
        mask = mask.at[..., 0].set(True)
    if pass_ == "fwd":
        return (x, mask)
    return (x, mask, inputs.random_array(kc, x_shape, dtype))


def run(bench: harness.Bench) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxgpu  # noqa: F401  (fail here, once, rather than in every case)

    impls = tuple(harness.default_implementations(bench.args))
    if not bench.args.impl:
        impls += (JAX_NN,)
    dtype = jnp.dtype(DTYPE)
    itemsize = np.dtype(dtype).itemsize
    cases = QUICK_CASES if bench.quick else CASES
    max_copies = 2 if bench.quick else None
    key = jax.random.PRNGKey(0)
    for name, x_shape, is_causal, mask_shape in cases:
        case = "x".join(map(str, x_shape))
        for pass_ in ("fwd", "fwd+bwd"):
            key, sub = jax.random.split(key)
            nbytes = bytes_moved(x_shape, is_causal, mask_shape, itemsize, pass_)
            one = functools.partial(make_inputs, x_shape=x_shape, mask_shape=mask_shape,
                                    dtype=dtype, pass_=pass_)
            set_bytes = inputs.tree_nbytes(jax.eval_shape(one, sub))
            arg_sets = inputs.make_arg_sets(one, sub, set_bytes, bench.l2_bytes,
                                             max_copies=max_copies)
            make = make_fwd if pass_ == "fwd" else make_fwd_bwd
            fns = {impl: make(impl, is_causal) for impl in impls}
            recs = bench.run_case(op=name, case=case, pass_=pass_, shape=x_shape, dtype=dtype,
                                  fns=fns, arg_sets=arg_sets,
                                  anchor=ANCHOR if ANCHOR in impls else None, bytes_moved=nbytes)
            if name == TARGET_CASE:
                # against the faster of our masked reference and jax.nn.softmax
                harness.mark_targets(bench, recs, pass_, fwd_vs=TARGET_FWD_VS_XLA,
                                     fwd_bwd_vs=TARGET_FWD_BWD_VS_XLA, baselines=(ANCHOR, JAX_NN))
            for r in recs:
                print(f"  {name:<16} {case:<16} {pass_:<8} {r.implementation:<5} "
                      f"{r.time_us:9.1f} us {record.fmt(r.gbs, '7.0f')} GB/s "
                      f"{record.fmt(r.vs_anchor, '.2f')}x", flush=True)
            del arg_sets, fns


if __name__ == "__main__":
    sys.exit(harness.main(FAMILY, run, description=__doc__.splitlines()[0]))
