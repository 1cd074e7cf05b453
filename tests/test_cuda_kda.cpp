// GPU tests of the KDA kernels (cuda/kda.h) against the CPU backend's
// (float64 sums) ([cuda][kimi]; skip with a message where no CUDA device is
// present): the recurrence (several sequences with their own states, decode
// steps and runs of tokens, every head size, ragged batches, a separate input
// state, a layer's offset into the state slots), the short convolution over
// ragged sequences continuing their histories, kda_prepare and the output gate.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/kda.h"

#ifdef DZ_WITH_CUDA
#include "cuda/kda.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#include "support/safetensors_writer.h"
#endif

#include "support/gpu.h"

#ifdef DZ_WITH_CUDA
namespace {

// Row offsets of sequences of the given token counts: [batch + 1].
std::vector<int32_t> row_offsets(const std::vector<int>& counts) {
  std::vector<int32_t> first(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), first.begin() + 1);
  return first;
}

// Pointers to n slots of `stride` floats in a device buffer, in reverse order
// (each sequence finds its own through the table, not by its index).
template <typename P>
std::vector<P> reversed_slots(float* base, int n, size_t stride) {
  std::vector<P> s(static_cast<size_t>(n));
  for (int b = 0; b < n; ++b) s[size_t(b)] = base + size_t(n - 1 - b) * stride;
  return s;
}

}  // namespace
#endif

