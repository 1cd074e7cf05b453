#include <cstdio>

#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

void throw_cuda(cudaError_t e, const char* what, const char* file, int line) {
  cudaGetLastError();  // clear a sticky-free error so later calls can report their own
  const dz_status st = (e == cudaErrorMemoryAllocation) ? DZ_ERR_OUT_OF_MEMORY : DZ_ERR_DEVICE;
  throw Error(
      st, cat("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", what, " at ", file, ":", line));
}

void throw_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  throw Error(DZ_ERR_DEVICE, cat("cuBLAS error ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s), ") in ",
                                 what, " at ", file, ":", line));
}

// ------------------------------------------------------------------ pool

DevicePool::DevicePool(size_t capacity) : capacity_(capacity) {
  check(capacity > 0, DZ_ERR_INVALID_ARGUMENT, "device pool of 0 bytes");
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, capacity);
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail(DZ_ERR_OUT_OF_MEMORY, "cannot reserve ", capacity >> 20, " MiB of device memory: ", cudaGetErrorString(e));
  }
  base_ = static_cast<char*>(p);
  free_[0] = capacity;
}

DevicePool::~DevicePool() {
  if (base_) cudaFree(base_);
}

void* DevicePool::alloc(size_t bytes, const char* what) {
  const size_t need = (bytes + 255) / 256 * 256;
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const size_t off = it->first, rest = it->second - need;
    free_.erase(it);
    if (rest) free_[off + need] = rest;
    live_[off] = need;
    used_ += need;
    if (used_ > peak_) peak_ = used_;
    return base_ + off;
  }
  fail(DZ_ERR_OUT_OF_MEMORY, "device pool full: ", what, " needs ", bytes >> 20, " MiB; ", used_ >> 20, " of ",
       capacity_ >> 20, " MiB in use");
}

void DevicePool::free(void* p) noexcept {
  if (!p) return;
  std::lock_guard<std::mutex> lk(mu_);
  const size_t off = static_cast<char*>(p) - base_;
  auto it = live_.find(off);
  if (it == live_.end()) return;
  size_t size = it->second;
  used_ -= size;
  live_.erase(it);
  size_t start = off;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + size) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = size;
}

size_t DevicePool::used() const {
  std::lock_guard<std::mutex> lk(mu_);
  return used_;
}
size_t DevicePool::peak() const {
  std::lock_guard<std::mutex> lk(mu_);
  return peak_;
}

// --------------------------------------------------------------- context

Context::Context(const ContextOptions& opt) : device_(opt.device) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    fail(DZ_ERR_DEVICE, "no CUDA device is available");
  }
  check(opt.device >= 0 && opt.device < n, DZ_ERR_INVALID_ARGUMENT, "CUDA device ", opt.device, " out of range (", n,
        " present)");
  DZ_CUDA_CHECK(cudaSetDevice(device_));
  DZ_CUDA_CHECK(cudaGetDeviceProperties(&props_, device_));
  check(props_.major >= 9, DZ_ERR_UNSUPPORTED, "CUDA device ", props_.name, " is sm_", props_.major, props_.minor,
        "; the CUDA backend needs sm_90 (Hopper) or newer");
  size_t free_b = 0, total_b = 0;
  DZ_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t want = opt.pool_bytes ? opt.pool_bytes : free_b / 10 * 9;
  pool_ = new DevicePool(want);
  try {
    // The main stream first when both have blocks waiting for SMs: the aux
    // stream's work (the FP8 path's folding of the next experts) fills what
    // the main stream's kernels leave.
    int least = 0, greatest = 0;
    DZ_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    DZ_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    DZ_CUDA_CHECK(cudaStreamCreateWithPriority(&aux_, cudaStreamNonBlocking, least));
    DZ_CUBLAS_CHECK(cublasLtCreate(&lt_));
    lt_ws_bytes_ = opt.cublas_workspace;
    lt_ws_ = pool_->alloc(lt_ws_bytes_, "cuBLASLt workspace");
  } catch (...) {
    this->~Context();
    throw;
  }
}

Context::~Context() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (aux_) cudaStreamSynchronize(aux_);
  if (lt_) cublasLtDestroy(lt_);
  if (stream_) cudaStreamDestroy(stream_);
  if (aux_) cudaStreamDestroy(aux_);
  if (pool_ && lt_ws_) pool_->free(lt_ws_);
  delete pool_;
  lt_ = nullptr, stream_ = aux_ = nullptr, pool_ = nullptr, lt_ws_ = nullptr;
}

void Context::sync() {
  DZ_CUDA_CHECK(cudaStreamSynchronize(aux_));
  DZ_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::string Context::describe() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %d SMs, %.0f GiB), pool %.1f GiB, cuBLASLt %zu", props_.name,
                props_.major, props_.minor, props_.multiProcessorCount, props_.totalGlobalMem / 1073741824.0,
                pool_->capacity() / 1073741824.0, cublasLtGetVersion());
  return buf;
}

}  // namespace dz::cuda
