// DeepSeek-V4 (model_type deepseek_v4) on the CPU backend, computed as
// transformers' DeepseekV4ForCausalLM defines it:
//  - mHC residuals: hc_mult streams per token, collapsed before and expanded
//    after each sublayer (cpu/hyper_connection.h), collapsed by hc_head at the end.
//  - Attention: low-rank q (q_a, RMSNorm, q_b, per-head unweighted RMSNorm),
//    one shared KV head with K = V (kv_proj, RMSNorm), RoPE on the trailing
//    rotary channels in interleaved pairs, a sink logit per head, the output's
//    rotary channels rotated back by the query's angle, and the grouped
//    low-rank output projection (o_a per head group, then o_b).
//    Every query sees its last sliding_window tokens, and per layer type:
//      sliding_attention              nothing more ("main" RoPE);
//      compressed_sparse_attention    (CSA) the compressed entries of every 4
//        tokens (overlapping windows of 8) that a lightning indexer over its
//        own compressed keys picks (top index_topk; "compress" RoPE);
//      heavily_compressed_attention   (HCA) every compressed entry of every
//        128 tokens.
//    An entry w covers tokens up to (w + 1) * m - 1 and is visible from there on.
//  - MoE: sqrt(softplus) router scores; the first layers (hash_moe) route by a
//    token-id table, the rest by score + bias; SwiGLU clamped at
//    swiglu_limit in routed and shared experts.
// Cache: a sequence's state slot holds, per layer, its sliding window (a ring
// of K=V vectors) and the open compressor pools (cpu/compress.h); pages hold
// only the compressed entries, spread over the m token slots they stand for
// (ceil(entry bytes / m) bytes a token). Sliding layers cache nothing per token.
// A forward pass works on copies of the states and writes them back only when
// every layer has run, so a failed pass leaves a sequence as it was.
#include "model/deepseek_v4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>

#include "common/host_alloc.h"
#include "cpu/attention.h"
#include "cpu/compress.h"
#include "cpu/hyper_connection.h"
#include "cpu/matmul.h"
#include "cpu/norm.h"
#include "cpu/rope.h"
#include "cpu/topk.h"
#include "model/family.h"
#include "model/lm_ends.h"
#include "model/moe_ffn.h"
#include "model/rope_config.h"
#include "model/weights.h"
#include "runtime/parallel.h"

namespace dz {

namespace {

using cpu::WeightRef;
using v4::Attn;
using v4::Compressor;
using v4::Hc;
using v4::kMaxIndexHeads;
using v4::kMaxRopeDim;
using v4::Layer;

// The compressed entries a sequence's queries see in a pass: pointers into the
// pages where an entry lies whole in one page at float alignment (page size a
// multiple of the rate), else into copies gathered from the pages.
struct Entries {
  std::vector<const float*> attn, index;  // [n] entry, indexer key (CSA)
  std::deque<std::vector<float>> copies;
  int64_t n() const { return int64_t(attn.size()); }
};

class Names {
 public:
  explicit Names(const WeightStore& ws) : native_(ws.has("embed.weight") && !ws.has("model.embed_tokens.weight")) {}
  bool native() const { return native_; }
  // Layer i's tensor (or linear weight base) `hf`, a name below model.layers.i.
  std::string layer(int i, const std::string& hf) const {
    if (!native_) return "model.layers." + std::to_string(i) + "." + hf;
    return "layers." + std::to_string(i) + "." + rename(hf, kLayer);
  }
  std::string top(const std::string& hf) const { return native_ ? rename(hf, kTop) : hf; }

 private:
  using Table = std::initializer_list<std::pair<const char*, const char*>>;
  // First match wins: a name equal to the key, or starting with key + ".".
  static std::string rename(const std::string& hf, const Table& table) {
    for (const auto& [from, to] : table) {
      const size_t n = std::strlen(from);
      if (hf.compare(0, n, from) == 0 && (hf.size() == n || hf[n] == '.')) return to + hf.substr(n);
    }
    fail(DZ_ERR_INTERNAL, "deepseek_v4: no checkpoint name for ", hf);
  }
  static constexpr Table kTop = {{"model.embed_tokens", "embed"},
                                 {"lm_head", "head"},
                                 {"model.norm", "norm"},
                                 {"model.hc_head.hc_fn", "hc_head_fn"},
                                 {"model.hc_head.hc_base", "hc_head_base"},
                                 {"model.hc_head.hc_scale", "hc_head_scale"}};
  static constexpr Table kLayer = {
      {"self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"},
      {"self_attn.compressor.indexer.kv_proj", "attn.indexer.compressor.wkv"},
      {"self_attn.compressor.indexer.gate_proj", "attn.indexer.compressor.wgate"},
      {"self_attn.compressor.indexer.kv_norm", "attn.indexer.compressor.norm"},
      {"self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"},
      {"self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"},
      {"self_attn.compressor.position_bias", "attn.compressor.ape"},
      {"self_attn.compressor.kv_proj", "attn.compressor.wkv"},
      {"self_attn.compressor.gate_proj", "attn.compressor.wgate"},
      {"self_attn.compressor.kv_norm", "attn.compressor.norm"},
      {"self_attn.sinks", "attn.attn_sink"},
      {"self_attn.q_a_proj", "attn.wq_a"},
      {"self_attn.q_b_proj", "attn.wq_b"},
      {"self_attn.q_a_norm", "attn.q_norm"},
      {"self_attn.kv_proj", "attn.wkv"},
      {"self_attn.kv_norm", "attn.kv_norm"},
      {"self_attn.o_a_proj", "attn.wo_a"},
      {"self_attn.o_b_proj", "attn.wo_b"},
      {"input_layernorm", "attn_norm"},
      {"post_attention_layernorm", "ffn_norm"},
      {"attn_hc.fn", "hc_attn_fn"},
      {"attn_hc.base", "hc_attn_base"},
      {"attn_hc.scale", "hc_attn_scale"},
      {"ffn_hc.fn", "hc_ffn_fn"},
      {"ffn_hc.base", "hc_ffn_base"},
      {"ffn_hc.scale", "hc_ffn_scale"},
      {"mlp.gate.e_score_correction_bias", "ffn.gate.bias"},
      {"mlp.gate.tid2eid", "ffn.gate.tid2eid"},
      {"mlp.gate", "ffn.gate"},
      {"mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"},
      {"mlp.shared_experts.up_proj", "ffn.shared_experts.w3"},
      {"mlp.shared_experts.down_proj", "ffn.shared_experts.w2"},
  };
  bool native_;
};

class DeepseekV4 final : public Family, private DeepseekV4Desc {
 public:
  DeepseekV4(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
      : DeepseekV4Desc(cfg, ws), pool_(std::make_unique<ThreadPool>(params.n_threads)) {
    check_cpu_family_params(params, "deepseek_v4");
  }

  void fill_info(dz_model_info& info) const override {
    fill_desc_info(info);
    info.device = DZ_DEVICE_CPU;
  }
  int32_t n_vocab() const override { return n_vocab_; }
  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    for (const Layer& L : layers_) l.layer_token_bytes.push_back(L.token_bytes);
    l.state_slot_bytes = state_floats_ * sizeof(float);
    l.model_key = model_key_;
    return l;
  }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;

