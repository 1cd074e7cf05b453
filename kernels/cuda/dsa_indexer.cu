#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "common/error.h"
#include "cuda/dsa_indexer.h"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kMaxD = 128;
constexpr int kScoreWarps = 4;
constexpr int kKeysPerWarp = 32;  // four MMA column groups of 8 keys
constexpr int kTileKeys = kScoreWarps * kKeysPerWarp;
constexpr int kQueryGroup = 4;  // queries a score block takes in turn (prefill: the keys stay in L1)
constexpr int kSelectThreads = 512;

// ------------------------------------------------------------ encoding
// One vector of D values (D threads): the Hadamard butterflies in the CPU's
// order (the same floats), the 1/sqrt(D) factor, then E4M3 under one scale
// amax / 448 (rounded up to a power of two when pow2), as
// cpu::fp8_quantize_block. Returns the scale (every thread).
__device__ float hadamard_quantize(float x, int D, float inv_sqrt_d, bool pow2, uint8_t* out) {
  __shared__ float v[kMaxD];
  __shared__ float wmax[kMaxD / 32];
  const int d = threadIdx.x;
  v[d] = x;
  __syncthreads();
  for (int h = 1; h < D; h *= 2) {
    float a = 0.f, b = 0.f;
    const bool lead = (d & h) == 0;
    if (lead) a = v[d], b = v[d + h];
    __syncthreads();
    if (lead) v[d] = a + b, v[d + h] = a - b;
    __syncthreads();
  }
  const float r = v[d] * inv_sqrt_d;
  float m = fabsf(r);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((d & 31) == 0) wmax[d >> 5] = m;
  __syncthreads();
  float amax = 0.f;
  for (int i = 0; i < D / 32; ++i) amax = fmaxf(amax, wmax[i]);
  float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
  if (pow2 && amax > 0.f) {  // the power of two at or above the scale, exactly
    int e;
    const float f = frexpf(scale, &e);  // scale = f 2^e, f in [0.5, 1)
    scale = ldexpf(1.f, f == 0.5f ? e - 1 : e);
  }
  out[d] = uint8_t(__nv_cvt_float_to_fp8(__fdiv_rn(r, scale), __NV_SATFINITE, __NV_E4M3));
  __syncthreads();  // v and wmax are reused by the caller's next vector
  return scale;
}

// Queries [nq, H, D] -> q8 [nq, H, D] and qw [nq, H] = w H^-0.5 D^-0.5 qs:
// every positive factor of a head's logit but the key's scale. Block (i, h).
__global__ void encode_queries_kernel(const float* q, const float* w, int D, float inv_sqrt_d, float h_scale, bool pow2,
                                      uint8_t* q8, float* qw) {
  const int64_t ih = blockIdx.x;
  const float s = hadamard_quantize(q[ih * D + threadIdx.x], D, inv_sqrt_d, pow2, q8 + ih * D);
  if (threadIdx.x == 0) qw[ih] = w[ih] * h_scale * inv_sqrt_d * s;
}

__global__ void encode_keys_kernel(const float* k, int D, float inv_sqrt_d, bool pow2, const int64_t* pos,
                                   uint8_t* const* pages, IndexerKeys keys) {
  const int64_t i = blockIdx.x, p = pos[i];
  uint8_t* const rec = pages[p / keys.page_tokens] + (p % keys.page_tokens) * keys.stride + keys.offset;
  const float s = hadamard_quantize(k[i * D + threadIdx.x], D, inv_sqrt_d, pow2, rec);
  if (threadIdx.x == 0) *reinterpret_cast<float*>(rec + D) = s;
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
  int64_t q0, nq;     // the block's first query (into pages / n_visible) and count
  const uint8_t* const* const* pages;
  const int64_t* n_visible;
  int64_t max_visible;
  IndexerKeys keys;
  float* scores;  // [nq, ld]
  int64_t ld;
  int H, D;
};

