"""Benchmark the RoPE family: rope forward and forward+backward, half and interleaved.

    python3 benchmarks/bench_rope.py                 # GPU: cuda vs xla, writes results/
    python3 benchmarks/bench_rope.py --out $OUT      # also writes $OUT/<gpu>.json, RESULTS.md
    python3 benchmarks/bench_rope.py --sweep         # then the target case per knob setting
    python3 benchmarks/bench_rope.py --quick --no-write   # CPU smoke test: cpu vs xla

Every case is timed for each implementation in the same run; the anchor is 'xla', the
pure-JAX reference (jaxgpu/reference/rope.py: exact integer angles) fused by XLA and
differentiated by plain autodiff. 'xla-f32' is the usual float32-angle formula (Hugging
Face style, inaccurate at long context), timed for reference only: it shows what the
anchor's accurate angles cost XLA, if anything.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from benchlib import inputs  # noqa: E402
from benchlib import record  # noqa: E402

FAMILY = "rope"
ANCHOR = "xla"
NAIVE = "xla-f32"
DTYPE = "bfloat16"
# q of a Llama-class model: (batch, sequence, heads, head_dim), positions (batch, sequence).
# (case name, x shape, layout, rotary_dim, positions shared by the batch)
CASES = [
    ("q-half", (8, 4096, 32, 128), "half", None, False),
    ("q-interleaved", (8, 4096, 32, 128), "interleaved", None, False),
    ("q-half-sharedpos", (8, 4096, 32, 128), "half", None, True),
    ("k-gqa8-half", (8, 4096, 8, 128), "half", None, False),
    ("neox-partial", (8, 2048, 32, 128), "half", 32, False),
]
QUICK_CASES = [
    ("q-half", (2, 64, 4, 64), "half", None, False),
    ("q-interleaved", (2, 64, 4, 64), "interleaved", None, True),
]
TARGET_CASE = "q-half"
# The issue's targets, for (8, 4096, 32, 128) bf16 on the H100 (XLA anchor there: 2.77 TB/s).
TARGET_FWD_VS_XLA = 1.0
TARGET_FWD_BWD_VS_XLA = 1.3
# --sweep: (heads_per_thread, unroll) settings of the CUDA kernel's developer knob
# JAXGPU_ROPE_TUNE (ffi/common/dev_knobs.h: a build with JAXGPU_DEV_KNOBS=ON), each timed in
# its own process (the kernel reads the knob once per process).
SWEEP = [(4, 4), (8, 2), (8, 8), (16, 4), (32, 2), (32, 4), (32, 8), (2, 2), (1, 1)]
MAX_POSITION = 1 << 20  # positions up to ~10^6: long context, where the angles matter


def naive_rope(x, positions, theta=10000.0, layout="half", rotary_dim=None):
    """The common float32-angle RoPE (inaccurate past ~10^4): timing reference only."""
    import jax.numpy as jnp

    r = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = theta ** (-jnp.arange(0, r, 2, dtype=jnp.float32) / r)
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
    xr = x[..., :r].astype(jnp.float32)
    if layout == "half":
        a, b = xr[..., : r // 2], xr[..., r // 2:]
        y = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        y = jnp.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(xr.shape)
    return jnp.concatenate([y.astype(x.dtype), x[..., r:]], -1)


def _apply(impl: str, layout: str, rotary_dim, x, positions):
    import jaxgpu

    if impl == NAIVE:
        return naive_rope(x, positions, layout=layout, rotary_dim=rotary_dim)
    return jaxgpu.rope(x, positions, layout=layout, rotary_dim=rotary_dim,
                       implementation=impl)


def make_fn(impl: str, layout: str, rotary_dim, pass_: str):
    """fwd: y = rope(x, p). fwd+bwd: (y, dx) through jax.vjp with a random cotangent; y is
    returned too (a training step uses it, and XLA would otherwise drop the anchor's
    forward as dead code)."""
    import jax

    f = functools.partial(_apply, impl, layout, rotary_dim)
    if pass_ == "fwd":
        return jax.jit(f)

    def step(x, positions, dy):
        y, vjp = jax.vjp(lambda x_: f(x_, positions), x)
        return y, vjp(dy)[0]

    return jax.jit(step)


def bytes_moved(shape, itemsize: int, shared: bool, pass_: str) -> int:
    """Bytes that must cross HBM per call, each input read once and each output written once.

    N = B*T*H*D*itemsize (256 MiB for (8, 4096, 32, 128) bf16); positions 4*B*T (128 KiB;
    4*T when shared).
      forward:          read x and positions, write y               2N + pos
      backward:         read dy and positions, write dx             2N + pos
      forward+backward: their sum                                   4N + 2 pos
    No cos/sin tables: the kernels compute angles from positions; the anchor's angle
    tensors (B, T, D/2) float32, if XLA materializes them, are its own extra traffic.
    """
    n = 1
    for d in shape:
        n *= d
    n *= itemsize
    pos = 4 * (shape[1] if shared else shape[0] * shape[1])
    fwd = 2 * n + pos
    return fwd if pass_ == "fwd" else 2 * fwd


def make_inputs(key, shape, dtype, shared: bool, pass_: str):
    """One input tuple (x, positions[, dy]): random, never zeros."""
    import jax
    import jax.numpy as jnp

    kx, kp, kc = jax.random.split(key, 3)
    x = inputs.random_array(kx, shape, dtype)
    pshape = (shape[1],) if shared else shape[:2]
    positions = jax.random.randint(kp, pshape, 0, MAX_POSITION, jnp.int32)
    if pass_ == "fwd":
        return (x, positions)
    return (x, positions, inputs.random_array(kc, shape, dtype))


def _sweep(bench: harness.Bench) -> None:
    """The target case's CUDA kernel at each SWEEP setting of JAXGPU_ROPE_TUNE, one process
    each (this script with --impl cuda --no-write), after the default run."""
    import subprocess

    from jaxgpu import _ffi

    module = _ffi.cuda_module() if _ffi.has_cuda_backend() else None
    if module is None or not module.dev_knobs():
        print("--sweep: needs the CUDA module built with the developer knobs "
              "(JAXGPU_DEV_KNOBS=ON pip install ...)", file=sys.stderr)
        return
    for hpt, unroll in SWEEP:
        env = dict(os.environ, JAXGPU_ROPE_TUNE=f"{hpt},{unroll}", JAXGPU_BENCH_CASES=TARGET_CASE)
        print(f"== JAXGPU_ROPE_TUNE={hpt},{unroll}", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--impl", "cuda", "--no-write"]
        if bench.quick:
            cmd.append("--quick")
        subprocess.run(cmd, env=env, check=False)


def run(bench: harness.Bench) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxgpu  # noqa: F401  (fail here, once, rather than in every case)

    impls = list(harness.default_implementations(bench.args))
    if ANCHOR in impls and NAIVE not in impls:
        impls.append(NAIVE)
    dtype = jnp.dtype(DTYPE)
    itemsize = np.dtype(dtype).itemsize
    cases = QUICK_CASES if bench.quick else CASES
    if os.environ.get("JAXGPU_BENCH_CASES"):  # e.g. "q-half,k-gqa8-half" for tuning runs
        wanted = set(os.environ["JAXGPU_BENCH_CASES"].split(","))
        cases = [c for c in cases if c[0] in wanted]
    max_copies = 2 if bench.quick else None
    key = jax.random.PRNGKey(0)
    for name, shape, layout, rotary_dim, shared in cases:
        for pass_ in ("fwd", "fwd+bwd"):
            key, sub = jax.random.split(key)
            one = functools.partial(make_inputs, shape=shape, dtype=dtype, shared=shared,
                                    pass_=pass_)
            set_bytes = inputs.tree_nbytes(jax.eval_shape(one, sub))
            arg_sets = inputs.make_arg_sets(one, sub, set_bytes, bench.l2_bytes,
                                             max_copies=max_copies)
            fns = {impl: make_fn(impl, layout, rotary_dim, pass_) for impl in impls}
            recs = bench.run_case(op="rope", case=name, pass_=pass_, shape=shape, dtype=dtype,
                                  fns=fns, arg_sets=arg_sets,
                                  anchor=ANCHOR if ANCHOR in impls else None,
                                  bytes_moved=bytes_moved(shape, itemsize, shared, pass_))
            if name == TARGET_CASE:
                # the issue's targets; not on the float32-angle formula's record
                harness.mark_targets(bench, recs, pass_, fwd_vs=TARGET_FWD_VS_XLA,
                                     fwd_bwd_vs=TARGET_FWD_BWD_VS_XLA, baselines=(ANCHOR,),
                                     skip=(NAIVE,))
            for r in recs:
                print(f"  {name:<18} {pass_:<8} {r.implementation:<14} {r.time_us:9.1f} us "
                      f"{record.fmt(r.gbs, '7.0f')} GB/s {record.fmt(r.vs_anchor, '.2f')}x",
                      flush=True)
            del arg_sets, fns
    if bench.args.sweep:
        _sweep(bench)


def _extend(parser) -> None:
    parser.add_argument("--sweep", action="store_true",
                        help="then time the target case at each (heads_per_thread, unroll) of "
                             "SWEEP through JAXGPU_ROPE_TUNE (a JAXGPU_DEV_KNOBS build)")


if __name__ == "__main__":
    sys.exit(harness.main(FAMILY, run, description=__doc__.splitlines()[0],
                          extend_parser=_extend))
