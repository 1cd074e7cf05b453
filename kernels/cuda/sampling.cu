#include <climits>
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "common/error.h"
#include "cuda/sampling.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kPer = kBins / kThreads;  // bins a thread scans
constexpr int kIdxBits = 24;
constexpr int kOrderBits = 32 + kIdxBits;
constexpr float kOne = 274877906944.0f;  // 2^38, the largest logit's weight: a row's total stays below 2^62
static_assert(kBins % kThreads == 0 && kMaxSampleVocab == 1 << kIdxBits);

using Scan = cub::BlockScan<unsigned long long, kThreads>;

// The candidates' order as one integer, larger first: the logit's bits made
// monotone (+0 and -0 one value), then the index reversed (lower first on ties).
__device__ __forceinline__ uint64_t order_of(float l, int i) {
  const uint32_t b = __float_as_uint(l == 0.f ? 0.f : l);
  const uint32_t key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t(key) << kIdxBits) | uint32_t(kMaxSampleVocab - 1 - i);
}

// exp((l - mx) / T) in units of 2^-38, k = log2(e) / T; exactly kOne at the
// largest logit, also where that is infinite.
__device__ __forceinline__ uint64_t weight_of(float l, float mx, float k) {
  return l == mx ? uint64_t(kOne) : __float2ull_rn(exp2f((l - mx) * k) * kOne);
}

// f(logit, index) for every index of the row this thread takes, several
// loads in flight (16-byte ones where the row allows); indices past the end
// come as NaN, which every caller skips.
template <class F>
__device__ __forceinline__ void for_each_logit(const float* row, int V, F&& f) {
  constexpr int U = 4;
  const int t = threadIdx.x;
  if ((V & 3) == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int n4 = V >> 2;
    for (int q0 = t; q0 < n4; q0 += kThreads * U) {
      float4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int q = q0 + u * kThreads;
        x[u] = q < n4 ? __ldg(r4 + q) : make_float4(NAN, NAN, NAN, NAN);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = 4 * (q0 + u * kThreads);
        f(x[u].x, i), f(x[u].y, i + 1), f(x[u].z, i + 2), f(x[u].w, i + 3);
      }
    }
  } else {
    for (int i0 = t; i0 < V; i0 += kThreads * U) {
      float x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = i0 + u * kThreads < V ? __ldg(row + i0 + u * kThreads) : NAN;
#pragma unroll
      for (int u = 0; u < U; ++u) f(x[u], i0 + u * kThreads);
    }
  }
}

// What a search stops at: the first candidate at which the running count
// reaches kth, the running mass reaches target, or the mass passes target.
enum Goal : int { kCount, kMassReaches, kMassPasses };

struct Shared {
  unsigned long long mass[kBins];
  unsigned cnt[kBins];
  unsigned lowest[kBins];  // each bin's lowest index: the candidate itself when it is alone
  Scan::TempStorage scan;
  float wmax[kThreads / 32];
  unsigned wcnt[kThreads / 32];
  int first, last;            // the pass's chosen bin, as positions largest first
  unsigned long long before;  // the count or mass of the bins ahead of it
  unsigned sel_cnt, sel_low;
};

