// Kimi Delta Attention (KDA): a gated delta rule whose forget gate decays each
// key channel of the recurrent state on its own. Per head, with the state S
// [d_k x d_v] in fp32 (row d = key channel d), for each token t:
//   S' = Diag(exp(g_t)) S;  S = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S^T q_t
// where q_t and k_t are L2-normalised (q also scaled by d_k^-0.5 by the
// caller's kda_prepare), g_t <= 0 per channel and beta_t in (0, 1).
//  - kda_recurrent: the definition, token by token (the CPU's decode and
//    prefill: cheaper there, see `dz bench kda`).
//  - kda_chunked: the same function over chunks (the prefill formulation of
//    tensor-core kernels, and the reference for them): within
//    a chunk the new values u solve (I + L) U = Diag(beta)(V - (e^G o K) S0)
//    by forward substitution (G the in-chunk cumulative log-decay), outputs are
//    (e^G o Q) S0 plus decayed in-chunk attention over U, and the state moves
//    once per chunk. Every exponent is of a non-positive number.
// Both leave S in the same [head][key channel][value channel] layout, so a
// decode continues a chunked prefill exactly (the tests hold them together).
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/parallel.h"

namespace dz::cpu {

struct KdaDims {
  int n_heads = 0;
  int head_dim = 0;     // d_k = d_v
  int conv_kernel = 4;  // short convolution width
  int64_t proj() const { return int64_t(n_heads) * head_dim; }
  // Floats of one sequence's state for one layer: the short convolutions'
  // history ((kernel - 1) rows of [q | k | v] inputs, oldest first), then S.
  size_t conv_floats() const { return size_t(conv_kernel - 1) * 3 * size_t(proj()); }
  size_t state_floats() const { return conv_floats() + size_t(n_heads) * head_dim * head_dim; }
};

// Causal depthwise convolution of width K followed by SiLU over n rows of
// `channels` inputs x (row stride ld), continuing the history hist
// [(K - 1) x channels] (oldest first), which ends holding the last K - 1 rows.
// w: [channels x K] (the checkpoint's [channels, 1, K]). y: [n x channels]
// (stride ld); y may not alias x.
void short_conv_silu(const float* x, int64_t n, int64_t channels, int64_t ld, const float* w, int K, float* hist,
                     float* y);

// In place over n rows: q, k of each head L2-normalised (x / sqrt(sum x^2 +
// 1e-6)), q also times d_k^-0.5; g_raw (the forget projection) becomes the
// log-decay -exp(a_log[h]) * softplus(g_raw + dt_bias); beta_raw becomes
// sigmoid(beta_raw). q, k, g: [n x H*D] with row stride ld; beta: [n x H].
void kda_prepare(const KdaDims& d, int64_t n, float* q, float* k, int64_t ld, float* g, int64_t ld_g,
                 const float* a_log, const float* dt_bias, float* beta);

// n tokens of one sequence; q, k, v, g: [n x H*D] with row strides ld, ld_g;
// beta [n x H]; state [H x D x D] updated; out [n x H*D].
void kda_recurrent(const KdaDims& d, const float* q, const float* k, const float* v, int64_t ld, const float* g,
                   int64_t ld_g, const float* beta, int64_t n, float* state, float* out, ThreadPool* pool);
void kda_chunked(const KdaDims& d, const float* q, const float* k, const float* v, int64_t ld, const float* g,
                 int64_t ld_g, const float* beta, int64_t n, float* state, float* out, ThreadPool* pool,
                 int chunk = 64);

// out (in place) per head: RMSNorm(o_h; w, eps) * sigmoid(gate_h); gate [n x H*D].
void kda_output_gate(const KdaDims& d, int64_t n, float* o, const float* gate, const float* w, float eps);

}  // namespace dz::cpu
