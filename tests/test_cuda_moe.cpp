// GPU tests of the MXFP4 expert pipeline ([cuda]; they skip with a message
// where no CUDA device is present, e.g. CI, but always compile there):
// folding bit-exact against the CPU reference, the FP8 1x128 GEMM and both MoE
// paths against float64 references, runtime error mapping and the pool.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "common/error.h"
#include "cpu/mxfp4_fold.h"
#include "runtime/device.h"

#ifdef DZ_WITH_CUDA
#include "cuda/fp8_gemm.h"
#include "cuda/fp8_grouped_gemm.h"
#include "cuda/moe.h"
#include "cuda/moe_one_token.h"
#include "cuda/mxfp4_fold.h"
#include "cuda/mxfp4_gemm.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#include "support/device_buffer.h"
#include "support/safetensors_writer.h"
#endif

#include "support/gpu.h"

using namespace dz;

namespace {
using dz::test::have_gpu;

// 1 - 2 sum(xy) / sum(x^2 + y^2): 0 for equal vectors.
double diff_metric(const std::vector<double>& x, const std::vector<double>& y) {
  double xy = 0, xx = 0;
  for (size_t i = 0; i < x.size(); ++i) xy += x[i] * y[i], xx += x[i] * x[i] + y[i] * y[i];
  return 1.0 - 2.0 * xy / xx;
}

struct Mx {
  std::vector<uint8_t> blocks, scales;
  int64_t rows, k;
  cpu::Mxfp4View view(int64_t expert = 0) const {
    return {blocks.data() + expert * rows * k / 2, scales.data() + expert * rows * k / 32, rows, k, "test"};
  }
};
Mx random_mx(int64_t n_mats, int64_t rows, int64_t k, std::mt19937& rng, int s_lo, int s_hi) {
  Mx m{std::vector<uint8_t>(size_t(n_mats * rows * k / 2)), std::vector<uint8_t>(size_t(n_mats * rows * k / 32)), rows,
       k};
  std::uniform_int_distribution<int> byte(0, 255), sc(s_lo, s_hi);
  for (auto& b : m.blocks) b = uint8_t(byte(rng));
  for (auto& s : m.scales) s = uint8_t(sc(rng));
  return m;
}
}  // namespace

#ifdef DZ_WITH_CUDA
namespace {
using namespace dz::cuda;

template <typename T>
using Dev = dz::test::DeviceBuffer<T>;

ContextOptions small_ctx() { return dz::test::pool_options(size_t(2) << 30); }

using dz::test::bf16_to_double;
using dz::test::f32_to_bf16;
}  // namespace
#endif

TEST_CASE("CUDA MXFP4 -> FP8 folding is bit-exact with the CPU reference", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  std::mt19937 rng(2024);
  // (rows, k, scale range): realistic, extreme spreads over the whole byte range
  // (0-scale bytes included), and gpt-oss-120b's K = 2880 (pads to 2944).
  struct Case {
    int64_t rows, k;
    int lo, hi;
  } cases[] = {{64, 320, 110, 125}, {48, 256, 0, 254}, {32, 2880, 0, 20}, {40, 96, 100, 140}};
  for (const auto& c : cases) {
    INFO("rows " << c.rows << " k " << c.k << " scales " << c.lo << ".." << c.hi);
    const int E = 3;
    Mx m = random_mx(E, c.rows, c.k, rng, c.lo, c.hi);
    // Zero sub-blocks (some with large scales, some of -0 nibbles), and 0-scale bytes.
    std::uniform_int_distribution<int64_t> pick(0, int64_t(m.scales.size()) - 1);
    for (int i = 0; i < int(m.scales.size() / 8); ++i) {
      const int64_t sb = pick(rng);
      for (int j = 0; j < 16; ++j) m.blocks[size_t(sb * 16 + j)] = (i & 1) ? 0x88 : 0x00;
      m.scales[size_t(sb)] = uint8_t(i % 3 == 0 ? 254 : 0);
    }
    for (int i = 0; i < int(m.scales.size() / 16); ++i) m.scales[size_t(pick(rng))] = 0;
    const int64_t kpad = cpu::fold_kpad(c.k), per = c.rows * kpad, per_s = c.rows * kpad / 128;
    Dev<uint8_t> db(m.blocks), ds(m.scales);
    Dev<uint8_t> q(size_t(2 * per));
    Dev<float> qs(size_t(2 * per_s));
    cudaStream_t st = nullptr;
    const int ids[2] = {2, 0};  // slot 0 <- expert 2, slot 1 <- expert 0
    mxfp4_fold_experts(Mxfp4Stack{db.p, ds.p, c.rows, c.k}, ids, 2, Fp8Slots{q.p, qs.p}, st);
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
    const auto gq = q.get();
    const auto gs = qs.get();
    cpu::FoldStats total;
    for (int slot = 0; slot < 2; ++slot) {
      std::vector<uint8_t> rq{};
      rq.resize(size_t(per));
      std::vector<float> rs{};
      rs.resize(size_t(per_s));
      cpu::FoldStats st1;
      cpu::mxfp4_fold_1x128(m.view(ids[slot]), rq.data(), rs.data(), &st1);
      size_t bad_q = 0, bad_s = 0;
      for (int64_t i = 0; i < per; ++i) bad_q += gq[size_t(slot * per + i)] != rq[size_t(i)];
      for (int64_t i = 0; i < per_s; ++i) bad_s += std::memcmp(&gs[size_t(slot * per_s + i)], &rs[size_t(i)], 4) != 0;
      CHECK(bad_q == 0);
      CHECK(bad_s == 0);
    }
    for (int e = 0; e < E; ++e) total.merge(cpu::mxfp4_fold_check(m.view(e)));
    uint64_t nan = 0;
    const cpu::FoldStats dev = mxfp4_fold_check_device(Mxfp4Stack{db.p, ds.p, c.rows, c.k}, E, &nan, st);
    CHECK(nan == 0);
    CHECK(dev.groups == total.groups);
    CHECK(dev.lossy_groups == total.lossy_groups);
    CHECK(dev.zero_groups == total.zero_groups);
    CHECK(dev.max_spread == total.max_spread);
    if (c.hi - c.lo > 14) CHECK(total.lossy_groups > 0);
    if (c.hi - c.lo <= 14) CHECK(total.lossy_groups == 0);
  }
#endif
}

TEST_CASE("CUDA MXFP4 -> FP8 folding by 64-row groups: table, bytes and scales bit-exact with the CPU", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  std::mt19937 rng(2025);
  // (rows, k, scale range): exact groups, gpt-oss-120b's K, and spreads past 14 (lossy groups).
  struct Case {
    int64_t rows, k;
    int lo, hi;
  } cases[] = {{128, 320, 110, 124}, {64, 2880, 100, 110}, {192, 256, 0, 254}};
  for (const auto& c : cases) {
    INFO("rows " << c.rows << " k " << c.k << " scales " << c.lo << ".." << c.hi);
    const int E = 3;
    Mx m = random_mx(E, c.rows, c.k, rng, c.lo, c.hi);
    std::uniform_int_distribution<int64_t> pick(0, int64_t(m.scales.size()) - 1);
    for (int i = 0; i < int(m.scales.size() / 8); ++i) {  // zero sub-blocks, some with large scales
      const int64_t sb = pick(rng);
      for (int j = 0; j < 16; ++j) m.blocks[size_t(sb * 16 + j)] = (i & 1) ? 0x88 : 0x00;
      m.scales[size_t(sb)] = uint8_t(i % 3 == 0 ? 254 : c.lo);
    }
    // One whole 64-row group of expert 1 zero in its first K group.
    const int64_t nsub = c.k / 32;
    for (int64_t r = 0; r < 64; ++r)
      for (int j = 0; j < 4 && j < nsub; ++j) std::memset(&m.blocks[size_t(((c.rows + r) * nsub + j) * 16)], 0, 16);
    const int64_t kpad = cpu::fold_kpad(c.k), ng = kpad / 128, rg = c.rows / 64;
    Dev<uint8_t> db(m.blocks), ds(m.scales), dg(size_t(E * rg * ng));
    cudaStream_t st = nullptr;
    const cpu::FoldStats dev = mxfp4_group_table(Mxfp4Stack{db.p, ds.p, c.rows, c.k}, E, dg.p, st);
    cpu::FoldStats cpu_st;
    for (int e = 0; e < E; ++e) cpu_st.merge(cpu::mxfp4_fold_check(m.view(e), 64));
    CHECK(dev.groups == cpu_st.groups);
    CHECK(dev.lossy_groups == cpu_st.lossy_groups);
    CHECK(dev.zero_groups == cpu_st.zero_groups);
    CHECK(dev.zero_groups >= 1);
    CHECK(dev.max_spread == cpu_st.max_spread);
    if (c.hi - c.lo <= 14) CHECK(dev.lossy_groups == 0);
    if (c.hi - c.lo > 14) CHECK(dev.lossy_groups > 0);
    // The folds with the table against the CPU fold by 64-row groups (lossy groups too: the same rule).
    const int64_t per = c.rows * kpad, per_s = rg * ng;
    Dev<uint8_t> q(size_t(2 * per));
    Dev<float> qs(size_t(2 * per_s));
    const int ids[2] = {1, 2};
    const Mxfp4Stack stack{db.p, ds.p, c.rows, c.k, dg.p};
    CHECK(fold_scale_count(stack) == per_s);
    mxfp4_fold_experts(stack, ids, 2, Fp8Slots{q.p, qs.p}, st);
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
    const auto gq = q.get();
    const auto gs = qs.get();
    for (int slot = 0; slot < 2; ++slot) {
      std::vector<uint8_t> rq(static_cast<size_t>(per));
      std::vector<float> rs(static_cast<size_t>(per_s));
      cpu::mxfp4_fold(m.view(ids[slot]), 64, rq.data(), rs.data(), nullptr);
      size_t bad_q = 0, bad_s = 0;
      for (int64_t i = 0; i < per; ++i) bad_q += gq[size_t(slot * per + i)] != rq[size_t(i)];
      for (int64_t i = 0; i < per_s; ++i) bad_s += std::memcmp(&gs[size_t(slot * per_s + i)], &rs[size_t(i)], 4) != 0;
      INFO("slot " << slot << " (expert " << ids[slot] << ")");
      CHECK(bad_q == 0);
      CHECK(bad_s == 0);
    }
  }
  // Rows that do not split into groups of 64 are refused.
  Dev<uint8_t> b(size_t(96 * 64 / 2)), sc(size_t(96 * 2)), t(16);
  CHECK_THROWS_AS(mxfp4_group_table(Mxfp4Stack{b.p, sc.p, 96, 64}, 1, t.p, nullptr), Error);
#endif
}

