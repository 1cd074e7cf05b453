// DeepSeek-V4 on the CUDA backend: the CPU family's computation (see
// deepseek_v4.cpp) with the kernels of kernels/cuda on the device.
//  - mHC: the streams' mix logits in fp32 (RMS-normalised streams against
//    fn), the weights with their Sinkhorn iterations and the collapse in one
//    launch a sublayer, the expand in another (cuda/hyper_connection.h).
//  - Attention: BF16 projections; the compressors' pools and the windows in
//    each sequence's state slot on the device, the compressed entries (fp32)
//    in the pages as the CPU lays them out (entry w over the token slots of
//    w * rate ..; 4-byte slots); the CSA indexer's fp32 scores over the
//    entries and the exact top-k of the DSA indexer; attention with sinks
//    over the window and the visible or picked entries
//    (cuda/compressed_attention.h); the grouped output projection as one BF16
//    GEMM a group.
//  - MoE: the router's logits in BF16, sqrt(softplus) scores, hash or scored
//    choice on the device; routed experts in BF16 through cuda::Bf16Experts
//    or in MXFP4 (DeepSeek's FP4 experts) through cuda::MoeLayer, and the
//    shared expert as BF16 GEMMs, all with V4's clamped SwiGLU.
// A forward works on copies of its sequences' states and moves them into the
// slots only once every pass has run, so a failed or cancelled call leaves the
// state as it was. Decode steps run as CUDA graphs (cuda::GraphCache), as
// deepseek_v32's; other passes launch eagerly.
#include "model/deepseek_v4.h"
#include "runtime/device.h"

#ifndef DZ_WITH_CUDA

namespace dz {
std::unique_ptr<Family> make_deepseek_v4_cuda(const Config&, const WeightStore&, const dz_model_params&) {
  require_cuda_device("deepseek_v4");  // (throws: no CUDA backend in this build)
  return nullptr;
}
}  // namespace dz

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "common/log.h"
#include "cuda/bf16_gemm.h"
#include "cuda/compressed_attention.h"
#include "cuda/dsa_indexer.h"
#include "cuda/hyper_connection.h"
#include "cuda/mla.h"
#include "cuda/moe.h"
#include "cuda/moe_bf16.h"
#include "cuda/norm.h"
#include "cuda/router.h"
#include "model/cuda_model.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/graph_cache.h"
#include "runtime/cuda/kv_storage.h"
#include "runtime/cuda/packer.h"
#include "runtime/cuda/upload.h"
#include "runtime/device.h"

namespace dz {

namespace {

using cuda::DeviceArray;
using v4::Attn;

constexpr int kDefaultRows = 2048;                 // rows a device pass holds unless pass_tokens says otherwise
constexpr size_t kScoreFloats = size_t(64) << 20;  // CSA scores a launch: rows x visible entries
constexpr int kLogitRows = CudaModelCore::kLogitRows;

struct DevHc {
  DeviceArray<float> fn, base, scale;
};
struct DevComp {
  DeviceArray<uint16_t> kv_gate;  // [2 S dim, H]: the kv rows, then the gate rows
  DeviceArray<float> bias, norm;
};
struct DevLayer {
  DevHc attn_hc, ffn_hc;
  DeviceArray<float> in_norm, post_norm, q_a_norm, kv_norm, sinks;
  DeviceArray<uint16_t> q_a, q_b, kv, o_a, o_b, iq_b, iweights;
  DevComp comp, icomp;
  DeviceArray<uint16_t> router, w13, w2;  // w13 [E][2I][H] (gate rows, up rows), w2 [E][H][I]
  DeviceArray<float> router_bias;
  DeviceArray<int32_t> hash;  // [vocab][k] or empty
  DevMlp shared;
  DevMxfp4Experts fp4;  // routed experts in MXFP4
};

// Page bytes a token of a compressed layer: the CPU's rule rounded up to whole floats.
size_t token_bytes_of(const v4::Layer& L) {
  if (L.kind == Attn::Sliding) return 0;
  const size_t b = (L.entry_floats * sizeof(float) + size_t(L.rate) - 1) / size_t(L.rate);
  return (b + 3) / 4 * 4;
}

class DeepseekV4Cuda final : public CudaFamily<DeepseekV4Desc> {
 public:
  DeepseekV4Cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    for (const v4::Layer& L : layers_) l.layer_token_bytes.push_back(token_bytes_of(L));
    l.state_slot_bytes = state_floats_ * sizeof(float);
    l.model_key = gpu_key_;
    return l;
  }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;

