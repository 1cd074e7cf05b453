// Embedding gather on the device: x[r] = float(table[tokens[r]]), table BF16 [V, H].
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

void embed_gather(const uint16_t* table, const int32_t* tokens, int n_rows, int H, float* x, cudaStream_t s);

}  // namespace dz::cuda
