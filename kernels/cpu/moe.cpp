#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace dz::cpu {

void router_topk_softmax(const float* logits, int n_experts, int k, int32_t* idx, float* weights) {
  std::vector<int32_t> order(static_cast<size_t>(n_experts));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  const float mx = logits[order[0]];
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += std::exp(double(logits[order[size_t(j)]]) - double(mx));
  for (int j = 0; j < k; ++j) {
    idx[j] = order[size_t(j)];
    weights[j] = float(std::exp(double(logits[idx[j]]) - double(mx)) / sum);
  }
}

void router_sigmoid_grouped(const float* logits, const float* bias, int n_experts, int n_group, int topk_group, int k,
                            bool norm, float scaling, int32_t* idx, float* weights, float* margin) {
  const int per = n_experts / n_group;
  std::vector<float> s(static_cast<size_t>(n_experts)), choice(static_cast<size_t>(n_experts));
  for (int e = 0; e < n_experts; ++e) {
    s[size_t(e)] = float(1.0 / (1.0 + std::exp(-double(logits[e]))));
    choice[size_t(e)] = s[size_t(e)] + (bias ? bias[e] : 0.0f);
  }
  auto better = [&](int32_t a, int32_t b) {
    return choice[size_t(a)] > choice[size_t(b)] || (choice[size_t(a)] == choice[size_t(b)] && a < b);
  };
  // Group score: the sum of the group's two best choice values (one when a group has one expert).
  std::vector<float> gscore(static_cast<size_t>(n_group));
  for (int g = 0; g < n_group; ++g) {
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int e = g * per; e < (g + 1) * per; ++e) {
      const float c = choice[size_t(e)];
      if (c > b1)
        b2 = b1, b1 = c;
      else if (c > b2)
        b2 = c;
    }
    gscore[size_t(g)] = per > 1 ? b1 + b2 : b1;
  }
  std::vector<int32_t> groups(static_cast<size_t>(n_group));
  std::iota(groups.begin(), groups.end(), 0);
  const int gsorted = margin && topk_group < n_group ? topk_group + 1 : topk_group;
  std::partial_sort(groups.begin(), groups.begin() + gsorted, groups.end(), [&](int32_t a, int32_t b) {
    return gscore[size_t(a)] > gscore[size_t(b)] || (gscore[size_t(a)] == gscore[size_t(b)] && a < b);
  });
  std::vector<int32_t> cand;
  for (int j = 0; j < topk_group; ++j)
    for (int e = groups[size_t(j)] * per; e < (groups[size_t(j)] + 1) * per; ++e) cand.push_back(e);
  const int esorted = margin && size_t(k) < cand.size() ? k + 1 : k;
  std::partial_sort(cand.begin(), cand.begin() + esorted, cand.end(), better);
  if (margin) {
    float m = INFINITY;
    if (gsorted > topk_group)
      m = gscore[size_t(groups[size_t(topk_group - 1)])] - gscore[size_t(groups[size_t(topk_group)])];
    if (esorted > k) m = std::min(m, choice[size_t(cand[size_t(k - 1)])] - choice[size_t(cand[size_t(k)])]);
    *margin = m;
  }
  float sum = 0;
  for (int j = 0; j < k; ++j) {
    idx[j] = cand[size_t(j)];
    weights[j] = s[size_t(idx[j])];
    sum += weights[j];
  }
  for (int j = 0; j < k; ++j) {
    if (norm) weights[j] /= sum + 1e-20f;
    weights[j] *= scaling;
  }
}

void router_sqrt_softplus(const float* logits, const float* bias, int n_experts, int k, const int32_t* fixed,
                          float scaling, int32_t* idx, float* weights) {
  std::vector<float> s(static_cast<size_t>(n_experts)), choice(static_cast<size_t>(n_experts));
  for (int e = 0; e < n_experts; ++e) {
    // torch's softplus: x itself above 20.
    const double x = logits[e];
    s[size_t(e)] = float(std::sqrt(x > 20 ? x : std::log1p(std::exp(x))));
    choice[size_t(e)] = s[size_t(e)] + (bias ? bias[e] : 0.0f);
  }
  if (fixed) {
    std::copy_n(fixed, k, idx);
  } else {
    std::vector<int32_t> cand(static_cast<size_t>(n_experts));
    std::iota(cand.begin(), cand.end(), 0);
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [&](int32_t a, int32_t b) {
      return choice[size_t(a)] > choice[size_t(b)] || (choice[size_t(a)] == choice[size_t(b)] && a < b);
    });
    std::copy_n(cand.begin(), k, idx);
  }
  float sum = 0;
  for (int j = 0; j < k; ++j) sum += (weights[j] = s[size_t(idx[j])]);
  for (int j = 0; j < k; ++j) weights[j] = weights[j] / (sum + 1e-20f) * scaling;
}

