// dz chat: an interactive chat on the public C API (dayzero.h only): chat
// template, tokenizer, one session whose KV cache is reused across turns, and
// streamed output through the detokenizer.
//
// Each turn renders the whole conversation, tokenizes it and compares it with
// the tokens already in the session: only the new suffix is prefilled. When a
// template re-renders an earlier turn differently (gpt-oss drops the analysis
// channel of finished turns), the session is truncated to the common prefix.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "dayzero.h"
#include "model_args.h"

namespace dz::cli {

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

struct ChatError {
  std::string msg;
  bool turn_only = false;  // the turn was refused, the conversation stands (interactive: carry on)
};

void ok(dz_status s, const char* what) {
  if (s != DZ_OK) throw ChatError{std::string(what) + ": " + dz_status_name(s) + ": " + dz_last_error()};
}

std::string render(const dz_tokenizer* tok, const ojson& messages, const std::string& options) {
  const std::string m = messages.dump();
  size_t n = 0;
  dz_status s = dz_chat_apply_template(tok, m.c_str(), options.empty() ? nullptr : options.c_str(), 1, nullptr, 0, &n);
  if (s != DZ_ERR_BUFFER_TOO_SMALL) ok(s, "chat template");
  std::string out(n + 1, '\0');
  ok(dz_chat_apply_template(tok, m.c_str(), options.empty() ? nullptr : options.c_str(), 1, out.data(), out.size(), &n),
     "chat template");
  out.resize(n);
  return out;
}

std::vector<int32_t> tokenize(const dz_tokenizer* tok, const std::string& text) {
  size_t n = 0;
  dz_status s = dz_tokenize(tok, text.data(), text.size(), 1, nullptr, 0, &n);
  if (s != DZ_ERR_BUFFER_TOO_SMALL && s != DZ_OK) ok(s, "tokenize");
  std::vector<int32_t> ids(n);
  ok(dz_tokenize(tok, text.data(), text.size(), 1, ids.data(), ids.size(), &n), "tokenize");
  return ids;
}

// An assistant reply as the template wants it back. Harmony (gpt-oss) replies
// carry channels: the final channel is the content, the analysis the thinking.
ojson assistant_message(const std::string& text) {
  ojson m = {{"role", "assistant"}};
  auto channel = [&](const std::string& name) -> std::pair<bool, std::string> {
    const std::string open = "<|channel|>" + name + "<|message|>";
    const size_t at = text.rfind(open);
    if (at == std::string::npos) return {false, ""};
    size_t end = text.size();
    for (const char* stop : {"<|end|>", "<|return|>", "<|call|>", "<|start|>"})
      end = std::min(end,
                     text.find(stop, at + open.size()) == std::string::npos ? end : text.find(stop, at + open.size()));
    return {true, text.substr(at + open.size(), end - at - open.size())};
  };
  auto [has_final, final_text] = channel("final");
  auto [has_analysis, analysis] = channel("analysis");
  if (has_final || has_analysis) {
    m["content"] = final_text;
    if (has_analysis) m["thinking"] = analysis;
  } else {
    m["content"] = text;
  }
  return m;
}

constexpr int64_t kDefaultCtx = 32768;  // --ctx's largest default (the arena is allocated up front)

struct Options {
  std::string model, system, prompt, device = "cpu", template_options;
  int max_new = 512;
  int64_t ctx = 0;  // KV capacity in tokens; 0: the model's context, at most kDefaultCtx
  dz_sampler_params sampler{};
  bool color = false, verbose = false;
};

void usage() {
  std::printf(
      "usage: dz chat [--model DIR] [--system TEXT] [--prompt TEXT] [--max-new N] [--device cpu|cuda|auto]\n"
      "               [--temperature T] [--top-k K] [--top-p P] [--seed S] [--options JSON] [--no-color]\n"
      "               [--verbose]\n\n"
      "Chat with a model: type a message, the reply streams back. The session's KV cache is kept across turns\n"
      "(only each new turn is prefilled). Commands: /reset (forget the conversation), /exit.\n"
      "  --model DIR        model directory (default: $DZ_MODEL, else %s beside the dz executable)\n"
      "  --system TEXT      system prompt\n"
      "  --prompt TEXT      one-shot: answer this message and exit (no interaction)\n"
      "  --max-new N        most tokens per reply (default 512)\n"
      "  --ctx N            tokens the conversation may hold: the KV arena's size (default: the model's\n"
      "                     context length, at most 32768)\n"
      "  --temperature T    0 = greedy (default); --top-k K (0 = off), --top-p P (1 = off), --seed S\n"
      "  --options JSON     extra chat-template variables, e.g. '{\"reasoning_effort\": \"low\"}'\n"
      "  --device D         cpu (default), cuda or auto\n"
      "  --verbose          report how many tokens each turn reused from the session\n",
      kDefaultModel);
}

class Chat {
 public:
  explicit Chat(const Options& o) : o_(o) {
    dz_model_params mp;
    dz_model_params_init(&mp);
    mp.device = o.device == "cuda" ? DZ_DEVICE_CUDA : o.device == "auto" ? DZ_DEVICE_AUTO : DZ_DEVICE_CPU;
    show_load_progress(&mp);
    ok(dz_model_open(o.model.c_str(), &mp, &model_), "open model");
    ok(dz_model_tokenizer(model_, &tok_), "tokenizer");
    // The arena holds the whole conversation: --ctx tokens in pages of 64.
    dz_model_info info;
    dz_model_info_init(&info);
    ok(dz_model_get_info(model_, &info), "model info");
    ctx_ = o.ctx > 0 ? o.ctx : std::min<int64_t>(info.max_context > 0 ? info.max_context : kDefaultCtx, kDefaultCtx);
    dz_kv_arena_params ap;
    dz_kv_arena_params_init(&ap);
    ap.page_tokens = 64;
    ap.capacity_pages = uint64_t(ctx_ + 63) / 64 + 1;  // + 1: the page a truncated turn may still hold
    ok(dz_kv_arena_create(model_, &ap, &arena_), "KV arena");
    dz_session_params sp;
    dz_session_params_init(&sp);
    sp.sampler = o.sampler;
    ok(dz_session_create(arena_, &sp, &session_), "session");
    const int32_t* stops = nullptr;
    size_t ns = 0;
    ok(dz_tokenizer_stop_ids(tok_, &stops, &ns), "stop ids");
    stops_.assign(stops, stops + ns);
    reset();
  }
  ~Chat() {
    dz_session_free(session_);
    dz_kv_arena_free(arena_);
    dz_model_free(model_);
  }

