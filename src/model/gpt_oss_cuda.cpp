// gpt-oss on the CUDA backend. Weights are uploaded once into the device pool
// in checkpoint precision: experts stay MXFP4 (blocks + E8M0 scales, BF16
// biases) and run through cuda::MoeLayer (fused W4A16 kernels for few tokens
// per expert, FP4->FP8 workspace + FP8 GEMMs for many); embeddings, attention
// projections, router and lm_head are BF16 through cuBLASLt; norms, biases
// and sinks fp32. The residual stream and the KV cache (paged, on the device)
// are fp32. Tensor validation is GptOssDesc's (shared with the CPU family).
#include "model/gpt_oss.h"

#ifndef DZ_WITH_CUDA

namespace dz {
std::unique_ptr<Family> make_gpt_oss_cuda(const Config&, const WeightStore&, const dz_model_params&) {
  fail(DZ_ERR_UNSUPPORTED, "gpt_oss: this build has no CUDA backend (configure with DZ_CUDA=ON); use DZ_DEVICE_CPU");
}
}  // namespace dz

#else

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "common/host_alloc.h"
#include "common/log.h"
#include "cpu/mxfp4.h"
#include "cuda/attention.h"
#include "cuda/bf16_gemm.h"
#include "cuda/embed.h"
#include "cuda/moe.h"
#include "cuda/norm.h"
#include "cuda/rope.h"
#include "cuda/router.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/device.h"

namespace dz {

namespace {

using cuda::DeviceArray;

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// KV pages on the device: one cudaMalloc per arena (zero-filled), on the
// device the model was opened on (one factory per ordinal: the arena takes a
// plain function pointer).
class DeviceStorage final : public kv::Storage {
 public:
  DeviceStorage(int dev, size_t bytes) : dev_(dev), size_(bytes) {
    DZ_CUDA_CHECK(cudaSetDevice(dev_));
    const cudaError_t e = cudaMalloc(&p_, bytes ? bytes : 1);
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail(DZ_ERR_OUT_OF_MEMORY, "KV arena: cannot allocate ", bytes >> 20, " MiB on CUDA device ", dev_, ": ",
           cudaGetErrorString(e));
    }
    DZ_CUDA_CHECK(cudaMemset(p_, 0, bytes));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~DeviceStorage() override {
    cudaSetDevice(dev_);
    cudaFree(p_);
  }
  uint8_t* data() override { return static_cast<uint8_t*>(p_); }
  size_t size() const override { return size_; }
  void copy(size_t dst, size_t src, size_t bytes) override {
    DZ_CUDA_CHECK(cudaSetDevice(dev_));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());  // no forward may still read or write these pages
    DZ_CUDA_CHECK(cudaMemcpy(data() + dst, data() + src, bytes, cudaMemcpyDeviceToDevice));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  bool on_device() const override { return true; }

 private:
  int dev_;
  void* p_ = nullptr;
  size_t size_;
};

template <int D>
std::unique_ptr<kv::Storage> make_device_storage(size_t bytes) {
  return std::make_unique<DeviceStorage>(D, bytes);
}
using StorageFn = std::unique_ptr<kv::Storage> (*)(size_t);
constexpr StorageFn kStorageFns[] = {make_device_storage<0>, make_device_storage<1>, make_device_storage<2>,
                                     make_device_storage<3>, make_device_storage<4>, make_device_storage<5>,
                                     make_device_storage<6>, make_device_storage<7>};

// Rows per device pass: activations and the MoE scratch are sized for this;
// longer batches run as consecutive passes (KV of earlier passes is in place).
constexpr int kMaxRows = 4096;
constexpr int kLogitRows = 256;  // lm_head rows per GEMM / host copy

struct DevLayer {
  bool sliding = false;
  DeviceArray<uint16_t> qkv_w, o_w, router_w;
  DeviceArray<float> qkv_b, o_b, router_b, in_norm, post_norm, sinks;
  DeviceArray<uint8_t> w1b, w1s, w2b, w2s;
  DeviceArray<uint16_t> b1, b2;
};

// Bytes packed into one host->device copy per pass (256-byte aligned parts).
class Packer {
 public:
  template <typename T>
  size_t add(const T* p, size_t n) {
    const size_t off = (buf_.size() + 255) / 256 * 256;
    buf_.resize(off + n * sizeof(T));
    if (n) std::memcpy(buf_.data() + off, p, n * sizeof(T));
    return off;
  }
  template <typename T>
  size_t add(const std::vector<T>& v) {
    return add(v.data(), v.size());
  }
  const std::vector<uint8_t>& bytes() const { return buf_; }

