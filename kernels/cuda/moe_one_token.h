// One token through gpt-oss's MXFP4 experts as a stream of the routed
// experts' bytes (MoeOptions::fused_one_token_stream; docs/cuda-moe.md).
//
// One persistent launch (or one a projection: OneTokenConfig::launches), one
// block an SM. A unit is 16 rows of one routed slot's projection over its
// whole K: contiguous bytes in the checkpoint layout. gate_up's units, then
// down's, are dealt round the blocks (unit u to block u mod blocks) so that
// the GPU reads the experts front to back. A producer warp keeps units in flight
// through the copy engine (a bulk copy a row, rows padded 16 bytes apart in
// shared memory so a warp's loads from 8 rows meet no bank conflict), a ring
// a group of consumer warps; the groups take units in turn, each warp a share
// of the K range: E2M1 -> fp16 in registers (exact) and `mma.sync m16n8k16`,
// two MMAs a 32-element sub-block so its E8M0 scale multiplies the fp32
// partial sums (the weights exact). The token is fp16 under one power-of-two
// scale, as in the W4A16 kernels; down's activations (gate_up's epilogue
// writes them as fp16: gpt-oss's SwiGLU is at most 56) wait only for their
// slot's gate_up units. The last of a row tile's slots to finish sums the
// slots in slot order (the combine: no further launch, the same bits
// whichever block is last).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/moe.h"

namespace dz::cuda {

// Device scratch of one layer call (reused by every layer; counters zeroed once).
struct OneTokenScratch {
  uint8_t* img = nullptr;  // down's activation images, one_token_img_bytes
  float* y = nullptr;      // [topk][hidden] expert outputs
  int* counts = nullptr;   // one_token_counts ints, zero before the first call (each call leaves them zero)
};
size_t one_token_img_bytes(const MoeShape& s);
inline size_t one_token_counts(const MoeShape& s) { return size_t(s.topk) + 1 + size_t(s.hidden) / 16; }

// Whether one_token_moe runs this shape and these weights here (sm_90,
// gpt-oss's activation, rows of 16, K a multiple of 32, 16-byte aligned
// weights, topk <= 8, the ring fitting shared memory). Sets the kernels'
// shared-memory limits on first use.
// All blocks must be resident at once (down's units wait for other blocks'
// gate_up units): blocks <= the device's SMs, nothing else holding them for good.
bool one_token_moe_supported(const MoeShape& s, const MoeWeights& w, const OneTokenConfig& c = {});

// out[H] (+)= sum_k gw[k] * expert_{ids[k]}(x) for one token. Invalid ids set
// *err and their slots are left out of the sum. blocks: the grid (one an SM).
void one_token_moe(const MoeShape& s, const MoeWeights& w, const float* x, const int* ids, const float* gw, float* out,
                   bool accumulate, const OneTokenScratch& scr, int* err, int blocks, bool pdl, cudaStream_t st,
                   const OneTokenConfig& c = {});

}  // namespace dz::cuda
