// Device pieces shared by the MoE kernels that decode gpt-oss's MXFP4
// experts in registers (moe.cu, moe_one_token.cu): the clamped SwiGLU, E2M1
// -> fp16 / E4M3 without tables, and the fixed scale of down's two-term E4M3
// activations. Device code only.
#pragma once
#include <cstdint>

#include "cuda/ptx.cuh"

namespace dz::cuda {

__device__ __forceinline__ float bf16_to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// The power of two that brings a row with largest magnitude amax into [-1, 1].
__device__ __forceinline__ float pow2_scale(float amax) {
  int ex = 0;
  frexpf(amax, &ex);  // amax = m * 2^ex, m in [0.5, 1)
  return amax > 0.f ? ldexpf(1.f, ex) : 1.f;
}

// gpt-oss's clamped SwiGLU. The fast division (~2 ulp; 0 once the
// denominator passes 2^126, where the quotient underflows anyway) keeps the
// FP8 path's SwiGLU + quantization pass off the instruction limit.
constexpr float kSwigluLimit = 7.f;
__device__ __forceinline__ float swiglu(float gate, float up) {
  gate = fminf(gate, kSwigluLimit);
  up = fminf(fmaxf(up, -kSwigluLimit), kSwigluLimit);
  return (up + 1.f) * __fdividef(gate, 1.f + __expf(-1.702f * gate));
}

// Nibbles j and j + 4 of w as fp16 pairs (low, high half), p[j] for j =
// 0..3: E2M1 bits placed at fp16 bits 15 and 11..9 are the code's value *
// 2^-14 exactly (the 0.5 code lands on the subnormal 2^-15), no table. By way
// of bytes: the even nibbles' fp16 high bytes in E, the odd ones' in O, then
// spread to half words: 11 instructions a word (15 placing each pair with its
// own shifts, before run 84).
__device__ __forceinline__ void w4_pairs(uint32_t w, uint32_t (&p)[4]) {
  const uint32_t E = ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u);
  const uint32_t O = ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);
  p[0] = ptx::prmt(E, 0u, 0x2404), p[2] = E & 0xFF00FF00u;
  p[1] = ptx::prmt(O, 0u, 0x2404), p[3] = O & 0xFF00FF00u;
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
