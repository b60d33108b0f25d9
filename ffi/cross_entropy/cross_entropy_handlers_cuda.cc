// CUDA FFI handlers of the cross-entropy family: validate, then launch
// cross_entropy_kernels.cu on XLA's stream. No syncs and no allocation (the kernels need no
// scratch), so the handlers are safe to capture in CUDA graphs (kCmdBufferCompatible).
#include <string>

#include "common/cuda_status.h"
#include "cross_entropy/cross_entropy_cuda.h"
#include "cross_entropy/cross_entropy_handlers.h"
#include "cross_entropy/cross_entropy_targets.h"

namespace jaxgpu {
namespace {

ffi::Error CrossEntropyFwdCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                               ffi::Result<ffi::AnyBuffer> loss, ffi::Result<ffi::AnyBuffer> lse,
                               int32_t ignore_index, bool has_ignore, float label_smoothing,
                               float softcap) {
  CrossEntropyFwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeCrossEntropyFwdParams(logits, labels, loss, lse, ignore_index,
                                                   has_ignore, label_smoothing, softcap, &p));
  return CudaStatus(cuda::LaunchCrossEntropyFwd(p, stream), "cross_entropy forward launch");
}

ffi::Error CrossEntropyBwdCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::AnyBuffer labels,
                               ffi::AnyBuffer lse, ffi::AnyBuffer dloss,
                               ffi::Result<ffi::AnyBuffer> dlogits, int32_t ignore_index,
                               bool has_ignore, float label_smoothing, float softcap) {
  CrossEntropyBwdParams p;
  JAXGPU_RETURN_IF_ERROR(MakeCrossEntropyBwdParams(
      logits, labels, lse, dloss, dlogits, ignore_index, has_ignore, label_smoothing, softcap, &p));
  return CudaStatus(cuda::LaunchCrossEntropyBwd(p, stream), "cross_entropy backward launch");
}

}  // namespace
}  // namespace jaxgpu

namespace xffi = xla::ffi;

#define JAXGPU_CE_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuCrossEntropyFwdCuda, jaxgpu::CrossEntropyFwdCuda,
                              JAXGPU_CROSS_ENTROPY_FWD_BINDING(JAXGPU_CE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuCrossEntropyBwdCuda, jaxgpu::CrossEntropyBwdCuda,
                              JAXGPU_CROSS_ENTROPY_BWD_BINDING(JAXGPU_CE_CUDA_BIND()),
                              {xffi::Traits::kCmdBufferCompatible});
