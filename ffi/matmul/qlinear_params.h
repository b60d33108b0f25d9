// Weight-only quantized linear: the packed weight layout and the launch parameters shared
// by the CPU loops (qlinear_cpu.cc), the CUDA kernels (qlinear_kernels.cu) and the Python
// packer (jaxgpu/reference/matmul.py). No XLA or CUDA types.
//
// Math. y[g, m, n] = act(sum_k x[g, m, k] * w[k, n] + bias[n]) with the dequantized weight
//   w[k, n] = round_T((q[k, n] - z[k / group_size, n]) * s[k / group_size, n])
// in the compute dtype T of x (bfloat16 or float16; float32 on the CPU): q - z is an exact
// small integer, the product is rounded once to T, as jaxgpu.QuantizedWeight.dequantize(T)
// computes it. Products are accumulated in float32 (float64 on the CPU), bias is added in
// float32, the activation applied in float32, and y rounded once to T.
// q is unsigned in [0, 2^bits); z is the zero point, read from `zeros` (uint8, same shape
// as the scales) or, without zeros (symmetric quantization), the midpoint 2^(bits - 1).
//
// Packed layout, chosen for mma.sync m16n8k16 with the weight as the A operand (16 output
// features x 16 k): a tile is 16 features (n) x 64 k, and each of a warp's 32 lanes holds
// its A fragments for the tile's four k16 steps in 16 (int4) or 32 (int8) contiguous bytes:
// one or two 128-bit loads per lane, a warp reading 512 or 1024 contiguous bytes.
//   packed: int32 (KT, NT, 32 * kWordsPerLane(bits)), KT = ceil(K / 64), NT = ceil(N / 16);
//           word index lane * kWordsPerLane + word.
//   lane = 4 * gq + tq (gq in [0, 8), tq in [0, 4)); within a tile, feature r = 8 * h + gq
//   (h in {0, 1}) and k offset c = 16 * s + 8 * kh + 2 * tq + e (s in [0, 4) the k16
//   step, kh, e in {0, 1}): mma's fragment a_j, j = 4 kh + 2 h + e.
//   int4: word s of the lane, nibble 4 e + 2 kh + h (bits 4 * nibble ..): the nibbles
//         i and i + 4 of a word are the two halves of fragment register i (a bf16x2 pair
//         from one mask-and-or with 0x000f000f).
//   int8: word 2 s + kh of the lane, byte 2 h + e (bits 8 * byte ..).
// Positions past K or N (padding) hold q = 0; the kernels read x as 0 there and never
// write outputs past N.
//
// Scales and zeros: (Gw, K / group_size, N), group_size dividing K and either a multiple
// of 16 (every k16 step inside one group) or equal to K (one group per feature).
#pragma once

#include <cstdint>

#include "common/dtype.h"

#if defined(__CUDACC__)
#define JAXGPU_QLINEAR_HD __host__ __device__
#else
#define JAXGPU_QLINEAR_HD
#endif

namespace jaxgpu {

constexpr int kQTileN = 16;  // features per tile
constexpr int kQTileK = 64;  // k per tile

JAXGPU_QLINEAR_HD constexpr int QWordsPerLane(int bits) { return bits == 4 ? 4 : 8; }
JAXGPU_QLINEAR_HD constexpr int QWordsPerTile(int bits) { return 32 * QWordsPerLane(bits); }

// Word index (within a tile's 32 * QWordsPerLane words) and bit shift of the value at
// tile-local feature r in [0, 16) and k offset c in [0, 64).
struct QPackedPosition {
  int word;
  int shift;
};
JAXGPU_QLINEAR_HD inline constexpr QPackedPosition QPackedAt(int bits, int r, int c) {
  const int h = r / 8, gq = r % 8;
  const int s = c / 16, kh = (c % 16) / 8, tq = (c % 8) / 2, e = c % 2;
  const int lane = 4 * gq + tq;
  if (bits == 4) return {lane * 4 + s, 4 * (4 * e + 2 * kh + h)};
  return {lane * 8 + 2 * s + kh, 8 * (2 * h + e)};
}

// Activation after the bias (jaxgpu.linear's `activation`).
enum class QActivation : int32_t {
  kNone = 0,
  kRelu = 1,
  kGeluTanh = 2,  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
  kGeluErf = 3,   // 0.5 x (1 + erf(x / sqrt(2)))
  kSilu = 4,      // x / (1 + exp(-x))
};

struct QLinearParams {
  DType dtype;            // T: of x, scales, bias and y (bf16 or f16 on CUDA; also f32 on the CPU)
  int bits;               // 4 or 8
  int64_t groups;         // G: x (G, M, K), y (G, M, N)
  int64_t weight_groups;  // Gw: 1 (shared) or G, for packed, scales and zeros
  int64_t bias_groups;    // 1 or G; 0 without bias
  int64_t m, k, n;
  int64_t group_size;  // k per scale row
  QActivation activation;
  const void* x;             // (G, M, K) T
  const int32_t* packed;     // (Gw, KT, NT, QWordsPerTile(bits)) int32
  const void* scales;        // (Gw, K / group_size, N) T
  const uint8_t* zeros;      // (Gw, K / group_size, N) uint8, or null (midpoint)
  const void* bias;          // (bias_groups, N) T, or null
  void* y;                   // (G, M, N) T
  float* workspace;          // split-K partial sums (CUDA), or null
  int64_t workspace_floats;  // its size: the launcher uses at most this many
};

// The dense weight of a packed one: w (G, K, N) in `dtype` (T, that of the scales), the
// dequantization rule above (the large-M route of jaxgpu.linear: this, then the GEMM).
struct QDequantParams {
  DType dtype;
  int bits;
  int64_t groups;  // G: packed, scales, zeros and w all have it
  int64_t k, n;
  int64_t group_size;
  const int32_t* packed;  // (G, KT, NT, QWordsPerTile(bits))
  const void* scales;     // (G, K / group_size, N)
  const uint8_t* zeros;   // (G, K / group_size, N), or null (midpoint)
  void* w;                // (G, K, N)
};

JAXGPU_QLINEAR_HD inline int64_t QTilesK(int64_t k) { return (k + kQTileK - 1) / kQTileK; }
JAXGPU_QLINEAR_HD inline int64_t QTilesN(int64_t n) { return (n + kQTileN - 1) / kQTileN; }
inline int64_t QScaleRows(const QLinearParams& p) { return p.k / p.group_size; }

}  // namespace jaxgpu
