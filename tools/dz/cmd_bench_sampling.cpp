// dz bench sampling: temperature / top-k / top-p sampling of logits rows on
// the GPU (cuda/sampling.h), batch x vocabulary x logit spread x sampler,
// beside a read of the same rows and the host sampler (cpu::sample_token) on
// one row. Random N(0, spread^2) logits: spread 1 is nearly flat (a top_p of
// 0.95 keeps most of the vocabulary, the hardest case), 4 is closer to a
// trained model's. Median of CUDA-event timings with the L2 flushed first.
// The PyTorch peer on the same shapes: tools/bench/sampling_peer.py.
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"
#include "cpu/sampling.h"

#ifdef DZ_WITH_CUDA
#include "bench_cuda.h"
#include "cuda/fill.h"
#include "cuda/sampling.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#endif

namespace dz::cli {

namespace {
const char* kUsage =
    "usage: dz bench sampling [--batch 1,8,64,256] [--vocab 201088] [--spread 1,4] [--reps 20] [--out FILE.json]\n"
    "Sampling on the GPU, one launch for a batch of logits rows: time per launch for each sampler\n"
    "(temperature 0.8 + top_p 0.95; temperature 1 + top_k 40; temperature 0.7 alone), also with each\n"
    "row's argmax given (as a decode step hands it over), next to a plain read of the rows and the host\n"
    "sampler on one row copied back.\n";
}  // namespace

#ifndef DZ_WITH_CUDA
int bench_sampling(const Args& a) { return bench_needs_cuda(a, kUsage, "dz bench sampling"); }
#else

int bench_sampling(const Args& a) {
  using namespace dz::cuda;
  if (has_flag(a, "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  reject_unknown(a, {"--batch", "--vocab", "--spread", "--reps", "--out", "--help"}, "dz bench sampling");
  const std::vector<int> batches = parse_int_list(flag_value(a, "--batch", "1,8,64,256"));
  const std::vector<int> spreads = parse_int_list(flag_value(a, "--spread", "1,4"));
  const int V = std::stoi(flag_value(a, "--vocab", "201088")), reps = std::stoi(flag_value(a, "--reps", "20"));
  const std::string out_path = flag_value(a, "--out", "");
  int max_b = 0;
  for (int b : batches) max_b = std::max(max_b, b);
  if (batches.empty() || spreads.empty() || max_b <= 0 || V <= 0 || V > kMaxSampleVocab || reps <= 0) {
    std::fprintf(stderr, "dz bench sampling: bad arguments\n%s", kUsage);
    return 2;
  }
  struct Sampler {
    const char* name;
    cpu::SamplerConfig cfg;
  };
  const Sampler samplers[] = {{"t0.8_p0.95", {0.8f, 0, 0.95f}}, {"t1_k40", {1.f, 40, 1.f}}, {"t0.7", {0.7f, 0, 1.f}}};
  try {
    ContextOptions co;
    co.pool_bytes = size_t(max_b) * size_t(V) * 4 + (size_t(512) << 20);
    Context ctx(co);
    cudaStream_t st = ctx.stream();
    DevicePool& P = ctx.pool();
    DeviceArray<float> logits(P, size_t(max_b) * size_t(V), "logits");
    DeviceArray<SampleRow> rows(P, size_t(max_b), "rows");
    DeviceArray<int32_t> tokens(P, size_t(max_b), "tokens");
    GpuTimer timer(ctx);
    nlohmann::json meta = bench_meta();
    meta["gpu"] = ctx.describe();
    nlohmann::json j = {{"bench", "sampling"},
                        {"meta", meta},
                        {"vocab", V},
                        {"timing", "median of " + std::to_string(reps) +
                                       " CUDA-event times, L2 flushed (256 MiB read) before each call"},
                        {"results", nlohmann::json::array()}};
    std::mt19937_64 rng(1);
    std::vector<float> host(logits.size());  // the rows on the host: their argmaxes, the host sampler's row 0
    std::vector<int32_t> am(static_cast<size_t>(max_b));
    for (int spread : spreads) {
      fill_random_f32(logits.get(), logits.size(), 31 + uint64_t(spread), float(spread), st);
      DZ_CUDA_CHECK(cudaMemcpyAsync(host.data(), logits.get(), host.size() * 4, cudaMemcpyDeviceToHost, st));
      ctx.sync();
      // Each row's argmax, as a decode step hands it over (the kernel then skips its max pass).
      for (int b = 0; b < max_b; ++b) am[size_t(b)] = cpu::argmax(host.data() + size_t(b) * size_t(V), V);
      for (const Sampler& sm : samplers) {
        // The host sampler on one row (what a session pays without this kernel, after its 0.8 MB copy).
        std::vector<double> hv;
        for (int i = 0; i < 5; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          (void)cpu::sample_token(host.data(), V, sm.cfg, rng);
          hv.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        const double host_ms = median(hv);
        for (int B : batches) {
          std::vector<SampleRow> hr(static_cast<size_t>(B));
          for (int b = 0; b < B; ++b)
            hr[size_t(b)] = {logits.get() + size_t(b) * size_t(V), sm.cfg.temperature, sm.cfg.top_k, sm.cfg.top_p,
                             cpu::uniform01(rng)};
          DZ_CUDA_CHECK(cudaMemcpy(rows.get(), hr.data(), hr.size() * sizeof(SampleRow), cudaMemcpyHostToDevice));
          const double ms = timer.median_ms(reps, 2, [&](int) { sample_rows(rows.get(), B, V, tokens.get(), st); });
          for (int b = 0; b < B; ++b) hr[size_t(b)].argmax = am[size_t(b)];
          DZ_CUDA_CHECK(cudaMemcpy(rows.get(), hr.data(), hr.size() * sizeof(SampleRow), cudaMemcpyHostToDevice));
          const double ms_am = timer.median_ms(reps, 2, [&](int) { sample_rows(rows.get(), B, V, tokens.get(), st); });
          const size_t bytes = size_t(B) * size_t(V) * 4;
          const double ms_read =
              timer.median_ms(reps, 2, [&](int) { stream_read(logits.get(), bytes, timer.sink(), st); });
          j["results"].push_back({{"spread", spread},
                                  {"sampler", sm.name},
                                  {"temperature", sm.cfg.temperature},
                                  {"top_k", sm.cfg.top_k},
                                  {"top_p", sm.cfg.top_p},
                                  {"batch", B},
                                  {"us", ms * 1e3},
                                  {"us_per_row", ms * 1e3 / B},
                                  {"us_argmax_given", ms_am * 1e3},
                                  {"plain_read_us", ms_read * 1e3},
                                  {"host_sampler_us_one_row", host_ms * 1e3}});
          std::fprintf(stderr,
                       "sampling spread %d %-11s B=%3d: %8.1f us (%6.1f us a row; argmax given %.1f us; plain read "
                       "%.1f us; host sampler %.0f us a row)\n",
                       spread, sm.name, B, ms * 1e3, ms * 1e3 / B, ms_am * 1e3, ms_read * 1e3, host_ms * 1e3);
        }
      }
    }
    bench_emit(j, out_path);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dz bench sampling: %s\n", e.what());
    return 1;
  }
}
#endif

}  // namespace dz::cli
