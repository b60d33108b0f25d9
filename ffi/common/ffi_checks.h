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

inline std::optional<DType> ToDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return std::nullopt;
  }
}

// `buf` must hold `expected` elements of `dtype`.
inline ffi::Error CheckBuffer(const ffi::AnyBuffer& buf, ffi::DataType dtype, int64_t expected,
                              const char* name) {
  if (buf.element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(name) + ": unexpected element type");
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

#define JAXGPU_RETURN_IF_ERROR(expr)           \
  do {                                         \
    ::xla::ffi::Error _err = (expr);           \
    if (_err.failure()) return _err;           \
  } while (0)
