// CUDA FFI handlers of the activation family: validate, then launch activation_kernels.cu
// on XLA's stream. No syncs and no allocation, so they are safe to capture in CUDA graphs
// (kCmdBufferCompatible).
#include <string>

#include "common/cuda_status.h"
#include "activation/activation_cuda.h"
#include "activation/activation_handlers.h"
#include "activation/activation_targets.h"

namespace jaxgpu {
namespace {

ffi::Error RunCuda(cudaStream_t stream, ffi::Error made, const ActParams& p) {
  if (made.failure()) return made;
  return CudaStatus(cuda::LaunchActivation(p, stream), "activation launch");
}

template <ActKind kKind>
ffi::Error UnaryFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  ActParams p;
  return RunCuda(stream, UnaryFwdParams(kKind, x, y, &p), p);
}

template <ActKind kKind>
ffi::Error UnaryBwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                        ffi::Result<ffi::AnyBuffer> dx) {
  ActParams p;
  return RunCuda(stream, UnaryBwdParams(kKind, x, dy, dx, &p), p);
}

ffi::Error GeluFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       bool approximate) {
  ActParams p;
  return RunCuda(stream, UnaryFwdParams(GeluKind(approximate), x, y, &p), p);
}

ffi::Error GeluBwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                       ffi::Result<ffi::AnyBuffer> dx, bool approximate) {
  ActParams p;
  return RunCuda(stream, UnaryBwdParams(GeluKind(approximate), x, dy, dx, &p), p);
}

ffi::Error SwigluFwdCuda(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                         ffi::Result<ffi::AnyBuffer> y) {
  ActParams p;
  return RunCuda(stream, GatedFwdParams(ActKind::kSilu, gate, up, y, &p), p);
}

ffi::Error SwigluBwdCuda(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                         ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dgate,
                         ffi::Result<ffi::AnyBuffer> dup) {
  ActParams p;
  return RunCuda(stream, GatedBwdParams(ActKind::kSilu, gate, up, dy, dgate, dup, &p), p);
}

ffi::Error GegluFwdCuda(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                        ffi::Result<ffi::AnyBuffer> y, bool approximate) {
  ActParams p;
  return RunCuda(stream, GatedFwdParams(GeluKind(approximate), gate, up, y, &p), p);
}

ffi::Error GegluBwdCuda(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                        ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dgate,
                        ffi::Result<ffi::AnyBuffer> dup, bool approximate) {
  ActParams p;
  return RunCuda(stream, GatedBwdParams(GeluKind(approximate), gate, up, dy, dgate, dup, &p), p);
}

}  // namespace
}  // namespace jaxgpu

using jaxgpu::ActKind;
namespace xffi = xla::ffi;

#define JAXGPU_CUDA_BIND() xffi::Ffi::Bind().Ctx<xffi::PlatformStream<cudaStream_t>>()
#define JAXGPU_CMD_BUFFER {xffi::Traits::kCmdBufferCompatible}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuReluFwdCuda, jaxgpu::UnaryFwdCuda<ActKind::kRelu>,
                              JAXGPU_ACT_UNARY_FWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuReluBwdCuda, jaxgpu::UnaryBwdCuda<ActKind::kRelu>,
                              JAXGPU_ACT_UNARY_BWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSigmoidFwdCuda, jaxgpu::UnaryFwdCuda<ActKind::kSigmoid>,
                              JAXGPU_ACT_UNARY_FWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSigmoidBwdCuda, jaxgpu::UnaryBwdCuda<ActKind::kSigmoid>,
                              JAXGPU_ACT_UNARY_BWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSiluFwdCuda, jaxgpu::UnaryFwdCuda<ActKind::kSilu>,
                              JAXGPU_ACT_UNARY_FWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSiluBwdCuda, jaxgpu::UnaryBwdCuda<ActKind::kSilu>,
                              JAXGPU_ACT_UNARY_BWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGeluFwdCuda, jaxgpu::GeluFwdCuda,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_UNARY_FWD_BINDING(JAXGPU_CUDA_BIND())),
    JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGeluBwdCuda, jaxgpu::GeluBwdCuda,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_UNARY_BWD_BINDING(JAXGPU_CUDA_BIND())),
    JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSwigluFwdCuda, jaxgpu::SwigluFwdCuda,
                              JAXGPU_ACT_GATED_FWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuSwigluBwdCuda, jaxgpu::SwigluBwdCuda,
                              JAXGPU_ACT_GATED_BWD_BINDING(JAXGPU_CUDA_BIND()), JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGegluFwdCuda, jaxgpu::GegluFwdCuda,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_GATED_FWD_BINDING(JAXGPU_CUDA_BIND())),
    JAXGPU_CMD_BUFFER);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxgpuGegluBwdCuda, jaxgpu::GegluBwdCuda,
    JAXGPU_ACT_APPROXIMATE_ATTR(JAXGPU_ACT_GATED_BWD_BINDING(JAXGPU_CUDA_BIND())),
    JAXGPU_CMD_BUFFER);
