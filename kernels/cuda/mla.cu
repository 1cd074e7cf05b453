#include <cuda_bf16.h>

#include "common/error.h"
#include "cuda/mla.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kRopeThreads = 128;
constexpr int kMaxRank = 4096;

__device__ __forceinline__ float bf16f(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0;
#pragma unroll
  for (int w = 0; w < kRopeThreads / 32; ++w) t += red[w];
  return t;
}

// One block a row: every rotation of the row, then the latent's norm.
__global__ void __launch_bounds__(kRopeThreads) mla_rope_store_kernel(MlaRopeStore a) {
  const int r = blockIdx.x, half = a.rope / 2;
  const float* cs = a.cos ? a.cos + size_t(r) * half : nullptr;
  const float* sn = a.sin ? a.sin + size_t(r) * half : nullptr;
  // Queries: interleaved pairs (2i, 2i + 1) of each head's rope part (none without cos).
  float* q = a.q + size_t(r) * a.n_heads * (a.nope + a.rope);
  for (int t = threadIdx.x; t < a.n_heads * half && a.cos; t += kRopeThreads) {
    const int h = t / half, i = t % half;
    float* v = q + size_t(h) * (a.nope + a.rope) + a.nope + 2 * i;
    const float x0 = v[0], x1 = v[1];
    v[0] = x0 * cs[i] - x1 * sn[i];
    v[1] = x1 * cs[i] + x0 * sn[i];
  }
  // Indexer: half-split pairs (i, i + half) over the first `rope` dims of each head and of the key.
  for (int t = threadIdx.x; t < (a.idx_heads + 1) * half && a.idx_heads > 0; t += kRopeThreads) {
    const int h = t / half, i = t % half;
    float* v = h < a.idx_heads ? a.iq + (size_t(r) * a.idx_heads + h) * a.idx_dim : a.ik + size_t(r) * a.idx_dim;
    const float x0 = v[i], x1 = v[i + half];
    v[i] = x0 * cs[i] - x1 * sn[i];
    v[i + half] = x1 * cs[i] + x0 * sn[i];
  }
  // The latent: RMSNorm of c_kv, rotated k_rope, both to bf16 in the record.
  const float* kv = a.kva + size_t(r) * (a.rank + a.rope);
  __nv_bfloat16* rec = reinterpret_cast<__nv_bfloat16*>(a.kv_layer + a.row_off[r]);
  __shared__ float red[kRopeThreads / 32];
  float ss = 0;
  for (int c = threadIdx.x; c < a.rank; c += kRopeThreads) ss += kv[c] * kv[c];
  const float inv = rsqrtf(block_sum(ss, red) / float(a.rank) + a.eps);
  for (int c = threadIdx.x; c < a.rank; c += kRopeThreads) rec[c] = __float2bfloat16_rn(a.kv_norm[c] * (kv[c] * inv));
  for (int i = threadIdx.x; i < half; i += kRopeThreads) {
    const float x0 = kv[a.rank + 2 * i], x1 = kv[a.rank + 2 * i + 1];
    rec[a.rank + 2 * i] = __float2bfloat16_rn(cs ? x0 * cs[i] - x1 * sn[i] : x0);
    rec[a.rank + 2 * i + 1] = __float2bfloat16_rn(cs ? x1 * cs[i] + x0 * sn[i] : x1);
  }
}

