#include "cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>
#include <vector>

namespace dz::cpu {

int32_t argmax(const float* logits, int64_t n) {
  int32_t best = -1;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(logits[i]) && (best < 0 || logits[i] > logits[best])) best = int32_t(i);
  return best;
}

double uniform01(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1p-53; }

int32_t sample_token(const float* logits, int64_t n, const SamplerConfig& cfg, std::mt19937_64& rng) {
  if (cfg.temperature <= 0) return argmax(logits, n);
  std::vector<int32_t> cand;
  cand.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(logits[i])) cand.push_back(int32_t(i));
  if (cand.empty()) return -1;
  auto before = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  size_t keep = cand.size();
  if (cfg.top_k > 0 && size_t(cfg.top_k) < keep) keep = size_t(cfg.top_k);
  std::partial_sort(cand.begin(), cand.begin() + std::ptrdiff_t(keep), cand.end(), before);
  cand.resize(keep);
  std::vector<double> p(keep);
  const double mx = double(logits[cand[0]]), t = double(cfg.temperature);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += (p[i] = std::exp((double(logits[cand[i]]) - mx) / t));
  if (cfg.top_p < 1) {
    double cum = 0;
    size_t m = 0;
    while (m < keep) {
      cum += p[m++] / total;
      if (cum >= double(cfg.top_p)) break;
    }
    keep = m;
    total = std::accumulate(p.begin(), p.begin() + std::ptrdiff_t(keep), 0.0);
  }
  const double u = uniform01(rng) * total;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += p[i];
    if (u < cum) return cand[i];
  }
  return cand[keep - 1];
}

}  // namespace dz::cpu
