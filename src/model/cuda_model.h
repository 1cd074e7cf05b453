// What the DeepSeek-lineage CUDA families (deepseek_v32, deepseek_v4, kimi_linear) share:
// the device and its memory pool, the BF16 GEMMs, the model's two ends on the
// device (embeddings in; final norm, lm_head and the logit rows out), dense
// SwiGLU MLPs, routed MXFP4 experts in cuda::MoeLayer's layout, and pass
// scratch grown on demand. Each family keeps its own layers and passes.
#pragma once

#ifdef DZ_WITH_CUDA

#include <cuda_runtime.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cpu/mla.h"
#include "cuda/bf16_gemm.h"
#include "cuda/moe.h"
#include "model/family.h"
#include "model/lm_ends.h"
#include "model/moe_ffn.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/graph_cache.h"
#include "runtime/cuda/kv_storage.h"
#include "runtime/cuda/logit_rows.h"
#include "runtime/cuda/upload.h"
#include "runtime/device.h"

namespace dz {

// A dense SwiGLU MLP in BF16: gate_up [2 inter, H] (gate rows, then up rows), down [H, inter].
struct DevMlp {
  int64_t inter = 0;  // 0: none
  cuda::DeviceArray<uint16_t> gate_up, down;
};

// A layer's routed experts in MXFP4 as cuda::MoeLayer takes them: gate_up [E][2I] rows (gate j at 2j, up j at
// 2j + 1), down [E][H] rows; blocks, then E8M0 scales.
struct DevMxfp4Experts {
  cuda::DeviceArray<uint8_t> w1b, w1s, w2b, w2s;
  cuda::MoeWeights weights() const;
};

// A model's routed experts counted layer by layer (add): all MXFP4 or all in
// other formats, which the CUDA families require.
struct ExpertFormats {
  static bool is_mxfp4(const SwiGlu& x);
  void add(const std::vector<SwiGlu>& experts);
  // Whether every expert is MXFP4; DZ_ERR_UNSUPPORTED (naming src) for a mix.
  bool all_mxfp4(const std::string& src) const;
  int mxfp4 = 0, other = 0;
  int64_t inter = 0;  // the experts' SwiGLU width (0: none)
};

class CudaModelCore {
 public:
  static constexpr int kLogitRows = 256;  // lm_head rows a GEMM

  // Device `dev` with one pool of `pool_bytes` (at most 90% of its free memory); `family` names it in messages.
  CudaModelCore(int dev, size_t pool_bytes, const char* family);
  int dev() const { return dev_; }
  int sms() const { return sms_; }
  cuda::Context& ctx() { return *ctx_; }
  cuda::Bf16Gemm& gemm() { return *gemm_; }
  cudaStream_t stream() const { return ctx_->stream(); }

  // a grows to at least n elements (contents dropped).
  template <typename T>
  T* room(cuda::DeviceArray<T>& a, size_t n, const char* what) {
    if (a.size() < n) {
      a.reset();
      a = cuda::DeviceArray<T>(ctx_->pool(), n, what);
      ++scratch_gen_;
    }
    return a.get();
  }

  // Uploads through ld (the model's WeightLoader on this pool).
  void load_ends(cuda::WeightLoader& ld, const LmEnds& ends);
  static DevMlp load_mlp(cuda::WeightLoader& ld, const SwiGlu& m);
  static DevMxfp4Experts load_mxfp4_experts(cuda::WeightLoader& ld, const std::vector<SwiGlu>& experts, int64_t H,
                                            int64_t I);

