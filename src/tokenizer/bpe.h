// Byte-level BPE over raw bytes. Token strings of tokenizer.json (GPT-2 byte
// to unicode mapped) and tiktoken ranks are both loaded as raw bytes, so
// decoding is concatenation and encoding never needs the character mapping.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dz {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

class Bpe {
 public:
  // Token bytes by id; ids may have no bytes (""), e.g. added tokens.
  std::vector<std::string> tokens;
  // Bytes -> id for tokens BPE may produce.
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> ids;
  bool ignore_merges = false;  // a piece that is a whole token is emitted as is
  int32_t unk = -1;            // for bytes without a token (-1: dropped, as tokenizers does)

  int32_t find(std::string_view bytes) const {
    auto it = ids.find(bytes);
    return it == ids.end() ? -1 : it->second;
  }
  // Merge (a, b) -> out with priority rank (lower first).
  void add_merge(int32_t a, int32_t b, uint32_t rank, int32_t out);
  size_t n_merges() const { return n_pairs_; }
  // Call after the vocabulary and merges are complete.
  void finalize();
  // Append the ids of one pre-tokenized piece.
  void encode(std::string_view piece, std::vector<int32_t>& out) const;

 private:
  // Open-addressing map (a,b) -> (rank, out): the hot lookup of the merge loop.
  std::vector<uint64_t> keys_;
  std::vector<uint64_t> vals_;
  size_t mask_ = 0, n_pairs_ = 0;
  int32_t byte_id_[256];
  bool find_pair(int32_t a, int32_t b, uint32_t& rank, int32_t& out) const;
  void grow();
};

}  // namespace dz
