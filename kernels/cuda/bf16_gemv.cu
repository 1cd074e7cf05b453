#include <cuda_bf16.h>

#include <algorithm>

#include "common/error.h"
#include "cuda/bf16_gemv.h"
#include "cuda/pdl.cuh"
#include "cuda/ptx.cuh"
#include "cuda/rms.cuh"
#include "runtime/cuda/cuda_check.h"

// Dense projections of a decode step (1-8 rows of X): the weights are read
// once at HBM speed and the few X rows ride along as the MMA's n = 8 columns.
// cuBLASLt's kernels for these shapes reached ~1.8 TB/s on an H200 (split-K
// plus a reduce kernel, bench/results/2026-12-01-h200-run6.md).
//
// A block owns 16 rows of W and splits K over its 8 warps, chunk by chunk;
// each lane streams 16 bytes of two rows per 32-wide K chunk, kRing chunks in
// flight in registers. The K order inside a chunk is permuted identically for W and X
// (lane t's 8 consecutive elements feed MMA slots 2t, 2t+1, 2t+8, 2t+9 of two
// m16n8k16 steps), so both operands load as plain 16-byte words. Partial sums
// meet in shared memory in a fixed order (deterministic).

namespace dz::cuda {

namespace {

constexpr int kRing = 4;
// Warps a block: 8, or 32 where the rows leave most multiprocessors idle (a
// router's 32 rows: two blocks), so each warp's share of K is one ring's worth.
constexpr int kWarpsWide = 8, kWarpsNarrow = 32, kNarrowMaxRows = 512;

// X rows live in shared memory with a 16-byte pad per row (rows k * 2 bytes
// apart would put all 8 tokens of a load on the same banks).
__host__ __device__ inline int x_stride_u4(int k) { return k / 8 + 1; }

// kNorm: X is bf16(RMS norm of fp32 rows xf with weights nw), computed by
// every block as rms_norm computes it (256 threads, the same partition and
// order of the sums: the same bits), instead of a norm launch before.
struct GemvNorm {
  const float *xf = nullptr, *nw = nullptr;
  float eps = 0.f;
};

template <int kWarps, bool kNorm>
__global__ void __launch_bounds__(32 * kWarps)
    bf16_gemv_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w, const float* __restrict__ bias,
                     float* d, int m, int n, int k, float beta, GemvNorm nrm) {
  static_assert(!kNorm || kWarps == 8, "the norm's sums as rms_norm's 256 threads");
  extern __shared__ uint4 xs[];
  __shared__ float4 red[kWarps - 1][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16;
  const int rA = min(n0 + g, n - 1), rB = min(n0 + g + 8, n - 1);  // rows past n load a valid row, unused
  // Warp w takes chunks w, w + kWarps, ...: at each ring step the block's
  // warps read neighbouring chunks, so every row streams front to back.
  const int nchunk = k / 32, nloc = (nchunk - warp + kWarps - 1) / kWarps;
  auto chunk = [&](int j) { return warp + j * kWarps; };
  const uint4* wA = reinterpret_cast<const uint4*>(w + int64_t(rA) * k) + t;
  const uint4* wB = reinterpret_cast<const uint4*>(w + int64_t(rB) * k) + t;

  // The weights do not depend on the previous kernel: their first loads go out before waiting for it.
  uint4 ra[kRing], rb[kRing];
#pragma unroll
  for (int p = 0; p < kRing; ++p)
    if (p < nloc) ra[p] = ptx::ldg_nc_v4(wA + chunk(p) * 4), rb[p] = ptx::ldg_nc_v4(wB + chunk(p) * 4);
  pdl_wait();
  pdl_trigger();
  const int xsu = x_stride_u4(k);
  if constexpr (kNorm) {
    __shared__ float npart[kWarps][kBf16GemvMaxRows];
    const int n4 = k / 4;
    const float4* xf4 = reinterpret_cast<const float4*>(nrm.xf);
    for (int r = 0; r < m; ++r) {
      float ss = 0.f;
      for (int q = threadIdx.x; q < n4; q += 32 * kWarps) {
        ss += rms::sq4(xf4[r * n4 + q]);
      }
      ss = rms::warp_sum(ss);
      if (lane == 0) npart[warp][r] = ss;
    }
    __syncthreads();
    for (int r = 0; r < m; ++r) {
      const float inv = rms::inv_rms<kWarps>(&npart[0][r], kBf16GemvMaxRows, k, nrm.eps);
      for (int q = threadIdx.x; q < n4; q += 32 * kWarps)
        reinterpret_cast<uint2*>(xs + r * xsu)[q] =
            rms::to_bf16x4(rms::apply(xf4[r * n4 + q], reinterpret_cast<const float4*>(nrm.nw)[q], inv));
    }
  } else {
    for (int i = threadIdx.x; i < m * (k / 8); i += 32 * kWarps) {
      const int r = i / (k / 8), q = i - r * (k / 8);
      xs[r * xsu + q] = reinterpret_cast<const uint4*>(x + int64_t(r) * k)[q];
    }
  }
  __syncthreads();

  const uint4* xr = xs + min(g, m - 1) * xsu + t;  // token g's X row (tokens past m read the last row, unused)
  float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j0 = 0; j0 < nloc; j0 += kRing) {
#pragma unroll
    for (int p = 0; p < kRing; ++p) {
      const int j = j0 + p;
      if (j >= nloc) break;
      const uint4 xv = xr[chunk(j) * 4];
      ptx::mma_16816<true>(acc0, ra[p].x, rb[p].x, ra[p].y, rb[p].y, xv.x, xv.y);
      ptx::mma_16816<true>(acc1, ra[p].z, rb[p].z, ra[p].w, rb[p].w, xv.z, xv.w);
      if (j + kRing < nloc)
        ra[p] = ptx::ldg_nc_v4(wA + chunk(j + kRing) * 4), rb[p] = ptx::ldg_nc_v4(wB + chunk(j + kRing) * 4);
    }
  }
  float acc[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = acc0[j] + acc1[j];
  if (warp > 0) red[warp - 1][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int j = 0; j < kWarps - 1; ++j) {  // fixed order: deterministic
    const float4 v = red[j][lane];
    acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
  }
  // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8.
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = n0 + g + (j >> 1) * 8, tok = 2 * t + (j & 1);
    if (row >= n || tok >= m) continue;
    float v = acc[j] + (bias ? bias[row] : 0.f);
    float* o = d + int64_t(tok) * n + row;
    if (beta != 0.f) v += beta * *o;
    *o = v;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The kernels' dynamic shared-memory limit, raised once.
void set_smem_limits() {
  static const bool done = [] {
    for (auto f : {bf16_gemv_kernel<kWarpsWide, false>, bf16_gemv_kernel<kWarpsNarrow, false>,
                   bf16_gemv_kernel<kWarpsWide, true>})
      DZ_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kBf16GemvMaxSmem)));
    return true;
  }();
  (void)done;
}

}  // namespace

