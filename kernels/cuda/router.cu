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

__global__ void __launch_bounds__(32 * kRows) topk_kernel(const float* __restrict__ logits, int T, int E, int k,
                                                          int32_t* __restrict__ ids, float* __restrict__ w) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31, t = blockIdx.x * kRows + int(threadIdx.x >> 5);
  if (t >= T) return;
  const float* l = logits + size_t(t) * E;
  float v[8];  // E <= 256; NaN and missing entries are never picked before real ones
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = lane + 32 * i;
    const float x = e < E ? l[e] : -INFINITY;
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
    ids[size_t(t) * k + j] = sel[j];
    w[size_t(t) * k + j] = float(exp(double(val[j]) - double(val[0])) / sum);
  }
}
}  // namespace

void router_topk_softmax(const float* logits, int T, int E, int k, int32_t* ids, float* weights, cudaStream_t s) {
  check(E > 0 && E <= 256 && k > 0 && k <= 16 && k <= E, DZ_ERR_INVALID_ARGUMENT, "router_topk_softmax: E=", E,
        " k=", k, " (E <= 256, k <= 16)");
  if (T <= 0) return;
  launch_pdl(topk_kernel, dim3(unsigned((T + kRows - 1) / kRows)), dim3(32 * kRows), 0, s, logits, T, E, k, ids,
             weights);
}

}  // namespace dz::cuda
