// nanobind module _jaxgpu_cpu: registrations() -> {FFI target name: handler capsule}.
// Target names are jaxgpu_<op>_<fwd|bwd>; jaxgpu/_ffi.py registers each for platform "cpu".
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "norm/norm_targets.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jaxgpu_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxgpu_rms_norm_fwd"] = Capsule(JaxgpuRmsNormFwdCpu);
    d["jaxgpu_rms_norm_bwd"] = Capsule(JaxgpuRmsNormBwdCpu);
    d["jaxgpu_layer_norm_fwd"] = Capsule(JaxgpuLayerNormFwdCpu);
    d["jaxgpu_layer_norm_bwd"] = Capsule(JaxgpuLayerNormBwdCpu);
    return d;
  });
  m.def("ffi_api_version", []() {
    return std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  });
}
