// Per-call cost of the norm launcher at decode sizes (a few rows), with no JAX in the
// process: each case is 200 calls chained in one CUDA graph (each reads the previous
// output), replayed 12 times; the median replay over 200 is what a call adds to a decode
// step. Two floors beside it: a 2 KB copy kernel and a minimal one-vector-a-thread RMSNorm
// (no options), so that the launcher's own latency shows against what a kernel of this
// size can take.
//
//   nvcc -O3 -std=c++17 -Iffi -arch=sm_90a -o /tmp/nl tools/norm_latency_check.cu \
//       ffi/norm/norm_kernels.cu
//   /tmp/nl
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>

#include "check_common.h"
#include "norm/norm_cuda.h"

namespace {

using jaxgpu::DType;
using jaxgpu::NormFwdParams;
using jaxgpu::NormKind;
using jaxgpu::check::GraphUsPerCall;

__global__ void Copy(const uint4* x, uint4* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}

// One row of nvec 16-byte bf16 vectors, one a thread: x and the weight loaded together.
__global__ void MinimalRmsNorm(const uint4* x, const uint4* w, uint4* y, int nvec) {
  __shared__ float partial[32];
  const int t = threadIdx.x;
  uint4 xv = make_uint4(0, 0, 0, 0), wv = xv;
  if (t < nvec) xv = x[t], wv = w[t];
  const __nv_bfloat16* xb = reinterpret_cast<const __nv_bfloat16*>(&xv);
  const __nv_bfloat16* wb = reinterpret_cast<const __nv_bfloat16*>(&wv);
  float ss = 0.f;
  for (int j = 0; j < 8; ++j) ss += __bfloat162float(xb[j]) * __bfloat162float(xb[j]);
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (t % 32 == 0) partial[t / 32] = ss;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < int(blockDim.x) / 32; ++i) total += partial[i];
  const float rstd = rsqrtf(total / float(nvec * 8) + 1e-6f);
  uint4 out;
  __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(&out);
  for (int j = 0; j < 8; ++j)
    ob[j] = __float2bfloat16(__bfloat162float(xb[j]) * rstd * (1.f + __bfloat162float(wb[j])));
  if (t < nvec) y[t] = out;
}

// Microseconds per call of `launch(stream, i)` (i = 0..calls-1) replayed from a CUDA graph.
double UsPerCall(const std::function<void(cudaStream_t, int)>& launch, int calls = 200) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) launch(s, i);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = GraphUsPerCall(exec, s, calls, 12);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
  return us;
}

}  // namespace

int main() {
  constexpr size_t kBytes = 16 << 20;  // the largest case: 4096 x 1152 bf16 (9 MiB)
  void *a, *b, *weight, *ha, *hb;
  float* rstd;
  for (void** buf : {&a, &b, &weight, &ha, &hb}) {
    CK(cudaMalloc(buf, kBytes));
    CK(cudaMemset(*buf, 0, kBytes));
  }
  CK(cudaMalloc(&rstd, 4096));
  auto src = [&](int i) { return i % 2 ? b : a; };
  auto dst = [&](int i) { return i % 2 ? a : b; };
  auto params = [&](int i, int rows, int dim, bool residual) {
    NormFwdParams p{};
    p.kind = NormKind::kRms;
    p.dtype = p.param_dtype = DType::kBF16;
    p.groups = 1;
    p.rows_per_group = rows;
    p.dim = dim;
    p.x = src(i);
    p.weight = weight;
    p.y = dst(i);
    p.rstd = rstd;
    p.eps = 1e-6f;
    p.weight_offset = 1.f;
    if (residual) p.residual = weight, p.h = i % 2 ? ha : hb;
    return p;
  };
  const int nvec = 1152 / 8;
  std::printf("floors (bf16, 1152 wide):\n");
  std::printf("  copy kernel              %5.2f us a call\n", UsPerCall([&](cudaStream_t s, int i) {
                Copy<<<1, 160, 0, s>>>(static_cast<const uint4*>(src(i)),
                                       static_cast<uint4*>(dst(i)), nvec);
              }));
  std::printf("  minimal rms norm         %5.2f us a call\n", UsPerCall([&](cudaStream_t s, int i) {
                MinimalRmsNorm<<<1, 160, 0, s>>>(static_cast<const uint4*>(src(i)),
                                                 static_cast<const uint4*>(weight),
                                                 static_cast<uint4*>(dst(i)), nvec);
              }));
  struct Case {
    int rows, dim;
    bool residual;
  };
  std::printf("jaxgpu::cuda::LaunchNormFwd (rms, bf16, weight offset 1):\n");
  for (const Case c : {Case{1, 1152, false}, Case{8, 1152, false}, Case{64, 1152, false},
                       Case{4, 256, false}, Case{1, 2304, true}, Case{4096, 1152, false}}) {
    std::printf("  %4d x %4d%s  %5.2f us a call\n", c.rows, c.dim,
                c.residual ? " + residual" : "           ", UsPerCall([&](cudaStream_t s, int i) {
                  CK(jaxgpu::cuda::LaunchNormFwd(params(i, c.rows, c.dim, c.residual), s));
                }));
  }
  return 0;
}
