// DeepSeek-V4 (model_type deepseek_v4): mHC residual streams; sliding, CSA and
// HCA attention over one shared K=V head with sinks; sqrt-softplus and hash
// MoE. What both backends share: the checkpoint parsed and validated once
// (DeepseekV4Desc), its cache layout rules and the factories.
#pragma once

#include <memory>
#include <vector>

#include "cpu/compress.h"
#include "cpu/hyper_connection.h"
#include "cpu/rope.h"
#include "model/family.h"
#include "model/lm_ends.h"
#include "model/moe_ffn.h"

namespace dz {

// DZ_DEVICE_CUDA: the CUDA family (deepseek_v4_cuda.cpp); AUTO: it where a GPU
// is present and it takes the checkpoint, else the CPU family.
std::unique_ptr<Family> make_deepseek_v4(const Config& cfg, const WeightStore& ws, const dz_model_params& params);
// The CUDA family; throws DZ_ERR_UNSUPPORTED in builds without CUDA or for
// what it does not serve yet, DZ_ERR_DEVICE without a usable GPU.
std::unique_ptr<Family> make_deepseek_v4_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

namespace v4 {

enum class Attn { Sliding, Csa, Hca };

constexpr int64_t kMaxIndexHeads = 1024, kMaxRopeDim = 512;

// One compressed series: the attention's entries, or the CSA indexer's keys.
struct Compressor {
  cpu::WeightRef kv, gate;  // [S * dim, hidden]; S = 2 for CSA's overlapping windows ([Ca | Cb])
  std::vector<float> bias;  // position_bias [rate, S * dim]
  std::vector<float> norm;  // [dim]
  int64_t dim = 0;
  bool overlap = false;
  size_t state_off = 0;  // floats: the open entry's pool, then (overlap) the next entry's
  int64_t series() const { return overlap ? 2 : 1; }
  size_t state_floats() const { return size_t(series() * cpu::pool_floats(dim)); }
};

struct Hc {
  cpu::WeightRef fn;  // [(2 + n) * n or n, n * hidden]
  std::vector<float> base, scale;
};

struct Layer {
  Attn kind = Attn::Sliding;
  int64_t rate = 0;  // compression rate (CSA / HCA)
  std::vector<float> in_norm, post_norm, q_a_norm, kv_norm, sinks;
  cpu::WeightRef q_a, q_b, kv, o_a, o_b;
  Hc attn_hc, ffn_hc;
  Compressor comp, icomp;         // icomp: the indexer's (CSA)
  cpu::WeightRef iq_b, iweights;  // indexer queries [heads * dim, q_lora], head weights [heads, hidden]
  size_t ring_off = 0;            // floats into the state: the window [sliding_window x head_dim]
  size_t entry_floats = 0;        // per compressed entry in the pages: attention entry (+ indexer key)
  size_t token_bytes = 0;         // page bytes per token (the CPU's layout)
  Ffn ffn;
};

}  // namespace v4

// The checkpoint as both backends see it: the CPU family computes from these
// views in place, the CUDA family uploads them. A sequence's state slot holds
// per layer its window ring (sliding_window x head_dim floats at ring_off)
// and the open compressor pools (at each Compressor's state_off).
struct DeepseekV4Desc {
  DeepseekV4Desc(const Config& cfg, const WeightStore& ws);
  void fill_desc_info(dz_model_info& info) const;
  const cpu::RopeFreqs& rope_of(const v4::Layer& L) const {
    return L.kind == v4::Attn::Sliding ? rope_main_ : rope_comp_;
  }

  int32_t n_vocab_ = 0, n_layers_ = 0;
  int64_t hidden_ = 0, max_context_ = 0, n_heads_ = 0, head_dim_ = 0, q_lora_ = 0, window_ = 0;
  int64_t o_groups_ = 0, o_rank_ = 0, idx_heads_ = 0, idx_dim_ = 0, idx_topk_ = 0, rope_dim_ = 0;
  int64_t moe_inter_ = 0;
  float eps_ = 1e-6f;
  cpu::HcDims hc_;
  cpu::RopeFreqs rope_main_, rope_comp_;
  MoeRouting routing_;
  LmEnds ends_;
  v4::Hc head_hc_;
  std::vector<v4::Layer> layers_;
  size_t state_floats_ = 0;
  uint64_t weights_bytes_ = 0;
  uint64_t model_key_ = 0;  // the CPU layout's
};

}  // namespace dz
