#include "cpu/fp8.h"

#include <array>
#include <cmath>

#include "cpu/mxfp4_fold.h"

namespace dz::cpu {

namespace {
// Decoding is a table lookup; the values come from the one E4M3 definition (cpu/mxfp4_fold.h).
std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) t[size_t(b)] = float(e4m3_to_double(uint8_t(b)));
  return t;
}
const std::array<float, 256> kE4M3 = make_e4m3_table();
}  // namespace

float e4m3_to_f32(uint8_t b) { return kE4M3[b]; }

// float -> double is exact, so rounding the double rounds the float.
uint8_t f32_to_e4m3(float x) { return e4m3_from_double(double(x)); }

void fp8_block_decode_row(const uint8_t* q, const float* scale_inv, int64_t n, int64_t cols, float* out) {
  const int64_t kb = (cols + kFp8WeightBlock - 1) / kFp8WeightBlock;
  const uint8_t* row = q + size_t(n) * size_t(cols);
  const float* s = scale_inv + size_t(n / kFp8WeightBlock) * size_t(kb);
  for (int64_t b = 0; b < kb; ++b) {
    const float sc = s[b];
    const int64_t k0 = b * kFp8WeightBlock, k1 = k0 + kFp8WeightBlock < cols ? k0 + kFp8WeightBlock : cols;
    for (int64_t k = k0; k < k1; ++k) out[k] = kE4M3[row[k]] * sc;
  }
}

void fp8_block_e8m0_decode_row(const uint8_t* q, const uint8_t* scale, int64_t n, int64_t cols, float* out) {
  const int64_t kb = (cols + kFp8WeightBlock - 1) / kFp8WeightBlock;
  const uint8_t* row = q + size_t(n) * size_t(cols);
  const uint8_t* s = scale + size_t(n / kFp8WeightBlock) * size_t(kb);
  for (int64_t b = 0; b < kb; ++b) {
    const float sc = std::ldexp(1.0f, int(s[b]) - 127);
    const int64_t k0 = b * kFp8WeightBlock, k1 = k0 + kFp8WeightBlock < cols ? k0 + kFp8WeightBlock : cols;
    for (int64_t k = k0; k < k1; ++k) out[k] = kE4M3[row[k]] * sc;
  }
}

float fp8_quantize_block(const float* v, int64_t n, bool pow2, uint8_t* out) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  float scale = amax > 0 ? amax / kE4M3Max : 1.0f;
  if (pow2 && amax > 0) {  // the power of two at or above the scale, exactly (log2 may round a near one down)
    int e;
    const float f = std::frexp(scale, &e);  // scale = f 2^e, f in [0.5, 1)
    scale = std::ldexp(1.0f, f == 0.5f ? e - 1 : e);
  }
  // Divide (as DeepSeek's act_quant does) rather than multiply by a rounded reciprocal.
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_e4m3(v[i] / scale);
  return scale;
}

}  // namespace dz::cpu
