// gpt-oss on the CPU backend, computed as transformers' GptOssForCausalLM
// does: RMSNorm, YaRN RoPE (half-split), GQA with attention sinks and a
// sliding window on alternate layers, top-k router with softmax over the
// selected logits, MXFP4 experts with clamped SwiGLU over interleaved
// gate/up rows. Weights stay in checkpoint precision (BF16 via the mmap,
// experts 4-bit); rows are decoded on the fly.
#include "model/gpt_oss.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/host_alloc.h"
#include "cpu/attention.h"
#include "cpu/matmul.h"
#include "cpu/moe.h"
#include "cpu/mxfp4.h"
#include "cpu/norm.h"
#include "cpu/rope.h"
#include "model/rope_config.h"
#include "model/weights.h"
#include "runtime/parallel.h"

namespace dz {

namespace {

using cpu::WeightRef;

GptOssMxfp4 mxfp4_experts(const WeightStore& ws, const std::string& prefix, int64_t n_experts, int64_t rows,
                          int64_t cols) {
  const std::string bn = prefix + "_blocks", sn = prefix + "_scales";
  if (!ws.has(bn) && ws.has(prefix))
    fail(DZ_ERR_UNSUPPORTED, "tensor ", prefix,
         ": dequantised expert weights are not supported yet; this build loads the published MXFP4 layout (", bn, " + ",
         sn, ")");
  const TensorView& b = ws.get(bn);
  const TensorView& s = ws.get(sn);
  for (const TensorView* t : {&b, &s})
    check(t->dtype == DType::U8, DZ_ERR_FORMAT, "tensor ", t->name, ": dtype ", dtype_name(t->dtype),
          " (expected U8 for MXFP4; in ", t->file ? *t->file : std::string("?"), ")");
  const int64_t groups = cols / cpu::kMxfp4Group;
  check_shape(b, {n_experts, rows, groups, cpu::kMxfp4GroupBytes});
  check_shape(s, {n_experts, rows, groups});
  const size_t bad = cpu::find_e8m0_nan(s.data, s.nbytes);
  if (bad != SIZE_MAX) {
    const int64_t e = int64_t(bad) / (rows * groups), n = int64_t(bad) / groups % rows, g = int64_t(bad) % groups;
    fail(DZ_ERR_FORMAT, "tensor ", sn, ": scale byte 0xFF (E8M0 NaN) at [", e, ", ", n, ", ", g, "] (byte ", bad,
         " of the tensor, in ", s.file ? *s.file : std::string("?"), "); the checkpoint is corrupt");
  }
  return {b.data, s.data, rows, cols};
}

class GptOss final : public Family, private GptOssDesc {
 public:
  GptOss(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

  void fill_info(dz_model_info& info) const override {
    fill_desc_info(info);
    info.device = DZ_DEVICE_CPU;
  }
  int32_t n_vocab() const override { return n_vocab_; }
  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    // Per token per layer: K then V, fp32, n_kv_heads x head_dim each.
    l.layer_token_bytes.assign(size_t(n_layers_), size_t(2 * kv_dim()) * sizeof(float));
    l.model_key = model_key_;
    return l;
  }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;
  void set_router_trace(std::vector<float>* m) { router_trace_ = m; }

