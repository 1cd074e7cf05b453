// GPU timing shared by the `dz bench` commands that time kernels (CUDA builds
// only): median of CUDA-event times with the L2 flushed before every call, so
// each call reads its bytes from HBM as in a model's forward pass.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "bench_common.h"
#include "cuda/fill.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cli {

class GpuTimer {
 public:
  static constexpr size_t kFlushBytes = size_t(256) << 20;  // larger than the L2
  // Its flush buffer (random bytes) and sink come from the context's pool.
  explicit GpuTimer(cuda::Context& c)
      : ctx_(c), flush_(c.pool(), kFlushBytes, "L2 flush"), sink_(c.pool(), 1, "flush sink") {
    cuda::fill_random_u8(flush_.get(), kFlushBytes, 5, 0, 255, c.stream());
    DZ_CUDA_CHECK(cudaEventCreate(&a_));
    DZ_CUDA_CHECK(cudaEventCreate(&b_));
  }
  ~GpuTimer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  // One float a kernel may write to (cuda::stream_read's result).
  float* sink() const { return sink_.get(); }
  // Reads the flush buffer on the context's stream (the L2 then holds none of a call's bytes).
  void flush_l2() { cuda::l2_flush_read(flush_.get(), kFlushBytes, sink_.get(), ctx_.stream()); }
  // Median ms of run(i) on the context's stream over reps calls, after warm calls (run(0 .. warm - 1)).
  template <typename F>
  double median_ms(int reps, int warm, F run) {
    std::vector<double> v;
    for (int i = -warm; i < reps; ++i) {
      flush_l2();
      DZ_CUDA_CHECK(cudaEventRecord(a_, ctx_.stream()));
      run(i < 0 ? i + warm : i);
      DZ_CUDA_CHECK(cudaEventRecord(b_, ctx_.stream()));
      DZ_CUDA_CHECK(cudaEventSynchronize(b_));
      float ms = 0;
      DZ_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
      if (i >= 0) v.push_back(ms);
    }
    return median(v);
  }

 private:
  cuda::Context& ctx_;
  cuda::DeviceArray<uint8_t> flush_;
  cuda::DeviceArray<float> sink_;
  cudaEvent_t a_{}, b_{};
};

}  // namespace dz::cli
