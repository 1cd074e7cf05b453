#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap (encoded through the runtime)
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "common/error.h"
#include "cuda/dsa_indexer.h"
#include "cuda/fp8_grouped_gemm.h"  // encode_tensor_map, and the sm_90a probe
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kScoreWarps = 4;
constexpr int kSelectDigitBits = 11, kSelectBins = 1 << kSelectDigitBits;
// Keys a selection block keeps in shared memory (192 KB) beside its ~13 KB of static arrays.
constexpr int64_t kSelectMaxSmemKeys = 48 * 1024;
constexpr int kSelectMaxCluster = 8;

// ------------------------------------------------------------ encoding
// One vector of D values a warp, lane l holding values l E .. l E + E - 1
// (E = D / 32): the Hadamard butterflies in the CPU's order (the same floats:
// a butterfly's two lanes form a + b and a - b from the same a and b), the
// 1/sqrt(D) factor, then E4M3 under one scale amax / 448 (rounded up to a
// power of two when pow2), as cpu::fp8_quantize_block. Returns the scale
// (every lane). (A block a vector with a barrier a butterfly until 2026-12-05.)
template <int E>
__device__ float hadamard_quantize(const float* x, float inv_sqrt_d, bool pow2, uint8_t* out) {
  constexpr int D = 32 * E;
  const int lane = threadIdx.x & 31;
  float v[E];
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = x[lane * E + e];
#pragma unroll
  for (int h = 1; h < D; h *= 2) {
    if (h < E) {
#pragma unroll
      for (int e = 0; e < E; ++e)
        if ((e & h) == 0) {
          const float a = v[e], b = v[e + h];
          v[e] = a + b, v[e + h] = a - b;
        }
    } else {
      const int ol = h / E;  // the partner lane: the same e, index d ^ h
      const bool lead = (lane & ol) == 0;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float o = __shfl_xor_sync(0xffffffffu, v[e], ol);
        v[e] = lead ? v[e] + o : o - v[e];
      }
    }
  }
  float m = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] *= inv_sqrt_d, m = fmaxf(m, fabsf(v[e]));
  const float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(m)));  // m >= 0: bits order
  float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
  if (pow2 && amax > 0.f) {  // the power of two at or above the scale, exactly
    int e;
    const float f = frexpf(scale, &e);  // scale = f 2^e, f in [0.5, 1)
    scale = ldexpf(1.f, f == 0.5f ? e - 1 : e);
  }
#pragma unroll
  for (int e = 0; e < E; ++e)
    out[lane * E + e] = uint8_t(__nv_cvt_float_to_fp8(__fdiv_rn(v[e], scale), __NV_SATFINITE, __NV_E4M3));
  return scale;
}
constexpr int kEncodeWarps = 8;  // vectors a block

// Queries [nq, H, D] -> q8 [nq, H, D] and qw [nq, H] = w H^-0.5 D^-0.5 qs:
// every positive factor of a head's logit but the key's scale. A warp a (query, head).
template <int E>
__global__ void __launch_bounds__(kEncodeWarps * 32)
    encode_queries_kernel(const float* q, const float* w, int64_t n, int D, float inv_sqrt_d, float h_scale, bool pow2,
                          uint8_t* q8, float* qw) {
  const int64_t ih = int64_t(blockIdx.x) * kEncodeWarps + (threadIdx.x >> 5);
  if (ih >= n) return;
  const float s = hadamard_quantize<E>(q + ih * D, inv_sqrt_d, pow2, q8 + ih * D);
  if ((threadIdx.x & 31) == 0) qw[ih] = w[ih] * h_scale * inv_sqrt_d * s;
}

template <int E>
__global__ void __launch_bounds__(kEncodeWarps * 32)
    encode_keys_kernel(const float* k, int64_t n, int D, float inv_sqrt_d, bool pow2, const int64_t* pos,
                       uint8_t* const* pages, uint8_t* const* const* row_pages, IndexerKeys keys) {
  const int64_t i = int64_t(blockIdx.x) * kEncodeWarps + (threadIdx.x >> 5);
  if (i >= n) return;
  const int64_t p = pos[i];
  uint8_t* const* const table = row_pages ? row_pages[i] : pages;
  uint8_t* const rec = table[p / keys.page_tokens] + (p % keys.page_tokens) * keys.stride + keys.offset;
  const float s = hadamard_quantize<E>(k + i * D, inv_sqrt_d, pow2, rec);
  if ((threadIdx.x & 31) == 0) *reinterpret_cast<float*>(rec + D) = s;
}

// ------------------------------------------------------------ scoring
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

struct ScoreArgs {
  const uint8_t* q8;  // this query block's [nq, H, D]
  const float* qw;    // [nq, H]
  int64_t q0;         // the block's first query (into pages / n_visible); the grid's y covers its queries
  const uint8_t* const* const* pages;
  const int64_t* n_visible;
  int64_t max_visible;
  IndexerKeys keys;
  float* scores;  // [nq, ld]
  int64_t ld;
  int H, D;
  int keys_per_warp;  // a multiple of 8
};

