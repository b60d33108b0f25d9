"""Benchmark dot_product_attention: TFLOP/s forward and forward+backward against cuDNN.

    python3 benchmarks/bench_attention.py                 # GPU: writes results/
    python3 benchmarks/bench_attention.py --out $OUT      # also writes $OUT/<gpu>.json, RESULTS.md
    python3 benchmarks/bench_attention.py --quick --no-write   # CPU smoke test: cpu vs xla
    python3 benchmarks/bench_attention.py --extras [--out $OUT]  # only the jax.nn-argument
                                                  # cases below (family attention_extras)

Implementations, timed in the same run on the same inputs (bf16, B*T = 16k tokens):
  cuda    jaxgpu.dot_product_attention (the kernels; 'cpu' on a CPU)
  cuda-unordered  the same with deterministic=False (forward+backward only: dQ's partial
          sums added in any order; cuDNN's backward, run with XLA's default
          xla_gpu_deterministic_ops=false, is not deterministic either)
  cudnn   jax.nn.dot_product_attention(implementation='cudnn'): the anchor (vs anchor =
          cuDNN's time / this time)
  pallas  jax.experimental.pallas.ops.gpu.attention.mha (Triton; MHA only, no GQA)
  xla     jax.nn.dot_product_attention(implementation='xla'): only at T <= 4k and H = 128
          (it materializes B*N*T*S float32 logits)
An implementation that cannot run a case (not built, out of memory, unsupported head dim
or option) is recorded as skipped, with the reason, under the family's "skipped" key in the
results JSON: it never costs the others their figures.

FLOPs (docs/design.md section 6): 4*B*T*S*N*H for the forward pass, halved under the causal
mask; the backward pass counts 2.5x the forward, so forward+backward is 3.5x.

The --extras cases (a family of their own, "attention_extras", so that running them alone
replaces no other figure), jax.nn's arguments, bf16, H = 128, N = 16:
  padded    a padded batch (B = 8, T = S = 4096, causal), half its rows at half length:
            cuda       query_seq_lengths / key_value_seq_lengths (tiles past them skipped)
            cuda-full  the same batch without lengths (every row at full length)
            cuda-valid the valid tokens alone: 4 rows at 4096 and 4 at 2048, two calls
                       (plus the slices of the inputs, ~0.1 GB of copies)
            cudnn      jax.nn with the same lengths (the anchor)
            TFLOP/s count the valid tokens' work only, for every implementation.
  bias      an ALiBi bias (1, N, T, S) bf16 (B = 8, T = S = 2048, non-causal), constant
            (no dbias); bias+mask adds a (B, 1, T, S) bool mask keeping ~90%; bias-grad
            differentiates the bias too (a learned relative bias: dbias (1, N, T, S) from
            atomics over B). cuda vs cudnn (jax.nn's bias / mask) vs xla. FLOPs as the
            plain non-causal case.

Targets (on the H100): forward >= 360 and forward+backward >= 300 TFLOP/s at H = 128,
T >= 4k. The 'attn+options' case (logit softcap, a local window and segment ids: cuDNN
has no softcap or segment ids) is an overhead probe: its window and segment ids mask
nothing, so the work equals the plain case of the same shape, and its time must stay
within 15% of that plain case's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under `python -P`

import harness  # noqa: E402
from benchlib import inputs  # noqa: E402
from benchlib import record  # noqa: E402

FAMILY = "attention"
ANCHOR = "cudnn"
DTYPE = "bfloat16"
TOKENS = 16384  # B * T

TARGET_FWD_TFLOPS = 360.0
TARGET_FWD_BWD_TFLOPS = 300.0
TARGET_OPTIONS_SLOWDOWN = 1.15

# Each pass's FLOPs in forward passes (the backward counts 2.5x the forward).
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(b: int, t: int, n: int, h: int, causal: bool, pass_: str) -> float:
    """4 B T S N H (T = S) for the forward, halved under the causal mask, times PASS_FLOPS."""
    return 4.0 * b * t * t * n * h * (0.5 if causal else 1.0) * PASS_FLOPS[pass_]


def random_inputs(key, b: int, t: int, n: int, k: int, h: int, dtype, segments: bool,
                  with_do: bool):
    """(q, k, v, q_seg, kv_seg[, do]): random normal, never zeros. Segment ids (if any) are
    one segment per sequence: they mask nothing."""
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kd = jax.random.split(key, 4)
    q = inputs.random_array(kq, (b, t, n, h), dtype)
    key_ = inputs.random_array(kk, (b, t, k, h), dtype)
    v = inputs.random_array(kv, (b, t, k, h), dtype)
    segs = (None, None)
    if segments:
        segs = (jnp.zeros((b, t), jnp.int32), jnp.zeros((b, t), jnp.int32))
    args = (q, key_, v) + segs
    return args + (inputs.random_array(kd, q.shape, dtype),) if with_do else args


def vjp_step(fn):
    """(q, k, v, q_seg, kv_seg, do) -> (o, (dq, dk, dv)) of fn(q, k, v, q_seg, kv_seg), not
    jitted; returns o too (a training step uses it, and without it XLA could drop the
    anchor's forward as dead code)."""
    import jax

    def step(q, k, v, q_seg, kv_seg, do):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, q_seg, kv_seg), q, k, v)
        return o, vjp(do)

    return step


