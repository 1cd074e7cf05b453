#include <cuda_bf16.h>

#include "common/error.h"
#include "cuda/pdl.cuh"
#include "cuda/router.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {
// One warp per row: each lane holds E / 32 logits, every pick is a warp
// argmax (the lower index wins ties, as in the CPU backend); the softmax over
// the k picks runs in double on lane 0. (One thread per row, scanning the
// logits k times, took ~5 us per decode step layer.)
constexpr int kRows = 4;  // rows (warps) per block

// Row t's top-k of E logits l (a warp; E <= 256, k <= 16) and the softmax
// over them (double, lane 0) into ids/w. L1-bypassing loads: the logits may
// have been written by other blocks of the same launch.
__device__ void topk_row(const float* l, int E, int k, int32_t* ids, float* w) {
  const int lane = threadIdx.x & 31;
  float v[8];  // NaN and missing entries are never picked before real ones
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = lane + 32 * i;
    const float x = e < E ? __ldcg(l + e) : -INFINITY;
    v[i] = x == x ? x : -INFINITY;
  }
  uint32_t taken = 0;  // bit i: entry lane + 32 i already picked
  int sel[16];
  float val[16];
  for (int j = 0; j < k; ++j) {
    float bv = -INFINITY;
    int be = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !(taken >> i & 1u) && (v[i] > bv || (v[i] == bv && e < be))) bv = v[i], be = e;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
    }
    if ((be & 31) == lane) taken |= 1u << (be >> 5);
    sel[j] = be;
    val[j] = bv;
  }
  if (lane != 0) return;
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += exp(double(val[j]) - double(val[0]));
  for (int j = 0; j < k; ++j) {
    ids[j] = sel[j];
    w[j] = float(exp(double(val[j]) - double(val[0])) / sum);
  }
}

__global__ void __launch_bounds__(32 * kRows) topk_kernel(const float* __restrict__ logits, int T, int E, int k,
                                                          int32_t* __restrict__ ids, float* __restrict__ w) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x * kRows + int(threadIdx.x >> 5);
  if (t >= T) return;
  topk_row(logits + size_t(t) * E, E, k, ids + size_t(t) * k, w + size_t(t) * k);
}

// A decode step's router in one launch (up to kFusedRows rows): RMS norm of
// the residual rows, the router's logits, top-k + softmax. Each block
// normalizes the rows itself (they are small) and takes kFusedWarps experts,
// a warp each, with the expert's weight row in registers (loaded before the
// PDL wait); the last block to finish (a ticket) picks the top k. Three
// launches before (norm, projection, top-k), ~9 us a layer on an H200.
constexpr int kFusedWarps = 8, kFusedRowU4 = 12;  // H <= 32 * 12 * 8 = 3072

