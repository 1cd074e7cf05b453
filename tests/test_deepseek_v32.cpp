// DeepSeek-V3.2 on the CPU backend: the FP8 weight format, the running top-k,
// the lightning indexer (exact and FP8 modes, streaming memory bound), MLA
// (absorbed decode vs expanded prefill vs a direct reference), and the whole
// model against transformers' float32 outputs for the tiny fixtures
// (tests/data/deepseek_v32_{bf16,fp8,mxfp4}, made by
// tools/reference/deepseek_v32_fixtures.py).
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu/fp8.h"
#include "cpu/indexer.h"
#include "cpu/mla.h"
#include "cpu/topk.h"

namespace {

std::vector<float> randn(size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// A toy page table: `n` token records of `stride` bytes spread over pages in a
// shuffled order, so any position arithmetic bug shows up.
struct ToyPages {
  uint32_t page_tokens;
  size_t stride;
  std::vector<std::vector<uint8_t>> storage;
  std::vector<const uint8_t*> table;
  ToyPages(int64_t n, uint32_t pt, size_t stride_bytes, std::mt19937& rng) : page_tokens(pt), stride(stride_bytes) {
    const size_t pages = size_t((n + pt - 1) / pt);
    storage.resize(pages, std::vector<uint8_t>(pt * stride));
    std::vector<size_t> order(pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t p : order) table.push_back(storage[p].data());
  }
  uint8_t* at(int64_t pos) {
    return const_cast<uint8_t*>(table[size_t(pos) / page_tokens]) + size_t(pos) % page_tokens * stride;
  }
  dz::cpu::PagedRows rows(size_t offset = 0) const { return {table.data(), page_tokens, stride, offset}; }
};

}  // namespace

TEST_CASE("E4M3 decodes every byte exactly and rounds to nearest even", "[deepseek]") {
  using namespace dz::cpu;
  CHECK(e4m3_to_f32(0x00) == 0.0f);
  CHECK(e4m3_to_f32(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(e4m3_to_f32(0x08) == std::ldexp(1.0f, -6));  // smallest normal
  CHECK(e4m3_to_f32(0x38) == 1.0f);
  CHECK(e4m3_to_f32(0x7E) == 448.0f);
  CHECK(e4m3_to_f32(0xFE) == -448.0f);
  CHECK(std::isnan(e4m3_to_f32(0x7F)));
  CHECK(std::isnan(e4m3_to_f32(0xFF)));
  // Independent definition: value = (-1)^s * 2^(e-7) * (1 + m/8), subnormal 2^-6 * m/8.
  std::vector<float> finite;
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    const int e = (b >> 3) & 15, m = b & 7;
    const double v = (e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6)) * ((b & 0x80) ? -1 : 1);
    REQUIRE(double(e4m3_to_f32(uint8_t(b))) == v);
    if (b != 0x80) CHECK(f32_to_e4m3(float(v)) == b);  // round trip (-0 encodes as 0x80 only from -0.0f)
    finite.push_back(float(v));
  }
  // Rounding: brute-force nearest (ties to the even mantissa) over random and midpoint inputs.
  std::mt19937 rng(7);
  std::vector<float> xs = randn(2000, rng, 40.0f);
  for (size_t i = 0; i + 1 < finite.size(); ++i) xs.push_back(0.5f * (finite[i] + finite[i + 1]));
  xs.push_back(1000.0f);
  xs.push_back(-500.0f);
  for (float x : xs) {
    const float y = e4m3_to_f32(f32_to_e4m3(x));
    const float c = std::clamp(x, -448.0f, 448.0f);
    double best = 1e300;
    for (float f : finite) best = std::min(best, std::fabs(double(f) - double(c)));
    INFO("x = " << x << " -> " << y);
    REQUIRE(std::fabs(double(y) - double(c)) == best);
    if (std::fabs(double(y) - double(c)) > 0 && best == std::fabs(double(y) - double(c))) {
      // On an exact tie the chosen byte has an even mantissa.
      const uint8_t b = f32_to_e4m3(x);
      bool tie = false;
      for (float f : finite)
        if (f != y && std::fabs(double(f) - double(c)) == best) tie = true;
      if (tie) CHECK((b & 1) == 0);
    }
  }
}

TEST_CASE("FP8 128x128 block-scaled rows decode with partial blocks", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(11);
  const int64_t rows = 200, cols = 300;  // 2 x 3 blocks, both last blocks partial
  std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
  for (auto& b : q) {
    b = uint8_t(rng() & 0xFF);
    if ((b & 0x7F) == 0x7F) b = 0x10;
  }
  const std::vector<float> s = randn(2 * 3, rng);
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t n : {0, 127, 128, 199}) {
    fp8_block_decode_row(q.data(), s.data(), n, cols, row.data());
    for (int64_t k = 0; k < cols; ++k)
      REQUIRE(row[size_t(k)] == e4m3_to_f32(q[size_t(n * cols + k)]) * s[size_t((n / 128) * 3 + k / 128)]);
  }
  // Quantising a block: scale = amax / 448 (or its power-of-two ceiling), error within half an E4M3 step.
  const std::vector<float> v = randn(128, rng, 3.0f);
  std::vector<uint8_t> out(128);
  for (bool p2 : {false, true}) {
    const float sc = fp8_quantize_block(v.data(), 128, p2, out.data());
    float amax = 0;
    for (float x : v) amax = std::max(amax, std::fabs(x));
    if (p2) {
      CHECK(sc >= amax / 448.0f);
      CHECK(sc < 2 * amax / 448.0f);
      CHECK(std::exp2(std::round(std::log2(sc))) == sc);
    } else {
      CHECK(sc == amax / 448.0f);
    }
    for (size_t i = 0; i < v.size(); ++i)
      REQUIRE(std::fabs(e4m3_to_f32(out[i]) * sc - v[i]) <= std::fabs(v[i]) / 16 + std::ldexp(sc, -10));
  }
}

TEST_CASE("Running top-k matches a full sort, ties to the lower index, pads with -1", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const int n = int(rng() % 300), k = 1 + int(rng() % 40);
    std::vector<float> s(static_cast<size_t>(n));
    for (auto& x : s) x = float(int(rng() % 50)) * 0.25f;  // many ties
    std::vector<int32_t> out(static_cast<size_t>(k));
    const int got = topk_row(s.data(), n, k, out.data());
    std::vector<int32_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return s[size_t(a)] > s[size_t(b)]; });
    idx.resize(size_t(std::min(n, k)));
    std::sort(idx.begin(), idx.end());
    REQUIRE(got == std::min(n, k));
    for (int j = 0; j < k; ++j) REQUIRE(out[size_t(j)] == (j < got ? idx[size_t(j)] : -1));
  }
  // NaN is never selected.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> s = {1.0f, nan, 3.0f};
  std::vector<int32_t> out(3);
  CHECK(topk_row(s.data(), 3, 3, out.data()) == 2);
  CHECK(out == std::vector<int32_t>{0, 2, -1});
}

TEST_CASE("Hadamard rotation is orthonormal", "[deepseek]") {
  std::mt19937 rng(5);
  for (int n : {1, 2, 64, 128}) {
    const std::vector<float> a = randn(size_t(n), rng), b = randn(size_t(n), rng);
    std::vector<float> ha = a, hb = b;
    dz::cpu::hadamard(ha.data(), n);
    dz::cpu::hadamard(hb.data(), n);
    double d0 = 0, d1 = 0;
    for (int i = 0; i < n; ++i) d0 += double(a[size_t(i)]) * b[size_t(i)], d1 += double(ha[size_t(i)]) * hb[size_t(i)];
    CHECK(std::fabs(d0 - d1) < 1e-4 * (1 + std::fabs(d0)));
    dz::cpu::hadamard(ha.data(), n);  // its own inverse
    for (int i = 0; i < n; ++i) REQUIRE(std::fabs(ha[size_t(i)] - a[size_t(i)]) < 1e-5);
  }
}

