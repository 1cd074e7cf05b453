// Manifold-constrained hyper-connections (mHC, DeepSeek-V4): each token
// carries n residual streams instead of one. Before a sublayer, mixing
// weights computed from the streams collapse them into the sublayer's input
// (`pre`); after it, the output is placed into every stream (`post`) on top
// of a doubly-stochastic mix of the old streams (`comb`, Sinkhorn-Knopp).
#pragma once

#include <cstdint>

namespace dz::cpu {

struct HcDims {
  int n = 4;                // streams (hc_mult)
  int64_t hidden = 0;       // per stream
  int sinkhorn_iters = 20;  // hc_sinkhorn_iters
  float hc_eps = 1e-6f;     // hc_eps
};

// Weights of one token from its mix logits `mix` ((2 + n) * n values: the
// flattened streams, RMS-normalised without weight, times fn^T), the learned
// `base` ((2 + n) * n) and `scale` (3: pre, post, comb):
//   pre[j]  = sigmoid(mix[j] * scale[0] + base[j]) + hc_eps
//   post[j] = 2 * sigmoid(mix[n + j] * scale[1] + base[n + j])
//   comb    = softmax over each row of (mix[2n..] * scale[2] + base[2n..]) as
//             [n x n], + hc_eps, then columns normalised once and
//             (rows, columns) sinkhorn_iters - 1 more times (each sum + hc_eps).
// comb[j * n + k] weighs old stream j in new stream k. fp64 inside.
void hc_weights(const HcDims& d, const float* mix, const float* base, const float* scale, float* pre, float* post,
                float* comb);

// out[h] = sum_j w[j] * x[j * hidden + h]: the n streams of one token collapsed.
void hc_collapse(const HcDims& d, const float* x, const float* w, float* out);

// x[k] = post[k] * y + sum_j comb[j * n + k] * x[j], in place over one token's streams.
void hc_expand(const HcDims& d, float* x, const float* y, const float* post, const float* comb);

// The final collapse before the output norm (hc_head): w[j] =
// sigmoid(mix[j] * scale + base[j]) + hc_eps from its n mix logits.
void hc_head_weights(const HcDims& d, const float* mix, const float* base, float scale, float* w);

}  // namespace dz::cpu
