// GPU tests of the few-row BF16 projection kernel (cuda/bf16_gemv.h) behind
// Bf16Gemm ([cuda]; they skip with a message where no CUDA device is present):
// random bf16 operands against a float64 reference and against cuBLASLt, with
// and without bias, beta = 1 accumulation, rows of D past m untouched,
// repeatability, and a throughput line at gpt-oss decode shapes.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#ifdef DZ_WITH_CUDA
#include "cuda/bf16_gemm.h"
#include "cuda/bf16_gemv.h"
#include "cuda/norm.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#include "support/device_buffer.h"
#include "support/safetensors_writer.h"
#endif

#include "support/gpu.h"

#ifdef DZ_WITH_CUDA
namespace {
using namespace dz;
using namespace dz::cuda;
template <typename T>
using Buf = dz::test::DeviceBuffer<T>;

using dz::test::bf16_to_double;

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float sd) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<uint16_t> v(n);
  for (auto& b : v) b = dz::test::f32_to_bf16(nd(rng));
  return v;
}

}  // namespace
#endif

TEST_CASE("CUDA few-row BF16 projections match float64 and cuBLASLt", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  Context ctx(dz::test::pool_options(size_t(256) << 20));
  Bf16Gemm gemm(ctx);
  std::mt19937 rng(11);
  struct Shape {
    int m, n, k;
  };
  // Decode shapes of gpt-oss (qkv, o_proj, router) and ragged ones: n off 16, one 32-wide K chunk, K split wider
  // than the chunks.
  for (Shape sh : {Shape{1, 5120, 2880}, Shape{8, 2880, 4096}, Shape{1, 32, 2880}, Shape{3, 40, 64}, Shape{5, 33, 96},
                   Shape{7, 200, 32}, Shape{2, 16, 288}}) {
    const int m = sh.m, n = sh.n, k = sh.k;
    INFO("m " << m << " n " << n << " k " << k);
    REQUIRE(bf16_gemv_fits(reinterpret_cast<const uint16_t*>(256), reinterpret_cast<const uint16_t*>(256), m, n, k));
    const auto x = random_bf16(size_t(m) * k, rng, 1.f), w = random_bf16(size_t(n) * k, rng, 0.05f);
    std::vector<float> bias(static_cast<size_t>(n)), d0(static_cast<size_t>(m + 1) * n);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& b : bias) b = nd(rng);
    for (auto& v : d0) v = nd(rng);
    Buf<uint16_t> dx(x), dw(w);
    Buf<float> db(bias), dd(d0);
    for (bool with_bias : {false, true})
      for (float beta : {0.f, 1.f}) {
        INFO("bias " << with_bias << " beta " << beta);
        // float64 reference and its scale (sum of |x w|) per element.
        std::vector<double> ref(size_t(m) * n), mag(size_t(m) * n);
        for (int r = 0; r < m; ++r)
          for (int c = 0; c < n; ++c) {
            double s = 0, a = 0;
            for (int i = 0; i < k; ++i) {
              const double p = bf16_to_double(x[size_t(r) * k + i]) * bf16_to_double(w[size_t(c) * k + i]);
              s += p, a += std::fabs(p);
            }
            s += with_bias ? bias[size_t(c)] : 0.0;
            s += beta * d0[size_t(r) * n + c];
            ref[size_t(r) * n + c] = s, mag[size_t(r) * n + c] = a + 1.0;
          }
        auto run = [&](bool small) {  // our kernel, or cuBLASLt through Bf16Gemm
          DZ_CUDA_CHECK(cudaMemcpy(dd.p, d0.data(), d0.size() * 4, cudaMemcpyHostToDevice));
          Buf<float>::settle();
          gemm.set_small_m_kernel(false);
          if (small)
            bf16_gemv(dx.p, dw.p, with_bias ? db.p : nullptr, dd.p, m, n, k, beta, ctx.stream());
          else
            gemm.run(dx.p, dw.p, with_bias ? db.p : nullptr, dd.p, m, n, k, beta, ctx.stream());
          ctx.sync();
          return dd.get();
        };
        const auto got = run(true), again = run(true), lt = run(false);
        int bad = 0, bad_lt = 0;
        double worst = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          // fp32 accumulation over k products: error well under 1e-5 of the magnitude sum.
          const double e = std::fabs(got[i] - ref[i]) / mag[i];
          worst = std::max(worst, e);
          bad += !(e < 1e-5);
          bad_lt += !(std::fabs(got[i] - lt[i]) / mag[i] < 2e-5);
        }
        INFO("worst |err| / sum |x w| " << worst);
        CHECK(bad == 0);
        CHECK(bad_lt == 0);
        // Row m of D (past the problem) untouched; the same bits on a second run.
        CHECK(std::memcmp(got.data() + size_t(m) * n, d0.data() + size_t(m) * n, size_t(n) * 4) == 0);
        CHECK(std::memcmp(got.data(), again.data(), got.size() * 4) == 0);
      }
  }
  // Shapes it does not take go to cuBLASLt.
  CHECK_FALSE(
      bf16_gemv_fits(reinterpret_cast<const uint16_t*>(256), reinterpret_cast<const uint16_t*>(256), 9, 64, 64));
  CHECK_FALSE(
      bf16_gemv_fits(reinterpret_cast<const uint16_t*>(256), reinterpret_cast<const uint16_t*>(256), 1, 64, 48));
  CHECK_FALSE(
      bf16_gemv_fits(reinterpret_cast<const uint16_t*>(258), reinterpret_cast<const uint16_t*>(256), 1, 64, 64));
#endif
}

