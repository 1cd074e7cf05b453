// Token sampling from a logits row: greedy, or temperature + top-k + top-p
// with a caller-owned RNG (deterministic for a given seed).
#pragma once

#include <cstdint>
#include <random>

namespace dz::cpu {

struct SamplerConfig {
  float temperature = 0;  // <= 0: greedy
  int32_t top_k = 0;      // 0: off
  float top_p = 1;        // 1: off
};

// Index of the largest logit (lowest index on ties; NaNs ignored); -1 if none is a number.
int32_t argmax(const float* logits, int64_t n);

// Uniform double in [0, 1) from the top 53 bits of one draw (portable, unlike
// std::uniform_real_distribution).
double uniform01(std::mt19937_64& rng);

// Greedy when temperature <= 0 (rng untouched); otherwise the candidates are
// the top_k largest logits (all when 0), softmax(logit / temperature) over
// them, then the smallest prefix (by probability) whose mass reaches top_p,
// renormalised; one rng draw picks the token. -1 if no logit is a number.
int32_t sample_token(const float* logits, int64_t n, const SamplerConfig& cfg, std::mt19937_64& rng);

}  // namespace dz::cpu
