#include <cuda_bf16.h>

#include <algorithm>

#include "common/error.h"
#include "cuda/attention.h"
#include "cuda/fp8_grouped_gemm.h"
#include "cuda/pdl.cuh"
#include "cuda/ptx.cuh"
#include "runtime/cuda/cuda_check.h"

// wgmma exists only in the sm_90a target: elsewhere the wgmma prefill kernel's
// body is empty and the host does not choose it (Fp8GroupedGemm::supported).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DZ_ATTN_SM90A 1
#endif

namespace dz::cuda {

namespace {

// The factor that finishes a row's softmax state (running max m and sum l, in
// log2 units, over the output o) with the sink as one more column:
// out = o * 2^(m - M) / (l 2^(m - M) + 2^(sink - M)), M = max(m, sink).
__device__ __forceinline__ float sink_finish(float m, float l, float sink) {
  const float mx = fmaxf(m, sink), w = exp2f(m - mx);
  return w / (l * w + exp2f(sink - mx));
}

constexpr float kLog2e = 1.4426950408889634f;

// The K row (all KV heads, bf16; the V row follows at + n_kv_heads * head_dim)
// of token `slot` of storage page `page`.
__device__ __forceinline__ const __nv_bfloat16* page_row(const AttnBatch& a, int64_t page, int slot) {
  return reinterpret_cast<const __nv_bfloat16*>(a.kv + page * a.page_bytes +
                                                int64_t(slot) * (2 * a.n_kv_heads * a.head_dim) * 2);
}
// Token j's K row, through the sequence's page table pt.
__device__ __forceinline__ const __nv_bfloat16* key_row(const AttnBatch& a, const int32_t* pt, int j) {
  return page_row(a, pt[j / a.page_tokens], j % a.page_tokens);
}

// A prefill thread's keys in the K/V ring: keys key0 + i * kStride (i < N) of
// each stage of kKeys keys, as (page of the sequence's table, token in the
// page), moved on a stage at a time. key_row's division by the page size
// (~20 instructions a key and stage) happens once, at the first stage.
template <int N, int kStride, int kKeys>
struct RingKeys {
  int key0, page[N], slot[N], step_pages, step_slots;
  __device__ RingKeys(const AttnBatch& a, int j0, int key0_) : key0(key0_) {
    step_pages = kKeys / a.page_tokens, step_slots = kKeys - step_pages * a.page_tokens;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int j = j0 + key0 + i * kStride;
      page[i] = j / a.page_tokens, slot[i] = j - page[i] * a.page_tokens;
    }
  }
  // Key i's K row at the current stage (all KV heads; V at + n_kv_heads * head_dim).
  __device__ const __nv_bfloat16* row(const AttnBatch& a, const int32_t* pt, int i) const {
    return page_row(a, pt[page[i]], slot[i]);
  }
  __device__ void next(const AttnBatch& a) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      slot[i] += step_slots, page[i] += step_pages;
      if (slot[i] >= a.page_tokens) slot[i] -= a.page_tokens, ++page[i];
    }
  }
  // The current stage (first key j0): this thread's 16-byte piece at element
  // col of each of its keys' K rows to dst(key) and of the V row (kvd
  // elements on) to dst(key) + v_off, by asynchronous copies, zeros for keys
  // past khi; then on to the next stage. The kernels differ only in dst.
  template <typename Dst>
  __device__ void copy_stage(const AttnBatch& a, const int32_t* pt, int j0, int khi, int col, int kvd, uint32_t v_off,
                             Dst dst) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int key = key0 + i * kStride;
      const bool ok = j0 + key <= khi;
      const __nv_bfloat16* kr = ok ? row(a, pt, i) + col : reinterpret_cast<const __nv_bfloat16*>(a.kv);
      const uint32_t d = dst(key);
      ptx::cp_async16_zfill(d, kr, ok ? 16 : 0);
      ptx::cp_async16_zfill(d + v_off, kr + (ok ? kvd : 0), ok ? 16 : 0);
    }
    next(a);
  }
};

// One block (4 warps) per (row, head); lane holds D/32 dims; each warp takes
// groups of 4 keys (4 independent dot products in flight), then the warps'
// partial softmax states are merged.
template <int D>
__global__ void __launch_bounds__(128) decode_kernel(AttnBatch a, const int32_t* __restrict__ rows) {
  constexpr int PER = D / 32;
  const int r = rows[blockIdx.x], h = blockIdx.y;
  const int item = a.row_item[r], pos = a.row_pos[r];
  const int lo = a.window > 0 ? max(0, pos - a.window + 1) : 0;
  const int kvh = h / (a.n_heads / a.n_kv_heads);
  const int KVD = a.n_kv_heads * D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float sl2 = a.scale * kLog2e;
  const int32_t* pt = a.page_table + a.item_pt[item];
  float q[PER], acc[PER];
  const float* qr = a.q + size_t(r) * a.q_stride + h * D + lane * PER;
#pragma unroll
  for (int i = 0; i < PER; ++i) q[i] = qr[i] * sl2, acc[i] = 0;
  float m = warp == 0 ? a.sinks[h] * kLog2e : -INFINITY, l = warp == 0 ? 1.f : 0.f;
  for (int j0 = lo + warp * 4; j0 <= pos; j0 += 16) {
    float s[4], v[4][PER];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = j0 + u;
      s[u] = 0;
#pragma unroll
      for (int i = 0; i < PER; ++i) v[u][i] = 0;
      if (j <= pos) {
        const __nv_bfloat16* kr = key_row(a, pt, j) + kvh * D + lane * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) s[u] += q[i] * __bfloat162float(kr[i]);
#pragma unroll
        for (int i = 0; i < PER; ++i) v[u][i] = __bfloat162float(kr[KVD + i]);
      }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1)
#pragma unroll
      for (int u = 0; u < 4; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
    float mc = -INFINITY;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (j0 + u > pos) s[u] = -INFINITY;
      mc = fmaxf(mc, s[u]);
    }
    const float nm = fmaxf(m, mc), f = exp2f(m - nm);
    l *= f;
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] *= f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float p = exp2f(s[u] - nm);
      l += p;
#pragma unroll
      for (int i = 0; i < PER; ++i) acc[i] += p * v[u][i];
    }
    m = nm;
  }
  __shared__ float sm[4], sl[4], sacc[4][D];
  if (lane == 0) sm[warp] = m, sl[warp] = l;
#pragma unroll
  for (int i = 0; i < PER; ++i) sacc[warp][lane * PER + i] = acc[i];
  __syncthreads();
  if (warp == 0) {
    const float M = fmaxf(fmaxf(sm[0], sm[1]), fmaxf(sm[2], sm[3]));
    float L = 0, w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = sm[k] == -INFINITY ? 0.f : exp2f(sm[k] - M), L += sl[k] * w[k];
    const size_t ob = size_t(r) * a.n_heads * D + h * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane * PER + i;
      const float x = (sacc[0][d] * w[0] + sacc[1][d] * w[1] + sacc[2][d] * w[2] + sacc[3][d] * w[3]) / L;
      if (a.out_f32)
        a.out_f32[ob + d] = x;
      else
        reinterpret_cast<__nv_bfloat16*>(a.out)[ob + d] = __float2bfloat16_rn(x);
    }
  }
}

