// Running top-k over a stream of (score, index) pairs in O(k) memory: the
// indexer pushes scores chunk by chunk and never holds a whole score row.
#pragma once

#include <cstdint>
#include <vector>

namespace dz::cpu {

class RunningTopK {
 public:
  explicit RunningTopK(int k = 0) { reset(k); }
  // Start a new selection of at most k entries.
  void reset(int k);
  int k() const { return k_; }
  int size() const { return int(heap_.size()); }
  // Offer a candidate. Higher scores win; on equal scores the lower index
  // wins (deterministic). NaN scores are never selected.
  void push(float score, int32_t index) {
    if (!(score == score) || k_ == 0) return;
    if (int(heap_.size()) < k_) return insert(score, index);
    if (better(score, index, heap_[0].score, heap_[0].index)) replace_top(score, index);
  }
  // Offer every entry another selection holds (the selection of the union:
  // the rules above pick one set whatever the order of the offers).
  void merge(const RunningTopK& other) {
    for (const Entry& e : other.heap_) push(e.score, e.index);
  }
  // Smallest score still selected (-inf while fewer than k are held).
  float threshold() const;
  // Write k entries: the selected indices in ascending order, then -1 for the
  // missing ones when fewer than k were offered. Returns the count selected.
  int finish(int32_t* out) const;

 private:
  struct Entry {
    float score;
    int32_t index;
  };
  static bool better(float s, int32_t i, float t, int32_t j) { return s > t || (s == t && i < j); }
  void insert(float score, int32_t index);
  void replace_top(float score, int32_t index);
  int k_ = 0;
  std::vector<Entry> heap_;  // min-heap by `better`: the worst selected entry on top
};

// Top-k of one full row (tests and small inputs): scores[0..n), same rules.
int topk_row(const float* scores, int64_t n, int k, int32_t* out);

}  // namespace dz::cpu