 private:
  std::vector<uint8_t> buf_;
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
    l.layer_token_bytes.assign(size_t(n_layers_), size_t(2 * kv_dim()) * sizeof(float));
    l.model_key = config_hash_ ^ 0x6375646131ull;  // "cuda1": device pages, fp32 K|V
    return l;
  }
  std::unique_ptr<kv::Storage> (*kv_storage() const)(size_t) override { return kStorageFns[dev_]; }
  void forward(std::span<ForwardItem> batch, const ForwardOptions& opt) override;

 private:
  struct Row {
    int32_t item, pos, token;
  };
  void pass(std::span<ForwardItem> batch, const std::vector<Row>& rows, int64_t r0, int64_t r1,
            const std::vector<int64_t>& first_row, kv::Arena& arena, const std::vector<int32_t>& pt,
            const ForwardOptions& opt);
  template <typename T>
  DeviceArray<T> upload(const T* p, size_t n, const char* what) {
    DeviceArray<T> d(ctx_->pool(), n, what);
    if (n) DZ_CUDA_CHECK(cudaMemcpy(d.get(), p, n * sizeof(T), cudaMemcpyHostToDevice));
    device_bytes_ += n * sizeof(T);
    return d;
  }
  DeviceArray<float> upload_f32(const std::vector<float>& v, const char* what) { return upload(v.data(), v.size(), what); }
  // BF16 rows of the given matrices stacked (checkpoint BF16 copied as is).
  DeviceArray<uint16_t> upload_bf16(std::initializer_list<const cpu::WeightRef*> ws, const char* what);

