#include "bench_common.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include "dayzero.h"
#include "dz_git_commit.h"  // generated at build time (cmake/git_commit.cmake)
#include "runtime/device.h"

namespace dz::cli {

namespace {
std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}
}  // namespace

nlohmann::json bench_meta() {
  char date[32];
  std::time_t t = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return {{"date", date},
          {"commit", DZ_GIT_COMMIT},
          {"dayzero", dz_version()},
          {"cpu", cpu_model()},
          {"threads", std::thread::hardware_concurrency()},
          {"devices", runtime_devices_summary()}};
}

void bench_emit(const nlohmann::json& j, const std::string& path) {
  const std::string s = j.dump(2);
  std::printf("%s\n", s.c_str());
  if (!path.empty()) {
    std::ofstream f(path);
    f << s << "\n";
    if (!f) std::fprintf(stderr, "dz bench: cannot write %s\n", path.c_str());
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

std::vector<int> parse_int_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) v.push_back(std::stoi(item));
  return v;
}

int bench_needs_cuda(const Args& a, const char* usage, const char* name) {
  if (has_flag(a, "--help")) {
    std::printf("%s", usage);
    return 0;
  }
  std::fprintf(stderr, "%s: this build has no CUDA backend\n", name);
  return 1;
}

}  // namespace dz::cli