TEST_CASE("CUDA KDA recurrence matches the CPU backend's, state and outputs", "[cuda][kimi]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  struct Case {
    int heads, dim;
    std::vector<int> counts;  // tokens each sequence (all equal unless ragged)
    bool ragged = false;      // through seq_first, else n each
    int64_t g_pad = -1;       // g in rows of stride heads x dim + g_pad (-1: in the q rows' stride, ld_g 0)
    bool own_in = false;      // read from a separate input state
    int64_t offset = 0;       // state_offset
  };
  const std::vector<Case> cases = {
      {4, 128, {1, 1, 1}},
      {4, 128, {45, 45}},
      {32, 128, {3}},
      {6, 64, {17, 17, 17, 17, 17}},
      {8, 16, {9, 9, 9}},
      {5, 32, {20, 20}, false, 3},
      {4, 64, {2, 2}, false, -1, true, 9},
      {4, 32, {0, 0}, false, -1, true},  // no tokens: the input state copied across
      {4, 16, {1, 7, 0, 30}, true, 5, true, 37},
      {6, 64, {1, 7, 0, 30}, true, -1, true},
      {3, 128, {5, 0, 12}, true, 4, false, 64},
      {2, 32, {0, 3, 1}, true, 1, true, 11},
  };
  for (const Case& c : cases) {
    const int batch = int(c.counts.size());
    const auto first = row_offsets(c.counts);
    INFO("heads " << c.heads << " dim " << c.dim << " batch " << batch << " tokens " << first.back() << " ragged "
                  << c.ragged << " g_pad " << c.g_pad << " own_in " << c.own_in << " offset " << c.offset);
    cpu::KdaDims d;
    d.n_heads = c.heads, d.head_dim = c.dim;
    const size_t P = size_t(d.proj()), SS = size_t(c.heads) * c.dim * c.dim, rows = size_t(first.back());
    const int64_t ld = int64_t(P) + 8;  // rows with a gap, as a model's fused projections leave
    const int64_t ld_g = c.g_pad < 0 ? ld : int64_t(P) + c.g_pad;
    std::vector<float> q(rows * size_t(ld)), k(q.size()), v(q.size()), g(rows * size_t(ld_g)),
        beta(rows * size_t(c.heads));
    for (auto* x : {&q, &k, &v}) std::generate(x->begin(), x->end(), [&] { return nd(rng); });
    for (auto& x : g) x = -std::exp(4 * ud(rng) - 5);
    for (auto& x : beta) x = ud(rng);
    for (size_t t = 0; t < rows; ++t)
      for (int h = 0; h < c.heads; ++h)
        for (auto* x : {&q, &k}) {
          float* r = x->data() + t * size_t(ld) + size_t(h) * c.dim;
          double ss = 0;
          for (int i = 0; i < c.dim; ++i) ss += double(r[i]) * r[i];
          const double s = (x == &q ? 1 / std::sqrt(double(c.dim)) : 1.0) / std::sqrt(ss);
          for (int i = 0; i < c.dim; ++i) r[i] = float(r[i] * s);
        }
    // Each sequence starts from its own random state (a continued conversation),
    // a layer's part of its slot at the offset, spare floats after it.
    const size_t SL = size_t(c.offset) + SS + 5;
    std::vector<float> state(SL * size_t(batch)), state_in(state.size());
    for (auto* x : {&state, &state_in}) std::generate(x->begin(), x->end(), [&] { return 0.3f * nd(rng); });
    const std::vector<float>& src = c.own_in ? state_in : state;
    std::vector<float> ref_state = state, ref_out(rows * P);
    for (int b = 0; b < batch; ++b) {
      // Slot b lies at batch - 1 - b (reversed_slots).
      const size_t at = size_t(batch - 1 - b) * SL + size_t(c.offset), r0 = size_t(first[size_t(b)]);
      std::copy_n(src.begin() + ptrdiff_t(at), SS, ref_state.begin() + ptrdiff_t(at));
      cpu::kda_recurrent(d, q.data() + r0 * size_t(ld), k.data() + r0 * size_t(ld), v.data() + r0 * size_t(ld), ld,
                         g.data() + r0 * size_t(ld_g), ld_g, beta.data() + r0 * size_t(c.heads), c.counts[size_t(b)],
                         ref_state.data() + at, ref_out.data() + r0 * P, nullptr);
    }
    test::DeviceBuffer<float> dq(q), dk(k), dv(v), dg(g), dbeta(beta), dstate(state), dout(rows * P);
    test::DeviceBuffer<float> dstate_in(state_in);
    test::DeviceBuffer<int32_t> dfirst(first);
    test::DeviceBuffer<float*> dslots(reversed_slots<float*>(dstate.p, batch, SL));
    test::DeviceBuffer<const float*> dslots_in(reversed_slots<const float*>(dstate_in.p, batch, SL));
    cuda::KdaRecurrent a;
    a.n_heads = c.heads, a.head_dim = c.dim, a.batch = batch, a.n = c.ragged ? 0 : c.counts[0];
    a.q = dq.p, a.k = dk.p, a.v = dv.p, a.g = dg.p, a.ld = ld, a.ld_g = c.g_pad < 0 ? 0 : ld_g, a.beta = dbeta.p;
    a.seq_first = c.ragged ? dfirst.p : nullptr, a.state = dslots.p, a.state_in = c.own_in ? dslots_in.p : nullptr;
    a.state_offset = c.offset, a.out = dout.p;
    cuda::kda_recurrent(a, ctx.stream());
    ctx.sync();
    const auto out = dout.get(), st = dstate.get();
    double od = 0, om = 0, sd = 0, sm = 0;
    for (size_t i = 0; i < out.size(); ++i)
      od = std::max(od, double(std::fabs(out[i] - ref_out[i]))), om = std::max(om, double(std::fabs(ref_out[i])));
    for (size_t i = 0; i < st.size(); ++i)
      sd = std::max(sd, double(std::fabs(st[i] - ref_state[i]))), sm = std::max(sm, double(std::fabs(ref_state[i])));
    WARN("KDA heads " << c.heads << " dim " << c.dim << " batch " << batch << " tokens " << rows << ": outputs " << od
                      << " of " << om << ", state " << sd << " of " << sm);
    // fp32 sums of 16-128 terms a step against float64, over up to 45 steps of a contracting recurrence.
    CHECK(od <= 2e-5 * om + 1e-7);
    CHECK(sd <= 2e-5 * sm + 1e-7);
    // Only the layer's part of each slot is written; the input state is only read.
    for (int b = 0; b < batch; ++b) {
      const size_t s0 = size_t(b) * SL;
      CHECK(std::equal(st.begin() + ptrdiff_t(s0), st.begin() + ptrdiff_t(s0 + size_t(c.offset)),
                       state.begin() + ptrdiff_t(s0)));
      CHECK(std::equal(st.begin() + ptrdiff_t(s0 + size_t(c.offset) + SS), st.begin() + ptrdiff_t(s0 + SL),
                       state.begin() + ptrdiff_t(s0 + size_t(c.offset) + SS)));
    }
    if (c.own_in) CHECK(dstate_in.get() == state_in);
  }
  cuda::KdaRecurrent bad;
  bad.n_heads = 4, bad.head_dim = 96, bad.batch = 1, bad.n = 1, bad.ld = 384;
  CHECK_THROWS_WITH(cuda::kda_recurrent(bad, ctx.stream()), Catch::Contains("head_dim 96"));
  bad.head_dim = 64, bad.ld = 256, bad.ld_g = 200;
  CHECK_THROWS_WITH(cuda::kda_recurrent(bad, ctx.stream()), Catch::Contains("g row stride 200"));
#endif
}

