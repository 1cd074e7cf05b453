#include <cooperative_groups.h>

#include <climits>
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "common/error.h"
#include "cuda/ptx.cuh"
#include "cuda/sampling.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kMaxCluster = 8;  // blocks a row, one cluster: histograms merged through distributed shared memory
constexpr int kThreads = 512;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kPer = kBins / kThreads;  // bins a thread scans
constexpr int kIdxBits = 24;
constexpr int kOrderBits = 32 + kIdxBits;
constexpr float kOne = 274877906944.0f;  // 2^38, the largest logit's weight: a row's total stays below 2^62
// Weights are added in shared memory as three 13-bit parts with native 32-bit
// atomics (64-bit ones are compare-and-swap loops): a block's parts cannot
// overflow while it holds at most 2^19 elements.
constexpr int kPartBits = 13;
constexpr int kMaxSlice = 1 << 19;
static_assert(kBins % kThreads == 0 && kMaxSampleVocab <= 1 << kIdxBits);

using Scan = cub::BlockScan<unsigned long long, kThreads>;

// The candidates' order as one integer, larger first: the logit's bits made
// monotone (+0 and -0 one value), then the index reversed (lower first on ties).
__device__ __forceinline__ uint64_t order_of(float l, int i) {
  return (uint64_t(ptx::float_order(l)) << kIdxBits) | uint32_t((1 << kIdxBits) - 1 - i);
}

// exp((l - mx) / T) in units of 2^-38, k = log2(e) / T; exactly kOne at the
// largest logit, also where that is infinite.
__device__ __forceinline__ uint64_t weight_of(float l, float mx, float k) {
  return l == mx ? uint64_t(kOne) : __float2ull_rn(exp2f((l - mx) * k) * kOne);
}

// f(logit, index) for every index in [i0, i1) this thread takes, several
// loads in flight (16-byte ones where the range allows); indices past the end
// come as NaN, which every caller skips.
template <class F>
__device__ __forceinline__ void for_each_logit(const float* row, int i0, int i1, F&& f) {
  constexpr int U = 4;
  const int t = threadIdx.x;
  if (((i0 | i1) & 3) == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int q1 = i1 >> 2;
    for (int q0 = (i0 >> 2) + t; q0 < q1; q0 += kThreads * U) {
      float4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int q = q0 + u * kThreads;
        x[u] = q < q1 ? __ldg(r4 + q) : make_float4(NAN, NAN, NAN, NAN);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = 4 * (q0 + u * kThreads);
        f(x[u].x, i), f(x[u].y, i + 1), f(x[u].z, i + 2), f(x[u].w, i + 3);
      }
    }
  } else {
    for (int j0 = i0 + t; j0 < i1; j0 += kThreads * U) {
      float x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = j0 + u * kThreads < i1 ? __ldg(row + j0 + u * kThreads) : NAN;
#pragma unroll
      for (int u = 0; u < U; ++u) f(x[u], j0 + u * kThreads);
    }
  }
}

// Logits a block of a C-block cluster takes: a multiple of 4 (16-byte loads stay aligned).
__host__ __device__ constexpr int slice_of(int V, int C) { return (V + C * 4 - 1) / (C * 4) * 4; }
static_assert(slice_of(kMaxSampleVocab, kMaxCluster) <= kMaxSlice);

// What a search stops at: the first candidate at which the running count
// reaches kth, the running mass reaches target, or the mass passes target.
enum Goal : int { kCount, kMassReaches, kMassPasses };

template <int C>
struct Shared {
  static constexpr int kShare = kBins / C;  // bins a block merges
  static_assert(kBins % C == 0);
  // This block's histogram of its slice of the row; the scan's storage once
  // every block has merged from it.
  union {
    unsigned part[3][kBins];  // weight bits [26, 39), [13, 26), [0, 13)
    Scan::TempStorage scan;
  };
  unsigned cnt[kBins];
  unsigned lowest[kBins];  // each bin's lowest index: the candidate itself when it is alone
  // The cluster's histogram for this block's share of the bins.
  unsigned long long m_mass[kShare];
  unsigned m_cnt[kShare], m_lowest[kShare];
  float wmax[kThreads / 32];
  unsigned wcnt[kThreads / 32];
  int first, last;            // the pass's chosen bin, as positions largest first
  unsigned long long before;  // the count or mass of the bins ahead of it
  unsigned sel_cnt, sel_low;
};