 private:
  void attention(const Layer& L, int li, std::span<ForwardItem> batch, const BatchRows& flat, const float* xn,
                 std::vector<std::vector<float>>& states, float* y, uint64_t& tokens_read);
  // Pool one token's compressor projections (kv, gate: S * dim each) at
  // position pos; when that closes a window, write the finished entry
  // (normalised, rotated) to out and return true.
  bool compress_token(const Compressor& c, int64_t rate, float* state, const float* kv, const float* gate, int64_t pos,
                      float* out) const;
  // Rotate n_vec vectors (stride apart) whose rotary channels start at x by
  // the angles of position pos (inverse: backwards).
  void rotate(const cpu::RopeFreqs& f, int64_t pos, float* x, int n_vec, int64_t stride, bool inverse) const;

  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace

void DeepseekV4Desc::fill_desc_info(dz_model_info& info) const {
  info.n_layers = n_layers_;
  info.n_vocab = n_vocab_;
  info.hidden_size = int32_t(hidden_);
  info.n_heads = int32_t(n_heads_);
  info.n_kv_heads = 1;
  info.n_experts = routing_.n_experts;
  info.n_experts_active = routing_.n_active;
  info.max_context = max_context_;
}

DeepseekV4Desc::DeepseekV4Desc(const Config& cfg, const WeightStore& ws) {
  const std::string& src = cfg.source();
  const auto& j = cfg.json();
  n_vocab_ = int32_t(cfg.get_positive_int("vocab_size"));
  hidden_ = cfg.get_positive_int("hidden_size");
  n_layers_ = int32_t(cfg.get_positive_int("num_hidden_layers"));
  n_heads_ = cfg.get_positive_int("num_attention_heads");
  head_dim_ = cfg.get_positive_int_or("head_dim", 512);
  q_lora_ = cfg.get_positive_int("q_lora_rank");
  check(cfg.get_or<int64_t>("num_key_value_heads", 1) == 1, DZ_ERR_UNSUPPORTED, src,
        ": num_key_value_heads must be 1 (deepseek_v4 shares one K=V head)");
  window_ = cfg.get_positive_int_or("sliding_window", 128);
  o_groups_ = cfg.get_positive_int_or("o_groups", 8);
  o_rank_ = cfg.get_positive_int_or("o_lora_rank", 1024);
  check(n_heads_ % o_groups_ == 0, DZ_ERR_FORMAT, src, ": o_groups ", o_groups_, " does not divide the ", n_heads_,
        " heads");
  idx_heads_ = cfg.get_positive_int_or("index_n_heads", 64);
  idx_dim_ = cfg.get_positive_int_or("index_head_dim", 128);
  idx_topk_ = cfg.get_positive_int_or("index_topk", 512);
  check(idx_heads_ <= kMaxIndexHeads, DZ_ERR_UNSUPPORTED, src, ": index_n_heads ", idx_heads_, " (at most ",
        kMaxIndexHeads, ")");
  eps_ = float(cfg.get_or<double>("rms_norm_eps", 1e-6));
  check(eps_ > 0, DZ_ERR_FORMAT, src, ": rms_norm_eps must be positive");
  max_context_ = cfg.get_positive_int_or("max_position_embeddings", 1048576);
  const std::string act = cfg.get_or<std::string>("hidden_act", "silu");
  check(act == "silu", DZ_ERR_UNSUPPORTED, src, ": hidden_act '", act, "' (deepseek_v4 uses silu)");

  // Hyper-connections.
  hc_.n = int(cfg.get_positive_int_or("hc_mult", 4));
  hc_.hidden = hidden_;
  hc_.sinkhorn_iters = int(cfg.get_positive_int_or("hc_sinkhorn_iters", 20));
  hc_.hc_eps = float(cfg.get_or<double>("hc_eps", 1e-6));
  check(hc_.n <= 64, DZ_ERR_UNSUPPORTED, src, ": hc_mult ", hc_.n, " (at most 64 streams)");

  // Layer types: layer_types, else the checkpoint's per-layer compress_ratios (0 / 4 / 128).
  int64_t rate_csa = 4, rate_hca = 128;
  if (cfg.has("compress_rates")) {
    const auto& cr = j["compress_rates"];
    check(cr.is_object(), DZ_ERR_FORMAT, src, ": compress_rates must be an object");
    for (const auto& [k, v] : cr.items()) {
      check(v.is_number_integer() && v.get<int64_t>() > 0, DZ_ERR_FORMAT, src, ": compress_rates.", k,
            " must be a positive integer");
      if (k == "compressed_sparse_attention") rate_csa = v.get<int64_t>();
      if (k == "heavily_compressed_attention") rate_hca = v.get<int64_t>();
    }
  }
  rate_csa = cfg.get_or<int64_t>("compress_rate_csa", rate_csa);
  rate_hca = cfg.get_or<int64_t>("compress_rate_hca", rate_hca);
  check(rate_csa > 0 && rate_hca > 0 && rate_csa <= 65536 && rate_hca <= 65536, DZ_ERR_FORMAT, src,
        ": compression rates must be in [1, 65536]");
  std::vector<Attn> kinds(static_cast<size_t>(n_layers_), Attn::Hca);
  if (cfg.has("layer_types")) {
    const auto types = cfg.get<std::vector<std::string>>("layer_types");
    check(types.size() >= size_t(n_layers_), DZ_ERR_FORMAT, src, ": layer_types has ", types.size(), " entries for ",
          n_layers_, " layers");
    for (int i = 0; i < n_layers_; ++i) {
      const std::string& t = types[size_t(i)];
      check(t == "sliding_attention" || t == "compressed_sparse_attention" || t == "heavily_compressed_attention",
            DZ_ERR_FORMAT, src, ": layer_types[", i, "] = '", t,
            "' (expected sliding_attention, compressed_sparse_attention or heavily_compressed_attention)");
      kinds[size_t(i)] = t == "sliding_attention"             ? Attn::Sliding
                         : t == "compressed_sparse_attention" ? Attn::Csa
                                                              : Attn::Hca;
    }
  } else if (cfg.has("compress_ratios")) {
    const auto ratios = cfg.get<std::vector<int64_t>>("compress_ratios");
    check(ratios.size() >= size_t(n_layers_), DZ_ERR_FORMAT, src, ": compress_ratios has ", ratios.size(),
          " entries for ", n_layers_, " layers");
    for (int i = 0; i < n_layers_; ++i) {
      const int64_t r = ratios[size_t(i)];
      check(r == 0 || r == 4 || r == 128, DZ_ERR_FORMAT, src, ": compress_ratios[", i, "] = ", r,
            " (expected 0 sliding, 4 CSA or 128 HCA)");
      kinds[size_t(i)] = r == 0 ? Attn::Sliding : r == 4 ? Attn::Csa : Attn::Hca;
    }
  } else {  // transformers' default: two HCA layers, then CSA and HCA alternating
    for (int i = 2; i < n_layers_; ++i) kinds[size_t(i)] = (i - 2) % 2 ? Attn::Csa : Attn::Hca;
  }

  // RoPE: "main" for sliding layers, "compress" (usually YaRN) for the others.
  double partial = 64.0 / 512.0;
  if (cfg.has("partial_rotary_factor"))
    partial = cfg.get<double>("partial_rotary_factor");
  else if (cfg.has("qk_rope_head_dim"))
    partial = double(cfg.get_positive_int("qk_rope_head_dim")) / double(head_dim_);
  const double theta = cfg.get_or<double>("rope_theta", 10000.0);
  const double comp_theta = cfg.get_or<double>("compress_rope_theta", 160000.0);
  nlohmann::json main_rp, comp_rp;
  const nlohmann::json rp = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? j["rope_parameters"]
                            : j.contains("rope_scaling") && j["rope_scaling"].is_object()     ? j["rope_scaling"]
                                                                                          : nlohmann::json::object();
  if (rp.contains("main") && rp["main"].is_object() && rp.contains("compress") && rp["compress"].is_object()) {
    main_rp = rp["main"], comp_rp = rp["compress"];
  } else {  // a flat form: the YaRN fields (if any) belong to the compressed layers
    main_rp = {{"rope_type", "default"}, {"rope_theta", theta}};
    comp_rp = nlohmann::json::object();
    for (const auto& [k, v] : rp.items())
      if (k != "main" && k != "compress") comp_rp[k] = v;
    comp_rp["rope_theta"] = comp_theta;
    const std::string t = comp_rp.value("rope_type", comp_rp.value("type", std::string("default")));
    if (t == "yarn" && !comp_rp.contains("attention_factor")) comp_rp["attention_factor"] = 1.0;
  }
  for (nlohmann::json* o : {&main_rp, &comp_rp})
    if (!o->contains("partial_rotary_factor")) (*o)["partial_rotary_factor"] = partial;
  const cpu::RopeParams pm = rope_params_from_object(cfg, main_rp, "rope_parameters.main", int(head_dim_), theta);
  const cpu::RopeParams pc =
      rope_params_from_object(cfg, comp_rp, "rope_parameters.compress", int(head_dim_), comp_theta);
  check(pm.dim == pc.dim, DZ_ERR_UNSUPPORTED, src, ": the main and compress rotary dimensions differ (", pm.dim, ", ",
        pc.dim, ")");
  rope_dim_ = pm.dim;
  check(rope_dim_ <= kMaxRopeDim, DZ_ERR_UNSUPPORTED, src, ": rotary dimension ", rope_dim_, " (at most ", kMaxRopeDim,
        ")");
  check(rope_dim_ <= head_dim_ && rope_dim_ <= idx_dim_, DZ_ERR_FORMAT, src, ": the rotary dimension ", rope_dim_,
        " exceeds head_dim ", head_dim_, " or index_head_dim ", idx_dim_);
  rope_main_ = cpu::rope_freqs(pm);
  rope_comp_ = cpu::rope_freqs(pc);

  // MoE.
  routing_.score = MoeRouting::Score::SqrtSoftplus;
  const std::string score = cfg.get_or<std::string>("scoring_func", "sqrtsoftplus");
  check(score == "sqrtsoftplus", DZ_ERR_UNSUPPORTED, src, ": scoring_func '", score,
        "' (deepseek_v4 uses sqrtsoftplus)");
  routing_.n_experts = int(cfg.get_first_or<int64_t>({"n_routed_experts", "num_local_experts"}, 0));
  routing_.n_active = int(cfg.get_or<int64_t>("num_experts_per_tok", 0));
  check(routing_.n_experts > 0 && routing_.n_active > 0 && routing_.n_active <= routing_.n_experts, DZ_ERR_FORMAT, src,
        ": n_routed_experts (", routing_.n_experts, ") and num_experts_per_tok (", routing_.n_active,
        ") must be positive, the second at most the first");
  routing_.scale = float(cfg.get_or<double>("routed_scaling_factor", 1.5));
  routing_.swiglu_limit = float(cfg.get_or<double>("swiglu_limit", 0.0));
  check(routing_.swiglu_limit >= 0, DZ_ERR_FORMAT, src, ": swiglu_limit must not be negative");
  std::vector<bool> hashed(static_cast<size_t>(n_layers_));
  if (cfg.has("mlp_layer_types")) {
    const auto t = cfg.get<std::vector<std::string>>("mlp_layer_types");
    check(t.size() >= size_t(n_layers_), DZ_ERR_FORMAT, src, ": mlp_layer_types has ", t.size(), " entries for ",
          n_layers_, " layers");
    for (int i = 0; i < n_layers_; ++i) {
      check(t[size_t(i)] == "hash_moe" || t[size_t(i)] == "moe", DZ_ERR_FORMAT, src, ": mlp_layer_types[", i, "] = '",
            t[size_t(i)], "' (expected hash_moe or moe)");
      hashed[size_t(i)] = t[size_t(i)] == "hash_moe";
    }
  } else {
    const int64_t n_hash = cfg.get_or<int64_t>("num_hash_layers", 3);
    for (int i = 0; i < n_layers_; ++i) hashed[size_t(i)] = i < n_hash;
  }
  const int64_t inter = moe_inter_ = cfg.get_positive_int("moe_intermediate_size");

  // Weights.
  const Names names(ws);
  const int64_t H = hidden_, D = head_dim_, NH = n_heads_, QL = q_lora_, G = o_groups_, NHC = hc_.n;
  ends_.load(ws, n_vocab_, H, cfg.get_or<bool>("tie_word_embeddings", false), names.top("model.embed_tokens"),
             names.top("lm_head"), names.top("model.norm.weight"));
  auto load_hc = [&](const std::string& fn, const std::string& base, const std::string& scale, int64_t outs,
                     int64_t n_scale) {
    Hc h;
    h.fn = float_matrix(ws, fn, {outs, NHC * H});
    h.base = vector_f32(ws, base, {outs});
    h.scale = vector_f32(ws, scale, {n_scale});
    return h;
  };
  head_hc_ = load_hc(names.top("model.hc_head.hc_fn"), names.top("model.hc_head.hc_base"),
                     names.top("model.hc_head.hc_scale"), NHC, 1);
  layers_.resize(size_t(n_layers_));
  for (int i = 0; i < n_layers_; ++i) {
    Layer& l = layers_[size_t(i)];
    auto n = [&](const std::string& hf) { return names.layer(i, hf); };
    auto load_comp = [&](const std::string& p, int64_t dim, bool overlap, int64_t rate) {
      Compressor c;
      c.dim = dim, c.overlap = overlap;
      c.kv = linear_weight(ws, n(p + "kv_proj"), c.series() * dim, H);
      c.gate = linear_weight(ws, n(p + "gate_proj"), c.series() * dim, H);
      c.bias = vector_f32(ws, n(p + "position_bias"), {rate, c.series() * dim});
      c.norm = vector_f32(ws, n(p + "kv_norm.weight"), {dim});
      c.state_off = state_floats_;
      state_floats_ += c.state_floats();
      return c;
    };
    l.kind = kinds[size_t(i)];
    l.in_norm = vector_f32(ws, n("input_layernorm.weight"), {H});
    l.post_norm = vector_f32(ws, n("post_attention_layernorm.weight"), {H});
    for (const char* hc : {"attn_hc.", "ffn_hc."})
      (hc[0] == 'a' ? l.attn_hc : l.ffn_hc) = load_hc(n(std::string(hc) + "fn"), n(std::string(hc) + "base"),
                                                      n(std::string(hc) + "scale"), (2 + NHC) * NHC, 3);
    l.q_a = linear_weight(ws, n("self_attn.q_a_proj"), QL, H);
    l.q_a_norm = vector_f32(ws, n("self_attn.q_a_norm.weight"), {QL});
    l.q_b = linear_weight(ws, n("self_attn.q_b_proj"), NH * D, QL);
    l.kv = linear_weight(ws, n("self_attn.kv_proj"), D, H);
    l.kv_norm = vector_f32(ws, n("self_attn.kv_norm.weight"), {D});
    l.o_a = linear_weight(ws, n("self_attn.o_a_proj"), G * o_rank_, NH * D / G);
    l.o_b = linear_weight(ws, n("self_attn.o_b_proj"), H, G * o_rank_);
    l.sinks = vector_f32(ws, n("self_attn.sinks"), {NH});
    l.ring_off = state_floats_;
    state_floats_ += size_t(window_ * D);
    if (l.kind != Attn::Sliding) {
      l.rate = l.kind == Attn::Csa ? rate_csa : rate_hca;
      l.comp = load_comp("self_attn.compressor.", D, l.kind == Attn::Csa, l.rate);
      l.entry_floats = size_t(D);
      if (l.kind == Attn::Csa) {
        l.icomp = load_comp("self_attn.compressor.indexer.", idx_dim_, true, l.rate);
        l.iq_b = linear_weight(ws, n("self_attn.compressor.indexer.q_b_proj"), idx_heads_ * idx_dim_, QL);
        l.iweights = linear_weight(ws, n("self_attn.compressor.indexer.scorer.weights_proj"), idx_heads_, H);
        l.entry_floats += size_t(idx_dim_);
      }
      l.token_bytes = (l.entry_floats * sizeof(float) + size_t(l.rate) - 1) / size_t(l.rate);
    }
    // MoE.
    const int64_t E = routing_.n_experts, K = routing_.n_active;
    l.ffn.moe = true;
    l.ffn.router = linear_weight(ws, n("mlp.gate"), E, H);
    if (hashed[size_t(i)]) {
      const TensorView& t = ws.get(n("mlp.gate.tid2eid"));
      check(t.dtype == DType::I64 || t.dtype == DType::I32, DZ_ERR_FORMAT, "tensor ", t.name, ": dtype ",
            dtype_name(t.dtype), " (expected I64 or I32)");
      check_shape(t, {int64_t(n_vocab_), K});
      l.ffn.hash.resize(size_t(t.numel()));
      for (size_t k = 0; k < l.ffn.hash.size(); ++k) {
        int64_t v = 0;
        if (t.dtype == DType::I64) {
          std::memcpy(&v, t.data + 8 * k, 8);
        } else {
          int32_t v32;
          std::memcpy(&v32, t.data + 4 * k, 4);
          v = v32;
        }
        check(v >= 0 && v < E, DZ_ERR_FORMAT, "tensor ", t.name, ": expert ", v, " for token ", int64_t(k) / K,
              " is outside [0, ", E, ")");
        l.ffn.hash[k] = int32_t(v);
      }
    } else {
      l.ffn.router_bias = vector_f32(ws, n("mlp.gate.e_score_correction_bias"), {E});
    }
    if (names.native()) {  // one tensor per expert and projection: w1 gate, w3 up, w2 down
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = "layers." + std::to_string(i) + ".ffn.experts." + std::to_string(e) + ".";
        l.ffn.experts.push_back(load_swiglu(ws, x + "w1", x + "w3", x + "w2", inter, H));
      }
    } else {  // transformers stacks them: [experts, 2 * inter, hidden] gate | up, [experts, hidden, inter] down
      const WeightRef gu = float_matrix(ws, n("mlp.experts.gate_up_proj"), {E, 2 * inter, H});
      const WeightRef dn = float_matrix(ws, n("mlp.experts.down_proj"), {E, H, inter});
      for (int64_t e = 0; e < E; ++e)
        l.ffn.experts.push_back(SwiGlu{gu.row_slice(e * 2 * inter, inter), gu.row_slice(e * 2 * inter + inter, inter),
                                       dn.row_slice(e * H, H), inter});
    }
    if (cfg.get_or<int64_t>("n_shared_experts", 1) > 0)
      l.ffn.shared = load_swiglu(ws, n("mlp.shared_experts.gate_proj"), n("mlp.shared_experts.up_proj"),
                                 n("mlp.shared_experts.down_proj"), inter, H);
  }
  model_key_ = fnv1a(cfg.json().dump(), fnv1a("deepseek_v4 kv: f32 entries|index keys per m tokens; state f32 "
                                              "window ring, softmax pools v1 " +
                                              std::to_string(ws.total_bytes())));
  weights_bytes_ = ws.total_bytes();
}

namespace {

void DeepseekV4::rotate(const cpu::RopeFreqs& f, int64_t pos, float* x, int n_vec, int64_t stride, bool inverse) const {
  const int half = int(rope_dim_ / 2);
  float cos[kMaxRopeDim / 2], sin[kMaxRopeDim / 2];
  cpu::rope_cos_sin(f, pos, cos, sin);
  if (inverse)
    for (int i = 0; i < half; ++i) sin[i] = -sin[i];
  cpu::rope_interleaved(x, n_vec, stride, half, cos, sin);
}

bool DeepseekV4::compress_token(const Compressor& c, int64_t rate, float* state, const float* kv, const float* gate,
                                int64_t pos, float* out) const {
  const int64_t D = c.dim, slot = pos % rate, P = cpu::pool_floats(D);
  const float* bias = c.bias.data() + slot * c.series() * D;
  float* open = state + c.state_off;
  if (c.overlap) {
    // Cb (second half) joins the entry of this window, Ca (first half) the next one's.
    cpu::pool_push(open, D, kv + D, gate + D, bias + D);
    cpu::pool_push(open + P, D, kv, gate, bias);
  } else {
    cpu::pool_push(open, D, kv, gate, bias);
  }
  if ((pos + 1) % rate != 0) return false;
  cpu::pool_result(open, D, out);
  if (c.overlap) {
    std::memcpy(open, open + P, size_t(P) * sizeof(float));
    cpu::pool_clear(open + P, D);
  } else {
    cpu::pool_clear(open, D);
  }
  cpu::rms_norm(out, 1, D, c.norm.data(), eps_, out);
  // Rotated at the window's first position.
  rotate(rope_comp_, pos + 1 - rate, out + D - rope_dim_, 1, D, false);
  return true;
}

void DeepseekV4::attention(const Layer& L, int li, std::span<ForwardItem> batch, const BatchRows& flat, const float* xn,
                           std::vector<std::vector<float>>& states, float* y, uint64_t& tokens_read) {
  const int64_t R = int64_t(flat.rows.size()), D = head_dim_, NH = n_heads_, QL = q_lora_;
  const int64_t G = o_groups_, GW = NH * D / G, RD = rope_dim_, W = window_;
  const int64_t ID = idx_dim_, IH = idx_heads_;
  ThreadPool* pool = pool_.get();
  const cpu::RopeFreqs& rope = rope_of(L);
  HostBuffer<float> qres(size_t(R * QL)), q(size_t(R * NH * D)), kv(size_t(R * D)), out(size_t(R * NH * D));
  cpu::matmul(xn, R, L.q_a, nullptr, qres.data(), pool);
  cpu::rms_norm(qres.data(), R, QL, L.q_a_norm.data(), eps_, qres.data());
  cpu::matmul(qres.data(), R, L.q_b, nullptr, q.data(), pool);
  cpu::rms_norm(q.data(), R * NH, D, nullptr, eps_, q.data());
  cpu::matmul(xn, R, L.kv, nullptr, kv.data(), pool);
  cpu::rms_norm(kv.data(), R, D, L.kv_norm.data(), eps_, kv.data());
  for (int64_t r = 0; r < R; ++r) {
    const int64_t pos = flat.rows[size_t(r)].pos;
    rotate(rope, pos, q.data() + r * NH * D + D - RD, int(NH), D, false);
    rotate(rope, pos, kv.data() + r * D + D - RD, 1, D, false);
  }
  // Compressor projections (and the indexer's queries and head weights).
  const Compressor &C = L.comp, &IC = L.icomp;
  const bool csa = L.kind == Attn::Csa, compressed = L.kind != Attn::Sliding;
  const int64_t CS = compressed ? C.series() * D : 0, ICS = csa ? IC.series() * ID : 0;
  HostBuffer<float> ckv(size_t(R * CS)), cg(size_t(R * CS)), ikv(size_t(R * ICS)), ig(size_t(R * ICS)),
      iq(size_t(csa ? R * IH * ID : 0)), iw(size_t(csa ? R * IH : 0));
  if (compressed) {
    cpu::matmul(xn, R, C.kv, nullptr, ckv.data(), pool);
    cpu::matmul(xn, R, C.gate, nullptr, cg.data(), pool);
  }
  if (csa) {
    cpu::matmul(xn, R, IC.kv, nullptr, ikv.data(), pool);
    cpu::matmul(xn, R, IC.gate, nullptr, ig.data(), pool);
    cpu::matmul(qres.data(), R, L.iq_b, nullptr, iq.data(), pool);
    cpu::matmul(xn, R, L.iweights, nullptr, iw.data(), pool);
    const float w_scale = float(1.0 / std::sqrt(double(IH)));
    for (int64_t r = 0; r < R; ++r) {
      rotate(rope_comp_, flat.rows[size_t(r)].pos, iq.data() + r * IH * ID + ID - RD, int(IH), ID, false);
      for (int64_t h = 0; h < IH; ++h) iw[size_t(r * IH + h)] *= w_scale;
    }
  }

  const float scale = float(1.0 / std::sqrt(double(D)));
  const float iscale = float(1.0 / std::sqrt(double(ID)));
  const size_t EB = L.entry_floats * sizeof(float);
  std::vector<float> entry(L.entry_floats);
  // 1. The compressors, token by token (cheap): entries a window closes go to the pages; visible[r] counts the
  //    entries row r sees.
  std::vector<Entries> ents(batch.size());
  std::vector<int64_t> visible(static_cast<size_t>(R));
  for (size_t b = 0; b < batch.size(); ++b) {
    kv::Sequence& seq = *batch[b].seq;
    kv::Arena& arena = seq.arena();
    float* st = states[b].data();
    const int64_t r0 = flat.first_row[b], n = int64_t(batch[b].tokens.size()), start = int64_t(seq.length());
    Entries& ent = ents[b];
    // Entry w's bytes sit in the token slots of positions w * rate .. w * rate + rate - 1.
    auto entry_io = [&](int64_t w, uint8_t* bytes, bool write) {
      for (int64_t s = 0; s < L.rate; ++s) {
        const size_t off = size_t(s) * L.token_bytes;
        if (off >= EB) break;
        const size_t len = std::min(L.token_bytes, EB - off);
        const size_t p = size_t(w * L.rate + s);
        uint8_t* slot = arena.token_ptr(seq.page_of(p), uint32_t(li), seq.slot_of(p));
        if (write)
          std::memcpy(slot, bytes + off, len);
        else
          std::memcpy(bytes + off, slot, len);
      }
    };
    const bool in_place =
        arena.page_tokens() % uint32_t(std::max<int64_t>(L.rate, 1)) == 0 && L.token_bytes % sizeof(float) == 0;
    auto add = [&](int64_t w) {  // entry w, already in the pages
      const float* e;
      if (in_place) {
        const size_t p = size_t(w * L.rate);
        e = reinterpret_cast<const float*>(arena.token_ptr(seq.page_of(p), uint32_t(li), seq.slot_of(p)));
      } else {
        std::vector<float>& c = ent.copies.emplace_back(L.entry_floats);
        entry_io(w, reinterpret_cast<uint8_t*>(c.data()), false);
        e = c.data();
      }
      ent.attn.push_back(e);
      if (csa) ent.index.push_back(e + D);
    };
    if (compressed)
      for (int64_t w = 0; w < start / L.rate; ++w) add(w);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = r0 + i, pos = start + i;
      if (compressed) {
        const bool closed = compress_token(C, L.rate, st, ckv.data() + r * CS, cg.data() + r * CS, pos, entry.data());
        if (csa) {
          const bool iclosed =
              compress_token(IC, L.rate, st, ikv.data() + r * ICS, ig.data() + r * ICS, pos, entry.data() + D);
          check(closed == iclosed, DZ_ERR_INTERNAL, "deepseek_v4: compressor windows out of step");
        }
        if (closed) {
          entry_io(ent.n(), reinterpret_cast<uint8_t*>(entry.data()), true);
          add(ent.n());
        }
      }
      visible[size_t(r)] = ent.n();
    }
  }
  // 2. Attention of every row: its window (this pass's K=V rows, older ones from its sequence's ring, not
  //    updated yet), then its visible entries (HCA) or those the indexer picks among them (CSA). Rows run in
  //    parallel; fewer rows than threads (decode) spread their indexer scores and heads over the threads.
  //    Below kParallelWork multiply-adds a thread, waking the threads costs more than it saves.
  constexpr int64_t kParallelWork = int64_t(1) << 16;
  const bool row_parallel = R >= pool->size();
  std::vector<uint64_t> keys_read(static_cast<size_t>(R));
  auto run_row = [&](int64_t r, std::vector<double>& scratch, std::vector<double>& qd, std::vector<float>& sc,
                     std::vector<int32_t>& pick, std::vector<const float*>& keys) {
    const size_t b = flat.rows[size_t(r)].item;
    const Entries& ent = ents[b];
    const float* ring = states[b].data() + L.ring_off;
    const int64_t pos = flat.rows[size_t(r)].pos, start = int64_t(batch[b].seq->length()), r0 = flat.first_row[b];
    const int64_t nv = visible[size_t(r)];
    keys.clear();
    for (int64_t p = std::max<int64_t>(0, pos - W + 1); p <= pos; ++p)
      keys.push_back(p >= start ? kv.data() + (r0 + p - start) * D : ring + (p % W) * D);
    if (L.kind == Attn::Hca) {
      keys.insert(keys.end(), ent.attn.begin(), ent.attn.begin() + nv);
    } else if (csa && nv > 0) {
      sc.resize(size_t(nv));
      const float* qi = iq.data() + r * IH * ID;
      const float* wi = iw.data() + r * IH;
      qd.assign(qi, qi + IH * ID);  // exact; dot_rows4_f64 then equals dot_f64 bit for bit
      auto score = [&](size_t w0, size_t w1) {
        double d[4 * kMaxIndexHeads];
        for (size_t w = w0; w < w1; w += 4) {  // every head's dot products with four keys at once
          const float* k4[4];
          const int m = int(std::min<size_t>(4, w1 - w));
          for (int j = 0; j < 4; ++j) k4[j] = ent.index[w + size_t(std::min(j, m - 1))];
          cpu::dot_rows4_f64(qd.data(), int(IH), ID, k4, ID, d);
          for (int j = 0; j < m; ++j) {
            double s = 0;
            for (int64_t h = 0; h < IH; ++h)
              if (d[4 * h + j] > 0) s += double(wi[h]) * (float(d[4 * h + j]) * iscale);
            sc[w + size_t(j)] = float(s);
          }
        }
      };
      if (row_parallel)
        score(0, size_t(nv));
      else
        pool->parallel_for(size_t(nv), size_t(std::max<int64_t>(64, kParallelWork / (IH * ID))), score);
      const int k = int(std::min<int64_t>(idx_topk_, nv));
      pick.resize(size_t(k));
      const int got = cpu::topk_row(sc.data(), nv, k, pick.data());
      for (int j = 0; j < got; ++j) keys.push_back(ent.attn[size_t(pick[size_t(j)])]);
    }
    keys_read[size_t(r)] = keys.size();
    float* o = out.data() + r * NH * D;
    const float* qr = q.data() + r * NH * D;
    auto heads = [&](size_t h0, size_t h1, std::vector<double>& scr) {
      for (size_t h = h0; h < h1; ++h)
        cpu::attend(qr + int64_t(h) * D, keys.data(), keys.data(), int64_t(keys.size()), 0, int(D), scale,
                    L.sinks.data() + h, o + int64_t(h) * D, scr);
    };
    if (row_parallel) {
      heads(0, size_t(NH), scratch);
    } else {
      const int64_t grain = std::max<int64_t>(1, kParallelWork / (int64_t(keys.size()) * D));
      pool->parallel_for(size_t(NH), size_t(grain), [&](size_t h0, size_t h1) {
        std::vector<double> scr;
        heads(h0, h1, scr);
      });
    }
    rotate(rope, pos, o + D - RD, int(NH), D, true);
  };
  auto rows = [&](size_t r_begin, size_t r_end) {
    std::vector<double> scratch, qd;
    std::vector<float> sc;
    std::vector<int32_t> pick;
    std::vector<const float*> keys;
    for (size_t r = r_begin; r < r_end; ++r) run_row(int64_t(r), scratch, qd, sc, pick, keys);
  };
  if (row_parallel)
    pool->parallel_for(size_t(R), 1, rows);
  else
    rows(0, size_t(R));
  // 3. Each ring keeps its sequence's last W positions; the reads are counted.
  for (size_t b = 0; b < batch.size(); ++b) {
    float* ring = states[b].data() + L.ring_off;
    const int64_t r0 = flat.first_row[b], n = int64_t(batch[b].tokens.size()), start = int64_t(batch[b].seq->length());
    for (int64_t p = std::max(start, start + n - W); p < start + n; ++p)
      std::memcpy(ring + (p % W) * D, kv.data() + (r0 + p - start) * D, size_t(D) * sizeof(float));
    uint64_t read = 0;
    for (int64_t r = r0; r < r0 + n; ++r) read += keys_read[size_t(r)];
    tokens_read += read;
    if (batch[b].attention_tokens_read) *batch[b].attention_tokens_read += read;
  }
  // Grouped output projection: heads [g * NH/G, (g + 1) * NH/G) through o_a's rows [g * rank, (g + 1) * rank).
  HostBuffer<float> grp(size_t(R * GW)), mid(size_t(R * G * o_rank_)), part(size_t(R * o_rank_));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(grp.data() + r * GW, out.data() + r * NH * D + g * GW, size_t(GW) * sizeof(float));
    cpu::matmul(grp.data(), R, L.o_a.row_slice(g * o_rank_, o_rank_), nullptr, part.data(), pool);
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(mid.data() + r * G * o_rank_ + g * o_rank_, part.data() + r * o_rank_,
                  size_t(o_rank_) * sizeof(float));
  }
  cpu::matmul(mid.data(), R, L.o_b, nullptr, y, pool);
}

void DeepseekV4::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  const int64_t H = hidden_, NHC = hc_.n, MIX = (2 + NHC) * NHC;
  const BatchRows flat = flatten_batch(batch, n_vocab_, "deepseek_v4");
  const int64_t R = int64_t(flat.rows.size());
  ThreadPool* pool = pool_.get();
  std::vector<std::vector<float>> states(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    const uint8_t* st = batch[b].seq->state_ptr();
    check(st != nullptr, DZ_ERR_INTERNAL, "deepseek_v4 forward: the sequence's arena has no state slot");
    states[b].assign(reinterpret_cast<const float*>(st), reinterpret_cast<const float*>(st) + state_floats_);
  }
  std::vector<int32_t> tokens(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const ForwardItem& it = batch[flat.rows[size_t(r)].item];
    tokens[size_t(r)] = it.tokens[size_t(flat.rows[size_t(r)].pos - int64_t(it.seq->length()))];
  }
  // Streams x [R x n x H], every stream starting as the embedding.
  HostBuffer<float> x(size_t(R * NHC * H)), normed(size_t(R * NHC * H)), col(size_t(R * H)), xn(size_t(R * H)),
      y(size_t(R * H)), mix(size_t(R * MIX)), w(size_t(R * (2 * NHC + NHC * NHC)));
  ends_.embed_rows(batch, flat, H, col.data());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NHC; ++j) std::memcpy(x.data() + (r * NHC + j) * H, col.data() + r * H, size_t(H) * 4);
  // The streams' mix logits and weights, then their collapse into col.
  auto hc_pre = [&](const Hc& hc) {
    cpu::rms_norm(x.data(), R, NHC * H, nullptr, eps_, normed.data());
    cpu::matmul(normed.data(), R, hc.fn, nullptr, mix.data(), pool);
    for (int64_t r = 0; r < R; ++r) {
      float* wr = w.data() + r * (2 * NHC + NHC * NHC);
      cpu::hc_weights(hc_, mix.data() + r * MIX, hc.base.data(), hc.scale.data(), wr, wr + NHC, wr + 2 * NHC);
      cpu::hc_collapse(hc_, x.data() + r * NHC * H, wr, col.data() + r * H);
    }
  };
  auto hc_post = [&] {
    for (int64_t r = 0; r < R; ++r) {
      const float* wr = w.data() + r * (2 * NHC + NHC * NHC);
      cpu::hc_expand(hc_, x.data() + r * NHC * H, y.data() + r * H, wr + NHC, wr + 2 * NHC);
    }
  };
  uint64_t tokens_read = 0;
  for (int li = 0; li < n_layers_; ++li) {
    opt.poll_abort();
    const Layer& L = layers_[size_t(li)];
    hc_pre(L.attn_hc);
    cpu::rms_norm(col.data(), R, H, L.in_norm.data(), eps_, xn.data());
    attention(L, li, batch, flat, xn.data(), states, y.data(), tokens_read);
    hc_post();
    hc_pre(L.ffn_hc);
    cpu::rms_norm(col.data(), R, H, L.post_norm.data(), eps_, xn.data());
    ffn_forward(L.ffn, routing_, H, xn.data(), R, y.data(), pool, tokens.data());
    hc_post();
  }
  opt.poll_abort();
  cpu::rms_norm(x.data(), R, NHC * H, nullptr, eps_, normed.data());
  cpu::matmul(normed.data(), R, head_hc_.fn, nullptr, mix.data(), pool);
  for (int64_t r = 0; r < R; ++r) {
    float* hw = w.data() + r * NHC;
    cpu::hc_head_weights(hc_, mix.data() + r * NHC, head_hc_.base.data(), head_hc_.scale[0], hw);
    cpu::hc_collapse(hc_, x.data() + r * NHC * H, hw, col.data() + r * H);
  }
  ends_.logits(batch, flat, col.data(), H, eps_, xn.data(), pool);
  for (size_t b = 0; b < batch.size(); ++b)
    std::memcpy(batch[b].seq->state_ptr(), states[b].data(), state_floats_ * sizeof(float));
  if (opt.attention_tokens_read) *opt.attention_tokens_read += tokens_read;
}

}  // namespace

std::unique_ptr<Family> make_deepseek_v4(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  return make_on_device<DeepseekV4>("deepseek_v4", make_deepseek_v4_cuda, cfg, ws, params);
}

}  // namespace dz
