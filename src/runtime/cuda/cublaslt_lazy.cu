// cuBLASLt is loaded on first use (dlopen) instead of at program start: the
// library is several hundred MB, and mapping it made every process linked with
// dayzero (CPU-only users, every test, `dz --help`) start about a second late.
// Each cuBLASLt entry point the backend calls is defined here with the
// header's exact signature and forwards to the loaded library; when it cannot
// be loaded the calls fail with CUBLAS_STATUS_NOT_INITIALIZED and the status
// string says why. A cuBLASLt function missing below fails at link time:
// add it here.
#include <cublasLt.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#ifndef DZ_CUDA_LIBRARY_DIR
#define DZ_CUDA_LIBRARY_DIR "/usr/local/cuda/lib64"
#endif

namespace dz {
namespace {
std::once_flag g_once;
void* g_lib = nullptr;
std::string g_why;

void load() {
  std::string tried;
  const char* env = std::getenv("DZ_CUBLASLT_PATH");
  const std::string candidates[] = {env ? env : "", "libcublasLt.so.13", DZ_CUDA_LIBRARY_DIR "/libcublasLt.so.13",
                                    "/usr/local/cuda/lib64/libcublasLt.so.13"};
  for (const auto& c : candidates) {
    if (c.empty()) continue;
    g_lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (g_lib) return;
    const char* e = dlerror();
    tried += (tried.empty() ? "" : "; ") + std::string(e ? e : c);
  }
  g_why = "libcublasLt.so.13 could not be loaded (set DZ_CUBLASLT_PATH): " + tried;
}
}  // namespace

void* cublaslt_sym(const char* name) {
  std::call_once(g_once, load);
  return g_lib ? dlsym(g_lib, name) : nullptr;
}

const char* cublaslt_unavailable() {
  std::call_once(g_once, load);
  return g_why.empty() ? "cuBLASLt symbol missing" : g_why.c_str();
}
}  // namespace dz

