#include "cuda/hyper_connection.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxMix = (2 + kHcMaxStreams) * kHcMaxStreams;

__device__ double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

// One block a row: every thread sums its share of the row's squares and of its
// products with each of the m rows of fn; one exchange reduces all m + 1 sums.
template <int M>
__global__ void __launch_bounds__(kThreads) hc_pre_kernel(HcPre a) {
  const int r = blockIdx.x, n = a.n;
  const int64_t NH = int64_t(n) * a.hidden;
  const float* x = a.x + size_t(r) * NH;
  float ss = 0, acc[M];
#pragma unroll
  for (int j = 0; j < M; ++j) acc[j] = 0;
  for (int64_t i = threadIdx.x; i < NH; i += kThreads) {
    const float v = x[i];
    ss += v * v;
#pragma unroll
    for (int j = 0; j < M; ++j) acc[j] += v * a.fn[size_t(j) * NH + i];
  }
  __shared__ float part[M + 1][kWarps];
  __shared__ float wsh[kMaxMix];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
#pragma unroll
  for (int j = 0; j < M; ++j)
    for (int o = 16; o; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  if (lane == 0) {
    part[M][warp] = ss;
#pragma unroll
    for (int j = 0; j < M; ++j) part[j][warp] = acc[j];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum[M + 1];
    for (int j = 0; j <= M; ++j) {
      float t = 0;
      for (int w = 0; w < kWarps; ++w) t += part[j][w];
      sum[j] = t;
    }
    const float inv = rsqrtf(sum[M] / float(NH) + a.eps);
    float mix[M];
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

void hc_pre(const HcPre& a, cudaStream_t s) {
  if (a.n_rows <= 0) return;
  if (a.n < 1 || a.n > kHcMaxStreams)
    fail(DZ_ERR_UNSUPPORTED, "hc_pre: ", a.n, " streams (at most ", kHcMaxStreams, ")");
  const int m = a.head ? a.n : (2 + a.n) * a.n;
  switch (m) {
#define DZ_HC_CASE(M)                                  \
  case M:                                              \
    hc_pre_kernel<M><<<a.n_rows, kThreads, 0, s>>>(a); \
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
      fail(DZ_ERR_INTERNAL, "hc_pre: no kernel for ", m, " mix logits");
  }
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