TEST_CASE("CUDA FP8 1x128 GEMM through cuBLASLt matches float64", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  Context ctx(small_ctx());
  Fp8Gemm gemm(ctx);
  std::mt19937 rng(99);
  const int M = 52, N = 96, K = 320;  // K pads to 384: 3 scale blocks
  const int64_t kpad = cpu::fold_kpad(K);
  Mx w = random_mx(1, N, K, rng, 115, 125);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(M) * K);
  for (int r = 0; r < M; ++r)  // rows of very different magnitudes: per-row scales matter
    for (int c = 0; c < K; ++c) x[size_t(r * K + c)] = nd(rng) * std::ldexp(1.f, (r % 7) - 3) * (c < 128 ? 4.f : 1.f);
  Dev<float> dx(x);
  Dev<uint8_t> db(w.blocks), ds(w.scales), wq(size_t(N * kpad)), xq(size_t(M * kpad));
  Dev<float> wqs(size_t(N * kpad / 128)), xqs(size_t(M * kpad / 128));
  Dev<uint16_t> d(size_t(M * N));
  const int id0 = 0;
  mxfp4_fold_experts(Mxfp4Stack{db.p, ds.p, N, K}, &id0, 1, Fp8Slots{wq.p, wqs.p}, ctx.stream());
  quantize_1x128(dx.p, K, M, K, int(kpad), xq.p, xqs.p, ctx.stream());
  gemm.run(xq.p, xqs.p, wq.p, wqs.p, d.p, M, N, int(kpad), ctx.stream());
  ctx.sync();
  const auto got = d.get();
  const auto hxq = xq.get();
  const auto hxs = xqs.get();
  const auto hwq = wq.get();
  const auto hws = wqs.get();
  std::vector<double> out(size_t(M * N)), ref(size_t(M * N)), refq(size_t(M * N));
  for (int r = 0; r < M; ++r)
    for (int n = 0; n < N; ++n) {
      double s = 0, sq = 0;
      for (int c = 0; c < K; ++c) s += double(x[size_t(r * K + c)]) * cpu::mxfp4_value(w.view(), n, c);
      for (int c = 0; c < kpad; ++c)
        sq += cpu::e4m3_to_double(hxq[size_t(r * kpad + c)]) * hxs[size_t((c / 128) * M + r)] *
              cpu::e4m3_to_double(hwq[size_t(n * kpad + c)]) * hws[size_t((c / 128) * N + n)];
      ref[size_t(r * N + n)] = s;
      refq[size_t(r * N + n)] = sq;
      out[size_t(r * N + n)] = bf16_to_double(got[size_t(r * N + n)]);
    }
  const double d_exact = diff_metric(out, refq), d_ref = diff_metric(out, ref);
  INFO("diff vs product of the quantized operands " << d_exact << ", vs float64 of the originals " << d_ref);
  CHECK(d_exact < 1e-4);  // only bf16 output rounding: checks the scale layouts
  CHECK(d_ref < 1e-2);    // one FP4 operand
  // Relative error per row: catches a row scaled by the wrong block scale.
  for (int r = 0; r < M; ++r) {
    double e2 = 0, n2 = 0;
    for (int n = 0; n < N; ++n) {
      const double dd = out[size_t(r * N + n)] - refq[size_t(r * N + n)];
      e2 += dd * dd, n2 += refq[size_t(r * N + n)] * refq[size_t(r * N + n)];
    }
    CHECK(std::sqrt(e2 / n2) < 1e-2);
  }
  CHECK_THROWS_AS(gemm.run(xq.p, xqs.p, wq.p, wqs.p, d.p, M, N, 100, ctx.stream()), Error);
#endif
}

#ifdef DZ_WITH_CUDA
namespace {
// Random gpt-oss-style MoE layer and a float64 reference of it.
struct MoeCase {
  int E, topk, H, I, T;
  Mx w1, w2;
  std::vector<uint16_t> b1, b2;
  std::vector<float> x, gw;
  std::vector<int> ids;
};
// Scale bytes uniform in [s_lo, s_hi].
MoeCase make_moe(int E, int topk, int H, int I, int T, std::mt19937& rng, int s_lo = 118, int s_hi = 124) {
  MoeCase c{E,  topk, H,  I,  T, random_mx(E, 2 * I, H, rng, s_lo, s_hi), random_mx(E, H, I, rng, s_lo, s_hi),
            {}, {},   {}, {}, {}};
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int i = 0; i < E * 2 * I; ++i) c.b1.push_back(f32_to_bf16(0.5f * nd(rng)));
  for (int i = 0; i < E * H; ++i) c.b2.push_back(f32_to_bf16(0.5f * nd(rng)));
  for (int i = 0; i < T * H; ++i) c.x.push_back(nd(rng) * 3.f);
  std::uniform_int_distribution<int> pe(0, E - 1);
  for (int t = 0; t < T; ++t) {
    // Distinct experts; every 5th token starts with expert t % 3 so a few
    // experts get more than 8 tokens (the fused kernel's token chunks).
    std::vector<int> chosen;
    if (t % 5 == 0) chosen.push_back(t % 3);
    while (int(chosen.size()) < topk) {
      const int e = pe(rng);
      bool dup = false;
      for (int q : chosen) dup |= q == e;
      if (!dup) chosen.push_back(e);
    }
    float sum = 0;
    std::vector<float> wv;
    for (int k = 0; k < topk; ++k) wv.push_back(std::exp(nd(rng))), sum += wv.back();
    for (int k = 0; k < topk; ++k) c.ids.push_back(chosen[size_t(k)]), c.gw.push_back(wv[size_t(k)] / sum);
  }
  return c;
}
// A case on the device, with an output of T x H floats and the weights as the layer takes them.
struct DevMoe {
  Dev<uint8_t> w1b, w1s, w2b, w2s;
  Dev<uint16_t> b1, b2;
  Dev<float> x, gw, out;
  Dev<int> ids;
  MoeWeights w;
  explicit DevMoe(const MoeCase& c)
      : w1b(c.w1.blocks),
        w1s(c.w1.scales),
        w2b(c.w2.blocks),
        w2s(c.w2.scales),
        b1(c.b1),
        b2(c.b2),
        x(c.x),
        gw(c.gw),
        out(size_t(c.T * c.H)),
        ids(c.ids),
        w{w1b.p, w1s.p, b1.p, w2b.p, w2s.p, b2.p} {}
};
// Small test layers: the fused path up to 8 tokens per expert, FP8 workspace
// tiles of 3 experts.
// (One token on the per-projection kernels, as by default: the stream has its own case.)
MoeOptions small_options() {
  MoeOptions o;
  o.fused_max_tokens_per_expert = 8.0, o.tile_experts = 3;
  o.fused_one_token_stream = false;
  return o;
}
// The same on the fused path's W4A16 kernels (fp16 activations: the tight
// bounds; the default, stated).
MoeOptions w4a16_options() {
  MoeOptions o = small_options();
  o.fused_w4a8 = false;
  return o;
}
#ifdef DZ_WITH_CUDA
// Both projections' tables (make: mxfp4_group_table or mxfp4_whole_k_table)
// into t1 / t2; every group must fold exactly.
template <typename Make>
void exact_tables(Make make, const uint8_t* w1b, const uint8_t* w1s, const uint8_t* w2b, const uint8_t* w2s, int E,
                  int H, int I, uint8_t* t1, uint8_t* t2, cudaStream_t s) {
  const cpu::FoldStats f1 = make(Mxfp4Stack{w1b, w1s, 2 * I, H}, E, t1, s);
  const cpu::FoldStats f2 = make(Mxfp4Stack{w2b, w2s, H, I}, E, t2, s);
  REQUIRE(f1.lossy_groups + f2.lossy_groups == 0);
}
#endif

