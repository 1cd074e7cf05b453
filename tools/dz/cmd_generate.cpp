// dz generate: prefill token ids, then decode with dz_generate_step and print
// the generated ids.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.h"
#include "model_args.h"

namespace dz::cli {

namespace {
bool parse_num(const std::string& s, double lo, double hi, double* out) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end || !(v >= lo && v <= hi)) return false;
  *out = v;
  return true;
}
}  // namespace

int cmd_generate(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz generate [--model DIR] --tokens 1,2,3 --max-new N [sampling] [options]\n\n"
        "Prefills the token ids, generates up to N tokens one step at a time (stopping\n"
        "after a stop token of the model's tokenizer: eos, end of turn) and prints the\n"
        "generated ids comma-separated (speed goes to stderr).\n\n"
        "  --model DIR       model directory (default: $DZ_MODEL, else %s beside the dz executable)\n"
        "  --tokens IDS      comma-separated prompt token ids\n"
        "  --max-new N       tokens to generate at most\n"
        "  --ignore-stop     generate all N tokens, also past stop tokens\n"
        "sampling (default greedy):\n"
        "  --greedy          always the most likely token\n"
        "  --temperature T   sample at temperature T > 0\n"
        "  --top-k K         only the K most likely tokens (0 = off)\n"
        "  --top-p P         smallest set with probability mass >= P (1 = off)\n"
        "  --seed S          random seed (default 0)\n"
        "options:\n%s",
        kDefaultModel, kModelOptionsHelp);
    return 0;
  }
  reject_unknown(a,
                 with_model_options({"--model", "--tokens", "--max-new", "--ignore-stop", "--greedy", "--temperature",
                                     "--top-k", "--top-p", "--seed", "--help"}),
                 "generate");
  const std::string dir = flag_value(a, "--model", default_model()), toks = flag_value(a, "--tokens");
  if (toks.empty() || flag_value(a, "--max-new").empty()) {
    std::fprintf(stderr, "dz generate: --tokens and --max-new are required (see dz generate --help)\n");
    return 2;
  }
  std::vector<int32_t> ids;
  std::string err;
  dz_model_params mp;
  if (!parse_tokens(toks, &ids, &err) || !parse_model_options(a, &mp, &err)) {
    std::fprintf(stderr, "dz generate: %s\n", err.c_str());
    return 2;
  }
  double max_new = 0, temp = 0, top_k = 0, top_p = 1, seed = 0;
  const bool sampling = !flag_value(a, "--temperature").empty() || !flag_value(a, "--top-k").empty() ||
                        !flag_value(a, "--top-p").empty() || !flag_value(a, "--seed").empty();
  if (!parse_num(flag_value(a, "--max-new"), 0, 1e9, &max_new) || max_new != double(int64_t(max_new)) ||
      !parse_num(flag_value(a, "--temperature", "0"), 0, 1e6, &temp) ||
      !parse_num(flag_value(a, "--top-k", "0"), 0, 1e9, &top_k) || top_k != double(int64_t(top_k)) ||
      !parse_num(flag_value(a, "--top-p", "1"), 1e-9, 1, &top_p) ||
      !parse_num(flag_value(a, "--seed", "0"), 0, 1.8e19, &seed)) {
    std::fprintf(stderr,
                 "dz generate: bad number: --max-new N (integer >= 0), --temperature T >= 0, --top-k K (integer "
                 ">= 0), --top-p P in (0, 1], --seed S >= 0\n");
    return 2;
  }
  if (has_flag(a, "--greedy") && sampling) {
    std::fprintf(stderr, "dz generate: --greedy excludes --temperature/--top-k/--top-p/--seed\n");
    return 2;
  }
  dz_session_params sp;
  dz_session_params_init(&sp);
  sp.sampler.temperature = float(temp);
  sp.sampler.top_k = int32_t(top_k);
  sp.sampler.top_p = float(top_p);
  sp.sampler.seed = uint64_t(std::strtoull(flag_value(a, "--seed", "0").c_str(), nullptr, 10));

  // One session: an arena just large enough (pages of 64 tokens).
  dz_kv_arena_params ap;
  dz_kv_arena_params_init(&ap);
  ap.capacity_pages = (uint64_t(ids.size()) + uint64_t(max_new) + 63) / 64 + 1;
  dz_model* model = nullptr;
  dz_kv_arena* arena = nullptr;
  dz_session* session = nullptr;
  int rc = 1;
  using clock = std::chrono::steady_clock;
  if (dz_model_open(dir.c_str(), &mp, &model) == DZ_OK && dz_kv_arena_create(model, &ap, &arena) == DZ_OK &&
      dz_session_create(arena, &sp, &session) == DZ_OK) {
    // Stop ids of the model's tokenizer (none without one, or with --ignore-stop).
    const int32_t* stop = nullptr;
    size_t n_stop = 0;
    const dz_tokenizer* tk = nullptr;
    if (!has_flag(a, "--ignore-stop") && dz_model_tokenizer(model, &tk) == DZ_OK && tk)
      dz_tokenizer_stop_ids(tk, &stop, &n_stop);
    const auto t0 = clock::now();
    dz_status st = dz_session_append(session, ids.data(), ids.size(), DZ_LOGITS_LAST);
    const auto t1 = clock::now();
    std::string out;
    int64_t n = 0;
    for (; st == DZ_OK && n < int64_t(max_new); ++n) {
      int32_t tok = 0;
      st = dz_generate_step(&session, 1, &tok);
      if (st != DZ_OK) break;
      out += (n ? "," : "") + std::to_string(tok);
      if (std::find(stop, stop + n_stop, tok) != stop + n_stop) {
        ++n;
        break;
      }
    }
    const auto t2 = clock::now();
    if (st == DZ_OK) {
      std::printf("%s\n", out.c_str());
      const double pf = std::chrono::duration<double>(t1 - t0).count();
      const double dec = std::chrono::duration<double>(t2 - t1).count();
      std::fprintf(
          stderr, "prefill %zu tokens in %.3f s (%.1f tokens/s); generated %lld tokens in %.3f s (%.1f tokens/s)\n",
          ids.size(), pf, pf > 0 ? double(ids.size()) / pf : 0.0, (long long)n, dec, dec > 0 ? double(n) / dec : 0.0);
      rc = 0;
    } else {
      std::fprintf(stderr, "dz generate: %s\n", dz_last_error());
    }
  } else {
    std::fprintf(stderr, "dz generate: %s\n", dz_last_error());
  }
  dz_session_free(session);
  dz_kv_arena_free(arena);
  dz_model_free(model);
  return rc;
}

}  // namespace dz::cli