// Block (key tile, query group): each warp 32 keys, MMA rows 16 heads, MMA
// columns 8 keys, K = D in steps of 32. A fragments are the queries' E4M3
// bytes, B the keys', straight from memory (4-byte loads; a quad reads 16
// contiguous bytes of a key).
__global__ void __launch_bounds__(kScoreWarps * 32) score_kernel(const ScoreArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t s0 = int64_t(blockIdx.x) * kTileKeys + warp * kKeysPerWarp;
  const int nks = a.D / 32;
  for (int qi = 0; qi < kQueryGroup; ++qi) {
    const int64_t i = int64_t(blockIdx.y) * kQueryGroup + qi;
    if (i >= a.nq) break;
    const int64_t vis = min(a.n_visible[a.q0 + i], a.max_visible);
    if (int64_t(blockIdx.x) * kTileKeys >= vis) continue;  // uniform over the block
    if (s0 >= vis) continue;                               // uniform over the warp
    const uint8_t* const* pages = a.pages[a.q0 + i];
    // This lane's keys: column g of each group of 8, bytes 4t.. and 16 + 4t.. of every 32.
    uint32_t kb[4][4][2];
#pragma unroll
    for (int ng = 0; ng < 4; ++ng) {
      const int64_t s = s0 + 8 * ng + g;
      const uint8_t* rec = nullptr;
      if (s < vis) rec = pages[s / a.keys.page_tokens] + (s % a.keys.page_tokens) * a.keys.stride + a.keys.offset;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const bool ok = rec && ks < nks;
        kb[ng][ks][0] = ok ? __ldg(reinterpret_cast<const uint32_t*>(rec + 32 * ks + 4 * t)) : 0u;
        kb[ng][ks][1] = ok ? __ldg(reinterpret_cast<const uint32_t*>(rec + 32 * ks + 16 + 4 * t)) : 0u;
      }
    }
    float part[4][2] = {};
    const uint8_t* qrow = a.q8 + i * a.H * a.D;
    const float* qw = a.qw + i * a.H;
    for (int m0 = 0; m0 < a.H; m0 += 16) {
      uint32_t qa[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const bool ok = ks < nks;
        const uint8_t* r0 = qrow + int64_t(m0 + g) * a.D + 32 * ks + 4 * t;
        const uint8_t* r1 = r0 + 8 * a.D;
        qa[ks][0] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r0)) : 0u;
        qa[ks][1] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r1)) : 0u;
        qa[ks][2] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r0 + 16)) : 0u;
        qa[ks][3] = ok ? __ldg(reinterpret_cast<const uint32_t*>(r1 + 16)) : 0u;
      }
      const float w0 = qw[m0 + g], w1 = qw[m0 + g + 8];
#pragma unroll
      for (int ng = 0; ng < 4; ++ng) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          if (ks < nks) mma_e4m3(c, qa[ks], kb[ng][ks][0], kb[ng][ks][1]);
        // c: heads m0 + g (0, 1) and m0 + g + 8 (2, 3); keys 2t, 2t + 1 of the group.
        part[ng][0] += w0 * fmaxf(c[0], 0.f) + w1 * fmaxf(c[2], 0.f);
        part[ng][1] += w0 * fmaxf(c[1], 0.f) + w1 * fmaxf(c[3], 0.f);
      }
    }
    // Sum over the heads held by the 8 lanes of each t; lanes 0-3 write.
#pragma unroll
    for (int ng = 0; ng < 4; ++ng)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float v = part[ng][j];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        part[ng][j] = v;
      }
    if (g == 0)
#pragma unroll
      for (int ng = 0; ng < 4; ++ng)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t s = s0 + 8 * ng + 2 * t + j;
          if (s >= vis) continue;
          const uint8_t* rec = pages[s / a.keys.page_tokens] + (s % a.keys.page_tokens) * a.keys.stride + a.keys.offset;
          a.scores[i * a.ld + s] = *reinterpret_cast<const float*>(rec + a.D) * part[ng][j];
        }
  }
}

// ------------------------------------------------------------ selection
// A score as an unsigned key, larger first; +0 and -0 one value; NaN 0 (never selected).
__device__ __forceinline__ uint32_t order_key(float x) { return x != x ? 0u : ptx::float_order(x); }

struct Counts {
  int gt, eq;
};
struct CountsSum {
  __device__ Counts operator()(const Counts& x, const Counts& y) const { return {x.gt + y.gt, x.eq + y.eq}; }
};
using SelectScan = cub::BlockScan<Counts, kSelectThreads>;

