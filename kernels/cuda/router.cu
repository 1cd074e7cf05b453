#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "common/error.h"
#include "cuda/pdl.cuh"
#include "cuda/rms.cuh"
#include "cuda/router.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {
// One warp per row: each lane holds E / 32 logits, every pick is a warp
// argmax (the lower index wins ties, as in the CPU backend); the softmax over
// the k picks runs in double on lane 0. (One thread per row, scanning the
// logits k times, took ~5 us per decode step layer.)
constexpr int kRows = 4;  // rows (warps) per block

// Row t's top-k of E logits l (a warp; E <= 256, k <= 16; global or shared
// memory) and the softmax over them (double, lane 0) into ids/w.
__device__ void topk_row(const float* l, int E, int k, int32_t* ids, float* w) {
  const int lane = threadIdx.x & 31;
  float v[8];  // NaN and missing entries are never picked before real ones
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

// DeepSeek-V3 grouped sigmoid routing, one warp per row: each lane holds
// entries lane + 32 i (i < 8) of the row, as topk_row. The sigmoid runs in
// double and is rounded to float, as the CPU backend computes it, so that
// choice = s + bias, the group sums and the weights have its bits and the
// picks (strict order on (value, index): lower index first on ties) are its
// picks. NaN choices count as -inf (the CPU's order is undefined there).
__global__ void __launch_bounds__(32 * kRows)
    sigmoid_grouped_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int T, int E, int n_group,
                           int topk_group, int k, bool norm, float scaling, int32_t* __restrict__ ids,
                           float* __restrict__ weights) {
  __shared__ float sc[kRows][256];            // choice values of the warp's row
  __shared__ unsigned char gsel[kRows][256];  // group g among the topk_group best
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float bv[8];  // the bias does not depend on the previous kernel: loaded before the PDL wait
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = lane + 32 * i;
    bv[i] = bias && e < E ? __ldg(bias + e) : 0.0f;
  }
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x * kRows + warp;
  if (t >= T) return;  // whole warps leave; only warp-level syncs below
  const float* l = logits + size_t(t) * E;
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = lane + 32 * i;
    s[i] = 0.f;
    if (e >= E) continue;
    s[i] = float(1.0 / (1.0 + exp(-double(l[e]))));
    const float c = s[i] + bv[i];
    sc[warp][e] = c == c ? c : -INFINITY;
  }
  __syncwarp();
  // Group scores: the sum of each group's two best choice values (the CPU's
  // scan, so the same float sum), lane + 32 i scoring group lane + 32 i.
  const int per = E / n_group;
  const bool all_groups = topk_group >= n_group;  // every group chosen (Kimi Linear: one group): no scores needed
  float gs[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int g = lane + 32 * i;
    gs[i] = -INFINITY;
    if (g >= n_group || all_groups) continue;
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int e = g * per; e < (g + 1) * per; ++e) {
      const float c = sc[warp][e];
      if (c > b1)
        b2 = b1, b1 = c;
      else if (c > b2)
        b2 = c;
    }
    const float v = per > 1 ? b1 + b2 : b1;
    gs[i] = v == v ? v : -INFINITY;
  }
  // The topk_group best groups: warp argmaxes as topk_row's. Every candidate
  // (even at -inf) beats the initial index, so each pick is a real group.
  uint32_t gtaken = all_groups ? 0xffu : 0u;
  for (int j = 0; j < topk_group && !all_groups; ++j) {
    float bestv = -INFINITY;
    int beste = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int g = lane + 32 * i;
      if (g < n_group && !(gtaken >> i & 1u) && (gs[i] > bestv || (gs[i] == bestv && g < beste)))
        bestv = gs[i], beste = g;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bestv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, beste, o);
      if (ov > bestv || (ov == bestv && oe < beste)) bestv = ov, beste = oe;
    }
    if ((beste & 31) == lane) gtaken |= 1u << (beste >> 5);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int g = lane + 32 * i;
    if (g < n_group) gsel[warp][g] = (gtaken >> i) & 1u;
  }
  __syncwarp();
  // The k best experts of the chosen groups, best first.
  uint32_t ok = 0;  // bit i: entry lane + 32 i in a chosen group and not yet picked
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = lane + 32 * i;
    if (e < E && gsel[warp][e / per]) ok |= 1u << i;
    v[i] = e < E ? sc[warp][e] : -INFINITY;
  }
  int sel[16];
  float sw[16];
  for (int j = 0; j < k; ++j) {
    float bestv = -INFINITY, bests = 0.f;
    int beste = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = lane + 32 * i;
      if ((ok >> i & 1u) && (v[i] > bestv || (v[i] == bestv && e < beste))) bestv = v[i], beste = e, bests = s[i];
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bestv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, beste, o);
      const float os = __shfl_xor_sync(0xffffffffu, bests, o);
      if (ov > bestv || (ov == bestv && oe < beste)) bestv = ov, beste = oe, bests = os;
    }
    if ((beste & 31) == lane) ok &= ~(1u << (beste >> 5));
    sel[j] = beste;
    sw[j] = bests;
  }
  if (lane != 0) return;
  // The weights as the CPU: s of the picks, their float sum in pick order.
  float sum = 0.f;
  for (int j = 0; j < k; ++j) sum += sw[j];
  for (int j = 0; j < k; ++j) {
    float w = sw[j];
    if (norm) w /= sum + 1e-20f;
    ids[size_t(t) * k + j] = sel[j];
    weights[size_t(t) * k + j] = w * scaling;
  }
}