  int dev_ = 0;
  cuda::MoePath path_ = cuda::MoePath::kAuto;
  uint64_t device_bytes_ = 0;
  std::unique_ptr<cuda::Context> ctx_;
  std::unique_ptr<cuda::Bf16Gemm> gemm_;
  std::unique_ptr<cuda::MoeLayer> moe_;
  DeviceArray<uint16_t> embed_d_, lm_head_d_;
  DeviceArray<float> final_norm_d_;
  std::vector<DevLayer> dl_;
  // Scratch for kMaxRows rows.
  DeviceArray<float> x_, xn_, qkv_, tmp_, rlog_, gw_, logits_;
  DeviceArray<uint16_t> xb_, att_;
  DeviceArray<int32_t> ids_;
  DeviceArray<uint8_t> meta_;
  float* logits_host_ = nullptr;  // pinned [kLogitRows][V]
  std::mutex mu_;                 // one forward at a time (shared scratch)
};

DeviceArray<uint16_t> GptOssCuda::upload_bf16(std::initializer_list<const cpu::WeightRef*> ws, const char* what) {
  size_t n = 0;
  for (const cpu::WeightRef* w : ws) n += size_t(w->rows * w->cols);
  DeviceArray<uint16_t> d(ctx_->pool(), n, what);
  size_t off = 0;
  std::vector<float> row;
  std::vector<uint16_t> conv;
  for (const cpu::WeightRef* w : ws) {
    const size_t e = size_t(w->rows * w->cols);
    if (w->kind == cpu::WeightKind::BF16) {
      DZ_CUDA_CHECK(cudaMemcpy(d.get() + off, w->data, e * 2, cudaMemcpyHostToDevice));
    } else {
      row.resize(size_t(w->cols));
      conv.resize(e);
      for (int64_t r = 0; r < w->rows; ++r) {
        w->decode_row(r, row.data());
        for (int64_t c = 0; c < w->cols; ++c) conv[size_t(r * w->cols + c)] = f32_to_bf16(row[size_t(c)]);
      }
      DZ_CUDA_CHECK(cudaMemcpy(d.get() + off, conv.data(), e * 2, cudaMemcpyHostToDevice));
    }
    off += e;
  }
  device_bytes_ += n * 2;
  return d;
}

GptOssCuda::GptOssCuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params)
    : GptOssDesc(cfg, ws), dev_(params.device_index) {
  const std::string& src = cfg.source();
  check(cuda_device_count() > 0, DZ_ERR_DEVICE, "gpt_oss: DZ_DEVICE_CUDA requested but no CUDA device is present");
  check(params.device_index >= 0 && params.device_index < int(std::size(kStorageFns)), DZ_ERR_INVALID_ARGUMENT,
        "device_index ", params.device_index, " (0..", std::size(kStorageFns) - 1, ")");
  check(params.bf16_sensitive != 0, DZ_ERR_UNSUPPORTED,
        "gpt_oss CUDA: bf16_sensitive = 0 (lower-precision attention/router/lm_head) is not implemented");
  check(params.activations != DZ_ACTIVATIONS_F32, DZ_ERR_UNSUPPORTED,
        "gpt_oss CUDA: DZ_ACTIVATIONS_F32 is not implemented (the GEMMs take BF16 activations; the CPU backend "
        "computes in fp32)");
  switch (params.experts) {
    case DZ_EXPERTS_AUTO: path_ = cuda::MoePath::kAuto; break;
    case DZ_EXPERTS_NATIVE: path_ = cuda::MoePath::kFused; break;  // MXFP4 decoded in registers
    case DZ_EXPERTS_FP8: path_ = cuda::MoePath::kFp8; break;
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
  const size_t scratch = size_t(kMaxRows) * size_t(4 * 4 * H + 4 * (QD + 2 * KVD) + 2 * H + 2 * QD + 8 * E + 256) +
                         size_t(kLogitRows) * size_t(V) * 4 + (size_t(3) << 30);
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
  cuda::MoeShape ms;
  ms.n_experts = n_experts_;
  ms.topk = n_active_;
  ms.hidden = int(H);
  ms.intermediate = int(I);
  moe_ = std::make_unique<cuda::MoeLayer>(*ctx_, ms, kMaxRows);

  embed_d_ = upload_bf16({&embed_}, "embed_tokens");
  lm_head_d_ = lm_head_.data == embed_.data ? DeviceArray<uint16_t>() : upload_bf16({&lm_head_}, "lm_head");
  final_norm_d_ = upload_f32(final_norm_, "model.norm");
  dl_.resize(size_t(n_layers_));
  for (int li = 0; li < n_layers_; ++li) {
    const GptOssLayer& L = layers_[size_t(li)];
    DevLayer& d = dl_[size_t(li)];
    d.sliding = L.sliding;
    d.qkv_w = upload_bf16({&L.q, &L.k, &L.v}, "qkv_proj");
    d.o_w = upload_bf16({&L.o}, "o_proj");
    d.router_w = upload_bf16({&L.router}, "router");
    if (!L.bq.empty()) {
      std::vector<float> b(L.bq);
      b.insert(b.end(), L.bk.begin(), L.bk.end());
      b.insert(b.end(), L.bv.begin(), L.bv.end());
      d.qkv_b = upload_f32(b, "qkv bias");
      d.o_b = upload_f32(L.bo, "o_proj bias");
    }
    d.router_b = upload_f32(L.router_bias, "router bias");
    d.in_norm = upload_f32(L.in_norm, "input_layernorm");
    d.post_norm = upload_f32(L.post_norm, "post_attention_layernorm");
    d.sinks = upload_f32(L.sinks, "sinks");
    d.w1b = upload(L.gate_up.blocks, L.gate_up.block_bytes(E), "gate_up blocks");
    d.w1s = upload(L.gate_up.scales, L.gate_up.scale_bytes(E), "gate_up scales");
    d.w2b = upload(L.down.blocks, L.down.block_bytes(E), "down blocks");
    d.w2s = upload(L.down.scales, L.down.scale_bytes(E), "down scales");
    std::vector<uint16_t> b1(L.gate_up_bias.size()), b2(L.down_bias.size());
    for (size_t i = 0; i < b1.size(); ++i) b1[i] = f32_to_bf16(L.gate_up_bias[i]);  // BF16 in the checkpoint: exact
    for (size_t i = 0; i < b2.size(); ++i) b2[i] = f32_to_bf16(L.down_bias[i]);
    d.b1 = upload(b1.data(), b1.size(), "gate_up bias");
    d.b2 = upload(b2.data(), b2.size(), "down bias");
  }
  auto& pool = ctx_->pool();
  const size_t MR = kMaxRows;
  x_ = DeviceArray<float>(pool, MR * H, "x");
  xn_ = DeviceArray<float>(pool, MR * H, "xn");
  tmp_ = DeviceArray<float>(pool, MR * H, "tmp");
  qkv_ = DeviceArray<float>(pool, MR * size_t(QD + 2 * KVD), "qkv");
  rlog_ = DeviceArray<float>(pool, MR * E, "router logits");
  gw_ = DeviceArray<float>(pool, MR * n_active_, "gate weights");
  ids_ = DeviceArray<int32_t>(pool, MR * n_active_, "expert ids");
  xb_ = DeviceArray<uint16_t>(pool, MR * H, "x bf16");
  att_ = DeviceArray<uint16_t>(pool, MR * QD, "attention out");
  logits_ = DeviceArray<float>(pool, size_t(kLogitRows) * V, "logits");
  DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&logits_host_), size_t(kLogitRows) * V * 4));
  DZ_CUDA_CHECK(cudaDeviceSynchronize());
  log_info("gpt_oss on ", ctx_->describe(), ": ", device_bytes_ >> 20, " MiB of weights on the device (checkpoint ",
           weights >> 20, " MiB)");
}

