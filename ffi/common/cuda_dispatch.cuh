// The dispatch vocabulary (common/dispatch.h) for CUDA launchers: each DType's device storage
// type, and cudaErrorInvalidValue for a value no case accepts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/dispatch.h"
#include "common/dtype.h"

namespace jaxgpu {

template <>
struct SwitchStatus<cudaError_t> {
  static constexpr cudaError_t Unknown() { return cudaErrorInvalidValue; }
};

namespace cuda {

// Two int4 elements in one byte, the first in the low nibble.
struct PackedInt4 {
  uint8_t bits;
};

template <DType>
struct CudaType;
template <>
struct CudaType<DType::kF32> {
  using type = float;
};
template <>
struct CudaType<DType::kBF16> {
  using type = __nv_bfloat16;
};
template <>
struct CudaType<DType::kF16> {
  using type = __half;
};
template <>
struct CudaType<DType::kS8> {
  using type = int8_t;
};
template <>
struct CudaType<DType::kU8> {
  using type = uint8_t;
};
template <>
struct CudaType<DType::kS4> {
  using type = PackedInt4;
};
template <>
struct CudaType<DType::kF8E4M3> {
  using type = __nv_fp8_e4m3;
};
template <>
struct CudaType<DType::kS32> {
  using type = int32_t;
};

}  // namespace cuda
}  // namespace jaxgpu

// `using T` = the device type of dtype, for dtype in the DTypeSet SET (e.g. kFloatDTypes);
// cudaErrorInvalidValue for any other dtype.
#define JAXGPU_DTYPE_SWITCH(dtype, T, SET, ...)                                           \
  ::jaxgpu::SwitchDType<(SET), ::jaxgpu::cuda::CudaType>((dtype), [&](auto _jaxgpu_tag) { \
    using T = typename std::decay_t<decltype(_jaxgpu_tag)>::type;                         \
    return __VA_ARGS__();                                                                 \
  })
