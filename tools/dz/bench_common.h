// Shared parts of the `dz bench ...` commands: every result JSON carries when,
// what (commit) and where (device, CPU) it was measured.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"

namespace dz::cli {

// {"date": "YYYY-MM-DDTHH:MM:SSZ", "commit": "...", "dayzero": "0.1.0", "cpu": "...", "threads": N,
//  "gpu": "... or none"}
nlohmann::json bench_meta();
// Write j to path (pretty) when path is non-empty, and always print it to stdout.
void bench_emit(const nlohmann::json& j, const std::string& path);
// Median (the mean of the middle two for an even count; 0 when empty).
double median(std::vector<double> v);
// "1,8,64" -> {1, 8, 64}.
std::vector<int> parse_int_list(const std::string& s);
// A GPU benchmark in a build without the CUDA backend: --help prints usage
// (exit 0), anything else says why it cannot run (exit 1).
int bench_needs_cuda(const Args& a, const char* usage, const char* name);

}  // namespace dz::cli
