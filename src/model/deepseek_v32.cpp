// DeepSeek-V3.2 on the CPU backend, computed as transformers'
// DeepseekV32ForCausalLM does (the semantic reference for the CUDA kernels):
//  - MLA: q = q_b(RMSNorm(q_a(x))) per head [nope | rope]; the cache keeps per
//    token only c_kv = RMSNorm(kv_a(x)[:rank]) and the shared k_rope (RoPE
//    interleaved, YaRN; softmax scale qk_head_dim^-0.5 * mscale^2).
//  - DSA indexer (per layer): keys LayerNorm(wk(x)), queries wq_b(c_q), both
//    [rope | nope] with half-split RoPE; its key cache sits beside the latent
//    in the same pages. Each token attends only to its top-k positions.
//  - Decode (one new token) runs MLA absorbed; prefill runs it expanded.
//  - MoE: sigmoid router with e_score_correction_bias, group-limited top-k,
//    normalisation, routed_scaling_factor, shared experts; the first
//    first_k_dense_replace layers are dense.
// Weights stay in checkpoint precision (BF16, FP8 E4M3 with 128x128 block
// scales, MXFP4 experts) and are decoded row by row.
#include "model/deepseek_v32.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/host_alloc.h"
#include "cpu/indexer.h"
#include "cpu/matmul.h"
#include "cpu/mla.h"
#include "cpu/norm.h"
#include "cpu/rope.h"
#include "model/lm_ends.h"
#include "model/moe_ffn.h"
#include "model/rope_config.h"
#include "model/weights.h"
#include "runtime/parallel.h"

