// Device pieces shared by the MoE kernels that decode gpt-oss's MXFP4
// experts in registers (moe.cu, moe_one_token.cu): bf16 and the token's
// power-of-two scale, the clamped SwiGLU, E2M1 -> fp16 without tables.
// Device code only.
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

}  // namespace dz::cuda