__global__ void __launch_bounds__(32 * kFusedWarps)
    router_fused_kernel(const float* __restrict__ x, int T, int H, const float* __restrict__ nw, float eps,
                        const uint16_t* __restrict__ wr, const float* __restrict__ bias, int E, int k,
                        float* __restrict__ xn, float* logits, int32_t* __restrict__ ids, float* __restrict__ gw,
                        int32_t* ticket) {
  extern __shared__ float4 xs4[];  // normalized rows, rounded to bf16 as the projection's input: [T][H / 4]
  __shared__ float part[kFusedWarps][kRouterFusedMaxRows];
  __shared__ int last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n8 = H / 8, n4 = H / 4;
  const int e = blockIdx.x * kFusedWarps + warp;
  uint4 w[kFusedRowU4];
#pragma unroll
  for (int j = 0; j < kFusedRowU4; ++j) {
    const int q = lane + 32 * j;
    w[j] = e < E && q < n8 ? __ldg(reinterpret_cast<const uint4*>(wr + size_t(e) * H) + q) : make_uint4(0, 0, 0, 0);
  }
  pdl_wait();
  pdl_trigger();
  // Sums of squares (rows' float4 pieces strided over the block), as rms_norm.
  float ss[kRouterFusedMaxRows] = {};
  for (int q = threadIdx.x; q < n4; q += blockDim.x)
    for (int t = 0; t < T; ++t) {
      const float4 v = reinterpret_cast<const float4*>(x + size_t(t) * H)[q];
      ss[t] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  for (int t = 0; t < T; ++t) {
    for (int o = 16; o; o >>= 1) ss[t] += __shfl_xor_sync(0xffffffffu, ss[t], o);
    if (lane == 0) part[warp][t] = ss[t];
  }
  __syncthreads();
  // This block's share of xn (fp32, for the experts) and all of the bf16-rounded rows (shared memory).
  const int per = (n4 + gridDim.x - 1) / gridDim.x, q0 = blockIdx.x * per;
  for (int t = 0; t < T; ++t) {
    float tot = 0;
#pragma unroll
    for (int j = 0; j < kFusedWarps; ++j) tot += part[j][t];  // every thread, same order
    const float inv = rsqrtf(tot / float(H) + eps);
    for (int q = threadIdx.x; q < n4; q += blockDim.x) {
      const float4 v = reinterpret_cast<const float4*>(x + size_t(t) * H)[q];
      const float4 g = reinterpret_cast<const float4*>(nw)[q];
      const float4 o = make_float4(g.x * (v.x * inv), g.y * (v.y * inv), g.z * (v.z * inv), g.w * (v.w * inv));
      if (q >= q0 && q < q0 + per) reinterpret_cast<float4*>(xn + size_t(t) * H)[q] = o;
      xs4[t * n4 + q] =
          make_float4(__bfloat162float(__float2bfloat16_rn(o.x)), __bfloat162float(__float2bfloat16_rn(o.y)),
                      __bfloat162float(__float2bfloat16_rn(o.z)), __bfloat162float(__float2bfloat16_rn(o.w)));
    }
  }
  __syncthreads();
  if (e < E) {
    const float b = bias ? bias[e] : 0.f;
    for (int t = 0; t < T; ++t) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kFusedRowU4; ++j) {
        const int q = lane + 32 * j;
        if (q >= n8) break;
        const float4 a0 = xs4[t * n4 + 2 * q], a1 = xs4[t * n4 + 2 * q + 1];
        const uint32_t u[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
        const float xv[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc = fmaf(__uint_as_float(u[i] << 16), xv[2 * i], acc);
          acc = fmaf(__uint_as_float(u[i] & 0xFFFF0000u), xv[2 * i + 1], acc);
        }
      }
      for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) logits[size_t(t) * E + e] = acc + b;
    }
  }
  // The last block picks the experts once every block's logits are visible.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == int(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (warp < T) topk_row(logits + size_t(warp) * E, E, k, ids + size_t(warp) * k, gw + size_t(warp) * k);
  if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch (and graph replay)
}
}  // namespace

void router_topk_softmax(const float* logits, int T, int E, int k, int32_t* ids, float* weights, cudaStream_t s) {
  check(E > 0 && E <= 256 && k > 0 && k <= 16 && k <= E, DZ_ERR_INVALID_ARGUMENT, "router_topk_softmax: E=", E,
        " k=", k, " (E <= 256, k <= 16)");
  if (T <= 0) return;
  launch_pdl(topk_kernel, dim3(unsigned((T + kRows - 1) / kRows)), dim3(32 * kRows), 0, s, logits, T, E, k, ids,
             weights);
}

bool router_fused_fits(int T, int H, int E, int k) {
  return T >= 1 && T <= kRouterFusedMaxRows && H % 8 == 0 && H / 8 <= 32 * kFusedRowU4 && E > 0 && E <= 256 && k > 0 &&
         k <= 16 && k <= E;
}

void router_fused(const float* x, int T, int H, const float* norm_w, float eps, const uint16_t* w, const float* bias,
                  int E, int k, float* xn, float* logits, int32_t* ids, float* weights, int32_t* ticket,
                  cudaStream_t s) {
  check(router_fused_fits(T, H, E, k), DZ_ERR_INVALID_ARGUMENT, "router_fused: T=", T, " H=", H, " E=", E, " k=", k,
        " (T <= ", kRouterFusedMaxRows, ", H % 8 == 0 and H <= ", 8 * 32 * kFusedRowU4, ", E <= 256, k <= 16)");
  launch_pdl(router_fused_kernel, dim3(unsigned((E + kFusedWarps - 1) / kFusedWarps)), dim3(32 * kFusedWarps),
             size_t(T) * H * 4, s, x, T, H, norm_w, eps, w, bias, E, k, xn, logits, ids, weights, ticket);
}

}  // namespace dz::cuda
