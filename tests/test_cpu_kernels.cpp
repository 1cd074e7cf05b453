// CPU operators against float64 math on random inputs.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/attention.h"
#include "cpu/matmul.h"
#include "cpu/moe.h"
#include "cpu/mxfp4.h"
#include "cpu/norm.h"
#include "cpu/rope.h"
#include "cpu/sampling.h"
#include "runtime/parallel.h"
#include "support/safetensors_writer.h"
#include "support/sampling_reference.h"

using namespace dz::cpu;

namespace {
std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1) {
  std::normal_distribution<float> nd(0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
}  // namespace

TEST_CASE("thread pool covers every index once and propagates exceptions", "[kernels]") {
  dz::ThreadPool pool(3);
  CHECK(pool.size() == 3);
  for (size_t n : {1, 7, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, 1, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) ++hits[i];
    });
    for (size_t i = 0; i < n; ++i) CHECK(hits[i] == 1);
  }
  CHECK_THROWS_WITH(pool.parallel_for(100, 1,
                                      [](size_t b, size_t) {
                                        if (b >= 50) throw std::runtime_error("boom");
                                      }),
                    "boom");
  // Still usable afterwards.
  std::atomic<size_t> sum{0};
  pool.parallel_for(100, 1, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) sum += i;
  });
  CHECK(sum == 4950);
}

TEST_CASE("matmul over F32, BF16, F16 and MXFP4 weights matches float64", "[kernels]") {
  std::mt19937 rng(3);
  const int64_t M = 5, N = 37, K = 96;
  const auto x = randn(size_t(M * K), rng);
  const auto bias = randn(size_t(N), rng);
  dz::ThreadPool pool(2);
  // Weights in each precision plus their exact float64 values.
  std::vector<float> wf = randn(size_t(N * K), rng);
  std::vector<uint16_t> wb(wf.size()), wh(wf.size());
  std::vector<double> exact_b(wf.size()), exact_h(wf.size()), exact_f(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) {
    wb[i] = dz::test::f32_to_bf16(wf[i]);
    exact_b[i] = double(bf16_to_f32(wb[i]));
    exact_f[i] = double(wf[i]);
    // F16 from a few exact patterns incl. subnormals: sign | exp | mantissa.
    wh[i] = uint16_t(rng() & 0xFFFF);
    if (((wh[i] >> 10) & 0x1F) == 0x1F) wh[i] &= 0x83FF;  // no inf/nan
    const int e = (wh[i] >> 10) & 0x1F, m = wh[i] & 0x3FF;
    const double mag = e ? std::ldexp(1.0 + m / 1024.0, e - 15) : std::ldexp(m / 1024.0, -14);
    exact_h[i] = (wh[i] & 0x8000) ? -mag : mag;
  }
  std::vector<uint8_t> blocks(static_cast<size_t>(N * K / 2)), scales(size_t(N * K / 32));
  for (auto& b : blocks) b = uint8_t(rng());
  for (auto& s : scales) s = uint8_t(120 + rng() % 10);
  std::vector<double> exact_m(wf.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = blocks[size_t(n * K / 2 + k / 2)];
      const unsigned code = k % 2 ? byte >> 4 : byte & 15;
      exact_m[size_t(n * K + k)] = double(kE2M1[code]) * std::ldexp(1.0, scales[size_t(n * K / 32 + k / 32)] - 127);
    }
  struct Case {
    WeightRef w;
    const std::vector<double>* exact;
  };
  const Case cases[] = {
      {{WeightKind::F32, reinterpret_cast<const uint8_t*>(wf.data()), nullptr, N, K}, &exact_f},
      {{WeightKind::BF16, reinterpret_cast<const uint8_t*>(wb.data()), nullptr, N, K}, &exact_b},
      {{WeightKind::F16, reinterpret_cast<const uint8_t*>(wh.data()), nullptr, N, K}, &exact_h},
      {{WeightKind::MXFP4, blocks.data(), scales.data(), N, K}, &exact_m},
  };
  for (const auto& c : cases) {
    std::vector<float> y(static_cast<size_t>(M * N));
    matmul(x.data(), M, c.w, bias.data(), y.data(), &pool);
    double worst = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double ref = bias[size_t(n)];
        for (int64_t k = 0; k < K; ++k) ref += double(x[size_t(m * K + k)]) * (*c.exact)[size_t(n * K + k)];
        worst = std::max(worst, std::fabs(double(y[size_t(m * N + n)]) - ref) / (std::fabs(ref) + 1e-3));
      }
    INFO("kind " << int(c.w.kind));
    CHECK(worst < 1e-6);  // fp32 rounding of an fp64 sum
    // Row slices address the same rows.
    std::vector<float> y2(static_cast<size_t>(M * 10));
    matmul(x.data(), M, c.w.row_slice(20, 10), bias.data() + 20, y2.data(), nullptr);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < 10; ++n) CHECK(y2[size_t(m * 10 + n)] == y[size_t(m * N + 20 + n)]);
  }
}

