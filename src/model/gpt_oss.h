// gpt-oss: the checkpoint as both backends see it. GptOssDesc parses
// config.json and validates every tensor (names, shapes, dtypes, MXFP4 NaN
// scales) once; the CPU family (gpt_oss.cpp) computes from these views in
// place, the CUDA family (gpt_oss_cuda.cpp) uploads them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cpu/matmul.h"
#include "cpu/moe.h"
#include "cpu/rope.h"
#include "model/family.h"

namespace dz {

// MXFP4 expert weights [E, rows, cols]: blocks [E, rows, cols/32, 16] U8 and
// scales [E, rows, cols/32] U8 (validated: no 0xFF scale).
struct GptOssMxfp4 {
  const uint8_t* blocks = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, cols = 0;
  cpu::WeightRef expert(int e) const;
  size_t block_bytes(int64_t n_experts) const { return size_t(n_experts) * size_t(rows) * size_t(cols / 2); }
  size_t scale_bytes(int64_t n_experts) const { return size_t(n_experts) * size_t(rows) * size_t(cols / 32); }
};

struct GptOssLayer {
  bool sliding = false;
  std::vector<float> in_norm, post_norm;
  cpu::WeightRef q, k, v, o;
  std::vector<float> bq, bk, bv, bo;  // empty without attention_bias
  std::vector<float> sinks;
  cpu::WeightRef router;
  std::vector<float> router_bias;
  GptOssMxfp4 gate_up, down;
  std::vector<float> gate_up_bias, down_bias;  // [E, 2I], [E, H]
};

struct GptOssDesc {
  GptOssDesc(const Config& cfg, const WeightStore& ws);
  int64_t kv_dim() const { return int64_t(n_kv_heads_) * head_dim_; }
  int64_t q_dim() const { return int64_t(n_heads_) * head_dim_; }
  void fill_desc_info(dz_model_info& info) const;

  int32_t n_vocab_ = 0, n_layers_ = 0, n_heads_ = 0, n_kv_heads_ = 0, head_dim_ = 0, n_experts_ = 0, n_active_ = 0;
  int64_t hidden_ = 0, inter_ = 0, window_ = 0, max_context_ = 0;
  float eps_ = 1e-5f, scale_ = 1;
  cpu::RopeFreqs rope_;
  cpu::Glu glu_;
  cpu::WeightRef embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<GptOssLayer> layers_;
  uint64_t config_hash_ = 0;  // config.json + checkpoint size, for KV prefix keys
};

// Test hook (CPU family): each forward appends, per layer and row, the
// router's top-k margin (k-th largest minus (k+1)-th largest logit) to
// *margins, layer-major; nullptr stops. Not thread-safe.
void gpt_oss_set_router_trace(Family& family, std::vector<float>* margins);

// The CUDA family (gpt_oss_cuda.cpp); throws DZ_ERR_UNSUPPORTED in builds
// without CUDA and DZ_ERR_DEVICE when no usable GPU is present.
std::unique_ptr<Family> make_gpt_oss_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

}  // namespace dz
