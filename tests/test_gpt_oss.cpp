// gpt-oss on the CPU backend against transformers' float32 outputs for the
// tiny fixture (tests/data/gpt_oss_tiny, made by
// tools/reference/gpt_oss_fixtures.py), and the session API around it.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "api/handles.h"
#include "cpu/mxfp4.h"
#include "cpu/sampling.h"
#include "dayzero.h"
#include "loader/safetensors.h"
#include "model/gpt_oss.h"
#include "support/run_cmd.h"
#include "support/safetensors_writer.h"

namespace fs = std::filesystem;
using namespace dz::test;

namespace {

const std::string kModelDir = std::string(DZ_TEST_DATA) + "/gpt_oss_tiny";

struct Reference {
  std::vector<int32_t> prompt;
  std::vector<float> logits;  // [T, vocab]
  std::vector<int32_t> greedy;
};

const std::vector<Reference>& references() {
  static const std::vector<Reference> refs = [] {
    dz::SafetensorsFile f(kModelDir + "/reference.safetensors");
    std::vector<Reference> r;
    for (int i = 0;; ++i) {
      const auto& ts = f.tensors();
      auto p = ts.find("prompt." + std::to_string(i));
      if (p == ts.end()) break;
      Reference ref;
      auto ints = [](const dz::TensorView& t) {
        std::vector<int32_t> v(static_cast<size_t>(t.numel()));
        for (size_t k = 0; k < v.size(); ++k) {
          int64_t x;
          std::memcpy(&x, t.data + 8 * k, 8);
          v[k] = int32_t(x);
        }
        return v;
      };
      ref.prompt = ints(p->second);
      ref.greedy = ints(ts.at("greedy." + std::to_string(i)));
      const auto& l = ts.at("logits." + std::to_string(i));
      ref.logits.resize(size_t(l.numel()));
      std::memcpy(ref.logits.data(), l.data, l.nbytes);
      r.push_back(std::move(ref));
    }
    return r;
  }();
  return refs;
}

// Owning wrappers so a failed REQUIRE frees everything.
struct Model {
  dz_model* m = nullptr;
  explicit Model(const std::string& dir = kModelDir) {
    dz_model_params p;
    dz_model_params_init(&p);
    p.n_threads = 2;
    const dz_status st = dz_model_open(dir.c_str(), &p, &m);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
  }
  ~Model() { dz_model_free(m); }
};

const Model& shared_model() {
  static Model m;
  return m;
}

struct Arena {
  dz_kv_arena* a = nullptr;
  // 4 MiB unless a page count is given (the default 256 MiB is slow to zero-fill).
  explicit Arena(uint32_t page_tokens = 0, uint64_t pages = 0, int prefix_cache = 1) {
    dz_kv_arena_params p;
    dz_kv_arena_params_init(&p);
    p.page_tokens = page_tokens;
    p.capacity_pages = pages;
    p.capacity_bytes = uint64_t(4) << 20;
    p.prefix_cache = prefix_cache;
    INFO(dz_last_error());
    REQUIRE(dz_kv_arena_create(shared_model().m, &p, &a) == DZ_OK);
  }
  ~Arena() { dz_kv_arena_free(a); }
};

struct Session {
  dz_session* s = nullptr;
  explicit Session(const Arena& arena, uint32_t chunk = 0, dz_abort_fn abort = nullptr, void* user = nullptr) {
    dz_session_params p;
    dz_session_params_init(&p);
    p.prefill_chunk = chunk;
    p.abort = abort;
    p.abort_user = user;
    REQUIRE(dz_session_create(arena.a, &p, &s) == DZ_OK);
  }
  explicit Session(dz_session* raw) : s(raw) {}
  ~Session() { dz_session_free(s); }
  Session(const Session&) = delete;

  void append(const std::vector<int32_t>& t, dz_logits_mode mode = DZ_LOGITS_LAST) {
    const dz_status st = dz_session_append(s, t.data(), t.size(), mode);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
  }
  std::vector<float> logits() const {
    const float* p = nullptr;
    size_t rows = 0, v = 0;
    REQUIRE(dz_session_logits(s, &p, &rows, &v) == DZ_OK);
    return std::vector<float>(p, p + rows * v);
  }
  std::vector<float> last_row() const {
    const float* p = nullptr;
    size_t rows = 0, v = 0;
    REQUIRE(dz_session_logits(s, &p, &rows, &v) == DZ_OK);
    return std::vector<float>(p + (rows - 1) * v, p + rows * v);
  }
  size_t length() const {
    size_t n = 0;
    REQUIRE(dz_session_length(s, &n) == DZ_OK);
    return n;
  }
  dz_session_stats stats() const {
    dz_session_stats st;
    dz_session_stats_init(&st);
    REQUIRE(dz_session_get_stats(s, &st) == DZ_OK);
    return st;
  }
};

std::vector<int32_t> head(const std::vector<int32_t>& v, size_t n) { return {v.begin(), v.begin() + ptrdiff_t(n)}; }

int32_t n_vocab() {
  dz_model_info info;
  dz_model_info_init(&info);
  REQUIRE(dz_model_get_info(shared_model().m, &info) == DZ_OK);
  return info.n_vocab;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
  return m;
}

// E2M1 from its bits (sign, 2-bit exponent with bias 1, 1-bit mantissa), in float64.
double e2m1_f64(unsigned code) {
  const unsigned e = (code >> 1) & 3, m = code & 1;
  const double mag = e == 0 ? 0.5 * m : (1.0 + 0.5 * m) * std::ldexp(1.0, int(e) - 1);
  return (code & 8) ? -mag : mag;
}

}  // namespace

