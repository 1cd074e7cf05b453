// Aligned host allocations of the core (large buffers for weights decoded on
// the CPU, activations, KV pages on the CPU backend).
#pragma once
#include <cstddef>
#include <memory>
#include <vector>

namespace dz {

void* host_alloc(size_t bytes, size_t align = 64);  // throws DZ_ERR_OUT_OF_MEMORY
void host_free(void* p) noexcept;

struct HostFree {
  void operator()(void* p) const noexcept { host_free(p); }
};

// An owning, 64-byte aligned buffer of n trivially-copyable T (uninitialised).
template <typename T>
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t n) : n_(n), p_(static_cast<T*>(host_alloc(n ? n * sizeof(T) : 1))) {}
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_.get()[i]; }
  const T& operator[](size_t i) const { return p_.get()[i]; }

 private:
  size_t n_ = 0;
  std::unique_ptr<T, HostFree> p_;
};

// std-compatible allocator over host_alloc: 16-byte aligned containers.
template <typename T>
struct HostAllocator {
  using value_type = T;
  HostAllocator() = default;
  template <typename U>
  HostAllocator(const HostAllocator<U>&) noexcept {}
  T* allocate(size_t n) { return static_cast<T*>(host_alloc(n * sizeof(T), alignof(T) < 16 ? 16 : alignof(T))); }
  void deallocate(T* p, size_t) noexcept { host_free(p); }
  template <typename U>
  bool operator==(const HostAllocator<U>&) const noexcept {
    return true;
  }
};

template <typename T>
using vec = std::vector<T, HostAllocator<T>>;

}  // namespace dz