  // The batch's arena (on the device: else DZ_ERR_INVALID_ARGUMENT) and its items' page ids, item b's from
  // page_ids[item_page[b]] on.
  static kv::Arena& batch_pages(std::span<ForwardItem> batch, std::vector<int32_t>& page_ids,
                                std::vector<int32_t>& item_page, const char* family);
  // DeepSeek-V3's grouped sigmoid routing of xb [T, H] bf16: logits [T, E] (scratch) = xb router_w^T, then each
  // row's ids / weights [T, k].
  void route(const uint16_t* xb, const uint16_t* router_w, const float* bias, const MoeRouting& r, int T, int H,
             float* logits, int32_t* ids, float* weights, cudaStream_t s);
  // x [T, H] = the token rows' embeddings.
  void embed(const int32_t* tokens, int T, int H, float* x, cudaStream_t s);
  // x [T, H] += down(silu(gate(xb)) * up(xb)), xb [T, H] bf16; limit > 0 clamps the SwiGLU (silu_mul's).
  void mlp(const DevMlp& f, const uint16_t* xb, int T, int H, float* x, cudaStream_t s, float limit = 0);
  // The logit rows `rows` (device, n of them) of the residual stream x [*, H]: final RMSNorm, lm_head,
  // then per row its argmax / device copy / host copy (LogitStaging::stage / collect: ddst a device array of n
  // pointers, host_dst and argmax_dst n entries), kLogitRows at a time. xb: bf16 scratch of kLogitRows x H.
  void logits(const float* x, const int32_t* rows, int n, int H, int V, float eps, uint16_t* xb, float* const* ddst,
              const std::vector<float*>& host_dst, const std::vector<int32_t*>& argmax_dst, cudaStream_t s);
  // logits in two halves for n <= kLogitRows, so that the first can be part of a CUDA graph: stage enqueues the
  // norm, lm_head, argmaxes and device rows (no host synchronisation); collect then delivers the host rows and
  // argmaxes (LogitStaging's).
  void logits_stage(const float* x, const int32_t* rows, int n, int H, int V, float eps, uint16_t* xb,
                    float* const* ddst, cudaStream_t s);
  void logits_collect(int n, int V, const std::vector<float*>& host_dst, const std::vector<int32_t*>& argmax_dst,
                      cudaStream_t s);

  // Absorbed MLA attention of T rows over their sequences' cached latents (bf16 [c_kv | k_rope] at the start of
  // each `stride`-byte record, `pages` a page table a row): qa [T, heads, rank + rope] fp32 (W_UK^T q_nope, then
  // the roped q_rope) -> out [T, heads, rank] fp32. sel [T, topk] picks each row's positions; null: row t attends
  // its first n_visible[t], topk their maximum. The tensor-core kernel at 512 + 64 with heads in 16s (qa rounded
  // to BF16 in qab), else the generic one; qab and scratch grow as room().
  void mla_attend(const cpu::MlaDims& d, int T, const float* qa, const int32_t* sel, const int64_t* n_visible, int topk,
                  const uint8_t* const* const* pages, uint32_t page_tokens, size_t stride, float* out,
                  cuda::DeviceArray<uint16_t>& qab, cuda::DeviceArray<uint8_t>& scratch, cudaStream_t s);
  // A pass after its metadata upload: `layers(capturing)` enqueues its launches up to the hidden states x [*, H]
  // of its logit rows `rows` (device, n of them; see logits for ddst, host_dst and argmax_dst), then the logits.
  // A decode step (n <= kLogitRows) runs as a CUDA graph under its key (GraphCache::run), other passes eagerly;
  // `layers` polls opt's abort between layers unless capturing. Ends as finish_pass(moe).
  void run_pass(bool decode, const cuda::GraphCache::Key& key, const ForwardOptions& opt,
                const std::function<void(bool capturing)>& layers, const float* x, const int32_t* rows, int n, int H,
                int V, float eps, uint16_t* xb, float* const* ddst, const std::vector<float*>& host_dst,
                const std::vector<int32_t*>& argmax_dst, cuda::MoeLayer* moe);
  // A decode step's key: the rows, page count, the arena's pages and storage, the metadata's address, how often
  // scratch moved, then the family's own values (grid buckets, other scratch generations).
  cuda::GraphCache::Key step_key(int T, int P, kv::Arena& arena, const void* meta,
                                 std::initializer_list<int64_t> extra) const;
  // ForwardOptions::poll_abort between layers: the stream's queued work completes before DZ_ERR_CANCELLED.
  void poll_abort(const ForwardOptions& opt);
  // A pass's end: waits for its logits, then DZ_ERR_INTERNAL if the MoE layer `moe` (null: none) saw an expert id
  // out of range.
  void finish_pass(cuda::MoeLayer* moe);

  std::unique_ptr<DeviceLogits> make_device_logits(int V) {
    return cuda::make_device_logits(ctx_->pool(), dev_, V, family_);
  }
  // Family::sample_on_device (the caller holds the family's lock).
  bool sample(std::span<const DeviceSample> rows, int V, int32_t* tokens);

