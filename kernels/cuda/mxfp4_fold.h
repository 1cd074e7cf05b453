// MXFP4 -> FP8 E4M3 folding on the device (rule: kernels/cpu/mxfp4_fold.h),
// bit-exact with the CPU reference. Experts of one layer share a shape; the
// routed ones are converted into slots of one FP8 workspace.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cpu/mxfp4_fold.h"

namespace dz::cuda {

// A stack of same-shaped MXFP4 matrices on the device: expert e's blocks at
// blocks + e * rows * k/2, scales at scales + e * rows * k/32.
struct Mxfp4Stack {
  const uint8_t* blocks = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, k = 0;
};

// Destination slots: slot s's fp8 [rows][kpad] at fp8 + s * rows * kpad, its
// scales [kpad/128][rows] at scales + s * rows * kpad/128.
struct Fp8Slots {
  uint8_t* fp8 = nullptr;
  float* scales = nullptr;
};

// Fold experts ids[0..n) into slots 0..n (ids on the host). A 0xFF scale
// yields a NaN block scale (the load-time check rejects such checkpoints).
void mxfp4_fold_experts(const Mxfp4Stack& w, const int* ids, int n, const Fp8Slots& out, cudaStream_t s);

// Spread check of n_experts experts on the device; returns the stats and the
// number of 0xFF scale bytes (synchronizes the stream).
cpu::FoldStats mxfp4_fold_check_device(const Mxfp4Stack& w, int n_experts, uint64_t* nan_scales, cudaStream_t s);

}  // namespace dz::cuda
