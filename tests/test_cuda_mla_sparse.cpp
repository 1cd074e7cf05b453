// GPU test of sparse MLA decode (cuda/mla_sparse.h) against float64 softmax
// attention over the selected positions, and through the absorbed weights
// against the CPU backend's cpu::mla_decode ([cuda]; skips with a message
// where no CUDA device is present). Paged bf16 latents (shuffled pages, a
// field offset), unselected (-1) and repeated positions, top-k not a multiple
// of the kernel's step, several splits, heads not a multiple of the block's 64.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/mla.h"

#ifdef DZ_WITH_CUDA
#include "cuda/mla_sparse.h"
#include "runtime/cuda/context.h"
#include "support/device_buffer.h"
#include "support/safetensors_writer.h"

using dz::test::bf16_to_double;
using dz::test::f32_to_bf16;
#endif

#include "support/gpu.h"

TEST_CASE("CUDA sparse MLA decode matches float64 attention over the selected positions", "[cuda][dsa]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  constexpr int R = cuda::kMlaRank, Rr = cuda::kMlaRope, D = R + Rr;
  struct Case {
    int batch, heads, topk, ctx_len, splits;  // splits 0: sparse_mla_splits' choice
  };
  const std::vector<Case> cases = {{1, 128, 2048, 5000, 0},
                                   {3, 48, 100, 300, 0},
                                   {2, 64, 2000, 2500, 7},
                                   {1, 16, 64, 64, 1},
                                   {4, 128, 2048, 2048, 0}};
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const Case& c : cases) {
    INFO("batch " << c.batch << " heads " << c.heads << " topk " << c.topk << " ctx " << c.ctx_len);
    const uint32_t pt = 64;
    const size_t offset = 32, stride = offset + size_t(D) * 2 + 48;  // 16-byte multiples
    const int pages_each = int((c.ctx_len + pt - 1) / pt), P = pages_each * c.batch;
    std::vector<int> perm(static_cast<size_t>(P));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<uint16_t> arena(size_t(P) * pt * stride / 2);
    for (auto& v : arena) v = f32_to_bf16(nd(rng) * 4.f);  // other fields: noise, never read as latents
    auto latent = [&](int b, int64_t p) {
      return arena.data() +
             (size_t(perm[size_t(b * pages_each + int(p / pt))]) * pt * stride + size_t(p % pt) * stride + offset) / 2;
    };
    for (int b = 0; b < c.batch; ++b)
      for (int64_t p = 0; p < c.ctx_len; ++p) {
        uint16_t* l = latent(b, p);
        for (int d = 0; d < D; ++d) l[d] = f32_to_bf16(nd(rng));
      }
    std::vector<uint16_t> q(size_t(c.batch) * c.heads * D);
    for (auto& v : q) v = f32_to_bf16(nd(rng) * 0.5f);
    // Selections: distinct positions mostly, some -1, some repeated.
    std::vector<int32_t> sel(size_t(c.batch) * c.topk);
    std::uniform_int_distribution<int> kind(0, 15), any(0, c.ctx_len - 1);
    for (int b = 0; b < c.batch; ++b) {
      std::vector<int32_t> pos(static_cast<size_t>(c.ctx_len));
      std::iota(pos.begin(), pos.end(), 0);
      std::shuffle(pos.begin(), pos.end(), rng);
      for (int j = 0; j < c.topk; ++j) {
        const int k = kind(rng);
        sel[size_t(b) * c.topk + j] = k == 0 ? -1 : k == 1 ? any(rng) : pos[size_t(j % c.ctx_len)];
      }
    }
    if (c.batch > 1)  // a row with nothing selected: zeros out
      std::fill(sel.begin() + (c.batch - 1) * c.topk, sel.end(), -1);

    test::DeviceBuffer<uint16_t> dar(arena), dq(q);
    test::DeviceBuffer<int32_t> dsel(sel);
    std::vector<const uint8_t*> page_ptr(static_cast<size_t>(P));
    for (int i = 0; i < P; ++i)
      page_ptr[size_t(i)] = reinterpret_cast<const uint8_t*>(dar.p) + size_t(perm[size_t(i)]) * pt * stride;
    test::DeviceBuffer<const uint8_t*> dpages(page_ptr);
    std::vector<const uint8_t* const*> tables(static_cast<size_t>(c.batch));
    for (int b = 0; b < c.batch; ++b) tables[size_t(b)] = dpages.p + b * pages_each;
    test::DeviceBuffer<const uint8_t* const*> dtables(tables);
    test::DeviceBuffer<float> dout(size_t(c.batch) * c.heads * R);
    cuda::SparseMlaDecode a;
    a.batch = c.batch, a.n_heads = c.heads, a.scale = 1.f / std::sqrt(192.f), a.q = dq.p, a.sel = dsel.p;
    a.topk = c.topk, a.pages = dtables.p, a.page_tokens = pt, a.stride = stride, a.offset = offset, a.out = dout.p;
    const int splits = c.splits ? c.splits : cuda::sparse_mla_splits(a, 132);
    test::DeviceBuffer<uint8_t> scratch(cuda::sparse_mla_scratch_bytes(a, splits));
    cuda::sparse_mla_decode(a, splits, scratch.p, scratch.n, ctx.stream());
    ctx.sync();
    const auto out = dout.get();
    cuda::sparse_mla_decode(a, splits, scratch.p, scratch.n, ctx.stream());
    ctx.sync();
    CHECK(dout.get() == out);  // the same bits again

    double worst = 0, min_cos = 1;
    for (int b = 0; b < c.batch; ++b)
      for (int h = 0; h < c.heads; ++h) {
        const uint16_t* qh = q.data() + (size_t(b) * c.heads + h) * D;
        std::vector<double> s, p;
        std::vector<const uint16_t*> rows;
        for (int j = 0; j < c.topk; ++j) {
          const int32_t pos = sel[size_t(b) * c.topk + j];
          if (pos < 0) continue;
          const uint16_t* l = latent(b, pos);
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += double(bf16_to_double(qh[d])) * double(bf16_to_double(l[d]));
          s.push_back(dot * a.scale), rows.push_back(l);
        }
        const float* g = out.data() + (size_t(b) * c.heads + h) * R;
        if (rows.empty()) {
          for (int d = 0; d < R; ++d) REQUIRE(g[d] == 0.f);
          continue;
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double v : s) p.push_back(std::exp(v - mx)), sum += p.back();
        double dot = 0, n1 = 0, n2 = 0;
        for (int d = 0; d < R; ++d) {
          double ref = 0, mag = 0;
          for (size_t j = 0; j < rows.size(); ++j) {
            const double v = bf16_to_double(rows[j][d]);
            ref += p[j] * v, mag += p[j] * std::fabs(v);
          }
          ref /= sum, mag /= sum;
          // Probabilities rounded to bf16 (relative 2^-9 each) and their fp32 sum: 2^-7 of the magnitudes.
          const double bound = mag * 0x1p-7 + 1e-6;
          worst = std::max(worst, std::fabs(g[d] - ref) / bound);
          if (std::fabs(g[d] - ref) > bound) {
            INFO("b " << b << " h " << h << " d " << d << " gpu " << g[d] << " ref " << ref << " bound " << bound);
            REQUIRE(std::fabs(g[d] - ref) <= bound);
          }
          dot += g[d] * ref, n1 += double(g[d]) * g[d], n2 += ref * ref;
        }
        min_cos = std::min(min_cos, dot / std::sqrt(n1 * n2));
      }
    CHECK(min_cos >= 0.99999);
    WARN("sparse MLA batch " << c.batch << " heads " << c.heads << " topk " << c.topk << " splits " << splits
                             << ": worst error " << worst << " of its bound, cosine >= " << min_cos);
  }