// ----------------------------------------------------------- split-K decode

constexpr int kSplitKeys = 32;  // chunk sizes are multiples of this
constexpr int kTileKeys = 16;   // keys a warp takes at a time (one MMA k step of P V)
constexpr int kSplitWarps = 4;  // a block's warps take its chunk's tiles in turn
constexpr int kSplitThreads = 32 * kSplitWarps;
constexpr int kSplitHeads = 16;  // query heads of one KV head a block: the MMA's rows
constexpr int kSplitStages = 3;  // K/V tiles in flight a warp

// Shared memory: per warp and stage a K and a V tile of kTileKeys rows of D
// bf16, each row padded by 16 bytes so ldmatrix's eight rows hit distinct
// banks; after the key loop the same bytes hold the warps' softmax states.
template <int D>
constexpr int split_row() {
  return D + 8;  // bf16 elements
}
template <int D>
constexpr uint32_t split_tile_bytes() {
  return uint32_t(kTileKeys * split_row<D>() * 2);
}
template <int D>
constexpr size_t split_smem() {
  const size_t tiles = size_t(kSplitWarps) * kSplitStages * 2 * split_tile_bytes<D>();
  const size_t merge = size_t(kSplitWarps) * kSplitHeads * (D + 2) * 4;
  return tiles > merge ? tiles : merge;
}

// The policy's chunk for len keys (see DecodeSplitPolicy), then larger if a
// grid of `splits` blocks per row is too small for it.
__host__ __device__ inline int chunk_keys(int len, const DecodeSplitPolicy& p, int splits) {
  int64_t c = p.min_chunk;
  for (;; c *= 2) {  // at most base_splits * (c / min_chunk) chunks of c keys, and max_splits
    const int64_t n = (int64_t(len) + c - 1) / c;
    if (n <= p.max_splits && n <= int64_t(p.base_splits) * (c / p.min_chunk)) break;
  }
  const int64_t need = (int64_t(len) + splits - 1) / splits;  // a grid too small for the policy: larger chunks
  if (need > c) c = (need + kSplitKeys - 1) / kSplitKeys * kSplitKeys;
  return int(c);
}

__device__ __forceinline__ int row_lo(const AttnBatch& a, int pos) {
  return a.window > 0 ? max(0, pos - a.window + 1) : 0;
}

// Partial state of (row i, head h, chunk c): acc[D] | m | l | pad (m in log2
// units; D + 4 floats keep every state 16-byte aligned for vector access).
__host__ __device__ inline size_t partial_stride(int D) { return size_t(D) + 4; }
__device__ __forceinline__ size_t partial_off(int i, int h, int c, int n_heads, int splits, int D) {
  return ((size_t(i) * n_heads + h) * splits + c) * partial_stride(D);
}

// x0, x1 as two bf16 pairs, hi (rounded) + lo (the remainder, rounded): ~16
// significant bits, so bf16 MMAs on fp32 queries and probabilities lose next
// to nothing; only K and V are bf16 themselves.
// hi's halves read back as floats by a shift and a mask (__bfloat1622float2
// took two byte permutes and two multiplies for the same values).
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  hi = reinterpret_cast<const uint32_t&>(h);
  const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xFFFF0000u);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - h0, x1 - h1);
  lo = reinterpret_cast<const uint32_t&>(l);
}

// Q fragments of a warp's 16 MMA rows as hi + lo bf16 pairs, scaled to log2
// units: this thread's rows g (qa) and g + 8 (qb), fp32 [D]; null: a row of
// zeros.
template <int D>
__device__ __forceinline__ void q_frags(const float* qa, const float* qb, float sl2, uint32_t (&qh)[D / 16][4],
                                        uint32_t (&ql)[D / 16][4]) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {  // a0 / a2: row g, a1 / a3: row g + 8
        const float* q = rr ? qb : qa;
        const int k = 16 * ks + 8 * hf + 2 * t;
        split_bf16(q ? q[k] * sl2 : 0.f, q ? q[k + 1] * sl2 : 0.f, qh[ks][2 * hf + rr], ql[ks][2 * hf + rr]);
      }
}

// ldmatrix byte offsets in a tile of rows of `row` bf16 (lane -> row lane % 8
// of matrix lane / 8). K: matrices (keys 0-7 | 8-15) x (dims +0 | +8) give b0,
// b1 of both key n-tiles; V (transposed): (keys 0-7 | 8-15) x (dims of n-tile
// nd | nd + 1).
__device__ __forceinline__ uint32_t k_ldsm_off(int lane, int row) {
  return uint32_t(((lane >> 4) * 8 + (lane & 7)) * row + ((lane >> 3) & 1) * 8) * 2;
}
__device__ __forceinline__ uint32_t v_ldsm_off(int lane, int row) {
  return uint32_t((((lane >> 3) & 1) * 8 + (lane & 7)) * row + (lane >> 4) * 8) * 2;
}

// Online softmax over NS 8-key column tiles of a warp's 16 rows in the MMA
// accumulator layout (s[n][2 rr + e]: row g + 8 rr, key 8 n + 2 t + e): with
// `masked`, keys kk row rr may not see (!see(rr, kk)) drop out; then one max
// and rescale of m, l and acc for all of them, s turned into probabilities.
template <int NS, int NT, typename See>
__device__ __forceinline__ void softmax_update(float (&s)[NS][4], float (&m)[2], float (&l)[2], float (&acc)[NT][4],
                                               bool masked, See see) {
  const int t = threadIdx.x & 3;
  if (masked)
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (!see(rr, 8 * n + 2 * t + e)) s[n][2 * rr + e] = -INFINITY;
  float f[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = fmaxf(s[0][2 * rr], s[0][2 * rr + 1]);
#pragma unroll
    for (int n = 1; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * rr], s[n][2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float nm = fmaxf(m[rr], mx), base = nm == -INFINITY ? 0.f : nm;  // nothing seen yet: all terms 0
    f[rr] = ptx::ex2_ftz(m[rr] - base);
    m[rr] = nm;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NS; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) s[n][2 * rr + e] = ptx::ex2_ftz(s[n][2 * rr + e] - base);
#pragma unroll
    for (int n = 0; n < NS; n += 2)  // pairs of tiles: the sum order of the 16-key form, (s0 pair) + (s1 pair)
      sum += (s[n][2 * rr] + s[n][2 * rr + 1]) + (s[n + 1][2 * rr] + s[n + 1][2 * rr + 1]);
    l[rr] = l[rr] * f[rr] + sum;
  }
  // Once a row's maximum settles (most updates of a long prompt) f is exactly
  // 1: a warp whose rows all kept theirs skips the rescale (same bits).
  if (__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f))
#pragma unroll
    for (int nd = 0; nd < NT; ++nd) acc[nd][0] *= f[0], acc[nd][1] *= f[0], acc[nd][2] *= f[1], acc[nd][3] *= f[1];
}

