// What the CUDA families share at the lm_head's end: a session's device
// logits rows (DeviceLogits), each logit row's argmax computed on the device
// and staged in pinned memory, and sampling on the device
// (Family::sample_on_device).
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <span>
#include <vector>

#include "cuda/sampling.h"
#include "model/family.h"
#include "runtime/cuda/context.h"

namespace dz::cuda {

// A session's two logits rows in a model's device pool; null (with a
// warning naming `family`) where the pool has no room: the rows then go to
// the host.
std::unique_ptr<DeviceLogits> make_device_logits(DevicePool& pool, int dev, int V, const char* family);

class LogitStaging {
 public:
  // Room for `rows` logit rows at a time (device and pinned host buffers).
  LogitStaging(DevicePool& pool, int rows);
  ~LogitStaging();
  LogitStaging(const LogitStaging&) = delete;
  LogitStaging& operator=(const LogitStaging&) = delete;

  int rows() const { return rows_; }
  int32_t* argmax() const { return argmax_.get(); }      // device [rows]
  int32_t* argmax_host() const { return argmax_host_; }  // pinned [rows]
  // Rows [0, nc) of `logits` (device, V floats apart, nc <= rows()): each
  // row's argmax into *argmax_dst[i] and its copy into the device row
  // ddst[i] (a device array of nc pointers) where those are not null, and
  // into the host row host_dst[i] where not null. In two halves, so that the
  // first can be part of a CUDA graph: stage enqueues the device rows and the
  // argmaxes' copy to pinned memory (no host synchronisation); collect then
  // copies the host rows, synchronises s and writes the argmaxes.
  void stage(const float* logits, int nc, int V, float* const* ddst, cudaStream_t s);
  void collect(const float* logits, int nc, int V, const std::vector<float*>& host_dst,
               const std::vector<int32_t*>& argmax_dst, cudaStream_t s);
  // Family::sample_on_device: false where V is past the device sampler's limit.
  bool sample(std::span<const DeviceSample> rows, int V, int32_t* tokens, cudaStream_t s);

 private:
  int rows_;
  DeviceArray<int32_t> argmax_;
  int32_t* argmax_host_ = nullptr;
  DeviceArray<SampleRow> sample_rows_;
  SampleRow* sample_host_ = nullptr;
};

}  // namespace dz::cuda
