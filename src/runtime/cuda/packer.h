// A CUDA pass's host metadata packed into one host->device copy: 256-byte
// aligned parts in the order they are added, each at the offset add() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dz::cuda {

class Packer {
 public:
  template <typename T>
  size_t add(const T* p, size_t n) {
    const size_t off = tail();
    buf_.resize(off + n * sizeof(T));
    if (n) std::memcpy(buf_.data() + off, p, n * sizeof(T));
    return off;
  }
  template <typename T>
  size_t add(const std::vector<T>& v) {
    return add(v.data(), v.size());
  }
  const std::vector<uint8_t>& bytes() const { return buf_; }
  // Where the next part would go: parts written on the device may follow there.
  size_t tail() const { return (buf_.size() + 255) / 256 * 256; }

 private:
  std::vector<uint8_t> buf_;
};

}  // namespace dz::cuda
