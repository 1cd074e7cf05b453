#include <algorithm>

#include "common/error.h"
#include "cuda/mxfp4_layout.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {
namespace {

// One thread per 16-byte unit of n experts: checkpoint order in src, device order in dst.
__global__ void to_device_order_kernel(const uint4* src, uint8_t* dst, int64_t n, int R, int S) {
  const int64_t per = int64_t(R) * S, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * per) return;
  const int64_t e = i / per, rs = i - e * per;
  const int r = int(rs / S), sub = int(rs - int64_t(r) * S);
  *reinterpret_cast<uint4*>(dst + e * per * 16 + w4_unit_offset(r, sub, R, S)) = src[i];
}

}  // namespace

void mxfp4_to_device_order(uint8_t* blocks, int64_t n_experts, int R, int64_t K, cudaStream_t s) {
  check(blocks && n_experts > 0 && R > 0 && K > 0 && K % 32 == 0, DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_to_device_order: bad shape (", n_experts, " experts, ", R, " rows, K ", K, ")");
  check((reinterpret_cast<uintptr_t>(blocks) & 15) == 0, DZ_ERR_INVALID_ARGUMENT,
        "mxfp4_to_device_order: blocks not 16-byte aligned");
  const int S = int(K / 32);
  const int64_t expert_bytes = int64_t(R) * S * 16;
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(n_experts, (int64_t(256) << 20) / expert_bytes));
  uint8_t* tmp = nullptr;
  DZ_CUDA_CHECK(cudaMallocAsync(&tmp, size_t(group * expert_bytes), s));  // load time only
  for (int64_t e0 = 0; e0 < n_experts; e0 += group) {
    const int64_t n = std::min(group, n_experts - e0);
    uint8_t* base = blocks + e0 * expert_bytes;
    DZ_CUDA_CHECK(cudaMemcpyAsync(tmp, base, size_t(n * expert_bytes), cudaMemcpyDeviceToDevice, s));
    const int64_t units = n * R * S;
    to_device_order_kernel<<<unsigned((units + 255) / 256), 256, 0, s>>>(reinterpret_cast<const uint4*>(tmp), base, n,
                                                                         R, S);
    DZ_CUDA_LAUNCH_CHECK();
  }
  DZ_CUDA_CHECK(cudaFreeAsync(tmp, s));
  DZ_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace dz::cuda