TEST_CASE("CUDA few-row BF16 projections: throughput at gpt-oss decode shapes (printed)", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  Context ctx(dz::test::pool_options(size_t(256) << 20));
  Bf16Gemm gemm(ctx);
  std::mt19937 rng(3);
  struct Shape {
    int m, n, k;
    const char* what;
  };
  for (Shape sh : {Shape{1, 5120, 2880, "qkv"}, Shape{1, 2880, 4096, "o_proj"}, Shape{8, 5120, 2880, "qkv x8"},
                   Shape{1, 201088, 2880, "lm_head"}}) {
    const auto x = random_bf16(size_t(sh.m) * sh.k, rng, 1.f), w = random_bf16(size_t(sh.n) * sh.k, rng, 0.05f);
    // Enough weight copies, used in turn, that they do not stay in the 50 MB L2 (as in a model's layers).
    const double bytes = 2.0 * sh.n * sh.k;
    const int copies = int(std::min(8.0, std::ceil(200e6 / bytes)));
    std::vector<std::unique_ptr<Buf<uint16_t>>> dw;
    for (int i = 0; i < copies; ++i) dw.push_back(std::make_unique<Buf<uint16_t>>(w));
    Buf<uint16_t> dx(x);
    Buf<float> dd(size_t(sh.m) * sh.n);
    for (bool small : {true, false}) {
      if (small && sh.n > Bf16Gemm::kSmallMaxN) continue;  // the LM head: cuBLASLt only
      gemm.set_small_m_kernel(false);
      auto call = [&](int i) {
        const uint16_t* wi = dw[size_t(i % copies)]->p;
        if (small)
          bf16_gemv(dx.p, wi, nullptr, dd.p, sh.m, sh.n, sh.k, 0.f, ctx.stream());
        else
          gemm.run(dx.p, wi, nullptr, dd.p, sh.m, sh.n, sh.k, 0.f, ctx.stream());
      };
      for (int i = 0; i < 3; ++i) call(i);
      cudaEvent_t e0, e1;
      DZ_CUDA_CHECK(cudaEventCreate(&e0));
      DZ_CUDA_CHECK(cudaEventCreate(&e1));
      const int reps = 50;
      DZ_CUDA_CHECK(cudaEventRecord(e0, ctx.stream()));
      for (int i = 0; i < reps; ++i) call(i);
      DZ_CUDA_CHECK(cudaEventRecord(e1, ctx.stream()));
      DZ_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      DZ_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      cudaEventDestroy(e0), cudaEventDestroy(e1);
      const double us = 1e3 * ms / reps;
      WARN("bf16 projection " << sh.what << " m=" << sh.m << " n=" << sh.n << " k=" << sh.k << ": "
                              << (small ? "few-row kernel" : "cuBLASLt") << " " << us << " us, "
                              << bytes / (us * 1e-6) / 1e12 << " TB/s of weights");
    }
  }
#endif
}

TEST_CASE("CUDA BF16 projection with the RMS norm inside: the bits of rms_norm then the projection", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  Context ctx(dz::test::pool_options(size_t(256) << 20));
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.5f, 1.5f);
  const float eps = 1e-5f;
  struct Shape {
    int m, n, k;
  };
  // gpt-oss's qkv projection at 1-4 rows, and a ragged one (n off 16, one K chunk per warp).
  for (Shape sh : {Shape{1, 5120, 2880}, Shape{2, 5120, 2880}, Shape{4, 5120, 2880}, Shape{3, 520, 64}}) {
    const int m = sh.m, n = sh.n, k = sh.k;
    INFO("m " << m << " n " << n << " k " << k);
    std::vector<float> x(static_cast<size_t>(m) * k), nw(static_cast<size_t>(k)), bias(static_cast<size_t>(n));
    for (auto& v : x) v = 4.f * nd(rng);
    for (auto& v : nw) v = ud(rng);
    for (auto& v : bias) v = nd(rng);
    const auto w = random_bf16(size_t(n) * k, rng, 0.05f);
    Buf<float> dx(x), dnw(nw), dbias(bias), d1(size_t(m) * n), d2(size_t(m) * n);
    Buf<uint16_t> dw(w), dxb(size_t(m) * k);
    REQUIRE(bf16_gemv_norm_fits(dx.p, dw.p, m, n, k));
    bf16_gemv_norm(dx.p, dnw.p, eps, dw.p, dbias.p, d1.p, m, n, k, ctx.stream());
    rms_norm(dx.p, nullptr, m, k, dnw.p, eps, nullptr, dxb.p, ctx.stream());
    bf16_gemv(dxb.p, dw.p, dbias.p, d2.p, m, n, k, 0.f, ctx.stream());
    ctx.sync();
    const auto a = d1.get(), b = d2.get();
    CHECK(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
    // And against float64 on the staged bf16 rows (the norm's own rounding is rms_norm's, tested elsewhere).
    const auto xb = dxb.get();
    double err = 0, scale = 0;
    for (int r = 0; r < m; ++r)
      for (int j = 0; j < n; j += 7) {
        double acc = bias[size_t(j)], mag = std::fabs(bias[size_t(j)]);
        for (int i = 0; i < k; ++i) {
          const double p = bf16_to_double(xb[size_t(r) * k + i]) * bf16_to_double(w[size_t(j) * k + i]);
          acc += p, mag += std::fabs(p);
        }
        err = std::max(err, std::fabs(a[size_t(r) * n + j] - acc));
        scale = std::max(scale, mag);
      }
    CHECK(err < 4e-6 * scale);
  }
  Buf<float> dx(std::vector<float>(64, 1.f));
  CHECK_FALSE(bf16_gemv_norm_fits(dx.p, reinterpret_cast<const uint16_t*>(256), 1, 512, 64));  // narrow n
  CHECK_FALSE(bf16_gemv_norm_fits(dx.p, reinterpret_cast<const uint16_t*>(256), 9, 5120, 64));
#endif
}
