// Whole-model fixtures of the CPU families (tests/data/<name>/, made by the
// scripts in tools/reference/): reference prompts, logits, greedy tokens and
// margins, and the other tensors a fixture's reference.safetensors holds; a
// model opened through the C API; one or more sequences driven straight
// through Family::forward on their own arena.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "api/handles.h"
#include "dayzero.h"
#include "kv/arena.h"
#include "loader/safetensors.h"
#include "model/family.h"
#include "support/safetensors_writer.h"

namespace dz::test {

inline const std::string kFixtureData = DZ_TEST_DATA;

struct Reference {
  std::vector<int32_t> prompt;
  std::vector<float> logits;  // [T, vocab]
  std::vector<int32_t> greedy;
  std::vector<float> margin;
};

// I32/I64 tensor values as int32.
inline std::vector<int32_t> tensor_ints(const TensorView& t) {
  std::vector<int32_t> v(static_cast<size_t>(t.numel()));
  for (size_t k = 0; k < v.size(); ++k) {
    if (t.dtype == DType::I64) {
      int64_t x;
      std::memcpy(&x, t.data + 8 * k, 8);
      v[k] = int32_t(x);
    } else {
      std::memcpy(&v[k], t.data + 4 * k, 4);
    }
  }
  return v;
}
inline std::vector<float> tensor_floats(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

struct FamilyFixture {
  std::vector<Reference> refs;                       // prompt.i, logits.i, greedy.i, margin.i
  std::map<std::string, std::vector<float>> floats;  // every other F32 tensor by name
  std::map<std::string, std::vector<int32_t>> ints;  // every other integer tensor by name
};

// Read once per name and kept for the test run.
inline const FamilyFixture& family_fixture(const std::string& name) {
  static std::map<std::string, FamilyFixture> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  SafetensorsFile f(kFixtureData + "/" + name + "/reference.safetensors");
  const auto& ts = f.tensors();
  FamilyFixture fx;
  for (int i = 0; ts.count("prompt." + std::to_string(i)); ++i) {
    const std::string s = std::to_string(i);
    fx.refs.push_back({tensor_ints(ts.at("prompt." + s)), tensor_floats(ts.at("logits." + s)),
                       tensor_ints(ts.at("greedy." + s)), tensor_floats(ts.at("margin." + s))});
  }
  for (const auto& [n, t] : ts) {
    if (n.rfind("prompt.", 0) == 0 || n.rfind("logits.", 0) == 0 || n.rfind("greedy.", 0) == 0 ||
        n.rfind("margin.", 0) == 0)
      continue;
    if (t.dtype == DType::F32)
      fx.floats[n] = tensor_floats(t);
    else
      fx.ints[n] = tensor_ints(t);
  }
  return cache[name] = std::move(fx);
}

struct FixtureModel {
  dz_model* m = nullptr;
  // name: a fixture folder, or an absolute path. tweak adjusts the parameters
  // (after dz_model_params_init, 2 threads).
  explicit FixtureModel(const std::string& name, void (*tweak)(dz_model_params&) = nullptr) {
    dz_model_params p;
    dz_model_params_init(&p);
    p.n_threads = 2;
    if (tweak) tweak(p);
    const std::string dir = name.rfind('/', 0) == 0 ? name : kFixtureData + "/" + name;
    const dz_status st = dz_model_open(dir.c_str(), &p, &m);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
  }
  ~FixtureModel() { dz_model_free(m); }
  Family& family() const { return *m->family; }
  int32_t vocab() const { return m->family->n_vocab(); }
};

// Sequences driven through Family::forward on their own arena (prefix cache off).
struct Runner {
  const FixtureModel& model;
  kv::Arena arena;
  std::vector<std::unique_ptr<kv::Sequence>> seqs;
  uint64_t tokens_read = 0;
  explicit Runner(const FixtureModel& m, uint32_t page_tokens = 16, uint64_t pages = 256)
      : model(m), arena(m.family().kv_layout(page_tokens), kv::ArenaConfig{pages, 4, false}) {}
  kv::Sequence& seq(size_t i = 0) {
    while (seqs.size() <= i) seqs.push_back(std::make_unique<kv::Sequence>(arena));
    return *seqs[i];
  }
  // Append tokens to sequence i; logits of every new token (or the last).
  std::vector<float> append(const std::vector<int32_t>& toks, bool all = true, size_t i = 0) {
    kv::Sequence& s = seq(i);
    s.reserve(toks.size());
    std::vector<float> logits((all ? toks.size() : 1) * size_t(model.vocab()));
    ForwardItem it;
    it.seq = &s;
    it.tokens = toks;
    it.all_logits = all;
    it.logits = logits.data();
    ForwardOptions opt;
    opt.attention_tokens_read = &tokens_read;
    model.family().forward({&it, 1}, opt);
    s.commit(toks);
    return logits;
  }
};

inline double cosine(const float* a, const float* b, size_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < n; ++i) ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return ab / std::sqrt(aa * bb);
}

inline int32_t argmax(const float* v, size_t n) { return int32_t(std::max_element(v, v + n) - v); }

// Worst per-row cosine and largest |difference| of two [rows x n] logits blocks.
struct LogitsDiff {
  double worst_cosine = 1, max_abs = 0;
};
inline LogitsDiff compare_logits(const float* a, const float* b, size_t rows, size_t n) {
  LogitsDiff d;
  for (size_t r = 0; r < rows; ++r) {
    d.worst_cosine = std::min(d.worst_cosine, cosine(a + r * n, b + r * n, n));
    for (size_t i = 0; i < n; ++i) d.max_abs = std::max(d.max_abs, double(std::fabs(a[r * n + i] - b[r * n + i])));
  }
  return d;
}

// A fixture's weights opened under configs a test edits: a temporary folder
// linking every file but config.json, which each open() writes afresh.
// fixture: a fixture folder, or an absolute path.
struct ConfigProbe {
  std::filesystem::path dir;
  nlohmann::json base;  // the fixture's own config
  explicit ConfigProbe(const std::string& fixture) {
    namespace fs = std::filesystem;
    const fs::path src = fixture.rfind('/', 0) == 0 ? fs::path(fixture) : fs::path(kFixtureData) / fixture;
    dir = temp_dir(src.filename().string());  // unique: two probes of one fixture may live at once
    for (const auto& e : fs::directory_iterator(src))
      if (e.path().filename() != "config.json") fs::create_symlink(e.path(), dir / e.path().filename());
    std::ifstream(src / "config.json") >> base;
  }
  ~ConfigProbe() { std::filesystem::remove_all(dir); }
  // Writes cfg as the folder's config.json; returns the folder.
  std::string with(const nlohmann::json& cfg) const {
    std::ofstream(dir / "config.json") << cfg.dump();
    return dir.string();
  }
  // dz_model_open under cfg: its status and dz_last_error().
  std::pair<dz_status, std::string> open(const nlohmann::json& cfg) const {
    std::ofstream(dir / "config.json") << cfg.dump();
    dz_model_params p;
    dz_model_params_init(&p);
    dz_model* m = nullptr;
    const dz_status st = dz_model_open(dir.c_str(), &p, &m);
    dz_model_free(m);
    return {st, std::string(dz_last_error())};
  }
  // Each case edits the fixture's config; opening must fail with its status
  // and a message containing `says`.
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    dz_status status;
    const char* says;
  };
  void check_cases(const std::vector<Case>& cases) const {
    for (const Case& c : cases) {
      nlohmann::json cfg = base;
      c.edit(cfg);
      const auto [st, msg] = open(cfg);
      INFO(c.what << ": " << msg);
      CHECK(st == c.status);
      CHECK(msg.find(c.says) != std::string::npos);
    }
  }
};

