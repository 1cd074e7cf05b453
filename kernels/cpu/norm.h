// Normalisations.
#pragma once

#include <cstdint>

namespace dz::cpu {

// y = w * x / sqrt(mean(x^2) + eps) over each of n_rows rows of dim (fp32
// math, sum of squares in fp64). w may be null (no weight); y may alias x.
void rms_norm(const float* x, int64_t n_rows, int64_t dim, const float* w, float eps, float* y);

// y = (x - mean) / sqrt(var + eps) * w + b over each row (biased variance, as
// torch.nn.LayerNorm; statistics in fp64). w and b may be null; y may alias x.
void layer_norm(const float* x, int64_t n_rows, int64_t dim, const float* w, const float* b, float eps, float* y);

}  // namespace dz::cpu