namespace {

// Direct scoring, fp64 over a dense key array: the definition, not the engine.
std::vector<double> reference_scores(const float* q, const float* w, int H, int D, const std::vector<float>& keys,
                                     int64_t n) {
  std::vector<double> s(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    double acc = 0;
    for (int h = 0; h < H; ++h) {
      double d = 0;
      for (int i = 0; i < D; ++i) d += double(q[h * D + i]) * keys[size_t(j * D + i)];
      acc += double(w[h]) / std::sqrt(double(H)) * std::max(0.0, d / std::sqrt(double(D)));
    }
    s[size_t(j)] = acc;
  }
  return s;
}

// A selection is a correct top-k when it has min(k, n) distinct visible
// positions and nothing left out scores above anything kept (up to tol).
void check_topk(const int32_t* sel, int k, const std::vector<double>& s, double tol) {
  const int64_t n = int64_t(s.size());
  const int want = int(std::min<int64_t>(k, n));
  std::set<int32_t> kept;
  double lowest = 1e300;
  for (int j = 0; j < k; ++j) {
    if (j >= want) {
      REQUIRE(sel[j] == -1);
      continue;
    }
    REQUIRE(sel[j] >= 0);
    REQUIRE(sel[j] < n);
    if (j) REQUIRE(sel[j] > sel[j - 1]);
    kept.insert(sel[j]);
    lowest = std::min(lowest, s[size_t(sel[j])]);
  }
  for (int64_t p = 0; p < n; ++p)
    if (!kept.count(int32_t(p))) REQUIRE(s[size_t(p)] <= lowest + tol);
}

// One vector as the FP8 mode holds it, in fp64: rotated (Hadamard), quantised
// to E4M3 with one scale per min(D, 128) dims, dequantised exactly.
std::vector<double> fp8_dequantised(const float* v, int D, bool pow2) {
  using namespace dz::cpu;
  const int blk = std::min(D, 128);
  std::vector<float> r(v, v + D);
  hadamard(r.data(), D);
  std::vector<uint8_t> b(static_cast<size_t>(blk));
  std::vector<double> out(static_cast<size_t>(D));
  for (int o = 0; o < D; o += blk) {
    const double sc = fp8_quantize_block(r.data() + o, blk, pow2, b.data());
    for (int j = 0; j < blk; ++j) out[size_t(o + j)] = double(e4m3_to_f32(b[size_t(j)])) * sc;
  }
  return out;
}

// The defining sum over given representations of q (per head) and the keys.
std::vector<double> scores_of(const std::vector<std::vector<double>>& qh, const float* w,
                              const std::vector<std::vector<double>>& keys, int64_t n) {
  const int H = int(qh.size()), D = int(qh[0].size());
  std::vector<double> s(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    double acc = 0;
    for (int h = 0; h < H; ++h) {
      double d = 0;
      for (int i = 0; i < D; ++i) d += qh[size_t(h)][size_t(i)] * keys[size_t(j)][size_t(i)];
      acc += double(w[h]) / std::sqrt(double(H)) * std::max(0.0, d / std::sqrt(double(D)));
    }
    s[size_t(j)] = acc;
  }
  return s;
}

// The FP8 mode's scores evaluated in fp64: only the number format differs from reference_scores.
std::vector<double> fp8_reference_scores(const float* q, const float* w, int H, int D, bool pow2,
                                         const std::vector<float>& keys, int64_t n) {
  std::vector<std::vector<double>> qh, kd;
  for (int h = 0; h < H; ++h) qh.push_back(fp8_dequantised(q + h * D, D, pow2));
  for (int64_t j = 0; j < n; ++j) kd.push_back(fp8_dequantised(keys.data() + j * D, D, pow2));
  return scores_of(qh, w, kd, n);
}

struct IndexerCase {
  int H = 4, D = 64, K = 16;
  int64_t n_ctx;
  std::vector<float> keys, q, w;
  explicit IndexerCase(int64_t n, int64_t n_q, std::mt19937& rng, int d = 64) : D(d), n_ctx(n) {
    keys = randn(size_t(n * D), rng);
    q = randn(size_t(n_q * H * D), rng);
    w = randn(size_t(n_q * H), rng);
  }
};

}  // namespace

TEST_CASE("Indexer exact mode selects the top-k of the defining scores, streaming over pages", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(21);
  const int64_t n = 300, n_q = 40;
  IndexerCase c(n, n_q, rng);
  IndexerConfig cfg{c.H, c.D, c.K, IndexerMode::Exact, false};
  const size_t kb = indexer_key_bytes(cfg);
  REQUIRE(kb == size_t(c.D) * 4);
  ToyPages pages(n, 16, kb + 8, rng);  // record: 8 bytes of something else, then the key
  for (int64_t p = 0; p < n; ++p) indexer_encode_key(cfg, c.keys.data() + p * c.D, pages.at(p) + 8);
  // Queries at the end of a prefill chunk: query i sees positions [0, n - n_q + i + 1).
  std::vector<int64_t> vis(static_cast<size_t>(n_q));
  for (int64_t i = 0; i < n_q; ++i) vis[size_t(i)] = n - n_q + i + 1;
  vis[0] = 5;  // and one that sees fewer than k positions
  for (IndexerBudget b : {IndexerBudget{1, 1}, IndexerBudget{7, 3}, IndexerBudget{4096, 64}}) {
    std::vector<int32_t> out(static_cast<size_t>(n_q * c.K));
    IndexerStats st;
    indexer_select(cfg, c.q.data(), c.w.data(), n_q, vis.data(), pages.rows(8), b, out.data(), &st, nullptr);
    uint64_t pairs = 0;
    for (int64_t i = 0; i < n_q; ++i) {
      const auto s =
          reference_scores(c.q.data() + i * c.H * c.D, c.w.data() + i * c.H, c.H, c.D, c.keys, vis[size_t(i)]);
      check_topk(out.data() + i * c.K, c.K, s, 1e-5);
      pairs += uint64_t(vis[size_t(i)]);
    }
    CHECK(st.keys_scored == pairs);
  }
}

