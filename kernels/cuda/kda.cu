#include <cuda_bf16.h>

#include <cmath>

#include "common/error.h"
#include "cuda/kda.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

// Block (head, sequence); thread pair (j, half): value channel j, key
// channels [half D/2, half D/2 + D/2) of S[:, j] in registers (a whole column
// a thread would spill at D = 128), the two halves' dot products summed by a
// shuffle. Per token: S' = Diag(exp(g)) S, u = beta (v - S'^T k),
// S = S' + k u^T, o = S^T q, in the CPU's order of operations (fp32 here,
// where the CPU sums in double).
template <int D>
__global__ void __launch_bounds__(2 * D) kda_recurrent_kernel(const KdaRecurrent a, int64_t ld_g) {
  constexpr int R = D / 2;
  __shared__ float qs[D], ks[D], decay[D];
  const int h = blockIdx.x, b = blockIdx.y, H = a.n_heads;
  const int j = threadIdx.x >> 1, r0 = (threadIdx.x & 1) * R;
  const int64_t first = a.seq_first ? a.seq_first[b] : int64_t(b) * a.n;
  const int64_t n = a.seq_first ? a.seq_first[b + 1] - first : a.n;
  const int64_t at = a.state_offset + int64_t(h) * D * D;
  float* const S = a.state[b] + at;
  const float* const S0 = (a.state_in ? a.state_in[b] : a.state[b]) + at;
  if (n <= 0 && S0 == S) return;  // nothing to run, nothing to move
  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = S0[(r0 + r) * D + j];
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = first + t, x = row * a.ld + int64_t(h) * D;
    if (threadIdx.x < D) {
      const int c = threadIdx.x;
      qs[c] = a.q[x + c], ks[c] = a.k[x + c], decay[c] = expf(a.g[row * ld_g + int64_t(h) * D + c]);
    }
    const float vj = a.v[x + j], beta = a.beta[row * H + h];
    __syncthreads();
    float mem = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] *= decay[r0 + r], mem = fmaf(s[r], ks[r0 + r], mem);
    mem += __shfl_xor_sync(0xffffffffu, mem, 1);
    const float u = beta * (vj - mem);
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = fmaf(ks[r0 + r], u, s[r]), o = fmaf(s[r], qs[r0 + r], o);
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    if (r0 == 0) a.out[row * int64_t(H) * D + int64_t(h) * D + j] = o;
    __syncthreads();  // the next token overwrites q, k and the decays
  }
#pragma unroll
  for (int r = 0; r < R; ++r) S[(r0 + r) * D + j] = s[r];
}

constexpr int kConvThreads = 128;

// Thread (channel, chunk of a sequence's tokens, sequence): the K - 1
// previous inputs in registers (from the history for the first chunk, else
// from x), shifted along the chunk's tokens. The first chunk's thread, the
// only reader of the history, writes the new one after its reads (so in
// place works). Sums in the CPU's order, fp32.
template <int K>
__global__ void __launch_bounds__(kConvThreads) short_conv_silu_kernel(const KdaConv a, int64_t chunk) {
  const int64_t c = blockIdx.x * int64_t(kConvThreads) + threadIdx.x, C = a.channels;
  const int b = blockIdx.z;
  if (c >= C) return;
  const int64_t first = a.seq_first[b], n = a.seq_first[b + 1] - first;
  const int64_t t0 = int64_t(blockIdx.y) * chunk, t1 = t0 + chunk < n ? t0 + chunk : n;
  if (t0 > 0 && t0 >= n) return;  // (chunk 0 of a sequence with no tokens still passes its history on)
  const float* __restrict__ x = a.x + first * a.ld + c;
  float w[K], hist[K - 1];
#pragma unroll
  for (int i = 0; i < K; ++i) w[i] = a.w[c * K + i];
  const float* hin = a.hist_in[b] + a.hist_offset + c;
#pragma unroll
  for (int i = 0; i < K - 1; ++i) {  // input row t0 - (K - 1) + i
    const int64_t src = t0 - (K - 1) + i;
    hist[i] = src >= 0 ? x[src * a.ld] : hin[(K - 1 + src) * C];
  }
  float* __restrict__ y = a.y + first * a.ld + c;
#pragma unroll 4
  for (int64_t t = t0; t < t1; ++t) {
    const float xt = x[t * a.ld];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < K - 1; ++i) acc = fmaf(w[i], hist[i], acc);
    acc = fmaf(w[K - 1], xt, acc);
    y[t * a.ld] = acc / (1.f + expf(-acc));
#pragma unroll
    for (int i = 0; i < K - 2; ++i) hist[i] = hist[i + 1];
    hist[K - 2] = xt;
  }
  if (t0 != 0) return;
  // The new history: the last K - 1 rows of [history; x].
  float last[K - 1];
#pragma unroll
  for (int i = 0; i < K - 1; ++i) {
    const int64_t src = n - (K - 1) + i;
    last[i] = src >= 0 ? x[src * a.ld] : hin[(K - 1 + src) * C];
  }
  float* hout = a.hist_out[b] + a.hist_offset + c;