TEST_CASE("fp64 dot products: the vector kernels and matmul give dot_f64's bits", "[kernels]") {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> ex(-140, 120);
  // Values over most of fp32's range, subnormals and zeros included: products stay exact in fp64.
  auto wide = [&](size_t n) {
    std::vector<float> v = randn(n, rng);
    for (size_t i = 0; i < n; ++i) v[i] = i % 11 == 5 ? 0.f : std::ldexp(v[i], i % 3 ? ex(rng) / 8 : ex(rng));
    return v;
  };
  for (int64_t n : {1, 7, 8, 13, 64, 96, 128, 200}) {
    const int m = 5;
    const auto a = wide(size_t(m * n)), b = wide(size_t(4 * n));
    std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end());
    const double* bp[4] = {bd.data(), bd.data() + n, bd.data() + 2 * n, bd.data() + 3 * n};
    const float* bf[4] = {b.data(), b.data() + n, b.data() + 2 * n, b.data() + 3 * n};
    // The vector kernels (where the CPU has them) and the portable ones, on double and on float vectors.
    std::vector<std::vector<double>> got(4, std::vector<double>(size_t(4 * m)));
    dot_rows4_f64(ad.data(), m, n, bp, n, got[0].data());
    dot_rows4_f64_portable(ad.data(), m, n, bp, n, got[1].data());
    dot_rows4_f64(ad.data(), m, n, bf, n, got[2].data());
    dot_rows4_f64_portable(ad.data(), m, n, bf, n, got[3].data());
    for (int r = 0; r < m; ++r)
      for (int j = 0; j < 4; ++j) {
        const double want = dot_f64(a.data() + r * n, b.data() + j * n, n);
        for (int form = 0; form < 4; ++form) {
          INFO("n " << n << " row " << r << " vector " << j << " form " << form);
          CHECK(std::memcmp(&got[size_t(form)][size_t(4 * r + j)], &want, 8) == 0);
        }
      }
  }
  // matmul: float(dot_f64(x, w) + bias) bit for bit, for few rows (decode), many (past one block of 64) and ragged
  // tiles.
  const int64_t N = 37, K = 96;
  const auto w = wide(size_t(N * K)), bias = randn(size_t(N), rng);
  const WeightRef wr{WeightKind::F32, reinterpret_cast<const uint8_t*>(w.data()), nullptr, N, K};
  dz::ThreadPool pool(3);
  for (int64_t M : {1, 3, 4, 5, 64, 70, 130}) {
    const auto x = randn(size_t(M * K), rng);
    std::vector<float> y(size_t(M * N));
    matmul(x.data(), M, wr, bias.data(), y.data(), &pool);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c) {
        const float want = float(dot_f64(x.data() + r * K, w.data() + c * K, K) + double(bias[size_t(c)]));
        INFO("rows " << M << " y[" << r << "][" << c << "]");
        CHECK(std::memcmp(&y[size_t(r * N + c)], &want, 4) == 0);
      }
  }
}

TEST_CASE("rms_norm matches float64", "[kernels]") {
  std::mt19937 rng(5);
  const int64_t R = 3, D = 64;
  const auto x = randn(size_t(R * D), rng, 3);
  const auto w = randn(size_t(D), rng);
  std::vector<float> y(x.size());
  rms_norm(x.data(), R, D, w.data(), 1e-5f, y.data());
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x[size_t(r * D + i)]) * x[size_t(r * D + i)];
    const double inv = 1 / std::sqrt(ss / D + 1e-5);
    for (int64_t i = 0; i < D; ++i)
      CHECK(y[size_t(r * D + i)] == Approx(double(w[size_t(i)]) * x[size_t(r * D + i)] * inv).epsilon(1e-6));
  }
}