// Decode (queries of several sequences) and shapes other than V3.2's: block
// (key run, query), each warp a contiguous run of its query's keys, 8 at a
// time (the MMA's n), against up to 16 kMT heads whose query fragments stay in
// registers for the whole run (more heads: runs of 16 kMT, each adding to the
// scores). MMA rows 16 heads, K = D in steps of 32; B fragments are the keys'
// E4M3 bytes straight from their records (4-byte loads: a quad reads 16
// contiguous bytes of a key), two groups of 8 keys in flight ahead of the
// MMAs. Bound by the rate of E4M3 mma.sync (~120 TFLOP/s on an H100 at batch
// 64); a wgmma form fed by a producer warp's 4-byte copies (records of 132
// bytes allow no wider ones) was slower, 882 against 572 us for 64 queries of
// 65,536 keys (2026-12-05). (Before that day each warp took 32 keys and loaded
// the query's fragments again for every 16 heads and every 32 keys.)
template <int kMT>
__global__ void __launch_bounds__(kScoreWarps * 32) score_kernel(const ScoreArgs a) {
  constexpr int kAhead = 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t i = blockIdx.y;
  const int64_t vis = min(a.n_visible[a.q0 + i], a.max_visible);
  const int64_t s_begin = (int64_t(blockIdx.x) * kScoreWarps + warp) * a.keys_per_warp;
  if (s_begin >= vis) return;  // uniform over the warp
  const int64_t s_end = min(vis, s_begin + a.keys_per_warp);
  const uint8_t* const* pages = a.pages[a.q0 + i];
  const int nks = a.D / 32;
  const IndexerKeys& K = a.keys;
  // This lane's key of each group (column g) walks the pages by a cursor: no division a group.
  uint32_t cp = 0, cj = 0;
  auto start_keys = [&]() {
    cp = uint32_t((s_begin + g) / K.page_tokens), cj = uint32_t((s_begin + g) % K.page_tokens);
  };
  // The next group's fragments (bytes 4t.. and 16 + 4t.. of every 32 of key g) and key g's scale.
  auto load_keys = [&](int64_t s0, uint32_t(&kb)[4][2], float& ksc) {
    const uint8_t* rec = s0 + g < s_end ? pages[cp] + size_t(cj) * K.stride + K.offset : nullptr;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const bool ok = rec && ks < nks;
      kb[ks][0] = ok ? __ldg(reinterpret_cast<const uint32_t*>(rec + 32 * ks + 4 * t)) : 0u;
      kb[ks][1] = ok ? __ldg(reinterpret_cast<const uint32_t*>(rec + 32 * ks + 16 + 4 * t)) : 0u;
    }
    ksc = rec ? __ldg(reinterpret_cast<const float*>(rec + a.D)) : 0.f;
    for (cj += 8; cj >= K.page_tokens; cj -= K.page_tokens) ++cp;
  };
  const uint8_t* qrow = a.q8 + i * a.H * a.D;
  float* out = a.scores + i * a.ld;
  for (int h0 = 0; h0 < a.H; h0 += 16 * kMT) {
    uint32_t qa[kMT][4][4];
    float w0[kMT], w1[kMT];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int h = h0 + 16 * mt;
      const bool hv = h < a.H;
      w0[mt] = hv ? a.qw[i * a.H + h + g] : 0.f;
      w1[mt] = hv ? a.qw[i * a.H + h + g + 8] : 0.f;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const bool ok = hv && ks < nks;
        const uint8_t* r0 = qrow + int64_t(h + g) * a.D + 32 * ks + 4 * t;
        const uint8_t* r1 = r0 + 8 * a.D;
        qa[mt][ks][0] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r0)) : 0u;
        qa[mt][ks][1] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r1)) : 0u;
        qa[mt][ks][2] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r0 + 16)) : 0u;
        qa[mt][ks][3] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r1 + 16)) : 0u;
      }
    }
    uint32_t kb[kAhead + 1][4][2];
    float ksc[kAhead + 1];
    start_keys();
#pragma unroll
    for (int r = 0; r < kAhead; ++r) load_keys(s_begin + 8 * r, kb[r], ksc[r]);
    for (int64_t s0 = s_begin; s0 < s_end; s0 += 8 * (kAhead + 1)) {
#pragma unroll
      for (int r = 0; r <= kAhead; ++r) {
        const int64_t sg = s0 + 8 * r;  // this group; its fragments are kb[r]
        if (sg >= s_end) break;
        load_keys(sg + 8 * kAhead, kb[(r + kAhead) % (kAhead + 1)], ksc[(r + kAhead) % (kAhead + 1)]);
        float p0 = 0.f, p1 = 0.f;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            if (ks < nks) mma_e4m3(c, qa[mt][ks], kb[r][ks][0], kb[r][ks][1]);
          // c: heads h + g (0, 1) and h + g + 8 (2, 3); keys 2t, 2t + 1 of the group.
          p0 += w0[mt] * fmaxf(c[0], 0.f) + w1[mt] * fmaxf(c[2], 0.f);
          p1 += w0[mt] * fmaxf(c[1], 0.f) + w1[mt] * fmaxf(c[3], 0.f);
        }
        // Sum over the heads held by the 8 lanes of each t; lanes 0-3 write.
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          p0 += __shfl_xor_sync(0xffffffffu, p0, o);
          p1 += __shfl_xor_sync(0xffffffffu, p1, o);
        }
        // Keys 2t and 2t + 1's scales, from the lanes that loaded them (g = 2t + j, t = 0).
        const float sc0 = __shfl_sync(0xffffffffu, ksc[r], 8 * t), sc1 = __shfl_sync(0xffffffffu, ksc[r], 8 * t + 4);
        if (g == 0) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int64_t s = sg + 2 * t + j;
            if (s >= s_end) continue;
            const float v = (j ? sc1 : sc0) * (j ? p1 : p0);
            out[s] = h0 == 0 ? v : out[s] + v;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------ scoring, one prompt (wgmma)
