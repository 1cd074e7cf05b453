#include <cmath>

#include "cuda/logits.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kThreads = 512;

// (v, i) beats (bv, bi): larger, or equal at a lower index; NaNs never win
// and an empty best (bi < 0, bv NaN) loses to any number.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {
  return !isnan(v) && (bi < 0 || v > bv || (v == bv && i < bi));
}

// One block a row. Each thread walks its elements in increasing index order,
// so keeping the first of equal values and then breaking ties by index in the
// reduction gives the lowest index of the maximum.
__global__ void __launch_bounds__(kThreads)
    logits_argmax_copy_kernel(const float* logits, int V, float* const* dst, int32_t* argmax) {
  const int r = blockIdx.x;
  const float* row = logits + int64_t(r) * V;
  float* out = dst ? dst[r] : nullptr;
  float bv = NAN;
  int bi = -1;
  const bool vec =
      (V & 3) == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    float4* o4 = reinterpret_cast<float4*>(out);
    for (int q = threadIdx.x; q < V / 4; q += kThreads) {
      const float4 v = r4[q];
      if (o4) o4[q] = v;
      const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (beats(e[j], 4 * q + j, bv, bi)) bv = e[j], bi = 4 * q + j;
    }
  } else {
    for (int i = threadIdx.x; i < V; i += kThreads) {
      const float v = row[i];
      if (out) out[i] = v;
      if (beats(v, i, bv, bi)) bv = v, bi = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(~0u, bv, o);
    const int oi = __shfl_xor_sync(~0u, bi, o);
    if (beats(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kThreads / 32; ++w)
    if (beats(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
  argmax[r] = bi;
}

}  // namespace

void logits_argmax_copy(const float* logits, int rows, int V, float* const* dst, int32_t* argmax, cudaStream_t s) {
  if (rows <= 0) return;
  logits_argmax_copy_kernel<<<rows, kThreads, 0, s>>>(logits, V, dst, argmax);
  DZ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dz::cuda
