// dz: the dayzero command-line tool.
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "commands.h"
#include "dayzero.h"

namespace dz::cli {

bool has_flag(const Args& a, const std::string& flag) {
  for (const auto& s : a)
    if (s == flag) return true;
  return false;
}

std::string flag_value(const Args& a, const std::string& flag, const std::string& fallback) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == flag && i + 1 < a.size()) return a[i + 1];
    if (a[i].rfind(flag + "=", 0) == 0) return a[i].substr(flag.size() + 1);
  }
  return fallback;
}

void reject_unknown(const Args& a, const std::vector<std::string>& known, const char* cmd) {
  for (const auto& s : a) {
    if (s.rfind("--", 0) != 0) continue;
    const std::string name = s.substr(0, s.find('='));
    bool ok = false;
    for (const auto& k : known) ok |= (k == name);
    if (!ok) {
      std::fprintf(stderr, "dz %s: unknown option '%s' (see dz %s --help)\n", cmd, name.c_str(), cmd);
      std::exit(2);
    }
  }
}

}  // namespace dz::cli

namespace {
struct Command {
  const char* name;
  int (*run)(const dz::cli::Args&);
  const char* summary;
};
const Command kCommands[] = {
    {"info", dz::cli::cmd_info, "describe and validate a model directory"},
    {"bench", dz::cli::cmd_bench, "benchmarks with JSON results (dz bench --help)"},
    {"logits", dz::cli::cmd_logits, "save a model's logits for token ids as .npy"},
    {"generate", dz::cli::cmd_generate, "generate token ids from a prompt of ids"},
    {"tokenize", dz::cli::cmd_tokenize, "text (or a chat as JSON) on stdin -> token ids"},
    {"detokenize", dz::cli::cmd_detokenize, "token ids on stdin -> text"},
    {"chat", dz::cli::cmd_chat, "interactive chat with streamed output (or one-shot --prompt)"},
    {"indexer-fp8", dz::cli::cmd_indexer_fp8, "FP8 vs exact DSA indexer of a DeepSeek-V3.2 model on a text"},
};

void usage(FILE* f) {
  std::fprintf(f, "dz %s - serve new LLM architectures on day zero\n\nusage: dz <command> [options]\n\ncommands:\n",
               dz_version());
  for (const auto& c : kCommands) std::fprintf(f, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(f, "\n'dz <command> --help' describes a command's options.\n");
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("dz %s (ABI %d)\n", dz_version(), dz_abi_version());
    return 0;
  }
  dz::cli::Args args(argv + 2, argv + argc);
  for (const auto& c : kCommands) {
    if (std::strcmp(argv[1], c.name)) continue;
    // Commands report their own errors; what escapes them (a number option
    // that std::stoi cannot read, an unexpected failure) still ends with a
    // message and a status, not std::terminate.
    try {
      return c.run(args);
    } catch (const std::invalid_argument&) {
      std::fprintf(stderr, "dz %s: an option that takes a number got something else (see dz %s --help)\n", c.name,
                   c.name);
      return 2;
    } catch (const std::out_of_range&) {
      std::fprintf(stderr, "dz %s: a number option is out of range (see dz %s --help)\n", c.name, c.name);
      return 2;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dz %s: %s\n", c.name, e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "dz: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