// NK 16-key tiles of K and V (shared memory, rows of D + 8 bf16, tile u at
// + u * tile_bytes; kt / vt already offset by the lane's ldmatrix row) into a
// warp's online softmax over its 16 MMA rows (a thread: rows g and g + 8, rr =
// 0 / 1), one max / rescale for all NK * 16 keys. With `masked`, keys kk of
// the tiles that row rr may not see (!see(rr, kk)) drop out; a row may see
// none of them.
template <int D, int NK, typename See, int kTerms = 2>
__device__ __forceinline__ void attend_tiles(uint32_t kt, uint32_t vt, uint32_t tile_bytes,
                                             const uint32_t (&qh)[D / 16][4], const uint32_t (&ql)[D / 16][4],
                                             float (&m)[2], float (&l)[2], float (&acc)[D / 8][4], bool masked,
                                             See see) {
  constexpr int KS = D / 16, NT = D / 8;
  // Scores: s[2u] keys 16u + 2t, + 1, s[2u + 1] keys 16u + 8 + 2t, + 1; [0..1] row g, [2..3] row g + 8.
  float s[2 * NK][4];
#pragma unroll
  for (int n = 0; n < 2 * NK; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int u = 0; u < NK; ++u) {
      uint32_t b[4];
      ptx::ldsm_x4(b, kt + uint32_t(u) * tile_bytes + uint32_t(ks) * 32);
      ptx::mma_16816<true>(s[2 * u], qh[ks][0], qh[ks][1], qh[ks][2], qh[ks][3], b[0], b[1]);
      ptx::mma_16816<true>(s[2 * u + 1], qh[ks][0], qh[ks][1], qh[ks][2], qh[ks][3], b[2], b[3]);
      if constexpr (kTerms == 2) {
        ptx::mma_16816<true>(s[2 * u], ql[ks][0], ql[ks][1], ql[ks][2], ql[ks][3], b[0], b[1]);
        ptx::mma_16816<true>(s[2 * u + 1], ql[ks][0], ql[ks][1], ql[ks][2], ql[ks][3], b[2], b[3]);
      }
    }
  softmax_update(s, m, l, acc, masked, see);
#pragma unroll
  for (int u = 0; u < NK; ++u) {
    // P as the A operand (keys are k): a0 row g keys 2t.., a1 row g + 8, a2 / a3 keys 8 + 2t.. .
    uint32_t ph[4], pl[4];
    split_bf16(s[2 * u][0], s[2 * u][1], ph[0], pl[0]);
    split_bf16(s[2 * u][2], s[2 * u][3], ph[1], pl[1]);
    split_bf16(s[2 * u + 1][0], s[2 * u + 1][1], ph[2], pl[2]);
    split_bf16(s[2 * u + 1][2], s[2 * u + 1][3], ph[3], pl[3]);
#pragma unroll
    for (int nd = 0; nd < NT; nd += 2) {
      uint32_t b[4];
      ptx::ldsm_x4<true>(b, vt + uint32_t(u) * tile_bytes + uint32_t(nd) * 16);
      ptx::mma_16816<true>(acc[nd], ph[0], ph[1], ph[2], ph[3], b[0], b[1]);
      if constexpr (kTerms == 2) ptx::mma_16816<true>(acc[nd], pl[0], pl[1], pl[2], pl[3], b[0], b[1]);
      ptx::mma_16816<true>(acc[nd + 1], ph[0], ph[1], ph[2], ph[3], b[2], b[3]);
      if constexpr (kTerms == 2) ptx::mma_16816<true>(acc[nd + 1], pl[0], pl[1], pl[2], pl[3], b[2], b[3]);
    }
  }
}

