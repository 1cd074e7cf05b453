// Kimi Linear on the CUDA backend: the CPU family's computation (see
// kimi_linear.cpp) with the kernels of kernels/cuda on the device.
//  - KDA layers: BF16 projections, the short convolutions, the gate and
//    decay preparation, the recurrence token by token (cuda/kda.h; prefill
//    too, not yet the chunked tensor-core form) and the gated output norm.
//    Each sequence's convolution history and fp32 state stay in its arena
//    state slot on the device. A forward reads the committed state and
//    writes a pass copy, moved into the slots only once every pass has run,
//    so a failed or cancelled call leaves the state as it was.
//  - MLA layers (no RoPE): the latent (RMSNorm c_kv | k_pe as projected) in
//    a bf16 cache record; absorbed attention over every visible position
//    (the sparse MLA kernels' dense causal mode; tensor cores at 512 + 64
//    and heads in 16s), W_UV after it.
//  - FFN: dense and shared MLPs as BF16 GEMMs, the sigmoid group-limited
//    router on the device, routed experts in BF16 through cuda::Bf16Experts
//    (one host sync a MoE layer); MXFP4 experts through cuda::MoeLayer.
// Decode steps run as CUDA graphs (cuda::GraphCache), as deepseek_v32's;
// other passes launch eagerly.
#include "model/kimi_linear.h"
#include "runtime/device.h"

#ifndef DZ_WITH_CUDA

namespace dz {
std::unique_ptr<Family> make_kimi_linear_cuda(const Config&, const WeightStore&, const dz_model_params&) {
  require_cuda_device("kimi_linear");  // (throws: no CUDA backend in this build)
  return nullptr;
}
}  // namespace dz

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "common/log.h"
#include "cuda/bf16_gemm.h"
#include "cuda/kda.h"
#include "cuda/mla.h"
#include "cuda/mla_sparse.h"
#include "cuda/moe.h"
#include "cuda/moe_bf16.h"
#include "cuda/norm.h"
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

constexpr int kDefaultRows = 16384;  // rows a device pass holds unless dz_model_params.pass_tokens says otherwise
constexpr int kLogitRows = CudaModelCore::kLogitRows;

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

struct DevLayer {
  bool kda = false, moe = false;
  DeviceArray<float> in_norm, post_norm;
  // KDA: qkv = [q; k; v] stacked; MLA: q, kv_a, kv_b; o for both.
  DeviceArray<uint16_t> qkv, f_a, f_b, g_a, g_b, b, q, kv_a, kv_b, o;
  DeviceArray<float> conv_w, a_log, dt_bias, o_norm, kv_a_norm;
  DevMlp dense, shared;
  DeviceArray<uint16_t> router, w13, w2;  // experts in BF16: w13 [E][2I][H] (gate rows, up rows), w2 [E][H][I]
  DeviceArray<float> router_bias;
  DevMxfp4Experts fp4;  // routed experts in MXFP4
};

class KimiLinearCuda final : public CudaFamily<KimiLinearDesc> {
 public:
  KimiLinearCuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    for (const KimiLinearLayer& L : layers_) l.layer_token_bytes.push_back(L.kda ? 0 : stride_);
    l.state_slot_bytes = state_floats_ * sizeof(float);
    l.model_key = model_key_;
    return l;
  }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;

 private:
  struct Segment {  // one item's rows within a pass
    int item, first, n;
  };
  void pass(std::span<ForwardItem> batch, const BatchRows& flat, int64_t r0, int64_t r1,
            const std::vector<int32_t>& page_ids, const std::vector<int32_t>& item_page, kv::Arena& arena,
            std::vector<char>& touched, const ForwardOptions& opt);
  void kda_layer(const DevLayer& D, const KimiLinearLayer& L, int T, int n_seg, int max_seg, const int32_t* seg_first,
                 float* const* st_in, float* const* st_out, cudaStream_t s);
  void mla_layer(const DevLayer& D, int T, const int64_t* row_off, const int64_t* n_vis, int64_t max_vis,
                 uint8_t* kv_layer, const uint8_t* const* const* pages, uint32_t page_tokens, cudaStream_t s);

  uint64_t model_key_ = 0;
  size_t stride_ = 0;  // an MLA record: bf16 [c_kv | k_pe], padded to 16 bytes
  int n_mla_ = 0;
  int64_t moe_inter_ = 0;
  bool mxfp4_experts_ = false;
  std::unique_ptr<cuda::Bf16Experts> bf16_experts_;
  std::vector<DevLayer> dl_;
  // Pass scratch (grown on demand).
  DeviceArray<float> x_, xn_, qkv_, conv_, fg_, g_, beta_, kout_, q_, kva_, qa_, olat_, rlog_, gw_, state_;
  DeviceArray<uint16_t> xb_, fgb_, ob_, att_, qab_;
  DeviceArray<int32_t> ids_;
  DeviceArray<uint8_t> meta_, mla_scratch_;
};

