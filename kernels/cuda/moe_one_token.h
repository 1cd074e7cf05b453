// One token through a layer's MXFP4 experts (a decode step at batch 1), in two
// launches that every SM streams at once:
//   1. gate_up + SwiGLU: one block an SM, each an equal contiguous range of the
//      token's (slot, row pair)s, every warp keeping three row pairs of weight
//      loads in flight; the weights are decoded to fp16 in registers and
//      multiplied on the CUDA cores against the input staged in shared memory
//      (fp16, a power-of-two scale a 32-element sub-block), fp32 row sums.
//   2. down + the weighted sum of the experts + the residual: one block an SM,
//      each owning a slice of the hidden rows of every routed expert. Launched
//      as a programmatic dependent of (1), its blocks become resident beside
//      (1)'s and bulk-copy their whole slice of down's weights into shared
//      memory while (1) still streams; only then do they wait for (1)'s
//      activations. The block then has all the token's experts for its rows,
//      so it also forms out (+)= sum_k gw[k] * (down_k + b2) in a fixed order
//      (no combine launch).
// The per-projection kernels of moe.cu leave one token at about half of HBM:
// each of their blocks waits a DRAM latency or two for its share of rows, and
// down's weights only start streaming once gate_up's blocks drain.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

struct MoeOneTokenArgs {
  // gate_up: blocks [E][2I][H/32][16], scales [E][2I][H/32], bias bf16 [E][2I]
  // (rows 2j, 2j+1: gate and up of feature j); down: [E][H][I/32][16], [E][H][I/32], [E][H].
  const uint8_t *w1_blocks = nullptr, *w1_scales = nullptr;
  const uint16_t* b1 = nullptr;
  const uint8_t *w2_blocks = nullptr, *w2_scales = nullptr;
  const uint16_t* b2 = nullptr;
  const int* ids = nullptr;   // [topk] the token's experts; one out of range sets *err and its slot counts 0
  const float* gw = nullptr;  // [topk] their weights
  const float* x = nullptr;   // [H] fp32 input
  float* out = nullptr;       // [H]: = (or += with accumulate) the weighted sum of the experts
  int accumulate = 0;
  __half* act = nullptr;  // scratch [topk][act_ld] fp16: the SwiGLU outputs
  int act_ld = 0;
  int* err = nullptr;
  // Device ints [kMoeOneTokenSync], zero before the first call (each call leaves them zero): the
  // slots' readiness between the two kernels.
  int* sync = nullptr;
  int n_experts = 0, topk = 0, hidden = 0, intermediate = 0;
  int up_signals = 0;  // (set by moe_one_token)
  int probe = 0;       // PROBE: no arithmetic (the stream's floor)
};
constexpr int kMoeOneTokenSync = 9;

// Whether the one-token kernels take this shape here: an sm_90 device and
// build, H and I multiples of 32 up to 3072, topk up to 8, down's slice of
// rows in shared memory. Sets the kernels' attributes on first use.
bool moe_one_token_fits(int topk, int hidden, int intermediate);

// Both launches on s (pdl: as programmatic dependents, the first of the
// previous kernel in s, the second of the first). Pointers must be 16-byte
// aligned (x, act, the weight blocks) and the shape must fit.
void moe_one_token(const MoeOneTokenArgs& a, cudaStream_t s, bool pdl);

}  // namespace dz::cuda