TEST_CASE("CUDA KDA short convolution + SiLU matches the CPU backend's over ragged sequences", "[cuda][kimi]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.f, 1.f);
  struct Case {
    int K;
    int64_t channels;
    std::vector<int> counts;  // some below K - 1: the history shifts only partly
    bool in_place;            // hist_in == hist_out
    int64_t max_tokens = 0;   // > 0: the tokens split in chunks across threads
  };
  const std::vector<Case> cases = {
      {4, 300, {5, 1, 0, 2, 13}, false},      {4, 3 * 2 * 16, {3, 2, 1, 0, 9}, true},
      {2, 200, {4, 0, 1, 6}, false},          {2, 130, {1, 3}, true},
      {4, 300, {40, 1, 0, 2, 33}, false, 40}, {4, 96, {70, 0, 17, 2}, true, 100},
      {3, 130, {16, 17, 1}, true, 17},
  };
  for (const Case& c : cases) {
    const int batch = int(c.counts.size());
    const auto first = row_offsets(c.counts);
    INFO("K " << c.K << " channels " << c.channels << " batch " << batch << " in place " << c.in_place << " max tokens "
              << c.max_tokens);
    const int64_t C = c.channels, ld = C + 5, off = 13;
    const size_t rows = size_t(first.back()), HS = size_t(c.K - 1) * size_t(C), SL = size_t(off) + HS + 3;
    std::vector<float> x(rows * size_t(ld)), w(size_t(C) * size_t(c.K)), y(x.size()), hin(SL * size_t(batch)),
        hout(hin.size());
    for (auto* v : {&x, &y, &hin, &hout}) std::generate(v->begin(), v->end(), [&] { return nd(rng); });
    for (auto& v : w) v = 0.5f * nd(rng);
    // Expected: y rows (the gap columns left as they were) and each slot's history replaced.
    std::vector<float> ref_y = y, ref_hist = c.in_place ? hin : hout;
    for (int b = 0; b < batch; ++b) {
      const size_t at = size_t(batch - 1 - b) * SL + size_t(off), r0 = size_t(first[size_t(b)]);
      std::vector<float> hist(hin.begin() + ptrdiff_t(at), hin.begin() + ptrdiff_t(at + HS));
      cpu::short_conv_silu(x.data() + r0 * size_t(ld), c.counts[size_t(b)], C, ld, w.data(), c.K, hist.data(),
                           ref_y.data() + r0 * size_t(ld));
      std::copy(hist.begin(), hist.end(), ref_hist.begin() + ptrdiff_t(at));
    }
    test::DeviceBuffer<float> dx(x), dw(w), dy(y), dhin(hin), dhout(hout);
    test::DeviceBuffer<int32_t> dfirst(first);
    test::DeviceBuffer<const float*> din(reversed_slots<const float*>(dhin.p, batch, SL));
    test::DeviceBuffer<float*> dout(reversed_slots<float*>(c.in_place ? dhin.p : dhout.p, batch, SL));
    cuda::KdaConv a;
    a.channels = C, a.kernel = c.K, a.batch = batch, a.seq_first = dfirst.p, a.x = dx.p, a.ld = ld, a.w = dw.p;
    a.hist_in = din.p, a.hist_out = dout.p, a.hist_offset = off, a.y = dy.p, a.max_tokens = c.max_tokens;
    cuda::kda_short_conv_silu(a, ctx.stream());
    ctx.sync();
    const auto gy = dy.get();
    double worst = 0;
    for (size_t i = 0; i < gy.size(); ++i)
      worst = std::max(worst, std::fabs(double(gy[i]) - ref_y[i]) / (1 + std::fabs(double(ref_y[i]))));
    INFO("worst error of y (relative above 1) " << worst);
    CHECK(worst <= 1e-5);  // fp32 sums of K terms and expf against float64
    // Histories are copies of inputs: exact; the rest of each slot untouched.
    CHECK((c.in_place ? dhin.get() : dhout.get()) == ref_hist);
    if (!c.in_place) CHECK(dhin.get() == hin);
    CHECK(dx.get() == x);
  }
  cuda::KdaConv bad;
  bad.channels = 96, bad.kernel = 9, bad.batch = 1, bad.ld = 96;
  CHECK_THROWS_WITH(cuda::kda_short_conv_silu(bad, ctx.stream()), Catch::Contains("kernel 9"));
  bad.kernel = 4;
  CHECK_THROWS_WITH(cuda::kda_short_conv_silu(bad, ctx.stream()), Catch::Contains("required"));
#endif
}