  void reset() {
    messages_ = ojson::array();
    if (!o_.system.empty()) messages_.push_back({{"role", "system"}, {"content", o_.system}});
    ok(dz_session_reset(session_), "reset");
    in_kv_.clear();
  }

  // One user turn: prefill what is new, then stream the reply to stdout.
  void turn(const std::string& user) {
    messages_.push_back({{"role", "user"}, {"content", user}});
    const std::vector<int32_t> ids = tokenize(tok_, render(tok_, messages_, o_.template_options));
    if (int64_t(ids.size()) >= ctx_) {
      messages_.erase(messages_.size() - 1);  // not answered: the conversation stays as it was
      throw ChatError{"the conversation (" + std::to_string(ids.size()) + " tokens) fills --ctx " +
                          std::to_string(ctx_) + ": /reset, or start with a larger --ctx",
                      true};
    }
    size_t common = 0;
    while (common < in_kv_.size() && common < ids.size() && in_kv_[common] == ids[common]) ++common;
    if (common == ids.size() && common > 0) --common;  // recompute the last token's logits
    if (common < in_kv_.size()) {
      ok(dz_session_truncate(session_, common), "truncate");
      in_kv_.resize(common);
    }
    const size_t n_new = ids.size() - common;
    if (o_.verbose)
      std::fprintf(stderr, "[prompt %zu tokens: %zu reused from the session, %zu prefilled]\n", ids.size(), common,
                   n_new);
    auto t0 = std::chrono::steady_clock::now();
    ok(dz_session_append(session_, ids.data() + common, n_new, DZ_LOGITS_LAST), "prefill");
    in_kv_.insert(in_kv_.end(), ids.begin() + long(common), ids.end());
    auto t1 = std::chrono::steady_clock::now();

    dz_detokenizer* det = nullptr;
    ok(dz_detokenizer_create(tok_, &det), "detokenizer");
    std::string reply;
    int n_gen = 0;
    try {
      for (; n_gen < o_.max_new && int64_t(in_kv_.size()) < ctx_; ++n_gen) {
        int32_t t = 0;
        ok(dz_session_sample(session_, &t), "sample");
        if (std::find(stops_.begin(), stops_.end(), t) != stops_.end()) break;
        const char* piece = nullptr;
        size_t len = 0;
        ok(dz_detokenizer_push(det, t, &piece, &len), "detokenize");
        print_piece(t, piece, len);
        reply.append(piece, len);
        ok(dz_session_append(session_, &t, 1, DZ_LOGITS_LAST), "decode");
        in_kv_.push_back(t);
      }
      const char* rest = nullptr;
      size_t len = 0;
      ok(dz_detokenizer_flush(det, &rest, &len), "detokenize");  // bytes held back at the end
      if (len) {
        std::fwrite(rest, 1, len, stdout);
        reply.append(rest, len);
      }
    } catch (...) {
      dz_detokenizer_free(det);
      throw;
    }
    dz_detokenizer_free(det);
    auto t2 = std::chrono::steady_clock::now();
    std::printf("\n");
    std::fflush(stdout);
    const double pf = std::chrono::duration<double>(t1 - t0).count(),
                 dc = std::chrono::duration<double>(t2 - t1).count();
    dz_kv_stats kv;
    dz_kv_stats_init(&kv);
    ok(dz_kv_arena_get_stats(arena_, &kv), "KV stats");
    std::fprintf(stderr,
                 "[prefill %zu tok in %.2f s (%.1f tok/s) | %d tok in %.2f s (%.1f tok/s)%s | context %zu tok, KV %llu "
                 "of %llu pages (%.1f of %.1f MiB)]\n",
                 n_new, pf, pf > 0 ? double(n_new) / pf : 0.0, n_gen, dc, dc > 0 ? double(n_gen) / dc : 0.0,
                 n_gen >= o_.max_new              ? ", hit --max-new"
                 : int64_t(in_kv_.size()) >= ctx_ ? ", hit --ctx"
                                                  : "",
                 in_kv_.size(), (unsigned long long)kv.pages_used, (unsigned long long)kv.pages_total,
                 double(kv.pages_used * kv.page_bytes) / 1048576.0, double(kv.bytes_total) / 1048576.0);
    messages_.push_back(assistant_message(reply));
  }

