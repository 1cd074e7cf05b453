// Paged GQA attention with per-head sinks and an optional sliding window
// (gpt-oss), reading fp32 K/V from KV pages through per-sequence page tables.
// Ragged batches: every row (query token) carries its sequence and position
// and attends to keys [lo, pos], lo = window ? max(0, pos - window + 1) : 0.
// Softmax includes the sink logit as one extra column that is then dropped.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

struct AttnBatch {
  const uint8_t* kv = nullptr;  // KV storage base + this layer's offset within a page
  int64_t page_bytes = 0;
  int page_tokens = 0;
  const int32_t* page_table = nullptr;  // all sequences' page ids, concatenated
  const int32_t* item_pt = nullptr;     // [items]: offset of each sequence's table
  const int32_t* row_item = nullptr;    // [R]
  const int32_t* row_pos = nullptr;     // [R]
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int window = 0;  // 0: full attention
  float scale = 1;
  const float* sinks = nullptr;  // [n_heads], fp32
  const float* q = nullptr;      // row r, head h at q + r * q_stride + h * head_dim
  int q_stride = 0;
  uint16_t* out = nullptr;  // bf16 [R][n_heads * head_dim]
};

// Rows with a single new token (decode): one block per (row, head), the keys
// split over 4 warps. rows: [n_rows] row indices.
void attention_decode(const AttnBatch& a, const int32_t* rows, int n_rows, cudaStream_t s);

// Tiles of consecutive rows of one sequence (prefill): one block per (tile,
// KV head), one thread per (row, head of the group), keys staged in shared
// memory. rows_per_tile = attention_tile_rows(a).
struct AttnTile {
  int32_t row0, n;
};
int attention_tile_rows(int n_heads, int n_kv_heads);
void attention_prefill(const AttnBatch& a, const AttnTile* tiles, int n_tiles, int rows_per_tile, cudaStream_t s);

// Head sizes the kernels are built for.
bool attention_supports(int head_dim);

}  // namespace dz::cuda
