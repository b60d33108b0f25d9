// What the quantized-linear launchers share across their files (qlinear_kernels.cu, the
// mma.sync kernels and the dispatch; qlinear_wgmma_sm90.cu, the Hopper kernel). Not part of
// the launcher's interface (qlinear_cuda.h). No XLA types.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

#include "matmul/qlinear_params.h"

namespace jaxgpu::cuda::qlinear {

// Devices whose attributes and kernel opt-ins are cached (higher ordinals query each time).
inline constexpr int kMaxDevices = 64;

// A device attribute, read once per device into `cache` (kMaxDevices entries; a 0 value is
// re-read); 0 where it cannot be read.
int DeviceAttribute(cudaDeviceAttr attr, std::atomic<int>* cache, int device);

// Runs `opt_in` (a kernel's cudaFuncSetAttribute calls) until it succeeds once on `device`,
// remembered in `done` (kMaxDevices entries, one array per kernel).
template <typename F>
cudaError_t OncePerDevice(std::atomic<bool>* done, int device, F&& opt_in) {
  const bool cached = device >= 0 && device < kMaxDevices;
  if (cached && done[device].load(std::memory_order_relaxed)) return cudaSuccess;
  const cudaError_t err = opt_in();
  if (err == cudaSuccess && cached) done[device].store(true, std::memory_order_relaxed);
  return err;
}

// Rows of x from which kAuto sends a call the Hopper kernel serves to it (below them the
// GEMV kernel). H100, M = 16, us: int4 8192 x 28672 73 against the staged kernel's 87; int8
// 97-109 against the GEMV kernel's ~132 (docs/perf/matmul.md).
constexpr int kWgmmaFromRows = 9;

// Whether the Hopper (wgmma) kernel can serve p: a build with sm_90a code, a compute
// capability 9.0 device, N a multiple of 16 and K of 8, a scale row per whole k tile
// (group_size a multiple of 64, or K), and 16-byte aligned x, scales and zeros (the copy
// engine's rule), y and the workspace (16-byte stores); `device` is the current device.
bool WgmmaEligible(const QLinearParams& p, int device);

// y = act(x w + bias) by the Hopper kernel (WgmmaEligible(p) must hold), plus the split-K
// reduction when K is split.
cudaError_t LaunchWgmma(const QLinearParams& p, cudaStream_t stream, int device, int sms);

// The split-K reduction: sums `splits` partial sums of p.workspace in split order into y,
// adding the bias and applying the activation (qlinear_kernels.cu).
cudaError_t LaunchSplitReduce(const QLinearParams& p, int splits, cudaStream_t stream, int device,
                              int sms);

}  // namespace jaxgpu::cuda::qlinear
