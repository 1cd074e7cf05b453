// dz bench kv: host-side cost of the paged KV arena's bookkeeping (no model):
// page allocate/free, decode and prefill appends (reserve + commit, which
// hashes every filled page), sequence create/release, fork with copy on write,
// prefix-cache lookups (hits and misses), concurrent appends from several
// threads, and the host bytes of bookkeeping for one 1M-token sequence.
// Pages are small by default (one layer, --token-bytes per token) so the
// numbers are the arena's, not memcpy's. Best of --reps runs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"
#include "kv/arena.h"

namespace dz::cli {

namespace {
const char* kUsage =
    "usage: dz bench kv [--page-tokens 64] [--token-bytes 64] [--tokens 1048576] [--reps 3] [--out FILE.json]\n"
    "Host cost of the KV arena's bookkeeping: allocate/append/free, fork, prefix lookups, threads,\n"
    "and host bytes of bookkeeping for one sequence of --tokens tokens. JSON results.\n";

using Clock = std::chrono::steady_clock;
using kv::Arena;
using kv::ArenaConfig;
using kv::Layout;
using kv::Sequence;

struct Setup {
  uint32_t page_tokens = 64;
  size_t token_bytes = 64;
  int reps = 3;
  Layout layout() const {
    Layout l;
    l.page_tokens = page_tokens;
    l.layer_token_bytes = {token_bytes};
    l.model_key = 1;
    return l;
  }
  std::unique_ptr<Arena> arena(uint64_t pages, bool prefix_cache = true) const {
    ArenaConfig c;
    c.capacity_pages = pages;
    c.prefix_cache = prefix_cache;
    return std::make_unique<Arena>(layout(), c);
  }
};

std::vector<int32_t> tokens(std::mt19937_64& rng, size_t n) {
  std::vector<int32_t> v(n);
  for (auto& t : v) t = int32_t(rng() % 200000);
  return v;
}

// Starts when constructed or restarted (after a run's setup).
struct Timer {
  Clock::time_point t0 = Clock::now();
  void restart() { t0 = Clock::now(); }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }
};

// Best rate over reps: run(timer) does its setup, restarts the timer, and
// returns the number of operations it timed.
template <typename F>
double best_rate(int reps, F&& run) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    Timer t;
    const double ops = double(run(t));
    best = std::max(best, ops / t.seconds());
  }
  return best;
}

void append(Sequence& s, std::span<const int32_t> ids) {
  s.reserve(ids.size());
  s.commit(ids);
}
}  // namespace

