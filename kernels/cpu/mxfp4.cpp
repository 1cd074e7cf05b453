#include "cpu/mxfp4.h"

#include <cmath>
#include <cstring>

namespace dz::cpu {

const float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float e8m0_to_float(uint8_t s) {
  // ldexp is exact for every exponent here, including the subnormal 2^-127
  // (shifting s into the fp32 exponent field would turn s = 0 into 0).
  return std::ldexp(1.0f, int(s) - 127);
}

size_t find_e8m0_nan(const uint8_t* scales, size_t n) {
  const void* p = std::memchr(scales, kE8M0Nan, n);
  return p ? size_t(static_cast<const uint8_t*>(p) - scales) : SIZE_MAX;
}

void mxfp4_decode_row(const uint8_t* blocks, const uint8_t* scales, int64_t k, float* out) {
  const int64_t groups = k / kMxfp4Group;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = e8m0_to_float(scales[g]);
    const uint8_t* b = blocks + g * kMxfp4GroupBytes;
    float* o = out + g * kMxfp4Group;
    for (int j = 0; j < kMxfp4GroupBytes; ++j) {
      // E2M1 values times a power of two: every product is exact in fp32.
      o[2 * j] = kE2M1[b[j] & 0x0F] * s;
      o[2 * j + 1] = kE2M1[b[j] >> 4] * s;
    }
  }
}

}  // namespace dz::cpu
