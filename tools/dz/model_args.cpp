#include "model_args.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace dz::cli {

const char* const kModelOptionsHelp =
    "  --device D     cpu (default), cuda or auto\n"
    "  --threads N    CPU threads (default: all cores)\n"
    "  --attention P  auto (default: precise), precise or bf16: the CUDA prefill's attention products\n"
    "                 (dz_attention_precision)\n"
    "  --pass-tokens N\n"
    "                 CUDA: tokens one device pass holds, 256..65536 (default 0: 16384); device\n"
    "                 scratch grows with it (dz_model_params.pass_tokens)\n"
    "  --activations A  auto (default), f32 or bf16: the CPU backend rounds the products' inputs as\n"
    "                 the CUDA backend does with bf16 (dz_activation_precision)\n"
    "  --indexer I    auto (default: the backend's own, CPU exact, CUDA fp8), exact or fp8: the DSA\n"
    "                 indexer's scores (dz_indexer_mode)\n";

const char* const kDefaultModel = "models/dayzero-tiny";

std::string default_model() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("DZ_MODEL"); env && *env) return env;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (const fs::path& dir : {exe.parent_path(), exe.parent_path().parent_path()}) {
      const fs::path p = dir / kDefaultModel;
      if (fs::exists(p, ec)) return p.string();
    }
  }
  return kDefaultModel;
}

bool parse_tokens(const std::string& s, std::vector<int32_t>* out, std::string* err) {
  out->clear();
  size_t i = 0;
  while (i <= s.size()) {
    const size_t j = s.find(',', i);
    const std::string part = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(part.c_str(), &end, 10);
    if (part.empty() || *end || errno || v < 0 || v > INT32_MAX) {
      *err = "'" + part + "' in --tokens is not a token id (expected e.g. --tokens 1,2,3)";
      return false;
    }
    out->push_back(int32_t(v));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return true;
}

namespace {

int print_progress(const char* stage, uint64_t done, uint64_t total, void*) {
  using Clock = std::chrono::steady_clock;
  static Clock::time_point start, last;
  const auto now = Clock::now();
  if (start == Clock::time_point()) start = now;
  const double t = std::chrono::duration<double>(now - start).count();
  const bool tty = isatty(2) != 0, end = done >= total;
  if (t < 1.0 || (!end && std::chrono::duration<double>(now - last).count() < (tty ? 0.2 : 5.0))) return 0;
  last = now;
  const bool gb = std::strcmp(stage, "upload weights") == 0;  // bytes; "validate shards": shards
  std::fprintf(stderr, "%sloading: %s %.*f of %.*f%s (%.0f%%, %.1f s)%s", tty ? "\r" : "", stage, gb ? 1 : 0,
               gb ? double(done) / 1e9 : double(done), gb ? 1 : 0, gb ? double(total) / 1e9 : double(total),
               gb ? " GB" : "", total ? 100.0 * double(done) / double(total) : 100.0, t, tty && !end ? "" : "\n");
  std::fflush(stderr);
  return 0;
}

}  // namespace

void show_load_progress(dz_model_params* params) { params->progress = print_progress; }

std::vector<std::string> with_model_options(std::vector<std::string> own) {
  for (const char* f : {"--device", "--threads", "--attention", "--pass-tokens", "--activations", "--indexer"})
    own.emplace_back(f);
  return own;
}

bool parse_model_options(const Args& a, dz_model_params* p, std::string* err, const ModelOptionDefaults& defaults) {
  dz_model_params_init(p);
  const std::string dev = flag_value(a, "--device", defaults.device);
  if (dev == "cpu")
    p->device = DZ_DEVICE_CPU;
  else if (dev == "cuda")
    p->device = DZ_DEVICE_CUDA;
  else if (dev == "auto")
    p->device = DZ_DEVICE_AUTO;
  else {
    *err = "--device '" + dev + "' (expected cpu, cuda or auto)";
    return false;
  }
  const std::string th = flag_value(a, "--threads", "0");
  char* end = nullptr;
  const long n = std::strtol(th.c_str(), &end, 10);
  if (th.empty() || *end || n < 0 || n > 4096) {
    *err = "--threads '" + th + "' is not a thread count";
    return false;
  }
  p->n_threads = int(n);
  const std::string act = flag_value(a, "--activations", "auto");
  if (act == "auto" || act == "f32" || act == "bf16") {
    p->activations = act == "f32" ? DZ_ACTIVATIONS_F32 : act == "bf16" ? DZ_ACTIVATIONS_BF16 : DZ_ACTIVATIONS_AUTO;
  } else {
    *err = "--activations '" + act + "' (expected auto, f32 or bf16)";
    return false;
  }
  const std::string ix = flag_value(a, "--indexer", "auto");
  if (ix == "auto" || ix == "exact" || ix == "fp8") {
    p->indexer = ix == "exact" ? DZ_INDEXER_EXACT : ix == "fp8" ? DZ_INDEXER_FP8 : DZ_INDEXER_AUTO;
  } else {
    *err = "--indexer '" + ix + "' (expected auto, exact or fp8)";
    return false;
  }
  show_load_progress(p);
  return parse_attention(flag_value(a, "--attention", defaults.attention), p, err) &&
         parse_pass_tokens(flag_value(a, "--pass-tokens", "0"), p, err);
}

bool parse_attention(const std::string& v, dz_model_params* p, std::string* err) {
  if (v == "precise" || v == "auto")
    p->attention = v == "auto" ? DZ_ATTENTION_AUTO : DZ_ATTENTION_PRECISE;
  else if (v == "bf16")
    p->attention = DZ_ATTENTION_BF16;
  else {
    *err = "--attention '" + v + "' (expected precise, bf16 or auto)";
    return false;
  }
  return true;
}

bool parse_pass_tokens(const std::string& v, dz_model_params* p, std::string* err) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || errno || (n != 0 && (n < 256 || n > 65536))) {
    *err = "--pass-tokens '" + v + "' (expected 256..65536, or 0 for the default)";
    return false;
  }
  p->pass_tokens = uint32_t(n);
  return true;
}

}  // namespace dz::cli
