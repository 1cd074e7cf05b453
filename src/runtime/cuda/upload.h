// Host -> device copies of a model's weights at load, pipelined: helper
// threads copy the (memory-mapped, pageable) source into pinned staging
// buffers while the copy engine moves the previous buffer to the device. A
// plain cudaMemcpy from pageable memory runs on one thread at ~6.5 GB/s on an
// H200 host (a 65 GB gpt-oss-120b checkpoint: 10.4 s).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dayzero.h"
#include "runtime/cuda/context.h"

namespace dz {
class ThreadPool;
namespace cpu {
struct WeightRef;
}
}  // namespace dz

namespace dz::cuda {

class Uploader {
 public:
  // progress(done, total) after each staged piece; returning true cancels
  // (copy then throws DZ_ERR_CANCELLED). total: the bytes the caller will
  // copy (for the progress report only). threads <= 0: the host's cores, up
  // to 16. staging: bytes of each of the kBuffers pinned buffers.
  using Progress = std::function<bool(uint64_t done, uint64_t total)>;
  static constexpr int kBuffers = 4;
  explicit Uploader(uint64_t total, Progress progress = {}, int threads = 0, size_t staging = size_t(64) << 20);
  ~Uploader();  // waits for the copies in flight
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  // Copies bytes from host src to device dst. Returns once src may be
  // released (its bytes are staged); the device copy completes by finish().
  void copy(void* dst, const void* src, size_t bytes);
  // Waits until every copy has reached the device.
  void finish();
  uint64_t done() const { return done_; }

 private:
  void next_buffer();
  void release() noexcept;

  uint64_t total_, done_ = 0;
  Progress progress_;
  std::unique_ptr<ThreadPool> pool_;
  size_t cap_, fill_ = 0;
  int cur_ = 0;
  uint8_t* buf_[kBuffers] = {};
  cudaEvent_t ev_[kBuffers] = {};
  cudaStream_t stream_ = nullptr;
};

// A model's weights onto the device at load: pool allocations filled through
// a pipelined Uploader (plain copies where pinned staging cannot be set up),
// reported as "upload weights" to params.progress against `total` bytes (the
// checkpoint's; done stays below it until finish()), which can cancel; the
// device bytes counted. Used by one thread while a model opens.
class WeightLoader {
 public:
  WeightLoader(DevicePool& pool, uint64_t total, const dz_model_params& params, const char* family);
  // n values from host memory (n = 0: an empty array).
  template <typename T>
  DeviceArray<T> array(const T* p, size_t n, const char* what) {
    if (!n) return {};
    DeviceArray<T> d(pool_, n, what);
    copy(d.get(), p, n * sizeof(T));
    bytes_ += n * sizeof(T);
    return d;
  }
  template <typename T>
  DeviceArray<T> array(const std::vector<T>& v, const char* what) {
    return array(v.data(), v.size(), what);
  }
  // The matrices' rows stacked in BF16: copied as is where the checkpoint
  // holds BF16, else decoded row by row and rounded to nearest even.
  DeviceArray<uint16_t> bf16(std::initializer_list<const cpu::WeightRef*> ws, const char* what);
  DeviceArray<uint16_t> bf16(const std::vector<const cpu::WeightRef*>& ws, const char* what);
  void copy(void* dst, const void* src, size_t bytes);
  // Waits for every copy and reports the total as done; throws
  // DZ_ERR_CANCELLED (naming src) where the progress callback says stop.
  void finish(const std::string& src);
  uint64_t bytes() const { return bytes_; }

 private:
  DevicePool& pool_;
  uint64_t total_, bytes_ = 0;
  const dz_model_params& params_;
  std::unique_ptr<Uploader> up_;
};

// fp32 -> bf16, round to nearest even (NaN stays NaN).
uint16_t f32_to_bf16(float f);

}  // namespace dz::cuda