 private:
  // Per-pass device metadata the layers read.
  struct PassMeta {
    int T = 0, n_seg = 0;
    const int32_t *tok = nullptr, *seg_first = nullptr, *row_seg = nullptr;
    const int64_t* pos = nullptr;
    float* const* state = nullptr;
    uint8_t*** row_tables = nullptr;  // [L][T]
    // cos / sin [T][half]: main and compress RoPE at each row's position, compress at its CSA / HCA window's start
    const float *cos_main, *sin_main, *cos_comp, *sin_comp, *cos_csa, *sin_csa, *cos_hca, *sin_hca;
    const int64_t *vis_csa, *vis_hca;  // entries each row sees
    int64_t max_vis_csa = 0, max_vis_hca = 0;
    int max_close_csa = 0, max_close_hca = 0;  // the most windows one segment closes
    uint32_t page_tokens = 0;
  };
  void pass(std::span<ForwardItem> batch, const BatchRows& flat, int64_t r0, int64_t r1,
            const std::vector<int32_t>& page_ids, const std::vector<int32_t>& item_page, kv::Arena& arena,
            std::vector<char>& touched, const ForwardOptions& opt);
  void attention(const DevLayer& D, const v4::Layer& L, int li, const PassMeta& m, float* y, cudaStream_t s);
  void hc_pre(const DevHc& hc, bool head, int T, float* col, cudaStream_t s);

