"""Benchmark the norm family: rms_norm and layer_norm, with and without a fused residual.

    python3 benchmarks/bench_norm.py                 # GPU: cuda vs xla, writes results/
    python3 benchmarks/bench_norm.py --out $OUT      # also writes $OUT/<gpu>.json, RESULTS.md
    python3 benchmarks/bench_norm.py --quick --no-write   # CPU smoke test: cpu vs xla

Every case is timed for each implementation in the same run; the anchor is 'xla', the
pure-JAX reference fused by XLA, differentiated by plain autodiff.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from benchlib import inputs  # noqa: E402
from benchlib import record  # noqa: E402

FAMILY = "norm"
ANCHOR = "xla"
DTYPE = "bfloat16"
# (rows, hidden): rows = batch * sequence.  8192 is a 70B-class model's hidden size, 4096 and
# 2048 smaller models'; (4096, 4096) is a 32 MiB input, so it is rotated past the 50 MB L2.
SHAPES = [(16384, 8192), (4096, 4096), (32768, 2048)]
QUICK_SHAPES = [(64, 512), (256, 128)]
TARGET_SHAPE = (16384, 8192)
# The targets, for (16384, 8192) bf16 on the H100.
TARGET_FWD_VS_XLA = 1.0
TARGET_RES_RMS_FWD_VS_XLA = 1.2
TARGET_FWD_BWD_VS_XLA = 1.4

OPS = {
    # op name -> number of (hidden,) parameters: rms_norm has weight, layer_norm weight + bias
    "rms_norm": 1,
    "layer_norm": 2,
}


def _apply(op: str, impl: str, x, params, residual):
    import jaxgpu

    if op == "rms_norm":
        (w,) = params
        return jaxgpu.rms_norm(x, w, residual=residual, implementation=impl)
    w, b = params
    return jaxgpu.layer_norm(x, w, b, residual=residual, implementation=impl)


def make_fwd(op: str, impl: str):
    import jax

    return jax.jit(functools.partial(_apply, op, impl))


def make_fwd_bwd(op: str, impl: str, residual: bool):
    """Forward + backward through jax.vjp with a random cotangent (for y and h), so the
    backward does the real work a training step does.

    Returns the primal outputs too: a training step uses y, and without it XLA would drop the
    anchor's forward normalization as dead code.  The gradient wrt the residual is the same
    value as dx (h = x + residual) and is not returned: returning both would add a copy kernel
    to both implementations that a real model, which sums them into one stream, does not do.
    """
    import jax

    def step(x, params, r, ct):
        if residual:
            out, vjp = jax.vjp(lambda x_, p_, r_: _apply(op, impl, x_, p_, r_), x, params, r)
            dx, dparams, _ = vjp(ct)
        else:
            out, vjp = jax.vjp(lambda x_, p_: _apply(op, impl, x_, p_, None), x, params)
            dx, dparams = vjp(ct)
        return out, dx, dparams

    return jax.jit(step)


def bytes_moved(rows: int, hidden: int, itemsize: int, n_params: int, residual: bool,
                pass_: str) -> int:
    """Bytes that must cross HBM per call, each input read once and each output written once.

    N = rows * hidden * itemsize (256 MiB for (16384, 8192) bf16); P = hidden * itemsize.
      forward:          read x (+ residual), write y (+ h)              2N (4N with residual)
      backward:         read dy (+ dh), read x (or h), write dx         3N (4N with residual)
                        (dresidual is the same values as dx: counted once)
      forward+backward: their sum                                       5N (8N with residual)
    Parameters (weight, bias: P each, read in both passes, gradients written once) and the
    per-row statistics the forward saves (rows * 4 bytes, 64 KiB) add well under 0.1%, but the
    parameters are counted since they are cheap to count.
    """
    n = rows * hidden * itemsize
    p = hidden * itemsize * n_params
    fwd = (4 if residual else 2) * n + p
    if pass_ == "fwd":
        return fwd
    bwd = (4 if residual else 3) * n + 2 * p  # params read + their gradients written
    return fwd + bwd


def make_inputs(key, rows: int, hidden: int, dtype, n_params: int, residual: bool,
                pass_: str):
    """One input tuple (x, params, residual, [cotangent]): random, never zeros."""
    import jax

    kx, kp, kr, kc1, kc2 = jax.random.split(key, 5)
    x = inputs.random_array(kx, (rows, hidden), dtype)
    pkeys = jax.random.split(kp, n_params)
    # weight ~ N(1, 0.1) as after training; bias ~ N(0, 0.1)
    params = tuple(
        inputs.random_array(k, (hidden,), dtype, scale=0.1, offset=1.0 if i == 0 else 0.0)
        for i, k in enumerate(pkeys))
    r = inputs.random_array(kr, (rows, hidden), dtype) if residual else None
    if pass_ == "fwd":
        return (x, params, r)
    dy = inputs.random_array(kc1, (rows, hidden), dtype)
    ct = (dy, inputs.random_array(kc2, (rows, hidden), dtype)) if residual else dy
    return (x, params, r, ct)


def attach_targets(bench: harness.Bench, records, op: str, residual: bool, pass_: str) -> None:
    """The issue's targets on the (16384, 8192) cases; residual + rms_norm forward: 1.2x."""
    fwd_vs = TARGET_RES_RMS_FWD_VS_XLA if (op == "rms_norm" and residual) else TARGET_FWD_VS_XLA
    harness.mark_targets(bench, records, pass_, fwd_vs=fwd_vs, fwd_bwd_vs=TARGET_FWD_BWD_VS_XLA,
                         baselines=(ANCHOR,))


