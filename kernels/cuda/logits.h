// The lm_head's rows after a decode step: each row's argmax (greedy sampling
// on the device) and, where asked, a copy of the row into its session's own
// device buffer, so that the logits cross to the host only when read.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

// For r < rows: argmax[r] = the index of the largest value of logits[r][0..V)
// (the lowest index on ties, NaNs ignored, -1 if every value is NaN: the CPU
// backend's cpu::argmax), and when dst[r] is not null, dst[r][0..V) = the row
// (bit for bit). logits rows are V floats apart; dst may be null (no copies).
void logits_argmax_copy(const float* logits, int rows, int V, float* const* dst, int32_t* argmax, cudaStream_t s);

}  // namespace dz::cuda