TEST_CASE("Indexer FP8 mode: top-k of the E4M3 scores (fp64 reference), recall against exact", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(33);
  const int64_t n = 400, n_q = 64;
  // D = 64: one scale per vector; D = 256: two scales of 128 dims each.
  for (int D : {64, 256}) {
    IndexerCase c(n, n_q, rng, D);
    IndexerConfig ex{c.H, c.D, c.K, IndexerMode::Exact, false};
    std::vector<int64_t> vis(static_cast<size_t>(n_q));
    for (int64_t i = 0; i < n_q; ++i) vis[size_t(i)] = n - n_q + i + 1;
    ToyPages pe(n, 64, indexer_key_bytes(ex), rng);
    for (int64_t p = 0; p < n; ++p) indexer_encode_key(ex, c.keys.data() + p * c.D, pe.at(p));
    std::vector<int32_t> exact(static_cast<size_t>(n_q * c.K));
    indexer_select(ex, c.q.data(), c.w.data(), n_q, vis.data(), pe.rows(), {}, exact.data(), nullptr, nullptr);
    for (bool p2 : {false, true}) {
      IndexerConfig f8{c.H, c.D, c.K, IndexerMode::Fp8, p2};
      REQUIRE(indexer_key_bytes(f8) == size_t(c.D) + 4 * size_t(std::max(1, c.D / 128)));
      ToyPages pf(n, 64, indexer_key_bytes(f8), rng);
      for (int64_t p = 0; p < n; ++p) indexer_encode_key(f8, c.keys.data() + p * c.D, pf.at(p));
      std::vector<int32_t> sel(static_cast<size_t>(n_q * c.K));
      indexer_select(f8, c.q.data(), c.w.data(), n_q, vis.data(), pf.rows(), {}, sel.data(), nullptr, nullptr);
      double recall = 0, band_misses = 0;
      for (int64_t i = 0; i < n_q; ++i) {
        // The kernel's selection is the exact top-k of the FP8 scores (fp64): its only error is the format.
        const auto s8 = fp8_reference_scores(c.q.data() + i * c.H * c.D, c.w.data() + i * c.H, c.H, c.D, p2, c.keys,
                                             vis[size_t(i)]);
        double top = 0;
        for (double v : s8) top = std::max(top, std::fabs(v));
        check_topk(sel.data() + i * c.K, c.K, s8, 1e-5 * top);
        std::set<int32_t> a(exact.begin() + i * c.K, exact.begin() + (i + 1) * c.K),
            b(sel.begin() + i * c.K, sel.begin() + (i + 1) * c.K);
        int hit = 0;
        for (int32_t x : a) hit += b.count(x);
        recall += double(hit) / c.K;
        // A miss is only acceptable near the k-th score: FP8 perturbs a score by
        // a few percent of its scale, never more than that.
        const auto s =
            reference_scores(c.q.data() + i * c.H * c.D, c.w.data() + i * c.H, c.H, c.D, c.keys, vis[size_t(i)]);
        double kth = 1e300, spread = 0;
        for (int32_t x : a) kth = std::min(kth, s[size_t(x)]);
        for (double v : s) spread = std::max(spread, std::fabs(v));
        for (int32_t x : b)
          if (!a.count(x) && s[size_t(x)] < kth - 0.05 * spread) band_misses += 1;
      }
      recall /= double(n_q);
      WARN("FP8 recall against exact, Gaussian data, D " << D << ": " << recall << " (pow2 scales " << p2 << ")");
      // Gaussian random keys and queries put many scores close to the k-th one;
      // E4M3 keeps 4 significant bits, so a few boundary swaps are expected
      // (measured 0.945 - 0.958).
      CHECK(recall >= 0.94);
      CHECK(band_misses == 0);
    }
  }
}

TEST_CASE("Indexer: a query's keys split over threads select what one thread selects", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(23);
  dz::ThreadPool pool(3);
  for (IndexerMode mode : {IndexerMode::Exact, IndexerMode::Fp8}) {
    const int64_t n = 5000;
    IndexerCase c(n, 3, rng);
    IndexerConfig cfg{c.H, c.D, 64, mode, false};
    ToyPages pages(n, 64, indexer_key_bytes(cfg), rng);
    for (int64_t p = 0; p < n; ++p) indexer_encode_key(cfg, c.keys.data() + p * c.D, pages.at(p));
    // Exact copies of earlier keys make equal scores: the lower position must win across the splits too.
    for (int64_t p = 4000; p < n; p += 7) std::memcpy(pages.at(p), pages.at(p - 3000), indexer_key_bytes(cfg));
    for (int64_t n_q : {1, 2, 3}) {  // fewer queries than threads: each query's keys in parts
      std::vector<int64_t> vis(static_cast<size_t>(n_q), n);
      vis[0] = n - 1;
      std::vector<int32_t> one(static_cast<size_t>(n_q * 64)), split(one.size());
      const IndexerBudget b{1500, 8};
      indexer_select(cfg, c.q.data(), c.w.data(), n_q, vis.data(), pages.rows(), b, one.data(), nullptr, nullptr);
      indexer_select(cfg, c.q.data(), c.w.data(), n_q, vis.data(), pages.rows(), b, split.data(), nullptr, &pool);
      INFO("mode " << int(mode) << ", " << n_q << " queries");
      CHECK(split == one);
    }
  }
}

TEST_CASE("Indexer on a 32K-token context: bounded scratch, exact against the definition", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(44);
  const int H = 4, D = 64, K = 64;
  const int64_t n_q = 16;
  IndexerBudget budget{1024, 8};
  for (IndexerMode mode : {IndexerMode::Exact, IndexerMode::Fp8}) {
    IndexerConfig cfg{H, D, K, mode, false};
    size_t peak[2] = {0, 0};
    for (int which = 0; which < 2; ++which) {
      const int64_t n = which == 0 ? 4096 : 32768 + 100;
      std::vector<float> keys = randn(size_t(n * D), rng);
      std::vector<float> q = randn(size_t(n_q * H * D), rng), w(size_t(n_q * H), 1.0f);
      ToyPages pages(n, 64, indexer_key_bytes(cfg), rng);
      for (int64_t p = 0; p < n; ++p) indexer_encode_key(cfg, keys.data() + p * D, pages.at(p));
      std::vector<int64_t> vis(static_cast<size_t>(n_q));
      for (int64_t i = 0; i < n_q; ++i) vis[size_t(i)] = n - n_q + i + 1;
      std::vector<int32_t> out(static_cast<size_t>(n_q * K));
      IndexerStats st;
      indexer_select(cfg, q.data(), w.data(), n_q, vis.data(), pages.rows(), budget, out.data(), &st, nullptr);
      peak[which] = st.peak_scratch_bytes;
      if (mode == IndexerMode::Exact && which == 1)
        for (int64_t i = 0; i < n_q; i += 5) {
          const auto s = reference_scores(q.data() + i * H * D, w.data() + i * H, H, D, keys, vis[size_t(i)]);
          check_topk(out.data() + i * K, K, s, 1e-5);
        }
    }
    // The scratch is set by the budget alone: the same at 4K and 32K tokens,
    // within one chunk of decoded keys plus one block of queries and heaps,
    // and below even this small batch's [queries x context] score matrix.
    WARN("indexer scratch " << peak[1] << " bytes at 32K tokens, " << peak[0] << " at 4K");
    // (keys and queries are held as fp64 for the vectorised dot products: exact, the same sums.)
    const size_t bound = size_t(budget.chunk_tokens) * (D * 8 + 4) +
                         size_t(budget.query_block) * (H * D * 12 + H * 8 + size_t(K) * 8) + 64;
    CHECK(peak[0] == peak[1]);
    CHECK(peak[1] <= bound);
    CHECK(peak[1] < size_t(n_q) * size_t(32768) * sizeof(float));
  }
}

namespace {

// MLA by its definition, fp64: expand K and V for every selected token.
std::vector<double> mla_reference(const dz::cpu::MlaDims& d, const float* q, const std::vector<float>& kvb,
                                  const std::vector<float>& latent, const int32_t* sel, int k) {
  const int R = d.rank, hr = d.nope + d.v;
  std::vector<double> out(static_cast<size_t>(d.n_heads * d.v));
  for (int h = 0; h < d.n_heads; ++h) {
    std::vector<double> s;
    std::vector<std::vector<double>> vs;
    for (int j = 0; j < k; ++j) {
      if (sel[j] < 0) continue;
      const float* c = latent.data() + size_t(sel[j]) * size_t(R + d.rope);
      double dotp = 0;
      for (int i = 0; i < d.nope; ++i) {
        double kn = 0;
        for (int r = 0; r < R; ++r) kn += double(kvb[size_t((h * hr + i) * R + r)]) * c[r];
        dotp += double(q[h * (d.nope + d.rope) + i]) * kn;
      }
      for (int i = 0; i < d.rope; ++i) dotp += double(q[h * (d.nope + d.rope) + d.nope + i]) * c[R + i];
      s.push_back(dotp * d.scale);
      std::vector<double> v(static_cast<size_t>(d.v));
      for (int i = 0; i < d.v; ++i)
        for (int r = 0; r < R; ++r) v[size_t(i)] += double(kvb[size_t((h * hr + d.nope + i) * R + r)]) * c[r];
      vs.push_back(v);
    }
    const double mx = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - mx));
    for (size_t j = 0; j < s.size(); ++j)
      for (int i = 0; i < d.v; ++i) out[size_t(h * d.v + i)] += s[j] / sum * vs[j][size_t(i)];
  }
  return out;
}

}  // namespace

