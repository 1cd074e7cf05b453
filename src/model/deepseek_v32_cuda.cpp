// DeepSeek-V3.2 on the CUDA backend: the CPU family's computation (see
// deepseek_v32.cpp) with the DSA kernels of kernels/cuda on the device.
//  - Cache: per token and layer one record, bf16 [c_kv | k_rope] (16-byte
//    aligned) then the indexer key (E4M3 bytes + fp32 scale), in device pages.
//  - Indexer: FP8 scores and the exact top-k (cuda/dsa_indexer.h); the CUDA
//    backend has no fp32 scoring, so DZ_INDEXER_EXACT stays on the CPU.
//  - Attention: absorbed for every query (decode and prefill): q~ = W_UK^T
//    q_nope, sparse attention over the selected latents, W_UV after it.
//  - Projections (attention, indexer, router, dense and shared MLPs,
//    lm_head) are BF16 GEMMs; FP8 checkpoints' projections are decoded to
//    BF16 at load (twice their bytes on the device).
//  - Routed experts stay MXFP4 and run through cuda::MoeLayer with plain
//    SwiGLU (MoeActivation::kSilu): fused W4A16 kernels for few tokens an
//    expert, FP8 GEMMs above (DZ_EXPERTS_NATIVE: fused at every size);
//    experts in other formats are not served on the GPU yet.
// Decode steps run as CUDA graphs (cuda::GraphCache): their page tables are
// padded to a power-of-two page count and the indexer's grid to a
// power-of-two context, so that one graph serves many steps; other passes
// launch eagerly.
#include "model/deepseek_v32.h"
#include "runtime/device.h"

#ifndef DZ_WITH_CUDA

namespace dz {
std::unique_ptr<Family> make_deepseek_v32_cuda(const Config&, const WeightStore&, const dz_model_params&) {
  require_cuda_device("deepseek_v32");  // (throws: no CUDA backend in this build)
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
#include "cuda/dsa_indexer.h"
#include "cuda/mla.h"
#include "cuda/mla_sparse.h"
#include "cuda/moe.h"
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
constexpr size_t kIndexerScratch = size_t(256) << 20;  // bounds the indexer's score block

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

struct DevLayer {
  DeviceArray<uint16_t> q_a, q_b, kv_a, kv_b, o, iwq, iwk, iwp, router;
  DeviceArray<float> q_a_b, kv_a_b, o_b, in_norm, post_norm, q_a_norm, kv_a_norm, knorm_w, knorm_b, router_bias;
  bool moe = false;
  DevMlp dense, shared;
  DevMxfp4Experts fp4;  // routed experts in MXFP4
};

class DeepseekV32Cuda final : public CudaFamily<DeepseekV32Desc> {
 public:
  DeepseekV32Cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);

  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    l.layer_token_bytes.assign(size_t(n_layers_), stride_);
    l.model_key = model_key_;
    return l;
  }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;

 private:
  void pass(std::span<ForwardItem> batch, const BatchRows& flat, int64_t r0, int64_t r1,
            const std::vector<int32_t>& page_ids, const std::vector<int32_t>& item_page, kv::Arena& arena,
            const ForwardOptions& opt);

  uint64_t model_key_ = 0;
  size_t lat_bytes_ = 0, stride_ = 0;  // the record: latent bf16 (padded to 16), the indexer key, padded to 16
  int64_t moe_inter_ = 0;
  std::vector<DevLayer> dl_;
  // Pass scratch (grown on demand).
  DeviceArray<float> x_, xn_, cq_, q_, kva_, iq_, ik_, iw_, qa_, olat_, rlog_, gw_;
  DeviceArray<uint16_t> xb_, cqb_, att_, qab_;
  DeviceArray<int32_t> sel_, ids_;
  DeviceArray<uint8_t> meta_, idx_scratch_, mla_scratch_;
};

