// Element types jaxgpu kernels understand, with no XLA or CUDA types, so that kernel
// files (.cu) and CPU implementations (.cc) can share launch parameters.
#pragma once

#include <cstdint>

namespace jaxgpu {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "unknown";
}

inline int64_t DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

}  // namespace jaxgpu
