#include <algorithm>

#include "cuda/hyper_connection.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxMix = (2 + kHcMaxStreams) * kHcMaxStreams;

__device__ double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

constexpr int kRows = 4;        // rows a block of hc_mix_kernel: each fn value loaded serves them all
constexpr int kMinSlice = 512;  // elements of n * hidden a block at least
constexpr int kTargetBlocks = 264;

int mix_count(const HcPre& a) { return a.head ? a.n : (2 + a.n) * a.n; }
int slices(const HcPre& a) {
  const int64_t NH = int64_t(a.n) * a.hidden, row_blocks = (a.n_rows + kRows - 1) / kRows;
  const int64_t most = std::max<int64_t>(1, NH / kMinSlice);
  return int(std::clamp<int64_t>((kTargetBlocks + row_blocks - 1) / row_blocks, 1, most));
}

// Block (row group, slice): each thread's share of the slice's squares and
// products with the m rows of fn for kRows rows; one exchange reduces them
// into partial[row][slice][m + 1] (the m dot products, then the squares).
template <int M>
__global__ void __launch_bounds__(kThreads) hc_mix_kernel(HcPre a, int64_t slice_len) {
  const int r0 = blockIdx.x * kRows, S = gridDim.y, nr = min(kRows, a.n_rows - r0);
  const int64_t NH = int64_t(a.n) * a.hidden, i0 = int64_t(blockIdx.y) * slice_len, i1 = min(NH, i0 + slice_len);
  float ss[kRows], acc[kRows][M];
#pragma unroll
  for (int q = 0; q < kRows; ++q) {
    ss[q] = 0;
#pragma unroll
    for (int j = 0; j < M; ++j) acc[q][j] = 0;
  }
  for (int64_t i = i0 + threadIdx.x; i < i1; i += kThreads) {
    float f[M];
#pragma unroll
    for (int j = 0; j < M; ++j) f[j] = a.fn[size_t(j) * NH + i];
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      if (q >= nr) break;
      const float v = a.x[size_t(r0 + q) * NH + i];
      ss[q] += v * v;
#pragma unroll
      for (int j = 0; j < M; ++j) acc[q][j] += v * f[j];
    }
  }
  __shared__ float part[kRows * (M + 1)][kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int q = 0; q < kRows; ++q) {
    if (q >= nr) break;
#pragma unroll
    for (int j = 0; j <= M; ++j) {
      float v = j < M ? acc[q][j] : ss[q];
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[q * (M + 1) + j][warp] = v;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < nr * (M + 1); e += kThreads) {
    float t = 0;
    for (int w = 0; w < kWarps; ++w) t += part[e][w];
    const int q = e / (M + 1), j = e % (M + 1);
    a.partial[(size_t(r0 + q) * S + blockIdx.y) * (M + 1) + j] = t;
  }
}

// Blocks (row, part of hidden): the slices' sums; the pre (and post) weights;
// then (V4's sublayers, not the head) block 0's warp 0 runs comb's Sinkhorn
// iterations in fp64 as the CPU (cpu::hc_weights) while every other warp
// collapses its block's part of the streams with the pre weights. comb's
// entry (j, k) a lane, each sum over a row or a column read by shuffles in the
// CPU's order, so every lane divides its own entry at once. (One thread
// forming all of it, then one block collapsing the row, took 75-99 us a call
// on an H100: 20 iterations of n^2 dependent fp64 divisions, then a block's
// loads one round trip after another.)
__global__ void __launch_bounds__(kThreads) hc_finish_kernel(HcPre a, int S, int64_t part_len) {
  const int r = blockIdx.x, n = a.n, M = a.head ? n : (2 + n) * n;
  const int64_t NH = int64_t(n) * a.hidden;
  const float* x = a.x + size_t(r) * NH;
  __shared__ float wsh[kMaxMix], sum[kMaxMix + 1];
  // Every block of a row adds the slices itself (S x (M + 1) values, from L2): no launch between.
  for (int j = threadIdx.x; j <= M; j += kThreads) {
    float t = 0;
    for (int s = 0; s < S; ++s) t += a.partial[(size_t(r) * S + s) * (M + 1) + j];
    sum[j] = t;
  }
  __syncthreads();
  const int l = int(threadIdx.x);
  const bool first = blockIdx.y == 0;
  const float inv = rsqrtf(sum[M] / float(NH) + a.eps);
  const double eps = a.hc_eps;
  float* wo = a.w + size_t(r) * (a.head ? n : 2 * n + n * n);
  if (l < n) {
    wsh[l] = float(sigmoid_d(double(sum[l] * inv) * a.scale[0] + a.base[l]) + eps);
    if (first) wo[l] = wsh[l];
    if (first && !a.head) wo[n + l] = float(2 * sigmoid_d(double(sum[n + l] * inv) * a.scale[1] + a.base[n + l]));
  }
  __syncthreads();
  const int c0 = first && !a.head ? 32 : 0;  // the threads that collapse: [c0, kThreads)
  if (l < c0) {
    const bool own = l < n * n;  // (the other lanes shadow entry 0)
    const int j = own ? l / n : 0, k = own ? l % n : 0, e = 2 * n + j * n + k;
    auto row_sum = [&](double v) {
      double t = 0;
      for (int q = 0; q < n; ++q) t += __shfl_sync(~0u, v, j * n + q);
      return t;
    };
    auto col_sum = [&](double v) {
      double t = 0;
      for (int q = 0; q < n; ++q) t += __shfl_sync(~0u, v, q * n + k);
      return t;
    };
    double c = double(sum[e] * inv) * a.scale[2] + a.base[e], mx = -1e300;
    for (int q = 0; q < n; ++q) mx = fmax(mx, __shfl_sync(~0u, c, j * n + q));
    c = exp(c - mx);
    c = c / row_sum(c) + eps;  // the row softmax
    for (int it = 0; it < a.sinkhorn_iters; ++it) {
      if (it > 0) c /= row_sum(c) + eps;
      c /= col_sum(c) + eps;
    }
    if (own) wo[2 * n + l] = float(c);
    return;
  }
  float* col = a.col + size_t(r) * a.hidden;
  const int64_t h1 = min(a.hidden, int64_t(blockIdx.y + 1) * part_len);
  for (int64_t h = int64_t(blockIdx.y) * part_len + l - c0; h < h1; h += kThreads - c0) {
    float s = 0;
    for (int j = 0; j < n; ++j) s += wsh[j] * x[j * a.hidden + h];
    col[h] = s;
  }
}

