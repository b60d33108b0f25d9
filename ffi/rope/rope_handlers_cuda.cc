// CUDA FFI handlers of the RoPE family: validate, then launch rope_kernels.cu on XLA's
// stream. No syncs, no allocation: safe to capture in CUDA graphs (kCmdBufferCompatible).
#include <string>

#include "common/cuda_status.h"
#include "rope/rope_cuda.h"
#include "rope/rope_handlers.h"
#include "rope/rope_targets.h"

namespace jaxgpu {
namespace {

template <bool kInverse>
ffi::Error RopeCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer positions,
                    ffi::Result<ffi::AnyBuffer> y, double theta, int32_t rotary_dim,
                    bool interleaved) {
  RopeParams p;
  JAXGPU_RETURN_IF_ERROR(
      MakeRopeParams(x, positions, y, theta, rotary_dim, interleaved, kInverse, &p));
  return CudaStatus(cuda::LaunchRope(p, stream), "rope launch");
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

#define JAXGPU_ROPE_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRopeFwdCuda, jaxgpu::RopeCuda<false>,
                              JAXGPU_ROPE_BINDING(JAXGPU_ROPE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRopeBwdCuda, jaxgpu::RopeCuda<true>,
                              JAXGPU_ROPE_BINDING(JAXGPU_ROPE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
