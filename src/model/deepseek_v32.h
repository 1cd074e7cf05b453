// DeepSeek-V3.2 (model_type deepseek_v32): MLA with the DSA lightning
// indexer, top-k sparse attention and group-limited MoE. What other code
// needs beyond the Family interface: the factory and a trace of the indexer's
// selections (for tests that compare them with the reference).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "cpu/indexer.h"
#include "cpu/mla.h"
#include "cpu/rope.h"
#include "model/family.h"
#include "model/lm_ends.h"
#include "model/moe_ffn.h"

namespace dz {

// DZ_DEVICE_CUDA: the CUDA family (deepseek_v32_cuda.cpp); AUTO: it where a
// GPU is present and it takes the checkpoint, else the CPU family.
std::unique_ptr<Family> make_deepseek_v32(const Config& cfg, const WeightStore& ws, const dz_model_params& params);
// The CUDA family; throws DZ_ERR_UNSUPPORTED in builds without CUDA or for
// what it does not serve yet, DZ_ERR_DEVICE without a usable GPU.
std::unique_ptr<Family> make_deepseek_v32_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

struct DeepseekV32Layer {
  std::vector<float> in_norm, post_norm;
  // MLA
  cpu::WeightRef q_a, q_b, kv_a, kv_b, o;
  std::vector<float> q_a_bias, kv_a_bias, o_bias;  // attention_bias only
  std::vector<float> q_a_norm, kv_a_norm;
  // Indexer
  cpu::WeightRef idx_wq, idx_wk, idx_wproj;
  std::vector<float> idx_knorm_w, idx_knorm_b;
  Ffn ffn;  // dense, or routed experts + shared experts
};

// The checkpoint as both backends see it: config.json parsed and every tensor
// validated once; the CPU family computes from these views in place, the
// CUDA family uploads them. idx_.mode is the CPU's (AUTO: exact).
struct DeepseekV32Desc {
  DeepseekV32Desc(const Config& cfg, const WeightStore& ws, const dz_model_params& params);
  void fill_desc_info(dz_model_info& info) const;

  int32_t n_vocab_ = 0, n_layers_ = 0;
  int64_t hidden_ = 0, q_lora_ = 0, max_context_ = 0;
  MoeRouting routing_;
  float eps_ = 1e-6f;
  cpu::MlaDims mla_;
  cpu::IndexerConfig idx_;
  cpu::RopeFreqs rope_;
  LmEnds ends_;
  std::vector<DeepseekV32Layer> layers_;
  uint64_t weights_bytes_ = 0;
};

struct DsaTrace {
  // Called once per layer and batch item with the positions each new token
  // attends to: sel [n_q x k], row i for position pos0 + i, ascending, -1-padded.
  std::function<void(int layer, size_t item, int64_t pos0, const int32_t* sel, int64_t n_q, int k)> on_select;
  // Called just before on_select with the indexer's fp32 inputs for the same
  // tokens: q [n_q x H x D] and k [n_q x D] after RoPE, w [n_q x H] the raw
  // weights_proj outputs (before any rotation or quantisation), so precision
  // studies can score them again in other number formats.
  std::function<void(int layer, size_t item, int64_t pos0, const float* q, const float* w, const float* k, int64_t n_q)>
      on_indexer;
  // Called once per MoE layer with each flattened row's routing margin
  // (cpu::router_sigmoid_grouped's): how near the row's experts are to a
  // different choice. CPU family only.
  std::function<void(int layer, const float* margins, int64_t rows)> on_route;
};

// Attach a trace (nullptr detaches) to a deepseek_v32 family; the caller keeps
// it alive while attached. Throws DZ_ERR_INVALID_ARGUMENT for other families.
void deepseek_v32_set_trace(Family& family, const DsaTrace* trace);

}  // namespace dz