KimiLinearCuda::KimiLinearCuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
    : CudaFamily("kimi_linear", params, kDefaultRows, cfg, ws) {
  const std::string& src = cfg.source();
  check(kda_.head_dim == 16 || kda_.head_dim == 32 || kda_.head_dim == 64 || kda_.head_dim == 128, DZ_ERR_UNSUPPORTED,
        src, ": linear attention head_dim ", kda_.head_dim, " (the CUDA KDA kernels take 16, 32, 64 or 128)");
  check(mla_.rank <= cuda::kMlaGenericMaxRank && mla_.rope <= cuda::kMlaGenericMaxRope && mla_.rope % 2 == 0,
        DZ_ERR_UNSUPPORTED, src, ": kv_lora_rank ", mla_.rank, " / qk_rope_head_dim ", mla_.rope,
        " (the CUDA MLA takes at most ", cuda::kMlaGenericMaxRank, " / ", cuda::kMlaGenericMaxRope, ", even)");
  check(routing_.n_experts == 0 || (routing_.n_experts <= 256 && routing_.n_active <= 16), DZ_ERR_UNSUPPORTED, src,
        ": ", routing_.n_experts, " experts top-", routing_.n_active, " (CUDA router: at most 256, top-16)");
  stride_ = align16(size_t(mla_.rank + mla_.rope) * 2);
  for (const KimiLinearLayer& L : layers_) n_mla_ += !L.kda;
  model_key_ = fnv1a(cfg.json().dump(), fnv1a("kimi_linear cuda kv: bf16 c_kv|k_pe; state f32 conv|S[h][k][v] v1 " +
                                              std::to_string(weights_bytes_)));

  // The experts: all BF16 (Moonshot's checkpoints) or all MXFP4.
  ExpertFormats ef;
  for (const KimiLinearLayer& L : layers_) ef.add(L.ffn.experts);
  mxfp4_experts_ = ef.all_mxfp4(src);
  moe_inter_ = ef.inter;

  const int64_t H = hidden_, P = kda_.proj(), D = kda_.head_dim, NHK = kda_.n_heads, NH = mla_.n_heads;
  const int64_t QD = mla_.nope + mla_.rope, KVA = mla_.rank + mla_.rope, E = routing_.n_experts, k = routing_.n_active;
  int64_t inter = moe_inter_;
  for (const KimiLinearLayer& L : layers_) inter = std::max({inter, L.ffn.dense.inter, L.ffn.shared.inter});
  // Scratch a row: activations (fp32 and bf16), KDA and MLA projections, attention partials, the BF16 experts'
  // slots; the MXFP4 experts' layer says what it reserves.
  const int64_t slot = mxfp4_experts_ ? 0 : 4 + 2 * H + 8 * moe_inter_ + 2 * moe_inter_ + 4 * H;
  const cuda::MoeShape ms{int(E), int(k), int(H), int(moe_inter_), cuda::MoeActivation::kSilu};
  const size_t moe_scratch = moe_inter_ > 0 && mxfp4_experts_ ? cuda::MoeLayer::reserved_bytes(ms, max_rows_) : 0;
  const int64_t row = 4 * (2 * H + 3 * P + 3 * P + 2 * D + 2 * P + NHK + P + NH * QD + KVA +
                           NH * (KVA + 2 * mla_.rank) + E + 2 * inter) +
                      2 * (H + 2 * D + P + NH * mla_.v + inter + NH * KVA) + 64 + (E ? k * slot : 0);
  size_t dev_weights = size_t(64) << 20;
  auto as_bf16 = [&](const cpu::WeightRef& w) { dev_weights += size_t(w.rows * w.cols) * 2; };
  as_bf16(ends_.embed);
  if (ends_.lm_head.data != ends_.embed.data) as_bf16(ends_.lm_head);
  for (const KimiLinearLayer& L : layers_) {
    for (const cpu::WeightRef* w : {&L.q, &L.k, &L.v, &L.f_a, &L.f_b, &L.b, &L.g_a, &L.g_b, &L.o, &L.kv_a, &L.kv_b})
      if (w->data) as_bf16(*w);
    for (const SwiGlu* m : {&L.ffn.dense, &L.ffn.shared})
      if (m->inter) as_bf16(m->gate), as_bf16(m->up), as_bf16(m->down);
    if (!L.ffn.moe) continue;
    as_bf16(L.ffn.router);
    for (const SwiGlu& x : L.ffn.experts)
      for (const cpu::WeightRef* w : {&x.gate, &x.up, &x.down})
        dev_weights += mxfp4_experts_ ? size_t(w->rows * w->cols) / 32 * 17 : size_t(w->rows * w->cols) * 2;
  }
  // Pass copies of the states for up to 64 sequences.
  const size_t scratch = size_t(max_rows_) * size_t(row) + moe_scratch + size_t(kLogitRows) * size_t(n_vocab_) * 4 +
                         64 * state_floats_ * 4 + (size_t(1) << 30);
  core_ = std::make_unique<CudaModelCore>(dev_, dev_weights + scratch, "kimi_linear");
  if (moe_inter_ > 0 && mxfp4_experts_) {
    moe_ = std::make_unique<cuda::MoeLayer>(core_->ctx(), ms, max_rows_);
  } else if (moe_inter_ > 0) {
    bf16_experts_ =
        std::make_unique<cuda::Bf16Experts>(core_->ctx(), core_->gemm(), int(E), int(k), int(H), int(moe_inter_));
  }

  cuda::WeightLoader ld(core_->ctx().pool(), weights_bytes_, params, "kimi_linear");
  core_->load_ends(ld, ends_);
  dl_.resize(size_t(n_layers_));
  for (int li = 0; li < n_layers_; ++li) {
    const KimiLinearLayer& L = layers_[size_t(li)];
    DevLayer& d = dl_[size_t(li)];
    d.kda = L.kda;
    d.in_norm = ld.array(L.in_norm, "input_layernorm");
    d.post_norm = ld.array(L.post_norm, "post_attention_layernorm");
    d.o = ld.bf16({&L.o}, "o_proj");
    if (L.kda) {
      d.qkv = ld.bf16({&L.q, &L.k, &L.v}, "q_proj/k_proj/v_proj");
      d.f_a = ld.bf16({&L.f_a}, "f_a_proj");
      d.g_a = ld.bf16({&L.g_a}, "g_a_proj");
      d.f_b = ld.bf16({&L.f_b}, "f_b_proj");
      d.g_b = ld.bf16({&L.g_b}, "g_b_proj");
      d.b = ld.bf16({&L.b}, "b_proj");
      d.conv_w = ld.array(L.conv_w, "short convolutions");
      d.a_log = ld.array(L.a_log, "A_log");
      d.dt_bias = ld.array(L.dt_bias, "dt_bias");
      d.o_norm = ld.array(L.o_norm, "o_norm");
    } else {
      d.q = ld.bf16({&L.q}, "q_proj");
      d.kv_a = ld.bf16({&L.kv_a}, "kv_a_proj_with_mqa");
      d.kv_b = ld.bf16({&L.kv_b}, "kv_b_proj");
      d.kv_a_norm = ld.array(L.kv_a_norm, "kv_a_layernorm");
    }
    d.moe = L.ffn.moe;
    if (!d.moe) {
      d.dense = CudaModelCore::load_mlp(ld, L.ffn.dense);
      continue;
    }
    d.shared = CudaModelCore::load_mlp(ld, L.ffn.shared);
    d.router = ld.bf16({&L.ffn.router}, "router");
    d.router_bias = ld.array(L.ffn.router_bias, "e_score_correction_bias");
    if (!mxfp4_experts_) {
      std::vector<const cpu::WeightRef*> w13, w2;
      for (const SwiGlu& x : L.ffn.experts) w13.push_back(&x.gate), w13.push_back(&x.up), w2.push_back(&x.down);
      d.w13 = ld.bf16(w13, "experts w1/w3");
      d.w2 = ld.bf16(w2, "experts w2");
      continue;
    }
    d.fp4 = CudaModelCore::load_mxfp4_experts(ld, L.ffn.experts, H, moe_inter_);
  }
  ld.finish(src);
  device_bytes_ = ld.bytes();
  DZ_CUDA_CHECK(cudaDeviceSynchronize());
  log_info("kimi_linear on ", core_->ctx().describe(), ": ", device_bytes_ >> 20,
           " MiB of weights on the device (checkpoint ", weights_bytes_ >> 20, " MiB)");
}