// Every value finite (checked), and the diff metric against ref.
double finite_diff(const std::vector<float>& got, const std::vector<double>& ref) {
  const std::vector<double> g(got.begin(), got.end());
  bool finite = true;
  for (double v : g) finite &= std::isfinite(v);
  CHECK(finite);
  return diff_metric(g, ref);
}
// The fused path's forward captured as a CUDA graph and replayed once (as a
// decode step runs it), into out (filled with NaNs first); its values.
std::vector<float> fused_in_graph(MoeLayer& layer, const MoeWeights& w, const float* x, const int* ids, const float* gw,
                                  int T, Dev<float>& out, Context& ctx) {
  DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  DZ_CUDA_CHECK(cudaStreamBeginCapture(ctx.stream(), cudaStreamCaptureModeThreadLocal));
  layer.forward(w, x, ids, gw, T, out.p, MoePath::kFused);
  DZ_CUDA_CHECK(cudaStreamEndCapture(ctx.stream(), &g));
  DZ_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
  DZ_CUDA_CHECK(cudaGraphLaunch(ge, ctx.stream()));
  ctx.sync();
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return out.get();
}
// act: gpt-oss's clamped SwiGLU, or (MoeActivation::kSilu) the plain one,
// silu(gate) * up; gate / up rows interleaved either way. Empty b1 / b2: no
// biases (null on the device).
// limit > 0 (kSilu): DeepSeek-V4's clamp first, gate <= limit and |up| <= limit.
std::vector<double> moe_ref(const MoeCase& c, MoeActivation act_kind = MoeActivation::kGptOss, double limit = 0) {
  std::vector<double> out(size_t(c.T * c.H), 0.0);
  std::vector<double> act(size_t(c.I));
  for (int t = 0; t < c.T; ++t)
    for (int k = 0; k < c.topk; ++k) {
      const int e = c.ids[size_t(t * c.topk + k)];
      const auto v1 = c.w1.view(e), v2 = c.w2.view(e);
      for (int j = 0; j < c.I; ++j) {
        double g = c.b1.empty() ? 0.0 : bf16_to_double(c.b1[size_t(e * 2 * c.I + 2 * j)]),
               u = c.b1.empty() ? 0.0 : bf16_to_double(c.b1[size_t(e * 2 * c.I + 2 * j + 1)]);
        for (int h = 0; h < c.H; ++h) {
          g += cpu::mxfp4_value(v1, 2 * j, h) * c.x[size_t(t * c.H + h)];
          u += cpu::mxfp4_value(v1, 2 * j + 1, h) * c.x[size_t(t * c.H + h)];
        }
        if (act_kind == MoeActivation::kSilu) {
          if (limit > 0) g = std::min(g, limit), u = std::max(-limit, std::min(u, limit));
          act[size_t(j)] = g / (1.0 + std::exp(-g)) * u;
          continue;
        }
        g = std::min(g, 7.0);
        u = std::max(-7.0, std::min(u, 7.0));
        act[size_t(j)] = (u + 1.0) * g / (1.0 + std::exp(-1.702 * g));
      }
      for (int n = 0; n < c.H; ++n) {
        double y = c.b2.empty() ? 0.0 : bf16_to_double(c.b2[size_t(e * c.H + n)]);
        for (int j = 0; j < c.I; ++j) y += cpu::mxfp4_value(v2, n, j) * act[size_t(j)];
        out[size_t(t * c.H + n)] += double(c.gw[size_t(t * c.topk + k)]) * y;
      }
    }
  return out;
}
}  // namespace
#endif

TEST_CASE("CUDA MoE layer: fused W4A16 and FP8 paths match float64 and are deterministic", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  Context ctx(small_ctx());
  std::mt19937 rng(5);
  // H = 320 and I = 192 are not multiples of 128 (padding); 2I = 384 rows.
  // 1100 tokens: 4400 routed slots, sorted by the multi-block routing.
  for (int T : {1, 5, 40, 1100}) {
    MoeCase c = make_moe(8, 4, 320, 192, T, rng);
    INFO("T = " << T);
    MoeLayer layer(ctx, MoeShape{c.E, c.topk, c.H, c.I}, std::max(64, T), w4a16_options());
    DevMoe dm(c);
    auto& [w1b, w1s, w2b, w2s, b1, b2, x, gw, out, ids, w] = dm;
    const auto ref = moe_ref(c);
    for (MoePath path : {MoePath::kFused, MoePath::kFp8}) {
      INFO((path == MoePath::kFused ? "fused W4A16 path" : "FP8 path"));
      DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));  // poison: every element must be written
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, path);
      ctx.sync();
      const auto got = out.get();
      const double d = finite_diff(got, ref);
      INFO("diff " << d);
      CHECK(d < 1e-2);
      if (path == MoePath::kFused) CHECK(d < 2e-4);  // fp16 activations, exact weights
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, path);
      ctx.sync();
      CHECK(std::memcmp(out.get().data(), got.data(), got.size() * sizeof(float)) == 0);
    }
    // The FP8 path with grouped GEMMs (one launch per projection, the experts
    // folded inside): the same reference, and the cuBLASLt path's output to rounding.
    if (Fp8GroupedGemm::supported()) {
      layer.options().fp8_gemm = 1;
      DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
      ctx.sync();
      const auto lt = out.get();
      // The FP8 path's output with weights ww (out filled with NaNs first).
      auto fp8_out = [&](const MoeWeights& ww) {
        DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
        layer.forward(ww, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
        ctx.sync();
        return out.get();
      };
      layer.options().fp8_gemm = 2;
      const auto got = fp8_out(w);
      const double d = finite_diff(got, ref), d_lt = diff_metric(std::vector<double>(got.begin(), got.end()),
                                                                 std::vector<double>(lt.begin(), lt.end()));
      INFO("FP8 path, grouped GEMMs: diff " << d << ", vs the cuBLASLt FP8 path " << d_lt);
      CHECK(d < 1e-2);
      CHECK(d_lt < 1e-4);
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
      ctx.sync();
      CHECK(std::memcmp(out.get().data(), got.data(), got.size() * sizeof(float)) == 0);
      // Folding into the FP8 workspace first (tiles of 3 experts) instead of
      // inside the GEMMs: the same FP8 operands, so the same bits.
      // Both tile widths there (128: the narrow GEMMs beside the next tile's
      // folding, the last tile at 192).
      layer.options().fp8_fold_in_gemm = false;
      for (int tile_n : {128, 192}) {
        layer.options().fp8_ws_tile_n = tile_n;
        DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
        layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
        ctx.sync();
        INFO("workspace tiles " << tile_n << " columns wide");
        CHECK(std::memcmp(out.get().data(), got.data(), got.size() * sizeof(float)) == 0);
      }
      layer.options().fp8_ws_tile_n = MoeOptions{}.fp8_ws_tile_n;
      layer.options().fp8_fold_in_gemm = true;
      layer.options().fp8_gemm = 0;
      // Auto above fp8_grouped_max_tokens_per_expert: the same kernels on the workspace.
      const double tpe_max = layer.options().fp8_grouped_max_tokens_per_expert;
      layer.options().fp8_grouped_max_tokens_per_expert = 0;
      DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
      ctx.sync();
      CHECK(std::memcmp(out.get().data(), got.data(), got.size() * sizeof(float)) == 0);
      // Weight scales by 64-row groups (the weights' group tables given, every
      // group exact here), folding inside and on the workspace: the same bits.
      const int64_t kph = cpu::fold_kpad(c.H), kpi = cpu::fold_kpad(c.I);
      Dev<uint8_t> g1(size_t(c.E * (2 * c.I / 64) * (kph / 128))), g2(size_t(c.E * (c.H / 64) * (kpi / 128)));
      exact_tables(mxfp4_group_table, w1b.p, w1s.p, w2b.p, w2s.p, c.E, c.H, c.I, g1.p, g2.p, ctx.stream());
      layer.options().fp8_mxfp4_gemm = -1;      // the grouped kernels (below: the MXFP4 GEMM)
      for (int which = 1; which <= 3; ++which)  // gate_up's table, down's, both
        for (double tpe : {tpe_max, 0.0}) {
          INFO("group scales for " << (which == 3   ? "both projections"
                                       : which == 1 ? "gate_up"
                                                    : "down")
                                   << ", " << (tpe > 0 ? "folding inside" : "on the workspace"));
          MoeWeights wg = w;
          if (which & 1) wg.w1_gmax = g1.p;
          if (which & 2) wg.w2_gmax = g2.p;
          layer.options().fp8_grouped_max_tokens_per_expert = tpe;
          DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
          layer.forward(wg, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
          ctx.sync();
          CHECK(std::memcmp(out.get().data(), got.data(), got.size() * sizeof(float)) == 0);
        }
      layer.options().fp8_grouped_max_tokens_per_expert = tpe_max;
      layer.options().fp8_mxfp4_gemm = 1;
      // Both tables: the MXFP4 GEMM (weights decoded in registers; the same
      // folded products, summed in another order): the reference, the grouped
      // path's output to rounding, deterministic, every tile width.
      if (Mxfp4Gemm::supported()) {
        MoeWeights wg = w;
        wg.w1_gmax = g1.p, wg.w2_gmax = g2.p;
        std::vector<float> first;
        for (int tile : {0, 64, 128, 160}) {
          layer.options().fp8_mxfp4_tile_tokens = tile;
          DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
          layer.forward(wg, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
          ctx.sync();
          const auto mg = out.get();
          const double dm = finite_diff(mg, ref), dg = diff_metric(std::vector<double>(mg.begin(), mg.end()),
                                                                   std::vector<double>(got.begin(), got.end()));
          INFO("MXFP4 GEMM, tile tokens " << tile << ": diff " << dm << ", vs the grouped FP8 path " << dg);
          CHECK(dm < 1e-2);
          CHECK(dg < 1e-4);
          layer.forward(wg, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
          ctx.sync();
          CHECK(std::memcmp(out.get().data(), mg.data(), mg.size() * sizeof(float)) == 0);
        }
        layer.options().fp8_mxfp4_tile_tokens = 0;
        layer.options().fp8_mxfp4_gemm = 0;
      }
      // Whole-K scales (one scale a row of the activations, one a 64-row
      // group of each expert over all of K, no promotion a K block): the
      // reference as closely as the other FP8 paths, near the grouped path,
      // deterministic.
      if (Mxfp4Gemm::supported() && c.H % 64 == 0 && c.I % 64 == 0) {
        Dev<uint8_t> k1(size_t(c.E * (2 * c.I / 64))), k2(size_t(c.E * (c.H / 64)));
        exact_tables(mxfp4_whole_k_table, w1b.p, w1s.p, w2b.p, w2s.p, c.E, c.H, c.I, k1.p, k2.p, ctx.stream());
        MoeWeights wk = w;
        wk.w1_gk = k1.p, wk.w2_gk = k2.p;
        layer.options().fp8_whole_k = 1;
        const auto wh = fp8_out(wk);
        const double dm = finite_diff(wh, ref), dg = diff_metric(std::vector<double>(wh.begin(), wh.end()),
                                                                 std::vector<double>(got.begin(), got.end()));
        WARN("MoE FP8 path, MXFP4 GEMM with whole-K scales, T " << c.T << ": diff " << dm << " vs float64 (grouped "
                                                                << d << "), " << dg << " vs the grouped FP8 path");
        CHECK(dm < 1e-2);
        CHECK(dg < 2e-3);
        layer.forward(wk, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
        ctx.sync();
        CHECK(std::memcmp(out.get().data(), wh.data(), wh.size() * sizeof(float)) == 0);
        // SwiGLU's quantization as a pass between the projections (amax / 448
        // a row) instead of gate_up's epilogue under the fixed scale: as close.
        layer.options().fp8_whole_k_glu = false;
        const auto wp = fp8_out(wk);
        layer.options().fp8_whole_k_glu = true;
        const double dp = finite_diff(wp, ref), dpe = diff_metric(std::vector<double>(wp.begin(), wp.end()),
                                                                  std::vector<double>(wh.begin(), wh.end()));
        WARN("  the same with SwiGLU's quantization as a pass: diff " << dp << " vs float64, " << dpe
                                                                      << " vs the epilogue's");
        CHECK(dp < 1e-2);
        CHECK(dpe < 2e-3);
        // Without the tables the option falls back to the other kernels.
        layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFp8);
        ctx.sync();
        CHECK(std::memcmp(out.get().data(), got.data(), got.size() * sizeof(float)) == 0);
        layer.options().fp8_whole_k = 0;
      }
    } else {
      WARN("grouped FP8 GEMM not supported here (needs sm_90 and an sm_90a build): FP8 grouped path not tested");
    }
    // Every fused-kernel variant (K split over 1, 4 or 8 warps, PDL on/off), also inside a CUDA graph.
    for (int ks : {1, 4, 8})
      for (bool pdl : {false, true}) {
        INFO("fused variant ks " << ks << " pdl " << pdl);
        layer.options().fused_k_split = ks;
        layer.options().pdl = pdl;
        const auto got = fused_in_graph(layer, w, x.p, ids.p, gw.p, c.T, out, ctx);
        const double d = diff_metric(std::vector<double>(got.begin(), got.end()), ref);
        INFO("diff " << d);
        CHECK(d < 2e-4);
      }
    // One token reads the router's ids directly (no routing launch): the same bits as through the routing kernel.
    if (T == 1) {
      layer.options() = w4a16_options();
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFused);
      ctx.sync();
      const auto direct = out.get();
      layer.options().fused_one_token_direct = false;
      DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFused);
      ctx.sync();
      CHECK(std::memcmp(out.get().data(), direct.data(), direct.size() * sizeof(float)) == 0);
    }
    layer.options() = w4a16_options();
    CHECK(layer.take_error() == 0);
  }
  // An out-of-range expert id is flagged, not a crash, and the other slots still count: one token (no routing
  // launch), a few tokens, and more than 4096 slots (the multi-block routing).
  struct BadId {
    int T, topk, slot, id;
    MoePath path;
  };
  for (const BadId& b : {BadId{1, 2, 1, 99, MoePath::kFused}, BadId{3, 2, 1, 99, MoePath::kFused},
                         BadId{1100, 4, 4321, -3, MoePath::kFp8}}) {
    INFO("T " << b.T << ", slot " << b.slot << " names expert " << b.id);
    MoeCase c = make_moe(8, b.topk, 64, 32, b.T, rng);
    c.ids[size_t(b.slot)] = b.id;
    MoeLayer layer(ctx, MoeShape{c.E, c.topk, c.H, c.I}, std::max(4, c.T));
    Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
    Dev<uint16_t> b1(c.b1), b2(c.b2);
    Dev<float> x(c.x), gw(c.gw), out(size_t(c.T * c.H));
    Dev<int> ids(c.ids);
    const MoeWeights w{w1b.p, w1s.p, b1.p, w2b.p, w2s.p, b2.p};
    layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, b.path);
    ctx.sync();
    CHECK(layer.take_error() == 1);
    bool finite = true;
    for (float v : out.get()) finite &= std::isfinite(v);
    CHECK(finite);
    if (b.T == 3) {
      CHECK_THROWS_AS(layer.forward(MoeWeights{}, x.p, ids.p, gw.p, c.T, out.p), Error);
      CHECK_THROWS_AS(layer.forward(w, x.p, ids.p, gw.p, 5, out.p), Error);  // more tokens than the scratch holds
    }
  }
