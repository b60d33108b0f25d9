// Element types jaxgpu kernels understand, with no XLA or CUDA types, so that kernel
// files (.cu) and CPU implementations (.cc) can share launch parameters.
#pragma once

#include <cstdint>
#include <string>

namespace jaxgpu {

// The float storage types come first with their historical values (launch parameters hold
// a DType); the integer and 8-bit float types serve quantized kernels. kS4 packs two
// elements per byte, the first in the low nibble (XLA's layout of s4 buffers).
enum class DType : int32_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kS8 = 3,
  kU8 = 4,
  kS4 = 5,
  kF8E4M3 = 6,  // float8_e4m3fn: no infinities, one NaN encoding, max 448
  kS32 = 7,
};
constexpr int kNumDTypes = 8;

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kS8: return "int8";
    case DType::kU8: return "uint8";
    case DType::kS4: return "int4";
    case DType::kF8E4M3: return "float8_e4m3fn";
    case DType::kS32: return "int32";
  }
  return "unknown";
}

constexpr int DTypeBits(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kS32: return 32;
    case DType::kBF16:
    case DType::kF16: return 16;
    case DType::kS8:
    case DType::kU8:
    case DType::kF8E4M3: return 8;
    case DType::kS4: return 4;
  }
  return 0;
}

// Bytes that n elements occupy: ceil(n / 2) for packed int4.
constexpr int64_t DTypeBytes(DType t, int64_t n) { return (n * DTypeBits(t) + 7) / 8; }
static_assert(DTypeBytes(DType::kS4, 3) == 2 && DTypeBytes(DType::kF8E4M3, 3) == 3 &&
              DTypeBytes(DType::kBF16, 3) == 6 && DTypeBytes(DType::kS32, 3) == 12);

// A set of DTypes, one bit each: what a handler or a kernel accepts.
using DTypeSet = uint32_t;

constexpr DTypeSet DTypeBit(DType t) { return DTypeSet(1) << static_cast<int>(t); }
constexpr bool InDTypeSet(DTypeSet set, DType t) { return (set & DTypeBit(t)) != 0; }

// What the memory-bound kernels (norm, softmax, activations, rope, cross-entropy) take.
constexpr DTypeSet kFloatDTypes =
    DTypeBit(DType::kF32) | DTypeBit(DType::kBF16) | DTypeBit(DType::kF16);
// 16-bit floats: what the tensor-core (attention) kernels take.
constexpr DTypeSet kHalfDTypes = DTypeBit(DType::kBF16) | DTypeBit(DType::kF16);

// "float32, bfloat16 or float16": the members of `set` for an error message.
inline std::string DTypeSetNames(DTypeSet set) {
  std::string out;
  int left = 0;
  for (int i = 0; i < kNumDTypes; ++i) left += InDTypeSet(set, static_cast<DType>(i)) ? 1 : 0;
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType t = static_cast<DType>(i);
    if (!InDTypeSet(set, t)) continue;
    if (!out.empty()) out += left == 1 ? " or " : ", ";
    out += DTypeName(t);
    --left;
  }
  return out;
}

}  // namespace jaxgpu
