// The ABI boundary: every exported function runs its body through guard(),
// which turns any exception into a dz_status and a thread-local message.
#pragma once

#include <cstring>
#include <new>

#include "common/error.h"

namespace dz {

template <typename F>
dz_status guard(const char* fn, F&& body) noexcept {
  try {
    body();
    return DZ_OK;
  } catch (const Error& e) {
    set_last_error(cat(fn, ": ", e.what()));
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error(cat(fn, ": out of host memory"));
    return DZ_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(cat(fn, ": internal error: ", e.what()));
    return DZ_ERR_INTERNAL;
  } catch (...) {
    set_last_error(cat(fn, ": internal error (unknown exception)"));
    return DZ_ERR_INTERNAL;
  }
}

// Checks shared by every entry point.
inline void need(const void* p, const char* what) {
  if (!p) fail(DZ_ERR_INVALID_ARGUMENT, what, " is NULL");
}
// A params struct from a caller: non-NULL struct_size at least that of the
// first ABI version's fields. Copy min(struct_size, sizeof) bytes over
// defaults so older callers get defaults for newer fields.
template <typename T>
T read_params(const T* in, void (*init)(T*), size_t min_size, const char* what) {
  T out;
  init(&out);
  if (!in) return out;
  if (in->struct_size < min_size)
    fail(DZ_ERR_INVALID_ARGUMENT, what, "->struct_size is ", in->struct_size, "; fill it with its _init function");
  const size_t n = in->struct_size < sizeof(T) ? in->struct_size : sizeof(T);
  std::memcpy(&out, in, n);
  out.struct_size = sizeof(T);
  return out;
}
// The body of every *_init_sized: the defaults go into a whole local T (zeroed,
// padding included, then set_defaults(T&)), of which the caller's first
// min(struct_size, sizeof(T)) bytes receive a copy with struct_size set to
// that count. Nothing is written for a NULL dst or a struct_size too small to
// hold struct_size itself.
template <typename T, typename F>
void init_sized(T* dst, size_t struct_size, F&& set_defaults) {
  if (!dst || struct_size < sizeof(size_t)) return;
  T d;
  std::memset(&d, 0, sizeof d);
  set_defaults(d);
  const size_t n = struct_size < sizeof(T) ? struct_size : sizeof(T);
  d.struct_size = n;
  std::memcpy(dst, &d, n);
}
// An output struct: write at most its struct_size bytes.
template <typename T>
void write_out(T* dst, const T& src, const char* what) {
  need(dst, what);
  if (dst->struct_size < sizeof(size_t) * 2)
    fail(DZ_ERR_INVALID_ARGUMENT, what, "->struct_size is ", dst->struct_size, "; fill it with its _init function");
  const size_t n = dst->struct_size < sizeof(T) ? dst->struct_size : sizeof(T);
  const size_t keep = dst->struct_size;
  std::memcpy(dst, &src, n);
  dst->struct_size = keep;
}

}  // namespace dz

#define DZ_GUARD(body) ::dz::guard(__func__, [&]() body)
