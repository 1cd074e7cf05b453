// dz bench indexer: the DSA lightning indexer on the GPU (cuda/dsa_indexer.h)
// at DeepSeek-V3.2's shapes (64 heads of 128, top-2048, FP8 keys in 64-token
// pages): decode (one query a sequence, a batch of sequences) and prefill
// (every position of one prompt, causal), scoring and top-k together. Random
// keys and queries, median of CUDA-event timings with the L2 flushed first.
// Next to published DeepGEMM + torch.topk figures on an H200 and, in the GPU
// script, the PyTorch peer tools/bench/indexer_peer.py on the same shapes.
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"

#ifdef DZ_WITH_CUDA
#include "bench_cuda.h"
#include "cuda/dsa_indexer.h"
#include "cuda/fill.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#endif

namespace dz::cli {

namespace {
const char* kUsage =
    "usage: dz bench indexer [--decode-ctx 8192,65536] [--batch 1,64] [--prefill 4096,16384] [--heads 64]\n"
    "                        [--head-dim 128] [--topk 2048] [--query-block 2048] [--reps 10]\n"
    "                        [--fp8-ceiling 1490e12] [--bw-ceiling 4.27e12] [--out FILE.json]\n"
    "The DSA lightning indexer on the GPU (FP8 keys and queries, E4M3 tensor-core scores, exact radix\n"
    "top-k): decode, a batch of sequences of --decode-ctx cached tokens with one query each; prefill,\n"
    "one prompt of --prefill tokens scoring its causal prefix, --query-block queries at a time.\n"
    "Reports time, FP8 TFLOP/s of the scores (2 x heads x head_dim a query-key pair) and the key bytes'\n"
    "HBM rate, each as a fraction of the ceilings, beside DeepGEMM + torch.topk's published H200 times;\n"
    "decode also times the top-k alone on the scores it computed.\n";

// Published H200 times of DeepGEMM's indexer kernels + torch.topk (V3.2 shapes), for the JSON.
double anchor_ms(bool prefill, int64_t ctx, int batch) {
  if (prefill) return ctx == 4096 ? 0.70 : ctx == 16384 ? 6.5 : ctx == 32768 ? 28.4 : ctx == 65536 ? 114.7 : 0;
  if (ctx == 65536) return batch == 1 ? 0.099 : batch == 64 ? 0.323 : 0;
  return 0;
}
}  // namespace

#ifndef DZ_WITH_CUDA
int bench_indexer(const Args& a) { return bench_needs_cuda(a, kUsage, "dz bench indexer"); }
#else

int bench_indexer(const Args& a) {
  using namespace dz::cuda;
  if (has_flag(a, "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  reject_unknown(a,
                 {"--decode-ctx", "--batch", "--prefill", "--heads", "--head-dim", "--topk", "--query-block", "--reps",
                  "--fp8-ceiling", "--bw-ceiling", "--out", "--help"},
                 "dz bench indexer");
  const std::vector<int> dctx = parse_int_list(flag_value(a, "--decode-ctx", "8192,65536"));
  const std::vector<int> batches = parse_int_list(flag_value(a, "--batch", "1,64"));
  const std::vector<int> pre = parse_int_list(flag_value(a, "--prefill", "4096,16384"));
  const int H = std::stoi(flag_value(a, "--heads", "64")), D = std::stoi(flag_value(a, "--head-dim", "128"));
  const int K = std::stoi(flag_value(a, "--topk", "2048")), reps = std::stoi(flag_value(a, "--reps", "10"));
  const int64_t qblock = std::stoll(flag_value(a, "--query-block", "2048"));
  const double fp8_ceiling = std::stod(flag_value(a, "--fp8-ceiling", "1490e12"));
  const double bw_ceiling = std::stod(flag_value(a, "--bw-ceiling", "4.27e12"));
  const std::string out_path = flag_value(a, "--out", "");
  if (H <= 0 || D <= 0 || K <= 0 || reps <= 0 || qblock <= 0) {
    std::fprintf(stderr, "dz bench indexer: bad arguments\n%s", kUsage);
    return 2;
  }
  try {
    const uint32_t pt = 64;
    const size_t stride = size_t(D) + 4;  // the key record alone (a model's record holds the latent too)
    // The largest case: its keys, queries, page tables and scratch.
    int64_t max_keys = 0, max_q = 0, max_vis = 0;
    for (int c : dctx)
      for (int b : batches) max_keys = std::max(max_keys, int64_t(c) * b), max_q = std::max<int64_t>(max_q, b);
    for (int c : dctx) max_vis = std::max<int64_t>(max_vis, c);
    for (int p : pre)
      max_keys = std::max<int64_t>(max_keys, p), max_q = std::max<int64_t>(max_q, p),
      max_vis = std::max<int64_t>(max_vis, p);
    const int64_t max_pages = max_keys / pt + int64_t(batches.size() + 2);
    // Decode's scores, kept to time the top-k alone on them.
    int64_t dec_scores = 0;
    for (int c : dctx)
      for (int b : batches) dec_scores = std::max(dec_scores, int64_t(c) * b);
    IndexerQueries probe;
    probe.n_heads = H, probe.head_dim = D, probe.topk = K, probe.n_q = max_q, probe.max_visible = max_vis;
    probe.keys = {pt, stride, 0};
    indexer_validate(probe);
    const size_t scratch_bytes = indexer_scratch_bytes(probe, qblock);
    ContextOptions co;
    co.pool_bytes = size_t(max_pages) * pt * stride + size_t(max_keys) * D * 4 + size_t(max_q) * (H * D + H) * 4 +
                    size_t(max_q) * K * 4 + scratch_bytes + size_t(max_q) * 24 + size_t(max_pages) * 8 +
                    size_t(dec_scores) * 4 + (size_t(384) << 20);
    Context ctx(co);
    cudaStream_t st = ctx.stream();
    DevicePool& P = ctx.pool();
    DeviceArray<uint8_t> arena(P, size_t(max_pages) * pt * stride, "key pages");
    DeviceArray<float> kf(P, size_t(max_keys) * D, "keys fp32");
    DeviceArray<float> q(P, size_t(max_q) * H * D, "queries");
    DeviceArray<float> w(P, size_t(max_q) * H, "head weights");
    DeviceArray<int32_t> out(P, size_t(max_q) * K, "selections");
    DeviceArray<uint8_t> scratch(P, scratch_bytes, "indexer scratch");
    DeviceArray<uint8_t*> pages(P, size_t(max_pages), "page table");
    DeviceArray<const uint8_t* const*> qpages(P, size_t(max_q), "query page tables");
    DeviceArray<int64_t> vis(P, size_t(max_q), "visible");
    DeviceArray<int64_t> pos(P, size_t(max_keys), "positions");
    DeviceArray<float> dscores(P, size_t(std::max<int64_t>(1, dec_scores)), "decode scores");
    GpuTimer timer(ctx);
    fill_random_f32(kf.get(), kf.size(), 41, 1.f, st);
    fill_random_f32(q.get(), q.size(), 42, 1.f, st);
    fill_random_f32(w.get(), w.size(), 43, 1.f, st);
    std::vector<uint8_t*> hp(pages.size());
    for (size_t i = 0; i < hp.size(); ++i) hp[i] = arena.get() + i * pt * stride;
    DZ_CUDA_CHECK(cudaMemcpy(pages.get(), hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
    nlohmann::json meta = bench_meta();
    meta["gpu"] = ctx.describe();
    nlohmann::json j = {{"bench", "indexer"},
                        {"meta", meta},
                        {"heads", H},
                        {"head_dim", D},
                        {"topk", K},
                        {"page_tokens", pt},
                        {"query_block", qblock},
                        {"ceilings", {{"fp8_flops", fp8_ceiling}, {"hbm_bytes_per_s", bw_ceiling}}},
                        {"timing", "median of " + std::to_string(reps) +
                                       " CUDA-event times, L2 flushed (256 MiB read) before each call"},
                        {"anchor", "DeepGEMM indexer + torch.topk, V3.2 shapes, H200 (published)"},
                        {"results", nlohmann::json::array()}};
    // One case: B sequences of `keys_each` cached keys (pages consecutive per sequence), n_q queries.
    auto run_case = [&](const char* mode, int B, int64_t keys_each, bool prefill) {
      const int64_t pages_each = (keys_each + pt - 1) / pt;
      const int64_t nq = prefill ? keys_each : B;
      std::vector<int64_t> hpos(static_cast<size_t>(keys_each));
      for (int64_t i = 0; i < keys_each; ++i) hpos[size_t(i)] = i;
      DZ_CUDA_CHECK(cudaMemcpy(pos.get(), hpos.data(), hpos.size() * 8, cudaMemcpyHostToDevice));
      for (int b = 0; b < B; ++b)
        indexer_encode_keys(D, false, kf.get() + size_t(b) * keys_each * D, keys_each, pos.get(),
                            pages.get() + b * pages_each, {pt, stride, 0}, st);
      std::vector<const uint8_t* const*> hq(static_cast<size_t>(nq));
      std::vector<int64_t> hv(static_cast<size_t>(nq));
      for (int64_t i = 0; i < nq; ++i) {
        hq[size_t(i)] = pages.get() + (prefill ? 0 : i * pages_each);
        hv[size_t(i)] = prefill ? i + 1 : keys_each;
      }
      DZ_CUDA_CHECK(cudaMemcpy(qpages.get(), hq.data(), hq.size() * sizeof(void*), cudaMemcpyHostToDevice));
      DZ_CUDA_CHECK(cudaMemcpy(vis.get(), hv.data(), hv.size() * 8, cudaMemcpyHostToDevice));
      IndexerQueries x;
      x.n_heads = H, x.head_dim = D, x.topk = K, x.n_q = nq, x.q = q.get(), x.w = w.get(), x.pages = qpages.get();
      x.n_visible = vis.get(), x.max_visible = keys_each, x.keys = {pt, stride, 0}, x.out = out.get();
      x.same_pages = prefill;
      const double ms =
          timer.median_ms(reps, 2, [&](int) { indexer_select(x, scratch.get(), scratch.size(), qblock, st); });
      // Decode: the top-k alone, on the scores of one more call.
      double topk_ms = 0;
      if (!prefill) {
        IndexerQueries y = x;
        y.scores = dscores.get();
        indexer_select(y, scratch.get(), scratch.size(), qblock, st);
        topk_ms = timer.median_ms(
            reps, 2, [&](int) { indexer_topk(dscores.get(), keys_each, nq, vis.get(), keys_each, K, out.get(), st); });
      }
      // Work: (query, key) pairs scored; key bytes each query's scoring reads (once per query block in prefill).
      double pairs = 0;
      for (int64_t v : hv) pairs += double(v);
      const double flops = pairs * 2.0 * H * D;
      const double key_bytes =
          prefill ? double(keys_each) * stride * double((nq + qblock - 1) / qblock) : double(B) * keys_each * stride;
      const double tflops = flops / (ms * 1e-3) / 1e12, gbs = key_bytes / (ms * 1e-3) / 1e9;
      const double anchor = anchor_ms(prefill, keys_each, B);
      nlohmann::json r = {{"mode", mode},
                          {"batch", B},
                          {"context", keys_each},
                          {"queries", nq},
                          {"us", ms * 1e3},
                          {"tflops", tflops},
                          {"fp8_peak_fraction", flops / (ms * 1e-3) / fp8_ceiling},
                          {"key_bytes", key_bytes},
                          {"key_gb_per_s", gbs},
                          {"hbm_fraction", key_bytes / (ms * 1e-3) / bw_ceiling}};
      if (anchor > 0) r["anchor_us"] = anchor * 1e3, r["vs_anchor"] = anchor / ms;
      if (topk_ms > 0) r["topk_us"] = topk_ms * 1e3;
      j["results"].push_back(r);
      std::fprintf(stderr,
                   "indexer %-7s B=%3d ctx %6lld: %9.1f us, %6.1f TFLOP/s (%.1f%% of FP8 peak), keys %.0f GB/s (%.1f%% "
                   "of HBM)%s%s\n",
                   mode, B, (long long)keys_each, ms * 1e3, tflops, 100 * flops / (ms * 1e-3) / fp8_ceiling, gbs,
                   100 * key_bytes / (ms * 1e-3) / bw_ceiling,
                   topk_ms > 0 ? (", top-k alone " + std::to_string(topk_ms * 1e3) + " us").c_str() : "",
                   anchor > 0 ? (", DeepGEMM + torch.topk " + std::to_string(anchor * 1e3) + " us").c_str() : "");
    };
    for (int c : dctx)
      for (int b : batches) run_case("decode", b, c, false);
    for (int p : pre) run_case("prefill", 1, p, true);
    bench_emit(j, out_path);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dz bench indexer: %s\n", e.what());
    return 1;
  }
}
#endif

}  // namespace dz::cli