#endif
}

TEST_CASE("CUDA runtime: errors carry the CUDA message; the pool sub-allocates one reservation", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  try {
    DZ_CUDA_CHECK(cudaMemcpy(reinterpret_cast<void*>(16), reinterpret_cast<void*>(32), 64, cudaMemcpyDeviceToDevice));
    FAIL("bad copy succeeded");
  } catch (const Error& e) {
    CHECK(e.status() == DZ_ERR_DEVICE);
    CHECK_THAT(e.what(), Catch::Contains("CUDA error") && Catch::Contains("cudaMemcpy"));
  }
  DevicePool pool(1 << 20);
  void* a = pool.alloc(1000, "a");
  void* b = pool.alloc(300000, "b");
  CHECK(reinterpret_cast<uintptr_t>(a) % 256 == 0);
  CHECK(pool.used() == 1024 + 300032);
  pool.free(a);
  void* c = pool.alloc(512, "c");  // first fit reuses the hole
  CHECK(c == a);
  try {
    pool.alloc(900000, "too big");
    FAIL("over-allocation succeeded");
  } catch (const Error& e) {
    CHECK(e.status() == DZ_ERR_OUT_OF_MEMORY);
    CHECK_THAT(e.what(), Catch::Contains("too big"));
  }
  pool.free(b);
  pool.free(c);
  CHECK(pool.used() == 0);
  void* all = pool.alloc(1 << 20, "all");  // freed ranges coalesced back into one
  CHECK(all != nullptr);
  pool.free(all);
#endif
}

TEST_CASE("CUDA MoE layer: reserves what reserved_bytes says, grows past it on first use", "[cuda]") {
#ifdef DZ_WITH_CUDA
  // Host arithmetic (no GPU needed): gpt-oss-120b's shape at 16384 tokens.
  // Every path needs the E4M3 input and activations and down's bf16 output
  // (65536 slots + 1920 rows of padding, K padded to 2944) and the fp16
  // input; gpt-oss's whole-K GEMMs need no bf16 gate_up output past 96
  // tokens an expert and no FP8 workspace, so it reserves well under the
  // plain SwiGLU's shape, which keeps both at every size.
  const MoeShape oss{128, 4, 2880, 2880};
  MoeShape silu = oss;
  silu.act = MoeActivation::kSilu;
  const double rows = 65536 + 128 * 15;
  const double every_path = rows * (2944 + 2944 + 2 * 2880) + 16384.0 * 2944 * 2;
  const double d1_full = rows * 2 * 2880 * 2, ws = 2 * 16 * (2.0 * 2880 * 2944 + 2880.0 * 2944);
  const double r_oss = double(MoeLayer::reserved_bytes(oss, 16384)),
               r_silu = double(MoeLayer::reserved_bytes(silu, 16384));
  INFO("gpt-oss " << r_oss / 1e9 << " GB, plain SwiGLU " << r_silu / 1e9 << " GB, every path " << every_path / 1e9);
  CHECK(r_oss > every_path);
  // The rest: gate_up's output for 14,208 rows (164 MB), the fused path's
  // buffers and W4A8 images for 512 tokens, a cuBLASLt workspace, scales.
  CHECK(r_oss < every_path + 0.5e9);
  CHECK(r_silu > every_path + d1_full + ws);
  MoeOptions off;
  off.fp8_whole_k = -1;  // no whole-K GEMMs: gpt-oss needs both at every size too
  CHECK(double(MoeLayer::reserved_bytes(oss, 16384, off)) > every_path + d1_full + ws);

  if (!have_gpu()) return;
  Context ctx(small_ctx());
  std::mt19937 rng(11);
  MoeCase c = make_moe(8, 4, 320, 192, 600, rng);
  const MoeShape sh{c.E, c.topk, c.H, c.I};
  const size_t before = ctx.pool().used();
  MoeLayer layer(ctx, sh, c.T);
  CHECK(ctx.pool().used() - before == MoeLayer::reserved_bytes(sh, c.T));
  CHECK(layer.scratch_bytes() + layer.fp8_workspace_bytes() <= MoeLayer::reserved_bytes(sh, c.T));
  // The fused path forced on 600 tokens (300 an expert, past its plan of 16)
  // and the FP8 path on the workspace (not reserved for gpt-oss): both grow,
  // and both still match float64.
  DevMoe dm(c);
  const auto ref = moe_ref(c);
  auto& [w1b, w1s, w2b, w2s, b1, b2, x, gw, out, ids, w] = dm;
  layer.options().fp8_fold_in_gemm = false;
  layer.options().fp8_mxfp4_gemm = -1;
  for (MoePath path : {MoePath::kFused, MoePath::kFp8}) {
    const size_t used = ctx.pool().used();
    DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
    layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, path);
    ctx.sync();
    INFO((path == MoePath::kFused ? "fused path" : "FP8 path on the workspace"));
    CHECK(ctx.pool().used() > used);
    CHECK(finite_diff(out.get(), ref) < (path == MoePath::kFused ? 2e-4 : 1e-2));
    const size_t grown = ctx.pool().used();  // a second call takes nothing more
    layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, path);
    ctx.sync();
    CHECK(ctx.pool().used() == grown);
  }
