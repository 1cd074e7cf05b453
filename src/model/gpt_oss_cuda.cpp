// gpt-oss on the CUDA backend. Weights are uploaded once into the device pool
// in checkpoint precision: experts stay MXFP4 (blocks + E8M0 scales, BF16
// biases) and run through cuda::MoeLayer (fused W4A16 kernels for few tokens
// per expert, FP4->FP8 workspace + FP8 GEMMs for many); embeddings, attention
// projections, router and lm_head are BF16 through cuBLASLt; norms, biases
// and sinks fp32. The residual stream and the KV cache (paged, on the device)
// are fp32. Tensor validation is GptOssDesc's (shared with the CPU family).
#include "model/gpt_oss.h"
#include "runtime/device.h"

#ifndef DZ_WITH_CUDA

namespace dz {
std::unique_ptr<Family> make_gpt_oss_cuda(const Config&, const WeightStore&, const dz_model_params&) {
  require_cuda_device("gpt_oss");  // (throws: no CUDA backend in this build)
  return nullptr;
}
}  // namespace dz

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/host_alloc.h"
#include "common/log.h"
#include "cpu/mxfp4.h"
#include "cpu/mxfp4_fold.h"
#include "cuda/attention.h"
#include "cuda/bf16_gemm.h"
#include "cuda/bf16_gemv.h"
#include "cuda/embed.h"
#include "cuda/logits.h"
#include "cuda/moe.h"
#include "cuda/norm.h"
#include "cuda/rope.h"
#include "cuda/router.h"
#include "cuda/sampling.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/graph_cache.h"
#include "runtime/cuda/kv_storage.h"
#include "runtime/cuda/logit_rows.h"
#include "runtime/cuda/packer.h"
#include "runtime/cuda/upload.h"
#include "runtime/device.h"
#include "runtime/parallel.h"

namespace dz {

namespace {

using cuda::DeviceArray;

// Rows per device pass unless dz_model_params.pass_tokens says otherwise:
// activations and the MoE scratch are sized for it; longer batches run as
// consecutive passes (KV of earlier passes is in place).
constexpr int kMaxRows = 16384;
constexpr int kLogitRows = 256;     // lm_head rows per GEMM / host copy; also the largest graphed decode batch
constexpr int kAttnGroupRows = 64;  // split decode attention: partials sized for this many rows at max_splits
constexpr size_t kKvBytes = 2;      // the KV cache holds K and V in bf16 (the checkpoint's own precision)
constexpr size_t kMaxGraphs = 32;   // captured decode graphs kept per model (least recently used dropped)

struct DevLayer {
  bool sliding = false;
  DeviceArray<uint16_t> qkv_w, o_w, router_w;
  DeviceArray<float> qkv_b, o_b, router_b, in_norm, post_norm, sinks;
  DeviceArray<uint8_t> w1b, w1s, w2b, w2s;
  DeviceArray<uint8_t> w1g, w2g;  // fold group tables where all 64-row groups are exact (else empty)
  DeviceArray<uint8_t> w1k, w2k;  // whole-K tables where every 64-row group is exact over all of K (else empty)
  DeviceArray<uint16_t> b1, b2;
};

class GptOssCuda final : public Family, private GptOssDesc {
 public:
  GptOssCuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params);
  ~GptOssCuda() override;

  void fill_info(dz_model_info& info) const override {
    fill_desc_info(info);
    info.device = DZ_DEVICE_CUDA;
    info.device_bytes = device_bytes_;
  }
  int32_t n_vocab() const override { return n_vocab_; }
  kv::Layout kv_layout(uint32_t page_tokens) const override {
    kv::Layout l;
    l.page_tokens = page_tokens;
    l.layer_token_bytes.assign(size_t(n_layers_), size_t(2 * kv_dim()) * kKvBytes);
    l.model_key = config_hash_ ^ 0x6375646132ull;  // "cuda2": device pages, bf16 K|V
    return l;
  }
  std::unique_ptr<kv::Storage> (*kv_storage() const)(size_t) override { return storage_fn_; }
  // A pass of up to max_rows_ rows reads (or folds) each layer's experts once:
  // fewer, larger passes read them fewer times.
  uint32_t prefill_chunk() const override { return uint32_t(max_rows_); }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;
  std::unique_ptr<DeviceLogits> make_device_logits() override {
    return cuda::make_device_logits(ctx_->pool(), dev_, n_vocab_, "gpt_oss");
  }
  bool sample_on_device(std::span<const DeviceSample> rows, int32_t* tokens) override;

