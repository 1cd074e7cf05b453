#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/log.h"
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

WeightLoader::WeightLoader(DevicePool& pool, uint64_t total, const dz_model_params& params, const char* family)
    : pool_(pool), total_(total), params_(params) {
  try {
    up_ = std::make_unique<Uploader>(total, [&params](uint64_t done, uint64_t t) {
      return params.progress && params.progress("upload weights", std::min(done, t - 1), t, params.progress_user);
    });
  } catch (const Error& e) {  // no pinned staging (a memlock limit, say): plain copies, slower
    log_warn(family, ": weights uploaded without pinned staging buffers (", e.what(), ")");
  }
}

void WeightLoader::copy(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  if (up_)
    up_->copy(dst, src, bytes);
  else
    DZ_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

DeviceArray<uint16_t> WeightLoader::bf16(std::initializer_list<const cpu::WeightRef*> ws, const char* what) {
  return bf16(std::vector<const cpu::WeightRef*>(ws), what);
}

DeviceArray<uint16_t> WeightLoader::bf16(const std::vector<const cpu::WeightRef*>& ws, const char* what) {
  size_t n = 0;
  for (const cpu::WeightRef* w : ws) n += size_t(w->rows * w->cols);
  DeviceArray<uint16_t> d(pool_, n, what);
  uint16_t* dst = d.get();
  std::vector<float> row;
  std::vector<uint16_t> conv;
  for (const cpu::WeightRef* w : ws) {
    const size_t e = size_t(w->rows * w->cols);
    if (w->kind == cpu::WeightKind::BF16) {
      copy(dst, w->data, e * 2);
    } else {
      row.resize(size_t(w->cols));
      conv.resize(e);
      for (int64_t r = 0; r < w->rows; ++r) {
        w->decode_row(r, row.data());
        for (int64_t c = 0; c < w->cols; ++c) conv[size_t(r * w->cols + c)] = f32_to_bf16(row[size_t(c)]);
      }
      copy(dst, conv.data(), e * 2);
    }
    dst += e;
  }
  bytes_ += n * 2;
  return d;
}

void WeightLoader::finish(const std::string& src) {
  if (up_) up_->finish();
  up_.reset();
  if (params_.progress && params_.progress("upload weights", total_, total_, params_.progress_user))
    fail(DZ_ERR_CANCELLED, src, ": open cancelled by the progress callback");
}

}  // namespace dz::cuda