 private:
  // Round GEMM inputs and the cached K, V as the CUDA backend does (DZ_ACTIVATIONS_BF16).
  void round_bf16(float* x, int64_t n) const {
    if (bf16_act_) cpu::round_to_bf16(x, size_t(n));
  }
  bool bf16_act_ = false;
  std::vector<float>* router_trace_ = nullptr;
  uint64_t model_key_ = 0;
  mutable std::unique_ptr<ThreadPool> pool_;
};

GptOss::GptOss(const Config& cfg, const WeightStore& ws, const dz_model_params& params) : GptOssDesc(cfg, ws) {
  check(params.experts == DZ_EXPERTS_AUTO || params.experts == DZ_EXPERTS_NATIVE, DZ_ERR_UNSUPPORTED,
        "gpt_oss: the CPU backend decodes experts in checkpoint precision only (DZ_EXPERTS_AUTO or "
        "DZ_EXPERTS_NATIVE), not dz_expert_precision ",
        int(params.experts));
  bf16_act_ = params.activations == DZ_ACTIVATIONS_BF16;
  // Rounded activations give different K/V: the prefix cache must not mix the two.
  model_key_ = fnv1a(bf16_act_ ? "gpt_oss kv: f32 K|V per layer, host, bf16 activations and K|V v2"
                               : "gpt_oss kv: f32 K|V per layer, host v1",
                     config_hash_);
  pool_ = std::make_unique<ThreadPool>(params.n_threads);
}

void GptOss::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  const int64_t H = hidden_, QD = q_dim(), KVD = kv_dim(), hd = head_dim_, half = hd / 2;
  const BatchRows flat = flatten_batch(batch, n_vocab_, "gpt_oss");
  const std::vector<BatchRow>& rows = flat.rows;
  const int64_t R = int64_t(rows.size());
  ThreadPool* pool = pool_.get();

  HostBuffer<float> x(size_t(R * H)), xn(size_t(R * H)), q(size_t(R * QD)), k(size_t(R * KVD)), v(size_t(R * KVD)),
      att(size_t(R * QD)), tmp(size_t(R * H)), cs(size_t(R * half)), sn(size_t(R * half)),
      router(size_t(R * n_experts_)), route_w(size_t(R * n_active_));
  HostBuffer<int32_t> route_i(size_t(R * n_active_));
  std::vector<float> xr;  // BF16-rounded router input (DZ_ACTIVATIONS_BF16)
  cpu::Glu glu = glu_;
  glu.round_f16 = bf16_act_;
  for (int64_t r = 0; r < R; ++r) {
    const ForwardItem& it = batch[rows[size_t(r)].item];
    embed_.decode_row(it.tokens[size_t(rows[size_t(r)].pos - int64_t(it.seq->length()))], x.data() + r * H);
    cpu::rope_cos_sin(rope_, rows[size_t(r)].pos, cs.data() + r * half, sn.data() + r * half);
  }

  // Per item: K/V row pointers for the positions any of its rows reads.
  std::vector<std::vector<const float*>> kp(batch.size()), vp(batch.size());
  std::vector<int64_t> kv_lo(batch.size());
  struct Task {
    int64_t row;
    int head;
  };
  std::vector<Task> tasks;
  for (int64_t r = 0; r < R; ++r)
    for (int h = 0; h < n_heads_; ++h) tasks.push_back({r, h});
  uint64_t tokens_read = 0;