// Block = (row, KV head x group of up to 16 query heads, chunk of keys); the
// group's heads are the rows of m16n8k16 bf16 MMAs (S = Q K^T with keys as the
// n columns, then O += P V with keys as k), so each key is read once for all
// of them. Each warp streams 16-key tiles of the chunk (tiles w, w + 4, ...)
// through a three-stage cp.async ring in its own shared memory (ldmatrix, V
// transposed) and keeps an online softmax per head; the warps' states merge in
// shared memory. A row of one chunk normalises at once; otherwise each block
// writes its partial state and the last block of the (row, KV head, group) to
// finish (a ticket counter, reset by that block for the next launch) merges
// the chunks in a fixed order with the sink.
template <int D>
__global__ void __launch_bounds__(kSplitThreads, D == 128 ? 1 : 4)
    split_kernel(AttnBatch a, const int32_t* __restrict__ rows, int splits, DecodeSplitPolicy pol,
                 float* __restrict__ part, int* __restrict__ tickets) {
  constexpr int KS = D / 16, NT = D / 8, ROW = split_row<D>(), PD = D / 8;
  constexpr uint32_t TB = split_tile_bytes<D>();
  const int i = blockIdx.z, r = rows[i];
  const int item = a.row_item[r], pos = a.row_pos[r], lo = row_lo(a, pos), len = pos - lo + 1;
  const int chunk = chunk_keys(len, pol, splits);
  const int n = int((int64_t(len) + chunk - 1) / chunk);
  const int c = blockIdx.y;
  if (c >= n) return;  // whole block: past this row's chunks
  const int G = a.n_heads / a.n_kv_heads, ngrp = (G + kSplitHeads - 1) / kSplitHeads;
  const int kvh = blockIdx.x / ngrp, g0 = (blockIdx.x % ngrp) * kSplitHeads, nh = min(kSplitHeads, G - g0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int KVD = a.n_kv_heads * D;
  const int j_begin = lo + c * chunk, j_end = min(pos, j_begin + chunk - 1);
  const int ntiles = (j_end - j_begin + kTileKeys) / kTileKeys;
  const int32_t* pt = a.page_table + a.item_pt[item];
  extern __shared__ __align__(16) uint8_t smem[];
  const uint32_t my = ptx::smem_u32(smem) + uint32_t(warp) * kSplitStages * 2 * TB;

  // Tile tl's K and V into stage st (keys past j_end: zeros), one commit group (empty past the tiles).
  auto issue = [&](int tl, int st) {
    if (tl < ntiles) {
      const int j0 = j_begin + tl * kTileKeys;
#pragma unroll
      for (int u = 0; u < kTileKeys * D / 8 / 32; ++u) {
        const int e = lane + 32 * u, key = e / (D / 8), q8 = e % (D / 8), j = j0 + key;
        const bool ok = j <= j_end;
        const __nv_bfloat16* kr = key_row(a, pt, ok ? j : j_end) + kvh * D + q8 * 8;
        const uint32_t dst = my + uint32_t(st) * 2 * TB + uint32_t(key * ROW + q8 * 8) * 2;
        ptx::cp_async16_zfill(dst, kr, ok ? 16 : 0);
        ptx::cp_async16_zfill(dst + TB, kr + KVD, ok ? 16 : 0);
      }
    }
    ptx::cp_async_commit();
  };
  // Rows, page tables and the keys before pos were written before the
  // previous kernel (which stores key pos and q): a warp whose first tile ends
  // before pos issues it before waiting.
  const bool early = warp >= ntiles || j_begin + (warp + 1) * kTileKeys - 1 < pos;
  if (!early) pdl_wait();
  issue(warp, 0);
  if (early) pdl_wait();
  pdl_trigger();
#pragma unroll
  for (int st = 1; st < kSplitStages; ++st) issue(warp + st * kSplitWarps, st);

  // Q fragments (rows g and g + 8 of the group; heads past it zero).
  uint32_t qh[KS][4], ql[KS][4];
  {
    const float* qr = a.q + size_t(r) * a.q_stride + size_t(kvh * G + g0) * D;
    q_frags<D>(g < nh ? qr + g * D : nullptr, g + 8 < nh ? qr + (g + 8) * D : nullptr, a.scale * kLog2e, qh, ql);
  }
  const uint32_t koff = k_ldsm_off(lane, ROW), voff = v_ldsm_off(lane, ROW);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g, g + 8 (l: this lane's share until the end)
  float acc[NT][4];
#pragma unroll
  for (int nd = 0; nd < NT; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.f;
  for (int tl = warp, k = 0; tl < ntiles; tl += kSplitWarps, ++k) {
    const int st = k % kSplitStages;
    ptx::cp_async_wait<kSplitStages - 1>();
    __syncwarp();  // the other lanes' copies too
    const uint32_t kt = my + uint32_t(st) * 2 * TB, vt = kt + TB;
    const int nv = j_end - (j_begin + tl * kTileKeys) + 1;  // valid keys of the tile (>= 1)
    attend_tiles<D, 1>(kt + koff, vt + voff, 0, qh, ql, m, l, acc, nv < kTileKeys,
                       [&](int, int kk) { return kk < nv; });
    __syncwarp();  // every lane done with stage st before it is refilled
    issue(tl + kSplitStages * kSplitWarps, st);
  }
  ptx::cp_async_wait<0>();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
  }

  // The warps' states: m, l per head row, acc [row][D] (a warp without tiles: m = -inf, l = 0, acc = 0).
  __syncthreads();  // every warp is done with its tiles: the bytes hold the states now
  float* ms = reinterpret_cast<float*>(smem);
  float* ls = ms + kSplitWarps * kSplitHeads;
  float* os = ls + kSplitWarps * kSplitHeads;
  if (t == 0) {
    ms[warp * kSplitHeads + g] = m[0], ms[warp * kSplitHeads + g + 8] = m[1];
    ls[warp * kSplitHeads + g] = l[0], ls[warp * kSplitHeads + g + 8] = l[1];
  }
#pragma unroll
  for (int nd = 0; nd < NT; ++nd)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      os[(warp * kSplitHeads + g) * D + 8 * nd + 2 * t + e] = acc[nd][e];
      os[(warp * kSplitHeads + g + 8) * D + 8 * nd + 2 * t + e] = acc[nd][2 + e];
    }
  __syncthreads();
  // Thread -> head row hr of the group, dims d0 .. d0 + PD - 1.
  const int hr = threadIdx.x >> 3, d0 = (threadIdx.x & 7) * PD;
  float M = -INFINITY, L = 0.f, o[PD];
#pragma unroll
  for (int d = 0; d < PD; ++d) o[d] = 0.f;
#pragma unroll
  for (int w = 0; w < kSplitWarps; ++w) M = fmaxf(M, ms[w * kSplitHeads + hr]);
#pragma unroll
  for (int w = 0; w < kSplitWarps; ++w) {
    const float mw = ms[w * kSplitHeads + hr];
    if (mw == -INFINITY) continue;  // fixed order, skipped warps add nothing: deterministic
    const float wt = exp2f(mw - M);
    L += ls[w * kSplitHeads + hr] * wt;
#pragma unroll
    for (int d = 0; d < PD; ++d) o[d] += os[(w * kSplitHeads + hr) * D + d0 + d] * wt;
  }
  const bool row_ok = hr < nh;
  const int h = kvh * G + g0 + hr;
  const size_t ob = size_t(r) * a.n_heads * D + size_t(h) * D + d0;
  auto store = [&](int d, float v) {
    if (a.out_f32)
      a.out_f32[ob + d] = v;
    else
      reinterpret_cast<__nv_bfloat16*>(a.out)[ob + d] = __float2bfloat16_rn(v);
  };
  if (n == 1) {  // the whole row in this block: merge with the sink here
    if (!row_ok) return;
    const float sc = sink_finish(M, L, a.sinks[h] * kLog2e);
#pragma unroll
    for (int d = 0; d < PD; ++d) store(d, o[d] * sc);
    return;
  }
  if (row_ok) {
    float* po = part + partial_off(i, h, c, a.n_heads, splits, D);
#pragma unroll
    for (int d = 0; d < PD; d += 4)
      *reinterpret_cast<float4*>(po + d0 + d) = make_float4(o[d], o[d + 1], o[d + 2], o[d + 3]);
    if ((threadIdx.x & 7) == 0) po[D] = M, po[D + 1] = L;
  }
  __threadfence();  // this block's partials visible device-wide before its ticket
  __syncthreads();
  __shared__ int ticket;
  int* tk = tickets + size_t(i) * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) ticket = atomicAdd(tk, 1);
  __syncthreads();
  if (ticket != n - 1) return;
  // The last block: every other block of this (row, KV head, group) has
  // published its partial state. With the sink as one more column:
  // M = max(sink, m_c), L = 2^(sink - M) + sum l_c 2^(m_c - M), out = sum
  // acc_c 2^(m_c - M) / L. A head's 8 threads split the chunks for M and L,
  // then each sums its dims over every chunk with independent loads (no
  // chain through a running maximum); fixed orders: deterministic.
  __threadfence();
  if (threadIdx.x == 0) *tk = 0;  // ready for the next launch
  if (!row_ok) return;            // (whole 8-thread groups)
  const unsigned grp = 0xffu << (threadIdx.x & 24);
  const int j8 = threadIdx.x & 7;
  const size_t PS = partial_stride(D);
  const float* p0 = part + partial_off(i, h, 0, a.n_heads, splits, D);
  const float sink = a.sinks[h] * kLog2e;
  float Mx = sink, Ls = 0.f;
  for (int cc = j8; cc < n; cc += 8) Mx = fmaxf(Mx, __ldcg(p0 + cc * PS + D));
#pragma unroll
  for (int o8 = 1; o8 < 8; o8 <<= 1) Mx = fmaxf(Mx, __shfl_xor_sync(grp, Mx, o8));
  for (int cc = j8; cc < n; cc += 8) {
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(p0 + cc * PS + D));
    Ls += ml.y * exp2f(ml.x - Mx);
  }
#pragma unroll
  for (int o8 = 1; o8 < 8; o8 <<= 1) Ls += __shfl_xor_sync(grp, Ls, o8);
  Ls += exp2f(sink - Mx);
  float out[PD];
#pragma unroll
  for (int d = 0; d < PD; ++d) out[d] = 0.f;