#endif
}

TEST_CASE("CUDA sparse MLA decode through the absorbed weights matches the CPU backend's MLA decode", "[cuda][dsa]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  constexpr int R = cuda::kMlaRank, Rr = cuda::kMlaRope, D = R + Rr;
  const int H = 16, nope = 128, vdim = 128, L = 700, K = 256;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  cpu::MlaDims md;
  md.n_heads = H, md.nope = nope, md.rope = Rr, md.v = vdim, md.rank = R;
  md.scale = float(1.0 / std::sqrt(double(nope + Rr)));
  // Latents (bf16 values, the CPU's fp32 records hold the same numbers), kv_b_proj, a query, a selection.
  std::vector<uint16_t> lat16(size_t(L) * D);
  for (auto& v : lat16) v = f32_to_bf16(nd(rng));
  std::vector<float> lat32(lat16.size());
  for (size_t i = 0; i < lat16.size(); ++i) lat32[i] = float(bf16_to_double(lat16[i]));
  std::vector<float> wkvb(size_t(H) * (nope + vdim) * R), qf(size_t(H) * (nope + Rr));
  for (auto& v : wkvb) v = nd(rng) * 0.05f;
  for (auto& v : qf) v = nd(rng);
  std::vector<int32_t> sel(static_cast<size_t>(K));
  for (int j = 0; j < K; ++j) sel[size_t(j)] = (j * 37 + 11) % L;
  sel[5] = -1;
  // CPU: one page holding every position, fp32 records.
  const uint8_t* page = reinterpret_cast<const uint8_t*>(lat32.data());
  cpu::PagedRows rows{&page, uint32_t(L), size_t(D) * 4, 0};
  std::vector<float> cpu_out(size_t(H) * vdim);
  cpu::mla_decode(md, qf.data(), wkvb.data(), rows, sel.data(), K, cpu_out.data(), nullptr);
  // GPU: q~ = W_UK^T q_nope (float64, then bf16) with the roped part; W_UV applied to its latent output.
  std::vector<uint16_t> qa(size_t(H) * D);
  for (int h = 0; h < H; ++h) {
    for (int r = 0; r < R; ++r) {
      double acc = 0;
      for (int i = 0; i < nope; ++i)
        acc += double(qf[size_t(h) * (nope + Rr) + i]) * wkvb[(size_t(h) * (nope + vdim) + i) * R + r];
      qa[size_t(h) * D + r] = f32_to_bf16(float(acc));
    }
    for (int i = 0; i < Rr; ++i) qa[size_t(h) * D + R + i] = f32_to_bf16(qf[size_t(h) * (nope + Rr) + nope + i]);
  }
  test::DeviceBuffer<uint16_t> dlat(lat16), dq(qa);
  test::DeviceBuffer<int32_t> dsel(sel);
  const uint8_t* dpage = reinterpret_cast<const uint8_t*>(dlat.p);
  test::DeviceBuffer<const uint8_t*> dpages(std::vector<const uint8_t*>{dpage});
  test::DeviceBuffer<const uint8_t* const*> dtables(std::vector<const uint8_t* const*>{dpages.p});
  test::DeviceBuffer<float> dout(size_t(H) * R);
  cuda::SparseMlaDecode a;
  a.batch = 1, a.n_heads = H, a.scale = md.scale, a.q = dq.p, a.sel = dsel.p, a.topk = K, a.pages = dtables.p;
  a.page_tokens = uint32_t(L), a.stride = size_t(D) * 2, a.offset = 0, a.out = dout.p;
  const int splits = cuda::sparse_mla_splits(a, 132);
  test::DeviceBuffer<uint8_t> scratch(cuda::sparse_mla_scratch_bytes(a, splits));
  cuda::sparse_mla_decode(a, splits, scratch.p, scratch.n, ctx.stream());
  ctx.sync();
  const auto lo = dout.get();
  double dot = 0, n1 = 0, n2 = 0, worst = 0;
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < vdim; ++j) {
      double o = 0;
      for (int r = 0; r < R; ++r)
        o += double(wkvb[(size_t(h) * (nope + vdim) + nope + j) * R + r]) * lo[size_t(h) * R + r];
      const double c = cpu_out[size_t(h) * vdim + j];
      dot += o * c, n1 += o * o, n2 += c * c, worst = std::max(worst, std::fabs(o - c));
    }
  const double cosv = dot / std::sqrt(n1 * n2);
  WARN("sparse MLA vs cpu::mla_decode: cosine " << cosv << ", max abs diff " << worst);
  CHECK(cosv >= 0.9999);  // the bf16 absorbed query and bf16 probabilities against fp32/fp64 on the host
