#include "cpu/rope.h"

#include <algorithm>
#include <cmath>

namespace dz::cpu {

namespace {
double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }
// Dimension index at which a frequency completes num_rotations over max_pos.
double correction_dim(double num_rotations, int dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (num_rotations * 2 * M_PI))) / (2 * std::log(base));
}
}  // namespace

RopeFreqs rope_freqs(const RopeParams& p) {
  RopeFreqs r;
  const int half = p.dim / 2;
  r.inv_freq.resize(size_t(half));
  // base ** (arange(0, dim, 2) / dim), each step in fp32 like the reference.
  std::vector<float> pos_freqs(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    const float e = float(2 * i) / float(p.dim);
    pos_freqs[size_t(i)] = float(std::pow(double(float(p.base)), double(e)));
  }
  if (p.type == RopeParams::Type::Default) {
    for (int i = 0; i < half; ++i) r.inv_freq[size_t(i)] = 1.0f / pos_freqs[size_t(i)];
    return r;
  }
  double af = p.attention_factor;
  if (af <= 0)
    af = (p.mscale != 0 && p.mscale_all_dim != 0)
             ? yarn_mscale(p.factor, p.mscale) / yarn_mscale(p.factor, p.mscale_all_dim)
             : yarn_mscale(p.factor, 1);
  r.attention_factor = float(af);
  double low = correction_dim(p.beta_fast, p.dim, p.base, p.original_max_position);
  double high = correction_dim(p.beta_slow, p.dim, p.base, p.original_max_position);
  if (p.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, double(p.dim - 1));
  if (low == high) high += 0.001;  // avoid a zero-width ramp
  const float flow = float(low), fspan = float(high - low);
  const float factor = float(p.factor);
  for (int i = 0; i < half; ++i) {
    const float extrap = 1.0f / pos_freqs[size_t(i)];
    const float interp = 1.0f / (factor * pos_freqs[size_t(i)]);
    const float ramp = std::clamp((float(i) - flow) / fspan, 0.0f, 1.0f);
    const float extrap_factor = 1.0f - ramp;
    r.inv_freq[size_t(i)] = interp * (1.0f - extrap_factor) + extrap * extrap_factor;
  }
  return r;
}

void rope_cos_sin(const RopeFreqs& f, int64_t pos, float* cos, float* sin) {
  const float fp = float(pos);
  for (size_t i = 0; i < f.inv_freq.size(); ++i) {
    const float angle = f.inv_freq[i] * fp;
    cos[i] = float(std::cos(double(angle))) * f.attention_factor;
    sin[i] = float(std::sin(double(angle))) * f.attention_factor;
  }
}

void rope_half_split(float* x, int n_heads, int64_t stride, int half, const float* cos, const float* sin) {
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + h * stride;
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

void rope_interleaved(float* x, int n_heads, int64_t stride, int half, const float* cos, const float* sin) {
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + h * stride;
    for (int i = 0; i < half; ++i) {
      const float a = v[2 * i], b = v[2 * i + 1];
      v[2 * i] = a * cos[i] - b * sin[i];
      v[2 * i + 1] = b * cos[i] + a * sin[i];
    }
  }
}

}  // namespace dz::cpu
