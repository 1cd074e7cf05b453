// MoE routers on the device: top-k of each row's logits (ties: lower index
// first) with a softmax over the k selected logits only (gpt-oss), and
// DeepSeek-V3's grouped sigmoid routing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dz::cuda {

// logits [T, E] fp32 -> ids [T, k] int32, weights [T, k] fp32. E <= 256, k <= 16.
void router_topk_softmax(const float* logits, int T, int E, int k, int32_t* ids, float* weights, cudaStream_t s);

// DeepSeek-V3 "noaux_tc" routing, as cpu::router_sigmoid_grouped row by row
// (the same ids and, bit for bit, the same weights): logits [T, E] fp32, bias
// [E] fp32 or null -> ids [T, k] int32, weights [T, k] fp32, in pick order
// (best first); all device pointers. E <= 256, k <= 16, E % n_group == 0,
// topk_group <= n_group, k <= topk_group * E / n_group.
void router_sigmoid_grouped(const float* logits, const float* bias, int T, int E, int n_group, int topk_group, int k,
                            bool norm, float scaling, int32_t* ids, float* weights, cudaStream_t s);

// DeepSeek-V4's routing, as cpu::router_sqrt_softplus row by row: scores
// sqrt(softplus(logits)); the experts are the top-k of score + bias (the
// lower index on ties) or, where hash is given, hash[tokens[t] * k ..] (a
// token-id table [vocab][k]); weights the chosen scores over their sum, times
// scaling. Device pointers; bias, hash and tokens may be null (hash needs
// tokens). E <= 256, k <= 16.
void router_sqrt_softplus(const float* logits, const float* bias, const int32_t* hash, const int32_t* tokens, int T,
                          int E, int k, float scaling, int32_t* ids, float* weights, cudaStream_t s);

// A decode step's router in one launch (one cluster of blocks), for T <=
// kRouterFusedMaxRows rows (router_fused_fits: also H % 8 == 0, H <= 3072,
// E <= 128): xn = RMS norm of x [T, H] with norm_w (fp32, for the experts;
// the bits of rms_norm), logits [T, E] = bf16(xn) w^T + bias (w bf16 [E, H],
// fp32 accumulation), then ids/weights as router_topk_softmax.
constexpr int kRouterFusedMaxRows = 4;
bool router_fused_fits(int T, int H, int E, int k);
void router_fused(const float* x, int T, int H, const float* norm_w, float eps, const uint16_t* w, const float* bias,
                  int E, int k, float* xn, float* logits, int32_t* ids, float* weights, cudaStream_t s);

}  // namespace dz::cuda
