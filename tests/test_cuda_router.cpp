// GPU tests of the routers (cuda/router.h) against the CPU backend's kernels
// ([cuda]; they skip with a message where no CUDA device is present): top-k +
// softmax on random logits with ties and -inf entries, many rows; the fused
// decode router; DeepSeek-V3's grouped sigmoid routing, with and without ties.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/moe.h"

#ifdef DZ_WITH_CUDA
#include "cuda/norm.h"
#include "cuda/router.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#include "support/safetensors_writer.h"
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

TEST_CASE("CUDA fused decode router: norm as rms_norm, logits vs float64, top-k as the CPU backend", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(22);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.5f, 1.5f);
  using dz::test::bf16_to_double;
  using dz::test::f32_to_bf16;
  const float eps = 1e-5f;
  for (int H : {2880, 64, 3072})
    for (int E : {32, 128})
      for (int T : {1, 2, 4}) {
        const int k = 4;
        INFO("H " << H << " E " << E << " T " << T);
        REQUIRE(dz::cuda::router_fused_fits(T, H, E, k));
        std::vector<float> x(static_cast<size_t>(T) * H), nw(static_cast<size_t>(H)), bias(static_cast<size_t>(E));
        std::vector<uint16_t> w(static_cast<size_t>(E) * H);
        for (auto& v : x) v = 3.f * nd(rng);
        for (auto& v : nw) v = ud(rng);
        for (auto& v : w) v = f32_to_bf16(0.05f * nd(rng));
        for (auto& v : bias) v = 0.1f * nd(rng);
        dz::test::DeviceBuffer<float> dx(x), dnw(nw), dbias(bias), dxn(size_t(T) * H), dxn2(size_t(T) * H),
            dlog(size_t(T) * E), dgw(size_t(T) * k);
        dz::test::DeviceBuffer<uint16_t> dw(w), dxb(size_t(T) * H);
        dz::test::DeviceBuffer<int32_t> dids(size_t(T) * k);
        for (int rep = 0; rep < 2; ++rep)  // a second launch over the same outputs
          dz::cuda::router_fused(dx.p, T, H, dnw.p, eps, dw.p, dbias.p, E, k, dxn.p, dlog.p, dids.p, dgw.p,
                                 ctx.stream());
        dz::cuda::rms_norm(dx.p, nullptr, T, H, dnw.p, eps, dxn2.p, dxb.p, ctx.stream());
        ctx.sync();
        const auto xn = dxn.get(), xn2 = dxn2.get(), logits = dlog.get(), gw = dgw.get();
        const auto ids = dids.get();
        // The experts' input: the same bits as the norm kernel's where the blocks
        // have its 256 threads (up to 64 experts), else within rounding.
        if (E <= 64) {
          CHECK(std::memcmp(xn.data(), xn2.data(), xn.size() * 4) == 0);
        } else {
          double d = 0;
          for (size_t i = 0; i < xn.size(); ++i)
            d = std::max(d, std::fabs(double(xn[i]) - xn2[i]) / (std::fabs(double(xn2[i])) + 1e-30));
          CHECK(d < 1e-6);
        }
        // The normalized rows against float64, and the logits against float64 sums of
        // the same bf16 products (the projection's input is bf16(xn)).
        double xn_err = 0, log_err = 0, log_scale = 0;
        int id_bad = 0;
        double w_err = 0;
        for (int t = 0; t < T; ++t) {
          double ss = 0;
          for (int h = 0; h < H; ++h) ss += double(x[size_t(t) * H + h]) * x[size_t(t) * H + h];
          const double inv = 1.0 / std::sqrt(ss / H + eps);
          for (int h = 0; h < H; ++h)
            xn_err = std::max(xn_err, std::fabs(xn[size_t(t) * H + h] - nw[size_t(h)] * x[size_t(t) * H + h] * inv) /
                                          (std::fabs(nw[size_t(h)] * x[size_t(t) * H + h] * inv) + 1e-30));
          for (int e = 0; e < E; ++e) {
            double acc = bias[size_t(e)], mag = std::fabs(bias[size_t(e)]);
            for (int h = 0; h < H; ++h) {
              const double p =
                  bf16_to_double(f32_to_bf16(xn[size_t(t) * H + h])) * bf16_to_double(w[size_t(e) * H + h]);
              acc += p, mag += std::fabs(p);
            }
            log_err = std::max(log_err, std::fabs(logits[size_t(t) * E + e] - acc));
            log_scale = std::max(log_scale, mag);
          }
          std::vector<int32_t> ri(size_t(k), 0);
          std::vector<float> rw(size_t(k), 0.f);
          dz::cpu::router_topk_softmax(logits.data() + size_t(t) * E, E, k, ri.data(), rw.data());
          for (int j = 0; j < k; ++j) {
            id_bad += ids[size_t(t) * k + j] != ri[size_t(j)];
            w_err = std::max(w_err, double(std::fabs(gw[size_t(t) * k + j] - rw[size_t(j)])));
          }
        }
        CHECK(xn_err < 1e-5);
        CHECK(log_err < 4e-6 * log_scale);  // fp32 accumulation (a missing product: ~1 / H of the scale)
        CHECK(id_bad == 0);
        CHECK(w_err < 1e-6);
      }
  CHECK_THROWS(dz::cuda::router_fused(nullptr, 5, 2880, nullptr, eps, nullptr, nullptr, 32, 4, nullptr, nullptr,
                                      nullptr, nullptr, ctx.stream()));
