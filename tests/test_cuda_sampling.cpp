// GPU test of temperature / top-k / top-p sampling on the device
// (cuda/sampling.h) against a float64 reference that sorts the vocabulary,
// draw for draw ([cuda]; skips with a message where no CUDA device is present).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cpu/sampling.h"
#include "support/sampling_reference.h"

#ifdef DZ_WITH_CUDA
#include "cuda/sampling.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#endif

#include "support/gpu.h"

TEST_CASE("CUDA sampling draws what a sorted float64 reference draws, and the same every run", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 gen(11);
  const std::vector<dz::cpu::SamplerConfig> cfgs = {
      {1.f, 0, 1.f}, {0.7f, 0, 0.9f},  {1.3f, 40, 1.f},      {0.8f, 300, 0.95f}, {5.f, 0, 0.999f},
      {1.f, 1, 1.f}, {0.6f, 0, 0.05f}, {2.f, 1 << 30, 0.5f}, {0.3f, 7, 0.6f},    {1e-30f, 0, 1.f}};
  size_t cases = 0, exact = 0, near_random = 0;
  for (const int V : {201088, 4099, 1000, 7}) {
    // Rows: Gaussian at three scales (flat to peaked) with NaN and -inf
    // entries, a coarse grid (many exact ties, +0 and -0), all -inf, one
    // number among NaNs, two +inf, all NaN (no token).
    const int rows = 9;
    std::vector<float> logits(size_t(rows) * size_t(V));
    std::uniform_int_distribution<int> kind(0, 63), grid(-6, 6);
    for (int r = 0; r < rows; ++r) {
      float* row = logits.data() + size_t(r) * size_t(V);
      std::normal_distribution<float> nd(0.f, r == 0 ? 0.5f : r == 1 ? 3.f : 30.f);
      for (int i = 0; i < V; ++i) {
        const int k = kind(gen);
        row[i] = r == 3 ? 0.5f * float(grid(gen)) : k == 0 ? NAN : k == 1 ? -INFINITY : nd(gen);
        if (r == 3 && row[i] == 0.f && k < 32) row[i] = -0.f;
      }
      if (r == 4) std::fill(row, row + V, -INFINITY);
      if (r == 5) std::fill(row, row + V, NAN), row[V / 2] = 1.5f;
      if (r == 6) row[V / 3] = INFINITY, row[V - 1] = INFINITY;
      if (r == 7) std::fill(row, row + V, NAN);
    }
    dz::test::DeviceBuffer<float> dl(logits);
    // Every row with every sampler, at ten draws each, two of them the ends of [0, 1).
    std::vector<dz::cuda::SampleRow> sr;
    std::uniform_real_distribution<double> ud(0, 1);
    for (int r = 0; r < rows; ++r)
      for (const auto& c : cfgs)
        for (int d = 0; d < 10; ++d)
          sr.push_back({dl.p + size_t(r) * size_t(V), c.temperature, c.top_k, c.top_p,
                        d == 0   ? 0.0
                        : d == 1 ? 1.0 - 0x1p-53
                                 : ud(gen)});
    dz::test::DeviceBuffer<dz::cuda::SampleRow> dr(sr);
    dz::test::DeviceBuffer<int32_t> dt(sr.size()), dt2(sr.size());
    // Once in launches of 16, 60 and 120 rows (a row split over 8, 4 and 2
    // blocks), once all at once (a block a row), once with the argmax given:
    // the same tokens, as the sums are integers.
    for (size_t j = 0, c = 0, k = 0; j < sr.size(); j += c, ++k) {
      c = std::min(sr.size() - j, size_t(k % 3 == 0 ? 16 : k % 3 == 1 ? 60 : 120));
      dz::cuda::sample_rows(dr.p + j, int(c), V, dt.p + j, ctx.stream());
    }
    dz::cuda::sample_rows(dr.p, int(sr.size()), V, dt2.p, ctx.stream());
    // Once more with each row's argmax given (the largest logit then costs no pass).
    std::vector<dz::cuda::SampleRow> sa = sr;
    for (size_t j = 0; j < sa.size(); ++j)
      sa[j].argmax = dz::cpu::argmax(logits.data() + j / (cfgs.size() * 10) * size_t(V), V);
    dz::test::DeviceBuffer<dz::cuda::SampleRow> da(sa);
    dz::test::DeviceBuffer<int32_t> dt3(sr.size());
    dz::cuda::sample_rows(da.p, int(sa.size()), V, dt3.p, ctx.stream());
    ctx.sync();
    const auto tok = dt.get(), tok2 = dt2.get(), tok3 = dt3.get();
    CHECK(tok == tok2);
    CHECK(tok == tok3);
    for (size_t j = 0; j < sr.size(); ++j) {
      const int r = int(j / (cfgs.size() * 10));
      const dz::cpu::SamplerConfig cfg{sr[j].temperature, sr[j].top_k, sr[j].top_p};
      const auto ref = dz::test::sample_reference(logits.data() + size_t(r) * size_t(V), V, cfg, sr[j].u, /*tol=*/1e-5);
      INFO("V " << V << " row " << r << " T " << cfg.temperature << " top_k " << cfg.top_k << " top_p " << cfg.top_p
                << " u " << sr[j].u << " reference " << ref.token << (ref.near ? " (near a boundary)" : ""));
      ++cases;
      if (tok[j] == ref.token) {
        ++exact;
        continue;
      }
      // The device's fp32 weights may pick a neighbour only at a boundary.
      CHECK(ref.near);
      // Rare for random draws (the ends of [0, 1) and the uniform row's top_p
      // of exactly half its mass sit on boundaries by construction).
      near_random += ref.near && j % 10 >= 2 && r != 4;
    }
  }
  std::printf("CUDA sampling: %zu draws, %zu as the float64 reference, %zu of the others next to it at a boundary\n",
              cases, exact, cases - exact);
  CHECK(near_random * 1000 <= cases);
#endif
}
