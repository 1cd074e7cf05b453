#include <cuda_bf16.h>

#include <algorithm>

#include "common/error.h"
#include "cuda/attention.h"
#include "cuda/pdl.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ const float* key_row(const AttnBatch& a, const int32_t* pt, int j) {
  const int64_t page = pt[j / a.page_tokens];
  return reinterpret_cast<const float*>(a.kv + page * a.page_bytes +
                                        int64_t(j % a.page_tokens) * (2 * a.n_kv_heads * a.head_dim) * 4);
}

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
        const float* kr = key_row(a, pt, j) + kvh * D + lane * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) s[u] += q[i] * kr[i];
#pragma unroll
        for (int i = 0; i < PER; ++i) v[u][i] = kr[KVD + i];
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

constexpr int kSplitKeys = 32;                   // keys per shared-memory tile (one per lane when scoring)
constexpr int kSplitHeads = 8;                   // query heads per block (one warp each)
constexpr int kSplitThreads = 32 * kSplitHeads;  // also with fewer heads per KV head: every warp loads
static_assert(kSplitKeys * 32 / 4 % kSplitThreads == 0, "a tile's float4s spread evenly over the threads");

__host__ __device__ inline int chunk_keys(int len, int min_chunk, int max_splits, int splits) {
  int64_t c = min_chunk;
  while ((int64_t(len) + c - 1) / c > max_splits) c *= 2;
  const int64_t need = (int64_t(len) + splits - 1) / splits;  // a grid too small for the policy: larger chunks
  if (need > c) c = (need + kSplitKeys - 1) / kSplitKeys * kSplitKeys;
  return int(c);
}

__device__ __forceinline__ int row_lo(const AttnBatch& a, int pos) {
  return a.window > 0 ? max(0, pos - a.window + 1) : 0;
}

// Partial state of (row i, head h, chunk c): acc[D] | m | l (m in log2 units).
__device__ __forceinline__ size_t partial_off(int i, int h, int c, int n_heads, int splits, int D) {
  return ((size_t(i) * n_heads + h) * splits + c) * size_t(D + 2);
}

