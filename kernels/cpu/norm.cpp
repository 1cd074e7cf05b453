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

}  // namespace dz::cpu
