// A float64 reference sampler for the tests: the whole vocabulary sorted
// (largest logit first, lower index on ties), softmax at the temperature over
// the top_k, the smallest prefix whose probability reaches top_p, one draw u.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/sampling.h"

namespace dz::test {

struct RefDraw {
  int32_t token = -1;
  // The top_p mass or the draw lies within `tol` (a fraction of the mass it
  // is taken of) of a boundary between two candidates: a sampler summing in
  // another precision may pick the neighbour.
  bool near = false;
};

inline RefDraw sample_reference(const float* l, int64_t n, const dz::cpu::SamplerConfig& cfg, double u,
                                double tol = 0) {
  RefDraw r;
  std::vector<int32_t> c;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(l[i])) c.push_back(int32_t(i));
  if (c.empty()) return r;
  std::sort(c.begin(), c.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  if (cfg.top_k > 0 && size_t(cfg.top_k) < c.size()) c.resize(size_t(cfg.top_k));
  std::vector<double> p(c.size());
  double total = 0;
  for (size_t i = 0; i < c.size(); ++i)
    total += (p[i] = l[c[i]] == l[c[0]] ? 1.0 : std::exp((double(l[c[i]]) - double(l[c[0]])) / cfg.temperature));
  size_t keep = c.size();
  if (cfg.top_p < 1) {
    double cum = 0, prev = 0;
    size_t m = 0;
    while (m < keep) {
      prev = cum;
      cum += p[m++] / total;
      if (cum >= double(cfg.top_p)) break;
    }
    keep = m;
    r.near = std::abs(cum - double(cfg.top_p)) <= tol || std::abs(prev - double(cfg.top_p)) <= tol;
    total = 0;
    for (size_t i = 0; i < keep; ++i) total += p[i];
  }
  const double target = u * total;
  double cum = 0, prev = 0;
  size_t i = 0;
  for (; i < keep; ++i) {
    prev = cum;
    if (target < (cum += p[i])) break;
  }
  if (i == keep) i = keep - 1;
  r.token = c[i];
  r.near = r.near || std::abs(cum - target) <= tol * total || std::abs(prev - target) <= tol * total;
  return r;
}

}  // namespace dz::test
