// Runs a shell command for the CLI tests: {exit code (-1 if it did not exit
// normally), captured output}; stderr is captured too unless told otherwise.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <utility>

namespace dz::test {

inline std::pair<int, std::string> run_cmd(const std::string& cmd, bool with_stderr = true) {
  std::string out;
  FILE* p = popen((with_stderr ? cmd + " 2>&1" : cmd).c_str(), "r");
  if (!p) return {-1, "popen failed: " + cmd};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

}  // namespace dz::test