DeepseekV32Cuda::DeepseekV32Cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
    : CudaFamily("deepseek_v32", params, kDefaultRows, cfg, ws, params) {
  const std::string& src = cfg.source();
  check(params.indexer != DZ_INDEXER_EXACT, DZ_ERR_UNSUPPORTED,
        "deepseek_v32 CUDA: the GPU indexer scores in FP8 (DZ_INDEXER_FP8 or AUTO); DZ_INDEXER_EXACT runs on the CPU");
  check(mla_.rank <= cuda::kMlaGenericMaxRank && mla_.rope <= cuda::kMlaGenericMaxRope, DZ_ERR_UNSUPPORTED, src,
        ": kv_lora_rank ", mla_.rank, " / qk_rope_head_dim ", mla_.rope, " (the CUDA sparse MLA takes at most ",
        cuda::kMlaGenericMaxRank, " / ", cuda::kMlaGenericMaxRope, ")");
  check(routing_.n_experts == 0 || (routing_.n_experts <= 256 && routing_.n_active <= 16), DZ_ERR_UNSUPPORTED, src,
        ": ", routing_.n_experts, " experts top-", routing_.n_active, " (CUDA router: at most 256, top-16)");

  // The record: the latent, then the indexer key at a 16-byte offset.
  lat_bytes_ = align16(size_t(mla_.rank + mla_.rope) * 2);
  stride_ = align16(lat_bytes_ + size_t(idx_.head_dim) + 4);
  {
    cuda::IndexerQueries probe;
    probe.n_heads = idx_.n_heads, probe.head_dim = idx_.head_dim, probe.topk = idx_.topk;
    probe.keys = {64, stride_, lat_bytes_};
    cuda::indexer_validate(probe);  // head counts and dims the GPU indexer takes
  }
  model_key_ = fnv1a(cfg.json().dump(), fnv1a(std::string("deepseek_v32 cuda kv: bf16 c_kv|k_rope + fp8 key v1 ") +
                                              std::to_string(idx_.pow2_scales) + " " + std::to_string(weights_bytes_)));

  // The experts must be MXFP4 (the GPU MoE layer's format).
  for (const DeepseekV32Layer& L : layers_)
    for (size_t e = 0; L.ffn.moe && e < L.ffn.experts.size(); ++e) {
      const SwiGlu& x = L.ffn.experts[e];
      check(ExpertFormats::is_mxfp4(x), DZ_ERR_UNSUPPORTED, src, ": routed expert ", e,
            " is not MXFP4; the CUDA backend serves deepseek_v32's experts in MXFP4 only so far (use DZ_DEVICE_CPU)");
      moe_inter_ = x.inter;
    }

  const int64_t H = hidden_, NH = mla_.n_heads, QD = mla_.nope + mla_.rope, KVA = mla_.rank + mla_.rope;
  const int64_t IH = idx_.n_heads, ID = idx_.head_dim, E = routing_.n_experts, K = idx_.topk;
  int64_t inter = moe_inter_;
  for (const DeepseekV32Layer& L : layers_) inter = std::max({inter, L.ffn.dense.inter, L.ffn.shared.inter});
  // Scratch a row: activations and projections (fp32 and bf16), the selection; the MoE layer says what it reserves.
  const int64_t row =
      4 * (3 * H + q_lora_ + NH * QD + KVA + IH * ID + ID + IH + NH * (KVA + mla_.rank) + E + 2 * inter) +
      2 * (H + q_lora_ + NH * mla_.v + inter + NH * KVA) + 4 * K + 64;
  const cuda::MoeShape ms{int(E), routing_.n_active, int(H), int(moe_inter_), cuda::MoeActivation::kSilu};
  const size_t moe_scratch = moe_inter_ > 0 ? cuda::MoeLayer::reserved_bytes(ms, max_rows_) : 0;
  const size_t weights = size_t(weights_bytes_);
  // What the weights take on the device: projections in BF16 (FP8 ones grow),
  // experts in MXFP4 as stored, norms and biases (fp32) within the slack.
  size_t dev_weights = size_t(64) << 20;
  auto as_bf16 = [&](const cpu::WeightRef& w) { dev_weights += size_t(w.rows * w.cols) * 2; };
  as_bf16(ends_.embed);
  if (ends_.lm_head.data != ends_.embed.data) as_bf16(ends_.lm_head);
  for (const DeepseekV32Layer& L : layers_) {
    for (const cpu::WeightRef* w : {&L.q_a, &L.q_b, &L.kv_a, &L.kv_b, &L.o, &L.idx_wq, &L.idx_wk, &L.idx_wproj})
      as_bf16(*w);
    for (const SwiGlu* m : {&L.ffn.dense, &L.ffn.shared})
      if (m->inter) as_bf16(m->gate), as_bf16(m->up), as_bf16(m->down);
    if (!L.ffn.moe) continue;
    as_bf16(L.ffn.router);
    for (const SwiGlu& x : L.ffn.experts)
      for (const cpu::WeightRef* w : {&x.gate, &x.up, &x.down}) dev_weights += size_t(w->rows * w->cols) / 32 * 17;
  }
  const size_t scratch = size_t(max_rows_) * size_t(row) + moe_scratch + size_t(kLogitRows) * size_t(n_vocab_) * 4 +
                         2 * kIndexerScratch + (size_t(2) << 30);
  core_ = std::make_unique<CudaModelCore>(dev_, dev_weights + scratch, "deepseek_v32");
  if (moe_inter_ > 0)  // some layer routes experts
    moe_ = std::make_unique<cuda::MoeLayer>(core_->ctx(), ms, max_rows_);

  cuda::WeightLoader ld(core_->ctx().pool(), weights, params, "deepseek_v32");
  core_->load_ends(ld, ends_);
  dl_.resize(size_t(n_layers_));
  for (int li = 0; li < n_layers_; ++li) {
    const DeepseekV32Layer& L = layers_[size_t(li)];
    DevLayer& d = dl_[size_t(li)];
    d.in_norm = ld.array(L.in_norm, "input_layernorm");
    d.post_norm = ld.array(L.post_norm, "post_attention_layernorm");
    d.q_a = ld.bf16({&L.q_a}, "q_a_proj");
    d.q_b = ld.bf16({&L.q_b}, "q_b_proj");
    d.kv_a = ld.bf16({&L.kv_a}, "kv_a_proj_with_mqa");
    d.kv_b = ld.bf16({&L.kv_b}, "kv_b_proj");
    d.o = ld.bf16({&L.o}, "o_proj");
    d.q_a_b = ld.array(L.q_a_bias, "q_a_proj bias");
    d.kv_a_b = ld.array(L.kv_a_bias, "kv_a_proj bias");
    d.o_b = ld.array(L.o_bias, "o_proj bias");
    d.q_a_norm = ld.array(L.q_a_norm, "q_a_layernorm");
    d.kv_a_norm = ld.array(L.kv_a_norm, "kv_a_layernorm");
    d.iwq = ld.bf16({&L.idx_wq}, "indexer wq_b");
    d.iwk = ld.bf16({&L.idx_wk}, "indexer wk");
    d.iwp = ld.bf16({&L.idx_wproj}, "indexer weights_proj");
    d.knorm_w = ld.array(L.idx_knorm_w, "indexer k_norm weight");
    d.knorm_b = ld.array(L.idx_knorm_b, "indexer k_norm bias");
    d.moe = L.ffn.moe;
    if (!d.moe) {
      d.dense = CudaModelCore::load_mlp(ld, L.ffn.dense);
      continue;
    }
    d.shared = CudaModelCore::load_mlp(ld, L.ffn.shared);
    d.router = ld.bf16({&L.ffn.router}, "router");
    d.router_bias = ld.array(L.ffn.router_bias, "e_score_correction_bias");
    d.fp4 = CudaModelCore::load_mxfp4_experts(ld, L.ffn.experts, H, moe_inter_);
  }
  ld.finish(src);
  device_bytes_ = ld.bytes();
  DZ_CUDA_CHECK(cudaDeviceSynchronize());
  log_info("deepseek_v32 on ", core_->ctx().describe(), ": ", device_bytes_ >> 20,
           " MiB of weights on the device (checkpoint ", weights >> 20, " MiB)");
}

