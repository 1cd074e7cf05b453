// Built with the CUDA backend only (the host compiler: model/family.h is C++20).
#ifdef DZ_WITH_CUDA

#include "model/cuda_model.h"

#include <algorithm>
#include <cstring>

#include "cuda/embed.h"
#include "cuda/mla_sparse.h"
#include "cuda/norm.h"
#include "cuda/router.h"
#include "runtime/cuda/cuda_check.h"

namespace dz {

cuda::MoeWeights DevMxfp4Experts::weights() const {
  cuda::MoeWeights w;
  w.w1_blocks = w1b.get(), w.w1_scales = w1s.get(), w.w2_blocks = w2b.get(), w.w2_scales = w2s.get();
  return w;
}

CudaModelCore::CudaModelCore(int dev, size_t pool_bytes, const char* family) : dev_(dev), family_(family) {
  int n = 0;
  DZ_CUDA_CHECK(cudaGetDeviceCount(&n));
  check(dev_ >= 0 && dev_ < n, DZ_ERR_INVALID_ARGUMENT, "device_index ", dev_, " but ", n, " CUDA devices are present");
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  DZ_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev_));
  size_t free_b = 0, total_b = 0;
  DZ_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  cuda::ContextOptions co;
  co.device = dev_;
  co.pool_bytes = std::min(pool_bytes, free_b / 10 * 9);
  ctx_ = std::make_unique<cuda::Context>(co);
  gemm_ = std::make_unique<cuda::Bf16Gemm>(*ctx_);
  lstage_ = std::make_unique<cuda::LogitStaging>(ctx_->pool(), kLogitRows);
  graphs_ = std::make_unique<cuda::GraphCache>(family, 32);
}

void CudaModelCore::load_ends(cuda::WeightLoader& ld, const LmEnds& ends) {
  embed_ = ld.bf16({&ends.embed}, "embed_tokens");
  if (ends.lm_head.data != ends.embed.data) lm_head_ = ld.bf16({&ends.lm_head}, "lm_head");
  final_norm_ = ld.array(ends.final_norm, "model.norm");
}

DevMlp CudaModelCore::load_mlp(cuda::WeightLoader& ld, const SwiGlu& m) {
  DevMlp d;
  d.inter = m.inter;
  if (!m.inter) return d;
  d.gate_up = ld.bf16({&m.gate, &m.up}, "mlp gate_up");
  d.down = ld.bf16({&m.down}, "mlp down");
  return d;
}

DevMxfp4Experts CudaModelCore::load_mxfp4_experts(cuda::WeightLoader& ld, const std::vector<SwiGlu>& experts, int64_t H,
                                                  int64_t I) {
  const int64_t E = int64_t(experts.size()), rb1 = H / 2, rs1 = H / 32, rb2 = I / 2, rs2 = I / 32;
  std::vector<uint8_t> b1(size_t(E * 2 * I * rb1)), s1(size_t(E * 2 * I * rs1)), b2(size_t(E * H * rb2)),
      s2(size_t(E * H * rs2));
  for (int64_t e = 0; e < E; ++e) {
    const SwiGlu& x = experts[size_t(e)];
    for (int64_t j = 0; j < I; ++j)
      for (int u = 0; u < 2; ++u) {
        const cpu::WeightRef& w = u ? x.up : x.gate;
        const int64_t r = (e * I + j) * 2 + u;
        std::memcpy(b1.data() + r * rb1, w.data + j * rb1, size_t(rb1));
        std::memcpy(s1.data() + r * rs1, w.scales + j * rs1, size_t(rs1));
      }
    std::memcpy(b2.data() + e * H * rb2, x.down.data, size_t(H * rb2));
    std::memcpy(s2.data() + e * H * rs2, x.down.scales, size_t(H * rs2));
  }
  DevMxfp4Experts d;
  d.w1b = ld.array(b1, "experts gate_up blocks");
  d.w1s = ld.array(s1, "experts gate_up scales");
  d.w2b = ld.array(b2, "experts down blocks");
  d.w2s = ld.array(s2, "experts down scales");
  return d;
}

bool ExpertFormats::is_mxfp4(const SwiGlu& x) {
  return x.gate.kind == cpu::WeightKind::MXFP4 && x.up.kind == cpu::WeightKind::MXFP4 &&
         x.down.kind == cpu::WeightKind::MXFP4;
}

