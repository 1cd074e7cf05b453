#include <cuda_bf16.h>

#include "cuda/norm.h"
#include "cuda/pdl.cuh"
#include "cuda/rms.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

// One block per row. Rows of up to kNormThreads * 4 * kNormPer floats (H % 4 == 0)
// stay in registers: one load round trip for the row and the weights (issued
// before the PDL wait: they do not depend on the previous kernel), instead of
// a latency-bound loop per pass (~8 us per decode-step row before).
constexpr int kNormThreads = 256, kNormPer = 8;

__global__ void __launch_bounds__(kNormThreads)
    rms_norm_reg_kernel(const float* __restrict__ x, const int32_t* __restrict__ rows, int H,
                        const float* __restrict__ w, float eps, float* __restrict__ of,
                        __nv_bfloat16* __restrict__ ob) {
  const int n4 = H / 4;
  float4 wv[kNormPer], v[kNormPer];
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int q = threadIdx.x + j * kNormThreads;
    if (q < n4) wv[j] = reinterpret_cast<const float4*>(w)[q];
  }
  pdl_wait();
  pdl_trigger();
  const int i = blockIdx.x;
  const int r = rows ? rows[i] : i;
  const float4* xr = reinterpret_cast<const float4*>(x + size_t(r) * H);
  float ss = 0;
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int q = threadIdx.x + j * kNormThreads;
    if (q < n4) {
      v[j] = xr[q];
      ss += rms::sq4(v[j]);
    }
  }
  __shared__ float part[kNormThreads / 32];
  ss = rms::warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  const float inv = rms::inv_rms<kNormThreads / 32>(part, 1, H, eps);
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int q = threadIdx.x + j * kNormThreads;
    if (q >= n4) continue;
    const float4 o = rms::apply(v[j], wv[j], inv);
    if (of) reinterpret_cast<float4*>(of + size_t(i) * H)[q] = o;
    if (ob) reinterpret_cast<uint2*>(ob + size_t(i) * H)[q] = rms::to_bf16x4(o);
  }
}

// Any H: strided loops.
__global__ void rms_norm_kernel(const float* __restrict__ x, const int32_t* __restrict__ rows, int H,
                                const float* __restrict__ w, float eps, float* __restrict__ of,
                                __nv_bfloat16* __restrict__ ob) {
  pdl_wait();
  pdl_trigger();
  const int i = blockIdx.x;
  const int r = rows ? rows[i] : i;
  const float* xr = x + size_t(r) * H;
  float ss = 0;
  for (int k = threadIdx.x; k < H; k += blockDim.x) ss += xr[k] * xr[k];
  __shared__ float part[32];
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(part[0] / float(H) + eps);
  for (int k = threadIdx.x; k < H; k += blockDim.x) {
    const float v = w[k] * (xr[k] * inv);
    if (of) of[size_t(i) * H + k] = v;
    if (ob) ob[size_t(i) * H + k] = __float2bfloat16_rn(v);
  }
}

__global__ void add_kernel(float* __restrict__ y, const float* __restrict__ x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

__global__ void to_bf16_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ o, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    o[i] = __float2bfloat16_rn(x[i]);
}

unsigned grid_for(size_t n) { return unsigned(n / 256 + 1 < 4096 ? n / 256 + 1 : 4096); }

}  // namespace

void rms_norm(const float* x, const int32_t* rows, int n_rows, int H, const float* w, float eps, float* out_f32,
              uint16_t* out_bf16, cudaStream_t s) {
  if (n_rows <= 0) return;
  auto* ob = reinterpret_cast<__nv_bfloat16*>(out_bf16);
  if (H % 4 == 0 && H <= kNormThreads * 4 * kNormPer)
    launch_pdl(rms_norm_reg_kernel, dim3(unsigned(n_rows)), dim3(kNormThreads), 0, s, x, rows, H, w, eps, out_f32, ob);
  else
    launch_pdl(rms_norm_kernel, dim3(unsigned(n_rows)), dim3(256), 0, s, x, rows, H, w, eps, out_f32, ob);
}

void add_inplace(float* y, const float* x, size_t n, cudaStream_t s) {
  if (!n) return;
  add_kernel<<<grid_for(n), 256, 0, s>>>(y, x, n);
  DZ_CUDA_LAUNCH_CHECK();
}

void to_bf16(const float* x, uint16_t* out, size_t n, cudaStream_t s) {
  if (!n) return;
  to_bf16_kernel<<<grid_for(n), 256, 0, s>>>(x, reinterpret_cast<__nv_bfloat16*>(out), n);
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