#pragma unroll 4
  for (int cc = 0; cc < n; ++cc) {
    const float* pc = p0 + cc * PS;
    const float w = exp2f(__ldcg(pc + D) - Mx);
#pragma unroll
    for (int d = 0; d < PD; d += 4) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(pc + d0 + d));
      out[d] += w * v.x, out[d + 1] += w * v.y, out[d + 2] += w * v.z, out[d + 3] += w * v.w;
    }
  }
  const float inv = 1.f / Ls;
#pragma unroll
  for (int d = 0; d < PD; ++d) store(d, out[d] * inv);
}

// ------------------------------------------------------------------ prefill

constexpr int kPreWarps = 8;
constexpr int kPreThreads = 32 * kPreWarps;
// Keys a ring stage (every warp takes all of them), and keys a softmax update.
// H200 (run 96), gpt-oss-20b prefill of 16,384 tokens, 457.1 ms with 32-key
// stages and 16-key updates before: 64 / 16 449.3 ms, 64 / 32 425.5 ms (two
// blocks an SM, 128 registers), 64 / 32 and 64 / 64 at one block an SM (165 /
// 172 registers) 445.4 / 434.4 ms.
constexpr int kPreKeys = 64;
constexpr int kPreUpdateKeys = 32;
constexpr int kPreStages = 3;  // K/V stages in flight a block
// Query tokens a warp: its 16 MMA rows are (token, head) pairs of one KV
// head's group (gpt-oss, 8 heads: 2 tokens); more than 16 heads a KV head go
// in groups of 16, one token a warp.
__host__ __device__ inline int prefill_tokens_per_warp(int G) { return G >= 16 ? 1 : 16 / G; }
template <int D>
constexpr size_t prefill_smem() {
  return size_t(kPreStages) * 2 * kPreKeys * split_row<D>() * 2;
}

// What a prefill block knows of its tile: the KV head and query-head group
// it serves, the keys its rows see ([klo, khi]), and this thread's two MMA
// rows (rr 0: row g of its warp's 16, 1: g + 8): token row, head, visible
// keys [rlo, rpos]; rok false for rows past the tile or the group.
struct PrefillRows {
  int G, kvh, g0, HG, TPW, pos0, klo, khi;
  const int32_t* pt;
  int row[2], head[2], rpos[2], rlo[2];
  bool rok[2];
};
__device__ __forceinline__ PrefillRows prefill_rows(const AttnBatch& a, const AttnTile& tile, int warp, int g) {
  PrefillRows r;
  r.G = a.n_heads / a.n_kv_heads;
  const int ngrp = (r.G + kSplitHeads - 1) / kSplitHeads;
  r.kvh = blockIdx.y / ngrp, r.g0 = (blockIdx.y % ngrp) * kSplitHeads, r.HG = min(kSplitHeads, r.G - r.g0);
  r.TPW = prefill_tokens_per_warp(r.G);
  const int item = a.row_item[tile.row0];
  r.pos0 = a.row_pos[tile.row0];
  r.klo = row_lo(a, r.pos0), r.khi = r.pos0 + tile.n - 1;
  r.pt = a.page_table + a.item_pt[item];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int mr = g + 8 * rr, tok = warp * r.TPW + mr / r.HG;
    r.rok[rr] = mr < r.TPW * r.HG && tok < tile.n;
    r.row[rr] = tile.row0 + min(tok, tile.n - 1);
    r.head[rr] = r.kvh * r.G + r.g0 + mr % r.HG;
    r.rpos[rr] = a.row_pos[r.row[rr]];
    r.rlo[rr] = row_lo(a, r.rpos[rr]);
  }
  return r;
}

// The end of a prefill block: each row's softmax sum over its 4 threads, the
// sink, and the output of this thread's two rows (acc(nd, i): dims 8 nd + 2 t
// (+1 for odd i) of row g (i 0-1) or g + 8 (i 2-3), the MMA accumulator layout).
template <int D, typename Acc>
__device__ __forceinline__ void prefill_store(const AttnBatch& a, const PrefillRows& pr, const float (&m)[2],
                                              float (&l)[2], Acc acc) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    if (!pr.rok[rr]) continue;
    const float sc = sink_finish(m[rr], l[rr], a.sinks[pr.head[rr]] * kLog2e);
    const size_t ob = size_t(pr.row[rr]) * a.n_heads * D + size_t(pr.head[rr]) * D + 2 * t;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      const float v0 = acc(nd, 2 * rr) * sc, v1 = acc(nd, 2 * rr + 1) * sc;
      if (a.out_f32)
        *reinterpret_cast<float2*>(a.out_f32 + ob + 8 * nd) = make_float2(v0, v1);
      else
        *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(a.out) + ob + 8 * nd) =
            __floats2bfloat162_rn(v0, v1);
    }
  }
}

