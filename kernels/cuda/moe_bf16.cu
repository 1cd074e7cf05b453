#include "cuda/moe_bf16.h"

#include <algorithm>

#include "common/error.h"
#include "cuda/bf16_gemm.h"
#include "cuda/norm.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

// Block a row, 16-byte chunks where H allows, else 2-byte values.
__global__ void gather_rows_kernel(const uint16_t* __restrict__ src, const int32_t* __restrict__ rows, int H,
                                   uint16_t* __restrict__ dst) {
  const uint16_t* s = src + size_t(rows[blockIdx.x]) * H;
  uint16_t* d = dst + size_t(blockIdx.x) * H;
  if (H % 8 == 0) {
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x)
      reinterpret_cast<uint4*>(d)[c] = reinterpret_cast<const uint4*>(s)[c];
  } else {
    for (int c = threadIdx.x; c < H; c += blockDim.x) d[c] = s[c];
  }
}

// Block a token; the k experts summed in slot order.
__global__ void combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ where,
                               const float* __restrict__ w, int k, int H, float* __restrict__ x) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc = fmaf(w[t * k + j], y[size_t(where[t * k + j]) * H + c], acc);
    x[size_t(t) * H + c] += acc;
  }
}

}  // namespace

void gather_rows_bf16(const uint16_t* src, const int32_t* rows, int n, int H, uint16_t* dst, cudaStream_t s) {
  check(H > 0 && n >= 0, DZ_ERR_INVALID_ARGUMENT, "gather_rows_bf16: ", n, " rows of ", H);
  if (n == 0) return;
  gather_rows_kernel<<<unsigned(n), 128, 0, s>>>(src, rows, H, dst);
  DZ_CUDA_LAUNCH_CHECK();
}

void moe_combine(const float* y, const int32_t* where, const float* w, int T, int k, int H, float* x,
                 cudaStream_t s) {
  check(H > 0 && T >= 0 && k > 0, DZ_ERR_INVALID_ARGUMENT, "moe_combine: ", T, " tokens, top-", k, ", ", H);
  if (T == 0) return;
  combine_kernel<<<unsigned(T), 256, 0, s>>>(y, where, w, k, H, x);
  DZ_CUDA_LAUNCH_CHECK();
}

Bf16Experts::Bf16Experts(Context& ctx, Bf16Gemm& gemm, int n_experts, int topk, int hidden, int inter)
    : ctx_(ctx), gemm_(gemm), E_(n_experts), k_(topk), H_(hidden), I_(inter) {
  check(E_ > 0 && k_ > 0 && k_ <= E_ && H_ > 0 && I_ > 0, DZ_ERR_INVALID_ARGUMENT, "BF16 experts: ", E_,
        " experts, top-", k_, ", hidden ", H_, ", intermediate ", I_);
}

template <typename T>
T* Bf16Experts::room(DeviceArray<T>& a, size_t n, const char* what) {
  if (a.size() < n) {
    a.reset();
    a = DeviceArray<T>(ctx_.pool(), n, what);
  }
  return a.get();
}

void Bf16Experts::forward(const Bf16ExpertWeights& w, const uint16_t* xb, const int32_t* ids, const float* weights,
                          int T, float* x, cudaStream_t s) {
  if (T <= 0) return;
  const size_t S = size_t(T) * size_t(k_);
  ids_.resize(S);
  DZ_CUDA_CHECK(cudaMemcpyAsync(ids_.data(), ids, S * 4, cudaMemcpyDeviceToHost, s));
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  // Counting sort of the slots by expert: meta = [token of each sorted slot | sorted position of each slot].
  count_.assign(size_t(E_) + 1, 0);
  for (size_t i = 0; i < S; ++i) {
    const int32_t e = ids_[i];
    check(e >= 0 && e < E_, DZ_ERR_INTERNAL, "BF16 experts: the router chose expert ", e, " of ", E_);
    ++count_[size_t(e) + 1];
  }
  for (int e = 0; e < E_; ++e) count_[size_t(e) + 1] += count_[size_t(e)];
  meta_.resize(2 * S);
  std::vector<int32_t> next(count_.begin(), count_.end() - 1);
  for (size_t i = 0; i < S; ++i) {
    const int32_t at = next[size_t(ids_[i])]++;
    meta_[size_t(at)] = int32_t(i / size_t(k_));
    meta_[S + i] = at;
  }
  int32_t* md = room(meta_d_, 2 * S, "BF16 experts: slot order");
  DZ_CUDA_CHECK(cudaMemcpyAsync(md, meta_.data(), 2 * S * 4, cudaMemcpyHostToDevice, s));
  uint16_t* xs = room(xs_, S * size_t(H_), "BF16 experts: inputs");
  float* h = room(h_, S * 2 * size_t(I_), "BF16 experts: gate_up");
  uint16_t* act = room(act_, S * size_t(I_), "BF16 experts: activations");
  float* y = room(y_, S * size_t(H_), "BF16 experts: outputs");
  gather_rows_bf16(xb, md, int(S), H_, xs, s);
  const size_t w13 = size_t(2) * I_ * H_, w2 = size_t(H_) * I_;
  for (int e = 0; e < E_; ++e) {
    const int n = count_[size_t(e) + 1] - count_[size_t(e)], r = count_[size_t(e)];
    if (n) gemm_.run(xs + size_t(r) * H_, w.w13 + size_t(e) * w13, nullptr, h + size_t(r) * 2 * I_, n, 2 * I_, H_, 0.f, s);
  }
  silu_mul(h, int(S), I_, int64_t(2) * I_, act, s);
  for (int e = 0; e < E_; ++e) {
    const int n = count_[size_t(e) + 1] - count_[size_t(e)], r = count_[size_t(e)];
    if (n) gemm_.run(act + size_t(r) * I_, w.w2 + size_t(e) * w2, nullptr, y + size_t(r) * H_, n, H_, I_, 0.f, s);
  }
  moe_combine(y, md + S, weights, T, k_, H_, x, s);
  // meta_ (pageable) was staged by the copy above before it returned; the
  // next call's host writes wait for its own sync.
}

}  // namespace dz::cuda
