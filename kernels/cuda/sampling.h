// Temperature / top-k / top-p sampling of logits rows on the device: the
// choice cpu::sample_token makes on the host, given each row's uniform draw,
// without copying the row (0.8 MB at gpt-oss's vocabulary) or sorting it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

// The largest vocabulary sample_rows takes (4M: a block's slice of a row
// stays below 2^19 logits, and an index within 24 bits of its sort key).
constexpr int kMaxSampleVocab = 1 << 22;

struct SampleRow {
  const float* logits;  // V floats on the device
  float temperature;    // > 0
  int32_t top_k;        // 0: off
  float top_p;          // (0, 1]; 1: off
  double u;             // the draw in [0, 1) (cpu::uniform01 of the session's rng)
  // The row's cpu::argmax where known (the decode step's logits kernel wrote
  // it): its value is the row's largest, which saves a pass; -1: no logit is
  // a number; below -1: unknown (the kernel finds the largest itself).
  int32_t argmax = -2;
};

// For r < n: tokens[r] = the token cpu::sample_token picks from rows[r] with
// draw u (-1 when every logit is NaN). The candidates are ordered as there
// (largest logit first, lower index on ties), and so are the top_k cut, the
// top_p prefix and the draw; the weights are exp2 in fp32 held as integers
// (2^38 for the largest logit), so every sum is exact and a row and draw give
// the same token on every run. The host's double weights differ by ~1e-6
// relative: the two agree except where a draw or the top_p mass lies that
// close to a boundary between two tokens; a token weighing below ~2^-39 of the
// largest is never drawn. rows and tokens are device pointers; 0 < V <=
// kMaxSampleVocab. One cluster of eight 512-thread blocks a row.
void sample_rows(const SampleRow* rows, int n, int V, int32_t* tokens, cudaStream_t s);

}  // namespace dz::cuda