 private:
  struct Row {
    int32_t item, pos, token;
  };
  // Device pointers and sizes of one pass's work (see enqueue).
  struct PassArgs {
    int T = 0, n_dec = 0, n_tiles = 0, n_logit = 0;
    int splits_full = 1, splits_sliding = 1;
    bool host_logits = false;      // some logit row goes to the host (else every row to a DeviceLogits)
    float* const* ddst = nullptr;  // per logit row: its DeviceLogits row, or null (a host row)
    const int32_t *tok = nullptr, *dec = nullptr, *lr = nullptr;
    const int64_t* off = nullptr;
    const float *cs = nullptr, *sn = nullptr;
    const cuda::AttnTile* tiles = nullptr;
    cuda::AttnBatch ab;
    kv::Arena* arena = nullptr;
  };
  void pass(std::span<ForwardItem> batch, const std::vector<Row>& rows, int64_t r0, int64_t r1,
            const std::vector<int64_t>& first_row, kv::Arena& arena, const std::vector<int32_t>& pt,
            const ForwardOptions& opt);
  // Layers, then (n_logit <= kLogitRows) the final norm, lm_head, each row's
  // argmax (into lstage_->argmax_host()) and copy into its DeviceLogits row, and (if
  // p.host_logits) the logits' copy into logits_host_, then the MoE error flag's copy into
  // err_host_ (and its reset). No host synchronisation unless `abort_between`
  // (polls the abort callback between layers; off while capturing).
  void enqueue(const PassArgs& p, const ForwardOptions* abort_between);
  // Logit rows [c0, c0 + nc) of the pass, computed into logits_ rows 0..nc:
  // argmax and DeviceLogits copies on the device, argmax (and host rows) to
  // the pinned buffers.
  void out_logits(const PassArgs& p, int c0, int nc) {
    if (nc <= 0) return;
    cudaStream_t s = ctx_->stream();
    lstage_->stage(logits_.get(), nc, n_vocab_, p.ddst + c0, s);
    if (p.host_logits)
      DZ_CUDA_CHECK(
          cudaMemcpyAsync(logits_host_, logits_.get(), size_t(nc) * size_t(n_vocab_) * 4, cudaMemcpyDeviceToHost, s));
  }
  bool moe_fused_for(int T) const {
    return path_ == cuda::MoePath::kFused ||
           (path_ == cuda::MoePath::kAuto && moe_->choose(T) == cuda::MoePath::kFused);
  }
  void check_folding(int64_t E, int64_t H, int64_t I);