  uint64_t gpu_key_ = 0;
  int64_t rate_csa_ = 0, rate_hca_ = 0;
  bool mxfp4_experts_ = false;
  std::unique_ptr<cuda::Bf16Experts> experts_;
  std::vector<DevLayer> dl_;
  DevHc head_;
  DeviceArray<float> ones_;  // the per-head query norm has no weight
  // Pass scratch (grown on demand).
  DeviceArray<float> x_, col_, xn_, y_, w_, qres_, q_, kv_, cbuf_, icbuf_, iq_, iw_, scores_, att_, mid_, rlog_, gw_,
      state_, hc_part_;
  DeviceArray<uint16_t> xb_, qresb_, grp_, midb_;
  DeviceArray<int32_t> ids_, sel_;
  DeviceArray<uint8_t> meta_;
};

DeepseekV4Cuda::DeepseekV4Cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
    : CudaFamily("deepseek_v4", params, kDefaultRows, cfg, ws) {
  const std::string& src = cfg.source();
  check(hc_.n <= cuda::kHcMaxStreams, DZ_ERR_UNSUPPORTED, src, ": hc_mult ", hc_.n, " (the CUDA mHC takes at most ",
        cuda::kHcMaxStreams, " streams)");
  check(head_dim_ % 32 == 0 && head_dim_ <= 512, DZ_ERR_UNSUPPORTED, src, ": head_dim ", head_dim_,
        " (the CUDA attention takes multiples of 32 up to 512)");
  check(routing_.n_experts <= 256 && routing_.n_active <= 16, DZ_ERR_UNSUPPORTED, src, ": ", routing_.n_experts,
        " experts top-", routing_.n_active, " (CUDA router: at most 256, top-16)");
  // The experts: all BF16 (transformers' layout) or all MXFP4 (DeepSeek's FP4 experts).
  ExpertFormats ef;
  for (const v4::Layer& L : layers_) {
    ef.add(L.ffn.experts);
    if (L.kind == Attn::Csa) rate_csa_ = L.rate;
    if (L.kind == Attn::Hca) rate_hca_ = L.rate;
  }
  mxfp4_experts_ = ef.all_mxfp4(src);
  gpu_key_ = fnv1a(cfg.json().dump(), fnv1a("deepseek_v4 cuda kv: f32 entries|index keys per m tokens, 4-byte "
                                            "slots; state f32 window ring, softmax pools v1 " +
                                            std::to_string(weights_bytes_)));

  const int64_t H = hidden_, NHC = hc_.n, D = head_dim_, NH = n_heads_, QL = q_lora_, G = o_groups_, R = o_rank_;
  const int64_t ID = idx_dim_, IH = idx_heads_, E = routing_.n_experts, k = routing_.n_active, I = moe_inter_;
  // Scratch a row (bytes); the MoE layer says what it reserves.
  const cuda::MoeShape ms{int(E), int(k), int(H), int(I), cuda::MoeActivation::kSilu, routing_.swiglu_limit};
  const size_t moe_scratch = mxfp4_experts_ ? cuda::MoeLayer::reserved_bytes(ms, max_rows_) : 0;
  const int64_t row = 4 * (NHC * H + 4 * H + 2 * NHC + NHC * NHC + QL + NH * D + D + 4 * D + 4 * ID + IH * ID + IH +
                           NH * D + G * R + E + k + 2 * I) +
                      2 * (H + QL + NH * D + G * R) + 4 * k + 4 * int64_t(std::min<int64_t>(idx_topk_, 1 << 20)) + 1024;
  size_t dev_weights = size_t(64) << 20;
  auto as_bf16 = [&](const cpu::WeightRef& w) { dev_weights += size_t(w.rows * w.cols) * 2; };
  auto as_f32 = [&](const cpu::WeightRef& w) { dev_weights += size_t(w.rows * w.cols) * 4; };
  as_bf16(ends_.embed);
  if (ends_.lm_head.data != ends_.embed.data) as_bf16(ends_.lm_head);
  as_f32(head_hc_.fn);
  for (const v4::Layer& L : layers_) {
    as_f32(L.attn_hc.fn), as_f32(L.ffn_hc.fn);
    for (const cpu::WeightRef* w : {&L.q_a, &L.q_b, &L.kv, &L.o_a, &L.o_b, &L.comp.kv, &L.comp.gate, &L.icomp.kv,
                                    &L.icomp.gate, &L.iq_b, &L.iweights, &L.ffn.router})
      if (w->data) as_bf16(*w);
    if (L.ffn.shared.inter) as_bf16(L.ffn.shared.gate), as_bf16(L.ffn.shared.up), as_bf16(L.ffn.shared.down);
    for (const SwiGlu& x : L.ffn.experts)
      for (const cpu::WeightRef* w : {&x.gate, &x.up, &x.down})
        dev_weights += mxfp4_experts_ ? size_t(w->rows * w->cols) / 32 * 17 : size_t(w->rows * w->cols) * 2;
    dev_weights += L.ffn.hash.size() * 4;
  }
  const size_t scratch = size_t(max_rows_) * size_t(row) + moe_scratch + kScoreFloats * 4 +
                         size_t(kLogitRows) * n_vocab_ * 4 + 64 * state_floats_ * 4 + (size_t(1) << 30);
  core_ = std::make_unique<CudaModelCore>(dev_, dev_weights + scratch, "deepseek_v4");
  if (mxfp4_experts_) {
    moe_ = std::make_unique<cuda::MoeLayer>(core_->ctx(), ms, max_rows_);
  } else {
    experts_ = std::make_unique<cuda::Bf16Experts>(core_->ctx(), core_->gemm(), int(E), int(k), int(H), int(I));
    experts_->set_swiglu_limit(routing_.swiglu_limit);
  }

  cuda::WeightLoader ld(core_->ctx().pool(), weights_bytes_, params, "deepseek_v4");
  auto f32 = [&](const cpu::WeightRef& w, const char* what) {
    std::vector<float> v(size_t(w.rows * w.cols));
    for (int64_t r = 0; r < w.rows; ++r) w.decode_row(r, v.data() + r * w.cols);
    return ld.array(v, what);
  };
  auto load_hc = [&](const v4::Hc& h, DevHc& d) {
    d.fn = f32(h.fn, "hc fn");
    d.base = ld.array(h.base, "hc base");
    d.scale = ld.array(h.scale, "hc scale");
  };
  auto load_comp = [&](const v4::Compressor& c, DevComp& d) {
    d.kv_gate = ld.bf16({&c.kv, &c.gate}, "compressor kv_proj/gate_proj");
    d.bias = ld.array(c.bias, "compressor position_bias");
    d.norm = ld.array(c.norm, "compressor kv_norm");
  };
  core_->load_ends(ld, ends_);
  load_hc(head_hc_, head_);
  ones_ = ld.array(std::vector<float>(size_t(std::max(D, ID)), 1.0f), "ones");
  dl_.resize(size_t(n_layers_));
  for (int li = 0; li < n_layers_; ++li) {
    const v4::Layer& L = layers_[size_t(li)];
    DevLayer& d = dl_[size_t(li)];
    load_hc(L.attn_hc, d.attn_hc);
    load_hc(L.ffn_hc, d.ffn_hc);
    d.in_norm = ld.array(L.in_norm, "input_layernorm");
    d.post_norm = ld.array(L.post_norm, "post_attention_layernorm");
    d.q_a_norm = ld.array(L.q_a_norm, "q_a_norm");
    d.kv_norm = ld.array(L.kv_norm, "kv_norm");
    d.sinks = ld.array(L.sinks, "sinks");
    d.q_a = ld.bf16({&L.q_a}, "q_a_proj");
    d.q_b = ld.bf16({&L.q_b}, "q_b_proj");
    d.kv = ld.bf16({&L.kv}, "kv_proj");
    d.o_a = ld.bf16({&L.o_a}, "o_a_proj");
    d.o_b = ld.bf16({&L.o_b}, "o_b_proj");
    if (L.kind != Attn::Sliding) load_comp(L.comp, d.comp);
    if (L.kind == Attn::Csa) {
      load_comp(L.icomp, d.icomp);
      d.iq_b = ld.bf16({&L.iq_b}, "indexer q_b_proj");
      d.iweights = ld.bf16({&L.iweights}, "indexer weights_proj");
    }
    d.router = ld.bf16({&L.ffn.router}, "router");
    if (!L.ffn.router_bias.empty()) d.router_bias = ld.array(L.ffn.router_bias, "e_score_correction_bias");
    if (!L.ffn.hash.empty()) d.hash = ld.array(L.ffn.hash, "tid2eid");
    if (L.ffn.shared.inter) d.shared = CudaModelCore::load_mlp(ld, L.ffn.shared);
    if (mxfp4_experts_) {
      d.fp4 = CudaModelCore::load_mxfp4_experts(ld, L.ffn.experts, H, I);
      continue;
    }
    std::vector<const cpu::WeightRef*> w13, w2;
    for (const SwiGlu& x : L.ffn.experts) w13.push_back(&x.gate), w13.push_back(&x.up), w2.push_back(&x.down);
    d.w13 = ld.bf16(w13, "experts gate/up");
    d.w2 = ld.bf16(w2, "experts down");
  }
  ld.finish(src);
  device_bytes_ = ld.bytes();
  DZ_CUDA_CHECK(cudaDeviceSynchronize());
  log_info("deepseek_v4 on ", core_->ctx().describe(), ": ", device_bytes_ >> 20,
           " MiB of weights on the device (checkpoint ", weights_bytes_ >> 20, " MiB)");
}

void DeepseekV4Cuda::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  std::lock_guard<std::mutex> lk(mu_);
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  const BatchRows flat = flatten_batch(batch, n_vocab_, "deepseek_v4");
  std::vector<int32_t> page_ids, item_page;
  kv::Arena& arena = CudaModelCore::batch_pages(batch, page_ids, item_page, "deepseek_v4");
  for (size_t b = 0; b < batch.size(); ++b)
    check(batch[b].seq->state_ptr() != nullptr, DZ_ERR_INTERNAL,
          "deepseek_v4 forward: the sequence's arena has no state slot");
  room(state_, batch.size() * state_floats_, "states (pass copies)");
  std::vector<char> touched(batch.size(), 0);
  const int64_t R = int64_t(flat.rows.size());
  for (int64_t r0 = 0; r0 < R; r0 += max_rows_)
    pass(batch, flat, r0, std::min<int64_t>(R, r0 + max_rows_), page_ids, item_page, arena, touched, opt);
  // Every pass ran: the copies become the sequences' states.
  cudaStream_t s = core_->stream();
  for (size_t b = 0; b < batch.size(); ++b)
    if (touched[b])
      DZ_CUDA_CHECK(cudaMemcpyAsync(batch[b].seq->state_ptr(), state_.get() + b * state_floats_, state_floats_ * 4,
                                    cudaMemcpyDeviceToDevice, s));
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  // Keys attended, as the CPU counts them: the window, then the visible (HCA) or picked (CSA) entries.
  uint64_t total = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    uint64_t n = 0;
    const int64_t start = int64_t(batch[b].seq->length());
    for (size_t t = 0; t < batch[b].tokens.size(); ++t) {
      const int64_t pos = start + int64_t(t);
      for (const v4::Layer& L : layers_) {
        n += uint64_t(std::min(window_, pos + 1));
        if (L.kind == Attn::Hca) n += uint64_t((pos + 1) / L.rate);
        if (L.kind == Attn::Csa) n += uint64_t(std::min(idx_topk_, (pos + 1) / L.rate));
      }
    }
    total += n;
    if (batch[b].attention_tokens_read) *batch[b].attention_tokens_read += n;
  }
  if (opt.attention_tokens_read) *opt.attention_tokens_read += total;
}

