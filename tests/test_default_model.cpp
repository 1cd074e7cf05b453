// The default model of `dz chat` (models/dayzero-tiny, trained by tools/train/train_dsv32.py: MLA, DSA
// indexer with index_topk 64, MoE with MXFP4 routed experts) against transformers
// (tests/data/dayzero_tiny/reference.safetensors: float32 CPU, eager attention, the dequantised weights of
// the committed files), through the public C API; and `dz chat --prompt` answering with it by default.
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dayzero.h"
#include "loader/safetensors.h"
#include "support/run_cmd.h"

namespace {

const std::string kModel = std::string(DZ_SOURCE_DIR) + "/models/dayzero-tiny";
const std::string kRef = std::string(DZ_TEST_DATA) + "/dayzero_tiny/reference.safetensors";

std::vector<int32_t> ints(const dz::TensorView& t) {
  REQUIRE(t.dtype == dz::DType::I64);
  std::vector<int32_t> v(static_cast<size_t>(t.numel()));
  for (size_t k = 0; k < v.size(); ++k) {
    int64_t x;
    std::memcpy(&x, t.data + 8 * k, 8);
    v[k] = int32_t(x);
  }
  return v;
}

std::vector<float> floats(const dz::TensorView& t) {
  REQUIRE(t.dtype == dz::DType::F32);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

double cosine(const float* a, const float* b, size_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < n; ++i) ab += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return ab / std::sqrt(aa * bb);
}

// "1,2,3\n" -> ids.
bool parse_ids(const std::string& line, std::vector<int32_t>* out) {
  out->clear();
  size_t i = 0;
  while (i < line.size() && line[i] != '\n') {
    size_t j = i;
    while (j < line.size() && line[j] >= '0' && line[j] <= '9') ++j;
    if (j == i) return false;
    out->push_back(int32_t(std::stol(line.substr(i, j - i))));
    i = j < line.size() && line[j] == ',' ? j + 1 : j;
  }
  return !out->empty();
}

struct Open {
  dz_model* m = nullptr;
  dz_kv_arena* arena = nullptr;
  Open() {
    dz_model_params p;
    dz_model_params_init(&p);
    p.n_threads = 2;
    p.indexer = DZ_INDEXER_EXACT;
    INFO(dz_last_error());
    REQUIRE(dz_model_open(kModel.c_str(), &p, &m) == DZ_OK);
    INFO(dz_last_error());
    REQUIRE(dz_kv_arena_create(m, nullptr, &arena) == DZ_OK);
  }
  ~Open() {
    dz_kv_arena_free(arena);
    dz_model_free(m);
  }
};

}  // namespace

TEST_CASE("default model (dayzero-tiny) matches transformers: logits and greedy continuation", "[deepseek]") {
  dz::SafetensorsFile f(kRef);
  const auto& ts = f.tensors();
  Open o;
  int n_prompts = 0;
  for (int i = 0; ts.count("prompt." + std::to_string(i)); ++i, ++n_prompts) {
    const std::string s = std::to_string(i);
    const std::vector<int32_t> prompt = ints(ts.at("prompt." + s)), greedy = ints(ts.at("greedy." + s));
    const std::vector<float> ref = floats(ts.at("logits." + s));
    const size_t T = prompt.size(), V = ref.size() / T;
    dz_session* sess = nullptr;
    REQUIRE(dz_session_create(o.arena, nullptr, &sess) == DZ_OK);
    INFO(dz_last_error());
    REQUIRE(dz_session_append(sess, prompt.data(), T, DZ_LOGITS_ALL) == DZ_OK);
    const float* lg = nullptr;
    size_t rows = 0, nv = 0;
    REQUIRE(dz_session_logits(sess, &lg, &rows, &nv) == DZ_OK);
    REQUIRE(rows == T);
    REQUIRE(nv == V);
    double worst = 1;
    for (size_t t = 0; t < T; ++t) worst = std::min(worst, cosine(lg + t * V, ref.data() + t * V, V));
    INFO("prompt " << i << " (T=" << T << "): worst per-position logits cosine " << worst);
    CHECK(worst >= 0.99999);
    // Greedy continuation through the session's cache, one token at a time.
    std::vector<int32_t> got;
    for (size_t step = 0; step < greedy.size(); ++step) {
      REQUIRE(dz_session_logits(sess, &lg, &rows, &nv) == DZ_OK);
      const float* last = lg + (rows - 1) * nv;
      const int32_t t = int32_t(std::max_element(last, last + nv) - last);
      got.push_back(t);
      REQUIRE(dz_session_append(sess, &t, 1, DZ_LOGITS_LAST) == DZ_OK);
    }
    CHECK(got == greedy);
    dz_session_free(sess);
  }
  CHECK(n_prompts == 2);
}

