#include "cpu/mla.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/host_alloc.h"
#include "cpu/matmul.h"

namespace dz::cpu {

namespace {

// p[j] = softmax(s)[j] in place (fp64); n > 0.
void softmax(double* s, int64_t n) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  for (int64_t j = 0; j < n; ++j) s[j] /= sum;
}
}  // namespace

int64_t mla_decode(const MlaDims& d, const float* q, const float* w_kv_b, const PagedRows& latent, const int32_t* sel,
                   int n_sel, float* out, ThreadPool* pool) {
  const int H = d.n_heads, qd = d.nope + d.rope, hr = d.nope + d.v, R = d.rank;
  std::vector<const float*> rows;
  rows.reserve(size_t(n_sel));
  for (int j = 0; j < n_sel; ++j)
    if (sel[j] >= 0) rows.push_back(latent.row_f32(sel[j]));
  const int64_t n = int64_t(rows.size());
  parallel_for(pool, size_t(H), 1, [&](size_t h0, size_t h1) {
    std::vector<double> qt(static_cast<size_t>(R)), acc(static_cast<size_t>(R)), s(static_cast<size_t>(n));
    std::vector<float> qtf(static_cast<size_t>(R));
    for (size_t h = h0; h < h1; ++h) {
      const float* qh = q + h * size_t(qd);
      const float* w_uk = w_kv_b + h * size_t(hr) * size_t(R);
      const float* w_uv = w_uk + size_t(d.nope) * size_t(R);
      // Absorb W_UK into the query: q~ = W_UK^T q_nope (rank values).
      std::fill(qt.begin(), qt.end(), 0.0);
      for (int i = 0; i < d.nope; ++i) {
        const double qi = qh[i];
        const float* wr = w_uk + size_t(i) * size_t(R);
        for (int r = 0; r < R; ++r) qt[size_t(r)] += qi * double(wr[r]);
      }
      for (int r = 0; r < R; ++r) qtf[size_t(r)] = float(qt[size_t(r)]);
      for (int64_t j = 0; j < n; ++j) {
        const float* c = rows[size_t(j)];
        s[size_t(j)] = double(float(dot_f64(qtf.data(), c, R) + dot_f64(qh + d.nope, c + R, d.rope)) * d.scale);
      }
      float* oh = out + h * size_t(d.v);
      if (n == 0) {
        std::fill(oh, oh + d.v, 0.0f);
        continue;
      }
      softmax(s.data(), n);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const float* c = rows[size_t(j)];
        const double p = s[size_t(j)];
        for (int r = 0; r < R; ++r) acc[size_t(r)] += p * double(c[r]);
      }
      // Then W_UV maps the attended latent to the head's value space.
      for (int i = 0; i < d.v; ++i) {
        const float* wr = w_uv + size_t(i) * size_t(R);
        double o = 0;
        for (int r = 0; r < R; ++r) o += double(wr[r]) * acc[size_t(r)];
        oh[i] = float(o);
      }
    }
  });
  return n;
}