// A decode step's router in one launch (up to kRouterFusedMaxRows rows): RMS
// norm of the residual rows, the router's logits, top-k + softmax. One
// cluster of blocks, W experts a block (a warp each, its weight row in
// registers, loaded with the norm's weights before the PDL wait); every block
// normalizes the rows itself (one read of them, kept in registers), writes
// its logits into the first block's shared memory, and after the cluster
// barrier that block picks the top k. (Three launches before: norm,
// projection, top-k; and a first form of this kernel that met through global
// memory and a ticket took as long as they did, ~9 us a layer on an H200.)
constexpr int kFusedRowU4 = 12;  // weight row pieces a lane: H <= 32 * 12 * 8 = 3072
constexpr int kMaxCluster = 8;

template <int W>
__global__ void __launch_bounds__(32 * W)
    router_fused_kernel(const float* __restrict__ x, int T, int H, const float* __restrict__ nw, float eps,
                        const uint16_t* __restrict__ wr, const float* __restrict__ bias, int E, int k,
                        float* __restrict__ xn, float* __restrict__ logits, int32_t* __restrict__ ids,
                        float* __restrict__ gw) {
  namespace cg = cooperative_groups;
  constexpr int kNP = (8 * 32 * kFusedRowU4 / 4 + 32 * W - 1) / (32 * W);  // float4 pieces of a row a thread
  __shared__ uint4 xs[kRouterFusedMaxRows][32 * kFusedRowU4];              // bf16(xn) rows, 8 a piece
  __shared__ float slog[kRouterFusedMaxRows][256];                         // the first block's: every expert's logit
  __shared__ float part[W][kRouterFusedMaxRows];
  cg::cluster_group cluster = cg::this_cluster();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n8 = H / 8, n4 = H / 4;
  const int e = int(cluster.block_rank()) * W + warp;
  uint4 w[kFusedRowU4];
#pragma unroll
  for (int j = 0; j < kFusedRowU4; ++j) {
    const int q = lane + 32 * j;
    w[j] = e < E && q < n8 ? __ldg(reinterpret_cast<const uint4*>(wr + size_t(e) * H) + q) : make_uint4(0, 0, 0, 0);
  }
  float4 g[kNP];
#pragma unroll
  for (int j = 0; j < kNP; ++j) {
    const int q = threadIdx.x + j * 32 * W;
    g[j] = q < n4 ? __ldg(reinterpret_cast<const float4*>(nw) + q) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float b = e < E && bias ? __ldg(bias + e) : 0.f;
  pdl_wait();
  pdl_trigger();
  // The rows in registers; sums of squares as rms_norm (same partition and order for W = 8).
  float4 v[kRouterFusedMaxRows][kNP];
  float ss[kRouterFusedMaxRows];
#pragma unroll
  for (int t = 0; t < kRouterFusedMaxRows; ++t) {
    ss[t] = 0.f;
#pragma unroll
    for (int j = 0; j < kNP; ++j) {
      const int q = threadIdx.x + j * 32 * W;
      v[t][j] =
          t < T && q < n4 ? reinterpret_cast<const float4*>(x + size_t(t) * H)[q] : make_float4(0.f, 0.f, 0.f, 0.f);
      ss[t] += rms::sq4(v[t][j]);
    }
    ss[t] = rms::warp_sum(ss[t]);
    if (lane == 0) part[warp][t] = ss[t];
  }
  __syncthreads();
  // xn (fp32, for the experts: the first block writes it) and bf16(xn) into shared memory.
  const bool first = cluster.block_rank() == 0;
#pragma unroll
  for (int t = 0; t < kRouterFusedMaxRows; ++t) {
    if (t >= T) break;
    const float inv = rms::inv_rms<W>(&part[0][t], kRouterFusedMaxRows, H, eps);
#pragma unroll
    for (int j = 0; j < kNP; ++j) {
      const int q = threadIdx.x + j * 32 * W;
      if (q >= n4) continue;
      const float4 o = rms::apply(v[t][j], g[j], inv);
      if (first) reinterpret_cast<float4*>(xn + size_t(t) * H)[q] = o;
      reinterpret_cast<uint2*>(&xs[t][0])[q] = rms::to_bf16x4(o);
    }
  }
  __syncthreads();
  float* const dst = cluster.map_shared_rank(&slog[0][0], 0);
  if (e < E)
    for (int t = 0; t < T; ++t) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kFusedRowU4; ++j) {
        const int q = lane + 32 * j;
        if (q >= n8) break;
        const uint4 xq = xs[t][q];
        const uint32_t u[4] = {w[j].x, w[j].y, w[j].z, w[j].w}, xv[4] = {xq.x, xq.y, xq.z, xq.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc = fmaf(__uint_as_float(u[i] << 16), __uint_as_float(xv[i] << 16), acc);
          acc = fmaf(__uint_as_float(u[i] & 0xFFFF0000u), __uint_as_float(xv[i] & 0xFFFF0000u), acc);
        }
      }
      for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) dst[t * 256 + e] = acc + b;
    }
  cluster.sync();  // every logit in the first block's shared memory
  if (!first) return;
  for (int i = threadIdx.x; i < T * E; i += blockDim.x) logits[i] = slog[i / E][i % E];
  if (warp < T) topk_row(&slog[warp][0], E, k, ids + size_t(warp) * k, gw + size_t(warp) * k);
}

