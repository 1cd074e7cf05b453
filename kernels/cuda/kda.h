// Kimi Delta Attention on the GPU: the recurrence of cpu/kda.h for a batch of
// sequences (a decode step, or a few tokens each), the fp32 state
// [head][key channel][value channel] read from and written back to each
// sequence's state slot. One block a (head, sequence), two threads a value
// channel holding its column of S in registers across the tokens: a decode
// step moves each state once in and once out of HBM.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

struct KdaRecurrent {
  int n_heads = 0;
  int head_dim = 0;  // 64 or 128 (d_k = d_v)
  int batch = 0;
  int64_t n = 0;  // tokens each sequence
  // Prepared inputs (cpu::kda_prepare's): q, k L2-normalised (q also times
  // d_k^-0.5), g the per-channel log-decay, beta in (0, 1). q, k, v, g:
  // [batch, n, H*D] rows of stride ld; beta [batch, n, H]. Device pointers.
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* g = nullptr;
  int64_t ld = 0;
  const float* beta = nullptr;
  float* const* state = nullptr;  // [batch] device array: each sequence's [H, D, D] state
  float* out = nullptr;           // [batch, n, H*D]
};

// Throws naming what the kernel cannot take. Stream-ordered.
void kda_recurrent(const KdaRecurrent& a, cudaStream_t s);

}  // namespace dz::cuda
