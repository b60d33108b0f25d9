// Developer knobs: tuning overrides read from environment variables, for measuring
// alternatives on the GPU machine without rebuilding. Compiled in only under the CMake option
// JAXGPU_DEV_KNOBS (default OFF): a product build reads no environment, and every knob is
// its default (kDevKnobs is false, so the family's Tuned* helpers return before reading).
//
// A knob is "i1,i2,...[,word]": up to kDevKnobInts integers (0 or absent: the default), then
// an optional word naming a variant. Families read each knob once per process (a static),
// so a sweep runs one process per setting (e.g. benchmarks/bench_rope.py --sweep).
#pragma once

#include <array>

#ifndef JAXGPU_DEV_KNOBS
#define JAXGPU_DEV_KNOBS 0
#endif

#if JAXGPU_DEV_KNOBS
#include <cstdio>
#include <cstdlib>
#include <cstring>
#endif

namespace jaxgpu {

inline constexpr bool kDevKnobs = JAXGPU_DEV_KNOBS != 0;
inline constexpr int kDevKnobInts = 4;

struct DevKnob {
  std::array<int, kDevKnobInts> ints{};  // 0 where not given
  char word[16] = "";                    // "" where not given
};

// Knob `name` from the environment; all defaults in a product build.
inline DevKnob ReadDevKnob(const char* name) {
  DevKnob k;
#if JAXGPU_DEV_KNOBS
  const char* env = std::getenv(name);
  if (env == nullptr) return k;
  const char* s = env;
  for (int i = 0; i < kDevKnobInts && *s != '\0'; ++i) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end == s) break;  // not a number: the word
    k.ints[i] = static_cast<int>(v);
    s = *end == ',' ? end + 1 : end;
  }
  std::snprintf(k.word, sizeof(k.word), "%s", s);
  std::fprintf(stderr, "jaxgpu: developer knob %s=%s\n", name, env);
#else
  (void)name;
#endif
  return k;
}

// Says why a knob's value is ignored (a value no kernel was compiled for).
inline void DevKnobIgnored(const char* name, const char* why) {
#if JAXGPU_DEV_KNOBS
  std::fprintf(stderr, "jaxgpu: developer knob %s: %s, ignored\n", name, why);
#else
  (void)name;
  (void)why;
#endif
}

}  // namespace jaxgpu