#endif
}

TEST_CASE("CUDA MoE layer: fused kernels on more shapes, crowded routing, interleaved sizes, bad ids", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  Context ctx(small_ctx());
  std::mt19937 rng(17);
  struct Case {
    int E, topk, H, I, T;
    bool crowd;  // every token routed to experts 0..topk-1: many passes per expert
    // Scale bytes: a wide range puts sub-blocks up to 34 binades under their
    // chunk's largest, through every branch of the fused kernels' fold.
    int s_lo = 118, s_hi = 124;
    // Inputs and biases times act: at 0.01 the SwiGLU outputs are ~1e-3, under
    // the W4A8 down projection's fixed scale's normal range (kW8DownInv).
    float act = 1.f;
  } cases[] = {{8, 4, 320, 192, 1, false},
               {8, 4, 320, 192, 2, false},
               {8, 4, 320, 192, 8, false},
               {8, 4, 320, 192, 64, false},
               {40, 2, 256, 320, 8, false},
               {8, 4, 320, 192, 24, true},
               {8, 4, 320, 192, 8, true},  // 8 tokens on the same 4 experts
               {8, 4, 320, 192, 8, false, 96, 130},
               {8, 4, 320, 192, 1, false, 96, 130},
               {8, 4, 320, 192, 8, false, 118, 124, 0.01f}};
  for (const auto& cs : cases) {
    MoeCase c = make_moe(cs.E, cs.topk, cs.H, cs.I, cs.T, rng, cs.s_lo, cs.s_hi);
    if (cs.act != 1.f) {
      for (float& v : c.x) v *= cs.act;
      for (auto* b : {&c.b1, &c.b2})
        for (uint16_t& v : *b) v = f32_to_bf16(cs.act * float(bf16_to_double(v)));
    }
    if (cs.crowd)
      for (int t = 0; t < c.T; ++t)
        for (int k = 0; k < c.topk; ++k) c.ids[size_t(t * c.topk + k)] = (k + t) % c.topk;
    INFO("E " << c.E << " topk " << c.topk << " H " << c.H << " I " << c.I << " T " << c.T << " crowd " << cs.crowd
              << " scales " << cs.s_lo << ".." << cs.s_hi << " act " << cs.act);
    const MoeOptions base = small_options();
    MoeLayer layer(ctx, MoeShape{c.E, c.topk, c.H, c.I}, 64, base);
    Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
    Dev<uint16_t> b1(c.b1), b2(c.b2);
    Dev<float> x(c.x), gw(c.gw), out(size_t(c.T * c.H));
    Dev<int> ids(c.ids);
    const MoeWeights w{w1b.p, w1s.p, b1.p, w2b.p, w2s.p, b2.p};
    const auto ref = moe_ref(c);
    auto run = [&](bool graph) {
      DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));  // poison: every element must be written
      if (graph) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        DZ_CUDA_CHECK(cudaStreamBeginCapture(ctx.stream(), cudaStreamCaptureModeThreadLocal));
        layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFused);
        DZ_CUDA_CHECK(cudaStreamEndCapture(ctx.stream(), &g));
        DZ_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
        for (int r = 0; r < 3; ++r) DZ_CUDA_CHECK(cudaGraphLaunch(ge, ctx.stream()));  // replays
        ctx.sync();
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
      } else {
        layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFused);
        ctx.sync();
      }
      return out.get();
    };
    // W4A16 (fp16 activations, exact weights), then W4A8 where it runs: E4M3
    // activations with 1x128 scales (as the FP8 path: the looser bound), and
    // two E4M3 terms a value (hi + lo: ~8 significant bits, near W4A16).
    for (int terms : {0, 1, 2}) {
      const bool w4a8 = terms > 0;
      if (w4a8 && !Fp8GroupedGemm::supported()) {
        WARN("W4A8 fused kernels need sm_90a: not tested");
        break;
      }
      INFO((w4a8 ? "W4A8, E4M3 terms " : "W4A16") << terms);
      layer.options() = base;
      layer.options().fused_w4a8 = w4a8;
      layer.options().fused_w4a8_terms = std::max(1, terms);
      layer.options().fused_w4a8_max_tokens_per_expert = 1e9;  // also crowded experts: several passes
      layer.options().fused_w4a8_min_slots = 0;                // and one or two tokens
      const auto got = run(false);
      const double d = finite_diff(got, ref);
      INFO("diff " << d);
      if (w4a8)
        std::printf("MoE fused W4A8, %d E4M3 term(s), E %d T %d H %d I %d scales %d..%d act %g: diff %.3g vs float64\n",
                    terms, c.E, c.T, c.H, c.I, cs.s_lo, cs.s_hi, double(cs.act), d);
      // W4A8 with sub-block scales 34 binades apart: a 128-block's activation
      // scale follows elements that meet tiny weights, and the ones that meet
      // huge weights keep few bits (the FP8 path's bound there; two terms keep
      // 4 more).
      const bool wide = cs.s_hi - cs.s_lo > 10;
      const double bound = terms == 0 ? 2e-4 : terms == 1 ? (wide ? 2e-2 : 3e-3) : (wide ? 4e-3 : 6e-4);
      CHECK(d < bound);
      // Bitwise equal: again, inside a CUDA graph (replayed), and without PDL.
      CHECK(std::memcmp(run(false).data(), got.data(), got.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(run(true).data(), got.data(), got.size() * sizeof(float)) == 0);
      layer.options().pdl = false;
      CHECK(std::memcmp(run(false).data(), got.data(), got.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(run(true).data(), got.data(), got.size() * sizeof(float)) == 0);
      if (w4a8)
        for (int ks : {1, 4}) {  // both block shapes (two 64-row tiles; one tile split over K)
          layer.options().fused_k_split = ks;
          INFO("k split " << ks);
          CHECK(finite_diff(run(false), ref) < bound);
        }
      if (w4a8) {  // two row tiles a warpgroup (K split 1): the same sums, bit for bit
        layer.options().fused_k_split = 1;
        layer.options().fused_w4a8_tiles = 1;
        const auto one = run(false);
        layer.options().fused_w4a8_tiles = 2;
        INFO("two tiles a warpgroup");
        CHECK(std::memcmp(run(false).data(), one.data(), one.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(run(true).data(), one.data(), one.size() * sizeof(float)) == 0);
      }
      if (w4a8)  // activations staged by every block instead of one image kernel a projection: the same bits
        for (int ks : {1, 4}) {
          layer.options().fused_w4a8_tiles = 0;
          layer.options().fused_k_split = ks;
          layer.options().fused_w4a8_images = true;
          layer.options().fused_w4a8_passes = -1;
          const auto img = run(false);
          layer.options().fused_w4a8_images = false;
          layer.options().fused_w4a8_stream_above = 1e9;  // W4A8 staged at any size (and whole images above)
          INFO("activations staged in the blocks, k split " << ks);
          CHECK(std::memcmp(run(false).data(), img.data(), img.size() * sizeof(float)) == 0);
          layer.options().fused_w4a8_images = true;
          layer.options().fused_w4a8_stream_above = MoeOptions{}.fused_w4a8_stream_above;
        }
      if (w4a8) {  // activations streamed with the weights, 1 / 2 / 4 passes a read: the same bits as whole images
        layer.options().fused_w4a8_tiles = 1;
        layer.options().fused_k_split = 1;
        layer.options().fused_w4a8_passes = -1;
        const auto img = run(false);
        for (int ps : {1, 2, 4}) {
          layer.options().fused_w4a8_passes = ps;
          INFO("activations streamed, passes a read " << ps);
          CHECK(std::memcmp(run(false).data(), img.data(), img.size() * sizeof(float)) == 0);
          CHECK(std::memcmp(run(true).data(), img.data(), img.size() * sizeof(float)) == 0);
        }
        layer.options().fused_w4a8_passes = 0;
      }
      if (terms == 2)  // down waiting for its own expert's gate_up blocks, not the whole grid: the same bits
        for (int ps : {-1, 4}) {
          layer.options().fused_w4a8_passes = ps;
          layer.options().fused_w4a8_expert_wait = false;
          const auto grid = run(false);
          layer.options().fused_w4a8_expert_wait = true;
          INFO("down waits by expert, passes a read " << ps);
          CHECK(std::memcmp(run(false).data(), grid.data(), grid.size() * sizeof(float)) == 0);
          CHECK(std::memcmp(run(true).data(), grid.data(), grid.size() * sizeof(float)) == 0);
        }
      CHECK(layer.take_error() == 0);
    }
  }
  // Interleaved sizes on one layer, accumulate, a bad id, and a call where no
  // id is valid (output zero).
  {
    MoeCase c = make_moe(8, 4, 320, 192, 16, rng);
    MoeLayer layer(ctx, MoeShape{c.E, c.topk, c.H, c.I}, 16);
    Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
    Dev<uint16_t> b1(c.b1), b2(c.b2);
    Dev<float> x(c.x), gw(c.gw), out(size_t(c.T * c.H));
    Dev<int> ids(c.ids);
    const MoeWeights w{w1b.p, w1s.p, b1.p, w2b.p, w2s.p, b2.p};
    const auto ref = moe_ref(c);
    for (int T : {16, 1, 5, 16, 3, 16}) {
      INFO("T " << T);
      DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
      layer.forward(w, x.p, ids.p, gw.p, T, out.p, MoePath::kFused);
      ctx.sync();
      const auto got = out.get();
      const std::vector<double> g(got.begin(), got.begin() + T * c.H), r(ref.begin(), ref.begin() + T * c.H);
      CHECK(diff_metric(g, r) < 2e-4);
    }
    CHECK(layer.take_error() == 0);
    {  // accumulate: out += the layer (the residual stream)
      std::vector<float> base(size_t(c.T * c.H));
      std::normal_distribution<float> nd(0.f, 1.f);
      for (auto& v : base) v = nd(rng);
      DZ_CUDA_CHECK(cudaMemcpy(out.p, base.data(), base.size() * sizeof(float), cudaMemcpyHostToDevice));
      DZ_CUDA_CHECK(cudaDeviceSynchronize());  // the DMA from pageable memory may still be in flight
      layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, MoePath::kFused, true);
      ctx.sync();
      const auto got = out.get();
      std::vector<double> g(got.begin(), got.end()), r(ref.size());
      for (size_t i = 0; i < r.size(); ++i) r[i] = ref[i] + base[i];
      CHECK(diff_metric(g, r) < 2e-4);
    }
    std::vector<int> bad = c.ids;
    bad[1] = 99;
    bad[6] = -1;
    Dev<int> dbad(bad);
    layer.forward(w, x.p, dbad.p, gw.p, 4, out.p, MoePath::kFused);
    CHECK(layer.take_error() == 1);
    std::vector<int> none(bad.size(), 8);
    Dev<int> dnone(none);
    DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
    layer.forward(w, x.p, dnone.p, gw.p, 2, out.p, MoePath::kFused);
    CHECK(layer.take_error() == 1);
    const auto z = out.get();
    bool zero = true;
    for (int i = 0; i < 2 * c.H; ++i) zero &= z[size_t(i)] == 0.f;
    CHECK(zero);
    // Still correct after the bad calls.
    layer.forward(w, x.p, ids.p, gw.p, 16, out.p, MoePath::kFused);
    ctx.sync();
    const auto got = out.get();
    CHECK(diff_metric(std::vector<double>(got.begin(), got.end()), ref) < 2e-4);
    layer.options().fused_k_split = 3;
    CHECK_THROWS_AS(layer.forward(w, x.p, ids.p, gw.p, 16, out.p, MoePath::kFused), Error);
  }
#endif
}

