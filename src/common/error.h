// Internal error handling: C++ code throws dz::Error; the C API layer catches
// every exception at the ABI boundary and turns it into a dz_status plus a
// thread-local message.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "dayzero.h"

namespace dz {

class Error : public std::runtime_error {
 public:
  Error(dz_status status, std::string msg) : std::runtime_error(std::move(msg)), status_(status) {}
  dz_status status() const noexcept { return status_; }

 private:
  dz_status status_;
};

// Concatenate streamable values into a string: cat("tensor ", name, " has ", n, " bytes").
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(dz_status status, Args&&... args) {
  throw Error(status, cat(std::forward<Args>(args)...));
}

// check(cond, status, parts...): throw when cond is false.
template <typename... Args>
void check(bool cond, dz_status status, Args&&... args) {
  if (!cond) fail(status, std::forward<Args>(args)...);
}

// Set the thread-local message (used by the API layer).
void set_last_error(const std::string& msg);

}  // namespace dz