TEST_CASE("CUDA KDA prepare and output gate match the CPU backend's", "[cuda][kimi]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  std::mt19937 rng(29);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(1.f, 16.f);
  struct Case {
    int heads, dim;
    int64_t rows;
  };
  // Worst elementwise relative error (the rows' gaps, left as they were, compare exactly).
  auto rel = [](const std::vector<float>& got, const std::vector<float>& ref) {
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::fabs(double(got[i]) - ref[i]) / std::max(std::fabs(double(ref[i])), 1e-30));
    return worst;
  };
  for (const Case c : {Case{4, 128, 7}, Case{3, 40, 5}, Case{2, 256, 3}, Case{6, 16, 9}}) {
    INFO("heads " << c.heads << " dim " << c.dim << " rows " << c.rows);
    cpu::KdaDims d;
    d.n_heads = c.heads, d.head_dim = c.dim;
    const int64_t P = d.proj(), ld = P + 4, ld_g = P + 7;
    const size_t rows = size_t(c.rows);
    {
      std::vector<float> q(rows * size_t(ld)), k(q.size()), g(rows * size_t(ld_g)), beta(rows * size_t(c.heads)),
          a_log(size_t(c.heads)), dt_bias(static_cast<size_t>(P));
      for (auto* x : {&q, &k}) std::generate(x->begin(), x->end(), [&] { return nd(rng); });
      for (auto& x : g) x = 4 * nd(rng);  // both sides of softplus's switch
      for (auto& x : beta) x = 3 * nd(rng);
      for (auto& x : a_log) x = std::log(ud(rng));
      for (auto& x : dt_bias) x = nd(rng);
      auto rq = q, rk = k, rg = g, rb = beta;
      cpu::kda_prepare(d, c.rows, rq.data(), rk.data(), ld, rg.data(), ld_g, a_log.data(), dt_bias.data(), rb.data());
      test::DeviceBuffer<float> dq(q), dk(k), dg(g), dbeta(beta), da(a_log), ddt(dt_bias);
      cuda::kda_prepare(c.heads, c.dim, c.rows, dq.p, dk.p, ld, dg.p, ld_g, da.p, ddt.p, dbeta.p, ctx.stream());
      ctx.sync();
      const double eq = rel(dq.get(), rq), ek = rel(dk.get(), rk), eg = rel(dg.get(), rg), eb = rel(dbeta.get(), rb);
      INFO("worst relative error q " << eq << ", k " << ek << ", g " << eg << ", beta " << eb);
      // fp32 sums of up to 256 squares, fp32 exp / log1p, against float64.
      CHECK(eq <= 1e-5);
      CHECK(ek <= 1e-5);
      CHECK(eg <= 1e-5);
      CHECK(eb <= 1e-5);
    }
    for (const float eps : {1e-5f, 1e-6f}) {
      const int64_t ld_gate = P + 6;
      std::vector<float> o(rows * size_t(P)), gate(rows * size_t(ld_gate)), w(size_t(c.dim));
      std::generate(o.begin(), o.end(), [&] { return nd(rng); });
      for (auto& x : gate) x = 2 * nd(rng);
      for (auto& x : w) x = 1 + 0.3f * nd(rng);
      // The CPU's gate is [rows, H*D] contiguous.
      std::vector<float> ref = o, gate_c(rows * size_t(P));
      for (size_t r = 0; r < rows; ++r)
        std::copy_n(gate.begin() + ptrdiff_t(r * size_t(ld_gate)), P, gate_c.begin() + ptrdiff_t(r * size_t(P)));
      cpu::kda_output_gate(d, c.rows, ref.data(), gate_c.data(), w.data(), eps);
      test::DeviceBuffer<float> dout_f(o), dgate(gate), dw(w);
      test::DeviceBuffer<uint16_t> dout(o.size());
      cuda::kda_output_gate(c.heads, c.dim, c.rows, dout_f.p, dgate.p, ld_gate, dw.p, eps, dout.p, ctx.stream());
      ctx.sync();
      const auto got = dout.get();
      // bf16 bits as ordered integers: adjacent values (across zero too) differ by 1.
      auto ord = [](uint16_t b) { return b & 0x8000 ? -int(b & 0x7fff) : int(b); };
      int bad = 0, worst_ulp = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const int ulp = std::abs(ord(got[i]) - ord(test::f32_to_bf16(ref[i])));
        worst_ulp = std::max(worst_ulp, ulp);
        bad += ulp > 1 && std::fabs(test::bf16_to_double(got[i]) - ref[i]) > 1e-2 * std::fabs(ref[i]);
      }
      INFO("eps " << eps << ": worst distance from the CPU's rounded value " << worst_ulp << " bf16 ulp");
      CHECK(bad == 0);
    }
  }
  CHECK_THROWS_WITH(
      cuda::kda_prepare(2, 300, 1, nullptr, nullptr, 600, nullptr, 600, nullptr, nullptr, nullptr, ctx.stream()),
      Catch::Contains("head_dim 300"));
  CHECK_THROWS_WITH(cuda::kda_output_gate(2, 64, 1, nullptr, nullptr, 100, nullptr, 1e-5f, nullptr, ctx.stream()),
                    Catch::Contains("gate row stride 100"));
#endif
}