__global__ void hc_post_kernel(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w, int n,
                               int64_t hidden) {
  const int r = blockIdx.x;
  const int64_t h = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (h >= hidden) return;
  const float* wr = w + size_t(r) * (2 * n + n * n);
  float* xr = x + size_t(r) * n * hidden;
  float old[kHcMaxStreams];
  for (int j = 0; j < n; ++j) old[j] = xr[j * hidden + h];
  const float yv = y[size_t(r) * hidden + h];
  for (int k = 0; k < n; ++k) {
    float s = wr[n + k] * yv;
    for (int j = 0; j < n; ++j) s += wr[2 * n + j * n + k] * old[j];
    xr[k * hidden + h] = s;
  }
}

}  // namespace

size_t hc_pre_scratch_floats(const HcPre& a) {
  return a.n_rows <= 0 ? 0 : size_t(a.n_rows) * slices(a) * (mix_count(a) + 1);
}

void hc_pre(const HcPre& a, cudaStream_t s) {
  if (a.n_rows <= 0) return;
  if (a.n < 1 || a.n > kHcMaxStreams)
    fail(DZ_ERR_UNSUPPORTED, "hc_pre: ", a.n, " streams (at most ", kHcMaxStreams, ")");
  check(a.partial != nullptr, DZ_ERR_INTERNAL, "hc_pre: no scratch for the partial sums");
  const int S = slices(a);
  const int64_t NH = int64_t(a.n) * a.hidden, slice_len = (NH + S - 1) / S;
  const dim3 grid(unsigned((a.n_rows + kRows - 1) / kRows), unsigned(S));
  switch (mix_count(a)) {
#define DZ_HC_CASE(M)                                         \
  case M:                                                     \
    hc_mix_kernel<M><<<grid, kThreads, 0, s>>>(a, slice_len); \
    break;
    DZ_HC_CASE(1)
    DZ_HC_CASE(2)
    DZ_HC_CASE(3)
    DZ_HC_CASE(4)
    DZ_HC_CASE(8)
    DZ_HC_CASE(15)
    DZ_HC_CASE(24)
#undef DZ_HC_CASE
    default:
      fail(DZ_ERR_INTERNAL, "hc_pre: no kernel for ", mix_count(a), " mix logits");
  }
  DZ_CUDA_LAUNCH_CHECK();
  // The collapse spread over blocks of kThreads values (a decode step has one row: one block would load
  // the streams one round trip after another).
  const int parts = int(std::min<int64_t>(64, (a.hidden + kThreads - 1) / kThreads));
  const int64_t part_len = (a.hidden + parts - 1) / parts;
  hc_finish_kernel<<<dim3(unsigned(a.n_rows), unsigned(parts)), kThreads, 0, s>>>(a, S, part_len);
  DZ_CUDA_LAUNCH_CHECK();
}

void hc_post(float* x, const float* y, const float* w, int n_rows, int n, int64_t hidden, cudaStream_t s) {
  if (n_rows <= 0) return;
  if (n < 1 || n > kHcMaxStreams) fail(DZ_ERR_UNSUPPORTED, "hc_post: ", n, " streams (at most ", kHcMaxStreams, ")");
  const dim3 grid(unsigned(n_rows), unsigned((hidden + 255) / 256));
  hc_post_kernel<<<grid, 256, 0, s>>>(x, y, w, n, hidden);
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
