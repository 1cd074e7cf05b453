// The RMS norm's arithmetic, shared by every kernel that normalizes a row
// (rms_norm, the fused router, the q/k/v projection with its norm): the same
// expressions in the same order give the same bits, which the tests check
// with memcmp. Device code only.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace dz::cuda::rms {

// Sum of squares of four elements, added to a running sum in this order.
__device__ __forceinline__ float sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// Sum over the 32 lanes of a warp (every lane gets it).
__device__ __forceinline__ float warp_sum(float s) {
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// 1 / rms from the warps' partial sums part[0], part[stride], ... (kWarps of
// them, added in warp order by every thread) over n elements.
template <int kWarps>
__device__ __forceinline__ float inv_rms(const float* part, int stride, int n, float eps) {
  float tot = 0.f;
#pragma unroll
  for (int j = 0; j < kWarps; ++j) tot += part[j * stride];
  return rsqrtf(tot / float(n) + eps);
}

// w * (x * inv), elementwise.
__device__ __forceinline__ float4 apply(float4 x, float4 w, float inv) {
  return make_float4(w.x * (x.x * inv), w.y * (x.y * inv), w.z * (x.z * inv), w.w * (x.w * inv));
}

// Four floats as bf16 (round to nearest), packed in two words.
__device__ __forceinline__ uint2 to_bf16x4(float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

}  // namespace dz::cuda::rms
