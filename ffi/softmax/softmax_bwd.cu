// Softmax backward launcher: picks the staged or the loop kernel (softmax_bwd_kernels.cuh)
// for the row, and launches it. The design of the kernels: softmax_cuda.h.
#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "common/fast_div.cuh"
#include "softmax/softmax_bwd_kernels.cuh"
#include "softmax/softmax_cuda.h"
#include "softmax/softmax_device.cuh"
#include "softmax/softmax_launch.cuh"

namespace jaxgpu::cuda {
namespace softmax {
namespace {

template <typename T, bool kCausal>
cudaError_t LaunchBwd(const BwdArgs& a, cudaStream_t stream) {
  constexpr int kFull = 16 / sizeof(T);
  const SoftmaxBwdParams& p = a.p;
  if (p.cols % kFull == 0 && Aligned(p.y, 16) && Aligned(p.dy, 16) && Aligned(p.dx, 16)) {
    const StagedConfig c = ChooseStaged(p.cols, kFull, sizeof(T), 2, TunedVpt(1, 4));
    if (c.staged) {
      return JAXGPU_INT_SWITCH(c.vpt, VPT, (2, 4, 8), [&] {
        return LaunchStaged(SoftmaxBwdStaged<T, kFull, VPT, true, kCausal>, c, p.rows, a, stream);
      });
    }
    return LaunchLoop(SoftmaxBwdLoop<T, kFull, kCausal>, p.rows, a, stream);
  }
  const StagedConfig c = ChooseStaged(p.cols, 1, sizeof(T), 2, kMaxVpt);
  if (c.staged) {
    return LaunchStaged(SoftmaxBwdStaged<T, 1, kMaxVpt, false, kCausal>, c, p.rows, a, stream);
  }
  return LaunchLoop(SoftmaxBwdLoop<T, 1, kCausal>, p.rows, a, stream);
}

}  // namespace
}  // namespace softmax

cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  softmax::BwdArgs a{};
  a.p = p;
  a.fast = p.rows < (int64_t(1) << 31);
  if (a.fast) a.query = MakeFastDiv(std::max<int64_t>(p.query_len, 1));
  return JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {
    return JAXGPU_BOOL_SWITCH(p.causal, kCausal,
                              [&] { return softmax::LaunchBwd<T, kCausal>(a, stream); });
  });
}

}  // namespace jaxgpu::cuda