void DeepseekV32Cuda::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  std::lock_guard<std::mutex> lk(mu_);
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  const BatchRows flat = flatten_batch(batch, n_vocab_, "deepseek_v32");
  std::vector<int32_t> page_ids, item_page;
  kv::Arena& arena = CudaModelCore::batch_pages(batch, page_ids, item_page, "deepseek_v32");
  const int64_t R = int64_t(flat.rows.size());
  for (int64_t r0 = 0; r0 < R; r0 += max_rows_)
    pass(batch, flat, r0, std::min<int64_t>(R, r0 + max_rows_), page_ids, item_page, arena, opt);
  // Positions attended: each query's selection (its visible positions, up to top-k), every layer.
  uint64_t total = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    uint64_t n = 0;
    const int64_t start = int64_t(batch[b].seq->length());
    for (size_t t = 0; t < batch[b].tokens.size(); ++t)
      n += uint64_t(std::min<int64_t>(start + int64_t(t) + 1, idx_.topk)) * uint64_t(n_layers_);
    total += n;
    if (batch[b].attention_tokens_read) *batch[b].attention_tokens_read += n;
  }
  if (opt.attention_tokens_read) *opt.attention_tokens_read += total;
}

void DeepseekV32Cuda::pass(std::span<ForwardItem> batch, const BatchRows& flat, int64_t r0, int64_t r1,
                           const std::vector<int32_t>& page_ids, const std::vector<int32_t>& item_page,
                           kv::Arena& arena, const ForwardOptions& opt) {
  const int T = int(r1 - r0), L = n_layers_;
  const int H = int(hidden_), NH = mla_.n_heads, QD = mla_.nope + mla_.rope, KVA = mla_.rank + mla_.rope;
  const int IH = idx_.n_heads, ID = idx_.head_dim, K = idx_.topk, half = mla_.rope / 2, V = n_vocab_;
  cudaStream_t s = core_->stream();
  const size_t page_bytes = arena.page_bytes();

  // Row metadata, packed into one upload (256-byte aligned parts).
  const size_t TS = static_cast<size_t>(T);
  std::vector<int32_t> tok(TS), row_first(TS), logit_rows;
  std::vector<int64_t> pos(TS), vis(TS), off(TS), layer_off(static_cast<size_t>(L));
  std::vector<float> cs(TS * half), sn(TS * half);
  std::vector<float*> logit_dst, dev_dst;  // per logit row: its host or DeviceLogits row (the other null)
  std::vector<int32_t*> argmax_dst;
  int64_t max_vis = 0;
  bool one_item = true;  // every row of one item (a prompt): the indexer then shares its key tiles
  for (int i = 0; i < T; ++i) {
    const BatchRow& rw = flat.rows[size_t(r0 + i)];
    const ForwardItem& it = batch[rw.item];
    const kv::Sequence& seq = *it.seq;
    const int64_t k = r0 + i - flat.first_row[rw.item];  // row within its item
    tok[size_t(i)] = it.tokens[size_t(k)];
    pos[size_t(i)] = rw.pos;
    vis[size_t(i)] = rw.pos + 1;
    max_vis = std::max(max_vis, rw.pos + 1);
    off[size_t(i)] = int64_t(seq.page_of(size_t(rw.pos))) * int64_t(page_bytes) +
                     int64_t(seq.slot_of(size_t(rw.pos))) * int64_t(stride_);
    row_first[size_t(i)] = item_page[rw.item];
    cpu::rope_cos_sin(rope_, rw.pos, cs.data() + size_t(i) * half, sn.data() + size_t(i) * half);
    one_item = one_item && rw.item == flat.rows[size_t(r0)].item;
    const auto [lr0, nlr] = flat.logit_rows(batch, rw.item);
    if (r0 + i >= lr0 && r0 + i < lr0 + nlr) {
      logit_rows.push_back(i);
      logit_dst.push_back(it.logits ? it.logits + (r0 + i - lr0) * int64_t(V) : nullptr);
      dev_dst.push_back(it.logits ? nullptr : it.device_logits);
      argmax_dst.push_back(it.logits ? nullptr : it.argmax);
    }
  }
  // A decode step: every item one row, each a logit row, on the fused MoE path (the FP8 path sizes its GEMMs on
  // the host).
  const bool decode = T == int(batch.size()) && int(logit_rows.size()) == T && T <= kLogitRows &&
                      (!moe_ || path_ == cuda::MoePath::kFused || moe_->choose(T) == cuda::MoePath::kFused);
  // Its page count and the indexer's grid rounded up to powers of two (the pads are never read: each row's
  // selection stops at its own visible count).
  std::vector<int32_t> pids(page_ids);
  if (decode) {
    pids.resize(size_t(cuda::pow2_at_least(int64_t(pids.size()))), 0);
    max_vis = cuda::pow2_at_least(max_vis);
  }
  const int P = int(pids.size());
  for (int l = 0; l < L; ++l) layer_off[size_t(l)] = int64_t(arena.layer_offset(uint32_t(l)));
  cuda::Packer pk;
  const size_t o_tok = pk.add(tok), o_first = pk.add(row_first), o_lr = pk.add(logit_rows), o_dd = pk.add(dev_dst),
               o_pos = pk.add(pos), o_vis = pk.add(vis), o_off = pk.add(off), o_loff = pk.add(layer_off),
               o_cs = pk.add(cs), o_sn = pk.add(sn), o_pid = pk.add(pids);
  // The page-pointer tables follow, written on the device (paged_tables).
  const size_t o_tab = pk.tail();
  const size_t o_rtab = o_tab + (size_t(L) * P * 8 + 255) / 256 * 256;
  const size_t meta_bytes = o_rtab + size_t(L) * T * 8;
  // Every pass ends synchronized (its logits reach the host), so the metadata is free to rewrite.
  uint8_t* m = room(meta_, meta_bytes, "batch metadata");
  DZ_CUDA_CHECK(cudaMemcpyAsync(m, pk.bytes().data(), pk.bytes().size(), cudaMemcpyHostToDevice, s));
  auto at = [m](size_t o) { return m + o; };
  const int32_t* d_tok = reinterpret_cast<const int32_t*>(at(o_tok));
  const int64_t* d_pos = reinterpret_cast<const int64_t*>(at(o_pos));
  const int32_t* d_lr = reinterpret_cast<const int32_t*>(at(o_lr));
  float* const* d_dd = reinterpret_cast<float* const*>(at(o_dd));
  uint8_t** tables = reinterpret_cast<uint8_t**>(at(o_tab));
  uint8_t*** row_tables = reinterpret_cast<uint8_t***>(at(o_rtab));
  uint8_t* kv_base = arena.storage().data();

  float* x = room(x_, TS * H, "x");
  float* xn = room(xn_, TS * H, "xn");
  uint16_t* xb = room(xb_, TS * H, "x bf16");
  float* cq = room(cq_, TS * q_lora_, "c_q");
  uint16_t* cqb = room(cqb_, TS * q_lora_, "c_q bf16");
  float* q = room(q_, TS * NH * QD, "q");
  float* kva = room(kva_, TS * KVA, "kv_a");
  float* iq = room(iq_, TS * IH * ID, "indexer q");
  float* ik = room(ik_, TS * ID, "indexer k");
  float* iw = room(iw_, TS * IH, "indexer w");
  float* qa = room(qa_, TS * NH * KVA, "absorbed q");
  float* olat = room(olat_, TS * NH * mla_.rank, "attended latent");
  uint16_t* att = room(att_, TS * NH * mla_.v, "attention out");
  int32_t* sel = room(sel_, TS * K, "selection");
  int32_t* ids = nullptr;
  float *rlog = nullptr, *gw = nullptr;
  if (moe_) {
    ids = room(ids_, TS * routing_.n_active, "expert ids");
    gw = room(gw_, TS * routing_.n_active, "expert weights");
    rlog = room(rlog_, TS * routing_.n_experts, "router logits");
  }

  cuda::IndexerQueries iqa;
  iqa.n_heads = IH, iqa.head_dim = ID, iqa.topk = K, iqa.pow2_scales = idx_.pow2_scales;
  iqa.n_q = T, iqa.q = iq, iqa.w = iw, iqa.n_visible = reinterpret_cast<const int64_t*>(at(o_vis));
  iqa.max_visible = max_vis, iqa.same_pages = one_item, iqa.out = sel;
  iqa.keys = {arena.page_tokens(), stride_, lat_bytes_};
  const int64_t qblock = std::max<int64_t>(1, std::min<int64_t>(T, int64_t(kIndexerScratch) / (4 * max_vis)));
  const size_t idx_bytes = cuda::indexer_scratch_bytes(iqa, qblock);
  uint8_t* idx_scratch = room(idx_scratch_, idx_bytes, "indexer scratch");

  // The pass's launches up to the last hidden state; no host synchronisation while capturing.
  auto layers = [&](bool capturing) {
    cuda::paged_tables(kv_base, reinterpret_cast<const int32_t*>(at(o_pid)), P, page_bytes,
                       reinterpret_cast<const int64_t*>(at(o_loff)), L, reinterpret_cast<const int32_t*>(at(o_first)),
                       T, tables, row_tables, s);
    core_->embed(d_tok, T, H, x, s);
    for (int li = 0; li < L; ++li) {
      if (!capturing) core_->poll_abort(opt);
      const DevLayer& D = dl_[size_t(li)];
      uint8_t* kv_layer = kv_base + arena.layer_offset(uint32_t(li));
      cuda::rms_norm(x, nullptr, T, H, D.in_norm.get(), eps_, nullptr, xb, s);
      core_->gemm().run(xb, D.q_a.get(), D.q_a_b.get(), cq, T, int(q_lora_), H, 0.f, s);
      cuda::rms_norm(cq, nullptr, T, int(q_lora_), D.q_a_norm.get(), eps_, nullptr, cqb, s);
      core_->gemm().run(cqb, D.q_b.get(), nullptr, q, T, NH * QD, int(q_lora_), 0.f, s);
      core_->gemm().run(xb, D.kv_a.get(), D.kv_a_b.get(), kva, T, KVA, H, 0.f, s);
      core_->gemm().run(cqb, D.iwq.get(), nullptr, iq, T, IH * ID, int(q_lora_), 0.f, s);
      core_->gemm().run(xb, D.iwk.get(), nullptr, ik, T, ID, H, 0.f, s);
      cuda::layer_norm(ik, T, ID, D.knorm_w.get(), D.knorm_b.get(), 1e-6f, ik, s);
      core_->gemm().run(xb, D.iwp.get(), nullptr, iw, T, IH, H, 0.f, s);

      cuda::MlaRopeStore rs;
      rs.n_rows = T, rs.n_heads = NH, rs.nope = mla_.nope, rs.rope = mla_.rope, rs.rank = mla_.rank;
      rs.cos = reinterpret_cast<const float*>(at(o_cs)), rs.sin = reinterpret_cast<const float*>(at(o_sn));
      rs.q = q, rs.kva = kva, rs.kv_norm = D.kv_a_norm.get(), rs.eps = eps_;
      rs.kv_layer = kv_layer, rs.row_off = reinterpret_cast<const int64_t*>(at(o_off));
      rs.idx_heads = IH, rs.idx_dim = ID, rs.iq = iq, rs.ik = ik;
      cuda::mla_rope_store(rs, s);
      cuda::indexer_encode_keys_rows(ID, idx_.pow2_scales, ik, T, d_pos, row_tables + size_t(li) * T, iqa.keys, s);
      cuda::IndexerQueries lq = iqa;
      lq.pages = row_tables + size_t(li) * T;
      cuda::indexer_select(lq, idx_scratch, idx_bytes, qblock, s);

      cuda::mla_absorb_q(q, T, NH, mla_.nope, mla_.rope, mla_.v, mla_.rank, D.kv_b.get(), qa, s);
      core_->mla_attend(mla_, T, qa, sel, nullptr, K, row_tables + size_t(li) * T, arena.page_tokens(), stride_, olat,
                        qab_, mla_scratch_, s);
      cuda::mla_out_proj(olat, T, NH, mla_.nope, mla_.v, mla_.rank, D.kv_b.get(), att, s);
      core_->gemm().run(att, D.o.get(), D.o_b.get(), x, T, H, NH * mla_.v, 1.f, s);  // x += o_proj(att)

      cuda::rms_norm(x, nullptr, T, H, D.post_norm.get(), eps_, xn, xb, s);
      if (!D.moe) {
        core_->mlp(D.dense, xb, int(T), H, x, s);
        continue;
      }
      core_->route(xb, D.router.get(), D.router_bias.get(), routing_, T, H, rlog, ids, gw, s);
      moe_->forward(D.fp4.weights(), xn, ids, gw, T, x, path_, true);  // x += experts(xn)
      if (D.shared.inter) core_->mlp(D.shared, xb, int(T), H, x, s);
    }
  };

  core_->run_pass(decode, core_->step_key(T, P, arena, m, {max_vis}), opt, layers, x, d_lr, int(logit_rows.size()), H,
                  V, eps_, xb, d_dd, logit_dst, argmax_dst, moe_.get());
}

}  // namespace

std::unique_ptr<Family> make_deepseek_v32_cuda(const Config& cfg, const WeightStore& ws,
                                               const dz_model_params& params) {
  return std::make_unique<DeepseekV32Cuda>(cfg, ws, params);
}

}  // namespace dz

#endif  // DZ_WITH_CUDA