namespace {
float silu(float a) { return float(double(a) / (1.0 + std::exp(-double(a)))); }
}  // namespace

void glu(const Glu& g, const float* h, int64_t inter, float* out) {
  switch (g.kind) {
    case Glu::Kind::SwiGLU:
      for (int64_t i = 0; i < inter; ++i) {
        out[i] = silu(h[i]) * h[inter + i];
      }
      break;
    case Glu::Kind::ClampedOss:
      for (int64_t i = 0; i < inter; ++i) {
        const float gate = std::min(h[2 * i], g.limit);
        const float up = std::clamp(h[2 * i + 1], -g.limit, g.limit);
        const float sig = float(1.0 / (1.0 + std::exp(-double(gate * g.alpha))));
        out[i] = (up + 1.0f) * (gate * sig);
      }
      break;
    case Glu::Kind::ClampedSwiGLU:
      for (int64_t i = 0; i < inter; ++i) {
        out[i] = silu(std::min(h[i], g.limit)) * std::clamp(h[inter + i], -g.limit, g.limit);
      }
      break;
  }
  if (g.round_f16)
    for (int64_t i = 0; i < inter; ++i) out[i] = float(static_cast<_Float16>(out[i]));
}

void moe_forward(const float* x, int64_t n_rows, int64_t hidden, int64_t inter, const int32_t* idx,
                 const float* weights, int k, int n_experts, const std::function<ExpertWeights(int)>& expert,
                 const Glu& g, float* y, ThreadPool* pool) {
  std::fill(y, y + n_rows * hidden, 0.0f);
  // Rows (and their routing weight) per expert, in row order.
  std::vector<std::vector<std::pair<int64_t, float>>> rows(static_cast<size_t>(n_experts));
  for (int64_t r = 0; r < n_rows; ++r)
    for (int j = 0; j < k; ++j) rows[size_t(idx[r * k + j])].push_back({r, weights[r * k + j]});
  std::vector<float> xs, h, gu, a, o;
  for (int e = 0; e < n_experts; ++e) {
    const auto& re = rows[size_t(e)];
    if (re.empty()) continue;
    const int64_t m = int64_t(re.size());
    const ExpertWeights w = expert(e);
    xs.resize(size_t(m * hidden));
    for (int64_t i = 0; i < m; ++i) std::copy_n(x + re[size_t(i)].first * hidden, hidden, xs.data() + i * hidden);
    h.resize(size_t(m * 2 * inter));
    if (w.gate.rows) {
      // Gate and up stored apart: compute both and lay them out as [gate | up].
      gu.resize(size_t(m * 2 * inter));
      matmul(xs.data(), m, w.gate, nullptr, gu.data(), pool);
      matmul(xs.data(), m, w.up, w.up_bias, gu.data() + m * inter, pool);
      for (int64_t i = 0; i < m; ++i) {
        std::copy_n(gu.data() + i * inter, inter, h.data() + i * 2 * inter);
        std::copy_n(gu.data() + (m + i) * inter, inter, h.data() + i * 2 * inter + inter);
      }
    } else {
      matmul(xs.data(), m, w.up, w.up_bias, h.data(), pool);
    }
    a.resize(size_t(m * inter));
    for (int64_t i = 0; i < m; ++i) glu(g, h.data() + i * 2 * inter, inter, a.data() + i * inter);
    o.resize(size_t(m * hidden));
    matmul(a.data(), m, w.down, w.down_bias, o.data(), pool);
    for (int64_t i = 0; i < m; ++i) {
      float* yr = y + re[size_t(i)].first * hidden;
      const float wt = re[size_t(i)].second;
      for (int64_t d = 0; d < hidden; ++d) yr[d] += o[size_t(i * hidden + d)] * wt;
    }
  }
}

}  // namespace dz::cpu
