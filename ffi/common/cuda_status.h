// Shared by the CUDA FFI handlers: a kernel launch's cudaError_t as an ffi::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "common/ffi_checks.h"

namespace jaxgpu {

inline ffi::Error CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace jaxgpu
