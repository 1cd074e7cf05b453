// Device pieces shared by the MoE kernels that run gpt-oss's experts on FP8
// tensor cores with the weights decoded in registers (moe.cu's W4A8 kernels,
// moe_one_token.cu): the clamped SwiGLU, E2M1 -> E4M3 without tables, and
// the fixed scale of down's two-term activations. Device code only.
#pragma once
#include <cstdint>

namespace dz::cuda {

// gpt-oss's clamped SwiGLU. The fast division (~2 ulp; 0 once the
// denominator passes 2^126, where the quotient underflows anyway) keeps the
// FP8 path's SwiGLU + quantization pass off the instruction limit.
constexpr float kSwigluLimit = 7.f;
__device__ __forceinline__ float swiglu(float gate, float up) {
  gate = fminf(gate, kSwigluLimit);
  up = fminf(fmaxf(up, -kSwigluLimit), kSwigluLimit);
  return (up + 1.f) * __fdividef(gate, 1.f + __expf(-1.702f * gate));
}

// A word's 8 E2M1 nibbles as E4M3 bytes, the even elements (0, 2, 4, 6) or
// the odd ones: E2M1 bits placed at E4M3 bits 7 and 4..2 are the value * 2^-6
// exactly (the 0.5 code lands on an E4M3 subnormal).
__device__ __forceinline__ uint32_t e2m1_even_to_e4m3(uint32_t w) {
  return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
}
__device__ __forceinline__ uint32_t e2m1_odd_to_e4m3(uint32_t w) {
  return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

// The down projection's activations as two E4M3 terms: gpt-oss's clamped
// SwiGLU is at most (7 + 1) * 7 = 56 in magnitude, so they take one fixed
// scale, 56 / 448 (E4M3's largest), instead of one a 128 values: E4M3 is as
// fine relative to each value either way, only values under 2^-6 * 56 / 448
// (0.002) meet its subnormals sooner (kW8DownLo), and with no reduction
// gate_up's epilogue writes down's images itself (w8_down_put): the launch
// between the projections that quantized them took 3.8 of 134 us (H200,
// 120b shapes, 8 tokens). The bound is gpt-oss's only: the plain SwiGLU
// (MoeActivation::kSilu) is unbounded, so the layer never runs the W4A8
// kernels for it (w8_chosen).
constexpr float kW8DownInv = 448.f / ((kSwigluLimit + 1.f) * kSwigluLimit);  // 8: a power of two
// Down's second term is stored times 16 (the MMA column's sum divided by it
// again): a remainder is at most half an E4M3 step of its first term (2^-4
// of it), so times 16 stays under 448, and values whose first term is
// subnormal (under 2^-6, 0.002 unscaled) keep 4 more bits than E4M3's
// subnormals would leave: an absolute error under 2^-14 / 8 a value.
constexpr float kW8DownLo = 16.f;

}  // namespace dz::cuda
