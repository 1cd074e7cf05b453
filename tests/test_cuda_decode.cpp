// The CUDA decode path ([cuda]; skipped with a message where no GPU is
// present, but always compiled): split-K decode attention against a float64
// reference, the unsplit kernel and itself under other grids; prefill
// attention against float64; gpt-oss decode
// steps replayed from CUDA graphs against the same steps run eagerly
// (bitwise), and against the CPU backend, over contexts that cross pages and
// split-grid buckets, at batch 1 and 3.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/sampling.h"
#include "dayzero.h"
#include "model/gpt_oss.h"
#include "runtime/device.h"
#include "support/api_model.h"
#include "support/gpu.h"
#include "support/safetensors_writer.h"

#ifdef DZ_WITH_CUDA
#include "cuda/attention.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#endif

namespace {

using dz::test::have_gpu;

}  // namespace

#ifdef DZ_WITH_CUDA

namespace {

using dz::cuda::DeviceArray;

// A paged single-layer KV cache (bf16 K|V, as the model stores it) with random pages, queries and sinks.
struct AttnCase {
  int n_heads, n_kv, D, page_tokens = 16;
  std::vector<int> pos, item;                // per row
  std::vector<std::vector<int32_t>> tables;  // per item: page ids
  std::vector<uint16_t> kv;                  // bf16, host copy
  std::vector<float> q, sinks;
  int q_stride = 0;
  int64_t page_bytes = 0;

