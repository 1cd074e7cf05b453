// The feed-forward block of the DeepSeek-V3 lineage (deepseek_v32,
// kimi_linear, deepseek_v4): a dense SwiGLU MLP, or routed SwiGLU experts plus
// always-on shared experts. Routing is sigmoid group-limited ("noaux_tc":
// choice = sigmoid + e_score_correction_bias, weights = the chosen sigmoids,
// normalised, times routed_scaling_factor), or DeepSeek-V4's sqrt(softplus)
// scores, chosen by score + bias or, in hash layers, by a token-id table.
// V4 also clamps every SwiGLU (swiglu_limit). Families differ only in tensor
// names and config field names, so each loads its own weights into these
// structs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/matmul.h"
#include "loader/config.h"
#include "loader/safetensors.h"
#include "runtime/parallel.h"

namespace dz {

struct SwiGlu {
  cpu::WeightRef gate, up, down;
  int64_t inter = 0;  // 0: absent
};

struct MoeRouting {
  enum class Score { Sigmoid, SqrtSoftplus };
  Score score = Score::Sigmoid;
  int n_experts = 0, n_active = 0, n_group = 1, topk_group = 1;
  bool norm = true;
  float scale = 1;
  float swiglu_limit = 0;  // > 0: gate <= limit and |up| <= limit in every SwiGLU (experts and dense)
};

struct Ffn {
  bool moe = false;
  SwiGlu dense;                    // !moe
  SwiGlu shared;                   // moe: shared experts (inter 0 = none)
  cpu::WeightRef router;           // [n_experts, hidden]
  std::vector<float> router_bias;  // e_score_correction_bias
  std::vector<int32_t> hash;       // hash routing: [vocab x n_active] experts per token id (empty: scored)
  std::vector<SwiGlu> experts;
};

// [inter x hidden] gate and up, [hidden x inter] down, by full tensor base names.
SwiGlu load_swiglu(const WeightStore& ws, const std::string& gate, const std::string& up, const std::string& down,
                   int64_t inter, int64_t hidden);

// Which layers are MoE: config mlp_layer_types ("dense" / "sparse" per layer),
// else all but the first first_k_dense_replace (default_dense when absent).
std::vector<bool> moe_layers(const Config& cfg, int n_layers, int64_t default_dense);

// Checks a routing config read from `src` (messages name it); n_experts and
// n_active must already be positive.
void validate_routing(const MoeRouting& r, const std::string& src);

// y[rows x hidden] = FFN(x) for one layer. tokens (the rows' token ids) is
// read by hash-routed layers only. route_margin (optional, sigmoid-routed
// MoE layers): each row's distance from a different choice of experts
// (cpu::router_sigmoid_grouped's margin), for tests that compare backends.
void ffn_forward(const Ffn& f, const MoeRouting& r, int64_t hidden, const float* x, int64_t rows, float* y,
                 ThreadPool* pool, const int32_t* tokens = nullptr, float* route_margin = nullptr);

}  // namespace dz