// Queries that share one page table (a prompt's prefill) share its keys: a
// block holds a tile of 128 keys in shared memory and scores a chunk of
// queries against it, one query a stage, on the tensor cores as
// wgmma m64n64k32 with the keys as A (64 a consumer warpgroup) and the
// query's 64 heads as B (N), both E4M3 and K-major (D = 128: one 128-byte
// swizzled row). The accumulators of a key row hold its 64 heads over a quad
// of lanes, so ReLU, the head weights and the sum over heads take 32 FMAs a
// thread and two shuffles, not a reduction across warps. The block loads the
// key tile, then one thread of its last warp brings each query's heads (a
// tensor copy) and weights (a bulk copy) through a ring of stages.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DZ_IDX_SM90A 1
#endif

constexpr int kWgKeys = 128, kWgHeads = 64, kWgD = 128, kWgStages = 6, kWgChunk = 64;
constexpr int kWgThreads = 2 * 128 + 32;  // two consumer warpgroups, then the producer warp
constexpr int kWgQBytes = kWgHeads * kWgD, kWgWBytes = kWgHeads * 4;
struct WgSmem {
  static constexpr int offA = 0, offQ = kWgKeys * kWgD, offW = offQ + kWgStages * kWgQBytes,
                       offScale = offW + kWgStages * kWgWBytes, offBar = offScale + kWgKeys * 4,
                       bytes = offBar + 2 * kWgStages * 8 + 1024;  // +1024: base aligned up
};

struct WgArgs {
  CUtensorMap qmap;  // q8 of the query block: [nq * 64 rows][128] u8, box 128 x 64, 128B swizzle
  const float* qw;   // [nq, 64]
  int64_t q0, nq;
  const uint8_t* const* const* pages;  // per query; one table for all (IndexerQueries::same_pages)
  const int64_t* n_visible;
  int64_t max_visible;
  IndexerKeys keys;
  float* scores;
  int64_t ld;
};

#ifdef DZ_IDX_SM90A
// d (64 x 64 fp32, wgmma layout) = A(64 x 32) B(64 x 32)^T, e4m3 from shared memory.
__device__ __forceinline__ void wgmma_64x64(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" DZ_WGMMA_R32 "}, %32, %33, p, 1, 1;\n}\n"
      : DZ_WGMMA_ACC32(d)
      : "l"(da), "l"(db), "r"(accumulate));
}

// d = the 64 keys at descriptor da (low word) against the 64 heads at db, K = 128: four MMAs, one group.
__device__ __forceinline__ void wg_scores(float (&d)[32], uint32_t da, uint32_t db) {
  ptx::wgmma_fence();
  ptx::fence_regs(d);
#pragma unroll
  for (int kk = 0; kk < kWgD / 32; ++kk) wgmma_64x64(d, ptx::sw128_desc(da + 2 * kk), ptx::sw128_desc(db + 2 * kk), kk);
  ptx::wgmma_commit();
  ptx::fence_regs(d);
}

// A thread's two key rows (16 w + g and + 8) summed over the 64 heads: ReLU
// and the head weights w on its columns 8 j + 2 t and + 1, then over the quad.
__device__ __forceinline__ void wg_head_sum(const float (&d)[32], const float* w, int t, float& p0, float& p1) {
  p0 = 0.f, p1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 wj = *reinterpret_cast<const float2*>(w + 8 * j + 2 * t);
    p0 += wj.x * fmaxf(d[4 * j + 0], 0.f) + wj.y * fmaxf(d[4 * j + 1], 0.f);
    p1 += wj.x * fmaxf(d[4 * j + 2], 0.f) + wj.y * fmaxf(d[4 * j + 3], 0.f);
  }
  p0 += __shfl_xor_sync(0xffffffffu, p0, 1);
  p1 += __shfl_xor_sync(0xffffffffu, p1, 1);
  p0 += __shfl_xor_sync(0xffffffffu, p0, 2);
  p1 += __shfl_xor_sync(0xffffffffu, p1, 2);
}

// count MMA groups through two accumulator sets: group n + 1 is issued
// before group n's epilogue, so the tensor cores run under it.
template <class Issue, class Finish>
__device__ __forceinline__ void wg_pipeline(int count, float (&acc)[2][32], Issue& issue, Finish& finish) {
  if (count > 0) issue(0, acc[0]);
  for (int n = 0; n < count; n += 2) {
    if (n + 1 < count) {
      issue(n + 1, acc[1]);
      ptx::wgmma_wait<1>();
    } else {
      ptx::wgmma_wait<0>();
    }
    ptx::fence_regs(acc[0]);
    finish(n, acc[0]);
    if (n + 1 >= count) break;
    if (n + 2 < count) {
      issue(n + 2, acc[0]);
      ptx::wgmma_wait<1>();
    } else {
      ptx::wgmma_wait<0>();
    }
    ptx::fence_regs(acc[1]);
    finish(n + 1, acc[1]);
  }
}
#endif