// Block = (row, KV head x head group, chunk); warp w = query head group*8 + w.
// Keys of the chunk are staged 32 at a time (K and V, rows padded to D + 4
// floats so lane-per-key float4 reads are conflict-free); each lane scores one
// key against its warp's head, then the warp accumulates P V with lane = D/32
// dims. A row of one chunk normalises at once; otherwise each block writes
// its partial state and the last block of the (row, KV head, group) to finish
// (a ticket counter, reset by that block for the next launch) merges them.
// Blocks a multiprocessor: head_dim 64 keeps the five it had before the
// register prefetch (48 registers, no spills).
constexpr int split_blocks_per_sm(int D) { return D == 128 ? 2 : D == 64 ? 5 : 3; }
template <int D>
__global__ void __launch_bounds__(kSplitThreads, split_blocks_per_sm(D))
    split_kernel(AttnBatch a, const int32_t* __restrict__ rows, int splits, int min_chunk, int max_splits,
                 float* __restrict__ part, int* __restrict__ tickets) {
  constexpr int PER = D / 32, KP = D + 4;
  const int i = blockIdx.x, r = rows[i];
  const int item = a.row_item[r], pos = a.row_pos[r], lo = row_lo(a, pos), len = pos - lo + 1;
  const int chunk = chunk_keys(len, min_chunk, max_splits, splits);
  const int n = int((int64_t(len) + chunk - 1) / chunk);
  const int c = blockIdx.z;
  if (c >= n) return;  // whole block: past this row's chunks
  const int G = a.n_heads / a.n_kv_heads, ngrp = (G + kSplitHeads - 1) / kSplitHeads;
  const int kvh = blockIdx.y / ngrp, gi = (blockIdx.y % ngrp) * kSplitHeads + int(threadIdx.x >> 5);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool head_ok = warp < kSplitHeads && gi < G;
  const int h = kvh * G + gi;
  const int KVD = a.n_kv_heads * D;
  const int j_begin = lo + c * chunk, j_end = min(pos, j_begin + chunk - 1);
  const int32_t* pt = a.page_table + a.item_pt[item];
  __shared__ __align__(16) float ks[kSplitKeys * KP], vs[kSplitKeys * KP];
  __shared__ __align__(16) float qs[kSplitHeads][D];
  __shared__ int ticket;
  const float sl2 = a.scale * kLog2e;
  float m = -INFINITY, l = 0, acc[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) acc[k] = 0;
  // A tile's K and V go through registers (kLd float4 pairs a thread): the
  // next tile's loads are in flight while this one is scored.
  constexpr int kLd = kSplitKeys * (D / 4) / kSplitThreads;
  float4 kreg[kLd], vreg[kLd];
  auto load_tile = [&](int j0) {
    const int nv = min(kSplitKeys, j_end - j0 + 1);
#pragma unroll
    for (int u = 0; u < kLd; ++u) {
      const int e = threadIdx.x + u * kSplitThreads, key = e / (D / 4), d4 = e % (D / 4);
      kreg[u] = vreg[u] = make_float4(0, 0, 0, 0);
      if (key < nv) {
        const float* kr = key_row(a, pt, j0 + key) + kvh * D;
        kreg[u] = reinterpret_cast<const float4*>(kr)[d4];
        vreg[u] = reinterpret_cast<const float4*>(kr + KVD)[d4];
      }
    }
  };
  // Rows, page tables and the keys before pos were written before the previous
  // kernel (which stores key pos and q): the first tile's loads go out first.
  const bool early = j_begin + kSplitKeys <= pos;
  if (!early) pdl_wait();
  load_tile(j_begin);
  if (early) pdl_wait();
  pdl_trigger();
  if (head_ok)
    for (int d = lane; d < D; d += 32) qs[warp][d] = a.q[size_t(r) * a.q_stride + h * D + d] * sl2;
  for (int j0 = j_begin; j0 <= j_end; j0 += kSplitKeys) {
    const int nv = min(kSplitKeys, j_end - j0 + 1);
    __syncthreads();  // previous tile consumed (and qs written, first time)
#pragma unroll
    for (int u = 0; u < kLd; ++u) {
      const int e = threadIdx.x + u * kSplitThreads, key = e / (D / 4), d4 = e % (D / 4);
      reinterpret_cast<float4*>(ks + key * KP)[d4] = kreg[u];
      reinterpret_cast<float4*>(vs + key * KP)[d4] = vreg[u];
    }
    __syncthreads();
    if (j0 + kSplitKeys <= j_end) load_tile(j0 + kSplitKeys);
    if (!head_ok) continue;
    float sc = -INFINITY;
    if (lane < nv) {
      const float4* kr = reinterpret_cast<const float4*>(ks + lane * KP);
      const float4* qr = reinterpret_cast<const float4*>(qs[warp]);
      float dot = 0;
#pragma unroll
      for (int d4 = 0; d4 < D / 4; ++d4) {
        const float4 kx = kr[d4], qx = qr[d4];
        dot += qx.x * kx.x + qx.y * kx.y + qx.z * kx.z + qx.w * kx.w;
      }
      sc = dot;
    }
    float mc = sc;
#pragma unroll
    for (int o = 16; o; o >>= 1) mc = fmaxf(mc, __shfl_xor_sync(0xffffffffu, mc, o));
    const float nm = fmaxf(m, mc);  // finite: lane 0 always holds a key
    const float f = exp2f(m - nm), p = exp2f(sc - nm);
    float ps = p;
#pragma unroll
    for (int o = 16; o; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
    l = l * f + ps;
#pragma unroll
    for (int k = 0; k < PER; ++k) acc[k] *= f;
    for (int u = 0; u < nv; ++u) {
      const float pu = __shfl_sync(0xffffffffu, p, u);
      const float* vr = vs + u * KP + lane * PER;
#pragma unroll
      for (int k = 0; k < PER; ++k) acc[k] += pu * vr[k];
    }
    m = nm;
  }
  const size_t ob = size_t(r) * a.n_heads * D + h * D + lane * PER;
  auto store = [&](int k, float v) {
    if (a.out_f32)
      a.out_f32[ob + k] = v;
    else
      reinterpret_cast<__nv_bfloat16*>(a.out)[ob + k] = __float2bfloat16_rn(v);
  };
  if (n == 1) {  // the whole row in this block: merge with the sink here
    if (!head_ok) return;
    const float sink = a.sinks[h] * kLog2e, M = fmaxf(m, sink), w = exp2f(m - M);
    const float inv = 1.f / (l * w + exp2f(sink - M));
#pragma unroll
    for (int k = 0; k < PER; ++k) store(k, acc[k] * w * inv);
    return;
  }
  if (head_ok) {
    float* o = part + partial_off(i, h, c, a.n_heads, splits, D);
#pragma unroll
    for (int k = 0; k < PER; ++k) o[lane * PER + k] = acc[k];
    if (lane == 0) o[D] = m, o[D + 1] = l;
  }
  __threadfence();  // this block's partials visible device-wide before its ticket
  __syncthreads();
  int* tk = tickets + size_t(i) * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) ticket = atomicAdd(tk, 1);
  __syncthreads();
  if (ticket != n - 1) return;
  // The last block: every other block of this (row, KV head, group) has
  // published its partial state.
  __threadfence();
  if (threadIdx.x == 0) *tk = 0;  // ready for the next launch
  if (!head_ok) return;
  const float sink = a.sinks[h] * kLog2e;
  float M = sink;
  for (int cc = lane; cc < n; cc += 32) M = fmaxf(M, __ldcg(part + partial_off(i, h, cc, a.n_heads, splits, D) + D));
#pragma unroll
  for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  float L = 0;
  for (int cc = lane; cc < n; cc += 32) {
    const float* pc = part + partial_off(i, h, cc, a.n_heads, splits, D);
    L += __ldcg(pc + D + 1) * exp2f(__ldcg(pc + D) - M);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  L += exp2f(sink - M);
  float out[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) out[k] = 0;
  for (int cc = 0; cc < n; ++cc) {
    const float* pc = part + partial_off(i, h, cc, a.n_heads, splits, D);
    const float w = exp2f(__ldcg(pc + D) - M);
#pragma unroll
    for (int k = 0; k < PER; ++k) out[k] += w * __ldcg(pc + lane * PER + k);
  }
  const float inv = 1.f / L;
#pragma unroll
  for (int k = 0; k < PER; ++k) store(k, out[k] * inv);
}

// One block per (tile of rows of one sequence, KV head); thread = (row, head
// of the group); keys in chunks of CH staged in shared memory (broadcast reads).
template <int D, int CH>
__global__ void __launch_bounds__(128) prefill_kernel(AttnBatch a, const AttnTile* __restrict__ tiles) {
  const AttnTile t = tiles[blockIdx.x];
  const int kvh = blockIdx.y, G = a.n_heads / a.n_kv_heads;
  const int qi = threadIdx.x / G, g = threadIdx.x % G;
  const bool active = qi < t.n;
  const int r = t.row0 + (active ? qi : t.n - 1), h = kvh * G + g;
  const int item = a.row_item[t.row0], pos0 = a.row_pos[t.row0];
  const int pos = a.row_pos[r];
  const int lo = a.window > 0 ? max(0, pos - a.window + 1) : 0;
  const int klo = a.window > 0 ? max(0, pos0 - a.window + 1) : 0, khi = pos0 + t.n - 1;
  const int KVD = a.n_kv_heads * D;
  const int32_t* pt = a.page_table + a.item_pt[item];
  const float sl2 = a.scale * kLog2e;
  __shared__ float4 ks[CH * D / 4], vs[CH * D / 4];
  float q[D], acc[D];
  {
    const float4* qr = reinterpret_cast<const float4*>(a.q + size_t(r) * a.q_stride + h * D);
#pragma unroll
    for (int i = 0; i < D / 4; ++i) {
      const float4 x = qr[i];
      q[4 * i] = x.x * sl2, q[4 * i + 1] = x.y * sl2, q[4 * i + 2] = x.z * sl2, q[4 * i + 3] = x.w * sl2;
    }
  }
#pragma unroll
  for (int i = 0; i < D; ++i) acc[i] = 0;
  float m = a.sinks[h] * kLog2e, l = 1;
  for (int c0 = klo; c0 <= khi; c0 += CH) {
    __syncthreads();
    for (int e = threadIdx.x; e < CH * D / 4; e += blockDim.x) {
      const int key = e / (D / 4), d4 = e % (D / 4), j = c0 + key;
      float4 kx = make_float4(0, 0, 0, 0), vx = kx;
      if (j <= khi) {
        const float* kr = key_row(a, pt, j) + kvh * D;
        kx = reinterpret_cast<const float4*>(kr)[d4];
        vx = reinterpret_cast<const float4*>(kr + KVD)[d4];
      }
      ks[e] = kx;
      vs[e] = vx;
    }
    __syncthreads();
    float s[CH], mc = -INFINITY;
#pragma unroll
    for (int u = 0; u < CH; ++u) {
      float dot = 0;
#pragma unroll
      for (int i = 0; i < D / 4; ++i) {
        const float4 kx = ks[u * (D / 4) + i];
        dot += q[4 * i] * kx.x + q[4 * i + 1] * kx.y + q[4 * i + 2] * kx.z + q[4 * i + 3] * kx.w;
      }
      const int j = c0 + u;
      s[u] = (j >= lo && j <= pos) ? dot : -INFINITY;
      mc = fmaxf(mc, s[u]);
    }
    if (mc == -INFINITY) continue;
    const float nm = fmaxf(m, mc), f = exp2f(m - nm);
    l *= f;
#pragma unroll
    for (int i = 0; i < D; ++i) acc[i] *= f;
#pragma unroll
    for (int u = 0; u < CH; ++u) {
      const float p = exp2f(s[u] - nm);
      l += p;
#pragma unroll
      for (int i = 0; i < D / 4; ++i) {
        const float4 vx = vs[u * (D / 4) + i];
        acc[4 * i] += p * vx.x, acc[4 * i + 1] += p * vx.y, acc[4 * i + 2] += p * vx.z, acc[4 * i + 3] += p * vx.w;
      }
    }
    m = nm;
  }
  if (!active) return;
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(a.out) + size_t(r) * a.n_heads * D + h * D;
  const float inv = 1.f / l;
#pragma unroll
  for (int i = 0; i < D; ++i) o[i] = __float2bfloat16_rn(acc[i] * inv);
}

}  // namespace