  int dev_ = 0;
  cuda::KvStorageFn storage_fn_ = nullptr;
  cuda::MoePath path_ = cuda::MoePath::kAuto;
  bool fp8_experts_ = false;  // DZ_EXPERTS_FP8
  bool auto_w4a8_ = false;    // the W4A8 kernels where the MoE layer's options choose them (AUTO, FP8)
  int attention_terms_ = 2;   // prefill attention: queries and probabilities as 2 bf16 terms or 1 (DZ_ATTENTION_BF16)
  int exact_moe_layers_ = 0;  // AUTO: first and last layers kept on the exact (fused MXFP4) path
  uint64_t device_bytes_ = 0;
  std::unique_ptr<cuda::Context> ctx_;
  std::unique_ptr<cuda::Bf16Gemm> gemm_;
  std::unique_ptr<cuda::MoeLayer> moe_;
  DeviceArray<uint16_t> embed_d_, lm_head_d_;
  DeviceArray<float> final_norm_d_;
  std::vector<DevLayer> dl_;
  // Scratch for max_rows_ rows (dz_model_params.pass_tokens, 0: kMaxRows).
  int max_rows_ = kMaxRows;
  DeviceArray<float> x_, xn_, qkv_, rlog_, gw_, logits_;
  DeviceArray<uint16_t> xb_, att_;
  DeviceArray<int32_t> ids_;
  DeviceArray<uint8_t> meta_;
  DeviceArray<float> att_part_;      // split decode attention partials
  DeviceArray<int32_t> att_ticket_;  // and its ticket counters (zero between launches)
  cuda::DecodeSplitPolicy split_;
  float* logits_host_ = nullptr;                // pinned [kLogitRows][V]
  std::unique_ptr<cuda::LogitStaging> lstage_;  // each logit row's argmax; sample_on_device
  uint8_t* stage_ = nullptr;                    // pinned staging of the metadata (uploaded with one copy)
  size_t stage_cap_ = 0;
  cudaEvent_t stage_ev_ = nullptr;         // after the last upload from stage_: rewrite only once it completed
  int* err_host_ = nullptr;                // pinned copy of the MoE error flag
  std::unique_ptr<ThreadPool> copy_pool_;  // host copies of many logits rows (batched decode: 51 MB at B = 64)
  cuda::GraphCache graphs_{"gpt_oss", kMaxGraphs};
  std::mutex mu_;  // one forward at a time (shared scratch)
};

GptOssCuda::GptOssCuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
    : GptOssDesc(cfg, ws), dev_(params.device_index) {
  const std::string& src = cfg.source();
  require_cuda_device("gpt_oss");
  storage_fn_ = cuda::device_kv_storage(dev_);
  check(params.bf16_sensitive != 0, DZ_ERR_UNSUPPORTED,
        "gpt_oss CUDA: bf16_sensitive = 0 (lower-precision attention/router/lm_head) is not implemented");
  check(params.activations != DZ_ACTIVATIONS_F32, DZ_ERR_UNSUPPORTED,
        "gpt_oss CUDA: DZ_ACTIVATIONS_F32 is not implemented (the GEMMs take BF16 activations; the CPU backend "
        "computes in fp32)");
  exact_moe_layers_ = params.exact_moe_layers;
  if (params.pass_tokens) max_rows_ = int(params.pass_tokens);  // 256..65536 (checked by dz_model_open)
  attention_terms_ = params.attention == DZ_ATTENTION_BF16 ? 1 : 2;
  switch (params.experts) {
    case DZ_EXPERTS_AUTO:
      path_ = cuda::MoePath::kAuto;
      break;
    case DZ_EXPERTS_NATIVE:
      path_ = cuda::MoePath::kFused;
      break;              // MXFP4 decoded in registers
    case DZ_EXPERTS_FP8:  // E4M3 arithmetic at every size: fused W4A8 kernels, FP8 GEMMs above 16 tokens an expert
      path_ = cuda::MoePath::kAuto;
      fp8_experts_ = true;
      break;
    default:
      fail(DZ_ERR_UNSUPPORTED, "gpt_oss CUDA: dz_expert_precision ", int(params.experts),
           " is not supported (AUTO, NATIVE or FP8)");
  }
  check(glu_.limit == 7.0f && glu_.alpha == 1.702f, DZ_ERR_UNSUPPORTED, src, ": swiglu_limit ", glu_.limit,
        " (the CUDA experts are built for 7)");
  check(cuda::attention_supports(head_dim_), DZ_ERR_UNSUPPORTED, src, ": head_dim ", head_dim_,
        " (the CUDA attention is built for 32, 64, 128)");
  check(n_experts_ <= 256 && n_active_ <= 16, DZ_ERR_UNSUPPORTED, src, ": ", n_experts_, " experts top-", n_active_,
        " (CUDA router: at most 256, top-16)");

  // The pool: weights + scratch; the KV arenas are allocated beside it.
  const int64_t H = hidden_, I = inter_, E = n_experts_, QD = q_dim(), KVD = kv_dim(), V = n_vocab_;
  const size_t weights = size_t(ws.total_bytes());
  // A pass row: the activations below; cuda::MoeLayer says what it reserves
  // for max_rows_ (at 16384 rows of gpt-oss-120b 1.18 GB: its buffers for
  // other paths grow on first use). The 3 GiB: what such growth may take
  // (gpt-oss's FP8 workspace and gate_up's bf16 output where whole-K tables
  // are missing, 1.6 GB at that size), GEMM workspaces and the rest.
  cuda::MoeShape ms;
  ms.n_experts = n_experts_;
  ms.topk = n_active_;
  ms.hidden = int(H);
  ms.intermediate = int(I);
  const int64_t row = 4 * 4 * H + 4 * (QD + 2 * KVD) + 2 * H + 2 * QD + 8 * E + 256;
  const size_t scratch = size_t(max_rows_) * size_t(row) + cuda::MoeLayer::reserved_bytes(ms, max_rows_) +
                         size_t(kLogitRows) * size_t(V) * 4 +
                         4 * cuda::decode_partial_floats(kAttnGroupRows, n_heads_, int(head_dim_), split_.max_splits) +
                         (size_t(3) << 30);
  int n = 0;
  DZ_CUDA_CHECK(cudaGetDeviceCount(&n));
  check(dev_ < n, DZ_ERR_INVALID_ARGUMENT, "device_index ", dev_, " but ", n, " CUDA devices are present");
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  size_t free_b = 0, total_b = 0;
  DZ_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  cuda::ContextOptions co;
  co.device = dev_;
  co.pool_bytes = std::min(weights + scratch, free_b / 10 * 9);
  ctx_ = std::make_unique<cuda::Context>(co);
  gemm_ = std::make_unique<cuda::Bf16Gemm>(*ctx_);
  moe_ = std::make_unique<cuda::MoeLayer>(*ctx_, ms, max_rows_);
  if (fp8_experts_) moe_->options().use_e4m3_activations();
  // NATIVE: fp16 activations throughout (the W4A16 kernels); AUTO: the
  // library's default (two-term E4M3 W4A8 kernels where they are faster).
  // Applied per layer in enqueue (exact layers keep fp16 activations).
  auto_w4a8_ = moe_->options().fused_w4a8 && path_ == cuda::MoePath::kAuto;

  // Weights through pinned staging buffers (host threads copy, the copy
  // engine uploads), reported as "upload weights" to params.progress against
  // the checkpoint's bytes (norms and biases grow to fp32 on the way).
  cuda::WeightLoader ld(ctx_->pool(), weights, params, "gpt_oss");
  embed_d_ = ld.bf16({&embed_}, "embed_tokens");
  lm_head_d_ = lm_head_.data == embed_.data ? DeviceArray<uint16_t>() : ld.bf16({&lm_head_}, "lm_head");
  final_norm_d_ = ld.array(final_norm_, "model.norm");
  dl_.resize(size_t(n_layers_));
  for (int li = 0; li < n_layers_; ++li) {
    const GptOssLayer& L = layers_[size_t(li)];
    DevLayer& d = dl_[size_t(li)];
    d.sliding = L.sliding;
    d.qkv_w = ld.bf16({&L.q, &L.k, &L.v}, "qkv_proj");
    d.o_w = ld.bf16({&L.o}, "o_proj");
    d.router_w = ld.bf16({&L.router}, "router");
    if (!L.bq.empty()) {
      std::vector<float> b(L.bq);
      b.insert(b.end(), L.bk.begin(), L.bk.end());
      b.insert(b.end(), L.bv.begin(), L.bv.end());
      d.qkv_b = ld.array(b, "qkv bias");
      d.o_b = ld.array(L.bo, "o_proj bias");
    }
    d.router_b = ld.array(L.router_bias, "router bias");
    d.in_norm = ld.array(L.in_norm, "input_layernorm");
    d.post_norm = ld.array(L.post_norm, "post_attention_layernorm");
    d.sinks = ld.array(L.sinks, "sinks");
    d.w1b = ld.array(L.gate_up.blocks, L.gate_up.block_bytes(E), "gate_up blocks");
    d.w1s = ld.array(L.gate_up.scales, L.gate_up.scale_bytes(E), "gate_up scales");
    d.w2b = ld.array(L.down.blocks, L.down.block_bytes(E), "down blocks");
    d.w2s = ld.array(L.down.scales, L.down.scale_bytes(E), "down scales");
    std::vector<uint16_t> b1(L.gate_up_bias.size()), b2(L.down_bias.size());
    for (size_t i = 0; i < b1.size(); ++i)
      b1[i] = cuda::f32_to_bf16(L.gate_up_bias[i]);  // BF16 in the checkpoint: exact
    for (size_t i = 0; i < b2.size(); ++i) b2[i] = cuda::f32_to_bf16(L.down_bias[i]);
    d.b1 = ld.array(b1.data(), b1.size(), "gate_up bias");
    d.b2 = ld.array(b2.data(), b2.size(), "down bias");
  }
  ld.finish(src);
  device_bytes_ = ld.bytes();
  check_folding(E, H, I);
  auto& pool = ctx_->pool();
  const size_t MR = size_t(max_rows_);
  x_ = DeviceArray<float>(pool, MR * H, "x");
  xn_ = DeviceArray<float>(pool, MR * H, "xn");
  qkv_ = DeviceArray<float>(pool, MR * size_t(QD + 2 * KVD), "qkv");
  rlog_ = DeviceArray<float>(pool, MR * E, "router logits");
  gw_ = DeviceArray<float>(pool, MR * n_active_, "gate weights");
  ids_ = DeviceArray<int32_t>(pool, MR * n_active_, "expert ids");
  xb_ = DeviceArray<uint16_t>(pool, MR * H, "x bf16");
  att_ = DeviceArray<uint16_t>(pool, MR * QD, "attention out");
  logits_ = DeviceArray<float>(pool, size_t(kLogitRows) * V, "logits");
  att_part_ =
      DeviceArray<float>(pool, cuda::decode_partial_floats(kAttnGroupRows, n_heads_, int(head_dim_), split_.max_splits),
                         "decode attention partials");
  att_ticket_ = DeviceArray<int32_t>(pool, cuda::decode_ticket_ints(kAttnGroupRows, n_heads_, n_kv_heads_),
                                     "decode attention tickets");
  DZ_CUDA_CHECK(cudaMemset(att_ticket_.get(), 0, att_ticket_.bytes()));
  meta_ = DeviceArray<uint8_t>(pool, size_t(1) << 20, "batch metadata");
  DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&logits_host_), size_t(kLogitRows) * V * 4));
  DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&err_host_), sizeof(int)));
  lstage_ = std::make_unique<cuda::LogitStaging>(pool, kLogitRows);
  *err_host_ = 0;
  stage_cap_ = size_t(1) << 20;
  DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&stage_), stage_cap_));
  DZ_CUDA_CHECK(cudaEventCreateWithFlags(&stage_ev_, cudaEventDisableTiming));
  copy_pool_ = std::make_unique<ThreadPool>(helper_threads());
  DZ_CUDA_CHECK(cudaDeviceSynchronize());
  log_info("gpt_oss on ", ctx_->describe(), ": ", device_bytes_ >> 20, " MiB of weights on the device (checkpoint ",
           weights >> 20, " MiB)");
}