@dataclasses.dataclass(frozen=True)
class Case:
    op: str            # the harness's op column (<= 18 characters)
    t: int             # T = S
    n: int             # query heads
    k: int             # kv heads
    h: int             # head dim
    causal: bool
    options: bool = False  # softcap + window + segment ids (masking nothing)
    tokens: int = TOKENS

    @property
    def b(self) -> int:
        return max(1, self.tokens // self.t)

    def label(self) -> str:
        return (f"b{self.b}t{self.t}n{self.n}" + (f"k{self.k}" if self.k != self.n else "")
                + f"h{self.h}" + ("-causal" if self.causal else ""))

    def flops(self, pass_: str) -> float:
        return attention_flops(self.b, self.t, self.n, self.h, self.causal, pass_)

    def kwargs(self) -> dict:
        """jaxgpu.dot_product_attention's options (segment ids are inputs)."""
        if not self.options:
            return dict(is_causal=self.causal)
        return dict(is_causal=self.causal, logit_softcap=30.0,
                    local_window_size=(self.t, self.t))

    def targeted(self) -> bool:
        return self.h == 128 and self.t >= 4096 and not self.options


# N * H = 2048 (a 2048-wide attention layer) for every head dim; GQA as Llama 3 8B (32/8).
CASES = [Case("attention", t, 16, 16, 128, c) for t in (1024, 4096, 16384) for c in (False, True)]
CASES += [Case("attention", 4096, 32, 32, 64, c) for c in (False, True)]
CASES += [Case("attention", 4096, 8, 8, 256, c) for c in (False, True)]
CASES += [Case("attention-gqa", 4096, 32, 8, 128, True),
          Case("attn+options", 4096, 16, 16, 128, False, options=True)]
QUICK_CASES = [Case("attention", 64, 2, 2, 32, False, tokens=128),
               Case("attention", 64, 2, 2, 59, True, tokens=128),
               Case("attention-gqa", 64, 4, 2, 32, True, tokens=128),
               Case("attn+options", 64, 2, 2, 32, False, options=True, tokens=128)]


def supported(impl: str, case: Case, quick: bool = False) -> str | None:
    """Why `impl` does not run `case` (None: it does)."""
    if case.options and impl in ("cudnn", "pallas", "xla"):
        return "no logit softcap / segment ids"
    if impl == "pallas" and case.k != case.n:
        return "MHA only (no GQA)"
    if impl == "xla" and not quick and (case.t > 4096 or case.h != 128):
        return "skipped by design: B*N*T*S float32 logits (run at T <= 4k, H = 128 only)"
    return None


def attention_fn(impl: str, case: Case):
    """(q, k, v, q_seg, kv_seg) -> o for one implementation."""
    import jax

    import jaxgpu

    scale = 1.0 / math.sqrt(case.h)
    if impl in ("cuda", "cpu", "cuda-unordered"):
        kw = case.kwargs()
        if impl == "cuda-unordered":
            impl, kw = "cuda", dict(kw, deterministic=False)

        def fn(q, k, v, q_seg, kv_seg):
            return jaxgpu.dot_product_attention(q, k, v, scale=scale, q_segment_ids=q_seg,
                                                kv_segment_ids=kv_seg, implementation=impl,
                                                **kw)
        return fn
    if impl in ("cudnn", "xla"):
        return lambda q, k, v, q_seg, kv_seg: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=case.causal, implementation=impl)
    if impl == "pallas":
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        return lambda q, k, v, q_seg, kv_seg: pallas_attention.mha(
            q, k, v, None, sm_scale=scale, causal=case.causal)
    raise ValueError(f"unknown implementation {impl!r}")


