#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "common/host_alloc.h"
#include "common/log.h"

namespace dz {

namespace {
thread_local std::string g_last_error;
dz_log_fn g_log_fn = nullptr;
void* g_log_user = nullptr;
dz_log_level g_log_level = DZ_LOG_WARN;
}  // namespace

void set_last_error(const std::string& msg) { g_last_error = msg; }
const char* last_error() { return g_last_error.c_str(); }

void set_log(dz_log_fn fn, void* user, dz_log_level level) {
  g_log_fn = fn;
  g_log_user = user;
  g_log_level = level;
}

void log(dz_log_level level, const std::string& msg) {
  if (level < g_log_level || level >= DZ_LOG_NONE) return;
  if (g_log_fn) {
    g_log_fn(level, msg.c_str(), g_log_user);
    return;
  }
  static const char* names[] = {"debug", "info", "warn", "error"};
  std::fprintf(stderr, "dayzero %s: %s\n", names[level], msg.c_str());
}

// The process's own allocator: an embedded library must not replace malloc for its host
// program (a shared mimalloc did, and crashed Python processes that had loaded PyTorch).
void* host_alloc(size_t bytes, size_t align) {
  void* p = nullptr;
  if (align < sizeof(void*)) align = sizeof(void*);
  if (posix_memalign(&p, align, bytes ? bytes : 1) != 0 || !p)
    fail(DZ_ERR_OUT_OF_MEMORY, "host allocation of ", bytes, " bytes failed");
  return p;
}

void host_free(void* p) noexcept { std::free(p); }

}  // namespace dz
