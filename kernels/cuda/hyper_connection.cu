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

// A block a row: the slices' sums, then (one thread) the weights with their
// Sinkhorn iterations in fp64 as the CPU, then the collapse.
__global__ void __launch_bounds__(kThreads) hc_finish_kernel(HcPre a, int S) {
  const int r = blockIdx.x, n = a.n, M = a.head ? n : (2 + n) * n;
  const int64_t NH = int64_t(n) * a.hidden;
  const float* x = a.x + size_t(r) * NH;
  __shared__ float wsh[kMaxMix], sum[kMaxMix + 1];
  for (int j = threadIdx.x; j <= M; j += kThreads) {
    float t = 0;
    for (int s = 0; s < S; ++s) t += a.partial[(size_t(r) * S + s) * (M + 1) + j];
    sum[j] = t;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float inv = rsqrtf(sum[M] / float(NH) + a.eps);
    float mix[kMaxMix];
    for (int j = 0; j < M; ++j) mix[j] = sum[j] * inv;
    const double eps = a.hc_eps;
    float* wo = a.w + size_t(r) * (a.head ? n : 2 * n + n * n);
    if (a.head) {
      for (int j = 0; j < n; ++j) wsh[j] = wo[j] = float(sigmoid_d(double(mix[j]) * a.scale[0] + a.base[j]) + eps);
    } else {
      for (int j = 0; j < n; ++j) {
        wsh[j] = wo[j] = float(sigmoid_d(double(mix[j]) * a.scale[0] + a.base[j]) + eps);
        wo[n + j] = float(2 * sigmoid_d(double(mix[n + j]) * a.scale[1] + a.base[n + j]));
      }
      double c[kHcMaxStreams * kHcMaxStreams];
      for (int j = 0; j < n; ++j) {
        double mx = -1e300, s = 0;
        for (int k = 0; k < n; ++k) {
          c[j * n + k] = double(mix[2 * n + j * n + k]) * a.scale[2] + a.base[2 * n + j * n + k];
          mx = fmax(mx, c[j * n + k]);
        }
        for (int k = 0; k < n; ++k) s += (c[j * n + k] = exp(c[j * n + k] - mx));
        for (int k = 0; k < n; ++k) c[j * n + k] = c[j * n + k] / s + eps;
      }
      for (int it = 0; it < a.sinkhorn_iters; ++it) {
        if (it > 0)
          for (int j = 0; j < n; ++j) {
            double s = 0;
            for (int k = 0; k < n; ++k) s += c[j * n + k];
            for (int k = 0; k < n; ++k) c[j * n + k] /= s + eps;
          }
        for (int k = 0; k < n; ++k) {
          double s = 0;
          for (int j = 0; j < n; ++j) s += c[j * n + k];
          for (int j = 0; j < n; ++j) c[j * n + k] /= s + eps;
        }
      }
      for (int i = 0; i < n * n; ++i) wo[2 * n + i] = float(c[i]);
    }
  }
  __syncthreads();
  float* col = a.col + size_t(r) * a.hidden;
  for (int64_t h = threadIdx.x; h < a.hidden; h += kThreads) {
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
  hc_finish_kernel<<<a.n_rows, kThreads, 0, s>>>(a, S);
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