  for (int li = 0; li < n_layers_; ++li) {
    opt.poll_abort();
    const GptOssLayer& L = layers_[size_t(li)];
    cpu::rms_norm(x.data(), R, H, L.in_norm.data(), eps_, xn.data());
    round_bf16(xn.data(), R * H);
    cpu::matmul(xn.data(), R, L.q, or_null(L.bq), q.data(), pool);
    cpu::matmul(xn.data(), R, L.k, or_null(L.bk), k.data(), pool);
    cpu::matmul(xn.data(), R, L.v, or_null(L.bv), v.data(), pool);
    for (int64_t r = 0; r < R; ++r) {
      cpu::rope_half_split(q.data() + r * QD, n_heads_, hd, int(half), cs.data() + r * half, sn.data() + r * half);
      cpu::rope_half_split(k.data() + r * KVD, n_kv_heads_, hd, int(half), cs.data() + r * half, sn.data() + r * half);
      // Write this token's K and V into its reserved slot of the page table.
      kv::Sequence& seq = *batch[rows[size_t(r)].item].seq;
      const int64_t pos = rows[size_t(r)].pos;
      float* dst = reinterpret_cast<float*>(
          seq.arena().token_ptr(seq.page_of(size_t(pos)), uint32_t(li), seq.slot_of(size_t(pos))));
      round_bf16(k.data() + r * KVD, KVD);  // the CUDA cache holds bf16 K and V
      round_bf16(v.data() + r * KVD, KVD);
      std::memcpy(dst, k.data() + r * KVD, size_t(KVD) * sizeof(float));
      std::memcpy(dst + KVD, v.data() + r * KVD, size_t(KVD) * sizeof(float));
    }
    for (size_t b = 0; b < batch.size(); ++b) {
      kv::Sequence& seq = *batch[b].seq;
      const int64_t start = int64_t(seq.length()), end = start + int64_t(batch[b].tokens.size());
      kv_lo[b] = L.sliding ? std::max<int64_t>(0, start - window_ + 1) : 0;
      kp[b].resize(size_t(end - kv_lo[b]));
      vp[b].resize(size_t(end - kv_lo[b]));
      for (int64_t p = kv_lo[b]; p < end; ++p) {
        const float* row = reinterpret_cast<const float*>(
            seq.arena().token_ptr(seq.page_of(size_t(p)), uint32_t(li), seq.slot_of(size_t(p))));
        kp[b][size_t(p - kv_lo[b])] = row;
        vp[b][size_t(p - kv_lo[b])] = row + KVD;
      }
    }
    const int group = n_heads_ / n_kv_heads_;
    parallel_for(pool, tasks.size(), 4, [&](size_t t0, size_t t1) {
      std::vector<double> scratch;
      for (size_t t = t0; t < t1; ++t) {
        const Task& tk = tasks[t];
        const BatchRow& rw = rows[size_t(tk.row)];
        const int64_t lo = L.sliding ? std::max<int64_t>(0, rw.pos - window_ + 1) : 0;
        const int64_t off = lo - kv_lo[rw.item];
        cpu::attend(q.data() + tk.row * QD + int64_t(tk.head) * hd, kp[rw.item].data() + off, vp[rw.item].data() + off,
                    rw.pos - lo + 1, int64_t(tk.head / group) * hd, int(hd), scale_, &L.sinks[size_t(tk.head)],
                    att.data() + tk.row * QD + int64_t(tk.head) * hd, scratch);
      }
    });
    for (int64_t r = 0; r < R; ++r) {
      const BatchRow& rw = rows[size_t(r)];
      const uint64_t n = uint64_t(rw.pos - (L.sliding ? std::max<int64_t>(0, rw.pos - window_ + 1) : 0) + 1);
      tokens_read += n;
      if (batch[rw.item].attention_tokens_read) *batch[rw.item].attention_tokens_read += n;
    }
    round_bf16(att.data(), R * QD);
    cpu::matmul(att.data(), R, L.o, or_null(L.bo), tmp.data(), pool);
    for (int64_t i = 0; i < R * H; ++i) x[size_t(i)] += tmp[size_t(i)];

    cpu::rms_norm(x.data(), R, H, L.post_norm.data(), eps_, xn.data());
    if (bf16_act_) {  // the router reads BF16, the experts FP16 scaled per token (fused path)
      xr.assign(xn.data(), xn.data() + R * H);
      cpu::round_to_bf16(xr.data(), xr.size());
      cpu::round_to_f16_scaled(xn.data(), size_t(R), size_t(H));
    }
    cpu::matmul(bf16_act_ ? xr.data() : xn.data(), R, L.router, L.router_bias.data(), router.data(), pool);
    if (router_trace_ && n_active_ < n_experts_)
      for (int64_t r = 0; r < R; ++r) {
        std::vector<float> l(router.data() + r * n_experts_, router.data() + (r + 1) * n_experts_);
        std::nth_element(l.begin(), l.begin() + n_active_, l.end(), std::greater<float>());
        const float next = l[size_t(n_active_)];
        router_trace_->push_back(*std::min_element(l.begin(), l.begin() + n_active_) - next);
      }
    for (int64_t r = 0; r < R; ++r)
      cpu::router_topk_softmax(router.data() + r * n_experts_, n_experts_, n_active_, route_i.data() + r * n_active_,
                               route_w.data() + r * n_active_);
    cpu::moe_forward(
        xn.data(), R, H, inter_, route_i.data(), route_w.data(), n_active_, n_experts_,
        [&](int e) {
          return cpu::ExpertWeights{L.gate_up.expert(e), L.gate_up_bias.data() + size_t(e) * size_t(2 * inter_),
                                    L.down.expert(e), L.down_bias.data() + size_t(e) * size_t(H)};
        },
        glu, tmp.data(), pool);
    for (int64_t i = 0; i < R * H; ++i) x[size_t(i)] += tmp[size_t(i)];
  }
  opt.poll_abort();

