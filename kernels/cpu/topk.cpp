#include "cpu/topk.h"

#include <algorithm>
#include <limits>

namespace dz::cpu {

void RunningTopK::reset(int k) {
  k_ = k < 0 ? 0 : k;
  heap_.clear();
  heap_.reserve(size_t(k_));
}

void RunningTopK::insert(float score, int32_t index) {
  // Sift up: parents are worse than (or equal to) children.
  size_t i = heap_.size();
  heap_.push_back({score, index});
  while (i > 0) {
    const size_t p = (i - 1) / 2;
    if (!better(heap_[p].score, heap_[p].index, heap_[i].score, heap_[i].index)) break;
    std::swap(heap_[p], heap_[i]);
    i = p;
  }
}

void RunningTopK::replace_top(float score, int32_t index) {
  heap_[0] = {score, index};
  const size_t n = heap_.size();
  size_t i = 0;
  for (;;) {
    const size_t l = 2 * i + 1, r = l + 1;
    size_t w = i;  // the worst of i and its children goes on top
    if (l < n && better(heap_[w].score, heap_[w].index, heap_[l].score, heap_[l].index)) w = l;
    if (r < n && better(heap_[w].score, heap_[w].index, heap_[r].score, heap_[r].index)) w = r;
    if (w == i) break;
    std::swap(heap_[i], heap_[w]);
    i = w;
  }
}

float RunningTopK::threshold() const {
  return int(heap_.size()) < k_ || heap_.empty() ? -std::numeric_limits<float>::infinity() : heap_[0].score;
}

int RunningTopK::finish(int32_t* out) const {
  const int n = int(heap_.size());
  for (int i = 0; i < n; ++i) out[i] = heap_[size_t(i)].index;
  std::sort(out, out + n);
  std::fill(out + n, out + k_, -1);
  return n;
}

int topk_row(const float* scores, int64_t n, int k, int32_t* out) {
  RunningTopK t(k);
  for (int64_t i = 0; i < n; ++i) t.push(scores[i], int32_t(i));
  return t.finish(out);
}

}  // namespace dz::cpu
