// dz bench <what>: benchmarks with JSON output. Each benchmark family lives in
// its own cmd_bench_<what>.cpp and adds one row here.
#include <cstdio>
#include <cstring>

#include "commands.h"

namespace dz::cli {

namespace {
struct Bench {
  const char* name;
  int (*run)(const Args&);
  const char* summary;
};
const Bench kBenches[] = {
    {"", nullptr, ""},  // rows: {"kv", bench_kv, "..."},
    {"attention", bench_attention, "split-K decode attention on the GPU over a paged bf16 KV cache"},
    {"indexer", bench_indexer, "DSA lightning indexer on the GPU: FP8 scores + top-k, decode and prefill"},
    {"kda", bench_kda, "Kimi Delta Attention on the CPU: recurrent and chunked forms, time a token"},
    {"kv", bench_kv, "KV arena bookkeeping: allocate/append/free, fork, prefix lookups, 1M-token memory"},
    {"mla", bench_mla, "sparse MLA decode on the GPU over paged bf16 latents (DSA's selected positions)"},
    {"model", bench_model,
     "whole model: load, prefill, decode (a random gpt-oss-20b-shaped checkpoint, or --model DIR)"},
    {"moe", bench_moe, "MXFP4 MoE layer on the GPU (fused W4A16 vs FP8 paths)"},
    {"sampling", bench_sampling, "temperature / top-k / top-p sampling of logits rows on the GPU"},
    {"tokenize", bench_tokenize, "tokenizer encode throughput (MB/s) on a corpus"},
};
void usage(FILE* f) {
  std::fprintf(f, "usage: dz bench <benchmark> [options] [--out FILE.json]\n\nbenchmarks:\n");
  for (const auto& b : kBenches)
    if (b.run) std::fprintf(f, "  %-12s %s\n", b.name, b.summary);
  std::fprintf(f,
               "\n'dz bench <benchmark> --help' describes its options. Results are JSON on stdout\n"
               "(and in --out) with date, commit and device.\n");
}
}  // namespace

int cmd_bench(const Args& a) {
  if (a.empty() || a[0] == "--help" || a[0] == "-h") {
    usage(a.empty() ? stderr : stdout);
    return a.empty() ? 2 : 0;
  }
  for (const auto& b : kBenches)
    if (b.run && a[0] == b.name) return b.run(Args(a.begin() + 1, a.end()));
  std::fprintf(stderr, "dz bench: unknown benchmark '%s'\n", a[0].c_str());
  usage(stderr);
  return 2;
}

}  // namespace dz::cli
