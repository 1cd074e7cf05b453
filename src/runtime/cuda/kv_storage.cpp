// Built with the CUDA backend only (the host compiler: kv/arena.h is C++20).
#ifdef DZ_WITH_CUDA

#include "runtime/cuda/kv_storage.h"

#include <cuda_runtime.h>

#include "common/error.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

class DeviceStorage final : public kv::Storage {
 public:
  DeviceStorage(int dev, size_t bytes) : dev_(dev), size_(bytes) {
    DZ_CUDA_CHECK(cudaSetDevice(dev_));
    const cudaError_t e = cudaMalloc(&p_, bytes ? bytes : 1);
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail(DZ_ERR_OUT_OF_MEMORY, "KV arena: cannot allocate ", bytes >> 20, " MiB on CUDA device ", dev_, ": ",
           cudaGetErrorString(e));
    }
    DZ_CUDA_CHECK(cudaMemset(p_, 0, bytes));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~DeviceStorage() override {
    cudaSetDevice(dev_);
    cudaFree(p_);
  }
  uint8_t* data() override { return static_cast<uint8_t*>(p_); }
  size_t size() const override { return size_; }
  void copy(size_t dst, size_t src, size_t bytes) override {
    DZ_CUDA_CHECK(cudaSetDevice(dev_));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());  // no forward may still read or write these pages
    DZ_CUDA_CHECK(cudaMemcpy(data() + dst, data() + src, bytes, cudaMemcpyDeviceToDevice));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void read(size_t off, void* dst, size_t bytes) override {
    check(off + bytes <= size_, DZ_ERR_INTERNAL, "KV storage read out of range");
    DZ_CUDA_CHECK(cudaSetDevice(dev_));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
    DZ_CUDA_CHECK(cudaMemcpy(dst, data() + off, bytes, cudaMemcpyDeviceToHost));
  }
  void write(size_t off, const void* src, size_t bytes) override {
    check(off + bytes <= size_, DZ_ERR_INTERNAL, "KV storage write out of range");
    DZ_CUDA_CHECK(cudaSetDevice(dev_));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
    DZ_CUDA_CHECK(cudaMemcpy(data() + off, src, bytes, cudaMemcpyHostToDevice));
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  bool on_device() const override { return true; }

 private:
  int dev_;
  void* p_ = nullptr;
  size_t size_;
};

template <int D>
std::unique_ptr<kv::Storage> make_storage(size_t bytes) {
  return std::make_unique<DeviceStorage>(D, bytes);
}
constexpr KvStorageFn kStorageFns[kMaxKvDevices] = {make_storage<0>, make_storage<1>, make_storage<2>, make_storage<3>,
                                                    make_storage<4>, make_storage<5>, make_storage<6>, make_storage<7>};

}  // namespace

KvStorageFn device_kv_storage(int dev) {
  check(dev >= 0 && dev < kMaxKvDevices, DZ_ERR_INVALID_ARGUMENT, "device_index ", dev, " (0..", kMaxKvDevices - 1,
        ")");
  return kStorageFns[dev];
}

}  // namespace dz::cuda

#endif  // DZ_WITH_CUDA