__global__ void __launch_bounds__(kWgThreads, 2) score_wgmma_kernel(const __grid_constant__ WgArgs a) {
#ifdef DZ_IDX_SM90A
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const sm = smem_raw + (base - raw);
  float* const kscale = reinterpret_cast<float*>(sm + WgSmem::offScale);
  const float* const sw = reinterpret_cast<const float*>(sm + WgSmem::offW);
  const uint32_t bars = base + WgSmem::offBar;
  auto full = [&](int st) { return bars + 8u * uint32_t(st); };
  auto empty = [&](int st) { return bars + 8u * uint32_t(kWgStages + st); };
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t k0 = int64_t(blockIdx.x) * kWgKeys, i0 = int64_t(blockIdx.y) * kWgChunk;
  const int nc = int(min(a.nq - i0, int64_t(kWgChunk)));
  // The chunk's visible counts, and the queries that see any key of the tile, in order.
  __shared__ int64_t s_vis[kWgChunk];
  __shared__ int s_list[kWgChunk];
  __shared__ int s_seen;
  if (tid < kWgChunk) s_vis[tid] = tid < nc ? min(a.n_visible[a.q0 + i0 + tid], a.max_visible) : 0;
  __syncthreads();
  int64_t vmax = 0;  // keys the chunk sees at most: the tile's keys past it are zeros
  for (int j = 0; j < nc; ++j) vmax = max(vmax, s_vis[j]);
  if (vmax <= k0) return;  // uniform: no query of the chunk sees the tile
  if (tid == 0) {
    int n = 0;
    for (int j = 0; j < nc; ++j)
      if (s_vis[j] > k0) s_list[n++] = j;
    s_seen = n;
    for (int st = 0; st < kWgStages; ++st) ptx::mbar_init(full(st), 1), ptx::mbar_init(empty(st), 8);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The key tile, a warp a key: its 32 words into the 128-byte swizzled row, and its scale.
  const IndexerKeys& K = a.keys;
  const uint8_t* const* const pages = a.pages[a.q0 + i0];
  for (int r = tid >> 5; r < kWgKeys; r += kWgThreads / 32) {
    const int64_t s = k0 + r;
    const int p = tid & 31;
    uint32_t v = 0u;
    float sc = 0.f;
    if (s < vmax) {
      const uint8_t* rec = pages[s / K.page_tokens] + (s % K.page_tokens) * K.stride + K.offset;
      v = __ldg(reinterpret_cast<const uint32_t*>(rec) + p);
      if (p == 0) sc = __ldg(reinterpret_cast<const float*>(rec + kWgD));
    }
    *reinterpret_cast<uint32_t*>(sm + WgSmem::offA + ptx::sw128_offset(r, 4 * p)) = v;
    if (p == 0) kscale[r] = sc;
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma's reads
  __syncthreads();
  const int seen = s_seen;
  if (wg == 2) {
    if (tid == 256) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&a.qmap)) : "memory");
      for (int n = 0; n < seen; ++n) {
        const int st = n % kWgStages;
        const int64_t i = i0 + s_list[n];
        ptx::mbar_wait(empty(st), ((n / kWgStages) & 1) ^ 1u);
        ptx::mbar_arrive_expect_tx(full(st), kWgQBytes + kWgWBytes);
        ptx::tma_2d(base + WgSmem::offQ + uint32_t(st * kWgQBytes), &a.qmap, full(st), 0, int(i * kWgHeads));
        ptx::bulk_g2s(base + WgSmem::offW + uint32_t(st * kWgWBytes), a.qw + i * kWgHeads, kWgWBytes, full(st));
      }
    }
    return;
  }
  // Consumers: warpgroup cw multiplies keys 64 cw.. of the tile; a thread's
  // rows are keys 16 w + g and + 8, its columns heads 8 j + 2 t and + 1. The
  // next query's MMAs are issued before this one's epilogue (two accumulator sets).
  const int cw = __shfl_sync(0xffffffffu, wg, 0), warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rk0 = cw * 64 + warp * 16 + g, rk1 = rk0 + 8;
  const uint32_t da = ptx::sw128_desc_lo(base + WgSmem::offA + uint32_t(cw * 64 * kWgD));
  const float ks0 = kscale[rk0], ks1 = kscale[rk1];
  float acc[2][32];
  auto issue = [&](int n, float(&d)[32]) {
    const int st = n % kWgStages;
    ptx::mbar_wait(full(st), (n / kWgStages) & 1);
    __syncwarp();
    wg_scores(d, da, ptx::sw128_desc_lo(base + WgSmem::offQ + uint32_t(st * kWgQBytes)));
  };
  auto finish = [&](int n, float(&d)[32]) {
    const int st = n % kWgStages;
    float p0, p1;
    wg_head_sum(d, sw + st * kWgHeads, t, p0, p1);
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(empty(st));
    if (t == 0) {
      const int64_t i = i0 + s_list[n], v = s_vis[s_list[n]];
      float* out = a.scores + i * a.ld + k0;
      if (k0 + rk0 < v) out[rk0] = ks0 * p0;
      if (k0 + rk1 < v) out[rk1] = ks1 * p1;
    }
  };
  wg_pipeline(seen, acc, issue, finish);
#else
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) printf("dsa indexer: kernel built without sm_90a\n");
  __trap();
#endif
}

// ------------------------------------------------------------ selection
// A score as an unsigned key, larger first; +0 and -0 one value; NaN 0 (never selected).
__device__ __forceinline__ uint32_t order_key(float x) { return x != x ? 0u : ptx::float_order(x); }

// The top w bits of a key (w = 0: none, every key alike).
__device__ __forceinline__ uint32_t top_bits(uint32_t u, int w) { return w == 0 ? 0u : u >> (32 - w); }

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

struct SelectArgs {
  const float* scores;
  int64_t ld, q0;
  const int64_t* n_visible;
  int64_t max_visible;
  int k;
  int32_t* out;
  int64_t smem_keys;  // keys a block keeps in shared memory (0: its passes read the scores again)
};

// What a block shows the other blocks of its cluster.
struct SelectShared {
  uint32_t lo, hi;
  int valid, gt, eq;
};

