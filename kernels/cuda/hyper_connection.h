// DeepSeek-V4's manifold-constrained hyper-connections (mHC) on the device:
// each token's n residual streams [n x H] fp32 are collapsed into a
// sublayer's input and expanded again after it, as cpu/hyper_connection.h
// defines them (fp32 here, fp64 there).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

constexpr int kHcMaxStreams = 4;  // (2 + n) n mix logits a token in registers

struct HcPre {
  int n_rows = 0, n = 4;
  int64_t hidden = 0;
  const float* x = nullptr;      // [rows][n][hidden] the streams
  const float* fn = nullptr;     // [m][n * hidden], m = (2 + n) n (sublayer) or n (head)
  const float* base = nullptr;   // [m]
  const float* scale = nullptr;  // [3] (sublayer) or [1] (head)
  bool head = false;             // hc_head: pre weights only
  float eps = 1e-6f;             // the streams' RMSNorm
  float hc_eps = 1e-6f;
  int sinkhorn_iters = 20;
  float* w = nullptr;        // [rows][2n + n^2]: pre, post, comb (head: [rows][n] pre)
  float* col = nullptr;      // [rows][hidden] = sum_j pre_j x_j
  float* partial = nullptr;  // device scratch of hc_pre_scratch_floats(*this) floats
};

// Mix logits from the RMS-normalised streams (fp32 dot products with fn), the
// weights (cpu::hc_weights / hc_head_weights) and the collapse. Two launches:
// blocks of 4 rows (sharing each read of fn) and a slice of n * hidden sum the
// squares and dot products, so a few rows still spread over the GPU; then a
// block a row adds the slices, forms the weights and collapses the streams.
size_t hc_pre_scratch_floats(const HcPre& a);
void hc_pre(const HcPre& a, cudaStream_t s);

// x_k = post_k y + sum_j comb[j n + k] x_j for every row's streams, in place;
// w as hc_pre wrote it, y [rows][hidden].
void hc_post(float* x, const float* y, const float* w, int n_rows, int n, int64_t hidden, cudaStream_t s);

}  // namespace dz::cuda
