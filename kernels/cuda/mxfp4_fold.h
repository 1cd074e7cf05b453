// MXFP4 -> FP8 E4M3 folding on the device (rule: kernels/cpu/mxfp4_fold.h),
// bit-exact with the CPU reference. Experts of one layer share a shape; the
// routed ones are converted into slots of one FP8 workspace.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cpu/mxfp4_fold.h"
#include "runtime/cuda/context.h"

namespace dz::cuda {

// Rows that share one FP8 block scale when a stack has a group table: the
// fold groups are then 64 rows x 128 (the 128x128 rule of the reference on
// half the rows), so a GEMM applies one weight scale per 64 columns.
constexpr int kFoldRowGroup = 64;

// A stack of same-shaped MXFP4 matrices on the device: expert e's blocks at
// blocks + e * rows * k/2, scales at scales + e * rows * k/32.
// gmax (optional): the stack's group table from mxfp4_group_table, [E][rows /
// 64][kpad / 128] scale bytes; with it every fold is by 64-row groups (block
// scales [kpad/128][rows/64] per expert), without it by rows (1x128: block
// scales [kpad/128][rows]). Only a table whose groups all fold exactly should
// be given (mxfp4_group_table counts the others).
struct Mxfp4Stack {
  const uint8_t* blocks = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, k = 0;
  const uint8_t* gmax = nullptr;
};

// Block scales of one folded expert: rows * kpad/128 floats, or rows/64 *
// kpad/128 with a group table.
int64_t fold_scale_count(const Mxfp4Stack& w);

// Destination slots: slot s's fp8 [rows][kpad] at fp8 + s * rows * kpad, its
// scales at scales + s * fold_scale_count(w).
struct Fp8Slots {
  uint8_t* fp8 = nullptr;
  float* scales = nullptr;
};

// Fold experts ids[0..n) into slots 0..n (ids on the host). A 0xFF scale
// yields a NaN block scale (the load-time check rejects such checkpoints).
void mxfp4_fold_experts(const Mxfp4Stack& w, const int* ids, int n, const Fp8Slots& out, cudaStream_t s);
// What one block of mxfp4_fold_experts' kernel takes on an SM, as this build
// compiled it (for kernels that leave room for it beside them).
struct FoldBlockResources {
  int threads = 0, regs_per_thread = 0;
  size_t static_smem = 0;
};
FoldBlockResources mxfp4_fold_block_resources();

// The group table of n_experts experts (w.gmax ignored; rows % 64 == 0): for
// each 64-row x 128 fold group the largest scale byte among its nonzero
// sub-blocks (133 where all are zero), into gmax [E][rows/64][kpad/128] on the
// device. Returns the spread check of those groups (lossy: a nonzero
// sub-block more than 14 binades under its group's scale; synchronizes).
cpu::FoldStats mxfp4_group_table(const Mxfp4Stack& w, int n_experts, uint8_t* gmax, cudaStream_t s);

// The group table of n_experts experts in a new pool array, kept only where
// the shape has 64-row groups the table kernel can cover and every group folds
// exactly; otherwise an empty array (fold by rows). stats (optional): the
// groups' check merged in where it ran. Synchronizes s.
DeviceArray<uint8_t> mxfp4_exact_group_table(DevicePool& pool, const Mxfp4Stack& w, int n_experts,
                                             cpu::FoldStats* stats, cudaStream_t s);

// The whole-K table of n_experts experts (w.gmax ignored; rows % 64 == 0): for
// each 64-row group over all of K the largest scale byte among its nonzero
// sub-blocks (133 where all are zero), into gk [E][rows/64] (Mxfp4GemmArgs::gk).
// Returns the spread check of those groups (lossy: a nonzero sub-block more
// than 14 binades under its group's scale; synchronizes).
cpu::FoldStats mxfp4_whole_k_table(const Mxfp4Stack& w, int n_experts, uint8_t* gk, cudaStream_t s);
// The same in a new pool array, kept only where every group folds exactly
// (otherwise empty); stats (optional): the check merged in. Synchronizes s.
DeviceArray<uint8_t> mxfp4_exact_whole_k_table(DevicePool& pool, const Mxfp4Stack& w, int n_experts,
                                               cpu::FoldStats* stats, cudaStream_t s);

// Spread check of n_experts experts on the device; returns the stats and the
// number of 0xFF scale bytes (synchronizes the stream).
cpu::FoldStats mxfp4_fold_check_device(const Mxfp4Stack& w, int n_experts, uint64_t* nan_scales, cudaStream_t s);

}  // namespace dz::cuda
