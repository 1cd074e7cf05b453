// Grouped FP8 E4M3 GEMM with 1x128 block scales on both operands, our own
// Hopper kernel (sm_90a: wgmma fed by bulk tensor copies through an mbarrier
// ring; one producer warpgroup, two consumer warpgroups of 64 rows each, tile
// 128 x 192 (128 x 128 with MXFP4 weights, or on request), one 128-wide K block
// per stage).
// One persistent launch covers every group; its blocks take tiles in order
// from a counter, so blocks that start late take fewer.
//
// For each group g (rows [off_g, off_g + m_g) of X and D, m_g >= 0):
//   D[off_g + r][c] (bf16) = sum_kb  xs_g[kb][r] * ws_g[kb][c] * sum_{k in kb} X[off_g + r][k] * W_g[c][k]
// with, as Fp8Gemm (fp8_gemm.h) takes them per group:
//   X   fp8 [rows_total][k] (row-major, K contiguous),
//   xs  float: group g's block of nkb * m_g floats at xs + nkb * off_g, laid out [kb][m_g],
//   W_g fp8 [n][k] at w + g * w_stride (bytes), ws_g float [k/128][n] at ws + g * ws_stride (floats)
//       (or [k/128][n/64], one scale a 64-row group: ws_row_group 64; then ws_g[kb][c/64] above),
//   D   bf16 [rows_total][n].
// With MXFP4 weights (Fp8GroupedArgs::w4) W_g and ws_g are the folded expert,
// made by the kernel's producer warps on the fly.
// Each 128-wide K block is accumulated by the tensor cores in fp32 on its own
// and then added, scaled, into the fp32 result (so the block scales never meet
// a tensor-core accumulation). Rows of D outside the groups are not written.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/mxfp4_fold.h"

namespace dz::cuda {

struct Fp8GroupedArgs {
  const uint8_t* x = nullptr;    // [rows_total][k]
  const float* xs = nullptr;     // group blocks as above
  int64_t rows_total = 0;        // rows of X and D (no group reaches past it)
  const uint8_t* w = nullptr;    // group 0's [n][k]
  int64_t w_stride = 0;          // bytes between groups' W (multiple of 16)
  const float* ws = nullptr;     // group 0's [k/128][n], or [k/128][n/64] with ws_row_group 64
  int64_t ws_stride = 0;         // floats between groups' W scales (1x128: a multiple of 4)
  int ws_row_group = 1;          // W rows sharing a scale: 1 (1x128) or 64 (mxfp4_fold_experts with a group table)
  void* d = nullptr;             // bf16 [rows_total][n]
  int n = 0, k = 0;              // n % 16 == 0, k % 128 == 0
  const int* offsets = nullptr;  // host: offsets[g], first row of group g
  const int* counts = nullptr;   // host: counts[g] = m_g
  int groups = 0;
  int max_blocks = 0;  // persistent blocks (0: one per SM); fewer leave SMs to concurrent kernels
  // FP8 weights: tile columns, 192 or 128. 128 runs a narrower block (128
  // registers a thread, 164 KB of shared memory) beside which one block of the
  // folding kernel (mxfp4_fold_experts) fits on every SM: the next experts
  // fold while these multiply. MXFP4 weights: always 128.
  int tile_n = 192;
  // MXFP4 weights instead of W/ws (sm_90a): group g uses expert experts[g] of
  // the stack w4 (rows == n, K == w4.k padded to k), folded to E4M3 with 1x128
  // scales inside the kernel exactly as mxfp4_fold_experts would (the same
  // bytes reach the tensor cores), without an FP8 copy in memory; by 64-row
  // groups where w4.gmax is given.
  Mxfp4Stack w4{};
  const int* experts = nullptr;  // host: [groups]
  int w4_experts = 0;            // experts in the stack (bounds check)
};

// A tensor map (TMA descriptor) through the driver's encoder, reached via the
// runtime's entry-point query (no link against libcuda); out-of-bounds
// elements read as zero. Throws DZ_ERR_INVALID_ARGUMENT naming `what`.
void encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base, const cuuint64_t* dims,
                       const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swz, const char* what);

// DZ_FP8_GROUPED_DEBUG=1 in the environment: the grouped GEMMs' checking mode
// (Fp8GroupedGemm, Mxfp4Gemm).
bool grouped_gemm_debug();
// In that mode, after each launch: synchronize s (unless it is capturing), so faults surface at the call.
void grouped_gemm_sync(cudaStream_t s);
// Streaming multiprocessors of the current device.
int current_device_sms();

// Calls on one instance must be ordered (one stream, or synchronized): with
// FP8 weights its blocks take tiles from the instance's device counter, which
// each launch's last block resets.
class Fp8GroupedGemm {
 public:
  Fp8GroupedGemm();
  ~Fp8GroupedGemm();
  Fp8GroupedGemm(const Fp8GroupedGemm&) = delete;
  Fp8GroupedGemm& operator=(const Fp8GroupedGemm&) = delete;
  // Enqueue on s. Arguments are validated on the host (DZ_ERR_INVALID_ARGUMENT);
  // DZ_ERR_UNSUPPORTED where the device is not sm_90 or the build lacks sm_90a.
  // DZ_FP8_GROUPED_DEBUG=1 in the environment: a checking kernel (bounded
  // barrier waits that report and trap instead of hanging) and a sync after
  // each launch so faults surface at the call.
  void run(const Fp8GroupedArgs& a, cudaStream_t s);
  static bool supported();  // this build and device can run the kernel
  // Whether a block of the folding kernel (mxfp4_fold_experts) fits on an SM
  // of the current device beside one of the narrow form's (tile_n 128):
  // registers (allocated by warps), shared memory and threads, from the
  // compiled kernels' attributes. False where the kernel is not supported.
  static bool narrow_leaves_room_for_fold();

 private:
  int n_sm_ = 0;
  bool debug_ = false;
  int* sched_ = nullptr;  // [next tile, blocks done]
};

}  // namespace dz::cuda
