// dz bench tokenize: encode throughput (MB/s) on a corpus repeated to ~10 MB,
// the same text tools/reference/tokenizer_refs.py gives Hugging Face
// tokenizers, so the numbers and token counts compare directly.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "bench_common.h"
#include "commands.h"
#include "common/error.h"
#include "tokenizer/tokenizer.h"

namespace dz::cli {

std::unique_ptr<Tokenizer> open_tokenizer_flags(const Args& a, const char* cmd);

int bench_tokenize(const Args& a) {
  if (has_flag(a, "--help") || has_flag(a, "-h")) {
    std::printf(
        "usage: dz bench tokenize (--tokenizer FILE | --model DIR) --corpus FILE.jsonl [--mb 10] [--repeat 3]\n"
        "                         [--out FILE.json]\n\n"
        "Encodes the corpus lines ({\"text\": ...} per line) joined by newlines and repeated to --mb MiB, as\n"
        "one string, --repeat times; reports the best run's MB/s (1 MB = 1e6 bytes) and the token count.\n");
    return 0;
  }
  reject_unknown(a, {"--tokenizer", "--model", "--corpus", "--mb", "--repeat", "--out"}, "bench tokenize");
  try {
    const std::string corpus = flag_value(a, "--corpus");
    if (corpus.empty()) fail(DZ_ERR_INVALID_ARGUMENT, "--corpus is required");
    auto t0 = std::chrono::steady_clock::now();
    auto tok = open_tokenizer_flags(a, "bench tokenize");
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::ifstream f(corpus);
    if (!f) fail(DZ_ERR_IO, corpus, ": cannot open");
    std::string line, unit;
    size_t lines = 0;
    while (std::getline(f, line)) {
      if (line.empty()) continue;
      unit += (lines++ ? "\n" : "") + nlohmann::json::parse(line).at("text").get<std::string>();
    }
    const double target = std::stod(flag_value(a, "--mb", "10")) * 1024 * 1024;
    const size_t reps = size_t(std::ceil(target / double(unit.size())));
    std::string big;
    for (size_t i = 0; i < reps; ++i) big += (i ? "\n" : "") + unit;
    const int repeat = std::max(1, std::stoi(flag_value(a, "--repeat", "3")));
    double best = 1e30;
    size_t n_tokens = 0;
    std::vector<int32_t> ids;
    for (int r = 0; r < repeat; ++r) {
      ids.clear();
      auto s = std::chrono::steady_clock::now();
      tok->encode(big, true, ids);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
      n_tokens = ids.size();
    }
    nlohmann::json j = bench_meta();
    j["bench"] = "tokenize";
    j["tokenizer"] = tok->source();
    j["corpus"] = corpus;
    j["corpus_lines"] = lines;
    j["mb"] = double(big.size()) / 1e6;
    j["seconds"] = best;
    j["mb_per_s"] = double(big.size()) / 1e6 / best;
    j["tokens"] = n_tokens;
    j["load_seconds"] = load_s;
    j["threads"] = 1;
    bench_emit(j, flag_value(a, "--out"));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dz bench tokenize: %s\n", e.what());
    return 1;
  }
}

}  // namespace dz::cli