void DeepseekV4Cuda::hc_pre(const DevHc& hc, bool head, int T, float* col, cudaStream_t s) {
  cuda::HcPre a;
  a.n_rows = T, a.n = hc_.n, a.hidden = hidden_, a.x = x_.get(), a.fn = hc.fn.get(), a.base = hc.base.get();
  a.scale = hc.scale.get(), a.head = head, a.eps = eps_, a.hc_eps = hc_.hc_eps, a.sinkhorn_iters = hc_.sinkhorn_iters;
  a.w = w_.get(), a.col = col;
  a.partial = room(hc_part_, cuda::hc_pre_scratch_floats(a), "mHC partial sums");
  cuda::hc_pre(a, s);
}

void DeepseekV4Cuda::attention(const DevLayer& D, const v4::Layer& L, int li, const PassMeta& m, float* y,
                               cudaStream_t s) {
  const int T = m.T, H = int(hidden_), HD = int(head_dim_), NH = int(n_heads_), QL = int(q_lora_);
  const int RD = int(rope_dim_), half = RD / 2, G = int(o_groups_), OR = int(o_rank_);
  const int ID = int(idx_dim_), IH = int(idx_heads_);
  const bool csa = L.kind == Attn::Csa, compressed = L.kind != Attn::Sliding;
  cuda::Bf16Gemm& gemm = core_->gemm();
  const uint16_t* xb = xb_.get();
  const float* cs = L.kind == Attn::Sliding ? m.cos_main : m.cos_comp;
  const float* sn = L.kind == Attn::Sliding ? m.sin_main : m.sin_comp;

  float* qres = room(qres_, size_t(T) * QL, "q_a out");
  uint16_t* qresb = room(qresb_, size_t(T) * QL, "q_a out bf16");
  float* q = room(q_, size_t(T) * NH * HD, "q");
  float* kv = room(kv_, size_t(T) * HD, "kv");
  gemm.run(xb, D.q_a.get(), nullptr, qres, T, QL, H, 0.f, s);
  cuda::rms_norm(qres, nullptr, T, QL, D.q_a_norm.get(), eps_, nullptr, qresb, s);
  gemm.run(qresb, D.q_b.get(), nullptr, q, T, NH * HD, QL, 0.f, s);
  cuda::rms_norm(q, nullptr, T * NH, HD, ones_.get(), eps_, q, nullptr, s);
  gemm.run(xb, D.kv.get(), nullptr, kv, T, HD, H, 0.f, s);
  cuda::rms_norm(kv, nullptr, T, HD, D.kv_norm.get(), eps_, kv, nullptr, s);
  cuda::rope_interleaved_rows(q, T, NH, int64_t(NH) * HD, HD, HD - RD, half, cs, sn, false, s);
  cuda::rope_interleaved_rows(kv, T, 1, HD, HD, HD - RD, half, cs, sn, false, s);

  cuda::EntryPages pages;
  pages.rows = m.row_tables + size_t(li) * T;
  pages.page_tokens = m.page_tokens;
  pages.token_bytes = uint32_t(token_bytes_of(L));
  pages.rate = L.rate;
  const int64_t* vis = csa ? m.vis_csa : m.vis_hca;
  const int64_t max_vis = csa ? m.max_vis_csa : m.max_vis_hca;
  if (compressed) {
    const int S = csa ? 2 : 1;
    float* cb = room(cbuf_, size_t(T) * 2 * S * HD, "compressor kv|gate");
    gemm.run(xb, D.comp.kv_gate.get(), nullptr, cb, T, 2 * S * HD, H, 0.f, s);
    cuda::CompressPass c;
    c.n_seg = m.n_seg, c.seg_first = m.seg_first, c.pos = m.pos, c.state = m.state, c.pages = pages;
    c.cos = csa ? m.cos_csa : m.cos_hca, c.sin = csa ? m.sin_csa : m.sin_hca, c.rope_half = half, c.eps = eps_;
    c.max_close = csa ? m.max_close_csa : m.max_close_hca;
    auto set = [&](cuda::Compressor& k, const v4::Compressor& src, const DevComp& d, const float* buf, int dim,
                   int off) {
      k.dim = dim, k.overlap = src.overlap, k.kv = buf, k.gate = buf + int64_t(S) * dim, k.ld = 2 * int64_t(S) * dim;
      k.bias = d.bias.get(), k.norm = d.norm.get(), k.state_off = int64_t(src.state_off), k.entry_off = off;
    };
    set(c.c[0], L.comp, D.comp, cb, HD, 0);
    c.n_comp = 1;
    if (csa) {
      float* icb = room(icbuf_, size_t(T) * 2 * S * ID, "indexer compressor kv|gate");
      gemm.run(xb, D.icomp.kv_gate.get(), nullptr, icb, T, 2 * S * ID, H, 0.f, s);
      set(c.c[1], L.icomp, D.icomp, icb, ID, HD);
      c.n_comp = 2;
    }
    cuda::compress(c, s);
  }
  cuda::SinkAttention a;
  int k = 0;
  if (csa && max_vis > 0) {
    // The indexer's queries (RoPE'd as the compressed layers' keys) and head weights, its scores over every
    // visible entry, then the exact top-k, rows in chunks that keep the scores under kScoreFloats.
    float* iq = room(iq_, size_t(T) * IH * ID, "indexer q");
    float* iw = room(iw_, size_t(T) * IH, "indexer weights");
    gemm.run(qresb, D.iq_b.get(), nullptr, iq, T, IH * ID, QL, 0.f, s);
    cuda::rope_interleaved_rows(iq, T, IH, int64_t(IH) * ID, ID, ID - RD, half, m.cos_comp, m.sin_comp, false, s);
    gemm.run(xb, D.iweights.get(), nullptr, iw, T, IH, H, 0.f, s);
    k = int(std::min<int64_t>(idx_topk_, max_vis));
    int32_t* sel = room(sel_, size_t(T) * k, "indexer picks");
    const int chunk = int(std::max<int64_t>(1, std::min<int64_t>(T, int64_t(kScoreFloats) / max_vis)));
    float* sc = room(scores_, size_t(chunk) * max_vis, "indexer scores");
    for (int r0 = 0; r0 < T; r0 += chunk) {
      const int n = std::min(chunk, T - r0);
      cuda::EntryScores e;
      e.n_rows = n, e.heads = IH, e.dim = ID, e.q = iq + size_t(r0) * IH * ID, e.w = iw + size_t(r0) * IH;
      e.wscale = float(1.0 / std::sqrt(double(IH))), e.scale = float(1.0 / std::sqrt(double(ID)));
      e.n_visible = vis + r0, e.max_visible = max_vis, e.pages = pages, e.key_off = HD, e.scores = sc;
      e.pages.rows = pages.rows + r0, e.ld = max_vis;
      cuda::entry_scores(e, s);
      cuda::indexer_topk(sc, max_vis, n, vis + r0, max_vis, k, sel + size_t(r0) * k, s);
    }
    a.entries = cuda::SinkAttention::kPicked, a.sel = sel, a.k = k;
  } else if (L.kind == Attn::Hca && max_vis > 0) {
    a.entries = cuda::SinkAttention::kVisible;
  }
  float* att = room(att_, size_t(T) * NH * HD, "attention out");
  a.n_rows = T, a.n_heads = NH, a.head_dim = HD, a.window = int(window_);
  a.scale = float(1.0 / std::sqrt(double(HD)));
  a.q = q, a.sinks = D.sinks.get(), a.kv = kv, a.pos = m.pos, a.row_seg = m.row_seg, a.seg_first = m.seg_first;
  a.state = m.state, a.ring_off = int64_t(L.ring_off), a.n_visible = vis, a.pages = pages, a.out = att;
  cuda::sink_attention(a, s);
  cuda::window_store(kv, HD, int(window_), m.n_seg, m.seg_first, m.pos, m.state, int64_t(L.ring_off), s);
  cuda::rope_interleaved_rows(att, T, NH, int64_t(NH) * HD, HD, HD - RD, half, cs, sn, true, s);
  // Grouped output projection: heads of group g through o_a's rows [g OR, (g + 1) OR), then o_b.
  const int GW = NH * HD / G;
  uint16_t* grp = room(grp_, size_t(T) * NH * HD, "grouped attention out");
  float* mid = room(mid_, size_t(T) * G * OR, "o_a out");
  uint16_t* midb = room(midb_, size_t(T) * G * OR, "o_a out bf16");
  cuda::split_groups_bf16(att, T, G, GW, grp, s);
  for (int g = 0; g < G; ++g)
    gemm.run(grp + size_t(g) * T * GW, D.o_a.get() + size_t(g) * OR * GW, nullptr, mid + size_t(g) * T * OR, T, OR, GW,
             0.f, s);
  cuda::join_groups_bf16(mid, T, G, OR, midb, s);
  gemm.run(midb, D.o_b.get(), nullptr, y, T, H, G * OR, 0.f, s);
}

