// BF16 GEMM through cuBLASLt for the dense projections:
//   D[m][n] (fp32) = X[m][k] (bf16) W[n][k]^T (bf16) + bias[n] (fp32) + beta * D
// row-major, K contiguous (the checkpoint's [out, in] layout is used as is).
// The bias rides the BIAS epilogue; beta = 1 fuses a residual add (C = D).
// Up to kSmallMaxM rows and N <= kSmallMaxN go to our own kernel
// (bf16_gemv.h), which streams W faster than cuBLASLt's kernels for these shapes.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace dz::cuda {

class Context;

class Bf16Gemm {
 public:
  explicit Bf16Gemm(Context& ctx);
  ~Bf16Gemm();
  Bf16Gemm(const Bf16Gemm&) = delete;
  Bf16Gemm& operator=(const Bf16Gemm&) = delete;

  // Plans (descriptors + heuristic algo) are cached per shape/alignment;
  // capturable in a CUDA graph once the plan exists.
  void run(const uint16_t* x, const uint16_t* w, const float* bias, float* d, int m, int n, int k, float beta,
           cudaStream_t s);
  // false: cuBLASLt for every shape (tests and benchmarks compare the two).
  void set_small_m_kernel(bool on) { small_m_ = on; }
  // Larger N (the LM head) stays on cuBLASLt, which streams it at HBM speed
  // already; so do 5-8 rows: on an H200 at 5120 x 2880, 1 row took 9.7 us with
  // our kernel vs 11.1 (cuBLASLt), 8 rows 11.3 vs 10.7 (2-4 rows not measured).
  static constexpr int kSmallMaxN = 65536, kSmallMaxM = 4;

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Context& ctx_;
  bool small_m_ = true;
  std::map<std::tuple<int, int, int, bool, int>, Plan> plans_;
};

}  // namespace dz::cuda
