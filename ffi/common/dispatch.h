// Runtime value -> compile-time type or constant: one instantiation of a body per case.
// Every switch lists the cases it accepts, and a value outside them is an error returned to
// the caller, never a fall-through to some default case: an int8 buffer reaching a float
// kernel, or a vector count no kernel was compiled for, fails the launch instead of running
// the wrong instantiation on it.
//
//   return JAXGPU_DTYPE_SWITCH(p.dtype, T, kFloatDTypes, [&] {       // common/cuda_dispatch.cuh
//     return JAXGPU_INT_SWITCH(c.vpt, VPT, (2, 4, 8), [&] {
//       return JAXGPU_BOOL_SWITCH(p.causal, kCausal, [&] { return Launch<T, VPT, kCausal>(p); });
//     });
//   });
//
// A body returns a status type (cudaError_t in kernel launchers); the switch returns the
// body's status, or SwitchStatus<R>::Unknown() for a value with no case. No CUDA types here:
// CPU code may switch too (with a SwitchStatus for its own status type).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/dtype.h"

namespace jaxgpu {

template <typename T>
struct TypeTag {
  using type = T;
};

template <auto V>
struct ValueTag {
  static constexpr auto value = V;
};

// The status a switch returns for a value with no case. Specialized per status type:
// cudaError_t in common/cuda_dispatch.cuh.
template <typename R>
struct SwitchStatus {
  static_assert(sizeof(R) == 0,
                "a switch body must return a status type with a SwitchStatus specialization");
};

namespace dispatch_detail {

template <typename R, typename Fn, typename Tag>
bool Try(bool hit, Fn& fn, Tag tag, R& out) {
  if (hit) out = fn(tag);
  return hit;
}

template <int kFirst, int... kRest>
constexpr int First() {
  return kFirst;
}

constexpr DType FirstDType(DTypeSet set) {
  int i = 0;
  while (i < kNumDTypes && !InDTypeSet(set, static_cast<DType>(i))) ++i;
  return static_cast<DType>(i);
}

template <DTypeSet kSet, template <DType> class TypeOf, DType kCase, typename R, typename Fn>
bool TryDType(DType t, Fn& fn, R& out) {
  if constexpr (InDTypeSet(kSet, kCase)) {
    return Try(t == kCase, fn, TypeTag<typename TypeOf<kCase>::type>{}, out);
  } else {
    return false;
  }
}

template <DTypeSet kSet, template <DType> class TypeOf, typename Fn, int... kIndex>
auto SwitchDType(DType t, Fn& fn, std::integer_sequence<int, kIndex...>) {
  using R = decltype(fn(TypeTag<typename TypeOf<FirstDType(kSet)>::type>{}));
  R out = SwitchStatus<R>::Unknown();
  (TryDType<kSet, TypeOf, static_cast<DType>(kIndex)>(t, fn, out) || ...);
  return out;
}

}  // namespace dispatch_detail

// fn(ValueTag<v>{}) for the case v == value among kCases; SwitchStatus::Unknown() otherwise.
template <int... kCases, typename Fn>
auto SwitchInt(int64_t value, Fn&& fn) {
  static_assert(sizeof...(kCases) > 0, "a switch needs at least one case");
  using R = decltype(fn(ValueTag<dispatch_detail::First<kCases...>()>{}));
  R out = SwitchStatus<R>::Unknown();
  (dispatch_detail::Try(value == kCases, fn, ValueTag<kCases>{}, out) || ...);
  return out;
}

// fn(TypeTag<TypeOf<t>::type>{}) for t in kSet; SwitchStatus::Unknown() otherwise.
template <DTypeSet kSet, template <DType> class TypeOf, typename Fn>
auto SwitchDType(DType t, Fn&& fn) {
  static_assert(kSet != 0, "a switch needs at least one case");
  return dispatch_detail::SwitchDType<kSet, TypeOf>(t, fn,
                                                    std::make_integer_sequence<int, kNumDTypes>{});
}

}  // namespace jaxgpu

#define JAXGPU_DISPATCH_UNPAREN(...) __VA_ARGS__

// `constexpr int NAME` = expr, for expr in the parenthesized list CASES, e.g. (2, 4, 8):
// vector counts, head dims, unrolls.
#define JAXGPU_INT_SWITCH(expr, NAME, CASES, ...)                                    \
  ::jaxgpu::SwitchInt<JAXGPU_DISPATCH_UNPAREN CASES>((expr), [&](auto _jaxgpu_tag) { \
    constexpr int NAME = std::decay_t<decltype(_jaxgpu_tag)>::value;                 \
    return __VA_ARGS__();                                                            \
  })

// `constexpr bool NAME` = cond (both cases exist: no unknown value).
#define JAXGPU_BOOL_SWITCH(cond, NAME, ...) \
  [&] {                                     \
    if (cond) {                             \
      constexpr bool NAME = true;           \
      return __VA_ARGS__();                 \
    } else {                                \
      constexpr bool NAME = false;          \
      return __VA_ARGS__();                 \
    }                                       \
  }()
