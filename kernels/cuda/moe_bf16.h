// Routed experts held in BF16 (Kimi Linear's checkpoints) on the device, two
// paths chosen by the number of token slots (tokens x top-k):
//  - few slots (a decode step): two launches, no host sync. Each slot's
//    expert rows are streamed once by warps that dot them with the token's
//    row (gate and up rows with the SwiGLU in one kernel; down with the
//    weighted sum of the token's k slots added into the residual stream).
//  - many slots (prefill): the slots sorted by expert on the host (one small
//    copy of the router's choice a layer, then a stream sync), each expert's
//    rows gathered, two BF16 GEMMs an expert with the plain SwiGLU between
//    them, and the weighted combine. The GEMMs read each active expert once.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "runtime/cuda/context.h"

namespace dz::cuda {

class Bf16Gemm;

// dst[i] = src[rows[i]] for i < n: bf16 rows of H values.
void gather_rows_bf16(const uint16_t* src, const int32_t* rows, int n, int H, uint16_t* dst, cudaStream_t s);

// x[t] += sum_j w[t k + j] y[where[t k + j]] for t < T: fp32 rows of H values.
void moe_combine(const float* y, const int32_t* where, const float* w, int T, int k, int H, float* x, cudaStream_t s);

// One layer's experts: w13 [E][2I][H] (each expert's gate rows, then its up
// rows), w2 [E][H][I]; bf16, device.
struct Bf16ExpertWeights {
  const uint16_t* w13 = nullptr;
  const uint16_t* w2 = nullptr;
};

class Bf16Experts {
 public:
  Bf16Experts(Context& ctx, Bf16Gemm& gemm, int n_experts, int topk, int hidden, int inter);
  // x [T, H] fp32 += sum over each row's k experts of weight * SwiGLU
  // expert(xb row) (xb: [T, H] bf16, the normalised input), for the router's
  // ids / weights [T, k] (device). Synchronises the stream once (the slots'
  // order is built on the host); throws DZ_ERR_INTERNAL for an id out of range.
  void forward(const Bf16ExpertWeights& w, const uint16_t* xb, const int32_t* ids, const float* weights, int T,
               float* x, cudaStream_t s);
  // The few-slot path up to this many slots (also needs H, I multiples of 8
  // and the k activation rows of a token in shared memory); 0: never.
  void set_few_max_slots(int64_t n) { few_max_slots_ = n; }
  bool few_slots(int T) const;
  // > 0: the SwiGLU clamped first (DeepSeek-V4): gate <= limit, |up| <= limit.
  void set_swiglu_limit(float limit) { limit_ = limit; }
  static constexpr size_t kFewMaxSmem = size_t(96) << 10;
  // How many times a scratch buffer moved (a CUDA graph's key: no replay on moved scratch).
  uint64_t scratch_generation() const { return gen_; }

 private:
  template <typename T>
  T* room(DeviceArray<T>& a, size_t n, const char* what);
  Context& ctx_;
  Bf16Gemm& gemm_;
  int E_, k_, H_, I_;
  int64_t few_max_slots_;
  float limit_ = 0;
  uint64_t gen_ = 0;
  std::vector<int32_t> ids_, meta_, count_;
  DeviceArray<int32_t> meta_d_;
  DeviceArray<uint16_t> xs_, act_;
  DeviceArray<float> h_, y_;
};

}  // namespace dz::cuda