// Per head, tiles of kTileRows rows x 128 latent columns: each thread one
// column, the rows' q_nope staged in shared memory [d][row] (float4 reads).
constexpr int kTileRows = 16;
__global__ void __launch_bounds__(128)
    mla_absorb_kernel(const float* __restrict__ q, int R, int NH, int nope, int rope, int v, int rank,
                      const uint16_t* __restrict__ kv_b, float* __restrict__ qa) {
  extern __shared__ float4 smem4[];
  float* qs = reinterpret_cast<float*>(smem4);  // [nope][kTileRows]
  const int h = blockIdx.y, r0 = blockIdx.z * kTileRows, c = blockIdx.x * 128 + threadIdx.x;
  const int qd = nope + rope;
  for (int t = threadIdx.x; t < nope * kTileRows; t += 128) {
    const int d = t / kTileRows, rr = t % kTileRows;
    qs[t] = r0 + rr < R ? q[(size_t(r0 + rr) * NH + h) * qd + d] : 0.f;
  }
  __syncthreads();
  const size_t qad = size_t(rank) + rope;
  if (blockIdx.x == 0)  // the roped part passes through
    for (int t = threadIdx.x; t < rope * kTileRows; t += 128) {
      const int rr = t / rope, j = t % rope;
      if (r0 + rr < R) qa[(size_t(r0 + rr) * NH + h) * qad + rank + j] = q[(size_t(r0 + rr) * NH + h) * qd + nope + j];
    }
  if (c >= rank) return;
  const uint16_t* w = kv_b + size_t(h) * (nope + v) * rank + c;
  float acc[kTileRows] = {};
  for (int d = 0; d < nope; ++d) {
    const float wd = bf16f(w[size_t(d) * rank]);
    const float4* qv = reinterpret_cast<const float4*>(qs + d * kTileRows);
#pragma unroll
    for (int k = 0; k < kTileRows / 4; ++k) {
      const float4 x = qv[k];
      acc[4 * k] += x.x * wd, acc[4 * k + 1] += x.y * wd, acc[4 * k + 2] += x.z * wd, acc[4 * k + 3] += x.w * wd;
    }
  }
#pragma unroll
  for (int rr = 0; rr < kTileRows; ++rr)
    if (r0 + rr < R) qa[(size_t(r0 + rr) * NH + h) * qad + c] = acc[rr];
}

// Per head, kTileRows rows x 8 value columns: a warp a column, its lanes
// across the latent (coalesced weight rows), the rows' latents in shared memory.
__global__ void __launch_bounds__(256)
    mla_out_kernel(const float* __restrict__ o, int R, int NH, int nope, int v, int rank,
                   const uint16_t* __restrict__ kv_b, __nv_bfloat16* __restrict__ out) {
  extern __shared__ float4 smem4[];
  float* os = reinterpret_cast<float*>(smem4);  // [kTileRows][rank]
  const int h = blockIdx.y, r0 = blockIdx.z * kTileRows, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int t = threadIdx.x; t < kTileRows * rank; t += 256) {
    const int rr = t / rank, c = t % rank;
    os[t] = r0 + rr < R ? o[(size_t(r0 + rr) * NH + h) * rank + c] : 0.f;
  }
  __syncthreads();
  const int j = blockIdx.x * 8 + warp;
  if (j >= v) return;
  const uint16_t* w = kv_b + (size_t(h) * (nope + v) + nope + j) * rank;
  float acc[kTileRows] = {};
  for (int c = lane; c < rank; c += 32) {
    const float wc = bf16f(w[c]);
#pragma unroll
    for (int rr = 0; rr < kTileRows; ++rr) acc[rr] += os[rr * rank + c] * wc;
  }
#pragma unroll
  for (int rr = 0; rr < kTileRows; ++rr) {
    float t = acc[rr];
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) t += __shfl_xor_sync(0xffffffffu, t, m);
    if (lane == 0 && r0 + rr < R) out[size_t(r0 + rr) * NH * v + size_t(h) * v + j] = __float2bfloat16_rn(t);
  }
}