int bench_kv(const Args& a) {
  if (has_flag(a, "--help")) {
    std::printf("%s", kUsage);
    return 0;
  }
  reject_unknown(a, {"--page-tokens", "--token-bytes", "--tokens", "--reps", "--out"}, "bench kv");
  Setup su;
  su.page_tokens = uint32_t(std::stoul(flag_value(a, "--page-tokens", "64")));
  su.token_bytes = std::stoul(flag_value(a, "--token-bytes", "64"));
  su.reps = std::max(1, std::stoi(flag_value(a, "--reps", "3")));
  const size_t big = std::stoull(flag_value(a, "--tokens", "1048576"));
  const uint32_t P = su.page_tokens;
  std::mt19937_64 rng(1);
  nlohmann::json res;

  try {
    // Decode: one token per reserve + commit.
    {
      constexpr size_t n = 1 << 18;
      const auto toks = tokens(rng, n);
      res["decode_append_tokens_per_s"] = best_rate(su.reps, [&](Timer& tm) {
        auto ar = su.arena(n / P + 1);
        Sequence s(*ar);
        tm.restart();
        for (size_t i = 0; i < n; ++i) append(s, std::span(&toks[i], 1));
        return n;
      });
      res["prefill_append_tokens_per_s"] = best_rate(su.reps, [&](Timer& tm) {
        auto ar = su.arena(n / P + 1);
        Sequence s(*ar);
        tm.restart();
        for (size_t i = 0; i < n; i += 512) append(s, std::span(toks).subspan(i, 512));
        return n;
      });
    }
    // Page allocate + free: reserve 16 pages, roll back.
    {
      auto ar = su.arena(1024);
      Sequence s(*ar);
      constexpr int iters = 100000;
      res["page_alloc_free_pages_per_s"] = best_rate(su.reps, [&](Timer& tm) {
        for (int i = 0; i < iters; ++i) {
          s.reserve(16 * P);
          s.rollback();
        }
        return size_t(iters) * 16;
      });
    }
    // Sequence create, one page of tokens, release (pages go to the free list).
    {
      auto ar = su.arena(1024, false);
      const auto toks = tokens(rng, P);
      constexpr int iters = 100000;
      res["sequence_create_append_free_per_s"] = best_rate(su.reps, [&](Timer& tm) {
        for (int i = 0; i < iters; ++i) {
          Sequence s(*ar);
          append(s, toks);
        }
        return size_t(iters);
      });
    }
    // Fork a 4,000-token sequence (partial last page), append one token to
    // the fork (copy on write of that page), release it.
    {
      auto ar = su.arena(1024);
      Sequence base(*ar);
      append(base, tokens(rng, 4000));
      const int32_t t = 7;
      constexpr int iters = 20000;
      res["fork_cow_free_per_s"] = best_rate(su.reps, [&](Timer& tm) {
        for (int i = 0; i < iters; ++i) {
          auto f = base.fork();
          append(*f, std::span(&t, 1));
        }
        return size_t(iters);
      });
    }
    // Prefix lookups: adopt a cached 4,096-token prompt (64 pages at P=64) and
    // drop it again; misses differ in the first token.
    {
      auto ar = su.arena(1024);
      const auto prompt = tokens(rng, 4096 + 1);
      {
        Sequence s(*ar);
        append(s, prompt);
      }
      constexpr int iters = 5000;
      size_t adopted = 0;
      Sequence s(*ar);
      const double hits = best_rate(su.reps, [&](Timer& tm) {
        for (int i = 0; i < iters; ++i) {
          adopted = s.adopt_prefix(prompt);
          s.truncate(0);
        }
        return size_t(iters);
      });
      check(adopted == 4096, DZ_ERR_INTERNAL, "bench kv: prefix lookup adopted ", adopted, " tokens, expected 4096");
      res["prefix_hit_lookups_per_s"] = hits;
      res["prefix_hit_tokens_per_s"] = hits * 4096;
      res["prefix_hit_pages_per_s"] = hits * 4096 / P;
      auto miss = prompt;
      miss[0] ^= 1;
      res["prefix_miss_lookups_per_s"] = best_rate(su.reps, [&](Timer& tm) {
        for (int i = 0; i < iters * 20; ++i) adopted += s.adopt_prefix(miss);
        return size_t(iters) * 20;
      });
    }
    // Several threads appending to their own sequences of one arena.
    {
      nlohmann::json th;
      const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
      for (unsigned nt = 1; nt <= std::min(hw, 8u); nt *= 2) {
        constexpr size_t n = 1 << 16;
        const auto toks = tokens(rng, n);
        th[std::to_string(nt)] = best_rate(su.reps, [&](Timer& tm) {
          auto ar = su.arena(nt * (n / P + 1));
          tm.restart();
          std::vector<std::thread> ts;
          for (unsigned t = 0; t < nt; ++t)
            ts.emplace_back([&] {
              Sequence s(*ar);
              for (size_t i = 0; i < n; ++i) append(s, std::span(&toks[i], 1));
            });
          for (auto& t : ts) t.join();
          return size_t(nt) * n;
        });
      }
      res["concurrent_decode_append_tokens_per_s"] = th;
    }
    // Host bookkeeping of one long sequence in an arena sized for it.
    {
      ArenaConfig c;
      c.capacity_pages = (big + P - 1) / P;
      Layout l = su.layout();
      l.layer_token_bytes = {1};  // storage is not bookkeeping; keep it small
      Arena ar(l, c);
      const uint64_t empty = ar.metadata_bytes();
      Sequence s(ar);
      const auto chunk = tokens(rng, 4096);
      for (size_t done = 0; done < big; done += chunk.size())
        append(s, std::span(chunk).first(std::min(chunk.size(), big - done)));
      const uint64_t total = ar.metadata_bytes();
      const uint64_t ids = s.tokens().capacity() * sizeof(int32_t);
      res["bookkeeping"] = {{"tokens", big},
                            {"bytes_total", total},
                            {"bytes_empty_arena", empty},
                            {"bytes_token_ids", ids},
                            {"bytes_per_token", double(total) / double(big)},
                            {"bytes_per_token_beyond_token_ids", double(total - ids) / double(big)}};
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "dz bench kv: %s\n", e.what());
    return 1;
  }

  nlohmann::json j = bench_meta();
  // Wall-clock rates on a shared machine: record how busy it was.
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    double l1 = 0;
    if (std::fscanf(f, "%lf", &l1) == 1) j["load_average_1min"] = l1;
    std::fclose(f);
  }
  j["benchmark"] = "kv";
  j["device"] = "cpu";
  j["config"] = {{"page_tokens", P}, {"layers", 1}, {"token_bytes", su.token_bytes}, {"reps", su.reps}};
  j["results"] = res;
  bench_emit(j, flag_value(a, "--out"));
  return 0;
}

}  // namespace dz::cli