void DeepseekV4Cuda::pass(std::span<ForwardItem> batch, const BatchRows& flat, int64_t r0, int64_t r1,
                          const std::vector<int32_t>& page_ids, const std::vector<int32_t>& item_page, kv::Arena& arena,
                          std::vector<char>& touched, const ForwardOptions& opt) {
  const int T = int(r1 - r0), L = n_layers_, H = int(hidden_), V = n_vocab_;
  const int NHC = hc_.n, half = int(rope_dim_ / 2);
  cudaStream_t s = core_->stream();
  const size_t TS = size_t(T);

  // Row and segment metadata and RoPE tables, packed into one upload.
  std::vector<int32_t> tok(TS), row_first(TS), row_seg(TS), logit_rows, seg_first;
  std::vector<int64_t> pos(TS), vis_csa(TS), vis_hca(TS), layer_off(static_cast<size_t>(L));
  std::vector<float> tabs(TS * size_t(half) * 8);  // cos, sin: main, compress, CSA window start, HCA window start
  std::vector<float*> logit_dst, dev_dst, st;
  std::vector<int32_t*> argmax_dst;
  PassMeta m;
  m.T = T;
  auto tab = [&](int which, bool sin, int i) { return tabs.data() + (size_t(2 * which + sin) * TS + i) * half; };
  for (int i = 0; i < T; ++i) {
    const BatchRow& rw = flat.rows[size_t(r0 + i)];
    const ForwardItem& it = batch[rw.item];
    tok[size_t(i)] = it.tokens[size_t(r0 + i - flat.first_row[rw.item])];
    pos[size_t(i)] = rw.pos;
    row_first[size_t(i)] = item_page[rw.item];
    if (seg_first.empty() || flat.rows[size_t(r0 + seg_first.back())].item != rw.item) {
      seg_first.push_back(i);
      float* copy = state_.get() + rw.item * state_floats_;
      if (!touched[rw.item])  // the call's copy starts as the committed state
        DZ_CUDA_CHECK(cudaMemcpyAsync(copy, it.seq->state_ptr(), state_floats_ * 4, cudaMemcpyDeviceToDevice, s));
      touched[rw.item] = 1;
      st.push_back(copy);
    }
    row_seg[size_t(i)] = int32_t(seg_first.size() - 1);
    if (half) {
      cpu::rope_cos_sin(rope_main_, rw.pos, tab(0, false, i), tab(0, true, i));
      cpu::rope_cos_sin(rope_comp_, rw.pos, tab(1, false, i), tab(1, true, i));
      if (rate_csa_) cpu::rope_cos_sin(rope_comp_, rw.pos + 1 - rate_csa_, tab(2, false, i), tab(2, true, i));
      if (rate_hca_) cpu::rope_cos_sin(rope_comp_, rw.pos + 1 - rate_hca_, tab(3, false, i), tab(3, true, i));
    }
    vis_csa[size_t(i)] = rate_csa_ ? (rw.pos + 1) / rate_csa_ : 0;
    vis_hca[size_t(i)] = rate_hca_ ? (rw.pos + 1) / rate_hca_ : 0;
    m.max_vis_csa = std::max(m.max_vis_csa, vis_csa[size_t(i)]);
    m.max_vis_hca = std::max(m.max_vis_hca, vis_hca[size_t(i)]);
    const auto [lr0, nlr] = flat.logit_rows(batch, rw.item);
    if (r0 + i >= lr0 && r0 + i < lr0 + nlr) {
      logit_rows.push_back(i);
      logit_dst.push_back(it.logits ? it.logits + (r0 + i - lr0) * int64_t(V) : nullptr);
      dev_dst.push_back(it.logits ? nullptr : it.device_logits);
      argmax_dst.push_back(it.logits ? nullptr : it.argmax);
    }
  }
  m.n_seg = int(seg_first.size());
  seg_first.push_back(T);
  for (int g = 0; g < m.n_seg; ++g) {
    const int64_t first = pos[size_t(seg_first[size_t(g)])], last = pos[size_t(seg_first[size_t(g) + 1] - 1)];
    if (rate_csa_) m.max_close_csa = std::max(m.max_close_csa, int((last + 1) / rate_csa_ - first / rate_csa_));
    if (rate_hca_) m.max_close_hca = std::max(m.max_close_hca, int((last + 1) / rate_hca_ - first / rate_hca_));
  }
  // A decode step: every item one row, each a logit row, with no host sync in the experts. It runs as a CUDA
  // graph, its page count and the entries each CSA / HCA layer sees rounded up to powers of two (the pads are
  // never read: each row stops at its own visible count) so that one graph serves many steps.
  const bool decode =
      T == int(batch.size()) && int(logit_rows.size()) == T && T <= kLogitRows &&
      (moe_ ? path_ == cuda::MoePath::kFused || moe_->choose(T) == cuda::MoePath::kFused : experts_->few_slots(T));
  std::vector<int32_t> pids(page_ids);
  if (decode) {
    if (!pids.empty()) pids.resize(size_t(cuda::pow2_at_least(int64_t(pids.size()))), 0);
    if (m.max_vis_csa > 0) m.max_vis_csa = cuda::pow2_at_least(m.max_vis_csa);
    if (m.max_vis_hca > 0) m.max_vis_hca = cuda::pow2_at_least(m.max_vis_hca);
  }
  const int P = int(pids.size());
  for (int l = 0; l < L; ++l) layer_off[size_t(l)] = int64_t(arena.layer_offset(uint32_t(l)));
  cuda::Packer pk;
  const size_t o_tok = pk.add(tok), o_first = pk.add(row_first), o_rseg = pk.add(row_seg), o_seg = pk.add(seg_first),
               o_pos = pk.add(pos), o_vc = pk.add(vis_csa), o_vh = pk.add(vis_hca), o_lr = pk.add(logit_rows),
               o_dd = pk.add(dev_dst), o_st = pk.add(st), o_loff = pk.add(layer_off), o_pid = pk.add(pids),
               o_tabs = pk.add(tabs);
  const size_t o_tab = pk.tail();
  const size_t o_rtab = o_tab + (size_t(L) * P * 8 + 255) / 256 * 256;
  const size_t meta_bytes = o_rtab + size_t(L) * T * 8;
  // Every pass ends synchronized (its logits reach the host), so the metadata is free to rewrite.
  uint8_t* mb = room(meta_, meta_bytes, "batch metadata");
  DZ_CUDA_CHECK(cudaMemcpyAsync(mb, pk.bytes().data(), pk.bytes().size(), cudaMemcpyHostToDevice, s));
  auto at = [mb](size_t o) { return mb + o; };
  m.tok = reinterpret_cast<const int32_t*>(at(o_tok));
  m.seg_first = reinterpret_cast<const int32_t*>(at(o_seg));
  m.row_seg = reinterpret_cast<const int32_t*>(at(o_rseg));
  m.pos = reinterpret_cast<const int64_t*>(at(o_pos));
  m.vis_csa = reinterpret_cast<const int64_t*>(at(o_vc));
  m.vis_hca = reinterpret_cast<const int64_t*>(at(o_vh));
  m.state = reinterpret_cast<float* const*>(at(o_st));
  const float* dt = reinterpret_cast<const float*>(at(o_tabs));
  auto dtab = [&](int which, bool sin) { return dt + size_t(2 * which + sin) * TS * half; };
  m.cos_main = dtab(0, false), m.sin_main = dtab(0, true), m.cos_comp = dtab(1, false), m.sin_comp = dtab(1, true);
  m.cos_csa = dtab(2, false), m.sin_csa = dtab(2, true), m.cos_hca = dtab(3, false), m.sin_hca = dtab(3, true);
  m.page_tokens = arena.page_tokens();
  m.row_tables = reinterpret_cast<uint8_t***>(at(o_rtab));
  const int32_t* d_lr = reinterpret_cast<const int32_t*>(at(o_lr));
  float* const* d_dd = reinterpret_cast<float* const*>(at(o_dd));

  float* x = room(x_, TS * NHC * H, "residual streams");
  float* col = room(col_, TS * H, "collapsed streams");
  float* xn = mxfp4_experts_ ? room(xn_, TS * H, "normalised ffn input") : nullptr;
  float* y = room(y_, TS * H, "sublayer out");
  uint16_t* xb = room(xb_, TS * H, "x bf16");
  room(w_, TS * (2 * NHC + NHC * NHC), "mHC weights");
  const int E = routing_.n_experts, k = routing_.n_active;
  int32_t* ids = room(ids_, TS * k, "expert ids");
  float* gw = room(gw_, TS * k, "expert weights");
  float* rlog = room(rlog_, TS * E, "router logits");

  // The pass's launches up to the head's collapsed stream; no host synchronisation while capturing.
  auto layers = [&](bool capturing) {
    if (P > 0)
      cuda::paged_tables(arena.storage().data(), reinterpret_cast<const int32_t*>(at(o_pid)), P, arena.page_bytes(),
                         reinterpret_cast<const int64_t*>(at(o_loff)), L, reinterpret_cast<const int32_t*>(at(o_first)),
                         T, reinterpret_cast<uint8_t**>(at(o_tab)), m.row_tables, s);
    // Every stream starts as the embedding.
    core_->embed(m.tok, T, H, col, s);
    for (int j = 0; j < NHC; ++j)
      DZ_CUDA_CHECK(cudaMemcpy2DAsync(x + size_t(j) * H, size_t(NHC) * H * 4, col, size_t(H) * 4, size_t(H) * 4, TS,
                                      cudaMemcpyDeviceToDevice, s));
    for (int li = 0; li < L; ++li) {
      if (!capturing) core_->poll_abort(opt);
      const DevLayer& D = dl_[size_t(li)];
      const v4::Layer& Ly = layers_[size_t(li)];
      hc_pre(D.attn_hc, false, T, col, s);
      cuda::rms_norm(col, nullptr, T, H, D.in_norm.get(), eps_, nullptr, xb, s);
      attention(D, Ly, li, m, y, s);
      cuda::hc_post(x, y, w_.get(), T, NHC, H, s);
      hc_pre(D.ffn_hc, false, T, col, s);
      cuda::rms_norm(col, nullptr, T, H, D.post_norm.get(), eps_, xn, xb, s);
      core_->gemm().run(xb, D.router.get(), nullptr, rlog, T, E, H, 0.f, s);
      cuda::router_sqrt_softplus(rlog, D.router_bias.get(), D.hash.get(), m.tok, T, E, k, routing_.scale, ids, gw, s);
      DZ_CUDA_CHECK(cudaMemsetAsync(y, 0, TS * H * 4, s));
      if (moe_) {
        moe_->forward(D.fp4.weights(), xn, ids, gw, T, y, path_, true);  // y = experts(xn)
      } else {
        cuda::Bf16ExpertWeights bw;
        bw.w13 = D.w13.get(), bw.w2 = D.w2.get();
        experts_->forward(bw, xb, ids, gw, T, y, s);  // y = experts(xb)
      }
      if (D.shared.inter) core_->mlp(D.shared, xb, T, H, y, s, routing_.swiglu_limit);
      cuda::hc_post(x, y, w_.get(), T, NHC, H, s);
    }
    if (!capturing) core_->poll_abort(opt);
    hc_pre(head_, true, T, col, s);
  };

  const int64_t experts_gen = experts_ ? int64_t(experts_->scratch_generation()) : 0;
  const cuda::GraphCache::Key key =
      core_->step_key(T, P, arena, mb, {m.max_vis_csa, m.max_vis_hca, m.max_close_csa, m.max_close_hca, experts_gen});
  core_->run_pass(decode, key, opt, layers, col, d_lr, int(logit_rows.size()), H, V, eps_, xb, d_dd, logit_dst,
                  argmax_dst, moe_.get());
}

}  // namespace

std::unique_ptr<Family> make_deepseek_v4_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  return std::make_unique<DeepseekV4Cuda>(cfg, ws, params);
}

}  // namespace dz

#endif  // DZ_WITH_CUDA
