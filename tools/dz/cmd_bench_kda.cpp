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

namespace dz::cli {

int bench_kda(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz bench kda [--heads 32] [--head-dim 128] [--tokens 512] [--chunks 0,16,32,64] [--threads N]\n"
        "                    [--reps 3] [--out FILE.json]\n\n"
        "One KDA layer's recurrence over --tokens tokens of random inputs (L2-normalised q and k, decays\n"
        "exp(g) spread over (0.007, 0.99), beta in (0, 1)), as the recurrent form (chunk 0) and the chunked form\n"
        "at each chunk size; best of --reps. Defaults: Kimi-Linear-48B's 32 heads x 128, all cores.\n");
    return 0;
  }
  reject_unknown(a, {"--heads", "--head-dim", "--tokens", "--chunks", "--threads", "--reps", "--out"}, "bench kda");
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
    bench_emit(j, flag_value(a, "--out"));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dz bench kda: %s\n", e.what());
    return 1;
  }
}

}  // namespace dz::cli