def run(bench: harness.Bench) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxgpu  # noqa: F401  (fail here, once, rather than in every case)

    impls = harness.default_implementations(bench.args)
    dtype = jnp.dtype(DTYPE)
    itemsize = np.dtype(dtype).itemsize
    shapes = harness.case_shapes(bench, SHAPES, QUICK_SHAPES)
    # Tiny quick shapes would need thousands of copies to exceed L2; the smoke test needs two.
    max_copies = 2 if bench.quick else None
    key = jax.random.PRNGKey(0)
    for rows, hidden in shapes:
        case = f"{rows}x{hidden}"
        for op, n_params in OPS.items():
            for residual in (False, True):
                for pass_ in ("fwd", "fwd+bwd"):
                    key, sub = jax.random.split(key)
                    nbytes = bytes_moved(rows, hidden, itemsize, n_params, residual, pass_)
                    one = functools.partial(make_inputs, rows=rows, hidden=hidden, dtype=dtype,
                                            n_params=n_params, residual=residual, pass_=pass_)
                    # the rotated inputs are what each call reads: x (+ residual, cotangents)
                    set_bytes = inputs.tree_nbytes(jax.eval_shape(one, sub))
                    arg_sets = inputs.make_arg_sets(one, sub, set_bytes, bench.l2_bytes,
                                                     max_copies=max_copies)
                    if pass_ == "fwd":
                        fns = {impl: make_fwd(op, impl) for impl in impls}
                    else:
                        fns = {impl: make_fwd_bwd(op, impl, residual) for impl in impls}
                    name = op + ("+res" if residual else "")
                    recs = bench.run_case(op=name, case=case, pass_=pass_, shape=(rows, hidden),
                                          dtype=dtype, fns=fns, arg_sets=arg_sets,
                                          anchor=ANCHOR if ANCHOR in impls else None,
                                          bytes_moved=nbytes)
                    if (rows, hidden) == TARGET_SHAPE:
                        attach_targets(bench, recs, op, residual, pass_)
                    for r in recs:
                        print(f"  {name:<16} {case:<12} {pass_:<8} {r.implementation:<5} "
                              f"{r.time_us:9.1f} us {record.fmt(r.gbs, '7.0f')} GB/s "
                              f"{record.fmt(r.vs_anchor, '.2f')}x", flush=True)
                    del arg_sets, fns


if __name__ == "__main__":
    sys.exit(harness.main(FAMILY, run, description=__doc__.splitlines()[0]))