// One cluster of C blocks a query (C = 1 for large batches), each block a
// contiguous chunk of the row, kept as keys in its shared memory when it fits.
// The k-th largest key is found digit by digit, as few digits as the row
// needs: a first pass finds the range of the keys, whose common leading bits
// need no pass; then 11-bit digits (2048 bins, so the bins a row's exponents
// fill stay many and the shared-memory atomics rarely meet), each block's
// histogram read by every block of the cluster, stopping early when the
// threshold's bin is kept whole. The threshold is then "the top w bits above
// tw, or equal to it for the first `need` such keys in position order". Two
// more passes write the selection in position order (ascending): each warp a
// contiguous piece of its block's chunk, counted and placed with ballots.
// (Until 2026-12-05: one 512-thread block a query, four 8-bit passes from the
// top byte, which for scores of one sign put every key in two or three bins,
// and a block scan every 512 positions: 152 us for 65,536 scores.)
template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) select_kernel(const SelectArgs a) {
  constexpr int kWarps = kThreads / 32, kUnroll = 8, kPer = kSelectBins / kThreads;  // bins a thread searches
  static_assert(kSelectBins % kThreads == 0, "bins split evenly");
  using BinScan = cub::BlockScan<int, kThreads>;
  extern __shared__ uint32_t keys_s[];
  __shared__ int hist[kSelectBins];
  __shared__ typename BinScan::TempStorage scan;
  __shared__ uint32_t s_lo[kWarps], s_hi[kWarps];
  __shared__ int s_valid[kWarps], s_gt[32], s_eq[32];
  __shared__ int s_gt_before, s_eq_before, s_gt_all, s_eq_all;  // this block's place in the cluster's selection
  __shared__ SelectShared mine;
  __shared__ int s_digit, s_above, s_bin;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int64_t i = blockIdx.y;
  const float* row = a.scores + i * a.ld;
  const int64_t n = min(a.n_visible[a.q0 + i], a.max_visible);
  int32_t* o = a.out + (a.q0 + i) * int64_t(a.k);
  const int k = a.k, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // This block's chunk [p0, p0 + m): a multiple of 32 positions but the last.
  const int64_t per_block = ((n + C - 1) / C + 31) / 32 * 32;
  const int64_t p0 = min(n, rank * per_block), m = min(n, p0 + per_block) - p0;
  const bool in_smem = m <= a.smem_keys;
  const float* chunk = row + p0;
  auto key = [&](int64_t j) { return in_smem ? keys_s[j] : order_key(__ldg(chunk + j)); };
  // Every block of the cluster, in rank order.
  auto other = [&](int q) -> const SelectShared& { return *cluster.map_shared_rank(&mine, q); };

  // Pass 1: the keys (into shared memory), the range of those not NaN and how many they are.
  uint32_t lo = ~0u, hi = 0u, valid = 0u;
  for (int64_t b = tid; b < m; b += int64_t(kThreads) * kUnroll) {
    uint32_t u[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t s = b + int64_t(j) * kThreads;
      u[j] = s < m ? order_key(__ldg(chunk + s)) : 0u;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t s = b + int64_t(j) * kThreads;
      if (in_smem && s < m) keys_s[s] = u[j];
      if (u[j]) lo = min(lo, u[j]), hi = max(hi, u[j]), ++valid;
    }
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  valid = __reduce_add_sync(0xffffffffu, valid);
  if (lane == 0) s_lo[warp] = lo, s_hi[warp] = hi, s_valid[warp] = int(valid);
  __syncthreads();
  // Warp 0 combines the warps', then the cluster's blocks' (one each a lane), for every thread.
  if (warp == 0) {
    lo = lane < kWarps ? s_lo[lane] : ~0u, hi = lane < kWarps ? s_hi[lane] : 0u;
    valid = lane < kWarps ? uint32_t(s_valid[lane]) : 0u;
    lo = __reduce_min_sync(0xffffffffu, lo), hi = __reduce_max_sync(0xffffffffu, hi);
    valid = __reduce_add_sync(0xffffffffu, valid);
    if (lane == 0) mine = {lo, hi, int(valid), 0, 0};
  }
  cluster.sync();
  if (warp == 0) {
    lo = ~0u, hi = 0u, valid = 0u;
    if (lane < C) {
      const SelectShared& v = other(lane);
      lo = v.lo, hi = v.hi, valid = uint32_t(v.valid);
    }
    lo = __reduce_min_sync(0xffffffffu, lo), hi = __reduce_max_sync(0xffffffffu, hi);
    valid = __reduce_add_sync(0xffffffffu, valid);
    if (lane == 0) s_lo[0] = lo, s_hi[0] = hi, s_valid[0] = int(valid);
  }
  __syncthreads();
  lo = s_lo[0], hi = s_hi[0];
  const int nvalid = s_valid[0];

  int w = 0, need = nvalid;  // no more valid keys than k: every one (all alike at width 0)
  uint32_t tw = 0u;
  if (nvalid > k) {
    w = lo == hi ? 32 : __clz(lo ^ hi);  // bits every valid key shares
    uint32_t prefix = w == 0 ? 0u : hi & (~0u << (32 - w));
    int rem = k;
    while (w < 32) {
      const int bits = min(kSelectDigitBits, 32 - w), shift = 32 - w - bits, nb = 1 << bits;
      for (int b = tid; b < nb; b += kThreads) hist[b] = 0;
      __syncthreads();
      const uint32_t pw = top_bits(prefix, w), dmask = uint32_t(nb - 1);
      for (int64_t b = tid; b < m; b += int64_t(kThreads) * kUnroll) {
        uint32_t u[kUnroll];
#pragma unroll
        for (int j = 0; j < kUnroll; ++j) {
          const int64_t s = b + int64_t(j) * kThreads;
          u[j] = s < m ? key(s) : 0u;
        }
#pragma unroll
        for (int j = 0; j < kUnroll; ++j)
          if (u[j] && top_bits(u[j], w) == pw) atomicAdd(&hist[(u[j] >> shift) & dmask], 1);
      }
      cluster.sync();  // every block's histogram complete
      // The digit whose bin holds the rem-th key from the top: thread t sums
      // the cluster's counts of kPer bins from nb - 1 - kPer t down, an
      // exclusive scan gives the keys above them.
      int c[kPer], sum = 0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int b = nb - 1 - kPer * tid - j;
        c[j] = 0;
        if (b >= 0) {
          int v[kSelectMaxCluster];  // every block's count loaded before any is added
#pragma unroll
          for (int q = 0; q < kSelectMaxCluster; ++q) v[q] = q < C ? *cluster.map_shared_rank(&hist[b], q) : 0;
#pragma unroll
          for (int q = 0; q < kSelectMaxCluster; ++q) c[j] += v[q];
        }
        sum += c[j];
      }
      int before;
      BinScan(scan).ExclusiveSum(sum, before);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (before < rem && before + c[j] >= rem) s_digit = nb - 1 - kPer * tid - j, s_above = before, s_bin = c[j];
        before += c[j];
      }
      cluster.sync();  // the digit found; every read of the histograms done before the next round clears them
      prefix |= uint32_t(s_digit) << shift;
      rem -= s_above;
      w += bits;
      if (s_bin == rem) break;  // the bin is kept whole: no need to tell its keys apart
    }
    tw = top_bits(prefix, w);
    need = rem;
  }

  // Passes 2 and 3: warp pieces (multiples of 32 positions) of the chunk, counted, then placed in order.
  const int64_t per = ((m + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int64_t c0 = min(m, int64_t(warp) * per), c1 = min(m, c0 + per);
  auto classify = [&](uint32_t u, bool& gt, bool& eq) {
    const uint32_t h = top_bits(u, w);
    gt = u != 0u && h > tw;
    eq = u != 0u && h == tw;
  };
  // The warp's piece in position order, 32 keys a step (kUnroll steps' loads at once): f(gt, eq, position).
  auto each_step = [&](auto&& f) {
    for (int64_t b = c0; b < c1; b += 32 * kUnroll) {
      uint32_t u[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t s = b + 32 * j + lane;
        u[j] = s < c1 ? key(s) : 0u;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        bool gt, eq;
        classify(u[j], gt, eq);
        f(gt, eq, b + 32 * j + lane);
      }
    }
  };
  int ngt = 0, neq = 0;
  each_step([&](bool gt, bool eq, int64_t) {
    ngt += __popc(__ballot_sync(0xffffffffu, gt));
    neq += __popc(__ballot_sync(0xffffffffu, eq));
  });
  if (lane == 0) s_gt[warp] = ngt, s_eq[warp] = neq;
  __syncthreads();
  // Warp 0: this block's totals for the cluster, then each warp's place: the
  // blocks before this one, then the warps before it (exclusive scans by shuffles).
  if (warp == 0) {
    int g = lane < kWarps ? s_gt[lane] : 0, e = lane < kWarps ? s_eq[lane] : 0;
    const int gw = g, ew = e;
    for (int o = 1; o < 32; o <<= 1) {
      const int gn = __shfl_up_sync(0xffffffffu, g, o), en = __shfl_up_sync(0xffffffffu, e, o);
      if (lane >= o) g += gn, e += en;
    }
    if (lane == 31) mine.gt = g, mine.eq = e;
    s_gt[lane] = g - gw, s_eq[lane] = e - ew;  // lanes past kWarps: unused (s_gt holds 32)
  }
  cluster.sync();
  if (warp == 0) {
    int vg = 0, ve = 0;
    if (lane < C) {
      const SelectShared& v = other(lane);
      vg = v.gt, ve = v.eq;
    }
    const int gb = __reduce_add_sync(0xffffffffu, lane < rank ? vg : 0);
    const int eb = __reduce_add_sync(0xffffffffu, lane < rank ? ve : 0);
    const int ga = __reduce_add_sync(0xffffffffu, vg), ea = __reduce_add_sync(0xffffffffu, ve);
    if (lane == 0) s_gt_before = gb, s_eq_before = eb, s_gt_all = ga, s_eq_all = ea;
  }
  __syncthreads();
  int gt_before = s_gt_before + s_gt[warp], eq_before = s_eq_before + s_eq[warp];
  const int gt_all = s_gt_all, eq_all = s_eq_all;
  const uint32_t lt = lanemask_lt();
  each_step([&](bool gt, bool eq, int64_t s) {
    const uint32_t gm = __ballot_sync(0xffffffffu, gt), em = __ballot_sync(0xffffffffu, eq);
    const int eb = eq_before + __popc(em & lt);
    if (gt || (eq && eb < need)) o[gt_before + __popc(gm & lt) + min(eb, need)] = int32_t(p0 + s);
    gt_before += __popc(gm);
    eq_before += __popc(em);
  });
  const int taken = gt_all + min(eq_all, need);
  for (int64_t j = taken + int64_t(rank) * kThreads + tid; j < k; j += int64_t(C) * kThreads) o[j] = -1;
  cluster.sync();  // no block leaves while another may read its shared memory
}

// Blocks a query and threads a block for a batch of nq queries seeing up to
// max_visible positions: a cluster of up to 8 blocks while the queries leave
// SMs idle, 1024 threads for long rows and 256 for short ones.
struct SelectShape {
  int cluster, threads;
  int64_t smem_keys;
};
SelectShape select_shape(int64_t nq, int64_t max_visible) {
  SelectShape sh{};
  sh.cluster = nq <= 16 ? kSelectMaxCluster : nq <= 32 ? 4 : nq <= 66 ? 2 : 1;
  // A few thousand keys a block at least.
  while (sh.cluster > 1 && max_visible <= int64_t(sh.cluster / 2) * 4096) sh.cluster /= 2;
  const int64_t per_block = ((max_visible + sh.cluster - 1) / sh.cluster + 31) / 32 * 32;
  sh.threads = per_block >= 8192 ? 1024 : 256;
  sh.smem_keys = per_block <= kSelectMaxSmemKeys ? per_block : 0;
  return sh;
}

template <int kThreads>
void launch_select(const SelectArgs& a, int64_t nq, const SelectShape& sh, cudaStream_t s) {
  static const bool sized = [] {
    DZ_CUDA_CHECK(cudaFuncSetAttribute(select_kernel<kThreads>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(kSelectMaxSmemKeys * sizeof(uint32_t))));
    return true;
  }();
  (void)sized;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(sh.cluster), unsigned(nq));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = size_t(sh.smem_keys) * sizeof(uint32_t);
  cfg.stream = s;
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(sh.cluster), attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  DZ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, select_kernel<kThreads>, a));
}

