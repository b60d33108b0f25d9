// Timing of cuBLASLt's candidate algorithms (cublaslt_tuning.h).
#include "common/blas/cublaslt_tuning.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>

#include "common/dev_knobs.h"

namespace jaxgpu::blas {
namespace {

constexpr int kDefaultCandidates = 8;
// Runs timed per candidate after one untimed run; the fastest mean wins. Three runs of an
// 8192^3 GEMM are ~5 ms, so tuning a plan costs tens of milliseconds once per process.
constexpr int kTimedRuns = 3;
// Random bytes generated on the host, then doubled on the device up to an operand's size.
constexpr size_t kSeedBytes = size_t(1) << 20;

// Device buffers freed on scope exit; a failed allocation leaves `ok` false.
class Scratch {
 public:
  ~Scratch() {
    for (void* p : owned_) cudaFree(p);
  }
  void* Alloc(size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      ok = false;
      return nullptr;
    }
    owned_.push_back(p);
    return p;
  }
  bool ok = true;

 private:
  std::vector<void*> owned_;
};

// kSeedBytes of values in [-1, 1) of type t (random bytes for the integer types): the
// tensor cores' power, and so the clocks, depend on the data, and zeros would flatter.
std::vector<unsigned char> SeedValues(DType t) {
  std::vector<unsigned char> bytes(kSeedBytes);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  auto fill = [&](auto convert, size_t width) {
    for (size_t i = 0; i + width <= bytes.size(); i += width) {
      const auto v = convert(uniform(rng));
      std::memcpy(&bytes[i], &v, width);
    }
  };
  switch (t) {
    case DType::kF32: fill([](float v) { return v; }, 4); break;
    case DType::kBF16: fill([](float v) { return __float2bfloat16(v); }, 2); break;
    case DType::kF16: fill([](float v) { return __float2half(v); }, 2); break;
    default:
      for (auto& b : bytes) b = static_cast<unsigned char>(rng());
      if (t == DType::kF8E4M3) {
        for (auto& b : bytes) b &= 0xbf;  // exponents below the top: no NaN encodings
      }
  }
  return bytes;
}

bool FillRandom(void* dst, size_t bytes, DType t, cudaStream_t stream) {
  if (dst == nullptr) return true;
  const std::vector<unsigned char> seed = SeedValues(t);
  size_t filled = std::min(bytes, seed.size());
  if (cudaMemcpyAsync(dst, seed.data(), filled, cudaMemcpyHostToDevice, stream) != cudaSuccess) {
    return false;
  }
  char* base = static_cast<char*>(dst);
  while (filled < bytes) {
    const size_t n = std::min(filled, bytes - filled);
    if (cudaMemcpyAsync(base + filled, base, n, cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
      return false;
    }
    filled += n;
  }
  return cudaStreamSynchronize(stream) == cudaSuccess;  // the seed's host memory is pageable
}

// Bytes of a column-major rows x cols matrix at leading dimension ld (0: packed), `batch` of
// them.
size_t MatrixBytes(DType t, int64_t rows, int64_t cols, int64_t ld, int64_t batch) {
  return static_cast<size_t>(DTypeBytes(t, (ld ? ld : rows) * cols * batch));
}

struct Timer {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Timer() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
  bool Create() {
    return cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess;
  }
};

// The body of FastestCandidate, on the helper thread.
int TimeOnThisThread(const GemmKey& key, cublasLtHandle_t handle, const PlanDescriptors& plan,
                     const std::vector<cublasLtMatmulAlgo_t>& candidates) {
  if (cudaSetDevice(key.device) != cudaSuccess) return -1;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return -1;
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } stream_guard{stream};

  Scratch scratch;
  const int64_t a_rows = key.trans_a ? key.k : key.m, a_cols = key.trans_a ? key.m : key.k;
  const int64_t b_rows = key.trans_b ? key.n : key.k, b_cols = key.trans_b ? key.k : key.n;
  const size_t a_bytes = MatrixBytes(key.a_type, a_rows, a_cols, key.lda, key.batch);
  const size_t b_bytes = MatrixBytes(key.b_type, b_rows, b_cols, key.ldb, key.batch);
  const size_t d_bytes = MatrixBytes(key.d_type, key.m, key.n, key.ldd, key.batch);
  void* a = scratch.Alloc(a_bytes);
  void* b = scratch.Alloc(b_bytes);
  void* d = scratch.Alloc(d_bytes);
  // beta is 0 here, so C is only read for its layout: D's buffer serves when the types agree.
  void* c = key.c_type == key.d_type
                ? d
                : scratch.Alloc(MatrixBytes(key.c_type, key.m, key.n, key.ldd, key.batch));
  // A bias (or the bias gradient of BGRADA / BGRADB) runs along m or n: room for either.
  const size_t bias_bytes =
      key.has_bias ? size_t(DTypeBytes(key.bias_type, std::max(key.m, key.n) * key.batch)) : 0;
  void* bias = scratch.Alloc(bias_bytes);
  void* aux =
      key.has_aux ? scratch.Alloc(MatrixBytes(key.aux_type, key.m, key.n, 0, key.batch)) : nullptr;
  void* workspace = scratch.Alloc(static_cast<size_t>(key.workspace_bytes));
  if (!scratch.ok) {
    cudaGetLastError();  // an out-of-memory here is not the caller's error
    return -1;
  }
  if (!FillRandom(a, a_bytes, key.a_type, stream) || !FillRandom(b, b_bytes, key.b_type, stream) ||
      !FillRandom(bias, bias_bytes, key.bias_type, stream)) {
    cudaGetLastError();
    return -1;
  }

  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t bytes) {
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(plan.desc, attr, v, bytes);
  };
  const void* no_scale = nullptr;
  if (key.has_bias) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  if (key.has_aux) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux));
  set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &no_scale, sizeof(no_scale));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &no_scale, sizeof(no_scale));
  set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &no_scale, sizeof(no_scale));
  if (s != CUBLAS_STATUS_SUCCESS) return -1;

  const bool integer =
      key.compute == CUBLAS_COMPUTE_32I || key.compute == CUBLAS_COMPUTE_32I_PEDANTIC;
  const float alpha_f = 1.f, beta_f = 0.f;
  const int32_t alpha_i = 1, beta_i = 0;
  const void* alpha = integer ? static_cast<const void*>(&alpha_i) : &alpha_f;
  const void* beta = integer ? static_cast<const void*>(&beta_i) : &beta_f;
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(handle, plan.desc, alpha, a, plan.a, b, plan.b, beta, c, plan.c, d,
                          plan.d, &algo, workspace, static_cast<size_t>(key.workspace_bytes),
                          stream) == CUBLAS_STATUS_SUCCESS;
  };

  Timer timer;
  if (!timer.Create()) {
    cudaGetLastError();
    return -1;
  }
  // Two runs of the first candidate before any timing: the clocks leave their idle state.
  run(candidates[0]);
  run(candidates[0]);
  int best = -1;
  float best_ms = 0.f;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!run(candidates[i])) continue;  // this algorithm refuses the problem: skip it
    cudaEventRecord(timer.start, stream);
    bool ok = true;
    for (int r = 0; r < kTimedRuns && ok; ++r) ok = run(candidates[i]);
    cudaEventRecord(timer.stop, stream);
    float ms = 0.f;
    if (!ok || cudaEventSynchronize(timer.stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, timer.start, timer.stop) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    if (best < 0 || ms < best_ms) {
      best = static_cast<int>(i);
      best_ms = ms;
    }
  }
  if (cudaStreamSynchronize(stream) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return best;
}

}  // namespace

int CandidateCount() {
  static const int count = [] {
    const int knob = ReadDevKnob("JAXGPU_CUBLASLT_TUNE").ints[0];
    return knob > 0 ? knob : kDefaultCandidates;
  }();
  return count;
}

int FastestCandidate(const GemmKey& key, cublasLtHandle_t handle, const PlanDescriptors& plan,
                     const std::vector<cublasLtMatmulAlgo_t>& candidates) {
  if (candidates.size() < 2) return candidates.empty() ? -1 : 0;
  int best = -1;
  std::thread worker([&] { best = TimeOnThisThread(key, handle, plan, candidates); });
  worker.join();
  return best;
}

}  // namespace jaxgpu::blas