// The spread check of the experts' FP4 -> FP8 folding, on the device at load:
// lossy 1x128 groups are counted and reported, never assumed away; each
// projection whose 64-row x 128 groups all fold exactly keeps its group table
// (mxfp4_group_table) for the FP8 path's grouped GEMMs, and each whose 64-row
// groups fold exactly over all of K its whole-K table (the MXFP4 GEMM's
// whole-K scales, mxfp4_whole_k_table).
void GptOssCuda::check_folding(int64_t E, int64_t H, int64_t I) {
  cudaStream_t s = ctx_->stream();
  cpu::FoldStats by_row, by_group, by_whole;
  int grouped = 0, whole = 0, projections = 0;
  size_t table_bytes = 0;
  for (int li = 0; li < n_layers_; ++li) {
    DevLayer& d = dl_[size_t(li)];
    const struct {
      const DeviceArray<uint8_t>& b;
      const DeviceArray<uint8_t>& sc;
      int64_t rows, k;
      DeviceArray<uint8_t>& table;
      DeviceArray<uint8_t>& whole;
    } projs[2] = {{d.w1b, d.w1s, 2 * I, H, d.w1g, d.w1k}, {d.w2b, d.w2s, H, I, d.w2g, d.w2k}};
    for (const auto& pr : projs) {
      const cuda::Mxfp4Stack st{pr.b.get(), pr.sc.get(), pr.rows, pr.k};
      by_row.merge(cuda::mxfp4_fold_check_device(st, int(E), nullptr, s));
      ++projections;
      pr.table = cuda::mxfp4_exact_group_table(ctx_->pool(), st, int(E), &by_group, s);
      if (pr.table.get()) table_bytes += pr.table.size(), ++grouped;
      pr.whole = cuda::mxfp4_exact_whole_k_table(ctx_->pool(), st, int(E), &by_whole, s);
      if (pr.whole.get()) table_bytes += pr.whole.size(), ++whole;
    }
  }
  log_info("expert folding: ", by_row.groups, " groups of 1x128, ", by_row.lossy_groups, " lossy (max spread ",
           by_row.max_spread, by_row.lossy_groups ? ": FP8 folding is not exact there" : ", exact", "); ",
           by_group.groups, " of 64x128, ", by_group.lossy_groups, " lossy (max spread ", by_group.max_spread,
           "): ", grouped, " of ", projections, " projections fold by 64-row groups; ", by_whole.groups,
           " 64-row groups over all of K, ", by_whole.lossy_groups, " lossy (max spread ", by_whole.max_spread,
           "): ", whole, " of ", projections, " projections fold by them (", table_bytes >> 10, " KiB of tables)");
}

