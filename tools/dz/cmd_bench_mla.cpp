// dz bench mla: sparse MLA decode on the GPU (cuda/mla_sparse.h) at
// DeepSeek-V3.2's shapes (128 heads, latent 512 + RoPE 64, top-2048 selected
// positions of a 64K context in 64-token pages of bf16 latents): time a layer
// for a batch of sequences, with FlashMLA's sparse decode on this H200 (FP8
// latents, 656 bytes a position) beside it and, in the GPU script, the
// PyTorch peer tools/bench/mla_peer.py on the same shapes.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"

#ifdef DZ_WITH_CUDA
#include "bench_cuda.h"
#include "cuda/fill.h"
#include "cuda/mla_sparse.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#endif

namespace dz::cli {

namespace {
const char* kUsage =
    "usage: dz bench mla [--batch 1,8,64,128] [--heads 128] [--topk 2048] [--ctx 65536] [--reps 20]\n"
    "                    [--bf16-ceiling 810e12] [--bw-ceiling 4.27e12] [--out FILE.json]\n"
    "Sparse MLA decode on the GPU (absorbed: scores against [c_kv | k_rope], output sum of c_kv), one\n"
    "query a sequence attending to --topk random positions of its --ctx cached bf16 latents: time a\n"
    "layer, TFLOP/s (2 x heads x (576 + 512) a selected position) and the selected bytes' rate, as\n"
    "fractions of the ceilings, beside FlashMLA's sparse decode measured on this H200 (FP8 latents).\n";

// FlashMLA sparse decode, V3.2 shapes (FP8 656-byte latents, 128 heads, top-2048), on our H200.
double flashmla_us(int batch) {
  return batch == 1 ? 18.5 : batch == 8 ? 27.2 : batch == 64 ? 96.2 : batch == 128 ? 185.7 : 0;
}
}  // namespace

#ifndef DZ_WITH_CUDA
int bench_mla(const Args& a) { return bench_needs_cuda(a, kUsage, "dz bench mla"); }
#else

int bench_mla(const Args& a) {
  using namespace dz::cuda;
  if (has_flag(a, "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  reject_unknown(
      a, {"--batch", "--heads", "--topk", "--ctx", "--reps", "--bf16-ceiling", "--bw-ceiling", "--out", "--help"},
      "dz bench mla");
  const std::vector<int> batches = parse_int_list(flag_value(a, "--batch", "1,8,64,128"));
  const int H = std::stoi(flag_value(a, "--heads", "128")), K = std::stoi(flag_value(a, "--topk", "2048"));
  const int64_t L = std::stoll(flag_value(a, "--ctx", "65536"));
  const int reps = std::stoi(flag_value(a, "--reps", "20"));
  const double bf16_ceiling = std::stod(flag_value(a, "--bf16-ceiling", "810e12"));
  const double bw_ceiling = std::stod(flag_value(a, "--bw-ceiling", "4.27e12"));
  const std::string out_path = flag_value(a, "--out", "");
  int max_b = 0;
  for (int b : batches) max_b = std::max(max_b, b);
  if (batches.empty() || max_b <= 0 || H <= 0 || K <= 0 || L <= 0 || reps <= 0) {
    std::fprintf(stderr, "dz bench mla: bad arguments\n%s", kUsage);
    return 2;
  }
  try {
    constexpr int D = kMlaRank + kMlaRope;
    const uint32_t pt = 64;
    const size_t stride = size_t(D) * 2;
    const int64_t pages_each = (L + pt - 1) / pt;
    SparseMlaDecode probe;
    probe.batch = max_b, probe.n_heads = H, probe.topk = K, probe.page_tokens = pt, probe.stride = stride;
    probe.scale = 1.f / std::sqrt(192.f);
    sparse_mla_validate(probe);
    int sms = 0;
    DZ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    size_t scratch_bytes = 0;
    for (int b : batches) {
      SparseMlaDecode x = probe;
      x.batch = b;
      scratch_bytes = std::max(scratch_bytes, sparse_mla_scratch_bytes(x, sparse_mla_splits(x, sms)));
    }
    const size_t lat_bytes = size_t(max_b) * pages_each * pt * stride;
    ContextOptions co;
    co.pool_bytes = lat_bytes + size_t(max_b) * H * (D * 2 + kMlaRank * 4) + size_t(max_b) * K * 4 + scratch_bytes +
                    size_t(max_b) * pages_each * 8 + size_t(max_b) * 8 + (size_t(384) << 20);
    Context ctx(co);
    cudaStream_t st = ctx.stream();
    DevicePool& P = ctx.pool();
    DeviceArray<uint16_t> lat(P, lat_bytes / 2, "latents");
    DeviceArray<uint16_t> q(P, size_t(max_b) * H * D, "queries");
    DeviceArray<int32_t> sel(P, size_t(max_b) * K, "selections");
    DeviceArray<float> out(P, size_t(max_b) * H * kMlaRank, "outputs");
    DeviceArray<uint8_t> scratch(P, scratch_bytes, "partials");
    DeviceArray<const uint8_t*> pages(P, size_t(max_b) * pages_each, "page tables");
    DeviceArray<const uint8_t* const*> tables(P, size_t(max_b), "tables");
    GpuTimer timer(ctx);
    fill_random_bf16(lat.get(), lat.size(), 51, 1.f, st);
    fill_random_bf16(q.get(), q.size(), 52, 0.5f, st);
    // Pages in a shuffled order; every sequence's selection distinct random positions.
    std::mt19937 rng(3);
    std::vector<int64_t> perm(static_cast<size_t>(max_b * pages_each));
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = int64_t(i);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<const uint8_t*> hp(perm.size());
    for (size_t i = 0; i < perm.size(); ++i)
      hp[i] = reinterpret_cast<const uint8_t*>(lat.get()) + size_t(perm[i]) * pt * stride;
    DZ_CUDA_CHECK(cudaMemcpy(pages.get(), hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
    std::vector<const uint8_t* const*> ht(static_cast<size_t>(max_b));
    for (int b = 0; b < max_b; ++b) ht[size_t(b)] = pages.get() + int64_t(b) * pages_each;
    DZ_CUDA_CHECK(cudaMemcpy(tables.get(), ht.data(), ht.size() * sizeof(void*), cudaMemcpyHostToDevice));
    std::vector<int32_t> hs(sel.size());
    std::uniform_int_distribution<int64_t> any(0, L - 1);
    for (auto& v : hs) v = int32_t(any(rng));  // repeats are rare at 2048 of 65536 and cost the same
    DZ_CUDA_CHECK(cudaMemcpy(sel.get(), hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    nlohmann::json meta = bench_meta();
    meta["gpu"] = ctx.describe();
    nlohmann::json j = {{"bench", "mla"},
                        {"meta", meta},
                        {"heads", H},
                        {"topk", K},
                        {"context", L},
                        {"latent_bytes", stride},
                        {"ceilings", {{"bf16_flops", bf16_ceiling}, {"hbm_bytes_per_s", bw_ceiling}}},
                        {"timing", "median of " + std::to_string(reps) +
                                       " CUDA-event times, L2 flushed (256 MiB read) before each call"},
                        {"anchor", "FlashMLA sparse decode (FP8 656-byte latents), V3.2 shapes, this H200"},
                        {"results", nlohmann::json::array()}};
    for (int B : batches) {
      SparseMlaDecode x = probe;
      x.batch = B, x.q = q.get(), x.sel = sel.get(), x.pages = tables.get(), x.out = out.get();
      const int splits = sparse_mla_splits(x, sms);
      const double ms =
          timer.median_ms(reps, 2, [&](int) { sparse_mla_decode(x, splits, scratch.get(), scratch.size(), st); });
      const double flops = double(B) * H * K * 2.0 * (D + kMlaRank), bytes = double(B) * K * stride;
      const double tflops = flops / (ms * 1e-3) / 1e12, gbs = bytes / (ms * 1e-3) / 1e9;
      nlohmann::json r = {{"batch", B},
                          {"splits", splits},
                          {"us", ms * 1e3},
                          {"tflops", tflops},
                          {"bf16_peak_fraction", flops / (ms * 1e-3) / bf16_ceiling},
                          {"selected_bytes", bytes},
                          {"selected_gb_per_s", gbs},
                          {"hbm_fraction", bytes / (ms * 1e-3) / bw_ceiling}};
      if (flashmla_us(B) > 0) r["flashmla_us"] = flashmla_us(B), r["vs_flashmla"] = flashmla_us(B) / (ms * 1e3);
      j["results"].push_back(r);
      std::fprintf(stderr,
                   "mla sparse decode B=%3d (%2d splits): %8.1f us, %6.1f TFLOP/s (%.1f%% of BF16 peak), selected "
                   "latents %.0f GB/s%s\n",
                   B, splits, ms * 1e3, tflops, 100 * flops / (ms * 1e-3) / bf16_ceiling, gbs,
                   flashmla_us(B) > 0 ? (", FlashMLA " + std::to_string(flashmla_us(B)) + " us").c_str() : "");
    }
    bench_emit(j, out_path);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dz bench mla: %s\n", e.what());
    return 1;
  }
}
#endif

}  // namespace dz::cli