GptOssCuda::~GptOssCuda() {
  if (ctx_) cudaStreamSynchronize(ctx_->stream());
  if (logits_host_) cudaFreeHost(logits_host_);
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
    check(it.seq && !it.tokens.empty() && it.logits && &it.seq->arena() == &arena, DZ_ERR_INTERNAL,
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
  for (int64_t r0 = 0; r0 < R; r0 += kMaxRows)
    pass(batch, rows, r0, std::min<int64_t>(R, r0 + kMaxRows), first_row, arena, pt, opt);
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
  const int64_t H = hidden_, QD = q_dim(), KVD = kv_dim(), D = head_dim_, half = D / 2, V = n_vocab_;
  const int qkv_n = int(QD + 2 * KVD);
  cudaStream_t s = ctx_->stream();

  // Row metadata for this pass (row indices local to the pass).
  std::vector<int32_t> tokens(static_cast<size_t>(T)), row_item(static_cast<size_t>(T)), row_pos(static_cast<size_t>(T)), dec_rows, logit_rows;
  std::vector<int64_t> row_off(static_cast<size_t>(T));
  std::vector<float> cs(size_t(T * half)), sn(size_t(T * half));
  std::vector<int32_t> item_pt(batch.size());
  {
    int32_t off = 0;
    for (size_t b = 0; b < batch.size(); ++b) item_pt[b] = off, off += int32_t(batch[b].seq->pages().size());
  }
  std::vector<cuda::AttnTile> tiles;
  const int tile_rows = cuda::attention_tile_rows(n_heads_, n_kv_heads_);
  const size_t ltb = size_t(2 * KVD) * 4;
  struct LogitDst {
    float* dst;
  };
  std::vector<LogitDst> logit_dst;
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
    } else if (i == 0 || row_item[size_t(i - 1)] != rw.item || tiles.back().n == tile_rows) {
      tiles.push_back({i, 1});
    } else {
      ++tiles.back().n;
    }
    if (it.all_logits || k == n - 1) {
      logit_rows.push_back(i);
      logit_dst.push_back({it.logits + (it.all_logits ? k : 0) * V});
    }
  }
  Packer pk;
  const size_t o_pt = pk.add(pt), o_ipt = pk.add(item_pt), o_tok = pk.add(tokens), o_item = pk.add(row_item),
               o_pos = pk.add(row_pos), o_off = pk.add(row_off), o_cs = pk.add(cs), o_sn = pk.add(sn),
               o_dec = pk.add(dec_rows), o_lr = pk.add(logit_rows), o_tiles = pk.add(tiles);
  const size_t need = pk.bytes().size();
  if (meta_.bytes() < need) {
    meta_.reset();
    meta_ = DeviceArray<uint8_t>(ctx_->pool(), std::max(need * 2, size_t(1) << 20), "batch metadata");
  }
  uint8_t* m = meta_.get();
  DZ_CUDA_CHECK(cudaMemcpyAsync(m, pk.bytes().data(), need, cudaMemcpyHostToDevice, s));
  auto at = [&](size_t off) { return m + off; };
  const int32_t* d_tok = reinterpret_cast<const int32_t*>(at(o_tok));
  const int64_t* d_off = reinterpret_cast<const int64_t*>(at(o_off));
  const float* d_cs = reinterpret_cast<const float*>(at(o_cs));
  const float* d_sn = reinterpret_cast<const float*>(at(o_sn));
  const int32_t* d_dec = reinterpret_cast<const int32_t*>(at(o_dec));
  const int32_t* d_lr = reinterpret_cast<const int32_t*>(at(o_lr));
  const cuda::AttnTile* d_tiles = reinterpret_cast<const cuda::AttnTile*>(at(o_tiles));

  cuda::AttnBatch ab;
  ab.page_bytes = int64_t(arena.page_bytes());
  ab.page_tokens = int(arena.page_tokens());
  ab.page_table = reinterpret_cast<const int32_t*>(at(o_pt));
  ab.item_pt = reinterpret_cast<const int32_t*>(at(o_ipt));
  ab.row_item = reinterpret_cast<const int32_t*>(at(o_item));
  ab.row_pos = reinterpret_cast<const int32_t*>(at(o_pos));
  ab.n_heads = n_heads_;
  ab.n_kv_heads = n_kv_heads_;
  ab.head_dim = int(D);
  ab.scale = scale_;
  ab.q = qkv_.get();
  ab.q_stride = qkv_n;
  ab.out = att_.get();

  auto abort_check = [&] {
    if (opt.abort && opt.abort(opt.abort_user)) {
      cudaStreamSynchronize(s);
      fail(DZ_ERR_CANCELLED, "cancelled by the abort callback");
    }
  };

  float* x = x_.get();
  cuda::embed_gather(embed_d_.get(), d_tok, T, int(H), x, s);
  for (int li = 0; li < n_layers_; ++li) {
    abort_check();
    const DevLayer& L = dl_[size_t(li)];
    uint8_t* kv_layer = arena.storage().data() + arena.layer_offset(uint32_t(li));
    cuda::rms_norm(x, nullptr, T, int(H), L.in_norm.get(), eps_, nullptr, xb_.get(), s);
    gemm_->run(xb_.get(), L.qkv_w.get(), L.qkv_b.get(), qkv_.get(), T, qkv_n, int(H), 0.f, s);
    cuda::rope_qk_store_kv(qkv_.get(), T, qkv_n, d_cs, d_sn, n_heads_, n_kv_heads_, int(D), kv_layer, d_off, s);
    ab.kv = kv_layer;
    ab.window = L.sliding ? int(window_) : 0;
    ab.sinks = L.sinks.get();
    cuda::attention_decode(ab, d_dec, int(dec_rows.size()), s);
    cuda::attention_prefill(ab, d_tiles, int(tiles.size()), tile_rows, s);
    gemm_->run(att_.get(), L.o_w.get(), L.o_b.get(), x, T, int(H), int(QD), 1.f, s);  // x += o_proj(att)
    cuda::rms_norm(x, nullptr, T, int(H), L.post_norm.get(), eps_, xn_.get(), xb_.get(), s);
    gemm_->run(xb_.get(), L.router_w.get(), L.router_b.get(), rlog_.get(), T, n_experts_, int(H), 0.f, s);
    cuda::router_topk_softmax(rlog_.get(), T, n_experts_, n_active_, ids_.get(), gw_.get(), s);
    cuda::MoeWeights mw;
    mw.w1_blocks = L.w1b.get();
    mw.w1_scales = L.w1s.get();
    mw.b1 = L.b1.get();
    mw.w2_blocks = L.w2b.get();
    mw.w2_scales = L.w2s.get();
    mw.b2 = L.b2.get();
    moe_->forward(mw, xn_.get(), ids_.get(), gw_.get(), T, tmp_.get(), path_);
    cuda::add_inplace(x, tmp_.get(), size_t(T) * size_t(H), s);
  }
  abort_check();

  const uint16_t* lm = lm_head_d_.get() ? lm_head_d_.get() : embed_d_.get();
  const int NL = int(logit_rows.size());
  for (int c0 = 0; c0 < NL; c0 += kLogitRows) {
    const int nc = std::min(kLogitRows, NL - c0);
    cuda::rms_norm(x, d_lr + c0, nc, int(H), final_norm_d_.get(), eps_, nullptr, xb_.get(), s);
    gemm_->run(xb_.get(), lm, nullptr, logits_.get(), nc, int(V), int(H), 0.f, s);
    DZ_CUDA_CHECK(
        cudaMemcpyAsync(logits_host_, logits_.get(), size_t(nc) * size_t(V) * 4, cudaMemcpyDeviceToHost, s));
    DZ_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < nc; ++i)
      std::memcpy(logit_dst[size_t(c0 + i)].dst, logits_host_ + size_t(i) * size_t(V), size_t(V) * 4);
  }
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  check(moe_->take_error() == 0, DZ_ERR_INTERNAL, "gpt_oss CUDA: an expert id was out of range");
}

}  // namespace

std::unique_ptr<Family> make_gpt_oss_cuda(const Config& cfg, const WeightStore& ws, const dz_model_params& params) {
  check(cuda_device_count() > 0, DZ_ERR_DEVICE,
        "gpt_oss: DZ_DEVICE_CUDA requested but no CUDA device is present (driver or GPU missing); use "
        "DZ_DEVICE_CPU or DZ_DEVICE_AUTO");
  return std::make_unique<GptOssCuda>(cfg, ws, params);
}

}  // namespace dz

#endif  // DZ_WITH_CUDA
