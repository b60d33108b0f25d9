// Standalone check of the dequantizing copy kernel (ffi/matmul/qdequant_kernels.cu, the
// large-M route of jaxgpu.linear with a QuantizedWeight), bitwise against the CPU handler's
// dequantization (jaxgpu::cpu::QDequant, the oracle of the CPU tests: q - z exact, one
// rounding to T of the product with the 16-bit scale), then its time on 8192 x 28672:
//
//   nvcc -O3 -std=c++17 -Iffi -DJAXGPU_HAS_SM90A=1 -arch=sm_90a -o /tmp/qd \
//       tools/qdequant_check.cu ffi/matmul/qdequant_kernels.cu ffi/matmul/matmul_cpu.cc \
//       && /tmp/qd [--no-time]
//
// Cases: bf16 / f16 x int4 / int8, with and without zero points, group sizes 16 .. K, N not
// a multiple of 8 or 16 and past one block's run of tiles, K not a multiple of 64, several
// groups. The packed words are random (every position, padding included), so every nibble
// and byte position of the layout is exercised.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check_common.h"
#include "matmul/matmul_cpu.h"
#include "matmul/qlinear_cuda.h"
#include "matmul/qlinear_params.h"

using jaxgpu::DType;
using jaxgpu::QDequantParams;

namespace {

using namespace jaxgpu::check;  // NOLINT: the checkers' own helpers

struct Case {
  DType dtype;
  int bits;
  int64_t groups, k, n, group_size;
  bool zeros;
};

struct DeviceCase {
  int32_t* packed = nullptr;
  uint16_t* scales = nullptr;
  uint8_t* zeros = nullptr;
  uint16_t* w = nullptr;
  QDequantParams p{};
  ~DeviceCase() {
    cudaFree(packed);
    cudaFree(scales);
    cudaFree(zeros);
    cudaFree(w);
  }
};

// Random inputs for `c` on the device (and their host copies), the params pointing at them.
void Make(const Case& c, std::mt19937& rng, DeviceCase& d, std::vector<int32_t>& packed,
          std::vector<uint16_t>& scales, std::vector<uint8_t>& zeros) {
  const int64_t words =
      c.groups * jaxgpu::QTilesK(c.k) * jaxgpu::QTilesN(c.n) * jaxgpu::QWordsPerTile(c.bits);
  const int64_t rows = c.k / c.group_size;
  packed.resize(words);
  for (auto& v : packed) v = int32_t(rng());
  scales.resize(c.groups * rows * c.n);
  std::uniform_real_distribution<float> su(0.002f, 0.2f);
  for (auto& v : scales) v = HalfBits(c.dtype, su(rng));
  zeros.assign(c.zeros ? c.groups * rows * c.n : 0, 0);
  for (auto& v : zeros) v = uint8_t(rng() % (1u << c.bits));
  CK(cudaMalloc(&d.packed, words * 4));
  CK(cudaMalloc(&d.scales, scales.size() * 2));
  CK(cudaMalloc(&d.w, c.groups * c.k * c.n * 2));
  CK(cudaMemcpy(d.packed, packed.data(), words * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.scales, scales.data(), scales.size() * 2, cudaMemcpyHostToDevice));
  if (c.zeros) {
    CK(cudaMalloc(&d.zeros, zeros.size()));
    CK(cudaMemcpy(d.zeros, zeros.data(), zeros.size(), cudaMemcpyHostToDevice));
  }
  d.p = QDequantParams{c.dtype,      c.bits,   c.groups, c.k,     c.n,
                       c.group_size, d.packed, d.scales, d.zeros, d.w};
}

bool Check(const Case& c, std::mt19937& rng) {
  DeviceCase d;
  std::vector<int32_t> packed;
  std::vector<uint16_t> scales;
  std::vector<uint8_t> zeros;
  Make(c, rng, d, packed, scales, zeros);
  CK(cudaMemset(d.w, 0xff, c.groups * c.k * c.n * 2));
  CK(jaxgpu::cuda::LaunchQDequant(d.p, nullptr));
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(c.groups * c.k * c.n);
  CK(cudaMemcpy(got.data(), d.w, got.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<uint16_t> want(got.size());
  QDequantParams host = d.p;
  host.packed = packed.data();
  host.scales = scales.data();
  host.zeros = c.zeros ? zeros.data() : nullptr;
  host.w = want.data();
  jaxgpu::cpu::QDequant(host);
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && bad++ < 5) {
      std::printf("  (g, k, n) = (%lld, %lld, %lld): got 0x%04x, want 0x%04x\n",
                  (long long)(i / (c.k * c.n)), (long long)(i / c.n % c.k), (long long)(i % c.n),
                  got[i], want[i]);
    }
  }
  std::printf("%s %s int%d G%lld K%lld N%lld group %lld %s: %lld wrong\n", bad ? "FAIL" : "ok  ",
              c.dtype == DType::kBF16 ? "bf16" : "f16 ", c.bits, (long long)c.groups,
              (long long)c.k, (long long)c.n, (long long)c.group_size,
              c.zeros ? "zeros" : "midpoint", (long long)bad);
  return bad == 0;
}

void Time(int bits, int64_t k, int64_t n, std::mt19937& rng) {
  const Case c{DType::kBF16, bits, 1, k, n, bits == 4 ? 128 : k, bits == 4};
  DeviceCase d;
  std::vector<int32_t> packed;
  std::vector<uint16_t> scales;
  std::vector<uint8_t> zeros;
  Make(c, rng, d, packed, scales, zeros);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CK(jaxgpu::cuda::LaunchQDequant(d.p, nullptr));
  const int iters = 20;
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) CK(jaxgpu::cuda::LaunchQDequant(d.p, nullptr));
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  const double us = 1e3 * ms / iters;
  const double bytes = double(packed.size()) * 4 + double(k) * n * 2;
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::printf("time int%d %lldx%lld: %.1f us, %.0f GB/s read + written\n", bits, (long long)k,
              (long long)n, us, bytes / us * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  const bool time = !(argc > 1 && std::strcmp(argv[1], "--no-time") == 0);
  std::mt19937 rng(1234);
  const Case cases[] = {
      {DType::kBF16, 4, 1, 111, 40, 111, true},     {DType::kF16, 8, 1, 111, 40, 111, false},
      {DType::kBF16, 4, 2, 256, 200, 64, true},     {DType::kF16, 4, 1, 64, 17, 32, false},
      {DType::kBF16, 8, 3, 320, 136, 16, true},     {DType::kF16, 8, 1, 128, 256, 128, true},
      {DType::kBF16, 8, 1, 1024, 1000, 128, false}, {DType::kF16, 4, 1, 192, 8, 64, true},
  };
  bool ok = true;
  for (const Case& c : cases) ok = Check(c, rng) && ok;
  if (time) {
    Time(4, 8192, 28672, rng);
    Time(8, 8192, 28672, rng);
  }
  std::printf(ok ? "all cases passed\n" : "FAILURES\n");
  return ok ? 0 : 1;
}