int64_t mla_prefill(const MlaDims& d, const float* q, int64_t n_q, const float* w_kv_b, const PagedRows& latent,
                    const int32_t* sel, int k, float* out, ThreadPool* pool, int64_t query_block) {
  const int H = d.n_heads, qd = d.nope + d.rope, hr = d.nope + d.v, R = d.rank;
  const int64_t blockq = std::max<int64_t>(1, query_block);
  int64_t attended = 0;
  std::vector<int32_t> uni;
  HostBuffer<float> expanded;
  HostBuffer<double> latent_d;
  for (int64_t q0 = 0; q0 < n_q; q0 += blockq) {
    const int64_t nq = std::min(blockq, n_q - q0);
    // The union of this block's selected positions, expanded once.
    uni.clear();
    for (int64_t i = 0; i < nq * k; ++i)
      if (sel[q0 * k + i] >= 0) uni.push_back(sel[q0 * k + i]);
    std::sort(uni.begin(), uni.end());
    uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
    const int64_t nu = int64_t(uni.size());
    const size_t row_floats = size_t(H) * size_t(hr);  // per position: per head [k_nope | v]
    if (expanded.size() < size_t(nu) * row_floats) expanded = HostBuffer<float>(size_t(nu) * row_floats);
    // e[o] = dot_f64(W_kv_b row o, c) for every position of the union: the latents and a block of
    // weight rows converted to double once (exactly), then four positions at a time (the same bits).
    if (latent_d.size() < size_t(nu) * size_t(R)) latent_d = HostBuffer<double>(size_t(nu) * size_t(R));
    parallel_for(pool, size_t(nu), 16, [&](size_t u0, size_t u1) {
      for (size_t u = u0; u < u1; ++u) {
        const float* c = latent.row_f32(uni[u]);
        for (int r = 0; r < R; ++r) latent_d[u * size_t(R) + size_t(r)] = double(c[r]);
      }
    });
    constexpr size_t kRows = 32;
    parallel_for(pool, (row_floats + kRows - 1) / kRows, 1, [&](size_t b0, size_t b1) {
      std::vector<double> wd(kRows * size_t(R)), dots(kRows * 4);
      for (size_t b = b0; b < b1; ++b) {
        const size_t o0 = b * kRows, mo = std::min(kRows, row_floats - o0);
        for (size_t x = 0; x < mo * size_t(R); ++x) wd[x] = double(w_kv_b[o0 * size_t(R) + x]);
        for (int64_t u = 0; u < nu; u += 4) {
          const double* c4[4];
          const int nk = four_rows<double>(latent_d.data(), u, nu, R, c4);
          dot_rows4_f64(wd.data(), int(mo), R, c4, R, dots.data());
          for (size_t r = 0; r < mo; ++r)
            for (int m = 0; m < nk; ++m) expanded[size_t(u + m) * row_floats + o0 + r] = float(dots[4 * r + size_t(m)]);
        }
      }
    });
    parallel_for(pool, size_t(nq) * size_t(H), 2, [&](size_t t0, size_t t1) {
      std::vector<double> s(static_cast<size_t>(k)), acc(static_cast<size_t>(d.v));
      std::vector<int64_t> at(static_cast<size_t>(k));
      for (size_t t = t0; t < t1; ++t) {
        const int64_t i = q0 + int64_t(t / size_t(H));
        const int h = int(t % size_t(H));
        const float* qh = q + (i * H + h) * qd;
        int64_t n = 0;
        for (int j = 0; j < k; ++j) {
          const int32_t pos = sel[i * k + j];
          if (pos < 0) continue;
          const int64_t u = std::lower_bound(uni.begin(), uni.end(), pos) - uni.begin();
          const float* kn = expanded.data() + size_t(u) * row_floats + size_t(h) * size_t(hr);
          const float* kr = latent.row_f32(pos) + R;
          s[size_t(n)] = double(float(dot_f64(qh, kn, d.nope) + dot_f64(qh + d.nope, kr, d.rope)) * d.scale);
          at[size_t(n++)] = u;
        }
        float* oh = out + (i * H + h) * d.v;
        if (n == 0) {
          std::fill(oh, oh + d.v, 0.0f);
          continue;
        }
        softmax(s.data(), n);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < n; ++j) {
          const float* vv = expanded.data() + size_t(at[size_t(j)]) * row_floats + size_t(h) * size_t(hr) + d.nope;
          for (int x = 0; x < d.v; ++x) acc[size_t(x)] += s[size_t(j)] * double(vv[x]);
        }
        for (int x = 0; x < d.v; ++x) oh[x] = float(acc[size_t(x)]);
      }
    });
    for (int64_t i = 0; i < nq * k; ++i) attended += sel[q0 * k + i] >= 0;
  }
  return attended;
}

}  // namespace dz::cpu
