// MXFP4 (OCP microscaling): E2M1 elements, one E8M0 scale byte per 32
// consecutive elements along K. Layout as in the published gpt-oss
// checkpoints: byte j of a 32-element group holds element 2j in its low
// nibble and element 2j+1 in its high nibble.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dz::cpu {

constexpr int kMxfp4Group = 32;       // elements per scale
constexpr int kMxfp4GroupBytes = 16;  // packed bytes per group
constexpr uint8_t kE8M0Nan = 0xFF;

// E2M1 code (bit 3 = sign) -> value: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
extern const float kE2M1[16];

// 2^(s-127) exactly (s = 0 gives the fp32 subnormal 2^-127). s must not be 0xFF (NaN).
float e8m0_to_float(uint8_t s);

// Index of the first 0xFF (NaN) scale byte among n, or SIZE_MAX if none.
size_t find_e8m0_nan(const uint8_t* scales, size_t n);

// Decode one row of k elements (k % 32 == 0): blocks k/2 bytes, scales k/32 bytes.
void mxfp4_decode_row(const uint8_t* blocks, const uint8_t* scales, int64_t k, float* out);

}  // namespace dz::cpu
