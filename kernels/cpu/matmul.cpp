#include "cpu/matmul.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "cpu/fp8.h"
#include "cpu/mxfp4.h"

namespace dz::cpu {

void round_to_bf16(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) continue;  // NaN stays NaN
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    std::memcpy(x + i, &u, 4);
  }
}

void round_to_f16_scaled(float* x, size_t n_rows, size_t row) {
  for (size_t r = 0; r < n_rows; ++r) {
    float* v = x + r * row;
    float amax = 0;
    for (size_t i = 0; i < row; ++i) amax = std::max(amax, std::fabs(v[i]));
    if (!(amax > 0) || !std::isfinite(amax)) continue;
    int ex = 0;
    std::frexp(amax, &ex);
    for (size_t i = 0; i < row; ++i) v[i] = std::ldexp(float(static_cast<_Float16>(std::ldexp(v[i], -ex))), ex);
  }
}

float bf16_to_f32(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else {
    // Zero or subnormal: value man * 2^-24, exact in fp32.
    float f = float(man) * 0x1p-24f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void to_f32(WeightKind kind, const uint8_t* src, int64_t n, float* out) {
  switch (kind) {
    case WeightKind::F32:
      std::memcpy(out, src, size_t(n) * 4);
      return;
    case WeightKind::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        out[i] = bf16_to_f32(v);
      }
      return;
    case WeightKind::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        out[i] = f16_to_f32(v);
      }
      return;
    case WeightKind::MXFP4:
    case WeightKind::FP8_BLOCK:
    case WeightKind::FP8_BLOCK_E8M0:
      break;
  }
  std::abort();  // MXFP4 / FP8 vectors are decoded through WeightRef
}

void WeightRef::decode_row(int64_t n, float* out) const {
  switch (kind) {
    case WeightKind::F32:
      std::memcpy(out, data + size_t(n) * size_t(cols) * 4, size_t(cols) * 4);
      return;
    case WeightKind::BF16:
      to_f32(kind, data + size_t(n) * size_t(cols) * 2, cols, out);
      return;
    case WeightKind::F16:
      to_f32(kind, data + size_t(n) * size_t(cols) * 2, cols, out);
      return;
    case WeightKind::MXFP4:
      mxfp4_decode_row(data + size_t(n) * size_t(cols / 2), scales + size_t(n) * size_t(cols / kMxfp4Group), cols, out);
      return;
    case WeightKind::FP8_BLOCK:
      fp8_block_decode_row(data, reinterpret_cast<const float*>(scales), row0 + n, cols, out);
      return;
    case WeightKind::FP8_BLOCK_E8M0:
      fp8_block_e8m0_decode_row(data, scales, row0 + n, cols, out);
      return;
  }
}

WeightRef WeightRef::row_slice(int64_t r0, int64_t n) const {
  WeightRef r = *this;
  r.rows = n;
  switch (kind) {
    case WeightKind::F32:
      r.data += size_t(r0) * size_t(cols) * 4;
      break;
    case WeightKind::BF16:
    case WeightKind::F16:
      r.data += size_t(r0) * size_t(cols) * 2;
      break;
    case WeightKind::MXFP4:
      r.data += size_t(r0) * size_t(cols / 2);
      r.scales += size_t(r0) * size_t(cols / kMxfp4Group);
      break;
    case WeightKind::FP8_BLOCK:
    case WeightKind::FP8_BLOCK_E8M0:
      r.row0 += r0;
      break;
  }
  return r;
}

