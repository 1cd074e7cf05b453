// GPU tests of the decode step's small kernels ([cuda]; they skip with a
// message where no CUDA device is present): RMSNorm (register-resident rows and
// the strided fallback, row indirection, fp32 and bf16 outputs) and RoPE + KV
// store (bf16 K and V, rounded to nearest) against float64 on random inputs.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
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
