// dz tokenize / dz detokenize: the tokenizer of a model directory (or a
// tokenizer file) on stdin/stdout, for scripts and for checking a new model's
// tokenizer by hand.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <sstream>

#include "commands.h"
#include "common/error.h"
#include "tokenizer/tokenizer.h"

namespace dz::cli {

std::unique_ptr<Tokenizer> open_tokenizer_flags(const Args& a, const char* cmd) {
  const std::string model = flag_value(a, "--model"), file = flag_value(a, "--tokenizer");
  if (model.empty() == file.empty()) {
    std::fprintf(stderr, "dz %s: give exactly one of --model DIR or --tokenizer FILE\n", cmd);
    std::exit(2);
  }
  if (!file.empty()) return Tokenizer::open(file);
  auto t = Tokenizer::open_dir(model);
  if (!t) fail(DZ_ERR_NOT_FOUND, model, ": no tokenizer.json or tiktoken.model");
  return t;
}

namespace {
std::string read_stdin() {
  std::ostringstream ss;
  ss << std::cin.rdbuf();
  return ss.str();
}
}  // namespace

int cmd_tokenize(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz tokenize (--model DIR | --tokenizer FILE) [--chat [--add-generation-prompt] [--options JSON]]\n"
        "                   [--no-special]\n\n"
        "Reads text from stdin and prints its token ids, comma-separated.\n"
        "  --model DIR        the model directory's tokenizer.json or tiktoken.model\n"
        "  --tokenizer FILE   a tokenizer.json or tiktoken.model (tokenizer_config.json beside it is read)\n"
        "  --chat             stdin is a JSON list of messages, rendered through the chat template first\n"
        "  --add-generation-prompt  end the rendered prompt with the assistant's turn header\n"
        "  --options JSON     extra template variables, e.g. '{\"reasoning_effort\": \"low\"}'\n"
        "  --print-text       with --chat: print the rendered prompt instead of ids\n"
        "  --no-special       special-token text is plain text (not its id)\n");
    return 0;
  }
  reject_unknown(
      a, {"--model", "--tokenizer", "--chat", "--add-generation-prompt", "--options", "--no-special", "--print-text"},
      "tokenize");
  try {
    auto tok = open_tokenizer_flags(a, "tokenize");
    std::string text = read_stdin();
    if (has_flag(a, "--chat")) {
      text = tok->apply_chat_template(text, flag_value(a, "--options"), has_flag(a, "--add-generation-prompt"));
      if (has_flag(a, "--print-text")) {
        std::fwrite(text.data(), 1, text.size(), stdout);
        return 0;
      }
    }
    const auto ids = tok->encode(text, !has_flag(a, "--no-special"));
    std::string out;
    for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
    std::printf("%s\n", out.c_str());
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dz tokenize: %s\n", e.what());
    return 1;
  }
}

int cmd_detokenize(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz detokenize (--model DIR | --tokenizer FILE)\n\n"
        "Reads comma- or space-separated token ids from stdin and prints their text.\n");
    return 0;
  }
  reject_unknown(a, {"--model", "--tokenizer"}, "detokenize");
  try {
    auto tok = open_tokenizer_flags(a, "detokenize");
    const std::string in = read_stdin();
    std::vector<int32_t> ids;
    size_t i = 0;
    while (i < in.size()) {
      if (in[i] == ',' || std::isspace(uint8_t(in[i]))) {
        ++i;
        continue;
      }
      size_t end = i;
      while (end < in.size() && in[end] != ',' && !std::isspace(uint8_t(in[end]))) ++end;
      const std::string t = in.substr(i, end - i);
      char* stop = nullptr;
      const long long v = std::strtoll(t.c_str(), &stop, 10);
      if (*stop || t.empty() || v < INT32_MIN || v > INT32_MAX)
        fail(DZ_ERR_INVALID_ARGUMENT, "'", t, "' is not a token id");
      ids.push_back(int32_t(v));
      i = end;
    }
    const std::string text = tok->decode(ids);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dz detokenize: %s\n", e.what());
    return 1;
  }
}

}  // namespace dz::cli
