// Multi-head latent attention (DeepSeek MLA) over the compressed cache, read
// through the page table. Each cached token holds c_kv (kv_lora_rank values,
// after kv_a_layernorm) and k_rope (the shared RoPE key, already rotated).
// Head h's key is [W_UK,h c_kv | k_rope] and its value W_UV,h c_kv, where
// kv_b_proj = [W_UK,0; W_UV,0; W_UK,1; W_UV,1; ...] (nope + v rows per head).
// Every query attends only to its own selected positions (the indexer's top-k;
// -1 entries are ignored), softmax(scale * q.k) in fp64.
//  - Decode (absorbed, one query): q~_h = W_UK,h^T q_nope,h scores directly
//    against c_kv; the output is W_UV,h (sum_s p_s c_kv,s). Nothing expanded.
//  - Prefill (expanded, many queries): K_nope and V are expanded once per
//    block of queries for the union of their selected positions, then plain
//    attention per query and head.
// Both compute the same function.
#pragma once

#include <cstdint>

#include "cpu/paged.h"
#include "runtime/parallel.h"

namespace dz::cpu {

struct MlaDims {
  int n_heads = 0;
  int nope = 0;     // qk_nope_head_dim
  int rope = 0;     // qk_rope_head_dim
  int v = 0;        // v_head_dim
  int rank = 0;     // kv_lora_rank
  float scale = 1;  // softmax scale (qk_head_dim^-0.5, times mscale^2 under YaRN)
};

// Bytes of one cached token: c_kv then k_rope, fp32.
inline size_t mla_latent_bytes(const MlaDims& d) { return size_t(d.rank + d.rope) * sizeof(float); }

// q: [H, nope + rope] (rope part rotated); w_kv_b: kv_b_proj decoded to fp32,
// [H * (nope + v), rank]; sel: n_sel positions (-1 ignored); out: [H, v].
// Returns the number of positions attended.
int64_t mla_decode(const MlaDims& d, const float* q, const float* w_kv_b, const PagedRows& latent, const int32_t* sel,
                   int n_sel, float* out, ThreadPool* pool);

// n_q queries q: [n_q, H, nope + rope]; sel: [n_q, k]; out: [n_q, H, v].
// query_block bounds the expansion scratch (union of a block's selections).
// Returns the number of (query, position) pairs attended.
int64_t mla_prefill(const MlaDims& d, const float* q, int64_t n_q, const float* w_kv_b, const PagedRows& latent,
                    const int32_t* sel, int k, float* out, ThreadPool* pool, int64_t query_block = 16);

}  // namespace dz::cpu