void KimiLinearCuda::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  std::lock_guard<std::mutex> lk(mu_);
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  const BatchRows flat = flatten_batch(batch, n_vocab_, "kimi_linear");
  std::vector<int32_t> page_ids, item_page;
  kv::Arena& arena = CudaModelCore::batch_pages(batch, page_ids, item_page, "kimi_linear");
  for (size_t b = 0; b < batch.size(); ++b)
    check(state_floats_ == 0 || batch[b].seq->state_ptr() != nullptr, DZ_ERR_INTERNAL,
          "kimi_linear forward: the sequence's arena has no state slot");
  // Every item's state copy for this call: item b's at state_ + b * state_floats_.
  if (state_floats_) room(state_, batch.size() * state_floats_, "KDA states (pass copies)");
  std::vector<char> touched(batch.size(), 0);  // its copy holds this call's state so far
  const int64_t R = int64_t(flat.rows.size());
  for (int64_t r0 = 0; r0 < R; r0 += max_rows_)
    pass(batch, flat, r0, std::min<int64_t>(R, r0 + max_rows_), page_ids, item_page, arena, touched, opt);
  // Every pass ran: the copies become the sequences' states.
  cudaStream_t s = core_->stream();
  for (size_t b = 0; b < batch.size() && state_floats_; ++b)
    if (touched[b])
      DZ_CUDA_CHECK(cudaMemcpyAsync(batch[b].seq->state_ptr(), state_.get() + b * state_floats_, state_floats_ * 4,
                                    cudaMemcpyDeviceToDevice, s));
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  // Positions attended: every visible position, each MLA layer.
  uint64_t total = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    uint64_t n = 0;
    const uint64_t start = batch[b].seq->length();
    for (size_t t = 0; t < batch[b].tokens.size(); ++t) n += (start + t + 1) * uint64_t(n_mla_);
    total += n;
    if (batch[b].attention_tokens_read) *batch[b].attention_tokens_read += n;
  }
  if (opt.attention_tokens_read) *opt.attention_tokens_read += total;
}

