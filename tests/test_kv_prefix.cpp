// Prefix reuse is real, through the public C API on the gpt-oss fixture: a
// session sharing a 1,000-token prefix with an earlier one computes only its
// suffix (its stats and the arena's say so), and its logits equal those of a
// session computing everything without the cache, also for the decode steps
// that follow (which attend over the adopted pages).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "dayzero.h"

namespace {

const std::string kFixture = std::string(DZ_TEST_DATA) + "/gpt_oss_tiny";

#define DZ_OK_OR_FAIL(call)                 \
  do {                                      \
    const dz_status st_ = (call);           \
    INFO(#call << ": " << dz_last_error()); \
    REQUIRE(st_ == DZ_OK);                  \
  } while (0)

struct Handles {
  dz_model* model = nullptr;
  dz_kv_arena* cached = nullptr;
  dz_kv_arena* plain = nullptr;
  std::vector<dz_session*> sessions;
  ~Handles() {
    for (dz_session* s : sessions) dz_session_free(s);
    dz_kv_arena_free(cached);
    dz_kv_arena_free(plain);
    dz_model_free(model);
  }
  dz_kv_arena* arena(uint32_t page_tokens, int prefix_cache) {
    dz_kv_arena_params p;
    dz_kv_arena_params_init(&p);
    p.page_tokens = page_tokens;
    p.capacity_bytes = uint64_t(16) << 20;
    p.prefix_cache = prefix_cache;
    dz_kv_arena* a = nullptr;
    DZ_OK_OR_FAIL(dz_kv_arena_create(model, &p, &a));
    return a;
  }
  dz_session* session(dz_kv_arena* a) {
    dz_session* s = nullptr;
    DZ_OK_OR_FAIL(dz_session_create(a, nullptr, &s));
    sessions.push_back(s);
    return s;
  }
};

std::vector<float> last_logits(dz_session* s) {
  const float* l = nullptr;
  size_t rows = 0, v = 0;
  DZ_OK_OR_FAIL(dz_session_logits(s, &l, &rows, &v));
  REQUIRE(rows == 1);
  return std::vector<float>(l, l + v);
}

dz_session_stats stats(dz_session* s) {
  dz_session_stats st;
  dz_session_stats_init(&st);
  DZ_OK_OR_FAIL(dz_session_get_stats(s, &st));
  return st;
}

dz_kv_stats stats(dz_kv_arena* a) {
  dz_kv_stats st;
  dz_kv_stats_init(&st);
  DZ_OK_OR_FAIL(dz_kv_arena_get_stats(a, &st));
  return st;
}

// max |a - b| relative to max |b|.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
    m = std::max(m, std::fabs(double(b[i])));
  }
  REQUIRE(m > 0);
  return d / m;
}

}  // namespace

TEST_CASE("kv prefix cache: a shared 1,000-token prefix is reused, only the suffix computed, same logits", "[kv]") {
  Handles h;
  dz_model_params mp;
  dz_model_params_init(&mp);
  mp.n_threads = 2;
  DZ_OK_OR_FAIL(dz_model_open(kFixture.c_str(), &mp, &h.model));
  dz_model_info info;
  dz_model_info_init(&info);
  DZ_OK_OR_FAIL(dz_model_get_info(h.model, &info));
  REQUIRE(info.n_vocab > 1);

  const uint64_t seed = std::random_device{}();
  INFO("token seed " << seed);
  std::mt19937_64 rng(seed);
  auto random_ids = [&](size_t n) {
    std::vector<int32_t> v(n);
    for (auto& t : v) t = int32_t(rng() % uint64_t(info.n_vocab));
    return v;
  };
  const auto prefix = random_ids(1000);
  auto with = [&](const std::vector<int32_t>& suffix) {
    auto v = prefix;
    v.insert(v.end(), suffix.begin(), suffix.end());
    return v;
  };
  const auto first = with(random_ids(37)), second = with(random_ids(29));

  // 8-token pages: the 1,000-token prefix is exactly 125 full pages.
  h.cached = h.arena(8, 1);
  h.plain = h.arena(8, 0);
  dz_session* a = h.session(h.cached);
  DZ_OK_OR_FAIL(dz_session_append(a, first.data(), first.size(), DZ_LOGITS_LAST));
  CHECK(stats(a).tokens_computed == first.size());
  CHECK(stats(a).tokens_reused == 0);

  dz_session* b = h.session(h.cached);
  DZ_OK_OR_FAIL(dz_session_append(b, second.data(), second.size(), DZ_LOGITS_LAST));
  const dz_session_stats sb = stats(b);
  CHECK(sb.tokens_reused == 1000);
  CHECK(sb.tokens_computed == 29);
  CHECK(sb.n_tokens == second.size());
  const dz_kv_stats ks = stats(h.cached);
  CHECK(ks.tokens_reused == 1000);
  CHECK(ks.tokens_requested == first.size() + second.size());
  // b holds the 125 shared pages plus 4 of its own; a holds 125 + 5.
  CHECK(ks.pages_used == 125 + 5 + 4);

  // The same tokens computed from scratch without a cache.
  dz_session* c = h.session(h.plain);
  DZ_OK_OR_FAIL(dz_session_append(c, second.data(), second.size(), DZ_LOGITS_LAST));
  CHECK(stats(c).tokens_computed == second.size());
  CHECK(stats(c).tokens_reused == 0);
  CHECK(stats(h.plain).tokens_reused == 0);
  CHECK(rel_diff(last_logits(b), last_logits(c)) <= 1e-5);

  // Decode steps attend over the adopted pages and agree too.
  for (int32_t t : random_ids(12)) {
    DZ_OK_OR_FAIL(dz_session_append(b, &t, 1, DZ_LOGITS_LAST));
    DZ_OK_OR_FAIL(dz_session_append(c, &t, 1, DZ_LOGITS_LAST));
    CHECK(rel_diff(last_logits(b), last_logits(c)) <= 1e-5);
  }
  // The earlier session is untouched by the sharing: one more token on a
  // matches the same token on an uncached copy of its sequence.
  dz_session* d = h.session(h.plain);
  DZ_OK_OR_FAIL(dz_session_append(d, first.data(), first.size(), DZ_LOGITS_LAST));
  const int32_t t = random_ids(1)[0];
  DZ_OK_OR_FAIL(dz_session_append(a, &t, 1, DZ_LOGITS_LAST));
  DZ_OK_OR_FAIL(dz_session_append(d, &t, 1, DZ_LOGITS_LAST));
  CHECK(rel_diff(last_logits(a), last_logits(d)) <= 1e-5);
}