void select_rows(const float* scores, int64_t ld, int64_t q0, int64_t nq, const int64_t* n_visible, int64_t max_visible,
                 int k, int32_t* out, cudaStream_t st) {
  const SelectShape sh = select_shape(nq, max_visible);
  for (int64_t r0 = 0; r0 < nq; r0 += 65535) {  // the grid's y extent
    const SelectArgs sa{scores + r0 * ld, ld, q0 + r0, n_visible, max_visible, k, out, sh.smem_keys};
    (sh.threads == 1024 ? launch_select<1024> : launch_select<256>)(sa, std::min<int64_t>(65535, nq - r0), sh, st);
  }
}

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

// Queries scored at a time: the grid's y extent bounds a block of them.
int64_t query_block_of(const IndexerQueries& a, int64_t query_block) {
  return std::max<int64_t>(1, std::min({query_block, a.n_q, int64_t(65535)}));
}

struct Scratch {
  uint8_t* q8;
  float* qw;
  float* scores;
};
Scratch carve(const IndexerQueries& a, int64_t qb, void* base) {
  uint8_t* p = static_cast<uint8_t*>(base);
  Scratch s{};
  s.q8 = p, p += align256(size_t(qb) * a.n_heads * a.head_dim);
  s.qw = reinterpret_cast<float*>(p), p += align256(size_t(qb) * a.n_heads * sizeof(float));
  s.scores = a.scores ? nullptr : reinterpret_cast<float*>(p);
  return s;
}

}  // namespace

