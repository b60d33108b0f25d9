// The wgmma main loop (Hopper's warpgroup MMAs, sm_90a): kernels for head dims padded to
// 64, 128 and 256, whose code exists only in a build with sm_90a among its architectures
// (JAXGPU_HAS_SM90A) and runs only on a compute capability 9.0 device. No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include "attention/attention_launch.cuh"
#include "attention/attention_main_loop.h"
#include "attention/attention_params.h"

namespace jaxgpu::cuda::attention::sm90 {

cudaError_t LaunchFwd(const AttentionParams& p, cudaStream_t stream);  // fwd_sm90.cu
cudaError_t LaunchDq(const AttentionParams& p, cudaStream_t stream);   // dq_sm90.cu
cudaError_t LaunchDkv(const AttentionParams& p, cudaStream_t stream);  // dkv_sm90.cu
// The warp-specialized backward (bwd_ws_sm90.cu) where p carries its workspaces and it
// takes the call; cudaErrorNotSupported otherwise.
cudaError_t LaunchFusedBwd(const AttentionParams& p, cudaStream_t stream);

inline const char* Unavailable(const AttentionParams& p) {
#ifdef JAXGPU_HAS_SM90A
  if (p.bias != nullptr || p.mask != nullptr) {
    return "the wgmma kernels take no bias or mask (the mma_sync kernels run them)";
  }
  const int padded = PaddedHeadDim(p.head_dim);
  if (padded != 64 && padded != 128 && padded != 256) {
    return "the wgmma kernels take head dims padded to 64, 128 or 256 (33..64, 97..128, "
           "129..256)";
  }
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return "the current device's compute capability could not be read";
  }
  if (major != 9 || minor != 0) {
    return "sm_90a code (wgmma) runs on compute capability 9.0 devices only";
  }
  return nullptr;
#else
  (void)p;
  return "this build has no sm_90a code (JAXGPU_CUDA_ARCHS without 90a)";
#endif
}

inline constexpr MainLoop kMainLoop{Unavailable, LaunchFwd, LaunchDq, LaunchDkv, LaunchFusedBwd};

}  // namespace jaxgpu::cuda::attention::sm90
