#include "model/moe_ffn.h"

#include <algorithm>

#include "common/error.h"
#include "common/host_alloc.h"
#include "cpu/moe.h"
#include "model/weights.h"

namespace dz {

namespace {
cpu::ExpertWeights expert_of(const SwiGlu& m) { return cpu::ExpertWeights{m.up, nullptr, m.down, nullptr, m.gate}; }

cpu::Glu glu_of(const MoeRouting& r) {
  cpu::Glu g;
  if (r.swiglu_limit > 0) g.kind = cpu::Glu::Kind::ClampedSwiGLU, g.limit = r.swiglu_limit;
  return g;
}

// SwiGLU through the MoE kernel as a single expert of weight 1 (exact: 0 + y * 1).
void swiglu_forward(const SwiGlu& m, const cpu::Glu& g, int64_t hidden, const float* x, int64_t rows, float* y,
                    ThreadPool* pool) {
  std::vector<int32_t> idx(size_t(rows), 0);
  std::vector<float> one(size_t(rows), 1.0f);
  cpu::moe_forward(
      x, rows, hidden, m.inter, idx.data(), one.data(), 1, 1, [&](int) { return expert_of(m); }, g, y, pool);
}
}  // namespace

SwiGlu load_swiglu(const WeightStore& ws, const std::string& gate, const std::string& up, const std::string& down,
                   int64_t inter, int64_t hidden) {
  return SwiGlu{linear_weight(ws, gate, inter, hidden), linear_weight(ws, up, inter, hidden),
                linear_weight(ws, down, hidden, inter), inter};
}

std::vector<bool> moe_layers(const Config& cfg, int n_layers, int64_t default_dense) {
  std::vector<bool> moe(static_cast<size_t>(n_layers));
  if (cfg.has("mlp_layer_types")) {
    const auto kinds = cfg.get<std::vector<std::string>>("mlp_layer_types");
    check(kinds.size() == size_t(n_layers), DZ_ERR_FORMAT, cfg.source(), ": mlp_layer_types has ", kinds.size(),
          " entries for ", n_layers, " layers");
    for (size_t i = 0; i < kinds.size(); ++i) {
      check(kinds[i] == "dense" || kinds[i] == "sparse", DZ_ERR_FORMAT, cfg.source(), ": mlp_layer_types[", i, "] = '",
            kinds[i], "' (expected dense or sparse)");
      moe[i] = kinds[i] == "sparse";
    }
  } else {
    const int64_t dense = std::clamp<int64_t>(cfg.get_or<int64_t>("first_k_dense_replace", default_dense), 0, n_layers);
    for (int i = 0; i < n_layers; ++i) moe[size_t(i)] = i >= dense;
  }
  return moe;
}

void validate_routing(const MoeRouting& r, const std::string& src) {
  const int E = r.n_experts;
  check(r.n_group > 0 && E % r.n_group == 0, DZ_ERR_FORMAT, src,
        ": the expert groups (n_group / num_expert_group = ", r.n_group, ") must divide the routed experts (", E, ")");
  check(r.topk_group > 0 && r.topk_group <= r.n_group, DZ_ERR_FORMAT, src, ": topk_group ", r.topk_group,
        " must be in [1, groups = ", r.n_group, "]");
  check(r.n_active <= r.topk_group * (E / r.n_group), DZ_ERR_FORMAT, src, ": ", r.n_active,
        " experts per token exceed the experts of topk_group groups (", r.topk_group * (E / r.n_group), ")");
}

void ffn_forward(const Ffn& f, const MoeRouting& r, int64_t hidden, const float* x, int64_t rows, float* y,
                 ThreadPool* pool, const int32_t* tokens, float* route_margin) {
  const cpu::Glu g = glu_of(r);
  if (!f.moe) return swiglu_forward(f.dense, g, hidden, x, rows, y, pool);
  const size_t R = size_t(rows), E = size_t(r.n_experts), k = size_t(r.n_active);
  HostBuffer<float> logits(R * E), weights(R * k);
  HostBuffer<int32_t> idx(R * k);
  cpu::matmul(x, rows, f.router, nullptr, logits.data(), pool);
  check(f.hash.empty() || tokens, DZ_ERR_INTERNAL, "ffn_forward: a hash-routed layer needs the token ids");
  for (size_t i = 0; i < R; ++i) {
    if (r.score == MoeRouting::Score::SqrtSoftplus)
      cpu::router_sqrt_softplus(logits.data() + i * E, or_null(f.router_bias), r.n_experts, r.n_active,
                                f.hash.empty() ? nullptr : f.hash.data() + size_t(tokens[i]) * k, r.scale,
                                idx.data() + i * k, weights.data() + i * k);
    else
      cpu::router_sigmoid_grouped(logits.data() + i * E, f.router_bias.data(), r.n_experts, r.n_group, r.topk_group,
                                  r.n_active, r.norm, r.scale, idx.data() + i * k, weights.data() + i * k,
                                  route_margin ? route_margin + i : nullptr);
  }
  cpu::moe_forward(
      x, rows, hidden, f.experts[0].inter, idx.data(), weights.data(), r.n_active, r.n_experts,
      [&](int e) { return expert_of(f.experts[size_t(e)]); }, g, y, pool);
  if (f.shared.inter) {
    HostBuffer<float> s(R * size_t(hidden));
    swiglu_forward(f.shared, g, hidden, x, rows, s.data(), pool);
    for (size_t i = 0; i < R * size_t(hidden); ++i) y[i] += s[i];
  }
}

}  // namespace dz
