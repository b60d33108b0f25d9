// Self-check of the cuBLASLt handle and plan cache (ffi/common/blas/cublaslt_plans.h) on a
// GPU, before any op family uses it. Built only on request, from a CUDA build's directory:
//
//   cmake --build build/<wheel tag> --target jaxgpu_cublaslt_selfcheck
//   build/<wheel tag>/jaxgpu_cublaslt_selfcheck
//
// Checks: a bf16 GEMM (and a transposed one with a bias epilogue) against a float reference
// on the host; equal keys reuse one plan, another key adds one; a problem cuBLASLt cannot
// plan, and a call without its workspace, come back as errors with a message; the first
// call of a plan (which times its candidate algorithms) leaves an accumulated D correct.
// Prints one line per check and exits 1 on any failure.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/blas/cublaslt_plans.h"

namespace {

using jaxgpu::DType;
using jaxgpu::blas::GemmKey;
using jaxgpu::blas::GemmOperands;
using jaxgpu::blas::Status;

int failures = 0;

void Expect(bool ok, const char* what, const std::string& detail = "") {
  std::printf("%s  %s%s%s\n", ok ? "ok  " : "FAIL", what, detail.empty() ? "" : ": ",
              detail.c_str());
  if (!ok) ++failures;
}

template <typename T>
T* Upload(const std::vector<T>& host) {
  void* dev = nullptr;
  cudaMalloc(&dev, host.size() * sizeof(T));
  cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(dev);
}

// Column-major m x n D = op(A) op(B) + bias (bias per row of D) [+ D's previous values when
// accumulate: beta = 1 with C = D], bf16 in, bf16 out, and the largest error against a
// float reference of the bf16 inputs.
float RunGemm(int64_t m, int64_t n, int64_t k, bool trans_a, bool with_bias, void* workspace,
              int64_t workspace_bytes, Status* status, bool accumulate = false) {
  std::vector<__nv_bfloat16> a(m * k), b(k * n), bias(m), d0(m * n);
  std::vector<float> af(m * k), bf(k * n), biasf(m), d0f(m * n);
  for (int64_t i = 0; i < m * k; ++i) {
    a[i] = __float2bfloat16(float((i * 7) % 13) / 13.f - 0.5f);
    af[i] = __bfloat162float(a[i]);
  }
  for (int64_t i = 0; i < k * n; ++i) {
    b[i] = __float2bfloat16(float((i * 5) % 11) / 11.f - 0.5f);
    bf[i] = __bfloat162float(b[i]);
  }
  for (int64_t i = 0; i < m; ++i) {
    bias[i] = __float2bfloat16(float(i % 3) - 1.f);
    biasf[i] = __bfloat162float(bias[i]);
  }
  for (int64_t i = 0; i < m * n; ++i) {
    d0[i] = __float2bfloat16(accumulate ? float(i % 5) * 0.25f : 0.f);
    d0f[i] = __bfloat162float(d0[i]);
  }
  __nv_bfloat16* da = Upload(a);
  __nv_bfloat16* db = Upload(b);
  __nv_bfloat16* dbias = Upload(bias);
  __nv_bfloat16* dd = Upload(d0);

  GemmKey key;
  cudaGetDevice(&key.device);
  key.m = m;
  key.n = n;
  key.k = k;
  key.trans_a = trans_a;
  key.epilogue = with_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  key.has_bias = with_bias;
  key.workspace_bytes = workspace_bytes;
  key.alignment = jaxgpu::blas::PointerAlignment({da, db, dd});
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  GemmOperands ops;
  ops.a = da;
  ops.b = db;
  ops.d = dd;
  ops.bias = with_bias ? dbias : nullptr;
  ops.alpha = &alpha;
  ops.beta = &beta;
  ops.workspace = workspace;
  *status = jaxgpu::blas::Matmul(key, ops, nullptr);
  float err = INFINITY;
  if (status->ok() && cudaDeviceSynchronize() == cudaSuccess) {
    std::vector<__nv_bfloat16> d(m * n);
    cudaMemcpy(d.data(), dd, d.size() * sizeof(d[0]), cudaMemcpyDeviceToHost);
    err = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < m; ++i) {
        float ref = (with_bias ? biasf[i] : 0.f) + d0f[i + j * m];
        for (int64_t l = 0; l < k; ++l) {
          const float av = trans_a ? af[l + i * k] : af[i + l * m];  // A stored k x m or m x k
          ref += av * bf[l + j * k];
        }
        err = std::fmax(err, std::fabs(__bfloat162float(d[i + j * m]) - ref));
      }
    }
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dbias);
  cudaFree(dd);
  return err;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 1;
  }
  constexpr int64_t kWorkspace = 32 << 20;
  void* workspace = nullptr;
  cudaMalloc(&workspace, kWorkspace);
  Status s = Status::Ok();

  // Errors within ~16 bf16 ulps of |ref| <= k/4: the output's rounding, not the product's.
  float err = RunGemm(256, 128, 64, false, false, workspace, kWorkspace, &s);
  Expect(s.ok() && err < 0.1f, "bf16 GEMM 256x128x64",
         s.ok() ? "max error " + std::to_string(err) : s.message());
  const size_t plans = jaxgpu::blas::CachedPlanCount();
  err = RunGemm(256, 128, 64, false, false, workspace, kWorkspace, &s);
  Expect(s.ok() && err < 0.1f && jaxgpu::blas::CachedPlanCount() == plans,
         "the same key reuses its plan",
         std::to_string(jaxgpu::blas::CachedPlanCount()) + " plans");
  err = RunGemm(96, 40, 24, true, true, workspace, kWorkspace, &s);
  Expect(s.ok() && err < 0.1f && jaxgpu::blas::CachedPlanCount() == plans + 1,
         "A transposed, bias epilogue: a second plan",
         s.ok() ? "max error " + std::to_string(err) : s.message());

  // A new plan is timed on its first call (cublaslt_tuning.h) on scratch operands: the
  // caller's D, read back as C here, must see exactly one product added.
  err = RunGemm(200, 72, 48, false, false, workspace, kWorkspace, &s, /*accumulate=*/true);
  Expect(s.ok() && err < 0.1f, "beta = 1 with C = D on a plan's first (tuning) call",
         s.ok() ? "max error " + std::to_string(err) : s.message());

  RunGemm(64, 64, 64, false, false, nullptr, kWorkspace, &s);
  Expect(!s.ok(), "a call without the plan's workspace is an error", s.message());

  GemmKey bad;
  cudaGetDevice(&bad.device);
  bad.m = bad.n = bad.k = 64;
  bad.a_type = bad.b_type = DType::kS4;  // no int4 GEMM in cuBLASLt
  const float one = 1.f, zero = 0.f;
  GemmOperands ops;
  ops.a = ops.b = workspace;
  ops.d = workspace;
  ops.alpha = &one;
  ops.beta = &zero;
  s = jaxgpu::blas::Matmul(bad, ops, nullptr);
  Expect(!s.ok(), "an unplannable problem is an error", s.message());

  cudaFree(workspace);
  std::printf("%s\n", failures == 0 ? "all checks passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