// The first candidate in order among those with order >= lo (the ones kept
// so far) at which `goal` holds, or the last one if it never does (a draw
// rounded up to the total). A radix search on the order value, one 11-bit
// digit a pass over the row: each block of the cluster counts (and weighs)
// the candidates of its slice that share the digits chosen so far, each
// merges its share of the bins from every block, and every block reads the
// merged histogram and makes the same choice. It ends at the pass whose
// chosen bin holds one candidate. `frac` of the candidates' mass is the target.
template <int C>
__device__ __noinline__ int search(Shared<C>& sh, const float* row, int i0, int i1, uint64_t lo, float mx, float k,
                                   Goal goal, double frac, uint64_t kth, uint64_t* order) {
  cg::cluster_group cluster = cg::this_cluster();
  const int t = threadIdx.x, rank = int(cluster.block_rank());
  uint64_t prefix = 0, mask = 0, acc = 0;
  double target = 0;
  for (int hi = kOrderBits; hi > 0;) {
    const int width = min(kDigitBits, hi), shift = hi - width;
    hi = shift;
    for (int b = t; b < kBins; b += kThreads)
      sh.part[0][b] = sh.part[1][b] = sh.part[2][b] = sh.cnt[b] = 0, sh.lowest[b] = ~0u;
    if (t == 0) sh.first = INT_MAX, sh.last = -1;
    __syncthreads();
    const uint64_t dmask = (uint64_t(1) << width) - 1;
    for_each_logit(row, i0, i1, [&](float l, int i) {
      if (isnan(l)) return;
      const uint64_t o = order_of(l, i);
      if (o < lo || (o & mask) != prefix) return;
      const int b = int((o >> shift) & dmask);
      if (goal != kCount) {
        const uint64_t w = weight_of(l, mx, k);
        if (w == 0) return;  // adds nothing: never where a running mass first reaches a goal
        constexpr unsigned pm = (1u << kPartBits) - 1;
        if (const unsigned x = unsigned(w >> (2 * kPartBits))) atomicAdd(&sh.part[0][b], x);
        if (const unsigned x = unsigned(w >> kPartBits) & pm) atomicAdd(&sh.part[1][b], x);
        if (const unsigned x = unsigned(w) & pm) atomicAdd(&sh.part[2][b], x);
      }
      atomicAdd(&sh.cnt[b], 1u);
      atomicMin(&sh.lowest[b], unsigned(i));
    });
    cluster.sync();  // every block's histogram complete (and every read of the last merge done)
    constexpr int kShare = Shared<C>::kShare;
    for (int u = t; u < kShare; u += kThreads) {
      const int b = rank * kShare + u;
      unsigned long long m = 0;
      unsigned c = 0, low = ~0u;
#pragma unroll
      for (int r = 0; r < C; ++r) {
        const Shared<C>& o = *cluster.map_shared_rank(&sh, r);
        m += (static_cast<unsigned long long>(o.part[0][b]) << (2 * kPartBits)) +
             (static_cast<unsigned long long>(o.part[1][b]) << kPartBits) + o.part[2][b];
        c += o.cnt[b];
        low = min(low, o.lowest[b]);
      }
      sh.m_mass[u] = m, sh.m_cnt[u] = c, sh.m_lowest[u] = low;
    }
    cluster.sync();  // the merged histogram complete
    // Bins largest first: thread t holds positions kPer t ... kPer t + kPer - 1.
    const int nb = 1 << width;
    uint64_t v[kPer];
    unsigned c[kPer];
    uint64_t mine = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int b = nb - 1 - (kPer * t + j);
      c[j] = 0, v[j] = 0;
      if (b >= 0) {
        const Shared<C>& o = *cluster.map_shared_rank(&sh, b / kShare);
        c[j] = o.m_cnt[b % kShare];
        v[j] = goal == kCount ? c[j] : o.m_mass[b % kShare];
      }
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
      const Shared<C>& o = *cluster.map_shared_rank(&sh, b / kShare);
      sh.before = ahead;
      sh.sel_cnt = o.m_cnt[b % kShare];
      sh.sel_low = o.m_lowest[b % kShare];
    }
    __syncthreads();
    acc += sh.before;
    prefix |= uint64_t(nb - 1 - q) << shift;
    mask |= dmask << shift;
    const unsigned cnt = sh.sel_cnt, low = sh.sel_low;
    __syncthreads();  // the next pass resets what was read here
    if (cnt == 1 || hi == 0) {
      *order = order_of(__ldg(row + low), int(low));
      return int(low);
    }
  }
  return -1;  // not reached: the last pass fixes every bit of the order
}