void ExpertFormats::add(const std::vector<SwiGlu>& experts) {
  for (const SwiGlu& x : experts) {
    (is_mxfp4(x) ? mxfp4 : other)++;
    inter = x.inter;
  }
}

bool ExpertFormats::all_mxfp4(const std::string& src) const {
  check(mxfp4 == 0 || other == 0, DZ_ERR_UNSUPPORTED, src, ": ", mxfp4, " routed experts in MXFP4 and ", other,
        " in other formats; the CUDA backend takes one format for all");
  return mxfp4 > 0;
}

kv::Arena& CudaModelCore::batch_pages(std::span<ForwardItem> batch, std::vector<int32_t>& page_ids,
                                      std::vector<int32_t>& item_page, const char* family) {
  kv::Arena& arena = batch[0].seq->arena();
  check(arena.storage().on_device(), DZ_ERR_INVALID_ARGUMENT, family,
        " CUDA: the KV arena is in host memory (create it from this model)");
  item_page.resize(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    check(&batch[b].seq->arena() == &arena, DZ_ERR_INTERNAL, family, " forward: items of different arenas");
    item_page[b] = int32_t(page_ids.size());
    for (kv::PageId p : batch[b].seq->pages()) page_ids.push_back(int32_t(p));
  }
  return arena;
}

void CudaModelCore::route(const uint16_t* xb, const uint16_t* router_w, const float* bias, const MoeRouting& r, int T,
                          int H, float* logits, int32_t* ids, float* weights, cudaStream_t s) {
  gemm_->run(xb, router_w, nullptr, logits, T, r.n_experts, H, 0.f, s);
  cuda::router_sigmoid_grouped(logits, bias, T, r.n_experts, r.n_group, r.topk_group, r.n_active, r.norm, r.scale, ids,
                               weights, s);
}

void CudaModelCore::embed(const int32_t* tokens, int T, int H, float* x, cudaStream_t s) {
  cuda::embed_gather(embed_.get(), tokens, T, H, x, s);
}

void CudaModelCore::mlp(const DevMlp& f, const uint16_t* xb, int T, int H, float* x, cudaStream_t s, float limit) {
  const int I = int(f.inter);
  float* h = room(h_, size_t(T) * 2 * I, "mlp gate_up out");
  uint16_t* hb = room(hb_, size_t(T) * I, "mlp act");
  gemm_->run(xb, f.gate_up.get(), nullptr, h, T, 2 * I, H, 0.f, s);
  cuda::silu_mul(h, T, I, int64_t(2) * I, hb, s, limit);
  gemm_->run(hb, f.down.get(), nullptr, x, T, H, I, 1.f, s);  // x += down(act)
}

void CudaModelCore::mla_attend(const cpu::MlaDims& d, int T, const float* qa, const int32_t* sel,
                               const int64_t* n_visible, int topk, const uint8_t* const* const* pages,
                               uint32_t page_tokens, size_t stride, float* out, cuda::DeviceArray<uint16_t>& qab,
                               cuda::DeviceArray<uint8_t>& scratch, cudaStream_t s) {
  if (d.rank == cuda::kMlaRank && d.rope == cuda::kMlaRope && d.n_heads % 16 == 0) {
    const size_t n = size_t(T) * d.n_heads * (d.rank + d.rope);
    uint16_t* qb = room(qab, n, "absorbed q bf16");
    cuda::to_bf16(qa, qb, n, s);
    cuda::SparseMlaDecode a;
    a.batch = T, a.n_heads = d.n_heads, a.scale = d.scale, a.q = qb, a.sel = sel, a.n_visible = n_visible;
    a.topk = topk, a.pages = pages, a.page_tokens = page_tokens, a.stride = stride, a.offset = 0, a.out = out;
    const int splits = cuda::sparse_mla_splits(a, sms_);
    const size_t sb = cuda::sparse_mla_scratch_bytes(a, splits);
    cuda::sparse_mla_decode(a, splits, room(scratch, sb, "sparse MLA partials"), sb, s);
    return;
  }
  cuda::SparseMlaGeneric a;
  a.n_q = T, a.n_heads = d.n_heads, a.rank = d.rank, a.rope = d.rope, a.scale = d.scale, a.q = qa, a.sel = sel;
  a.n_visible = n_visible, a.topk = topk, a.pages = pages, a.page_tokens = page_tokens, a.stride = stride;
  a.offset = 0, a.out = out;
  cuda::sparse_mla_generic(a, s);
}

