// DeepSeek-V4's KV compression as a stream: a compressed entry is, per
// channel, the softmax-over-positions-weighted sum of its window's values
// (weights from the gate logits plus a learned per-slot bias). A pool keeps
// the running max, sum and weighted sum per channel, so a sequence carries a
// fixed 3 x dim floats per open entry between forward passes instead of the
// window's raw projections, and the result equals the batch softmax up to
// rounding. An all-zero pool is empty (a new sequence's state slot).
#pragma once

#include <cstdint>

namespace dz::cpu {

// Pool layout: [max | sum | weighted sum], dim floats each.
constexpr int64_t pool_floats(int64_t dim) { return 3 * dim; }

// Add one position: value v, logit gate + bias per channel (bias may be null).
void pool_push(float* pool, int64_t dim, const float* v, const float* gate, const float* bias);

// out = the pooled entry (zeros for an empty pool).
void pool_result(const float* pool, int64_t dim, float* out);

// Empty the pool.
void pool_clear(float* pool, int64_t dim);

}  // namespace dz::cpu
