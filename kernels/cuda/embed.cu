#include <cuda_bf16.h>

#include "cuda/embed.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {
__global__ void embed_kernel(const __nv_bfloat16* __restrict__ table, const int32_t* __restrict__ tokens, int H,
                             float* __restrict__ x) {
  const int r = blockIdx.x;
  const __nv_bfloat16* row = table + size_t(tokens[r]) * H;
  for (int k = threadIdx.x; k < H; k += blockDim.x) x[size_t(r) * H + k] = __bfloat162float(row[k]);
}
}  // namespace

void embed_gather(const uint16_t* table, const int32_t* tokens, int n_rows, int H, float* x, cudaStream_t s) {
  if (n_rows <= 0) return;
  embed_kernel<<<n_rows, 256, 0, s>>>(reinterpret_cast<const __nv_bfloat16*>(table), tokens, H, x);
  DZ_CUDA_LAUNCH_CHECK();
}

}  // namespace dz::cuda