 private:
  Options o_;
  dz_model* model_ = nullptr;
  const dz_tokenizer* tok_ = nullptr;
  dz_kv_arena* arena_ = nullptr;
  dz_session* session_ = nullptr;
  int64_t ctx_ = 0;
  std::vector<int32_t> stops_, in_kv_;
  ojson messages_;

  void print_piece(int32_t id, const char* piece, size_t len) {
    // Special tokens (channel markers) dimmed on a terminal.
    const bool special = len > 2 && piece[0] == '<' && piece[len - 1] == '>' && is_single_token(id);
    if (o_.color && special) std::fputs("\x1b[2m", stdout);
    std::fwrite(piece, 1, len, stdout);
    if (o_.color && special) std::fputs("\x1b[0m", stdout);
    std::fflush(stdout);
  }
  bool is_single_token(int32_t id) {
    char buf[64];
    size_t n = 0;
    if (dz_detokenize(tok_, &id, 1, buf, sizeof buf, &n) != DZ_OK) return false;
    int32_t back = -1;
    return dz_tokenizer_token_id(tok_, std::string(buf, n).c_str(), &back) == DZ_OK && back == id;
  }
};

}  // namespace

int cmd_chat(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    usage();
    return 0;
  }
  reject_unknown(a,
                 {"--model", "--system", "--prompt", "--max-new", "--ctx", "--device", "--temperature", "--top-k",
                  "--top-p", "--seed", "--options", "--no-color", "--verbose"},
                 "chat");
  Options o;
  o.model = flag_value(a, "--model", default_model());
  o.system = flag_value(a, "--system");
  o.prompt = flag_value(a, "--prompt");
  o.device = flag_value(a, "--device", "cpu");
  o.template_options = flag_value(a, "--options");
  o.verbose = has_flag(a, "--verbose");
  o.color = !has_flag(a, "--no-color") && isatty(STDOUT_FILENO);
  dz_sampler_params_init(&o.sampler);
  try {
    o.max_new = std::stoi(flag_value(a, "--max-new", "512"));
    o.ctx = std::stoll(flag_value(a, "--ctx", "0"));
    o.sampler.temperature = std::stof(flag_value(a, "--temperature", "0"));
    o.sampler.top_k = std::stoi(flag_value(a, "--top-k", "0"));
    o.sampler.top_p = std::stof(flag_value(a, "--top-p", "1"));
    o.sampler.seed = std::stoull(flag_value(a, "--seed", "0"));
  } catch (const std::exception&) {
    std::fprintf(stderr, "dz chat: a numeric flag has a value that is not a number\n");
    return 2;
  }
  if (o.ctx < 0) {
    std::fprintf(stderr, "dz chat: --ctx takes a token count (0: the model's context, at most %lld)\n",
                 (long long)kDefaultCtx);
    return 2;
  }
  if (o.device != "cpu" && o.device != "cuda" && o.device != "auto") {
    std::fprintf(stderr, "dz chat: --device must be cpu, cuda or auto\n");
    return 2;
  }
  try {
    Chat chat(o);
    if (!o.prompt.empty()) {
      chat.turn(o.prompt);
      return 0;
    }
    const bool tty = isatty(STDIN_FILENO);
    std::string line;
    while (true) {
      if (tty) {
        std::fputs("> ", stderr);
        std::fflush(stderr);
      }
      if (!std::getline(std::cin, line)) break;
      if (line.empty()) continue;
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        chat.reset();
        std::fprintf(stderr, "[conversation reset]\n");
        continue;
      }
      try {
        chat.turn(line);
      } catch (const ChatError& e) {
        if (!e.turn_only) throw;
        std::fprintf(stderr, "dz chat: %s\n", e.msg.c_str());
      }
    }
    return 0;
  } catch (const ChatError& e) {
    std::fprintf(stderr, "dz chat: %s\n", e.msg.c_str());
    return 1;
  }
}

}  // namespace dz::cli