#endif
}

TEST_CASE("CUDA grouped sigmoid router (DeepSeek-V3) matches the CPU backend", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> q(-8, 8), qb(-2, 2);
  struct Shape {
    int T, E, n_group, topk_group, k;
  };
  // Two groups of 8, DeepSeek-V3's 256 experts in 8 groups, a single group;
  // and groups of one expert (the group score is the expert's own choice).
  for (const Shape sh :
       {Shape{37, 16, 2, 1, 2}, Shape{5, 256, 8, 4, 8}, Shape{64, 64, 1, 1, 6}, Shape{9, 32, 32, 5, 4}})
    for (bool ties : {false, true})
      for (bool with_bias : {true, false})
        for (bool norm : {true, false})
          for (float scaling : {1.0f, 2.5f}) {
            const int T = sh.T, E = sh.E, k = sh.k;
            INFO("T " << T << " E " << E << " n_group " << sh.n_group << " topk_group " << sh.topk_group << " k " << k
                      << " ties " << ties << " bias " << with_bias << " norm " << norm << " scaling " << scaling);
            // Ties: logits on a grid of 0.25 and biases on one of 0.125, so that
            // equal choice values (and equal group scores) are common.
            std::vector<float> logits(static_cast<size_t>(T) * E), bias(static_cast<size_t>(E));
            for (auto& v : logits) v = ties ? 0.25f * float(q(rng)) : 2.f * nd(rng);
            for (auto& v : bias) v = ties ? 0.125f * float(qb(rng)) : 0.1f * nd(rng);
            dz::test::DeviceBuffer<float> dl(logits), db(bias), dw(size_t(T) * k);
            dz::test::DeviceBuffer<int32_t> di(size_t(T) * k);
            dz::cuda::router_sigmoid_grouped(dl.p, with_bias ? db.p : nullptr, T, E, sh.n_group, sh.topk_group, k, norm,
                                             scaling, di.p, dw.p, ctx.stream());
            ctx.sync();
            const auto ids = di.get();
            const auto w = dw.get();
            int id_bad = 0, w_bits = 0;
            double w_err = 0;
            for (int t = 0; t < T; ++t) {
              std::vector<int32_t> ri(static_cast<size_t>(k));
              std::vector<float> rw(static_cast<size_t>(k));
              dz::cpu::router_sigmoid_grouped(logits.data() + size_t(t) * E, with_bias ? bias.data() : nullptr, E,
                                              sh.n_group, sh.topk_group, k, norm, scaling, ri.data(), rw.data());
              for (int j = 0; j < k; ++j) {
                id_bad += ids[size_t(t) * k + j] != ri[size_t(j)];
                w_bits += w[size_t(t) * k + j] != rw[size_t(j)];
                w_err = std::max(w_err, double(std::fabs(w[size_t(t) * k + j] - rw[size_t(j)])));
              }
            }
            INFO("weights with other bits than the CPU's: " << w_bits << ", largest difference " << w_err);
            CHECK(id_bad == 0);
            CHECK(w_err < 1e-5);
          }
  // Shapes beyond the kernel (E > 256, k > 16) and inconsistent groups throw before any launch.
  CHECK_THROWS(
      dz::cuda::router_sigmoid_grouped(nullptr, nullptr, 1, 512, 8, 4, 8, true, 1.f, nullptr, nullptr, ctx.stream()));
  CHECK_THROWS(
      dz::cuda::router_sigmoid_grouped(nullptr, nullptr, 1, 256, 8, 4, 17, true, 1.f, nullptr, nullptr, ctx.stream()));
  CHECK_THROWS(
      dz::cuda::router_sigmoid_grouped(nullptr, nullptr, 1, 60, 8, 4, 8, true, 1.f, nullptr, nullptr, ctx.stream()));
  CHECK_THROWS(
      dz::cuda::router_sigmoid_grouped(nullptr, nullptr, 1, 16, 8, 1, 3, true, 1.f, nullptr, nullptr, ctx.stream()));
#endif
}