TEST_CASE("dz chat --prompt answers with the default model", "[deepseek]") {
  // Reference prompt 0 is the chat template rendered for this user message; its greedy continuation,
  // detokenized, is the start of the reply `dz chat` must print (greedy is its default).
  dz::SafetensorsFile f(kRef);
  const std::vector<int32_t> greedy = ints(f.tensors().at("greedy.0"));
  Open o;
  const dz_tokenizer* tok = nullptr;
  REQUIRE(dz_model_tokenizer(o.m, &tok) == DZ_OK);
  std::vector<char> buf(4096);
  size_t n = 0;
  REQUIRE(dz_detokenize(tok, greedy.data(), greedy.size(), buf.data(), buf.size(), &n) == DZ_OK);
  const std::string expected(buf.data(), n);
  REQUIRE(!expected.empty());

  // From the source folder, without DZ_MODEL: the default model path must resolve on its own.
  const std::string cmd = "cd '" + std::string(DZ_SOURCE_DIR) + "' && env -u DZ_MODEL '" + DZ_TOOL +
                          "' chat --prompt 'Tell me a fortune.' --max-new " + std::to_string(greedy.size()) +
                          " --no-color 2>/dev/null";
  const auto [rc, out] = dz::test::run_cmd(cmd, false);
  INFO("output: " << out);
  CHECK(rc == 0);
  CHECK(out.rfind(expected, 0) == 0);
}

TEST_CASE("dz chat --ctx bounds the conversation's tokens", "[deepseek][cli]") {
  // Reference prompt 0 is the chat template rendered for 'Tell me a fortune.': P tokens; its greedy reply
  // runs past 5 tokens without a stop token.
  dz::SafetensorsFile f(kRef);
  const std::vector<int32_t> prompt = ints(f.tensors().at("prompt.0")), greedy = ints(f.tensors().at("greedy.0"));
  REQUIRE(greedy.size() > 5);
  const long P = long(prompt.size());
  const std::string cd = "cd '" + std::string(DZ_SOURCE_DIR) + "' && ",
                    chat = "env -u DZ_MODEL '" + std::string(DZ_TOOL) + "' chat --no-color ",
                    base = cd + chat + "--prompt 'Tell me a fortune.' --max-new 100 --ctx ";
  // Room for 5 reply tokens: the reply stops there and says why.
  const auto [rc, out] = dz::test::run_cmd(base + std::to_string(P + 5));
  INFO("output: " << out);
  CHECK(rc == 0);
  CHECK(out.find("5 tok in") != std::string::npos);
  CHECK(out.find(", hit --ctx | context " + std::to_string(P + 5) + " tok") != std::string::npos);
  // No room for a reply: a clear error, no crash.
  const auto [rc_full, full] = dz::test::run_cmd(base + std::to_string(P));
  INFO("output: " << full);
  CHECK(rc_full == 1);
  CHECK(full.find("fills --ctx " + std::to_string(P)) != std::string::npos);
  CHECK(dz::test::run_cmd(base + "-1").first == 2);
  // Interactive: the turn that would fill it is refused, the conversation carries on with the next one.
  const auto [rc_i, inter] = dz::test::run_cmd(cd + "printf 'Tell me a fortune.\\nHi\\n' | " + chat +
                                               "--max-new 4 --ctx " + std::to_string(P));
  INFO("output: " << inter);
  CHECK(rc_i == 0);
  CHECK(inter.find("fills --ctx") != std::string::npos);
  CHECK(inter.find("4 tok in") != std::string::npos);
}

TEST_CASE("dz generate opens the default model and stops after a stop token", "[deepseek][cli]") {
  dz::SafetensorsFile f(kRef);
  const std::vector<int32_t> prompt = ints(f.tensors().at("prompt.0"));
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(prompt[i]);
  const std::string base = "cd '" + std::string(DZ_SOURCE_DIR) + "' && env -u DZ_MODEL '" + DZ_TOOL +
                           "' generate --threads 2 --tokens " + ids + " --max-new 96";
  const auto [rc_all, all] = dz::test::run_cmd(base + " --ignore-stop 2>/dev/null", false);
  const auto [rc, stopped] = dz::test::run_cmd(base + " 2>/dev/null", false);
  REQUIRE(rc_all == 0);
  REQUIRE(rc == 0);
  std::vector<int32_t> a, s;
  REQUIRE(parse_ids(all, &a));
  REQUIRE(parse_ids(stopped, &s));
  REQUIRE(a.size() == 96);
  Open o;
  const dz_tokenizer* tok = nullptr;
  REQUIRE(dz_model_tokenizer(o.m, &tok) == DZ_OK);
  const int32_t* stop = nullptr;
  size_t n_stop = 0;
  REQUIRE(dz_tokenizer_stop_ids(tok, &stop, &n_stop) == DZ_OK);
  REQUIRE(n_stop > 0);
  // The stopped run is the full run cut right after its first stop token.
  size_t cut = a.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (std::find(stop, stop + n_stop, a[i]) != stop + n_stop) {
      cut = i + 1;
      break;
    }
  INFO("full: " << all << "stopped: " << stopped);
  CHECK(cut < a.size());  // this prompt's greedy reply ends within 96 tokens
  CHECK(s == std::vector<int32_t>(a.begin(), a.begin() + std::ptrdiff_t(cut)));
}