TEST_CASE("YaRN inverse frequencies and both rotation layouts match float64", "[kernels]") {
  for (bool truncate : {false, true}) {
    RopeParams p;
    p.type = RopeParams::Type::Yarn;
    p.dim = 64;
    p.base = 150000;
    p.factor = 32;
    p.original_max_position = 4096;
    p.beta_fast = 32;
    p.beta_slow = 1;
    p.truncate = truncate;
    const RopeFreqs f = rope_freqs(p);
    // YaRN (arXiv 2309.00071, as transformers implements it): blend the
    // interpolated and extrapolated frequencies with a linear ramp over the
    // dimension range whose wavelengths fall between beta_fast and beta_slow
    // rotations of the original context.
    auto corr = [&](double rot) { return 64 * std::log(4096 / (rot * 2 * M_PI)) / (2 * std::log(150000.0)); };
    double lo = corr(32), hi = corr(1);
    if (truncate) lo = std::floor(lo), hi = std::ceil(hi);
    lo = std::max(lo, 0.0);
    hi = std::min(hi, 63.0);
    CHECK(f.attention_factor == Approx(0.1 * std::log(32.0) + 1).epsilon(1e-7));
    for (int i = 0; i < 32; ++i) {
      const double base_f = std::pow(150000.0, -2.0 * i / 64);
      const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
      const double want = base_f / 32 * ramp + base_f * (1 - ramp);
      INFO("truncate " << truncate << " i " << i);
      CHECK(f.inv_freq[size_t(i)] == Approx(want).epsilon(2e-6));
    }
  }
  // Rotation: half-split pairs (i, i + half), interleaved pairs (2i, 2i + 1).
  std::mt19937 rng(9);
  const int half = 4;
  const auto v = randn(16, rng);
  const auto ang = randn(half, rng);
  std::vector<float> c(half), s(half);
  for (int i = 0; i < half; ++i) c[size_t(i)] = std::cos(ang[size_t(i)]), s[size_t(i)] = std::sin(ang[size_t(i)]);
  auto a = v, b = v;
  rope_half_split(a.data(), 2, 8, half, c.data(), s.data());
  rope_interleaved(b.data(), 2, 8, half, c.data(), s.data());
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < half; ++i) {
      const double x0 = v[size_t(h * 8 + i)], x1 = v[size_t(h * 8 + i + half)];
      CHECK(a[size_t(h * 8 + i)] == Approx(x0 * std::cos(ang[size_t(i)]) - x1 * std::sin(ang[size_t(i)])));
      CHECK(a[size_t(h * 8 + i + half)] == Approx(x1 * std::cos(ang[size_t(i)]) + x0 * std::sin(ang[size_t(i)])));
      const double y0 = v[size_t(h * 8 + 2 * i)], y1 = v[size_t(h * 8 + 2 * i + 1)];
      CHECK(b[size_t(h * 8 + 2 * i)] == Approx(y0 * std::cos(ang[size_t(i)]) - y1 * std::sin(ang[size_t(i)])));
      CHECK(b[size_t(h * 8 + 2 * i + 1)] == Approx(y1 * std::cos(ang[size_t(i)]) + y0 * std::sin(ang[size_t(i)])));
    }
}

TEST_CASE("gpt-oss clamped SwiGLU and plain SwiGLU match float64 (values beyond the clamp)", "[kernels]") {
  std::mt19937 rng(11);
  const int64_t I = 64;
  const auto h = randn(size_t(2 * I), rng, 6);  // many |values| > 7
  Glu oss;
  oss.kind = Glu::Kind::ClampedOss;
  std::vector<float> out(static_cast<size_t>(I));
  glu(oss, h.data(), I, out.data());
  int clamped = 0;
  for (int64_t i = 0; i < I; ++i) {
    const double gate = std::min(double(h[size_t(2 * i)]), 7.0);
    const double up = std::clamp(double(h[size_t(2 * i + 1)]), -7.0, 7.0);
    clamped += h[size_t(2 * i)] > 7 || std::fabs(h[size_t(2 * i + 1)]) > 7;
    CHECK(out[size_t(i)] == Approx((up + 1) * gate / (1 + std::exp(-1.702 * gate))).epsilon(1e-5).margin(1e-6));
  }
  CHECK(clamped > 5);
  Glu plain;
  glu(plain, h.data(), I, out.data());
  for (int64_t i = 0; i < I; ++i) {
    const double g = h[size_t(i)];
    CHECK(out[size_t(i)] == Approx(g / (1 + std::exp(-g)) * h[size_t(I + i)]).epsilon(1e-5).margin(1e-6));
  }
}

