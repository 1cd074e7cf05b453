// dz bench kda: Kimi Delta Attention on the CPU, token by token (decode) and
// in chunks of several sizes (prefill), at a model's head shapes: time a token
// per layer and the two forms' largest output difference.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"
#include "cpu/kda.h"
#include "runtime/device.h"

#ifdef DZ_WITH_CUDA
#include "bench_cuda.h"
#include "cuda/kda.h"
#include "runtime/cuda/context.h"
#include "runtime/cuda/cuda_check.h"
#endif

namespace dz::cli {

namespace {
#ifdef DZ_WITH_CUDA
// The GPU recurrence: a decode step (one token) of each batch, each sequence
// its own state, and the CPU's n tokens once (outputs compared); median of
// CUDA-event times with the L2 flushed, state bytes in and out against HBM.
nlohmann::json bench_kda_gpu(const cpu::KdaDims& d, int64_t n, const std::vector<float>& q, const std::vector<float>& k,
                             const std::vector<float>& v, const std::vector<float>& g, const std::vector<float>& beta,
                             const std::vector<float>& cpu_out, const std::vector<int>& batches, int reps,
                             double bw_ceiling) {
  using namespace dz::cuda;
  const size_t P = size_t(d.proj()), SS = size_t(d.n_heads) * d.head_dim * d.head_dim;
  int max_b = 1;
  for (int b : batches) max_b = std::max(max_b, b);
  ContextOptions co;
  co.pool_bytes = SS * 4 * size_t(max_b) + q.size() * 4 * 5 + size_t(max_b) * P * 4 * 5 + (size_t(320) << 20);
  Context ctx(co);
  cudaStream_t st = ctx.stream();
  DevicePool& pool = ctx.pool();
  const size_t rows = std::max(size_t(n), size_t(max_b));
  DeviceArray<float> dq(pool, rows * P, "q"), dk(pool, rows * P, "k"), dv(pool, rows * P, "v"), dg(pool, rows * P, "g");
  DeviceArray<float> dbeta(pool, rows * size_t(d.n_heads), "beta"), dout(pool, rows * P, "out");
  DeviceArray<float> dstate(pool, SS * size_t(max_b), "states");
  DeviceArray<float*> dptr(pool, size_t(max_b), "state slots");
  // Row i of every input is token i % n of the CPU's inputs.
  auto upload = [&](DeviceArray<float>& dst, const std::vector<float>& src, size_t w) {
    std::vector<float> h(rows * w);
    for (size_t i = 0; i < rows; ++i) std::copy_n(src.data() + (i % size_t(n)) * w, w, h.data() + i * w);
    DZ_CUDA_CHECK(cudaMemcpy(dst.get(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  };
  upload(dq, q, P), upload(dk, k, P), upload(dv, v, P), upload(dg, g, P), upload(dbeta, beta, size_t(d.n_heads));
  std::vector<float*> hp(static_cast<size_t>(max_b));
  for (int b = 0; b < max_b; ++b) hp[size_t(b)] = dstate.get() + size_t(b) * SS;
  DZ_CUDA_CHECK(cudaMemcpy(dptr.get(), hp.data(), hp.size() * sizeof(float*), cudaMemcpyHostToDevice));
  KdaRecurrent x;
  x.n_heads = d.n_heads, x.head_dim = d.head_dim, x.q = dq.get(), x.k = dk.get(), x.v = dv.get(), x.g = dg.get();
  x.ld = int64_t(P), x.beta = dbeta.get(), x.state = dptr.get(), x.out = dout.get();
  // The CPU's sequence on the GPU, from a zero state.
  DZ_CUDA_CHECK(cudaMemsetAsync(dstate.get(), 0, SS * 4, st));
  x.batch = 1, x.n = n;
  kda_recurrent(x, st);
  std::vector<float> out(size_t(n) * P);
  DZ_CUDA_CHECK(cudaMemcpyAsync(out.data(), dout.get(), out.size() * 4, cudaMemcpyDeviceToHost, st));
  ctx.sync();
  double diff = 0, mag = 0;
  for (size_t i = 0; i < out.size(); ++i)
    diff = std::max(diff, double(std::fabs(out[i] - cpu_out[i]))), mag = std::max(mag, double(std::fabs(cpu_out[i])));
  nlohmann::json r = {{"gpu", ctx.describe()}, {"max_abs_diff_vs_cpu", diff}, {"max_abs_cpu_output", mag}};
  std::fprintf(stderr, "  GPU recurrence over the %lld tokens: max abs diff vs the CPU %.2e (outputs up to %.2e)\n",
               (long long)n, diff, mag);
  GpuTimer timer(ctx);
  nlohmann::json steps = nlohmann::json::array();
  for (int B : batches) {
    x.batch = B, x.n = 1;
    const double ms = timer.median_ms(reps, 2, [&](int) { kda_recurrent(x, st); });
    const double bytes = 2.0 * double(SS) * 4 * B;
    std::fprintf(stderr, "  GPU decode step B=%3d: %8.2f us a layer, states %.0f GB/s (%.1f%% of HBM)\n", B, ms * 1e3,
                 bytes / (ms * 1e-3) / 1e9, 100 * bytes / (ms * 1e-3) / bw_ceiling);
    steps.push_back({{"batch", B},
                     {"us", ms * 1e3},
                     {"state_bytes", bytes},
                     {"gb_per_s", bytes / (ms * 1e-3) / 1e9},
                     {"hbm_fraction", bytes / (ms * 1e-3) / bw_ceiling}});
  }
  r["decode_steps"] = steps;
  return r;
}
#endif
}  // namespace

int bench_kda(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz bench kda [--heads 32] [--head-dim 128] [--tokens 512] [--chunks 0,16,32,64] [--threads N]\n"
        "                    [--reps 3] [--gpu-batch 1,64] [--bw-ceiling 4.27e12] [--out FILE.json]\n\n"
        "One KDA layer's recurrence over --tokens tokens of random inputs (L2-normalised q and k, decays\n"
        "exp(g) spread over (0.007, 0.99), beta in (0, 1)), as the recurrent form (chunk 0) and the chunked form\n"
        "at each chunk size; best of --reps. Defaults: Kimi-Linear-48B's 32 heads x 128, all cores.\n"
        "With a GPU: the CUDA recurrence over the same tokens (compared with the CPU's outputs) and one\n"
        "decode step for each --gpu-batch (every sequence its own state), state bytes against HBM.\n");
    return 0;
  }
  reject_unknown(
      a,
      {"--heads", "--head-dim", "--tokens", "--chunks", "--threads", "--reps", "--gpu-batch", "--bw-ceiling", "--out"},
      "bench kda");
  // Numbers are parsed here: a word where one belongs ends in dz's usage message (status 2).
  cpu::KdaDims d;
  d.n_heads = std::stoi(flag_value(a, "--heads", "32"));
  d.head_dim = std::stoi(flag_value(a, "--head-dim", "128"));
  const int64_t n = std::stoll(flag_value(a, "--tokens", "512"));
  const int reps = std::max(1, std::stoi(flag_value(a, "--reps", "3")));
  const int threads = std::stoi(flag_value(a, "--threads", "0"));
  const std::vector<int> chunks = parse_int_list(flag_value(a, "--chunks", "0,16,32,64"));
  try {
    check(d.n_heads > 0 && d.head_dim > 0 && n > 0 && d.proj() <= (1 << 20) && n <= (1 << 20), DZ_ERR_INVALID_ARGUMENT,
          "--heads, --head-dim and --tokens must be positive (heads x head-dim and tokens at "
          "most 2^20)");
    const size_t P = size_t(d.proj());
    std::vector<float> q(size_t(n) * P), k(q.size()), v(q.size()), g(q.size()), beta(size_t(n * d.n_heads));
    std::mt19937_64 rng(1);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> ud(0, 1);
    for (auto* x : {&q, &k, &v}) std::generate(x->begin(), x->end(), [&] { return nd(rng); });
    for (auto& x : g) x = -std::exp(4 * ud(rng) - 5);
    for (auto& x : beta) x = ud(rng);
    for (int64_t t = 0; t < n; ++t)
      for (int h = 0; h < d.n_heads; ++h)
        for (auto* x : {&q, &k}) {
          float* r = x->data() + size_t(t) * P + size_t(h) * d.head_dim;
          double ss = 0;
          for (int c = 0; c < d.head_dim; ++c) ss += double(r[c]) * r[c];
          const double s = (x == &q ? 1 / std::sqrt(double(d.head_dim)) : 1.0) / std::sqrt(ss);
          for (int c = 0; c < d.head_dim; ++c) r[c] = float(r[c] * s);
        }
    ThreadPool pool(threads);
    nlohmann::json j = bench_meta();
    j["bench"] = "kda";
    j["heads"] = d.n_heads;
    j["head_dim"] = d.head_dim;
    j["tokens"] = n;
    j["threads"] = pool.size();
    std::vector<float> ref;
    nlohmann::json rows = nlohmann::json::array();
    for (int chunk : chunks) {
      std::vector<float> S(size_t(d.n_heads) * d.head_dim * d.head_dim), out(q.size());
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        std::fill(S.begin(), S.end(), 0.f);
        const auto t0 = std::chrono::steady_clock::now();
        if (chunk > 0)
          cpu::kda_chunked(d, q.data(), k.data(), v.data(), int64_t(P), g.data(), int64_t(P), beta.data(), n, S.data(),
                           out.data(), &pool, chunk);
        else
          cpu::kda_recurrent(d, q.data(), k.data(), v.data(), int64_t(P), g.data(), int64_t(P), beta.data(), n,
                             S.data(), out.data(), &pool);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      if (ref.empty()) ref = out;
      double diff = 0;
      for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, double(std::fabs(out[i] - ref[i])));
      std::fprintf(stderr, "  %-10s %8.3f ms  %8.1f us a token\n",
                   chunk ? ("chunk " + std::to_string(chunk)).c_str() : "recurrent", best * 1e3,
                   best / double(n) * 1e6);
      rows.push_back({{"chunk", chunk},
                      {"form", chunk ? "chunked" : "recurrent"},
                      {"seconds", best},
                      {"us_per_token", best / double(n) * 1e6},
                      {"max_abs_diff_vs_first", diff}});
    }
    j["results"] = rows;
#ifdef DZ_WITH_CUDA
    if (dz::cuda_device_count() > 0) {
      std::vector<float> cpu_out(q.size()), S(size_t(d.n_heads) * d.head_dim * d.head_dim, 0.f);
      cpu::kda_recurrent(d, q.data(), k.data(), v.data(), int64_t(P), g.data(), int64_t(P), beta.data(), n, S.data(),
                         cpu_out.data(), &pool);
      j["cuda"] = bench_kda_gpu(d, n, q, k, v, g, beta, cpu_out, parse_int_list(flag_value(a, "--gpu-batch", "1,64")),
                                std::max(reps, 10), std::stod(flag_value(a, "--bw-ceiling", "4.27e12")));
    }
#endif
    bench_emit(j, flag_value(a, "--out"));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dz bench kda: %s\n", e.what());
    return 1;
  }
}

}  // namespace dz::cli
