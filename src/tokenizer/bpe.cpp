#include "tokenizer/bpe.h"

#include <algorithm>
#include <queue>

namespace dz {

namespace {
constexpr uint64_t kEmpty = ~uint64_t{0};
inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
inline size_t mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  return size_t(k);
}
}  // namespace

void Bpe::grow() {
  std::vector<uint64_t> ok = std::move(keys_), ov = std::move(vals_);
  const size_t cap = ok.empty() ? 1024 : ok.size() * 2;
  keys_.assign(cap, kEmpty);
  vals_.assign(cap, 0);
  mask_ = cap - 1;
  for (size_t i = 0; i < ok.size(); ++i) {
    if (ok[i] == kEmpty) continue;
    size_t h = mix(ok[i]) & mask_;
    while (keys_[h] != kEmpty) h = (h + 1) & mask_;
    keys_[h] = ok[i];
    vals_[h] = ov[i];
  }
}

void Bpe::add_merge(int32_t a, int32_t b, uint32_t rank, int32_t out) {
  if ((n_pairs_ + 1) * 2 > keys_.size()) grow();
  const uint64_t k = pair_key(a, b);
  size_t h = mix(k) & mask_;
  while (keys_[h] != kEmpty) {
    if (keys_[h] == k) {  // a repeated pair: the later line wins, as in tokenizers
      vals_[h] = (uint64_t(rank) << 32) | uint32_t(out);
      return;
    }
    h = (h + 1) & mask_;
  }
  keys_[h] = k;
  vals_[h] = (uint64_t(rank) << 32) | uint32_t(out);
  ++n_pairs_;
}

bool Bpe::find_pair(int32_t a, int32_t b, uint32_t& rank, int32_t& out) const {
  if (keys_.empty()) return false;
  const uint64_t k = pair_key(a, b);
  size_t h = mix(k) & mask_;
  while (true) {
    const uint64_t kk = keys_[h];
    if (kk == k) {
      rank = uint32_t(vals_[h] >> 32);
      out = int32_t(uint32_t(vals_[h]));
      return true;
    }
    if (kk == kEmpty) return false;
    h = (h + 1) & mask_;
  }
}

void Bpe::finalize() {
  for (int c = 0; c < 256; ++c) {
    const char ch = char(c);
    byte_id_[c] = find(std::string_view(&ch, 1));
  }
}

// The merge loop of tokenizers' Word::merge_all: a heap of candidate merges
// ordered by (rank, position); an entry is stale when the pair now at its
// position no longer merges into the same token. With tiktoken ranks (a
// pair's rank is its result's rank) this is exactly tiktoken's "merge the
// lowest-ranked adjacent pair, leftmost first".
void Bpe::encode(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    const int32_t id = byte_id_[uint8_t(piece[0])];
    if (id >= 0)
      out.push_back(id);
    else if (unk >= 0)
      out.push_back(unk);
    return;
  }
  if (ignore_merges) {
    const int32_t id = find(piece);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  struct Sym {
    int32_t id, prev, next;
  };
  struct Cand {
    uint32_t rank, pos;
    int32_t id;
    bool operator<(const Cand& o) const {  // max-heap on "worse": higher rank, then later position
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  thread_local std::vector<Sym> sym;
  thread_local std::vector<Cand> heap;
  sym.clear();
  heap.clear();
  for (size_t i = 0; i < piece.size(); ++i) {
    int32_t id = byte_id_[uint8_t(piece[i])];
    if (id < 0) {
      if (unk < 0) continue;
      id = unk;
    }
    const int32_t n = int32_t(sym.size());
    sym.push_back({id, n - 1, n + 1});
  }
  if (sym.empty()) return;
  sym.back().next = -1;
  uint32_t rank;
  int32_t nid;
  for (size_t i = 0; i + 1 < sym.size(); ++i)
    if (find_pair(sym[i].id, sym[i + 1].id, rank, nid)) heap.push_back({rank, uint32_t(i), nid});
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Cand top = heap.back();
    heap.pop_back();
    Sym& s = sym[top.pos];
    if (s.id < 0 || s.next < 0) continue;
    const int32_t right = s.next;
    if (!find_pair(s.id, sym[right].id, rank, nid) || nid != top.id) continue;
    s.id = top.id;
    s.next = sym[right].next;
    sym[right].id = -1;  // removed
    if (s.next >= 0) sym[s.next].prev = int32_t(top.pos);
    if (s.prev >= 0 && find_pair(sym[s.prev].id, s.id, rank, nid)) {
      heap.push_back({rank, uint32_t(s.prev), nid});
      std::push_heap(heap.begin(), heap.end());
    }
    if (s.next >= 0 && find_pair(s.id, sym[s.next].id, rank, nid)) {
      heap.push_back({rank, top.pos, nid});
      std::push_heap(heap.begin(), heap.end());
    }
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

}  // namespace dz
