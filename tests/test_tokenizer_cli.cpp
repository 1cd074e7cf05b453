// dz tokenize / detokenize / chat as a user runs them.
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "support/run_cmd.h"
#include "support/safetensors_writer.h"

namespace fs = std::filesystem;

namespace {

// A tiny tiktoken tokenizer written by the test: bytes a..z, space, and a few merges.
fs::path tiny_tokenizer() {
  auto d = dz::test::temp_dir("tok-cli");
  std::ofstream f(d / "tiktoken.model");
  // base64 of single bytes ' '..'z' (ranks 0..90), then "he"(91) "ll"(92) "hell"(93) "hello"(94)
  const char* b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  auto enc = [&](const std::string& s) {
    std::string o;
    size_t i = 0;
    for (; i + 2 < s.size(); i += 3) {
      const unsigned v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8) | uint8_t(s[i + 2]);
      o += {b64[v >> 18], b64[(v >> 12) & 63], b64[(v >> 6) & 63], b64[v & 63]};
    }
    if (i + 1 == s.size()) {
      const unsigned v = uint8_t(s[i]) << 16;
      o += {b64[v >> 18], b64[(v >> 12) & 63], '=', '='};
    } else if (i + 2 == s.size()) {
      const unsigned v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8);
      o += {b64[v >> 18], b64[(v >> 12) & 63], b64[(v >> 6) & 63], '='};
    }
    return o;
  };
  int r = 0;
  for (int c = ' '; c <= 'z'; ++c) f << enc(std::string(1, char(c))) << ' ' << r++ << '\n';
  for (const char* t : {"he", "ll", "hell", "hello"}) f << enc(t) << ' ' << r++ << '\n';
  f.close();
  std::ofstream(d / "tokenizer_config.json")
      << R"({"added_tokens_decoder": {"95": {"content": "<|end|>", "special": true}},
    "eos_token": "<|end|>",
    "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"})";
  return d;
}
}  // namespace

TEST_CASE("dz tokenize and dz detokenize round-trip through stdin/stdout", "[tokenizer][cli]") {
  const auto d = tiny_tokenizer();
  const std::string dz = DZ_TOOL;
  auto [rc, out] = dz::test::run_cmd("printf 'hello hell<|end|>' | " + dz + " tokenize --model " + d.string());
  INFO(out);
  REQUIRE(rc == 0);
  // "hello" -> 94; " hell" -> ' '(0) + "hell"(93); "<|end|>" -> 95
  CHECK(out == "94,0,93,95\n");
  auto [rc2, out2] = dz::test::run_cmd("printf 'hello hell<|end|>' | " + dz + " tokenize --no-special --tokenizer " +
                                       (d / "tiktoken.model").string());
  CHECK(rc2 == 0);
  CHECK(out2.find(",95") == std::string::npos);  // '<|end|>' as plain characters
  auto [rc3, out3] = dz::test::run_cmd("echo '94, 0 93,95' | " + dz + " detokenize --model " + d.string());
  CHECK(rc3 == 0);
  CHECK(out3 == "hello hell<|end|>");
  auto [rc4, out4] =
      dz::test::run_cmd("echo '[{\"role\":\"user\",\"content\":\"hello\"}]' | " + dz + " tokenize --chat " +
                        "--add-generation-prompt --print-text --model " + d.string());
  CHECK(rc4 == 0);
  CHECK(out4 == "<user>hello<|end|><assistant>");
  // bad input: clear message, non-zero exit
  auto [rc5, out5] = dz::test::run_cmd("echo '1,x' | " + dz + " detokenize --model " + d.string());
  CHECK(rc5 == 1);
  CHECK_THAT(out5, Catch::Contains("'x' is not a token id"));
  auto [rc6, out6] = dz::test::run_cmd("echo '99999' | " + dz + " detokenize --model " + d.string());
  CHECK(rc6 == 1);
  CHECK_THAT(out6, Catch::Contains("outside the vocabulary"));
  auto [rc7, out7] = dz::test::run_cmd("echo hi | " + dz + " tokenize --model /nonexistent");
  CHECK(rc7 == 1);
  auto [rc8, out8] = dz::test::run_cmd(dz + " tokenize");
  CHECK(rc8 == 2);
}

