// CUDA / cuBLAS status -> dz::Error(DZ_ERR_DEVICE) carrying the library's own
// message and the failing call.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "common/error.h"

namespace dz::cuda {

[[noreturn]] void throw_cuda(cudaError_t e, const char* what, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* what, const char* file, int line);

}  // namespace dz::cuda

#define DZ_CUDA_CHECK(expr)                                                             \
  do {                                                                                  \
    cudaError_t dz_e_ = (expr);                                                         \
    if (dz_e_ != cudaSuccess) ::dz::cuda::throw_cuda(dz_e_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here.
#define DZ_CUDA_LAUNCH_CHECK() DZ_CUDA_CHECK(cudaGetLastError())

#define DZ_CUBLAS_CHECK(expr)                                                                       \
  do {                                                                                              \
    cublasStatus_t dz_s_ = (expr);                                                                  \
    if (dz_s_ != CUBLAS_STATUS_SUCCESS) ::dz::cuda::throw_cublas(dz_s_, #expr, __FILE__, __LINE__); \
  } while (0)
