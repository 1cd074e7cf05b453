// Rotary position embeddings: inverse frequencies (default and YaRN, as
// transformers' modeling_rope_utils computes them, float32 rounding included)
// and the two rotation layouts (half-split "NeoX" and interleaved pairs).
#pragma once

#include <cstdint>
#include <vector>

namespace dz::cpu {

struct RopeParams {
  enum class Type { Default, Yarn };
  Type type = Type::Default;
  int dim = 0;          // rotated dimensions (head_dim x partial_rotary_factor), even
  double base = 10000;  // rope_theta
  // YaRN
  double factor = 1;
  double original_max_position = 0;
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;         // floor/ceil the correction range
  double attention_factor = 0;  // <= 0: derived from factor (and mscale / mscale_all_dim)
  double mscale = 0, mscale_all_dim = 0;
};

struct RopeFreqs {
  std::vector<float> inv_freq;  // dim / 2
  float attention_factor = 1;   // multiplies cos and sin
};

RopeFreqs rope_freqs(const RopeParams& p);

// cos/sin of position pos for each frequency (dim/2 values each), scaled by
// the attention factor. The angle is rounded to fp32 as transformers does.
void rope_cos_sin(const RopeFreqs& f, int64_t pos, float* cos, float* sin);

// Rotate n_heads vectors (stride `stride` floats apart) in place over their
// first 2*half dims. Half-split: pairs (i, i + half). Interleaved: (2i, 2i+1).
void rope_half_split(float* x, int n_heads, int64_t stride, int half, const float* cos, const float* sin);
void rope_interleaved(float* x, int n_heads, int64_t stride, int half, const float* cos, const float* sin);

}  // namespace dz::cpu