void KimiLinearCuda::kda_layer(const DevLayer& D, const KimiLinearLayer& L, int T, int n_seg, int max_seg,
                               const int32_t* seg_first, float* const* st_in, float* const* st_out, cudaStream_t s) {
  const int H = int(hidden_), P = int(kda_.proj()), HD = kda_.head_dim, NH = kda_.n_heads;
  float* qkv = room(qkv_, size_t(T) * 3 * P, "KDA q|k|v");
  float* conv = room(conv_, size_t(T) * 3 * P, "KDA convolved q|k|v");
  float* fg = room(fg_, size_t(T) * 2 * HD, "KDA f_a|g_a");
  uint16_t* fgb = room(fgb_, size_t(T) * 2 * HD, "KDA f_a|g_a bf16");
  float* g = room(g_, size_t(T) * 2 * P, "KDA decay|gate");
  float* beta = room(beta_, size_t(T) * NH, "KDA beta");
  float* out = room(kout_, size_t(T) * P, "KDA out");
  uint16_t* ob = room(ob_, size_t(T) * P, "KDA gated out");
  const uint16_t* xb = xb_.get();
  core_->gemm().run(xb, D.qkv.get(), nullptr, qkv, T, 3 * P, H, 0.f, s);
  core_->gemm().run(xb, D.b.get(), nullptr, beta, T, NH, H, 0.f, s);
  // f_a and g_a outputs as two [T, D] blocks, so each feeds its up-projection as contiguous bf16 rows.
  core_->gemm().run(xb, D.f_a.get(), nullptr, fg, T, HD, H, 0.f, s);
  core_->gemm().run(xb, D.g_a.get(), nullptr, fg + size_t(T) * HD, T, HD, H, 0.f, s);
  cuda::to_bf16(fg, fgb, size_t(T) * 2 * HD, s);
  core_->gemm().run(fgb, D.f_b.get(), nullptr, g, T, P, HD, 0.f, s);
  core_->gemm().run(fgb + size_t(T) * HD, D.g_b.get(), nullptr, g + size_t(T) * P, T, P, HD, 0.f, s);
  float* gate = g + size_t(T) * P;

  cuda::KdaConv c;
  c.channels = 3 * int64_t(P), c.kernel = kda_.conv_kernel, c.batch = n_seg, c.seq_first = seg_first;
  c.x = qkv, c.ld = 3 * int64_t(P), c.w = D.conv_w.get(), c.hist_in = st_in, c.hist_out = st_out;
  c.hist_offset = int64_t(L.state_off), c.y = conv, c.max_tokens = max_seg;
  cuda::kda_short_conv_silu(c, s);
  cuda::kda_prepare(NH, HD, T, conv, conv + P, 3 * int64_t(P), g, P, D.a_log.get(), D.dt_bias.get(), beta, s);
  cuda::KdaRecurrent a;
  a.n_heads = NH, a.head_dim = HD, a.batch = n_seg, a.seq_first = seg_first;
  a.q = conv, a.k = conv + P, a.v = conv + 2 * P, a.ld = 3 * int64_t(P), a.g = g, a.ld_g = P, a.beta = beta;
  a.state_in = st_in, a.state = st_out, a.state_offset = int64_t(L.state_off + kda_.conv_floats()), a.out = out;
  cuda::kda_recurrent(a, s);
  cuda::kda_output_gate(NH, HD, T, out, gate, P, D.o_norm.get(), eps_, ob, s);
  core_->gemm().run(ob, D.o.get(), nullptr, x_.get(), T, H, P, 1.f, s);  // x += o_proj(gated out)
}

