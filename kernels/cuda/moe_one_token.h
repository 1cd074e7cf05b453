// One token through gpt-oss's MXFP4 experts as a stream of the routed
// experts' bytes (MoeOptions::fused_one_token_stream; docs/cuda-moe.md).
//
// Two persistent launches, gate_up (+ SwiGLU) and down (+ the weighted sum of
// the slots), each one block an SM. A unit is 16 rows of one routed slot's
// projection over its whole K: contiguous bytes in the checkpoint layout,
// dealt round the blocks (unit u to block u mod blocks) so that the GPU reads
// the experts front to back. A producer warp keeps a ring of units in flight
// through the copy engine (a bulk copy a row, rows padded 16 bytes apart in
// shared memory so a warp's loads from 8 rows meet no bank conflict); groups
// of 4 consumer warps take units in turn, each warp a quarter of the K range:
// E2M1 -> E4M3 in registers and `mma.sync m16n8k32` on FP8 tensor cores, one
// MMA a 32-element sub-block so its E8M0 scale multiplies the fp32 partial
// sums (the weights exact). The token is two E4M3 terms, hi and the remainder
// times 16, in MMA columns 0 and 1: gate_up's input under one power-of-two
// scale for the token, down's activations (gate_up's epilogue writes them)
// under gpt-oss's fixed scale 56 / 448. The last of a row tile's slots to
// finish sums the slots in slot order (the combine: no third launch, the same
// bits whichever block is last).
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
bool one_token_moe_supported(const MoeShape& s, const MoeWeights& w, const OneTokenConfig& c = {});

// out[H] (+)= sum_k gw[k] * expert_{ids[k]}(x) for one token. Invalid ids set
// *err and their slots are left out of the sum. blocks: the grid (one an SM).
void one_token_moe(const MoeShape& s, const MoeWeights& w, const float* x, const int* ids, const float* gw, float* out,
                   bool accumulate, const OneTokenScratch& scr, int* err, int blocks, bool pdl, cudaStream_t st,
                   const OneTokenConfig& c = {});

}  // namespace dz::cuda