TEST_CASE("MLA: absorbed decode and expanded prefill equal the definition over selected tokens", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(55);
  MlaDims d{4, 32, 16, 24, 64, 0.13f};
  const int64_t n = 200, n_q = 12;
  const int k = 16;
  const std::vector<float> latent = randn(size_t(n * (d.rank + d.rope)), rng);
  const std::vector<float> kvb = randn(size_t(d.n_heads * (d.nope + d.v) * d.rank), rng, 0.125f);
  const std::vector<float> q = randn(size_t(n_q * d.n_heads * (d.nope + d.rope)), rng);
  ToyPages pages(n, 32, mla_latent_bytes(d) + 12, rng);
  for (int64_t p = 0; p < n; ++p) std::memcpy(pages.at(p), latent.data() + p * (d.rank + d.rope), mla_latent_bytes(d));
  // Random selections, some rows short (padded with -1).
  std::vector<int32_t> sel(static_cast<size_t>(n_q * k), -1);
  for (int64_t i = 0; i < n_q; ++i) {
    std::vector<int32_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const int m = i % 4 == 0 ? 5 : k;
    std::sort(all.begin(), all.begin() + m);
    std::copy(all.begin(), all.begin() + m, sel.begin() + i * k);
  }
  std::vector<float> pre(static_cast<size_t>(n_q * d.n_heads * d.v)), dec(static_cast<size_t>(d.n_heads * d.v));
  int64_t expect_pairs = 0;
  for (int32_t s : sel) expect_pairs += s >= 0;
  CHECK(mla_prefill(d, q.data(), n_q, kvb.data(), pages.rows(), sel.data(), k, pre.data(), nullptr, 5) == expect_pairs);
  double max_err = 0, max_pd = 0;
  for (int64_t i = 0; i < n_q; ++i) {
    const float* qi = q.data() + i * d.n_heads * (d.nope + d.rope);
    const auto ref = mla_reference(d, qi, kvb, latent, sel.data() + i * k, k);
    const int64_t attended = mla_decode(d, qi, kvb.data(), pages.rows(), sel.data() + i * k, k, dec.data(), nullptr);
    CHECK(attended == (i % 4 == 0 ? 5 : k));
    for (size_t j = 0; j < ref.size(); ++j) {
      max_err = std::max({max_err, std::fabs(pre[size_t(i) * ref.size() + j] - ref[j]), std::fabs(dec[j] - ref[j])});
      max_pd = std::max(max_pd, double(std::fabs(pre[size_t(i) * ref.size() + j] - dec[j])));
    }
  }
  WARN("MLA max |error| " << max_err << ", max |prefill - decode| " << max_pd);
  CHECK(max_err < 2e-5);
  CHECK(max_pd < 2e-5);
}

// ------------------------------------------------------------ whole model

#include "api/handles.h"
#include "kv/arena.h"
#include "loader/safetensors.h"
#include "model/deepseek_v32.h"
#include "support/family_fixture.h"

namespace {

const std::string kData = DZ_TEST_DATA;
using dz::test::argmax;
using dz::test::cosine;
using dz::test::Reference;
using Model = dz::test::FixtureModel;
using Runner = dz::test::Runner;

struct Fixture {
  std::vector<Reference> refs;
  std::map<int, std::vector<int32_t>> topk;  // layer -> [T_last, index_topk] for the last prompt
  int topk_prompt = -1;
};

const Fixture& fixture(const std::string& name) {
  static std::map<std::string, Fixture> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  const dz::test::FamilyFixture& f = dz::test::family_fixture(name);
  Fixture fx;
  fx.refs = f.refs;
  fx.topk_prompt = int(fx.refs.size()) - 1;
  for (int l = 0; f.ints.count("topk." + std::to_string(fx.topk_prompt) + "." + std::to_string(l)); ++l)
    fx.topk[l] = f.ints.at("topk." + std::to_string(fx.topk_prompt) + "." + std::to_string(l));
  return cache[name] = std::move(fx);
}

void fp8_indexer(dz_model_params& p) { p.indexer = DZ_INDEXER_FP8; }

std::vector<int32_t> head(const std::vector<int32_t>& v, size_t n) { return {v.begin(), v.begin() + ptrdiff_t(n)}; }

}  // namespace

TEST_CASE("deepseek_v32 matches transformers: logits, indexer selections, greedy decode", "[deepseek]") {
  for (const char* name : {"deepseek_v32_bf16", "deepseek_v32_fp8", "deepseek_v32_mxfp4"}) {
    SECTION(name) {
      const Fixture& fx = fixture(name);
      Model model(name);
      const size_t V = size_t(model.vocab());
      REQUIRE(fx.refs.size() == 3);
      double worst_all = 1, diff_all = 0;
      for (size_t i = 0; i < fx.refs.size(); ++i) {
        const Reference& ref = fx.refs[i];
        const size_t T = ref.prompt.size();
        Runner run(model);
        std::map<int, std::vector<int32_t>> got_sel;
        dz::DsaTrace trace;
        trace.on_select = [&](int layer, size_t, int64_t pos0, const int32_t* sel, int64_t nq, int k) {
          if (pos0 == 0) got_sel[layer].assign(sel, sel + nq * k);
        };
        dz::deepseek_v32_set_trace(model.family(), &trace);
        const std::vector<float> logits = run.append(ref.prompt);
        dz::deepseek_v32_set_trace(model.family(), nullptr);
        const auto [worst, max_diff] = dz::test::compare_logits(logits.data(), ref.logits.data(), T, V);
        INFO(name << " prompt " << i << " (T=" << T << "): worst cosine " << worst << ", max |diff| " << max_diff);
        CHECK(worst >= 0.99999);
        CHECK(max_diff < 1e-3);
        worst_all = std::min(worst_all, worst);
        diff_all = std::max(diff_all, max_diff);
        if (int(i) == fx.topk_prompt) {
          REQUIRE(fx.topk.size() == got_sel.size());
          for (const auto& [layer, want] : fx.topk) {
            size_t rows_differ = 0;
            const size_t k = want.size() / T;
            for (size_t t = 0; t < T; ++t)
              rows_differ += !std::equal(want.begin() + ptrdiff_t(t * k), want.begin() + ptrdiff_t((t + 1) * k),
                                         got_sel[layer].begin() + ptrdiff_t(t * k));
            INFO("layer " << layer << ": " << rows_differ << " of " << T << " selections differ");
            CHECK(rows_differ == 0);
          }
        }
        // Greedy continuation: each step decodes one token (absorbed MLA).
        const std::vector<int32_t> greedy =
            dz::test::greedy_decode(run, {logits.end() - ptrdiff_t(V), logits.end()}, ref.greedy.size());
        INFO("smallest reference margin " << *std::min_element(ref.margin.begin(), ref.margin.end()));
        CHECK(greedy == ref.greedy);
      }
      WARN(name << ": worst per-position logits cosine " << worst_all << ", max |logit diff| " << diff_all
                << " against transformers");
    }
  }
}

