// Kimi Linear (model_type kimi_linear): Kimi Delta Attention layers beside
// NoPE MLA layers, DeepSeek-V3-style MoE. What both backends share: the
// checkpoint parsed and validated once (KimiLinearDesc) and the factories.
#pragma once

#include <memory>
#include <vector>

#include "cpu/kda.h"
#include "cpu/mla.h"
#include "model/family.h"
#include "model/lm_ends.h"
#include "model/moe_ffn.h"

namespace dz {

// DZ_DEVICE_CUDA: the CUDA family (kimi_linear_cuda.cpp); AUTO: it where a
// GPU is present and it takes the checkpoint, else the CPU family.
std::unique_ptr<Family> make_kimi_linear(const Config& cfg, const WeightStore& ws, const dz_model_params& params);
// The CUDA family; throws DZ_ERR_UNSUPPORTED in builds without CUDA or for
// what it does not serve yet, DZ_ERR_DEVICE without a usable GPU.
std::unique_ptr<Family> make_kimi_linear_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

struct KimiLinearLayer {
  bool kda = false;
  std::vector<float> in_norm, post_norm;
  // KDA
  cpu::WeightRef q, k, v, f_a, f_b, b, g_a, g_b, o;
  std::vector<float> conv_w;  // [3P x K]: q, k, v channels
  std::vector<float> a_log, dt_bias, o_norm;
  size_t state_off = 0;  // floats into a sequence's state slot
  // MLA (q and o also serve)
  cpu::WeightRef kv_a, kv_b;
  std::vector<float> kv_a_norm;
  Ffn ffn;
};

// The checkpoint as both backends see it: the CPU family computes from these
// views in place, the CUDA family uploads them.
struct KimiLinearDesc {
  KimiLinearDesc(const Config& cfg, const WeightStore& ws);
  void fill_desc_info(dz_model_info& info) const;

  int32_t n_vocab_ = 0, n_layers_ = 0;
  int64_t hidden_ = 0, max_context_ = 0;
  float eps_ = 1e-5f;
  cpu::KdaDims kda_;
  cpu::MlaDims mla_;
  MoeRouting routing_;
  size_t state_floats_ = 0;  // one sequence's state slot: every KDA layer's conv history and S
  LmEnds ends_;
  std::vector<KimiLinearLayer> layers_;
  uint64_t weights_bytes_ = 0;
};

}  // namespace dz