GptOssCuda::~GptOssCuda() {
  if (ctx_) cudaStreamSynchronize(ctx_->stream());
  graphs_.clear();
  if (stage_ev_) cudaEventDestroy(stage_ev_);
  if (stage_) cudaFreeHost(stage_);
  if (err_host_) cudaFreeHost(err_host_);
  if (logits_host_) cudaFreeHost(logits_host_);
}

bool GptOssCuda::sample_on_device(std::span<const DeviceSample> rows, int32_t* tokens) {
  std::lock_guard<std::mutex> lk(mu_);
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  return lstage_->sample(rows, n_vocab_, tokens, ctx_->stream());
}

void GptOssCuda::forward(std::span<ForwardItem> batch, const ForwardOptions& opt) {
  std::lock_guard<std::mutex> lk(mu_);
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  check(!batch.empty(), DZ_ERR_INTERNAL, "gpt_oss forward: empty batch");
  kv::Arena& arena = batch[0].seq->arena();
  check(arena.storage().on_device(), DZ_ERR_INVALID_ARGUMENT,
        "gpt_oss CUDA: the KV arena is in host memory (create it from this model)");
  std::vector<Row> rows;
  std::vector<int64_t> first_row(batch.size());
  std::vector<int32_t> pt;
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardItem& it = batch[b];
    const bool out_ok = it.logits || (it.device_logits && it.argmax && !it.all_logits);
    check(it.seq && !it.tokens.empty() && out_ok && &it.seq->arena() == &arena, DZ_ERR_INTERNAL,
          "gpt_oss forward: malformed batch item ", b);
    first_row[b] = int64_t(rows.size());
    const int64_t start = int64_t(it.seq->length());
    check(start + int64_t(it.tokens.size()) < (int64_t(1) << 31), DZ_ERR_INVALID_ARGUMENT, "sequence too long");
    for (size_t t = 0; t < it.tokens.size(); ++t) {
      const int32_t tok = it.tokens[t];
      check(tok >= 0 && tok < n_vocab_, DZ_ERR_INVALID_ARGUMENT, "token id ", tok, " is outside the vocabulary [0, ",
            n_vocab_, ")");
      rows.push_back({int32_t(b), int32_t(start + int64_t(t)), tok});
    }
    for (kv::PageId p : it.seq->pages()) pt.push_back(int32_t(p));
  }
  const int64_t R = int64_t(rows.size());
  for (int64_t r0 = 0; r0 < R; r0 += max_rows_)
    pass(batch, rows, r0, std::min<int64_t>(R, r0 + max_rows_), first_row, arena, pt, opt);
  uint64_t total = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    uint64_t n = 0;
    const int64_t start = int64_t(batch[b].seq->length());
    for (size_t t = 0; t < batch[b].tokens.size(); ++t) {
      const int64_t pos = start + int64_t(t);
      for (const GptOssLayer& L : layers_)
        n += uint64_t(pos - (L.sliding ? std::max<int64_t>(0, pos - window_ + 1) : 0) + 1);
    }
    total += n;
    if (batch[b].attention_tokens_read) *batch[b].attention_tokens_read += n;
  }
  if (opt.attention_tokens_read) *opt.attention_tokens_read += total;
}

