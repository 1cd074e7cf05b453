// FP8 E4M3 ("e4m3fn": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits;
// no infinities, S.1111.111 is NaN, largest finite 448) and the DeepSeek
// block-scaled weight format: W[n, k] = e4m3(q[n, k]) * scale_inv[n / 128, k / 128]
// with scale_inv F32 [ceil(rows / 128), ceil(cols / 128)] (the last block of a
// dimension may be partial).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dz::cpu {

constexpr float kE4M3Max = 448.0f;
constexpr int kFp8WeightBlock = 128;

// Exact value of an E4M3 byte (NaN for 0x7F / 0xFF).
float e4m3_to_f32(uint8_t b);
// Nearest E4M3 byte (ties to even), saturating at +-448; NaN maps to 0x7F.
uint8_t f32_to_e4m3(float x);
inline bool e4m3_is_nan(uint8_t b) { return (b & 0x7F) == 0x7F; }

// Decode row n (cols values) of a block-scaled FP8 weight of `cols` columns.
void fp8_block_decode_row(const uint8_t* q, const float* scale_inv, int64_t n, int64_t cols, float* out);
// The same with E8M0 scale bytes (scale 2^(b - 127)), as DeepSeek-V4 ships its FP8 weights.
void fp8_block_e8m0_decode_row(const uint8_t* q, const uint8_t* scale, int64_t n, int64_t cols, float* out);

// Quantise v[0..n) to E4M3 with one scale (the caller's block): scale =
// amax / 448, or the next power of two at or above it when pow2; an all-zero
// block gets scale 1. Writes n bytes and returns the scale (v ~= e4m3 * scale).
float fp8_quantize_block(const float* v, int64_t n, bool pow2, uint8_t* out);

}  // namespace dz::cpu