__global__ void paged_tables_kernel(uint8_t* base, const int32_t* page_ids, int n_pages, size_t page_bytes,
                                    const int64_t* layer_off, int n_layers, const int32_t* row_first, int n_rows,
                                    uint8_t** tables, uint8_t*** row_tables) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nt = int64_t(n_layers) * n_pages;
  if (i < nt) {
    const int l = int(i / n_pages), j = int(i % n_pages);
    tables[i] = base + size_t(page_ids[j]) * page_bytes + size_t(layer_off[l]);
  } else if (i < nt + int64_t(n_layers) * n_rows) {
    const int64_t k = i - nt;
    const int l = int(k / n_rows), r = int(k % n_rows);
    row_tables[k] = tables + size_t(l) * n_pages + row_first[r];
  }
}

}  // namespace

void mla_rope_store(const MlaRopeStore& a, cudaStream_t s) {
  if (a.n_rows <= 0) return;
  check(a.rank > 0 && a.rank <= kMaxRank && a.rope > 0 && a.rope % 2 == 0 && a.n_heads > 0, DZ_ERR_UNSUPPORTED,
        "CUDA MLA: kv_lora_rank ", a.rank, " and qk_rope_head_dim ", a.rope, " (rank <= ", kMaxRank,
        ", an even RoPE width)");
  check(a.idx_heads == 0 || a.idx_dim >= a.rope, DZ_ERR_UNSUPPORTED, "CUDA MLA: index_head_dim ", a.idx_dim,
        " is below the RoPE width ", a.rope);
  check((a.cos == nullptr) == (a.sin == nullptr) && (a.cos || a.idx_heads == 0), DZ_ERR_INVALID_ARGUMENT,
        "CUDA MLA: cos and sin must both be given (or neither, without an indexer)");
  mla_rope_store_kernel<<<a.n_rows, kRopeThreads, 0, s>>>(a);
  DZ_CUDA_CHECK(cudaGetLastError());
}

void mla_absorb_q(const float* q, int n_rows, int n_heads, int nope, int rope, int v, int rank, const uint16_t* kv_b,
                  float* qa, cudaStream_t s) {
  if (n_rows <= 0) return;
  const size_t smem = size_t(nope) * kTileRows * sizeof(float);
  check(smem <= 48 * 1024, DZ_ERR_UNSUPPORTED, "CUDA MLA: qk_nope_head_dim ", nope, " (at most 768)");
  const dim3 grid((rank + 127) / 128, n_heads, (n_rows + kTileRows - 1) / kTileRows);
  mla_absorb_kernel<<<grid, 128, smem, s>>>(q, n_rows, n_heads, nope, rope, v, rank, kv_b, qa);
  DZ_CUDA_CHECK(cudaGetLastError());
}

void mla_out_proj(const float* o, int n_rows, int n_heads, int nope, int v, int rank, const uint16_t* kv_b,
                  uint16_t* out, cudaStream_t s) {
  if (n_rows <= 0) return;
  const size_t smem = size_t(rank) * kTileRows * sizeof(float);
  check(smem <= 160 * 1024, DZ_ERR_UNSUPPORTED, "CUDA MLA: kv_lora_rank ", rank, " (at most 2560)");
  if (smem > 48 * 1024)
    DZ_CUDA_CHECK(cudaFuncSetAttribute(mla_out_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid((v + 7) / 8, n_heads, (n_rows + kTileRows - 1) / kTileRows);
  mla_out_kernel<<<grid, 256, smem, s>>>(o, n_rows, n_heads, nope, v, rank, kv_b,
                                         reinterpret_cast<__nv_bfloat16*>(out));
  DZ_CUDA_CHECK(cudaGetLastError());
}

void paged_tables(uint8_t* base, const int32_t* page_ids, int n_pages, size_t page_bytes, const int64_t* layer_off,
                  int n_layers, const int32_t* row_first, int n_rows, uint8_t** tables, uint8_t*** row_tables,
                  cudaStream_t s) {
  const int64_t n = int64_t(n_layers) * (n_pages + n_rows);
  if (n <= 0) return;
  paged_tables_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(base, page_ids, n_pages, page_bytes, layer_off,
                                                                n_layers, row_first, n_rows, tables, row_tables);
  DZ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dz::cuda
