#include <algorithm>
#include <cstring>
#include <thread>

#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/upload.h"
#include "runtime/parallel.h"

namespace dz::cuda {

Uploader::Uploader(uint64_t total, Progress progress, int threads, size_t staging)
    : total_(total), progress_(std::move(progress)), cap_(std::max<size_t>(staging, 4096)) {
  if (threads <= 0) threads = int(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
  pool_ = std::make_unique<ThreadPool>(threads);
  try {
    DZ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (int b = 0; b < kBuffers; ++b) {
      DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&buf_[b]), cap_));
      DZ_CUDA_CHECK(cudaEventCreateWithFlags(&ev_[b], cudaEventDisableTiming));
    }
  } catch (...) {
    release();
    throw;
  }
}

Uploader::~Uploader() { release(); }

void Uploader::release() noexcept {
  if (stream_) cudaStreamSynchronize(stream_);  // the staging buffers may still be read
  for (int b = 0; b < kBuffers; ++b) {
    if (ev_[b]) cudaEventDestroy(ev_[b]), ev_[b] = nullptr;
    if (buf_[b]) cudaFreeHost(buf_[b]), buf_[b] = nullptr;
  }
  if (stream_) cudaStreamDestroy(stream_), stream_ = nullptr;
}

// The current buffer's copies are queued: mark them, and take the next buffer
// once the copies queued from it last time have completed.
void Uploader::next_buffer() {
  DZ_CUDA_CHECK(cudaEventRecord(ev_[cur_], stream_));
  cur_ = (cur_ + 1) % kBuffers;
  DZ_CUDA_CHECK(cudaEventSynchronize(ev_[cur_]));
  fill_ = 0;
}

void Uploader::copy(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  while (bytes) {
    if (fill_ == cap_) next_buffer();
    const size_t n = std::min(bytes, cap_ - fill_);
    uint8_t* stage = buf_[cur_] + fill_;
    // Slices of 1 MiB a thread: page faults on the mapped file run in parallel too.
    constexpr size_t kSlice = size_t(1) << 20;
    if (n <= kSlice)
      std::memcpy(stage, s, n);
    else
      pool_->parallel_for((n + kSlice - 1) / kSlice, 1, [&](size_t b, size_t e) {
        const size_t o = b * kSlice, len = std::min(n, e * kSlice) - o;
        std::memcpy(stage + o, s + o, len);
      });
    DZ_CUDA_CHECK(cudaMemcpyAsync(d, stage, n, cudaMemcpyHostToDevice, stream_));
    fill_ += n, d += n, s += n, bytes -= n, done_ += n;
    if (progress_ && progress_(done_, total_))
      fail(DZ_ERR_CANCELLED, "weight upload cancelled by the progress callback");
  }
}

void Uploader::finish() { DZ_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

}  // namespace dz::cuda
