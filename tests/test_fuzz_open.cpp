// Mutated checkpoints of every CPU family (config.json fields set to wrong
// values or removed, safetensors headers with random bytes changed, files cut
// short): dz_model_open must either refuse with a status and a message or
// load a model that then runs (or refuses) a short generation through the C
// API, never crash. Runs under AddressSanitizer/UBSan too ([loader]).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "dayzero.h"

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
  explicit Scratch(const std::string& name)
      : src(fs::path(kData) / name),
        dir(fs::temp_directory_path() / ("dz-fuzz-" + name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(dir);
    fs::create_directories(dir);
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
      for (const auto& f : fields) {
        for (const nlohmann::json& v : bad_values()) {
          nlohmann::json c = base;
          c[f] = v;
          sc.write("config.json", c.dump());
          open_and_run(sc.dir, f.to_string() + " = " + v.dump(), out);
        }
        nlohmann::json c = base;
        nlohmann::json& parent = c[f.parent_pointer()];
        if (parent.is_array())
          parent.erase(size_t(0));
        else
          parent.erase(f.back());
        sc.write("config.json", c.dump());
        open_and_run(sc.dir, "without " + f.to_string(), out);
      }
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
