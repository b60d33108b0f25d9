// nanobind module _jaxgpu_cpu: registrations() -> {FFI target name: handler capsule}.
// Target names are jaxgpu_<op>_<fwd|bwd>; jaxgpu/_ffi.py registers each for platform "cpu".
#include "common/module.h"
#include "jaxgpu_all_targets.h"

NB_MODULE(_jaxgpu_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict d;
#define JAXGPU_ADD(name, stem) d[name] = jaxgpu::HandlerCapsule(stem##Cpu);
    JAXGPU_ALL_TARGETS(JAXGPU_ADD)
#undef JAXGPU_ADD
    return d;
  });
  jaxgpu::DefineBuildInfo(m);
}