bool bf16_gemv_fits(const uint16_t* x, const uint16_t* w, int m, int n, int k) {
  return m >= 1 && m <= kBf16GemvMaxRows && n >= 1 && k >= 32 && k % 32 == 0 && aligned16(x) && aligned16(w) &&
         size_t(m) * x_stride_u4(k) * 16 <= kBf16GemvMaxSmem;
}

void bf16_gemv(const uint16_t* x, const uint16_t* w, const float* bias, float* d, int m, int n, int k, float beta,
               cudaStream_t s) {
  set_smem_limits();
  const size_t smem = size_t(m) * x_stride_u4(k) * 16;
  const bool narrow = n <= kNarrowMaxRows;
  launch_pdl(narrow ? bf16_gemv_kernel<kWarpsNarrow, false> : bf16_gemv_kernel<kWarpsWide, false>,
             dim3(unsigned((n + 15) / 16)), dim3(32 * (narrow ? kWarpsNarrow : kWarpsWide)), smem, s, x, w, bias, d, m,
             n, k, beta, GemvNorm{});
}

bool bf16_gemv_norm_fits(const float* x, const uint16_t* w, int m, int n, int k) {
  return m >= 1 && m <= kBf16GemvMaxRows && n > kNarrowMaxRows && k >= 32 && k % 32 == 0 && aligned16(x) &&
         aligned16(w) && size_t(m) * x_stride_u4(k) * 16 <= kBf16GemvMaxSmem;
}

void bf16_gemv_norm(const float* x, const float* norm_w, float eps, const uint16_t* w, const float* bias, float* d,
                    int m, int n, int k, cudaStream_t s) {
  check(bf16_gemv_norm_fits(x, w, m, n, k) && aligned16(norm_w), DZ_ERR_INVALID_ARGUMENT, "bf16_gemv_norm: m=", m,
        " n=", n, " k=", k, " (1..", kBf16GemvMaxRows, " rows, n > ", kNarrowMaxRows,
        ", k a multiple of 32, 16-byte aligned rows and weights)");
  set_smem_limits();
  const size_t smem = size_t(m) * x_stride_u4(k) * 16;
  launch_pdl(bf16_gemv_kernel<kWarpsWide, true>, dim3(unsigned((n + 15) / 16)), dim3(32 * kWarpsWide), smem, s,
             (const uint16_t*)nullptr, w, bias, d, m, n, k, 0.f, GemvNorm{x, norm_w, eps});
}

}  // namespace dz::cuda
