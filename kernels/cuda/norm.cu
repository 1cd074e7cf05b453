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

// LayerNorm, one block per row held in registers (dim <= kLnThreads *
// kLnPer): the mean, then the sum of squared deviations from it (two passes,
// no cancellation in E[x^2] - mean^2), each a block sum that every thread
// finishes in the same order. x and y may alias: each thread writes only the
// elements it read, after both reductions.
constexpr int kLnThreads = 256, kLnPer = 32;

// Sum of v over the block (kLnThreads threads); every thread gets it. part:
// kLnThreads / 32 floats of shared memory, reusable when this returns.
__device__ __forceinline__ float block_sum(float v, float* part) {
  v = rms::warp_sum(v);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < kLnThreads / 32; ++j) t += part[j];
  __syncthreads();
  return t;
}

__global__ void __launch_bounds__(kLnThreads) layer_norm_kernel(const float* x, int dim, const float* __restrict__ w,
                                                                const float* __restrict__ b, float eps, float* y) {
  __shared__ float part[kLnThreads / 32];
  pdl_wait();
  pdl_trigger();
  const float* xr = x + size_t(blockIdx.x) * dim;
  float v[kLnPer];
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kLnPer; ++j) {
    const int q = threadIdx.x + j * kLnThreads;
    v[j] = q < dim ? xr[q] : 0.f;
    sum += v[j];
  }
  const float mean = block_sum(sum, part) / float(dim);
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < kLnPer; ++j) {
    const int q = threadIdx.x + j * kLnThreads;
    if (q < dim) {
      v[j] -= mean;
      sq += v[j] * v[j];
    }
  }
  const float inv = 1.f / sqrtf(block_sum(sq, part) / float(dim) + eps);
  float* yr = y + size_t(blockIdx.x) * dim;
#pragma unroll
  for (int j = 0; j < kLnPer; ++j) {
    const int q = threadIdx.x + j * kLnThreads;
    if (q >= dim) continue;
    float o = v[j] * inv;
    if (w) o *= w[q];
    if (b) o += b[q];
    yr[q] = o;
  }
}

// SwiGLU: blockIdx.x a chunk of 256 columns, rows blockIdx.y + k gridDim.y.
// silu in double, rounded to float, as cpu::glu computes it (the same bits
// before the bf16 rounding).
__global__ void silu_mul_kernel(const float* __restrict__ gu, int n_rows, int inter, int64_t ld, float limit,
                                __nv_bfloat16* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= inter) return;
  for (int r = blockIdx.y; r < n_rows; r += gridDim.y) {
    const float* row = gu + r * ld;
    float g = row[j], u = row[inter + j];
    if (limit > 0) g = fminf(g, limit), u = fminf(fmaxf(u, -limit), limit);
    const float sg = float(double(g) / (1.0 + exp(-double(g))));
    out[size_t(r) * inter + j] = __float2bfloat16_rn(sg * u);
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

void layer_norm(const float* x, int n_rows, int dim, const float* w, const float* b, float eps, float* y,
                cudaStream_t s) {
  check(dim > 0 && dim <= kLnThreads * kLnPer, DZ_ERR_UNSUPPORTED, "layer_norm: dim=", dim, " (at most ",
        kLnThreads * kLnPer, ")");
  if (n_rows <= 0) return;
  launch_pdl(layer_norm_kernel, dim3(unsigned(n_rows)), dim3(kLnThreads), 0, s, x, dim, w, b, eps, y);
}

void silu_mul(const float* gu, int n_rows, int inter, int64_t ld, uint16_t* out_bf16, cudaStream_t s, float limit) {
  check(inter >= 0 && ld >= 2 * int64_t(inter), DZ_ERR_INVALID_ARGUMENT, "silu_mul: inter=", inter, " ld=", ld);
  if (n_rows <= 0 || inter == 0) return;
  const dim3 grid(unsigned((inter + 255) / 256), unsigned(n_rows < 65535 ? n_rows : 65535));
  silu_mul_kernel<<<grid, 256, 0, s>>>(gu, n_rows, inter, ld, limit, reinterpret_cast<__nv_bfloat16*>(out_bf16));
  DZ_CUDA_LAUNCH_CHECK();
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