TEST_CASE("CUDA MoE layer: the plain SwiGLU (DeepSeek) without biases, fused and FP8 paths, against float64",
          "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  CHECK(MoeShape{}.act == MoeActivation::kGptOss);  // gpt-oss's layers stay as they were (the tests above)
  Context ctx(small_ctx());
  CHECK_THROWS_AS(MoeLayer(ctx, MoeShape{16, 2, 256, 256, MoeActivation(7)}, 4), Error);
  std::mt19937 rng(41);
  struct Shape {
    int E, topk, H, I;
  } shapes[] = {{16, 2, 256, 256},  // DeepSeek-V3.2's tiny default model
                {16, 4, 96, 64}};   // a test fixture (K of 96: 3 sub-blocks, padded to 128)
  for (const Shape& sh : shapes) {
    // Tokens: the fused path (1: one token's direct kernels; 8), 15 an expert
    // (gpt-oss would stay fused there on the streamed W4A8 kernels; the plain
    // SwiGLU, without them, takes the FP8 path) and 20.
    const int t15 = 15 * sh.E / sh.topk, t20 = 20 * sh.E / sh.topk;
    // Inputs times 8 and 64: SwiGLU outputs far past gpt-oss's bound of 56
    // that the W4A8 kernels' fixed scale assumes (they must not run), and past
    // fp16's 65504 (the fused path stages them divided by the token's input
    // scale squared); times 0.01: small ones.
    for (float amp : {0.01f, 1.f, 8.f, 64.f}) {
      MoeCase c = make_moe(sh.E, sh.topk, sh.H, sh.I, t20, rng);
      c.b1.clear(), c.b2.clear();  // no biases: null on the device
      for (float& v : c.x) v *= amp;
      const auto ref = moe_ref(c, MoeActivation::kSilu);
      MoeOptions opt;
      opt.fused_w4a8_min_slots = 0;  // W4A8 asked for at every size (ignored for the plain SwiGLU)
      opt.tile_experts = 3;
      MoeLayer layer(ctx, MoeShape{sh.E, sh.topk, sh.H, sh.I, MoeActivation::kSilu}, t20, opt);
      Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
      Dev<float> x(c.x), gw(c.gw), out(size_t(c.T * c.H));
      Dev<int> ids(c.ids);
      const MoeWeights w{w1b.p, w1s.p, nullptr, w2b.p, w2s.p, nullptr};
      for (int T : {1, 3, 8, t15, t20}) {
        const double tpe = double(T) * sh.topk / sh.E;
        INFO("E " << sh.E << " topk " << sh.topk << " H " << sh.H << " I " << sh.I << " T " << T << " inputs x" << amp);
        const std::vector<double> r(ref.begin(), ref.begin() + int64_t(T) * sh.H);
        auto run = [&](MoePath path, const MoeWeights& wt) {
          DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));  // poison: every element must be written
          layer.forward(wt, x.p, ids.p, gw.p, T, out.p, path);
          ctx.sync();
          auto got = out.get();
          got.resize(size_t(T) * sh.H);
          return got;
        };
        CHECK(layer.choose(T) == (tpe <= opt.fused_max_tokens_per_expert ? MoePath::kFused : MoePath::kFp8));
        // Fused (W4A16 kernels: fp16 activations, exact weights), deterministic;
        // with W4A8 off the same kernels, so the same bits.
        const auto fused = run(MoePath::kFused, w);
        const double d_fused = finite_diff(fused, r);
        INFO("fused diff " << d_fused);
        CHECK(d_fused < 2e-4);
        CHECK(std::memcmp(run(MoePath::kFused, w).data(), fused.data(), fused.size() * sizeof(float)) == 0);
        layer.options().fused_w4a8 = false;
        CHECK(std::memcmp(run(MoePath::kFused, w).data(), fused.data(), fused.size() * sizeof(float)) == 0);
        layer.options().fused_w4a8 = true;
        // FP8 path (1x128 E4M3 activations: the SwiGLU + quantization kernel), deterministic.
        const auto fp8 = run(MoePath::kFp8, w);
        const double d_fp8 = finite_diff(fp8, r);
        INFO("FP8 path diff " << d_fp8);
        CHECK(d_fp8 < 1e-2);
        CHECK(std::memcmp(run(MoePath::kFp8, w).data(), fp8.data(), fp8.size() * sizeof(float)) == 0);
        const auto& chosen = layer.choose(T) == MoePath::kFused ? fused : fp8;
        CHECK(std::memcmp(run(MoePath::kAuto, w).data(), chosen.data(), chosen.size() * sizeof(float)) == 0);
        if (T <= 8) {  // every fused-kernel variant (K split 1 / 4 / 8, PDL off), inside a CUDA graph
          for (int ks : {1, 4, 8})
            for (bool pdl : {true, false}) {
              INFO("K split " << ks << " pdl " << pdl);
              layer.options().fused_k_split = ks, layer.options().pdl = pdl;
              auto got = fused_in_graph(layer, w, x.p, ids.p, gw.p, T, out, ctx);
              got.resize(size_t(T) * sh.H);
              CHECK(finite_diff(got, r) < 2e-4);
            }
          layer.options().fused_k_split = 0, layer.options().pdl = true;
        }
        if (T == 1) {  // one token through the routing kernel instead of its direct kernels: the same bits
          layer.options().fused_one_token_direct = false;
          CHECK(std::memcmp(run(MoePath::kFused, w).data(), fused.data(), fused.size() * sizeof(float)) == 0);
          layer.options().fused_one_token_direct = true;
        }
        std::printf(
            "MoE plain SwiGLU, no biases, E %d topk %d H %d I %d T %d inputs x%g: fused %.3g, FP8 %.3g vs float64\n",
            sh.E, sh.topk, sh.H, sh.I, T, double(amp), d_fused, d_fp8);
        if (T != t20) continue;
        // The FP8 path's other GEMMs: each expert on cuBLASLt (the SwiGLU kernel
        // per expert), and the grouped kernel on the workspace (the same bits as
        // folding inside).
        layer.options().fp8_gemm = 1;
        const auto lt = run(MoePath::kFp8, w);
        const double d_lt = finite_diff(lt, r);
        CHECK(d_lt < 1e-2);
        layer.options().fp8_gemm = 0;
        if (!Fp8GroupedGemm::supported()) continue;
        CHECK(diff_metric(std::vector<double>(lt.begin(), lt.end()), std::vector<double>(fp8.begin(), fp8.end())) <
              1e-4);
        layer.options().fp8_fold_in_gemm = false;
        CHECK(std::memcmp(run(MoePath::kFp8, w).data(), fp8.data(), fp8.size() * sizeof(float)) == 0);
        layer.options().fp8_fold_in_gemm = true;
        // The MXFP4 GEMM (both projections' group tables; K and rows multiples of 64).
        if (Mxfp4Gemm::supported() && sh.H % 64 == 0 && sh.I % 64 == 0) {
          const int64_t kph = cpu::fold_kpad(sh.H), kpi = cpu::fold_kpad(sh.I);
          Dev<uint8_t> g1(size_t(sh.E * (2 * sh.I / 64) * (kph / 128))), g2(size_t(sh.E * (sh.H / 64) * (kpi / 128)));
          exact_tables(mxfp4_group_table, w1b.p, w1s.p, w2b.p, w2s.p, sh.E, sh.H, sh.I, g1.p, g2.p, ctx.stream());
          MoeWeights wg = w;
          wg.w1_gmax = g1.p, wg.w2_gmax = g2.p;
          layer.options().fp8_mxfp4_gemm = 1;
          const auto mg = run(MoePath::kFp8, wg);
          const double dm = finite_diff(mg, r);
          INFO("MXFP4 GEMM diff " << dm);
          CHECK(dm < 1e-2);
          CHECK(diff_metric(std::vector<double>(mg.begin(), mg.end()), std::vector<double>(fp8.begin(), fp8.end())) <
                1e-4);
          layer.options().fp8_mxfp4_gemm = 0;
          // Whole-K scales.
          Dev<uint8_t> k1(size_t(sh.E * (2 * sh.I / 64))), k2(size_t(sh.E * (sh.H / 64)));
          exact_tables(mxfp4_whole_k_table, w1b.p, w1s.p, w2b.p, w2s.p, sh.E, sh.H, sh.I, k1.p, k2.p, ctx.stream());
          MoeWeights wk = w;
          wk.w1_gk = k1.p, wk.w2_gk = k2.p;
          layer.options().fp8_whole_k = 1;
          const auto wh = run(MoePath::kFp8, wk);
          const double dw = finite_diff(wh, r);
          WARN("MoE FP8 path at " << sh.E << " experts, H " << sh.H << ", T " << T << ": whole-K scales diff " << dw
                                  << " vs float64 (grouped " << d_fp8 << ")");
          CHECK(dw < 1e-2);
          layer.options().fp8_whole_k = 0;
        }
      }
      CHECK(layer.take_error() == 0);
    }
  }
  // DeepSeek-V4's clamped plain SwiGLU (MoeShape::silu_limit) on both paths, inputs large enough that most
  // gate/up sums pass the limit.
  {
    const float limit = 0.75f;
    CHECK_THROWS_AS(MoeLayer(ctx, MoeShape{16, 2, 256, 256, MoeActivation::kGptOss, limit}, 4), Error);
    MoeCase c = make_moe(16, 4, 96, 64, 80, rng);
    c.b1.clear(), c.b2.clear();
    for (float& v : c.x) v *= 8;
    const auto ref = moe_ref(c, MoeActivation::kSilu, limit), plain = moe_ref(c, MoeActivation::kSilu);
    MoeOptions opt;
    opt.tile_experts = 3;
    MoeLayer layer(ctx, MoeShape{c.E, c.topk, c.H, c.I, MoeActivation::kSilu, limit}, c.T, opt);
    Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
    Dev<float> x(c.x), gw(c.gw), out(size_t(c.T * c.H));
    Dev<int> ids(c.ids);
    const MoeWeights w{w1b.p, w1s.p, nullptr, w2b.p, w2s.p, nullptr};
    for (int T : {1, 8, 80})
      for (MoePath path : {MoePath::kFused, MoePath::kFp8}) {
        layer.forward(w, x.p, ids.p, gw.p, T, out.p, path);
        ctx.sync();
        auto got = out.get();
        got.resize(size_t(T) * c.H);
        const std::vector<double> r(ref.begin(), ref.begin() + int64_t(T) * c.H),
            u(plain.begin(), plain.begin() + int64_t(T) * c.H);
        const double d = finite_diff(got, r), d_plain = finite_diff(got, u);
        INFO("clamped SwiGLU, T " << T << (path == MoePath::kFused ? " fused" : " FP8") << ": diff " << d
                                  << " (unclamped reference: " << d_plain << ")");
        // FP8: the clamp leaves mostly near-constant activations, so the E4M3 rounding of the sums that stay
        // under the limit weighs more than without it (measured on an H100: 0.0145 at 80 tokens).
        CHECK(d < (path == MoePath::kFused ? 2e-4 : 3e-2));
        CHECK(d_plain > 10 * d);  // the clamp changed the result
      }
    CHECK(layer.take_error() == 0);
  }
  // gpt-oss's activation without one or both biases: the projection without
  // one runs on the W4A16 kernels (the W4A8 kernels add theirs unconditionally),
  // the other on W4A8; the FP8 path adds none.
  for (int which : {0, 1, 2}) {  // 0: no biases, 1: gate_up's only, 2: down's only
    for (int T : {8, 40}) {
      MoeCase c = make_moe(8, 4, 320, 192, T, rng);
      INFO("gpt-oss, " << (which == 0   ? "no biases"
                           : which == 1 ? "gate_up's bias only"
                                        : "down's bias only")
                       << ", T " << T);
      if (which != 1) c.b1.clear();
      if (which != 2) c.b2.clear();
      const auto ref = moe_ref(c);
      MoeOptions opt = small_options();
      opt.fused_w4a8_min_slots = 0;
      MoeLayer layer(ctx, MoeShape{c.E, c.topk, c.H, c.I}, T, opt);
      Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
      Dev<uint16_t> b1(std::max<size_t>(1, c.b1.size())), b2(std::max<size_t>(1, c.b2.size()));
      if (which == 1) DZ_CUDA_CHECK(cudaMemcpy(b1.p, c.b1.data(), c.b1.size() * 2, cudaMemcpyHostToDevice));
      if (which == 2) DZ_CUDA_CHECK(cudaMemcpy(b2.p, c.b2.data(), c.b2.size() * 2, cudaMemcpyHostToDevice));
      Dev<float> x(c.x), gw(c.gw), out(size_t(c.T * c.H));
      Dev<int> ids(c.ids);
      const MoeWeights w{w1b.p, w1s.p, which == 1 ? b1.p : nullptr, w2b.p, w2s.p, which == 2 ? b2.p : nullptr};
      for (MoePath path : {MoePath::kFused, MoePath::kFp8}) {
        DZ_CUDA_CHECK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));
        layer.forward(w, x.p, ids.p, gw.p, c.T, out.p, path);
        ctx.sync();
        const double d = finite_diff(out.get(), ref);
        INFO((path == MoePath::kFused ? "fused" : "FP8 path") << " diff " << d);
        CHECK(d < (path == MoePath::kFused ? 6e-4 : 1e-2));  // fused: W4A8 two terms' bound where it runs
      }
      CHECK(layer.take_error() == 0);
    }
  }
