// Subcommands of the `dz` tool. Each lives in its own file and returns the
// process exit code.
#pragma once

#include <string>
#include <vector>

namespace dz::cli {

using Args = std::vector<std::string>;

int cmd_info(const Args& args);
int cmd_bench(const Args& args);  // dispatches to the bench_* functions below
int cmd_logits(const Args& args);
int cmd_generate(const Args& args);
int cmd_tokenize(const Args& args);
int cmd_detokenize(const Args& args);
int cmd_chat(const Args& args);         // examples/chat/chat.cpp
int cmd_indexer_fp8(const Args& args);  // FP8 vs exact DSA indexer on real text

// Benchmarks (dz bench <name>), one per cmd_bench_<name>.cpp; add a row to kBenches in cmd_bench.cpp.
int bench_moe(const Args& args);
int bench_attention(const Args& args);
int bench_kv(const Args& args);
int bench_tokenize(const Args& args);
int bench_kda(const Args& args);
int bench_model(const Args& args);
int bench_indexer(const Args& args);
int bench_mla(const Args& args);
int bench_sampling(const Args& args);

// Small argument helpers shared by the subcommands.
bool has_flag(const Args& a, const std::string& flag);
// Value after `flag` (or `flag=value`); fallback when absent.
std::string flag_value(const Args& a, const std::string& flag, const std::string& fallback = "");
// Exits with a message when a flag is not in `known` (typos fail loudly).
void reject_unknown(const Args& a, const std::vector<std::string>& known, const char* cmd);

}  // namespace dz::cli