def make_fwd(impl: str, case: Case):
    import jax

    return jax.jit(attention_fn(impl, case))


def make_fwd_bwd(impl: str, case: Case):
    """Forward + backward through jax.vjp with a random cotangent (vjp_step), jitted."""
    import jax

    return jax.jit(vjp_step(attention_fn(impl, case)))


def make_inputs(key, case: Case, dtype, pass_: str):
    """random_inputs of the case; segment ids in the options case only (as the window, they
    mask nothing)."""
    return random_inputs(key, case.b, case.t, case.n, case.k, case.h, dtype, case.options,
                         with_do=pass_ != "fwd")


def _skip(bench: harness.Bench, case: Case, pass_: str, impl: str, why: str) -> None:
    bench.skip(f"{case.op} {case.label()} {pass_} {impl}", why)


def _mark_targets(bench: harness.Bench, case: Case, pass_: str, recs, plain_times) -> None:
    if not bench.on_gpu:
        return
    for r in recs:
        if r.implementation != "cuda":
            continue
        if case.targeted():
            goal = TARGET_FWD_TFLOPS if pass_ == "fwd" else TARGET_FWD_BWD_TFLOPS
            r.target = f">= {goal:.0f} TFLOP/s"
            r.target_met = r.tflops is not None and r.tflops >= goal
        elif case.options and (case.t, case.h, pass_) in plain_times:
            plain = plain_times[(case.t, case.h, pass_)]
            r.target = (f"<= {TARGET_OPTIONS_SLOWDOWN:.2f}x the plain case's time "
                        f"({r.time_us / plain:.2f}x)")
            r.target_met = r.time_us <= TARGET_OPTIONS_SLOWDOWN * plain


def _arg_sets(bench: harness.Bench, make, case, dtype, pass_, key):
    """Enough copies of one case's arguments to defeat L2 between timed calls."""
    import jax

    one = functools.partial(make, case=case, dtype=dtype, pass_=pass_)
    set_bytes = inputs.tree_nbytes(jax.eval_shape(one, key))
    return inputs.make_arg_sets(one, key, set_bytes, bench.l2_bytes,
                                max_copies=2 if bench.quick else None)


def run(bench: harness.Bench) -> None:
    import jax
    import jax.numpy as jnp

    import jaxgpu  # fail here, once, rather than in every case
    del jaxgpu

    kernel = "cuda" if bench.on_gpu else "cpu"
    if bench.args.impl:
        impls = tuple(harness.default_implementations(bench.args))
    else:
        impls = (kernel, ANCHOR, "pallas", "xla")
        if bench.on_gpu:
            impls += ("cuda-unordered",)
    if not bench.args.repeats and not bench.quick:
        bench.config.repeats = 5  # ~24 cases x 4 implementations within a few GPU minutes
    dtype = jnp.dtype(DTYPE)
    cases = QUICK_CASES if bench.quick else CASES
    plain_times: dict = {}  # (T, H, pass) -> our plain non-causal MHA time, for the probe
    key = jax.random.PRNGKey(0)
    for case in cases:
        for pass_ in ("fwd", "fwd+bwd"):
            key, sub = jax.random.split(key)
            arg_sets = _arg_sets(bench, make_inputs, case, dtype, pass_, sub)
            make = make_fwd if pass_ == "fwd" else make_fwd_bwd
            fns = {}
            for impl in impls:
                if impl == "cuda-unordered" and pass_ == "fwd":
                    continue  # the forward has no order to relax
                why = supported(impl, case, bench.quick)
                if why:
                    _skip(bench, case, pass_, impl, why)
                else:
                    fns[impl] = make(impl, case)
            fns = bench.runnable(f"{case.op} {case.label()} {pass_}", fns, arg_sets[0])
            if not fns:
                continue
            recs = bench.run_case(op=case.op, case=case.label(), pass_=pass_,
                                  shape=(case.b, case.t, case.n, case.h), dtype=dtype, fns=fns,
                                  arg_sets=arg_sets,
                                  anchor=ANCHOR if ANCHOR in fns else None,
                                  flops=case.flops(pass_))
            if not case.options and not case.causal and case.k == case.n:
                for r in recs:
                    if r.implementation == kernel:
                        plain_times[(case.t, case.h, pass_)] = r.time_us
            _mark_targets(bench, case, pass_, recs, plain_times)
            for r in recs:
                print(f"  {case.op:<14} {case.label():<24} {pass_:<8} {r.implementation:<6} "
                      f"{r.time_us:10.1f} us {record.fmt(r.tflops, '7.1f')} TFLOP/s "
                      f"{record.fmt(r.vs_anchor, '.2f')}x {ANCHOR}"
                      + (f"  [{'met' if r.target_met else 'MISSED'}: {r.target}]"
                         if r.target else ""), flush=True)
            del arg_sets, fns