// Block = (tile of consecutive rows of one sequence, KV head x group of up to
// 16 query heads); each warp's 16 MMA rows are its tokens x the group's heads
// (rows past them idle). The block's keys (from the first row's window start
// to the last row) stream through a three-stage cp.async ring of 32-key K and
// V stages in shared memory that every warp reads (ldmatrix), each row
// masking to its own [window start, position]; a warp skips the 16-key tiles
// none of its rows sees. Online softmax in the MMAs' fragments, queries and
// probabilities as kTerms bf16 terms each (decode: two), the sink at the end.
template <int D, int kTerms>
__global__ void __launch_bounds__(kPreThreads, D == 128 ? 1 : 2)
    prefill_kernel(AttnBatch a, const AttnTile* __restrict__ tiles) {
  constexpr int KS = D / 16, NT = D / 8, ROW = split_row<D>();
  constexpr uint32_t TB = uint32_t(kPreKeys * ROW * 2);  // one K (or V) stage
  const AttnTile tile = tiles[blockIdx.x];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const PrefillRows pr = prefill_rows(a, tile, warp, g);
  const int TPW = pr.TPW, kvh = pr.kvh, pos0 = pr.pos0, klo = pr.klo, khi = pr.khi;
  const int32_t* pt = pr.pt;
  const int *row = pr.row, *head = pr.head, *rpos = pr.rpos, *rlo = pr.rlo;
  const bool* rok = pr.rok;
  const int KVD = a.n_kv_heads * D;
  // The warp's tokens see keys within [wlo_min, wpos_max]; every one of them sees [wlo_max, wpos_min].
  const int tfirst = warp * TPW, tlast = min(tfirst + TPW, tile.n) - 1;
  const bool wactive = tfirst < tile.n;
  const int wpos_min = pos0 + tfirst, wpos_max = pos0 + tlast;
  const int wlo_min = row_lo(a, wpos_min), wlo_max = row_lo(a, wpos_max);
  uint32_t qh[KS][4], ql[KS][4];
  q_frags<D>(rok[0] ? a.q + size_t(row[0]) * a.q_stride + size_t(head[0]) * D : nullptr,
             rok[1] ? a.q + size_t(row[1]) * a.q_stride + size_t(head[1]) * D : nullptr, a.scale * kLog2e, qh, ql);

  extern __shared__ __align__(16) uint8_t smem[];
  const uint32_t ring = ptx::smem_u32(smem);
  const int ntiles = (khi - klo + kPreKeys) / kPreKeys;
  // This thread's 16-byte piece q8 of keys key0 + i * (kPreThreads / PD) of every stage.
  constexpr int PD = D / 8;
  const int q8 = threadIdx.x % PD;
  RingKeys<kPreKeys * PD / kPreThreads, kPreThreads / PD, kPreKeys> rk(a, klo, threadIdx.x / PD);
  auto issue = [&](int k) {  // stage k's K and V (keys past khi: zeros), one commit group
    if (k < ntiles) {
      const uint32_t stage = ring + uint32_t(k % kPreStages) * 2 * TB;
      rk.copy_stage(a, pt, klo + k * kPreKeys, khi, kvh * D + q8 * 8, KVD, TB,
                    [&](int key) { return stage + uint32_t(key * ROW + q8 * 8) * 2; });
    }
    ptx::cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < kPreStages - 1; ++st) issue(st);

  const uint32_t koff = k_ldsm_off(lane, ROW), voff = v_ldsm_off(lane, ROW);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[NT][4];
#pragma unroll
  for (int nd = 0; nd < NT; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.f;
  for (int k = 0; k < ntiles; ++k) {
    ptx::cp_async_wait<kPreStages - 2>();
    __syncthreads();            // stage k landed for every thread; stage k - 1 read by every warp
    issue(k + kPreStages - 1);  // into stage k - 1's slot
    if (!wactive) continue;
    const uint32_t stage = ring + uint32_t(k % kPreStages) * 2 * TB;
#pragma unroll
    for (int part = 0; part < kPreKeys / kPreUpdateKeys; ++part) {
      const int h0 = klo + k * kPreKeys + part * kPreUpdateKeys;
      if (h0 > wpos_max || h0 + kPreUpdateKeys - 1 < wlo_min) continue;  // no row of the warp sees these keys
      const bool masked = !(h0 >= wlo_max && h0 + kPreUpdateKeys - 1 <= wpos_min);
      const uint32_t off = uint32_t(part * kPreUpdateKeys * ROW * 2);
      auto see = [&](int rr, int kk) {
        const int j = h0 + kk;
        return j >= rlo[rr] && j <= rpos[rr];
      };
      attend_tiles<D, kPreUpdateKeys / kTileKeys, decltype(see), kTerms>(
          stage + off + koff, stage + TB + off + voff, uint32_t(kTileKeys * ROW * 2), qh, ql, m, l, acc, masked, see);
    }
  }
  ptx::cp_async_wait<0>();
  prefill_store<D>(a, pr, m, l, [&](int nd, int i) { return acc[nd][i]; });
}

// ------------------------------------------------- prefill on wgmma (sm_90a)
// The block and rows of prefill_kernel<64>, two warpgroups of 64 MMA rows;
// each 64-key stage is one wgmma chain for S = Q K^T (Q and K from shared
// memory, K-major, 128-byte swizzle) and one for O += P V (P from registers,
// V from shared memory MN-major: the transposed B operand). Scores and O are
// in the wgmma accumulator layout, which per warp is the mma.sync layout of
// attend_tiles. Q lives in shared memory because ptxas treated the registers
// of a wgmma's A operand as free once its chain was done: a Q kept in
// registers across the loop was overwritten by later values (H200, against
// float64: 0.01-0.02 with two terms, 2-6 with one, instead of 2e-5).
constexpr int kWgKeys = 64;                  // keys a stage and a softmax update
constexpr int kWgStages = 3;                 // K/V stages in flight
constexpr uint32_t kWgTile = kWgKeys * 128;  // one K (or V) stage, or one Q term of a warpgroup: 64 rows x 128 B

// Descriptor of a 64-row x 128-byte tile with the 128-byte swizzle (rows
// 128 B, 8-row groups 1024 B apart; base 1024-aligned). K-major (Q and K of
// S): a 16-wide K step adds 32 B (2 in the 16-byte start field). MN-major
// (V of P V, rows are keys): the PTX ISA's canonical layout
// ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) in 16-byte units, so SBO = 1024 B
// between 8-key groups and LBO (between 64-wide N blocks) unused with N =
// 64; a 16-key K step is 16 rows, 2048 B.
// (ptx::sw128_desc_lo / sw128_desc build it.)
// Byte offset of (row r, bf16 column k) in such a tile.
__device__ __forceinline__ uint32_t sw128_off(int r, int k) { return uint32_t(ptx::sw128_offset(r, 2 * k)); }

#ifdef DZ_ATTN_SM90A
// d (64 x 64 fp32) [+]= A (64 x 16 bf16, shared, K-major) B (16 x 64 bf16, shared, K-major).
__device__ __forceinline__ void wgmma_ss_m64n64k16(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DZ_WGMMA_R32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : DZ_WGMMA_ACC32(d)
      : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 64 fp32) += A (64 x 16 bf16, registers) B (16 x 64 bf16, shared, MN-major).
__device__ __forceinline__ void wgmma_rs_m64n64k16_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(" wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" DZ_WGMMA_R32
               "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
               : DZ_WGMMA_ACC32(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
using ptx::fence_regs;
#endif

// kTerms: queries and probabilities as two bf16 terms (2) or one (1). Two
// blocks an SM either way (two terms fit 128 registers without spills since
// the ring's keys stopped dividing by the page size: one block an SM at 141
// registers before; H200, one layer at 16,384 tokens 13.9 -> 9.9 ms).
template <int kTerms>
__global__ void __launch_bounds__(kPreThreads, 2) prefill_wg_kernel(AttnBatch a, const AttnTile* __restrict__ tiles) {
#ifdef DZ_ATTN_SM90A
  constexpr int D = 64, KS = D / 16;
  const AttnTile tile = tiles[blockIdx.x];
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  // The warpgroup as a value the compiler knows is the same in every lane:
  // what derives from it (the MMA descriptors, the stage bounds) then lives in
  // uniform registers, not copied into them before each MMA.
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const PrefillRows pr = prefill_rows(a, tile, warp, g);
  const int TPW = pr.TPW, kvh = pr.kvh, pos0 = pr.pos0, klo = pr.klo, khi = pr.khi;
  const int32_t* pt = pr.pt;
  const int *row = pr.row, *head = pr.head, *rpos = pr.rpos, *rlo = pr.rlo;
  const bool* rok = pr.rok;
  const int KVD = a.n_kv_heads * D;
  // The warpgroup's tokens (its 4 warps) see keys within [glo_min, gpos_max];
  // every one of them sees [glo_max, gpos_min].
  const int gfirst = 4 * wg * TPW, glast = min(gfirst + 4 * TPW, tile.n) - 1;
  const bool gactive = gfirst < tile.n;
  const int gpos_min = pos0 + gfirst, gpos_max = pos0 + glast;
  const int glo_min = row_lo(a, gpos_min), glo_max = row_lo(a, gpos_max);

  // Shared memory: the K/V ring, then each warpgroup's Q terms (64 rows x 64 dims, swizzled).
  extern __shared__ uint8_t wg_raw[];
  const uint32_t ring = (ptx::smem_u32(wg_raw) + 1023) & ~1023u;  // the swizzle's 1024-byte alignment
  const uint32_t qs = ring + kWgStages * 2 * kWgTile + uint32_t(wg * kTerms) * kWgTile;
  {
    uint32_t qh[KS][4], ql[KS][4];
    q_frags<D>(rok[0] ? a.q + size_t(row[0]) * a.q_stride + size_t(head[0]) * D : nullptr,
               rok[1] ? a.q + size_t(row[1]) * a.q_stride + size_t(head[1]) * D : nullptr, a.scale * kLog2e, qh, ql);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // a0 / a2: row g, a1 / a3: row g + 8; a2 / a3 columns + 8
        const uint32_t off = sw128_off(16 * (warp & 3) + g + 8 * (i & 1), 16 * ks + 8 * (i >> 1) + 2 * t);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(qs + off), "r"(qh[ks][i]) : "memory");
        if (kTerms == 2) asm volatile("st.shared.b32 [%0], %1;" ::"r"(qs + kWgTile + off), "r"(ql[ks][i]) : "memory");
      }
  }  // (made visible to the MMAs by the loop's first proxy fence and barrier)
  const uint32_t dq = ptx::sw128_desc_lo(qs);

  const int ntiles = (khi - klo + kWgKeys) / kWgKeys;
  // This thread's 16-byte piece c of keys key0 and key0 + 32 of every stage.
  const int c = threadIdx.x & 7;
  RingKeys<kWgKeys * 8 / kPreThreads, kPreThreads / 8, kWgKeys> rk(a, klo, threadIdx.x >> 3);
  auto issue = [&](int k) {  // stage k's K and V rows (keys past khi: zeros), swizzled, one commit group
    if (k < ntiles) {
      const uint32_t stage = ring + uint32_t(k % kWgStages) * 2 * kWgTile;
      rk.copy_stage(a, pt, klo + k * kWgKeys, khi, kvh * D + c * 8, KVD, kWgTile,
                    [&](int key) { return stage + uint32_t(key * 128 + ((c ^ (key & 7)) << 4)); });
    }
    ptx::cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st < kWgStages - 1; ++st) issue(st);

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[32];  // (as on: 8 column tiles x 4, the accumulator layout softmax_update takes)
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.f;
  float(&on)[8][4] = *reinterpret_cast<float(*)[8][4]>(&o);
  for (int k = 0; k < ntiles; ++k) {
    ptx::cp_async_wait<kWgStages - 2>();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async and Q writes -> wgmma's reads
    __syncthreads();  // stage k landed for every thread; stage k - 1 read by every warpgroup
    issue(k + kWgStages - 1);
    const int h0 = klo + k * kWgKeys;
    if (!gactive || h0 > gpos_max || h0 + kWgKeys - 1 < glo_min) continue;  // no row of the warpgroup sees these
    const bool masked = !(h0 >= glo_max && h0 + kWgKeys - 1 <= gpos_min);
    const uint32_t stage = ring + uint32_t(k % kWgStages) * 2 * kWgTile;
    const uint32_t dk = ptx::sw128_desc_lo(stage), dv = ptx::sw128_desc_lo(stage + kWgTile);
    // S = Q K^T: 64 rows x 64 keys.
    float s[32];
    float(&sn)[8][4] = *reinterpret_cast<float(*)[8][4]>(&s);
    fence_regs(s);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      wgmma_ss_m64n64k16(s, ptx::sw128_desc(dq + 2 * ks), ptx::sw128_desc(dk + 2 * ks), ks);
      if (kTerms == 2)
        wgmma_ss_m64n64k16(s, ptx::sw128_desc(dq + (kWgTile >> 4) + 2 * ks), ptx::sw128_desc(dk + 2 * ks), 1);
    }
    ptx::wgmma_commit();
    fence_regs(s);
    ptx::wgmma_wait0();
    fence_regs(s);
    softmax_update(sn, m, l, on, masked, [&](int rr, int kk) {
      const int j = h0 + kk;
      return j >= rlo[rr] && j <= rpos[rr];
    });
    // O += P V; A fragment of 16-key step u: a0 row g keys 16u + 2t, a1 row g + 8, a2 / a3 keys + 8.
    uint32_t ph[4][4], pl[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) split_bf16(s[8 * u + 2 * i], s[8 * u + 2 * i + 1], ph[u][i], pl[u][i]);
    fence_regs(ph);
    if (kTerms == 2) fence_regs(pl);
    fence_regs(o);
    ptx::wgmma_fence();
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      wgmma_rs_m64n64k16_tb(o, ph[u], ptx::sw128_desc(dv + u * (2048 >> 4)));
      if (kTerms == 2) wgmma_rs_m64n64k16_tb(o, pl[u], ptx::sw128_desc(dv + u * (2048 >> 4)));
    }
    ptx::wgmma_commit();
    fence_regs(o);
    ptx::wgmma_wait0();
    fence_regs(o);
  }
  ptx::cp_async_wait<0>();
  prefill_store<D>(a, pr, m, l, [&](int nd, int i) { return o[4 * nd + i]; });
