#include "cuda/router.h"

#include "common/error.h"
#include "cuda/pdl.cuh"
#include "runtime/cuda/cuda_check.h"

namespace dz::cuda {

namespace {
// One thread per row: E and k are small (gpt-oss: 32 or 128 experts, top-4).
__global__ void topk_kernel(const float* __restrict__ logits, int T, int E, int k, int32_t* __restrict__ ids,
                            float* __restrict__ w) {
  pdl_wait();
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const float* l = logits + size_t(t) * E;
  uint32_t taken[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int sel[16];
  float val[16];
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float bv = 0;
    for (int e = 0; e < E; ++e) {
      if (taken[e >> 5] >> (e & 31) & 1u) continue;
      const float v = l[e];
      if (best < 0 || v > bv) best = e, bv = v;  // strict: the lower index wins ties
    }
    taken[best >> 5] |= 1u << (best & 31);
    sel[j] = best;
    val[j] = bv;
  }
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += exp(double(val[j]) - double(val[0]));
  for (int j = 0; j < k; ++j) {
    ids[size_t(t) * k + j] = sel[j];
    w[size_t(t) * k + j] = float(exp(double(val[j]) - double(val[0])) / sum);
  }
}
}  // namespace

void router_topk_softmax(const float* logits, int T, int E, int k, int32_t* ids, float* weights, cudaStream_t s) {
  check(E > 0 && E <= 256 && k > 0 && k <= 16 && k <= E, DZ_ERR_INVALID_ARGUMENT, "router_topk_softmax: E=", E,
        " k=", k, " (E <= 256, k <= 16)");
  if (T <= 0) return;
  launch_pdl(topk_kernel, dim3(unsigned((T + 127) / 128)), dim3(128), 0, s, logits, T, E, k, ids, weights);
}

}  // namespace dz::cuda
