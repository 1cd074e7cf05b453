// Grouped GEMM of E4M3 activations with MXFP4 expert weights decoded in the
// tensor cores' registers (sm_90a): the weights are the MMA's A operand
// (wgmma m64nNk32 with A from registers), each consumer thread decoding its
// fragment of a 64-row weight tile straight from the MXFP4 bytes the copy
// engine brought (no FP8 copy of W in shared or global memory); the tokens
// are the MMA's N (64, 128 or 160 a tile; 256 with whole-K scales, below),
// brought by the copy engine.
//
// For each group g (rows [off_g, off_g + m_g) of X and D), expert e = experts[g]:
//   D[off_g + r][c] (bf16) = sum_kb xs[kb][off_g + r] * ws_e(c / 64, kb) *
//                            sum_{k in kb} X[off_g + r][k] * W_e[c][k]
// where W_e / ws_e is the expert folded to E4M3 by 64-row groups (the group
// table Mxfp4Stack::gmax: the bytes mxfp4_fold_experts writes), every 128-wide
// K block accumulated in fp32 on its own and then added, scaled.
//
// X is E4M3 [rows_total][k] with the 4-byte words of each 32-element
// sub-block in register order (mxfp4_gemm_x_word): word j of the sub-block
// holds its elements 4 * mxfp4_gemm_x_group(j) .. + 3, so that a thread's
// decoded weight word meets its activations in the MMA's k order. The X
// scales are [k/128][xs_ld] floats by row of X (xs_ld >= rows_total, a
// multiple of 4). D is bf16 [rows_total][n]; rows outside the groups are not
// written.
//
// Whole-K scales (gk given): X's scales are one per row, xs [rows_total], and
// W folds under one scale byte per 64-row group over all of K (gk [E][n / 64],
// mxfp4_whole_k_table), so
//   D[off_g + r][c] = xs[off_g + r] * 2^(gk[e][c / 64] - 133) * sum_k X[off_g + r][k] * W_e[c][k]
// with the whole sum accumulated in the tensor cores (FP8 MMAs keep about 14
// significant bits of a running sum, as against fp32 per K block; the test
// states the error): no promotion a K block, so tiles of 256 tokens fit, each
// tile's MMAs as wide as its tokens need (64 to 256), and an expert's last
// tokens, up to 64, may ride on the tile before them (ride_along).
//
// gpt-oss's activation in the epilogue (whole-K only, q given): W's rows come
// as interleaved gate / up pairs (2j, 2j + 1), and instead of D the kernel
// writes each pair's clamped SwiGLU (bias added: bias [E][n] bf16, or none)
// times kGluInv as E4M3 into q [rows_total][q_ld] at column j, in X's
// register order: the next projection's X, whose every row then has the
// scale 1 / kGluInv (x_scale). The SwiGLU is at most (7 + 1) * 7 = 56 in
// magnitude, so 56 * kGluInv = 448 (E4M3's largest) never saturates, and
// E4M3 is as fine relative to each value as under a row's amax / 448; only
// values under 2^-9 meet its subnormals sooner (an absolute error under
// 2^-13). No pass between the projections reads or writes D.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/mxfp4_fold.h"

