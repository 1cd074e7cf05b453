#include "cuda/attention.h"

#include <cuda_bf16.h>

#include "common/error.h"
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
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(a.out) + size_t(r) * a.n_heads * D + h * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane * PER + i;
      const float x = (sacc[0][d] * w[0] + sacc[1][d] * w[1] + sacc[2][d] * w[2] + sacc[3][d] * w[3]) / L;
      o[d] = __float2bfloat16_rn(x);
    }
  }
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
    case 32: decode_kernel<32><<<grid, 128, 0, s>>>(a, rows); break;
    case 64: decode_kernel<64><<<grid, 128, 0, s>>>(a, rows); break;
    case 128: decode_kernel<128><<<grid, 128, 0, s>>>(a, rows); break;
    default: fail(DZ_ERR_UNSUPPORTED, "CUDA attention: head_dim ", a.head_dim, " (built for 32, 64, 128)");
  }
  DZ_CUDA_LAUNCH_CHECK();
}

void attention_prefill(const AttnBatch& a, const AttnTile* tiles, int n_tiles, int rows_per_tile, cudaStream_t s) {
  if (n_tiles <= 0) return;
  const int G = a.n_heads / a.n_kv_heads;
  check(G <= 128 && rows_per_tile * G <= 128, DZ_ERR_UNSUPPORTED, "CUDA attention: ", G,
        " query heads per KV head (at most 128)");
  const dim3 grid(unsigned(n_tiles), unsigned(a.n_kv_heads));
  const unsigned threads = unsigned(rows_per_tile * G);
  switch (a.head_dim) {
    case 32: prefill_kernel<32, 32><<<grid, threads, 0, s>>>(a, tiles); break;
    case 64: prefill_kernel<64, 32><<<grid, threads, 0, s>>>(a, tiles); break;
    case 128: prefill_kernel<128, 8><<<grid, threads, 0, s>>>(a, tiles); break;
    default: fail(DZ_ERR_UNSUPPORTED, "CUDA attention: head_dim ", a.head_dim, " (built for 32, 64, 128)");
  }
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
