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
__global__ void __launch_bounds__(2 * D) kda_recurrent_kernel(const KdaRecurrent a) {
  constexpr int R = D / 2;
  __shared__ float qs[D], ks[D], decay[D];
  const int h = blockIdx.x, b = blockIdx.y, H = a.n_heads;
  const int j = threadIdx.x >> 1, r0 = (threadIdx.x & 1) * R;
  float* const S = a.state[b] + int64_t(h) * D * D;
  float s[R];
#pragma unroll
  for (int r = 0; r < R; ++r) s[r] = S[(r0 + r) * D + j];
  for (int64_t t = 0; t < a.n; ++t) {
    const int64_t row = (int64_t(b) * a.n + t) * a.ld + int64_t(h) * D;
    if (threadIdx.x < D) {
      const int c = threadIdx.x;
      qs[c] = a.q[row + c], ks[c] = a.k[row + c], decay[c] = expf(a.g[row + c]);
    }
    const float vj = a.v[row + j], beta = a.beta[(int64_t(b) * a.n + t) * H + h];
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
    if (r0 == 0) a.out[(int64_t(b) * a.n + t) * int64_t(H) * D + int64_t(h) * D + j] = o;
    __syncthreads();  // the next token overwrites q, k and the decays
  }
#pragma unroll
  for (int r = 0; r < R; ++r) S[(r0 + r) * D + j] = s[r];
}

}  // namespace

void kda_recurrent(const KdaRecurrent& a, cudaStream_t st) {
  check(a.head_dim == 64 || a.head_dim == 128, DZ_ERR_UNSUPPORTED, "CUDA KDA: head_dim ", a.head_dim, " (64 or 128)");
  check(a.n_heads > 0 && a.batch >= 0 && a.n >= 0, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA: ", a.n_heads, " heads, batch ",
        a.batch, ", ", a.n, " tokens");
  check(a.ld >= int64_t(a.n_heads) * a.head_dim, DZ_ERR_INVALID_ARGUMENT, "CUDA KDA: row stride ", a.ld,
        " below heads x head_dim");
  if (a.batch == 0 || a.n == 0) return;
  const dim3 grid(unsigned(a.n_heads), unsigned(a.batch));
  if (a.head_dim == 128)
    kda_recurrent_kernel<128><<<grid, 256, 0, st>>>(a);
  else
    kda_recurrent_kernel<64><<<grid, 128, 0, st>>>(a);
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