TEST_CASE("router top-k softmax over the selected logits", "[kernels]") {
  const float logits[8] = {0.1f, 2.0f, -1.0f, 1.5f, 2.0f, 0.3f, -3.0f, 1.0f};
  int32_t idx[4];
  float w[4];
  router_topk_softmax(logits, 8, 4, idx, w);
  CHECK(std::vector<int32_t>(idx, idx + 4) == std::vector<int32_t>{1, 4, 3, 7});
  const double z = 2 * std::exp(2.0) + std::exp(1.5) + std::exp(1.0);
  CHECK(w[0] == Approx(std::exp(2.0) / z));
  CHECK(w[2] == Approx(std::exp(1.5) / z));
  CHECK(w[3] == Approx(std::exp(1.0) / z));
}

TEST_CASE("attention with a sink over row pointers matches float64", "[kernels]") {
  std::mt19937 rng(13);
  const int hd = 16, n = 9, heads = 2;
  const auto q = randn(hd, rng);
  std::vector<std::vector<float>> rows;
  std::vector<const float*> kp, vp;
  for (int j = 0; j < n; ++j) rows.push_back(randn(size_t(2 * heads * hd), rng));
  for (int j = 0; j < n; ++j) kp.push_back(rows[size_t(j)].data()), vp.push_back(rows[size_t(j)].data() + heads * hd);
  const float scale = 0.25f, sink = 0.7f;
  std::vector<double> scratch;
  for (bool with_sink : {false, true}) {
    std::vector<float> out(hd);
    attend(q.data(), kp.data(), vp.data(), n, hd, hd, scale, with_sink ? &sink : nullptr, out.data(), scratch);
    std::vector<double> s(n);
    double mx = with_sink ? sink : -1e300, den = 0;
    for (int j = 0; j < n; ++j) {
      double d = 0;
      for (int k = 0; k < hd; ++k) d += double(q[size_t(k)]) * kp[size_t(j)][hd + k];
      s[size_t(j)] = d * scale;
      mx = std::max(mx, s[size_t(j)]);
    }
    for (int j = 0; j < n; ++j) den += std::exp(s[size_t(j)] - mx);
    if (with_sink) den += std::exp(sink - mx);
    for (int k = 0; k < hd; ++k) {
      double acc = 0;
      for (int j = 0; j < n; ++j) acc += std::exp(s[size_t(j)] - mx) / den * vp[size_t(j)][hd + k];
      CHECK(out[size_t(k)] == Approx(acc).epsilon(1e-5).margin(1e-6));
    }
  }
}

// Nearest representable value by search over the format's grid (float64), ties to even mantissa.
namespace {
double nearest_on_grid(double x, int mant_bits, int min_exp) {
  if (x == 0) return 0;
  const double a = std::fabs(x);
  int e = std::ilogb(a);
  if (e < min_exp) e = min_exp;  // subnormal spacing below the smallest normal
  const double ulp = std::ldexp(1.0, e - mant_bits);
  const double lo = std::floor(a / ulp) * ulp, hi = lo + ulp;
  double r;
  if (a - lo < hi - a)
    r = lo;
  else if (hi - a < a - lo)
    r = hi;
  else
    r = std::fmod(lo / ulp, 2.0) == 0 ? lo : hi;
  return std::copysign(r, x);
}
}  // namespace

