#include "cpu/hyper_connection.h"

#include <cmath>
#include <vector>

namespace dz::cpu {

namespace {
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
}  // namespace

void hc_weights(const HcDims& d, const float* mix, const float* base, const float* scale, float* pre, float* post,
                float* comb) {
  const int n = d.n;
  const double eps = d.hc_eps;
  for (int j = 0; j < n; ++j) {
    pre[j] = float(sigmoid(double(mix[j]) * scale[0] + base[j]) + eps);
    post[j] = float(2 * sigmoid(double(mix[n + j]) * scale[1] + base[n + j]));
  }
  std::vector<double> c(size_t(n) * size_t(n));
  for (int j = 0; j < n; ++j) {
    double* row = c.data() + size_t(j) * size_t(n);
    double mx = -INFINITY, sum = 0;
    for (int k = 0; k < n; ++k) {
      row[k] = double(mix[2 * n + j * n + k]) * scale[2] + base[2 * n + j * n + k];
      mx = std::max(mx, row[k]);
    }
    for (int k = 0; k < n; ++k) sum += (row[k] = std::exp(row[k] - mx));
    for (int k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
  }
  auto normalise_columns = [&] {
    for (int k = 0; k < n; ++k) {
      double s = 0;
      for (int j = 0; j < n; ++j) s += c[size_t(j * n + k)];
      for (int j = 0; j < n; ++j) c[size_t(j * n + k)] /= s + eps;
    }
  };
  normalise_columns();
  for (int it = 1; it < d.sinkhorn_iters; ++it) {
    for (int j = 0; j < n; ++j) {
      double s = 0;
      for (int k = 0; k < n; ++k) s += c[size_t(j * n + k)];
      for (int k = 0; k < n; ++k) c[size_t(j * n + k)] /= s + eps;
    }
    normalise_columns();
  }
  for (size_t i = 0; i < c.size(); ++i) comb[i] = float(c[i]);
}

void hc_collapse(const HcDims& d, const float* x, const float* w, float* out) {
  for (int64_t h = 0; h < d.hidden; ++h) {
    double s = 0;
    for (int j = 0; j < d.n; ++j) s += double(w[j]) * x[j * d.hidden + h];
    out[h] = float(s);
  }
}

void hc_expand(const HcDims& d, float* x, const float* y, const float* post, const float* comb) {
  const int n = d.n;
  std::vector<double> col(static_cast<size_t>(n));
  for (int64_t h = 0; h < d.hidden; ++h) {
    for (int j = 0; j < n; ++j) col[size_t(j)] = x[j * d.hidden + h];
    for (int k = 0; k < n; ++k) {
      double s = double(post[k]) * y[h];
      for (int j = 0; j < n; ++j) s += double(comb[j * n + k]) * col[size_t(j)];
      x[k * d.hidden + h] = float(s);
    }
  }
}

void hc_head_weights(const HcDims& d, const float* mix, const float* base, float scale, float* w) {
  for (int j = 0; j < d.n; ++j) w[j] = float(sigmoid(double(mix[j]) * scale + base[j]) + d.hc_eps);
}

}  // namespace dz::cpu