TEST_CASE("MXFP4 rows decode exactly (interleaved nibbles, E8M0 scales incl. 0 and 254)", "[gpt_oss]") {
  std::mt19937 rng(7);
  const int64_t K = 32 * 24;
  std::vector<uint8_t> blocks(static_cast<size_t>(K / 2)), scales(static_cast<size_t>(K / 32));
  for (auto& b : blocks) b = uint8_t(rng());
  const uint8_t special[] = {0, 1, 254, 127, 126, 128, 100, 200};
  for (size_t g = 0; g < scales.size(); ++g) scales[g] = g < 8 ? special[g] : uint8_t(rng() % 255);
  std::vector<float> out(static_cast<size_t>(K));
  dz::cpu::mxfp4_decode_row(blocks.data(), scales.data(), K, out.data());
  int overflow = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t g = k / 32, j = (k % 32) / 2;
    const uint8_t byte = blocks[size_t(g * 16 + j)];
    const unsigned code = (k % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
    const double ref = e2m1_f64(code) * std::ldexp(1.0, int(scales[size_t(g)]) - 127);
    // The decoded value is the float64 value rounded to fp32 (exact unless it
    // exceeds fp32's range, which only scale 254 with |E2M1| >= 2 does).
    const float want = float(ref);
    INFO("k=" << k << " code=" << code << " scale=" << int(scales[size_t(g)]));
    CHECK(std::memcmp(&out[size_t(k)], &want, 4) == 0);
    if (std::isinf(want))
      ++overflow;
    else
      CHECK(double(out[size_t(k)]) == ref);
  }
  CHECK(overflow > 0);  // the 254 group did reach the overflow case
  CHECK(dz::cpu::e8m0_to_float(0) == float(std::ldexp(1.0, -127)));
  CHECK(dz::cpu::e8m0_to_float(0) > 0);
  CHECK(dz::cpu::e8m0_to_float(254) == float(std::ldexp(1.0, 127)));
  scales[5] = 0xFF;
  CHECK(dz::cpu::find_e8m0_nan(scales.data(), scales.size()) == 5);
  scales[5] = 0xFE;
  CHECK(dz::cpu::find_e8m0_nan(scales.data(), scales.size()) == SIZE_MAX);
}

TEST_CASE("gpt-oss logits match transformers at every position", "[gpt_oss]") {
  const int32_t V = n_vocab();
  // Small pages so attention walks many page-table entries.
  Arena arena(8);
  for (size_t i = 0; i < references().size(); ++i) {
    const Reference& ref = references()[i];
    Session s(arena);
    s.append(ref.prompt, DZ_LOGITS_ALL);
    const std::vector<float> got = s.logits();
    REQUIRE(got.size() == ref.logits.size());
    double worst_cos = 1, worst_rel = 0;
    for (size_t t = 0; t < ref.prompt.size(); ++t) {
      const float* a = got.data() + t * size_t(V);
      const float* b = ref.logits.data() + t * size_t(V);
      double dot = 0, na = 0, nb = 0, mx = 0, err = 0;
      for (int32_t v = 0; v < V; ++v) {
        dot += double(a[v]) * b[v];
        na += double(a[v]) * a[v];
        nb += double(b[v]) * b[v];
        mx = std::max(mx, std::fabs(double(b[v])));
        err = std::max(err, std::fabs(double(a[v]) - b[v]));
      }
      const double cos = dot / std::sqrt(na * nb);
      INFO("prompt " << i << " position " << t);
      CHECK(cos >= 0.99999);
      CHECK(err <= 1e-3 * mx);
      worst_cos = std::min(worst_cos, cos);
      worst_rel = std::max(worst_rel, err / mx);
    }
    std::printf("gpt_oss_tiny prompt %zu (T=%zu): min cosine %.9f, max |err|/max|ref| %.3g\n", i, ref.prompt.size(),
                worst_cos, worst_rel);
  }
}

