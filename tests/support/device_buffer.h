// A device array for GPU tests: allocated with cudaMalloc (16 spare bytes for
// kernels that read whole 16-byte words), filled from and copied back to host
// vectors. Include only where DZ_WITH_CUDA is defined.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "runtime/cuda/cuda_check.h"

namespace dz::test {

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