void GptOssCuda::pass(std::span<ForwardItem> batch, const std::vector<Row>& rows, int64_t r0, int64_t r1,
                      const std::vector<int64_t>& first_row, kv::Arena& arena, const std::vector<int32_t>& pt,
                      const ForwardOptions& opt) {
  const int T = int(r1 - r0);
  const int64_t KVD = kv_dim(), D = head_dim_, half = D / 2, V = n_vocab_;
  cudaStream_t s = ctx_->stream();

  // Row metadata for this pass (row indices local to the pass).
  std::vector<int32_t> tokens(static_cast<size_t>(T)), row_item(static_cast<size_t>(T)),
      row_pos(static_cast<size_t>(T)), dec_rows, logit_rows;
  std::vector<int64_t> row_off(static_cast<size_t>(T));
  std::vector<float> cs(size_t(T * half)), sn(size_t(T * half));
  std::vector<int32_t> item_pt(batch.size());
  {
    int32_t off = 0;
    for (size_t b = 0; b < batch.size(); ++b) item_pt[b] = off, off += int32_t(batch[b].seq->pages().size());
  }
  std::vector<cuda::AttnTile> tiles;
  const int tile_rows = cuda::attention_tile_rows(n_heads_, n_kv_heads_);
  const size_t ltb = size_t(2 * KVD) * kKvBytes;
  std::vector<float*> logit_dst, dev_dst;  // per logit row: host or DeviceLogits destination (the other null)
  std::vector<int32_t*> argmax_dst;
  int chunks_full = 1, chunks_sliding = 1;  // most chunks a decode row needs (split attention grid)
  for (int i = 0; i < T; ++i) {
    const Row& rw = rows[size_t(r0 + i)];
    const kv::Sequence& seq = *batch[size_t(rw.item)].seq;
    tokens[size_t(i)] = rw.token;
    row_item[size_t(i)] = rw.item;
    row_pos[size_t(i)] = rw.pos;
    row_off[size_t(i)] = int64_t(seq.page_of(size_t(rw.pos))) * int64_t(arena.page_bytes()) +
                         int64_t(seq.slot_of(size_t(rw.pos))) * int64_t(ltb);
    cpu::rope_cos_sin(rope_, rw.pos, cs.data() + i * half, sn.data() + i * half);
    const ForwardItem& it = batch[size_t(rw.item)];
    const int64_t k = (r0 + i) - first_row[size_t(rw.item)];  // row within the item
    const int64_t n = int64_t(it.tokens.size());
    if (n == 1) {
      dec_rows.push_back(i);
      const int len = rw.pos + 1;
      chunks_full = std::max(chunks_full, cuda::decode_chunks(len, split_, split_.max_splits));
      chunks_sliding =
          std::max(chunks_sliding, cuda::decode_chunks(std::min<int>(len, int(window_)), split_, split_.max_splits));
    } else if (i == 0 || row_item[size_t(i - 1)] != rw.item || tiles.back().n == tile_rows) {
      tiles.push_back({i, 1});
    } else {
      ++tiles.back().n;
    }
    if (it.all_logits || k == n - 1) {
      logit_rows.push_back(i);
      logit_dst.push_back(it.device_logits ? nullptr : it.logits + (it.all_logits ? k : 0) * V);
      dev_dst.push_back(it.device_logits);
      argmax_dst.push_back(it.device_logits ? it.argmax : nullptr);
    }
  }
  // A fixed order, so that a decode batch of B rows has the same offsets every
  // step: only the page table, packed last, varies in length.
  cuda::Packer pk;
  const size_t o_tok = pk.add(tokens), o_item = pk.add(row_item), o_pos = pk.add(row_pos), o_off = pk.add(row_off),
               o_cs = pk.add(cs), o_sn = pk.add(sn), o_dec = pk.add(dec_rows), o_lr = pk.add(logit_rows),
               o_tiles = pk.add(tiles), o_dd = pk.add(dev_dst), o_ipt = pk.add(item_pt), o_pt = pk.add(pt);
  const size_t need = pk.bytes().size();
  // The previous upload from the staging buffer must have completed before it is rewritten.
  DZ_CUDA_CHECK(cudaEventSynchronize(stage_ev_));
  if (meta_.bytes() < need) {
    DZ_CUDA_CHECK(cudaStreamSynchronize(s));  // no queued work may still read the old metadata
    graphs_.clear();                          // they point into it
    meta_.reset();
    meta_ = DeviceArray<uint8_t>(ctx_->pool(), need * 2, "batch metadata");
  }
  if (stage_cap_ < need) {
    DZ_CUDA_CHECK(cudaFreeHost(stage_));
    stage_ = nullptr;
    stage_cap_ = 0;
    DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&stage_), need * 2));
    stage_cap_ = need * 2;
  }
  std::memcpy(stage_, pk.bytes().data(), need);
  uint8_t* m = meta_.get();
  DZ_CUDA_CHECK(cudaMemcpyAsync(m, stage_, need, cudaMemcpyHostToDevice, s));
  DZ_CUDA_CHECK(cudaEventRecord(stage_ev_, s));

  PassArgs p;
  p.T = T;
  p.n_dec = int(dec_rows.size());
  p.n_tiles = int(tiles.size());
  p.n_logit = int(logit_rows.size());
  p.host_logits = std::any_of(logit_dst.begin(), logit_dst.end(), [](const float* d) { return d != nullptr; });
  p.ddst = reinterpret_cast<float* const*>(m + o_dd);
  // Grids as powers of two: a graph serves a range of contexts (a row's
  // chunking does not depend on the grid as long as it fits).
  p.splits_full = int(cuda::pow2_at_least(chunks_full));
  p.splits_sliding = int(cuda::pow2_at_least(chunks_sliding));
  p.tok = reinterpret_cast<const int32_t*>(m + o_tok);
  p.off = reinterpret_cast<const int64_t*>(m + o_off);
  p.cs = reinterpret_cast<const float*>(m + o_cs);
  p.sn = reinterpret_cast<const float*>(m + o_sn);
  p.dec = reinterpret_cast<const int32_t*>(m + o_dec);
  p.lr = reinterpret_cast<const int32_t*>(m + o_lr);
  p.tiles = reinterpret_cast<const cuda::AttnTile*>(m + o_tiles);
  p.arena = &arena;
  cuda::AttnBatch& ab = p.ab;
  ab.page_bytes = int64_t(arena.page_bytes());
  ab.page_tokens = int(arena.page_tokens());
  ab.page_table = reinterpret_cast<const int32_t*>(m + o_pt);
  ab.item_pt = reinterpret_cast<const int32_t*>(m + o_ipt);
  ab.row_item = reinterpret_cast<const int32_t*>(m + o_item);
  ab.row_pos = reinterpret_cast<const int32_t*>(m + o_pos);
  ab.n_heads = n_heads_;
  ab.n_kv_heads = n_kv_heads_;
  ab.head_dim = int(D);
  ab.scale = scale_;
  ab.q = qkv_.get();
  ab.q_stride = int(q_dim() + 2 * KVD);
  ab.out = att_.get();
  ab.terms = attention_terms_;

  // Decode batches (every row a single token of its own item, logits of each)
  // run as CUDA graphs; the metadata's offsets are fixed for a batch size, and
  // the kernels read everything else from it.
  const bool decode = p.n_dec == T && p.n_logit == T && T <= kLogitRows && int(batch.size()) == T;
  if (decode && moe_fused_for(T)) {
    const cuda::GraphCache::Key key = {T,
                                       p.splits_full,
                                       p.splits_sliding,
                                       ab.page_tokens,
                                       ab.page_bytes,
                                       p.host_logits,
                                       int64_t(reinterpret_cast<intptr_t>(arena.storage().data())),
                                       int64_t(reinterpret_cast<intptr_t>(m))};
    opt.poll_abort();
    graphs_.run(key, s, [&](bool capturing) { enqueue(p, capturing ? nullptr : &opt); });
  } else {
    enqueue(p, &opt);
  }
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  auto copy_rows = [&](int c0, int nc) {
    for (int i = 0; i < nc; ++i)
      if (argmax_dst[size_t(c0 + i)]) *argmax_dst[size_t(c0 + i)] = lstage_->argmax_host()[i];
    if (!p.host_logits) return;
    const size_t grain = std::max<size_t>(1, (size_t(4) << 20) / (size_t(V) * 4));  // ~4 MB per task
    parallel_for(nc * V * 4 > (int64_t(8) << 20) ? copy_pool_.get() : nullptr, size_t(nc), grain,
                 [&](size_t i0, size_t i1) {
                   for (size_t i = i0; i < i1; ++i)
                     if (float* d = logit_dst[size_t(c0) + i])
                       std::memcpy(d, logits_host_ + i * size_t(V), size_t(V) * 4);
                 });
  };
  if (p.n_logit <= kLogitRows) copy_rows(0, p.n_logit);

  // More logit rows than one lm_head chunk (long prefills with all logits).
  const uint16_t* lm = lm_head_d_.get() ? lm_head_d_.get() : embed_d_.get();
  const int H = int(hidden_);
  for (int c0 = 0; p.n_logit > kLogitRows && c0 < p.n_logit; c0 += kLogitRows) {
    const int nc = std::min(kLogitRows, p.n_logit - c0);
    cuda::rms_norm(x_.get(), p.lr + c0, nc, H, final_norm_d_.get(), eps_, nullptr, xb_.get(), s);
    gemm_->run(xb_.get(), lm, nullptr, logits_.get(), nc, int(V), H, 0.f, s);
    out_logits(p, c0, nc);
    DZ_CUDA_CHECK(cudaStreamSynchronize(s));
    copy_rows(c0, nc);
  }
  const int moe_err = *err_host_;
  *err_host_ = 0;
  check(moe_err == 0, DZ_ERR_INTERNAL, "gpt_oss CUDA: an expert id was out of range");
}