  // Final norm and lm_head over the rows whose logits are wanted.
  for (size_t b = 0; b < batch.size(); ++b) {
    const auto [r0, nr] = flat.logit_rows(batch, b);
    cpu::rms_norm(x.data() + r0 * H, nr, H, final_norm_.data(), eps_, xn.data());
    round_bf16(xn.data(), nr * H);
    cpu::matmul(xn.data(), nr, lm_head_, nullptr, batch[b].logits, pool);
  }
  if (opt.attention_tokens_read) *opt.attention_tokens_read += tokens_read;
}

}  // namespace

cpu::WeightRef GptOssMxfp4::expert(int e) const {
  cpu::WeightRef w;
  w.kind = cpu::WeightKind::MXFP4;
  w.rows = rows;
  w.cols = cols;
  w.data = blocks + size_t(e) * size_t(rows) * size_t(cols / 2);
  w.scales = scales + size_t(e) * size_t(rows) * size_t(cols / cpu::kMxfp4Group);
  return w;
}

GptOssDesc::GptOssDesc(const Config& cfg, const WeightStore& ws) {
  const std::string& src = cfg.source();
  n_vocab_ = int32_t(cfg.get_positive_int("vocab_size"));
  hidden_ = cfg.get_positive_int("hidden_size");
  inter_ = cfg.get_positive_int("intermediate_size");
  n_layers_ = int32_t(cfg.get_positive_int("num_hidden_layers"));
  n_heads_ = int32_t(cfg.get_positive_int("num_attention_heads"));
  n_kv_heads_ = cfg.has("num_key_value_heads") ? int32_t(cfg.get_positive_int("num_key_value_heads")) : n_heads_;
  head_dim_ = cfg.has("head_dim") ? int32_t(cfg.get_positive_int("head_dim")) : int32_t(hidden_ / n_heads_);
  n_experts_ = int32_t(cfg.get_positive_int("num_local_experts"));
  n_active_ = int32_t(cfg.has("num_experts_per_tok") ? cfg.get_positive_int("num_experts_per_tok")
                                                     : cfg.get_positive_int("experts_per_token"));
  max_context_ = cfg.get_positive_int_or("max_position_embeddings", 131072);
  eps_ = float(cfg.get_or<double>("rms_norm_eps", 1e-5));
  check(n_heads_ % n_kv_heads_ == 0, DZ_ERR_FORMAT, src, ": num_attention_heads ", n_heads_,
        " is not a multiple of num_key_value_heads ", n_kv_heads_);
  check(n_active_ <= n_experts_, DZ_ERR_FORMAT, src, ": num_experts_per_tok ", n_active_, " exceeds num_local_experts ",
        n_experts_);
  check(hidden_ % cpu::kMxfp4Group == 0 && inter_ % cpu::kMxfp4Group == 0, DZ_ERR_FORMAT, src,
        ": hidden_size and intermediate_size must be multiples of 32 for MXFP4 experts");
  check(eps_ > 0, DZ_ERR_FORMAT, src, ": rms_norm_eps must be positive");
  scale_ = float(1.0 / std::sqrt(double(head_dim_)));
  glu_.kind = cpu::Glu::Kind::ClampedOss;
  glu_.alpha = 1.702f;
  glu_.limit = float(cfg.get_or<double>("swiglu_limit", 7.0));
  rope_ = cpu::rope_freqs(rope_params_from_config(cfg, head_dim_, 150000.0));
  check(rope_.inv_freq.size() * 2 == size_t(head_dim_), DZ_ERR_UNSUPPORTED, src,
        ": partial rotary embeddings are not supported for gpt_oss");

  std::vector<std::string> types;
  if (cfg.has("layer_types")) {
    types = cfg.get<std::vector<std::string>>("layer_types");
    check(types.size() == size_t(n_layers_), DZ_ERR_FORMAT, src, ": layer_types has ", types.size(), " entries for ",
          n_layers_, " layers");
  } else {
    for (int i = 0; i < n_layers_; ++i) types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  }
  if (cfg.has("sliding_window")) window_ = cfg.get<int64_t>("sliding_window");
  const bool bias = cfg.get_or<bool>("attention_bias", true);
  const bool tied = cfg.get_or<bool>("tie_word_embeddings", false);

  const int64_t H = hidden_, I = inter_, E = n_experts_;
  embed_ = linear_weight(ws, "model.embed_tokens", n_vocab_, H);
  lm_head_ = tied ? embed_ : linear_weight(ws, "lm_head", n_vocab_, H);
  final_norm_ = vector_f32(ws, "model.norm.weight", {H});
  layers_.resize(size_t(n_layers_));
  for (int i = 0; i < n_layers_; ++i) {
    GptOssLayer& l = layers_[size_t(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    check(types[size_t(i)] == "sliding_attention" || types[size_t(i)] == "full_attention", DZ_ERR_FORMAT, src,
          ": layer_types[", i, "] = '", types[size_t(i)], "' (expected sliding_attention or full_attention)");
    l.sliding = types[size_t(i)] == "sliding_attention";
    check(!l.sliding || window_ > 0, DZ_ERR_FORMAT, src, ": layer ", i,
          " is sliding_attention but sliding_window is missing or not positive");
    l.in_norm = vector_f32(ws, p + "input_layernorm.weight", {H});
    l.post_norm = vector_f32(ws, p + "post_attention_layernorm.weight", {H});
    l.q = linear_weight(ws, p + "self_attn.q_proj", q_dim(), H);
    l.k = linear_weight(ws, p + "self_attn.k_proj", kv_dim(), H);
    l.v = linear_weight(ws, p + "self_attn.v_proj", kv_dim(), H);
    l.o = linear_weight(ws, p + "self_attn.o_proj", H, q_dim());
    if (bias) {
      l.bq = vector_f32(ws, p + "self_attn.q_proj.bias", {q_dim()});
      l.bk = vector_f32(ws, p + "self_attn.k_proj.bias", {kv_dim()});
      l.bv = vector_f32(ws, p + "self_attn.v_proj.bias", {kv_dim()});
      l.bo = vector_f32(ws, p + "self_attn.o_proj.bias", {H});
    }
    l.sinks = vector_f32(ws, p + "self_attn.sinks", {n_heads_});
    l.router = linear_weight(ws, p + "mlp.router", E, H);
    l.router_bias = vector_f32(ws, p + "mlp.router.bias", {E});
    l.gate_up = mxfp4_experts(ws, p + "mlp.experts.gate_up_proj", E, 2 * I, H);
    l.gate_up_bias = vector_f32(ws, p + "mlp.experts.gate_up_proj_bias", {E, 2 * I});
    l.down = mxfp4_experts(ws, p + "mlp.experts.down_proj", E, H, I);
    l.down_bias = vector_f32(ws, p + "mlp.experts.down_proj_bias", {E, H});
  }
  config_hash_ = fnv1a(cfg.json().dump(), fnv1a(std::to_string(ws.total_bytes())));
}

void GptOssDesc::fill_desc_info(dz_model_info& info) const {
  info.n_layers = n_layers_;
  info.n_vocab = n_vocab_;
  info.hidden_size = int32_t(hidden_);
  info.n_heads = n_heads_;
  info.n_kv_heads = n_kv_heads_;
  info.n_experts = n_experts_;
  info.n_experts_active = n_active_;
  info.max_context = max_context_;
}

void gpt_oss_set_router_trace(Family& family, std::vector<float>* margins) {
  auto* f = dynamic_cast<GptOss*>(&family);
  check(f != nullptr, DZ_ERR_INVALID_ARGUMENT, "gpt_oss_set_router_trace: not the CPU gpt_oss family");
  f->set_router_trace(margins);
}

// The factory row in registry.cpp.
// DZ_DEVICE_AUTO takes the GPU when one is present and usable, else the CPU.
std::unique_ptr<Family> make_gpt_oss(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  return make_on_device<GptOss>("gpt_oss", make_gpt_oss_cuda, cfg, ws, params);
}

}  // namespace dz