TEST_CASE("deepseek_v32: decode after prefill and chunked prefill equal one full prefill", "[deepseek]") {
  Model model("deepseek_v32_bf16");
  const Reference& ref = fixture("deepseek_v32_bf16").refs[2];
  const size_t V = size_t(model.vocab()), T = ref.prompt.size();
  Runner full(model);
  const std::vector<float> all = full.append(ref.prompt);
  // Prefill 140 tokens (expanded MLA), then 10 single-token decode steps (absorbed MLA).
  Runner dec(model);
  dec.append(head(ref.prompt, 140), false);
  double max_diff = 0;
  for (size_t t = 140; t < T; ++t) {
    const std::vector<float> l = dec.append({ref.prompt[t]}, false);
    for (size_t v = 0; v < V; ++v) max_diff = std::max(max_diff, double(std::fabs(l[v] - all[t * V + v])));
  }
  // Chunks of 37 tokens (pages of 16: chunks cross page boundaries).
  Runner chunked(model);
  double chunk_diff = 0;
  for (size_t t0 = 0; t0 < T; t0 += 37) {
    const size_t t1 = std::min(T, t0 + 37);
    const std::vector<float> l =
        chunked.append({ref.prompt.begin() + ptrdiff_t(t0), ref.prompt.begin() + ptrdiff_t(t1)});
    for (size_t i = 0; i < (t1 - t0) * V; ++i)
      chunk_diff = std::max(chunk_diff, double(std::fabs(l[i] - all[t0 * V + i])));
  }
  WARN("decode after prefill vs full prefill: max |logit diff| " << max_diff << "; chunked prefill: " << chunk_diff);
  CHECK(max_diff < 1e-4);
  CHECK(chunk_diff < 1e-4);
}

TEST_CASE("deepseek_v32: attention reads only the selected tokens", "[deepseek]") {
  Model model("deepseek_v32_bf16");
  const Reference& ref = fixture("deepseek_v32_bf16").refs[2];
  const int64_t T = int64_t(ref.prompt.size()), k = 16, layers = 3;
  Runner run(model);
  run.append(ref.prompt, false);
  // Each query attends to min(k, pos + 1) positions per layer: 2280 of the 11325 causal pairs here.
  int64_t sparse = 0, dense = 0;
  for (int64_t t = 0; t < T; ++t) sparse += std::min(k, t + 1), dense += t + 1;
  CHECK(int64_t(run.tokens_read) == layers * sparse);
  CHECK(3 * sparse < dense);
  // A decode step at position T reads k tokens per layer.
  run.tokens_read = 0;
  run.append({5}, false);
  CHECK(int64_t(run.tokens_read) == layers * k);
}

TEST_CASE("deepseek_v32: a ragged batch computes what each sequence computes alone", "[deepseek]") {
  Model model("deepseek_v32_mxfp4");
  const auto& refs = fixture("deepseek_v32_mxfp4").refs;
  const size_t V = size_t(model.vocab());
  Runner alone(model), batched(model);
  std::vector<std::vector<float>> want;
  for (size_t i = 0; i < 3; ++i) want.push_back(alone.append(refs[i].prompt, true, i));
  // One forward: prompt 0 in full, prompt 1 in full, prompt 2's first 100 tokens; then a mixed step:
  // prompt 2's remaining 50 tokens (prefill) beside single tokens for the other two (decode).
  std::vector<std::vector<float>> out(3);
  std::vector<dz::ForwardItem> items(3);
  const std::vector<int32_t> p2a = head(refs[2].prompt, 100);
  const std::vector<int32_t>* toks[3] = {&refs[0].prompt, &refs[1].prompt, &p2a};
  for (size_t i = 0; i < 3; ++i) {
    batched.seq(i).reserve(toks[i]->size());
    out[i].resize(toks[i]->size() * V);
    items[i].seq = &batched.seq(i);
    items[i].tokens = *toks[i];
    items[i].all_logits = true;
    items[i].logits = out[i].data();
  }
  model.family().forward(items, {});
  for (size_t i = 0; i < 3; ++i) batched.seq(i).commit(*toks[i]);
  for (size_t i = 0; i < 3; ++i)
    for (size_t j = 0; j < out[i].size(); ++j) REQUIRE(std::fabs(out[i][j] - want[i][j]) < 1e-5);
  const std::vector<int32_t> p2b(refs[2].prompt.begin() + 100, refs[2].prompt.end()), one = {7}, two = {9};
  const std::vector<int32_t>* step[3] = {&one, &two, &p2b};
  for (size_t i = 0; i < 3; ++i) {
    batched.seq(i).reserve(step[i]->size());
    out[i].assign(V, 0.0f);
    items[i].tokens = *step[i];
    items[i].all_logits = false;
    items[i].logits = out[i].data();
  }
  model.family().forward(items, {});
  for (size_t i = 0; i < 3; ++i) batched.seq(i).commit(*step[i]);
  const std::vector<float> a0 = alone.append(one, false, 0), a1 = alone.append(two, false, 1);
  for (size_t v = 0; v < V; ++v) {
    REQUIRE(std::fabs(out[0][v] - a0[v]) < 1e-5);
    REQUIRE(std::fabs(out[1][v] - a1[v]) < 1e-5);
    REQUIRE(std::fabs(out[2][v] - want[2][(refs[2].prompt.size() - 1) * V + v]) < 1e-4);
  }
}

// FP8 indexer mode on the random fixtures. E4M3 keeps 4 significant bits, so
// scores within a few percent of the k-th one can swap places; on untrained
// random weights (Gaussian-like score rows, 16 of 60..150 kept) that costs
// 2-3% of recall on identical inputs (layer 0) and more in later layers, whose
// inputs differ once an earlier layer's selection did; since a random model's
// attention is unrelated to its indexer, one swapped token moves the logits
// far. Measured (rows t >= k): layer 0 0.975-0.978, layer 1 0.89-0.90, layer 2
// 0.76-0.78. The floors below pin what an implementation controls: identical
// results whenever the selection cannot differ (positions < k) and layer-0
// recall on identical inputs; the kernel tests above check that the FP8
// selection is the top-k of the FP8 scores, and the trained model's test below
// measures the mode where its score rows are meaningful.
TEST_CASE("deepseek_v32: FP8 indexer mode (Hadamard + E4M3 key cache) against exact mode", "[deepseek]") {
  for (const char* name : {"deepseek_v32_bf16", "deepseek_v32_fp8"}) {
    const Fixture& fx = fixture(name);
    Model exact(name), fp8(name, fp8_indexer);
    const size_t V = size_t(exact.vocab());
    const int K = 16;
    // The FP8 key cache is smaller: 64 E4M3 bytes + one fp32 scale instead of 64 fp32 per token per layer.
    const auto le = exact.family().kv_layout(16), lf = fp8.family().kv_layout(16);
    CHECK(le.layer_token_bytes[0] - lf.layer_token_bytes[0] == 64 * 4 - (64 + 4));
    CHECK(le.model_key != lf.model_key);
    std::vector<double> recall(3, 0.0);
    std::vector<size_t> rows(3, 0);
    double early_diff = 0, cos_sum = 0, cos_min = 1;
    size_t n_cos = 0;
    for (const Reference& ref : fx.refs) {
      const size_t T = ref.prompt.size();
      std::map<std::pair<int, int>, std::vector<int32_t>> sel;  // (mode, layer) -> [T, k]
      dz::DsaTrace te, tf;
      te.on_select = [&](int l, size_t, int64_t, const int32_t* s, int64_t n, int k) {
        sel[{0, l}].assign(s, s + n * k);
      };
      tf.on_select = [&](int l, size_t, int64_t, const int32_t* s, int64_t n, int k) {
        sel[{1, l}].assign(s, s + n * k);
      };
      dz::deepseek_v32_set_trace(exact.family(), &te);
      dz::deepseek_v32_set_trace(fp8.family(), &tf);
      Runner re(exact), rf(fp8);
      const std::vector<float> lex = re.append(ref.prompt), lf8 = rf.append(ref.prompt);
      dz::deepseek_v32_set_trace(exact.family(), nullptr);
      dz::deepseek_v32_set_trace(fp8.family(), nullptr);
      for (size_t t = 0; t < T; ++t) {
        if (t < size_t(K))
          for (size_t v = 0; v < V; ++v)
            early_diff = std::max(early_diff, double(std::fabs(lf8[t * V + v] - lex[t * V + v])));
        const double c = cosine(lf8.data() + t * V, ref.logits.data() + t * V, V);
        cos_sum += c, cos_min = std::min(cos_min, c), ++n_cos;
      }
      // Recall over the rows with more visible tokens than k (below that both modes keep everything).
      for (int l = 0; l < 3; ++l)
        for (size_t t = size_t(K); t < T; ++t) {
          const auto& a = sel[{0, l}];
          const auto& b = sel[{1, l}];
          std::set<int32_t> sa(a.begin() + ptrdiff_t(t * K), a.begin() + ptrdiff_t((t + 1) * K)),
              sb(b.begin() + ptrdiff_t(t * K), b.begin() + ptrdiff_t((t + 1) * K));
          sa.erase(-1);
          size_t hit = 0;
          for (int32_t x : sa) hit += sb.count(x);
          recall[size_t(l)] += double(hit) / double(sa.size());
          ++rows[size_t(l)];
        }
    }
    for (int l = 0; l < 3; ++l) recall[size_t(l)] /= double(rows[size_t(l)]);
    WARN(name << " FP8 indexer: top-k recall against exact, averaged over positions t >= k: layer 0 " << recall[0]
              << " (identical inputs), layer 1 " << recall[1] << ", layer 2 " << recall[2]
              << "; logits cosine against transformers: mean " << cos_sum / double(n_cos) << ", worst " << cos_min
              << "; positions < k: max |diff| to exact mode " << early_diff);
    CHECK(early_diff < 1e-5);  // every position selected in both modes: the FP8 cache changes nothing else
    CHECK(recall[0] >= 0.96);
    CHECK(recall[1] >= 0.87);
    CHECK(recall[2] >= 0.72);
  }
}