void GptOssCuda::enqueue(const PassArgs& p, const ForwardOptions* abort_between) {
  const int T = p.T;
  const int64_t H = hidden_, QD = q_dim(), KVD = kv_dim(), D = head_dim_, V = n_vocab_;
  const int qkv_n = int(QD + 2 * KVD);
  cudaStream_t s = ctx_->stream();
  cuda::AttnBatch ab = p.ab;
  kv::Arena& arena = *p.arena;
  auto abort_check = [&] {
    if (abort_between) abort_between->poll_abort([&] { cudaStreamSynchronize(s); });
  };

  float* x = x_.get();
  cuda::embed_gather(embed_d_.get(), p.tok, T, int(H), x, s);
  for (int li = 0; li < n_layers_; ++li) {
    abort_check();
    const DevLayer& L = dl_[size_t(li)];
    uint8_t* kv_layer = arena.storage().data() + arena.layer_offset(uint32_t(li));
    if (T <= cuda::Bf16Gemm::kSmallMaxM && cuda::bf16_gemv_norm_fits(x, L.qkv_w.get(), T, qkv_n, int(H))) {
      cuda::bf16_gemv_norm(x, L.in_norm.get(), eps_, L.qkv_w.get(), L.qkv_b.get(), qkv_.get(), T, qkv_n, int(H), s);
    } else {
      cuda::rms_norm(x, nullptr, T, int(H), L.in_norm.get(), eps_, nullptr, xb_.get(), s);
      gemm_->run(xb_.get(), L.qkv_w.get(), L.qkv_b.get(), qkv_.get(), T, qkv_n, int(H), 0.f, s);
    }
    cuda::rope_qk_store_kv(qkv_.get(), T, qkv_n, p.cs, p.sn, n_heads_, n_kv_heads_, int(D), kv_layer, p.off, s);
    ab.kv = kv_layer;
    ab.window = L.sliding ? int(window_) : 0;
    ab.sinks = L.sinks.get();
    cuda::attention_decode_split(ab, p.dec, p.n_dec, L.sliding ? p.splits_sliding : p.splits_full, split_,
                                 {att_part_.get(), att_part_.size(), att_ticket_.get(), att_ticket_.size()}, s);
    cuda::attention_prefill(ab, p.tiles, p.n_tiles, cuda::attention_tile_rows(n_heads_, n_kv_heads_), s);
    gemm_->run(att_.get(), L.o_w.get(), L.o_b.get(), x, T, int(H), int(QD), 1.f, s);  // x += o_proj(att)
    if (cuda::router_fused_fits(T, int(H), n_experts_, n_active_)) {                  // a decode step: one launch
      cuda::router_fused(x, T, int(H), L.post_norm.get(), eps_, L.router_w.get(), L.router_b.get(), n_experts_,
                         n_active_, xn_.get(), rlog_.get(), ids_.get(), gw_.get(), s);
    } else {
      cuda::rms_norm(x, nullptr, T, int(H), L.post_norm.get(), eps_, xn_.get(), xb_.get(), s);
      gemm_->run(xb_.get(), L.router_w.get(), L.router_b.get(), rlog_.get(), T, n_experts_, int(H), 0.f, s);
      cuda::router_topk_softmax(rlog_.get(), T, n_experts_, n_active_, ids_.get(), gw_.get(), s);
    }
    cuda::MoeWeights mw;
    mw.w1_blocks = L.w1b.get();
    mw.w1_scales = L.w1s.get();
    mw.b1 = L.b1.get();
    mw.w2_blocks = L.w2b.get();
    mw.w2_scales = L.w2s.get();
    mw.b2 = L.b2.get();
    mw.w1_gmax = L.w1g.get();
    mw.w2_gmax = L.w2g.get();
    mw.w1_gk = L.w1k.get();
    mw.w2_gk = L.w2k.get();
    const bool exact = !fp8_experts_ && (li < exact_moe_layers_ || li >= n_layers_ - exact_moe_layers_);
    const cuda::MoePath lp = path_ == cuda::MoePath::kAuto && exact ? cuda::MoePath::kFused : path_;
    moe_->options().fused_w4a8 = auto_w4a8_ && !exact;                    // exact layers: fp16 activations
    moe_->forward(mw, xn_.get(), ids_.get(), gw_.get(), T, x, lp, true);  // x += experts(xn)
  }
  abort_check();
  if (p.n_logit <= kLogitRows) {
    const uint16_t* lm = lm_head_d_.get() ? lm_head_d_.get() : embed_d_.get();
    cuda::rms_norm(x, p.lr, p.n_logit, int(H), final_norm_d_.get(), eps_, nullptr, xb_.get(), s);
    gemm_->run(xb_.get(), lm, nullptr, logits_.get(), p.n_logit, int(V), int(H), 0.f, s);
    out_logits(p, 0, p.n_logit);
  }
  int* err = moe_->error_flag();
  DZ_CUDA_CHECK(cudaMemcpyAsync(err_host_, err, sizeof(int), cudaMemcpyDeviceToHost, s));
  DZ_CUDA_CHECK(cudaMemsetAsync(err, 0, sizeof(int), s));
}

}  // namespace

std::unique_ptr<Family> make_gpt_oss_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  return std::make_unique<GptOssCuda>(cfg, ws, params);
}

}  // namespace dz

#endif  // DZ_WITH_CUDA