double dot_f64(const float* a, const float* b, int64_t n) {
  // Independent partial sums let the compiler vectorise without reassociating
  // a single chain (no -ffast-math).
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += double(a[i + j]) * double(b[i + j]);
  for (; i < n; ++i) s[0] += double(a[i]) * double(b[i]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

namespace {

// The eight partial sums of dot_f64 after the vector part, its tail and its combine.
template <class B>
double finish_dot(double (&s)[8], const double* a, const B* b, int64_t i, int64_t n) {
  for (; i < n; ++i) s[0] += a[i] * double(b[i]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

template <class B>
void dot_rows4_portable(const double* a, int m, int64_t lda, const B* const b[4], int64_t n, double* out) {
  for (int r = 0; r < m; ++r) {
    const double* ar = a + r * lda;
    double s[4][8] = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 8; ++l) s[j][l] += ar[i + l] * double(b[j][i + l]);
    for (int j = 0; j < 4; ++j) out[4 * r + j] = finish_dot(s[j], ar, b[j], i, n);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) inline __m256d load4(const double* p) { return _mm256_loadu_pd(p); }
__attribute__((target("avx2,fma"))) inline __m256d load4(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }

// One row against four vectors: partial sums 0-3 and 4-7 of each in two registers.
template <class B>
__attribute__((target("avx2,fma"))) inline void dot_row4_avx2(const double* a, const B* const b[4], int64_t n,
                                                              double* out) {
  __m256d lo[4], hi[4];
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256d a0 = _mm256_loadu_pd(a + i), a1 = _mm256_loadu_pd(a + i + 4);
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm256_fmadd_pd(a0, load4(b[j] + i), lo[j]);
      hi[j] = _mm256_fmadd_pd(a1, load4(b[j] + i + 4), hi[j]);
    }
  }
  if (i < n) {  // a tail: the scalar order
    for (int j = 0; j < 4; ++j) {
      double s[8];
      _mm256_storeu_pd(s, lo[j]);
      _mm256_storeu_pd(s + 4, hi[j]);
      out[j] = finish_dot(s, a, b[j], i, n);
    }
    return;
  }
  // ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) for the four at once: hadd gives
  // [s0+s1, s4+s5, s2+s3, s6+s7]; adding its halves, then the two lanes, keeps that order.
  __m256d h[4];
  for (int j = 0; j < 4; ++j) {
    h[j] = _mm256_hadd_pd(lo[j], hi[j]);
    h[j] = _mm256_add_pd(h[j], _mm256_permute2f128_pd(h[j], h[j], 1));  // [A+C, B+D, ...]
  }
  const __m256d x01 = _mm256_hadd_pd(h[0], h[1]), x23 = _mm256_hadd_pd(h[2], h[3]);  // [r0, r1, r0, r1], [r2, r3, ...]
  _mm256_storeu_pd(out, _mm256_permute2f128_pd(x01, x23, 0x20));                     // [r0, r1, r2, r3]
}

template <class B>
__attribute__((target("avx2,fma"))) void dot_rows4_avx2(const double* a, int m, int64_t lda, const B* const b[4],
                                                        int64_t n, double* out) {
  for (int r = 0; r < m; ++r) dot_row4_avx2(a + r * lda, b, n, out + 4 * r);
}

#endif

template <class B>
void dot_rows4(const double* a, int m, int64_t lda, const B* const b[4], int64_t n, double* out) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool vector = cpu_has_avx2_fma();
  if (vector) return dot_rows4_avx2(a, m, lda, b, n, out);
#endif
  dot_rows4_portable(a, m, lda, b, n, out);
}

}  // namespace

bool cpu_has_avx2_fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

void dot_rows4_f64(const double* a, int m, int64_t lda, const double* const b[4], int64_t n, double* out) {
  dot_rows4(a, m, lda, b, n, out);
}
void dot_rows4_f64(const double* a, int m, int64_t lda, const float* const b[4], int64_t n, double* out) {
  dot_rows4(a, m, lda, b, n, out);
}
void dot_rows4_f64_portable(const double* a, int m, int64_t lda, const double* const b[4], int64_t n, double* out) {
  dot_rows4_portable(a, m, lda, b, n, out);
}
void dot_rows4_f64_portable(const double* a, int m, int64_t lda, const float* const b[4], int64_t n, double* out) {
  dot_rows4_portable(a, m, lda, b, n, out);
}

void matmul(const float* x, int64_t n_rows, const WeightRef& w, const float* bias, float* y, ThreadPool* pool) {
  if (n_rows <= 0 || w.rows <= 0) return;
  const int64_t K = w.cols, N = w.rows;
  // Each task decodes a tile of weight rows once and reuses it for every
  // activation row; activation rows are walked in blocks to stay in cache.
  constexpr int64_t kTileN = 16, kBlockM = 64;
  const size_t tiles = size_t((N + kTileN - 1) / kTileN);
  // At least ~64K multiply-adds per task so scheduling overhead stays small.
  const size_t grain = size_t(std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, kTileN * K * n_rows)));
  // Four dot products a call on exactly converted operands: each y equals
  // float(dot_f64(x row, w row) + bias) bit for bit (dot_rows4_f64).
  parallel_for(pool, tiles, grain, [&](size_t t0, size_t t1) {
    const int64_t xm = std::min(kBlockM, n_rows);
    std::unique_ptr<float[]> tile(new float[size_t(kTileN * K)]);
    std::unique_ptr<double[]> td(new double[size_t(kTileN * K)]), xd(new double[size_t(xm * K)]);
    double dots[kTileN * 4];
    auto convert_x = [&](int64_t m0, int64_t mm) {
      for (int64_t e = 0; e < mm * K; ++e) xd[size_t(e)] = double(x[m0 * K + e]);
    };
    if (n_rows <= kBlockM) convert_x(0, n_rows);  // one block of rows: converted once for every tile
    for (size_t t = t0; t < t1; ++t) {
      const int64_t n0 = int64_t(t) * kTileN, nn = std::min(kTileN, N - n0);
      for (int64_t i = 0; i < nn; ++i) w.decode_row(n0 + i, tile.get() + i * K);
      if (n_rows >= 4)
        for (int64_t e = 0; e < nn * K; ++e) td[size_t(e)] = double(tile[size_t(e)]);
      for (int64_t m0 = 0; m0 < n_rows; m0 += kBlockM) {
        const int64_t mm = std::min(kBlockM, n_rows - m0);
        if (n_rows > kBlockM) convert_x(m0, mm);
        auto put = [&](int64_t m, int64_t i, double d) {
          y[m * N + n0 + i] = float(d + (bias ? double(bias[n0 + i]) : 0.0));
        };
        if (n_rows >= 4) {  // the tile's rows against four activation rows at a time
          for (int64_t m = 0; m < mm; m += 4) {
            const double* xr[4];
            const int nk = four_rows<double>(xd.get(), m, mm, K, xr);
            dot_rows4_f64(td.get(), int(nn), K, xr, K, dots);
            for (int64_t i = 0; i < nn; ++i)
              for (int j = 0; j < nk; ++j) put(m0 + m + j, i, dots[4 * i + j]);
          }
        } else {  // a few rows (decode): each against four tile rows at a time, the weights converted in the loads
          for (int64_t i = 0; i < nn; i += 4) {
            const float* wr[4];
            const int nk = four_rows<float>(tile.get(), i, nn, K, wr);
            dot_rows4_f64(xd.get(), int(mm), K, wr, K, dots);
            for (int64_t m = 0; m < mm; ++m)
              for (int j = 0; j < nk; ++j) put(m0 + m, i + j, dots[4 * m + j]);
          }
        }
      }
    }
  });
}

}  // namespace dz::cpu