namespace dz::cuda {

// Where element group i (elements 4i..4i+3) of a 32-element sub-block is
// stored in X (word index inside the sub-block): the even groups first, then
// the odd ones (a thread's weight word t holds elements 8t..8t+7, which the
// MMA takes as k 4t..4t+3 and 16 + 4t..16 + 4t + 3).
__host__ __device__ constexpr int mxfp4_gemm_x_word(int i) { return (i >> 1) | ((i & 1) << 2); }
// The inverse: the element group stored in word j.
__host__ __device__ constexpr int mxfp4_gemm_x_group(int j) { return j < 4 ? 2 * j : 2 * (j - 4) + 1; }
// The byte of a row of X that holds its element c.
__host__ __device__ constexpr int mxfp4_gemm_x_byte(int c) {
  return (c & ~31) + 4 * mxfp4_gemm_x_word((c & 31) >> 2) + (c & 3);
}

constexpr float kGluInv = 8.f;  // 448 / 56: SwiGLU's outputs scaled into E4M3's range (a power of two)

struct Mxfp4GemmArgs {
  const uint8_t* x = nullptr;   // E4M3 [rows_total][k], register order (above)
  const float* xs = nullptr;    // [k/128][xs_ld]; with gk: [rows_total] (or null with x_scale)
  float x_scale = 0;            // whole-K: > 0, every row's scale (xs not read)
  int64_t xs_ld = 0;            // unused with gk
  const uint8_t* gk = nullptr;  // whole-K scales: W's table [w_experts][n / 64] (then w.gmax is not read)
  int64_t rows_total = 0;
  Mxfp4Stack w{};                  // rows == n, K (w.k) a multiple of 64 padding to k; gmax required (not with gk)
  const int* experts = nullptr;    // host: [groups]
  int w_experts = 0;               // experts in the stack (bounds check)
  void* d = nullptr;               // bf16 [rows_total][n] (not with q)
  uint8_t* q = nullptr;            // whole-K: SwiGLU's E4M3 [rows_total][q_ld] instead of D (above)
  int64_t q_ld = 0;                // >= n / 2
  const uint16_t* bias = nullptr;  // with q: bf16 [w_experts][n] added before the SwiGLU (null: none)
  int n = 0, k = 0;                // n % 64 == 0, k % 128 == 0
  const int* offsets = nullptr;    // host: offsets[g], first row of group g (a multiple of 4)
  const int* counts = nullptr;     // host: counts[g] = m_g
  int groups = 0;
  int max_blocks = 0;   // persistent blocks (0: one per SM)
  int tile_tokens = 0;  // tokens a tile: 64, 128 or 160 (whole-K: 256); 0: the least padded work
  // Whole-K: an expert's last tile of at most 64 tokens carried by the tile
  // before it (one decode; a stage less in the ring). 1: on, -1: off, 0: where
  // it saves more than a tenth of the tiles.
  int ride_along = 0;
  // Timings only (wrong results; not in the kernel with ride-along tokens):
  // bit 0 skips the epilogue's stores, bit 1 the weights' folding (the MXFP4
  // words go to the MMAs as they are), bit 3 the scale bytes' loads. Each is a
  // uniform branch on a kernel parameter where it acts. (Bit 2 skipped the
  // MMAs: its branch cost every K block an injected warpgroup.arrive.)
  int probe = 0;
  // With q: the outputs staged in shared memory and stored 16 bytes a thread
  // (1), or stored a byte at a time from the registers (0); -1: the built
  // default, 1 (3.4% off the layer at 4096 and 16384 tokens on an H100;
  // DZ_MXFP4_GEMM_STAGE_Q=0 overrides it, for A/B runs).
  int stage_q = -1;
};

// Calls on one instance must be ordered (one stream, or synchronized).
class Mxfp4Gemm {
 public:
  Mxfp4Gemm();
  Mxfp4Gemm(const Mxfp4Gemm&) = delete;
  Mxfp4Gemm& operator=(const Mxfp4Gemm&) = delete;
  // Enqueue on s. Arguments are validated on the host (DZ_ERR_INVALID_ARGUMENT);
  // DZ_ERR_UNSUPPORTED where the device is not sm_90 or the build lacks sm_90a.
  // DZ_FP8_GROUPED_DEBUG=1: a sync after each launch, so faults surface at the call.
  void run(const Mxfp4GemmArgs& a, cudaStream_t s);
  static bool supported();  // this build and device can run the kernel
  // The tokens a tile run() would take for these group sizes (tile_tokens 0).
  static int pick_tile_tokens(const int* counts, int groups, bool whole_k = false);
  int last_tile_tokens() const { return last_bn_; }
  bool last_ride_along() const { return last_ride_; }

 private:
  int n_sm_ = 0;
  bool debug_ = false;
  int last_bn_ = 0;
  bool stage_q_default_ = true;
  bool last_ride_ = false;
};

}  // namespace dz::cuda
