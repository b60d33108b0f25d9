// Host helpers shared by every FFI handler: dtype mapping and buffer checks that return
// ffi::Error instead of crashing the process. Handlers validate every argument AND result
// buffer against what the kernel will read and write, even though the Python layer has
// already checked shapes: the handler is the last line of defence.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "common/dtype.h"

namespace jaxgpu {

namespace ffi = xla::ffi;

// Every DType, from XLA's element type (nullopt: none of ours).
inline std::optional<DType> DTypeOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::S8: return DType::kS8;
    case ffi::DataType::U8: return DType::kU8;
    case ffi::DataType::S4: return DType::kS4;
    case ffi::DataType::F8E4M3FN: return DType::kF8E4M3;
    case ffi::DataType::S32: return DType::kS32;
    default: return std::nullopt;
  }
}

// XLA's element type by its NumPy name, for error messages.
inline std::string DataTypeName(ffi::DataType t) {
  if (const std::optional<DType> d = DTypeOf(t)) return DTypeName(*d);
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U4: return "uint4";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return "XLA element type " + std::to_string(static_cast<int>(t));
  }
}

// `buf`'s element type as a DType of `accepted`, or an error naming the argument:
// "x: dtype must be float32, bfloat16 or float16, got int8".
inline ffi::Error CheckDType(const ffi::AnyBuffer& buf, DTypeSet accepted, const char* name,
                             DType* out) {
  const std::optional<DType> d = DTypeOf(buf.element_type());
  if (!d || !InDTypeSet(accepted, *d)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": dtype must be " +
                                       DTypeSetNames(accepted) + ", got " +
                                       DataTypeName(buf.element_type()));
  }
  *out = *d;
  return ffi::Error::Success();
}

// `buf` must hold `expected` elements of `dtype`.
inline ffi::Error CheckBuffer(const ffi::AnyBuffer& buf, ffi::DataType dtype, int64_t expected,
                              const char* name) {
  if (buf.element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(name) + ": unexpected element type " +
                                       DataTypeName(buf.element_type()) + " (expected " +
                                       DataTypeName(dtype) + ")");
  }
  if (static_cast<int64_t>(buf.element_count()) != expected) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expected " +
                                       std::to_string(expected) + " elements, got " +
                                       std::to_string(buf.element_count()));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckBuffer(ffi::Result<ffi::AnyBuffer>& buf, ffi::DataType dtype,
                              int64_t expected, const char* name) {
  return CheckBuffer(*buf, dtype, expected, name);
}

// Checks `buf` has the given dimensions exactly.
template <typename Buf>
ffi::Error CheckDims(const Buf& buf, std::initializer_list<int64_t> dims, const char* name) {
  auto got = buf.dimensions();
  bool ok = got.size() == dims.size();
  size_t i = 0;
  for (int64_t d : dims) {
    if (!ok) break;
    ok = got[i++] == d;
  }
  if (!ok) return ffi::Error::InvalidArgument(std::string(name) + ": unexpected shape");
  return ffi::Error::Success();
}

}  // namespace jaxgpu

#define JAXGPU_RETURN_IF_ERROR(expr) \
  do {                               \
    ::xla::ffi::Error _err = (expr); \
    if (_err.failure()) return _err; \
  } while (0)
