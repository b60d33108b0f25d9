// CUDA FFI handlers of the softmax family: validate, then launch the kernels (softmax_cuda.h)
// on XLA's stream. No syncs and no allocation, so they are safe to capture in CUDA graphs
// (kCmdBufferCompatible).
#include <string>

#include "common/cuda_status.h"
#include "softmax/softmax_cuda.h"
#include "softmax/softmax_handlers.h"
#include "softmax/softmax_targets.h"

namespace jaxgpu {
namespace {

ffi::Error SoftmaxFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                          ffi::Result<ffi::AnyBuffer> y, float scale, bool causal, bool has_mask,
                          int64_t query_len) {
  SoftmaxFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeSoftmaxFwdParams(x, mask, y, scale, causal, has_mask, query_len, &p));
  return CudaStatus(cuda::LaunchSoftmaxFwd(p, stream), "softmax forward launch");
}

ffi::Error SoftmaxBwdCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy,
                          ffi::Result<ffi::AnyBuffer> dx, float scale, bool causal,
                          int64_t query_len) {
  SoftmaxBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeSoftmaxBwdParams(y, dy, dx, scale, causal, query_len, &p));
  return CudaStatus(cuda::LaunchSoftmaxBwd(p, stream), "softmax backward launch");
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

#define JAXGPU_SOFTMAX_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSoftmaxFwdCuda, jaxgpu::SoftmaxFwdCuda,
                              JAXGPU_SOFTMAX_FWD_BINDING(JAXGPU_SOFTMAX_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSoftmaxBwdCuda, jaxgpu::SoftmaxBwdCuda,
                              JAXGPU_SOFTMAX_BWD_BINDING(JAXGPU_SOFTMAX_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
