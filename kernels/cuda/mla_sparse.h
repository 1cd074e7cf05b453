// Sparse multi-head latent attention (DeepSeek MLA under DSA) for decode on
// the GPU: every query attends only to the positions its indexer selected,
// read through the page table from a bf16 latent cache, in the absorbed form
// (cpu/mla.h's decode): scores against [c_kv | k_rope] directly, the output
// the probability-weighted sum of c_kv (W_UV is applied after, as a GEMM).
// Tensor cores (mma m16n8k16 bf16 -> fp32), 64 heads x 64 selected positions
// a step, an online softmax over a split's steps, splits merged by a second
// launch. Probabilities are rounded to bf16 for the value product, as
// FlashAttention / FlashMLA do.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dz::cuda {

// The latent rank and RoPE width the kernel is built for (DeepSeek-V3/V3.2
// and Kimi Linear: 512 and 64).
constexpr int kMlaRank = 512;
constexpr int kMlaRope = 64;

struct SparseMlaDecode {
  int batch = 0;
  int n_heads = 0;    // a multiple of 16
  float scale = 1.f;  // softmax scale (q.k multiplied by it)
  // [batch, n_heads, kMlaRank + kMlaRope] bf16 (device): the absorbed query
  // (W_UK^T q_nope) then the roped q_rope.
  const uint16_t* q = nullptr;
  // [batch, topk] positions (device); negative entries are skipped. Null:
  // dense causal attention (Kimi Linear's MLA layers), row b attending
  // positions [0, n_visible[b]) and topk the largest n_visible (the loop bound).
  const int32_t* sel = nullptr;
  int topk = 0;
  const int64_t* n_visible = nullptr;  // [batch] (device), with sel null
  // Per batch row its sequence's page table (device array of page pointers).
  const uint8_t* const* const* pages = nullptr;
  // The latent record: bf16 [c_kv (kMlaRank) | k_rope (kMlaRope)] at `offset`
  // of each `stride`-byte token record; both multiples of 16.
  uint32_t page_tokens = 0;
  size_t stride = 0;
  size_t offset = 0;
  float* out = nullptr;  // [batch, n_heads, kMlaRank] fp32 (device); zeros where nothing is selected
};

// Throws naming what the kernel cannot take.
void sparse_mla_validate(const SparseMlaDecode& a);
// Splits of the selected positions for this batch (filling the GPU) and the
// device scratch they need.
int sparse_mla_splits(const SparseMlaDecode& a, int sm_count);
size_t sparse_mla_scratch_bytes(const SparseMlaDecode& a, int splits);
// Stream-ordered; scratch of sparse_mla_scratch_bytes(a, splits) bytes.
void sparse_mla_decode(const SparseMlaDecode& a, int splits, void* scratch, size_t scratch_bytes, cudaStream_t s);

// Any latent width (rank <= 512, rope <= 128) and head count, fp32 queries:
// one block a (query, head), its warps taking alternate selected positions
// with an online softmax each, merged at the end. For small models and test
// shapes; DeepSeek's 512 + 64 at 16k heads take sparse_mla_decode.
struct SparseMlaGeneric {
  int n_q = 0, n_heads = 0, rank = 0, rope = 0;
  float scale = 1.f;
  const float* q = nullptr;      // [n_q, n_heads, rank + rope] fp32 (device): W_UK^T q_nope, then q_rope
  const int32_t* sel = nullptr;  // [n_q, topk] positions (device); negative entries are skipped
  int topk = 0;
  const int64_t* n_visible = nullptr;            // sel null: query i attends [0, n_visible[i]), topk >= every count
  const uint8_t* const* const* pages = nullptr;  // per query its sequence's page table (device)
  uint32_t page_tokens = 0;
  size_t stride = 0, offset = 0;  // bf16 [c_kv | k_rope] at `offset` of each record (both even)
  float* out = nullptr;           // [n_q, n_heads, rank] fp32 (device); zeros where nothing is selected
};
constexpr int kMlaGenericMaxRank = 512, kMlaGenericMaxRope = 128;
void sparse_mla_generic(const SparseMlaGeneric& a, cudaStream_t s);

}  // namespace dz::cuda
