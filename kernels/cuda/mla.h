// The dense parts of DeepSeek MLA around the sparse attention, on the device,
// computing what cpu/mla.h's absorbed (decode) form computes for every query:
//  - mla_rope_store: each new token's latent (RMSNorm of c_kv, interleaved
//    RoPE of k_rope) into its bf16 cache record; interleaved RoPE on each
//    query head's rope part; half-split RoPE on the indexer's query heads and
//    key (their first `rope` dims), as the CPU family applies them.
//  - mla_absorb_q: q~ = W_UK,h^T q_nope,h per head (fp32 sums of bf16
//    weights), followed by q_rope: the query sparse attention scores against
//    the cached [c_kv | k_rope] directly.
//  - mla_out_proj: W_UV,h times the attended latent, per head, in bf16 for
//    the o projection's GEMM.
// kv_b_proj is bf16 [n_heads * (nope + v), rank] = [W_UK,0; W_UV,0; W_UK,1; ...].
// Per-head CUDA-core tiles: these projections are a small share of a layer's
// bytes at decode; at long prefills they are the place for tensor cores next.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dz::cuda {

struct MlaRopeStore {
  int n_rows = 0;
  int n_heads = 0, nope = 0, rope = 0, rank = 0;
  // [n_rows][rope / 2]; null: no rotation (Kimi Linear's NoPE MLA caches k_rope as projected).
  const float *cos = nullptr, *sin = nullptr;
  float* q = nullptr;              // [n_rows][n_heads][nope + rope], rotated in place
  const float* kva = nullptr;      // [n_rows][rank + rope]: c_kv then k_rope, as projected
  const float* kv_norm = nullptr;  // [rank] RMSNorm weight
  float eps = 1e-6f;
  // Row r's record at kv_layer + row_off[r]: bf16 [c_kv (rank) | k_rope (rope)].
  uint8_t* kv_layer = nullptr;
  const int64_t* row_off = nullptr;
  int idx_heads = 0, idx_dim = 0;  // the indexer (0 heads: none)
  float* iq = nullptr;             // [n_rows][idx_heads][idx_dim], rotated in place
  float* ik = nullptr;             // [n_rows][idx_dim], rotated in place
};
// Throws naming what it cannot take (rank <= 4096, even rope, idx_dim >= rope).
void mla_rope_store(const MlaRopeStore& a, cudaStream_t s);

// qa [n_rows][n_heads][rank + rope] fp32 from q [n_rows][n_heads][nope + rope].
void mla_absorb_q(const float* q, int n_rows, int n_heads, int nope, int rope, int v, int rank, const uint16_t* kv_b,
                  float* qa, cudaStream_t s);

// out [n_rows][n_heads * v] bf16 from the attended latent o [n_rows][n_heads][rank] fp32.
void mla_out_proj(const float* o, int n_rows, int n_heads, int nope, int v, int rank, const uint16_t* kv_b,
                  uint16_t* out, cudaStream_t s);

// Page pointer tables for kernels that read paged records through pointers:
// tables[l * n_pages + j] = base + page_ids[j] * page_bytes + layer_off[l]
// for l < n_layers, and per layer each row's table,
// row_tables[l * n_rows + r] = tables + l * n_pages + row_first[r].
// All device arrays.
void paged_tables(uint8_t* base, const int32_t* page_ids, int n_pages, size_t page_bytes, const int64_t* layer_off,
                  int n_layers, const int32_t* row_first, int n_rows, uint8_t** tables, uint8_t*** row_tables,
                  cudaStream_t s);

}  // namespace dz::cuda
