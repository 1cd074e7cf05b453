// GPU test of the BF16 experts (cuda/moe_bf16.h) against float64 SwiGLU
// experts on the same bf16 weights and inputs ([cuda][kimi]; skips with a
// message where no CUDA device is present): both paths (few slots without a
// host sync; sorted slots through per-expert GEMMs) on random routings, with
// repeated experts, and shapes the few-slot kernels do not take.
// Tolerance: the activations are rounded to bf16 between the projections (as
// the GEMM path's SwiGLU writes them): every output within 1% of its row's
// largest magnitude, and the two paths within that of each other.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#ifdef DZ_WITH_CUDA
#include "cuda/bf16_gemm.h"
#include "cuda/moe_bf16.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#include "support/safetensors_writer.h"
#endif

#include "support/gpu.h"

TEST_CASE("CUDA BF16 experts match float64 SwiGLU experts on both paths", "[cuda][kimi]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  using test::bf16_to_double;
  using test::f32_to_bf16;
  cuda::Context ctx(test::pool_options(size_t(256) << 20));
  cuda::Bf16Gemm gemm(ctx);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  struct Case {
    int E, k, H, I, T;
  };
  for (const Case c : {Case{16, 4, 256, 96, 1}, Case{16, 4, 256, 96, 5}, Case{8, 8, 64, 32, 3},
                       Case{32, 2, 128, 64, 40}, Case{6, 2, 72, 36, 4}}) {
    INFO("E " << c.E << " top-" << c.k << " H " << c.H << " I " << c.I << " T " << c.T);
    const size_t S = size_t(c.T) * c.k;
    std::vector<uint16_t> w13(size_t(c.E) * 2 * c.I * c.H), w2(size_t(c.E) * c.H * c.I), xb(size_t(c.T) * c.H);
    for (auto& v : w13) v = f32_to_bf16(nd(rng) / std::sqrt(float(c.H)));
    for (auto& v : w2) v = f32_to_bf16(nd(rng) / std::sqrt(float(c.I)));
    for (auto& v : xb) v = f32_to_bf16(nd(rng));
    std::vector<int32_t> ids(S);
    std::vector<float> gw(S), x0(size_t(c.T) * c.H);
    std::uniform_int_distribution<int> pick(0, c.E - 1);
    for (int t = 0; t < c.T; ++t) {
      std::vector<int> all(size_t(c.E));
      for (int e = 0; e < c.E; ++e) all[size_t(e)] = e;
      std::shuffle(all.begin(), all.end(), rng);
      for (int j = 0; j < c.k; ++j)
        ids[size_t(t) * c.k + j] = all[size_t(j)], gw[size_t(t) * c.k + j] = 0.2f + nd(rng) * 0.1f;
    }
    if (c.T > 1) ids[0] = ids[size_t(c.k)];  // two tokens share an expert
    for (auto& v : x0) v = nd(rng);
    // float64 reference
    std::vector<double> want(x0.begin(), x0.end());
    for (int t = 0; t < c.T; ++t)
      for (int j = 0; j < c.k; ++j) {
        const int e = ids[size_t(t) * c.k + j];
        std::vector<double> act(size_t(c.I));
        for (int i = 0; i < c.I; ++i) {
          double g = 0, u = 0;
          for (int h = 0; h < c.H; ++h) {
            const double xv = bf16_to_double(xb[size_t(t) * c.H + h]);
            g += bf16_to_double(w13[(size_t(e) * 2 * c.I + i) * c.H + h]) * xv;
            u += bf16_to_double(w13[(size_t(e) * 2 * c.I + c.I + i) * c.H + h]) * xv;
          }
          act[size_t(i)] = g / (1 + std::exp(-g)) * u;
        }
        for (int n = 0; n < c.H; ++n) {
          double y = 0;
          for (int i = 0; i < c.I; ++i) y += bf16_to_double(w2[(size_t(e) * c.H + n) * c.I + i]) * act[size_t(i)];
          want[size_t(t) * c.H + n] += gw[size_t(t) * c.k + j] * y;
        }
      }
    test::DeviceBuffer<uint16_t> dw13(w13), dw2(w2), dxb(xb);
    test::DeviceBuffer<int32_t> dids(ids);
    test::DeviceBuffer<float> dgw(gw);
    cuda::Bf16Experts ex(ctx, gemm, c.E, c.k, c.H, c.I);
    cuda::Bf16ExpertWeights w;
    w.w13 = dw13.p, w.w2 = dw2.p;
    std::vector<std::vector<float>> got;
    for (const bool few : {true, false}) {
      ex.set_few_max_slots(few ? int64_t(1) << 30 : 0);
      if (few && !ex.few_slots(c.T)) continue;  // I not a multiple of 8: the GEMM path only
      test::DeviceBuffer<float> dx(x0);
      ex.forward(w, dxb.p, dids.p, dgw.p, c.T, dx.p, ctx.stream());
      ctx.sync();
      got.push_back(dx.get());
      double worst = 0;
      for (int t = 0; t < c.T; ++t) {
        double mag = 0;
        for (int n = 0; n < c.H; ++n) mag = std::max(mag, std::fabs(want[size_t(t) * c.H + n]));
        for (int n = 0; n < c.H; ++n)
          worst = std::max(worst, std::fabs(got.back()[size_t(t) * c.H + n] - want[size_t(t) * c.H + n]) / mag);
      }
      INFO((few ? "few-slot path" : "GEMM path") << ": worst error " << worst << " of a row's magnitude");
      CHECK(worst < 1e-2);
    }
    if (got.size() == 2) {
      double d = 0, m = 0;
      for (size_t i = 0; i < got[0].size(); ++i)
        d = std::max(d, double(std::fabs(got[0][i] - got[1][i]))), m = std::max(m, double(std::fabs(got[1][i])));
      CHECK(d / m < 1e-2);
    }
  }
#endif
}
