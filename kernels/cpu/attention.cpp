#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/matmul.h"

namespace dz::cpu {

void attend(const float* q, const float* const* k_rows, const float* const* v_rows, int64_t n, int64_t offset,
            int head_dim, float scale, const float* sink, float* out, std::vector<double>& scratch) {
  if (scratch.size() < size_t(n) + size_t(head_dim)) scratch.resize(size_t(n) + size_t(head_dim));
  double* s = scratch.data();
  double* acc = s + n;
  double mx = sink ? double(*sink) : -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    // The reference scales the fp32 dot product by head_dim^-0.5 in fp32.
    s[j] = double(float(dot_f64(q, k_rows[j] + offset, head_dim)) * scale);
    mx = std::max(mx, s[j]);
  }
  double denom = sink ? std::exp(double(*sink) - mx) : 0.0;
  std::fill(acc, acc + head_dim, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    const double p = std::exp(s[j] - mx);
    denom += p;
    const float* v = v_rows[j] + offset;
    for (int d = 0; d < head_dim; ++d) acc[d] += p * double(v[d]);
  }
  const double inv = denom > 0 ? 1.0 / denom : 0.0;
  for (int d = 0; d < head_dim; ++d) out[d] = float(acc[d] * inv);
}

}  // namespace dz::cpu
