// DeepSeek-V4's attention on the device (the CPU's deepseek_v4.cpp is the
// definition): the compressors' streaming pools and the entries they close,
// the CSA indexer's scores over the entries, attention with a sink logit per
// head over a query's window plus its visible (HCA) or picked (CSA) entries,
// the window rings, interleaved RoPE by per-row tables, and the grouped
// output projection's regrouping. fp32 throughout; one K=V head.
//
// Pages: entry w of a layer lies in the token slots of positions w * rate ..
// w * rate + rate - 1 of its sequence, token_bytes (a multiple of 4) a slot:
// float c at slot w * rate + c / (token_bytes / 4), offset c % (token_bytes /
// 4). Any page size works (entries may straddle pages).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

struct EntryPages {
  uint8_t* const* const* rows = nullptr;  // [T]: each row's sequence's page pointers at this layer
  uint32_t page_tokens = 0, token_bytes = 0;
  int64_t rate = 0;
};

// Both of a layer's compressors (attention entries, CSA indexer keys) over
// one pass: per segment (a sequence's consecutive rows), each channel's pools
// (cpu/compress.h: [max | sum | weighted sum] of dim floats at state_off)
// pushed token by token in the serial order, and every window the pass closes
// turned into its entry (RMSNorm with norm, RoPE of its last 2 * rope_half
// channels at the window's first position: cos / sin [T][rope_half] of each
// closing row) written to the pages at entry_off floats. A block an entry,
// then a block a segment for the pools left open.
struct Compressor {
  int dim = 0;
  bool overlap = false;  // CSA: [Ca | Cb] projections, two pools
  const float* kv = nullptr;
  const float* gate = nullptr;  // [T][ld]
  int64_t ld = 0;
  const float* bias = nullptr;  // [rate][S * dim]
  const float* norm = nullptr;  // [dim]
  int64_t state_off = 0;
  int entry_off = 0;
};
struct CompressPass {
  int n_seg = 0;
  const int32_t* seg_first = nullptr;  // [n_seg + 1] rows
  const int64_t* pos = nullptr;        // [T] positions
  float* const* state = nullptr;       // [n_seg] state slots (updated in place)
  EntryPages pages;
  const float *cos = nullptr, *sin = nullptr;
  int rope_half = 0;
  float eps = 1e-6f;
  Compressor c[2];
  int n_comp = 1;
  int max_close = 0;  // the most windows one segment closes: (last pos + 1) / rate - first pos / rate
};
void compress(const CompressPass& a, cudaStream_t s);

// The CSA indexer: scores[r][w] = sum_h w_h * wscale * max(0, scale * q_h . key_w)
// for the first n_visible[r] entries (their keys at key_off floats).
struct EntryScores {
  int n_rows = 0, heads = 0, dim = 0;
  const float* q = nullptr;  // [T][heads * dim]
  const float* w = nullptr;  // [T][heads]
  float wscale = 1, scale = 1;
  const int64_t* n_visible = nullptr;
  int64_t max_visible = 0;
  EntryPages pages;
  int key_off = 0;
  float* scores = nullptr;
  int64_t ld = 0;
};
void entry_scores(const EntryScores& a, cudaStream_t s);

// out[r][h] = softmax-weighted sum over row r's keys (K = V) with a sink
// logit per head taking probability mass but no value: the window (positions
// max(0, pos - window + 1) .. pos: this pass's kv rows from the segment's
// first row on, older ones from the segment's ring state[seg] + ring_off, slot
// position % window), then entries: none, every visible one, or the picked
// ones (sel [T][k], -1 padded).
struct SinkAttention {
  int n_rows = 0, n_heads = 0, head_dim = 0, window = 0;
  float scale = 1;
  const float* q = nullptr;      // [T][n_heads * head_dim]
  const float* sinks = nullptr;  // [n_heads]
  const float* kv = nullptr;     // [T][head_dim]
  const int64_t* pos = nullptr;
  const int32_t* row_seg = nullptr;    // [T] segment of each row
  const int32_t* seg_first = nullptr;  // [n_seg + 1]
  float* const* state = nullptr;
  int64_t ring_off = 0;
  enum Entries { kNone, kVisible, kPicked } entries = kNone;
  const int64_t* n_visible = nullptr;
  const int32_t* sel = nullptr;
  int k = 0;
  EntryPages pages;
  float* out = nullptr;  // [T][n_heads * head_dim]
};
void sink_attention(const SinkAttention& a, cudaStream_t s);

// Each segment's ring (state[seg] + ring_off, window x dim) takes its last
// min(window, rows) kv rows, at slot position % window.
void window_store(const float* kv, int dim, int window, int n_seg, const int32_t* seg_first, const int64_t* pos,
                  float* const* state, int64_t ring_off, cudaStream_t s);

// Rotates n_vec vectors a row (vec_stride apart, their rotary channels from
// offset on) in interleaved pairs by the row's cos / sin [rows][half];
// inverse: backwards.
void rope_interleaved_rows(float* x, int n_rows, int n_vec, int64_t row_stride, int64_t vec_stride, int offset,
                           int half, const float* cos, const float* sin, bool inverse, cudaStream_t s);

// dst[g][r][c] = bf16(src[r][g * C + c]) (groups apart), and back:
// dst[r][g * C + c] = bf16(src[g][r][c]) (groups together).
void split_groups_bf16(const float* src, int rows, int groups, int C, uint16_t* dst, cudaStream_t s);
void join_groups_bf16(const float* src, int rows, int groups, int C, uint16_t* dst, cudaStream_t s);

}  // namespace dz::cuda