void KimiLinearCuda::mla_layer(const DevLayer& D, int T, const int64_t* row_off, const int64_t* n_vis, int64_t max_vis,
                               uint8_t* kv_layer, const uint8_t* const* const* pages, uint32_t page_tokens,
                               cudaStream_t s) {
  const int H = int(hidden_), NH = mla_.n_heads, QD = mla_.nope + mla_.rope, KVA = mla_.rank + mla_.rope;
  float* q = room(q_, size_t(T) * NH * QD, "q");
  float* kva = room(kva_, size_t(T) * KVA, "kv_a");
  float* qa = room(qa_, size_t(T) * NH * KVA, "absorbed q");
  float* olat = room(olat_, size_t(T) * NH * mla_.rank, "attended latent");
  uint16_t* att = room(att_, size_t(T) * NH * mla_.v, "attention out");
  const uint16_t* xb = xb_.get();
  core_->gemm().run(xb, D.q.get(), nullptr, q, T, NH * QD, H, 0.f, s);
  core_->gemm().run(xb, D.kv_a.get(), nullptr, kva, T, KVA, H, 0.f, s);
  cuda::MlaRopeStore rs;  // no cos / sin: NoPE, k_pe cached as projected
  rs.n_rows = T, rs.n_heads = NH, rs.nope = mla_.nope, rs.rope = mla_.rope, rs.rank = mla_.rank;
  rs.q = q, rs.kva = kva, rs.kv_norm = D.kv_a_norm.get(), rs.eps = eps_;
  rs.kv_layer = kv_layer, rs.row_off = row_off;
  cuda::mla_rope_store(rs, s);
  cuda::mla_absorb_q(q, T, NH, mla_.nope, mla_.rope, mla_.v, mla_.rank, D.kv_b.get(), qa, s);
  core_->mla_attend(mla_, T, qa, nullptr, n_vis, int(max_vis), pages, page_tokens, stride_, olat, qab_, mla_scratch_,
                    s);
  cuda::mla_out_proj(olat, T, NH, mla_.nope, mla_.v, mla_.rank, D.kv_b.get(), att, s);
  core_->gemm().run(att, D.o.get(), nullptr, x_.get(), T, H, NH * mla_.v, 1.f, s);  // x += o_proj(att)
}

