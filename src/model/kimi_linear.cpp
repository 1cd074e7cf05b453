// Kimi Linear (model_type kimi_linear) on the CPU backend: a hybrid of Kimi
// Delta Attention layers and MLA layers, with DeepSeek-V3-style MoE, loaded
// from Moonshot's published checkpoint layout.
//  - KDA layers (config linear_attn_config.kda_layers, or layer_types
//    "linear_attention"): q/k/v projections, each through a causal depthwise
//    short convolution and SiLU; the gated delta rule of cpu/kda.h with
//    per-channel decay g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) and
//    beta = sigmoid(b_proj(x)); output RMSNorm(o; o_norm) * sigmoid(g_b(g_a(x)))
//    per head, then o_proj. They cache nothing per token: each sequence's
//    convolution history and fp32 state [head][key][value] live in its
//    arena state slot. Both prefill and decode run the recurrence (the faster
//    form on the CPU; the chunked form is tested equal to it).
//  - MLA layers (full attention): no RoPE anywhere (mla_use_nope); the cache
//    keeps c_kv = RMSNorm(kv_a(x)[:rank]) and the shared, unrotated k_pe; q
//    from q_proj directly (no q LoRA); softmax scale
//    (nope + rope)^-0.5; every token attends to all positions up to its own
//    through the absorbed form of cpu/mla.h.
//  - FFN: a dense SwiGLU for the first first_k_dense_replace layers, then
//    routed experts (block_sparse_moe.experts.J.w1/w3/w2) with sigmoid
//    group-limited routing and shared experts (model/moe_ffn.h).
// A forward pass updates a copy of each sequence's state and writes it back
// only when every layer has run, so a failed or cancelled pass leaves the
// state as it was (the caller rolls back the pages).
#include "model/kimi_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "common/host_alloc.h"
#include "cpu/kda.h"
#include "cpu/matmul.h"
#include "cpu/mla.h"
#include "cpu/norm.h"
#include "model/weights.h"
#include "runtime/parallel.h"

namespace dz {

namespace {

using cpu::WeightRef;

class KimiLinear final : public Family, private KimiLinearDesc {
 public:
  KimiLinear(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

  void fill_info(dz_model_info& info) const override {
    fill_desc_info(info);
    info.device = DZ_DEVICE_CPU;
  }
  int32_t n_vocab() const override { return n_vocab_; }
  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    for (const KimiLinearLayer& L : layers_) l.layer_token_bytes.push_back(L.kda ? 0 : cpu::mla_latent_bytes(mla_));
    l.state_slot_bytes = state_floats_ * sizeof(float);
    l.model_key = model_key_;
    return l;
  }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;

 private:
  void kda_layer(const KimiLinearLayer& L, std::span<ForwardItem> batch, const BatchRows& flat, const float* xn,
                 std::vector<std::vector<float>>& states, float* y);
  void mla_layer(const KimiLinearLayer& L, int li, std::span<ForwardItem> batch, const BatchRows& flat, const float* xn,
                 float* y, uint64_t& tokens_read);