// One block a query: the k-th largest key by four 8-bit radix passes, then
// the selection in position order (so ascending): every key above it and the
// first `need` equal to it.
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const float* scores, int64_t ld, int64_t q0, const int64_t* n_visible, int64_t max_visible, int k,
                  int32_t* out) {
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_remaining;
  __shared__ typename SelectScan::TempStorage scan;
  __shared__ Counts s_carry;
  const int64_t i = blockIdx.x;
  const float* row = scores + i * ld;
  const int64_t n = min(n_visible[q0 + i], max_visible);
  int32_t* o = out + (q0 + i) * int64_t(k);
  const int tid = threadIdx.x;
  if (n <= k) {  // everything visible, in order (NaN scores dropped as the CPU does)
    if (tid == 0) s_carry = {0, 0};
    __syncthreads();
    for (int64_t base = 0; base < n; base += kSelectThreads) {
      const int64_t s = base + tid;
      const int keep = s < n && order_key(row[s]) != 0u;
      Counts c{keep, 0}, pre, tot;
      SelectScan(scan).ExclusiveScan(c, pre, Counts{0, 0}, CountsSum(), tot);
      if (keep) o[s_carry.gt + pre.gt] = int32_t(s);
      __syncthreads();
      if (tid == 0) s_carry.gt += tot.gt;
      __syncthreads();
    }
    for (int64_t j = s_carry.gt + tid; j < k; j += kSelectThreads) o[j] = -1;
    return;
  }
  if (tid == 0) s_prefix = 0u, s_remaining = k;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t hi_mask = pass == 0 ? 0u : ~0u << (32 - 8 * pass);
    for (int b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    for (int64_t s = tid; s < n; s += kSelectThreads) {
      const uint32_t u = order_key(row[s]);
      if ((u & hi_mask) == prefix) atomicAdd(&hist[(u >> shift) & 255], 1);
    }
    __syncthreads();
    if (tid < 32) {  // the digit whose bin holds the remaining k-th key, from the top
      int rem = s_remaining;
      int acc = 0, digit = 0;
      for (int b = 255; b >= 0; --b) {
        if (acc + hist[b] >= rem) {
          digit = b;
          break;
        }
        acc += hist[b];
      }
      if (tid == 0) s_prefix = prefix | (uint32_t(digit) << shift), s_remaining = rem - acc;
    }
    __syncthreads();
  }
  const uint32_t T = s_prefix;
  const int need = T == 0u ? 0 : s_remaining;  // keys equal to T to keep (none when T is the NaN key)
  if (tid == 0) s_carry = {0, 0};
  __syncthreads();
  for (int64_t base = 0; base < n; base += kSelectThreads) {
    const int64_t s = base + tid;
    const uint32_t u = s < n ? order_key(row[s]) : 0u;
    const Counts c{u > T && u != 0u, u == T && T != 0u};
    Counts pre, tot;
    SelectScan(scan).ExclusiveScan(c, pre, Counts{0, 0}, CountsSum(), tot);
    const Counts carry = s_carry;
    const int eq_before = carry.eq + pre.eq;
    if (c.gt || (c.eq && eq_before < need)) o[carry.gt + pre.gt + min(eq_before, need)] = int32_t(s);
    __syncthreads();
    if (tid == 0) s_carry = {carry.gt + tot.gt, carry.eq + tot.eq};
    __syncthreads();
  }
  const int taken = s_carry.gt + min(s_carry.eq, need);
  for (int64_t j = taken + tid; j < k; j += kSelectThreads) o[j] = -1;
}

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

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
  const int64_t qb = std::max<int64_t>(1, std::min(query_block, a.n_q));
  size_t b = align256(size_t(qb) * a.n_heads * a.head_dim) + align256(size_t(qb) * a.n_heads * sizeof(float));
  if (!a.scores) b += align256(size_t(qb) * size_t(std::max<int64_t>(1, a.max_visible)) * sizeof(float));
  return b;
}

void indexer_select(const IndexerQueries& a, void* scratch, size_t scratch_bytes, int64_t query_block,
                    cudaStream_t st) {
  indexer_validate(a);
  if (a.n_q == 0) return;
  const int64_t qb = std::max<int64_t>(1, std::min(query_block, a.n_q));
  check(scratch_bytes >= indexer_scratch_bytes(a, qb), DZ_ERR_INVALID_ARGUMENT, "CUDA indexer: scratch of ",
        scratch_bytes, " bytes, needs ", indexer_scratch_bytes(a, qb));
  const Scratch sc = carve(a, qb, scratch);
  const int H = a.n_heads, D = a.head_dim;
  const float inv_sqrt_d = float(1.0 / std::sqrt(double(D))), h_scale = float(1.0 / std::sqrt(double(H)));
  const int64_t ld = std::max<int64_t>(1, a.max_visible);
  for (int64_t q0 = 0; q0 < a.n_q; q0 += qb) {
    const int64_t nq = std::min(qb, a.n_q - q0);
    encode_queries_kernel<<<unsigned(nq * H), unsigned(D), 0, st>>>(a.q + q0 * H * D, a.w + q0 * H, D, inv_sqrt_d,
                                                                    h_scale, a.pow2_scales, sc.q8, sc.qw);
    DZ_CUDA_LAUNCH_CHECK();
    float* scores = a.scores ? a.scores + q0 * ld : sc.scores;
    if (a.max_visible > 0) {
      ScoreArgs s{sc.q8, sc.qw, q0, nq, a.pages, a.n_visible, a.max_visible, a.keys, scores, ld, H, D};
      const dim3 grid(unsigned((a.max_visible + kTileKeys - 1) / kTileKeys),
                      unsigned((nq + kQueryGroup - 1) / kQueryGroup));
      score_kernel<<<grid, kScoreWarps * 32, 0, st>>>(s);
      DZ_CUDA_LAUNCH_CHECK();
    }
    select_kernel<<<unsigned(nq), kSelectThreads, 0, st>>>(scores, ld, q0, a.n_visible, a.max_visible, a.topk, a.out);
    DZ_CUDA_LAUNCH_CHECK();
  }
}

void indexer_encode_keys(int head_dim, bool pow2_scales, const float* k, int64_t n, const int64_t* pos,
                         uint8_t* const* pages, const IndexerKeys& keys, cudaStream_t st) {
  check(head_dim == 32 || head_dim == 64 || head_dim == 128, DZ_ERR_UNSUPPORTED,
        "CUDA indexer: index_head_dim = ", head_dim, " (32, 64 or 128)");
  if (n == 0) return;
  encode_keys_kernel<<<unsigned(n), unsigned(head_dim), 0, st>>>(k, head_dim, float(1.0 / std::sqrt(double(head_dim))),
                                                                 pow2_scales, pos, pages, keys);
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
