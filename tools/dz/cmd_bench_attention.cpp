// dz bench attention: split-K decode attention on the GPU over a paged bf16 KV
// cache (one layer; gpt-oss-20b heads by default), every session appending one
// token at position ctx - 1, for a grid of batch sizes and context lengths.
// Each chunk policy (--policy list; the first is the library's default) is
// timed, with the KV bytes it reads as a fraction of HBM bandwidth and a plain
// read of the same byte count. Random bf16 K/V, pages scattered over the
// cache; median of CUDA-event timings with the L2 flushed before every call.
// With --prefill, the prefill kernel too: one prompt of each length (every
// row attending to the keys up to its own, or its window), as tensor-core
// FLOP/s against the BF16 ceiling.
// The PyTorch peer on the same shapes: tools/bench/attention_peer.py.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"

#ifdef DZ_WITH_CUDA
#include "bench_cuda.h"
#include "cuda/attention.h"
#include "cuda/fill.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#endif

namespace dz::cli {

namespace {
const char* kUsage =
    "usage: dz bench attention [--batch 1,8,64] [--ctx 128,1024,2048,3072,4096,8192,16384,32768,131072]\n"
    "                          [--heads 64] [--kv-heads 8] [--head-dim 64] [--window 0]\n"
    "                          [--policy MIN:BASE:MAX,...] [--page-tokens 64] [--reps 20] [--max-kv-gib 16]\n"
    "                          [--bw-ceiling 4.27e12] [--prefill 4096,16384,65536] [--bf16-ceiling 810e12]\n"
    "                          [--out FILE.json]\n"
    "Split-K decode attention (paged bf16 KV, one layer): time per call for every batch x context\n"
    "(skipping those whose KV exceeds --max-kv-gib), KV bytes read as a fraction of HBM bandwidth, and\n"
    "a plain read of the same bytes. Every chunk policy given is timed: min_chunk:base_splits:max_splits\n"
    "(DecodeSplitPolicy; default: the library's, then 256:32:32, the policy before run 93, and 512:8:32);\n"
    "the first is reported as the default. --prefill: prompts of these lengths through the prefill kernel\n"
    "(one sequence, all rows; 0: none), FLOP/s of QK^T and PV against --bf16-ceiling.\n";
}  // namespace

#ifndef DZ_WITH_CUDA
int bench_attention(const Args& a) { return bench_needs_cuda(a, kUsage, "dz bench attention"); }
#else

int bench_attention(const Args& a) {
  using namespace dz::cuda;
  if (has_flag(a, "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  reject_unknown(a,
                 {"--batch", "--ctx", "--heads", "--kv-heads", "--head-dim", "--window", "--policy", "--page-tokens",
                  "--reps", "--max-kv-gib", "--bw-ceiling", "--prefill", "--bf16-ceiling", "--out", "--help"},
                 "dz bench attention");
  const std::vector<int> batches = parse_int_list(flag_value(a, "--batch", "1,8,64"));
  const std::vector<int> ctxs =
      parse_int_list(flag_value(a, "--ctx", "128,1024,2048,3072,4096,8192,16384,32768,131072"));
  // Policies as "min_chunk:base_splits:max_splits", the library's default first.
  auto policy_name = [](const DecodeSplitPolicy& p) {
    return std::to_string(p.min_chunk) + ":" + std::to_string(p.base_splits) + ":" + std::to_string(p.max_splits);
  };
  std::string policy_list = flag_value(a, "--policy", "");
  if (policy_list.empty()) policy_list = policy_name(DecodeSplitPolicy{}) + ",256:32:32,512:8:32";
  std::vector<DecodeSplitPolicy> policies;
  bool policies_ok = true;
  for (size_t b = 0; b <= policy_list.size();) {
    const size_t e = std::min(policy_list.find(',', b), policy_list.size());
    DecodeSplitPolicy p;
    char tail = 0;
    policies_ok = policies_ok &&
                  std::sscanf(policy_list.substr(b, e - b).c_str(), "%d:%d:%d%c", &p.min_chunk, &p.base_splits,
                              &p.max_splits, &tail) == 3 &&
                  decode_policy_valid(p);
    policies.push_back(p);
    b = e + 1;
  }
  auto int_flag = [&](const char* f, int d) { return std::stoi(flag_value(a, f, std::to_string(d))); };
  const int nh = int_flag("--heads", 64), nkv = int_flag("--kv-heads", 8), D = int_flag("--head-dim", 64);
  const int window = int_flag("--window", 0);
  const int pt = int_flag("--page-tokens", 64), reps = int_flag("--reps", 20);
  const double max_kv = std::stod(flag_value(a, "--max-kv-gib", "16")) * double(1ull << 30);
  const double bw_ceiling = std::stod(flag_value(a, "--bw-ceiling", "4.27e12"));
  const double bf16_ceiling = std::stod(flag_value(a, "--bf16-ceiling", "810e12"));
  std::vector<int> prompts = parse_int_list(flag_value(a, "--prefill", "4096,16384,65536"));
  prompts.erase(std::remove(prompts.begin(), prompts.end(), 0), prompts.end());
  const std::string out_path = flag_value(a, "--out", "");
  if (batches.empty() || ctxs.empty() || !policies_ok || nkv <= 0 || nh % nkv != 0 || !attention_supports(D) ||
      pt <= 0 || reps <= 0) {
    std::fprintf(stderr, "dz bench attention: bad arguments\n%s", kUsage);
    return 2;
  }
  const int64_t token_bytes = int64_t(2) * nkv * D * 2;  // K | V, bf16, all KV heads
  const int64_t page_bytes = token_bytes * pt;
  try {
    // The largest case that fits decides the cache's size.
    int64_t max_pages = 0;
    int max_b = 1;
    for (int b : batches)
      for (int c : ctxs) {
        const int64_t pages = int64_t(b) * ((c + pt - 1) / pt);
        if (double(pages * page_bytes) <= max_kv) max_pages = std::max(max_pages, pages), max_b = std::max(max_b, b);
      }
    for (int n : prompts) {
      const int64_t pages = (int64_t(n) + pt - 1) / pt;
      if (n > 0 && double(pages * page_bytes) <= max_kv) max_pages = std::max(max_pages, pages);
    }
    check(max_pages > 0, DZ_ERR_INVALID_ARGUMENT, "dz bench attention: no case fits --max-kv-gib");
    ContextOptions co;
    size_t prefill_bytes = 0;  // the largest prompt's q, output and row tables
    for (int n : prompts)
      prefill_bytes = std::max(prefill_bytes, size_t(n) * (size_t(nh + 2 * nkv) * D * 4 + size_t(nh) * D * 2 + 64));
    co.pool_bytes = size_t(max_pages * page_bytes) + prefill_bytes + (size_t(2) << 30);
    Context ctx(co);
    cudaStream_t st = ctx.stream();
    DevicePool& P = ctx.pool();
    std::fprintf(stderr, "attention: %d heads / %d KV heads, head_dim %d, %lld-token pages; KV cache %.2f GiB\n", nh,
                 nkv, D, (long long)pt, double(max_pages * page_bytes) / double(1ull << 30));
    DeviceArray<uint8_t> kv(P, size_t(max_pages * page_bytes), "KV pages");
    fill_random_bf16(reinterpret_cast<uint16_t*>(kv.get()), kv.size() / 2, 21, 1.f, st);
    const int q_stride = (nh + 2 * nkv) * D;
    DeviceArray<float> q(P, size_t(max_b) * q_stride, "q"), sinks(P, size_t(nh), "sinks");
    fill_random_f32(q.get(), q.size(), 22, 1.f, st);
    fill_random_f32(sinks.get(), sinks.size(), 23, 1.f, st);
    DeviceArray<uint16_t> out(P, size_t(max_b) * nh * D, "out");
    GpuTimer timer(ctx);

    nlohmann::json meta = bench_meta();
    meta["gpu"] = ctx.describe();
    nlohmann::json j = {{"bench", "attention"},
                        {"meta", meta},
                        {"shape", {{"heads", nh}, {"kv_heads", nkv}, {"head_dim", D}, {"window", window}}},
                        {"kv", {{"dtype", "bf16"}, {"page_tokens", pt}, {"token_bytes_per_layer", token_bytes}}},
                        {"ceilings", {{"hbm_bytes_per_s", bw_ceiling}, {"bf16_flops_per_s", bf16_ceiling}}},
                        {"timing", "median of " + std::to_string(reps) +
                                       " CUDA-event times, L2 flushed (256 MiB read) before each call"},
                        {"results", nlohmann::json::array()}};
    std::mt19937 rng(7);
    // npg pages scattered over the cache.
    auto scattered_pages = [&](int64_t npg) {
      std::vector<int32_t> perm(static_cast<size_t>(max_pages));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      perm.resize(static_cast<size_t>(npg));
      return perm;
    };
    auto upload = [&]<typename T>(const std::vector<T>& v, const char* what) {
      DeviceArray<T> d(P, v.size(), what);
      DZ_CUDA_CHECK(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
      return d;
    };
    // What both kernels read: the cache, the row tables (device), q and out.
    auto make_batch = [&](const int32_t* table, const int32_t* ipt, const int32_t* item, const int32_t* pos,
                          const float* qp, uint16_t* outp) {
      AttnBatch ab;
      ab.kv = kv.get();
      ab.page_bytes = page_bytes;
      ab.page_tokens = pt;
      ab.page_table = table;
      ab.item_pt = ipt;
      ab.row_item = item;
      ab.row_pos = pos;
      ab.n_heads = nh;
      ab.n_kv_heads = nkv;
      ab.head_dim = D;
      ab.window = window;
      ab.scale = float(1.0 / std::sqrt(double(D)));
      ab.sinks = sinks.get();
      ab.q = qp;
      ab.q_stride = q_stride;
      ab.out = outp;
      return ab;
    };
    for (int B : batches)
      for (int C : ctxs) {
        const int npg = (C + pt - 1) / pt;
        const int64_t pages = int64_t(B) * npg;
        if (double(pages * page_bytes) > max_kv) {
          std::fprintf(stderr, "attention B=%d ctx=%d: KV %.1f GiB over --max-kv-gib, skipped\n", B, C,
                       double(pages * page_bytes) / double(1ull << 30));
          continue;
        }
        std::vector<int32_t> item_pt(static_cast<size_t>(B)), row_item(static_cast<size_t>(B)),
            row_pos(static_cast<size_t>(B), C - 1), rows(static_cast<size_t>(B));
        for (int b = 0; b < B; ++b) item_pt[size_t(b)] = b * npg, row_item[size_t(b)] = b, rows[size_t(b)] = b;
        const DeviceArray<int32_t> d_table = upload(scattered_pages(pages), "page table"),
                                   d_ipt = upload(item_pt, "item tables"), d_item = upload(row_item, "row items"),
                                   d_pos = upload(row_pos, "row positions"), d_rows = upload(rows, "rows");
        const AttnBatch ab = make_batch(d_table.get(), d_ipt.get(), d_item.get(), d_pos.get(), q.get(), out.get());
        const int len = window > 0 ? std::min(C, window) : C;
        const double bytes = double(B) * len * double(token_bytes);
        nlohmann::json pol = nlohmann::json::object();
        double best = 1e30;
        std::string best_policy;
        for (const DecodeSplitPolicy& p : policies) {
          const int splits = decode_chunks(len, p, p.max_splits);
          const size_t pf = decode_partial_floats(B, nh, D, splits), ti = decode_ticket_ints(B, nh, nkv);
          DeviceArray<float> part(P, pf, "partials");
          DeviceArray<int32_t> tickets(P, ti, "tickets");
          DZ_CUDA_CHECK(cudaMemsetAsync(tickets.get(), 0, ti * 4, st));
          const DecodeScratch scratch{part.get(), pf, tickets.get(), ti};
          const double ms = timer.median_ms(
              reps, 2, [&](int) { attention_decode_split(ab, d_rows.get(), B, splits, p, scratch, st); });
          pol[policy_name(p)] = {{"us", ms * 1e3},
                                 {"chunks", splits},
                                 {"chunk_keys", decode_chunk_keys(len, p, splits)},
                                 {"hbm_fraction", bytes / (ms * 1e-3) / bw_ceiling}};
          if (ms < best) best = ms, best_policy = policy_name(p);
        }
        const double ms_default = pol[policy_name(policies[0])]["us"].get<double>() * 1e-3;
        const size_t read_bytes = size_t(bytes) / 16 * 16;
        const double ms_read =
            timer.median_ms(reps, 2, [&](int) { stream_read(kv.get(), read_bytes, timer.sink(), st); });
        j["results"].push_back({{"batch", B},
                                {"ctx", C},
                                {"keys_per_row", len},
                                {"kv_bytes", bytes},
                                {"us", ms_default * 1e3},
                                {"hbm_fraction", bytes / (ms_default * 1e-3) / bw_ceiling},
                                {"best_policy", best_policy},
                                {"best_us", best * 1e3},
                                {"policies", pol},
                                {"plain_read_us", ms_read * 1e3},
                                {"plain_read_hbm_fraction", bytes / (ms_read * 1e-3) / bw_ceiling}});
        std::fprintf(stderr,
                     "attention B=%3d ctx=%6d: %8.1f us (%.0f%% of HBM on %.1f MB of KV; plain read %.1f us), best "
                     "policy %s: %.1f us\n",
                     B, C, ms_default * 1e3, 100 * bytes / (ms_default * 1e-3) / bw_ceiling, bytes / 1e6, ms_read * 1e3,
                     best_policy.c_str(), best * 1e3);
      }
    // Prefill: one sequence of n tokens, every row its own position, in the
    // tiles the model uses.
    j["prefill"] = nlohmann::json::array();
    const int tile_rows = attention_tile_rows(nh, nkv);
    for (int n : prompts) {
      const int64_t npg = (int64_t(n) + pt - 1) / pt;
      if (n < 0 || npg > max_pages) {
        std::fprintf(stderr, "attention prefill %d: over --max-kv-gib, skipped\n", n);
        continue;
      }
      std::vector<int32_t> row_item(static_cast<size_t>(n), 0), row_pos(static_cast<size_t>(n));
      std::iota(row_pos.begin(), row_pos.end(), 0);
      std::vector<AttnTile> tl;
      for (int r0 = 0; r0 < n; r0 += tile_rows) tl.push_back({r0, std::min(tile_rows, n - r0)});
      const DeviceArray<int32_t> d_table = upload(scattered_pages(npg), "page table"),
                                 d_ipt = upload(std::vector<int32_t>{0}, "item tables"),
                                 d_item = upload(row_item, "row items"), d_pos = upload(row_pos, "row positions");
      const DeviceArray<AttnTile> d_tiles = upload(tl, "tiles");
      DeviceArray<float> pq(P, size_t(n) * q_stride, "prefill q");
      fill_random_f32(pq.get(), pq.size(), 24, 1.f, st);
      DeviceArray<uint16_t> pout(P, size_t(n) * nh * D, "prefill out");
      const AttnBatch ab = make_batch(d_table.get(), d_ipt.get(), d_item.get(), d_pos.get(), pq.get(), pout.get());
      // Query-key pairs: row i sees min(i + 1, window) keys.
      double pairs = 0;
      for (int i = 0; i < n; ++i) pairs += window > 0 ? std::min(i + 1, window) : i + 1;
      const double flops = 4.0 * pairs * nh * D;  // QK^T and PV, 2 FLOPs a multiply-add
      // The default (two terms, the wgmma kernel where it runs), then each precision on each kernel.
      auto time = [&](int terms, bool wgmma) {
        AttnBatch b = ab;
        b.terms = terms;
        b.prefill_wgmma = wgmma;
        return timer.median_ms(std::max(3, std::min(reps, n >= 32768 ? 5 : reps)), 1,
                               [&](int) { attention_prefill(b, d_tiles.get(), int(tl.size()), tile_rows, st); });
      };
      nlohmann::json variants = nlohmann::json::array();
      double ms = 0;
      for (const int terms : {2, 1})
        for (const bool wgmma : {true, false}) {
          const double v = time(terms, wgmma);
          if (terms == 2 && wgmma) ms = v;
          variants.push_back({{"terms", terms},
                              {"prefill_wgmma", wgmma},
                              {"us", v * 1e3},
                              {"tflops", flops / (v * 1e-3) / 1e12},
                              {"bf16_peak_fraction", flops / (v * 1e-3) / bf16_ceiling}});
          std::fprintf(stderr,
                       "attention prefill %6d tokens, %d term%s%s: %10.1f us (%.0f TFLOP/s, %.0f%% of the BF16 "
                       "ceiling)\n",
                       n, terms, terms == 2 ? "s" : " ", wgmma ? "" : ", mma.sync", v * 1e3, flops / (v * 1e-3) / 1e12,
                       100 * flops / (v * 1e-3) / bf16_ceiling);
        }
      j["prefill"].push_back({{"tokens", n},
                              {"window", window},
                              {"tile_rows", tile_rows},
                              {"flops", flops},
                              {"us", ms * 1e3},
                              {"tflops", flops / (ms * 1e-3) / 1e12},
                              {"bf16_peak_fraction", flops / (ms * 1e-3) / bf16_ceiling},
                              {"variants", variants}});
    }
    bench_emit(j, out_path);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dz bench attention: %s\n", e.what());
    return 1;
  }
}
#endif

}  // namespace dz::cli
