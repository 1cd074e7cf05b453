// RMSNorm and residual adds on the device (fp32 residual stream).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

// out[i] = w * x[row_i] * rsqrt(mean(x[row_i]^2) + eps) for i < n_rows, where
// row_i = rows ? rows[i] : i. Writes out_f32 and/or out_bf16 (either may be
// null; bf16 rounded to nearest even). x, out: [*, H] row-major.
void rms_norm(const float* x, const int32_t* rows, int n_rows, int H, const float* w, float eps, float* out_f32,
              uint16_t* out_bf16, cudaStream_t s);

// y[i] += x[i] for i < n.
void add_inplace(float* y, const float* x, size_t n, cudaStream_t s);

// out[i] = bf16(x[i]) (round to nearest even).
void to_bf16(const float* x, uint16_t* out, size_t n, cudaStream_t s);

}  // namespace dz::cuda