# ---- the --extras cases: bias, mask and sequence lengths ------------------------------------

EXTRAS_FAMILY = "attention_extras"


@dataclasses.dataclass(frozen=True)
class ExtraCase:
    op: str          # padded, bias, bias+mask, bias-grad
    b: int
    t: int           # T = S
    n: int = 16
    h: int = 128
    causal: bool = False

    def label(self) -> str:
        return f"b{self.b}t{self.t}n{self.n}h{self.h}" + ("-causal" if self.causal else "")

    def lengths(self):
        """Per-row lengths of the padded case: the second half of the rows at T / 2."""
        return [self.t] * (self.b - self.b // 2) + [self.t // 2] * (self.b // 2)

    def flops(self, pass_: str) -> float:
        rows = self.lengths() if self.op == "padded" else [self.t] * self.b
        return sum(attention_flops(1, t, self.n, self.h, self.causal, pass_) for t in rows)


EXTRA_CASES = [ExtraCase("padded", 8, 4096, causal=True), ExtraCase("bias", 8, 2048),
               ExtraCase("bias+mask", 8, 2048), ExtraCase("bias-grad", 8, 2048)]
QUICK_EXTRA_CASES = [ExtraCase("padded", 4, 64, 2, 32, True), ExtraCase("bias", 2, 64, 2, 32),
                     ExtraCase("bias+mask", 2, 64, 2, 32), ExtraCase("bias-grad", 2, 64, 2, 32)]


def extra_inputs(key, case: ExtraCase, dtype, pass_: str):
    """(q, k, v, bias, mask, q_lengths, kv_lengths[, do]); absent ones are None."""
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kd, km = jax.random.split(key, 5)
    shape = (case.b, case.t, case.n, case.h)
    q, k, v = (inputs.random_array(x, shape, dtype) for x in (kq, kk, kv))
    bias = mask = ql = kvl = None
    if case.op == "padded":
        ql = kvl = jnp.asarray(case.lengths(), jnp.int32)
    else:
        # ALiBi: head n's slope 2^(-8 (n + 1) / N) times -|i - j|.
        slopes = 2.0 ** (-8.0 * jnp.arange(1, case.n + 1) / case.n)
        dist = jnp.abs(jnp.arange(case.t)[:, None] - jnp.arange(case.t)[None, :])
        bias = (-slopes[:, None, None] * dist)[None].astype(dtype)
        # Every random set gets its own bias (inputs past L2): a small random shift.
        bias = bias + inputs.random_array(kd, (1, case.n, 1, 1), dtype, scale=0.01)
    if case.op == "bias+mask":
        mask = jax.random.uniform(km, (case.b, 1, case.t, case.t)) < 0.9
    args = (q, k, v, bias, mask, ql, kvl)
    return args + (inputs.random_array(kd, shape, dtype),) if pass_ != "fwd" else args


def extra_fn(impl: str, case: ExtraCase):
    """(q, k, v, bias, mask, ql, kvl) -> o for one implementation."""
    import jax

    import jaxgpu

    kernel = impl.split("-")[0]  # cuda or cpu
    if impl.endswith("-full"):
        return lambda q, k, v, bias, mask, ql, kvl: jaxgpu.dot_product_attention(
            q, k, v, is_causal=case.causal, implementation=kernel)
    if impl.endswith("-valid"):
        full, half = case.b - case.b // 2, case.t // 2

        def valid(q, k, v, bias, mask, ql, kvl):
            a = jaxgpu.dot_product_attention(q[:full], k[:full], v[:full],
                                             is_causal=case.causal, implementation=kernel)
            b = jaxgpu.dot_product_attention(q[full:, :half], k[full:, :half], v[full:, :half],
                                             is_causal=case.causal, implementation=kernel)
            return a, b
        return valid
    if impl in ("cuda", "cpu"):
        return lambda q, k, v, bias, mask, ql, kvl: jaxgpu.dot_product_attention(
            q, k, v, bias, mask, is_causal=case.causal, query_seq_lengths=ql,
            key_value_seq_lengths=kvl, implementation=impl)
    if impl in ("cudnn", "xla"):
        def nn(q, k, v, bias, mask, ql, kvl):
            return jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=case.causal,
                                                query_seq_lengths=ql,
                                                key_value_seq_lengths=kvl, implementation=impl)
        return nn
    raise ValueError(f"unknown implementation {impl!r}")


