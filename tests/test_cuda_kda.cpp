// GPU test of the KDA recurrence (cuda/kda.h) against the CPU backend's
// cpu::kda_recurrent (float64 sums) ([cuda][kimi]; skips with a message where
// no CUDA device is present): several sequences with their own states and
// inputs, a decode step and a run of tokens, both head sizes.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "cpu/kda.h"

#ifdef DZ_WITH_CUDA
#include "cuda/kda.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#endif

#include "support/gpu.h"

TEST_CASE("CUDA KDA recurrence matches the CPU backend's, state and outputs", "[cuda][kimi]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  struct Case {
    int heads, dim, batch;
    int64_t n;
  };
  for (const Case c : {Case{4, 128, 3, 1}, Case{4, 128, 2, 45}, Case{32, 128, 1, 3}, Case{6, 64, 5, 17}}) {
    INFO("heads " << c.heads << " dim " << c.dim << " batch " << c.batch << " tokens " << c.n);
    cpu::KdaDims d;
    d.n_heads = c.heads, d.head_dim = c.dim;
    const size_t P = size_t(d.proj()), SS = size_t(c.heads) * c.dim * c.dim, rows = size_t(c.batch) * size_t(c.n);
    const int64_t ld = int64_t(P) + 8;  // rows with a gap, as a model's fused projections leave
    std::vector<float> q(rows * size_t(ld)), k(q.size()), v(q.size()), g(q.size()), beta(rows * size_t(c.heads));
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
    // Each sequence starts from its own random state (a continued conversation).
    std::vector<float> state(SS * size_t(c.batch));
    for (auto& x : state) x = 0.3f * nd(rng);
    std::vector<float> ref_state = state, ref_out(rows * P);
    for (int b = 0; b < c.batch; ++b) {
      const size_t r0 = size_t(b) * size_t(c.n);
      cpu::kda_recurrent(d, q.data() + r0 * size_t(ld), k.data() + r0 * size_t(ld), v.data() + r0 * size_t(ld), ld,
                         g.data() + r0 * size_t(ld), ld, beta.data() + r0 * size_t(c.heads), c.n,
                         ref_state.data() + size_t(b) * SS, ref_out.data() + r0 * P, nullptr);
    }
    test::DeviceBuffer<float> dq(q), dk(k), dv(v), dg(g), dbeta(beta), dstate(state), dout(rows * P);
    // State slots in reverse order: each sequence reads its own through the pointer table.
    std::vector<float*> slots(static_cast<size_t>(c.batch));
    for (int b = 0; b < c.batch; ++b) slots[size_t(b)] = dstate.p + size_t(b) * SS;
    test::DeviceBuffer<float*> dslots(slots);
    cuda::KdaRecurrent a;
    a.n_heads = c.heads, a.head_dim = c.dim, a.batch = c.batch, a.n = c.n, a.q = dq.p, a.k = dk.p, a.v = dv.p;
    a.g = dg.p, a.ld = ld, a.beta = dbeta.p, a.state = dslots.p, a.out = dout.p;
    cuda::kda_recurrent(a, ctx.stream());
    ctx.sync();
    const auto out = dout.get(), st = dstate.get();
    double od = 0, om = 0, sd = 0, sm = 0;
    for (size_t i = 0; i < out.size(); ++i)
      od = std::max(od, double(std::fabs(out[i] - ref_out[i]))), om = std::max(om, double(std::fabs(ref_out[i])));
    for (size_t i = 0; i < st.size(); ++i)
      sd = std::max(sd, double(std::fabs(st[i] - ref_state[i]))), sm = std::max(sm, double(std::fabs(ref_state[i])));
    WARN("KDA heads " << c.heads << " dim " << c.dim << " batch " << c.batch << " tokens " << c.n << ": outputs " << od
                      << " of " << om << ", state " << sd << " of " << sm);
    // fp32 sums of 64-128 terms a step against float64, over up to 45 steps of a contracting recurrence.
    CHECK(od <= 2e-5 * om + 1e-7);
    CHECK(sd <= 2e-5 * sm + 1e-7);
  }
  cuda::KdaRecurrent bad;
  bad.n_heads = 4, bad.head_dim = 96, bad.batch = 1, bad.n = 1, bad.ld = 384;
  CHECK_THROWS_WITH(cuda::kda_recurrent(bad, ctx.stream()), Catch::Contains("head_dim 96"));
#endif
}
