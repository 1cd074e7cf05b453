// Paged GQA attention with per-head sinks and an optional sliding window
// (gpt-oss), reading bf16 K/V from KV pages through per-sequence page tables
// (a token's slot: K of every KV head, then V).
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
  uint16_t* out = nullptr;   // bf16 [R][n_heads * head_dim]
  float* out_f32 = nullptr;  // when set, fp32 output here instead of out (tests)
  // Prefill: queries and probabilities enter the bf16 MMAs as two terms each
  // (hi + lo, ~16 significant bits: fp32-like) or as one (rounded to bf16,
  // as FlashAttention does: half the MMAs, errors at the bf16 output's own
  // rounding). Decode always takes two (its reads of K and V bound it).
  int terms = 2;
  bool prefill_wgmma = true;  // false: the mma.sync prefill kernel on sm_90a too (tests, benchmarks)
};

// Rows with a single new token (decode), unsplit: one block per (row, head),
// the keys split over 4 warps. rows: [n_rows] row indices. (Reference for the
// split kernel; the model uses attention_decode_split.)
void attention_decode(const AttnBatch& a, const int32_t* rows, int n_rows, cudaStream_t s);

// Split-K decode ("flash decoding"). A row attending to len = pos - lo + 1
// keys cuts them into chunks of decode_chunk_keys(len) keys starting at lo;
// one block per (row, KV head, group of up to 16 query heads, chunk) reads each
// key of its chunk once for all those heads (bf16 tensor-core MMAs, queries
// and probabilities as two bf16 terms each: fp32-like accuracy on the bf16
// cache). A row of one chunk is finished
// by its block; otherwise blocks write partial softmax states (max, sum, acc)
// and the last block of the row to finish merges them with the sink. The
// chunk size depends on the row's own length only, so a row's output does
// not depend on the batch or on the grid (`splits` blocks per row; those past
// the row's chunk count exit), which is what lets a CUDA graph captured for
// `splits` serve every row that needs at most that many chunks.
// Launched as a programmatic dependent of the previous kernel (PDL), it reads
// rows, row metadata, page tables and the keys before each row's position
// before waiting for that kernel: only q and key pos may come from it.
struct DecodeSplitPolicy {
  // Keys per chunk at least (multiple of 32). Each chunk costs its block a
  // fixed latency and a partial state to merge, so short chunks pay only where
  // rows are few (H200, dz bench attention: 256 vs 64 at batch 64 x 4K keys
  // 207 vs 499 us, at batch 1 x 4K 14 vs 23 us; 128 is 2 us ahead at 1K keys).
  int min_chunk = 256;
  // Chunks of min_chunk * 2^k keys, at most base_splits * 2^k of them: a
  // chunk doubles each time the length quadruples past base_splits *
  // min_chunk keys, so a long row gets both more blocks and longer chunks
  // (256 keys up to 2K, 512 up to 8K, 1K up to 32K, 2K up to 64K, then
  // max_splits chunks). H200 (run 93, against at most 32 chunks of 256 keys
  // and up): 4K keys, 1 / 8 / 64 sessions 14.5 / 39.4 / 209.1 -> 15.4 / 31.4
  // / 167.7 us; 8K 18.2 / 66.4 / 400.4 -> 17.4 / 56.3 / 317.9; 16K 23.4 /
  // 98.2 / 615.8 -> 23.3 / 89.7 / 573.6; 3K one session 15.4 -> 17.4.
  // base_splits >= max_splits gives chunks of min_chunk * 2^k, at most
  // max_splits of them.
  int base_splits = 8;
  // Chunks per row at most (32 vs 64: batch 1 x 128K keys 83 vs 91 us, batch
  // 64 x 32K 1118 vs 1215 us; one session from 32K keys needs the 32: 32K
  // 32.4 vs 35.2 us with 16, 128K 83.4 vs 99.6).
  int max_splits = 32;
};
// min_chunk a multiple of 32 up to 2^20, base_splits and max_splits 1..4096.
bool decode_policy_valid(const DecodeSplitPolicy& p);
// Keys per chunk and chunks for a row attending to len keys (len >= 1) when
// `splits` blocks per row are launched: decode_chunk_keys(len) as long as
// that needs at most `splits` chunks, else larger chunks (still correct, but
// then the row's rounding depends on `splits`): callers launch
// splits >= max over rows of decode_chunks(len, p, p.max_splits).
int decode_chunk_keys(int len, const DecodeSplitPolicy& p, int splits);
int decode_chunks(int len, const DecodeSplitPolicy& p, int splits);
// Device scratch: partial states (fp32) and ticket counters (int32, zeroed
// once by the owner: every launch leaves them zero again). Rows are processed
// in groups that fit both (one row at least).
struct DecodeScratch {
  float* partials = nullptr;
  size_t partial_floats = 0;
  int* tickets = nullptr;
  size_t ticket_ints = 0;
};
size_t decode_partial_floats(int n_rows, int n_heads, int head_dim, int splits);
size_t decode_ticket_ints(int n_rows, int n_heads, int n_kv_heads);
void attention_decode_split(const AttnBatch& a, const int32_t* rows, int n_rows, int splits, const DecodeSplitPolicy& p,
                            const DecodeScratch& scratch, cudaStream_t s);

// Tiles of consecutive rows of one sequence (prefill; rows_per_tile =
// attention_tile_rows(n_heads, n_kv_heads)): one block per (tile, KV head x
// group of up to 16 query heads), the tile's (token, head) pairs the rows of
// the same bf16 tensor-core MMAs as decode (queries and probabilities as two
// terms), the block's keys streamed once through shared memory for all of them.
struct AttnTile {
  int32_t row0, n;
};
int attention_tile_rows(int n_heads, int n_kv_heads);
void attention_prefill(const AttnBatch& a, const AttnTile* tiles, int n_tiles, int rows_per_tile, cudaStream_t s);

// Head sizes the kernels are built for.
bool attention_supports(int head_dim);

}  // namespace dz::cuda