// The first candidate in order among those with order >= lo (the ones kept
// so far) at which `goal` holds, or the last one if it never does (a draw
// rounded up to the total). A radix search on the order value, one 11-bit
// digit a pass over the row, each pass counting (and weighing) the candidates
// that share the digits chosen so far; it ends at the pass whose chosen bin
// holds one candidate. `frac` of the candidates' total mass is the target.
__device__ __noinline__ int search(Shared& sh, const float* row, int V, uint64_t lo, float mx, float k, Goal goal,
                                   double frac, uint64_t kth, uint64_t* order) {
  const int t = threadIdx.x;
  uint64_t prefix = 0, mask = 0, acc = 0;
  double target = 0;
  for (int hi = kOrderBits; hi > 0;) {
    const int width = min(kDigitBits, hi), shift = hi - width;
    hi = shift;
    for (int b = t; b < kBins; b += kThreads) sh.mass[b] = 0, sh.cnt[b] = 0, sh.lowest[b] = ~0u;
    if (t == 0) sh.first = INT_MAX, sh.last = -1;
    __syncthreads();
    const uint64_t dmask = (uint64_t(1) << width) - 1;
    for_each_logit(row, V, [&](float l, int i) {
      if (isnan(l)) return;
      const uint64_t o = order_of(l, i);
      if (o < lo || (o & mask) != prefix) return;
      uint64_t w = 0;
      if (goal != kCount) {
        w = weight_of(l, mx, k);
        if (w == 0) return;  // adds nothing: never where a running mass first reaches a goal
      }
      const int b = int((o >> shift) & dmask);
      atomicAdd(&sh.cnt[b], 1u);
      atomicMin(&sh.lowest[b], unsigned(i));
      if (w) atomicAdd(&sh.mass[b], static_cast<unsigned long long>(w));
    });
    __syncthreads();
    // Bins largest first: thread t holds positions kPer t ... kPer t + kPer - 1.
    const int nb = 1 << width;
    uint64_t v[kPer];
    unsigned c[kPer];
    uint64_t mine = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int b = nb - 1 - (kPer * t + j);
      c[j] = b >= 0 ? sh.cnt[b] : 0;
      v[j] = b < 0 ? 0 : goal == kCount ? c[j] : sh.mass[b];
      mine += v[j];
    }
    unsigned long long excl, total;
    Scan(sh.scan).ExclusiveSum(static_cast<unsigned long long>(mine), excl, total);
    if (mask == 0) target = frac * double(total);  // the first pass sees every candidate
    uint64_t run = excl;
    int first = INT_MAX, last = -1;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      run += v[j];
      if (!c[j]) continue;
      last = kPer * t + j;
      const uint64_t s = acc + run;
      const bool reached = goal == kCount ? s >= kth : goal == kMassReaches ? double(s) >= target : double(s) > target;
      if (reached && first == INT_MAX) first = kPer * t + j;
    }
    if (first != INT_MAX) atomicMin(&sh.first, first);
    if (last >= 0) atomicMax(&sh.last, last);
    __syncthreads();
    const int q = sh.first != INT_MAX ? sh.first : sh.last;
    if (t == q / kPer) {
      const int b = nb - 1 - q;
      uint64_t ahead = excl;
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        if (j < q % kPer) ahead += v[j];
      sh.before = ahead;
      sh.sel_cnt = sh.cnt[b];
      sh.sel_low = sh.lowest[b];
    }
    __syncthreads();
    acc += sh.before;
    prefix |= uint64_t(nb - 1 - q) << shift;
    mask |= dmask << shift;
    const unsigned cnt = sh.sel_cnt, low = sh.sel_low;
    __syncthreads();  // the next pass clears what was read here
    if (cnt == 1 || hi == 0) {
      *order = order_of(__ldg(row + low), int(low));
      return int(low);
    }
  }
  return -1;  // not reached: the last pass fixes every bit of the order
}

// One block a row: the row's largest logit and candidate count, then up to
// three searches, each narrowing the candidates to a prefix of the order:
// the top_k, the top_p prefix, the draw.
__global__ void __launch_bounds__(kThreads, 1) sample_kernel(const SampleRow* rows, int V, int32_t* tokens) {
  __shared__ Shared sh;
  const SampleRow p = rows[blockIdx.x];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float mx = -INFINITY;
  unsigned n = 0;
  for_each_logit(p.logits, V, [&](float l, int) {
    if (!isnan(l)) mx = fmaxf(mx, l), ++n;
  });
  for (int o = 16; o > 0; o >>= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, o));
    n += __shfl_xor_sync(~0u, n, o);
  }
  if (lane == 0) sh.wmax[warp] = mx, sh.wcnt[warp] = n;
  __syncthreads();
  mx = sh.wmax[0], n = 0;
  for (int w = 0; w < kThreads / 32; ++w) mx = fmaxf(mx, sh.wmax[w]), n += sh.wcnt[w];
  if (n == 0) {
    if (t == 0) tokens[blockIdx.x] = -1;
    return;
  }
  const float k = 1.4426950408889634f / p.temperature;
  uint64_t lo = 0;
  if (p.top_k > 0 && unsigned(p.top_k) < n) search(sh, p.logits, V, lo, mx, k, kCount, 0, uint64_t(p.top_k), &lo);
  if (p.top_p < 1) search(sh, p.logits, V, lo, mx, k, kMassReaches, double(p.top_p), 0, &lo);
  const int token = search(sh, p.logits, V, lo, mx, k, kMassPasses, p.u, 0, &lo);
  if (t == 0) tokens[blockIdx.x] = token;
}

}  // namespace

void sample_rows(const SampleRow* rows, int n, int V, int32_t* tokens, cudaStream_t s) {
  check(V > 0 && V <= kMaxSampleVocab, DZ_ERR_INVALID_ARGUMENT, "device sampling: a vocabulary of ", V,
        " is outside [1, ", kMaxSampleVocab, "]");
  if (n <= 0) return;
  sample_kernel<<<n, kThreads, 0, s>>>(rows, V, tokens);
  DZ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dz::cuda