#endif
}

TEST_CASE("One-token stream plan: every unit streamed once, a down tile's slots in one block, blocks balanced",
          "[cuda]") {
#ifdef DZ_WITH_CUDA
  // Host arithmetic only (no GPU): grids of real SM counts and odd ones, gpt-oss's shapes and small ones.
  for (int G : {132, 114, 78, 16, 7, 1, 200})
    for (int topk : {1, 2, 4, 8})
      for (int gt : {360, 24, 12, 1})
        for (int T2 : {180, 20, 12, 4, 1, 448}) {
          INFO("blocks " << G << " topk " << topk << " gate_up tiles " << gt << " down tiles " << T2);
          const OneTokenPlan p(G, topk, gt, T2);
          std::vector<int> seen(size_t(topk) * gt, 0), tiles(size_t(T2), 0);
          int most = 0, fewest = 1 << 30;
          for (int b = 0; b < G; ++b) {
            for (int i = 0; i < p.gate_up_units(b); ++i) {
              const int u = p.gate_up_unit(b, i);
              REQUIRE(u >= 0);
              REQUIRE(u < topk * gt);
              ++seen[size_t(u)];
              const OneTokenPlan::Unit un = p.unit(b, i);  // what the kernel streams
              CHECK((un.proj == 0 && un.tile >= 0 && un.tile < gt && un.slot * gt + un.tile == u));
            }
            REQUIRE(p.down_tiles(b) <= p.max_down_tiles());
            for (int k = 0; k < p.down_tiles(b) * topk; ++k) {  // (tile, slot) pairs of this block
              const int j = p.down_tile(b, k), q = p.down_slot(b, k), l = p.down_local(b, k);
              REQUIRE(j >= 0);
              REQUIRE(j < T2);
              REQUIRE(q >= 0);
              REQUIRE(q < topk);
              REQUIRE(l < p.down_tiles(b));
              CHECK(j % G == b);
              tiles[size_t(j)] += 1 << (2 * q);              // every slot once: 0b0101.. at the end
              if (k > 0) CHECK(q >= p.down_slot(b, k - 1));  // slot by slot
              const OneTokenPlan::Unit un = p.unit(b, p.gate_up_units(b) + k);
              CHECK((un.proj == 1 && un.slot == q && un.tile == j));
            }
            const int n = p.gate_up_units(b) + topk * p.down_tiles(b);
            most = std::max(most, n), fewest = std::min(fewest, n);
          }
          CHECK(std::count(seen.begin(), seen.end(), 1) == topk * gt);
          int every = 0;
          for (int q = 0; q < topk; ++q) every |= 1 << (2 * q);
          CHECK(std::count(tiles.begin(), tiles.end(), every) == T2);
          // Within one unit of the mean wherever gate_up's units can even out down's tiles.
          const int total = topk * gt + topk * T2;
          if (topk * gt >= topk * G) CHECK(most <= (total + G - 1) / G);
          if (topk * gt >= topk * G) CHECK(fewest >= total / G - 1);
        }
  // gpt-oss-120b on 132 SMs: 16 or 17 units a block.
  const OneTokenPlan p(132, 4, 360, 180);
  for (int b = 0; b < 132; ++b) {
    const int n = p.gate_up_units(b) + 4 * p.down_tiles(b);
    CHECK((n == 16 || n == 17));
  }
#endif
}

