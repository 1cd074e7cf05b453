// The DeepSeek sparse attention (DSA) lightning indexer on the GPU, in the
// CPU backend's FP8 mode (cpu/indexer.h): keys and queries rotated by the
// orthonormal Hadamard transform and quantized to E4M3 with one fp32 scale a
// vector (index_head_dim <= 128: DeepSeek-V3.2's is 128), scored on the tensor
// cores (E4M3 x E4M3 -> fp32: wgmma over key tiles shared by a prompt's
// queries, mma.sync for decode batches and other shapes),
//   score(t, s) = sum_h w[t, h] H^-0.5 D^-0.5 qs[t, h] ks[s] ReLU(q8[t, h] . k8[s]),
// then the top-k positions of each query kept by an exact radix selection
// (higher score first, the lower position on ties, as cpu::RunningTopK), its
// output ascending and -1-padded like the CPU's. Decode and prefill are the
// same launches over a batch of queries; prefill is cut into query blocks
// that bound the score scratch. docs/cuda-dsa.md has the kernels' design and
// measurements.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dz::cuda {

// Where the keys live: records of `stride` bytes, page_tokens to a page; a
// key (D E4M3 bytes, then its fp32 scale) at `offset` in its record (4-byte
// aligned). Pages are device pointers.
struct IndexerKeys {
  uint32_t page_tokens = 0;
  size_t stride = 0;
  size_t offset = 0;
};

struct IndexerQueries {
  int n_heads = 0;   // H, at most 128 (a multiple of 16)
  int head_dim = 0;  // D: 32, 64 or 128
  int topk = 0;
  bool pow2_scales = false;  // power-of-two E4M3 scales (DeepSeek's "ue8m0")
  int64_t n_q = 0;
  const float* q = nullptr;  // [n_q, H, D] roped fp32 (device)
  const float* w = nullptr;  // [n_q, H] weights_proj outputs (device)
  // Per query its sequence's page table (device array of page pointers) and
  // how many positions it sees ([0, n_visible)); both device arrays of n_q.
  const uint8_t* const* const* pages = nullptr;
  const int64_t* n_visible = nullptr;
  int64_t max_visible = 0;  // host: no query sees more (sizes the grid and the scratch)
  // Every query reads the same page table (one prompt's prefill): at 64 heads
  // of 128 the scores then share key tiles across queries on the tensor cores.
  bool same_pages = false;
  IndexerKeys keys;
  int32_t* out = nullptr;   // [n_q, topk] device: ascending positions, -1-padded
  float* scores = nullptr;  // optional [n_q, max_visible] device: each query's scores (tests, traces)
};

// Throws DZ_ERR_UNSUPPORTED / DZ_ERR_INVALID_ARGUMENT naming what the kernels
// cannot take (head counts, head dims, alignment).
void indexer_validate(const IndexerQueries& a);

// Device scratch indexer_select needs for queries of up to max_visible
// positions, at most query_block queries scored at a time.
size_t indexer_scratch_bytes(const IndexerQueries& a, int64_t query_block);

// Select for every query (see the file comment). scratch: device memory of
// indexer_scratch_bytes(a, query_block) bytes. Stream-ordered; no host sync.
void indexer_select(const IndexerQueries& a, void* scratch, size_t scratch_bytes, int64_t query_block, cudaStream_t s);

// The selection alone, on scores already computed: for each of n_q rows
// (row i at scores + i * ld, its first min(n_visible[i], max_visible) values;
// n_visible a device array), the top-k positions exactly as indexer_select
// keeps them (higher score first, the lower position on ties, NaN never),
// ascending and -1-padded into out [n_q, k]. Stream-ordered.
void indexer_topk(const float* scores, int64_t ld, int64_t n_q, const int64_t* n_visible, int64_t max_visible, int k,
                  int32_t* out, cudaStream_t s);

// Encode n keys (fp32 [n, D], normalised and roped) into their records:
// key i at position pos[i] of the sequence whose page table is `pages`
// (all device pointers). The same bytes as cpu::indexer_encode_key.
void indexer_encode_keys(int head_dim, bool pow2_scales, const float* k, int64_t n, const int64_t* pos,
                         uint8_t* const* pages, const IndexerKeys& keys, cudaStream_t s);
// The same for keys of several sequences in one launch: key i's page table
// is row_pages[i] (a device array of n device page tables).
void indexer_encode_keys_rows(int head_dim, bool pow2_scales, const float* k, int64_t n, const int64_t* pos,
                              uint8_t* const* const* row_pages, const IndexerKeys& keys, cudaStream_t s);

}  // namespace dz::cuda
