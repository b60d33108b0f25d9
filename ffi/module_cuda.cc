// nanobind module _jaxgpu_cuda: registrations() -> {FFI target name: handler capsule}, for
// platform "CUDA". Imported by jaxgpu/_ffi.py only when JAX has a CUDA backend.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "norm/norm_targets.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

#ifndef JAXGPU_CUDA_ARCHS
#define JAXGPU_CUDA_ARCHS "unknown"
#endif

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jaxgpu_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxgpu_rms_norm_fwd"] = Capsule(JaxgpuRmsNormFwdCuda);
    d["jaxgpu_rms_norm_bwd"] = Capsule(JaxgpuRmsNormBwdCuda);
    d["jaxgpu_layer_norm_fwd"] = Capsule(JaxgpuLayerNormFwdCuda);
    d["jaxgpu_layer_norm_bwd"] = Capsule(JaxgpuLayerNormBwdCuda);
    return d;
  });
  m.def("cuda_architectures", []() { return std::string(JAXGPU_CUDA_ARCHS); });
  m.def("ffi_api_version", []() {
    return std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  });
}