  AttnCase(int nh, int nkv, int d, std::vector<int> positions, std::vector<int> items, uint32_t seed, int page = 16)
      : n_heads(nh), n_kv(nkv), D(d), page_tokens(page), pos(std::move(positions)), item(std::move(items)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int n_items = *std::max_element(item.begin(), item.end()) + 1;
    std::vector<int> need(size_t(n_items), 0);
    for (size_t r = 0; r < pos.size(); ++r) need[size_t(item[r])] = std::max(need[size_t(item[r])], pos[r] + 1);
    int pages = 0;
    for (int n : need) pages += (n + page_tokens - 1) / page_tokens;
    std::vector<int32_t> perm(static_cast<size_t>(pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);  // pages scattered over the storage
    tables.resize(size_t(n_items));
    for (int it = 0, k = 0; it < n_items; ++it)
      for (int p = 0; p < (need[size_t(it)] + page_tokens - 1) / page_tokens; ++p)
        tables[size_t(it)].push_back(perm[size_t(k++)]);
    page_bytes = int64_t(page_tokens) * 2 * n_kv * D * 2;
    kv.resize(size_t(pages) * size_t(page_bytes) / 2);
    for (auto& x : kv) x = dz::test::f32_to_bf16(nd(rng) * 1.5f);  // scores spread enough that the softmax is not flat
    q_stride = n_heads * D + 2 * n_kv * D;                         // as in the fused QKV rows
    q.resize(pos.size() * size_t(q_stride));
    for (auto& x : q) x = nd(rng);
    sinks.resize(size_t(n_heads));
    for (auto& x : sinks) x = nd(rng) * 2.f;
  }
  const uint16_t* key(int it, int j) const {
    const int64_t page = tables[size_t(it)][size_t(j / page_tokens)];
    return kv.data() + (page * page_bytes + int64_t(j % page_tokens) * 2 * n_kv * D * 2) / 2;
  }
  // float64 reference of row r, head h: softmax over [sink, keys lo..pos], sink dropped.
  std::vector<double> reference(int r, int h, int window) const {
    const int p = pos[size_t(r)], lo = window > 0 ? std::max(0, p - window + 1) : 0, kvh = h / (n_heads / n_kv);
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> s;
    double m = sinks[size_t(h)];
    for (int j = lo; j <= p; ++j) {
      const uint16_t* k = key(item[size_t(r)], j) + kvh * D;
      double dot = 0;
      for (int d = 0; d < D; ++d)
        dot += double(q[size_t(r) * q_stride + size_t(h * D + d)]) * dz::test::bf16_to_double(k[d]);
      s.push_back(dot * scale);
      m = std::max(m, dot * scale);
    }
    double l = std::exp(double(sinks[size_t(h)]) - m);
    std::vector<double> out(size_t(D), 0.0);
    for (int j = lo; j <= p; ++j) {
      const double w = std::exp(s[size_t(j - lo)] - m);
      l += w;
      const uint16_t* v = key(item[size_t(r)], j) + n_kv * D + kvh * D;
      for (int d = 0; d < D; ++d) out[size_t(d)] += w * dz::test::bf16_to_double(v[d]);
    }
    for (auto& x : out) x /= l;
    return out;
  }
};

struct DeviceCase {
  dz::cuda::Context& ctx;
  const AttnCase& c;
  DeviceArray<uint8_t> kv;
  DeviceArray<float> q, sinks, out;
  DeviceArray<int32_t> pt, ipt, ritem, rpos, rows;
  DeviceCase(dz::cuda::Context& cx, const AttnCase& cs) : ctx(cx), c(cs) {
    auto& P = ctx.pool();
    kv = DeviceArray<uint8_t>(P, c.kv.size() * 2, "kv");
    q = DeviceArray<float>(P, c.q.size(), "q");
    sinks = DeviceArray<float>(P, c.sinks.size(), "sinks");
    out = DeviceArray<float>(P, c.pos.size() * size_t(c.n_heads * c.D), "out");
    std::vector<int32_t> flat, offs;
    for (const auto& t : c.tables) offs.push_back(int32_t(flat.size())), flat.insert(flat.end(), t.begin(), t.end());
    std::vector<int32_t> all(c.pos.size());
    std::iota(all.begin(), all.end(), 0);
    pt = up(flat);
    ipt = up(offs);
    ritem = up(std::vector<int32_t>(c.item.begin(), c.item.end()));
    rpos = up(std::vector<int32_t>(c.pos.begin(), c.pos.end()));
    rows = up(all);
    DZ_CUDA_CHECK(cudaMemcpy(kv.get(), c.kv.data(), c.kv.size() * 2, cudaMemcpyHostToDevice));
    DZ_CUDA_CHECK(cudaMemcpy(q.get(), c.q.data(), c.q.size() * 4, cudaMemcpyHostToDevice));
    DZ_CUDA_CHECK(cudaMemcpy(sinks.get(), c.sinks.data(), c.sinks.size() * 4, cudaMemcpyHostToDevice));
    // Copies from pageable memory may return before their DMA lands, and the
    // kernels run on a non-blocking stream.
    DZ_CUDA_CHECK(cudaDeviceSynchronize());
  }
  DeviceArray<int32_t> up(const std::vector<int32_t>& v) {
    DeviceArray<int32_t> d(ctx.pool(), std::max<size_t>(v.size(), 1), "ints");
    if (!v.empty()) DZ_CUDA_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return d;
  }
  dz::cuda::AttnBatch batch(int window) const {
    dz::cuda::AttnBatch a;
    a.kv = kv.get();
    a.page_bytes = c.page_bytes;
    a.page_tokens = c.page_tokens;
    a.page_table = pt.get();
    a.item_pt = ipt.get();
    a.row_item = ritem.get();
    a.row_pos = rpos.get();
    a.n_heads = c.n_heads;
    a.n_kv_heads = c.n_kv;
    a.head_dim = c.D;
    a.window = window;
    a.scale = float(1.0 / std::sqrt(double(c.D)));
    a.sinks = sinks.get();
    a.q = q.get();
    a.q_stride = c.q_stride;
    a.out_f32 = out.get();
    return a;
  }
  // Rows `which` (indices into the case's rows) through the split kernel; fp32 [rows][heads*D] of all rows
  // (rows not run keep NaN).
  std::vector<float> split(int window, const std::vector<int32_t>& which, int splits,
                           const dz::cuda::DecodeSplitPolicy& p, size_t partial_rows) {
    DeviceArray<int32_t> w = up(which);
    const size_t pf = dz::cuda::decode_partial_floats(int(partial_rows), c.n_heads, c.D, splits);
    const size_t ti = dz::cuda::decode_ticket_ints(int(partial_rows), c.n_heads, c.n_kv);
    DeviceArray<float> part(ctx.pool(), pf, "partials");
    DeviceArray<int32_t> tickets(ctx.pool(), ti, "tickets");
    // On the kernels' stream (non-blocking: a plain cudaMemset is not ordered before them).
    DZ_CUDA_CHECK(cudaMemsetAsync(part.get(), 0xff, pf * 4, ctx.stream()));  // NaN: a partial read before written shows
    DZ_CUDA_CHECK(cudaMemsetAsync(tickets.get(), 0, ti * 4, ctx.stream()));
    DZ_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), ctx.stream()));
    // Twice: the tickets must be back to zero after a launch for the next one to be right.
    std::vector<float> first;
    for (int rep = 0; rep < 2; ++rep) {
      dz::cuda::attention_decode_split(batch(window), w.get(), int(which.size()), splits, p,
                                       {part.get(), pf, tickets.get(), ti}, ctx.stream());
      DZ_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
      if (rep == 0) first = fetch();
    }
    std::vector<int32_t> left(ti);
    DZ_CUDA_CHECK(cudaMemcpy(left.data(), tickets.get(), ti * 4, cudaMemcpyDeviceToHost));
    CHECK(std::count(left.begin(), left.end(), 0) == std::ptrdiff_t(ti));
    const std::vector<float> second = fetch();
    CHECK(std::memcmp(first.data(), second.data(), first.size() * 4) == 0);
    return second;
  }
  // Prefill over tiles of consecutive rows; fp32 [rows][heads*D] (rows of no tile keep NaN).
  std::vector<float> prefill(int window, const std::vector<dz::cuda::AttnTile>& tiles, int terms = 2,
                             bool wgmma = true) {
    DeviceArray<uint8_t> dt(ctx.pool(), tiles.size() * sizeof(dz::cuda::AttnTile), "tiles");
    DZ_CUDA_CHECK(
        cudaMemcpy(dt.get(), tiles.data(), tiles.size() * sizeof(dz::cuda::AttnTile), cudaMemcpyHostToDevice));
    DZ_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), ctx.stream()));
    dz::cuda::AttnBatch b = batch(window);
    b.terms = terms;
    b.prefill_wgmma = wgmma;
    dz::cuda::attention_prefill(b, reinterpret_cast<const dz::cuda::AttnTile*>(dt.get()), int(tiles.size()),
                                dz::cuda::attention_tile_rows(c.n_heads, c.n_kv), ctx.stream());
    DZ_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    return fetch();
  }
  std::vector<float> unsplit(int window) {
    DZ_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), ctx.stream()));
    dz::cuda::attention_decode(batch(window), rows.get(), int(c.pos.size()), ctx.stream());
    DZ_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    return fetch();
  }
  std::vector<float> fetch() {
    std::vector<float> h(out.size());
    DZ_CUDA_CHECK(cudaMemcpy(h.data(), out.get(), out.bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
};

dz::cuda::ContextOptions small_ctx() {
  dz::cuda::ContextOptions o;
  o.pool_bytes = size_t(512) << 20;
  o.cublas_workspace = size_t(4) << 20;
  return o;
}

}  // namespace

TEST_CASE("split-K decode attention: the chunk policy on the host (no GPU needed)", "[cuda]") {
  using dz::cuda::decode_chunk_keys;
  using dz::cuda::decode_chunks;
  const dz::cuda::DecodeSplitPolicy def;
  // The default's table (docs/cuda-attention.md): 256 keys up to 2K, 512 up to 8K, 1K up to 32K, then at most 32.
  const std::pair<int, int> table[] = {
      {1, 256},      {256, 256},    {2048, 256},   {2049, 512},    {8192, 512},      {8193, 1024},        {32768, 1024},
      {32769, 2048}, {65536, 2048}, {65537, 4096}, {131072, 4096}, {1 << 20, 32768}, {INT32_MAX, 1 << 26}};
  for (const auto& [len, chunk] : table) {
    INFO("len " << len);
    CHECK(decode_chunk_keys(len, def, def.max_splits) == chunk);
  }
  CHECK_FALSE(dz::cuda::decode_policy_valid({48, 8, 32}));
  CHECK_FALSE(dz::cuda::decode_policy_valid({256, 0, 32}));
  CHECK_FALSE(dz::cuda::decode_policy_valid({256, 8, 0}));
  CHECK(dz::cuda::decode_policy_valid(def));
  // Random policies and lengths against a search over chunk sizes: the
  // smallest min_chunk * 2^k with at most base_splits * 2^k and max_splits
  // chunks; a grid too small for it takes the fewest 32-key multiples that fit.
  std::mt19937 rng(5);
  for (int it = 0; it < 20000; ++it) {
    dz::cuda::DecodeSplitPolicy p;
    p.min_chunk = 32 * int(1 + rng() % 32);
    p.base_splits = int(1 + rng() % 64);
    p.max_splits = int(1 + rng() % 64);
    const int len = int(1 + rng() % (it % 2 ? 5000u : 3000000u));
    int64_t want = 0;
    for (int k = 0; k < 40 && !want; ++k) {
      const int64_t c = int64_t(p.min_chunk) << k, n = (len + c - 1) / c;
      if (n <= p.max_splits && n <= int64_t(p.base_splits) << k) want = c;
    }
    const int splits = int(1 + rng() % 80);
    const int64_t fit = (int64_t(len) + splits - 1) / splits;
    if (fit > want) want = (fit + 31) / 32 * 32;
    INFO("policy " << p.min_chunk << ":" << p.base_splits << ":" << p.max_splits << ", len " << len << ", splits "
                   << splits);
    REQUIRE(decode_chunk_keys(len, p, splits) == want);
    REQUIRE(decode_chunks(len, p, splits) == int((len + want - 1) / want));
    REQUIRE(decode_chunks(len, p, splits) <= std::min(splits, p.max_splits));
  }
}

TEST_CASE("split-K decode attention: float64 reference, unsplit kernel, grid independence", "[cuda]") {
  if (!have_gpu()) return;
  dz::cuda::Context ctx(small_ctx());
  struct Shape {
    int nh, nkv, D;
  };
  // G = 8 (gpt-oss: MMA rows 8-15 idle), G = 2, G = 12 (rows 12-15 idle), G = 20 (two head groups, the second
  // partial).
  for (const Shape sh : {Shape{16, 2, 64}, Shape{4, 2, 32}, Shape{24, 2, 128}, Shape{40, 2, 64}}) {
    // Each warp's keys move 64 at a time through the page table: pages of 16 tokens, and for the gpt-oss grouping
    // also 24 and 100 (two policies).
    const std::vector<int> pages = sh.nh == 16 && sh.D == 64 ? std::vector<int>{16, 24, 100} : std::vector<int>{16};
    for (const int page : pages) {
      // Rows of two sequences; long contexts, page and chunk boundaries, a single key.
      const AttnCase c(sh.nh, sh.nkv, sh.D, {4999, 0, 63, 64, 2048, 4095, 1000}, {0, 1, 1, 0, 0, 1, 1},
                       uint32_t(sh.D * 7 + sh.nh), page);
      DeviceCase dc(ctx, c);
      const int R = int(c.pos.size());
      std::vector<int32_t> all(static_cast<size_t>(R));
      std::iota(all.begin(), all.end(), 0);
      for (const int window : {0, 128, 1000}) {
        // Reference once per window.
        std::vector<std::vector<double>> ref(size_t(R * sh.nh));
        double amax = 0;
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < sh.nh; ++h) {
            ref[size_t(r * sh.nh + h)] = c.reference(r, h, window);
            for (double x : ref[size_t(r * sh.nh + h)]) amax = std::max(amax, std::fabs(x));
          }
        auto max_err = [&](const std::vector<float>& got) {
          double e = 0;
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < sh.nh; ++h)
              for (int d = 0; d < sh.D; ++d) {
                const double g = got[size_t(r) * sh.nh * sh.D + size_t(h * sh.D + d)];
                e = std::max(e, std::isfinite(g) ? std::fabs(g - ref[size_t(r * sh.nh + h)][size_t(d)]) : 1e30);
              }
          return e;
        };
        const std::vector<float> un = dc.unsplit(window);
        const double e_un = max_err(un);
        INFO("heads " << sh.nh << "/" << sh.nkv << " D " << sh.D << ", " << page << "-token pages, window " << window
                      << ": unsplit max error " << e_un << " (max |out| " << amax << ")");
        CHECK(e_un < 2e-5 * std::max(1.0, amax));
        struct Pol {
          int min_chunk, base_splits, max_splits;
        };
        // The library's default, chunks growing with the length from 32 keys,
        // and fixed-size chunks (base_splits >= max_splits).
        const dz::cuda::DecodeSplitPolicy def;
        int n_pol = 0;
        for (const Pol pol : {Pol{def.min_chunk, def.base_splits, def.max_splits}, Pol{32, 2, 64}, Pol{64, 64, 64},
                              Pol{32, 1024, 1024}, Pol{32, 8, 8}, Pol{256, 4, 4}, Pol{512, 64, 64}}) {
          if (page != 16 && n_pol++ >= 2) break;
          dz::cuda::DecodeSplitPolicy p;
          p.min_chunk = pol.min_chunk;
          p.base_splits = pol.base_splits;
          p.max_splits = pol.max_splits;
          int need = 1;
          for (int r = 0; r < R; ++r) {
            const int len = c.pos[size_t(r)] + 1 - (window > 0 ? std::max(0, c.pos[size_t(r)] - window + 1) : 0);
            need = std::max(need, dz::cuda::decode_chunks(len, p, p.max_splits));
            CHECK(dz::cuda::decode_chunks(len, p, p.max_splits) <= p.max_splits);
          }
          // The exact grid, a larger one (blocks past each row's chunks exit), a
          // too-small one (chunks grow: still correct), and partials for 3 rows
          // at a time (several launches).
          for (const int splits : {need, 2 * need + 3, std::max(1, need / 3)}) {
            for (const size_t prow : {size_t(R), size_t(3)}) {
              const std::vector<float> got = dc.split(window, all, splits, p, prow);
              const double e = max_err(got);
              double vs_un = 0;
              for (size_t k = 0; k < got.size(); ++k) vs_un = std::max(vs_un, double(std::fabs(got[k] - un[k])));
              INFO("policy " << p.min_chunk << ":" << p.base_splits << ":" << p.max_splits << ", grid " << splits
                             << " (need " << need << "), partial rows " << prow << ": max error " << e
                             << ", vs unsplit " << vs_un);
              CHECK(e < 2e-5 * std::max(1.0, amax));
              CHECK(vs_un < 4e-5 * std::max(1.0, amax));
            }
          }
          // A row's output does not depend on the other rows or on the grid (>= need): bitwise.
          const std::vector<float> full = dc.split(window, all, need, p, size_t(R));
          for (const int r : {0, 3, 6}) {
            const std::vector<float> alone = dc.split(window, {r}, 2 * need, p, 1);
            const size_t n = size_t(sh.nh * sh.D);
            CHECK(std::memcmp(alone.data() + size_t(r) * n, full.data() + size_t(r) * n, n * 4) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("prefill attention (tensor cores): float64 reference over ragged tiles, windows, head groupings", "[cuda]") {
  if (!have_gpu()) return;
  dz::cuda::Context ctx(small_ctx());
  struct Shape {
    int nh, nkv, D;
  };
  // G = 8 (gpt-oss: 2 tokens a warp), 2 (8 tokens), 12 (one token, rows 12-15 idle), 20 (two head groups), 1 (16
  // tokens a warp).
  for (const Shape sh : {Shape{16, 2, 64}, Shape{4, 2, 32}, Shape{24, 2, 128}, Shape{40, 2, 64}, Shape{2, 2, 64}}) {
    // A prompt from position 0 and one continuing after 700 cached tokens: keys cross pages and stages.
    std::vector<int> pos, item;
    for (int p = 0; p < 150; ++p) pos.push_back(p), item.push_back(0);
    for (int p = 700; p < 764; ++p) pos.push_back(p), item.push_back(1);
    // The kernels step each thread's keys a stage (64 keys) at a time through the page table: pages of 16
    // tokens (4 a stage), and for the gpt-oss grouping also 24 (a stage ends mid-page) and 100 (longer than a
    // stage), two terms.
    const std::vector<int> pages = sh.nh == 16 && sh.D == 64 ? std::vector<int>{16, 24, 100} : std::vector<int>{16};
    for (const int page : pages) {
      const AttnCase c(sh.nh, sh.nkv, sh.D, pos, item, uint32_t(sh.D * 5 + sh.nh), page);
      DeviceCase dc(ctx, c);
      const int R = int(pos.size()), tr = dz::cuda::attention_tile_rows(sh.nh, sh.nkv);
      std::vector<dz::cuda::AttnTile> tiles;
      for (int r0 = 0; r0 < R;) {  // tiles of at most tr consecutive rows of one sequence (the last of each ragged)
        int n = 1;
        while (n < tr && r0 + n < R && item[size_t(r0 + n)] == item[size_t(r0)]) ++n;
        tiles.push_back({r0, n});
        r0 += n;
      }
      // Two terms (fp32-like) and one (bf16 queries and probabilities); the wgmma kernel (sm_90a, D = 64) and
      // the mma.sync one.
      for (const int terms : {2, 1})
        for (const bool wgmma : {true, false})
          for (const int window : {0, 100}) {
            if (page != 16 && terms != 2) continue;
            const std::vector<float> got = dc.prefill(window, tiles, terms, wgmma);
            double e = 0, amax = 0;
            int er = 0, eh = 0, ed = 0;  // where the largest error is
            for (int r = 0; r < R; ++r)
              for (int h = 0; h < sh.nh; ++h) {
                const std::vector<double> ref = c.reference(r, h, window);
                for (int d = 0; d < sh.D; ++d) {
                  const double g = got[size_t(r) * sh.nh * sh.D + size_t(h * sh.D + d)];
                  amax = std::max(amax, std::fabs(ref[size_t(d)]));
                  const double ed_ = std::isfinite(g) ? std::fabs(g - ref[size_t(d)]) : 1e30;
                  if (ed_ > e) e = ed_, er = r, eh = h, ed = d;
                }
              }
            std::printf(
                "prefill attention heads %d/%d D %d window %d (%d rows a tile, %d-token pages), %d term%s%s: max error "
                "%.3g (max |out| %.3g) at row %d (position %d), head %d, dim %d\n",
                sh.nh, sh.nkv, sh.D, window, tr, page, terms, terms == 2 ? "s" : "", wgmma ? "" : ", mma.sync", e, amax,
                er, pos[size_t(er)], eh, ed);
            // One term: bf16 rounding of the queries (scores off by ~2^-9 of their size) and probabilities;
            // measured up to 2.8e-3 of max |out| on an H200.
            CHECK(e < (terms == 2 ? 2e-5 : 1e-2) * std::max(1.0, amax));
          }
    }
  }
}

#endif  // DZ_WITH_CUDA

namespace {

const std::string kDir = std::string(DZ_TEST_DATA) + "/gpt_oss_tiny";

struct Model {
  dz_model* m = nullptr;
  explicit Model(dz_device dev) {
    dz_model_params p;
    dz_model_params_init(&p);
    p.device = dev;
    p.experts = DZ_EXPERTS_NATIVE;
    p.activations = DZ_ACTIVATIONS_BF16;  // the CPU rounds GEMM inputs as the GPU does: comparable position by position
    p.n_threads = 2;
    const dz_status st = dz_model_open(kDir.c_str(), &p, &m);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
  }
  ~Model() { dz_model_free(m); }
};

struct Arena {
  dz_kv_arena* a = nullptr;
  explicit Arena(const Model& m) {
    dz_kv_arena_params p;
    dz_kv_arena_params_init(&p);
    p.page_tokens = 16;
    p.capacity_bytes = uint64_t(32) << 20;
    p.prefix_cache = 0;
    REQUIRE(dz_kv_arena_create(m.m, &p, &a) == DZ_OK);
  }
  ~Arena() { dz_kv_arena_free(a); }
};

// n sessions on one model: prompts, then forced decode steps; logits of every step.
struct Run {
  Model model;
  Arena arena;
  std::vector<dz_session*> ss;
  std::vector<int32_t> greedy;  // the last step's greedy samples
  bool graphs;
  Run(dz_device dev, bool g, const std::vector<std::vector<int32_t>>& prompts) : model(dev), arena(model), graphs(g) {
    dz::test::GraphsOn gg(graphs);
    for (const auto& pr : prompts) {
      dz_session* s = nullptr;
      REQUIRE(dz_session_create(arena.a, nullptr, &s) == DZ_OK);
      ss.push_back(s);
      const dz_status st = dz_session_append(s, pr.data(), pr.size(), DZ_LOGITS_LAST);
      INFO(dz_last_error());
      REQUIRE(st == DZ_OK);
    }
  }
  ~Run() {
    for (auto s : ss) dz_session_free(s);
  }
  std::vector<std::vector<float>> step(const std::vector<int32_t>& tokens) {
    dz::test::GraphsOn gg(graphs);
    const dz_status st = dz_decode_batch(ss.data(), tokens.data(), ss.size());
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
    std::vector<std::vector<float>> out;
    greedy.clear();
    for (auto s : ss) {
      // The default sampler is greedy: on the GPU the device's argmax, read
      // before the row itself is copied to the host.
      int32_t t = -1;
      REQUIRE(dz_session_sample(s, &t) == DZ_OK);
      greedy.push_back(t);
      const float* p;
      size_t rows, v;
      REQUIRE(dz_session_logits(s, &p, &rows, &v) == DZ_OK);
      REQUIRE(rows == 1);
      out.emplace_back(p, p + v);
    }
    return out;
  }
};

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return ab / std::sqrt(aa * bb);
}

}  // namespace

// Contexts up to ~200 cross 16-token pages every 16 steps and the split grid's
// buckets (64-key chunks: 1, 2, 4 chunks), so graphs are captured for several
// keys and replayed with page tables, positions and grids changing under them.
TEST_CASE("gpt-oss decode: CUDA graph replays equal eager steps bitwise and match the CPU backend", "[cuda]") {
  if (!have_gpu()) return;
  for (const int batch : {1, 3}) {
    std::vector<std::vector<int32_t>> prompts;
    for (int b = 0; b < batch; ++b) {
      std::vector<int32_t> pr(static_cast<size_t>(3 + 37 * b));  // 3, 40, 77 tokens
      for (size_t k = 0; k < pr.size(); ++k) pr[k] = int32_t((k * 131 + size_t(b) * 17 + 5) % 512);
      prompts.push_back(pr);
    }
    Run g(DZ_DEVICE_CUDA, true, prompts), e(DZ_DEVICE_CUDA, false, prompts), c(DZ_DEVICE_CPU, true, prompts);
    const uint64_t replays0 = dz::cuda_graph_replays();
    const int steps = 150;
    int mismatched = 0, greedy_bad = 0;
    std::vector<double> vs_cpu;
    for (int k = 0; k < steps; ++k) {
      std::vector<int32_t> t(static_cast<size_t>(batch));
      for (int b = 0; b < batch; ++b) t[size_t(b)] = int32_t((k * 97 + b * 31 + 11) % 512);
      const auto lg = g.step(t), le = e.step(t), lc = c.step(t);
      for (int b = 0; b < batch; ++b) {
        const size_t n = lg[size_t(b)].size();
        REQUIRE(le[size_t(b)].size() == n);
        if (std::memcmp(lg[size_t(b)].data(), le[size_t(b)].data(), n * 4) != 0) {
          ++mismatched;
          INFO("batch " << batch << " step " << k << " session " << b << ": graph vs eager cosine "
                        << cosine(lg[size_t(b)], le[size_t(b)]));
          CHECK(cosine(lg[size_t(b)], le[size_t(b)]) > 0.999999);
        }
        vs_cpu.push_back(cosine(lg[size_t(b)], lc[size_t(b)]));
        greedy_bad += g.greedy[size_t(b)] != dz::cpu::argmax(lg[size_t(b)].data(), int64_t(n));
        greedy_bad += e.greedy[size_t(b)] != dz::cpu::argmax(le[size_t(b)].data(), int64_t(n));
        greedy_bad += c.greedy[size_t(b)] != dz::cpu::argmax(lc[size_t(b)].data(), int64_t(n));
      }
    }
    const uint64_t replays = dz::cuda_graph_replays() - replays0;
    std::sort(vs_cpu.begin(), vs_cpu.end());
    const size_t below = size_t(std::count_if(vs_cpu.begin(), vs_cpu.end(), [](double x) { return x < 0.999; }));
    std::printf(
        "CUDA decode batch %d: %d steps, %llu graph replays, %d of %d logits rows differ from eager; cosine "
        "vs CPU (BF16 activations) min %.7f median %.7f, %zu rows below 0.999\n",
        batch, steps, (unsigned long long)replays, mismatched, steps * batch, vs_cpu.front(), vs_cpu[vs_cpu.size() / 2],
        below);
    CHECK(mismatched == 0);
    CHECK(greedy_bad == 0);
    // A fork taken while the last row is still on the device has the same
    // logits and samples the same token.
    {
      std::vector<int32_t> t(static_cast<size_t>(batch), 3);
      REQUIRE(dz_decode_batch(g.ss.data(), t.data(), g.ss.size()) == DZ_OK);
      dz_session* f = nullptr;
      REQUIRE(dz_session_fork(g.ss[0], &f) == DZ_OK);
      const float *pf, *po;
      size_t rf, ro, vf, vo;
      REQUIRE(dz_session_logits(f, &pf, &rf, &vf) == DZ_OK);
      REQUIRE(dz_session_logits(g.ss[0], &po, &ro, &vo) == DZ_OK);
      REQUIRE((rf == 1 && ro == 1 && vf == vo));
      CHECK(std::memcmp(pf, po, vf * 4) == 0);
      int32_t tf = -1, to = -1;
      REQUIRE(dz_session_sample(f, &tf) == DZ_OK);
      REQUIRE(dz_session_sample(g.ss[0], &to) == DZ_OK);
      CHECK(tf == to);
      CHECK(tf == dz::cpu::argmax(po, int64_t(vo)));
      dz_session_free(f);
    }
    // Every step replays a graph except the first of each key (eager) and its capture step (replayed too).
    CHECK(replays >= uint64_t(steps - 8));
    CHECK(replays <= uint64_t(steps));
    // A router near-tie may still flip a route now and then (different
    // summation orders): rare, not a blanket excuse.
    CHECK(vs_cpu[vs_cpu.size() / 2] > 0.9999);
    CHECK(below * 50 <= vs_cpu.size());
  }
}

// Rows left on the device by appends and decode steps are sampled there
// (batched in dz_generate_step, one row in dz_session_sample); a fork holds a
// host copy of the same row and the same rng, so it samples the same token on
// the host.
TEST_CASE("gpt-oss decode: sampling on the device draws what the host sampler draws", "[cuda]") {
  if (!have_gpu()) return;
  const std::vector<std::vector<int32_t>> prompts = {{5, 9, 200}, {7, 1, 2, 3, 4}, {100}};
  Run g(DZ_DEVICE_CUDA, true, prompts);
  // A prompt's last row stays on the device too: greedy takes its argmax.
  for (dz_session* s : g.ss) {
    int32_t t = -1;
    REQUIRE(dz_session_sample(s, &t) == DZ_OK);
    const float* p;
    size_t rows, v;
    REQUIRE(dz_session_logits(s, &p, &rows, &v) == DZ_OK);
    REQUIRE(rows == 1);
    CHECK(t == dz::cpu::argmax(p, int64_t(v)));
  }
  const dz::cpu::SamplerConfig cfgs[3] = {{0.8f, 0, 0.95f}, {1.2f, 40, 1.f}, {0.5f, 0, 0.5f}};
  for (size_t i = 0; i < 3; ++i) {
    dz_sampler_params p;
    dz_sampler_params_init(&p);
    p.temperature = cfgs[i].temperature, p.top_k = cfgs[i].top_k, p.top_p = cfgs[i].top_p, p.seed = 100 + i;
    REQUIRE(dz_session_set_sampler(g.ss[i], &p) == DZ_OK);
  }
  auto forks = [&] {
    std::vector<dz_session*> f(g.ss.size());
    for (size_t i = 0; i < f.size(); ++i) REQUIRE(dz_session_fork(g.ss[i], &f[i]) == DZ_OK);
    return f;
  };
  int draws = 0, differ = 0;
  for (int step = 0; step < 40; ++step) {
    std::vector<dz_session*> f = forks();
    std::vector<int32_t> out(g.ss.size());
    const dz_status st = dz_generate_step(g.ss.data(), g.ss.size(), out.data());
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
    for (size_t i = 0; i < f.size(); ++i) {
      int32_t t = -1;
      REQUIRE(dz_session_sample(f[i], &t) == DZ_OK);
      differ += t != out[i], ++draws;
      dz_session_free(f[i]);
    }
    if (step % 4 != 3) continue;
    f = forks();  // one row at a time: dz_session_sample
    for (size_t i = 0; i < f.size(); ++i) {
      int32_t td = -1, th = -1;
      REQUIRE(dz_session_sample(g.ss[i], &td) == DZ_OK);
      REQUIRE(dz_session_sample(f[i], &th) == DZ_OK);
      differ += td != th, ++draws;
      dz_session_free(f[i]);
    }
  }
  std::printf("gpt-oss CUDA sampling on the device: %d draws, %d differ from the host sampler\n", draws, differ);
  // fp32 weights against the host's double: a draw within ~1e-6 of a boundary may differ (~1e-5 of draws).
  CHECK(differ <= 1);
}