#endif
}

// Kimi Linear's MLA layers attend to every visible position: with no selection
// the kernels read [0, n_visible) of each row. That must be exactly the
// explicit selection of those positions (-1 after them).
TEST_CASE("CUDA sparse MLA's dense causal mode equals selecting every visible position", "[cuda][kimi]") {
  if (!dz::test::have_gpu()) return;
#ifdef DZ_WITH_CUDA
  using namespace dz;
  cuda::Context ctx(test::pool_options(size_t(64) << 20));
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint32_t pt = 16;
  const std::vector<int64_t> vis = {1, 17, 300, 64, 129};
  const int B = int(vis.size()), topk = 300, pages_each = (topk + pt - 1) / pt, P = pages_each * B;
  for (const bool tensor : {true, false}) {
    const int heads = tensor ? 32 : 3, rank = tensor ? cuda::kMlaRank : 96, rope = tensor ? cuda::kMlaRope : 32;
    const size_t stride = (size_t(rank + rope) * 2 + 15) / 16 * 16;
    std::vector<uint16_t> arena(size_t(P) * pt * stride / 2);
    for (auto& v : arena) v = f32_to_bf16(nd(rng));
    std::vector<int32_t> sel(size_t(B) * topk, -1);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < vis[size_t(b)]; ++j) sel[size_t(b) * topk + j] = j;
    test::DeviceBuffer<uint16_t> dar(arena);
    test::DeviceBuffer<int32_t> dsel(sel);
    test::DeviceBuffer<int64_t> dvis(vis);
    std::vector<const uint8_t*> page_ptr(static_cast<size_t>(P));
    for (int i = 0; i < P; ++i) page_ptr[size_t(i)] = reinterpret_cast<const uint8_t*>(dar.p) + size_t(i) * pt * stride;
    test::DeviceBuffer<const uint8_t*> dpages(page_ptr);
    std::vector<const uint8_t* const*> tables(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) tables[size_t(b)] = dpages.p + b * pages_each;
    test::DeviceBuffer<const uint8_t* const*> dtables(tables);
    test::DeviceBuffer<float> o_sel(size_t(B) * heads * rank), o_dense(o_sel.n);
    if (tensor) {
      std::vector<uint16_t> q(size_t(B) * heads * (rank + rope));
      for (auto& v : q) v = f32_to_bf16(nd(rng) * 0.5f);
      test::DeviceBuffer<uint16_t> dq(q);
      cuda::SparseMlaDecode a;
      a.batch = B, a.n_heads = heads, a.scale = 0.07f, a.q = dq.p, a.topk = topk, a.pages = dtables.p;
      a.page_tokens = pt, a.stride = stride, a.offset = 0;
      const int splits = cuda::sparse_mla_splits(a, 132);
      test::DeviceBuffer<uint8_t> scratch(cuda::sparse_mla_scratch_bytes(a, splits));
      a.sel = dsel.p, a.out = o_sel.p;
      cuda::sparse_mla_decode(a, splits, scratch.p, scratch.n, ctx.stream());
      a.sel = nullptr, a.n_visible = dvis.p, a.out = o_dense.p;
      cuda::sparse_mla_decode(a, splits, scratch.p, scratch.n, ctx.stream());
    } else {
      std::vector<float> q(size_t(B) * heads * (rank + rope));
      for (auto& v : q) v = nd(rng) * 0.3f;
      test::DeviceBuffer<float> dq(q);
      cuda::SparseMlaGeneric a;
      a.n_q = B, a.n_heads = heads, a.rank = rank, a.rope = rope, a.scale = 0.1f, a.q = dq.p, a.topk = topk;
      a.pages = dtables.p, a.page_tokens = pt, a.stride = stride, a.offset = 0;
      a.sel = dsel.p, a.out = o_sel.p;
      cuda::sparse_mla_generic(a, ctx.stream());
      a.sel = nullptr, a.n_visible = dvis.p, a.out = o_dense.p;
      cuda::sparse_mla_generic(a, ctx.stream());
    }
    ctx.sync();
    const std::vector<float> x = o_sel.get(), y = o_dense.get();
    INFO((tensor ? "tensor-core kernel" : "generic kernel"));
    CHECK(x == y);
    CHECK(std::any_of(x.begin(), x.end(), [](float v) { return v != 0.f; }));
  }
#endif
}
