// One token through gpt-oss's MXFP4 experts as a stream of the routed
// experts' bytes (MoeOptions::fused_one_token_stream; docs/cuda-moe.md).
//
// One persistent launch (or one a projection: OneTokenConfig::launches), one
// block an SM. A unit is 16 rows of one routed slot's projection over its
// whole K: contiguous bytes in the checkpoint layout. Each block streams its
// units (OneTokenPlan): gate_up's dealt round the blocks so that the GPU reads
// the experts front to back, then its share of down's 16-row tiles, every
// slot of a tile, so that the block sums a tile's slots itself. A producer
// warp keeps units in flight through the copy engine (a bulk copy a row, rows
// padded 16 bytes apart in shared memory so a warp's loads from 8 rows meet no
// bank conflict), a ring a group of consumer warps; the groups take units in
// turn, each warp a share of the K range: E2M1 -> fp16 in registers (exact)
// and `mma.sync m16n8k16`, two MMAs a 32-element sub-block so its E8M0 scale
// multiplies the fp32 partial sums (the weights exact). The token is fp16
// under one power-of-two scale, as in the W4A16 kernels; down's activations
// (gate_up's epilogue writes them as fp16: gpt-oss's SwiGLU is at most 56)
// reach each block once their slot's gate_up units are done. The last of a
// tile's slots to finish sums the slots in slot order (the same bits
// whichever group is last), with no further launch.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/moe.h"

#if defined(__CUDACC__)
#define DZ_OT_HD __host__ __device__
#else
#define DZ_OT_HD
#endif

namespace dz::cuda {

// Which units block b of G streams, in order: first its gate_up units, then
// its down units: its tiles j = b, b + G, .. (all topk slots of each), slot
// by slot, so the last slot's activations, the last gate_up finishes, are
// needed last. gate_up's units (slot-major, so the GPU reads the experts front
// to back) are dealt in rounds: where down's tiles do not divide evenly,
// first topk rounds over the blocks with one tile fewer, then R rounds over
// all blocks, then the rest from block 0: every block streams within one unit
// as many as the others (while gate_up has units enough), and the last slot's
// units come in the rounds every block takes.
struct OneTokenPlan {
  int G = 1, topk = 1, U1 = 0, T2 = 0;  // blocks, slots, gate_up's units, down's 16-row tiles
  int r = 0, nL = 1;                    // blocks [0, r) hold one more down tile; nL = G - r
  int E1 = 0, R = 0;                    // units of the lighter blocks' rounds, full rounds after them

  OneTokenPlan() = default;
  DZ_OT_HD OneTokenPlan(int blocks, int slots, int gate_up_tiles, int down_tiles)
      : G(blocks), topk(slots), U1(slots * gate_up_tiles), T2(down_tiles) {
    r = T2 % G, nL = G - r;
    const int extra = r > 0 ? topk * nL : 0;
    R = U1 > extra ? (U1 - extra) / G : 0;
    E1 = extra < U1 - R * G ? extra : U1 - R * G;
  }
  // Block b's units in the lighter blocks' rounds.
  DZ_OT_HD int light_units(int b) const {
    const int x = E1 - (b - r);
    return b < r || x <= 0 ? 0 : (x + nL - 1) / nL;
  }
  DZ_OT_HD int gate_up_units(int b) const { return light_units(b) + R + (b < U1 - E1 - R * G ? 1 : 0); }
  DZ_OT_HD int down_tiles(int b) const { return T2 / G + (b < r ? 1 : 0); }
  DZ_OT_HD int max_down_tiles() const { return T2 / G + (r > 0 ? 1 : 0); }
  // gate_up's unit (slot * gate_up_tiles + tile) at block b's position i < gate_up_units(b).
  DZ_OT_HD int gate_up_unit(int b, int i) const {
    const int lu = light_units(b);
    if (i < lu) return i * nL + (b - r);
    return E1 + (i - lu) * G + b;  // (past R rounds: the rest, block b's one unit)
  }
  // Block b's k-th down unit: its tile (of the block's, 0 ..), the tile's row index, its slot.
  DZ_OT_HD int down_local(int b, int k) const { return k % down_tiles(b); }
  DZ_OT_HD int down_tile(int b, int k) const { return b + down_local(b, k) * G; }
  DZ_OT_HD int down_slot(int b, int k) const { return k / down_tiles(b); }
  // Block b's unit at position i (its gate_up units, then its down units): which projection (0 gate_up, 1
  // down), slot and 16-row tile. The kernel streams by it and the bench labels its traces by it.
  struct Unit {
    int proj, slot, tile;
  };
  DZ_OT_HD Unit unit(int b, int i) const { return unit(b, i, gate_up_units(b)); }
  DZ_OT_HD Unit unit(int b, int i, int ng) const {  // ng: gate_up_units(b)
    if (i < ng) {
      const int t1 = U1 / topk, u = gate_up_unit(b, i), slot = u / t1;
      return {0, slot, u - slot * t1};
    }
    return {1, down_slot(b, i - ng), down_tile(b, i - ng)};
  }
};

// The plan one_token_moe streams by for shape s on a grid of `blocks` (units of 16 rows).
inline OneTokenPlan one_token_plan(const MoeShape& s, int blocks) {
  return OneTokenPlan(blocks, s.topk, 2 * s.intermediate / 16, s.hidden / 16);
}

// Device scratch of one layer call (reused by every layer; counters zeroed once).
struct OneTokenScratch {
  uint8_t* img = nullptr;  // down's activation images, one_token_img_bytes
  int* counts = nullptr;   // one_token_counts ints, zero before the first call (each call leaves them zero)
};
size_t one_token_img_bytes(const MoeShape& s);
inline size_t one_token_counts(const MoeShape& s) { return size_t(s.topk) + 1; }

// Whether one_token_moe runs this shape and these weights here (sm_90,
// gpt-oss's activation, rows of 16, K a multiple of 32, 16-byte aligned
// weights, topk <= 8, the ring fitting shared memory). Sets the kernels'
// shared-memory limits on first use.
// All blocks must be resident at once (down's units wait for other blocks'
// gate_up units): blocks <= the device's SMs, launched cooperatively
// (OneTokenConfig::cooperative), so that two such launches on two streams
// never each hold part of the GPU while waiting for the rest.
bool one_token_moe_supported(const MoeShape& s, const MoeWeights& w, const OneTokenConfig& c = {});

// out[H] (+)= sum_k gw[k] * expert_{ids[k]}(x) for one token. Invalid ids set
// *err and their slots are left out of the sum. blocks: the grid (one an SM).
void one_token_moe(const MoeShape& s, const MoeWeights& w, const float* x, const int* ids, const float* gw, float* out,
                   bool accumulate, const OneTokenScratch& scr, int* err, int blocks, bool pdl, cudaStream_t st,
                   const OneTokenConfig& c = {});

}  // namespace dz::cuda
