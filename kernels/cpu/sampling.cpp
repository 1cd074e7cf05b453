#include "cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
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
  struct Cand {
    float l;  // the logit (held here: the orderings below compare without indirection)
    int32_t id;
    double w;  // exp((logit - max) / temperature)
  };
  std::vector<Cand> c;
  c.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i)
    if (!std::isnan(logits[i])) c.push_back({logits[i], int32_t(i), 0.0});
  if (c.empty()) return -1;
  auto before = [](const Cand& a, const Cand& b) { return a.l > b.l || (a.l == b.l && a.id < b.id); };

  if (cfg.top_k > 0 && size_t(cfg.top_k) < c.size()) {
    std::nth_element(c.begin(), c.begin() + (cfg.top_k - 1), c.end(), before);
    c.resize(size_t(cfg.top_k));
  }
  float mx = c[0].l;
  for (const Cand& x : c) mx = std::max(mx, x.l);
  const double t = double(cfg.temperature);
  double total = 0;
  for (Cand& x : c) total += (x.w = std::exp((double(x.l) - double(mx)) / t));
  // The walks below go through the candidates in order (largest logit first,
  // lower index on ties) but rarely far: c[0, sorted) is put in order only as
  // far as they reach (a full sort of a 200k vocabulary took ~60 ms a token).
  size_t sorted = 0;
  auto sort_more = [&] {
    const size_t m = std::min(c.size(), std::max<size_t>(256, 4 * sorted));
    if (m < c.size())
      std::nth_element(c.begin() + std::ptrdiff_t(sorted), c.begin() + std::ptrdiff_t(m), c.end(), before);
    std::sort(c.begin() + std::ptrdiff_t(sorted), c.begin() + std::ptrdiff_t(m), before);
    sorted = m;
  };
  size_t keep = c.size();
  if (cfg.top_p < 1) {
    double cum = 0;
    size_t m = 0;
    for (bool reached = false; !reached;) {
      if (m == sorted) {
        if (sorted == c.size()) break;
        sort_more();
      }
      cum += c[m++].w / total;
      reached = cum >= double(cfg.top_p);
    }
    keep = m;
    total = 0;
    for (size_t i = 0; i < keep; ++i) total += c[i].w;
  }
  const double u = uniform01(rng) * total;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    if (i == sorted) sort_more();
    cum += c[i].w;
    if (u < cum) return c[i].id;
  }
  while (sorted < keep) sort_more();
  return c[keep - 1].id;
}

}  // namespace dz::cpu