// The FP8 indexer mode on the trained default model (models/dayzero-tiny:
// index_topk 64, DeepSeek-V3.2's indexer size of 64 heads x 128 dims, context
// 256) against its exact mode, on held-out text: the Devil's Dictionary entries
// of the held-out split of its training data (tests/data/dayzero_tiny/heldout_devil.txt),
// tokenized with the model's tokenizer through the C API, in windows of 256 tokens.
// `dz indexer-fp8` measures the same on the whole held-out text (docs/precision.md).
// What must hold exactly: every layer's FP8 selection is the top-k of the FP8
// scores of its own inputs evaluated in fp64. What must hold as the issue
// states it: top-k recall against the exact mode >= 0.99 averaged over
// positions (rows with more than k visible tokens) and logits cosine >= 0.999
// (on the mean: E4M3 moves a few cutoff tokens per row, and where those carry
// attention a position's logits move more). Measured on these 4 windows:
// recall 0.9920 (per layer 0.9896 / 0.9926 / 0.9934 / 0.9922), cosine mean
// 0.99957, worst 0.868, argmax agreement 0.986.
TEST_CASE("default model: FP8 indexer mode against exact mode on held-out text", "[deepseek]") {
  const std::string dir = std::string(DZ_SOURCE_DIR) + "/models/dayzero-tiny";
  std::ifstream in(kData + "/dayzero_tiny/heldout_devil.txt", std::ios::binary);
  REQUIRE(in);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  struct Opened {
    dz_model* m = nullptr;
    dz_kv_arena* arena = nullptr;
    ~Opened() {
      dz_kv_arena_free(arena);
      dz_model_free(m);
    }
  } ex, f8;
  for (Opened* o : {&ex, &f8}) {
    dz_model_params p;
    dz_model_params_init(&p);
    p.n_threads = 2;
    p.indexer = o == &f8 ? DZ_INDEXER_FP8 : DZ_INDEXER_EXACT;
    INFO(dz_last_error());
    REQUIRE(dz_model_open(dir.c_str(), &p, &o->m) == DZ_OK);
    dz_kv_arena_params ap;
    dz_kv_arena_params_init(&ap);
    ap.prefix_cache = 0;  // every window computes (and traces) every position
    REQUIRE(dz_kv_arena_create(o->m, &ap, &o->arena) == DZ_OK);
  }
  const dz_tokenizer* tok = nullptr;
  REQUIRE(dz_model_tokenizer(ex.m, &tok) == DZ_OK);
  std::vector<int32_t> ids(text.size());
  size_t n_ids = 0;
  REQUIRE(dz_tokenize(tok, text.data(), text.size(), 0, ids.data(), ids.size(), &n_ids) == DZ_OK);
  const size_t T = 256, n_win = 4;  // the first 4 windows: seconds
  REQUIRE(n_ids >= n_win * T);
  std::ifstream cfg_in(dir + "/config.json");
  const nlohmann::json cfg = nlohmann::json::parse(cfg_in);
  const int H = cfg.at("index_n_heads").get<int>(), D = cfg.at("index_head_dim").get<int>(),
            K = cfg.at("index_topk").get<int>(), L = cfg.at("num_hidden_layers").get<int>();
  REQUIRE((H == 64 && D == 128));  // DeepSeek-V3.2's indexer

  std::vector<double> recall(L, 0.0);
  size_t rows = 0, n_pos = 0, agree = 0;
  double cos_sum = 0, cos_min = 1;
  for (size_t wi = 0; wi < n_win; ++wi) {
    const std::vector<int32_t> win(ids.begin() + ptrdiff_t(wi * T), ids.begin() + ptrdiff_t((wi + 1) * T));
    std::map<std::pair<int, int>, std::vector<int32_t>> sel;  // (mode, layer) -> [T, K]
    std::map<int, std::vector<float>> iq, iw, ik;             // FP8 run's indexer inputs per layer
    std::vector<std::vector<float>> logits;
    for (int mode = 0; mode < 2; ++mode) {
      dz::DsaTrace tr;
      tr.on_select = [&](int l, size_t, int64_t pos0, const int32_t* s, int64_t n, int k) {
        REQUIRE(k == K);
        auto& v = sel[{mode, l}];
        v.resize(T * size_t(K));
        std::copy(s, s + n * k, v.begin() + pos0 * k);
      };
      if (mode == 1)
        tr.on_indexer = [&](int l, size_t, int64_t pos0, const float* q, const float* w, const float* k, int64_t n) {
          iq[l].resize(T * H * D), iw[l].resize(T * H), ik[l].resize(T * D);
          std::copy(q, q + n * H * D, iq[l].begin() + pos0 * H * D);
          std::copy(w, w + n * H, iw[l].begin() + pos0 * H);
          std::copy(k, k + n * D, ik[l].begin() + pos0 * D);
        };
      Opened& o = mode ? f8 : ex;
      dz::deepseek_v32_set_trace(*o.m->family, &tr);
      dz_session* s = nullptr;
      REQUIRE(dz_session_create(o.arena, nullptr, &s) == DZ_OK);
      const dz_status st = dz_session_append(s, win.data(), T, DZ_LOGITS_ALL);
      dz::deepseek_v32_set_trace(*o.m->family, nullptr);
      INFO(dz_last_error());
      REQUIRE(st == DZ_OK);
      const float* lg = nullptr;
      size_t r = 0, nv = 0;
      REQUIRE(dz_session_logits(s, &lg, &r, &nv) == DZ_OK);
      REQUIRE(r == T);
      logits.emplace_back(lg, lg + T * nv);
      dz_session_free(s);
    }
    const size_t V = logits[0].size() / T;
    for (size_t t = 0; t < T; ++t) {
      const float *a = logits[0].data() + t * V, *b = logits[1].data() + t * V;
      const double c = cosine(b, a, V);
      cos_sum += c, cos_min = std::min(cos_min, c), ++n_pos;
      agree += argmax(a, V) == argmax(b, V);
    }
    for (int l = 0; l < L; ++l) {
      std::vector<std::vector<double>> kd;
      for (size_t j = 0; j < T; ++j) kd.push_back(fp8_dequantised(ik[l].data() + j * D, D, false));
      const auto &se = sel[{0, l}], &sf = sel[{1, l}];
      for (size_t t = size_t(K); t < T; ++t) {  // rows with more visible tokens than k
        std::vector<std::vector<double>> qh;
        for (int h = 0; h < H; ++h) qh.push_back(fp8_dequantised(iq[l].data() + (t * H + size_t(h)) * D, D, false));
        const std::vector<double> s8 = scores_of(qh, iw[l].data() + t * H, kd, int64_t(t + 1));
        // The FP8 selection is the top-k of s8: nothing left out scores above anything kept (up to rounding).
        const std::set<int32_t> kept(sf.begin() + ptrdiff_t(t * K), sf.begin() + ptrdiff_t((t + 1) * K));
        double lowest = 1e300;
        for (int32_t x : kept) lowest = std::min(lowest, x >= 0 && size_t(x) <= t ? s8[size_t(x)] : -1e300);
        const double tol = 1e-5 * *std::max_element(s8.begin(), s8.end());
        size_t above = 0;
        for (size_t j = 0; j <= t; ++j) above += !kept.count(int32_t(j)) && s8[j] > lowest + tol;
        if (kept.size() != size_t(K) || above) REQUIRE(!"FP8 selection is not the top-k of its fp64 FP8 scores");
        const std::set<int32_t> a(se.begin() + ptrdiff_t(t * K), se.begin() + ptrdiff_t((t + 1) * K));
        int hit = 0;
        for (size_t j = 0; j < size_t(K); ++j) hit += int(a.count(sf[t * K + j]));
        recall[size_t(l)] += double(hit) / K;
        rows += l == 0;
      }
    }
  }
  double mean = 0;
  for (double& r : recall) r /= double(rows), mean += r / L;
  WARN("dayzero-tiny FP8 indexer vs exact over "
       << n_win << " windows of " << T << " held-out tokens: recall (rows t >= " << K << ") per layer " << recall[0]
       << ", " << recall[1] << ", " << recall[2] << ", " << recall[3] << ", mean " << mean << "; logits cosine mean "
       << cos_sum / double(n_pos) << ", worst " << cos_min << "; argmax agreement " << double(agree) / double(n_pos));
  CHECK(mean >= 0.99);  // the recall target
  for (double r : recall) CHECK(r >= 0.985);
  CHECK(cos_sum / double(n_pos) >= 0.999);  // the logits target holds on the mean ...
  CHECK(cos_min >= 0.8);                    // ... not at every position
  CHECK(double(agree) / double(n_pos) >= 0.97);
}