// The last logits row a session holds (dz_session_logits).
inline std::vector<float> session_last_logits(dz_session* s) {
  const float* l = nullptr;
  size_t rows = 0, nv = 0;
  REQUIRE(dz_session_logits(s, &l, &rows, &nv) == DZ_OK);
  return std::vector<float>(l + (rows - 1) * nv, l + rows * nv);
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t k = 0; k < a.size(); ++k) d = std::max(d, double(std::fabs(a[k] - b[k])));
  return d;
}

// The hybrid families' (recurrent or windowed state beside the pages) C API
// scenario on fixture `name`'s third prompt (144+ tokens), in an arena of
// `capacity` bytes with 16-token pages and prefill chunks of 40:
//  - logits and greedy tokens through sessions equal the reference;
//  - a second session with the same prompt adopts the cached pages and the
//    state snapshot at 144 (chunks are cut at page boundaries: 32, 64, ...,
//    144) and computes the same logits;
//  - truncation works to a position with a snapshot (96), not elsewhere (100),
//    and the failed call changes nothing;
//  - a prefill cancelled after a committed chunk leaves the session as it was.
// check_arena(arena) checks the family's state accounting with 3 sessions live.
// On the GPU (gpu true) logits are held to the reference by cosine 0.999 and
// to each other by `tol` (BF16 activations: the GEMMs' sums differ with the
// chunking), and the cancelled prefill is compared with a fresh session.
inline void hybrid_session_scenario(const std::string& name, size_t capacity,
                                    const std::function<void(dz_kv_arena*)>& check_arena, bool gpu = false,
                                    double tol = 1e-5) {
  FixtureModel model(name, gpu ? +[](dz_model_params& p) { p.device = DZ_DEVICE_CUDA; } : nullptr);
  const Reference& ref = family_fixture(name).refs[2];
  const size_t V = size_t(model.vocab()), T = ref.prompt.size();
  REQUIRE(T > 144);
  dz_kv_arena_params ap;
  dz_kv_arena_params_init(&ap);
  ap.page_tokens = 16;
  ap.capacity_bytes = capacity;
  dz_kv_arena* arena = nullptr;
  REQUIRE(dz_kv_arena_create(model.m, &ap, &arena) == DZ_OK);
  dz_session_params sp;
  dz_session_params_init(&sp);
  sp.prefill_chunk = 40;  // not a multiple of the page: chunks are cut at page boundaries
  dz_session *a = nullptr, *b = nullptr, *f = nullptr;
  REQUIRE(dz_session_create(arena, &sp, &a) == DZ_OK);
  REQUIRE(dz_session_append(a, ref.prompt.data(), T, DZ_LOGITS_LAST) == DZ_OK);
  const std::vector<float> want = session_last_logits(a);
  CHECK(cosine(want.data(), ref.logits.data() + (T - 1) * V, V) >= (gpu ? 0.999 : 0.99999));
  std::vector<int32_t> greedy(4);
  REQUIRE(dz_session_fork(a, &f) == DZ_OK);
  for (int32_t& t : greedy) REQUIRE(dz_generate_step(&f, 1, &t) == DZ_OK);
  CHECK(std::equal(greedy.begin(), greedy.end(), ref.greedy.begin()));
  REQUIRE(dz_session_create(arena, &sp, &b) == DZ_OK);
  REQUIRE(dz_session_append(b, ref.prompt.data(), T, DZ_LOGITS_LAST) == DZ_OK);
  dz_session_stats st;
  dz_session_stats_init(&st);
  REQUIRE(dz_session_get_stats(b, &st) == DZ_OK);
  CHECK(st.tokens_reused == 144);
  const std::vector<float> got = session_last_logits(b);
  INFO("reused prefix: max |logit diff| " << max_abs_diff(got, want));
  CHECK(max_abs_diff(got, want) < tol);
  check_arena(arena);
  size_t len = 0;
  CHECK(dz_session_truncate(b, 100) == DZ_ERR_UNSUPPORTED);
  CHECK(std::string(dz_last_error()).find("recurrent state") != std::string::npos);
  REQUIRE(dz_session_length(b, &len) == DZ_OK);
  CHECK(len == T);
  REQUIRE(dz_session_truncate(b, 96) == DZ_OK);
  REQUIRE(dz_session_append(b, ref.prompt.data() + 96, T - 96, DZ_LOGITS_LAST) == DZ_OK);
  CHECK(max_abs_diff(session_last_logits(b), want) < tol);
  struct Count {
    int polls = -1000;
  } count;
  dz_session_params cancel = sp;
  // A forward polls once per layer and once before the logits (5 polls with the
  // fixtures' 4 layers): the second append's second chunk is cancelled.
  cancel.abort = [](void* u) -> int { return ++static_cast<Count*>(u)->polls > 7; };
  cancel.abort_user = &count;
  dz_session* c = nullptr;
  REQUIRE(dz_session_create(arena, &cancel, &c) == DZ_OK);
  const std::vector<int32_t> other(ref.prompt.rbegin(), ref.prompt.rend());
  REQUIRE(dz_session_append(c, other.data(), 20, DZ_LOGITS_LAST) == DZ_OK);
  count.polls = 0;
  CHECK(dz_session_append(c, other.data() + 20, 100, DZ_LOGITS_LAST) == DZ_ERR_CANCELLED);
  REQUIRE(dz_session_length(c, &len) == DZ_OK);
  CHECK(len == 20);
  count.polls = -1000;
  REQUIRE(dz_session_append(c, other.data() + 20, 100, DZ_LOGITS_LAST) == DZ_OK);
  std::vector<float> direct;
  dz_session* d = nullptr;
  if (gpu) {  // device arenas are the API's: a session of its own
    REQUIRE(dz_session_create(arena, &sp, &d) == DZ_OK);
    REQUIRE(dz_session_append(d, other.data(), 120, DZ_LOGITS_LAST) == DZ_OK);
    direct = session_last_logits(d);
  } else {
    Runner plain(model);
    direct = plain.append({other.begin(), other.begin() + 120}, false);
  }
  INFO("after a cancelled prefill: max |logit diff| " << max_abs_diff(session_last_logits(c), direct));
  CHECK(max_abs_diff(session_last_logits(c), direct) < tol);
  for (dz_session* s : {a, b, c, f, d}) dz_session_free(s);
  dz_kv_arena_free(arena);
}

// Greedy continuation of sequence 0 from its last logits row: steps tokens, each
// decoded as one new token.
inline std::vector<int32_t> greedy_decode(Runner& run, std::vector<float> last, size_t steps) {
  std::vector<int32_t> toks;
  const size_t V = last.size();
  for (size_t s = 0; s < steps; ++s) {
    toks.push_back(argmax(last.data(), V));
    last = run.append({toks.back()}, false);
  }
  return toks;
}

}  // namespace dz::test
