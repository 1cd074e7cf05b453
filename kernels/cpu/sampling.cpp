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
  auto before = [](const Cand& a, const Cand& b) { return a.l > b.l || (a.l == b.l && a.id < b.id); };
  // Reused per thread: a fresh 3 MB vector a call costs its page faults (~9 ms measured).
  thread_local std::vector<Cand> c;
  c.clear();
  const size_t k = size_t(std::max(cfg.top_k, 0));
  if (k > 0 && k <= size_t(n) / 64) {
    // The top_k by a heap of k (its front the last of them in order): most
    // logits are rejected by one comparison with the front.
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(logits[i])) continue;
      const Cand x{logits[i], int32_t(i), 0.0};
      if (c.size() < k) {
        c.push_back(x);
        std::push_heap(c.begin(), c.end(), before);
      } else if (before(x, c.front())) {
        std::pop_heap(c.begin(), c.end(), before);
        c.back() = x;
        std::push_heap(c.begin(), c.end(), before);
      }
    }
  } else {
    c.reserve(size_t(n));
    for (int64_t i = 0; i < n; ++i)
      if (!std::isnan(logits[i])) c.push_back({logits[i], int32_t(i), 0.0});
    if (k > 0 && k < c.size()) {
      std::nth_element(c.begin(), c.begin() + std::ptrdiff_t(k - 1), c.end(), before);
      c.resize(k);
    }
  }
  if (c.empty()) return -1;
  float mx = c[0].l;
  for (const Cand& x : c) mx = std::max(mx, x.l);
  const double t = double(cfg.temperature);
  double total = 0;
  // The largest weighs 1 also where it is infinite (all -inf: uniform).
  for (Cand& x : c) total += (x.w = x.l == mx ? 1.0 : std::exp((double(x.l) - double(mx)) / t));
  // Both walks below (the top_p prefix, then the draw) go through the
  // candidates in order, largest logit first, lower index on ties: a
  // quickselect by accumulated weight finds where each stops without sorting
  // the vocabulary (a full sort of 201k logits took ~60 ms a token). It
  // returns m: c[m - 1] is where the walk over c[lo, hi) stops (the first
  // candidate at which `reached(sum)` holds, else the last one) and c[lo, m - 1)
  // are the candidates before it, in any order.
  auto walk = [&](size_t lo, size_t hi, auto reached) {
    double acc = 0;
    for (;;) {
      if (hi - lo <= 32) {
        std::sort(c.begin() + std::ptrdiff_t(lo), c.begin() + std::ptrdiff_t(hi), before);
        for (size_t i = lo; i < hi; ++i)
          if (reached(acc += c[i].w)) return i + 1;
        return hi;
      }
      Cand a = c[lo], b = c[lo + (hi - lo) / 2], d = c[hi - 1];  // median of three
      if (before(b, a)) std::swap(a, b);
      if (before(d, b)) b = before(d, a) ? a : d;
      const Cand pv = b;
      const auto mid = std::partition(c.begin() + std::ptrdiff_t(lo), c.begin() + std::ptrdiff_t(hi),
                                      [&](const Cand& x) { return before(x, pv); });
      std::iter_swap(mid,
                     std::find_if(mid, c.begin() + std::ptrdiff_t(hi), [&](const Cand& x) { return x.id == pv.id; }));
      const size_t m = size_t(mid - c.begin());
      double left = 0;
      for (size_t i = lo; i < m; ++i) left += c[i].w;
      if (reached(acc + left)) {
        hi = m;
      } else {
        acc += left;
        if (reached(acc += pv.w)) return m + 1;
        lo = m + 1;
      }
    }
  };
  size_t keep = c.size();
  if (cfg.top_p < 1) {
    const double target = double(cfg.top_p) * total;
    keep = walk(0, c.size(), [&](double sum) { return sum >= target; });
    total = 0;
    for (size_t i = 0; i < keep; ++i) total += c[i].w;
  }
  const double u = uniform01(rng) * total;
  return c[walk(0, keep, [&](double sum) { return u < sum; }) - 1].id;
}

}  // namespace dz::cpu
