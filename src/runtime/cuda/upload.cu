#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu/matmul.h"
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

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void upload_bf16(Uploader* up, uint16_t* dst, const cpu::WeightRef& w) {
  const size_t n = size_t(w.rows * w.cols);
  auto put = [&](uint16_t* d, const void* src, size_t bytes) {
    if (!bytes) return;
    if (up)
      up->copy(d, src, bytes);
    else
      DZ_CUDA_CHECK(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
  };
  if (w.kind == cpu::WeightKind::BF16) return put(dst, w.data, n * 2);
  std::vector<float> row(static_cast<size_t>(w.cols));
  std::vector<uint16_t> conv(n);
  for (int64_t r = 0; r < w.rows; ++r) {
    w.decode_row(r, row.data());
    for (int64_t c = 0; c < w.cols; ++c) conv[size_t(r * w.cols + c)] = f32_to_bf16(row[size_t(c)]);
  }
  put(dst, conv.data(), n * 2);
}

}  // namespace dz::cuda