TEST_CASE("deepseek_v32: bad checkpoints fail with clear errors", "[deepseek]") {
  namespace fs = std::filesystem;
  const fs::path src = kData + "/deepseek_v32_fp8";
  const fs::path dir = fs::temp_directory_path() / ("dz_dsv32_bad_" + std::to_string(::getpid()));
  auto fresh_copy = [&] {
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(src)) fs::copy_file(e.path(), dir / e.path().filename());
  };
  auto open_err = [&](dz_status want, const std::string& needle) {
    dz_model* m = nullptr;
    const dz_status st = dz_model_open(dir.c_str(), nullptr, &m);
    const std::string msg = dz_last_error();
    dz_model_free(m);
    INFO(msg);
    CHECK(st == want);
    CHECK(msg.find(needle) != std::string::npos);
  };
  auto edit_config = [&](const std::function<void(nlohmann::json&)>& f) {
    nlohmann::json j;
    std::ifstream(dir / "config.json") >> j;
    f(j);
    std::ofstream(dir / "config.json") << j.dump(2);
  };
  fresh_copy();
  edit_config([](nlohmann::json& j) { j["quantization_config"]["weight_block_size"] = {64, 64}; });
  open_err(DZ_ERR_UNSUPPORTED, "weight_block_size");
  fresh_copy();
  edit_config([](nlohmann::json& j) { j["n_group"] = 3; });
  open_err(DZ_ERR_FORMAT, "n_group");
  // A NaN block scale is refused at load, naming the tensor.
  fresh_copy();
  {
    const std::string name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv";
    nlohmann::json idx;
    std::ifstream(dir / "model.safetensors.index.json") >> idx;
    const fs::path shard = dir / idx["weight_map"][name].get<std::string>();
    uint64_t hlen = 0;
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.read(reinterpret_cast<char*>(&hlen), 8);
    std::string header(hlen, '\0');
    f.read(header.data(), std::streamsize(hlen));
    const auto h = nlohmann::json::parse(header);
    const uint64_t off = 8 + hlen + h[name]["data_offsets"][0].get<uint64_t>();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    f.seekp(std::streamoff(off));
    f.write(reinterpret_cast<const char*>(&nan), 4);
  }
  open_err(DZ_ERR_FORMAT, "kv_b_proj.weight_scale_inv");
  fs::remove_all(dir);
}

// ------------------------------------------------- operators added for V3.2

#include "cpu/matmul.h"
#include "cpu/moe.h"
#include "cpu/norm.h"

TEST_CASE("LayerNorm with weight and bias matches its definition", "[deepseek]") {
  std::mt19937 rng(61);
  const int64_t rows = 5, dim = 64;
  std::vector<float> x = randn(size_t(rows * dim), rng, 3.0f), w = randn(size_t(dim), rng), b = randn(size_t(dim), rng);
  for (auto& v : x) v += 2.0f;  // a mean far from zero
  std::vector<float> y(x.size());
  dz::cpu::layer_norm(x.data(), rows, dim, w.data(), b.data(), 1e-6f, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0, var = 0;
    for (int64_t i = 0; i < dim; ++i) m += x[size_t(r * dim + i)];
    m /= dim;
    for (int64_t i = 0; i < dim; ++i) var += (x[size_t(r * dim + i)] - m) * (x[size_t(r * dim + i)] - m);
    var /= dim;
    for (int64_t i = 0; i < dim; ++i) {
      const double want = (x[size_t(r * dim + i)] - m) / std::sqrt(var + 1e-6) * w[size_t(i)] + b[size_t(i)];
      REQUIRE(std::fabs(y[size_t(r * dim + i)] - want) < 1e-5 * (1 + std::fabs(want)));
    }
  }
}

TEST_CASE("Group-limited sigmoid routing matches a brute-force definition", "[deepseek]") {
  std::mt19937 rng(62);
  const int E = 32, groups = 8, topk_group = 3, k = 6;
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<float> logits = randn(E, rng, 2.0f), bias = randn(E, rng, 0.3f);
    std::vector<int32_t> idx(k);
    std::vector<float> w(k);
    dz::cpu::router_sigmoid_grouped(logits.data(), bias.data(), E, groups, topk_group, k, true, 2.5f, idx.data(),
                                    w.data());
    // Brute force: every allowed set of topk_group groups is scored by its members' top-2 sums; the best
    // set's experts compete by biased score.
    std::vector<double> s(E), c(E);
    for (int e = 0; e < E; ++e)
      s[size_t(e)] = 1 / (1 + std::exp(-double(logits[size_t(e)]))), c[size_t(e)] = s[size_t(e)] + bias[size_t(e)];
    std::vector<std::pair<double, int>> gs;
    for (int g = 0; g < groups; ++g) {
      std::vector<double> m(c.begin() + g * 4, c.begin() + g * 4 + 4);
      std::sort(m.rbegin(), m.rend());
      gs.push_back({m[0] + m[1], g});
    }
    std::sort(gs.rbegin(), gs.rend());
    std::vector<std::pair<double, int>> cand;
    for (int j = 0; j < topk_group; ++j)
      for (int e = gs[size_t(j)].second * 4; e < gs[size_t(j)].second * 4 + 4; ++e) cand.push_back({c[size_t(e)], e});
    std::sort(cand.rbegin(), cand.rend());
    std::set<int> want, got(idx.begin(), idx.end());
    double sum = 0;
    for (int j = 0; j < k; ++j) want.insert(cand[size_t(j)].second), sum += s[size_t(cand[size_t(j)].second)];
    REQUIRE(got == want);
    for (int j = 0; j < k; ++j) REQUIRE(std::fabs(w[size_t(j)] - s[size_t(idx[size_t(j)])] / sum * 2.5) < 1e-5);
  }
}

