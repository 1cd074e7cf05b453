#include "cuda/rope.h"

#include "cuda/pdl.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {
__global__ void rope_store_kernel(float* __restrict__ qkv, int stride, const float* __restrict__ cosv,
                                  const float* __restrict__ sinv, int n_heads, int n_kv, int D,
                                  uint8_t* __restrict__ kv_layer, const int64_t* __restrict__ row_off) {
  pdl_wait();
  const int r = blockIdx.x, half = D / 2;
  float* q = qkv + size_t(r) * stride;
  const float* k = q + n_heads * D;
  const float* v = k + n_kv * D;
  const float* c = cosv + size_t(r) * half;
  const float* s = sinv + size_t(r) * half;
  for (int p = threadIdx.x; p < n_heads * half; p += blockDim.x) {
    const int h = p / half, i = p % half;
    float* x = q + h * D;
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
  float* dst = reinterpret_cast<float*>(kv_layer + row_off[r]);
  for (int p = threadIdx.x; p < n_kv * half; p += blockDim.x) {
    const int h = p / half, i = p % half;
    const float x1 = k[h * D + i], x2 = k[h * D + i + half];
    dst[h * D + i] = x1 * c[i] - x2 * s[i];
    dst[h * D + i + half] = x2 * c[i] + x1 * s[i];
  }
  for (int p = threadIdx.x; p < n_kv * D; p += blockDim.x) dst[n_kv * D + p] = v[p];
}
}  // namespace

void rope_qk_store_kv(float* qkv, int R, int stride, const float* cos, const float* sin, int n_heads, int n_kv,
                      int D, uint8_t* kv_layer, const int64_t* row_off, cudaStream_t s) {
  if (R <= 0) return;
  launch_pdl(rope_store_kernel, dim3(unsigned(R)), dim3(128), 0, s, qkv, stride, cos, sin, n_heads, n_kv, D, kv_layer,
             row_off);
}

}  // namespace dz::cuda
