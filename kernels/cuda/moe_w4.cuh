// Device helpers shared by the MoE kernels that read MXFP4 experts with fp16
// activations (moe.cu's fused kernels, moe_one_token.cu).
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/ptx.cuh"

namespace dz::cuda {

__device__ __forceinline__ float bf16_to_float(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// 2^(s-127) for an E8M0 byte s in 0..254 (s = 0 is the fp32 subnormal 2^-127).
__device__ __forceinline__ float e8m0_to_float(int s) {
  return s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(uint32_t(s) << 23);
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

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

}  // namespace dz::cuda
