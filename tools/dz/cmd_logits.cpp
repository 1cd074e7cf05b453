// dz logits: run a model over given token ids and save every position's
// logits as a float32 .npy [T, vocab] (for comparisons with other engines).
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "model_args.h"

namespace dz::cli {

namespace {
bool write_npy(const std::string& path, const float* data, size_t rows, size_t cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " +
                       std::to_string(cols) + "), }";
  // Magic (6) + version (2) + length (2) + header + '\n', padded to 64 bytes.
  const size_t total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header += '\n';
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const unsigned char pre[10] = {
      0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(header.size() & 0xFF), (unsigned char)(header.size() >> 8)};
  bool ok = std::fwrite(pre, 1, 10, f) == 10 && std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data, sizeof(float), rows * cols, f) == rows * cols;
  ok = (std::fclose(f) == 0) && ok;
  return ok;
}
}  // namespace

int cmd_logits(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz logits --model DIR --tokens 1,2,3 --out FILE.npy [options]\n\n"
        "Runs the model over the token ids (one prefill) and writes the logits of\n"
        "every position as a float32 .npy array of shape [T, vocab].\n\n"
        "  --model DIR    model directory (config.json + *.safetensors)\n"
        "  --tokens IDS   comma-separated token ids\n"
        "  --out FILE     output .npy path\n%s",
        kModelOptionsHelp);
    return 0;
  }
  reject_unknown(a, with_model_options({"--model", "--tokens", "--out", "--help"}), "logits");
  const std::string dir = flag_value(a, "--model"), toks = flag_value(a, "--tokens"), out = flag_value(a, "--out");
  if (dir.empty() || toks.empty() || out.empty()) {
    std::fprintf(stderr, "dz logits: --model, --tokens and --out are required (see dz logits --help)\n");
    return 2;
  }
  std::vector<int32_t> ids;
  std::string err;
  dz_model_params mp;
  if (!parse_tokens(toks, &ids, &err) || !parse_model_options(a, &mp, &err)) {
    std::fprintf(stderr, "dz logits: %s\n", err.c_str());
    return 2;
  }
  // One session: an arena just large enough (pages of 64 tokens).
  dz_kv_arena_params ap;
  dz_kv_arena_params_init(&ap);
  ap.capacity_pages = (ids.size() + 63) / 64 + 1;
  dz_model* model = nullptr;
  dz_kv_arena* arena = nullptr;
  dz_session* session = nullptr;
  const float* logits = nullptr;
  size_t rows = 0, vocab = 0;
  int rc = 1;
  if (dz_model_open(dir.c_str(), &mp, &model) == DZ_OK && dz_kv_arena_create(model, &ap, &arena) == DZ_OK &&
      dz_session_create(arena, nullptr, &session) == DZ_OK &&
      dz_session_append(session, ids.data(), ids.size(), DZ_LOGITS_ALL) == DZ_OK &&
      dz_session_logits(session, &logits, &rows, &vocab) == DZ_OK) {
    if (write_npy(out, logits, rows, vocab)) {
      std::fprintf(stderr, "wrote %s: float32 [%zu, %zu]\n", out.c_str(), rows, vocab);
      rc = 0;
    } else {
      std::fprintf(stderr, "dz logits: cannot write %s\n", out.c_str());
    }
  } else {
    std::fprintf(stderr, "dz logits: %s\n", dz_last_error());
  }
  dz_session_free(session);
  dz_kv_arena_free(arena);
  dz_model_free(model);
  return rc;
}

}  // namespace dz::cli