#pragma unroll
  for (int i = 0; i < K - 1; ++i) hout[i * C] = last[i];
}

// The per-head kernels: a warp a (row, head), a head's D <= 256 values held 8
// a lane (lane + 32 i) across the reduction and the rescale.
constexpr int kHeadPer = 8, kMaxHeadDim = 32 * kHeadPer, kHeadThreads = 256;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

// As cpu softplus: no overflow of exp for large x.
__device__ __forceinline__ float softplusf_(float x) { return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x)); }

__device__ __forceinline__ void l2_normalise(float* x, int D, int lane, float scale) {
  float v[kHeadPer], ss = 0.f;
#pragma unroll
  for (int i = 0; i < kHeadPer; ++i) {
    const int c = lane + 32 * i;
    v[i] = c < D ? x[c] : 0.f;
    ss = fmaf(v[i], v[i], ss);
  }
  const float s = scale / sqrtf(warp_sum(ss) + 1e-6f);
#pragma unroll
  for (int i = 0; i < kHeadPer; ++i)
    if (lane + 32 * i < D) x[lane + 32 * i] = v[i] * s;
}

// Warps whose (row, head) is past the end leave as a whole, so the shuffles
// see full warps.
__global__ void __launch_bounds__(kHeadThreads)
    kda_prepare_kernel(int H, int D, int64_t pairs, float* q, float* k, int64_t ld, float* g, int64_t ld_g,
                       const float* a_log, const float* dt_bias, float* beta, float qscale) {
  const int64_t p = (blockIdx.x * int64_t(kHeadThreads) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (p >= pairs) return;
  const int64_t r = p / H;
  const int h = int(p % H);
  l2_normalise(q + r * ld + int64_t(h) * D, D, lane, qscale);
  l2_normalise(k + r * ld + int64_t(h) * D, D, lane, 1.f);
  const float a = expf(a_log[h]);
  float* gh = g + r * ld_g + int64_t(h) * D;
  for (int c = lane; c < D; c += 32) gh[c] = -a * softplusf_(gh[c] + dt_bias[h * D + c]);
  if (lane == 0) beta[p] = sigmoidf_(beta[p]);  // p = r H + h
}

__global__ void __launch_bounds__(kHeadThreads)
    kda_output_gate_kernel(int H, int D, int64_t pairs, const float* o, const float* gate, int64_t ld_gate,
                           const float* w, float eps, __nv_bfloat16* out) {
  const int64_t p = (blockIdx.x * int64_t(kHeadThreads) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (p >= pairs) return;
  const int64_t r = p / H;
  const int h = int(p % H);
  const float* x = o + p * D;  // o rows are H*D contiguous: (r, h) at p D
  float v[kHeadPer], ss = 0.f;
#pragma unroll
  for (int i = 0; i < kHeadPer; ++i) {
    const int c = lane + 32 * i;
    v[i] = c < D ? x[c] : 0.f;
    ss = fmaf(v[i], v[i], ss);
  }
  const float inv = 1.f / sqrtf(warp_sum(ss) / float(D) + eps);
  const float* gt = gate + r * ld_gate + int64_t(h) * D;
#pragma unroll
  for (int i = 0; i < kHeadPer; ++i) {
    const int c = lane + 32 * i;
    if (c < D) out[p * D + c] = __float2bfloat16_rn(w[c] * (v[i] * inv) * sigmoidf_(gt[c]));
  }
}

unsigned head_blocks(int64_t pairs) { return unsigned((pairs + kHeadThreads / 32 - 1) / (kHeadThreads / 32)); }

}  // namespace

void kda_recurrent(const KdaRecurrent& a, cudaStream_t st) {
  const int D = a.head_dim;
  check(D == 16 || D == 32 || D == 64 || D == 128, DZ_ERR_UNSUPPORTED, "CUDA KDA: head_dim ", D,
        " (16, 32, 64 or 128)");
  check(a.n_heads > 0 && a.batch >= 0 && a.batch <= 65535 && a.n >= 0, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA: ", a.n_heads,
        " heads, batch ", a.batch, ", ", a.n, " tokens");
  const int64_t P = int64_t(a.n_heads) * D, ld_g = a.ld_g ? a.ld_g : a.ld;
  check(a.ld >= P, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA: row stride ", a.ld, " below heads x head_dim");
  check(ld_g >= P, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA: g row stride ", ld_g, " below heads x head_dim");
  check(a.state_offset >= 0, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA: state_offset ", a.state_offset);
  // Without seq_first or a separate input state, no tokens is nothing to do.
  if (a.batch == 0 || (a.n == 0 && !a.seq_first && !a.state_in)) return;
  const dim3 grid(unsigned(a.n_heads), unsigned(a.batch));
  switch (D) {
    case 128:
      kda_recurrent_kernel<128><<<grid, 256, 0, st>>>(a, ld_g);
      break;
    case 64:
      kda_recurrent_kernel<64><<<grid, 128, 0, st>>>(a, ld_g);
      break;
    case 32:
      kda_recurrent_kernel<32><<<grid, 64, 0, st>>>(a, ld_g);
      break;
    default:
      kda_recurrent_kernel<16><<<grid, 32, 0, st>>>(a, ld_g);
      break;
  }
  DZ_CUDA_LAUNCH_CHECK();
}

void kda_short_conv_silu(const KdaConv& a, cudaStream_t st) {
  check(a.kernel >= 2 && a.kernel <= 8, DZ_ERR_UNSUPPORTED, "CUDA KDA short conv: kernel ", a.kernel, " (2..8)");
  check(a.channels > 0 && a.batch >= 0 && a.batch <= 65535, DZ_ERR_INVALID_ARGUMENT,
        "CUDA KDA short conv: ", a.channels, " channels, batch ", a.batch);
  check(a.ld >= a.channels, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA short conv: row stride ", a.ld, " below channels ",
        a.channels);
  check(a.hist_offset >= 0, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA short conv: hist_offset ", a.hist_offset);
  if (a.batch == 0) return;
  check(a.seq_first && a.x && a.w && a.hist_in && a.hist_out && a.y, DZ_ERR_INVALID_ARGUMENT,
        "CUDA KDA short conv: seq_first, x, w, hist_in, hist_out and y are required");
  check(a.y != a.x, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA short conv: y may not alias x");
  // Chunks of 16 tokens where the longest sequence is known (a decode step: one).
  const int64_t chunk = a.max_tokens > 0 ? 16 : int64_t(1) << 40;
  const int64_t n_chunks = a.max_tokens > 0 ? (a.max_tokens + chunk - 1) / chunk : 1;
  check(n_chunks <= 65535, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA short conv: ", a.max_tokens, " tokens a sequence");
  const dim3 grid(unsigned((a.channels + kConvThreads - 1) / kConvThreads), unsigned(n_chunks), unsigned(a.batch));
  switch (a.kernel) {
    case 2:
      short_conv_silu_kernel<2><<<grid, kConvThreads, 0, st>>>(a, chunk);
      break;
    case 3:
      short_conv_silu_kernel<3><<<grid, kConvThreads, 0, st>>>(a, chunk);
      break;
    case 4:
      short_conv_silu_kernel<4><<<grid, kConvThreads, 0, st>>>(a, chunk);
      break;
    case 5:
      short_conv_silu_kernel<5><<<grid, kConvThreads, 0, st>>>(a, chunk);
      break;
    case 6:
      short_conv_silu_kernel<6><<<grid, kConvThreads, 0, st>>>(a, chunk);
      break;
    case 7:
      short_conv_silu_kernel<7><<<grid, kConvThreads, 0, st>>>(a, chunk);
      break;
    default:
      short_conv_silu_kernel<8><<<grid, kConvThreads, 0, st>>>(a, chunk);
      break;
  }
  DZ_CUDA_LAUNCH_CHECK();
}

void kda_prepare(int n_heads, int head_dim, int64_t n_rows, float* q, float* k, int64_t ld, float* g, int64_t ld_g,
                 const float* a_log, const float* dt_bias, float* beta, cudaStream_t st) {
  check(head_dim >= 1 && head_dim <= kMaxHeadDim, DZ_ERR_UNSUPPORTED, "CUDA KDA prepare: head_dim ", head_dim, " (1..",
        kMaxHeadDim, ")");
  check(n_heads > 0 && n_rows >= 0, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA prepare: ", n_heads, " heads, ", n_rows,
        " rows");
  const int64_t P = int64_t(n_heads) * head_dim;
  check(ld >= P && ld_g >= P, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA prepare: row strides ", ld, " (q, k), ", ld_g,
        " (g) below heads x head_dim ", P);
  if (n_rows == 0) return;
  const int64_t pairs = n_rows * n_heads;
  kda_prepare_kernel<<<head_blocks(pairs), kHeadThreads, 0, st>>>(
      n_heads, head_dim, pairs, q, k, ld, g, ld_g, a_log, dt_bias, beta, float(1.0 / std::sqrt(double(head_dim))));
  DZ_CUDA_LAUNCH_CHECK();
}

void kda_output_gate(int n_heads, int head_dim, int64_t n_rows, const float* o, const float* gate, int64_t ld_gate,
                     const float* w, float eps, uint16_t* out_bf16, cudaStream_t st) {
  check(head_dim >= 1 && head_dim <= kMaxHeadDim, DZ_ERR_UNSUPPORTED, "CUDA KDA output gate: head_dim ", head_dim,
        " (1..", kMaxHeadDim, ")");
  check(n_heads > 0 && n_rows >= 0, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA output gate: ", n_heads, " heads, ", n_rows,
        " rows");
  check(ld_gate >= int64_t(n_heads) * head_dim, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA output gate: gate row stride ",
        ld_gate, " below heads x head_dim");
  if (n_rows == 0) return;
  const int64_t pairs = n_rows * n_heads;
  kda_output_gate_kernel<<<head_blocks(pairs), kHeadThreads, 0, st>>>(n_heads, head_dim, pairs, o, gate, ld_gate, w,
                                                                      eps, reinterpret_cast<__nv_bfloat16*>(out_bf16));
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
