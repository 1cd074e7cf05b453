// GPU test of the router's top-k + softmax (cuda/router.h) against the CPU
// backend's kernel ([cuda]; skips with a message where no CUDA device is
// present): random logits with ties and -inf entries, many rows.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "cpu/moe.h"

#ifdef DZ_WITH_CUDA
#include "cuda/router.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#endif

#include "support/gpu.h"

TEST_CASE("CUDA router top-k softmax matches the CPU backend (ties to the lower index)", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(21);
  for (int E : {8, 32, 128, 256})
    for (int k : {1, 4, 8}) {
      const int T = 37;
      INFO("E " << E << " k " << k);
      // Logits on a coarse grid: many exact ties; a few -inf.
      std::uniform_int_distribution<int> q(-8, 8), hole(0, 15);
      std::vector<float> logits(static_cast<size_t>(T) * E);
      for (auto& v : logits) v = hole(rng) == 0 ? -INFINITY : 0.25f * float(q(rng));
      dz::test::DeviceBuffer<float> dl(logits), dw(size_t(T) * k);
      dz::test::DeviceBuffer<int32_t> di(size_t(T) * k);
      dz::cuda::router_topk_softmax(dl.p, T, E, k, di.p, dw.p, ctx.stream());
      ctx.sync();
      const auto ids = di.get();
      const auto w = dw.get();
      int id_bad = 0;
      double w_err = 0;
      for (int t = 0; t < T; ++t) {
        std::vector<int32_t> ri(static_cast<size_t>(k));
        std::vector<float> rw(static_cast<size_t>(k));
        dz::cpu::router_topk_softmax(logits.data() + size_t(t) * E, E, k, ri.data(), rw.data());
        for (int j = 0; j < k; ++j) {
          id_bad += ids[size_t(t) * k + j] != ri[size_t(j)];
          w_err = std::max(w_err, double(std::fabs(w[size_t(t) * k + j] - rw[size_t(j)])));
        }
      }
      CHECK(id_bad == 0);
      CHECK(w_err < 1e-6);
    }
#endif
}