void CudaModelCore::logits(const float* x, const int32_t* rows, int n, int H, int V, float eps, uint16_t* xb,
                           float* const* ddst, const std::vector<float*>& host_dst,
                           const std::vector<int32_t*>& argmax_dst, cudaStream_t s) {
  for (int c0 = 0; c0 < n; c0 += kLogitRows) {
    const int nc = std::min(kLogitRows, n - c0);
    logits_stage(x, rows + c0, nc, H, V, eps, xb, ddst + c0, s);
    logits_collect(nc, V, {host_dst.begin() + c0, host_dst.begin() + c0 + nc},
                   {argmax_dst.begin() + c0, argmax_dst.begin() + c0 + nc}, s);
  }
}

void CudaModelCore::logits_stage(const float* x, const int32_t* rows, int n, int H, int V, float eps, uint16_t* xb,
                                 float* const* ddst, cudaStream_t s) {
  check(n <= kLogitRows, DZ_ERR_INTERNAL, family_, " CUDA: ", n, " logit rows at once");
  const uint16_t* lm = lm_head_.get() ? lm_head_.get() : embed_.get();
  float* out = room(logits_, size_t(std::max(n, 1)) * V, "logits");
  if (n == 0) return;
  cuda::rms_norm(x, rows, n, H, final_norm_.get(), eps, nullptr, xb, s);
  gemm_->run(xb, lm, nullptr, out, n, V, H, 0.f, s);
  lstage_->stage(out, n, V, ddst, s);
}

void CudaModelCore::logits_collect(int n, int V, const std::vector<float*>& host_dst,
                                   const std::vector<int32_t*>& argmax_dst, cudaStream_t s) {
  lstage_->collect(logits_.get(), n, V, host_dst, argmax_dst, s);
}

void CudaModelCore::run_pass(bool decode, const cuda::GraphCache::Key& key, const ForwardOptions& opt,
                             const std::function<void(bool)>& layers, const float* x, const int32_t* rows, int n, int H,
                             int V, float eps, uint16_t* xb, float* const* ddst, const std::vector<float*>& host_dst,
                             const std::vector<int32_t*>& argmax_dst, cuda::MoeLayer* moe) {
  cudaStream_t s = ctx_->stream();
  if (decode) {
    poll_abort(opt);
    graphs_->run(key, s, [&](bool capturing) {
      layers(capturing);
      logits_stage(x, rows, n, H, V, eps, xb, ddst, s);
    });
    logits_collect(n, V, host_dst, argmax_dst, s);
  } else {
    layers(false);
    logits(x, rows, n, H, V, eps, xb, ddst, host_dst, argmax_dst, s);
  }
  finish_pass(moe);
}

cuda::GraphCache::Key CudaModelCore::step_key(int T, int P, kv::Arena& arena, const void* meta,
                                              std::initializer_list<int64_t> extra) const {
  cuda::GraphCache::Key k = {T,
                             P,
                             int64_t(arena.page_bytes()),
                             int64_t(arena.page_tokens()),
                             int64_t(reinterpret_cast<intptr_t>(arena.storage().data())),
                             int64_t(reinterpret_cast<intptr_t>(meta)),
                             int64_t(scratch_gen_)};
  k.insert(k.end(), extra);
  return k;
}

void CudaModelCore::poll_abort(const ForwardOptions& opt) {
  opt.poll_abort([&] { cudaStreamSynchronize(ctx_->stream()); });
}

void CudaModelCore::finish_pass(cuda::MoeLayer* moe) {
  DZ_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream()));
  check(!moe || moe->take_error() == 0, DZ_ERR_INTERNAL, family_, " CUDA: an expert id was out of range");
}

bool CudaModelCore::sample(std::span<const DeviceSample> rows, int V, int32_t* tokens) {
  DZ_CUDA_CHECK(cudaSetDevice(dev_));
  return lstage_->sample(rows, V, tokens, ctx_->stream());
}

}  // namespace dz

#endif  // DZ_WITH_CUDA
