// DeepSeek-V3.2 (model_type deepseek_v32): MLA with the DSA lightning
// indexer, top-k sparse attention and group-limited MoE. What other code
// needs beyond the Family interface: the factory and a trace of the indexer's
// selections (for tests that compare them with the reference).
#pragma once

#include <functional>
#include <memory>

#include "model/family.h"

namespace dz {

std::unique_ptr<Family> make_deepseek_v32(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

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
};

// Attach a trace (nullptr detaches) to a deepseek_v32 family; the caller keeps
// it alive while attached. Throws DZ_ERR_INVALID_ARGUMENT for other families.
void deepseek_v32_set_trace(Family& family, const DsaTrace* trace);

}  // namespace dz
