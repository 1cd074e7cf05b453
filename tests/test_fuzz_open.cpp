// Mutated inputs from untrusted model folders, never a crash:
//  - checkpoints of every CPU family (config.json fields set to wrong values or
//    removed, safetensors headers with random bytes changed, files cut short):
//    dz_model_open refuses with a status and a message, or loads a model that
//    then runs (or refuses) a short generation through the C API;
//  - the default model's tokenizer.json fields and chat template: refused with a
//    message, or encode, decode and render work or say what is wrong.
// Runs under AddressSanitizer/UBSan too ([loader], [tokenizer]).

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "dayzero.h"
#include "support/safetensors_writer.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace {

const std::string kData = DZ_TEST_DATA;

struct Outcome {
  int refused = 0, ran = 0, run_refused = 0;
};

// Opens dir on the CPU; if it loads, appends a few tokens and decodes two.
// Every failure must come with a message.
void open_and_run(const fs::path& dir, const std::string& what, Outcome& out) {
  dz_model_params p;
  dz_model_params_init(&p);
  p.device = DZ_DEVICE_CPU;
  p.n_threads = 1;
  dz_model* m = nullptr;
  if (const char* v = std::getenv("DZ_FUZZ_VERBOSE"); v && std::string(v) == "2")
    std::fprintf(stderr, "try: %s\n", what.c_str());
  const dz_status st = dz_model_open(dir.c_str(), &p, &m);
  INFO(what << ": " << dz_last_error());
  if (st != DZ_OK) {
    CHECK(m == nullptr);
    CHECK(std::strlen(dz_last_error()) > 0);
    ++out.refused;
    return;
  }
  REQUIRE(m != nullptr);
  dz_kv_arena_params ap;
  dz_kv_arena_params_init(&ap);
  ap.capacity_bytes = 8u << 20;
  ap.max_sessions = 2;
  dz_kv_arena* arena = nullptr;
  dz_session* s = nullptr;
  bool ok = dz_kv_arena_create(m, &ap, &arena) == DZ_OK && dz_session_create(arena, nullptr, &s) == DZ_OK;
  const int32_t prompt[] = {3, 5, 7, 11, 13};
  ok = ok && dz_session_append(s, prompt, 5, DZ_LOGITS_LAST) == DZ_OK;
  for (int i = 0; ok && i < 2; ++i) {
    int32_t t = -1;
    ok = dz_generate_step(&s, 1, &t) == DZ_OK;
  }
  if (!ok) CHECK(std::strlen(dz_last_error()) > 0);
  ++(ok ? out.ran : out.run_refused);
  if (std::getenv("DZ_FUZZ_VERBOSE"))  // which mutations a family accepts
    std::fprintf(stderr, "%s: %s\n", ok ? "ran" : "refused to run", what.c_str());
  dz_session_free(s);
  dz_kv_arena_free(arena);
  dz_model_free(m);
}

// A working copy of a fixture: links to every file but the ones a case rewrites.
struct Scratch {
  fs::path src, dir;
  explicit Scratch(const std::string& name) : src(fs::path(kData) / name), dir(dz::test::temp_dir("fuzz-" + name)) {
    for (const auto& e : fs::directory_iterator(src)) fs::create_symlink(e.path(), dir / e.path().filename());
  }
  ~Scratch() { fs::remove_all(dir); }
  void write(const std::string& file, const std::string& bytes) {
    fs::remove(dir / file);
    std::ofstream(dir / file, std::ios::binary) << bytes;
  }
  void restore(const std::string& file) {
    fs::remove(dir / file);
    fs::create_symlink(src / file, dir / file);
  }
  std::string read(const std::string& file) const {
    std::ifstream f(src / file, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  }
};

// Values no config field should take, or that stretch a valid one.
std::vector<nlohmann::json> bad_values() {
  return {0,    -1,  1,       3,   int64_t(1) << 31,        int64_t(1) << 40,         1e300,
          -0.5, 2.5, nullptr, "x", nlohmann::json::array(), nlohmann::json::object(), true};
}

// fn(copy of base with one field set to a bad value, or removed, "what was done") for every field.
void for_each_mutation(const nlohmann::json& base, const std::vector<nlohmann::json::json_pointer>& fields,
                       const std::function<void(const nlohmann::json&, const std::string&)>& fn) {
  for (const auto& f : fields) {
    for (const nlohmann::json& v : bad_values()) {
      nlohmann::json c = base;
      c[f] = v;
      fn(c, f.to_string() + " = " + v.dump());
    }
    nlohmann::json c = base;
    nlohmann::json& parent = c[f.parent_pointer()];
    if (parent.is_array())
      parent.erase(size_t(0));
    else
      parent.erase(f.back());
    fn(c, "without " + f.to_string());
  }
}

}  // namespace

