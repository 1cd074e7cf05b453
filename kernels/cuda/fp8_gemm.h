// FP8 E4M3 GEMM with 1x128 block scales on both operands through cuBLASLt
// (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F; sm_90, cuBLAS >= 12.9), and the
// 1x128 activation quantizer (per row per 128 columns, scale = amax/448).
//
// Layouts (row-major, K contiguous, K a multiple of 128):
//   X [m][k] fp8 with scales [k/128][m] (row index fastest),
//   W [n][k] fp8 with scales [k/128][n],
//   D [m][n] bf16 = X W^T.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace dz::cuda {

class Context;

class Fp8Gemm {
 public:
  // workspace: cuBLASLt scratch for this instance (null: the context's); one
  // instance per stream when GEMMs run concurrently.
  explicit Fp8Gemm(Context& ctx, void* workspace = nullptr, size_t workspace_bytes = 0);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  // Pointers 16-byte aligned; m >= 1. Plans (layouts + autotuned algo) are cached per shape.
  // workspace: cuBLASLt scratch for this call (null: the instance's); calls on
  // concurrent streams need distinct workspaces.
  void run(const uint8_t* x, const float* x_scales, const uint8_t* w, const float* w_scales, void* d_bf16, int m, int n,
           int k, cudaStream_t s, void* workspace = nullptr, size_t workspace_bytes = 0);

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // Layouts and the fastest of cuBLASLt's heuristic candidates, timed once on
  // the first call's operands (not while the stream is being captured).
  Plan& plan(int m, int n, int k, const uint8_t* x, const float* xs, const uint8_t* w, const float* ws, void* d,
             cudaStream_t s, void* work, size_t work_bytes);
  Context& ctx_;
  void* ws_;
  size_t ws_bytes_;
  std::map<std::tuple<int, int, int>, Plan> plans_;
};

// Quantize rows of a float matrix [m][k_in] (leading dimension ld) to fp8
// [m][kpad] with scales [kpad/128][m]; columns k_in..kpad are zero.
void quantize_1x128(const float* x, int64_t ld, int m, int k_in, int kpad, uint8_t* q, float* scales, cudaStream_t s);

}  // namespace dz::cuda
