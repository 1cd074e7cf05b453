// Softmax attention of one query vector over keys/values read through row
// pointers (so the caller can walk a paged KV cache without copying).
#pragma once

#include <cstdint>
#include <vector>

namespace dz::cpu {

// out[d] = sum_j p_j v_j[d] with p = softmax over {scale * q.k_j} (plus an
// optional sink logit that takes probability mass but has no value: gpt-oss).
// k_rows[j] / v_rows[j] point at token j's cached row; this head's vector
// starts `offset` floats in. Scores and sums in fp64. scratch is resized as
// needed (one per thread).
void attend(const float* q, const float* const* k_rows, const float* const* v_rows, int64_t n, int64_t offset,
            int head_dim, float scale, const float* sink, float* out, std::vector<double>& scratch);

}  // namespace dz::cpu