TEST_CASE("fuzz: config.json fields set to wrong values or removed, every family", "[loader][fuzz]") {
  for (const char* name : {"gpt_oss_tiny", "deepseek_v32_bf16", "kimi_linear_bf16"}) {
    SECTION(name) {
      Scratch sc(name);
      const nlohmann::json base = nlohmann::json::parse(sc.read("config.json"));
      Outcome out;
      // Top-level fields and the fields of nested objects, one level down.
      std::vector<nlohmann::json::json_pointer> fields;
      for (auto it = base.begin(); it != base.end(); ++it) {
        if (it.key() == "model_type") continue;  // another family's loader would just say "not served"
        fields.emplace_back("/" + it.key());
        if (it->is_object())
          for (auto jt = it->begin(); jt != it->end(); ++jt) fields.emplace_back("/" + it.key() + "/" + jt.key());
        if (it->is_array() && !it->empty()) fields.emplace_back("/" + it.key() + "/0");
      }
      for_each_mutation(base, fields, [&](const nlohmann::json& c, const std::string& what) {
        sc.write("config.json", c.dump());
        open_and_run(sc.dir, what, out);
      });
      WARN(name << ": " << fields.size() << " config fields mutated: " << out.refused << " refused at open, " << out.ran
                << " loaded and ran, " << out.run_refused << " loaded and refused to run");
      CHECK(out.refused > 0);
    }
  }
}

TEST_CASE("fuzz: safetensors headers with random bytes changed, and files cut short", "[loader][fuzz]") {
  for (const char* name : {"gpt_oss_tiny", "deepseek_v32_fp8", "kimi_linear_bf16"}) {
    SECTION(name) {
      Scratch sc(name);
      std::mt19937_64 rng(std::hash<std::string>{}(name));
      Outcome out;
      for (const char* file :
           {"model-00001-of-00002.safetensors", "model-00001-of-00003.safetensors", "model.safetensors.index.json"}) {
        if (!fs::exists(sc.src / file)) continue;
        const std::string bytes = sc.read(file);
        const bool index = std::string(file).find(".json") != std::string::npos;
        uint64_t hlen = bytes.size();
        if (!index) std::memcpy(&hlen, bytes.data(), 8), hlen += 8;
        // The header (or the index) is where every offset, shape and dtype comes from.
        for (int i = 0; i < 120; ++i) {
          std::string b = bytes;
          const int n = 1 + int(rng() % 3);
          for (int j = 0; j < n; ++j) {
            const size_t at = size_t(rng() % hlen);
            const char* pool = "0123456789,:[]{}\"eE-+. FBIU8_";
            b[at] = (rng() % 2) ? char(rng() % 256) : pool[rng() % std::strlen(pool)];
          }
          sc.write(file, b);
          open_and_run(sc.dir, std::string(file) + " with " + std::to_string(n) + " byte(s) changed", out);
        }
        for (int i = 0; i < 12; ++i) {
          const size_t cut = size_t(rng() % bytes.size());
          sc.write(file, bytes.substr(0, cut));
          open_and_run(sc.dir, std::string(file) + " cut to " + std::to_string(cut) + " bytes", out);
        }
        sc.restore(file);
      }
      WARN(name << ": " << out.refused << " refused at open, " << out.ran << " loaded and ran, " << out.run_refused
                << " loaded and refused to run");
      CHECK(out.refused > 0);
    }
  }
}

