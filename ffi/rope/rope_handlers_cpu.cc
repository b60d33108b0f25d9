// CPU FFI handlers of the RoPE family: validate, then run rope_cpu.cc.
#include "rope/rope_handlers.h"

#include "rope/rope_cpu.h"
#include "rope/rope_targets.h"

namespace jaxgpu {
namespace {

template <bool kInverse>
ffi::Error RopeCpu(ffi::AnyBuffer x, ffi::AnyBuffer positions, ffi::Result<ffi::AnyBuffer> y,
                   double theta, int32_t rotary_dim, bool interleaved) {
  RopeParams p;
  JAXGPU_RETURN_IF_ERROR(
      MakeRopeParams(x, positions, y, theta, rotary_dim, interleaved, kInverse, &p));
  cpu::Rope(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxgpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRopeFwdCpu, jaxgpu::RopeCpu<false>,
                              JAXGPU_ROPE_BINDING(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgpuRopeBwdCpu, jaxgpu::RopeCpu<true>,
                              JAXGPU_ROPE_BINDING(xla::ffi::Ffi::Bind()));
