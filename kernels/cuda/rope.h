// Rotary embeddings (half-split / NeoX pairs) applied to a fused QKV row
// block, with the rotated K and the V written into paged KV slots (bf16,
// rounded to nearest; K then V per token per layer). cos/sin come from the host (YaRN tables of
// cpu/rope.h, attention factor folded in), so both backends rotate by the
// same fp32 numbers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

// qkv [R][stride]: q (n_heads x D) | k (n_kv x D) | v (n_kv x D), fp32; q is
// rotated in place. cos/sin [R][D/2]. Row r's KV slot is kv_layer + row_off[r]
// (bytes): K (n_kv x D bf16) then V.
void rope_qk_store_kv(float* qkv, int R, int stride, const float* cos, const float* sin, int n_heads, int n_kv, int D,
                      uint8_t* kv_layer, const int64_t* row_off, cudaStream_t s);

}  // namespace dz::cuda