// One cluster a row, each block a slice of it: the row's largest logit and
// candidate count (a pass, unless the argmax is given), then up to three searches, each narrowing the candidates
// to a prefix of the order: the top_k, the top_p prefix, the draw.
template <int C>
__global__ void __launch_bounds__(kThreads, 1) sample_kernel(const SampleRow* rows, int V, int32_t* tokens) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared<C>& sh = *reinterpret_cast<Shared<C>*>(smem);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int r = blockIdx.x / C;
  const SampleRow p = rows[r];
  const int slice = slice_of(V, C);
  const int i0 = min(V, rank * slice), i1 = min(V, i0 + slice);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float mx = -INFINITY;
  unsigned n = 0;  // candidates (numbers); where the argmax is known, only whether there is one
  if (p.argmax >= -1) {
    n = p.argmax >= 0;
    if (n) mx = __ldg(p.logits + p.argmax);
  } else {
    for_each_logit(p.logits, i0, i1, [&](float l, int) {
      if (!isnan(l)) mx = fmaxf(mx, l), ++n;
    });
    for (int o = 16; o > 0; o >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, o));
      n += __shfl_xor_sync(~0u, n, o);
    }
    if (lane == 0) sh.wmax[warp] = mx, sh.wcnt[warp] = n;
    cluster.sync();
    mx = -INFINITY, n = 0;
    for (int q = 0; q < C; ++q) {
      const Shared<C>& o = *cluster.map_shared_rank(&sh, q);
      for (int w = 0; w < kThreads / 32; ++w) mx = fmaxf(mx, o.wmax[w]), n += o.wcnt[w];
    }
  }
  int token = -1;
  if (n > 0) {
    const float k = 1.4426950408889634f / p.temperature;
    uint64_t lo = 0;
    // With the argmax given the count is not known: a top_k of at least the
    // count then searches for the last candidate, which keeps them all.
    if (p.top_k > 0 && (p.argmax >= 0 || unsigned(p.top_k) < n))
      search(sh, p.logits, i0, i1, lo, mx, k, kCount, 0, uint64_t(p.top_k), &lo);
    if (p.top_p < 1) search(sh, p.logits, i0, i1, lo, mx, k, kMassReaches, double(p.top_p), 0, &lo);
    token = search(sh, p.logits, i0, i1, lo, mx, k, kMassPasses, p.u, 0, &lo);
  }
  if (rank == 0 && t == 0) tokens[r] = token;
  cluster.sync();  // no block leaves while another may read its shared memory
}

template <int C>
void launch(const SampleRow* rows, int n, int V, int32_t* tokens, cudaStream_t s) {
  static const bool sized = [] {  // more than the 48 KB a launch gets unasked
    DZ_CUDA_CHECK(
        cudaFuncSetAttribute(sample_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(Shared<C>))));
    return true;
  }();
  (void)sized;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(n * C));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = sizeof(Shared<C>);
  cfg.stream = s;
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(C), attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  DZ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, sample_kernel<C>, rows, V, tokens));
}

}  // namespace

void sample_rows(const SampleRow* rows, int n, int V, int32_t* tokens, cudaStream_t s) {
  check(V > 0 && V <= kMaxSampleVocab, DZ_ERR_INVALID_ARGUMENT, "device sampling: a vocabulary of ", V,
        " is outside [1, ", kMaxSampleVocab, "]");
  if (n <= 0) return;
  // Eight blocks a row while the rows leave SMs idle (a row's passes are
  // short: latency), fewer as the batch fills the GPU (each block's merge and
  // cluster barriers are overhead), never a slice above kMaxSlice.
  int c = n <= 32 ? 8 : n <= 64 ? 4 : n <= 128 ? 2 : 1;
  while (c < kMaxCluster && slice_of(V, c) > kMaxSlice) c *= 2;
  switch (c) {
    case 1:
      launch<1>(rows, n, V, tokens, s);
      break;
    case 2:
      launch<2>(rows, n, V, tokens, s);
      break;
    case 4:
      launch<4>(rows, n, V, tokens, s);
      break;
    default:
      launch<8>(rows, n, V, tokens, s);
      break;
  }
}

}  // namespace dz::cuda
