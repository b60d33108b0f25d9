// Softmax forward launcher: picks the one-pass kernel (softmax_fwd_regs.cuh), the staged one
// or the loop one (softmax_fwd_kernels.cuh) for the row, and launches it. The design of the
// kernels: softmax_cuda.h.
#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/fast_div.cuh"
#include "softmax/softmax_cuda.h"
#include "softmax/softmax_device.cuh"
#include "softmax/softmax_fwd_kernels.cuh"
#include "softmax/softmax_fwd_regs.cuh"
#include "softmax/softmax_launch.cuh"

namespace jaxgpu::cuda {
namespace softmax {
namespace {

FwdArgs MakeFwdArgs(const SoftmaxFwdParams& p) {
  FwdArgs a{};
  a.p = p;
  a.fast = p.rows < (int64_t(1) << 31);
  if (a.fast) {
    for (int k = 0; k < p.ndims; ++k) a.dims[k] = MakeFastDiv(std::max<int64_t>(p.dims[k], 1));
    a.query = MakeFastDiv(std::max<int64_t>(p.query_len, 1));
  }
  return a;
}

struct OnePassConfig {
  bool fits;  // at most 8 vectors a thread, and at most 4 above 512 threads
  int tpr;
  int vpt;  // vectors a thread owns, rounded up to 2, 4 or 8 (a template parameter)
  int rows_per_block;
};

OnePassConfig ChooseOnePass(int64_t nvec, int target_vpt) {
  OnePassConfig c{};
  c.tpr = static_cast<int>(std::min<int64_t>(kMaxThreads, NextPow2(CeilDiv(nvec, target_vpt))));
  const int64_t per_thread = CeilDiv(nvec, c.tpr);
  c.vpt = per_thread <= 2 ? 2 : (per_thread <= 4 ? 4 : 8);
  c.fits = per_thread <= 8 && c.tpr <= (c.vpt > 4 ? OnePassMaxThreads<8>() : kMaxThreads);
  c.rows_per_block = c.tpr >= kBlockThreads ? 1 : kBlockThreads / c.tpr;
  return c;
}

template <typename T, int VEC, int VPT, bool kCausal, bool kMask>
cudaError_t LaunchOnePass(const FwdArgs& a, const OnePassConfig& c, cudaStream_t stream) {
  const int64_t blocks = CeilDiv(a.p.rows, c.rows_per_block);
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;  // one grid dimension
  SoftmaxFwdRegs<T, VEC, VPT, kCausal, kMask>
      <<<blocks, dim3(c.tpr, c.rows_per_block), 0, stream>>>(a, c.tpr);
  return cudaGetLastError();
}

template <typename T, bool kCausal, bool kMask>
cudaError_t LaunchFwd(const FwdArgs& a, cudaStream_t stream) {
  constexpr int kFull = 16 / sizeof(T);
  const int64_t S = a.p.cols;
  // XLA's buffers are aligned far beyond 16 bytes; the check costs nothing and keeps the
  // vector path from ever faulting on a misaligned one (the mask's vector is kFull bytes).
  if (S % kFull == 0 && Aligned(a.p.x, 16) && Aligned(a.p.y, 16) &&
      (!kMask || Aligned(a.p.mask, kFull))) {
    const Tune tune = GetTune();
    if (tune.fwd != FwdKernel::kStaged && a.fast) {  // the one-pass kernels' row math: 32 bits
      const OnePassConfig c = ChooseOnePass(S / kFull, TunedVpt(0, 4));
      if (c.fits) {
        return JAXGPU_INT_SWITCH(c.vpt, VPT, (2, 4, 8), [&] {
          return LaunchOnePass<T, kFull, VPT, kCausal, kMask>(a, c, stream);
        });
      }
    }
    const StagedConfig c = ChooseStaged(S, kFull, sizeof(T), 1, TunedVpt(0, 4));
    if (c.staged) {
      return JAXGPU_INT_SWITCH(c.vpt, VPT, (2, 4, 8), [&] {
        return LaunchStaged(SoftmaxFwdStaged<T, kFull, VPT, true, kCausal, kMask>, c, a.p.rows, a,
                            stream);
      });
    }
    return LaunchLoop(SoftmaxFwdLoop<T, kFull, kCausal, kMask>, a.p.rows, a, stream);
  }
  // S not a whole number of 16-byte vectors: scalar accesses.
  const StagedConfig c = ChooseStaged(S, 1, sizeof(T), 1, kMaxVpt);
  if (c.staged) {
    return LaunchStaged(SoftmaxFwdStaged<T, 1, kMaxVpt, false, kCausal, kMask>, c, a.p.rows, a,
                        stream);
  }
  return LaunchLoop(SoftmaxFwdLoop<T, 1, kCausal, kMask>, a.p.rows, a, stream);
}

}  // namespace
}  // namespace softmax

cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const softmax::FwdArgs a = softmax::MakeFwdArgs(p);
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    return JAXGPU_BOOL_SWITCH(p.causal, kCausal, [&] {
      return JAXGPU_BOOL_SWITCH(p.mask != nullptr, kMask,
                                [&] { return softmax::LaunchFwd<T, kCausal, kMask>(a, stream); });
    });
  });
}

}  // namespace jaxgpu::cuda