  uint64_t model_key_ = 0;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace

void KimiLinearDesc::fill_desc_info(dz_model_info& info) const {
  info.n_layers = n_layers_;
  info.n_vocab = n_vocab_;
  info.hidden_size = int32_t(hidden_);
  info.n_heads = mla_.n_heads;
  info.n_kv_heads = 1;  // MLA: one latent shared by every head
  info.n_experts = routing_.n_experts;
  info.n_experts_active = routing_.n_active;
  info.max_context = max_context_;
}

KimiLinearDesc::KimiLinearDesc(const Config& cfg, const WeightStore& ws) {
  const std::string& src = cfg.source();
  n_vocab_ = int32_t(cfg.get_positive_int("vocab_size"));
  hidden_ = cfg.get_positive_int("hidden_size");
  n_layers_ = int32_t(cfg.get_positive_int("num_hidden_layers"));
  eps_ = float(cfg.get_or<double>("rms_norm_eps", 1e-5));
  check(eps_ > 0, DZ_ERR_FORMAT, src, ": rms_norm_eps must be positive");
  max_context_ = cfg.has("model_max_length") ? cfg.get_positive_int("model_max_length")
                                             : cfg.get_positive_int_or("max_position_embeddings", 1048576);
  const std::string act = cfg.get_or<std::string>("hidden_act", "silu");
  check(act == "silu", DZ_ERR_UNSUPPORTED, src, ": hidden_act '", act, "' (kimi_linear uses silu)");

  // Which layers are KDA: layer_types, else linear_attn_config's 1-based lists.
  const nlohmann::json lac =
      cfg.has("linear_attn_config") ? cfg.json()["linear_attn_config"] : nlohmann::json::object();
  check(lac.is_object(), DZ_ERR_FORMAT, src, ": linear_attn_config must be an object");
  std::vector<int> kind(size_t(n_layers_), -1);  // 1 KDA, 0 MLA
  if (cfg.has("layer_types")) {
    const auto types = cfg.get<std::vector<std::string>>("layer_types");
    check(types.size() == size_t(n_layers_), DZ_ERR_FORMAT, src, ": layer_types has ", types.size(), " entries for ",
          n_layers_, " layers");
    for (size_t i = 0; i < types.size(); ++i) {
      check(types[i] == "linear_attention" || types[i] == "full_attention", DZ_ERR_FORMAT, src, ": layer_types[", i,
            "] = '", types[i], "' (expected linear_attention or full_attention)");
      kind[i] = types[i] == "linear_attention";
    }
  } else {
    check(lac.contains("kda_layers") && lac.contains("full_attn_layers"), DZ_ERR_FORMAT, src,
          ": neither layer_types nor linear_attn_config.kda_layers / full_attn_layers says which layers are KDA");
    for (const char* key : {"full_attn_layers", "kda_layers"}) {
      check(lac[key].is_array(), DZ_ERR_FORMAT, src, ": linear_attn_config.", key, " must be an array");
      for (const auto& v : lac[key]) {
        check(v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= n_layers_, DZ_ERR_FORMAT, src,
              ": linear_attn_config.", key, " holds ", v.dump(), " (layers are numbered 1..", n_layers_, ")");
        int& k = kind[size_t(v.get<int64_t>() - 1)];
        check(k < 0, DZ_ERR_FORMAT, src, ": layer ", v.get<int64_t>(), " is listed twice in linear_attn_config");
        k = std::string(key) == "kda_layers";
      }
    }
    for (int i = 0; i < n_layers_; ++i)
      check(kind[size_t(i)] >= 0, DZ_ERR_FORMAT, src, ": layer ", i + 1,
            " is in neither linear_attn_config.kda_layers nor full_attn_layers");
  }
  auto lac_int = [&](const char* key, const char* flat, int64_t fallback) {
    const int64_t v = lac.contains(key) ? lac[key].get<int64_t>() : cfg.get_or<int64_t>(flat, fallback);
    check(v > 0 && v <= 65536, DZ_ERR_FORMAT, src, ": linear attention ", key, " = ", v, " must be positive");
    return int(v);
  };
  kda_.n_heads = lac_int("num_heads", "linear_num_heads", 32);
  kda_.head_dim = lac_int("head_dim", "linear_head_dim", 128);
  kda_.conv_kernel = lac_int("short_conv_kernel_size", "linear_conv_kernel_dim", 4);
  check(kda_.proj() <= (int64_t(1) << 20), DZ_ERR_FORMAT, src, ": linear attention heads x head_dim = ", kda_.proj(),
        " is implausibly large");

  // MLA without RoPE.
  mla_.n_heads = int(cfg.get_positive_int("num_attention_heads"));
  mla_.rank = int(cfg.get_positive_int("kv_lora_rank"));
  mla_.nope = int(cfg.get_positive_int("qk_nope_head_dim"));
  mla_.rope = int(cfg.get_or<int64_t>("qk_rope_head_dim", 0));
  mla_.v = int(cfg.get_positive_int("v_head_dim"));
  check(mla_.rope >= 0, DZ_ERR_FORMAT, src, ": qk_rope_head_dim must not be negative");
  check(cfg.get_or<bool>("mla_use_nope", mla_.rope == 0), DZ_ERR_UNSUPPORTED, src,
        ": mla_use_nope is false: kimi_linear MLA layers with RoPE are not implemented (Kimi Linear uses none)");
  mla_.scale = float(1.0 / std::sqrt(double(mla_.nope + mla_.rope)));
  check(!cfg.has("q_lora_rank"), DZ_ERR_UNSUPPORTED, src,
        ": q_lora_rank is set: kimi_linear MLA layers with a low-rank query are not implemented (Kimi Linear "
        "projects q directly)");

  // MoE: Moonshot's field names first, then the DeepSeek/transformers ones.
  routing_.n_experts = int32_t(cfg.get_first_or<int64_t>({"num_experts", "num_local_experts", "n_routed_experts"}, 0));
  check(cfg.has("mlp_layer_types") || cfg.get_or<int64_t>("moe_layer_freq", 1) == 1, DZ_ERR_UNSUPPORTED, src,
        ": moe_layer_freq other than 1 (every layer after the dense ones is MoE)");
  const std::vector<bool> moe = moe_layers(cfg, n_layers_, 1);
  int64_t moe_inter = 0, n_shared = 0;
  if (std::count(moe.begin(), moe.end(), true) > 0) {
    check(routing_.n_experts > 0, DZ_ERR_FORMAT, src, ": num_experts must be positive for MoE layers");
    routing_.n_active = int32_t(cfg.get_first_or<int64_t>({"num_experts_per_token", "num_experts_per_tok"}, 0));
    check(routing_.n_active > 0, DZ_ERR_FORMAT, src, ": num_experts_per_token must be positive");
    const std::string fn = cfg.get_or<std::string>("moe_router_activation_func", "sigmoid");
    check(fn == "sigmoid", DZ_ERR_UNSUPPORTED, src, ": moe_router_activation_func '", fn, "' (sigmoid is supported)");
    if (cfg.get_or<bool>("use_grouped_topk", true)) {
      routing_.n_group = int32_t(cfg.get_first_or<int64_t>({"num_expert_group", "n_group"}, 1));
      routing_.topk_group = int32_t(cfg.get_or<int64_t>("topk_group", 1));
    }
    validate_routing(routing_, src);
    routing_.norm = cfg.get_first_or<bool>({"moe_renormalize", "norm_topk_prob"}, true);
    routing_.scale = float(cfg.get_or<double>("routed_scaling_factor", 1.0));
    moe_inter = cfg.get_positive_int("moe_intermediate_size");
    n_shared = cfg.get_first_or<int64_t>({"num_shared_experts", "n_shared_experts"}, 0);
    check(n_shared >= 0, DZ_ERR_FORMAT, src, ": num_shared_experts must not be negative");
  }

  const int64_t H = hidden_, P = kda_.proj(), D = kda_.head_dim, K = kda_.conv_kernel, NH = mla_.n_heads;
  const int64_t QD = mla_.nope + mla_.rope;
  ends_.load(ws, n_vocab_, H, cfg.get_or<bool>("tie_word_embeddings", false));
  layers_.resize(size_t(n_layers_));
  for (int i = 0; i < n_layers_; ++i) {
    KimiLinearLayer& l = layers_[size_t(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
    l.in_norm = vector_f32(ws, p + "input_layernorm.weight", {H});
    l.post_norm = vector_f32(ws, p + "post_attention_layernorm.weight", {H});
    l.kda = kind[size_t(i)] == 1;
    if (l.kda) {
      l.q = linear_weight(ws, a + "q_proj", P, H);
      l.k = linear_weight(ws, a + "k_proj", P, H);
      l.v = linear_weight(ws, a + "v_proj", P, H);
      for (const char* c : {"q_conv1d", "k_conv1d", "v_conv1d"}) {
        const std::vector<float> w = vector_f32(ws, a + c + ".weight", {P, 1, K});
        l.conv_w.insert(l.conv_w.end(), w.begin(), w.end());
      }
      l.f_a = linear_weight(ws, a + "f_a_proj", D, H);
      l.f_b = linear_weight(ws, a + "f_b_proj", P, D);
      l.dt_bias = vector_f32(ws, a + "dt_bias", {P});
      l.a_log = vector_f32(ws, a + "A_log", {1, 1, kda_.n_heads, 1});
      l.b = linear_weight(ws, a + "b_proj", kda_.n_heads, H);
      l.g_a = linear_weight(ws, a + "g_a_proj", D, H);
      l.g_b = linear_weight(ws, a + "g_b_proj", P, D);
      l.o_norm = vector_f32(ws, a + "o_norm.weight", {D});
      l.o = linear_weight(ws, a + "o_proj", H, P);
      l.state_off = state_floats_;
      state_floats_ += kda_.state_floats();
    } else {
      l.q = linear_weight(ws, a + "q_proj", NH * QD, H);
      l.kv_a = linear_weight(ws, a + "kv_a_proj_with_mqa", mla_.rank + mla_.rope, H);
      l.kv_a_norm = vector_f32(ws, a + "kv_a_layernorm.weight", {mla_.rank});
      l.kv_b = linear_weight(ws, a + "kv_b_proj", NH * (mla_.nope + mla_.v), mla_.rank);
      l.o = linear_weight(ws, a + "o_proj", H, NH * mla_.v);
    }
    l.ffn.moe = moe[size_t(i)];
    if (!l.ffn.moe) {
      const std::string m = p + "mlp.";
      l.ffn.dense = load_swiglu(ws, m + "gate_proj", m + "up_proj", m + "down_proj",
                                cfg.get_first_or<int64_t>({"dense_ffn_hidden", "intermediate_size"}, 0), H);
      continue;
    }
    const std::string m = p + "block_sparse_moe.";
    l.ffn.router = linear_weight(ws, m + "gate", routing_.n_experts, H);
    l.ffn.router_bias = vector_f32(ws, m + "gate.e_score_correction_bias", {routing_.n_experts});
    for (int e = 0; e < routing_.n_experts; ++e) {
      const std::string x = m + "experts." + std::to_string(e) + ".";
      l.ffn.experts.push_back(load_swiglu(ws, x + "w1", x + "w3", x + "w2", moe_inter, H));
    }
    if (n_shared > 0) {
      const std::string s = m + "shared_experts.";
      l.ffn.shared = load_swiglu(ws, s + "gate_proj", s + "up_proj", s + "down_proj", moe_inter * n_shared, H);
    }
  }
  weights_bytes_ = ws.total_bytes();
}

namespace {

KimiLinear::KimiLinear(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
    : KimiLinearDesc(cfg, ws) {
  check_cpu_family_params(params, "kimi_linear");
  model_key_ = fnv1a(cfg.json().dump(), fnv1a("kimi_linear kv: f32 c_kv|k_pe; state f32 conv|S[h][k][v] v1 " +
                                              std::to_string(ws.total_bytes())));
  pool_ = std::make_unique<ThreadPool>(params.n_threads);
}

void KimiLinear::kda_layer(const KimiLinearLayer& L, std::span<ForwardItem> batch, const BatchRows& flat,
                           const float* xn, std::vector<std::vector<float>>& states, float* y) {
  const int64_t R = int64_t(flat.rows.size()), P = kda_.proj(), D = kda_.head_dim, NH = kda_.n_heads;
  ThreadPool* pool = pool_.get();
  HostBuffer<float> proj(size_t(R * P)), qkv(size_t(R * 3 * P)), conv(size_t(R * 3 * P)), fa(size_t(R * D)),
      g(size_t(R * P)), beta(size_t(R * NH)), out(size_t(R * P));
  // [q | k | v] per row, the short convolutions' input.
  const WeightRef* proj_w[3] = {&L.q, &L.k, &L.v};
  for (int j = 0; j < 3; ++j) {
    cpu::matmul(xn, R, *proj_w[j], nullptr, proj.data(), pool);
    for (int64_t r = 0; r < R; ++r) std::memcpy(qkv.data() + r * 3 * P + j * P, proj.data() + r * P, size_t(P) * 4);
  }
  cpu::matmul(xn, R, L.f_a, nullptr, fa.data(), pool);
  cpu::matmul(fa.data(), R, L.f_b, nullptr, g.data(), pool);
  cpu::matmul(xn, R, L.b, nullptr, beta.data(), pool);
  for (size_t b = 0; b < batch.size(); ++b) {
    const int64_t r0 = flat.first_row[b], n = int64_t(batch[b].tokens.size());
    float* st = states[b].data() + L.state_off;
    float *c = conv.data() + r0 * 3 * P, *gb = g.data() + r0 * P, *bb = beta.data() + r0 * NH;
    cpu::short_conv_silu(qkv.data() + r0 * 3 * P, n, 3 * P, 3 * P, L.conv_w.data(), kda_.conv_kernel, st, c);
    cpu::kda_prepare(kda_, n, c, c + P, 3 * P, gb, P, L.a_log.data(), L.dt_bias.data(), bb);
    float* S = st + kda_.conv_floats();
    // Token by token for prefill too: on the CPU the recurrence's D^2 work a token beats the chunked form's
    // C x D exponentials a token (bench/results/kda-2026-12-05-cpu.json, dz bench kda at the 48B model's
    // 32 x 128 heads, 512 tokens, one thread: 491 us a token a layer against 582 in chunks of 16 and 1092 in
    // chunks of 64). The chunked form, the GPU's formulation, is held equal to it by the tests.
    cpu::kda_recurrent(kda_, c, c + P, c + 2 * P, 3 * P, gb, P, bb, n, S, out.data() + r0 * P, pool);
  }
  // The output gate reuses g's buffer.
  cpu::matmul(xn, R, L.g_a, nullptr, fa.data(), pool);
  cpu::matmul(fa.data(), R, L.g_b, nullptr, g.data(), pool);
  cpu::kda_output_gate(kda_, R, out.data(), g.data(), L.o_norm.data(), eps_);
  cpu::matmul(out.data(), R, L.o, nullptr, y, pool);
}

void KimiLinear::mla_layer(const KimiLinearLayer& L, int li, std::span<ForwardItem> batch, const BatchRows& flat,
                           const float* xn, float* y, uint64_t& tokens_read) {
  const int64_t R = int64_t(flat.rows.size()), NH = mla_.n_heads, QD = mla_.nope + mla_.rope;
  const int64_t KVA = mla_.rank + mla_.rope, OD = NH * mla_.v;
  ThreadPool* pool = pool_.get();
  HostBuffer<float> q(size_t(R * NH * QD)), kva(size_t(R * KVA)), att(size_t(R * OD)),
      kvb(size_t(NH * (mla_.nope + mla_.v) * mla_.rank));
  cpu::matmul(xn, R, L.q, nullptr, q.data(), pool);
  cpu::matmul(xn, R, L.kv_a, nullptr, kva.data(), pool);
  for (int64_t r = 0; r < R; ++r) {
    float* lat = kva.data() + r * KVA;
    cpu::rms_norm(lat, 1, mla_.rank, L.kv_a_norm.data(), eps_, lat);
    kv::Sequence& seq = *batch[flat.rows[size_t(r)].item].seq;
    const size_t pos = size_t(flat.rows[size_t(r)].pos);
    std::memcpy(seq.arena().token_ptr(seq.page_of(pos), uint32_t(li), seq.slot_of(pos)), lat,
                cpu::mla_latent_bytes(mla_));
  }
  for (int64_t n = 0; n < L.kv_b.rows; ++n) L.kv_b.decode_row(n, kvb.data() + n * mla_.rank);
  // Full causal attention: position p reads positions 0..p (a prefix of one index list).
  int64_t max_pos = 0;
  for (const BatchRow& row : flat.rows) max_pos = std::max(max_pos, row.pos);
  std::vector<int32_t> all(size_t(max_pos + 1));
  std::iota(all.begin(), all.end(), 0);
  std::vector<const uint8_t*> base;
  for (size_t b = 0; b < batch.size(); ++b) {
    kv::Sequence& seq = *batch[b].seq;
    base.clear();
    for (kv::PageId pg : seq.pages()) base.push_back(seq.arena().token_ptr(pg, uint32_t(li), 0));
    const cpu::PagedRows latent{base.data(), seq.arena().page_tokens(), cpu::mla_latent_bytes(mla_), 0};
    const int64_t r0 = flat.first_row[b], n = int64_t(batch[b].tokens.size());
    uint64_t read = 0;
    for (int64_t r = r0; r < r0 + n; ++r)
      read += uint64_t(cpu::mla_decode(mla_, q.data() + r * NH * QD, kvb.data(), latent, all.data(),
                                       int(flat.rows[size_t(r)].pos + 1), att.data() + r * OD, pool));
    tokens_read += read;
    if (batch[b].attention_tokens_read) *batch[b].attention_tokens_read += read;
  }
  cpu::matmul(att.data(), R, L.o, nullptr, y, pool);
}

void KimiLinear::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  const int64_t H = hidden_;
  const BatchRows flat = flatten_batch(batch, n_vocab_, "kimi_linear");
  const int64_t R = int64_t(flat.rows.size());
  ThreadPool* pool = pool_.get();
  // Each sequence's state, copied in; written back once every layer has run.
  std::vector<std::vector<float>> states(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    states[b].resize(state_floats_);
    if (state_floats_) {
      const uint8_t* st = batch[b].seq->state_ptr();
      check(st != nullptr, DZ_ERR_INTERNAL, "kimi_linear forward: the sequence's arena has no state slot");
      std::memcpy(states[b].data(), st, state_floats_ * sizeof(float));
    }
  }
  HostBuffer<float> x(size_t(R * H)), xn(size_t(R * H)), tmp(size_t(R * H));
  ends_.embed_rows(batch, flat, H, x.data());
  uint64_t tokens_read = 0;
  for (int li = 0; li < n_layers_; ++li) {
    opt.poll_abort();
    const KimiLinearLayer& L = layers_[size_t(li)];
    cpu::rms_norm(x.data(), R, H, L.in_norm.data(), eps_, xn.data());
    if (L.kda)
      kda_layer(L, batch, flat, xn.data(), states, tmp.data());
    else
      mla_layer(L, li, batch, flat, xn.data(), tmp.data(), tokens_read);
    for (int64_t i = 0; i < R * H; ++i) x[size_t(i)] += tmp[size_t(i)];
    cpu::rms_norm(x.data(), R, H, L.post_norm.data(), eps_, xn.data());
    ffn_forward(L.ffn, routing_, H, xn.data(), R, tmp.data(), pool);
    for (int64_t i = 0; i < R * H; ++i) x[size_t(i)] += tmp[size_t(i)];
  }
  opt.poll_abort();
  ends_.logits(batch, flat, x.data(), H, eps_, xn.data(), pool);
  for (size_t b = 0; b < batch.size(); ++b)
    if (state_floats_) std::memcpy(batch[b].seq->state_ptr(), states[b].data(), state_floats_ * sizeof(float));
  if (opt.attention_tokens_read) *opt.attention_tokens_read += tokens_read;
}

}  // namespace

std::unique_ptr<Family> make_kimi_linear(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  return make_on_device<KimiLinear>("kimi_linear", make_kimi_linear_cuda, cfg, ws, params);
}

}  // namespace dz
