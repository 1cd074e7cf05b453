// Helpers of the GPU tests (include only where DZ_WITH_CUDA is defined):
// context options with a given device pool, and a device array allocated with
// cudaMalloc (16 spare bytes for kernels that read whole 16-byte words),
// filled from and copied back to host vectors.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::test {

// Context options of a GPU test: a device pool of the given size.
inline dz::cuda::ContextOptions pool_options(size_t pool_bytes) {
  dz::cuda::ContextOptions o;
  o.pool_bytes = pool_bytes;
  return o;
}

template <typename T>
struct DeviceBuffer {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t n_) : n(n_) { DZ_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T) + 16)); }
  explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) {
    DZ_CUDA_CHECK(cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    settle();
  }
  // A copy from pageable memory may return before its DMA lands; kernels on a
  // non-blocking stream do not wait for it. Call after any such copy.
  static void settle() { DZ_CUDA_CHECK(cudaDeviceSynchronize()); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<T> get() const {
    std::vector<T> v(n);
    DZ_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

}  // namespace dz::test