extern "C" {
cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t* lightHandle) {
  static auto f = reinterpret_cast<decltype(&cublasLtCreate)>(dz::cublaslt_sym("cublasLtCreate"));
  return f ? f(lightHandle) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtDestroy(cublasLtHandle_t lightHandle) {
  static auto f = reinterpret_cast<decltype(&cublasLtDestroy)>(dz::cublaslt_sym("cublasLtDestroy"));
  return f ? f(lightHandle) : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char* CUBLASWINAPI cublasLtGetStatusName(cublasStatus_t status) {
  static auto f = reinterpret_cast<decltype(&cublasLtGetStatusName)>(dz::cublaslt_sym("cublasLtGetStatusName"));
  return f ? f(status) : dz::cublaslt_unavailable();
}

const char* CUBLASWINAPI cublasLtGetStatusString(cublasStatus_t status) {
  static auto f = reinterpret_cast<decltype(&cublasLtGetStatusString)>(dz::cublaslt_sym("cublasLtGetStatusString"));
  return f ? f(status) : dz::cublaslt_unavailable();
}

size_t CUBLASWINAPI cublasLtGetVersion(void) {
  static auto f = reinterpret_cast<decltype(&cublasLtGetVersion)>(dz::cublaslt_sym("cublasLtGetVersion"));
  return f ? f() : 0;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc,
                                           const void* alpha, /* host or device pointer */ const void* A,
                                           cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                                           const void* beta, /* host or device pointer */ const void* C,
                                           cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                                           const cublasLtMatmulAlgo_t* algo, void* workspace,
                                           size_t workspaceSizeInBytes, cudaStream_t stream) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatmul)>(dz::cublaslt_sym("cublasLtMatmul"));
  return f ? f(lightHandle, computeDesc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
               workspaceSizeInBytes, stream)
           : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc, cublasLtMatrixLayout_t Adesc,
    cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
    cublasLtMatmulPreference_t preference, int requestedAlgoCount,
    cublasLtMatmulHeuristicResult_t heuristicResultsArray[], int* returnAlgoCount) {
  static auto f =
      reinterpret_cast<decltype(&cublasLtMatmulAlgoGetHeuristic)>(dz::cublaslt_sym("cublasLtMatmulAlgoGetHeuristic"));
  return f ? f(lightHandle, operationDesc, Adesc, Bdesc, Cdesc, Ddesc, preference, requestedAlgoCount,
               heuristicResultsArray, returnAlgoCount)
           : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc, cublasComputeType_t computeType,
                                                     cudaDataType_t scaleType) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatmulDescCreate)>(dz::cublaslt_sym("cublasLtMatmulDescCreate"));
  return f ? f(matmulDesc, computeType, scaleType) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatmulDescDestroy)>(dz::cublaslt_sym("cublasLtMatmulDescDestroy"));
  return f ? f(matmulDesc) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                                           cublasLtMatmulDescAttributes_t attr, const void* buf,
                                                           size_t sizeInBytes) {
  static auto f =
      reinterpret_cast<decltype(&cublasLtMatmulDescSetAttribute)>(dz::cublaslt_sym("cublasLtMatmulDescSetAttribute"));
  return f ? f(matmulDesc, attr, buf, sizeInBytes) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t matmulDesc,
                                                           cublasLtMatmulDescAttributes_t attr, void* buf,
                                                           size_t sizeInBytes, size_t* sizeWritten) {
  static auto f =
      reinterpret_cast<decltype(&cublasLtMatmulDescGetAttribute)>(dz::cublaslt_sym("cublasLtMatmulDescGetAttribute"));
  return f ? f(matmulDesc, attr, buf, sizeInBytes, sizeWritten) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  static auto f =
      reinterpret_cast<decltype(&cublasLtMatmulPreferenceCreate)>(dz::cublaslt_sym("cublasLtMatmulPreferenceCreate"));
  return f ? f(pref) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  static auto f =
      reinterpret_cast<decltype(&cublasLtMatmulPreferenceDestroy)>(dz::cublaslt_sym("cublasLtMatmulPreferenceDestroy"));
  return f ? f(pref) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                                 cublasLtMatmulPreferenceAttributes_t attr,
                                                                 const void* buf, size_t sizeInBytes) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatmulPreferenceSetAttribute)>(
      dz::cublaslt_sym("cublasLtMatmulPreferenceSetAttribute"));
  return f ? f(pref, attr, buf, sizeInBytes) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type,
                                                       uint64_t rows, uint64_t cols, int64_t ld) {
  static auto f =
      reinterpret_cast<decltype(&cublasLtMatrixLayoutCreate)>(dz::cublaslt_sym("cublasLtMatrixLayoutCreate"));
  return f ? f(matLayout, type, rows, cols, ld) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  static auto f =
      reinterpret_cast<decltype(&cublasLtMatrixLayoutDestroy)>(dz::cublaslt_sym("cublasLtMatrixLayoutDestroy"));
  return f ? f(matLayout) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout,
                                                             cublasLtMatrixLayoutAttribute_t attr, const void* buf,
                                                             size_t sizeInBytes) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatrixLayoutSetAttribute)>(
      dz::cublaslt_sym("cublasLtMatrixLayoutSetAttribute"));
  return f ? f(matLayout, attr, buf, sizeInBytes) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoInit(cublasLtHandle_t lightHandle, cublasComputeType_t computeType,
                                                   cudaDataType_t scaleType, cudaDataType_t Atype, cudaDataType_t Btype,
                                                   cudaDataType_t Ctype, cudaDataType_t Dtype, int algoId,
                                                   cublasLtMatmulAlgo_t* algo) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatmulAlgoInit)>(dz::cublaslt_sym("cublasLtMatmulAlgoInit"));
  return f ? f(lightHandle, computeType, scaleType, Atype, Btype, Ctype, Dtype, algoId, algo)
           : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoConfigSetAttribute(cublasLtMatmulAlgo_t* algo,
                                                                 cublasLtMatmulAlgoConfigAttributes_t attr,
                                                                 const void* buf, size_t sizeInBytes) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatmulAlgoConfigSetAttribute)>(
      dz::cublaslt_sym("cublasLtMatmulAlgoConfigSetAttribute"));
  return f ? f(algo, attr, buf, sizeInBytes) : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetIds(cublasLtHandle_t lightHandle, cublasComputeType_t computeType,
                                                     cudaDataType_t scaleType, cudaDataType_t Atype,
                                                     cudaDataType_t Btype, cudaDataType_t Ctype, cudaDataType_t Dtype,
                                                     int requestedAlgoCount, int algoIdsArray[], int* returnAlgoCount) {
  static auto f = reinterpret_cast<decltype(&cublasLtMatmulAlgoGetIds)>(dz::cublaslt_sym("cublasLtMatmulAlgoGetIds"));
  return f ? f(lightHandle, computeType, scaleType, Atype, Btype, Ctype, Dtype, requestedAlgoCount, algoIdsArray,
               returnAlgoCount)
           : CUBLAS_STATUS_NOT_INITIALIZED;
}
}  // extern "C"