def make_extra(impl: str, case: ExtraCase, pass_: str):
    """Jitted forward, or forward + backward through jax.vjp (q, k, v, and the bias in the
    bias-grad case) with a random cotangent."""
    import jax

    fn = extra_fn(impl, case)
    if pass_ == "fwd":
        return jax.jit(fn)

    def step(q, k, v, bias, mask, ql, kvl, do):
        if case.op == "bias-grad":
            o, vjp = jax.vjp(lambda q, k, v, bias: fn(q, k, v, bias, mask, ql, kvl), q, k, v,
                             bias)
        else:
            o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, bias, mask, ql, kvl), q, k, v)
        if isinstance(o, tuple):  # the valid-tokens pair: the cotangent of each part
            full, half = case.b - case.b // 2, case.t // 2
            return o, vjp((do[:full], do[full:, :half]))
        return o, vjp(do)

    return jax.jit(step)


def run_extras(bench: harness.Bench) -> None:
    import jax
    import jax.numpy as jnp

    kernel = "cuda" if bench.on_gpu else "cpu"
    if not bench.args.repeats and not bench.quick:
        bench.config.repeats = 5
    dtype = jnp.dtype(DTYPE)
    key = jax.random.PRNGKey(1)
    for case in QUICK_EXTRA_CASES if bench.quick else EXTRA_CASES:
        if case.op == "padded":
            impls = (kernel, f"{kernel}-full", f"{kernel}-valid", ANCHOR)
        else:
            impls = (kernel, ANCHOR, "xla")
        for pass_ in ("fwd", "fwd+bwd"):
            key, sub = jax.random.split(key)
            arg_sets = _arg_sets(bench, extra_inputs, case, dtype, pass_, sub)
            what = f"{case.op} {case.label()} {pass_}"
            fns = {}
            for impl in impls:
                if impl == ANCHOR and not bench.on_gpu:
                    _skip_extra(bench, what, impl, "cuDNN needs a GPU")
                    continue
                fns[impl] = make_extra(impl, case, pass_)
            fns = bench.runnable(what, fns, arg_sets[0])
            if not fns:
                continue
            recs = bench.run_case(op=case.op, case=case.label(), pass_=pass_,
                                  shape=(case.b, case.t, case.n, case.h), dtype=dtype, fns=fns,
                                  arg_sets=arg_sets, anchor=ANCHOR if ANCHOR in fns else None,
                                  flops=case.flops(pass_))
            for r in recs:
                print(f"  {case.op:<10} {case.label():<24} {pass_:<8} {r.implementation:<10} "
                      f"{r.time_us:10.1f} us {record.fmt(r.tflops, '7.1f')} TFLOP/s "
                      f"{record.fmt(r.vs_anchor, '.2f')}x {ANCHOR}", flush=True)
            del arg_sets, fns


def _skip_extra(bench: harness.Bench, what: str, impl: str, why: str) -> None:
    bench.skip(f"{what} {impl}", why)


def _extend(parser) -> None:
    parser.add_argument("--extras", action="store_true",
                        help="run only the bias / mask / sequence-length cases (family "
                             f"{EXTRAS_FAMILY})")


if __name__ == "__main__":
    extras = "--extras" in sys.argv[1:]
    sys.exit(harness.main(EXTRAS_FAMILY if extras else FAMILY, run_extras if extras else run,
                          description=__doc__.splitlines()[0], extend_parser=_extend))