TEST_CASE("fuzz: safetensors header entries with wrong dtypes, shapes and data offsets", "[loader][fuzz]") {
  // The header parsed and rewritten (its length prefix too), so every mutation reaches the loader's checks
  // of what the header says rather than its JSON parser.
  for (const char* name : {"gpt_oss_tiny", "deepseek_v32_fp8", "kimi_linear_bf16"}) {
    SECTION(name) {
      Scratch sc(name);
      const std::string file = fs::exists(sc.src / "model-00001-of-00002.safetensors")
                                   ? "model-00001-of-00002.safetensors"
                                   : "model-00001-of-00003.safetensors";
      const std::string bytes = sc.read(file);
      uint64_t hlen = 0;
      std::memcpy(&hlen, bytes.data(), 8);
      const nlohmann::ordered_json header = nlohmann::ordered_json::parse(bytes.substr(8, hlen));
      const std::string data = bytes.substr(8 + hlen);
      const int64_t total = int64_t(data.size());
      auto write = [&](const nlohmann::ordered_json& h) {
        const std::string j = h.dump();
        const uint64_t n = j.size();
        std::string b(8, '\0');
        std::memcpy(b.data(), &n, 8);
        sc.write(file, b + j + data);
      };
      const std::vector<nlohmann::ordered_json> dtypes = {"F64", "I8", "BOOL", "F8_E5M2", "U8", "XYZ", 5, nullptr};
      const std::vector<nlohmann::ordered_json> shapes = {
          nlohmann::ordered_json::array(),      {-1}, {int64_t(1) << 40},          {0},
          {int64_t(1) << 31, int64_t(1) << 31}, "x",  {1, 2, 3, 4, 5, 6, 7, 8, 9}, {2.5}};
      Outcome out;
      int tensors = 0;
      for (auto it = header.begin(); it != header.end() && tensors < 6; ++it) {
        if (it.key() == "__metadata__") continue;
        ++tensors;
        const auto off = it.value()["data_offsets"];
        const int64_t a = off[0].get<int64_t>(), b = off[1].get<int64_t>();
        const std::vector<nlohmann::ordered_json> offsets = {{0, 0},
                                                             {b, a},
                                                             {a, total + 1},
                                                             {-1, b - a - 1},
                                                             {a, a + 1},
                                                             {a, b, b},
                                                             "x",
                                                             nullptr,
                                                             {total + 8, total + 16},
                                                             {int64_t(1) << 62, (int64_t(1) << 62) + (b - a)},
                                                             {0, b - a}};
        auto mutate = [&](const char* field, const std::vector<nlohmann::ordered_json>& values) {
          for (const auto& v : values) {
            nlohmann::ordered_json h = header;
            h[it.key()][field] = v;
            write(h);
            open_and_run(sc.dir, it.key() + "." + field + " = " + v.dump(), out);
          }
          nlohmann::ordered_json h = header;
          h[it.key()].erase(field);
          write(h);
          open_and_run(sc.dir, it.key() + " without " + field, out);
        };
        mutate("dtype", dtypes);
        mutate("shape", shapes);
        mutate("data_offsets", offsets);
      }
      sc.restore(file);
      WARN(name << ": " << tensors << " header entries mutated: " << out.refused << " refused at open, " << out.ran
                << " loaded and ran, " << out.run_refused << " loaded and refused to run");
      CHECK(out.refused > 0);
    }
  }
}