void KimiLinearCuda::pass(std::span<ForwardItem> batch, const BatchRows& flat, int64_t r0, int64_t r1,
                          const std::vector<int32_t>& page_ids, const std::vector<int32_t>& item_page, kv::Arena& arena,
                          std::vector<char>& touched, const ForwardOptions& opt) {
  const int T = int(r1 - r0), L = n_layers_, H = int(hidden_), V = n_vocab_;
  cudaStream_t s = core_->stream();
  const size_t page_bytes = arena.page_bytes(), TS = size_t(T);

  // Row and segment metadata, packed into one upload.
  std::vector<int32_t> tok(TS), row_first(TS), logit_rows, seg_first;
  std::vector<int64_t> vis(TS), off(TS), layer_off(static_cast<size_t>(L));
  std::vector<Segment> segs;
  std::vector<float*> logit_dst, dev_dst;  // per logit row: its host or DeviceLogits row (the other null)
  std::vector<int32_t*> argmax_dst;
  int64_t max_vis = 0;
  for (int i = 0; i < T; ++i) {
    const BatchRow& rw = flat.rows[size_t(r0 + i)];
    const ForwardItem& it = batch[rw.item];
    const kv::Sequence& seq = *it.seq;
    tok[size_t(i)] = it.tokens[size_t(r0 + i - flat.first_row[rw.item])];
    vis[size_t(i)] = rw.pos + 1;
    max_vis = std::max(max_vis, rw.pos + 1);
    off[size_t(i)] = int64_t(seq.page_of(size_t(rw.pos))) * int64_t(page_bytes) +
                     int64_t(seq.slot_of(size_t(rw.pos))) * int64_t(stride_);
    row_first[size_t(i)] = item_page[rw.item];
    if (segs.empty() || segs.back().item != int(rw.item)) segs.push_back({int(rw.item), i, 0});
    ++segs.back().n;
    const auto [lr0, nlr] = flat.logit_rows(batch, rw.item);
    if (r0 + i >= lr0 && r0 + i < lr0 + nlr) {
      logit_rows.push_back(i);
      logit_dst.push_back(it.logits ? it.logits + (r0 + i - lr0) * int64_t(V) : nullptr);
      dev_dst.push_back(it.logits ? nullptr : it.device_logits);
      argmax_dst.push_back(it.logits ? nullptr : it.argmax);
    }
  }
  // Each segment's state: read from the slot (first pass of the call) or this call's copy, written to the copy.
  std::vector<float*> st_in, st_out;
  for (const Segment& g : segs) {
    seg_first.push_back(g.first);
    float* copy = state_floats_ ? state_.get() + size_t(g.item) * state_floats_ : nullptr;
    st_in.push_back(
        touched[size_t(g.item)] || !copy ? copy : reinterpret_cast<float*>(batch[size_t(g.item)].seq->state_ptr()));
    st_out.push_back(copy);
    touched[size_t(g.item)] = 1;
  }
  seg_first.push_back(T);
  int max_seg = 0;
  for (const Segment& g : segs) max_seg = std::max(max_seg, g.n);
  // A decode step: every item one row, each a logit row, with no host sync in the experts. It runs as a CUDA
  // graph, its page count and the attention's context rounded up to powers of two (the pads are never read:
  // each row stops at its own visible count) so that one graph serves many steps.
  const bool decode = T == int(batch.size()) && int(logit_rows.size()) == T && T <= kLogitRows &&
                      (moe_ ? path_ == cuda::MoePath::kFused || moe_->choose(T) == cuda::MoePath::kFused
                            : !bf16_experts_ || bf16_experts_->few_slots(T));
  std::vector<int32_t> pids(page_ids);
  if (decode) {
    pids.resize(size_t(cuda::pow2_at_least(int64_t(pids.size()))), 0);
    max_vis = cuda::pow2_at_least(max_vis);
  }
  const int P = int(pids.size());
  for (int l = 0; l < L; ++l) layer_off[size_t(l)] = int64_t(arena.layer_offset(uint32_t(l)));
  cuda::Packer pk;
  const size_t o_tok = pk.add(tok), o_first = pk.add(row_first), o_lr = pk.add(logit_rows), o_dd = pk.add(dev_dst),
               o_vis = pk.add(vis), o_off = pk.add(off), o_loff = pk.add(layer_off), o_pid = pk.add(pids),
               o_seg = pk.add(seg_first), o_sin = pk.add(st_in), o_sout = pk.add(st_out);
  const size_t o_tab = pk.tail();
  const size_t o_rtab = o_tab + (size_t(L) * P * 8 + 255) / 256 * 256;
  const size_t meta_bytes = o_rtab + size_t(L) * T * 8;
  // Every pass ends synchronized (its logits reach the host), so the metadata is free to rewrite.
  uint8_t* m = room(meta_, meta_bytes, "batch metadata");
  DZ_CUDA_CHECK(cudaMemcpyAsync(m, pk.bytes().data(), pk.bytes().size(), cudaMemcpyHostToDevice, s));
  auto at = [m](size_t o) { return m + o; };
  uint8_t** tables = reinterpret_cast<uint8_t**>(at(o_tab));
  uint8_t*** row_tables = reinterpret_cast<uint8_t***>(at(o_rtab));
  uint8_t* kv_base = arena.storage().data();
  const int32_t* d_seg = reinterpret_cast<const int32_t*>(at(o_seg));
  float* const* d_sin = reinterpret_cast<float* const*>(at(o_sin));
  float* const* d_sout = reinterpret_cast<float* const*>(at(o_sout));
  const int32_t* d_lr = reinterpret_cast<const int32_t*>(at(o_lr));
  float* const* d_dd = reinterpret_cast<float* const*>(at(o_dd));

  float* x = room(x_, TS * H, "x");
  float* xn = room(xn_, TS * H, "xn");
  uint16_t* xb = room(xb_, TS * H, "x bf16");
  int32_t* ids = nullptr;
  float *rlog = nullptr, *gw = nullptr;
  if (moe_inter_) {
    ids = room(ids_, TS * routing_.n_active, "expert ids");
    gw = room(gw_, TS * routing_.n_active, "expert weights");
    rlog = room(rlog_, TS * routing_.n_experts, "router logits");
  }

  // The pass's launches up to the last hidden state; no host synchronisation while capturing.
  auto layers = [&](bool capturing) {
    if (n_mla_)
      cuda::paged_tables(kv_base, reinterpret_cast<const int32_t*>(at(o_pid)), P, page_bytes,
                         reinterpret_cast<const int64_t*>(at(o_loff)), L, reinterpret_cast<const int32_t*>(at(o_first)),
                         T, tables, row_tables, s);
    core_->embed(reinterpret_cast<const int32_t*>(at(o_tok)), T, H, x, s);
    for (int li = 0; li < L; ++li) {
      if (!capturing) core_->poll_abort(opt);
      const DevLayer& D = dl_[size_t(li)];
      cuda::rms_norm(x, nullptr, T, H, D.in_norm.get(), eps_, nullptr, xb, s);
      if (D.kda)
        kda_layer(D, layers_[size_t(li)], T, int(segs.size()), max_seg, d_seg, d_sin, d_sout, s);
      else
        mla_layer(D, T, reinterpret_cast<const int64_t*>(at(o_off)), reinterpret_cast<const int64_t*>(at(o_vis)),
                  max_vis, kv_base + arena.layer_offset(uint32_t(li)), row_tables + size_t(li) * T, arena.page_tokens(),
                  s);

      cuda::rms_norm(x, nullptr, T, H, D.post_norm.get(), eps_, xn, xb, s);
      if (!D.moe) {
        core_->mlp(D.dense, xb, int(T), H, x, s);
        continue;
      }
      core_->route(xb, D.router.get(), D.router_bias.get(), routing_, T, H, rlog, ids, gw, s);
      if (moe_) {
        moe_->forward(D.fp4.weights(), xn, ids, gw, T, x, path_, true);  // x += experts(xn)
      } else {
        cuda::Bf16ExpertWeights bw;
        bw.w13 = D.w13.get(), bw.w2 = D.w2.get();
        bf16_experts_->forward(bw, xb, ids, gw, T, x, s);  // x += experts(xb)
      }
      if (D.shared.inter) core_->mlp(D.shared, xb, int(T), H, x, s);
    }
    if (!capturing) core_->poll_abort(opt);  // as the CPU family: once more before the logits
  };

  const int64_t experts_gen = bf16_experts_ ? int64_t(bf16_experts_->scratch_generation()) : 0;
  core_->run_pass(decode, core_->step_key(T, P, arena, m, {max_vis, experts_gen}), opt, layers, x, d_lr,
                  int(logit_rows.size()), H, V, eps_, xb, d_dd, logit_dst, argmax_dst, moe_.get());
}

}  // namespace

std::unique_ptr<Family> make_kimi_linear_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  return std::make_unique<KimiLinearCuda>(cfg, ws, params);
}

}  // namespace dz

#endif  // DZ_WITH_CUDA