#endif
}
template <int kTerms>
constexpr size_t prefill_wg_smem() {
  return size_t(kWgStages) * 2 * kWgTile + size_t(2 * kTerms) * kWgTile + 1024;
}

}  // namespace

bool attention_supports(int d) { return d == 32 || d == 64 || d == 128; }

int attention_tile_rows(int n_heads, int n_kv_heads) {
  return kPreWarps * prefill_tokens_per_warp(n_heads / std::max(1, n_kv_heads));
}

void attention_decode(const AttnBatch& a, const int32_t* rows, int n_rows, cudaStream_t s) {
  if (n_rows <= 0) return;
  const dim3 grid(unsigned(n_rows), unsigned(a.n_heads));
  switch (a.head_dim) {
    case 32:
      decode_kernel<32><<<grid, 128, 0, s>>>(a, rows);
      break;
    case 64:
      decode_kernel<64><<<grid, 128, 0, s>>>(a, rows);
      break;
    case 128:
      decode_kernel<128><<<grid, 128, 0, s>>>(a, rows);
      break;
    default:
      fail(DZ_ERR_UNSUPPORTED, "CUDA attention: head_dim ", a.head_dim, " (built for 32, 64, 128)");
  }
  DZ_CUDA_LAUNCH_CHECK();
}

bool decode_policy_valid(const DecodeSplitPolicy& p) {
  return p.min_chunk >= kSplitKeys && p.min_chunk % kSplitKeys == 0 && p.min_chunk <= (1 << 20) && p.base_splits >= 1 &&
         p.base_splits <= 4096 && p.max_splits >= 1 && p.max_splits <= 4096;
}

int decode_chunk_keys(int len, const DecodeSplitPolicy& p, int splits) { return chunk_keys(len, p, splits); }

int decode_chunks(int len, const DecodeSplitPolicy& p, int splits) {
  const int64_t c = chunk_keys(len, p, splits);
  return int((int64_t(len) + c - 1) / c);
}