namespace {
// The tiny gpt-oss fixture (vocab 512) with a tokenizer made to fit it: the
// 256 bytes, a few merges, harmony's special tokens at 500.., and the real
// gpt-oss chat template, so `dz chat` runs the whole path on a small model.
fs::path tiny_gpt_oss_with_tokenizer() {
  auto d = dz::test::temp_dir("chat-model");
  const fs::path src = fs::path(DZ_TEST_DATA) / "gpt_oss_tiny";
  for (const auto& e : fs::directory_iterator(src)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("reference", 0) == 0) continue;
    fs::create_symlink(e.path(), d / n);
  }
  const char* b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  auto enc = [&](const std::string& s) {
    std::string o;
    unsigned v = 0;
    int bits = 0;
    for (unsigned char c : s) {
      v = (v << 8) | c;
      bits += 8;
      while (bits >= 6) o += b64[(v >> (bits -= 6)) & 63];
    }
    if (bits) o += b64[(v << (6 - bits)) & 63];
    while (o.size() % 4) o += '=';
    return o;
  };
  std::ofstream f(d / "tiktoken.model");
  for (int b = 0; b < 256; ++b) f << enc(std::string(1, char(b))) << ' ' << b << '\n';
  int r = 256;
  for (const char* t :
       {"he", "ll", "hello", "er", "in",   "th",     " t",        "the",     "an",      "on",       "re",
        "ou", "is", "it",    "at", "user", "system", "assistant", "message", "channel", "analysis", "final"})
    f << enc(t) << ' ' << r++ << '\n';
  f.close();
  std::ofstream(d / "tokenizer_config.json") << R"({"added_tokens_decoder": {
    "500": {"content": "<|return|>"}, "501": {"content": "<|constrain|>"}, "502": {"content": "<|channel|>"},
    "503": {"content": "<|start|>"}, "504": {"content": "<|end|>"}, "505": {"content": "<|message|>"},
    "506": {"content": "<|call|>"}, "507": {"content": "<|endoftext|>"}}, "eos_token": "<|return|>"})";
  fs::copy_file(fs::path(DZ_TEST_DATA) / "tokenizer" / "gpt_oss_chat_template.jinja", d / "chat_template.jinja");
  return d;
}
}  // namespace

TEST_CASE("dz chat --prompt runs one turn on the tiny gpt-oss model and later turns reuse the session",
          "[tokenizer][cli]") {
  const auto d = tiny_gpt_oss_with_tokenizer();
  const std::string dz = DZ_TOOL;
  auto [rc, out] =
      dz::test::run_cmd(dz + " chat --model " + d.string() + " --prompt 'hello there' --max-new 6 --no-color");
  INFO(out);
  if (out.find("not implemented in this build yet") != std::string::npos ||
      out.find("is not served by this build") != std::string::npos) {
    WARN("SKIPPED: gpt-oss sessions are not in this build yet");
    return;
  }
  REQUIRE(rc == 0);
  CHECK_THAT(out, Catch::Contains("tok/s"));
  CHECK_THAT(out, Catch::Contains("prefill"));
  // Greedy decoding is deterministic: the same prompt gives the same reply.
  auto [rc2, out2] =
      dz::test::run_cmd(dz + " chat --model " + d.string() + " --prompt 'hello there' --max-new 6 --no-color");
  CHECK(rc2 == 0);
  auto reply = [](const std::string& s) { return s.substr(0, s.find("[prefill")); };
  CHECK(reply(out) == reply(out2));
  // Two turns from stdin: the second prefills only what the first did not.
  auto [rc3, out3] = dz::test::run_cmd("printf 'hello\\nthe end\\n/reset\\nhello\\n' | " + dz +
                                       " chat --verbose --max-new 4 --model " + d.string() + " --system 'be brief'");
  CHECK(rc3 == 0);
  std::vector<size_t> reused;
  for (size_t p = out3.find(" reused"); p != std::string::npos; p = out3.find(" reused", p + 1)) {
    const size_t colon = out3.rfind(": ", p);
    reused.push_back(std::stoul(out3.substr(colon + 2, p - colon - 2)));
  }
  REQUIRE(reused.size() == 3);
  CHECK(reused[0] == 0);
  CHECK(reused[1] > 20);  // the system prompt and first turn stay in the KV cache
  CHECK(reused[2] == 0);  // after /reset
  auto [rc4, out4] = dz::test::run_cmd(dz + " chat --model " + (d / "nope").string() + " --prompt hi");
  CHECK(rc4 == 1);
  CHECK_THAT(out4, Catch::Contains("dz chat: open model"));
}