TEST_CASE("CUDA MoE layer: one token streamed (fp16 mma.sync, exact weights) against float64", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  Context ctx(small_ctx());
  std::mt19937 rng(31);
  struct Case {
    int E, topk, H, I;
    int s_lo = 118, s_hi = 124;
    float act = 1.f;    // inputs and biases times this
    int bad_slot = -1;  // this slot names expert 99
  } cases[] = {{8, 4, 320, 192},
               {8, 4, 320, 192, 96, 130},          // sub-block scales 34 binades apart
               {8, 4, 320, 192, 118, 124, 0.01f},  // SwiGLU outputs under down's normal E4M3 range
               {40, 2, 256, 320},
               {16, 8, 256, 128},    // topk 8
               {32, 4, 2880, 2880},  // gpt-oss's H and I (90 sub-blocks a row)
               {8, 4, 320, 192, 118, 124, 1.f, 2}};
  for (const auto& cs : cases) {
    MoeCase c = make_moe(cs.E, cs.topk, cs.H, cs.I, 1, rng, cs.s_lo, cs.s_hi);
    if (cs.act != 1.f) {
      for (float& v : c.x) v *= cs.act;
      for (auto* b : {&c.b1, &c.b2})
        for (uint16_t& v : *b) v = f32_to_bf16(cs.act * float(bf16_to_double(v)));
    }
    INFO("E " << c.E << " topk " << c.topk << " H " << c.H << " I " << c.I << " scales " << cs.s_lo << ".." << cs.s_hi
              << " act " << cs.act << " bad slot " << cs.bad_slot);
    MoeOptions opt = small_options();
    opt.fused_one_token_stream = true;
    MoeLayer layer(ctx, MoeShape{c.E, c.topk, c.H, c.I}, 4, opt);
    Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
    Dev<uint16_t> b1(c.b1), b2(c.b2);
    Dev<float> x(c.x), gw(c.gw), out(size_t(c.H));
    const MoeWeights w{w1b.p, w1s.p, b1.p, w2b.p, w2s.p, b2.p};
    if (!one_token_moe_supported(MoeShape{c.E, c.topk, c.H, c.I}, w)) {
      WARN("the one-token stream needs sm_90: not tested");
      return;
    }
    // The reference leaves a bad slot out (its gate weight zero, its expert any valid one).
    MoeCase rc = c;
    if (cs.bad_slot >= 0) rc.gw[size_t(cs.bad_slot)] = 0.f, c.ids[size_t(cs.bad_slot)] = 99;
    Dev<int> ids(c.ids);
    const auto ref = moe_ref(rc);
    auto run = [&](bool graph, bool accumulate, const std::vector<float>& init) {
      DZ_CUDA_CHECK(cudaMemcpy(out.p, init.data(), init.size() * 4, cudaMemcpyHostToDevice));
      if (graph) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        DZ_CUDA_CHECK(cudaStreamBeginCapture(ctx.stream(), cudaStreamCaptureModeThreadLocal));
        layer.forward(w, x.p, ids.p, gw.p, 1, out.p, MoePath::kFused, accumulate);
        DZ_CUDA_CHECK(cudaStreamEndCapture(ctx.stream(), &g));
        DZ_CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
        for (int r = 0; r < 3; ++r) {  // replays: the row tiles' counts return to zero each time
          DZ_CUDA_CHECK(cudaMemcpyAsync(out.p, init.data(), init.size() * 4, cudaMemcpyHostToDevice, ctx.stream()));
          DZ_CUDA_CHECK(cudaGraphLaunch(ge, ctx.stream()));
        }
        ctx.sync();
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
      } else {
        layer.forward(w, x.p, ids.p, gw.p, 1, out.p, MoePath::kFused, accumulate);
        ctx.sync();
      }
      return out.get();
    };
    const std::vector<float> poison(size_t(c.H), std::nanf(""));
    const auto got = run(false, false, poison);
    const double d = finite_diff(got, ref);
    std::printf("MoE one token streamed, E %d topk %d H %d I %d scales %d..%d act %g: diff %.3g vs float64\n", c.E,
                c.topk, c.H, c.I, cs.s_lo, cs.s_hi, double(cs.act), d);
    INFO("diff " << d);
    // fp16 activations and exact weights: the W4A16 kernels' bound.
    const bool wide = cs.s_hi - cs.s_lo > 10;
    CHECK(d < 2e-4);
    // Largest error against the output's scale: catches one wrong row tile that the metric would average away.
    double amax = 0, emax = 0;
    for (size_t i = 0; i < ref.size(); ++i)
      amax = std::max(amax, std::fabs(ref[i])), emax = std::max(emax, std::fabs(double(got[i]) - ref[i]));
    INFO("max abs error " << emax << " of max " << amax);
    CHECK(emax < (wide ? 5e-2 : 1e-2) * amax);
    CHECK(layer.take_error() == (cs.bad_slot >= 0 ? 1 : 0));
    // The same bits again, in a CUDA graph replayed, without PDL; accumulate adds to what out holds.
    CHECK(std::memcmp(run(false, false, poison).data(), got.data(), got.size() * 4) == 0);
    CHECK(std::memcmp(run(true, false, poison).data(), got.data(), got.size() * 4) == 0);
    layer.options().pdl = false;
    CHECK(std::memcmp(run(false, false, poison).data(), got.data(), got.size() * 4) == 0);
    layer.options().pdl = true;
    std::vector<float> base(size_t(c.H));
    std::normal_distribution<float> nd(0.f, 1.f);
    for (float& v : base) v = nd(rng);
    const auto acc = run(true, true, base);
    size_t bad = 0;
    for (size_t i = 0; i < acc.size(); ++i) bad += acc[i] != got[i] + base[i];
    CHECK(bad == 0);
    // Every block shape, a short ring, a launch a projection: each unit's sums split the same way within a
    // group's warps only for the same warps a group, so the bits match those; the others meet the bound.
    for (const OneTokenConfig& oc :
         {OneTokenConfig{3, 4, 2, 1}, OneTokenConfig{3, 4, 0, 2}, OneTokenConfig{4, 4, 3, 1},
          OneTokenConfig{6, 2, 1, 2}, OneTokenConfig{4, 2, 1, 1}, OneTokenConfig{1, 12, 0, 1},
          OneTokenConfig{2, 6, 4, 2}, OneTokenConfig{6, 2, 0, 1}, OneTokenConfig{2, 8, 2, 1},
          OneTokenConfig{8, 2, 0, 1}, OneTokenConfig{4, 2, 1, 1}, OneTokenConfig{8, 1, 0, 2}}) {
      INFO("groups " << oc.groups << " x " << oc.group_warps << " warps, stages " << oc.stages << ", launches "
                     << oc.launches);
      layer.options().one_token = oc;
      const auto v = run(false, false, poison);
      if (oc.group_warps == OneTokenConfig{}.group_warps)
        CHECK(std::memcmp(v.data(), got.data(), got.size() * 4) == 0);
      else
        CHECK(finite_diff(v, ref) < 2e-4);
      CHECK(std::memcmp(run(true, false, poison).data(), v.data(), v.size() * 4) == 0);
    }
    layer.take_error();
  }
#endif
}

// The stream's blocks wait for each other, so they must all be resident at once. Two layers streaming on
// two streams beside a third busy with 64-token calls (the shape of two models decoding on one GPU while a
// third prefills) must all finish, and with their lone results' bits: a launch that left each grid part of
// the GPU would wait forever, which a watchdog turns into a failure.
TEST_CASE("CUDA MoE layer: one token streamed on two streams beside a third never waits forever", "[cuda]") {
  if (!have_gpu()) return;
#ifdef DZ_WITH_CUDA
  std::mt19937 rng(47);
  const int E = 16, topk = 4, H = 1024, I = 1024, Tc = 64;
  MoeCase c = make_moe(E, topk, H, I, Tc, rng);
  Dev<uint8_t> w1b(c.w1.blocks), w1s(c.w1.scales), w2b(c.w2.blocks), w2s(c.w2.scales);
  Dev<uint16_t> b1(c.b1), b2(c.b2);
  Dev<float> x(c.x), gw(c.gw);
  Dev<int> ids(c.ids);
  const MoeWeights w{w1b.p, w1s.p, b1.p, w2b.p, w2s.p, b2.p};
  if (!one_token_moe_supported(MoeShape{E, topk, H, I}, w)) {
    WARN("the one-token stream needs sm_90: not tested");
    return;
  }
  MoeOptions opt = small_options();
  opt.fused_one_token_stream = true;
  std::vector<std::unique_ptr<Context>> ctx;
  std::vector<std::unique_ptr<MoeLayer>> layer;
  std::vector<std::unique_ptr<Dev<float>>> out;
  const int tokens[3] = {1, 1, Tc};
  for (int k = 0; k < 3; ++k) {
    ctx.push_back(std::make_unique<Context>(small_ctx()));
    layer.push_back(std::make_unique<MoeLayer>(*ctx[size_t(k)], MoeShape{E, topk, H, I}, Tc, opt));
    out.push_back(std::make_unique<Dev<float>>(size_t(tokens[k]) * H));
  }
  // Each call alone: the bits to expect (the two one-token layers read different tokens).
  auto call = [&](int k) {
    const int t0 = k == 1 ? 7 : 0;
    layer[size_t(k)]->forward(w, x.p + size_t(t0) * H, ids.p + t0 * topk, gw.p + t0 * topk, tokens[k],
                              out[size_t(k)]->p, MoePath::kAuto);
  };
  std::vector<std::vector<float>> want;
  for (int k = 0; k < 3; ++k) call(k), ctx[size_t(k)]->sync(), want.push_back(out[size_t(k)]->get());
  for (int r = 0; r < 300; ++r)
    for (int k : {2, 0, 1}) call(k);
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    bool busy = false;
    for (auto& cx : ctx) {
      const cudaError_t e = cudaStreamQuery(cx->stream());
      REQUIRE((e == cudaSuccess || e == cudaErrorNotReady));
      busy |= e == cudaErrorNotReady;
    }
    if (!busy) break;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) {
      std::fprintf(stderr, "one-token streams still running after 60 s: their grids wait on each other\n");
      std::fflush(stderr);
      std::_Exit(3);  // (a hung grid cannot be joined; the driver ends it with the process)
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (int k = 0; k < 3; ++k) {
    INFO("stream " << k);
    const auto got = out[size_t(k)]->get();
    CHECK(std::memcmp(got.data(), want[size_t(k)].data(), got.size() * 4) == 0);
  }
#endif
}
