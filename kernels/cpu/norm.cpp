#include "cpu/norm.h"

#include <cmath>

namespace dz::cpu {

void rms_norm(const float* x, int64_t n_rows, int64_t dim, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += double(xr[i]) * double(xr[i]);
    // transformers: x * rsqrt(mean + eps) in fp32, then weight * that.
    const float inv = float(1.0 / std::sqrt(ss / double(dim) + double(eps)));
    for (int64_t i = 0; i < dim; ++i) {
      const float v = xr[i] * inv;
      yr[i] = w ? w[i] * v : v;
    }
  }
}

void layer_norm(const float* x, int64_t n_rows, int64_t dim, const float* w, const float* b, float eps, float* y) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double mean = 0;
    for (int64_t i = 0; i < dim; ++i) mean += xr[i];
    mean /= double(dim);
    double var = 0;
    for (int64_t i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const double inv = 1.0 / std::sqrt(var / double(dim) + double(eps));
    for (int64_t i = 0; i < dim; ++i) {
      const float v = float((xr[i] - mean) * inv);
      yr[i] = (w ? w[i] * v : v) + (b ? b[i] : 0.0f);
    }
  }
}

}  // namespace dz::cpu
