#include <cooperative_groups.h>

#include <cmath>

#include "common/error.h"
#include "cuda/logits.h"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {

constexpr int kThreads = 512;

// (v, i) beats (bv, bi): larger, or equal at a lower index; NaNs never win
// and an empty best (bi < 0, bv NaN) loses to any number.
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {
  return !isnan(v) && (bi < 0 || v > bv || (v == bv && i < bi));
}

// A cluster of kSplit blocks a row (one block a row read a 201088-wide
// vocabulary at ~16 GB/s, one SM's worth: 49 us a decode step at batch 1,
// H200), each block a contiguous slice. Each thread walks its elements in
// increasing index order, so keeping the first of equal values and then
// breaking ties by index in the reductions gives the lowest index of the
// maximum; the first block reduces the slices' results in its cluster.
constexpr int kSplit = 8;  // the portable cluster size

__global__ void __launch_bounds__(kThreads)
    logits_argmax_copy_kernel(const float* logits, int V, float* const* dst, int32_t* argmax) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int r = blockIdx.y, part = int(cluster.block_rank());
  const float* row = logits + int64_t(r) * V;
  float* out = dst ? dst[r] : nullptr;
  // The slice [lo, hi): a multiple of 4 elements but the last.
  const int per = (V + 4 * kSplit - 1) / (4 * kSplit) * 4, lo = min(V, part * per), hi = min(V, lo + per);
  float bv = NAN;
  int bi = -1;
  const bool vec =
      (V & 3) == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    float4* o4 = reinterpret_cast<float4*>(out);
    for (int q = lo / 4 + int(threadIdx.x); q < hi / 4; q += kThreads) {
      const float4 v = r4[q];
      if (o4) o4[q] = v;
      const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (beats(e[j], 4 * q + j, bv, bi)) bv = e[j], bi = 4 * q + j;
    }
  } else {
    for (int i = lo + int(threadIdx.x); i < hi; i += kThreads) {
      const float v = row[i];
      if (out) out[i] = v;
      if (beats(v, i, bv, bi)) bv = v, bi = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(~0u, bv, o);
    const int oi = __shfl_xor_sync(~0u, bi, o);
    if (beats(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w)
      if (beats(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
    sv[0] = bv, si[0] = bi;  // the slice's result, read by the first block
  }
  cluster.sync();
  if (part == 0 && threadIdx.x == 0) {
    for (int c = 1; c < kSplit; ++c) {
      const float v = *cluster.map_shared_rank(&sv[0], c);
      const int i = *cluster.map_shared_rank(&si[0], c);
      if (beats(v, i, bv, bi)) bv = v, bi = i;
    }
    argmax[r] = bi;
  }
  cluster.sync();  // the other blocks' shared memory stays until it has been read
}

}  // namespace

void logits_argmax_copy(const float* logits, int rows, int V, float* const* dst, int32_t* argmax, cudaStream_t s) {
  if (rows <= 0) return;
  check(rows <= 65535, DZ_ERR_INVALID_ARGUMENT, "logits_argmax_copy: ", rows, " rows (at most 65535)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(kSplit, unsigned(rows));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kSplit, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  DZ_CUDA_CHECK(cudaLaunchKernelEx(&cfg, logits_argmax_copy_kernel, logits, V, dst, argmax));
}

}  // namespace dz::cuda
