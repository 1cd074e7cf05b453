// Y = X W^T (+ b) with weights kept in checkpoint precision (F32, BF16, F16 or
// MXFP4); each weight row is decoded to fp32 on the fly, products are summed
// in fp64. Rows of W are output features; K (input) is contiguous.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/parallel.h"

namespace dz::cpu {

// FP8_BLOCK: E4M3 bytes with F32 scale_inv per 128x128 block (cpu/fp8.h);
// FP8_BLOCK_E8M0: the same with power-of-two E8M0 scale bytes (DeepSeek-V4).
enum class WeightKind : uint8_t { F32, BF16, F16, MXFP4, FP8_BLOCK, FP8_BLOCK_E8M0 };

// A [rows x cols] weight matrix in place (usually an mmap'd checkpoint tensor).
struct WeightRef {
  WeightKind kind = WeightKind::F32;
  const uint8_t* data = nullptr;    // MXFP4: blocks, cols/2 bytes per row
  const uint8_t* scales = nullptr;  // MXFP4: cols/32 bytes per row; FP8_BLOCK: F32 [ceil(rows0/128), ceil(cols/128)]
                                    // (FP8_BLOCK_E8M0: one byte each)
  int64_t rows = 0, cols = 0;
  int64_t row0 = 0;  // FP8_BLOCK: first row within the scaled matrix (block rows are absolute)

  // Decode row n (cols floats) into out.
  void decode_row(int64_t n, float* out) const;
  // The sub-matrix of rows [r0, r0 + n).
  WeightRef row_slice(int64_t r0, int64_t n) const;
};

float bf16_to_f32(uint16_t v);
float f16_to_f32(uint16_t v);
// Round n fp32 values in place to the nearest BF16 (ties to even) / to FP16
// after scaling each run of `row` values by the power of two that brings its
// largest magnitude into [0.5, 1] (as the CUDA experts stage their inputs).
void round_to_bf16(float* x, size_t n);
void round_to_f16_scaled(float* x, size_t n_rows, size_t row);
// Decode n elements of a BF16/F16/F32 vector to fp32.
void to_f32(WeightKind kind, const uint8_t* src, int64_t n, float* out);

// fp64-accumulated dot product of two fp32 vectors.
double dot_f64(const float* a, const float* b, int64_t n);
// dot_f64 of m vectors (a + r * lda, r < m) with four (b[0..3]), on values
// already converted to double (exactly): out[4 r + j] equals dot_f64 of the
// fp32 originals of a_r and b[j] bit for bit (exact products, the same eight
// partial sums and combine order, so fused multiply-adds round as its separate
// adds did). AVX2 + FMA where the CPU has them, else dot_rows4_f64_portable.
// The float forms convert b in their loads (for vectors used once).
void dot_rows4_f64(const double* a, int m, int64_t lda, const double* const b[4], int64_t n, double* out);
void dot_rows4_f64(const double* a, int m, int64_t lda, const float* const b[4], int64_t n, double* out);
void dot_rows4_f64_portable(const double* a, int m, int64_t lda, const double* const b[4], int64_t n, double* out);
void dot_rows4_f64_portable(const double* a, int m, int64_t lda, const float* const b[4], int64_t n, double* out);
// The four vectors of one dot_rows4_f64 call: rows first .. first + 3 of
// base (stride elements apart), the last real one repeated past `end`.
// Returns how many are real, min(4, end - first).
template <class T>
int four_rows(const T* base, int64_t first, int64_t end, int64_t stride, const T* (&rows)[4]) {
  const int n = int(end - first < 4 ? end - first : 4);
  for (int j = 0; j < 4; ++j) rows[j] = base + (first + (j < n ? j : n - 1)) * stride;
  return n;
}
// x86-64 with AVX2 and FMA (the vector forms above run there).
bool cpu_has_avx2_fma();

// y[m, n] = sum_k x[m, k] w[n, k] + bias[n] for m < n_rows; x has w.cols
// columns, y has w.rows columns; bias may be null. Work is split over output
// features on pool (null: the calling thread).
void matmul(const float* x, int64_t n_rows, const WeightRef& w, const float* bias, float* y, ThreadPool* pool);

}  // namespace dz::cpu
