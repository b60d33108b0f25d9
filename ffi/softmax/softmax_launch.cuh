// Host-side pieces both softmax launchers share: the developer knob, the staged kernels'
// row configuration, and the launches of the staged and loop kernels. No XLA types.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/cuda_utils.cuh"
#include "common/dev_knobs.h"
#include "softmax/softmax_device.cuh"

namespace jaxgpu::cuda::softmax {

// Forward kernels of rows of whole 16-byte vectors (rows too wide for the one-pass kernels,
// more than 4096 vectors, and 2^31 rows or more take version 1 whatever is asked).
enum class FwdKernel {
  kRegs,    // SoftmaxFwdRegs
  kStaged,  // version 1: SoftmaxFwdStaged
};

struct Tune {
  int vpt[2];  // target vectors per thread, forward and backward; 0: the default
  FwdKernel fwd;
};

// Developer knob (common/dev_knobs.h): JAXGPU_SOFTMAX_TUNE="a,b[,kernel]" overrides the
// target vectors per thread of the forward (a) and backward (b) kernels (0 keeps the
// default) and picks the forward kernel: regs (the default) or staged (version 1, for A/B
// runs; 2259 GB/s against regs' 2944 on the H100).
inline Tune GetTune() {
  const Tune defaults{{0, 0}, FwdKernel::kRegs};
  if (!kDevKnobs) return defaults;
  static const Tune tune = [&] {
    const DevKnob knob = ReadDevKnob("JAXGPU_SOFTMAX_TUNE");
    Tune t = defaults;
    t.vpt[0] = knob.ints[0];
    t.vpt[1] = knob.ints[1];
    if (std::strcmp(knob.word, "staged") == 0) {
      t.fwd = FwdKernel::kStaged;
    } else if (knob.word[0] != '\0' && std::strcmp(knob.word, "regs") != 0) {
      DevKnobIgnored("JAXGPU_SOFTMAX_TUNE", "the kernel must be regs or staged");
    }
    return t;
  }();
  return tune;
}

inline int TunedVpt(int which, int fallback) {
  const int v = GetTune().vpt[which];
  return v > 0 && v <= kMaxVpt ? v : fallback;
}

struct StagedConfig {
  bool staged;
  int tpr;
  int vpt;  // vectors a thread owns, rounded up to 2, 4 or 8 (a template parameter)
  int rows_per_block;
  int64_t smem;
};

// ~target_vpt vectors a thread: 4 keeps 64 bytes in flight per thread at ~32-40 registers
// (the norm kernels' measured optimum). Staged when a thread needs at most kMaxVpt vectors and
// the block's rows fit in shared memory.
inline StagedConfig ChooseStaged(int64_t S, int vec, int64_t elem_bytes, int arrays,
                                 int target_vpt) {
  StagedConfig c{};
  const int64_t nvec = CeilDiv(S, vec);
  const int max_threads = vec == 1 ? StagedMaxThreads<1>() : kMaxThreads;
  c.tpr = static_cast<int>(std::min<int64_t>(max_threads, NextPow2(CeilDiv(nvec, target_vpt))));
  const int64_t per_thread = CeilDiv(nvec, c.tpr);
  c.vpt = per_thread <= 2 ? 2 : (per_thread <= 4 ? 4 : kMaxVpt);
  c.rows_per_block = c.tpr >= kBlockThreads ? 1 : kBlockThreads / c.tpr;
  c.smem = int64_t(c.rows_per_block) * arrays * S * elem_bytes;
  c.staged = per_thread <= kMaxVpt && c.smem <= MaxStagedBytes(kScratchBytes);
  return c;
}

template <typename Kernel, typename Args>
cudaError_t LaunchStaged(Kernel kernel, const StagedConfig& c, int64_t rows, const Args& args,
                         cudaStream_t stream) {
  const int64_t blocks = CeilDiv(rows, c.rows_per_block);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;  // one grid dimension
  if (cudaError_t err = AllowSmem(kernel, c.smem); err != cudaSuccess) return err;
  kernel<<<blocks, dim3(c.tpr, c.rows_per_block), c.smem, stream>>>(args, c.tpr);
  return cudaGetLastError();
}

template <typename Kernel, typename Args>
cudaError_t LaunchLoop(Kernel kernel, int64_t rows, const Args& args, cudaStream_t stream) {
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<rows, kMaxThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

inline bool Aligned(const void* ptr, int bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace jaxgpu::cuda::softmax
