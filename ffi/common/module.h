// What both nanobind modules (_jaxgpu_cpu, _jaxgpu_cuda) define besides their handlers.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "common/dev_knobs.h"
#include "xla/ffi/api/c_api.h"

namespace jaxgpu {

template <typename Fn>
nanobind::capsule HandlerCapsule(Fn* fn) {
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

// What both modules report about their build: the XLA FFI API version the handlers were
// compiled against (a runtime older than it rejects them; `python -m jaxgpu info` compares it
// with jaxlib's), and whether the developer knobs (common/dev_knobs.h) are compiled in.
inline void DefineBuildInfo(nanobind::module_& m) {
  m.def("ffi_api_version", []() {
    return std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  });
  m.def("dev_knobs", []() { return kDevKnobs; });
}

}  // namespace jaxgpu
