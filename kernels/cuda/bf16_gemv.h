// BF16 projections with few rows (a decode step's 1-8 tokens):
//   D[m][n] (fp32) = X[m][k] (bf16) W[n][k]^T (bf16) + bias[n] (fp32, optional) + beta * D
// the same contract as Bf16Gemm (which calls this where it fits), streaming W
// at HBM speed with tensor-core MMAs. Launched as a programmatic dependent of
// the previous kernel in the stream (its first weight loads overlap it).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dz::cuda {

constexpr int kBf16GemvMaxRows = 8;
constexpr size_t kBf16GemvMaxSmem = size_t(96) << 10;  // X rows staged in shared memory

// Whether bf16_gemv takes this problem: 1..8 rows, K a multiple of 32, X and W
// 16-byte aligned, X small enough for shared memory.
bool bf16_gemv_fits(const uint16_t* x, const uint16_t* w, int m, int n, int k);

void bf16_gemv(const uint16_t* x, const uint16_t* w, const float* bias, float* d, int m, int n, int k, float beta,
               cudaStream_t s);

// D = bf16(rms_norm(x) * norm_w) W^T + bias, the norm inside the projection's
// launch (the bits of rms_norm's bf16 output): x fp32 [m][k] rows, norm_w fp32
// [k]. Fits: as bf16_gemv, and n > 512 (the wide blocks).
bool bf16_gemv_norm_fits(const float* x, const uint16_t* w, int m, int n, int k);
void bf16_gemv_norm(const float* x, const float* norm_w, float eps, const uint16_t* w, const float* bias, float* d,
                    int m, int n, int k, cudaStream_t s);

}  // namespace dz::cuda
