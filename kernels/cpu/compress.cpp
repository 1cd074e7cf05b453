#include "cpu/compress.h"

#include <algorithm>
#include <cmath>

namespace dz::cpu {

void pool_push(float* pool, int64_t dim, const float* v, const float* gate, const float* bias) {
  float *mx = pool, *sum = pool + dim, *acc = pool + 2 * dim;
  for (int64_t c = 0; c < dim; ++c) {
    const float g = gate[c] + (bias ? bias[c] : 0.0f);
    if (sum[c] == 0) {  // empty channel (every push adds at least exp(0) = 1)
      mx[c] = g, sum[c] = 1, acc[c] = v[c];
    } else if (g > mx[c]) {
      const float r = float(std::exp(double(mx[c]) - g));
      sum[c] = sum[c] * r + 1, acc[c] = acc[c] * r + v[c], mx[c] = g;
    } else {
      const float e = float(std::exp(double(g) - mx[c]));
      sum[c] += e, acc[c] += e * v[c];
    }
  }
}

void pool_result(const float* pool, int64_t dim, float* out) {
  const float *sum = pool + dim, *acc = pool + 2 * dim;
  for (int64_t c = 0; c < dim; ++c) out[c] = sum[c] == 0 ? 0.0f : acc[c] / sum[c];
}

void pool_clear(float* pool, int64_t dim) { std::fill(pool, pool + pool_floats(dim), 0.0f); }

}  // namespace dz::cpu
