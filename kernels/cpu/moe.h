// Mixture of experts: routing and expert evaluation grouped by expert (each
// expert's weights are decoded once per call, whatever their precision).
#pragma once

#include <cstdint>
#include <functional>

#include "cpu/matmul.h"

namespace dz::cpu {

// Top-k of n_experts router logits (ties: lower index first), then softmax
// over the k selected logits only (gpt-oss). idx/weights get k entries.
void router_topk_softmax(const float* logits, int n_experts, int k, int32_t* idx, float* weights);

// Gated activation of one row of the first expert projection h [2 * inter].
// DeepSeek-V3 routing ("noaux_tc"): s = sigmoid(logits); choice = s + bias
// (e_score_correction_bias); experts form n_group equal groups scored by the
// sum of their two best choice values; the topk_group best groups stay; the k
// best experts by choice among them are chosen (ties: lower index first).
// Their weights are s (without the bias), divided by their sum when norm,
// times scaling. fp32 arithmetic as transformers does it. margin (optional):
// how far the choice is from flipping, the smaller of the last kept group's
// score minus the next group's and the k-th chosen expert's choice value
// minus the next candidate's (+inf where nothing is left out).
void router_sigmoid_grouped(const float* logits, const float* bias, int n_experts, int n_group, int topk_group, int k,
                            bool norm, float scaling, int32_t* idx, float* weights, float* margin = nullptr);

// DeepSeek-V4 routing: s = sqrt(softplus(logits)); the k best of s + bias
// (bias may be null; ties: lower index first), or the k experts `fixed`
// names (hash-routed layers: a token-id table chooses). Weights are the
// chosen s divided by their sum (+1e-20), times scaling.
void router_sqrt_softplus(const float* logits, const float* bias, int n_experts, int k, const int32_t* fixed,
                          float scaling, int32_t* idx, float* weights);

struct Glu {
  enum class Kind {
    SwiGLU,         // h = [gate | up]: silu(gate) * up
    ClampedOss,     // gpt-oss: gate = h[0::2], up = h[1::2]; gate <= limit, |up| <= limit;
                    // (up + 1) * gate * sigmoid(alpha * gate)
    ClampedSwiGLU,  // DeepSeek-V4: h = [gate | up]; silu(min(gate, limit)) * clamp(up, -limit, limit)
  };
  Kind kind = Kind::SwiGLU;
  float alpha = 1.702f;
  float limit = 7.0f;
  bool round_f16 = false;  // outputs rounded to FP16, as the CUDA fused experts stage them
};
void glu(const Glu& g, const float* h, int64_t inter, float* out);

struct ExpertWeights {
  WeightRef up;                      // [2 * inter, hidden] (gate and up rows, layout per Glu),
                                     // or [inter, hidden] up rows alone when `gate` is set
  const float* up_bias = nullptr;    // [2 * inter] or null
  WeightRef down;                    // [hidden, inter]
  const float* down_bias = nullptr;  // [hidden] or null
  WeightRef gate = {};               // optional [inter, hidden] gate rows stored apart (SwiGLU only)
};

// y[r] = sum_j weights[r, j] * down(glu(up(x[r]))) over the experts idx[r, j]
// (k per row), accumulated in expert order. expert(e) gives expert e's weights.
void moe_forward(const float* x, int64_t n_rows, int64_t hidden, int64_t inter, const int32_t* idx,
                 const float* weights, int k, int n_experts, const std::function<ExpertWeights(int)>& expert,
                 const Glu& g, float* y, ThreadPool* pool);

}  // namespace dz::cpu
