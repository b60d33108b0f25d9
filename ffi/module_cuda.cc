// nanobind module _jaxgpu_cuda: registrations() -> {FFI target name: handler capsule}, for
// platform "CUDA". Imported by jaxgpu/_ffi.py only when JAX has a CUDA backend.
#include "common/module.h"
#include "jaxgpu_all_targets.h"

#ifndef JAXGPU_CUDA_ARCHS
#define JAXGPU_CUDA_ARCHS "unknown"
#endif

NB_MODULE(_jaxgpu_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
#define JAXGPU_ADD(name, stem) d[name] = jaxgpu::HandlerCapsule(stem##Cuda);
    JAXGPU_ALL_TARGETS(JAXGPU_ADD)
#undef JAXGPU_ADD
    return d;
  });
  m.def("cuda_architectures", []() { return std::string(JAXGPU_CUDA_ARCHS); });
  jaxgpu::DefineBuildInfo(m);
}