 private:
  int dev_ = 0, sms_ = 132;
  uint64_t scratch_gen_ = 0;  // how often room() moved a buffer: in step_key, so no graph replays moved scratch
  const char* family_;
  std::unique_ptr<cuda::Context> ctx_;
  std::unique_ptr<cuda::Bf16Gemm> gemm_;
  std::unique_ptr<cuda::LogitStaging> lstage_;
  std::unique_ptr<cuda::GraphCache> graphs_;  // decode steps as CUDA graphs
  cuda::DeviceArray<uint16_t> embed_, lm_head_;
  cuda::DeviceArray<float> final_norm_;
  cuda::DeviceArray<float> h_, logits_;
  cuda::DeviceArray<uint16_t> hb_;
};

// The Family face these families share over their description `Desc` (the
// layers as read from the checkpoint): info, KV storage on the device, pass
// size, device logits and sampling; and the dz_model_params every one of them
// takes or refuses alike. Each family builds core_ (and moe_, if it routes
// MXFP4 experts) and its layers, and sets device_bytes_.
template <class Desc>
class CudaFamily : public Family, protected Desc {
 public:
  void fill_info(dz_model_info& info) const override {
    this->fill_desc_info(info);
    info.device = DZ_DEVICE_CUDA;
    info.device_bytes = device_bytes_;
  }
  int32_t n_vocab() const override { return this->n_vocab_; }
  std::unique_ptr<kv::Storage> (*kv_storage() const)(size_t) override { return storage_fn_; }
  uint32_t prefill_chunk() const override { return uint32_t(max_rows_); }
  std::unique_ptr<DeviceLogits> make_device_logits() override { return core_->make_device_logits(this->n_vocab_); }
  bool sample_on_device(std::span<const DeviceSample> rows, int32_t* tokens) override {
    std::lock_guard<std::mutex> lk(mu_);
    return core_->sample(rows, this->n_vocab_, tokens);
  }

 protected:
  // desc_args: Desc's constructor's; default_rows: a pass's rows unless params.pass_tokens says otherwise.
  template <class... DescArgs>
  CudaFamily(const char* family, const dz_model_params& params, int default_rows, DescArgs&&... desc_args)
      : Desc(std::forward<DescArgs>(desc_args)...), dev_(params.device_index), max_rows_(default_rows) {
    require_cuda_device(family);
    storage_fn_ = cuda::device_kv_storage(dev_);
    check(params.activations != DZ_ACTIVATIONS_F32, DZ_ERR_UNSUPPORTED, family,
          " CUDA: DZ_ACTIVATIONS_F32 is not implemented (the GEMMs take BF16 activations)");
    check(params.experts == DZ_EXPERTS_AUTO || params.experts == DZ_EXPERTS_NATIVE, DZ_ERR_UNSUPPORTED, family,
          " CUDA: dz_expert_precision ", int(params.experts), " (AUTO or NATIVE so far)");
    check(params.bf16_sensitive != 0, DZ_ERR_UNSUPPORTED, family,
          " CUDA: bf16_sensitive = 0 (lower-precision projections) is not implemented");
    // NATIVE: the fused MXFP4 kernels (FP16 activations) at every batch size;
    // AUTO: FP8 GEMMs (E4M3 activations, 1x128 scales) above the fused path's threshold.
    path_ = params.experts == DZ_EXPERTS_NATIVE ? cuda::MoePath::kFused : cuda::MoePath::kAuto;
    if (params.pass_tokens) max_rows_ = int(params.pass_tokens);
  }
  template <typename T>
  T* room(cuda::DeviceArray<T>& a, size_t n, const char* what) {
    return core_->room(a, n, what);
  }

  int dev_ = 0;
  cuda::MoePath path_ = cuda::MoePath::kAuto;
  cuda::KvStorageFn storage_fn_ = nullptr;
  uint64_t device_bytes_ = 0;
  int max_rows_ = 0;
  std::unique_ptr<CudaModelCore> core_;
  std::unique_ptr<cuda::MoeLayer> moe_;  // null: no layer routes MXFP4 experts
  std::mutex mu_;                        // one forward at a time (shared scratch)
};

}  // namespace dz

#endif  // DZ_WITH_CUDA