TEST_CASE("activation rounding as the CUDA backend stages it: BF16, and FP16 scaled per row", "[kernels]") {
  std::mt19937 rng(7);
  std::vector<float> v = randn(4096, rng, 3.f);
  for (size_t i = 0; i < 64; ++i) v[i] = std::ldexp(v[i], int(i) - 40);  // wide exponent range
  // Exact ties: mantissa ...1 1000 0000 0000 0000 and ...0 1000 ...
  uint32_t t1 = 0x3f818000u, t2 = 0x3f808000u;
  std::memcpy(&v[100], &t1, 4);
  std::memcpy(&v[101], &t2, 4);
  std::vector<float> b = v;
  round_to_bf16(b.data(), b.size());
  for (size_t i = 0; i < v.size(); ++i) {
    INFO("bf16 index " << i << " x " << v[i]);
    REQUIRE(double(b[i]) == nearest_on_grid(v[i], 7, -126));
  }
  CHECK(b[100] == 1.015625f);  // tie rounds to the even mantissa (up)
  CHECK(b[101] == 1.0f);       // tie rounds to the even mantissa (down)

  const size_t row = 256;
  std::vector<float> h(v.begin() + 1024, v.begin() + 1024 + 4 * row);
  h[5] = 1e-7f;  // far below the row's largest value: FP16 subnormal after scaling
  std::vector<float> hr = h;
  round_to_f16_scaled(hr.data(), 4, row);
  for (size_t r = 0; r < 4; ++r) {
    double amax = 0;
    for (size_t i = 0; i < row; ++i) amax = std::max(amax, std::fabs(double(h[r * row + i])));
    const int ex = std::ilogb(amax) + 1;  // amax / 2^ex in [0.5, 1)
    for (size_t i = 0; i < row; ++i) {
      const double x = std::ldexp(double(h[r * row + i]), -ex);
      INFO("f16 row " << r << " col " << i);
      REQUIRE(double(hr[r * row + i]) == std::ldexp(nearest_on_grid(x, 10, -14), ex));
    }
  }
  CHECK(hr[5] != h[5]);  // the subnormal lost precision
}

TEST_CASE("sampling: the partial-order sampler draws what a full sort draws, seed for seed", "[kernels]") {
  std::mt19937 gen(5);
  for (const int64_t n : {int64_t(6), int64_t(1000), int64_t(201088)}) {
    for (const float scale : {0.5f, 3.f, 30.f}) {  // flat to peaked distributions
      std::vector<float> l(static_cast<size_t>(n));
      std::normal_distribution<float> nd(0.f, scale);
      std::uniform_int_distribution<int> kind(0, 99);
      for (auto& x : l) {
        const int k = kind(gen);
        x = k == 0 ? NAN : k == 1 ? -INFINITY : k < 10 ? std::round(nd(gen)) : nd(gen);  // NaN, -inf, ties
      }
      for (const dz::cpu::SamplerConfig cfg :
           {dz::cpu::SamplerConfig{1.f, 0, 1.f}, dz::cpu::SamplerConfig{0.7f, 0, 0.9f},
            dz::cpu::SamplerConfig{1.3f, 40, 1.f}, dz::cpu::SamplerConfig{0.8f, 300, 0.95f},
            dz::cpu::SamplerConfig{5.f, 0, 0.999f}}) {
        INFO("n " << n << " scale " << scale << " T " << cfg.temperature << " top_k " << cfg.top_k << " top_p "
                  << cfg.top_p);
        std::mt19937_64 ra(17), rb(17);
        int differ = 0;
        const int draws = n > 100000 ? 40 : 400;
        for (int d = 0; d < draws; ++d)
          differ += dz::cpu::sample_token(l.data(), n, cfg, ra) !=
                    dz::test::sample_reference(l.data(), n, cfg, dz::cpu::uniform01(rb)).token;
        // Sums in another order could flip a draw within ~1e-16 of a boundary: never in practice.
        CHECK(differ == 0);
      }
    }
  }
  std::vector<float> nan(100, NAN);
  std::mt19937_64 r(1);
  CHECK(dz::cpu::sample_token(nan.data(), 100, {1.f, 0, 1.f}, r) == -1);
  // Infinite logits: the largest weighs 1, so every -inf is as likely as
  // another, and a +inf takes all the mass.
  std::vector<float> ninf(8, -INFINITY);
  const std::vector<float> pinf = {1.f, INFINITY, 3.f, INFINITY, NAN};
  std::vector<int> hits(8, 0);
  for (int d = 0; d < 400; ++d) {
    const int32_t t = dz::cpu::sample_token(ninf.data(), 8, {1.f, 0, 1.f}, r);
    REQUIRE((t >= 0 && t < 8));
    ++hits[size_t(t)];
    const int32_t ti = dz::cpu::sample_token(pinf.data(), 5, {0.7f, 0, 0.9f}, r);
    CHECK((ti == 1 || ti == 3));
  }
  CHECK(*std::min_element(hits.begin(), hits.end()) > 20);
}
