// The two ends of a decoder-only model on the CPU backend, as the DeepSeek
// lineage's families (deepseek_v32, kimi_linear) load and run them: token
// embeddings in; the final RMSNorm and lm_head out.
#pragma once

#include <span>
#include <vector>

#include "cpu/matmul.h"
#include "loader/safetensors.h"
#include "model/family.h"
#include "runtime/parallel.h"

namespace dz {

struct LmEnds {
  cpu::WeightRef embed, lm_head;
  std::vector<float> final_norm;

  // model.embed_tokens, model.norm and lm_head (the embedding itself when tied),
  // or the same under other names (linear bases; norm is the full name).
  void load(const WeightStore& ws, int64_t vocab, int64_t hidden, bool tied,
            const std::string& embed_base = "model.embed_tokens", const std::string& head_base = "lm_head",
            const std::string& norm_name = "model.norm.weight");
  // x[r] = the embedding of each flattened row's token ([rows x hidden]).
  void embed_rows(std::span<const ForwardItem> batch, const BatchRows& flat, int64_t hidden, float* x) const;
  // Each item's logits rows from the residual stream x ([rows x hidden]); xn is
  // scratch of the same size.
  void logits(std::span<ForwardItem> batch, const BatchRows& flat, const float* x, int64_t hidden, float eps, float* xn,
              ThreadPool* pool) const;
};

}  // namespace dz
