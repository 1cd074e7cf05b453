#include "cpu/indexer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "common/error.h"
#include "common/host_alloc.h"
#include "cpu/fp8.h"
#include "cpu/matmul.h"
#include "cpu/topk.h"

namespace dz::cpu {

namespace {
bool pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

// For four keys: acc[m] += w[h] * logit where logit = float(dot[4 h + m]) * d_scale > 0, over the heads in order.
void accumulate_heads_portable(const double* dot, const float* w, int H, float d_scale, double* acc) {
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < 4; ++m) {
      const float logit = float(dot[4 * h + m]) * d_scale;
      if (logit > 0) acc[m] += double(w[h]) * double(logit);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same operations on the four keys at once (exact products, one rounding an add: the same bits).
__attribute__((target("avx2,fma"))) void accumulate_heads_avx2(const double* dot, const float* w, int H, float d_scale,
                                                               double* acc) {
  __m256d a = _mm256_loadu_pd(acc);
  const __m128 ds = _mm_set1_ps(d_scale);
  for (int h = 0; h < H; ++h) {
    const __m128 logit = _mm_mul_ps(_mm256_cvtpd_ps(_mm256_loadu_pd(dot + 4 * h)), ds);
    const __m256d pos =
        _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm_castps_si128(_mm_cmpgt_ps(logit, _mm_setzero_ps()))));
    const __m256d sum = _mm256_add_pd(a, _mm256_mul_pd(_mm256_set1_pd(double(w[h])), _mm256_cvtps_pd(logit)));
    a = _mm256_blendv_pd(a, sum, pos);
  }
  _mm256_storeu_pd(acc, a);
}
#endif

void accumulate_heads(const double* dot, const float* w, int H, float d_scale, double* acc) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool vector = cpu_has_avx2_fma();
  if (vector) return accumulate_heads_avx2(dot, w, H, d_scale, acc);
#endif
  accumulate_heads_portable(dot, w, H, d_scale, acc);
}

}  // namespace

int indexer_scale_block(const IndexerConfig& c) { return std::min(c.head_dim, 128); }

size_t indexer_key_bytes(const IndexerConfig& c) {
  if (c.mode == IndexerMode::Exact) return size_t(c.head_dim) * sizeof(float);
  return size_t(c.head_dim) + size_t(c.head_dim / indexer_scale_block(c)) * sizeof(float);
}

void indexer_validate(const IndexerConfig& c) {
  check(c.n_heads > 0 && c.head_dim > 0 && c.topk > 0, DZ_ERR_FORMAT, "indexer: heads ", c.n_heads, ", head dim ",
        c.head_dim, " and top-k ", c.topk, " must be positive");
  if (c.mode == IndexerMode::Fp8)
    check(pow2(c.head_dim), DZ_ERR_UNSUPPORTED, "indexer FP8 mode needs a power-of-two head dim for the Hadamard ",
          "rotation (index_head_dim = ", c.head_dim, "); use the exact indexer");
}

