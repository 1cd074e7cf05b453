// GPU test of the DSA lightning indexer (cuda/dsa_indexer.h) against the CPU
// backend's FP8 indexer and a float64 recomputation ([cuda]; skips with a
// message where no CUDA device is present). Keys in paged records (shuffled
// pages, a field offset inside each record), several sequences in one batch,
// decode and causal prefill, exact ties, fewer visible positions than k.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/fp8.h"
#include "cpu/indexer.h"

#ifdef DZ_WITH_CUDA
#include "cuda/dsa_indexer.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#endif

#include "support/gpu.h"

#ifdef DZ_WITH_CUDA
namespace {

struct Case {
  int H, D, k;
  bool pow2;
  std::vector<int64_t> seq_len;  // keys cached a sequence
  int prefill;  // the last sequence's last `prefill` positions are queries (causal), else one query a sequence
};

// One query's reference: scores over its visible keys in float64 from the
// E4M3 values both sides encode (the CPU's encoder), and an error bound for
// fp32 sums of exact products.
struct Ref {
  std::vector<double> score, bound;
};

}  // namespace
#endif

TEST_CASE("CUDA DSA indexer: scores match float64, selections match the CPU indexer up to near-ties", "[cuda][dsa]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  const std::vector<Case> cases = {
      {64, 128, 2048, false, {5000, 1500, 2048, 2049}, 0},  // V3.2's indexer: decode, four sequences
      {64, 128, 2048, true, {3000}, 200},                   // prefill, power-of-two scales
      {16, 64, 64, false, {700, 40}, 0},                    // small heads; a sequence shorter than k
      {32, 32, 16, true, {333}, 333},                       // the whole prompt, every query causal
      {128, 64, 128, false, {1500, 77}, 0},                 // 128 heads: two runs of 64 a key run
      {80, 128, 256, false, {1100}, 0},                     // 80 heads: a run of 64, then one of 16
      {64, 128, 256, false, {1000}, 1000},                  // a whole prompt: partial key tiles and query chunks
  };
  std::mt19937 rng(7);
  for (const Case& c : cases) {
    INFO("H " << c.H << " D " << c.D << " k " << c.k << " pow2 " << c.pow2);
    cpu::IndexerConfig cfg;
    cfg.n_heads = c.H, cfg.head_dim = c.D, cfg.topk = c.k, cfg.mode = cpu::IndexerMode::Fp8, cfg.pow2_scales = c.pow2;
    const size_t kb = cpu::indexer_key_bytes(cfg);
    const size_t offset = 40, stride = (offset + kb + 12 + 3) / 4 * 4;  // the key between other fields
    const uint32_t pt = 64;
    const int S = int(c.seq_len.size());
    // Pages: every sequence's, shuffled over one device arena.
    std::vector<int> first_page(size_t(S) + 1, 0);
    for (int s = 0; s < S; ++s)
      first_page[size_t(s) + 1] = first_page[size_t(s)] + int((c.seq_len[size_t(s)] + pt - 1) / pt);
    const int P = first_page.back();
    std::vector<int> perm(static_cast<size_t>(P));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const size_t page_bytes = size_t(pt) * stride;
    std::vector<uint8_t> arena(size_t(P) * page_bytes);
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& b : arena) b = uint8_t(byte(rng));  // other fields: noise the kernels must not read as keys
    // Keys: normal, some scaled far up or down (scale spread), some exact copies of an earlier key (ties).
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_int_distribution<int> kind(0, 19);
    std::vector<std::vector<float>> keys(static_cast<size_t>(S));
    for (int s = 0; s < S; ++s) {
      const int64_t L = c.seq_len[size_t(s)];
      keys[size_t(s)].resize(size_t(L) * c.D);
      for (int64_t j = 0; j < L; ++j) {
        float* k = keys[size_t(s)].data() + j * c.D;
        const int kd = kind(rng);
        if (kd == 0 && j > 0) {
          std::memcpy(k, keys[size_t(s)].data() + (j / 2) * c.D, sizeof(float) * c.D);
          continue;
        }
        const float m = kd == 1 ? 1e-3f : kd == 2 ? 40.f : 1.f;
        for (int d = 0; d < c.D; ++d) k[d] = m * nd(rng);
      }
    }
    auto record = [&](std::vector<uint8_t>& ar, int s, int64_t j) {
      return ar.data() + size_t(perm[size_t(first_page[size_t(s)] + int(j / pt))]) * page_bytes +
             size_t(j % pt) * stride + offset;
    };
    std::vector<uint8_t> host_encoded = arena;
    for (int s = 0; s < S; ++s)
      for (int64_t j = 0; j < c.seq_len[size_t(s)]; ++j)
        cpu::indexer_encode_key(cfg, keys[size_t(s)].data() + j * c.D, record(host_encoded, s, j));

    // The device arena (noise), keys encoded there by the GPU.
    test::DeviceBuffer<uint8_t> dar(arena);
    std::vector<uint8_t*> page_ptr(static_cast<size_t>(P));
    for (int s = 0; s < S; ++s)
      for (int p = first_page[size_t(s)]; p < first_page[size_t(s) + 1]; ++p)
        page_ptr[size_t(p)] = dar.p + size_t(perm[size_t(p)]) * page_bytes;
    test::DeviceBuffer<uint8_t*> dpages(page_ptr);
    cuda::IndexerKeys ik{pt, stride, offset};
    for (int s = 0; s < S; ++s) {
      const int64_t L = c.seq_len[size_t(s)];
      std::vector<int64_t> pos(static_cast<size_t>(L));
      std::iota(pos.begin(), pos.end(), int64_t(0));
      std::shuffle(pos.begin(), pos.end(), rng);  // any order of positions
      std::vector<float> kin(size_t(L) * c.D);
      for (int64_t j = 0; j < L; ++j)
        std::memcpy(kin.data() + j * c.D, keys[size_t(s)].data() + pos[size_t(j)] * c.D, sizeof(float) * c.D);
      test::DeviceBuffer<int64_t> dpos(pos);
      test::DeviceBuffer<float> dk(kin);
      cuda::indexer_encode_keys(c.D, c.pow2, dk.p, L, dpos.p, dpages.p + first_page[size_t(s)], ik, ctx.stream());
      ctx.sync();
    }
    // The GPU's key bytes are the CPU encoder's, bit for bit (and nothing else in the records moved).
    REQUIRE(dar.get() == host_encoded);

    // Queries: one a sequence (decode, seeing every key) or, with prefill, the last sequence's last positions.
    std::vector<int> q_seq;
    std::vector<int64_t> q_vis;
    if (c.prefill)
      for (int64_t p = c.seq_len.back() - c.prefill; p < c.seq_len.back(); ++p)
        q_seq.push_back(S - 1), q_vis.push_back(p + 1);
    else
      for (int s = 0; s < S; ++s) q_seq.push_back(s), q_vis.push_back(c.seq_len[size_t(s)]);
    const int64_t nq = int64_t(q_seq.size());
    std::vector<float> q(size_t(nq) * c.H * c.D), w(size_t(nq) * c.H);
    for (auto& v : q) v = nd(rng);
    for (auto& v : w) v = nd(rng);  // negative head weights too
    std::vector<const uint8_t* const*> qpages(static_cast<size_t>(nq));
    for (int64_t i = 0; i < nq; ++i) qpages[size_t(i)] = dpages.p + first_page[size_t(q_seq[size_t(i)])];
    const int64_t maxv = *std::max_element(q_vis.begin(), q_vis.end());
    test::DeviceBuffer<float> dq(q), dw(w), dscores(size_t(nq) * size_t(maxv));
    test::DeviceBuffer<const uint8_t* const*> dqp(qpages);
    test::DeviceBuffer<int64_t> dvis(q_vis);
    test::DeviceBuffer<int32_t> dout(size_t(nq) * c.k);
    cuda::IndexerQueries a;
    a.n_heads = c.H, a.head_dim = c.D, a.topk = c.k, a.pow2_scales = c.pow2, a.n_q = nq;
    a.q = dq.p, a.w = dw.p, a.pages = dqp.p, a.n_visible = dvis.p, a.max_visible = maxv, a.keys = ik;
    a.out = dout.p, a.scores = dscores.p;
    a.same_pages = c.prefill > 0;  // one prompt: the tensor-core scores at 64 heads of 128
    const int64_t qblock = 48;     // several query blocks in the prefill cases
    test::DeviceBuffer<uint8_t> scratch(cuda::indexer_scratch_bytes(a, qblock));
    cuda::indexer_select(a, scratch.p, scratch.n, qblock, ctx.stream());
    ctx.sync();
    const auto gpu_sel = dout.get();
    const auto gpu_scores = dscores.get();
    // Reruns give the same bits; so does the scratch-only form (no scores out) with one query block.
    cuda::indexer_select(a, scratch.p, scratch.n, qblock, ctx.stream());
    ctx.sync();
    CHECK(dout.get() == gpu_sel);
    {
      cuda::IndexerQueries b = a;
      b.scores = nullptr;
      test::DeviceBuffer<uint8_t> scratch2(cuda::indexer_scratch_bytes(b, nq));
      test::DeviceBuffer<int32_t> dout2(size_t(nq) * c.k);
      b.out = dout2.p;
      cuda::indexer_select(b, scratch2.p, scratch2.n, nq, ctx.stream());
      ctx.sync();
      CHECK(dout2.get() == gpu_sel);
    }

    // The CPU indexer on the host records.
    std::vector<int32_t> cpu_sel(size_t(nq) * c.k);
    std::vector<const uint8_t*> hpages(static_cast<size_t>(P));
    for (int p = 0; p < P; ++p) hpages[size_t(p)] = host_encoded.data() + size_t(perm[size_t(p)]) * page_bytes;
    for (int64_t i = 0; i < nq; ++i) {
      cpu::PagedRows rows{hpages.data() + first_page[size_t(q_seq[size_t(i)])], pt, stride, offset};
      cpu::indexer_select(cfg, q.data() + i * c.H * c.D, w.data() + i * c.H, 1, &q_vis[size_t(i)], rows, {},
                          cpu_sel.data() + i * c.k, nullptr, nullptr);
    }

    // float64 scores from the encoded bytes; fp32 sums of 32 exact products per MMA, then a
    // 2^-12 relative bound of the sum of magnitudes (Hopper's FP8 MMA accumulates in reduced precision).
    const double hs = 1.0 / std::sqrt(double(c.H)), ds = 1.0 / std::sqrt(double(c.D));
    double worst = 0;
    int64_t ties_resolved = 0, near_tie_swaps = 0;
    for (int64_t i = 0; i < nq; ++i) {
      const int s = q_seq[size_t(i)];
      const int64_t V = q_vis[size_t(i)];
      std::vector<uint8_t> q8(size_t(c.H) * (c.D + 4));
      for (int h = 0; h < c.H; ++h)
        cpu::indexer_encode_key(cfg, q.data() + (i * c.H + h) * c.D, q8.data() + h * (c.D + 4));
      Ref r;
      r.score.resize(size_t(V)), r.bound.resize(size_t(V));
      for (int64_t j = 0; j < V; ++j) {
        const uint8_t* kr = record(host_encoded, s, j);
        float ks;
        std::memcpy(&ks, kr + c.D, 4);
        double acc = 0, mag = 0;
        for (int h = 0; h < c.H; ++h) {
          const uint8_t* qh = q8.data() + h * (c.D + 4);
          float qs;
          std::memcpy(&qs, qh + c.D, 4);
          double dot = 0, am = 0;
          for (int d = 0; d < c.D; ++d) {
            const double p = double(cpu::e4m3_to_f32(qh[d])) * double(cpu::e4m3_to_f32(kr[d]));
            dot += p, am += std::fabs(p);
          }
          const double f = double(w[size_t(i * c.H + h)]) * hs * ds * double(qs) * double(ks);
          if (dot > 0) acc += f * dot;
          mag += std::fabs(f) * am;
        }
        r.score[size_t(j)] = acc, r.bound[size_t(j)] = mag * 0x1p-12 + 1e-30;
        const double g = gpu_scores[size_t(i * maxv + j)];
        worst = std::max(worst, std::fabs(g - acc) / r.bound[size_t(j)]);
        if (std::fabs(g - acc) > r.bound[size_t(j)]) {
          INFO("query " << i << " key " << j << " gpu " << g << " ref " << acc << " bound " << r.bound[size_t(j)]);
          REQUIRE(std::fabs(g - acc) <= r.bound[size_t(j)]);
        }
      }
      // Selections: ascending, -1-padded, and the CPU's set but for swaps across the k-th score within the bounds.
      const int32_t* gs = gpu_sel.data() + i * c.k;
      const int32_t* cs = cpu_sel.data() + i * c.k;
      const int64_t want = std::min<int64_t>(V, c.k);
      for (int j = 0; j < c.k; ++j) {
        if (j < want) {
          REQUIRE(gs[j] >= 0);
          REQUIRE(gs[j] < V);
          if (j) REQUIRE(gs[j] > gs[j - 1]);
        } else {
          REQUIRE(gs[j] == -1);
        }
      }
      std::vector<int32_t> only_gpu, only_cpu;
      std::set_difference(gs, gs + want, cs, cs + want, std::back_inserter(only_gpu));
      std::set_difference(cs, cs + want, gs, gs + want, std::back_inserter(only_cpu));
      REQUIRE(only_gpu.size() == only_cpu.size());
      if (want == c.k && V > c.k) {
        // The k-th largest reference score; every swapped position lies within its bound of it.
        std::vector<double> sorted(r.score);
        std::nth_element(sorted.begin(), sorted.begin() + (c.k - 1), sorted.end(), std::greater<double>());
        const double kth = sorted[size_t(c.k - 1)];
        const double max_bound = *std::max_element(r.bound.begin(), r.bound.end());
        for (const auto* v : {&only_gpu, &only_cpu})
          for (int32_t j : *v) {
            INFO("query " << i << " swapped position " << j << " ref " << r.score[size_t(j)] << " k-th " << kth);
            REQUIRE(std::fabs(r.score[size_t(j)] - kth) <= 2 * max_bound);
          }
        near_tie_swaps += int64_t(only_gpu.size());
      }
      ties_resolved += int64_t(want);
    }
    WARN("H " << c.H << " D " << c.D << " k " << c.k << ": " << nq << " queries, worst score error " << worst
              << " of its bound, " << near_tie_swaps << " near-tie swaps of " << ties_resolved << " selected");
  }
