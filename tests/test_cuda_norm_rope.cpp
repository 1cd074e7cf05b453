// GPU tests of the decode step's small kernels ([cuda]; they skip with a
// message where no CUDA device is present): RMSNorm (register-resident rows and
// the strided fallback, row indirection, fp32 and bf16 outputs), RoPE + KV
// store (bf16 K and V, rounded to nearest), LayerNorm and SwiGLU (bf16 out)
// against float64 on random inputs.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#ifdef DZ_WITH_CUDA
#include "cuda/norm.h"
#include "cuda/rope.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#include "support/safetensors_writer.h"
#endif

#include "support/gpu.h"

TEST_CASE("CUDA rms_norm matches float64 (register rows and the strided fallback)", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.f, 1.f);
  // 2880: gpt-oss; 8192: the register path's largest; 8196 and 30: the fallback.
  for (int H : {2880, 64, 8192, 8196, 30}) {
    INFO("H " << H);
    const int R = 5, n = 3;
    std::vector<float> x(static_cast<size_t>(R) * H), w(static_cast<size_t>(H));
    for (auto& v : x) v = 3.f * nd(rng);
    for (auto& v : w) v = 1.f + 0.1f * nd(rng);
    const std::vector<int32_t> rows = {4, 0, 2};
    dz::test::DeviceBuffer<float> dx(x), dw(w), df(size_t(n) * H);
    dz::test::DeviceBuffer<int32_t> dr(rows);
    dz::test::DeviceBuffer<uint16_t> db(size_t(n) * H);
    const float eps = 1e-5f;
    dz::cuda::rms_norm(dx.p, dr.p, n, H, dw.p, eps, df.p, db.p, ctx.stream());
    ctx.sync();
    const auto f = df.get();
    const auto b = db.get();
    double worst = 0, worst_b = 0;
    for (int i = 0; i < n; ++i) {
      const float* xr = x.data() + size_t(rows[size_t(i)]) * H;
      double ss = 0;
      for (int k = 0; k < H; ++k) ss += double(xr[k]) * xr[k];
      const double inv = 1.0 / std::sqrt(ss / H + eps);
      for (int k = 0; k < H; ++k) {
        const double ref = w[size_t(k)] * xr[k] * inv;
        worst = std::max(worst, std::fabs(f[size_t(i) * H + k] - ref) / (std::fabs(ref) + 1e-3));
        worst_b = std::max(worst_b,
                           std::fabs(dz::test::bf16_to_double(b[size_t(i) * H + k]) - ref) / (std::fabs(ref) + 1e-3));
      }
    }
    INFO("worst relative error fp32 " << worst << ", bf16 " << worst_b);
    CHECK(worst < 1e-5);
    CHECK(worst_b < 5e-3);  // bf16 rounding: 2^-9
  }
#endif
}

TEST_CASE("CUDA RoPE + KV store matches float64", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(32);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ang(-3.14159f, 3.14159f);
  // gpt-oss-20b's heads (64 q, 8 kv, D 64) and a small odd one.
  for (auto [nh, nkv, D] : {std::tuple{64, 8, 64}, std::tuple{6, 2, 32}}) {
    INFO("heads " << nh << " kv " << nkv << " D " << D);
    const int R = 3, half = D / 2, stride = (nh + 2 * nkv) * D + 8;
    std::vector<float> qkv(static_cast<size_t>(R) * stride), cs(static_cast<size_t>(R) * half),
        sn(static_cast<size_t>(R) * half);
    for (auto& v : qkv) v = nd(rng);
    for (size_t i = 0; i < cs.size(); ++i) {
      const float a = ang(rng);
      cs[i] = 1.1f * std::cos(a), sn[i] = 1.1f * std::sin(a);  // an attention factor folded in, as YaRN does
    }
    // Rows' KV slots out of order inside a larger page buffer.
    const int slot = 2 * nkv * D * 2;  // bf16 K | V
    const std::vector<int64_t> off = {2 * int64_t(slot), 0, 4 * int64_t(slot)};
    dz::test::DeviceBuffer<float> dq(qkv), dc(cs), ds(sn);
    dz::test::DeviceBuffer<int64_t> doff(off);
    std::vector<uint8_t> kv0(size_t(5) * slot, 0);
    dz::test::DeviceBuffer<uint8_t> dkv(kv0);
    dz::cuda::rope_qk_store_kv(dq.p, R, stride, dc.p, ds.p, nh, nkv, D, dkv.p, doff.p, ctx.stream());
    ctx.sync();
    const auto q = dq.get();
    const auto kvb = dkv.get();
    double worst = 0, worst_kv = 0;  // q: absolute; K: in half-ulps of bf16 (rounded to nearest: <= 1)
    int untouched_bad = 0, v_bad = 0;
    auto rot = [&](const float* src, int r, int i, bool second) {
      const double c = cs[size_t(r) * half + i], s = sn[size_t(r) * half + i];
      return second ? double(src[i + half]) * c + double(src[i]) * s : double(src[i]) * c - double(src[i + half]) * s;
    };
    for (int r = 0; r < R; ++r) {
      const float* in = qkv.data() + size_t(r) * stride;
      const uint8_t* kvr = kvb.data() + off[size_t(r)];
      auto kv_at = [&](int i) {
        uint16_t b;
        std::memcpy(&b, kvr + 2 * i, 2);
        return b;
      };
      for (int h = 0; h < nh + nkv; ++h)
        for (int i = 0; i < D; ++i) {
          const double ref = rot(in + h * D, r, i % half, i >= half);
          if (h < nh) {
            worst = std::max(worst, std::fabs(q[size_t(r) * stride + h * D + i] - ref));
          } else {
            const double got = dz::test::bf16_to_double(kv_at((h - nh) * D + i));
            const double half_ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(ref), 1e-30)) - 8);
            worst_kv = std::max(worst_kv, std::fabs(got - ref) / (half_ulp + 1e-6));  // + the fp32 rotation
          }
        }
      for (int i = 0; i < nkv * D; ++i) v_bad += kv_at(nkv * D + i) != dz::test::f32_to_bf16(in[(nh + nkv) * D + i]);
      // k and v inside qkv, and its padding, stay as they were.
      for (int i = nh * D; i < stride; ++i) untouched_bad += q[size_t(r) * stride + i] != in[i];
    }
    CHECK(worst < 1e-5);
    CHECK(worst_kv <= 1.0);
    CHECK(v_bad == 0);
    CHECK(untouched_bad == 0);
  }