void hadamard(float* x, int n) {
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float s = float(1.0 / std::sqrt(double(n)));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

void indexer_encode_key(const IndexerConfig& c, const float* k, uint8_t* dst) {
  const int D = c.head_dim;
  if (c.mode == IndexerMode::Exact) {
    std::memcpy(dst, k, size_t(D) * sizeof(float));
    return;
  }
  std::vector<float> r(k, k + D);
  hadamard(r.data(), D);
  const int blk = indexer_scale_block(c);
  float* scales = reinterpret_cast<float*>(dst + D);  // record offsets keep this 4-byte aligned
  for (int b = 0; b * blk < D; ++b) {
    const float s = fp8_quantize_block(r.data() + b * blk, blk, c.pow2_scales, dst + b * blk);
    std::memcpy(scales + b, &s, sizeof(float));
  }
}

void indexer_select(const IndexerConfig& c, const float* q, const float* w, int64_t n_q, const int64_t* n_visible,
                    const PagedRows& keys, const IndexerBudget& budget, int32_t* out, IndexerStats* stats,
                    ThreadPool* pool) {
  const int H = c.n_heads, D = c.head_dim, K = c.topk;
  const bool fp8 = c.mode == IndexerMode::Fp8;
  const int blk = indexer_scale_block(c), nb = D / blk;
  const int64_t chunk = std::max<int64_t>(1, budget.chunk_tokens);
  const int64_t qblock = std::max<int64_t>(1, std::min(budget.query_block, n_q));
  const float d_scale = float(1.0 / std::sqrt(double(D)));
  const float h_scale = float(1.0 / std::sqrt(double(H)));
  // While a block has fewer queries than threads (decode), each query's keys are split over parts, each
  // part with its own running top-k, merged at the end (the selection does not depend on the order of the
  // offers): a block never holds more than max(qblock, threads) heaps.
  const int threads = pool ? pool->size() : 1;

  // Scratch, sized once: one block of prepared queries (fp32 while rotated and
  // quantised, then fp64), one chunk of keys as fp64 (Fp8: the E4M3 values,
  // plus their scales) and the block's running top-k heaps. Every value is
  // converted exactly, so the fp64 dot products are those of the fp32 values.
  HostBuffer<float> qb{size_t(qblock * H * D)}, wb{size_t(qblock * H)}, qs{fp8 ? size_t(qblock * H * nb) : 1};
  HostBuffer<double> qd{size_t(qblock * H * D)}, kd{size_t(chunk * D)};
  HostBuffer<float> ks{fp8 ? size_t(chunk * nb) : 1};
  std::vector<RunningTopK> heaps(size_t(std::max<int64_t>(qblock, threads)), RunningTopK{K});
  const size_t scratch = qb.size() * 4 + wb.size() * 4 + qs.size() * 4 + qd.size() * 8 + kd.size() * 8 + ks.size() * 4 +
                         heaps.size() * size_t(K) * 8;
  if (stats) stats->peak_scratch_bytes = std::max(stats->peak_scratch_bytes, scratch);
  uint64_t scored = 0;

  for (int64_t q0 = 0; q0 < n_q; q0 += qblock) {
    const int64_t nq = std::min(qblock, n_q - q0);
    int64_t reach = 0;
    for (int64_t i = 0; i < nq; ++i) reach = std::max(reach, n_visible[q0 + i]);
    const int parts = int(std::clamp<int64_t>(threads / nq, 1, std::max<int64_t>(1, std::min(chunk, reach) / 256)));
    for (int64_t h = 0; h < nq * parts; ++h) heaps[size_t(h)].reset(K);
    std::vector<uint8_t> q8(static_cast<size_t>(blk));
    for (int64_t i = 0; i < nq; ++i) {
      float* qi = qb.data() + i * H * D;
      std::memcpy(qi, q + (q0 + i) * H * D, size_t(H * D) * sizeof(float));
      for (int h = 0; h < H; ++h) {
        // Both scales are positive, so they fold into the head weight outside the ReLU.
        wb[size_t(i * H + h)] = w[(q0 + i) * H + h] * h_scale;
        if (!fp8) continue;
        float* v = qi + h * D;
        hadamard(v, D);
        for (int b = 0; b < nb; ++b) {
          qs[size_t((i * H + h) * nb + b)] = fp8_quantize_block(v + b * blk, blk, c.pow2_scales, q8.data());
          for (int j = 0; j < blk; ++j) v[b * blk + j] = e4m3_to_f32(q8[size_t(j)]);
        }
      }
      for (int64_t d = 0; d < H * D; ++d) qd[size_t(i * H * D + d)] = double(qi[d]);
    }
    for (int64_t s0 = 0; s0 < reach; s0 += chunk) {
      const int64_t ns = std::min(chunk, reach - s0);
      parallel_for(pool, size_t(ns), 64, [&](size_t j0, size_t j1) {
        for (size_t j = j0; j < j1; ++j) {
          double* kj = kd.data() + j * size_t(D);
          if (fp8) {
            const uint8_t* r = keys.row(s0 + int64_t(j));
            for (int d = 0; d < D; ++d) kj[d] = double(e4m3_to_f32(r[d]));
            std::memcpy(ks.data() + j * size_t(nb), r + D, size_t(nb) * sizeof(float));
          } else {
            const float* r = keys.row_f32(s0 + int64_t(j));
            for (int d = 0; d < D; ++d) kj[d] = double(r[d]);
          }
        }
      });
      // Tasks: (query, part of its visible keys).
      parallel_for(pool, size_t(nq * parts), 1, [&](size_t t0, size_t t1) {
        std::vector<double> dot(size_t(H) * 4), d(fp8 ? size_t(H) * 4 : 0);  // [head][key]
        for (size_t t = t0; t < t1; ++t) {
          const int64_t i = int64_t(t) / parts, p = int64_t(t) % parts;
          const int64_t vis = std::max<int64_t>(0, std::min(ns, n_visible[q0 + i] - s0));
          const double* qi = qd.data() + i * H * D;
          const float* wi = wb.data() + i * H;
          RunningTopK& heap = heaps[size_t(i * parts + p)];
          for (int64_t j = vis * p / parts, j_end = vis * (p + 1) / parts; j < j_end; j += 4) {
            const double* kk[4];
            const int nk = four_rows<double>(kd.data(), j, j_end, D, kk);
            if (fp8) {
              std::fill(d.begin(), d.end(), 0.0);
              for (int b = 0; b < nb; ++b) {
                const double* kb[4] = {kk[0] + b * blk, kk[1] + b * blk, kk[2] + b * blk, kk[3] + b * blk};
                dot_rows4_f64(qi + b * blk, H, D, kb, blk, dot.data());
                for (int h = 0; h < H; ++h) {
                  const double qsc = double(qs[size_t((i * H + h) * nb + b)]);
                  for (int m = 0; m < nk; ++m)
                    d[size_t(4 * h + m)] += dot[size_t(4 * h + m)] * qsc * double(ks[size_t((j + m) * nb + b)]);
                }
              }
            } else {
              dot_rows4_f64(qi, H, D, kk, D, dot.data());
            }
            double acc[4] = {0, 0, 0, 0};
            accumulate_heads(fp8 ? d.data() : dot.data(), wi, H, d_scale, acc);
            for (int m = 0; m < nk; ++m) heap.push(float(acc[m]), int32_t(s0 + j + m));
          }
        }
      });
      for (int64_t i = 0; i < nq; ++i) scored += uint64_t(std::max<int64_t>(0, std::min(ns, n_visible[q0 + i] - s0)));
    }
    for (int64_t i = 0; i < nq; ++i) {
      RunningTopK& heap = heaps[size_t(i * parts)];
      for (int p = 1; p < parts; ++p) heap.merge(heaps[size_t(i * parts + p)]);
      heap.finish(out + (q0 + i) * K);
    }
  }
  if (stats) stats->keys_scored += scored;
}

}  // namespace dz::cpu
