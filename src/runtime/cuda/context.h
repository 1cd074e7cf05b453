// The CUDA backend's per-device runtime: one device-memory reservation
// sub-allocated by a pool (no cudaMalloc in the steady state), a compute
// stream plus an auxiliary stream (weight conversion overlapping GEMMs), and
// the cuBLASLt handle with its workspace.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string>

namespace dz::cuda {

// First-fit allocator over one cudaMalloc'd range. Thread-safe.
class DevicePool {
 public:
  explicit DevicePool(size_t capacity_bytes);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // 256-byte aligned; throws DZ_ERR_OUT_OF_MEMORY with the pool's state when full.
  void* alloc(size_t bytes, const char* what);
  void free(void* p) noexcept;
  size_t capacity() const { return capacity_; }
  size_t used() const;
  size_t peak() const;

 private:
  char* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0, peak_ = 0;
  std::map<size_t, size_t> free_;  // offset -> size
  std::map<size_t, size_t> live_;  // offset -> size
  mutable std::mutex mu_;
};

// An owning pool allocation of n T.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(DevicePool& pool, size_t n, const char* what)
      : pool_(&pool), n_(n), p_(static_cast<T*>(pool.alloc(n * sizeof(T) != 0 ? n * sizeof(T) : 1, what))) {}
  ~DeviceArray() { reset(); }
  DeviceArray(DeviceArray&& o) noexcept : pool_(o.pool_), n_(o.n_), p_(o.p_) { o.p_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      reset();
      pool_ = o.pool_, n_ = o.n_, p_ = o.p_;
      o.p_ = nullptr;
    }
    return *this;
  }
  void reset() {
    if (p_) pool_->free(p_);
    p_ = nullptr;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  DevicePool* pool_ = nullptr;
  size_t n_ = 0;
  T* p_ = nullptr;
};

struct ContextOptions {
  int device = 0;
  size_t pool_bytes = 0;  // 0: 90% of the free device memory at creation
  size_t cublas_workspace = 64 << 20;
};

class Context {
 public:
  explicit Context(const ContextOptions& opt = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  const cudaDeviceProp& props() const { return props_; }
  DevicePool& pool() { return *pool_; }
  cudaStream_t stream() const { return stream_; }
  cudaStream_t aux_stream() const { return aux_; }
  cublasLtHandle_t lt() const { return lt_; }
  void* lt_workspace() const { return lt_ws_; }
  size_t lt_workspace_bytes() const { return lt_ws_bytes_; }
  void sync();
  std::string describe() const;  // "NVIDIA H200 (sm_90, 132 SMs, 139 GiB), pool 120.0 GiB"

 private:
  int device_ = 0;
  cudaDeviceProp props_{};
  DevicePool* pool_ = nullptr;
  cudaStream_t stream_ = nullptr, aux_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* lt_ws_ = nullptr;
  size_t lt_ws_bytes_ = 0;
};

}  // namespace dz::cuda