TEST_CASE("FP8 block-scaled weights through matmul, row slices and split gate/up experts", "[deepseek]") {
  using namespace dz::cpu;
  std::mt19937 rng(63);
  const int64_t N = 300, K = 200;  // partial blocks in both dimensions
  std::vector<uint8_t> q(size_t(N * K));
  for (auto& b : q) b = f32_to_e4m3(std::normal_distribution<float>(0.f, 30.f)(rng));
  const std::vector<float> sc = [&] {
    std::vector<float> v = randn(3 * 2, rng);
    for (auto& x : v) x = 0.01f + std::fabs(x);
    return v;
  }();
  WeightRef w;
  w.kind = WeightKind::FP8_BLOCK;
  w.data = q.data();
  w.scales = reinterpret_cast<const uint8_t*>(sc.data());
  w.rows = N;
  w.cols = K;
  const std::vector<float> x = randn(size_t(3 * K), rng);
  std::vector<float> y(size_t(3 * N));
  matmul(x.data(), 3, w, nullptr, y.data(), nullptr);
  auto deq = [&](int64_t n, int64_t k) {
    return double(e4m3_to_f32(q[size_t(n * K + k)])) * sc[size_t((n / 128) * 2 + k / 128)];
  };
  for (int64_t m = 0; m < 3; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (int64_t k = 0; k < K; ++k) want += double(x[size_t(m * K + k)]) * deq(n, k);
      REQUIRE(std::fabs(y[size_t(m * N + n)] - want) < 1e-4 * (1 + std::fabs(want)));
    }
  // A slice starting mid-block keeps the absolute block rows.
  const WeightRef s = w.row_slice(100, 150);
  std::vector<float> row(static_cast<size_t>(K));
  s.decode_row(40, row.data());  // absolute row 140: block row 1
  for (int64_t k = 0; k < K; ++k)
    REQUIRE(row[size_t(k)] == e4m3_to_f32(q[size_t(140 * K + k)]) * sc[size_t(2 + k / 128)]);
  // Experts with gate and up stored apart equal the [gate | up] stacked form.
  const int64_t H = 40, I = 24;
  const std::vector<float> gate = randn(size_t(I * H), rng), up = randn(size_t(I * H), rng),
                           down = randn(size_t(H * I), rng), xs = randn(size_t(4 * H), rng);
  std::vector<float> stacked(gate);
  stacked.insert(stacked.end(), up.begin(), up.end());
  auto ref_of = [](const std::vector<float>& v, int64_t r, int64_t c) {
    WeightRef m;
    m.kind = WeightKind::F32;
    m.data = reinterpret_cast<const uint8_t*>(v.data());
    m.rows = r;
    m.cols = c;
    return m;
  };
  const std::vector<int32_t> idx = {0, 0, 0, 0};
  const std::vector<float> one = {1, 0.5f, 2, 1};
  std::vector<float> y1(size_t(4 * H)), y2(size_t(4 * H));
  moe_forward(
      xs.data(), 4, H, I, idx.data(), one.data(), 1, 1,
      [&](int) {
        return ExpertWeights{ref_of(stacked, 2 * I, H), nullptr, ref_of(down, H, I), nullptr};
      },
      Glu{}, y1.data(), nullptr);
  moe_forward(
      xs.data(), 4, H, I, idx.data(), one.data(), 1, 1,
      [&](int) {
        return ExpertWeights{ref_of(up, I, H), nullptr, ref_of(down, H, I), nullptr, ref_of(gate, I, H)};
      },
      Glu{}, y2.data(), nullptr);
  CHECK(y1 == y2);
}

// ------------------------------------------------------------ C API

namespace {

struct Api {
  dz_model* m = nullptr;
  dz_kv_arena* arena = nullptr;
  explicit Api(const std::string& name, uint32_t page_tokens = 16) {
    dz_model_params p;
    dz_model_params_init(&p);
    p.n_threads = 2;
    INFO(dz_last_error());
    REQUIRE(dz_model_open((kData + "/" + name).c_str(), &p, &m) == DZ_OK);
    dz_kv_arena_params ap;
    dz_kv_arena_params_init(&ap);
    ap.page_tokens = page_tokens;
    ap.capacity_pages = 256;
    INFO(dz_last_error());
    REQUIRE(dz_kv_arena_create(m, &ap, &arena) == DZ_OK);
  }
  ~Api() {
    dz_kv_arena_free(arena);
    dz_model_free(m);
  }
  dz_session* session(uint32_t chunk = 0) {
    dz_session_params sp;
    dz_session_params_init(&sp);
    sp.prefill_chunk = chunk;
    dz_session* s = nullptr;
    REQUIRE(dz_session_create(arena, &sp, &s) == DZ_OK);
    return s;
  }
};

}  // namespace

TEST_CASE("deepseek_v32 through the C API: greedy generation batched over sessions, prefix reuse", "[deepseek]") {
  for (const char* name : {"deepseek_v32_bf16", "deepseek_v32_fp8", "deepseek_v32_mxfp4"}) {
    SECTION(name) {
      const Fixture& fx = fixture(name);
      Api api(name);
      // All three prompts as three sessions (prefill chunks of 64), then 12 batched greedy steps.
      std::vector<dz_session*> s;
      for (const Reference& ref : fx.refs) {
        s.push_back(api.session(64));
        INFO(dz_last_error());
        REQUIRE(dz_session_append(s.back(), ref.prompt.data(), ref.prompt.size(), DZ_LOGITS_LAST) == DZ_OK);
      }
      std::vector<std::vector<int32_t>> got(s.size());
      for (size_t step = 0; step < 12; ++step) {
        std::vector<int32_t> out(s.size());
        INFO(dz_last_error());
        REQUIRE(dz_generate_step(s.data(), s.size(), out.data()) == DZ_OK);
        for (size_t i = 0; i < s.size(); ++i) got[i].push_back(out[i]);
      }
      for (size_t i = 0; i < s.size(); ++i) CHECK(got[i] == fx.refs[i].greedy);
      // The sparse attention counter: the prefill and 12 decode steps (each step computes new logits).
      dz_session_stats st;
      dz_session_stats_init(&st);
      REQUIRE(dz_session_get_stats(s[2], &st) == DZ_OK);
      uint64_t want = 0;
      for (uint64_t t = 0; t < fx.refs[2].prompt.size() + 12; ++t) want += 3 * std::min<uint64_t>(16, t + 1);
      CHECK(st.attention_tokens_read == want);
      // A new session with the same prompt reuses the cached full pages (latent + indexer keys) and
      // computes the same last logits.
      dz_session* again = api.session();
      REQUIRE(dz_session_append(again, fx.refs[2].prompt.data(), fx.refs[2].prompt.size(), DZ_LOGITS_LAST) == DZ_OK);
      dz_session_stats st2;
      dz_session_stats_init(&st2);
      REQUIRE(dz_session_get_stats(again, &st2) == DZ_OK);
      CHECK(st2.tokens_reused == 144);  // 9 full pages of 16; the last token is always computed
      const float* lg = nullptr;
      size_t rows = 0, nv = 0;
      REQUIRE(dz_session_logits(again, &lg, &rows, &nv) == DZ_OK);
      const size_t T = fx.refs[2].prompt.size();
      CHECK(cosine(lg, fx.refs[2].logits.data() + (T - 1) * nv, nv) >= 0.99999);
      dz_session_free(again);
      for (dz_session* x : s) dz_session_free(x);
    }
  }
}