#endif
}

TEST_CASE("CUDA DSA top-k: exact against a sort on adversarial rows", "[cuda][dsa]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(96) << 20));  // the context's cuBLASLt workspace included
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // One row of n scores of a kind.
  auto make_row = [&](int kind, int64_t n) {
    std::vector<float> r(static_cast<size_t>(n));
    std::uniform_int_distribution<int> small(0, 2), pick(0, 99);
    for (auto& v : r) {
      switch (kind) {
        case 0:  // both signs
          v = nd(rng);
          break;
        case 1:  // one sign, spread exponents
          v = std::fabs(nd(rng)) * std::exp2(float(pick(rng) % 12));
          break;
        case 2:  // huge exact ties at the threshold
          v = float(small(rng));
          break;
        case 3:  // every score equal
          v = 0.75f;
          break;
        case 4: {  // NaN, infinities, signed zeros among normals
          const int p = pick(rng);
          v = p < 10 ? nan : p < 12 ? inf : p < 14 ? -inf : p < 20 ? 0.f : p < 26 ? -0.f : nd(rng);
          break;
        }
        case 5:  // fewer valid scores than k
          v = pick(rng) < 97 ? nan : nd(rng);
          break;
        default:  // close values: a deep threshold
          v = 1e-3f * float(small(rng)) + 1e-9f * nd(rng);
      }
    }
    return r;
  };
  struct Batch {
    int k;
    std::vector<int64_t> n;  // each row's visible count
    int64_t max_visible;
    std::vector<int> kinds;
  };
  const std::vector<Batch> batches = {
      {2048, {65536}, 65536, {0}},                      // decode at 64K: a cluster of blocks, keys in shared memory
      {2048, {65536, 65536, 40000}, 65536, {1, 2, 4}},  // a few rows
      {2048, {500000}, 500000, {6}},                    // past shared memory: passes read the scores again
      {512, {3000, 512, 513, 511, 0, 1, 5000}, 4000, {0, 3, 2, 1, 0, 4, 5}},  // around k; rows past max_visible
      {64, std::vector<int64_t>(150, 2000), 2000, {0, 1, 2, 3, 4, 5, 6}},     // a prefill-like batch, one block a row
      {2048, std::vector<int64_t>(40, 20000), 20000, {1, 6, 2}},              // clusters of two blocks
      {100, std::vector<int64_t>(10, 6000), 6000, {4, 6, 0}},                 // clusters of two 256-thread blocks
  };
  for (const Batch& bt : batches) {
    const int64_t nq = int64_t(bt.n.size()), ld = bt.max_visible + 3;
    INFO("k " << bt.k << " rows " << nq << " max_visible " << bt.max_visible);
    std::vector<float> scores(size_t(nq * ld), 123.f);  // past a row's visible part: ignored
    for (int64_t i = 0; i < nq; ++i) {
      const auto r = make_row(bt.kinds[size_t(i) % bt.kinds.size()], std::min(bt.n[size_t(i)], bt.max_visible));
      std::copy(r.begin(), r.end(), scores.begin() + i * ld);
    }
    test::DeviceBuffer<float> ds(scores);
    test::DeviceBuffer<int64_t> dn(bt.n);
    test::DeviceBuffer<int32_t> dout(size_t(nq) * bt.k);
    cuda::indexer_topk(ds.p, ld, nq, dn.p, bt.max_visible, bt.k, dout.p, ctx.stream());
    ctx.sync();
    const auto got = dout.get();
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t n = std::min(bt.n[size_t(i)], bt.max_visible);
      const float* r = scores.data() + i * ld;
      std::vector<int32_t> idx;
      for (int64_t j = 0; j < n; ++j)
        if (!std::isnan(r[j])) idx.push_back(int32_t(j));
      const size_t take = std::min(idx.size(), size_t(bt.k));
      std::partial_sort(idx.begin(), idx.begin() + std::ptrdiff_t(take), idx.end(), [&](int32_t x, int32_t y) {
        return r[x] > r[y] || (r[x] == r[y] && x < y);  // -0 == +0: one value, the lower position first
      });
      idx.resize(take);
      std::sort(idx.begin(), idx.end());
      idx.resize(size_t(bt.k), -1);
      const std::vector<int32_t> g(got.begin() + i * bt.k, got.begin() + (i + 1) * bt.k);
      INFO("row " << i << " n " << n);
      REQUIRE(g == idx);
    }
  }
#endif
}

TEST_CASE("CUDA DSA indexer: bad shapes and records are refused by name", "[cuda][dsa]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  dz::cuda::IndexerQueries a;
  a.n_heads = 64, a.head_dim = 128, a.topk = 2048, a.keys = {64, 132, 0};
  CHECK_NOTHROW(dz::cuda::indexer_validate(a));
  auto refused = [](dz::cuda::IndexerQueries b, const char* what) {
    try {
      dz::cuda::indexer_validate(b);
      FAIL("accepted: " << what);
    } catch (const dz::Error& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  auto b = a;
  b.n_heads = 24;
  refused(b, "index_n_heads");
  b = a, b.head_dim = 96;
  refused(b, "index_head_dim");
  b = a, b.keys.stride = 130;
  refused(b, "alignment");
  b = a, b.keys.offset = 8;
  refused(b, "overruns");
#endif
}
