"""Benchmark the activation family: swiglu and geglu (gated units), gelu and silu.

    python3 benchmarks/bench_activation.py                 # GPU: cuda vs xla, writes results/
    python3 benchmarks/bench_activation.py --out $OUT      # also writes $OUT/<gpu>.json, RESULTS.md
    python3 benchmarks/bench_activation.py --quick --no-write   # CPU smoke test: cpu vs xla

Every case is timed for each implementation in the same run; the anchor is 'xla', the
pure-JAX reference (jax.nn in float32, jaxgpu/reference/activation.py) fused by XLA and
differentiated by plain autodiff.

Forward+backward is a training step's two passes, kept apart as in a model (between them
the rest of the network runs): an optimization barrier orders the backward pass after the
forward output. Without it XLA may merge the anchor's forward and backward into one
fusion that reads gate, up and the cotangent once (6N instead of 8N below), which cannot
happen in a model; the case "<op> (one program)" measures that unseparated form too, so
the effect is visible rather than hidden.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from benchlib import inputs  # noqa: E402
from benchlib import record  # noqa: E402

FAMILY = "activation"
ANCHOR = "xla"
DTYPE = "bfloat16"
# (rows, d_ff): a 70B-class MLP's intermediate size (Llama 3 70B: 28672) at 8192 tokens.
# One (8192, 28672) bf16 tensor is 470 MB (9x the 50 MB L2): no rotation needed.
SHAPES = [(8192, 28672)]
QUICK_SHAPES = [(256, 1024)]
TARGET_SHAPE = (8192, 28672)
# The targets for the gated units, bf16 (8192, 28672) on the H100. (Anchor measured
# on this H100 when the issue was filed: XLA SwiGLU forward 3.01 TB/s.)
TARGET_FWD_VS_XLA = 1.0
TARGET_FWD_BWD_VS_XLA = 1.3

# name -> (jaxgpu op, gated, approximate or None)
OPS = {
    "swiglu": ("swiglu", True, None),
    "geglu": ("geglu", True, True),            # Gemma: the tanh form
    "geglu_erf": ("geglu", True, False),
    "gelu": ("gelu", False, True),
    "gelu_erf": ("gelu", False, False),
    "silu": ("silu", False, None),
}
ONE_PROGRAM = ("swiglu",)  # also measured without the barrier (see the module docstring)


def _op_fn(name: str, impl: str):
    import jaxgpu

    op, _, approximate = OPS[name]
    kw = {} if approximate is None else {"approximate": approximate}
    return functools.partial(getattr(jaxgpu, op), implementation=impl, **kw)


def make_fwd(name: str, impl: str):
    import jax

    return jax.jit(_op_fn(name, impl))


def make_fwd_bwd(name: str, impl: str, separated: bool = True):
    """Forward + backward through jax.vjp with a random cotangent, returning the forward
    output too (a training step uses it; without it XLA drops the anchor's forward as dead
    code). `separated`: the backward pass waits for the forward output (a barrier), as in a
    model."""
    import jax

    fn = _op_fn(name, impl)

    def step(*args):
        *inputs, ct = args
        out, pull = jax.vjp(fn, *inputs)
        if separated:
            out, ct = jax.lax.optimization_barrier((out, ct))
        return (out,) + tuple(pull(ct))

    return jax.jit(step)


def bytes_moved(rows: int, cols: int, itemsize: int, gated: bool, pass_: str) -> int:
    """Bytes that must cross HBM per call, each input read once and each output written once.

    N = rows * cols * itemsize (470 MB for (8192, 28672) bf16).
      gated   forward:   read gate, up; write y                           3N
              backward:  read gate, up, dy; write dgate, dup              5N
              forward+backward                                            8N
      unary   forward:   read x; write y                                  2N
              backward:  read x, dy; write dx                             3N
              forward+backward                                            5N
    XLA's gradient may recompute the activation or save float32 residuals: what it does
    beyond this is its own cost, not counted as useful bytes.
    """
    n = rows * cols * itemsize
    fwd, bwd = (3 * n, 5 * n) if gated else (2 * n, 3 * n)
    return fwd if pass_ == "fwd" else fwd + bwd


def make_inputs(key, rows: int, cols: int, dtype, gated: bool, pass_: str):
    """(x,) or (gate, up), then the cotangent for fwd+bwd: random, never zeros. gate/x
    ~ N(0, 2): both tails of the activation are reached."""
    import jax

    kx, ku, kc = jax.random.split(key, 3)
    args = [inputs.random_array(kx, (rows, cols), dtype, scale=2.0)]
    if gated:
        args.append(inputs.random_array(ku, (rows, cols), dtype))
    if pass_ != "fwd":
        args.append(inputs.random_array(kc, (rows, cols), dtype))
    return tuple(args)


def run(bench: harness.Bench) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxgpu  # noqa: F401  (fail here, once, rather than in every case)

    impls = harness.default_implementations(bench.args)
    dtype = jnp.dtype(DTYPE)
    itemsize = np.dtype(dtype).itemsize
    shapes = harness.case_shapes(bench, SHAPES, QUICK_SHAPES)
    max_copies = 2 if bench.quick else None
    key = jax.random.PRNGKey(0)
    for rows, cols in shapes:
        case = f"{rows}x{cols}"
        for name, (_, gated, _) in OPS.items():
            variants = [("fwd", True), ("fwd+bwd", True)]
            if name in ONE_PROGRAM:
                variants.append(("fwd+bwd", False))
            for pass_, separated in variants:
                key, sub = jax.random.split(key)
                nbytes = bytes_moved(rows, cols, itemsize, gated, pass_)
                one = functools.partial(make_inputs, rows=rows, cols=cols, dtype=dtype,
                                        gated=gated, pass_=pass_)
                set_bytes = inputs.tree_nbytes(jax.eval_shape(one, sub))
                arg_sets = inputs.make_arg_sets(one, sub, set_bytes, bench.l2_bytes,
                                                 max_copies=max_copies)
                if pass_ == "fwd":
                    fns = {impl: make_fwd(name, impl) for impl in impls}
                else:
                    fns = {impl: make_fwd_bwd(name, impl, separated) for impl in impls}
                label = name if separated else f"{name} (one program)"
                recs = bench.run_case(op=label, case=case, pass_=pass_, shape=(rows, cols),
                                      dtype=dtype, fns=fns, arg_sets=arg_sets,
                                      anchor=ANCHOR if ANCHOR in impls else None,
                                      bytes_moved=nbytes)
                if (rows, cols) == TARGET_SHAPE and gated and separated:
                    # the targets: the gated units at (8192, 28672)
                    harness.mark_targets(bench, recs, pass_, fwd_vs=TARGET_FWD_VS_XLA,
                                         fwd_bwd_vs=TARGET_FWD_BWD_VS_XLA, baselines=(ANCHOR,))
                for r in recs:
                    print(f"  {label:<22} {case:<12} {pass_:<8} {r.implementation:<5} "
                          f"{r.time_us:9.1f} us {record.fmt(r.gbs, '7.0f')} GB/s "
                          f"{record.fmt(r.vs_anchor, '.2f')}x", flush=True)
                del arg_sets, fns


if __name__ == "__main__":
    sys.exit(harness.main(FAMILY, run, description=__doc__.splitlines()[0]))