// Warps a block for E experts: a cluster of at most kMaxCluster blocks.
int fused_warps(int E) { return E <= 8 * kMaxCluster ? 8 : 16; }
}  // namespace

void router_topk_softmax(const float* logits, int T, int E, int k, int32_t* ids, float* weights, cudaStream_t s) {
  check(E > 0 && E <= 256 && k > 0 && k <= 16 && k <= E, DZ_ERR_INVALID_ARGUMENT, "router_topk_softmax: E=", E,
        " k=", k, " (E <= 256, k <= 16)");
  if (T <= 0) return;
  launch_pdl(topk_kernel, dim3(unsigned((T + kRows - 1) / kRows)), dim3(32 * kRows), 0, s, logits, T, E, k, ids,
             weights);
}

void router_sigmoid_grouped(const float* logits, const float* bias, int T, int E, int n_group, int topk_group, int k,
                            bool norm, float scaling, int32_t* ids, float* weights, cudaStream_t s) {
  check(E <= 256 && k <= 16, DZ_ERR_UNSUPPORTED, "router_sigmoid_grouped: E=", E, " k=", k, " (E <= 256, k <= 16)");
  check(E > 0 && n_group > 0 && E % n_group == 0 && topk_group > 0 && topk_group <= n_group && k > 0 &&
            k <= topk_group * (E / n_group),
        DZ_ERR_INVALID_ARGUMENT, "router_sigmoid_grouped: E=", E, " n_group=", n_group, " topk_group=", topk_group,
        " k=", k);
  if (T <= 0) return;
  launch_pdl(sigmoid_grouped_kernel, dim3(unsigned((T + kRows - 1) / kRows)), dim3(32 * kRows), 0, s, logits, bias, T,
             E, n_group, topk_group, k, norm, scaling, ids, weights);
}

