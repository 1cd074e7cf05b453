// Rows of one layer of one sequence in the paged KV arena, addressed by
// position through the sequence's page table (no copies).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dz::cpu {

struct PagedRows {
  const uint8_t* const* pages = nullptr;  // per page: this layer's token slot 0
  uint32_t page_tokens = 0;
  size_t stride = 0;  // bytes per token record of this layer
  size_t offset = 0;  // byte offset of the field within the record

  const uint8_t* row(int64_t pos) const {
    return pages[size_t(pos) / page_tokens] + size_t(pos) % page_tokens * stride + offset;
  }
  const float* row_f32(int64_t pos) const { return reinterpret_cast<const float*>(row(pos)); }
};

}  // namespace dz::cpu
