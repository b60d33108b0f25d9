// What the standalone attention checkers (tools/attention_ws_check.cu,
// tools/attention_ws_bwd_check.cu) share: a case's shape and position options, its name, and
// the AttentionParams fields they set.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "attention/attention_params.h"
#include "common/dtype.h"

namespace jaxgpu::check {

// B, T, S, K, R (query heads a kv head), H, the masks, softcap and dtype. The checkers'
// cases derive from it and add their segment-id options (brace-initialized flat: the
// base's fields first).
struct AttentionCase {
  int64_t b, t, s, k, r, h;
  bool causal = false;
  int64_t left = -1, right = -1;
  float softcap = 0.f;
  DType dtype = DType::kBF16;

  int64_t N() const { return k * r; }

  // "B.. T.. S.. K.. R.. H..[ causal][ window(l,r)][ softcap]".
  std::string ShapeName() const {
    std::string name = "B" + std::to_string(b) + " T" + std::to_string(t) + " S" +
                       std::to_string(s) + " K" + std::to_string(k) + " R" + std::to_string(r) +
                       " H" + std::to_string(h);
    if (causal) name += " causal";
    if (left >= 0 || right >= 0) {
      name += " window(" + std::to_string(left) + "," + std::to_string(right) + ")";
    }
    if (softcap > 0) name += " softcap";
    return name;
  }
  const char* DTypeName() const { return dtype == DType::kBF16 ? "bf16" : "f16"; }

  // The shape, the options and the default scale 1/sqrt(H); no buffers.
  AttentionParams ShapeParams() const {
    AttentionParams p{};
    p.dtype = dtype;
    p.batch = b;
    p.q_len = t;
    p.kv_len = s;
    p.kv_heads = k;
    p.group = r;
    p.head_dim = h;
    p.scale = float(1.0 / std::sqrt(double(h)));
    p.softcap = softcap;
    p.causal = causal;
    p.window_left = left;
    p.window_right = right;
    return p;
  }
};

}  // namespace jaxgpu::check