// DZ_ACTIVATIONS_BF16 rounds what the CPU feeds each product as the CUDA
// backend does; the GPU test compares the two position by position. Here: the
// mode changes the numbers by BF16-sized amounts only (T=7: no route flips).
TEST_CASE("DZ_ACTIVATIONS_BF16 on the CPU: BF16-sized changes; bad values refused", "[gpt_oss]") {
  dz_model_params p;
  dz_model_params_init(&p);
  p.n_threads = 2;
  p.activations = DZ_ACTIVATIONS_BF16;
  dz_model* m = nullptr;
  REQUIRE(dz_model_open(kModelDir.c_str(), &p, &m) == DZ_OK);
  dz_kv_arena_params ap;
  dz_kv_arena_params_init(&ap);
  ap.capacity_bytes = uint64_t(4) << 20;
  dz_kv_arena* arena = nullptr;
  REQUIRE(dz_kv_arena_create(m, &ap, &arena) == DZ_OK);
  dz_session* s = nullptr;
  REQUIRE(dz_session_create(arena, nullptr, &s) == DZ_OK);
  const Reference& ref = references()[0];
  std::vector<float> margins;  // the router trace the GPU test reads
  dz::gpt_oss_set_router_trace(*m->family, &margins);
  REQUIRE(dz_session_append(s, ref.prompt.data(), ref.prompt.size(), DZ_LOGITS_ALL) == DZ_OK);
  dz::gpt_oss_set_router_trace(*m->family, nullptr);
  dz_model_info info;
  dz_model_info_init(&info);
  REQUIRE(dz_model_get_info(m, &info) == DZ_OK);
  REQUIRE(margins.size() == size_t(info.n_layers) * ref.prompt.size());
  for (float g : margins) CHECK(g >= 0.f);
  CHECK(*std::max_element(margins.begin(), margins.end()) > 0.f);
  const float* lp = nullptr;
  size_t rows = 0, V = 0;
  REQUIRE(dz_session_logits(s, &lp, &rows, &V) == DZ_OK);
  double worst = 1, moved = 0;
  for (size_t t = 0; t < rows; ++t) {
    double ab = 0, aa = 0, bb = 0;
    for (size_t v = 0; v < V; ++v) {
      const double a = lp[t * V + v], b = ref.logits[t * V + v];
      ab += a * b, aa += a * a, bb += b * b;
      moved = std::max(moved, std::fabs(a - b));
    }
    worst = std::min(worst, ab / std::sqrt(aa * bb));
  }
  std::printf("gpt_oss_tiny T=%zu with BF16 activations on the CPU: min cosine vs transformers %.6f, max |diff| %.4f\n",
              rows, worst, moved);
  CHECK(worst >= 0.9999);
  CHECK(moved > 1e-3);  // the rounding is really applied (fp32 mode: 3e-6)
  CHECK(moved < 0.1);
  dz_session_free(s);
  dz_kv_arena_free(arena);
  dz_model_free(m);

  p.activations = dz_activation_precision(7);
  CHECK(dz_model_open(kModelDir.c_str(), &p, &m) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(std::string(dz_last_error()).find("activations") != std::string::npos);
  p.activations = DZ_ACTIVATIONS_AUTO;
  p.exact_moe_layers = -1;
  CHECK(dz_model_open(kModelDir.c_str(), &p, &m) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(std::string(dz_last_error()).find("exact_moe_layers") != std::string::npos);
  p.exact_moe_layers = 0;
  p.attention = dz_attention_precision(3);
  CHECK(dz_model_open(kModelDir.c_str(), &p, &m) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(std::string(dz_last_error()).find("params->attention 3") != std::string::npos);
  p.attention = DZ_ATTENTION_AUTO;
  // pass_tokens: 0 or 256..65536, refused before any device work (so also
  // here for DZ_DEVICE_CUDA without a GPU).
  for (dz_device dev : {DZ_DEVICE_CPU, DZ_DEVICE_CUDA})
    for (uint32_t bad : {1u, 255u, 65537u}) {
      p.device = dev;
      p.pass_tokens = bad;
      CHECK(dz_model_open(kModelDir.c_str(), &p, &m) == DZ_ERR_INVALID_ARGUMENT);
      CHECK(std::string(dz_last_error()).find("params->pass_tokens " + std::to_string(bad)) != std::string::npos);
    }
  p.device = DZ_DEVICE_CPU;
  p.pass_tokens = 256;  // the CPU backend ignores it
  REQUIRE(dz_model_open(kModelDir.c_str(), &p, &m) == DZ_OK);
  dz_model_free(m);
}

TEST_CASE("gpt-oss greedy continuations match transformers through dz_generate_step", "[gpt_oss]") {
  Arena arena;
  for (const Reference& ref : references()) {
    Session s(arena);
    s.append(ref.prompt);
    std::vector<int32_t> got;
    for (size_t k = 0; k < ref.greedy.size(); ++k) {
      int32_t tok = -1;
      REQUIRE(dz_generate_step(&s.s, 1, &tok) == DZ_OK);
      got.push_back(tok);
    }
    CHECK(got == ref.greedy);
    CHECK(s.length() == ref.prompt.size() + ref.greedy.size());
  }
}

TEST_CASE("prefill then one step equals a full prefill; chunked prefill equals unchunked", "[gpt_oss]") {
  Arena arena(16);
  const Reference& ref = references()[2];
  const size_t T = ref.prompt.size();
  Session full(arena);
  full.append(ref.prompt, DZ_LOGITS_ALL);
  const std::vector<float> all = full.logits();
  const size_t V = size_t(n_vocab());

  Session stepped(arena);
  stepped.append(head(ref.prompt, T - 1));
  const int32_t last = ref.prompt[T - 1];
  REQUIRE(dz_decode_batch(&stepped.s, &last, 1) == DZ_OK);
  // Every row is computed independently of the batch around it: identical bits.
  CHECK(stepped.last_row() == std::vector<float>(all.end() - ptrdiff_t(V), all.end()));

  Session chunked(arena, 7);
  chunked.append(ref.prompt, DZ_LOGITS_ALL);
  CHECK(chunked.logits() == all);
  CHECK(chunked.stats().tokens_computed == T);
}

TEST_CASE("sessions of different lengths batched through dz_generate_step match each alone", "[gpt_oss]") {
  Arena arena(16);
  const size_t steps = 6;
  // Greedy, then sampling (several sessions sample in parallel in a batch):
  // each session's seed fixes its draws either way.
  for (const float temp : {0.f, 0.8f}) {
    INFO("temperature " << temp);
    auto set_sampler = [&](dz_session* s, size_t i) {
      dz_sampler_params sp;
      dz_sampler_params_init(&sp);
      sp.temperature = temp;
      sp.top_p = 0.95f;
      sp.seed = 100 + i;
      REQUIRE(dz_session_set_sampler(s, &sp) == DZ_OK);
    };
    std::vector<std::vector<int32_t>> alone_tokens;
    std::vector<std::vector<float>> alone_logits;
    for (size_t i = 0; i < references().size(); ++i) {
      Session s(arena);
      set_sampler(s.s, i);
      s.append(references()[i].prompt);
      std::vector<int32_t> toks;
      for (size_t k = 0; k < steps; ++k) {
        int32_t t;
        REQUIRE(dz_generate_step(&s.s, 1, &t) == DZ_OK);
        toks.push_back(t);
      }
      alone_tokens.push_back(toks);
      alone_logits.push_back(s.last_row());
    }
    std::vector<std::unique_ptr<Session>> ss;
    std::vector<dz_session*> raw;
    for (size_t i = 0; i < references().size(); ++i) {
      ss.push_back(std::make_unique<Session>(arena));
      set_sampler(ss.back()->s, i);
      ss.back()->append(references()[i].prompt);
      raw.push_back(ss.back()->s);
    }
    std::vector<std::vector<int32_t>> batched(raw.size());
    for (size_t k = 0; k < steps; ++k) {
      std::vector<int32_t> out(raw.size(), -1);
      REQUIRE(dz_generate_step(raw.data(), raw.size(), out.data()) == DZ_OK);
      for (size_t i = 0; i < raw.size(); ++i) batched[i].push_back(out[i]);
    }
    for (size_t i = 0; i < raw.size(); ++i) {
      CHECK(batched[i] == alone_tokens[i]);
      CHECK(ss[i]->last_row() == alone_logits[i]);
      CHECK(ss[i]->length() == references()[i].prompt.size() + steps);
    }
  }
}

TEST_CASE("sliding layers read only the window", "[gpt_oss]") {
  // The fixture: 4 layers alternating sliding (window 16) and full.
  std::ifstream cf(kModelDir + "/config.json");
  const auto cfg = nlohmann::json::parse(cf);
  const int64_t W = cfg["sliding_window"].get<int64_t>();
  const auto types = cfg["layer_types"].get<std::vector<std::string>>();
  const Reference& ref = references()[2];
  const int64_t T = int64_t(ref.prompt.size());
  REQUIRE(T > 2 * W);
  uint64_t want = 0;
  for (const auto& t : types)
    for (int64_t p = 0; p < T; ++p) want += uint64_t(t == "sliding_attention" ? std::min(p + 1, W) : p + 1);
  Arena arena;
  Session s(arena);
  s.append(ref.prompt);
  CHECK(s.stats().attention_tokens_read == want);
  // One more token: full layers read T + 1 tokens, sliding ones W.
  const int32_t tok = 5;
  REQUIRE(dz_decode_batch(&s.s, &tok, 1) == DZ_OK);
  uint64_t step = 0;
  for (const auto& t : types) step += uint64_t(t == "sliding_attention" ? W : T + 1);
  CHECK(s.stats().attention_tokens_read == want + step);
}

TEST_CASE("a 0xFF MXFP4 scale is refused at open, naming the tensor", "[gpt_oss]") {
  const fs::path dir = temp_dir("gptoss-nan");
  for (const auto& e : fs::directory_iterator(kModelDir)) fs::copy_file(e.path(), dir / e.path().filename());
  // Find a scales tensor and poison one byte in the middle of it.
  const std::string victim = "model.layers.2.mlp.experts.down_proj_scales";
  std::ifstream idx(dir / "model.safetensors.index.json");
  const std::string shard = (dir / nlohmann::json::parse(idx)["weight_map"][victim].get<std::string>()).string();
  size_t offset = 0;
  {
    // The middle byte of the tensor's data, located through the shard header.
    std::ifstream in(shard, std::ios::binary);
    uint64_t hlen = 0;
    in.read(reinterpret_cast<char*>(&hlen), 8);
    std::string h(hlen, '\0');
    in.read(h.data(), std::streamsize(hlen));
    const auto j = nlohmann::json::parse(h);
    const auto offs = j[victim]["data_offsets"];
    offset = 8 + size_t(hlen) + (offs[0].get<size_t>() + offs[1].get<size_t>()) / 2;
  }
  {
    std::fstream io(shard, std::ios::binary | std::ios::in | std::ios::out);
    io.seekp(std::streamoff(offset));
    io.put(char(0xFF));
  }
  dz_model_params p;
  dz_model_params_init(&p);
  dz_model* m = nullptr;
  CHECK(dz_model_open(dir.string().c_str(), &p, &m) == DZ_ERR_FORMAT);
  CHECK(m == nullptr);
  const std::string msg = dz_last_error();
  CHECK_THAT(msg, Catch::Contains(victim) && Catch::Contains("0xFF"));
  dz_model_free(m);
  fs::remove_all(dir);
}

TEST_CASE("fork shares the prefix; truncate rewinds exactly", "[gpt_oss]") {
  Arena arena(8);
  const Reference& ref = references()[1];
  Session a(arena);
  a.append(ref.prompt);
  const std::vector<float> a_logits = a.logits();
  dz_session* raw = nullptr;
  REQUIRE(dz_session_fork(a.s, &raw) == DZ_OK);
  Session b(raw);
  CHECK(b.length() == a.length());
  CHECK(b.logits() == a_logits);
  // Both continue greedily and agree; the fork's steps leave the original alone.
  int32_t tb[3], ta[3];
  for (int k = 0; k < 3; ++k) REQUIRE(dz_generate_step(&b.s, 1, &tb[k]) == DZ_OK);
  CHECK(a.logits() == a_logits);
  CHECK(a.length() == ref.prompt.size());
  for (int k = 0; k < 3; ++k) REQUIRE(dz_generate_step(&a.s, 1, &ta[k]) == DZ_OK);
  CHECK(std::vector<int32_t>(ta, ta + 3) == std::vector<int32_t>(tb, tb + 3));
  CHECK(std::vector<int32_t>(ta, ta + 3) == head(ref.greedy, 3));

  // Truncate into the middle of a page and recompute: same logits as the first time.
  const size_t cut = ref.prompt.size() - 5;
  REQUIRE(dz_session_truncate(b.s, cut) == DZ_OK);
  CHECK(b.length() == cut);
  int32_t tok;
  CHECK(dz_generate_step(&b.s, 1, &tok) == DZ_ERR_INVALID_ARGUMENT);  // no logits after truncate
  b.append(std::vector<int32_t>(ref.prompt.begin() + ptrdiff_t(cut), ref.prompt.end()));
  CHECK(b.logits() == a_logits);
  CHECK(dz_session_truncate(b.s, b.length() + 1) == DZ_ERR_INVALID_ARGUMENT);
  REQUIRE(dz_session_reset(b.s) == DZ_OK);
  CHECK(b.length() == 0);
  b.append(ref.prompt);
  CHECK(b.logits() == a_logits);
}

TEST_CASE("KV_FULL leaves the session unchanged and usable", "[gpt_oss]") {
  Arena tiny(8, 2, 0);  // 16 tokens in all
  const Reference& ref = references()[2];
  Session s(tiny);
  s.append(head(ref.prompt, 10));
  const std::vector<float> before = s.logits();
  const std::vector<int32_t> more(ref.prompt.begin() + 10, ref.prompt.begin() + 20);
  CHECK(dz_session_append(s.s, more.data(), more.size(), DZ_LOGITS_LAST) == DZ_ERR_KV_FULL);
  CHECK(s.length() == 10);
  CHECK(s.logits() == before);
  // Chunked: the first chunk fits, the second does not; the first is undone too.
  Session c(tiny, 4);
  CHECK(dz_session_append(c.s, more.data(), more.size(), DZ_LOGITS_LAST) == DZ_ERR_KV_FULL);
  CHECK(c.length() == 0);
  dz_session_free(c.s);
  c.s = nullptr;
  // Exactly filling the arena works and matches a roomy arena.
  s.append(std::vector<int32_t>(ref.prompt.begin() + 10, ref.prompt.begin() + 16));
  Arena roomy;
  Session r(roomy);
  r.append(head(ref.prompt, 16));
  CHECK(s.logits() == r.logits());
  // A step with no room fails without consuming the sampler or changing the session.
  int32_t tok = -1;
  CHECK(dz_generate_step(&s.s, 1, &tok) == DZ_ERR_KV_FULL);
  CHECK(s.length() == 16);
  CHECK(s.logits() == r.logits());
  REQUIRE(dz_session_truncate(s.s, 12) == DZ_OK);
  const std::vector<int32_t> tail(ref.prompt.begin() + 12, ref.prompt.begin() + 16);
  s.append(tail);
  CHECK(s.logits() == r.logits());
}

TEST_CASE("the abort callback cancels a prefill and leaves the session unchanged", "[gpt_oss]") {
  Arena arena;
  int calls = 0;
  auto abort_after = [](void* u) -> int { return ++*static_cast<int*>(u) > 3; };
  Session s(arena, 0, abort_after, &calls);
  const Reference& ref = references()[1];
  CHECK(dz_session_append(s.s, ref.prompt.data(), ref.prompt.size(), DZ_LOGITS_ALL) == DZ_ERR_CANCELLED);
  CHECK(s.length() == 0);
  CHECK(calls > 3);
  calls = -1000;
  s.append(ref.prompt);
  CHECK(s.length() == ref.prompt.size());
}

TEST_CASE("prefix cache reuses pages and gives the same logits", "[gpt_oss]") {
  Arena arena(8);
  const Reference& ref = references()[2];
  Session a(arena);
  a.append(ref.prompt);
  Session b(arena);
  b.append(ref.prompt);
  const auto st = b.stats();
  CHECK(st.tokens_reused > 0);
  CHECK(st.tokens_reused % 8 == 0);
  CHECK(st.tokens_reused + st.tokens_computed == ref.prompt.size());
  CHECK(b.logits() == a.logits());
  dz_kv_stats ks;
  dz_kv_stats_init(&ks);
  REQUIRE(dz_kv_arena_get_stats(arena.a, &ks) == DZ_OK);
  CHECK(ks.tokens_reused >= st.tokens_reused);
}

TEST_CASE("sampling: greedy, seeded and deterministic, top-k/top-p against float64 math", "[gpt_oss]") {
  // The kernel's distribution over 5 logits equals the float64 formula.
  const float logits[6] = {1.0f, 2.5f, 0.5f, 2.0f, -1.0f, NAN};
  dz::cpu::SamplerConfig cfg{0.7f, 4, 0.9f};
  // Top 4 by logit: 1, 3, 0, 2; softmax at T = 0.7; smallest prefix with mass >= 0.9.
  const int order[4] = {1, 3, 0, 2};
  double p[4], tot = 0;
  for (int i = 0; i < 4; ++i) tot += (p[i] = std::exp((logits[order[i]] - 2.5) / 0.7));
  double cum = 0;
  int keep = 0;
  while (keep < 4) {
    cum += p[keep++] / tot;
    if (cum >= 0.9) break;
  }
  double kept = 0;
  for (int i = 0; i < keep; ++i) kept += p[i];
  std::mt19937_64 rng(42);
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++counts[dz::cpu::sample_token(logits, 6, cfg, rng)];
  for (int i = 0; i < 4; ++i) {
    const double want = i < keep ? p[i] / kept : 0.0;
    INFO("token " << order[i]);
    CHECK(std::fabs(counts[order[i]] / double(n) - want) < 0.01);
  }
  CHECK(counts.count(4) == 0);
  CHECK(counts.count(5) == 0);
  CHECK(dz::cpu::argmax(logits, 6) == 1);

  // Through the API: a seed fixes the sequence; top_k = 1 is greedy.
  Arena arena;
  const Reference& ref = references()[0];
  auto run = [&](float temp, int32_t top_k, uint64_t seed) {
    Session s(arena);
    dz_sampler_params sp;
    dz_sampler_params_init(&sp);
    sp.temperature = temp;
    sp.top_k = top_k;
    sp.seed = seed;
    REQUIRE(dz_session_set_sampler(s.s, &sp) == DZ_OK);
    s.append(ref.prompt);
    std::vector<int32_t> out(8);
    for (auto& t : out) REQUIRE(dz_generate_step(&s.s, 1, &t) == DZ_OK);
    return out;
  };
  const auto s1 = run(1.0f, 0, 1), s1b = run(1.0f, 0, 1), s2 = run(1.0f, 0, 2);
  CHECK(s1 == s1b);
  CHECK(s1 != s2);
  CHECK(run(1.0f, 1, 3) == head(ref.greedy, 8));
  CHECK(run(0.0f, 0, 3) == head(ref.greedy, 8));
}

TEST_CASE("session API argument errors", "[api][gpt_oss]") {
  Arena arena;
  Session s(arena);
  const int32_t V = n_vocab();
  const int32_t ok[2] = {3, 4}, bad[2] = {3, V};
  const int32_t neg = -1;
  CHECK(dz_session_append(nullptr, ok, 2, DZ_LOGITS_LAST) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_append(s.s, nullptr, 2, DZ_LOGITS_LAST) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_append(s.s, ok, 0, DZ_LOGITS_LAST) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_append(s.s, ok, 2, dz_logits_mode(7)) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_append(s.s, bad, 2, DZ_LOGITS_LAST) == DZ_ERR_INVALID_ARGUMENT);
  CHECK_THAT(std::string(dz_last_error()), Catch::Contains("tokens[1]"));
  CHECK(dz_session_append(s.s, &neg, 1, DZ_LOGITS_LAST) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(s.length() == 0);
  const float* lp;
  size_t rows, nv;
  int32_t tok;
  CHECK(dz_session_logits(s.s, &lp, &rows, &nv) == DZ_ERR_INVALID_ARGUMENT);  // nothing appended yet
  CHECK(dz_session_sample(s.s, &tok) == DZ_ERR_INVALID_ARGUMENT);
  s.append({3, 4});
  CHECK(dz_session_logits(s.s, nullptr, &rows, &nv) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_sample(s.s, nullptr) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_sample(s.s, &tok) == DZ_OK);

  dz_sampler_params sp;
  dz_sampler_params_init(&sp);
  sp.top_p = 0;
  CHECK(dz_session_set_sampler(s.s, &sp) == DZ_ERR_INVALID_ARGUMENT);
  sp.top_p = 1;
  sp.top_k = -2;
  CHECK(dz_session_set_sampler(s.s, &sp) == DZ_ERR_INVALID_ARGUMENT);
  sp.top_k = 0;
  sp.temperature = NAN;
  CHECK(dz_session_set_sampler(s.s, &sp) == DZ_ERR_INVALID_ARGUMENT);
  sp.temperature = 0;
  sp.struct_size = 4;
  CHECK(dz_session_set_sampler(s.s, &sp) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_set_sampler(s.s, nullptr) == DZ_ERR_INVALID_ARGUMENT);

  // Batches: NULLs, duplicates, mixed arenas, bad tokens; nothing changes on error.
  int32_t outs[2];
  dz_session* dup[2] = {s.s, s.s};
  CHECK(dz_generate_step(nullptr, 1, outs) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_generate_step(&s.s, 0, outs) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_generate_step(&s.s, 1, nullptr) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_generate_step(dup, 2, outs) == DZ_ERR_INVALID_ARGUMENT);
  Arena other;
  Session o(other);
  o.append({5});
  dz_session* mixed[2] = {s.s, o.s};
  CHECK(dz_generate_step(mixed, 2, outs) == DZ_ERR_INVALID_ARGUMENT);
  CHECK_THAT(std::string(dz_last_error()), Catch::Contains("different KV arena"));
  CHECK(dz_decode_batch(&s.s, &V, 1) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_decode_batch(&s.s, nullptr, 1) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(s.length() == 2);
  CHECK(dz_session_truncate(nullptr, 0) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_truncate(s.s, 3) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_session_length(s.s, nullptr) == DZ_ERR_INVALID_ARGUMENT);
  dz_session* forked = s.s;
  CHECK(dz_session_fork(nullptr, &forked) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(forked == nullptr);
  CHECK(dz_session_fork(s.s, nullptr) == DZ_ERR_INVALID_ARGUMENT);
  dz_session_stats st;
  dz_session_stats_init(&st);
  st.struct_size = 1;
  CHECK(dz_session_get_stats(s.s, &st) == DZ_ERR_INVALID_ARGUMENT);

  // Arena and session creation.
  dz_kv_arena* a = nullptr;
  dz_kv_arena_params ap;
  dz_kv_arena_params_init(&ap);
  CHECK(dz_kv_arena_create(nullptr, &ap, &a) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_kv_arena_create(shared_model().m, &ap, nullptr) == DZ_ERR_INVALID_ARGUMENT);
  ap.capacity_bytes = 100;  // less than one page
  CHECK(dz_kv_arena_create(shared_model().m, &ap, &a) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(a == nullptr);
  ap.capacity_bytes = 0;
  ap.struct_size = 3;
  CHECK(dz_kv_arena_create(shared_model().m, &ap, &a) == DZ_ERR_INVALID_ARGUMENT);
  dz_session* ns = nullptr;
  CHECK(dz_session_create(nullptr, nullptr, &ns) == DZ_ERR_INVALID_ARGUMENT);
  dz_session_params sess;
  dz_session_params_init(&sess);
  sess.sampler.top_p = 2;
  CHECK(dz_session_create(arena.a, &sess, &ns) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(ns == nullptr);
  CHECK(dz_kv_arena_get_stats(nullptr, nullptr) == DZ_ERR_INVALID_ARGUMENT);
  dz_session_free(nullptr);
  dz_kv_arena_free(nullptr);
}

namespace {

// What a program built against an older (or newer) declaration of T passes: the
// first `cut` bytes are its struct, the rest of the buffer guard bytes of 0xAB.
template <typename T>
struct CutStruct {
  static constexpr unsigned char kGuard = 0xAB;
  alignas(T) unsigned char bytes[sizeof(T) + 64];
  size_t cut;
  explicit CutStruct(size_t n) : cut(n) {
    REQUIRE(n <= sizeof bytes);
    std::memset(bytes, kGuard, sizeof bytes);
  }
  T* p() { return reinterpret_cast<T*>(bytes); }
  size_t struct_size() const {
    size_t n;
    std::memcpy(&n, bytes, sizeof n);
    return n;
  }
  std::vector<unsigned char> range(size_t from, size_t to) const { return {bytes + from, bytes + to}; }
  // The bytes from `from` to the end of the buffer, and what they must still be.
  std::vector<unsigned char> guard(size_t from) const { return range(from, sizeof bytes); }
  std::vector<unsigned char> untouched(size_t from) const {
    return std::vector<unsigned char>(sizeof bytes - from, kGuard);
  }
};

template <typename T>
std::vector<unsigned char> bytes_of(const T& t, size_t from, size_t to) {
  const auto* b = reinterpret_cast<const unsigned char*>(&t);
  return {b + from, b + to};
}

// A getter on a struct cut at `cut` bytes (init_sized first): struct_size the
// cut, nothing past it written, and the fields inside it as in `full`.
template <typename T, typename Init, typename Get>
void check_cut_getter(const T& full, size_t cut, Init init_sized, Get get) {
  CutStruct<T> c(cut);
  init_sized(c.p(), c.cut);
  REQUIRE(get(c.p()) == DZ_OK);
  CHECK(c.struct_size() == c.cut);
  CHECK(c.guard(c.cut) == c.untouched(c.cut));
  CHECK(c.range(sizeof(size_t), c.cut) == bytes_of(full, sizeof(size_t), c.cut));
}

// init_sized on a struct cut at `cut` bytes: nothing past it written, struct_size
// the cut (or sizeof(T) when longer), and every byte inside the full init's.
template <typename T>
void check_sized_init(void (*init_sized)(T*, size_t), void (*init)(T*), size_t cut) {
  INFO("a struct of " << sizeof(T) << " bytes, cut at " << cut);
  T full;
  std::memset(&full, 0xCD, sizeof full);
  init(&full);
  REQUIRE(full.struct_size == sizeof(T));
  CutStruct<T> c(cut);
  init_sized(c.p(), cut);
  const size_t n = std::min(cut, sizeof(T));
  CHECK(c.struct_size() == n);
  CHECK(c.guard(n) == c.untouched(n));
  CHECK(c.range(sizeof(size_t), n) == bytes_of(full, sizeof(size_t), n));
  // Too small to hold struct_size: nothing written at all. NULL: ignored.
  for (size_t tiny : {size_t(0), size_t(1), sizeof(size_t) - 1}) {
    CutStruct<T> t(tiny);
    init_sized(t.p(), tiny);
    CHECK(t.guard(0) == t.untouched(0));
  }
  init_sized(nullptr, sizeof(T));
  init(nullptr);
}

}  // namespace

TEST_CASE("sized *_init writes only the caller's struct_size bytes", "[api][gpt_oss]") {
  // The unsized functions (the macros' names in parentheses) give the full defaults.
  check_sized_init(dz_model_params_init_sized, dz_model_params_init, offsetof(dz_model_params, activations));
  check_sized_init(dz_model_params_init_sized, dz_model_params_init, sizeof(dz_model_params));
  check_sized_init(dz_model_params_init_sized, dz_model_params_init, sizeof(dz_model_params) + 24);
  check_sized_init(dz_model_params_init_sized, dz_model_params_init, offsetof(dz_model_params, bf16_sensitive) + 2);
  check_sized_init(dz_model_params_init_sized, dz_model_params_init, offsetof(dz_model_params, pass_tokens));
  check_sized_init(dz_model_info_init_sized, dz_model_info_init, offsetof(dz_model_info, n_params));
  check_sized_init(dz_kv_arena_params_init_sized, dz_kv_arena_params_init, offsetof(dz_kv_arena_params, max_sessions));
  check_sized_init(dz_kv_stats_init_sized, dz_kv_stats_init, offsetof(dz_kv_stats, pages_free));
  check_sized_init(dz_sampler_params_init_sized, dz_sampler_params_init, offsetof(dz_sampler_params, seed));
  check_sized_init(dz_session_params_init_sized, dz_session_params_init, offsetof(dz_session_params, abort));
  check_sized_init(dz_session_stats_init_sized, dz_session_stats_init, offsetof(dz_session_stats, pages));

  // The defaults themselves, through the macro (sizeof *(p)).
  dz_model_params mp;
  std::memset(&mp, 0xCD, sizeof mp);
  dz_model_params_init(&mp);
  CHECK(mp.struct_size == sizeof mp);
  CHECK(mp.device == DZ_DEVICE_CPU);
  CHECK(mp.n_threads == 0);
  CHECK(mp.bf16_sensitive == 1);
  CHECK(mp.progress == nullptr);
  CHECK(mp.exact_moe_layers == 0);
  CHECK(mp.attention == DZ_ATTENTION_AUTO);
  CHECK(mp.pass_tokens == 0);
  dz_session_params sp;
  std::memset(&sp, 0xCD, sizeof sp);
  dz_session_params_init(&sp);
  CHECK(sp.struct_size == sizeof sp);
  CHECK(sp.sampler.struct_size == sizeof sp.sampler);
  CHECK(sp.sampler.top_p == 1.0f);
  CHECK(sp.sampler.seed == 0);
  CHECK(sp.abort == nullptr);

  // A dz_session_params ending inside its sampler: the nested struct_size counts
  // the sampler's bytes that are there.
  {
    const size_t at = offsetof(dz_session_params, sampler), cut = at + offsetof(dz_sampler_params, top_p);
    CutStruct<dz_session_params> c(cut);
    dz_session_params_init_sized(c.p(), cut);
    CHECK(c.struct_size() == cut);
    CHECK(c.guard(cut) == c.untouched(cut));
    size_t nested;
    std::memcpy(&nested, c.bytes + at, sizeof nested);
    CHECK(nested == offsetof(dz_sampler_params, top_p));
    CHECK(c.range(at + sizeof(size_t), cut) == bytes_of(sp, at + sizeof(size_t), cut));
  }
}

TEST_CASE("an older program's shorter structs work with the library", "[api][gpt_oss]") {
  // dz_model_params as it was before `activations`: the model opens with the
  // defaults for the fields past its end (0xAB there would be refused).
  {
    CutStruct<dz_model_params> c(offsetof(dz_model_params, activations));
    dz_model_params_init_sized(c.p(), c.cut);
    c.p()->n_threads = 2;
    dz_model* raw = nullptr;
    const dz_status st = dz_model_open(kModelDir.c_str(), c.p(), &raw);
    INFO(dz_last_error());
    REQUIRE(st == DZ_OK);
    std::unique_ptr<dz_model, void (*)(dz_model*)> m(raw, dz_model_free);
    CHECK(c.guard(c.cut) == c.untouched(c.cut));
    CHECK(m->params.struct_size == sizeof(dz_model_params));
    CHECK(m->params.n_threads == 2);
    CHECK(m->params.device == DZ_DEVICE_CPU);
    CHECK(m->params.bf16_sensitive == 1);
    CHECK(m->params.activations == DZ_ACTIVATIONS_AUTO);
    CHECK(m->params.exact_moe_layers == 0);
    CHECK(m->params.attention == DZ_ATTENTION_AUTO);
    CHECK(m->params.pass_tokens == 0);
    // It computes what the shared model (full params, also 2 threads) computes.
    Arena shared_arena;
    dz_kv_arena* ka = nullptr;
    dz_kv_arena_params ap;
    dz_kv_arena_params_init(&ap);
    ap.capacity_bytes = uint64_t(4) << 20;
    REQUIRE(dz_kv_arena_create(m.get(), &ap, &ka) == DZ_OK);
    std::unique_ptr<dz_kv_arena, void (*)(dz_kv_arena*)> arena(ka, dz_kv_arena_free);
    {
      dz_session* raw_s = nullptr;
      REQUIRE(dz_session_create(ka, nullptr, &raw_s) == DZ_OK);
      Session mine(raw_s), theirs(shared_arena);
      mine.append({3, 4, 5});
      theirs.append({3, 4, 5});
      CHECK(mine.last_row() == theirs.last_row());
    }
  }

  Arena arena;
  Session s(arena);
  s.append({3, 4, 5});

  // Output structs: get_info / get_stats fill the short struct and stop at its end.
  {
    dz_model_info full;
    dz_model_info_init(&full);
    REQUIRE(dz_model_get_info(shared_model().m, &full) == DZ_OK);
    check_cut_getter(full, offsetof(dz_model_info, n_params), dz_model_info_init_sized,
                     [](dz_model_info* p) { return dz_model_get_info(shared_model().m, p); });
  }
  {
    dz_kv_stats full;
    dz_kv_stats_init(&full);
    REQUIRE(dz_kv_arena_get_stats(arena.a, &full) == DZ_OK);
    CHECK(full.pages_used > 0);
    check_cut_getter(full, offsetof(dz_kv_stats, pages_free), dz_kv_stats_init_sized,
                     [&](dz_kv_stats* p) { return dz_kv_arena_get_stats(arena.a, p); });
  }
  {
    const dz_session_stats full = s.stats();
    CHECK(full.n_tokens == 3);
    check_cut_getter(full, offsetof(dz_session_stats, pages), dz_session_stats_init_sized,
                     [&](dz_session_stats* p) { return dz_session_get_stats(s.s, p); });
  }

  // dz_session_params: the first ABI's struct ends at abort_user, so a shorter
  // one is refused (and nothing past it is read or written); a newer program's
  // longer one gets the library's part filled and works.
  {
    CutStruct<dz_session_params> c(offsetof(dz_session_params, abort));
    dz_session_params_init_sized(c.p(), c.cut);
    dz_session* ns = reinterpret_cast<dz_session*>(0x1);
    CHECK(dz_session_create(arena.a, c.p(), &ns) == DZ_ERR_INVALID_ARGUMENT);
    CHECK(ns == nullptr);
    CHECK_THAT(std::string(dz_last_error()), Catch::Contains("struct_size"));
    CHECK(c.guard(c.cut) == c.untouched(c.cut));
  }
  {
    CutStruct<dz_session_params> c(sizeof(dz_session_params) + 16);
    dz_session_params_init_sized(c.p(), c.cut);
    CHECK(c.struct_size() == sizeof(dz_session_params));
    CHECK(c.guard(sizeof(dz_session_params)) == c.untouched(sizeof(dz_session_params)));
    c.p()->prefill_chunk = 2;
    dz_session* ns = nullptr;
    REQUIRE(dz_session_create(arena.a, c.p(), &ns) == DZ_OK);
    Session longer(ns);
    CHECK(ns->params.prefill_chunk == 2);
    CHECK(ns->params.sampler.struct_size == sizeof(dz_sampler_params));
    CHECK(ns->params.sampler.top_p == 1.0f);
    longer.append({3, 4, 5});
    CHECK(longer.last_row() == s.last_row());  // chunking changes no bit
  }
}

TEST_CASE("gpt_oss open errors: wrong shapes, CUDA request", "[gpt_oss]") {
  // A copy of the fixture with one tensor's shape wrong in its shard header.
  const fs::path dir = temp_dir("gptoss-shape");
  for (const auto& e : fs::directory_iterator(kModelDir)) fs::copy_file(e.path(), dir / e.path().filename());
  std::ifstream cf(dir / "config.json");
  auto cfg = nlohmann::json::parse(cf);
  cf.close();
  cfg["intermediate_size"] = 64;  // experts in the shards are 96 wide
  std::ofstream(dir / "config.json") << cfg.dump();
  dz_model* m = nullptr;
  CHECK(dz_model_open(dir.string().c_str(), nullptr, &m) == DZ_ERR_FORMAT);
  CHECK_THAT(std::string(dz_last_error()), Catch::Contains("gate_up_proj") && Catch::Contains("expected shape"));
  fs::remove_all(dir);

  dz_model_params p;
  dz_model_params_init(&p);
  p.device = DZ_DEVICE_CUDA;
  const dz_status st = dz_model_open(kModelDir.c_str(), &p, &m);
  if (st == DZ_OK) {  // a GPU is present: the CUDA tests cover it
    dz_model_free(m);
    return;
  }
  CHECK((st == DZ_ERR_DEVICE || st == DZ_ERR_UNSUPPORTED));  // no GPU / no CUDA in this build
  CHECK_THAT(std::string(dz_last_error()), Catch::Contains("no CUDA"));
  CHECK(m == nullptr);
}

TEST_CASE("dz logits and dz generate on the fixture", "[gpt_oss][cli]") {
  const Reference& ref = references()[0];
  std::string ids;
  for (size_t i = 0; i < ref.prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(ref.prompt[i]);
  const fs::path dir = temp_dir("gptoss-cli");
  const std::string npy = (dir / "l.npy").string();
  const std::string tool = DZ_TOOL;
  auto [rc, out] =
      run_cmd(tool + " logits --model " + kModelDir + " --tokens " + ids + " --out " + npy + " --threads 2");
  INFO(out);
  REQUIRE(rc == 0);
  std::ifstream f(npy, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  REQUIRE(all.size() > 10);
  CHECK(all.compare(0, 6, "\x93NUMPY") == 0);
  const size_t hlen = size_t(uint8_t(all[8])) | size_t(uint8_t(all[9])) << 8;
  CHECK((10 + hlen) % 64 == 0);
  CHECK_THAT(all.substr(10, hlen),
             Catch::Contains("'descr': '<f4'") &&
                 Catch::Contains("(" + std::to_string(ref.prompt.size()) + ", " + std::to_string(n_vocab()) + ")"));
  std::vector<float> got((all.size() - 10 - hlen) / 4);
  REQUIRE(got.size() == ref.logits.size());
  std::memcpy(got.data(), all.data() + 10 + hlen, got.size() * 4);
  double mx = 0;
  for (float v : ref.logits) mx = std::max(mx, std::fabs(double(v)));
  CHECK(max_abs_diff(got, ref.logits) <= 1e-3 * mx);

  auto [grc, gout] = run_cmd(tool + " generate --model " + kModelDir + " --tokens " + ids + " --max-new 12 --greedy");
  INFO(gout);
  REQUIRE(grc == 0);
  std::string want;
  for (size_t i = 0; i < ref.greedy.size(); ++i) want += (i ? "," : "") + std::to_string(ref.greedy[i]);
  CHECK_THAT(gout, Catch::Contains(want + "\n") && Catch::Contains("tokens/s"));

  auto [crc, cout] = run_cmd(tool + " logits --model " + kModelDir + " --tokens 1,2 --out " + npy + " --device cuda");
  if (crc != 0) {  // without a GPU: a clear message, no crash
    CHECK(crc == 1);
    CHECK_THAT(cout, Catch::Contains("no CUDA"));
  }
  CHECK(run_cmd(tool + " generate --model " + kModelDir + " --tokens 1,x --max-new 2").first == 2);
  CHECK(run_cmd(tool + " generate --model " + kModelDir + " --tokens 1 --max-new 2 --top-p 3").first == 2);
  CHECK(run_cmd(tool + " logits --model " + kModelDir + " --tokens 1,2").first == 2);
  fs::remove_all(dir);
}
