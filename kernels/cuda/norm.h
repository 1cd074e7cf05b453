// RMSNorm, LayerNorm, SwiGLU and residual adds on the device (fp32 residual
// stream).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

// out[i] = w * x[row_i] * rsqrt(mean(x[row_i]^2) + eps) for i < n_rows, where
// row_i = rows ? rows[i] : i. Writes out_f32 and/or out_bf16 (either may be
// null; bf16 rounded to nearest even). x, out: [*, H] row-major.
void rms_norm(const float* x, const int32_t* rows, int n_rows, int H, const float* w, float eps, float* out_f32,
              uint16_t* out_bf16, cudaStream_t s);

// LayerNorm of each of n_rows rows of x [n_rows, dim] fp32: y = (x - mean) /
// sqrt(var + eps) * w + b (biased variance, fp32 statistics, two passes).
// w, b [dim] may be null; y may alias x. dim <= 8192. Device pointers.
void layer_norm(const float* x, int n_rows, int dim, const float* w, const float* b, float eps, float* y,
                cudaStream_t s);

// SwiGLU of rows [gate (inter) | up (inter)] fp32 at gu + r * ld: out_bf16[r *
// inter + j] = bf16(silu(gate_j) * up_j) (round to nearest even), silu as
// cpu::glu's; limit > 0 clamps first (DeepSeek-V4): gate <= limit, |up| <= limit.
// Device pointers.
void silu_mul(const float* gu, int n_rows, int inter, int64_t ld, uint16_t* out_bf16, cudaStream_t s, float limit = 0);

// y[i] += x[i] for i < n.
void add_inplace(float* y, const float* x, size_t n, cudaStream_t s);

// out[i] = bf16(x[i]) (round to nearest even).
void to_bf16(const float* x, uint16_t* out, size_t n, cudaStream_t s);

}  // namespace dz::cuda