bool attention_supports(int d) { return d == 32 || d == 64 || d == 128; }

int attention_tile_rows(int n_heads, int n_kv_heads) {
  const int g = n_heads / n_kv_heads;
  return g >= 128 ? 1 : 128 / g;
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

int decode_chunk_keys(int len, const DecodeSplitPolicy& p, int splits) {
  return chunk_keys(len, p.min_chunk, p.max_splits, splits);
}

int decode_chunks(int len, const DecodeSplitPolicy& p, int splits) {
  const int64_t c = chunk_keys(len, p.min_chunk, p.max_splits, splits);
  return int((int64_t(len) + c - 1) / c);
}

size_t decode_partial_floats(int n_rows, int n_heads, int head_dim, int splits) {
  return size_t(n_rows) * size_t(n_heads) * size_t(splits) * size_t(head_dim + 2);
}

size_t decode_ticket_ints(int n_rows, int n_heads, int n_kv_heads) {
  const int G = n_heads / std::max(1, n_kv_heads);
  return size_t(n_rows) * size_t(n_kv_heads) * size_t((G + kSplitHeads - 1) / kSplitHeads);
}

void attention_decode_split(const AttnBatch& a, const int32_t* rows, int n_rows, int splits, const DecodeSplitPolicy& p,
                            const DecodeScratch& scratch, cudaStream_t s) {
  if (n_rows <= 0) return;
  check(
      p.min_chunk >= kSplitKeys && p.min_chunk % kSplitKeys == 0 && p.max_splits >= 1 && splits >= 1 && splits <= 4096,
      DZ_ERR_INVALID_ARGUMENT, "split decode attention: min_chunk ", p.min_chunk, " (multiple of ", kSplitKeys,
      "), max_splits ", p.max_splits, ", splits ", splits, " (1..4096)");
  check(a.n_kv_heads > 0 && a.n_heads % a.n_kv_heads == 0, DZ_ERR_INVALID_ARGUMENT,
        "split decode attention: ", a.n_heads, " heads over ", a.n_kv_heads, " KV heads");
  const size_t per_row = decode_partial_floats(1, a.n_heads, a.head_dim, splits);
  const size_t tickets_per_row = decode_ticket_ints(1, a.n_heads, a.n_kv_heads);
  check(scratch.partials && scratch.tickets && scratch.partial_floats >= per_row &&
            scratch.ticket_ints >= tickets_per_row,
        DZ_ERR_INTERNAL, "split decode attention: scratch of ", scratch.partial_floats, " floats and ",
        scratch.ticket_ints, " tickets, one row needs ", per_row, " and ", tickets_per_row);
  const int group =
      int(std::min({size_t(n_rows), scratch.partial_floats / per_row, scratch.ticket_ints / tickets_per_row}));
  const int G = a.n_heads / a.n_kv_heads, ngrp = (G + kSplitHeads - 1) / kSplitHeads;
  const unsigned threads = unsigned(kSplitThreads);
  for (int r0 = 0; r0 < n_rows; r0 += group) {
    const int n = std::min(group, n_rows - r0);
    const dim3 grid(unsigned(n), unsigned(a.n_kv_heads * ngrp), unsigned(splits));
    switch (a.head_dim) {
      case 32:
        launch_pdl(split_kernel<32>, grid, dim3(threads), 0, s, a, rows + r0, splits, p.min_chunk, p.max_splits,
                   scratch.partials, scratch.tickets);
        break;
      case 64:
        launch_pdl(split_kernel<64>, grid, dim3(threads), 0, s, a, rows + r0, splits, p.min_chunk, p.max_splits,
                   scratch.partials, scratch.tickets);
        break;
      case 128:
        launch_pdl(split_kernel<128>, grid, dim3(threads), 0, s, a, rows + r0, splits, p.min_chunk, p.max_splits,
                   scratch.partials, scratch.tickets);
        break;
      default:
        fail(DZ_ERR_UNSUPPORTED, "CUDA attention: head_dim ", a.head_dim, " (built for 32, 64, 128)");
    }
    DZ_CUDA_LAUNCH_CHECK();
  }
}

void attention_prefill(const AttnBatch& a, const AttnTile* tiles, int n_tiles, int rows_per_tile, cudaStream_t s) {
  if (n_tiles <= 0) return;
  const int G = a.n_heads / a.n_kv_heads;
  check(G <= 128 && rows_per_tile * G <= 128, DZ_ERR_UNSUPPORTED, "CUDA attention: ", G,
        " query heads per KV head (at most 128)");
  const dim3 grid(unsigned(n_tiles), unsigned(a.n_kv_heads));
  const unsigned threads = unsigned(rows_per_tile * G);
  switch (a.head_dim) {
    case 32:
      prefill_kernel<32, 32><<<grid, threads, 0, s>>>(a, tiles);
      break;
    case 64:
      prefill_kernel<64, 32><<<grid, threads, 0, s>>>(a, tiles);
      break;
    case 128:
      prefill_kernel<128, 8><<<grid, threads, 0, s>>>(a, tiles);
      break;
    default:
      fail(DZ_ERR_UNSUPPORTED, "CUDA attention: head_dim ", a.head_dim, " (built for 32, 64, 128)");
  }
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
