#include <cuda_bf16.h>

#include "cuda/pdl.cuh"
#include "cuda/rope.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {
// One thread per item of a row: a rotated q pair, a rotated k pair stored to
// the KV page, or a v element copied there; blocks over the row's items (one
// block per row looped ~16 times and took ~6 us per decode-step layer).
constexpr int kRopeThreads = 256;

__global__ void __launch_bounds__(kRopeThreads)
    rope_store_kernel(float* __restrict__ qkv, int stride, const float* __restrict__ cosv,
                      const float* __restrict__ sinv, int n_heads, int n_kv, int D, uint8_t* __restrict__ kv_layer,
                      const int64_t* __restrict__ row_off) {
  pdl_wait();
  pdl_trigger();
  const int r = blockIdx.x, half = D / 2;
  const int p = blockIdx.y * kRopeThreads + threadIdx.x;
  const int nq = n_heads * half, nk = n_kv * half, nv = n_kv * D;
  if (p >= nq + nk + nv) return;
  float* q = qkv + size_t(r) * stride;
  const float* k = q + n_heads * D;
  const float* v = k + n_kv * D;
  __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(kv_layer + row_off[r]);  // K | V, bf16
  if (p >= nq + nk) {
    dst[n_kv * D + (p - nq - nk)] = __float2bfloat16_rn(v[p - nq - nk]);
    return;
  }
  const bool is_q = p < nq;
  const int pp = is_q ? p : p - nq, h = pp / half, i = pp % half;
  const float c = cosv[size_t(r) * half + i], s = sinv[size_t(r) * half + i];
  const float* src = (is_q ? q : k) + h * D;
  const float x1 = src[i], x2 = src[i + half];
  const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
  if (is_q) {
    q[h * D + i] = y1;
    q[h * D + i + half] = y2;
  } else {
    dst[h * D + i] = __float2bfloat16_rn(y1);
    dst[h * D + i + half] = __float2bfloat16_rn(y2);
  }
}
}  // namespace

void rope_qk_store_kv(float* qkv, int R, int stride, const float* cos, const float* sin, int n_heads, int n_kv, int D,
                      uint8_t* kv_layer, const int64_t* row_off, cudaStream_t s) {
  if (R <= 0) return;
  const int items = (n_heads + n_kv) * (D / 2) + n_kv * D;
  launch_pdl(rope_store_kernel, dim3(unsigned(R), unsigned((items + kRopeThreads - 1) / kRopeThreads)),
             dim3(kRopeThreads), 0, s, qkv, stride, cos, sin, n_heads, n_kv, D, kv_layer, row_off);
}

}  // namespace dz::cuda
