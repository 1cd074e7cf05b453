// The DeepSeek sparse attention (DSA) lightning indexer: per query token t it
// scores every visible cached token s,
//   score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * D^-0.5,  w = weights_proj(x) * H^-0.5,
// and keeps the top-k positions. Two modes:
//  - Exact: fp32 keys, scores as transformers computes them.
//  - Fp8: as production engines run it: q and k rotated by the orthonormal
//    Hadamard transform (D a power of two), quantised to E4M3 with one scale
//    per 128 dims (amax / 448, optionally rounded up to a power of two); the
//    products are summed over the E4M3 values and scaled afterwards.
// Scoring streams over the context in chunks of keys with a running top-k per
// query, one block of queries at a time: scratch memory is bounded by the
// budget whatever the context length, never a [queries x context] matrix.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/paged.h"
#include "runtime/parallel.h"

namespace dz::cpu {

enum class IndexerMode : uint8_t { Exact, Fp8 };

struct IndexerConfig {
  int n_heads = 0;
  int head_dim = 0;  // D
  int topk = 0;
  IndexerMode mode = IndexerMode::Exact;
  bool pow2_scales = false;  // Fp8: power-of-two scales
};

// Streaming budget: keys decoded per chunk and queries scored per block.
struct IndexerBudget {
  int64_t chunk_tokens = 2048;
  int64_t query_block = 64;
};

struct IndexerStats {
  size_t peak_scratch_bytes = 0;  // largest scratch held by one indexer_select call
  uint64_t keys_scored = 0;       // (query, key) pairs scored
};

// Bytes one token's key takes in the cache: Exact D fp32; Fp8 D E4M3 bytes
// followed by one fp32 scale per 128 dims.
size_t indexer_key_bytes(const IndexerConfig& c);
// Dims covered by one FP8 scale: min(D, 128).
int indexer_scale_block(const IndexerConfig& c);
// Throws DZ_ERR_UNSUPPORTED when the mode cannot serve this head size.
void indexer_validate(const IndexerConfig& c);

// In-place orthonormal Walsh-Hadamard transform of n values (n a power of two).
void hadamard(float* x, int n);

// Store one key (already normalised and rotated by RoPE, fp32 [D]) in its cache slot.
void indexer_encode_key(const IndexerConfig& c, const float* k, uint8_t* dst);

// Select the top-k visible positions for n_q queries of one sequence.
// q: [n_q, H, D] roped fp32 queries; w: [n_q, H] raw weights_proj outputs;
// n_visible[i]: query i sees positions [0, n_visible[i]); keys: the cached
// keys through the page table. out: [n_q, topk], each row ascending,
// -1-padded when fewer than topk positions are visible.
void indexer_select(const IndexerConfig& c, const float* q, const float* w, int64_t n_q, const int64_t* n_visible,
                    const PagedRows& keys, const IndexerBudget& budget, int32_t* out, IndexerStats* stats,
                    ThreadPool* pool);

}  // namespace dz::cpu