TEST_CASE("fuzz: tokenizer.json fields and chat templates mutated", "[tokenizer][fuzz]") {
  const fs::path src = fs::path(DZ_SOURCE_DIR) / "models" / "dayzero-tiny";
  const fs::path dir = dz::test::temp_dir("fuzz-tok");
  auto read = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  };
  const nlohmann::json tok = nlohmann::json::parse(read(src / "tokenizer.json"));
  const nlohmann::json cfg = nlohmann::json::parse(read(src / "tokenizer_config.json"));
  const std::string text = "Tell me a fortune.\n  Ünïcödé 123 <|eos|> \xff\xfe tabs\t and   spaces";
  const char* messages = R"([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}])";
  int refused = 0, loaded = 0, templates_refused = 0;
  // Loads dir's tokenizer; if it loads, encodes, decodes and renders the chat template.
  auto exercise = [&](const std::string& what) {
    INFO(what);
    std::unique_ptr<dz::Tokenizer> t;
    try {
      t = dz::Tokenizer::open((dir / "tokenizer.json").string());
    } catch (const dz::Error& e) {
      CHECK(std::strlen(e.what()) > 0);
      ++refused;
      return;
    }
    ++loaded;
    try {
      const std::vector<int32_t> ids = t->encode(text);
      (void)t->decode(ids);
    } catch (const dz::Error& e) {
      CHECK(std::strlen(e.what()) > 0);
    }
    try {
      (void)t->apply_chat_template(messages, "{}", true);
    } catch (const dz::Error& e) {
      CHECK(std::strlen(e.what()) > 0);
      ++templates_refused;
    }
  };
  std::ofstream(dir / "tokenizer_config.json") << cfg.dump();
  // Every field of the tokenizer (objects two levels down, the first entries of arrays) set wrong or removed.
  std::vector<nlohmann::json::json_pointer> fields;
  std::function<void(const nlohmann::json&, const nlohmann::json::json_pointer&, int)> walk =
      [&](const nlohmann::json& j, const nlohmann::json::json_pointer& at, int depth) {
        if (depth > 3) return;
        if (j.is_object()) {
          int n = 0;
          for (auto it = j.begin(); it != j.end() && n < 12; ++it, ++n) {
            fields.push_back(at / it.key());
            walk(*it, at / it.key(), depth + 1);
          }
        } else if (j.is_array()) {
          for (size_t i = 0; i < std::min<size_t>(j.size(), 2); ++i) {
            fields.push_back(at / i);
            walk(j[i], at / i, depth + 1);
          }
        }
      };
  walk(tok, nlohmann::json::json_pointer(), 0);
  for_each_mutation(tok, fields, [&](const nlohmann::json& t, const std::string& what) {
    std::ofstream(dir / "tokenizer.json") << t.dump();
    exercise(what);
  });
  // The chat template with pieces cut out, repeated or replaced by template syntax.
  std::ofstream(dir / "tokenizer.json") << tok.dump();
  // Two seeds: the default model's short template and gpt-oss's long one (macros, filters, loops, namespaces).
  const std::string templates[] = {cfg["chat_template"].get<std::string>(),
                                   read(fs::path(DZ_TEST_DATA) / "tokenizer" / "gpt_oss_chat_template.jinja")};
  // DZ_FUZZ_ITERS / DZ_FUZZ_SEED: a longer hunt than CI's 400 mutations.
  const int iters = std::getenv("DZ_FUZZ_ITERS") ? std::atoi(std::getenv("DZ_FUZZ_ITERS")) : 400;
  std::mt19937_64 rng(std::getenv("DZ_FUZZ_SEED") ? std::strtoull(std::getenv("DZ_FUZZ_SEED"), nullptr, 10) : 17);
  // clang-format off
  const char* pieces[] = {"{%", "%}", "{{", "}}", "{#", "(", ")", "[", "]", "|", "'", "\"", " if ", " for ",
                          " endfor ", " endif ", " in ", "messages", "loop.index", "~", "*", "-", "set x = ",
                          "macro m() %}{{ m() }}{% endmacro", "range(999999999)", "x.y.z", "none", "0/0",
                          "9223372036854775807", "**", "//", "%", "1e308", "|int", "|abs", "[::-1]", "[]", "{}", "."};
  // clang-format on
  for (int i = 0; i < iters; ++i) {
    std::string t = templates[i % 2];
    for (int m = 1 + int(rng() % 3); m > 0; --m) {
      const size_t at = size_t(rng() % t.size()), len = size_t(rng() % 8);
      switch (rng() % 3) {
        case 0:
          t.erase(at, len);
          break;
        case 1:
          t.insert(at, t.substr(at, len));
          break;
        default:
          t.insert(at, pieces[rng() % std::size(pieces)]);
          break;
      }
    }
    nlohmann::json c = cfg;
    c["chat_template"] = t;
    // Cut UTF-8 sequences are written as U+FFFD (JSON cannot hold them).
    std::ofstream(dir / "tokenizer_config.json") << c.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    exercise("template " + c["chat_template"].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  WARN("tokenizer: " << fields.size() << " fields mutated and " << iters << " templates: " << refused
                     << " refused at open, " << loaded << " loaded (" << templates_refused
                     << " of them refused to render)");
  CHECK(refused > 0);
  CHECK(templates_refused > 0);
  fs::remove_all(dir);
}