namespace {
// A block a token: each thread scores one expert (fp64 softplus, as the CPU;
// a warp scoring all of them took 14.7 us a call at decode on an H100: eight
// fp64 softplus one after another a lane), then warp 0 runs k warp-wide
// argmax rounds (ties to the lower expert, the CPU's first maximum).
constexpr int kSoftplusThreads = 256, kSoftplusPer = kSoftplusThreads / 32;

__global__ void __launch_bounds__(kSoftplusThreads)
    sqrt_softplus_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                         const int32_t* __restrict__ hash, const int32_t* __restrict__ tokens, int T, int E, int k,
                         float scaling, int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int t = blockIdx.x, lane = threadIdx.x & 31;
  const float* l = logits + size_t(t) * E;
  auto score = [&](int e) {  // torch's softplus: x itself above 20
    const double x = l[e];
    return float(sqrt(x > 20 ? x : log1p(exp(x))));
  };
  __shared__ float ssc[kSoftplusThreads], sc_b[kSoftplusThreads];  // score, score + bias
  int32_t* id = ids + size_t(t) * k;
  if (!hash) {
    const int e = threadIdx.x;
    const float v = e < E ? score(e) : 0.f;
    ssc[e] = v, sc_b[e] = e < E ? v + (bias ? bias[e] : 0.f) : 0.f;
    __syncthreads();
  }
  if (threadIdx.x >= 32) return;
  float w[16];  // the chosen experts' scores, in choice order (every lane holds them)
  if (hash) {
    for (int j = 0; j < k; ++j) {
      const int e = hash[size_t(tokens[t]) * k + j];
      if (lane == 0) id[j] = e;
      w[j] = score(e);
    }
  } else {
    float sc[kSoftplusPer], c[kSoftplusPer];  // the lane's experts lane + 32 i
#pragma unroll
    for (int i = 0; i < kSoftplusPer; ++i) sc[i] = ssc[lane + 32 * i], c[i] = sc_b[lane + 32 * i];
    unsigned taken = 0;  // bit i: expert lane + 32 i
    for (int j = 0; j < k; ++j) {
      float bv = 0, bs = 0;
      int be = E;  // none yet
#pragma unroll
      for (int i = 0; i < kSoftplusPer; ++i)
        if (lane + 32 * i < E && !(taken >> i & 1u) && (be == E || c[i] > bv))
          bv = c[i], bs = sc[i], be = lane + 32 * i;
      for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o), os = __shfl_xor_sync(0xffffffffu, bs, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (oe < E && (be == E || ov > bv || (ov == bv && oe < be))) bv = ov, bs = os, be = oe;
      }
      if ((be & 31) == lane) taken |= 1u << (be >> 5);
      w[j] = bs;
      if (lane == 0) id[j] = be;
    }
  }
  if (lane != 0) return;
  float sum = 0;
  for (int j = 0; j < k; ++j) sum += w[j];
  for (int j = 0; j < k; ++j) weights[size_t(t) * k + j] = w[j] / (sum + 1e-20f) * scaling;
}
}  // namespace

void router_sqrt_softplus(const float* logits, const float* bias, const int32_t* hash, const int32_t* tokens, int T,
                          int E, int k, float scaling, int32_t* ids, float* weights, cudaStream_t s) {
  check(E > 0 && E <= 256 && k > 0 && k <= 16 && k <= E, DZ_ERR_UNSUPPORTED, "router_sqrt_softplus: E=", E, " k=", k,
        " (E <= 256, k <= 16)");
  check(!hash || tokens, DZ_ERR_INVALID_ARGUMENT, "router_sqrt_softplus: a hash table needs the token ids");
  if (T <= 0) return;
  sqrt_softplus_kernel<<<T, kSoftplusThreads, 0, s>>>(logits, bias, hash, tokens, T, E, k, scaling, ids, weights);
  DZ_CUDA_LAUNCH_CHECK();
}

bool router_fused_fits(int T, int H, int E, int k) {
  return T >= 1 && T <= kRouterFusedMaxRows && H % 8 == 0 && H / 8 <= 32 * kFusedRowU4 && E > 0 &&
         E <= 16 * kMaxCluster && k > 0 && k <= 16 && k <= E;
}

void router_fused(const float* x, int T, int H, const float* norm_w, float eps, const uint16_t* w, const float* bias,
                  int E, int k, float* xn, float* logits, int32_t* ids, float* weights, cudaStream_t s) {
  check(router_fused_fits(T, H, E, k), DZ_ERR_INVALID_ARGUMENT, "router_fused: T=", T, " H=", H, " E=", E, " k=", k,
        " (T <= ", kRouterFusedMaxRows, ", H % 8 == 0 and H <= ", 8 * 32 * kFusedRowU4, ", E <= ", 16 * kMaxCluster,
        ", k <= 16)");
  const int W = fused_warps(E);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned((E + W - 1) / W));
  cfg.blockDim = dim3(unsigned(32 * W));
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cfg.gridDim.x, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 2 : 1;
  DZ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, W == 8 ? router_fused_kernel<8> : router_fused_kernel<16>, x, T, H, norm_w,
                                   eps, w, bias, E, k, xn, logits, ids, weights));
}

}  // namespace dz::cuda