namespace dz {

DeepseekV32Desc::DeepseekV32Desc(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  const std::string& src = cfg.source();
  n_vocab_ = int32_t(cfg.get_positive_int("vocab_size"));
  hidden_ = cfg.get_positive_int("hidden_size");
  n_layers_ = int32_t(cfg.get_positive_int("num_hidden_layers"));
  check(cfg.has("q_lora_rank"), DZ_ERR_UNSUPPORTED, src,
        ": q_lora_rank is null; deepseek_v32 needs the low-rank query (the indexer reads it)");
  q_lora_ = cfg.get_positive_int("q_lora_rank");
  mla_.n_heads = int(cfg.get_positive_int("num_attention_heads"));
  mla_.rank = int(cfg.get_positive_int("kv_lora_rank"));
  mla_.nope = int(cfg.get_positive_int("qk_nope_head_dim"));
  mla_.rope = int(cfg.get_positive_int("qk_rope_head_dim"));
  mla_.v = int(cfg.get_positive_int("v_head_dim"));
  check(mla_.rope % 2 == 0, DZ_ERR_FORMAT, src, ": qk_rope_head_dim ", mla_.rope, " must be even");
  idx_.n_heads = int(cfg.get_positive_int("index_n_heads"));
  idx_.head_dim = int(cfg.get_positive_int("index_head_dim"));
  idx_.topk = int(cfg.get_positive_int("index_topk"));
  check(idx_.head_dim >= mla_.rope, DZ_ERR_FORMAT, src, ": index_head_dim ", idx_.head_dim,
        " is smaller than qk_rope_head_dim ", mla_.rope);
  check(params.indexer == DZ_INDEXER_EXACT || params.indexer == DZ_INDEXER_FP8 || params.indexer == DZ_INDEXER_AUTO,
        DZ_ERR_INVALID_ARGUMENT, "dz_model_params.indexer = ", int(params.indexer), " is not a dz_indexer_mode");
  idx_.mode = params.indexer == DZ_INDEXER_FP8 ? cpu::IndexerMode::Fp8 : cpu::IndexerMode::Exact;
  // Power-of-two indexer scales when the checkpoint quantises that way (DeepSeek's "ue8m0").
  if (cfg.has("quantization_config") && cfg.json()["quantization_config"].is_object()) {
    const auto& q = cfg.json()["quantization_config"];
    idx_.pow2_scales = q.contains("scale_fmt") && q["scale_fmt"] == "ue8m0";
    if (q.contains("quant_method") && q["quant_method"] == "fp8" && q.contains("weight_block_size"))
      check(q["weight_block_size"] == nlohmann::json::array({128, 128}), DZ_ERR_UNSUPPORTED, src,
            ": quantization_config.weight_block_size ", q["weight_block_size"].dump(),
            " (128x128 FP8 blocks are supported)");
  }
  cpu::indexer_validate(idx_);
  max_context_ = cfg.get_positive_int_or("max_position_embeddings", 163840);
  eps_ = float(cfg.get_or<double>("rms_norm_eps", 1e-6));
  check(eps_ > 0, DZ_ERR_FORMAT, src, ": rms_norm_eps must be positive");
  const std::string act = cfg.get_or<std::string>("hidden_act", "silu");
  check(act == "silu", DZ_ERR_UNSUPPORTED, src, ": hidden_act '", act, "' (deepseek_v32 uses silu)");
  const std::string scoring = cfg.get_or<std::string>("scoring_func", "sigmoid");
  check(scoring == "sigmoid", DZ_ERR_UNSUPPORTED, src, ": scoring_func '", scoring, "' (sigmoid is supported)");

  // RoPE over the rope slice; YaRN's mscale also sharpens the softmax.
  const cpu::RopeParams rp = rope_params_from_config(cfg, mla_.rope, 10000.0);
  rope_ = cpu::rope_freqs(rp);
  double scale = 1.0 / std::sqrt(double(mla_.nope + mla_.rope));
  if (rp.type == cpu::RopeParams::Type::Yarn && rp.mscale_all_dim != 0 && rp.factor > 1) {
    const double m = 0.1 * rp.mscale_all_dim * std::log(rp.factor) + 1.0;
    scale *= m * m;
  }
  mla_.scale = float(scale);

  // MoE shape and the dense/sparse pattern.
  const int64_t E = cfg.get_or<int64_t>("n_routed_experts", 0);
  routing_.n_experts = int32_t(E);
  const std::vector<bool> moe = moe_layers(cfg, n_layers_, 3);
  const bool any_moe = std::count(moe.begin(), moe.end(), true) > 0;
  int64_t moe_inter = 0;
  if (any_moe) {
    check(E > 0, DZ_ERR_FORMAT, src, ": n_routed_experts must be positive for MoE layers");
    routing_.n_active = int32_t(cfg.get_positive_int("num_experts_per_tok"));
    routing_.n_group = int32_t(cfg.get_or<int64_t>("n_group", 1));
    routing_.topk_group = int32_t(cfg.get_or<int64_t>("topk_group", 1));
    moe_inter = cfg.get_positive_int("moe_intermediate_size");
    validate_routing(routing_, src);
    routing_.norm = cfg.get_or<bool>("norm_topk_prob", true);
    routing_.scale = float(cfg.get_or<double>("routed_scaling_factor", 1.0));
  }
  const int64_t n_shared = cfg.get_or<int64_t>("n_shared_experts", 0);
  check(n_shared >= 0, DZ_ERR_FORMAT, src, ": n_shared_experts ", n_shared, " must not be negative");
  const bool bias = cfg.get_or<bool>("attention_bias", false);
  const bool tied = cfg.get_or<bool>("tie_word_embeddings", false);

  const int64_t H = hidden_, NH = mla_.n_heads, QD = mla_.nope + mla_.rope;
  ends_.load(ws, n_vocab_, H, tied);
  layers_.resize(size_t(n_layers_));
  for (int i = 0; i < n_layers_; ++i) {
    DeepseekV32Layer& l = layers_[size_t(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
    l.in_norm = vector_f32(ws, p + "input_layernorm.weight", {H});
    l.post_norm = vector_f32(ws, p + "post_attention_layernorm.weight", {H});
    l.q_a = linear_weight(ws, a + "q_a_proj", q_lora_, H);
    l.q_a_norm = vector_f32(ws, a + "q_a_layernorm.weight", {q_lora_});
    l.q_b = linear_weight(ws, a + "q_b_proj", NH * QD, q_lora_);
    l.kv_a = linear_weight(ws, a + "kv_a_proj_with_mqa", mla_.rank + mla_.rope, H);
    l.kv_a_norm = vector_f32(ws, a + "kv_a_layernorm.weight", {mla_.rank});
    l.kv_b = linear_weight(ws, a + "kv_b_proj", NH * (mla_.nope + mla_.v), mla_.rank);
    l.o = linear_weight(ws, a + "o_proj", H, NH * mla_.v);
    if (bias) {
      l.q_a_bias = vector_f32(ws, a + "q_a_proj.bias", {q_lora_});
      l.kv_a_bias = vector_f32(ws, a + "kv_a_proj_with_mqa.bias", {mla_.rank + mla_.rope});
      l.o_bias = vector_f32(ws, a + "o_proj.bias", {H});
    }
    const std::string ix = a + "indexer.";
    l.idx_wq = linear_weight(ws, ix + "wq_b", int64_t(idx_.n_heads) * idx_.head_dim, q_lora_);
    l.idx_wk = linear_weight(ws, ix + "wk", idx_.head_dim, H);
    l.idx_wproj = linear_weight(ws, ix + "weights_proj", idx_.n_heads, H);
    l.idx_knorm_w = vector_f32(ws, ix + "k_norm.weight", {idx_.head_dim});
    l.idx_knorm_b = vector_f32(ws, ix + "k_norm.bias", {idx_.head_dim});
    auto load_mlp = [&](const std::string& m, int64_t inter) {
      return load_swiglu(ws, m + ".gate_proj", m + ".up_proj", m + ".down_proj", inter, H);
    };
    l.ffn.moe = moe[size_t(i)];
    if (!l.ffn.moe) {
      l.ffn.dense = load_mlp(p + "mlp", cfg.get_positive_int("intermediate_size"));
      continue;
    }
    l.ffn.router = linear_weight(ws, p + "mlp.gate", E, H);
    l.ffn.router_bias = vector_f32(ws, p + "mlp.gate.e_score_correction_bias", {E});
    l.ffn.experts.reserve(size_t(E));
    for (int64_t e = 0; e < E; ++e)
      l.ffn.experts.push_back(load_mlp(p + "mlp.experts." + std::to_string(e), moe_inter));
    if (n_shared > 0) l.ffn.shared = load_mlp(p + "mlp.shared_experts", moe_inter * n_shared);
  }
  weights_bytes_ = ws.total_bytes();
}

void DeepseekV32Desc::fill_desc_info(dz_model_info& info) const {
  info.n_layers = n_layers_;
  info.n_vocab = n_vocab_;
  info.hidden_size = int32_t(hidden_);
  info.n_heads = mla_.n_heads;
  info.n_kv_heads = 1;  // one latent shared by every head
  info.n_experts = routing_.n_experts;
  info.n_experts_active = routing_.n_active;
  info.max_context = max_context_;
}

namespace {

using cpu::WeightRef;

class DeepseekV32 final : public Family, private DeepseekV32Desc {
 public:
  DeepseekV32(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

  void fill_info(dz_model_info& info) const override {
    fill_desc_info(info);
    info.device = DZ_DEVICE_CPU;
  }
  int32_t n_vocab() const override { return n_vocab_; }
  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    l.layer_token_bytes.assign(size_t(n_layers_), token_bytes());
    l.model_key = model_key_;
    return l;
  }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;

  void set_trace(const DsaTrace* t) { trace_ = t; }

 private:
  // Per token per layer: [c_kv | k_rope] fp32, then the indexer key.
  size_t latent_bytes() const { return cpu::mla_latent_bytes(mla_); }
  size_t token_bytes() const { return latent_bytes() + cpu::indexer_key_bytes(idx_); }

  cpu::IndexerBudget idx_budget_;
  uint64_t model_key_ = 0;
  const DsaTrace* trace_ = nullptr;
  std::unique_ptr<ThreadPool> pool_;
};

DeepseekV32::DeepseekV32(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
    : DeepseekV32Desc(cfg, ws, params) {
  check_cpu_family_params(params, "deepseek_v32");
  model_key_ = fnv1a(cfg.json().dump(), fnv1a(std::string("deepseek_v32 kv: f32 c_kv|k_rope + indexer key v1 mode ") +
                                              std::to_string(int(idx_.mode)) + std::to_string(idx_.pow2_scales) + " " +
                                              std::to_string(ws.total_bytes())));
  pool_ = std::make_unique<ThreadPool>(params.n_threads);
}

void DeepseekV32::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  const int64_t H = hidden_, NH = mla_.n_heads, QD = mla_.nope + mla_.rope, KVA = mla_.rank + mla_.rope;
  const int64_t IH = idx_.n_heads, ID = idx_.head_dim, half = mla_.rope / 2, K = idx_.topk;
  const int64_t OD = NH * mla_.v;
  const BatchRows flat = flatten_batch(batch, n_vocab_, "deepseek_v32");
  const std::vector<BatchRow>& rows = flat.rows;
  const std::vector<int64_t>& first_row = flat.first_row;
  const int64_t R = int64_t(rows.size());
  ThreadPool* pool = pool_.get();

  HostBuffer<float> x(size_t(R * H)), xn(size_t(R * H)), cq(size_t(R * q_lora_)), q(size_t(R * NH * QD)),
      kva(size_t(R * KVA)), iq(size_t(R * IH * ID)), ik(size_t(R * ID)), iw(size_t(R * IH)), att(size_t(R * OD)),
      tmp(size_t(R * H)), cs(size_t(R * half)), sn(size_t(R * half)),
      kvb(size_t(NH * (mla_.nope + mla_.v) * mla_.rank));
  HostBuffer<int32_t> sel(size_t(R * K));
  ends_.embed_rows(batch, flat, H, x.data());
  for (int64_t r = 0; r < R; ++r)
    cpu::rope_cos_sin(rope_, rows[size_t(r)].pos, cs.data() + r * half, sn.data() + r * half);
  // Per item: the layer's page base addresses (the page table as row pointers).
  std::vector<std::vector<const uint8_t*>> page_base(batch.size());
  uint64_t tokens_read = 0;

  for (int li = 0; li < n_layers_; ++li) {
    opt.poll_abort();
    const DeepseekV32Layer& L = layers_[size_t(li)];
    cpu::rms_norm(x.data(), R, H, L.in_norm.data(), eps_, xn.data());
    // Queries: c_q = RMSNorm(q_a(x)), q = q_b(c_q), RoPE (interleaved) on each head's rope part.
    cpu::matmul(xn.data(), R, L.q_a, or_null(L.q_a_bias), cq.data(), pool);
    cpu::rms_norm(cq.data(), R, q_lora_, L.q_a_norm.data(), eps_, cq.data());
    cpu::matmul(cq.data(), R, L.q_b, nullptr, q.data(), pool);
    // The latent: c_kv = RMSNorm(kv_a(x)[:rank]), k_rope = RoPE(kv_a(x)[rank:]).
    cpu::matmul(xn.data(), R, L.kv_a, or_null(L.kv_a_bias), kva.data(), pool);
    // Indexer: q = wq_b(c_q), k = LayerNorm(wk(x)), both [rope | nope] with half-split RoPE; w = weights_proj(x).
    cpu::matmul(cq.data(), R, L.idx_wq, nullptr, iq.data(), pool);
    cpu::matmul(xn.data(), R, L.idx_wk, nullptr, ik.data(), pool);
    cpu::layer_norm(ik.data(), R, ID, L.idx_knorm_w.data(), L.idx_knorm_b.data(), 1e-6f, ik.data());
    cpu::matmul(xn.data(), R, L.idx_wproj, nullptr, iw.data(), pool);
    for (int64_t r = 0; r < R; ++r) {
      const float *c = cs.data() + r * half, *s = sn.data() + r * half;
      cpu::rope_interleaved(q.data() + r * NH * QD + mla_.nope, int(NH), QD, int(half), c, s);
      float* lat = kva.data() + r * KVA;
      cpu::rms_norm(lat, 1, mla_.rank, L.kv_a_norm.data(), eps_, lat);
      cpu::rope_interleaved(lat + mla_.rank, 1, mla_.rope, int(half), c, s);
      cpu::rope_half_split(iq.data() + r * IH * ID, int(IH), ID, int(half), c, s);
      cpu::rope_half_split(ik.data() + r * ID, 1, ID, int(half), c, s);
      // This token's cache record in its reserved page slot: [c_kv | k_rope | indexer key].
      kv::Sequence& seq = *batch[rows[size_t(r)].item].seq;
      const size_t pos = size_t(rows[size_t(r)].pos);
      uint8_t* dst = seq.arena().token_ptr(seq.page_of(pos), uint32_t(li), seq.slot_of(pos));
      std::memcpy(dst, lat, latent_bytes());
      cpu::indexer_encode_key(idx_, ik.data() + r * ID, dst + latent_bytes());
    }
    // kv_b_proj decoded once per layer and call (absorbed and expanded forms both read it).
    for (int64_t n = 0; n < L.kv_b.rows; ++n) L.kv_b.decode_row(n, kvb.data() + n * mla_.rank);

    for (size_t b = 0; b < batch.size(); ++b) {
      kv::Sequence& seq = *batch[b].seq;
      kv::Arena& arena = seq.arena();
      auto& base = page_base[b];
      base.clear();
      for (kv::PageId pg : seq.pages()) base.push_back(arena.token_ptr(pg, uint32_t(li), 0));
      const cpu::PagedRows latent{base.data(), arena.page_tokens(), token_bytes(), 0};
      const cpu::PagedRows keys{base.data(), arena.page_tokens(), token_bytes(), latent_bytes()};
      const int64_t r0 = first_row[b], nq = int64_t(batch[b].tokens.size()), pos0 = rows[size_t(r0)].pos;
      std::vector<int64_t> visible(static_cast<size_t>(nq));
      for (int64_t i = 0; i < nq; ++i) visible[size_t(i)] = pos0 + i + 1;  // causal: positions <= own
      if (trace_ && trace_->on_indexer)
        trace_->on_indexer(li, b, pos0, iq.data() + r0 * IH * ID, iw.data() + r0 * IH, ik.data() + r0 * ID, nq);
      cpu::indexer_select(idx_, iq.data() + r0 * IH * ID, iw.data() + r0 * IH, nq, visible.data(), keys, idx_budget_,
                          sel.data() + r0 * K, nullptr, pool);
      if (trace_ && trace_->on_select) trace_->on_select(li, b, pos0, sel.data() + r0 * K, nq, int(K));
      const int64_t read = nq == 1 ? cpu::mla_decode(mla_, q.data() + r0 * NH * QD, kvb.data(), latent,
                                                     sel.data() + r0 * K, int(K), att.data() + r0 * OD, pool)
                                   : cpu::mla_prefill(mla_, q.data() + r0 * NH * QD, nq, kvb.data(), latent,
                                                      sel.data() + r0 * K, int(K), att.data() + r0 * OD, pool);
      tokens_read += uint64_t(read);
      if (batch[b].attention_tokens_read) *batch[b].attention_tokens_read += uint64_t(read);
    }
    cpu::matmul(att.data(), R, L.o, or_null(L.o_bias), tmp.data(), pool);
    for (int64_t i = 0; i < R * H; ++i) x[size_t(i)] += tmp[size_t(i)];

    cpu::rms_norm(x.data(), R, H, L.post_norm.data(), eps_, xn.data());
    std::vector<float> margins(trace_ && trace_->on_route && L.ffn.moe ? size_t(R) : 0);
    ffn_forward(L.ffn, routing_, H, xn.data(), R, tmp.data(), pool, nullptr,
                margins.empty() ? nullptr : margins.data());
    if (!margins.empty()) trace_->on_route(li, margins.data(), R);
    for (int64_t i = 0; i < R * H; ++i) x[size_t(i)] += tmp[size_t(i)];
  }
  opt.poll_abort();

  ends_.logits(batch, flat, x.data(), H, eps_, xn.data(), pool);
  if (opt.attention_tokens_read) *opt.attention_tokens_read += tokens_read;
}

}  // namespace

std::unique_ptr<Family> make_deepseek_v32(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  return make_on_device<DeepseekV32>("deepseek_v32", make_deepseek_v32_cuda, cfg, ws, params);
}

void deepseek_v32_set_trace(Family& family, const DsaTrace* trace) {
  auto* f = dynamic_cast<DeepseekV32*>(&family);
  check(f != nullptr, DZ_ERR_INVALID_ARGUMENT, "deepseek_v32_set_trace: the model is not deepseek_v32");
  f->set_trace(trace);
}

}  // namespace dz