void indexer_validate(const IndexerQueries& a) {
  check(a.n_heads > 0 && a.n_heads <= 128 && a.n_heads % 16 == 0, DZ_ERR_UNSUPPORTED,
        "CUDA indexer: index_n_heads = ", a.n_heads, " (a multiple of 16 up to 128)");
  check(a.head_dim == 32 || a.head_dim == 64 || a.head_dim == 128, DZ_ERR_UNSUPPORTED,
        "CUDA indexer: index_head_dim = ", a.head_dim, " (32, 64 or 128)");
  check(a.topk > 0, DZ_ERR_INVALID_ARGUMENT, "CUDA indexer: top-k ", a.topk);
  check(a.n_q >= 0 && a.max_visible >= 0, DZ_ERR_INVALID_ARGUMENT, "CUDA indexer: negative counts");
  check(a.keys.page_tokens > 0 && a.keys.stride % 4 == 0 && a.keys.offset % 4 == 0, DZ_ERR_INVALID_ARGUMENT,
        "CUDA indexer: key records need 4-byte alignment (stride ", a.keys.stride, ", offset ", a.keys.offset, ")");
  check(a.keys.offset + size_t(a.head_dim) + 4 <= a.keys.stride, DZ_ERR_INVALID_ARGUMENT, "CUDA indexer: a key (",
        a.head_dim + 4, " bytes at ", a.keys.offset, ") overruns its ", a.keys.stride, "-byte record");
}

size_t indexer_scratch_bytes(const IndexerQueries& a, int64_t query_block) {
  const int64_t qb = query_block_of(a, query_block);
  size_t b = align256(size_t(qb) * a.n_heads * a.head_dim) + align256(size_t(qb) * a.n_heads * sizeof(float));
  if (!a.scores) b += align256(size_t(qb) * size_t(std::max<int64_t>(1, a.max_visible)) * sizeof(float));
  return b;
}

