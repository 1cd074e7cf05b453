// MoE router on the device: top-k of each row's logits (ties: lower index
// first), softmax over the k selected logits only (gpt-oss).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

// logits [T, E] fp32 -> ids [T, k] int32, weights [T, k] fp32. E <= 256, k <= 16.
void router_topk_softmax(const float* logits, int T, int E, int k, int32_t* ids, float* weights, cudaStream_t s);

}  // namespace dz::cuda
