// Built with the CUDA backend only (the host compiler: model/family.h is C++20).
#ifdef DZ_WITH_CUDA

#include "runtime/cuda/logit_rows.h"

#include <algorithm>

#include "common/log.h"
#include "cuda/logits.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

class DevLogits final : public DeviceLogits {
 public:
  DevLogits(DevicePool& pool, int dev, int V) : dev_(dev), v_(V), rows_(pool, size_t(2) * size_t(V), "logits rows") {}
  ~DevLogits() override {
    if (pinned_) cudaFreeHost(pinned_);
  }
  float* row(int i) override { return rows_.get() + size_t(i) * size_t(v_); }
  // Into a pinned row of its own (allocated on the first read): read in
  // place, no second copy into pageable memory.
  const float* fetch(int i) const override {
    DZ_CUDA_CHECK(cudaSetDevice(dev_));
    const size_t bytes = size_t(v_) * 4;
    if (!pinned_) DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned_), bytes));
    // The forward that wrote the row synchronised its stream before returning.
    DZ_CUDA_CHECK(cudaMemcpy(pinned_, rows_.get() + size_t(i) * size_t(v_), bytes, cudaMemcpyDeviceToHost));
    return pinned_;
  }

 private:
  int dev_, v_;
  DeviceArray<float> rows_;
  mutable float* pinned_ = nullptr;
};

}  // namespace

std::unique_ptr<DeviceLogits> make_device_logits(DevicePool& pool, int dev, int V, const char* family) {
  try {
    return std::make_unique<DevLogits>(pool, dev, V);
  } catch (const Error& e) {
    log_warn(family, " CUDA: no device room for a session's logits rows (", e.what(), "); copying them to the host");
    return nullptr;
  }
}

LogitStaging::LogitStaging(DevicePool& pool, int rows)
    : rows_(rows), argmax_(pool, size_t(rows), "logits argmax"), sample_rows_(pool, size_t(rows), "sampling rows") {
  DZ_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&argmax_host_), size_t(rows) * sizeof(int32_t)));
  const cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&sample_host_), size_t(rows) * sizeof(SampleRow));
  if (e != cudaSuccess) {
    cudaFreeHost(argmax_host_);
    DZ_CUDA_CHECK(e);
  }
}

LogitStaging::~LogitStaging() {
  if (argmax_host_) cudaFreeHost(argmax_host_);
  if (sample_host_) cudaFreeHost(sample_host_);
}

void LogitStaging::stage(const float* logits, int nc, int V, float* const* ddst, cudaStream_t s) {
  check(nc >= 0 && nc <= rows_, DZ_ERR_INTERNAL, "logit rows: ", nc, " rows, staging for ", rows_);
  if (nc == 0) return;
  logits_argmax_copy(logits, nc, V, ddst, argmax_.get(), s);
  DZ_CUDA_CHECK(cudaMemcpyAsync(argmax_host_, argmax_.get(), size_t(nc) * 4, cudaMemcpyDeviceToHost, s));
}

void LogitStaging::collect(const float* logits, int nc, int V, const std::vector<float*>& host_dst,
                           const std::vector<int32_t*>& argmax_dst, cudaStream_t s) {
  if (nc == 0) return;
  for (int i = 0; i < nc; ++i)
    if (float* d = host_dst[size_t(i)])
      DZ_CUDA_CHECK(cudaMemcpyAsync(d, logits + size_t(i) * V, size_t(V) * 4, cudaMemcpyDeviceToHost, s));
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
  for (int i = 0; i < nc; ++i)
    if (int32_t* a = argmax_dst[size_t(i)]) *a = argmax_host_[i];
}

bool LogitStaging::sample(std::span<const DeviceSample> rows, int V, int32_t* tokens, cudaStream_t s) {
  if (V > kMaxSampleVocab) return false;
  // The staging buffers are free: every forward and every chunk here ends
  // with its stream synchronised.
  for (size_t c0 = 0; c0 < rows.size(); c0 += size_t(rows_)) {
    const size_t nc = std::min(rows.size() - c0, size_t(rows_));
    for (size_t i = 0; i < nc; ++i) {
      const DeviceSample& r = rows[c0 + i];
      sample_host_[i] = {r.logits, r.cfg.temperature, r.cfg.top_k, r.cfg.top_p, r.u, r.argmax};
    }
    DZ_CUDA_CHECK(cudaMemcpyAsync(sample_rows_.get(), sample_host_, nc * sizeof(SampleRow), cudaMemcpyHostToDevice, s));
    sample_rows(sample_rows_.get(), int(nc), V, argmax_.get(), s);
    DZ_CUDA_CHECK(cudaMemcpyAsync(argmax_host_, argmax_.get(), nc * 4, cudaMemcpyDeviceToHost, s));
    DZ_CUDA_CHECK(cudaStreamSynchronize(s));
    std::copy(argmax_host_, argmax_host_ + nc, tokens + c0);
  }
  return true;
}

}  // namespace dz::cuda

#endif  // DZ_WITH_CUDA