size_t decode_partial_floats(int n_rows, int n_heads, int head_dim, int splits) {
  return size_t(n_rows) * size_t(n_heads) * size_t(splits) * partial_stride(head_dim);
}

size_t decode_ticket_ints(int n_rows, int n_heads, int n_kv_heads) {
  const int G = n_heads / std::max(1, n_kv_heads);
  return size_t(n_rows) * size_t(n_kv_heads) * size_t((G + kSplitHeads - 1) / kSplitHeads);
}

void attention_decode_split(const AttnBatch& a, const int32_t* rows, int n_rows, int splits, const DecodeSplitPolicy& p,
                            const DecodeScratch& scratch, cudaStream_t s) {
  if (n_rows <= 0) return;
  check(decode_policy_valid(p) && splits >= 1 && splits <= 4096, DZ_ERR_INVALID_ARGUMENT,
        "split decode attention: min_chunk ", p.min_chunk, " (a multiple of ", kSplitKeys, " up to 2^20), base_splits ",
        p.base_splits, " and max_splits ", p.max_splits, " (1..4096), splits ", splits, " (1..4096)");
  check(a.n_kv_heads > 0 && a.n_heads % a.n_kv_heads == 0, DZ_ERR_INVALID_ARGUMENT,
        "split decode attention: ", a.n_heads, " heads over ", a.n_kv_heads, " KV heads");
  const size_t per_row = decode_partial_floats(1, a.n_heads, a.head_dim, splits);
  const size_t tickets_per_row = decode_ticket_ints(1, a.n_heads, a.n_kv_heads);
  check(scratch.partials && scratch.tickets && scratch.partial_floats >= per_row &&
            scratch.ticket_ints >= tickets_per_row,
        DZ_ERR_INTERNAL, "split decode attention: scratch of ", scratch.partial_floats, " floats and ",
        scratch.ticket_ints, " tickets, one row needs ", per_row, " and ", tickets_per_row);
  const int group = int(std::min(
      {size_t(n_rows), scratch.partial_floats / per_row, scratch.ticket_ints / tickets_per_row, size_t(65535)}));
  const int G = a.n_heads / a.n_kv_heads, ngrp = (G + kSplitHeads - 1) / kSplitHeads;
  static const bool attr_set = [] {  // head_dim 128 takes more than the default 48 KB
    DZ_CUDA_CHECK(
        cudaFuncSetAttribute(split_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(split_smem<32>())));
    DZ_CUDA_CHECK(
        cudaFuncSetAttribute(split_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(split_smem<64>())));
    DZ_CUDA_CHECK(
        cudaFuncSetAttribute(split_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(split_smem<128>())));
    return true;
  }();
  (void)attr_set;
  const dim3 block{unsigned(kSplitThreads)};
  for (int r0 = 0; r0 < n_rows; r0 += group) {
    const int n = std::min(group, n_rows - r0);
    // KV heads fastest, then chunks: blocks running together read neighbouring bytes of the same pages.
    const dim3 grid(unsigned(a.n_kv_heads * ngrp), unsigned(splits), unsigned(n));
    switch (a.head_dim) {
      case 32:
        launch_pdl(split_kernel<32>, grid, block, split_smem<32>(), s, a, rows + r0, splits, p, scratch.partials,
                   scratch.tickets);
        break;
      case 64:
        launch_pdl(split_kernel<64>, grid, block, split_smem<64>(), s, a, rows + r0, splits, p, scratch.partials,
                   scratch.tickets);
        break;
      case 128:
        launch_pdl(split_kernel<128>, grid, block, split_smem<128>(), s, a, rows + r0, splits, p, scratch.partials,
                   scratch.tickets);
        break;
      default:
        fail(DZ_ERR_UNSUPPORTED, "CUDA attention: head_dim ", a.head_dim, " (built for 32, 64, 128)");
    }
    DZ_CUDA_LAUNCH_CHECK();
  }
}

void attention_prefill(const AttnBatch& a, const AttnTile* tiles, int n_tiles, int rows_per_tile, cudaStream_t s) {
  if (n_tiles <= 0) return;
  check(a.n_kv_heads > 0 && a.n_heads % a.n_kv_heads == 0 &&
            rows_per_tile == attention_tile_rows(a.n_heads, a.n_kv_heads),
        DZ_ERR_INVALID_ARGUMENT, "prefill attention: ", a.n_heads, " heads over ", a.n_kv_heads,
        " KV heads in tiles of ", rows_per_tile,
        " rows (attention_tile_rows: ", attention_tile_rows(a.n_heads, a.n_kv_heads), ")");
  const int G = a.n_heads / a.n_kv_heads, ngrp = (G + kSplitHeads - 1) / kSplitHeads;
  const dim3 grid(unsigned(n_tiles), unsigned(a.n_kv_heads * ngrp)), block{unsigned(kPreThreads)};
  check(a.terms == 1 || a.terms == 2, DZ_ERR_INVALID_ARGUMENT, "prefill attention: terms ", a.terms, " (1 or 2)");
  // The wgmma kernel where this build and device run sm_90a bodies (the probe
  // moe.cu's kernels go by too) and the head size is its 64; mma.sync elsewhere.
  const bool sm90a = Fp8GroupedGemm::supported();
  static const bool attr_set = [] {  // more than the default 48 KB
    auto set = [](auto f, size_t bytes) {
      DZ_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    };
    set(prefill_kernel<32, 1>, prefill_smem<32>()), set(prefill_kernel<32, 2>, prefill_smem<32>());
    set(prefill_kernel<64, 1>, prefill_smem<64>()), set(prefill_kernel<64, 2>, prefill_smem<64>());
    set(prefill_kernel<128, 1>, prefill_smem<128>()), set(prefill_kernel<128, 2>, prefill_smem<128>());
    set(prefill_wg_kernel<1>, prefill_wg_smem<1>()), set(prefill_wg_kernel<2>, prefill_wg_smem<2>());
    return true;
  }();
  (void)attr_set;
  const bool two = a.terms == 2;
  switch (a.head_dim) {
    case 32:
      (two ? prefill_kernel<32, 2> : prefill_kernel<32, 1>)<<<grid, block, prefill_smem<32>(), s>>>(a, tiles);
      break;
    case 64:
      if (sm90a && a.prefill_wgmma)
        (two ? prefill_wg_kernel<2>
             : prefill_wg_kernel<1>)<<<grid, block, two ? prefill_wg_smem<2>() : prefill_wg_smem<1>(), s>>>(a, tiles);
      else
        (two ? prefill_kernel<64, 2> : prefill_kernel<64, 1>)<<<grid, block, prefill_smem<64>(), s>>>(a, tiles);
      break;
    case 128:
      (two ? prefill_kernel<128, 2> : prefill_kernel<128, 1>)<<<grid, block, prefill_smem<128>(), s>>>(a, tiles);
      break;
    default:
      fail(DZ_ERR_UNSUPPORTED, "CUDA attention: head_dim ", a.head_dim, " (built for 32, 64, 128)");
  }
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
