#include "cuda/bf16_gemm.h"
#include "cuda/bf16_gemv.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {
// Largest power of two (<= 256) dividing the address: the heuristic's alignment promise.
int align_of(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && (v % uintptr_t(a))) a >>= 1;
  return a;
}
}  // namespace

Bf16Gemm::Bf16Gemm(Context& ctx) : ctx_(ctx) {}

Bf16Gemm::~Bf16Gemm() {
  for (auto& [_, p] : plans_) {
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.d) cublasLtMatrixLayoutDestroy(p.d);
    if (p.op) cublasLtMatmulDescDestroy(p.op);
  }
}

void Bf16Gemm::run(const uint16_t* x, const uint16_t* w, const float* bias, float* d, int m, int n, int k, float beta,
                   cudaStream_t s) {
  if (m <= 0) return;
  if (small_m_ && m <= kSmallMaxM && n <= kSmallMaxN && bf16_gemv_fits(x, w, m, n, k)) {
    bf16_gemv(x, w, bias, d, m, n, k, beta, s);
    return;
  }
  const int al = std::min(std::min(align_of(x), align_of(w)), align_of(d));
  const auto key = std::make_tuple(m, n, k, bias != nullptr, al);
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    Plan p;
    // Column-major view: D^T [n x m] = W [k x n]^T * X^T [k x m].
    DZ_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    DZ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    DZ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (bias) {
      const cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
      DZ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
      const cudaDataType_t bt = CUDA_R_32F;
      DZ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    }
    DZ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
    DZ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
    DZ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, CUDA_R_32F, n, m, n));
    cublasLtMatmulPreference_t pref = nullptr;
    DZ_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = ctx_.lt_workspace_bytes();
    const uint32_t a32 = uint32_t(al);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(pref, attr, &a32, sizeof a32);
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(ctx_.lt(), p.op, p.a, p.b, p.d, p.d, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      cublasLtMatrixLayoutDestroy(p.a), cublasLtMatrixLayoutDestroy(p.b), cublasLtMatrixLayoutDestroy(p.d);
      cublasLtMatmulDescDestroy(p.op);
      fail(DZ_ERR_DEVICE, "cuBLASLt has no BF16 algorithm for m=", m, " n=", n, " k=", k, " (alignment ", al,
           "): ", cublasLtGetStatusString(st));
    }
    p.algo = res.algo;
    it = plans_.emplace(key, p).first;
  }
  Plan& p = it->second;
  if (bias)
    DZ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  const float alpha = 1.f;
  DZ_CUBLAS_CHECK(cublasLtMatmul(ctx_.lt(), p.op, &alpha, w, p.a, x, p.b, &beta, d, p.d, d, p.d, &p.algo,
                                 ctx_.lt_workspace(), ctx_.lt_workspace_bytes(), s));
}

}  // namespace dz::cuda