void indexer_select(const IndexerQueries& a, void* scratch, size_t scratch_bytes, int64_t query_block,
                    cudaStream_t st) {
  indexer_validate(a);
  if (a.n_q == 0) return;
  const int64_t qb = query_block_of(a, query_block);
  check(scratch_bytes >= indexer_scratch_bytes(a, qb), DZ_ERR_INVALID_ARGUMENT, "CUDA indexer: scratch of ",
        scratch_bytes, " bytes, needs ", indexer_scratch_bytes(a, qb));
  const Scratch sc = carve(a, qb, scratch);
  const int H = a.n_heads, D = a.head_dim;
  const float inv_sqrt_d = float(1.0 / std::sqrt(double(D))), h_scale = float(1.0 / std::sqrt(double(H)));
  const int64_t ld = std::max<int64_t>(1, a.max_visible);
  // One prompt's queries at V3.2's shape share key tiles on the tensor cores (sm_90a).
  // One prompt's queries at V3.2's shape share key tiles on the tensor cores (sm_90a).
  const bool wgmma = a.same_pages && H == kWgHeads && D == kWgD && Fp8GroupedGemm::supported();
  if (wgmma) {
    static const bool sized = [] {
      DZ_CUDA_CHECK(
          cudaFuncSetAttribute(score_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WgSmem::bytes));
      return true;
    }();
    (void)sized;
  }
  for (int64_t q0 = 0; q0 < a.n_q; q0 += qb) {
    const int64_t nq = std::min(qb, a.n_q - q0);
    const unsigned eb = unsigned((nq * H + kEncodeWarps - 1) / kEncodeWarps);
    (D == 32   ? encode_queries_kernel<1>
     : D == 64 ? encode_queries_kernel<2>
               : encode_queries_kernel<4>)<<<eb, kEncodeWarps * 32, 0, st>>>(
        a.q + q0 * H * D, a.w + q0 * H, nq * H, D, inv_sqrt_d, h_scale, a.pow2_scales, sc.q8, sc.qw);
    DZ_CUDA_LAUNCH_CHECK();
    float* scores = a.scores ? a.scores + q0 * ld : sc.scores;
    if (a.max_visible > 0) {
      if (wgmma) {
        WgArgs w{};
        const cuuint64_t dims[2] = {cuuint64_t(kWgD), cuuint64_t(nq * kWgHeads)}, strides[1] = {cuuint64_t(kWgD)};
        const cuuint32_t box[2] = {kWgD, kWgHeads};
        encode_tensor_map(&w.qmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, sc.q8, dims, strides, box,
                          CU_TENSOR_MAP_SWIZZLE_128B, "indexer queries");
        w.qw = sc.qw, w.q0 = q0, w.nq = nq, w.pages = a.pages, w.n_visible = a.n_visible;
        w.max_visible = a.max_visible, w.keys = a.keys, w.scores = scores, w.ld = ld;
        const dim3 grid(unsigned((a.max_visible + kWgKeys - 1) / kWgKeys), unsigned((nq + kWgChunk - 1) / kWgChunk));
        score_wgmma_kernel<<<grid, kWgThreads, WgSmem::bytes, st>>>(w);
      } else {
        // Runs of 64 keys a warp while the queries leave SMs idle, 256 once they fill the GPU.
        const int kpw = nq * a.max_visible >= (int64_t(1) << 22) ? 256 : 64;
        const ScoreArgs s{sc.q8, sc.qw, q0, a.pages, a.n_visible, a.max_visible, a.keys, scores, ld, H, D, kpw};
        const dim3 grid(unsigned((a.max_visible + kScoreWarps * kpw - 1) / (kScoreWarps * kpw)), unsigned(nq));
        switch (std::min(H, 64) / 16) {
          case 1:
            score_kernel<1><<<grid, kScoreWarps * 32, 0, st>>>(s);
            break;
          case 2:
            score_kernel<2><<<grid, kScoreWarps * 32, 0, st>>>(s);
            break;
          case 3:
            score_kernel<3><<<grid, kScoreWarps * 32, 0, st>>>(s);
            break;
          default:
            score_kernel<4><<<grid, kScoreWarps * 32, 0, st>>>(s);
            break;
        }
      }
      DZ_CUDA_LAUNCH_CHECK();
    }
    select_rows(scores, ld, q0, nq, a.n_visible, a.max_visible, a.topk, a.out, st);
  }
}

void indexer_topk(const float* scores, int64_t ld, int64_t n_q, const int64_t* n_visible, int64_t max_visible, int k,
                  int32_t* out, cudaStream_t s) {
  check(k > 0 && n_q >= 0 && max_visible >= 0 && ld >= std::max<int64_t>(1, max_visible), DZ_ERR_INVALID_ARGUMENT,
        "CUDA top-k: k ", k, ", ", n_q, " rows of ", max_visible, " scores, ", ld, " apart");
  if (n_q == 0) return;
  check(scores != nullptr || max_visible == 0, DZ_ERR_INVALID_ARGUMENT, "CUDA top-k: no scores");
  check(n_visible != nullptr && out != nullptr, DZ_ERR_INVALID_ARGUMENT, "CUDA top-k: null pointer");
  select_rows(scores, ld, 0, n_q, n_visible, max_visible, k, out, s);
}

namespace {
void encode_keys(int head_dim, bool pow2_scales, const float* k, int64_t n, const int64_t* pos, uint8_t* const* pages,
                 uint8_t* const* const* row_pages, const IndexerKeys& keys, cudaStream_t st) {
  check(head_dim == 32 || head_dim == 64 || head_dim == 128, DZ_ERR_UNSUPPORTED,
        "CUDA indexer: index_head_dim = ", head_dim, " (32, 64 or 128)");
  if (n == 0) return;
  (head_dim == 32 ? encode_keys_kernel<1>
   : head_dim == 64
       ? encode_keys_kernel<2>
       : encode_keys_kernel<4>)<<<unsigned((n + kEncodeWarps - 1) / kEncodeWarps), kEncodeWarps * 32, 0, st>>>(
      k, n, head_dim, float(1.0 / std::sqrt(double(head_dim))), pow2_scales, pos, pages, row_pages, keys);
  DZ_CUDA_LAUNCH_CHECK();
}
}  // namespace

void indexer_encode_keys(int head_dim, bool pow2_scales, const float* k, int64_t n, const int64_t* pos,
                         uint8_t* const* pages, const IndexerKeys& keys, cudaStream_t st) {
  encode_keys(head_dim, pow2_scales, k, n, pos, pages, nullptr, keys, st);
}

void indexer_encode_keys_rows(int head_dim, bool pow2_scales, const float* k, int64_t n, const int64_t* pos,
                              uint8_t* const* const* row_pages, const IndexerKeys& keys, cudaStream_t st) {
  encode_keys(head_dim, pow2_scales, k, n, pos, nullptr, row_pages, keys, st);
}

}  // namespace dz::cuda