#endif
}

TEST_CASE("CUDA layer_norm matches float64 (with and without w and b, in place and not)", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(33);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.5f, 2.f);
  const float eps = 1e-6f;
  // 128: DeepSeek-V3.2's indexer keys; 7168: its hidden size; 8192: the largest.
  for (int dim : {64, 128, 1000, 7168, 8192})
    for (bool affine : {true, false})
      for (bool in_place : {false, true}) {
        INFO("dim " << dim << " affine " << affine << " in place " << in_place);
        const int R = 6;
        // Rows with an offset and a scale of their own (the two-pass variance).
        std::vector<float> x(static_cast<size_t>(R) * dim), w(static_cast<size_t>(dim)), b(static_cast<size_t>(dim));
        for (int r = 0; r < R; ++r) {
          const float off = nd(rng), sc = ud(rng);
          for (int i = 0; i < dim; ++i) x[size_t(r) * dim + i] = off + sc * nd(rng);
        }
        for (auto& v : w) v = 1.f + 0.2f * nd(rng);
        for (auto& v : b) v = 0.2f * nd(rng);
        dz::test::DeviceBuffer<float> dx(x), dw(w), db(b), dy(size_t(R) * dim);
        dz::cuda::layer_norm(dx.p, R, dim, affine ? dw.p : nullptr, affine ? db.p : nullptr, eps,
                             in_place ? dx.p : dy.p, ctx.stream());
        ctx.sync();
        const auto y = in_place ? dx.get() : dy.get();
        if (!in_place) CHECK(dx.get() == x);  // the input stays as it was
        // Error relative to the size of the row's terms: |w| * max(|v|, 1) + |b|
        // (v the normalized value; the fp32 mean's rounding is absolute in v).
        double worst = 0;
        for (int r = 0; r < R; ++r) {
          const float* xr = x.data() + size_t(r) * dim;
          double mean = 0, var = 0;
          for (int i = 0; i < dim; ++i) mean += xr[i];
          mean /= dim;
          for (int i = 0; i < dim; ++i) var += (xr[i] - mean) * (xr[i] - mean);
          const double inv = 1.0 / std::sqrt(var / dim + eps);
          for (int i = 0; i < dim; ++i) {
            const double v = (xr[i] - mean) * inv;
            const double wi = affine ? w[size_t(i)] : 1.0, bi = affine ? b[size_t(i)] : 0.0;
            const double ref = wi * v + bi;
            const double scale = std::fabs(wi) * std::max(std::fabs(v), 1.0) + std::fabs(bi);
            worst = std::max(worst, std::fabs(y[size_t(r) * dim + i] - ref) / scale);
          }
        }
        INFO("worst relative error " << worst);
        CHECK(worst < 1e-5);
      }
  CHECK_THROWS(dz::cuda::layer_norm(nullptr, 1, 8193, nullptr, nullptr, eps, nullptr, ctx.stream()));
#endif
}

TEST_CASE("CUDA silu_mul (SwiGLU to bf16) matches float64 within bf16 rounding", "[cuda]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::Context ctx(dz::test::pool_options(size_t(64) << 20));
  std::mt19937 rng(34);
  std::normal_distribution<float> nd(0.f, 1.f);
  // bf16 bits in a monotone integer order (-0 and +0 together): ulps apart.
  auto key = [](uint16_t v) { return v & 0x8000 ? -int(v & 0x7fff) : int(v & 0x7fff); };
  // 18432: DeepSeek-V3's dense intermediate size; 70000 rows: more than one
  // grid's rows (65535).
  for (auto [R, inter] :
       {std::tuple{5, 1}, std::tuple{7, 100}, std::tuple{3, 2048}, std::tuple{2, 18432}, std::tuple{70000, 3}}) {
    INFO("rows " << R << " inter " << inter);
    const int64_t ld = 2 * int64_t(inter) + 3;  // rows padded: ld is not 2 * inter
    std::vector<float> gu(size_t(R) * size_t(ld));
    for (size_t i = 0; i < gu.size(); ++i) gu[i] = (i % size_t(ld)) < size_t(inter) ? 3.f * nd(rng) : 2.f * nd(rng);
    dz::test::DeviceBuffer<float> dgu(gu);
    dz::test::DeviceBuffer<uint16_t> dout(size_t(R) * inter);
    dz::cuda::silu_mul(dgu.p, R, inter, ld, dout.p, ctx.stream());
    ctx.sync();
    const auto out = dout.get();
    int worst_ulps = 0;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < inter; ++j) {
        const double g = gu[size_t(r) * ld + j], u = gu[size_t(r) * ld + inter + j];
        const double ref = g / (1.0 + std::exp(-g)) * u;
        worst_ulps =
            std::max(worst_ulps, std::abs(key(out[size_t(r) * inter + j]) - key(dz::test::f32_to_bf16(float(ref)))));
      }
    INFO("worst distance from float64 rounded to bf16: " << worst_ulps << " ulps");
    CHECK(worst_ulps <= 1);
  }
#endif
}
